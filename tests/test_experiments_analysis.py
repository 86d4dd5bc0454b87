"""End-to-end runs of the analysis experiments on tiny configurations, each into its
own temporary folder through its `main(argv)`: valid JSON, readable PNGs, and the
numbers the JSON promises."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import attention_maps, head_pruning, head_timing, param_count
from jax_mha.checkpoint import load_checkpoint, save_checkpoint
from jax_mha.models import CopyTransformer

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def read_outputs(out, pngs):
    """The parsed results.json; asserts every named PNG exists and decodes."""
    import matplotlib.image

    results = json.loads((out / "results.json").read_text())
    for name in pngs:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE), name
        image = matplotlib.image.imread(out / name)
        assert image.ndim == 3 and min(image.shape[:2]) > 100, (name, image.shape)
    return results


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A random-init model of the tiny preset, saved as the ablation would save it."""
    cfg = head_pruning.tiny()
    params = jax.jit(CopyTransformer(cfg.model).init)(jax.random.PRNGKey(0), jnp.zeros((1, cfg.task.seq_len), jnp.int32))["params"]
    path = tmp_path_factory.mktemp("ckpt") / "h3_seed0.msgpack"
    save_checkpoint(path, params, cfg.model, {"task": dataclasses.asdict(cfg.task), "heads": 3, "seed": 0})
    return path


@pytest.mark.parametrize("module", [head_pruning, attention_maps, param_count, head_timing])
def test_help_explains_options(module, capsys):
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--out" in text and "output folder" in text


def test_head_pruning_trains_when_no_checkpoint(tmp_path):
    out = tmp_path / "pruning"
    head_pruning.main(["--preset", "tiny", "--out", str(out), "--no-progress"])
    results = read_outputs(out, ["pruning_curves.png", "importance_heatmap.png"])
    assert results["source"]["kind"] == "trained"
    params, config, metadata = load_checkpoint(out / "checkpoints" / "h3_seed0.msgpack")
    assert config.num_heads == 3 and metadata["heads"] == 3
    total = results["total_heads"]
    assert total == 6 and np.asarray(results["importance"]).shape == (2, 3)
    for order in ("importance", "oracle"):
        record = results["pruning"][order]
        pruned = [s["num_pruned"] for s in record["steps"]]
        assert pruned == list(range(total + 1))  # run to the end, one head per step
        k = results["heads_prunable"][order]
        assert k == record["heads_prunable"] and 0 <= k <= total
        # Within the 1-point rule up to k heads, out of it at the step after (if any).
        assert all(s["accuracy"] >= record["base_accuracy"] - 0.01 for s in record["steps"][: k + 1])
        if k < total:
            assert record["steps"][k + 1]["accuracy"] < record["base_accuracy"] - 0.01
    assert 0.0 <= results["all_heads_off_accuracy"] <= 1.0
    assert results["chance_accuracy"] == pytest.approx((5 / 7 + 1) / 6)


def test_head_pruning_from_checkpoint(tmp_path, tiny_checkpoint):
    out = tmp_path / "pruning_ckpt"
    results = head_pruning.main(["--preset", "tiny", "--checkpoint", str(tiny_checkpoint), "--out", str(out),
                                 "--no-progress", "--max-drop", "0.5", "--heads-per-step", "2"])
    on_disk = read_outputs(out, ["pruning_curves.png", "importance_heatmap.png"])
    assert on_disk["source"] == {"kind": "checkpoint", "path": str(tiny_checkpoint), "metadata": results["source"]["metadata"]}
    assert [s["num_pruned"] for s in on_disk["pruning"]["importance"]["steps"]] == [0, 2, 4, 6]
    assert not (out / "checkpoints").exists()


def test_head_pruning_bad_checkpoint_names_the_file(tmp_path):
    bad = tmp_path / "broken.msgpack"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="broken.msgpack"):
        head_pruning.main(["--preset", "tiny", "--checkpoint", str(bad), "--out", str(tmp_path / "o"), "--no-progress"])


def test_attention_maps(tmp_path, tiny_checkpoint):
    out = tmp_path / "maps"
    attention_maps.main(["--preset", "tiny", "--checkpoint", str(tiny_checkpoint), "--out", str(out),
                         "--stats-size", "23", "--example", "3", "--no-progress"])
    results = read_outputs(out, ["layer0.png", "layer1.png", "offset_profile.png"])
    at_l = np.asarray(results["weight_at_offset_L"])
    assert at_l.shape == (2, 3) and np.all((0 <= at_l) & (at_l <= 1))
    r = results["retrieval_head"]
    assert at_l[r["layer"], r["head"]] == pytest.approx(at_l.max())
    assert len(results["example_tokens"]) == 12


def test_param_count(tmp_path):
    out = tmp_path / "params"
    param_count.main(["--d-model", "30", "--heads", "1", "2", "3", "5", "--block-heads", "3", "--d-ff", "44",
                      "--out", str(out)])
    results = read_outputs(out, ["params.png"])
    for row in results["attention"]:
        assert row["total"] == 4 * 30**2 + (4 * 30 if row["bias"] else 0)
        assert row["d_k"] == 30 // row["heads"]
        assert row["W_Q_shape"] == [30, 30]
    assert results["same_count_for_every_h"] == {"False": True, "True": True}
    block = results["block"]
    assert block["parts"]["attention"] == 4 * 30**2 + 30  # biased W_O only
    assert block["parts"]["feed-forward"] == 2 * 30 * 44 + 44 + 30
    assert sum(block["fractions"].values()) == pytest.approx(1.0)
    assert (out / "table.md").read_text().count("\n| ") >= 8


def test_head_timing(tmp_path):
    out = tmp_path / "timing"
    head_timing.main(["--seq", "7", "--heads", "1", "3", "--d-model", "15", "--batch", "2", "--repeats", "1",
                      "--out", str(out), "--no-progress"])
    results = read_outputs(out, ["timing.png"])
    rows = results["rows"]
    assert {(r["impl"], r["heads"]) for r in rows} == {("jax_mha", 1), ("jax_mha", 3), ("flax", 1), ("flax", 3)}
    for r in rows:
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0
        assert r["gflops_fwd"] == pytest.approx((8 * 2 * 7 * 15**2 + 4 * 2 * 7**2 * 15) / 1e9)
        assert r["gflops_fwd_bwd"] == pytest.approx(3 * r["gflops_fwd"])


def test_head_timing_rejects_indivisible_heads(tmp_path):
    with pytest.raises(SystemExit, match="d_model=15 is not divisible by num_heads=4"):
        head_timing.main(["--heads", "4", "--d-model", "15", "--out", str(tmp_path)])
