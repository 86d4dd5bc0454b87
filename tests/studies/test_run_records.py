"""Run records: results.json names the git commit (and whether the tree was dirty) and
the command line; training appends one JSON line per evaluation to metrics.jsonl; an
optional TensorBoard writer (`--tensorboard DIR`, tensorboardX)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import run_in

from experiments import common
from jax_mha.lab.train import train_seeds

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          check=True, capture_output=True, text=True).stdout


def test_git_state_names_the_commit_and_whether_the_tree_is_dirty(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / ".gitignore").write_text("results/\n")
    (repo / "a.txt").write_text("a")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "first")
    head = _git(repo, "rev-parse", "HEAD").strip()
    tree = _git(repo, "log", "-1", "--format=%T").strip()  # the files as committed
    assert common.git_state(repo) == {"commit": head, "dirty": False, "tree": tree}
    (repo / "results").mkdir()
    (repo / "results" / "r.json").write_text("{}")  # ignored output does not make the tree dirty
    assert common.git_state(repo) == {"commit": head, "dirty": False, "tree": tree}
    (repo / "a.txt").write_text("changed")
    changed = common.git_state(repo)
    assert changed["commit"] == head and changed["dirty"] and changed["tree"] not in (None, tree)
    (repo / "a.txt").write_text("a")  # the same files again: the same tree, whatever HEAD says
    (repo / "b.txt").write_text("b")
    _git(repo, "add", "b.txt")
    _git(repo, "commit", "-qm", "second")
    (repo / "b.txt").unlink()
    assert common.git_state(repo)["tree"] == tree
    assert _git(repo, "status", "--porcelain", "--", "a.txt") == ""  # the index was not touched
    outside = tmp_path / "not_a_checkout"
    outside.mkdir()
    assert common.git_state(outside) == {"commit": None, "dirty": None, "tree": None}


def test_results_json_records_commit_dirty_and_the_command_line(tmp_path):
    out = tmp_path / "out"
    args = ["--out", str(out), "--heads", "1", "2", "--d-model", "8", "--block-heads", "2", "--d-ff", "16"]
    done = subprocess.run([sys.executable, "-m", "experiments.param_count", *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    meta = json.loads((out / "results.json").read_text())["metadata"]
    assert meta["argv"][1:] == args and meta["argv"][0].endswith(os.path.join("experiments", "param_count.py"))
    expected = common.git_state(ROOT)
    if expected["commit"] is None:
        assert meta["commit"] is None and meta["dirty"] is None
    else:
        assert len(meta["commit"]) == 40 and meta["commit"] == expected["commit"]
        assert isinstance(meta["dirty"], bool)
    assert isinstance(meta["host_memory_reused"], bool)


def _reports(seeds: int, evals: int, every: int = 25) -> list[dict]:
    """What train_seeds' callback receives: a report per chunk, `eval` at evaluations."""
    out = []
    for step in range(every, every * evals + 1, every):
        out.append({"step": step - every // 2, "loss": 2.0, "accuracy": 0.1})  # a chunk without an evaluation
        out.append({"step": step, "loss": np.float32(1.5), "accuracy": np.float32(0.25),
                    "eval": {"exact_accuracy": np.linspace(0, 1, seeds), "loss": np.full(seeds, np.nan),
                             "entropy": np.ones((seeds, 2, 4))}})
    return out


def test_metrics_log_appends_one_parsable_line_per_evaluation(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    log = common.MetricsLog(path, [3, 4], {"heads": 8})
    for report in _reports(seeds=2, evals=3):
        log(report)
    log.close()
    again = common.MetricsLog(path, [3, 4], {"heads": 16})  # a second head count (or a resumed run) appends
    for report in _reports(seeds=2, evals=1):
        again(report)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 4 and [(x["heads"], x["step"]) for x in lines] == [(8, 25), (8, 50), (8, 75), (16, 25)]
    first = lines[0]
    assert first["seeds"] == [3, 4] and first["train_loss"] == 1.5 and first["eval"]["exact_accuracy"] == [0.0, 1.0]
    assert first["eval"]["loss"] == [None, None]  # NaN written as null: every line is strict JSON
    assert np.asarray(first["eval"]["entropy"]).shape == (2, 2, 4)


def test_training_writes_a_metrics_line_per_evaluation(tmp_path):
    cfg = common.tiny()  # 50 steps, an evaluation every 25
    path = tmp_path / "metrics.jsonl"
    bar = common.TrainingBar(cfg.train.num_steps, "test", disable=True,
                             log=common.MetricsLog(path, cfg.seeds, {"heads": 4}))
    try:  # 4 heads: the model the study below trains as a command, which then finds its programs compiled
        result = train_seeds(cfg.model_for(4), cfg.task, cfg.train, cfg.seeds, callback=bar)
    finally:
        bar.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == len(result.evals["step"]) == 2
    assert [x["step"] for x in lines] == list(result.evals["step"])
    for i, line in enumerate(lines):
        np.testing.assert_allclose(line["eval"]["exact_accuracy"], result.evals["exact_accuracy"][:, i], rtol=1e-6)


def _tfrecords(path: Path) -> list[bytes]:
    """The records of a TensorBoard event file (TFRecord: length, crc, data, crc)."""
    data, records, at = path.read_bytes(), [], 0
    while at < len(data):
        (length,) = struct.unpack("<Q", data[at : at + 8])
        records.append(data[at + 12 : at + 12 + length])
        at += 12 + length + 4
    return records


def test_tensorboard_writer_writes_an_events_file_per_seed(tmp_path):
    pytest.importorskip("tensorboardX", reason="the tensorboard extra (tensorboardX) is not installed")
    board = tmp_path / "tb"
    log = common.MetricsLog(tmp_path / "metrics.jsonl", [0, 1], {"heads": 4}, tensorboard=board)
    for report in _reports(seeds=2, evals=3):
        log(report)
    log.close()
    runs = sorted(p.name for p in board.iterdir())
    assert runs == ["heads4_seed0", "heads4_seed1"]
    for run in runs:
        (events,) = (board / run).glob("events.out.tfevents.*")
        records = _tfrecords(events)
        # one header record, then per evaluation a scalar for each per-seed metric (the (seeds, 2, 4) entropy is skipped)
        scalars = [r for r in records if b"eval/" in r]
        assert len(scalars) == 6 and sum(b"eval/exact_accuracy" in r for r in scalars) == 3
        assert not any(b"eval/entropy" in r for r in records)


def test_tensorboard_without_its_extra_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.raises(SystemExit) as e:
        common.MetricsLog(tmp_path / "metrics.jsonl", [0], tensorboard=tmp_path / "tb")
    message = str(e.value.code)
    assert "\n" not in message and "tensorboardX" in message and 'pip install -e ".[tensorboard]"' in message


def test_head_ablation_writes_metrics_jsonl_and_tensorboard_events(tmp_path):
    """The study end to end: one metrics line per evaluation beside results.json, whose
    metadata has the command line; `--tensorboard DIR` gets one run per head count and seed."""
    out = tmp_path / "out"
    args = ["--preset", "tiny", "--heads", "4", "--steps", "50", "--no-early-stop", "--no-progress", "--out", str(out)]
    try:
        import tensorboardX  # noqa: F401

        args += ["--tensorboard", str(tmp_path / "tb")]
    except ImportError:
        pass  # the metrics.jsonl half still runs
    done = subprocess.run([sys.executable, "-m", "experiments.head_ablation", *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300)  # a command: its argv is the one recorded
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["metadata"]["argv"][1:] == args
    eval_steps = results["heads"]["4"]["runs"][0]["eval_curve"]["step"]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == eval_steps and len(lines) == 2
    assert {x["heads"] for x in lines} == {4} and all(x["seeds"] == [0, 1] for x in lines)
    for i, line in enumerate(lines):
        assert [r["eval_curve"]["exact_accuracy"][i] for r in results["heads"]["4"]["runs"]] == pytest.approx(
            line["eval"]["exact_accuracy"])
    if "--tensorboard" in args:
        assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == ["heads4_seed0", "heads4_seed1"]
    from experiments import head_ablation

    _, stdout = run_in(ROOT, head_ablation.main, args)  # the rerun, in-process: the head count is done
    assert "h=4: already in" in stdout
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2  # skipped, nothing appended
