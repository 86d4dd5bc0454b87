"""The accelerator benchmark: the smoke preset runs here and writes a well-formed
result and figure; the FLOP count against a brute-force count of visible pairs; the
budget stops a run with what it has; a path that fails on the device is recorded and
the run goes on. The smoke grid is float32, so on a GPU cuDNN is recorded as refused
(never forced) and the Triton kernel runs.

The flex preset (composed attention): its smoke size runs every case here; the very
steps it timed (cached) match `implementation="xla"` with the same mods, values and
gradients; the mods, evaluated in NumPy, mean what the cases say (ALiBi, the soft cap,
T5's buckets, documents, the window, the prefix); the visible pairs against a
brute-force count; a refusal is recorded untimed; PyTorch's side (where torch is
installed) against the same reference, forward."""

import functools
import json
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import f32_tolerance, np_allowed

from experiments import common_flex
from experiments import device_benchmark as bench
from jax_mha import _dispatch, attention

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
@pytest.mark.parametrize("argv", [[], ["--preset", "full"], ["--preset", "flex"]])
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


# ----------------------------------------------------------------- the flex preset

FLEX = bench.FLEX_PRESETS["flex_smoke"]
N, D = FLEX.seq[0], FLEX.head_dim[0]
FLEX_TIMED = {"first_call_s", "times_ms", "ms", "ms_min", "ms_max", "tflops", "peak_pct"}


