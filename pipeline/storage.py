"""Shared paths and object storage (S3 and S3-compatible servers) for running the pipeline on a cluster.

Everything here works on plain local paths too, so a call site can use it unconditionally.
Credentials come from the usual AWS variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, instance roles) and the endpoint of an S3-compatible server
(MinIO, Ceph, moto, ...) from ``AWS_ENDPOINT_URL``: botocore/s3fs and pyarrow read both themselves.

- :func:`shard_dir` — where a stage reads its shards: ``$VIT_SHARDS_URL/<name>`` (``s3://...`` or a
  shared path) or ``data/shards/<name>``. The loader (``pipeline.data.loader``) already streams
  ``s3://`` shard URLs through fsspec.
- :func:`worker_path` — what the driver hands to Ray workers: URLs unchanged, local paths absolute.
- :func:`join`, :func:`file_hash` — path arithmetic and content hashes that work on URLs too.
- :func:`ray_storage` — ``RunConfig(storage_path=..., storage_filesystem=...)`` for an ``s3://``
  ``ray.storage_path`` (checkpoints written to and resumed from the bucket).
- :func:`upload_dir` / :func:`download_dir` — mirror a directory (shards, models, metrics) to and
  from a bucket prefix, markers (``dataset.json``, ``config.json``) last so readers never see a
  manifest naming objects that are not there yet.

CLI (used by ``infra/job.sh``)::

    python -m pipeline.storage push [--keep] [--missing-ok] LOCAL URL [LOCAL URL ...]
    python -m pipeline.storage pull [--missing-ok] URL LOCAL [URL LOCAL ...]
    python -m pipeline.storage ls s3://bucket/ws
"""
from __future__ import annotations

import argparse
import errno
import os
import sys
from pathlib import Path
from typing import Optional

from pipeline.outputs import StagedOutputs
from pipeline.utils import CONFIG_NAME, DATASET_INFO, MANIFEST, SHARDS, apply_umask

SHARDS_URL_ENV = "VIT_SHARDS_URL"
MARKERS = (DATASET_INFO, CONFIG_NAME)  # written last: their presence marks a complete directory


def is_url(path) -> bool:
    return "://" in str(path)


def check_location(path, what: str) -> None:
    """``s3:/bucket/x`` (one slash) is a local folder named ``s3:``: a push there uploaded nothing and
    exited 0. Refused, with the URL meant; so is an empty one (``ls ''`` listed the current directory)."""
    if not str(path):
        raise ValueError(f"{what}{' ' if what else ''}'': names nothing: give a folder or s3://BUCKET/PREFIX")
    scheme, sep, rest = str(path).partition(":/")
    if sep and not rest.startswith("/") and len(scheme) > 1 and scheme.replace("+", "").replace("-", "").isalnum():
        meant = f"{scheme}:///{rest}" if scheme == "file" else f"{scheme}://{rest}"  # file URLs: an absolute path
        raise ValueError(f"{what}{' ' if what else ''}{path!r}: a URL needs two slashes: did you mean {meant}?")


def join(base, *names: str) -> str:
    """``join("s3://b/x", "y")`` -> ``"s3://b/x/y"``; local paths joined with the OS separator."""
    if is_url(base):
        return "/".join([str(base).rstrip("/"), *(n.strip("/") for n in names)])
    return os.path.join(str(base), *names)


def shard_dir(name: str, default_root: str | os.PathLike = SHARDS):
    """Shard directory of dataset ``name``: ``$VIT_SHARDS_URL/<name>`` when set, else ``data/shards/<name>``."""
    root = os.environ.get(SHARDS_URL_ENV)
    if not root:
        return Path(default_root) / name
    check_location(root, f"${SHARDS_URL_ENV}:")
    if not is_url(root):
        return Path(root) / name
    try:
        filesystem(root)  # a scheme that cannot be opened fails here, naming the variable
    except ValueError as exc:
        raise ValueError(f"${SHARDS_URL_ENV}: {exc}") from None
    return join(root, name)


def worker_path(path) -> str:
    """A path every Ray worker can open: URLs as they are, local paths made absolute."""
    return str(path) if is_url(path) else str(Path(path).resolve())


