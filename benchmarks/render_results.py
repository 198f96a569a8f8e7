"""Render ``docs/results.md`` from ``benchmarks/results/*.jsonl``, and README.md's headline table.

    python -m benchmarks.render_results            # rewrite both
    python -m benchmarks.render_results --check    # exit 1 if either is out of date (the tests run this)

``docs/results.md`` holds, per benchmark, the latest record per case and machine, then every record
newest first. README.md's block between ``<!-- results:start -->`` and ``<!-- results:end -->`` gets
the rows of :data:`HEADLINE`; a README without those markers is left alone.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results import RESULTS_DIR
from pipeline.utils import atomic_write_text

DOC, README = ROOT / "docs" / "results.md", ROOT / "README.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"

# What each file measures, in the order docs/results.md shows them; files not named here follow.
TITLES = {
    "time_to_accuracy": "`benchmarks/time_to_accuracy.py`: a recipe's stages through the project's loop, "
                        "then test top-1 (fractions) and wall times (s)",
    "pipeline": "`bash scripts/pipeline.sh` in a fresh clone, building `.venv` included: the default "
                "pipeline's wall time (s) and its digits test figures",
    "suite": "The test suite: `bash .ci/run` in a fresh clone, and its fast tier",
    "seeds": "The default pipeline's digits test top-1 over `pretrain.seed` × `finetune.seed`",
    "train_throughput": "`benchmarks/train_throughput.py`: images/s of the model alone, the input alone and "
                        "the full loop; feed ratio = loop ÷ model",
    "model_speed": "`benchmarks/model_speed.py`: our ViT's images/s over timm's of the same config",
    "loader_speed": "`benchmarks/loader_speed.py`: the webdataset train loader against torchvision's "
                    "ImageFolder (img/s)",
    "shard_speed": "`benchmarks/shard_speed.py`: the shard stage on CIFAR-10 train",
    "decode_speed": "`benchmarks/decode_speed.py`: CPU ms per image of the JPEG decode + crop, reduced-size "
                    "decode where it fits against a full decode",
    "train_memory": "`benchmarks/train_memory.py`: step memory and speed with and without "
                    "`grad_checkpointing`",
    "plain_loop": "`benchmarks/plain_loop.py`: a textbook PyTorch loop on a recipe's pretrain stage",
    "ray_report": "`benchmarks/ray_report.py`: time a rank waits in `ray.train.report`",
    "sweep_speed": "`benchmarks/sweep_speed.py`: a sweep's wall time (s) with ASHA against the same trials run "
                   "to their end, and whether both find the same best trial",
    "proxy": "The CPU proxy of the 1-GPU recipe: levers tried before spending GPU time on them",
}


@dataclass(frozen=True)
class Headline:
    """One row of README's table: the latest record of ``benchmark`` and ``case`` (None: records without one) and
    the figures it shows, each ``(key, format)`` with format ``pct`` (a fraction) or ``min`` (seconds)."""
    what: str
    benchmark: str
    case: str | None
    shown: tuple[tuple[str, str, str], ...]  # (key, format, label)


HEADLINE = (
    Headline("CIFAR-10 on one GPU (`configs/cifar10-1gpu.yaml`)", "time_to_accuracy",
             "configs/cifar10-1gpu.yaml, pretrain",
             (("test_top1", "pct", "test top-1"), ("test_top1_single_view", "pct", "the image alone"),
              ("training_wall_time_s", "min", "training"))),
    Headline("The default pipeline on CPU (`bash scripts/pipeline.sh`)", "pipeline", None,
             (("test_top1", "pct", "digits test top-1"), ("wall_time_s", "min", "wall time (`.venv` built)"))),
)


def load(results: Path) -> dict[str, list[dict]]:
    """``{benchmark: [record, ...]}`` in file order; a line that is not a record names its file and line."""
    got = {}
    for path in sorted(results.glob("*.jsonl")):
        rows = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            try:
                record = json.loads(line)
                if not isinstance(record.get("figures"), dict):
                    raise ValueError("no figures")
            except ValueError as exc:
                raise ValueError(f"{path}:{n}: not a record ({exc})") from None
            rows.append(record)
        got[path.stem] = rows
    return got


def machine_label(record: dict) -> str:
    m = record.get("machine") or {}
    return m.get("gpu") or m.get("cpu") or "unknown"


def newest_first(rows: list[dict]) -> list[dict]:
    """Newest date first; within a date (the older records give only the day) the later line first."""
    order = sorted(enumerate(rows), key=lambda ir: (ir[1].get("date") or "", ir[0]), reverse=True)
    return [r for _, r in order]


def latest(rows: list[dict]) -> list[dict]:
    """The newest record per (case, machine), by case, then newest first."""
    seen: dict[tuple, dict] = {}
    for r in newest_first(rows):
        seen.setdefault((r.get("case") or "", machine_label(r)), r)
    return sorted(seen.values(), key=lambda r: r.get("case") or "")


def cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def value(v: object) -> str:
    if isinstance(v, list):
        return " / ".join(value(x) for x in v)
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) >= 1e4 else f"{v:.4g}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def figures(record: dict) -> str:
    return "; ".join(f"{k} {value(v)}" for k, v in record["figures"].items())


def when(record: dict) -> str:
    commit = record.get("commit") or "unknown"
    short = commit[:7] if commit != "unknown" else commit
    dirty = " (uncommitted changes)" if record.get("dirty") else ""
    return f"{(record.get('date') or 'undated')[:10]}, `{short}`{dirty}"


def section(name: str, rows: list[dict]) -> list[str]:
    out = [f"## {name}", "", TITLES.get(name, f"`{name}`") + ".", "",
           "Latest per case and machine:", "",
           "| case | machine | figures | measured |", "|---|---|---|---|"]
    out += [f"| {cell(r.get('case') or '')} | {cell(machine_label(r))} | {cell(figures(r))} | {when(r)} |"
            for r in latest(rows)]
    out += ["", "<details><summary>Every record, newest first, with its command</summary>", "",
            "| measured | case | machine | figures | command | note |", "|---|---|---|---|---|---|"]
    out += [f"| {when(r)} | {cell(r.get('case') or '')} | {cell(machine_label(r))} | {cell(figures(r))} | "
            f"`{cell(r['command'])}` | {cell(r.get('note') or '')} |" for r in newest_first(rows)]
    return out + ["", "</details>", ""]


def render_doc(records: dict[str, list[dict]]) -> str:
    order = [n for n in TITLES if n in records] + sorted(set(records) - set(TITLES))
    lines = ["# Results", "",
             "<!-- Generated by `python -m benchmarks.render_results` from benchmarks/results/*.jsonl: "
             "edit those, not this file. -->", "",
             "Every measured figure, as recorded by the run that measured it: the benchmarks append a record "
             "each run (`--no-record` to skip), figures measured by hand go in with `python -m "
             "benchmarks.results NAME --command CMD KEY=VALUE ...`; see `benchmarks/results.py`. The same "
             "code gives different figures on different CPUs and under load, so each row names its machine "
             "(for a CPU: its model, the cores the process could use, whether it has AVX-512). Records with "
             "a note came from the project's earlier measurement log; the note gives their context.", ""]
    lines += [f"- [{n}](#{n})" for n in order] + [""]
    for name in order:
        lines += section(name, records[name])
    return "\n".join(lines).rstrip("\n") + "\n"


def formatted(v: object, how: str) -> str:
    if how == "pct":
        return f"{100 * v:.4g} %"
    minutes, seconds = divmod(round(v), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


def headline_rows(records: dict[str, list[dict]]) -> list[str]:
    rows = ["| what | result | machine | measured |", "|---|---|---|---|"]
    for h in HEADLINE:
        found = [r for r in newest_first(records.get(h.benchmark, [])) if r.get("case") == h.case]
        if not found:
            continue
        r = found[0]
        result = ", ".join(f"{label}: {formatted(r['figures'][k], how)}" for k, how, label in h.shown
                           if k in r["figures"])
        rows.append(f"| {h.what} | {cell(result)} | {cell(machine_label(r))} | {when(r)} |")
    return rows + ["", "Every figure, per machine and commit: [docs/results.md](docs/results.md)."]


def render_readme(text: str, records: dict[str, list[dict]]) -> str:
    """``text`` with its results block rewritten; unchanged when it has no (complete) block."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        return text
    return text[:start + len(START)] + "\n" + "\n".join(headline_rows(records)) + "\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=RESULTS_DIR, help="where the records are")
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("--readme", type=Path, default=README)
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is out of date")
    args = ap.parse_args(argv)
    try:
        records = load(args.results)
        wanted = {args.doc: render_doc(records)}
        if args.readme.exists():
            wanted[args.readme] = render_readme(args.readme.read_text(encoding="utf-8"), records)
        stale = [p for p, text in wanted.items() if not p.exists() or p.read_text(encoding="utf-8") != text]
        if args.check:
            for p in stale:
                print(f"{p}: out of date; run python -m benchmarks.render_results", file=sys.stderr)
            return 1 if stale else 0
        for p in stale:
            atomic_write_text(p, wanted[p])
            print(f"wrote {p}")
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
