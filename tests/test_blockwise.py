"""Tests for `jax_mha.blockwise`: values and gradients against a float64 NumPy reference
and against `attention(..., implementation="xla")`.

Every case uses prime sizes that are not multiples of the block size (N=37, S=53 with
16-blocks) so the internal padding of both queries and keys is exercised, and every
axis has a different length so a swapped axis cannot pass.

Tolerances: float32 blockwise vs float64 reference and vs float32 xla, `rtol=1e-5`
plus `atol=1e-5`. The atol is needed because many gradient entries are close to 0
(masked keys, rows whose cotangent cancels), where a relative error of float32
round-off (~1e-7 of the O(1) terms being summed) is meaningless. Measured worst
absolute errors, for blockwise and for xla alike against float64: ~2e-6 on gradients
of magnitude up to ~15, ~4e-7 on outputs.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_mha.blockwise import blockwise_attention

RTOL, ATOL = 1e-5, 1e-5
BLOCKS = dict(query_block_size=16, key_block_size=16)


# --------------------------------------------------------------------------------------
# Independent float64 reference: dense NumPy, k/v repeated per query head (GQA), with
# the analytic softmax-attention gradient (checked against finite differences below).
# --------------------------------------------------------------------------------------


def _reduce_to_shape(x, shape):
    """Sum a `(B…, H, N, S)` array over the axes that `shape` broadcasts."""
    padded = (1,) * (x.ndim - len(shape)) + tuple(shape)
    axes = tuple(a for a, (n, m) in enumerate(zip(x.shape, padded)) if m == 1 and n != 1)
    return x.sum(axis=axes, keepdims=True).reshape(shape)


def np_reference(q, k, v, d_out=None, *, mask=None, bias=None, kv_lengths=None,
                 is_causal=False, scale=None):
    """Float64 attention and, given the output cotangent `d_out`, its gradients.

    Returns `out (B…, H, N, Dv)`, or `(out, {"q", "k", "v", "bias"})` when `d_out` is
    given. Fully masked rows give zero output and zero gradients.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    h, n, d = q.shape[-3:]
    kh, s = k.shape[-3:-1]
    group = h // kh
    batch = q.shape[:-3]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    k_rep = np.repeat(k, group, axis=-3)  # (B…, H, S, D): head h reads kv head h // G
    v_rep = np.repeat(v, group, axis=-3)
    allowed = np.ones(batch + (h, n, s), bool)
    if mask is not None:
        allowed &= np.asarray(mask)
    if kv_lengths is not None:
        lengths = np.broadcast_to(np.asarray(kv_lengths), batch)[..., None, None, None]
        allowed &= np.arange(s) < lengths
    if is_causal:
        allowed &= np.arange(s)[None, :] <= np.arange(n)[:, None] + (s - n)
    logits = scale * q @ np.swapaxes(k_rep, -1, -2)
    if bias is not None:
        logits = logits + np.asarray(bias, np.float64)
    logits = np.where(allowed, logits, -np.inf)
    row_max = logits.max(axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    e = np.where(allowed, np.exp(logits - row_max), 0.0)
    denom = e.sum(axis=-1, keepdims=True)
    p = e / np.where(denom > 0, denom, 1.0)  # (B…, H, N, S)
    out = p @ v_rep
    if d_out is None:
        return out
    d_out = np.asarray(d_out, np.float64)
    dv_rep = np.swapaxes(p, -1, -2) @ d_out
    dp = d_out @ np.swapaxes(v_rep, -1, -2)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))  # softmax Jacobian
    dq = scale * ds @ k_rep
    dk_rep = scale * np.swapaxes(ds, -1, -2) @ q
    fold = lambda x: x.reshape(batch + (kh, group) + x.shape[-2:]).sum(axis=-3)
    grads = {"q": dq, "k": fold(dk_rep), "v": fold(dv_rep)}
    if bias is not None:
        grads["bias"] = _reduce_to_shape(ds, np.shape(bias))
    return out, grads


