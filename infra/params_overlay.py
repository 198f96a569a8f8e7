"""Merge a params overlay (only the keys that differ, e.g. infra/params.cluster.yaml) into a params
file and check the result like every stage does:

    python infra/params_overlay.py params.yaml infra/params.cluster.yaml OUT.yaml

Used by infra/job.sh and infra/submit.sh when VIT_PARAMS_OVERLAY is set, so params.yaml stays the
one full copy of the pipeline's settings. Exit code 2 with the offending key on a bad result.
"""
from __future__ import annotations

import sys
from pathlib import Path

import yaml


def merge(base: dict, overlay: dict) -> dict:
    out = dict(base)
    for key, value in overlay.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python infra/params_overlay.py PARAMS OVERLAY OUT", file=sys.stderr)
        return 2
    base, overlay, out = (Path(a) for a in argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from pipeline.config import ConfigError, load_params, params_from_dict, read_partial_params

    try:  # checked before anything is written: a bad overlay leaves no OUT behind
        load_params(base)  # a whole params file (an empty one would leave every key at its default)
        merged = merge(read_partial_params(base), read_partial_params(overlay))
        params_from_dict(merged, f"{overlay} over {base}")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(f"# {base.name} + {overlay.name} (written by infra/params_overlay.py)\n"
                       + yaml.safe_dump(merged, sort_keys=False))
    except OSError as exc:
        print(f"error: {exc.filename or out}: cannot write the merged params ({exc.strerror or exc})", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
