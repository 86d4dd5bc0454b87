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
    args = [a if a != "2" or i != 3 else a for i, a in enumerate(TINY)]
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