def _inputs(rng, batch, h, kh, n, s, d, dv=None, dtype=jnp.float32):
    q = rng.normal(size=batch + (h, n, d))
    k = rng.normal(size=batch + (kh, s, d))
    v = rng.normal(size=batch + (kh, s, dv or d))
    d_out = rng.normal(size=batch + (h, n, dv or d))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v, d_out))


def _value_and_grads(fn, q, k, v, d_out, bias=None):
    """`fn(q, k, v, bias)` and the gradients of `sum(fn(...) * d_out)` w.r.t. q, k, v, bias."""

    def loss(q, k, v, bias):
        out = fn(q, k, v, bias)
        return jnp.sum(out.astype(jnp.float32) * d_out), out

    argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
    grads, out = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))(q, k, v, bias)
    names = ("q", "k", "v", "bias")[: len(grads)]
    return out, dict(zip(names, grads))


def _xla_attention():
    functional = pytest.importorskip("jax_mha.functional")
    return functional.attention


# --------------------------------------------------------------------------------------
# Reference self-check.
# --------------------------------------------------------------------------------------


def test_reference_gradient_matches_finite_differences(rng):
    """The analytic float64 reference gradient is right (so later comparisons mean something)."""
    q, k, v, d_out = (np.asarray(x, np.float64) for x in _inputs(rng, (1,), 2, 1, 3, 5, 2))
    bias = rng.normal(size=(2, 3, 5))
    mask = rng.random((1, 2, 3, 5)) > 0.3
    mask[0, 1, 2] = False  # a fully masked row
    kw = dict(mask=mask, kv_lengths=np.array([4]), is_causal=True)
    _, grads = np_reference(q, k, v, d_out, bias=bias, **kw)
    args = {"q": q, "k": k, "v": v, "bias": bias}
    eps = 1e-6
    for name, x in args.items():
        fd = np.zeros_like(x)
        for idx in np.ndindex(*x.shape):
            plus, minus = dict(args), dict(args)
            plus[name], minus[name] = x.copy(), x.copy()
            plus[name][idx] += eps
            minus[name][idx] -= eps
            f = lambda a: np.sum(np_reference(a["q"], a["k"], a["v"], bias=a["bias"], **kw) * d_out)
            fd[idx] = (f(plus) - f(minus)) / (2 * eps)
        np.testing.assert_allclose(grads[name], fd, rtol=1e-6, atol=1e-8, err_msg=name)


def test_reference_matches_shared_loop_reference(rng, np_attention):
    """The dense reference agrees with the loop reference of tests/conftest.py."""
    q, k, v, _ = _inputs(rng, (2,), 6, 2, 7, 11, 3)
    mask = rng.random((2, 1, 7, 11)) > 0.4
    bias = rng.normal(size=(6, 7, 11))
    expected, _ = np_attention(q, k, v, mask=mask, bias=bias)
    np.testing.assert_allclose(np_reference(q, k, v, mask=mask, bias=bias), expected, rtol=1e-12)


# --------------------------------------------------------------------------------------
# Values and gradients.
# --------------------------------------------------------------------------------------

# (name, batch, H, K, N, S, extra) — extra builds mask/bias/kv_lengths/is_causal from rng.
CASES = [
    ("causal_square", (2,), 3, 3, 37, 37, lambda rng: {"is_causal": True}),
    ("causal_cache_gqa", (2,), 6, 2, 37, 53, lambda rng: {"is_causal": True}),  # N < S
    ("kv_lengths_mqa", (3,), 6, 1, 37, 53, lambda rng: {"kv_lengths": np.array([53, 20, 1])}),
    (
        "mask_and_broadcast_bias",
        (2,), 6, 2, 37, 53,
        lambda rng: {"mask": rng.random((2, 6, 37, 53)) > 0.5, "bias": rng.normal(size=(6, 1, 53))},
    ),
    (
        "everything",
        (2,), 6, 2, 37, 53,
        lambda rng: {
            "mask": rng.random((2, 1, 37, 53)) > 0.2,
            "bias": rng.normal(size=(2, 6, 37, 53)),
            "kv_lengths": np.array([50, 29]),
            "is_causal": True,
        },
    ),
    # N, S multiples of the blocks with no mask/causal/lengths: the validity select is
    # skipped; with H == K the G axis is squeezed out.
    ("dense_mha", (2,), 4, 4, 32, 48, lambda rng: {}),
    ("dense_bias_gqa", (2,), 6, 2, 32, 48, lambda rng: {"bias": rng.normal(size=(2, 6, 32, 48))}),
    (
        "mask_bias_mha",
        (2,), 4, 4, 37, 53,
        lambda rng: {"mask": rng.random((2, 4, 37, 53)) > 0.3, "bias": rng.normal(size=(4, 37, 1))},
    ),
]


