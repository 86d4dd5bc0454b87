"""The studies as commands: every class of bad input ends in one `error:` line (exit 2
for arguments, 1 for unusable files) and never in a traceback or a hang; `--help`
lists every preset's values; blockwise_memory's measuring child dies with its
parent; and the imports point one way.

The bad-input cases run in one subprocess (importing jax once), each through the
module's real `__main__` path (`runpy`), under a timeout: a case that would hang or
start training fails the test instead of stalling the suite.
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

DRIVER = r"""
import contextlib, io, json, runpy, sys
results = []
for module, argv in json.load(sys.stdin):
    out, err = io.StringIO(), io.StringIO()
    sys.argv = [module] + argv
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) or e.code is None else (print(e.code, file=sys.stderr) or 1)
        except BaseException as e:  # what a user would see as a traceback
            code = "raised " + type(e).__name__ + ": " + str(e)
    results.append({"code": code or 0, "stdout": out.getvalue(), "stderr": err.getvalue()})
print("RESULTS " + json.dumps(results))
"""

# (module, argv, exit status, fragment of the last stderr line). One per class of bad input.
BAD_ARGUMENTS = [
    ("head_ablation", ["--d-model", "0"], "argument --d-model: 0 is not an integer >= 1"),
    ("head_ablation", ["--steps-per-call", "0"], "argument --steps-per-call: 0 is not an integer >= 1"),
    ("head_ablation", ["--eval-every", "0"], "argument --eval-every: 0 is not an integer >= 1"),
    ("head_ablation", ["--seeds", "0"], "argument --seeds: 0 is not an integer >= 1"),
    ("head_ablation", ["--seeds", "-1"], "argument --seeds: -1 is not an integer >= 1"),
    ("head_ablation", ["--seeds", "two"], "argument --seeds: 'two' is not an integer"),
    ("head_ablation", ["--lr", "-0.01"], "argument --lr: -0.01 is not a finite number > 0"),
    ("head_ablation", ["--lr", "nan"], "argument --lr: nan is not a finite number > 0"),
    ("head_ablation", ["--layers", "0"], "argument --layers: 0 is not an integer >= 1"),
    ("head_ablation", ["--steps", "75"], "num_steps=75 must be a multiple of steps_per_call=50"),
    ("head_ablation", ["--eval-every", "70"], "eval_every=70 must be a multiple of steps_per_call=50"),
    ("head_ablation", ["--heads", "3", "--d-model", "8"], "d_model=8 is not divisible by num_heads=3"),
    ("head_ablation", ["--mesh", "data=x"], "mesh axis 'data' needs a positive integer size"),
    ("head_ablation", ["--mesh", "data=1,model=2"], "data=1 x sequence=1 x model=2 needs 2 devices, only 1 available"),
    ("head_ablation", ["--task", "lm", "--seq-len", "20", "--mesh", "data=1,sequence=4"],
     "sequence length 20 is not a multiple of 4² = 16"),
    ("head_ablation", ["--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
    ("head_ablation", ["--task", "bogus"], "argument --task: invalid choice: 'bogus'"),
    ("head_ablation", ["--task", "lm", "--length", "5"], "--length and --reverse are copy-task options"),
    ("head_ablation", ["--seq-len", "8"], "--seq-len and --text need --task lm"),
    ("head_ablation", ["--task", "lm", "--seq-len", "0"], "argument --seq-len: 0 is not an integer >= 1"),
    ("head_ablation", ["--task", "lm", "--seq-len", "100000"], "is too short"),
    ("head_ablation", ["--task", "lm", "--text", "missing.txt"], "text file 'missing.txt' does not exist"),
    ("head_pruning", ["--task", "lm", "--preset", "tiny", "--text", "missing.txt"], "'missing.txt' does not exist"),
    ("head_pruning", ["--text", "a.txt"], "--text a.txt needs --task lm"),
    ("head_pruning", ["--score-size", "0"], "argument --score-size: 0 is not an integer >= 1"),
    ("head_pruning", ["--eval-size", "0"], "argument --eval-size: 0 is not an integer >= 1"),
    ("head_pruning", ["--max-drop", "5"], r"argument --max-drop: 5 is not in [0, 1]"),
    ("head_pruning", ["--heads", "5", "--preset", "tiny"], "d_model=8 is not divisible by num_heads=5"),
    ("head_pruning", ["--train-steps", "30", "--preset", "tiny"], "num_steps=30 must be a multiple of steps_per_call=25"),
    ("attention_maps", ["--example", "300"], "--example 300 must be below --stats-size 256"),
    ("attention_maps", ["--stats-size", "0"], "argument --stats-size: 0 is not an integer >= 1"),
    ("head_timing", ["--batch", "0"], "argument --batch: 0 is not an integer >= 1"),
    ("head_timing", ["--seq", "-8"], "argument --seq: -8 is not an integer >= 1"),
    ("head_timing", ["--heads", "3", "--d-model", "16"], "d_model=16 is not divisible by num_heads=3"),
    ("param_count", ["--d-model", "-512"], "argument --d-model: -512 is not an integer >= 1"),
    ("param_count", ["--heads", "5"], "d_model=512 is not divisible by num_heads=5"),
    ("benchmark", ["--shapes", "0,16,32,4"], "'0,16,32,4' must be four integers >= 1"),
    ("benchmark", ["--shapes", "garbage"], "'garbage' is not four integers B,N,d_model,H"),
    ("benchmark", ["--shapes", "2,16,32,3"], "d_model=32 is not divisible by H=3"),
    ("blockwise_memory", ["--query-block-size", "0"], "argument --query-block-size: 0 is not an integer >= 1"),
    ("blockwise_memory", ["--max-rss-gib", "-1"], "argument --max-rss-gib: -1 is not a finite number > 0"),
]

# Files a study reads, damaged: the contents, and the fragment of the one error line.
DAMAGED_RESULTS = [
    (b"\x8f\x00\xff random bytes", "results.json is damaged: it is not valid JSON"),
    (b"[1, 2, 3]", "results.json is damaged: it holds a JSON list, not an object"),
    (b"null", "results.json is damaged: it holds a JSON NoneType, not an object"),
    (b'{"config": {}, "metadata": {}, "heads": {"4": {"runs": []}}}', "the record of h=4 is incomplete"),
]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Runs every case in one subprocess; returns `{case id: outcome}`."""
    tmp = tmp_path_factory.mktemp("cli")
    cases = {f"{m} {' '.join(a)}": (f"experiments.{m}", a) for m, a, _ in BAD_ARGUMENTS}
    for i, (data, _) in enumerate(DAMAGED_RESULTS):
        (tmp / f"damaged{i}").mkdir()
        (tmp / f"damaged{i}" / "results.json").write_bytes(data)
        cases[f"damaged {i}"] = ("experiments.head_ablation", ["--preset", "tiny", "--out", str(tmp / f"damaged{i}")])
    (tmp / "broken.msgpack").write_bytes(b"\x81\xa6format\xa5bogus")
    cases["missing checkpoint"] = ("experiments.head_pruning", ["--checkpoint", str(tmp / "missing.msgpack")])
    cases["broken checkpoint"] = ("experiments.head_pruning", ["--checkpoint", str(tmp / "broken.msgpack")])
    cases["help"] = ("experiments.head_ablation", ["--help"])
    cases["help pruning"] = ("experiments.head_pruning", ["--help"])
    proc = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps(list(cases.values())), cwd=tmp,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.split("RESULTS ", 1)[1])
    return dict(zip(cases, results))


