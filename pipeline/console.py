"""The `vit-pipeline` command: one entry point for what users run by hand.

Each subcommand is an existing module's ``main(argv, prog)``, imported only when that subcommand
runs, so ``vit-pipeline --help`` loads no third-party package and ``vit-pipeline predict`` loads
torch, torchvision and (for ONNX) onnxruntime, MLflow only for a registered version, never Ray or DVC.
``stage`` runs a DVC stage module exactly as ``python -m stages.<name>`` (what dvc.yaml calls) does;
the stage names are the modules in ``stages/``.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import pkgutil
import runpy
import sys

import pipeline
from pipeline.utils import freeze_heap_at_exit

PROG = "vit-pipeline"

# name -> ("module:function" that runs it as function(argv, prog=...), one-line summary for --help)
COMMANDS = {
    "predict": ("pipeline.predict:main", "classify image files with the exported model in exports/ or a "
                                         "registered version (prints path, class, probability)"),
    "storage": ("pipeline.storage:main", "push | pull | ls: mirror shard/model directories to and from "
                                         "s3:// prefixes"),
    "recipe": ("pipeline.recipes:main", "check a recipe (configs/*.yaml) against params.yaml and print it "
                                        "as `dvc exp run -S` overrides"),
    "sweep": ("pipeline.sweep:main", "tune a training stage's params with Ray Tune (ASHA stops bad trials early) "
                                     "and print the best as `dvc exp run -S` overrides"),
    "stage": ("pipeline.console:stage_main", "run one DVC stage ({stages}) in the current checkout, "
                                             "as dvc.yaml does"),
}


def stage_names() -> list[str]:
    """The stage modules in the ``stages`` package (found without importing them)."""
    import stages

    return sorted(m.name for m in pkgutil.iter_modules(stages.__path__) if not m.name.startswith("_"))


def stage_doc(name: str) -> str:
    """A stage module's docstring, read from its source so that help does not import torch or Ray."""
    spec = importlib.util.find_spec(f"stages.{name}")
    with open(spec.origin, encoding="utf-8") as f:
        return ast.get_docstring(ast.parse(f.read())) or ""


def stage_main(argv: list[str], prog: str = f"{PROG} stage") -> int:
    """``stage <name> [args]``: run ``stages/<name>.py`` as ``python -m stages.<name> [args]`` would."""
    names = stage_names()
    ap = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run one DVC stage in the current directory, a checkout of the pipeline: it reads\n"
                    "params.yaml (or $VIT_PARAMS) and the stage's inputs there and writes its outputs there.\n"
                    "`dvc repro` runs the same modules and also records what they wrote.",
        epilog="stages:\n" + "\n".join(f"  {n:<9} {stage_doc(n).splitlines()[0].partition(': ')[2]}" for n in names))
    ap.add_argument("name", choices=names, metavar="NAME", help="the stage (see below)")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="passed to the stage (shard takes pretrain|finetune)")
    args = ap.parse_args(argv)
    if {"-h", "--help"} & set(args.args):
        print(f"usage: {prog} {args.name} [args]\n\n{stage_doc(args.name)}")
        return 0
    sys.argv = [f"{prog} {args.name}", *args.args]
    runpy.run_module(f"stages.{args.name}", run_name="__main__", alter_sys=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    freeze_heap_at_exit()  # `vit-pipeline predict` on one image: 7.0 s -> 4.3-5.7 s on 2 cores
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:
        module, _, function = COMMANDS[argv[0]][0].partition(":")
        run = getattr(importlib.import_module(module), function)
        return run(argv[1:], prog=f"{PROG} {argv[0]}")
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                 epilog=f"`{PROG} COMMAND --help` says what a command reads and writes.")
    ap.add_argument("--version", action="version", version=f"%(prog)s {pipeline.__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, summary) in COMMANDS.items():
        sub.add_parser(name, help=summary.format(stages=", ".join(stage_names())))
    ap.parse_args(argv)  # only reached for --help, --version or a bad command: prints and exits
    return 2


if __name__ == "__main__":
    sys.exit(main())