@pytest.mark.parametrize("name,batch,h,kh,n,s,extra", CASES, ids=[c[0] for c in CASES])
def test_matches_references(rng, name, batch, h, kh, n, s, extra):
    """Values and grads (q, k, v, bias) match float64 NumPy and float32 xla attention."""
    q, k, v, d_out = _inputs(rng, batch, h, kh, n, s, d=5, dv=7)
    kw = extra(rng)
    bias = kw.pop("bias", None)
    bias = None if bias is None else jnp.asarray(bias, jnp.float32)
    mask = kw.get("mask")
    out, grads = _value_and_grads(
        lambda q, k, v, b: blockwise_attention(q, k, v, bias=b, **kw, **BLOCKS),
        q, k, v, d_out, bias,
    )
    ref_out, ref_grads = np_reference(q, k, v, d_out, bias=bias, **kw)
    chex.assert_shape(out, batch + (h, n, 7))
    chex.assert_trees_all_close(out, ref_out.astype(np.float32), rtol=RTOL, atol=ATOL)
    chex.assert_trees_all_close(
        grads, {key: g.astype(np.float32) for key, g in ref_grads.items()}, rtol=RTOL, atol=ATOL
    )

    attention = _xla_attention()
    xla_kw = {key: val for key, val in kw.items() if key != "mask"}
    xla_out, xla_grads = _value_and_grads(
        lambda q, k, v, b: attention(q, k, v, mask, b, implementation="xla", **xla_kw),
        q, k, v, d_out, bias,
    )
    chex.assert_trees_all_close(out, xla_out, rtol=RTOL, atol=ATOL)
    chex.assert_trees_all_close(grads, xla_grads, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("blocks", [(1, 1), (1000, 1000)])
def test_any_block_size(rng, blocks):
    """Block sizes of 1 and larger than N/S (clamped to one block) agree with the reference."""
    q, k, v, _ = _inputs(rng, (2,), 6, 2, 13, 17, 3)
    lengths = np.array([17, 6])
    out = blockwise_attention(
        q, k, v, kv_lengths=lengths, is_causal=True,
        query_block_size=blocks[0], key_block_size=blocks[1],
    )
    expected = np_reference(q, k, v, kv_lengths=lengths, is_causal=True)
    chex.assert_trees_all_close(out, expected.astype(np.float32), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("batch", [(), (2, 3)])
def test_batch_dims_and_broadcast_mask_bias_lengths(rng, batch):
    """No or several batch dims; mask/bias/kv_lengths broadcast over some of them; the
    bias gradient is summed back to the bias's own shape. Unequal blocks (4 x 6), N < S."""
    q, k, v, d_out = _inputs(rng, batch, 4, 2, 9, 14, 3)
    if batch:
        mask = rng.random((3, 1, 9, 14)) > 0.3
        bias = rng.normal(size=(3, 4, 1, 14))
        lengths = np.array([14, 5, 0])
    else:
        mask, bias, lengths = rng.random((9, 14)) > 0.3, rng.normal(size=(14,)), np.array(7)
    bias = jnp.asarray(bias, jnp.float32)
    kw = dict(mask=mask, kv_lengths=lengths, is_causal=True)
    out, grads = _value_and_grads(
        lambda q, k, v, b: blockwise_attention(
            q, k, v, bias=b, **kw, query_block_size=4, key_block_size=6
        ),
        q, k, v, d_out, bias,
    )
    ref_out, ref_grads = np_reference(q, k, v, d_out, bias=bias, **kw)
    chex.assert_trees_all_close(out, ref_out.astype(np.float32), rtol=RTOL, atol=ATOL)
    chex.assert_trees_all_close(
        grads, {key: g.astype(np.float32) for key, g in ref_grads.items()}, rtol=RTOL, atol=ATOL
    )


def test_fully_masked_rows_are_zero_with_finite_grads(rng):
    """kv_lengths=0, an all-False mask row, and causal N > S rows: zeros, zero finite grads."""
    q, k, v, d_out = _inputs(rng, (3,), 6, 2, 37, 29, 5)
    mask = np.ones((3, 1, 37, 29), bool)
    mask[1, :, 4] = False  # query row 4 of batch 1 sees nothing
    bias = jnp.asarray(rng.normal(size=(3, 6, 37, 29)), jnp.float32)
    kw = dict(mask=mask, kv_lengths=np.array([0, 29, 17]), is_causal=True)  # N > S: rows < 8 empty
    out, grads = _value_and_grads(
        lambda q, k, v, b: blockwise_attention(q, k, v, bias=b, **kw, **BLOCKS), q, k, v, d_out, bias
    )
    chex.assert_tree_all_finite((out, grads))
    np.testing.assert_array_equal(out[0], 0.0)  # no key at all in batch 0
    np.testing.assert_array_equal(out[1, :, 4], 0.0)
    np.testing.assert_array_equal(out[:, :, : 37 - 29], 0.0)  # causal: before the first key
    for name in ("q", "k", "v", "bias"):
        np.testing.assert_array_equal(grads[name][0], 0.0, err_msg=name)
    np.testing.assert_array_equal(grads["q"][1, :, 4], 0.0)
    ref_out, ref_grads = np_reference(q, k, v, d_out, bias=bias, **kw)
    chex.assert_trees_all_close(out, ref_out.astype(np.float32), rtol=RTOL, atol=ATOL)
    chex.assert_trees_all_close(
        grads, {key: g.astype(np.float32) for key, g in ref_grads.items()}, rtol=RTOL, atol=ATOL
    )


def test_bfloat16_runs_and_is_close(rng):
    """bfloat16 inputs: bfloat16 output and grads, close to float64 (statistics in float32)."""
    q, k, v, d_out = _inputs(rng, (2,), 6, 2, 37, 53, 8, dtype=jnp.bfloat16)
    kw = dict(kv_lengths=np.array([53, 30]), is_causal=True)
    out, grads = _value_and_grads(
        lambda q, k, v, b: blockwise_attention(q, k, v, **kw, **BLOCKS), q, k, v, d_out
    )
    chex.assert_type([out, grads["q"], grads["k"], grads["v"]], jnp.bfloat16)
    f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32))
    ref_out, ref_grads = np_reference(f32(q), f32(k), f32(v), f32(d_out), **kw)
    # bfloat16 has an 8-bit mantissa (relative step 2**-8 ~ 4e-3).
    np.testing.assert_allclose(f32(out), ref_out, rtol=2e-2, atol=2e-2)
    for name in ("q", "k", "v"):
        np.testing.assert_allclose(f32(grads[name]), ref_grads[name], rtol=5e-2, atol=5e-2)