def one_error_line(outcome: dict) -> str:
    """The error line; asserts there is no traceback and nothing but usage before it."""
    err = outcome["stderr"].strip()
    assert "Traceback" not in err, err
    lines = err.splitlines()
    usage = [line for line in lines[:-1] if not line.startswith(("usage:", " "))]
    assert not usage, err  # argparse's usage lines may precede the one error line
    assert lines[-1].startswith(("error:", "python -m experiments.")) and "error:" in lines[-1], err
    return lines[-1]


@pytest.mark.parametrize("module, argv, fragment", BAD_ARGUMENTS, ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_bad_argument_is_one_error_line(outcomes, module, argv, fragment):
    outcome = outcomes[f"{module} {' '.join(argv)}"]
    assert outcome["code"] == 2, outcome
    assert fragment in one_error_line(outcome)


@pytest.mark.parametrize("index", range(len(DAMAGED_RESULTS)))
def test_damaged_results_name_the_file_and_force(outcomes, index):
    outcome = outcomes[f"damaged {index}"]
    line = one_error_line(outcome)
    assert outcome["code"] == 1 and DAMAGED_RESULTS[index][1] in line and "--force" in line, line


def test_unusable_checkpoint_names_the_file(outcomes):
    """A missing file is a bad argument (exit 2, before anything runs); a file that is
    there but unreadable is found while loading (exit 1)."""
    for case, fragment, code in (("missing checkpoint", "missing.msgpack does not exist", 2),
                                 ("broken checkpoint", "broken.msgpack is not a jax_mha-checkpoint-v2 file", 1)):
        line = one_error_line(outcomes[case])
        assert outcomes[case]["code"] == code and fragment in line, (line, outcomes[case]["code"])


def test_help_lists_every_preset(outcomes):
    for case in ("help", "help pruning"):
        text = outcomes[case]["stdout"]
        assert outcomes[case]["code"] == 0
        for name, fragment in (("quick", "d_model=64"), ("full", "d_model=256"), ("tiny", "d_model=8")):
            line = next(l for l in text.splitlines() if l.strip().startswith(name + " "))
            assert fragment in line and "the model reads T=" in line and "steps" in line, line
        lm = text.split("presets with --task lm:", 1)[1]
        for name, fragment in (("quick", "d_model=64"), ("standard", "d_model=128"), ("full", "d_model=128"),
                               ("tiny", "d_model=8")):
            line = next(l for l in lm.splitlines() if l.strip().startswith(name + " "))
            assert fragment in line and "character LM" in line and "bpc" in line, line


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _measuring(pid: int) -> list[int]:
    """The parent's measuring children (`--child` on their command line): the parent
    also runs short-lived helpers (git, for the run record), and a signal sent while
    only those run arrives before any row is being measured."""
    def is_measuring(child):
        try:
            return b"--child" in Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
    return [c for c in _children(pid) if is_measuring(c)]


def _gone(pid: int) -> bool:
    """Exited (a zombie waiting for a reaper counts: it runs no more)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc to find the child")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGKILL])
def test_blockwise_memory_child_dies_with_its_parent(tmp_path, signum):
    cmd = [sys.executable, "-m", "experiments.blockwise_memory", "--lengths", "2048", "--implementations", "xla",
           "--out", str(tmp_path / "results.json")]
    parent = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not _measuring(parent.pid) and parent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        children = _measuring(parent.pid)
        assert children, "the measuring child never started"
        os.kill(parent.pid, signum)
        _, err = parent.communicate(timeout=30)
    finally:
        parent.kill()
    deadline = time.monotonic() + 10
    while not all(map(_gone, children)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(map(_gone, children)), f"child {children} outlived its parent"
    if signum == signal.SIGINT:
        assert parent.returncode == 130 and "Traceback" not in err
        assert err.strip().splitlines()[-1].startswith("interrupted: the rows measured so far are in")


def test_blockwise_memory_states_its_memory_writes_each_row_and_resumes(tmp_path, capsys):
    """The parent in-process (its rows are measured in child processes all the same)."""
    from experiments import blockwise_memory

    out = tmp_path / "results.json"

    def run(*lengths):
        code = blockwise_memory.main(["--implementations", "xla", "--out", str(out), "--lengths", *map(str, lengths)])
        captured = capsys.readouterr()
        assert code == 0, captured.err[-2000:]
        return captured.out

    first = run(64)
    assert re.match(r"needs about \d+\.\d GiB of free memory .*; this machine has \d+\.\d GiB available",
                    first.splitlines()[0])
    assert (tmp_path / "peak_rss.png").read_bytes()[:4] == b"\x89PNG"
    second = run(64, 128)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["n"], r["status"]) for r in rows] == [(64, "ok"), (128, "ok")]
    assert "(from the earlier run)" in next(l for l in second.splitlines() if l.split()[:1] == ["64"])


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return {n for n in names if n.split(".")[0] in ("jax_mha", "experiments")}


def test_imports_point_one_way():
    """library (jax_mha) <- harness (jax_mha.lab) <- experiments: the library never
    imports the harness or the studies, and its paths never the modules or the mesh
    code; inside the harness, models <- checkpoint <- train <- analysis; no experiment
    imports another (but the shared common, plotting and common_tables and
    common_anchors, the results pages' renderers a study also prints its summary with)."""
    library = ROOT / "jax_mha"
    for path in sorted(library.rglob("*.py")):
        if path.relative_to(library).parts[0] != "lab":
            deps = _imports(path)
            assert not any(d.startswith(("experiments", "jax_mha.lab")) for d in deps), (path.name, deps)
    for path in sorted((library / "paths").glob("*.py")):  # the paths sit under the modules and the mesh code
        deps = _imports(path)
        assert not any(d.startswith(("jax_mha.nn", "jax_mha.parallel")) for d in deps), (path.name, deps)
    order = ["data", "models", "checkpoint", "train", "analysis"]  # each may import only earlier ones
    for path in sorted((ROOT / "jax_mha" / "lab").glob("*.py")):
        deps = _imports(path)
        assert not any(d.startswith("experiments") for d in deps), (path.name, deps)
        later = order[order.index(path.stem) + 1:] if path.stem in order else []
        assert not deps & {f"jax_mha.lab.{m}" for m in later}, (path.name, deps)
    assert not _imports(library / "parallel" / "partitioning.py"), "partitioning works out shardings, nothing else"
    for path in sorted((ROOT / "experiments").glob("*.py")):
        others = {d for d in _imports(path) if d.startswith("experiments.") and not d.split(".")[1].startswith("common") and d.split(".")[1] != "plotting"}
        assert not others, (path.name, others)
    source = (ROOT / "experiments" / "benchmark.py").read_text()
    assert "AUTO_BLOCKWISE_MIN_SCORES" not in source and "XLA_CHUNK_SCORE_BYTES" not in source
