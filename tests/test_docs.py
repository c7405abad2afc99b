"""The README's and the site's code samples run as written (see docs_samples)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docs_samples import ROOT, pages, python_blocks, run_page, upstream


@pytest.fixture(scope="module")
def local_api() -> Iterator[str]:
    with upstream() as base:
        yield base


@pytest.mark.parametrize("page", pages(), ids=lambda page: str(page.relative_to(ROOT)))
def test_every_sample_of_the_page_runs(page: Path, redis_url: str, local_api: str) -> None:
    done = run_page(page, redis_url, local_api)
    assert done.returncode == 0, f"{page.name}:\n{done.stdout}\n{done.stderr}"


def test_the_readme_and_the_site_have_samples_to_run() -> None:
    """A page whose fence the reader sees as Python is run: none is left out by a
    spelling the runner does not know."""
    assert python_blocks(ROOT / "README.md")
    for page in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        text = page.read_text(encoding="utf-8")
        for fence in ("```py\n", "```python3", "```pycon", "``` python"):
            assert fence not in text, f"{page}: {fence.strip()!r} is not run: write ```python"
