"""DVC stage `shard@<name>`: the dataset in params `data.<name>` -> WebDataset shards in data/shards/<name>/.

Reads params `data.<name>` (name: pretrain or finetune) and the source it names; writes
data/shards/<name>/ ({split}-NNNNNN.tar, manifest.parquet, dataset.json, bad_files.json).
"""
import sys

from pipeline.cli import run_stage
from pipeline.config import TRAINING_STAGES, ConfigError, Params
from pipeline.data import shard_dataset
from pipeline.data.shard_writer import shard_warnings
from pipeline.utils import SHARDS


def main(params: Params, name: str = "") -> None:
    if name not in TRAINING_STAGES:
        raise ConfigError(f"usage: python -m stages.shard {{{'|'.join(TRAINING_STAGES)}}} (got {name!r})")
    spec = getattr(params.data, name)
    try:
        info = shard_dataset(SHARDS / name, spec, params.ray)
    except ValueError as exc:  # the data's own problem (too few images, too many bad ones): say which data
        if isinstance(exc, ConfigError):  # names its data.<name> key already
            raise
        where = f"{spec.source} {spec.root}" if spec.root is not None else spec.source
        raise ValueError(f"data.{name} ({where}): {exc}") from None
    print(f"[shard:{name}] {spec.source}: {info['counts']} -> {SHARDS / name}/", flush=True)
    for note in shard_warnings(info, SHARDS / name):
        print(f"[shard:{name}] warning: {note}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    run_stage(main, *sys.argv[1:], name="-".join(["shard", *sys.argv[1:]]))