def file_hash(path) -> str:
    """First 16 hex chars of the sha256 of a local file or an object (``"none"`` if missing)."""
    import hashlib

    if not is_url(path):
        p = Path(path)
        return hashlib.sha256(p.read_bytes()).hexdigest()[:16] if p.is_file() else "none"
    fs, p = filesystem(str(path))
    try:
        return hashlib.sha256(fs.cat_file(p)).hexdigest()[:16]
    except FileNotFoundError:
        return "none"


def manifest_digest(shard_dir) -> str:
    """What a shard directory's samples are, as a hash: its manifest's (the MLflow dataset inputs and tags)."""
    return file_hash(join(shard_dir, MANIFEST))


def _endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


def _endpoint_named() -> str:
    return _endpoint() or "not set: AWS S3"


def access_problem(exc: BaseException) -> str | None:
    """One line for an object store that we cannot sign in to or reach (botocore's errors, which s3fs
    passes on as they are), naming what to set; None for any other error."""
    errors = sys.modules.get("botocore.exceptions")  # not imported here: whatever raised it has loaded it
    if errors is None:
        return None
    if isinstance(exc, (errors.NoCredentialsError, errors.PartialCredentialsError, errors.CredentialRetrievalError)):
        return (f"object storage: {exc}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), "
                f"or run where an instance role applies")
    if isinstance(exc, (errors.EndpointConnectionError, errors.ConnectTimeoutError)):
        return f"object storage: {exc}: check AWS_ENDPOINT_URL ({_endpoint_named()}) and that the server is up"
    if type(exc) is ValueError and str(exc).startswith("Invalid endpoint"):  # botocore's, for a malformed URL
        var = "AWS_ENDPOINT_URL_S3" if os.environ.get("AWS_ENDPOINT_URL_S3") else "AWS_ENDPOINT_URL"
        return f"object storage: {var}={_endpoint()} is not a URL (valid: http(s)://HOST[:PORT])"
    return None


def check_ray_storage(storage_path: Optional[str]) -> None:
    """Before Ray starts, for an ``s3://`` ``ray.storage_path``: Ray Train's controller creates the path in
    the bucket, and a bucket that is missing or out of reach would end the run in Ray's traceback of its
    controller actor."""
    path, fs = ray_storage(storage_path)
    if fs is None:
        return
    try:
        fs.create_dir(path)
    except OSError as exc:
        raise OSError(f"ray.storage_path {storage_path}: {exc} (AWS_ENDPOINT_URL: {_endpoint_named()})") from None


def filesystem(url: str):
    """``(fsspec filesystem, path without scheme)`` for ``url`` (``s3://``, ``memory://``, local)."""
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(str(url))
    except (ImportError, ValueError) as exc:  # a scheme fsspec does not know, or whose package is missing
        raise ValueError(f"{url}: cannot open this URL ({exc}); local paths and s3:// URLs work with the "
                         f"pipeline's packages") from None
    if str(url).split("://", 1)[0] in ("s3", "s3a") and not root.strip("/"):  # fsspec: "Cannot traverse all of S3"
        raise ValueError(f"{url}: names no bucket (valid: s3://BUCKET or s3://BUCKET/PREFIX)")
    return fs, root


def file_sizes(folder) -> dict[str, int]:
    """``{name: bytes}`` of the files directly in a local folder or under an object-store prefix."""
    fs, root = filesystem(str(folder))
    fs.invalidate_cache()
    try:
        entries = fs.ls(root, detail=True)
    except FileNotFoundError:
        return {}
    return {e["name"].rstrip("/").rsplit("/", 1)[-1]: e["size"] for e in entries if e["type"] == "file"}


def ray_storage(storage_path: Optional[str], default: str = ".ray_results"):
    """``(storage_path, storage_filesystem)`` for Ray Train's ``RunConfig``.

    Local paths are made absolute (filesystem ``None``). For ``s3://bucket/prefix`` an explicit
    ``pyarrow.fs.S3FileSystem`` is built with ``AWS_ENDPOINT_URL`` (pyarrow >= 16 also reads it
    itself) and the path is returned without its scheme, as Ray expects with a filesystem.
    """
    path = storage_path or default
    if not is_url(path):
        return str(Path(path).resolve()), None
    scheme, rest = str(path).split("://", 1)
    if scheme not in ("s3", "s3a"):
        return str(path), None  # gs://, hdfs://, ... : let pyarrow resolve it from the URI
    from pyarrow import fs as pafs

    kwargs = {}
    endpoint = _endpoint()
    if endpoint:
        kwargs["endpoint_override"] = endpoint
        if endpoint.startswith("http://"):
            kwargs["scheme"] = "http"
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        kwargs["region"] = region
    return rest.rstrip("/"), pafs.S3FileSystem(**kwargs)