def test_vmap_matches_batched_call(rng):
    """vmap over a leading axis gives the same values and grads as the batched call."""
    q, k, v, d_out = _inputs(rng, (3,), 6, 2, 11, 13, 5)
    lengths = np.array([13, 2, 9])
    call = lambda q, k, v, n: blockwise_attention(
        q, k, v, kv_lengths=n, is_causal=True, query_block_size=4, key_block_size=8
    )
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v, lengths) * d_out)
    batched = jax.jit(jax.value_and_grad(loss(call), argnums=(0, 1, 2)))(q, k, v)
    mapped = jax.jit(jax.value_and_grad(loss(jax.vmap(call)), argnums=(0, 1, 2)))(q, k, v)
    chex.assert_trees_all_close(mapped, batched, rtol=RTOL, atol=ATOL)


def test_memory_is_linear_in_sequence_length():
    """Compiled forward+backward temp memory grows ~linearly and stays far below N x S."""
    temp = {}
    for n in (1024, 4096):
        x = jax.ShapeDtypeStruct((1, 2, n, 16), jnp.float32)
        fn = lambda q, k, v: blockwise_attention(
            q, k, v, is_causal=True, query_block_size=128, key_block_size=128
        ).sum()
        compiled = jax.jit(jax.grad(fn, argnums=(0, 1, 2))).lower(x, x, x).compile()
        analysis = compiled.memory_analysis()
        if analysis is None:
            pytest.skip("this backend reports no memory analysis")
        temp[n] = analysis.temp_size_in_bytes
    scores_bytes = 2 * 4096 * 4096 * 4  # one float32 (H, N, S) array at N = S = 4096
    assert temp[4096] < scores_bytes / 16, temp
    assert temp[4096] / temp[1024] < 6, temp  # linear: ~x4 at most; quadratic would be x16


