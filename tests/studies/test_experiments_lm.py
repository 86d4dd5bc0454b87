"""`--task lm` end to end on the tiny preset: the ablation's `main` writes bpc, head-type
tables and samples; the attention maps and the pruning study then find its checkpoint.
All in-process (no new Python and JAX start): the command line itself is tested as a
command in tests/studies/test_experiments.py (Ctrl-C, exit code, the resume line).

Everything runs in one temporary working directory, so the default output folders
(results/head_ablation/lm-tiny, ...) are the ones exercised.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_in

from experiments import attention_maps, head_ablation, head_pruning
from jax_mha.lab.head_types import HEAD_TYPES

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ARGS = ["--task", "lm", "--preset", "tiny", "--no-progress"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """Runs `experiments.head_ablation.main(["--task", "lm", "--preset", "tiny", "--heads", "4", ...])`
    (an error raises here)."""
    cwd = tmp_path_factory.mktemp("lm")
    _, stdout = run_in(cwd, head_ablation.main, [*ARGS, "--heads", "4"])
    return cwd, stdout


def test_ablation_writes_bpc_head_types_and_samples(workdir):
    cwd, stdout = workdir
    out = cwd / "results" / "head_ablation" / "lm-tiny"
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["task"]["name"] == "lm"
    record = results["heads"]["4"]
    assert record["stop_reason"] == "step limit" and record["tokens_per_second"] > 0
    for run in record["runs"]:
        assert 0 < run["final_bpc"] < 8 and run["steps_to_target"] is None
        assert len(run["eval_curve"]["bpc"]) == len(run["eval_curve"]["step"]) == 2
        assert len(run["head_types"]) == 4 and {r["type"] for r in run["head_types"]} <= set(HEAD_TYPES)
        assert sum(run["head_type_counts"].values()) == 4
    lines = results["samples"]["lines"]
    assert {l["sampling"] for l in lines} == {"greedy", "temperature 0.8"} and all(l["continuation"] for l in lines)
    table = (out / "head_types.md").read_text()
    assert table.count("\n| 4 | ") == 8  # 2 seeds x 4 heads, one row each
    assert "test bpc" in (out / "summary.md").read_text() and "test bpc" in stdout  # the reported split
    artifact = json.loads((out / "artifact.json").read_text())  # what docs/results/data/ takes
    assert artifact["kind"] == "lm_sweep" and artifact["split"] == "test"
    assert artifact["heads"]["4"]["final_bpc"] == [run["final_bpc"] for run in record["runs"]]
    from experiments import report

    assert "| 4 | 2 |" in report.render(artifact, "table")
    # baselines of the split, characters seen, the gap, and the induction curves of every evaluation.
    assert set(results["ngram_bpc"]) == {"1", "2", "3", "4", "5"}
    assert all(run["characters_seen"] == 50 * 4 * 16 for run in record["runs"])
    assert len(record["runs"][0]["eval_curve"]["icl_score"]) == 2
    assert "3-gram" in (out / "summary.md").read_text() and "gap" in (out / "summary.md").read_text()
    assert (out / "induction.md").read_text().count("\n| 4 | ") == 2  # one row per seed
    for png in ("bpc_curves.png", "bpc_vs_heads.png", "head_types/h4_seed0.png", "head_types/h4_seed1.png",
                "induction_curves.png"):
        assert (out / png).read_bytes().startswith(PNG_MAGIC), png


def test_attention_maps_and_pruning_use_the_ablation_model(workdir):
    cwd, _ = workdir
    maps, stdout = run_in(cwd, attention_maps.main, [*ARGS, "--heads", "4"])
    assert "results/head_ablation/lm-tiny/checkpoints/h4_seed0.msgpack" in stdout
    assert maps["sentence"][0].isupper() and len(maps["sentence"]) == 16
    assert (cwd / "results/attention_maps/lm-tiny/h4_layer0.png").read_bytes().startswith(PNG_MAGIC)
    pruned, stdout = run_in(cwd, head_pruning.main, [*ARGS, "--heads", "4"])
    assert pruned["config"]["criterion"] == "loss" and pruned["total_heads"] == 4
    for order in ("importance", "oracle"):
        survivors = pruned["survivors"][order]
        assert len(survivors["heads"]) == 4 - pruned["heads_prunable"][order]
        assert survivors["bpc"] <= pruned["base_bpc"] * 1.01 + 1e-6
    assert "heads pruned before bpc rose > 1 %" in stdout
    # the LM's importance is compared with its own oracle, the stop rules are stated side by side,
    # and the causal induction check gates the top prefix-matching heads against the bottom ones.
    rho = pruned["spearman_importance_vs_oracle"]
    assert rho != rho or -1.0 <= rho <= 1.0  # NaN only when a ranking is constant
    assert set(pruned["stop_rules"]) == {"copy", "lm"} and "Spearman" in stdout
    arms = pruned["induction_check"]["arms"]
    assert len(arms["top"]["heads"]) == 2 and set(arms["top"]["heads"]).isdisjoint(arms["bottom"]["heads"])
    assert all(arms[a]["second_copy_loss"] > 0 for a in ("none", "top", "bottom"))
    artifact = json.loads((cwd / "results/head_pruning/lm-tiny/artifact.json").read_text())
    (row,) = artifact["seeds"]
    assert artifact["kind"] == "lm_pruning" and row["seed"] == 0 and row["unpruned_bpc"] == pruned["base_bpc"]
    assert row["induction"]["top"]["heads"] == [list(h) for h in arms["top"]["heads"]]


@pytest.mark.parametrize("preset", ["quick", "standard"])
def test_lm_preset_is_the_configuration_its_committed_data_was_measured_with(preset):
    """docs/results/data/lm_<preset>.json is what lm_heads.md reports: the preset must
    still produce it (same task and split, rates, characters per seed, and its seeds
    the first of the page's: the page may run more with `--seeds`)."""
    from experiments import common
    from jax_mha.lab.data import task_to_dict

    cfg = common.LM_PRESETS[preset]()
    data = json.loads((Path(__file__).parents[2] / "docs/results/data" / f"lm_{preset}.json").read_text("utf-8"))
    assert data["task"] == json.loads(json.dumps(task_to_dict(cfg.task))) and data["split"] == "test"
    assert {int(h): lr for h, lr in data["learning_rates"].items()} == {h: cfg.train_for(h).learning_rate
                                                                         for h in cfg.heads}
    for h in cfg.heads:
        record = data["heads"][str(h)]
        assert record["seeds"][:len(cfg.seeds)] == list(cfg.seeds) and record["head_dim"] == cfg.model.d_model // h
        assert record["characters_per_seed"] == cfg.train.num_steps * cfg.train.batch_size * cfg.task.seq_len