def _local_files(local: Path) -> list[str]:
    files = sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
    # markers last, so a reader that sees one also sees everything it names
    return sorted(files, key=lambda r: (Path(r).name in MARKERS, r))


def upload_dir(local: str | os.PathLike, url: str, *, delete: bool = True) -> list[str]:
    """Mirror directory ``local`` to ``url`` (a bucket prefix); returns the relative names written.

    Hidden files (``.partial.*``, left by an interrupted write) are skipped.
    With ``delete``, objects under the prefix that are not in ``local`` are removed afterwards.
    """
    local = Path(local)
    if not local.is_dir():
        raise FileNotFoundError(f"{local} is not a directory")
    fs, root = filesystem(url)
    if not is_url(url):  # mirroring into `.` deleted the current directory's files, the source's too
        spare = {**_never_replaced(), "the folder pushed": local} if delete else {}
        _local_target(url, "push", "push mirrors the folder, deleting what it lacks: name a folder below it, "
                      "or pass --keep", spare)
    rels = [r for r in _local_files(local) if not any(part.startswith(".") for part in Path(r).parts)]
    if not is_url(url):  # a shared folder: object stores need no parent folders, a file system does
        for rel in rels:
            Path(root, rel).parent.mkdir(parents=True, exist_ok=True)
    if rels:  # one call: s3fs uploads the files concurrently
        fs.put([str(local / rel) for rel in rels], [f"{root.rstrip('/')}/{rel}" for rel in rels])
    if delete:
        keep = {f"{root.rstrip('/')}/{r}" for r in rels}
        stale = [p for p in _find(fs, root) if p not in keep]
        if stale:
            fs.rm(stale)
    fs.invalidate_cache()
    return rels


def _find(fs, root: str) -> list[str]:
    try:
        return [p for p in fs.find(root.rstrip("/") + "/") if not p.endswith("/")]
    except FileNotFoundError:
        return []


def _under(fs, root: str, url: str) -> list[str]:
    """Objects under prefix ``root``. A URL or path naming one file is an error: ``ls`` printed an empty
    name for it and ``pull`` wrote it over its own temporary folder."""
    prefix = root.rstrip("/") + "/"
    found = _find(fs, root)
    objects = [p for p in found if p.startswith(prefix)]
    if found and not objects:
        raise NotADirectoryError(errno.ENOTDIR, "is a file, not a folder or prefix: name the one that holds it",
                                 str(url))
    return objects


def _never_replaced() -> dict[str, Path]:
    """Folders a pull (or a mirroring push) must not replace, nor any folder above them (``/`` included)."""
    return {"the current directory": Path.cwd(), "the home folder": Path(os.path.expanduser("~"))}


def _local_target(local, verb: str, what_to_do: str, spare: dict) -> Path:
    """``local`` resolved; refused when it is a file, or when it is a folder in ``spare`` or above one, which
    ``verb`` would delete: ``pull URL .`` deleted the current directory, the download with it."""
    dest = Path(os.path.expanduser(str(local))).resolve()
    for name, folder in spare.items():
        folder = Path(folder).resolve()
        if dest == folder or dest in folder.parents:
            raise OSError(errno.EINVAL, f"is {name} or holds it, and {what_to_do}", str(dest))
    if dest.exists() and not dest.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, f"is a file: {verb} writes a folder there; name another path, "
                                 f"or move the file", str(dest))
    return dest


def download_dir(url: str, local: str | os.PathLike, *, missing_ok: bool = False) -> Optional[Path]:
    """Copy everything under ``url`` into folder ``local`` (resolved, and returned), replacing it whole:
    downloaded beside it, then swapped in, so a failure leaves the old folder as it was.

    Returns ``None`` (and leaves ``local`` alone) when nothing is there and ``missing_ok``.
    """
    fs, root = filesystem(url)
    local = _local_target(local, "pull", "pull replaces a folder whole: name a folder below it",
                          _never_replaced())
    fs.invalidate_cache()
    objects = _under(fs, root, url)
    if not objects:
        if missing_ok:
            return None
        raise FileNotFoundError(f"nothing under {url}")
    local.parent.mkdir(parents=True, exist_ok=True)  # a file in the way: main() names it
    staged = StagedOutputs([local])  # downloaded beside it, then swapped in; what a killed pull left goes
    tmp = staged[local]
    tmp.mkdir()
    prefix = root.rstrip("/") + "/"
    try:
        targets = [tmp / obj[len(prefix):] for obj in objects]
        for target in targets:
            target.parent.mkdir(parents=True, exist_ok=True)
        fs.get(objects, [str(t) for t in targets])  # one call: s3fs downloads the files concurrently
        apply_umask(tmp)
        staged.publish()
    finally:
        staged.discard()
    return local


