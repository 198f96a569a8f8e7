"""The docs' own links: every relative link in README.md, infra/README.md and docs/*.md names a file
that exists, and every #anchor a heading of that file (GitHub's heading slugs)."""
from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from tests.conftest import ROOT

DOCS = [ROOT / "README.md", ROOT / "infra/README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, each space a hyphen."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def prose(path: Path) -> str:
    """The file without its code blocks: a '#' line there is no heading, a ``](`` no link."""
    return re.sub(r"```.*?```", "", path.read_text(), flags=re.S)


@functools.cache  # a doc links to the same file many times
def anchors(path: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", prose(path), flags=re.M)}


def test_slug_is_githubs():
    assert slug("Training (`pretrain`, `finetune`)") == "training-pretrain-finetune"
    assert slug("Training: input-path throughput (CPU, H100, H200)") == "training-input-path-throughput-cpu-h100-h200"
    assert slug("Is it the loop?") == "is-it-the-loop"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    broken = []
    for target in LINK.findall(prose(doc)):
        if re.match(r"[a-z]+:", target):  # http(s):, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_params_reference_names_every_key():
    """docs/params.md's table has a row for every key a params file may set."""
    from pipeline.config import Params, flatten

    text = (ROOT / "docs/params.md").read_text()
    table = text[text.index("## The keys"):text.index("## Checking")]
    keys = " ".join(line.split(" | ")[0] for line in table.splitlines() if line.startswith("| `"))  # first column
    named = set(re.findall(r"`(?:[^`\s]*\.)?(\w+)`", keys))  # `data.*.root`, `{pretrain,finetune}.keep`, `maxsize`
    # a key, or the section holding it (`augment`'s keys are listed in its row)
    missing = [key for key in flatten(Params()) if not set(key.split(".")[-2:]) & named]
    assert not missing, f"docs/params.md's table lacks {missing}"
