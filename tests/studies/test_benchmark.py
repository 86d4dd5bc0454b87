"""Tests for `experiments/benchmark.py`: the verdicts it prints follow from its rows,
and the window and decode sections run end to end on tiny sizes."""

from __future__ import annotations

import dataclasses

import pytest

from experiments import benchmark

SHAPE = (2, 512, 64, 4)
META = {"cpu": "test CPU", "cpu_count": 2, "jax": "0", "flax": "0"}


def _row(layer: str, mode: str, ms: float, frac: float, vs_flax: float) -> dict:
    b, n, d, h = SHAPE
    return {"B": b, "N": n, "d_model": d, "H": h, "layer": layer, "mode": mode, "ms": ms,
            "frac_roofline": frac, "vs_flax": vs_flax}


def _result(ours_ms: float, torch_ms: float, frac: float, vs_flax: float, window_speedup: float,
            decode_speedup: float, train: tuple[float, float]) -> dict:
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        rows += [_row("jax_mha (xla)", mode, ours_ms, frac, vs_flax), _row("torch SDPA", mode, torch_ms, 0.8, 0.5),
                 _row(benchmark.FLAX, mode, ours_ms / vs_flax, 0.3, 1.0)]
    n, w, _ = benchmark.WINDOW_TARGET
    length, _ = benchmark.DECODE_TARGET
    return {
        "rows": rows, "auto_path": {str(SHAPE): "xla"}, "metadata": META,
        "train_step_ms": {"jax_mha train step (jit, optax)": train[0], "torch train step (eager, AdamW)": train[1]},
        "window_rows": [{"N": n, "layer": "jax_mha (blockwise)", "window": [w, 0], "speedup_vs_full_causal": window_speedup}],
        "decode_rows": [{"L": length, "layer": "with cache (generate)", "speedup_vs_no_cache": decode_speedup}],
    }


def test_every_verdict_met_when_the_rows_meet_it():
    result = _result(ours_ms=11.0, torch_ms=10.0, frac=0.71, vs_flax=0.9, window_speedup=12.0, decode_speedup=6.0,
                     train=(9.0, 10.0))
    targets = benchmark.check_targets(result)
    assert len(targets["verdicts"]) == 6 and all(targets["verdicts"].values()), targets["verdicts"]
    assert targets["auto_vs_torch_sdpa_fwd_bwd"][str(SHAPE)] == pytest.approx(1.1)
    assert targets["train_speed_vs_torch"] == pytest.approx(10 / 9)


@pytest.mark.parametrize("miss", ["torch", "roofline", "flax", "window", "decode", "train"])
def test_each_verdict_missed_when_its_row_misses_it(miss):
    good = dict(ours_ms=11.0, torch_ms=10.0, frac=0.71, vs_flax=0.9, window_speedup=12.0, decode_speedup=6.0,
                train=(9.0, 10.0))
    bad = {"torch": {"torch_ms": 9.0}, "roofline": {"frac": 0.69}, "flax": {"vs_flax": 1.01},
           "window": {"window_speedup": 9.9}, "decode": {"decode_speedup": 4.9}, "train": {"train": (11.0, 10.0)}}[miss]
    result = _result(**{**good, **bad})
    result["targets"] = benchmark.check_targets(result)
    missed = [name for name, ok in result["targets"]["verdicts"].items() if not ok]
    assert len(missed) == 1, missed
    lines = benchmark.verdict_lines(result).splitlines()
    assert "test CPU, 2 cores" in lines[0]
    assert [line for line in lines if "MISSED" in line] == [f"  MISSED {missed[0]}"]


