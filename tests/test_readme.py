"""Every ```python block of README.md runs as written, each in a fresh namespace."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
TEXT = README.read_text(encoding="utf-8")
BLOCKS = re.findall(r"^```python\n(.*?)^```", TEXT, flags=re.DOTALL | re.MULTILINE)


def test_readme_has_python_snippets():
    assert len(BLOCKS) >= 7, f"found only {len(BLOCKS)} ```python blocks in {README}"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_snippet_runs(index):
    code = compile(BLOCKS[index], f"README.md[python block {index}]", "exec")
    exec(code, {"__name__": f"readme_snippet_{index}"})


def test_quick_start_commands():
    quick_start = TEXT.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert 'python -m pip install -e ".[dev]"' in quick_start
    assert re.search(r"^pytest$", quick_start, flags=re.MULTILINE)
