"""Smoke runs of the studies at tiny size: they run end to end and write what they say."""

import json

import numpy as np
import pytest

from experiments import associative_recall, lm_sizing


def test_associative_recall_tiny(tmp_path):
    results = associative_recall.main(["--preset", "tiny", "--out", str(tmp_path), "--no-progress"])
    assert set(results["heads"]) == {"1", "2"}
    for name in ("results.json", "summary.md", "recall_curves.png", "recall_vs_heads.png"):
        assert (tmp_path / name).stat().st_size > 0
    summary = (tmp_path / "summary.md").read_text()
    assert "AUC, h = 2 − h = 1" in summary and "Holm p = " in summary and "Wilson" in summary
    assert "elimination strategy" in summary and "/2 [" in summary  # seeds solved, k of 2, with an interval
    run = json.loads((tmp_path / "results.json").read_text())["heads"]["2"]["runs"][0]
    assert run["auc_loss"] == pytest.approx(associative_recall.area_under_loss(run["eval_step"], run["eval_loss"]))
    art = json.loads((tmp_path / "artifact.json").read_text())
    assert art["kind"] == "recall" and art["heads"]["2"]["auc_loss"][0] == pytest.approx(run["auc_loss"])
    from experiments import common_tables

    assert common_tables.recall_table(art) in summary  # the page and the study render the same table
    assert "Fisher p" in summary and len(art["heads"]["2"]["escape_step"]) == 2


def test_area_under_loss_is_the_trapezoid_mean():
    assert associative_recall.area_under_loss([0, 10, 30], [3.0, 1.0, 1.0]) == pytest.approx((20 + 20) / 30)
    assert associative_recall.area_under_loss([5], [2.0]) == 2.0


def test_lm_sizing_tiny(tmp_path):
    results = lm_sizing.main(["--heads", "2", "--lrs", "3e-3", "--steps", "50", "--d-model", "8", "--seq-len", "16",
                              "--batch-size", "4", "--warmup", "5", "--out", str(tmp_path), "--no-progress"])
    (run,) = results["runs"]
    assert run["characters_per_seed"] == 50 * 4 * 16
    assert np.all(np.isfinite(run["final_bpc"]))
    assert run["seeds"] == [lm_sizing.GRID_FIRST_SEED]  # disjoint from the seeds a sweep reports (0, 1, ...)
    assert 0 < run["test_bpc"][0] < 8 and run["test_bpc"][0] != run["final_bpc"][0]  # the whole test split, not dev
    assert results["ngram_bpc"][1] > results["ngram_bpc"][3]  # the baselines come from the split
    assert "3-gram" in (tmp_path / "summary.md").read_text() and (tmp_path / "sizing_curves.png").exists()


def test_one_token_accuracy_reference_lines():
    from jax_mha.lab.data import RecallTaskConfig

    # With 40 key symbols another of the 8 pairs shares the token with probability ~7/40: mostly one token will do.
    assert associative_recall.one_token_accuracy(RecallTaskConfig(num_key_symbols=40), "a", rows=256) > 0.9
    # With 2 key symbols and 4 distinct keys, each token value is shared by exactly 2 pairs:
    # right with probability 1/2 + (1/2)(1/V) when the other candidate's value may coincide.
    cfg = RecallTaskConfig(num_pairs=4, num_queries=4, num_key_symbols=2, num_values=8)
    assert associative_recall.one_token_accuracy(cfg, "b", rows=4096) == pytest.approx(0.5 + 0.5 / 8, abs=0.01)


def test_context_value_strategies_by_hand():
    from jax_mha.lab.data import RecallTaskConfig

    # One pair asked twice (with repeats): the most common value is always right; the
    # elimination strategy is right at the first query and at chance (all values tied,
    # nothing left) at the second: (1 + 1/V) / 2.
    one = RecallTaskConfig(num_pairs=1, num_queries=2, num_key_symbols=2, num_values=8)
    assert associative_recall.context_value_accuracy(one, "mode", rows=64) == 1.0
    assert associative_recall.context_value_accuracy(one, "elimination", rows=64) == pytest.approx((1 + 1 / 8) / 2)
    # Two pairs, each asked once (the earlier generator): the first query is right if the
    # values agree (1/V), else half the time; the second is the one pair left: always right.
    two = RecallTaskConfig(num_pairs=2, num_queries=2, num_key_symbols=2, num_values=8, queries_with_replacement=False)
    exact = (1 / 8 + (1 - 1 / 8) / 2 + 1) / 2
    assert associative_recall.context_value_accuracy(two, "elimination", rows=8192) == pytest.approx(exact, abs=0.01)
    with pytest.raises(ValueError, match="strategy must be"):
        associative_recall.context_value_accuracy(one, "guess")


def test_elimination_shortcut_is_gone_with_repeated_queries():
    from jax_mha.lab.data import RecallTaskConfig

    # The reviewer's figure for the earlier generator (every key asked once): 0.480.
    once = RecallTaskConfig(queries_with_replacement=False)
    assert associative_recall.context_value_accuracy(once, "elimination", rows=2048) == pytest.approx(0.48, abs=0.015)
    repeats = RecallTaskConfig()
    lines = associative_recall.reference_lines(repeats, rows=2048)
    assert lines["elimination"] < lines["value_mode"] < 0.35 < 0.6 < lines["one_token_a"]
