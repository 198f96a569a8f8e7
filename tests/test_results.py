"""Figures as data: a benchmark's record (benchmarks/results.py) and docs/results.md rendered from the records."""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

from benchmarks import render_results, results
from tests.conftest import ROOT


def test_committed_results_doc_and_readme_block_are_up_to_date():
    """docs/results.md (and README's headline block, where it has one) is what the records render to."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.render_results", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_every_committed_record_has_the_fields_the_renderer_reads():
    for path in sorted(results.RESULTS_DIR.glob("*.jsonl")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            record = json.loads(line)
            where = f"{path.name}:{n}"
            assert {"date", "commit", "dirty", "machine", "command", "figures"} <= set(record), where
            assert set(record["machine"]) == {"cpu", "cores", "gpu"}, where
            kinds = (int, float, str, list)
            assert record["figures"] and all(isinstance(v, kinds) for v in record["figures"].values()), where


def test_append_record_writes_one_line_with_when_where_and_how(tmp_path, monkeypatch):
    monkeypatch.setenv(results.DIR_VAR, str(tmp_path))
    before = sorted(p.read_bytes() for p in results.RESULTS_DIR.glob("*.jsonl"))
    path = results.append_record("bench", {"img_s": 12.5}, command="python benchmarks/bench.py --x 1", case="nano")
    results.append_record("bench", {"img_s": 13, "per_core": {"copy": 1.5}}, command="python benchmarks/bench.py")
    assert path == tmp_path / "bench.jsonl"
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert first["figures"] == {"img_s": 12.5} and first["case"] == "nano" and "case" not in second
    assert second["figures"] == {"img_s": 13, "per_core.copy": 1.5}  # one level: what the renderer shows
    assert first["command"] == "python benchmarks/bench.py --x 1"
    when = datetime.datetime.fromisoformat(first["date"])
    assert when.tzinfo is not None and abs(datetime.datetime.now(datetime.timezone.utc) - when).total_seconds() < 60
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert first["commit"] == head and isinstance(first["dirty"], bool)
    assert first["machine"]["cores"] == os.cpu_count() and first["machine"]["cpu"]
    assert first["machine"]["gpu"] is None or isinstance(first["machine"]["gpu"], str)
    assert sorted(p.read_bytes() for p in results.RESULTS_DIR.glob("*.jsonl")) == before  # the repo's untouched


def test_outside_git_the_commit_is_unknown(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "ROOT", tmp_path)
    assert results.code_version() == ("unknown", None)


def test_hand_recorded_figures_and_bad_input(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(results.DIR_VAR, str(tmp_path))
    assert results.main(["pipeline", "wall_time_s=290", "test_top1=0.989", "note=fresh",
                         "--command", "bash scripts/pipeline.sh"]) == 0
    record = json.loads((tmp_path / "pipeline.jsonl").read_text())
    assert record["figures"] == {"wall_time_s": 290, "test_top1": 0.989, "note": "fresh"}
    for bad in (["../x", "a=1", "--command", "c"], ["pipeline", "a", "--command", "c"]):
        try:
            results.main(bad)
        except SystemExit as exc:
            assert exc.code == 2
        assert len(capsys.readouterr().err.strip().splitlines()) >= 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipeline.jsonl"]


def records() -> dict[str, list[dict]]:
    machine = {"cpu": "AMD EPYC (2 cores, no AVX-512)", "cores": 2, "gpu": None}
    gpu = {"cpu": None, "cores": 16, "gpu": "NVIDIA H200"}
    tta = "configs/cifar10-1gpu.yaml, pretrain"
    return {
        "time_to_accuracy": [
            {"date": "2026-01-01", "commit": "a" * 40, "dirty": False, "machine": gpu, "command": "python t.py",
             "case": tta, "figures": {"test_top1": 0.8, "training_wall_time_s": 400.0}},
            {"date": "2026-02-01T10:00:00+00:00", "commit": "b" * 40, "dirty": True, "machine": gpu,
             "command": "python t.py --a|b", "case": tta,
             "figures": {"test_top1": 0.9272, "training_wall_time_s": 448.2}},
        ],
        "pipeline": [{"date": "2026-01-02", "commit": "c" * 40, "dirty": None, "machine": machine,
                      "command": "bash scripts/pipeline.sh", "figures": {"wall_time_s": 290, "test_top1": 0.989}}],
    }


def test_doc_shows_the_latest_per_case_and_machine_and_every_record():
    doc = render_results.render_doc(records())
    latest = doc.split("## time_to_accuracy")[1].split("<details>")[0]
    assert "test_top1 0.9272" in latest and "test_top1 0.8;" not in latest  # the newer of one case and machine
    assert "2026-02-01, `bbbbbbb` (uncommitted changes)" in latest
    history = doc.split("## time_to_accuracy")[1].split("## pipeline")[0].split("<details>")[1]
    assert history.index("0.9272") < history.index("test_top1 0.8;")  # newest first
    assert "`python t.py --a\\|b`" in history  # a | in a command does not split the table's row
    assert doc.index("## time_to_accuracy") < doc.index("## pipeline")


def test_readme_block_is_rewritten_and_a_readme_without_one_left_alone(tmp_path):
    text = f"# x\n\n{render_results.START}\nold table\n{render_results.END}\n\nrest\n"
    out = render_results.render_readme(text, records())
    block = out.split(render_results.START)[1].split(render_results.END)[0]
    assert "old table" not in block and out.endswith(f"{render_results.END}\n\nrest\n")
    assert "test top-1: 92.72 %" in block and "training: 7 min 28 s" in block and "NVIDIA H200" in block
    assert "digits test top-1: 98.9 %" in block and "4 min 50 s" in block and "docs/results.md" in block
    assert render_results.render_readme(out, records()) == out
    plain = "# x\n\nno block here\n"
    assert render_results.render_readme(plain, records()) == plain
    # the command: --check finds a stale block, a plain README stays as it was
    res = tmp_path / "results"
    res.mkdir()
    for name, rows in records().items():
        (res / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "README.md").write_text(text)
    (tmp_path / "plain.md").write_text(plain)
    args = ["--results", str(res), "--doc", str(tmp_path / "results.md")]
    assert render_results.main([*args, "--readme", str(tmp_path / "README.md"), "--check"]) == 1
    assert render_results.main([*args, "--readme", str(tmp_path / "README.md")]) == 0
    assert (tmp_path / "README.md").read_text() == out
    assert render_results.main([*args, "--readme", str(tmp_path / "plain.md")]) == 0
    assert (tmp_path / "plain.md").read_text() == plain
    assert render_results.main([*args, "--readme", str(tmp_path / "README.md"), "--check"]) == 0


def test_a_damaged_record_is_one_line_naming_its_file_and_line(tmp_path, capsys):
    (tmp_path / "x.jsonl").write_text('{"figures": {"a": 1}, "command": "c"}\nnot json\n')
    assert render_results.main(["--results", str(tmp_path), "--doc", str(tmp_path / "d.md"),
                                "--readme", str(tmp_path / "none.md")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'x.jsonl'}:2: not a record") and err.count("\n") == 1
    assert not (tmp_path / "d.md").exists()
