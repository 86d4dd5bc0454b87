"""Packaging: one version source, a LICENSE, py.typed shipped, only `jax_mha` installed;
the studies say which extra to install instead of a traceback; importing the studies'
shared module leaves the process's memory allocator alone."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import jax_mha

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
STUDIES = ("attention_maps", "benchmark", "blockwise_memory", "head_ablation", "head_pruning", "head_timing",
           "param_count")


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_version_has_one_source_and_only_jax_mha_is_installed():
    from setuptools import find_packages

    config = pyproject()
    project, tool = config["project"], config["tool"]["setuptools"]
    assert "version" not in project and project["dynamic"] == ["version"]
    assert tool["dynamic"]["version"] == {"attr": "jax_mha.__version__"}
    written = [line for line in (ROOT / "jax_mha" / "__init__.py").read_text().splitlines()
               if line.startswith("__version__ = ")]
    assert len(written) == 1 and f'"{jax_mha.__version__}"' in written[0]  # a literal setuptools reads statically
    found = find_packages(str(ROOT), include=tool["packages"]["find"]["include"])
    assert sorted(found) == ["jax_mha", "jax_mha.lab", "jax_mha.nn", "jax_mha.parallel", "jax_mha.paths"]  # no `experiments`
    assert tool["package-data"]["jax_mha"] == ["py.typed"] and (ROOT / "jax_mha" / "py.typed").is_file()
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]


def test_extras_split_library_studies_and_tools():
    project = pyproject()["project"]
    extras = project["optional-dependencies"]
    names = lambda reqs: {re.split(r"[<>=\[ ;]", req, maxsplit=1)[0] for req in reqs}
    assert names(extras["studies"]) == {"matplotlib", "tqdm"}
    assert "jax_mha[studies]" in extras["dev"] and {"pytest", "ruff", "chex"} <= names(extras["dev"])
    assert names(extras["tensorboard"]) == {"tensorboardX"} and {"mkdocs", "mkdocstrings"} <= names(extras["docs"])
    assert names(project["dependencies"]) == {"jax", "jaxlib", "flax", "optax", "numpy"}  # the library needs no more


def test_license_is_the_apache_2_text():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text and "END OF TERMS AND CONDITIONS" in text
    assert len(text.splitlines()) > 190  # the whole text, not a pointer to it


def _python(code: str, *, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def _run_study(module: str, args: list[str], hide: list[str]) -> subprocess.CompletedProcess:
    """`python -m experiments.<module> ARGS` with the modules in `hide` unimportable."""
    code = (f"import runpy, sys\nfor m in {hide!r}: sys.modules[m] = None\n"
            f"sys.argv = ['{module}', *{args!r}]\nrunpy.run_module('experiments.{module}', run_name='__main__', "
            "alter_sys=True)\n")
    return _python(code)


@pytest.mark.parametrize("module, hide, missing", [
    ("head_timing", ["tqdm"], "tqdm"),
    ("head_ablation", ["tqdm"], "tqdm"),
    ("param_count", ["matplotlib"], "matplotlib"),
])
def test_a_study_without_its_extra_says_which_to_install(tmp_path, module, hide, missing):
    done = _run_study(module, ["--out", str(tmp_path / "out")], hide)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("error:") and missing in lines[0] and 'pip install -e ".[studies]"' in lines[0]
    assert not (tmp_path / "out").exists()  # it stopped before doing anything


def test_the_studies_import_without_the_extras():
    hide = ["tqdm", "matplotlib", "tensorboardX"]
    code = (f"import sys\nfor m in {hide!r}: sys.modules[m] = None\n"
            f"import importlib\nfor s in {STUDIES!r}: importlib.import_module('experiments.' + s)\nprint('ok')\n")
    done = _python(code)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_importing_the_studies_leaves_the_allocator_alone():
    """reuse_freed_memory changes the whole process: only a study's main() (start_study) may call it."""
    code = f"""
import json, sys
import jax_mha.lab.host_memory as host_memory
calls = []
real = host_memory.reuse_freed_memory
host_memory.reuse_freed_memory = lambda: calls.append(1) or real()
import importlib
for s in {STUDIES!r}:
    importlib.import_module("experiments." + s)
from experiments import common
before = (len(calls), common.HOST_MEMORY_REUSED)
first = common.start_study()
again = common.start_study()
meta = common.run_metadata()
print(json.dumps({{"before": before, "first": first, "again": again, "calls": len(calls),
                   "recorded": meta["host_memory_reused"]}}))
"""
    done = _python(code)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["before"] == [0, None]  # imported: not called
    assert got["calls"] == 1 and got["first"] == got["again"] == got["recorded"]  # called once, recorded as it went
    if sys.platform == "linux" and os.confstr("CS_GNU_LIBC_VERSION"):
        assert got["first"] is True  # before any JAX computation on glibc it takes effect


def test_start_study_after_jax_started_changes_nothing_and_says_so():
    code = """
import json, warnings
import jax.numpy as jnp
jnp.ones(3).block_until_ready()  # JAX has started: too late for the allocator
from experiments import common
with warnings.catch_warnings():
    warnings.simplefilter("error")
    print(json.dumps([common.start_study(), common.run_metadata()["host_memory_reused"]]))
"""
    done = _python(code)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [False, False]
