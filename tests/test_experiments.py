"""experiments.head_ablation end to end on a tiny configuration, and its resume logic."""

import json

import pytest

from experiments import head_ablation

TINY = ["--heads", "1", "2", "--seeds", "2", "--steps", "50", "--d-model", "8", "--layers", "1",
        "--length", "3", "--batch-size", "8", "--steps-per-call", "25", "--eval-every", "25", "--no-progress"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ablation")
    head_ablation.main(TINY + ["--out", str(out)])
    return out


def test_cli_writes_results_summary_and_plots(first_run):
    results = json.loads((first_run / "results.json").read_text())
    assert set(results["heads"]) == {"1", "2"}
    assert results["config"]["model"]["d_model"] == 8 and results["config"]["num_seeds"] == 2
    assert {"jax", "flax", "optax", "backend"} <= set(results["metadata"])
    for key, h in (("1", 1), ("2", 2)):
        record = results["heads"][key]
        assert record["heads"] == h and [r["seed"] for r in record["runs"]] == [0, 1]
        for run in record["runs"]:
            assert 0.0 <= run["final_token_accuracy"] <= 1.0
            assert len(run["entropy"]) == 1 and len(run["entropy"][0]) == h
            assert run["curve"]["step"] == [25, 50] and len(run["eval_curve"]["token_accuracy"]) == 2
        assert record["tokens_per_second"] > 0
    for name in ("learning_curves.png", "accuracy_vs_heads.png", "entropy_per_head.png"):
        assert (first_run / name).read_bytes()[:8] == PNG_MAGIC
    summary = (first_run / "summary.md").read_text()
    assert "| 1 | 8 |" in summary and "| 2 | 4 |" in summary
    assert (first_run / "checkpoints" / "h2_seed1.msgpack").stat().st_size > 0


def test_rerun_skips_finished_heads(first_run, monkeypatch, capsys):
    before = json.loads((first_run / "results.json").read_text())
    trained = []
    real = head_ablation.train_seeds

    def spy(model_cfg, *args, **kwargs):
        trained.append(model_cfg.num_heads)
        return real(model_cfg, *args, **kwargs)

    monkeypatch.setattr(head_ablation, "train_seeds", spy)
    args = list(TINY)
    args[args.index("--heads") : args.index("--heads") + 3] = ["--heads", "1", "2", "4"]
    after = head_ablation.main(args + ["--out", str(first_run)])
    assert trained == [4]
    assert "h=1: already in" in capsys.readouterr().out
    assert after["heads"]["1"] == before["heads"]["1"]
    assert set(json.loads((first_run / "results.json").read_text())["heads"]) == {"1", "2", "4"}

    head_ablation.main(TINY + ["--out", str(first_run), "--force"])
    assert trained == [4, 1, 2]


def test_other_config_in_same_folder_is_refused(first_run):
    with pytest.raises(SystemExit, match="different configuration"):
        head_ablation.main(TINY[:-1] + ["--lr", "0.1", "--out", str(first_run)])


def test_bad_head_count_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="d_model=8 is not divisible by num_heads=3"):
        head_ablation.main(["--heads", "3", "--d-model", "8", "--out", str(tmp_path)])


def test_mesh_option_gives_the_same_training(first_run, tmp_path):
    """--mesh data=2,model=2 on 4 simulated CPU devices trains the same models."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    args = list(TINY)
    args[args.index("--heads") : args.index("--heads") + 3] = ["--heads", "2"]  # 2 heads over model=2
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.head_ablation", *args, "--mesh", "data=2,model=2", "--out", str(tmp_path)],
        env=env, capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    sharded = json.loads((tmp_path / "results.json").read_text())["heads"]["2"]["runs"]
    plain = json.loads((first_run / "results.json").read_text())["heads"]["2"]["runs"]
    assert len(sharded) == len(plain) == 2
    for a, b in zip(sharded, plain):
        assert a["curve"]["loss"] == pytest.approx(b["curve"]["loss"], rel=1e-4)


def test_mesh_that_does_not_divide_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="data=1 x model=2 needs 2 devices, only 1 available"):
        head_ablation.main(["--heads", "1", "--mesh", "data=1,model=2", "--out", str(tmp_path)])
