"""Turn a recipe file (a partial params.yaml) into `dvc exp run -S key=value` arguments.

    python -m pipeline.recipes configs/cifar10.yaml --set data.pretrain.root=/data/cifar10 | xargs -r dvc exp run

The merged params are validated first, so a typo in a recipe fails here, not mid-run.
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import sys

import yaml

from pipeline.config import ConfigError, Params, flatten, load_params, read_partial_params, safe_yaml, yaml_problem


def recipe_overrides(path: str | None, sets: list[str] = ()) -> dict[str, object]:
    """Flattened ``{dotted.key: value}`` of the recipe (none: ``path`` None), then ``--set key=value`` on top.

    A dict-valued leaf such as ``augment`` is replaced whole, as DVC's ``-S`` does. A recipe that
    cannot be read, or a ``--set`` without ``=``, is a :class:`ConfigError` naming it.
    """
    raw = read_partial_params(path) if path is not None else {}
    flat: dict[str, object] = {}
    for section, body in raw.items():
        for key, value in flatten(body, section).items():
            parts = key.split(".")
            cut = next((i for i, p in enumerate(parts) if p == "augment"), None)
            if cut is not None:  # augment dicts are params values, not sections
                k = ".".join(parts[:cut + 1])
                flat[k] = {**flat.get(k, {}), ".".join(parts[cut + 1:]): value}
            else:
                flat[key] = value
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"--set {item}: expected KEY=VALUE, e.g. --set model.depth=6")
        try:
            flat[key] = safe_yaml(value, f"--set {key}")
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {item}: the value is not valid YAML ({yaml_problem(exc)})") from None
    return flat


def load_recipe_params(params_path, recipe: str | None, sets: list[str] = (),
                       forced: dict[str, object] | None = None) -> Params:
    """``params_path`` with the recipe, then the ``--set``s, then ``forced`` (a caller's own settings) on
    top, checked layer by layer, so that a bad value names where it came from: the params file, the
    recipe, or the ``--set``s. A ``--set`` of a forced key to another value is refused, not overridden."""
    params = load_params(params_path)  # its own problems name it
    asked = recipe_overrides(None, sets)
    for key, value in (forced or {}).items():  # a --set the command would silently override
        if key in asked and asked[key] != value:
            raise ConfigError(f"--set {key}={asked[key]}: this command sets {key} itself (to {value})")
    layers = [(str(recipe), recipe_overrides(recipe)), ("--set " + " ".join(sets), asked), ("", forced or {})]
    applied: dict[str, object] = {}
    for source, layer in layers:
        if not layer:
            continue
        applied.update(layer)
        try:
            params = load_params(params_path, overrides=applied)
        except ConfigError as exc:
            problem = str(exc).removeprefix(f"{params_path}: ")
            raise ConfigError(f"{source}: {problem}" if source else str(exc)) from None
    return params


def override_value(value: object) -> str:
    """A value in the override grammar `dvc exp run -S` parses (Hydra's): JSON numbers, booleans and
    null, bare dict keys (``{auto_augment: 'randaugment'}``; a quoted key is a syntax error there) and
    :func:`hydra_quoted` strings."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {override_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(override_value(v) for v in value) + "]"
    return hydra_quoted(value) if isinstance(value, str) else json.dumps(value)


def hydra_quoted(text: str) -> str:
    """``text`` in Hydra's single quotes, whose grammar escapes only the quote and the backslashes before
    one or at the end: JSON's escapes (``\\u00e9`` for é, a doubled backslash) would reach params.yaml as
    written."""
    text = re.sub(r"(\\*)'", lambda m: m[1] * 2 + "\\'", text)
    return "'" + re.sub(r"(\\+)$", lambda m: m[1] * 2, text) + "'"


def main(argv: list[str] | None = None, prog: str = "python -m pipeline.recipes") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", help="a partial params.yaml, e.g. configs/cifar10.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one key (repeatable)")
    ap.add_argument("--params", default="params.yaml", help="the params the recipe is merged over and checked "
                    "against (default: params.yaml); nothing is written, the overrides go to stdout")
    args = ap.parse_args(argv)
    try:
        overrides = recipe_overrides(args.recipe, args.set)
        load_recipe_params(args.params, args.recipe, args.set)
    except ConfigError as exc:  # names the recipe or the --set
        print(f"error: {exc}", file=sys.stderr)
        return 2
    present = set(flatten(read_partial_params(args.params)))
    args_out = []
    for k, v in overrides.items():
        if isinstance(v, dict) and override_key(k, present) == k:  # replace the dict whole, not merge into it
            args_out += ["-S", shlex.quote(f"~{k}"), "-S", shlex.quote(f"++{k}={override_value(v)}")]
        else:
            args_out += ["-S", shlex.quote(f"{override_key(k, present)}={override_value(v)}")]
    print(" ".join(args_out))
    return 0


def override_key(key: str, present: set[str]) -> str:
    """``key`` if params.yaml has it; ``++key`` (add) for an optional key it leaves out, which a plain
    ``-S key=...`` refuses ("Key ... is not in struct"). Dict-valued keys are replaced whole either way."""
    if key in present or any(p.startswith(key + ".") for p in present):
        return key
    return "++" + key


if __name__ == "__main__":
    sys.exit(main())
