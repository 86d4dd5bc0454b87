"""Every ```python block of README.md and of every docs/**/*.md page runs as written,
each in a fresh namespace; the README's Quick start gives the three commands."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TEXT = README.read_text(encoding="utf-8")
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)


def _blocks():
    """(id, code) for every ```python block, ids like `docs/usage.md[3]`."""
    for page in PAGES:
        name = page.relative_to(ROOT).as_posix()
        for index, code in enumerate(PYTHON_BLOCK.findall(page.read_text(encoding="utf-8"))):
            yield f"{name}[{index}]", code


BLOCKS = dict(_blocks())


def test_pages_have_python_snippets():
    assert len(BLOCKS) >= 16, f"found only {len(BLOCKS)} ```python blocks in README.md and docs/"
    assert any(block_id.startswith("README.md[") for block_id in BLOCKS), "README.md has no ```python block"
    assert any(block_id.startswith("docs/usage.md[") for block_id in BLOCKS), "docs/usage.md has no ```python block"


@pytest.mark.parametrize("block_id", list(BLOCKS))
def test_snippet_runs(block_id):
    code = compile(BLOCKS[block_id], block_id, "exec")
    exec(code, {"__name__": "snippet_" + re.sub(r"\W", "_", block_id)})


def test_quick_start_commands():
    quick_start = TEXT.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = re.search(r"^```bash\n(.*?)^```", quick_start, flags=re.DOTALL | re.MULTILINE).group(1).splitlines()
    assert commands == [
        'python -m pip install -e ".[dev]"',
        "python -m experiments.head_ablation",
        "pytest",
    ]
    assert re.search(r"^pytest$", quick_start, flags=re.MULTILINE)


def test_readme_is_short():
    assert len(TEXT.splitlines()) <= 400


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.*)$", PYTHON_BLOCK.sub("", page.read_text(encoding="utf-8")), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_relative_links_resolve():
    """Every relative link and image of README.md and docs/ names a file (and heading) that exists."""
    missing = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists() or (anchor and path.suffix == ".md" and anchor not in _anchors(path)):
                missing.append(f"{page.relative_to(ROOT)}: {target}")
    assert not missing, missing
