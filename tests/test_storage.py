"""Object storage: a real S3 API server (moto, own process, loopback). Shards go to a bucket, the
pipeline's loader streams them from it, a training job checkpoints into the bucket through Ray
Train's ``storage_path: s3://…``, dies, and a re-run on a wiped local disk resumes from the bucket."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pipeline import storage
from pipeline.config import DataConfig
from pipeline.data import make_eval_loader, make_train_loader, read_dataset_info, shard_dataset
from pipeline.train.context import STAGING_PREFIX, STAGING_SUFFIX, node_staging_dir
from tests.conftest import tracebacks
from tests.faults import fault_env, hook_env
from tests.repo_copy import copy_repo_files

ROOT = Path(__file__).resolve().parents[1]
REPO_FILES = ["pipeline", "stages", "infra", "params.yaml", "dvc.yaml", ".gitignore"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_shards(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards") / "pretrain"
    shard_dataset(out, DataConfig(source="digits", maxcount=256))
    return out


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("argv, needle", [
    (["ls", "{tmp}/none"], "error: FileNotFoundError: nothing under {tmp}/none"),
    (["ls", "gs://bucket/x"], "error: ValueError: gs://bucket/x: cannot open this URL (Please install gcsfs"),
    (["pull", "foo://bucket/x", "{tmp}/y"], "error: ValueError: foo://bucket/x: cannot open this URL (Protocol not"),
    (["push", "{tmp}", "s3://"], "error: ValueError: s3://: names no bucket (valid: s3://BUCKET or s3://BUCKET/"),
    (["push", "{tmp}", "s3:/bucket/y"], "error: ValueError: 's3:/bucket/y': a URL needs two slashes: did you mean "
                                        "s3://bucket/y?"),
    (["ls", "s3:/bucket"], "error: ValueError: 's3:/bucket': a URL needs two slashes"),
], ids=["ls-nothing", "scheme-without-package", "unknown-scheme", "s3-without-bucket", "one-slash", "ls-one-slash"])
def test_cli_bad_location_is_one_line(tmp_path, capsys, argv, needle):
    """`vit-pipeline storage` on nothing, or on a URL scheme this install cannot open: exit 1 in one line
    (before: `ls` printed nothing and exited 0, a gs:// URL ended in an ImportError traceback)."""
    assert storage.main([a.format(tmp=tmp_path) for a in argv]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(needle.format(tmp=tmp_path)) and err.count("\n") == 1, err
    assert not (tmp_path / "y").exists() and not Path("s3:").exists()  # one slash made a local folder s3:/


def test_push_and_pull_a_shared_folder(local_shards, tmp_path):
    """A shared file system path (NFS, a mounted volume) in place of a URL: push creates the folders it
    needs (before: FileNotFoundError on the first file) and mirrors, pull copies back."""
    dest = tmp_path / "shared/ws/shards/pretrain"
    assert storage.main(["push", str(local_shards), str(dest)]) == 0
    (dest / "stale.tar").write_text("not in the local folder")
    assert storage.main(["push", str(local_shards), str(dest)]) == 0
    assert _tree(dest) == _tree(local_shards)
    assert storage.main(["pull", str(dest), str(tmp_path / "back")]) == 0
    assert _tree(tmp_path / "back") == _tree(local_shards)



@pytest.fixture
def src_and_cwd(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """A folder to pull from, and a current directory (beside a home folder) holding a file of its own."""
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("a")
    (src / "sub/b.txt").write_text("b")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    cwd = tmp_path / "work"
    cwd.mkdir()
    (cwd / "important.txt").write_text("keep")
    monkeypatch.chdir(cwd)
    return src, cwd


@pytest.mark.parametrize("dest, named, what", [
    (".", "{cwd}", "the current directory"), ("..", "{cwd.parent}", "the current directory"),
    ("~", "{home}", "the home folder"), ("{home}", "{home}", "the home folder"),
], ids=["cwd", "parent", "tilde", "home"])
def test_pull_refuses_to_replace_the_current_directory_or_home(src_and_cwd, capsys, dest, named, what):
    """`pull URL .` replaced the current directory whole: it deleted it, the download with it, and ended in
    an `OSError: [Errno 22] Invalid argument: '.'` traceback. Now: one line, exit 1, nothing touched."""
    src, cwd = src_and_cwd
    home = cwd.parent / "home"
    assert storage.main(["pull", str(src), dest.format(home=home)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"error: {named.format(cwd=cwd, home=home)}: is {what} or holds it, and pull replaces "
                          f"a folder whole: name a folder below it"), err
    assert _tree(cwd) == {"important.txt": b"keep"} and sorted(p.name for p in cwd.parent.iterdir()) == [
        "home", "src", "work"]


def test_root_is_never_replaced():
    """`/` holds every current directory. Checked on the guard alone: a regression must not run a pull there."""
    with pytest.raises(OSError, match=r"^\[Errno 22\] is the current directory or holds it, .*: '/'$"):
        storage._local_target("/", "pull", "…", storage._never_replaced())


def test_pull_replaces_a_folder_whole_and_a_failure_keeps_the_old_one(src_and_cwd, monkeypatch):
    """Pull into an existing folder (not the current directory) replaces its contents; a failure while the
    new copy is swapped in leaves the old contents there (before: the old folder was deleted first)."""
    src, cwd = src_and_cwd
    (cwd / "out").mkdir()
    (cwd / "out/old.txt").write_text("old")
    real_replace = os.replace

    def replace_fails_into_out(src, dst):
        if Path(dst).name == "out" and Path(src).name == ".partial.out":
            raise OSError(28, "No space left on device", str(dst))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_fails_into_out)
    with pytest.raises(OSError, match="No space left"):
        storage.download_dir(str(src), "out")
    assert _tree(cwd / "out") == {"old.txt": b"old"} and sorted(p.name for p in cwd.iterdir()) == [
        "important.txt", "out"], "the old folder must be back, and no temporary folder left"
    monkeypatch.setattr(os, "replace", real_replace)
    assert storage.main(["pull", str(src), "out"]) == 0
    assert _tree(cwd / "out") == _tree(src)
    assert sorted(p.name for p in cwd.iterdir()) == ["important.txt", "out"]


def test_push_refuses_to_mirror_into_the_current_directory_or_its_source(src_and_cwd, capsys):
    """A mirroring `push SRC .` deleted every file of the current directory that SRC lacks, and SRC's own
    files with them; `push --keep` deletes nothing, so it may copy there."""
    src, cwd = src_and_cwd
    assert storage.main(["push", str(src), "."]) == 1
    assert storage.main(["push", str(src / "sub"), str(src)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: {cwd}: is the current directory or holds it, and push mirrors the folder, deleting "
                   f"what it lacks: name a folder below it, or pass --keep",
                   f"error: {src}: is the folder pushed or holds it, and push mirrors the folder, deleting what "
                   f"it lacks: name a folder below it, or pass --keep"], err
    assert _tree(cwd) == {"important.txt": b"keep"} and _tree(src) == {"a.txt": b"a", "sub/b.txt": b"b"}
    assert storage.main(["push", "--keep", str(src), "."]) == 0
    assert _tree(cwd) == {"important.txt": b"keep", "a.txt": b"a", "sub/b.txt": b"b"}


@pytest.mark.parametrize("argv, needle", [
    (["push", "{src}", "{f}"], "{f}: is a file: push writes a folder there; name another path, or move the file"),
    (["push", "{src}", "{f}/x"], "{f}/x: Not a directory: a file is in the way on this path: name a folder, or "
                                 "move the file"),
    (["pull", "{src}", "{f}"], "{f}: is a file: pull writes a folder there; name another path, or move the file"),
    (["pull", "{src}", "{f}/x"], "{f}: File exists: a file is in the way: name a folder, or move the file"),
    (["pull", "{f}", "{tmp}/y"], "{f}: is a file, not a folder or prefix: name the one that holds it"),
    (["ls", "{f}"], "{f}: is a file, not a folder or prefix: name the one that holds it"),
], ids=["push-onto-file", "push-below-file", "pull-onto-file", "pull-below-file", "pull-a-file", "ls-a-file"])
def test_cli_file_in_the_way_is_one_line(src_and_cwd, tmp_path, capsys, argv, needle):
    """A file where a folder belongs: one line naming it and what to do, exit 1, the file untouched (before:
    FileExistsError / NotADirectoryError / IsADirectoryError tracebacks; `ls FILE` printed an empty line
    and exited 0)."""
    src, _ = src_and_cwd
    f = tmp_path / "afile"
    f.write_text("x")
    fmt = dict(src=src, f=f, tmp=tmp_path)
    assert storage.main([a.format(**fmt) for a in argv]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err == f"error: {needle.format(**fmt)}\n", err
    assert f.read_text() == "x" and not (tmp_path / "y").exists()


@pytest.mark.parametrize("argv", [["ls", ""], ["push", "", "{tmp}/x"], ["pull", "{tmp}", ""]],
                         ids=["ls", "push", "pull"])
def test_cli_empty_location_names_nothing(src_and_cwd, tmp_path, capsys, argv):
    """An empty path or URL is refused (``ls ''`` listed the current directory and exited 0)."""
    assert storage.main([a.format(tmp=tmp_path) for a in argv]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err == "error: ValueError: '': names nothing: give a folder or s3://BUCKET/PREFIX\n", err


def test_cli_odd_pairs_and_malformed_endpoint_are_one_line(tmp_path, monkeypatch, capsys):
    """A push / pull without its pairs is a usage error (exit 2, as argparse's own); an AWS_ENDPOINT_URL that
    is not a URL is named (botocore said only "Invalid endpoint: garbage")."""
    with pytest.raises(SystemExit) as stop:
        storage.main(["push", str(tmp_path)])
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"error: push takes LOCAL URL pairs, got 1 argument(s): "
                                                           f"{tmp_path}")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "garbage")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    assert storage.main(["ls", "s3://bucket/prefix"]) == 1
    assert capsys.readouterr().err == ("error: object storage: AWS_ENDPOINT_URL=garbage is not a URL "
                                       "(valid: http(s)://HOST[:PORT])\n")


def test_shards_url_with_unusable_scheme_names_the_variable(monkeypatch):
    monkeypatch.setenv(storage.SHARDS_URL_ENV, "gs://bucket/ws")
    with pytest.raises(ValueError, match=r"^\$VIT_SHARDS_URL: gs://bucket/ws: cannot open this URL"):
        storage.shard_dir("pretrain")
    monkeypatch.setenv(storage.SHARDS_URL_ENV, "s3:/bucket/ws")
    with pytest.raises(ValueError, match=r"^\$VIT_SHARDS_URL: 's3:/bucket/ws': a URL needs two slashes: did you mean "
                                         r"s3://bucket/ws\?"):
        storage.shard_dir("pretrain")
    monkeypatch.setenv(storage.SHARDS_URL_ENV, "s3://bucket/ws")
    assert storage.shard_dir("pretrain") == "s3://bucket/ws/pretrain"


def test_push_pull_mirror_and_ray_filesystem(s3_server, local_shards, tmp_path, monkeypatch):
    url = f"s3://{s3_server.bucket}/t1/shards/pretrain"
    stale = "t1/shards/pretrain/train-999999.tar"
    s3_server.client().put_object(Bucket=s3_server.bucket, Key=stale, Body=b"old")
    names = storage.upload_dir(local_shards, url)
    assert names[-1] == "dataset.json", "the manifest must be written last"
    assert s3_server.keys("t1/") == sorted(f"t1/shards/pretrain/{n}" for n in names)  # stale object gone
    assert stale not in s3_server.keys("t1/")

    (tmp_path / "copy").mkdir()
    (tmp_path / "copy/old-file").write_text("replaced whole")
    got = storage.download_dir(url, tmp_path / "copy")
    assert _tree(got) == _tree(local_shards)
    assert storage.download_dir(f"s3://{s3_server.bucket}/nothing", tmp_path / "x", missing_ok=True) is None
    with pytest.raises(FileNotFoundError):
        storage.download_dir(f"s3://{s3_server.bucket}/nothing", tmp_path / "x")
    with pytest.raises(NotADirectoryError, match="is a file, not a folder or prefix"):  # one object, not a prefix
        storage.list_objects(f"{url}/dataset.json")

    path, fs = storage.ray_storage(f"s3://{s3_server.bucket}/ray/")
    assert path == f"{s3_server.bucket}/ray" and fs is not None
    with fs.open_output_stream(f"{path}/probe.txt") as f:  # the filesystem Ray Train would write through
        f.write(b"ok")
    assert "ray/probe.txt" in s3_server.keys("ray/")
    assert storage.ray_storage(None)[0] == str(Path(".ray_results").resolve())

    monkeypatch.setenv("VIT_SHARDS_URL", f"s3://{s3_server.bucket}/t1/shards")
    assert storage.shard_dir("pretrain") == url
    assert storage.worker_path(storage.shard_dir("pretrain")) == url
    monkeypatch.delenv("VIT_SHARDS_URL")
    assert storage.worker_path(storage.shard_dir("pretrain")) == str(Path("data/shards/pretrain").resolve())


def test_loader_streams_shards_from_bucket(s3_server, local_shards):
    """What each Ray worker does when handed an s3:// shard dir: stream the tars over the S3 API."""
    url = f"s3://{s3_server.bucket}/t2/shards/pretrain"
    storage.upload_dir(local_shards, url)
    info = read_dataset_info(url)
    assert info == read_dataset_info(local_shards)
    n_val = sum(len(y) for _, y in make_eval_loader(url, "val", batch_size=64, image_size=16, rank=0,
                                                    world_size=1, augment={}))
    assert n_val == info["counts"]["val"]
    seen = []
    for rank in (0, 1):
        batches = list(make_train_loader(url, batch_size=32, image_size=16, steps_per_epoch=3, rank=rank,
                                         world_size=2, epoch=0, seed=0, augment={}))
        assert len(batches) == 3 and all(x.shape == (32, 3, 16, 16) for x, _ in batches)
        seen.append(sum(len(y) for _, y in batches))
    assert seen == [96, 96]


def _copy_repo(dst: Path, storage_path: str) -> Path:
    copy_repo_files(dst, REPO_FILES)
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["model"].update(depth=2)
    raw["pretrain"].update(epochs=2, warmup_epochs=0)
    raw["ray"].update(num_workers=2, max_failures=0, storage_path=storage_path)
    raw["mlflow"]["experiment"] = "storage-test"
    (dst / "params.s3.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return dst


def test_job_shards_to_bucket_trains_checkpoints_and_resumes(s3_server, mlflow_server, env_factory, tmp_path):
    bucket = s3_server.bucket
    repo = _copy_repo(tmp_path / "repo", storage_path=f"s3://{bucket}/ray")
    scratch = tmp_path / "scratch"  # the job's local disk; wiped between runs like a fresh node
    env = env_factory(**s3_server.env, VIT_WORKSPACE=f"s3://{bucket}/ws", VIT_SCRATCH=str(scratch),
                      VIT_PARAMS="params.s3.yaml", MLFLOW_TRACKING_URI=mlflow_server.url)

    def job(*stages: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "infra/job.sh", *stages], cwd=repo, env={**env, **extra},
                              capture_output=True, text=True, timeout=600)

    # 1. Shard into the bucket.
    out = job("shard-pretrain")
    assert out.returncode == 0, out.stdout + out.stderr
    keys = s3_server.keys("ws/")
    assert "ws/data/shards/pretrain/dataset.json" in keys and any(k.endswith(".tar") for k in keys)
    info = json.loads(s3_server.client().get_object(
        Bucket=bucket, Key="ws/data/shards/pretrain/dataset.json")["Body"].read())
    batch = yaml.safe_load((repo / "params.s3.yaml").read_text())["pretrain"]["global_batch_size"]
    steps_per_epoch = info["counts"]["train"] // batch
    shutil.rmtree(scratch)

    # 2. Train from the bucket; the run dies in epoch 2, after epoch 1's checkpoint went to the bucket.
    marker = tmp_path / "fault-marker"
    fail = job("pretrain", **fault_env(f"raise@{steps_per_epoch + 2}:{marker}"))
    assert fail.returncode != 0 and marker.exists(), fail.stdout[-3000:] + fail.stderr[-3000:]
    assert "[storage] s3://" in fail.stdout and "data/shards" in fail.stdout  # shards came from the bucket
    ckpts = [k for k in s3_server.keys("ray/") if re.search(r"ray/pretrain-\w+/checkpoint_[^/]+/state\.pt$", k)]
    assert ckpts, s3_server.keys("ray/")
    assert not (scratch / ".ray_results").exists(), "checkpoints must not stay on the local disk"
    assert not s3_server.keys("ws/models/"), "a failed stage must not publish a model"
    shutil.rmtree(scratch)

    # 3. Re-run on a wiped disk: Ray Train restores the run from the bucket and finishes epoch 2 only,
    # streaming the shards this time (VIT_SHARDS_URL): the same shards elsewhere are the same run.
    # Checkpoints are staged in the node's temp dir; plant what a rank killed mid-save leaves there.
    staging = Path(node_staging_dir(re.search(r"run (pretrain-\w+)", fail.stdout).group(1)))
    assert not staging.exists(), "the failed stage left its staging folder"
    (staging / f"{STAGING_PREFIX}planted{STAGING_SUFFIX}").mkdir(parents=True)
    seen = tmp_path / "staging-at-start.txt"
    done = job("pretrain", VIT_SHARDS_URL=f"s3://{bucket}/ws/data/shards", **hook_env(f"record_staging={seen}"))
    logs = done.stdout + done.stderr
    assert done.returncode == 0, logs[-5000:]
    assert not (scratch / "data").exists(), "shards were pulled instead of streamed"
    assert seen.read_text() == str(staging), "rank 0 must clear an earlier attempt's half-written checkpoints"
    assert not staging.exists(), "nothing of the run may stay in the node's temp dir"
    assert re.search(r"\[pretrain\] resumed from checkpoint", logs), logs[-3000:]
    assert "epoch 2/2" in logs and "epoch 1/2" not in logs
    keys = s3_server.keys("ws/")
    for k in ("ws/models/pretrain/model.safetensors", "ws/models/pretrain/config.json", "ws/metrics/pretrain.json"):
        assert k in keys, keys
    meta = json.loads(s3_server.client().get_object(Bucket=bucket, Key="ws/models/pretrain/config.json")["Body"].read())
    assert any(k.startswith(f"ray/{meta['ray_run']}/checkpoint_") for k in s3_server.keys("ray/"))

    from mlflow.tracking import MlflowClient

    ml = MlflowClient(mlflow_server.url)
    runs = ml.search_runs([ml.get_experiment_by_name("storage-test").experiment_id], "tags.stage = 'pretrain'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"  # the re-run continued the same run
    assert len(ml.get_metric_history(runs[0].info.run_id, "val_top1")) == 2


def test_job_with_a_shards_url_pulls_no_shards(s3_server, env_factory, tmp_path):
    """infra/README.md: with VIT_SHARDS_URL, job.sh pulls a stage's models but not its shards (the stage and
    its ranks stream those, as the bucket job's resumed run above checks); without it, both; and evaluate's training curves
    (plots/), also after a fine-tune in the same job, which writes only its own there. The bucket is empty, so
    the stage itself stops at once (exit 1, no shards): what is checked is what the job pulled for it."""
    bucket = s3_server.bucket
    repo = _copy_repo(tmp_path / "repo", storage_path=f"s3://{bucket}/t5/ray")
    ws = f"s3://{bucket}/t5/ws"
    for i, (stages, shards_url, pulled) in enumerate((
            (["finetune"], None, ["data/shards/finetune", "models/pretrain"]),
            (["finetune"], f"{ws}/data/shards", ["models/pretrain"]),
            (["evaluate"], f"{ws}/data/shards", ["models/finetune", "plots"]),
            (["finetune", "evaluate"], None, ["data/shards/finetune", "models/pretrain", "plots"]))):
        env = env_factory(**s3_server.env, VIT_WORKSPACE=ws, VIT_SCRATCH=str(tmp_path / f"scratch-{i}"),
                          VIT_PARAMS="params.s3.yaml", MLFLOW_TRACKING_URI="http://127.0.0.1:9",
                          **({"VIT_SHARDS_URL": shards_url} if shards_url else {}))
        proc = subprocess.run(["bash", "infra/job.sh", *stages], cwd=repo, env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 1 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr, \
            proc.stdout + proc.stderr
        storage_lines = [line for line in proc.stdout.splitlines() if line.startswith("[storage]")]
        assert storage_lines == [f"[storage] nothing under {ws}/{d}" for d in pulled], proc.stdout


def test_object_store_out_of_reach_is_one_line(s3_server, mlflow_server, env_factory, port_factory, local_shards,
                                               tmp_path):
    """No credentials, an endpoint where no server listens, a `ray.storage_path` bucket that does not exist:
    `vit-pipeline storage` and the stage end in one line naming what to set, exit 1, nothing written
    (before: botocore's traceback, or Ray's of its controller actor)."""
    shards_url = f"s3://{s3_server.bucket}/t4/shards"
    storage.upload_dir(local_shards, f"{shards_url}/pretrain")
    repo = _copy_repo(tmp_path / "repo", storage_path="s3://no-such-bucket/ray")
    shutil.copytree(local_shards, repo / "data/shards/pretrain")
    signed_in = env_factory(**s3_server.env, VIT_PARAMS="params.s3.yaml", MLFLOW_TRACKING_URI=mlflow_server.url)
    signed_out = {k: v for k, v in signed_in.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    signed_out.update(AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"))
    nobody = f"http://127.0.0.1:{port_factory()}"

    def last_line(argv: list[str], env: dict[str, str]) -> str:
        out = subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 1 and not tracebacks(out.stderr), out.stdout[-2000:] + out.stderr[-3000:]
        return out.stderr.strip().splitlines()[-1]

    no_credentials = ("error: object storage: Unable to locate credentials: set AWS_ACCESS_KEY_ID and "
                      "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or run where an instance role applies")
    ls = ["python", "-m", "pipeline.storage", "ls", shards_url]
    assert last_line(ls, signed_out) == no_credentials
    line = last_line(ls, {**signed_in, "AWS_ENDPOINT_URL": nobody})
    assert line.startswith("error: object storage: Could not connect to the endpoint URL") and (
        line.endswith(f"check AWS_ENDPOINT_URL ({nobody}) and that the server is up")), line

    stage = ["python", "-m", "stages.pretrain"]
    assert last_line(stage, {**signed_out, "VIT_SHARDS_URL": shards_url}) == no_credentials
    line = last_line(stage, signed_in)  # local shards; checkpoints into a bucket that is not there
    assert line.startswith("error: ray.storage_path s3://no-such-bucket/ray: Bucket 'no-such-bucket' not found") and (
        line.endswith(f"(AWS_ENDPOINT_URL: {s3_server.endpoint})")), line
    assert not (repo / "models/pretrain").exists() and not (repo / "metrics/pretrain.json").exists()
