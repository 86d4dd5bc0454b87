"""The library's kernel (`jax_mha.paths.flex`) in its Mosaic form: exported for a TPU
from this CPU (`jax.export(..., platforms=["tpu"])` runs Pallas' Mosaic lowering; this
CPU's jaxlib lacks libtpu's layout passes, so a module here is necessary, not
sufficient, for a TPU to compile it), forward and backward, for every composed part;
and its numbers in TPU interpret mode (`pltpu.InterpretParams`: SMEM, VMEM and the
copies between them emulated) against conftest's float64 reference, at the smallest
sizes that cross block edges on both axes with ragged tails (2 query blocks of 32, 3
key blocks of 128). A gather at a computed index has no TPU form: refused by name."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import f32_tolerance, jax_reference, np_allowed, x64

from jax_mha import _masking
from jax_mha.paths import flex, pallas_tpu

B, H, K, D = 2, 4, 2, 16  # GQA: two query heads per kv head
N, S = 37, 263  # 2 query blocks of 32, 3 key blocks of 128, both ragged
OFFSET = S - N


def _case(name, values):
    """`(Visibility keywords, jax_reference keywords)` of one case; `values` the floating
    arrays a case closes over (slopes, bias, sinks), by name."""
    rows, cols = np.arange(N)[:, None] + OFFSET, np.arange(S)[None, :]
    ids = np.sort(np.random.default_rng(5).integers(0, 3, (B, S)), axis=-1).astype(np.int32)
    docs = jnp.asarray(ids)
    causal = np_allowed((B, H, N, S), is_causal=True)
    kv_len = np.array([150, S], np.int32)
    same = ids[:, None, OFFSET:, None] == ids[:, None, None, :]
    return {
        "causal": (dict(is_causal=True), dict(allowed=causal)),
        "window": (dict(window=_masking.Window(40, 7)), dict(allowed=np_allowed((B, H, N, S), window=(40, 7)))),
        "kv_lengths": (dict(kv_lengths=jnp.asarray(kv_len).reshape(B, 1, 1, 1)),
                       dict(allowed=np_allowed((B, H, N, S), kv_lengths=kv_len))),
        "segments": (dict(zip(("q_segment_ids", "kv_segment_ids"), _masking.segments_at_rank(ids[:, OFFSET:], ids, 1))),
                     dict(allowed=same)),
        "bias": (dict(bias=values["bias"]), dict(bias=values["bias"])),
        "soft_cap": (dict(is_causal=True, logits_soft_cap=1.5), dict(allowed=causal, cap=1.5)),
        "alibi": (dict(is_causal=True, score_mod=lambda s, b, h, i, j: s + values["slopes"][h] * (j - i - OFFSET)),
                  dict(allowed=causal, bias=values["slopes"][None, :, None, None] * jnp.asarray(cols - rows, jnp.float32)[None, None])),
        "documents": (dict(mask_mod=lambda b, h, i, j: docs[b, i + OFFSET] == docs[b, j]), dict(allowed=same)),
    }[name]


CASES = ("causal", "window", "kv_lengths", "segments", "bias", "soft_cap", "alibi", "documents")


def _values(rng):
    return {"slopes": jnp.asarray(rng.uniform(0.05, 0.5, H), jnp.float32),
            "bias": jnp.asarray(rng.standard_normal((B, H, N, S)), jnp.float32),
            "sinks": jnp.asarray(rng.standard_normal(H), jnp.float32)}


def _ours(case, interpret, q_block=None, sinks=False):
    """`f(q, k, v, values) -> (out, lse)`: the kernel under `case`'s description,
    sinks merged after it as `pallas_tpu` does."""
    from jax_mha._softmax import close

    def f(q, k, v, values):
        vis_kw, _ = _case(case, values)
        vis = _masking.Visibility(N, S, batch_shape=(B,), num_heads=H, sinks=values["sinks"] if sinks else None,
                                  **{"is_causal": False, **vis_kw})
        bq, bk = flex.tpu_blocks(N) if q_block is None else (q_block, flex.TPU_BLOCK)
        out, lse, _ = flex.attend(q, k, v, jnp.zeros((B, K, S), bool), vis, scale=D ** -0.5, q_block=bq, k_block=bk,
                                  interpret=interpret, backend="mosaic")
        return close(out, lse, vis)
    return f


def _inputs(rng, dtype=jnp.float32):
    return tuple(jnp.asarray(rng.standard_normal(shape), dtype) for shape in ((B, H, N, D), (B, K, S, D), (B, K, S, D)))


def _loss(f, w):
    """A loss whose gradient reaches every input through out and lse."""
    def loss(q, k, v, values):
        out, lse = f(q, k, v, values)
        return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w[..., 0])
    return loss


@pytest.mark.parametrize("case", CASES + ("sinks",))
def test_forward_and_backward_export_for_a_tpu(case):
    """Three Mosaic kernels (forward, dq, dk/dv) in the exported gradient, none in the forward alone but one."""
    rng = np.random.default_rng(0)
    q, k, v = _inputs(rng, jnp.bfloat16)
    values = _values(rng)
    f = _ours("causal" if case == "sinks" else case, interpret=False, sinks=case == "sinks")
    forward = jax.export.export(jax.jit(f), platforms=["tpu"])(q, k, v, values).mlir_module()
    assert forward.count("custom_call @tpu_custom_call") == 1
    w = jnp.ones((B, H, N, D), jnp.float32)
    grad = jax.jit(jax.grad(_loss(f, w), argnums=(0, 1, 2, 3)))
    text = jax.export.export(grad, platforms=["tpu"])(q, k, v, values).mlir_module()
    assert text.count("custom_call @tpu_custom_call") == 3, case


def test_a_table_at_a_computed_index_is_refused_on_a_tpu_by_name():
    """`table[h, bucket(kv - q)]` is a gather: compiled for a TPU the kernel raises and
    the path refuses it by name; off a TPU it runs in interpret mode (test_flex)."""
    table = jnp.ones((H, 32), jnp.float32)
    mod = lambda s, b, h, i, j: s + table[h, jnp.clip(j - i, 0, 31)]
    vis = _masking.Visibility(N, S, score_mod=mod, batch_shape=(B,), num_heads=H)
    q, k, v = _inputs(np.random.default_rng(1))
    with pytest.raises(ValueError, match="a table indexed by a computed index"):
        flex.attend(q, k, v, jnp.zeros((B, K, S), bool), vis, scale=0.25, q_block=32, k_block=128, interpret=False,
                    backend="mosaic")
    why = pallas_tpu.refusal(vis, _masking.Call(q, k, v, platform="tpu"))
    assert why.startswith("implementation='pallas_tpu' cannot take a table indexed by a computed index"), why
    assert pallas_tpu.refusal(vis, _masking.Call(q, k, v, platform="cpu")) is None
    alibi = _masking.Visibility(N, S, score_mod=lambda s, b, h, i, j: s + table[h, 0] * (j - i))
    assert pallas_tpu.refusal(alibi, _masking.Call(q, k, v, platform="tpu")) is None


@functools.cache
def _compare(case):
    """`(ours, reference)`: out, lse and the gradients of q, k, v and the floating values
    in TPU interpret mode (float32) and in float64."""
    rng = np.random.default_rng(CASES.index(case) + 10 if case in CASES else 99)
    q, k, v = _inputs(rng)
    values = _values(rng)
    w = jnp.asarray(rng.standard_normal((B, H, N, D)), jnp.float32)
    sinks = case == "sinks"
    base = "causal" if sinks else case
    f = _ours(base, interpret="tpu", q_block=32, sinks=sinks)
    got = jax.jit(lambda *a: (f(*a), jax.grad(_loss(f, w), argnums=(0, 1, 2, 3))(*a)))(q, k, v, values)

    def reference(q, k, v, values):
        _, ref = _case(base, values)
        return jax_reference(q, k, v, return_lse=True, sinks=values["sinks"] if sinks else None, **ref)

    with x64():
        f64 = lambda t: jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), t)
        want = jax.jit(lambda *a: (reference(*a), jax.grad(_loss(reference, w), argnums=(0, 1, 2, 3))(*a)))(
            *f64((q, k, v, values)))
        want = jax.tree.map(np.asarray, want)
    return jax.tree.map(np.asarray, got), want


USED = {"bias": "bias", "alibi": "slopes", "sinks": "sinks"}  # the floating value each case differentiates


# TPU interpret mode costs 6-10 s of CPU a case: the cases with a TPU-only read (a bias
# tile and its gradient, SMEM scalars and their gradient, a per-position window, padded
# keys past a length, sinks through the lse); every case above exports.
INTERPRETED = ("kv_lengths", "bias", "alibi", "documents", "sinks")


@pytest.mark.parametrize("case", INTERPRETED)
def test_interpret_mode_equals_the_float64_reference(case):
    got, want = _compare(case)
    (out, lse), (dq, dk, dv, dvals) = got
    (w_out, w_lse), (w_dq, w_dk, w_dv, w_dvals) = want
    pairs = [(out, w_out), (lse, w_lse), (dq, w_dq), (dk, w_dk), (dv, w_dv)]
    if case in USED:
        pairs.append((dvals[USED[case]], w_dvals[USED[case]]))
    terms = 2 * D + 3 * S + (H // K) * N
    for a, b in pairs:
        finite = np.isfinite(b)
        np.testing.assert_array_equal(np.isfinite(a), finite)
        np.testing.assert_allclose(a[finite], b[finite], atol=f32_tolerance(terms=terms, magnitude=b[finite]))