def test_flex_smoke_runs_every_case_and_writes_json_and_figure(tmp_path):
    out = tmp_path / "flex.json"
    result = bench.main(["--preset", "flex", "--smoke", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["kind"] == "device_benchmark_flex" and saved["preset"] == "flex_smoke" and not saved["stopped_early"]
    assert saved["device"] == str(jax.devices()[0].device_kind) and (tmp_path / "flex.png").stat().st_size > 10_000
    assert [(r["case"], r["impl"]) for r in saved["rows"]] == [
        (case, name) for case in common_flex.CASES for name in bench.flex_implementations(case)]
    assert [a["case"] for a in saved["auto"]] == list(common_flex.CASES)
    for row in saved["rows"]:
        assert row["visible_pairs"] == common_flex.visible_pairs(row["case"], N, FLEX)
        for name in ("forward", "forward_backward"):
            cell = row[name]
            if row["impl"] == "jax_mha:blockwise" or (result["platform"] != "cpu" and "ms" in cell):
                assert set(cell) == FLEX_TIMED and len(cell["times_ms"]) == FLEX.repeats, row
                assert 0 < cell["ms_min"] <= cell["ms"] <= cell["ms_max"] and cell["ms"] == np.median(cell["times_ms"])
                flops = common_flex.attention_flops(FLEX, row["case"], N, D, name == "forward_backward")
                assert cell["tflops"] == pytest.approx(flops / cell["ms"] / 1e9)
            elif result["platform"] == "cpu":  # kernels, cuDNN and torch are never run on a CPU
                assert set(cell) == {"skipped"} and cell["skipped"], row
            else:  # float32 on an accelerator: cuDNN skipped, a kernel's refusal named
                assert set(cell) <= {"skipped", "refused"}, row


@functools.cache
def _xla_reference(case: str):
    """(inputs, out, grads of q, k, v) of `implementation="xla"` with the case's own mods."""
    arrays = bench.flex_arrays(FLEX, N, D)

    def f(q, k, v, params):
        c = common_flex.compose(case, params, N, FLEX, common_flex.JAX_OPS)
        return attention(q, k, v, implementation="xla", **common_flex.jax_kwargs(c))

    loss = lambda *args: jnp.sum(f(*args).astype(jnp.float32))
    out, grads = jax.jit(lambda *args: (f(*args), jax.grad(loss, argnums=(0, 1, 2))(*args)))(*arrays["bhnd"],
                                                                                            arrays["params"])
    return arrays, out, grads


@pytest.mark.parametrize("case", common_flex.CASES)
def test_flex_steps_match_xla_with_the_same_mods(case):
    """The steps the benchmark times (cached: compiled once, by the smoke run when it
    ran first) against the dense path; sums of D terms in the logits, N in the rest."""
    arrays, out, grads = _xla_reference(case)
    args = (*arrays["bhnd"], arrays["params"])
    got = bench.flex_jax_step("jax_mha:blockwise", case, FLEX, N, False)(*args)
    tol = f32_tolerance(terms=D + N, magnitude=out)
    np.testing.assert_allclose(got, out, rtol=0, atol=tol)
    for g, ref in zip(bench.flex_jax_step("jax_mha:blockwise", case, FLEX, N, True)(*args), grads):
        np.testing.assert_allclose(g, ref, rtol=0, atol=f32_tolerance(terms=D + 2 * N, magnitude=ref))


def _t5_bucket(rel: int) -> int:
    """T5's `_relative_position_bucket(rel, bidirectional=False, num_buckets=32, max_distance=128)`, one int."""
    n = max(-rel, 0)
    return n if n < 16 else min(16 + int(math.log(n / 16) / math.log(128 / 16) * 16), 31)


def test_flex_mods_mean_what_the_cases_say():
    """`full_score` and `full_mask` (what FlexAttention reads) in NumPy, on every pair,
    against each case written out apart; the visible pairs are the mask's."""
    b, h, n = FLEX.batch, FLEX.heads, 61  # 61: documents of unequal length (8 of 8, the last 5)
    params = common_flex.case_params(FLEX, n)
    idx = dict(b=np.arange(b).reshape(b, 1, 1, 1), h=np.arange(h).reshape(1, h, 1, 1),
               q=np.arange(n).reshape(1, 1, n, 1), kv=np.arange(n).reshape(1, 1, 1, n))
    s = np.random.default_rng(1).normal(size=(b, h, n, n)) * 40
    rel = idx["kv"] - idx["q"]
    causal = np_allowed((b, h, n, n), is_causal=True)
    expect_score = {"alibi": s + params["slopes"][idx["h"]] * rel, "softcap": 30 * np.tanh(s / 30),
                    "relative": s + params["table"][idx["h"], np.vectorize(_t5_bucket)(rel)]}
    expect_mask = {"documents": np_allowed((b, h, n, n), is_causal=True, q_segment_ids=params["ids"]),
                   "window": np_allowed((b, h, n, n), window=(FLEX.window, FLEX.window)),
                   "prefix_lm": np.broadcast_to(np.where(idx["q"] < n // 4, idx["kv"] < n // 4, rel <= 0), s.shape)}
    assert np.array_equal(np.bincount(params["ids"][0]), [8] * 7 + [5])
    for case in common_flex.CASES:
        c = common_flex.compose(case, params, n, FLEX, common_flex.NUMPY_OPS)
        score, mask = common_flex.full_score(c, common_flex.NUMPY_OPS), common_flex.full_mask(c)
        got = s if score is None else score(s, idx["b"], idx["h"], idx["q"], idx["kv"])
        np.testing.assert_allclose(got, expect_score.get(case, s), rtol=1e-6, atol=1e-5, err_msg=case)  # float32 products
        allowed = np.broadcast_to(mask(idx["b"], idx["h"], idx["q"], idx["kv"]), s.shape)
        assert np.array_equal(allowed, expect_mask.get(case, causal)), case
        assert common_flex.visible_pairs(case, n, FLEX) == allowed[0, 0].sum(), case
        assert (c.sinks is not None) == (case == "sinks") and c.is_causal == (case not in ("window", "prefix_lm"))


@pytest.mark.parametrize("n", [4096, 64, 100])
def test_flex_visible_pairs_against_a_brute_force_count(n):
    """The closed forms against the pattern of who may attend, counted pair by pair
    (`np_allowed`, the prefix written out), at the preset's own size too."""
    grid = common_flex.FlexGrid() if n == 4096 else FLEX
    ids = common_flex.document_ids(1, n, grid.docs)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    brute = dict(causal=np_allowed((1, 1, n, n), is_causal=True).sum(),
                 documents=np_allowed((1, 1, n, n), is_causal=True, q_segment_ids=ids).sum(),
                 window=np_allowed((1, 1, n, n), window=(grid.window, grid.window)).sum(),
                 prefix_lm=np.sum(np.where(i < n // 4, j < n // 4, j <= i)))
    for case in common_flex.CASES:
        assert common_flex.visible_pairs(case, n, grid) == brute.get(case, brute["causal"]), case
    assert common_flex.attention_flops(grid, "window", n, 64, True) == (
        3.5 * 4 * grid.batch * grid.heads * brute["window"] * 64)


def test_an_unknown_flex_case_is_named():
    with pytest.raises(ValueError, match="unknown case 'bogus'"):
        common_flex.compose("bogus", common_flex.case_params(FLEX, N), N, FLEX, common_flex.NUMPY_OPS)
    with pytest.raises(ValueError, match="unknown case 'bogus'"):
        common_flex.visible_pairs("bogus", N, FLEX)


def test_flex_refusals_are_recorded_untimed(monkeypatch):
    """This CPU described as a GPU: each jax_mha path's own refusal is the reason (the
    Triton kernel takes plain causal attention today), jax.nn's cuDNN call runs, and
    torch says why it cannot."""
    monkeypatch.setattr(_dispatch, "platform", lambda: "gpu")
    arrays = bench.flex_arrays(FLEX, N, D)
    for case in common_flex.CASES:
        c = common_flex.compose(case, arrays["params"], N, FLEX, common_flex.JAX_OPS)
        untimed = bench.flex_untimed("jax_mha:pallas_gpu", c, arrays, "bfloat16", "gpu")
        if case == "causal":  # a kernel that takes a mod one day is timed; one that refuses it says why
            assert untimed is None
        else:
            assert untimed is None or (set(untimed) == {"refused"} and "pallas_gpu" in untimed["refused"]), untimed
        assert bench.flex_untimed("jax_mha:blockwise", c, arrays, "bfloat16", "gpu") is None
    assert bench.flex_untimed("jax.nn:cudnn", c, arrays, "bfloat16", "gpu") is None
    assert "float16" in bench.flex_untimed("jax.nn:cudnn", c, arrays, "float32", "gpu")["skipped"]
    assert "interpret" in bench.flex_untimed("jax_mha:pallas_gpu", c, arrays, "bfloat16", "cpu")["skipped"]
    why = common_flex.torch_missing()
    assert bench.flex_untimed("torch:flex", c, arrays, "bfloat16", "gpu") == (None if why is None else dict(skipped=why))


def test_flex_budget_stops_with_every_case_recorded(tmp_path):
    result = bench.main(["--preset", "flex", "--smoke", "--budget", "0", "--out", str(tmp_path / "f.json")])
    assert result["stopped_early"] and not result["auto"]
    assert len(result["rows"]) == sum(len(bench.flex_implementations(c)) for c in common_flex.CASES)
    assert all("budget" in row[p]["skipped"] for row in result["rows"] for p in ("forward", "forward_backward"))


def test_round_robin_interleaves_and_records_a_failure():
    calls = []

    def fails_later():
        calls.append("b")
        if calls.count("b") > 2:
            raise RuntimeError("out of memory\nmore")

    cells = common_flex.round_robin({"a": lambda: calls.append("a"), "b": fails_later}, repeats=3)
    assert calls == ["a", "b"] + ["a", "b"] * 2 + ["a"]  # compiling calls, then rounds in turn; b fails in round 2
    assert cells["b"] == {"error": "RuntimeError: out of memory"} and len(cells["a"]["times_ms"]) == 3
    threads = {}
    cells = common_flex.round_robin({"c": lambda: threads.setdefault("c", threading.get_ident()),
                                     "d": lambda: threads.setdefault("d", threading.get_ident())}, repeats=2,
                                    concurrent=frozenset({"c"}))  # c compiles in a thread, d here
    assert list(cells) == ["c", "d"] and threads["d"] == threading.get_ident() != threads["c"]
    assert all(len(cell["times_ms"]) == 2 for cell in cells.values())


@pytest.mark.skipif(common_flex.torch_missing(need_cuda=False) is not None, reason="torch is not installed")
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on purpose: a CPU
@pytest.mark.parametrize("case", common_flex.CASES)
def test_flex_torch_side_matches_xla(case):
    """PyTorch's score and mask functions, block mask and sink merge, by eager
    FlexAttention on the CPU (forward only: it has no CPU backward), against the same
    reference."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    arrays, out, _ = _xla_reference(case)
    q, k, v = (torch.tensor(np.asarray(x)) for x in arrays["bhnd"])
    c = common_flex.compose(case, {key: torch.as_tensor(x) for key, x in arrays["np"].items()}, N, FLEX,
                            common_flex.torch_ops())
    got = common_flex.torch_attention(q, k, v, c, common_flex.torch_block_mask(c, FLEX.batch, N, "cpu"),
                                      flex_attention)
    np.testing.assert_allclose(got.numpy(), out, rtol=0, atol=f32_tolerance(terms=D + N, magnitude=out))


def test_each_timed_step_gets_its_own_layout(monkeypatch):
    """In the causal case jax.nn's cuDNN reference takes `(B, N, H, D)` and jax_mha's
    paths `(B, H, N, D)`: each timed step must be called with its own arrays (a closure
    over the loop's last ones once timed jax_mha on the transposed inputs, N and H
    swapped). Every implementation is let through as if on a GPU and recorded."""
    seen = {}

    def fake_step(name, case, grid, n, backward):
        return lambda q, k, v, params: seen.setdefault((name, backward), q.shape)

    monkeypatch.setattr(bench, "flex_jax_step", fake_step)
    monkeypatch.setattr(bench, "flex_untimed", lambda name, *a: dict(skipped="torch") if name == "torch:flex" else None)
    monkeypatch.setattr(jax, "block_until_ready", lambda x: x)
    grid = common_flex.FlexGrid(batch=2, heads=3, seq=(8,), head_dim=(4,), dtype="float32", repeats=1, budget=None)
    arrays = bench.flex_arrays(grid, 8, 4)
    bench.flex_case("causal", grid, 8, 4, arrays, "gpu", None)
    want = {"jax_mha:pallas_gpu": (2, 3, 8, 4), "jax_mha:blockwise": (2, 3, 8, 4), "jax.nn:cudnn": (2, 8, 3, 4)}
    assert seen == {(name, backward): shape for name, shape in want.items() for backward in (False, True)}


def test_flex_grid_narrowed_from_the_command_line(tmp_path, capsys):
    """`--seq`, `--head-dim` and `--cases` run that part of the flex grid only; they
    name the flex preset, and anything else is an argparse error (exit 2)."""
    out = tmp_path / "part.json"
    bench.main(["--preset", "flex", "--smoke", "--seq", "24", "--head-dim", "8", "--cases", "causal", "window",
                "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert {(r["case"], r["seq"], r["head_dim"]) for r in rows} == {("causal", 24, 8), ("window", 24, 8)}
    for argv, message in ((["--smoke", "--seq", "64"], "--seq narrows the flex preset only"),
                          (["--preset", "flex", "--smoke", "--head-dim", "-3"], "expected a positive integer, got -3"),
                          (["--preset", "flex", "--smoke", "--cases", "alibi", "nope"], "invalid choice: 'nope'")):
        with pytest.raises(SystemExit) as exit_info:
            bench.main(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_engine_block_sweep_smoke_writes_every_pair_and_renders(tmp_path):
    """`experiments.engine_blocks --smoke`: each pair of both masks timed (or its error
    recorded), the platform's defaults named, and the report's table drawn from it."""
    from experiments import common_device, engine_blocks

    out = tmp_path / "blocks.json"
    engine_blocks.main(["--smoke", "--repeats", "2", "--out", str(out)])
    data = json.loads(out.read_text())
    assert [(r["causal"], r["q_block"], r["k_block"]) for r in data["rows"]] == [
        (c, b, b) for c in (True, False) for b in (64, 128)]
    assert all(r["ms_min"] <= r["ms"] <= r["ms_max"] and r["first_call_s"] > 0 for r in data["rows"])
    assert data["defaults"] == {"causal": [512, 512], "unmasked": [2048, 256]}
    assert "| causal | 64 | 64 |" in common_device.render(data, "table")
