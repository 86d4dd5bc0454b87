"""A rerun reads back what a finished run stored: nulls (NaN is stored as null) and
single seeds must format as "–", never crash or print "nan"."""

from __future__ import annotations

import json

import pytest
from conftest import run_in

from experiments import common, head_ablation


def test_fmt_prints_a_dash_for_missing_numbers():
    assert common.fmt(None, ",.0f") == "–" and common.fmt(float("nan"), ".3f") == "–"
    assert common.fmt(12345.6, ",.0f") == "12,346"
    assert common.fmt_mean_std(1.5, float("nan"), ".2f") == "1.50 ± –"  # one seed: no spread
    assert common.fmt_mean_std(None, None, ".2f") == "–"
    assert common.fmt_mean_std(1.5, 0.25, ".2f") == "1.50 ± 0.25"


def test_one_chunk_run_resumes_and_prints_dashes(tmp_path):
    # --steps equal to --steps-per-call: one training call, none timed after the first,
    # so the throughput is NaN and results.json stores it as null.
    argv = ["--preset", "tiny", "--heads", "2", "--seeds", "1", "--steps", "25", "--steps-per-call", "25",
            "--eval-every", "25", "--no-early-stop", "--no-progress", "--out", str(tmp_path / "out")]
    run_in(tmp_path, head_ablation.main, argv)
    stored = json.loads((tmp_path / "out" / "results.json").read_text())["heads"]["2"]
    assert stored["tokens_per_second"] is None and stored["program_steps_per_second"] is None
    _, stdout = run_in(tmp_path, head_ablation.main, argv)  # the rerun: skips h=2 and formats what it read
    assert "h=2: already in" in stdout
    row = next(line for line in stdout.splitlines() if line.startswith("| 2 |"))
    assert "nan" not in row and row.rstrip().endswith("| – |")  # throughput: a dash
    assert "± –" in row  # one seed: the spread does not exist


def lm_results(bpc_per_head: dict[int, list], tokens_per_second=None) -> dict:
    """A minimal LM results.json as read back, with nulls where NaNs were stored."""
    run = lambda seed, bpc: {"seed": seed, "final_bpc": bpc, "final_train_bpc": None if bpc is None else bpc - 0.1,
                             "characters_seen": 1000}
    return {"config": {"task": {"name": "lm", "seq_len": 16, "test_fraction": 0.1},
                       "model": {"d_model": 8, "num_layers": 1, "head_dim": None}, "num_seeds": 1, "seed": 0,
                       "train": {"batch_size": 4, "num_steps": 25}},
            "heads": {str(h): {"head_dim": 8 // h, "wall_seconds": None, "tokens_per_second": tokens_per_second,
                               "runs": [run(i, b) for i, b in enumerate(values)]}
                      for h, values in bpc_per_head.items()}}


@pytest.mark.parametrize("per_head", [{2: [3.5], 4: [3.25]}, {2: [3.5, None], 4: [3.25, 3.0]}])
def test_lm_summary_of_one_seed_or_a_missing_value(per_head):
    text = head_ablation.lm_summary_table(lm_results(per_head))
    assert "nan" not in text.lower()
    row = next(line for line in text.splitlines() if line.startswith("| 2 |"))
    assert "3.5000 ± –" in row and row.rstrip().endswith("| – | – |")  # wall s and tokens/s were null
    assert "test bpc" in text  # the split the number was measured on


def test_lm_summary_comparisons_are_holm_adjusted():
    text = head_ablation.lm_summary_table(lm_results({1: [2.0, 2.1, 2.3], 2: [1.9, 2.05, 2.1], 4: [1.8, 1.9, 2.0]}))
    assert "Holm-adjusted over these 3 comparisons" in text
    for name in ("h=2 − h=1", "h=4 − h=1", "h=4 − h=2"):
        assert f"- {name}: " in text