# --------------------------------------------------------------------------------------
# jit / no-jit variants.
# --------------------------------------------------------------------------------------


class BlockwiseVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_gqa_causal_lengths_scale(self):
        rng = np.random.default_rng(1)
        q, k, v, _ = _inputs(rng, (2,), 6, 2, 37, 53, 5)
        lengths = jnp.array([53, 11])
        fn = self.variant(
            functools.partial(blockwise_attention, is_causal=True, scale=0.3, **BLOCKS)
        )
        out = fn(q, k, v, kv_lengths=lengths)
        expected = np_reference(q, k, v, kv_lengths=lengths, is_causal=True, scale=0.3)
        chex.assert_trees_all_close(out, expected.astype(np.float32), rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------------------
# Failure paths.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["query_block_size", "key_block_size"])
@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_block_size_raises(field, bad):
    x = jnp.zeros((1, 2, 5, 3))
    with pytest.raises(ValueError, match=rf"{field} must be a positive int\. Got {bad}"):
        blockwise_attention(x, x, x, **{field: bad})


def test_shape_errors_name_the_numbers():
    q = jnp.zeros((2, 6, 5, 3))
    k = jnp.zeros((2, 4, 7, 3))
    with pytest.raises(ValueError, match=r"query heads \(6\).*key/value heads \(4\)"):
        blockwise_attention(q, k, k)
    k = jnp.zeros((2, 3, 7, 3))
    with pytest.raises(ValueError, match=r"mask must be broadcastable to .*\(2, 6, 5, 7\)\. Got \(5, 6\)"):
        blockwise_attention(q, k, k, mask=jnp.ones((5, 6), bool))
    with pytest.raises(ValueError, match=r"kv_lengths must be broadcastable to \(B...\)=\(2,\)"):
        blockwise_attention(q, k, k, kv_lengths=jnp.array([1, 2, 3]))


def test_minus_inf_bias_rows_without_mask(rng):
    """No mask and block-multiple N, S (validity select skipped): a row whose bias is all
    -inf outputs zeros, everything stays finite, and the rest matches the reference."""
    q, k, v, d_out = _inputs(rng, (2,), 3, 3, 32, 32, 5)
    bias = rng.normal(size=(2, 3, 32, 32))
    bias[0, 1, 5] = -np.inf
    bias[1, 2, :, 7] = -np.inf
    bias = jnp.asarray(bias, jnp.float32)
    out, grads = _value_and_grads(
        lambda q, k, v, b: blockwise_attention(q, k, v, bias=b, **BLOCKS), q, k, v, d_out, bias
    )
    ref_out, ref_grads = np_reference(q, k, v, d_out, bias=bias)
    chex.assert_tree_all_finite((out, grads["q"], grads["k"], grads["v"]))
    np.testing.assert_array_equal(np.asarray(out[0, 1, 5]), 0.0)
    chex.assert_trees_all_close(out, ref_out.astype(np.float32), rtol=RTOL, atol=ATOL)
    for key in ("q", "k", "v"):
        chex.assert_trees_all_close(grads[key], ref_grads[key].astype(np.float32), rtol=RTOL, atol=ATOL)
