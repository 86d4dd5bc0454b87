"""End-to-end runs of the analysis studies on tiny configurations, each into its own
temporary folder through its `main(argv)`: valid JSON, readable PNGs, the numbers the
JSON promises, and the first line that names the analysed model and why.
(tests/studies/test_experiments.py runs them on the checkpoints of a real ablation run.)"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from experiments import attention_maps, common, head_pruning, head_timing, param_count
from jax_mha.lab.checkpoint import load_checkpoint, save_checkpoint
from jax_mha.lab.data import task_to_dict
from jax_mha.lab.models import CopyTransformer

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
def random_checkpoint(tmp_path_factory):
    """A random-init model of the tiny preset, saved as the ablation would save it."""
    spec = common.PRESETS["tiny"]()
    model_cfg = spec.model_for(4)
    params = jax.jit(CopyTransformer(model_cfg).init)(jax.random.PRNGKey(0), jnp.zeros((1, spec.task.seq_len), jnp.int32))
    path = tmp_path_factory.mktemp("ckpt") / "h4_seed0.msgpack"
    save_checkpoint(path, params["params"], model_cfg, {"task": task_to_dict(spec.task), "heads": 4, "seed": 0})
    return path


@pytest.mark.parametrize("module", [head_pruning, attention_maps, param_count, head_timing])
def test_help_explains_options(module, capsys):
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--out" in text and "output folder" in text


def test_pruning_skips_a_checkpoint_of_another_model_and_trains(tmp_path, monkeypatch, capsys):
    """A checkpoint at the preset's path whose config is not the preset's is not
    analysed silently: a line says so, and the preset's model is trained instead."""
    monkeypatch.chdir(tmp_path)
    spec = common.PRESETS["tiny"]()
    other = dataclasses.replace(spec.model_for(4), d_model=12)
    params = jax.jit(CopyTransformer(other).init)(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
    stale = Path("results/head_ablation/tiny/checkpoints/h4_seed0.msgpack")
    save_checkpoint(stale, params, other, {"task": task_to_dict(spec.task)})
    results = head_pruning.main(["--preset", "tiny", "--train-steps", "25", "--no-progress"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"skipping {stale}: it is a 1 layer x 4 heads, d_model=12")
    assert lines[1].startswith("model: training the --preset tiny model with 4 heads, seed 0")
    assert results["source"]["kind"] == "trained" and results["source"]["steps_run"] == 25
    _, config, metadata = load_checkpoint("results/head_pruning/tiny/checkpoints/h4_seed0.msgpack")
    assert config == spec.model_for(4) and metadata["heads"] == 4
    assert results["chance_accuracy"] == pytest.approx((3 / 5 + 1) / 4)


def test_head_pruning_from_given_checkpoint(tmp_path, random_checkpoint, capsys):
    out = tmp_path / "pruning_ckpt"
    results = head_pruning.main(["--preset", "tiny", "--checkpoint", str(random_checkpoint), "--out", str(out),
                                 "--no-progress", "--max-drop", "0.5", "--heads-per-step", "2"])
    assert capsys.readouterr().out.startswith(f"model: {random_checkpoint}, given by --checkpoint")
    on_disk = read_outputs(out, ["pruning_curves.png", "importance_heatmap.png"])
    assert on_disk["source"]["path"] == str(random_checkpoint) == results["source"]["path"]
    assert [s["num_pruned"] for s in on_disk["pruning"]["importance"]["steps"]] == [0, 2, 4]
    assert not (out / "checkpoints").exists()


def test_attention_maps_untrained(tmp_path, capsys):
    out = tmp_path / "maps"
    results = attention_maps.main(["--preset", "tiny", "--untrained", "--seed", "4", "--out", str(out),
                                   "--stats-size", "23", "--example", "3"])
    assert capsys.readouterr().out.startswith("model: untrained, the --preset tiny model with 4 heads initialised from seed 4")
    on_disk = read_outputs(out, ["layer0.png", "offset_profile.png"])
    assert on_disk["source"]["kind"] == "untrained" and len(results["example_tokens"]) == 8


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
