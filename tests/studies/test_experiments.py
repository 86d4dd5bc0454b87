"""experiments.head_ablation end to end on the tiny preset, as a user runs it: started as
a command, interrupted with Ctrl-C once a training state is saved (one line, exit
130), resumed with the command it printed (continuing inside the head count), then
the studies that read its checkpoints, with the checks on which checkpoint they use.

Everything runs in one temporary working directory, so the default output folders
(results/head_ablation/tiny, ...) are the ones exercised.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
from conftest import run_in

from experiments import attention_maps, common, head_ablation, head_pruning
from jax_mha.lab.checkpoint import saved_train_step

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--preset", "tiny", "--heads", "4", "--steps", "100", "--no-early-stop", "--no-progress"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ENV = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")


def interrupt_once_saved(cwd: Path, state_dir: Path) -> subprocess.CompletedProcess:
    """Starts the ablation as a command and sends SIGINT as soon as `state_dir` holds
    a completely saved training step."""
    proc = subprocess.Popen([sys.executable, "-m", "experiments.head_ablation", *ARGS], cwd=cwd, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while saved_train_step(state_dir) is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("study")
    out = cwd / "results" / "head_ablation" / "tiny"
    interrupted = interrupt_once_saved(cwd, out / "checkpoints" / "h4_state")
    results, stdout = run_in(cwd, head_ablation.main, ARGS)  # the resume, in-process
    return types.SimpleNamespace(cwd=cwd, out=out, interrupted=interrupted, results=results, stdout=stdout)


def test_ctrl_c_prints_one_line_and_exits_130(study):
    proc = study.interrupted
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and len(proc.stderr) < 2000, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    match = re.fullmatch(r"interrupted: no head count finished; h=4 is saved at step (\d+); resume with: (.*)", line)
    assert match, line
    assert shlex.split(match.group(2)) == ["python", "-m", "experiments.head_ablation", *ARGS]
    assert proc.stdout.splitlines()[0].startswith("copy task: copy L=3")


def test_resume_continues_inside_the_head_count(study):
    saved_at = int(re.search(r"saved at step (\d+)", study.interrupted.stderr).group(1))
    record = study.results["heads"]["4"]
    assert record["resumed_from"] == saved_at > 0 and record["steps_run"] == 100
    assert "h=4: resuming from the training state saved in" in study.stdout
    assert list(record["runs"][0]["curve"]["step"]) == [25, 50, 75, 100]  # the curve of the whole run, not just the rest
    leftovers = [p for p in study.cwd.rglob("*") if p.name.endswith(".tmp") or p.name.endswith("_state")]
    assert not leftovers


def test_outputs(study):
    results = json.loads((study.out / "results.json").read_text())
    assert set(results["heads"]) == {"4"} and results["config"]["seed"] == 0
    assert {"jax", "flax", "optax", "cpu", "cpu_count"} <= set(results["metadata"])
    for key, h in (("4", 4),):
        record = results["heads"][key]
        assert record["heads"] == h and [r["seed"] for r in record["runs"]] == [0, 1]
        assert record["stop_reason"] == "step limit" and record["tokens_per_second"] > 0
        for run in record["runs"]:
            assert 0.0 <= run["final_token_accuracy"] <= 1.0
            assert np.asarray(run["entropy"]).shape == (1, h)
    for name in ("learning_curves.png", "accuracy_vs_heads.png", "entropy_per_head.png"):
        assert (study.out / name).read_bytes()[:8] == PNG_MAGIC
    summary = (study.out / "summary.md").read_text()
    assert "| 4 | 2 |" in summary and "the model reads T=8" in summary
    assert (study.out / "checkpoints" / "h4_seed1.msgpack").stat().st_size > 0


def test_rerun_skips_finished_heads_and_force_starts_over(study, monkeypatch):
    trained = []

    def spy(model_cfg, *args, **kwargs):
        trained.append(model_cfg.num_heads)
        raise KeyboardInterrupt  # Ctrl-C at once

    monkeypatch.setattr(head_ablation, "train_seeds", spy)
    _, stdout = run_in(study.cwd, head_ablation.main, ARGS)
    assert trained == [] and "h=4: already in" in stdout
    with pytest.raises(common.Interrupted, match="no head count finished"):
        run_in(study.cwd, head_ablation.main, ARGS + ["--force"])
    assert trained == [4]
    assert json.loads((study.out / "results.json").read_text())["heads"].keys() == {"4"}  # untouched


def test_other_config_in_same_folder_is_refused(study):
    with pytest.raises(SystemExit, match=r"different configuration \(differs in \['train'\]\)"):
        run_in(study.cwd, head_ablation.main, ARGS + ["--lr", "0.1"])


def test_pruning_uses_and_checks_the_ablation_checkpoint(study):
    results, stdout = run_in(study.cwd, head_pruning.main, ["--preset", "tiny", "--no-progress"])
    assert stdout.splitlines()[0] == ("model: results/head_ablation/tiny/checkpoints/h4_seed0.msgpack, the --preset "
                                      "tiny model with 4 heads, seed 0 (1 layer x 4 heads, d_model=8, copy L=3 (T=8))")
    out = study.cwd / "results" / "head_pruning" / "tiny"
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["source"]["kind"] == "checkpoint" and results["total_heads"] == 4
    for order in ("importance", "oracle"):
        record = on_disk["pruning"][order]
        assert [s["num_pruned"] for s in record["steps"]] == list(range(5))  # run to the end, one head per step
        k = on_disk["heads_prunable"][order]
        assert all(s["accuracy"] >= record["base_accuracy"] - 0.01 for s in record["steps"][: k + 1])
        if k < 4:
            assert record["steps"][k + 1]["accuracy"] < record["base_accuracy"] - 0.01
    for name in ("pruning_curves.png", "importance_heatmap.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    assert not (out / "checkpoints").exists()  # nothing trained


def test_attention_maps_of_the_ablation_model(study):
    results, stdout = run_in(study.cwd, attention_maps.main, ["--preset", "tiny", "--stats-size", "23", "--example",
                                                              "3", "--no-progress"])
    assert stdout.startswith("model: results/head_ablation/tiny/checkpoints/h4_seed0.msgpack, the --preset tiny")
    at_l = np.asarray(results["weight_at_offset_L"])
    assert at_l.shape == (1, 4) and np.all((0 <= at_l) & (at_l <= 1))
    r = results["retrieval_head"]
    assert at_l[r["layer"], r["head"]] == pytest.approx(at_l.max())
    for name in ("layer0.png", "offset_profile.png"):
        assert (study.cwd / "results" / "attention_maps" / "tiny" / name).read_bytes()[:8] == PNG_MAGIC


def test_docs_load_and_decode_snippet(study):
    """The head-ablation page's snippet that loads an ablation checkpoint and decodes
    with it, on this run's tiny checkpoint."""
    text = (ROOT / "docs" / "results" / "head_ablation.md").read_text(encoding="utf-8")
    block = re.search(r"```py\n(# Load a trained copy model.*?)```", text, re.S).group(1)
    block = block.replace("quick/checkpoints/h8_seed0", "tiny/checkpoints/h4_seed0")
    run_in(study.cwd, lambda _: exec(compile(block, "docs/results/head_ablation.md[load and decode]", "exec"), {}), None)


def test_mesh_option_gives_the_same_training(study, tmp_path):
    """--mesh data=2,model=2 on 4 simulated CPU devices trains the same models."""
    # Compiled at -O0 like the run it is compared with (conftest's flag, which this variable would otherwise drop).
    env = dict(ENV, XLA_FLAGS="--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0")
    proc = subprocess.run([sys.executable, "-m", "experiments.head_ablation", *ARGS, "--mesh",
                           "data=2,model=2", "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sharded = json.loads((tmp_path / "results.json").read_text())["heads"]["4"]["runs"]
    for a, b in zip(sharded, study.results["heads"]["4"]["runs"]):
        assert a["curve"]["loss"] == pytest.approx(list(b["curve"]["loss"]), rel=1e-4)
