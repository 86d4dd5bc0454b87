"""`python -m experiments.report`: the results pages agree with their committed data, and
a page that disagrees, a missing or unused data file is named."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from experiments import report
from jax_mha.lab import stats


def test_committed_pages_agree_with_their_data(capsys):
    assert report.main(["--check"]) == 0, capsys.readouterr().err
    assert "every page agrees" in capsys.readouterr().out


SWEEP = {"kind": "lm_sweep", "split": "test",
         "heads": {"1": {"head_dim": 8, "final_bpc": [2.0, 2.2, 2.4], "gap": [0.1, 0.2, 0.3], "wall_seconds": 12.4,
                         "tokens_per_second": None},
                   "2": {"head_dim": 4, "final_bpc": [1.9, 2.05, 2.35], "gap_mean": 0.25, "wall_seconds": 13,
                         "tokens_per_second": 1234.5}}}


def test_sweep_table_is_computed_from_the_seeds():
    text = report.render(SWEEP, "table")
    half = stats.t_quantile(0.975, 2) * 0.2 / math.sqrt(3)  # values 2.0, 2.2, 2.4: mean 2.2, sample std 0.2
    assert f"| 1 | 8 | 2.2000 ± 0.2000 [{2.2 - half:.3f}, {2.2 + half:.3f}] | 2.0000, 2.2000, 2.4000 | +0.200 |" in text
    assert "| 12 | – |" in text and "| +0.250 |" in text and "1,234" in text  # a null is a dash; gap as stored
    (line,) = report.render(SWEEP, "comparisons").splitlines()  # two head counts: one comparison, Holm = raw
    t, p = stats.paired_t_test([1.9, 2.05, 2.35], [2.0, 2.2, 2.4])
    assert line.startswith("- h = 2 − h = 1: −0.1000 [") and f"p = {p:#.2g}, Holm p = {p:#.2g}" in line


def test_head_type_counts_sum_over_seeds_and_an_untyped_run_is_a_dash():
    seed = {"induction": 1, "previous_token": 2, "first_token": 0, "diffuse": 0, "other": 5}
    data = {"kind": "lm_sweep", "heads": {"8": {"final_bpc": [2.0, 2.1], "head_type_counts": [seed, seed]},
                                          "4": {"final_bpc": [2.0, 2.1], "head_type_counts": [seed, None]}}}
    rows = report.render(data, "head_types").splitlines()[2:]
    assert rows == ["| 4 | 2 | – | – | – | – | – | – |", "| 8 | 2 | 16 | 2 | 4 | 0 | 0 | 10 |"]


def test_a_page_that_disagrees_is_named_and_regenerated(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "sweep.json").write_text(json.dumps(SWEEP), encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text("Intro.\n\n<!-- report: sweep#table -->\n| stale |\n<!-- /report -->\n\nEnd.\n", encoding="utf-8")
    problems = report.run(tmp_path, check=True)
    assert problems == ["page.md: disagrees with its data in sweep#table"]
    assert "| stale |" in page.read_text(encoding="utf-8")  # --check changes nothing
    assert report.run(tmp_path) == []
    text = page.read_text(encoding="utf-8")
    assert text.startswith("Intro.\n\n<!-- report: sweep#table -->\n| heads |") and text.endswith("<!-- /report -->\n\nEnd.\n")
    assert report.run(tmp_path, check=True) == []


def test_missing_unused_and_unknown_are_problems(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "orphan.json").write_text(json.dumps(SWEEP), encoding="utf-8")
    (tmp_path / "data" / "sweep.json").write_text(json.dumps(SWEEP), encoding="utf-8")
    (tmp_path / "page.md").write_text("<!-- report: gone#table -->\nx\n<!-- /report -->\n"
                                      "<!-- report: sweep#plot -->\ny\n<!-- /report -->\n", encoding="utf-8")
    problems = report.run(tmp_path, check=True)
    assert any(p.startswith("page.md: gone#table: FileNotFoundError") for p in problems)
    assert any("sweep#plot" in p and "has no block 'plot'" in p for p in problems)
    assert "data/orphan.json: no page shows it" in problems
    assert report.main(["--check", "--pages", str(tmp_path)]) == 1


def test_merge_orders_the_seeds_and_refuses_mixed_kinds(tmp_path):
    for seed in (2, 0):
        (tmp_path / f"s{seed}.json").write_text(json.dumps({"kind": "lm_pruning", "seeds": [{"seed": seed}]}))
    merged = report.merge([tmp_path / "s2.json", tmp_path / "s0.json"])
    assert [s["seed"] for s in merged["seeds"]] == [0, 2] and merged["kind"] == "lm_pruning"
    (tmp_path / "other.json").write_text(json.dumps(SWEEP))
    with pytest.raises(ValueError, match="one kind"):
        report.merge([tmp_path / "s0.json", tmp_path / "other.json"])


def test_recall_table_counts_solved_seeds_with_wilson():
    data = {"kind": "recall", "solved_accuracy": 0.9, "task": {"num_values": 8},
            "reference": {"rows": 64, "value_mode": 0.3, "elimination": 0.29, "one_token_a": 0.65, "one_token_b": 0.65},
            "heads": {"1": {"head_dim": 32, "auc_loss": [1.0, 1.1, 0.9, 1.0], "final_accuracy": [0.95, 0.5, 0.91, 0.4]},
                      "2": {"head_dim": 16, "auc_loss": [0.8, 0.9, 0.7, 0.8], "final_accuracy": [0.99, 0.97, 0.92, 0.3]}}}
    low, high = stats.wilson_interval(3, 4)
    assert f"| 3/4 [{low:.2f}, {high:.2f}] |" in report.render(data, "table")
    assert "elimination" in report.render(data, "reference") and "0.125" in report.render(data, "reference")
    assert "best line without any key lookup, always the most common value among the row's pairs, 0.300, and below " \
           "it the elimination strategy" in report.render(data, "reference")  # the higher of the two is the best
    flipped = {**data, "reference": {**data["reference"], "elimination": 0.48}}
    assert "best line without any key lookup, the elimination strategy" in report.render(flipped, "reference")
    assert report.render(data, "comparisons").count("Holm p ") == 2


def test_recall_shares_escape_and_exact_tests():
    ref = {"rows": 64, "value_mode": 0.3, "elimination": 0.29, "one_token_a": 0.65, "one_token_b": 0.65}
    accs = {"1": [0.31, 0.32, 0.3, 0.33, 0.29, 0.31], "2": [0.95, 0.67, 0.66, 0.32, 0.99, 0.65],
            "4": [0.3, 0.39, 0.41, 0.31, 0.3, 0.3]}  # escape line 0.3 + 0.1: 0.39 does not escape, 0.41 does
    data = {"kind": "recall", "solved_accuracy": 0.9, "task": {"num_values": 8}, "reference": ref,
            "heads": {h: {"head_dim": 32 // int(h), "learning_rate": 3e-3, "auc_loss": [1.0] * 6, "final_accuracy": a,
                          "escape_step": [None if v < 0.4 else 100 * (i + 1) for i, v in enumerate(a)]}
                      for h, a in accs.items()}}
    text = report.render(data, "table")
    assert "seeds escaped (accuracy ≥ 0.400)" in text and "| 2 | 16 | 3e-3 | 2/6 [" in text
    assert "| 5/6 [" in text and "| 1/6 [" in text  # escaped at h = 2 and h = 4
    assert "| 300 (100–600; 5/6) |" in text and "| never (0/6) |" in text  # median of 100, 200, 300, 500, 600
    exact = report.render(data, "exact").splitlines()
    assert len(exact) == 4
    p = stats.fisher_exact(5, 6, 0, 6)
    ps = [stats.fisher_exact(2, 6, 0, 6), p, stats.fisher_exact(0, 6, 0, 6), stats.fisher_exact(1, 6, 0, 6)]
    holm = stats.holm(ps)
    assert exact[1].startswith("- escaped, h = 2 against h = 1: 5/6 against 0/6, Fisher p = ")
    assert f"Fisher p = {p:#.2g}, Holm p = {holm[1]:#.2g}" in exact[1]


GRID = {"kind": "lr_grid", "metric": "dev bpc", "lower_is_better": True,
        "cells": [{"heads": 1, "lr": 1e-3, "values": [2.5, 2.7]}, {"heads": 1, "lr": 3e-3, "values": [2.2, 2.4]},
                  {"heads": 1, "lr": 1e-2, "values": [2.6, 2.8]}, {"heads": 4, "lr": 1e-3, "values": [2.4, 2.4]},
                  {"heads": 4, "lr": 3e-3, "values": [2.35, 2.55]}]}


def test_lr_grid_chooses_the_best_mean_and_says_whether_it_is_bracketed(tmp_path):
    from experiments.common_tables import best_rates

    assert best_rates(GRID) == {1: (3e-3, True), 4: (1e-3, False)}
    text = report.render(GRID, "table")
    assert "| 1 | 2.600 ± 0.141 | **2.300 ± 0.141** | 2.700 ± 0.141 | 3e-3 | yes |" in text
    assert "| 4 | **2.400 ± 0.000** | 2.450 ± 0.141 | – | 1e-3 | no (edge of the grid) |" in text
    higher = dict(GRID, lower_is_better=False)
    assert best_rates(higher)[1] == (1e-2, False)
    parts = []
    for i, cells in enumerate((GRID["cells"][:3], GRID["cells"][3:])):
        (tmp_path / f"{i}.json").write_text(json.dumps(dict(GRID, cells=cells)), encoding="utf-8")
        parts.append(tmp_path / f"{i}.json")
    assert report.merge(parts[::-1])["cells"] == sorted(GRID["cells"], key=lambda c: (c["heads"], c["lr"]))


def test_lr_grid_test_block_shows_test_values_the_dev_choice_and_the_ranking_per_rate():
    cells = [dict(c, test=[v + 1.0 for v in c["values"]]) for c in GRID["cells"]]
    cells[3]["test"] = [3.0, 3.4]  # h = 4 at 1e-3: 3.2, so at 1e-3 h = 1 (3.6) ranks below it
    text = report.render(dict(GRID, cells=cells), "test")
    assert "| 1 | 3.600 ± 0.141 | **3.300 ± 0.141** | 3.700 ± 0.141 |" in text  # bold: the rate dev chose
    assert "| 4 | **3.200 ± 0.283** | 3.450 ± 0.141 | – |" in text
    assert "| best first | 4 < 1 | 1 < 4 | 1 |" in text
    with pytest.raises(ValueError, match="no test values"):
        report.render(GRID, "test")


def test_lm_sweep_power_block_sizes_seeds_from_the_paired_spread():
    rng = np.random.default_rng(5)
    base = rng.normal(2.3, 0.03, size=5)
    heads = {str(h): {"head_dim": 64 // h, "final_bpc": list(base - 0.01 * i + rng.normal(0, 0.01 * (i + 1), 5))}
             for i, h in enumerate((1, 2, 4))}
    text = report.render({"kind": "lm_sweep", "heads": heads}, "power")
    d = np.subtract(heads["4"]["final_bpc"], heads["2"]["final_bpc"])
    sd, alpha = float(np.std(d, ddof=1)), 0.05 / 3
    assert (f"| h = 4 − h = 2 | 5 | {d.mean():+.4f} | {sd:.4f} | {stats.seeds_for_power(0.02, sd, alpha)} | "
            f"{stats.detectable_difference(5, sd, alpha):.3f} |").replace("-", "−") in text
    assert text.count("| h = ") == 3 and "α = 0.05/3 = 0.0167" in text


@pytest.mark.parametrize("preset", ["quick", "standard"])
def test_lm_preset_rates_are_the_committed_grid_choice(preset):
    from experiments import common
    from experiments.common_tables import best_rates

    grid = json.loads((report.DATA / f"lm_{preset}_lr_grid.json").read_text(encoding="utf-8"))
    chosen = best_rates(grid)
    assert all(bracketed for _, bracketed in chosen.values())
    assert dict(common.LM_PRESETS[preset]().learning_rates) == {h: lr for h, (lr, _) in chosen.items()}
    assert tuple(h for h, _ in common.LM_PRESETS[preset]().learning_rates) == common.LM_PRESETS[preset]().heads


def test_recall_standard_rates_are_the_committed_grid_choice():
    from experiments import associative_recall
    from experiments.common_tables import best_rates

    grid = json.loads((report.DATA / "recall_lr_grid.json").read_text(encoding="utf-8"))
    assert dict(associative_recall.STANDARD_RATES) == {h: lr for h, (lr, _) in best_rates(grid).items()}
    assert associative_recall.standard().learning_rates == associative_recall.STANDARD_RATES


def _bench_row(impl, mask, n, fwd, fwd_bwd):
    cell = lambda ms: {"ms": ms, "tflops": 1.0, "peak_pct": None} if ms is not None else {"refused": "no"}
    return dict(impl=impl, mask=mask, batch=2, heads=3, seq=n, head_dim=64, dtype="bfloat16",
                forward=cell(fwd), forward_backward=cell(fwd_bwd))


def test_device_benchmark_ratios_are_over_jax_nns_cudnn_and_refusals_are_named():
    rows = [_bench_row("jax_mha:cudnn", "causal", 256, 3.0, 8.0), _bench_row("jax.nn:cudnn", "causal", 256, 2.0, 4.0),
            _bench_row("jax_mha:pallas_mgpu", "causal", 256, None, None)]
    data = dict(kind="device_benchmark", device="GPU X", peak_bf16_tflops=None, docs_per_row=8, stopped_early=False,
                rows=rows, auto=[dict(mask="causal", seq=256, head_dim=64, chosen="cudnn")],
                grid=dict(batch=[2], heads=[3], dtype=["bfloat16"], repeats=3))
    assert "| causal | 256 | 64 | 1.50 / 2.00 |" in report.render(data, "versus_jax_nn")
    table = report.render(data, "table")
    assert "| 256 | 64 | `cudnn` | 3.00 / 8.00 | 2.00 / 4.00 |" in table
    assert "Not run: `jax_mha:pallas_mgpu` (refused: no)." in table
    with pytest.raises(ValueError, match="no block 'nope'"):
        report.render(data, "nope")


def test_junit_report_becomes_a_device_tests_file(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="tests.test_device" name="test_a[x]" time="1.5"/>'
                   '<testcase classname="tests.test_device" name="test_b" time="0.2"><failure message="m"/></testcase>'
                   '<testcase classname="tests.test_device" name="test_c" time="0"><skipped message="s"/></testcase>'
                   '</testsuite></testsuites>')
    out = tmp_path / "tests.json"
    assert report.main(["--junit", str(xml), "--device", "GPU X", "--versions", "jax 9", "-o", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [(t["name"], t["outcome"]) for t in data["tests"]] == [
        ("test_device::test_a[x]", "passed"), ("test_device::test_b", "failed"), ("test_device::test_c", "skipped")]
    assert report.render(data, "table").startswith("`pytest -m device` on GPU X (jax 9): 1 of 2 passed; 1 skipped")
    with pytest.raises(SystemExit) as exit_info:
        report.main(["--junit", str(xml), "-o", str(out)])
    assert exit_info.value.code == 2


def _flex_row(impl, case, fwd, fwd_bwd):
    cell = lambda ms: ms if isinstance(ms, dict) else dict(ms=ms, ms_min=0.9 * ms, ms_max=1.1 * ms, tflops=500.0 / ms,
                                                           peak_pct=50.0 / ms)
    return dict(case=case, impl=impl, batch=2, heads=3, seq=256, head_dim=64, dtype="bfloat16", visible_pairs=32896,
                forward=cell(fwd), forward_backward=cell(fwd_bwd))


def test_flex_benchmark_ratios_are_over_cudnn_plain_causal_and_refusals_are_grouped():
    no_mod, oom = {"refused": "no score_mod"}, {"error": "OutOfMemory"}
    rows = [_flex_row("jax_mha:pallas_gpu", "causal", 2.0, 4.0), _flex_row("jax_mha:blockwise", "causal", 10.0, 40.0),
            _flex_row("jax.nn:cudnn", "causal", 1.0, 2.0), _flex_row("torch:flex", "causal", 1.5, 3.0),
            _flex_row("jax_mha:pallas_gpu", "alibi", no_mod, no_mod), _flex_row("jax_mha:blockwise", "alibi", 12.0, 44.0),
            _flex_row("torch:flex", "alibi", oom, oom)]
    data = dict(kind="device_benchmark_flex", device="GPU X", peak_bf16_tflops=1000.0, stopped_early=True, torch="2.11",
                cases={"causal": "plain", "alibi": "ALiBi"}, rows=rows,
                grid=dict(batch=2, heads=3, dtype="bfloat16", repeats=3))
    versus = report.render(data, "versus_cudnn")  # every case over the causal case's cuDNN call
    assert "| causal | 256 | 64 | 2.00 / 2.00 | 10.00 / 20.00 | 1.50 / 1.50 |" in versus
    assert "| alibi | 256 | 64 | – / – | 12.00 / 22.00 | – / – |" in versus
    table = report.render(data, "table")
    assert "stopped early by its budget" in table and "torch 2.11" in table
    assert "| causal | 2.00 [1.80–2.20] / 4.00 [3.60–4.40] | 10.00 [9.00–11.00] / 40.00 [36.00–44.00] |" in table
    assert "| alibi | refused / refused | 12.00 [10.80–13.20] / 44.00 [39.60–48.40] | error / error | – |" in table
    tflops = report.render(data, "tflops")
    assert "(% of the 1000 TFLOP/s" in tflops and "| causal | 256 | 64 | 32,896 | 125 (12 %) | 12 (1 %) |" in tflops
    assert report.render(data, "refusals").splitlines() == ["- `jax_mha:pallas_gpu`, alibi: refused: no score_mod",
                                                          "- `torch:flex`, alibi: error: OutOfMemory"]
    with pytest.raises(ValueError, match="no block 'table_x'"):
        report.render(data, "table_x")


def test_composed_attention_page_shows_every_block_of_its_measured_runs():
    """The page renders every block of the H200 run and says nothing is unmeasured."""
    page = (report.PAGES / "composed_attention.md").read_text(encoding="utf-8")
    assert (report.DATA / "device_benchmark_flex_h200.json").exists() and "Not measured yet" not in page
    for block in ("table", "tflops", "versus_cudnn", "refusals", "targets"):
        assert f"<!-- report: device_benchmark_flex_h200#{block} -->" in page, block


def test_flex_targets_count_the_met_ratios():
    rows = [_flex_row("jax_mha:pallas_gpu", "alibi", 1.0, 5.0), _flex_row("jax_mha:blockwise", "alibi", 9.0, 30.0),
            _flex_row("torch:flex", "alibi", 1.0, 3.0), _flex_row("jax_mha:pallas_gpu", "window", 1.0, 10.0),
            _flex_row("jax_mha:blockwise", "window", 9.0, 30.0), _flex_row("torch:flex", "window", 1.0, 9.0)]
    data = dict(kind="device_benchmark_flex", device="GPU X", cases={"alibi": "", "window": ""}, rows=rows)
    text = report.render(data, "targets")
    assert "| alibi | 256 | 64 | 5.00 | 6.00 met | 1.67 **not met** |" in text
    assert "| window | 256 | 64 | 10.00 | 3.00 **not met** | 1.11 met |" in text
    assert "Engine target met in 1 of 2 composed measurements; FlexAttention target in 1 of 2" in text


def test_engine_blocks_table_marks_the_fastest_pair_per_mask():
    row = lambda causal, q, k, ms: dict(causal=causal, q_block=q, k_block=k, ms=ms, ms_min=ms - 1, ms_max=ms + 1)
    data = dict(kind="engine_blocks", device="GPU X", batch=4, heads=16, seq=8192, head_dim=64, dtype="bfloat16",
                defaults={"causal": [512, 512], "unmasked": [2048, 256]}, stopped_early=True,
                rows=[row(True, 512, 512, 80.0), row(True, 1024, 1024, 61.0), row(False, 512, 512, 130.0),
                      dict(causal=False, q_block=4096, k_block=4096, error="OOM")])
    text = report.render(data, "table")
    assert "| causal | 1024 | 1024 | **61.0 [60.0–62.0]** |" in text and "| causal | 512 | 512 | 80.0 [79.0–81.0] |" in text
    assert "| unmasked | 512 | 512 | **130.0 [129.0–131.0]** |" in text and "| unmasked | 4096 | 4096 | OOM |" in text
    assert "causal (512, 512), unmasked (2048, 256) (stopped by its budget)." in text
