"""The accelerator benchmark: the smoke preset runs here and writes a well-formed
result and figure; the FLOP count against a brute-force count of visible pairs; the
budget stops a run with what it has; a path that fails on the device is recorded and
the run goes on. The smoke grid is float32, so on a GPU cuDNN is recorded as refused
(never forced) and the Triton kernel runs."""

import json

import jax
import numpy as np
import pytest
from conftest import np_allowed

from experiments import device_benchmark as bench
from jax_mha import _dispatch

TIMED = ("ms", "first_call_s", "tflops", "peak_pct")


def test_smoke_runs_and_writes_json_and_figure(tmp_path, capsys):
    out = tmp_path / "bench.json"
    result = bench.main(["--smoke", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["device"] == str(jax.devices()[0].device_kind) and saved["preset"] == "smoke"
    assert not saved["stopped_early"] and (tmp_path / "bench.png").stat().st_size > 10_000
    platform = result["platform"]
    names = bench.implementations(platform, "float32")
    assert [(r["impl"], r["mask"]) for r in saved["rows"]] == [(n, m) for m in ("causal", "packed") for n in names]
    for row in saved["rows"]:
        for name in ("forward", "forward_backward"):
            cell = row[name]
            assert "error" not in cell, row
            if row["impl"] in ("jax_mha:cudnn", "jax.nn:cudnn"):  # float32: cuDNN is never forced
                assert "float16" in cell.get("refused", cell.get("skipped", "")), row
            else:
                assert set(cell) == set(TIMED) and cell["ms"] > 0 and cell["tflops"] > 0, row
    assert {a["chosen"] for a in saved["auto"]} <= set(_dispatch.PATHS)
    assert "wrote" in capsys.readouterr().out


def test_flops_count_visible_pairs_only():
    """Against the pairs np_allowed marks visible (causal; causal and same document)."""
    for n in (64, 8 * 13):
        ids = bench.segment_ids(1, n)
        assert np.array_equal(np.bincount(ids[0]), [n // 8] * 8)
        assert bench.visible_pairs(n, "causal") == np_allowed((1, 1, n, n), is_causal=True).sum()
        packed = np_allowed((1, 1, n, n), is_causal=True, q_segment_ids=ids).sum()
        assert bench.visible_pairs(n, "packed") == packed
    assert bench.attention_flops(2, 3, 64, 16, "causal", False) == 4 * 2 * 3 * 64 * 65 // 2 * 16
    assert bench.attention_flops(2, 3, 64, 16, "packed", True) == 3.5 * bench.attention_flops(2, 3, 64, 16, "packed",
                                                                                              False)


@pytest.mark.parametrize("kind, peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                        ("TPU v5 lite", 197.0), ("cpu", None), ("NVIDIA GeForce RTX 4090", None)])
def test_peak_by_device_kind(kind, peak):
    assert bench.peak_tflops(kind) == peak


def test_paths_per_platform_never_time_interpret_mode():
    assert bench.paths_for("cpu") == ["xla", "blockwise"] and bench.paths_for("cpu", "bfloat16") == ["blockwise"]
    assert bench.paths_for("gpu", "bfloat16") == ["blockwise", "cudnn", "pallas_gpu", "pallas_mgpu"]
    assert bench.paths_for("tpu") == ["xla", "blockwise", "pallas_tpu"]
    assert "jax.nn:cudnn" in bench.implementations("gpu", "bfloat16")
    assert "jax.nn:cudnn" not in bench.implementations("tpu", "bfloat16")


def test_budget_stops_with_what_it_has(tmp_path):
    result = bench.main(["--smoke", "--budget", "0", "--out", str(tmp_path / "b.json")])
    assert result["stopped_early"] and result["rows"]
    assert all("budget" in row[name]["skipped"] for row in result["rows"] for name in ("forward", "forward_backward"))
    assert json.loads((tmp_path / "b.json").read_text())["stopped_early"]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="on a GPU the kernels would compile")
def test_a_failing_path_is_recorded_and_the_run_goes_on(monkeypatch):
    """This CPU described as a GPU: the kernels fail to compile (no CUDA), each failure
    is recorded, and the pure-JAX paths are still timed; "auto" names cuDNN in bfloat16."""
    monkeypatch.setattr(_dispatch, "platform", lambda: "gpu")
    grid = bench.Grid(seq=(64,), head_dim=(64,), batch=(1,), heads=(2,), masks=("causal",), repeats=1, budget=None)
    result = bench.run(grid, None)
    cells = {row["impl"]: row["forward"] for row in result["rows"]}
    assert set(cells) == {"jax_mha:blockwise", "jax_mha:cudnn", "jax_mha:pallas_gpu", "jax_mha:pallas_mgpu",
                          "jax.nn:cudnn", "jax.nn:xla"}
    assert "error" in cells["jax_mha:cudnn"] and "error" in cells["jax.nn:cudnn"], cells
    assert "float16" in cells["jax_mha:pallas_mgpu"]["refused"], cells  # bfloat16: the Hopper kernel says why
    assert cells["jax_mha:blockwise"]["ms"] > 0 and cells["jax.nn:xla"]["ms"] > 0
    assert result["auto"][0]["chosen"] == "cudnn" and result["peak_bf16_tflops"] is None


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="on an accelerator the presets run")
@pytest.mark.parametrize("argv", [[], ["--preset", "full"]])
def test_presets_refused_on_cpu(argv):
    with pytest.raises(SystemExit):
        bench.main(argv)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="on a GPU the sweep runs")
@pytest.mark.parametrize("argv, message", [([], "compiles for a GPU; this backend is cpu"),
                                           (["--repeats", "0"], "--repeats must be >= 1, got 0")])
def test_backward_block_sweep_refuses_a_cpu_and_bad_repeats(capsys, argv, message):
    from experiments import pallas_gpu_blocks

    with pytest.raises(SystemExit) as exit_info:
        pallas_gpu_blocks.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
