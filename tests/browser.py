"""The headless browser the MLflow UI tests drive: Debian's Chromium through Playwright."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]


def ensure_chromium() -> None:
    """Debian's chromium, which `bash scripts/test.sh` installs (visibly) before the suite runs."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run the suite with `bash scripts/test.sh` (it installs it), "
                    f"or `apt-get install chromium fonts-dejavu-core`")


def param_row(page, name: str):
    """The compare view's table row of param ``name``."""
    return page.locator("tr").filter(has=page.locator("th", has_text=re.compile(rf"^{re.escape(name)}$")))


def compact_screenshot(page, path: Path, *, hidden: str, kept: str) -> None:
    """The compare view as the README shows it: only differing params (``hidden`` goes, ``kept``
    stays), no plots, no sidebar."""
    page.get_by_label("Show diff only").first.click()
    param_row(page, hidden).wait_for(state="detached")
    assert param_row(page, kept).count() == 1
    page.get_by_role("button", name=re.compile("Visualizations")).first.click()
    if page.get_by_role("button", name="Toggle sidebar").count():
        page.get_by_role("button", name="Toggle sidebar").first.click()
    page.wait_for_timeout(500)
    page.screenshot(path=str(path))