def list_objects(url: str) -> list[str]:
    """Object names under ``url``, relative to it."""
    fs, root = filesystem(url)
    fs.invalidate_cache()
    prefix = root.rstrip("/") + "/"
    return [p[len(prefix):] for p in _under(fs, root, url)]


def _pairs(items: list[str]) -> list[tuple[str, str]]:
    """``[a, b, c, d]`` -> ``[(a, b), (c, d)]``, each a usable location (main checked the count)."""
    for item in items:
        check_location(item, "")
    return list(zip(items[::2], items[1::2]))


# What to do about the system's own errors on a local path (ours say it themselves).
_WHAT_TO_DO = {
    errno.EEXIST: "a file is in the way: name a folder, or move the file",
    errno.ENOTDIR: "a file is in the way on this path: name a folder, or move the file",
    errno.EACCES: "check its permissions, or name a folder you can write",
    errno.EPERM: "check its permissions, or name a folder you can write",
    errno.EROFS: "name a folder you can write",
    errno.ENOSPC: "free some space, or name a folder on another disk",
}


def _one_line(exc: Exception) -> Optional[str]:
    """The CLI's one line for an error it reports without a traceback: the object store's sign-in or reach,
    ``<path>: <problem>[: <what to do>]`` for an OS error on a path, ``<Type>: <message>`` for the rest;
    None for a bug."""
    if (problem := access_problem(exc)) is not None:  # first: some of botocore's are OSErrors
        return problem
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        hint = _WHAT_TO_DO.get(exc.errno) if exc.strerror == os.strerror(exc.errno or 0) else None
        return f"{exc.filename}: {exc.strerror}" + (f": {hint}" if hint else "")
    if isinstance(exc, (OSError, ValueError)):
        return f"{type(exc).__name__}: {exc}"
    return None


def main(argv: Optional[list[str]] = None, prog: str = "python -m pipeline.storage") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    push = sub.add_parser("push", help="mirror local directories to URL prefixes")
    push.add_argument("pairs", nargs="+", metavar="LOCAL URL")
    push.add_argument("--keep", action="store_true", help="do not delete remote objects missing locally")
    push.add_argument("--missing-ok", action="store_true", help="skip local directories that do not exist")
    pull = sub.add_parser("pull", help="copy URL prefixes into local directories (each replaced whole)")
    pull.add_argument("pairs", nargs="+", metavar="URL LOCAL")
    pull.add_argument("--missing-ok", action="store_true", help="succeed when nothing is there")
    ls = sub.add_parser("ls", help="list objects under a URL prefix")
    ls.add_argument("url")
    args = ap.parse_args(argv)
    if args.cmd != "ls" and len(args.pairs) % 2:  # a usage error, as argparse's own (exit 2)
        ap.error(f"{args.cmd} takes {'LOCAL URL' if args.cmd == 'push' else 'URL LOCAL'} pairs, got {len(args.pairs)} "
                 f"argument(s): {' '.join(args.pairs)}")
    try:
        if args.cmd == "push":
            for local, url in _pairs(args.pairs):
                if args.missing_ok and not Path(local).is_dir():
                    continue
                n = len(upload_dir(local, url, delete=not args.keep))
                print(f"[storage] {local} -> {url} ({n} files)", flush=True)
        elif args.cmd == "pull":
            for url, local in _pairs(args.pairs):
                got = download_dir(url, local, missing_ok=args.missing_ok)
                print(f"[storage] {url} -> {local}" if got else f"[storage] nothing under {url}", flush=True)
        else:
            check_location(args.url, "")
            names = list_objects(args.url)
            if not names:
                raise FileNotFoundError(f"nothing under {args.url}")
            print("\n".join(names))
    except Exception as exc:
        if (line := _one_line(exc)) is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