def test_window_and_decode_sections_run_and_report_speedups():
    cfg = dataclasses.replace(benchmark.QUICK, shapes=(), window_lengths=(64,), windows=(7,), decode_lengths=(5,),
                              window_repeats=1, min_sample_s=0.0)
    windows = benchmark.time_windows(cfg)
    by_case = {(r["layer"], None if r["window"] is None else tuple(r["window"])): r for r in windows}
    assert set(by_case) == {("jax_mha (blockwise)", None), ("jax_mha (blockwise)", (7, 0)),
                            ("jax.nn.dot_product_attention", (7, 0))}
    assert by_case[("jax_mha (blockwise)", None)]["speedup_vs_full_causal"] == 1.0
    assert all(r["ms"] > 0 for r in windows)
    decode = benchmark.time_decode(cfg)
    assert [(r["L"], r["layer"]) for r in decode] == [(5, "with cache (generate)"), (5, "no cache (re-run prefix)")]
    assert all(r["tokens_per_s"] > 0 for r in decode)
    assert "| jax_mha (blockwise) | 64 | (7, 0) |" in "\n".join(benchmark._window_table(windows))


def test_bad_config_values_raise():
    with pytest.raises(ValueError, match="decode_lengths"):
        benchmark.BenchConfig(decode_lengths=(1,))
    with pytest.raises(ValueError, match="window_repeats"):
        benchmark.BenchConfig(window_repeats=0)


@pytest.mark.parametrize("op_name, part", [
    ("jit(step)/jvp(Decoder)/block_1/ffn/hidden/dot_general", "feed-forward"),
    ("jit(step)/transpose(jvp(Decoder))/block_0/attention/value/dot_general", "attention projections"),
    ("jit(step)/jvp(Decoder)/block_0/attention/...hnd,...hsd->...hns/dot_general", "attention core"),
    ("jit(step)/jvp(Decoder)/block_0/norm1/reduce_sum", "LayerNorm"),
    ("jit(step)/jvp(Decoder)/final_norm/mul", "LayerNorm"),
    ("jit(step)/jvp(Decoder)/embed/jit(_take)/gather", "embedding"),
    ("jit(step)/jvp(Decoder)/logits/dot_general", "logits + loss"),
    ("jit(step)/jvp()/reduce_max", "logits + loss"),
    ("jit(step)/sqrt", "optimizer (clip + AdamW)"),
    ("jit(step)/jvp(Decoder)/block_0/add", "other"),
])
def test_profile_assigns_xla_ops_by_module_path(op_name, part):
    assert benchmark._jax_part(op_name) == part


@pytest.mark.parametrize("op, shapes, part", [
    ("aten::addmm", [[1024], [2176, 256], [256, 1024]], "feed-forward"),
    ("aten::mm", [[2176, 256], [256, 256]], "attention projections"),
    ("aten::addmm", [[14], [2176, 256], [256, 14]], "logits + loss"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", [], "attention core"),
    ("aten::native_layer_norm_backward", [], "LayerNorm"),
    ("aten::gelu_backward", [], "feed-forward"),
    ("aten::add", [], "other"),
])
def test_profile_assigns_torch_ops_by_name_and_shape(op, shapes, part):
    assert benchmark._torch_part(op, shapes, vocab=14, d_ff=1024) == part


def test_jax_step_profile_covers_the_step():
    """A real trace of the copy-task step: time in every model part, and almost all
    of it assigned to a named part."""
    steps = benchmark.train_steps(with_torch=False)
    parts = benchmark.profile_jax_step(steps, calls=1)  # every op of the step runs in each call
    assert set(parts) == set(benchmark.PROFILE_PARTS)
    for part in ("LayerNorm", "attention projections", "attention core", "feed-forward", benchmark.OPTIMIZER_PART):
        assert parts[part] > 0, parts
    assert parts["other"] < 0.1 * sum(parts.values()), parts
    table = "\n".join(benchmark._profile_table({"jax_mha (jit, optax)": parts}))
    assert "| attention core |" in table and "| sum of the parts |" in table


def test_torch_step_profile_covers_the_step():
    pytest.importorskip("torch", reason="the PyTorch rows need torch (pip install -e .[torch])")
    steps = benchmark.train_steps(with_torch=True)
    parts = benchmark.profile_torch_step(steps, calls=2)
    for part in ("LayerNorm", "attention projections", "attention core", "feed-forward", benchmark.OPTIMIZER_PART):
        assert parts[part] > 0, parts
