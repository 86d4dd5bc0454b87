"""Tests for `jax_mha.functional`: every dimension a different prime, so a swapped axis
cannot pass; expected values from the float64 NumPy reference in `conftest.py`."""

from __future__ import annotations

import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import f32_tolerance, normal

from jax_mha import (
    attention,
    attention_entropy,
    causal_mask,
    combine_heads,
    lengths_mask,
    padding_mask,
    split_heads,
)

# B, H, N, S, D, Dv: all distinct primes.
B, H, N, S, D, DV = 2, 3, 5, 7, 11, 13
# The float32 sums of one attention, for the tolerances: the logits over D, the
# softmax sum and weights @ v over (at most) S keys; the weights go through the first two.
FORWARD_TERMS = D + 2 * S
WEIGHTS_TERMS = D + S


def tol(want, terms=FORWARD_TERMS):
    """`f32_tolerance` at `want`'s size."""
    return f32_tolerance(terms=terms, magnitude=want)


def qkv(rng, b=(B,), h=H, kv=H, n=N, s=S, d=D, dv=DV, dtype=jnp.float32):
    """q `(b…, h, n, d)`, k `(b…, kv, s, d)`, v `(b…, kv, s, dv)`."""
    return (
        normal(rng, (*b, h, n, d), dtype),
        normal(rng, (*b, kv, s, d), dtype),
        normal(rng, (*b, kv, s, dv), dtype),
    )


def random_mask(rng, shape, p=0.7):
    """Random boolean mask with every row keeping key 0 (no fully masked rows)."""
    m = rng.random(shape) < p
    m[..., 0] = True
    return jnp.asarray(m)


# --------------------------------------------------------------------------- shapes


class ShapeTest(chex.TestCase):
    """Output shapes, with and without jit."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_split_and_combine_heads(self):
        x = jnp.asarray(np.random.default_rng(1).standard_normal((B, N, H * D)), jnp.float32)
        split = self.variant(lambda x: split_heads(x, H))(x)
        chex.assert_shape(split, (B, H, N, D))
        chex.assert_shape(self.variant(combine_heads)(split), (B, N, H * D))

    @chex.variants(with_jit=True, without_jit=True)
    def test_split_heads_extra_batch_dims(self):
        x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 3, N, 7 * 2)), jnp.float32)
        chex.assert_shape(self.variant(lambda x: split_heads(x, 7))(x), (2, 3, 7, N, 2))

    @chex.variants(with_jit=True, without_jit=True)
    def test_attention(self):
        q, k, v = qkv(np.random.default_rng(3))
        out, weights = self.variant(lambda q, k, v: attention(q, k, v, return_weights=True))(q, k, v)
        chex.assert_shape(out, (B, H, N, DV))
        chex.assert_shape(weights, (B, H, N, S))
        chex.assert_shape(self.variant(attention)(q, k, v), (B, H, N, DV))

    @chex.variants(with_jit=True, without_jit=True)
    def test_attention_gqa_and_extra_batch_dims(self):
        q, k, v = qkv(np.random.default_rng(4), b=(2, 3), h=6, kv=2)
        out, weights = self.variant(lambda q, k, v: attention(q, k, v, is_causal=True, return_weights=True))(q, k, v)
        chex.assert_shape(out, (2, 3, 6, N, DV))
        chex.assert_shape(weights, (2, 3, 6, N, S))

    @chex.variants(with_jit=True, without_jit=True)
    def test_attention_without_batch_dims(self):
        q, k, v = qkv(np.random.default_rng(5), b=())
        chex.assert_shape(self.variant(attention)(q, k, v), (H, N, DV))

    @chex.variants(with_jit=True, without_jit=True)
    def test_masks_and_entropy(self):
        chex.assert_shape(self.variant(lambda: causal_mask(N, S))(), (N, S))
        chex.assert_shape(self.variant(lambda: causal_mask(N))(), (N, N))
        valid = jnp.asarray(np.random.default_rng(6).random((B, S)) < 0.5)
        pm = self.variant(padding_mask)(valid)
        chex.assert_shape(pm, (B, 1, 1, S))
        chex.assert_type(pm, bool)
        w = jax.nn.softmax(normal(np.random.default_rng(7), (B, H, N, S)), axis=-1)
        chex.assert_shape(self.variant(attention_entropy)(w), (B, H, N))


# ------------------------------------------------------------------- split / combine


def test_split_combine_round_trip(rng):
    x = normal(rng, (B, 3, N, H * D))
    np.testing.assert_array_equal(combine_heads(split_heads(x, H)), x)
    y = normal(rng, (B, H, N, D))
    np.testing.assert_array_equal(split_heads(combine_heads(y), H), y)


def test_split_heads_layout(rng):
    """Head h is features h*D:(h+1)*D, and axes come out as (B, H, N, D)."""
    x = np.asarray(rng.standard_normal((B, N, H * D)), np.float32)
    split = np.asarray(split_heads(jnp.asarray(x), H))
    for h in range(H):
        np.testing.assert_array_equal(split[:, h], x[:, :, h * D : (h + 1) * D])


# ------------------------------------------------------------- attention vs reference


@pytest.mark.parametrize("use_mask", [False, True])
@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("scale", [None, 0.37])
def test_attention_matches_numpy(rng, np_attention, use_mask, use_bias, scale):
    q, k, v = qkv(rng)
    mask = random_mask(rng, (B, 1, N, S)) if use_mask else None  # broadcast over heads
    bias = normal(rng, (H, N, S)) if use_bias else None  # broadcast over batch
    out, weights = attention(q, k, v, mask, bias, scale=scale, return_weights=True)
    ref_out, ref_w = np_attention(q, k, v, mask, bias, scale)
    np.testing.assert_allclose(out, ref_out, atol=tol(ref_out))
    np.testing.assert_allclose(weights, ref_w, atol=tol(1.0, WEIGHTS_TERMS))
    np.testing.assert_allclose(jnp.sum(weights, axis=-1), np.ones((B, H, N)), rtol=0, atol=tol(1.0, WEIGHTS_TERMS + S))
    if use_mask:
        assert not np.any(np.asarray(weights)[~np.broadcast_to(np.asarray(mask), weights.shape)])


def test_default_scale_is_inverse_sqrt_head_dim(rng):
    q, k, v = qkv(rng)
    want = attention(q, k, v, scale=1 / math.sqrt(D))
    np.testing.assert_allclose(attention(q, k, v), want, atol=tol(want))
    assert not np.allclose(attention(q, k, v), attention(q, k, v, scale=1.0), atol=1e-3)


def test_attention_with_broadcast_2d_mask_and_bias(rng, np_attention):
    q, k, v = qkv(rng)
    mask, bias = random_mask(rng, (N, S)), normal(rng, (N, S))
    want = np_attention(q, k, v, mask, bias)[0]
    np.testing.assert_allclose(attention(q, k, v, mask, bias), want, atol=tol(want))


def test_attention_is_vmappable_and_differentiable(rng, np_attention):
    q, k, v = qkv(rng)
    want = attention(q, k, v)
    np.testing.assert_allclose(jax.vmap(attention)(q, k, v), want, atol=tol(want))
    # Gradient against central finite differences of the float64 reference.
    r = np.asarray(rng.standard_normal((B, H, N, DV)))
    g = jax.grad(lambda q: jnp.sum(attention(q, k, v) * r))(q)
    qn = np.asarray(q, np.float64)
    for idx in [(0, 0, 0, 0), (1, 2, 4, 10), (0, 1, 3, 5)]:
        e = np.zeros_like(qn)
        e[idx] = 1e-5
        fd = (np.sum(np_attention(qn + e, k, v)[0] * r) - np.sum(np_attention(qn - e, k, v)[0] * r)) / 2e-5
        np.testing.assert_allclose(g[idx], fd, rtol=1e-3, atol=1e-4)


def test_bfloat16_inputs(rng, np_attention):
    q, k, v = qkv(rng, dtype=jnp.bfloat16)
    out, weights = attention(q, k, v, is_causal=True, return_weights=True)
    assert out.dtype == jnp.bfloat16
    ref, _ = np_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), causal_mask(N, S))
    np.testing.assert_allclose(out.astype(jnp.float32), ref, rtol=0.05, atol=0.05)
    np.testing.assert_allclose(jnp.sum(weights.astype(jnp.float32), -1), np.ones((B, H, N)), atol=0.02)


# --------------------------------------------------------- jax.nn.dot_product_attention


def to_bthd(x):
    """(B, H, T, D) -> (B, T, H, D), jax.nn.dot_product_attention's layout."""
    return jnp.swapaxes(x, -3, -2)


@pytest.mark.parametrize("kv_heads", [H, 1])
def test_matches_jax_nn_dot_product_attention(rng, kv_heads):
    q, k, v = qkv(rng, h=H, kv=kv_heads, dv=D)  # jax.nn needs equal q/k and v head dims
    mask = random_mask(rng, (B, H, N, S))
    bias = normal(rng, (B, H, N, S))
    expected = jax.nn.dot_product_attention(to_bthd(q), to_bthd(k), to_bthd(v), bias=bias, mask=mask)
    np.testing.assert_allclose(attention(q, k, v, mask, bias), to_bthd(expected), atol=tol(expected))
    # N < S: jax.nn's is_causal aligns top-left, ours bottom-right (queries are the last
    # N positions), so compare against an explicit causal_mask(N, S) there...
    expected = jax.nn.dot_product_attention(to_bthd(q), to_bthd(k), to_bthd(v), mask=causal_mask(N, S), scale=0.5)
    np.testing.assert_allclose(attention(q, k, v, is_causal=True, scale=0.5), to_bthd(expected), atol=tol(expected))
    # ...and against its own is_causal where both conventions agree (N == S).
    qs = q[..., :S - 2, :]
    ks, vs = k[..., :S - 2, :], v[..., :S - 2, :]
    expected = jax.nn.dot_product_attention(to_bthd(qs), to_bthd(ks), to_bthd(vs), is_causal=True)
    np.testing.assert_allclose(attention(qs, ks, vs, is_causal=True), to_bthd(expected), atol=tol(expected))


# ------------------------------------------------------------------------- GQA / MQA


@pytest.mark.parametrize("kv_heads", [1, 2, 3])  # MQA, GQA (group 3), GQA (group 2)
def test_gqa_equals_repeated_kv_heads(rng, np_attention, kv_heads):
    h = 6
    q, k, v = qkv(rng, h=h, kv=kv_heads)
    mask = random_mask(rng, (B, h, N, S))
    out, weights = attention(q, k, v, mask, return_weights=True)
    k_rep, v_rep = (jnp.repeat(x, h // kv_heads, axis=-3) for x in (k, v))
    out_rep, weights_rep = attention(q, k_rep, v_rep, mask, return_weights=True)
    np.testing.assert_allclose(out, out_rep, atol=tol(out_rep))
    np.testing.assert_allclose(weights, weights_rep, atol=tol(1.0, WEIGHTS_TERMS))
    want = np_attention(q, k, v, mask)[0]
    np.testing.assert_allclose(out, want, atol=tol(want))


# --------------------------------------------------------------------------- masking


@pytest.mark.parametrize("n,s", [(N, S), (S, S), (S, N), (1, S)])
def test_causal_mask_values(n, s):
    expected = np.array([[j <= i + (s - n) for j in range(s)] for i in range(n)])
    np.testing.assert_array_equal(causal_mask(n, s), expected)
    if n == s:
        np.testing.assert_array_equal(causal_mask(n), np.tril(np.ones((n, n), bool)))


@pytest.mark.parametrize("n,s", [(N, N), (N, S), (S, N)])  # square, N < S (cache), N > S
@pytest.mark.parametrize("with_padding", [False, True])
def test_is_causal_equals_explicit_causal_mask(rng, np_attention, n, s, with_padding):
    q, k, v = qkv(rng, n=n, s=s)
    pad = padding_mask(jnp.asarray(rng.random((B, s)) < 0.7)) if with_padding else None
    explicit = causal_mask(n, s) if pad is None else jnp.logical_and(pad, causal_mask(n, s)[None, None])
    out, w = attention(q, k, v, pad, is_causal=True, return_weights=True)
    out_explicit, w_explicit = attention(q, k, v, explicit, return_weights=True)
    np.testing.assert_allclose(out, out_explicit, atol=tol(out_explicit))
    np.testing.assert_allclose(w, w_explicit, atol=tol(1.0, WEIGHTS_TERMS))
    want = np_attention(q, k, v, explicit)[0]
    np.testing.assert_allclose(out, want, atol=tol(want))


def test_padding_mask_equals_dropping_padded_keys(rng, np_attention):
    q, k, v = qkv(rng)
    lengths = [3, S]
    valid = jnp.asarray(np.arange(S)[None, :] < np.array(lengths)[:, None])
    pm = padding_mask(valid)
    np.testing.assert_array_equal(pm[:, 0, 0, :], valid)
    np.testing.assert_array_equal(pm, lengths_mask(jnp.asarray(lengths), S))
    out = attention(q, k, v, pm)
    for b, length in enumerate(lengths):
        ref, _ = np_attention(q[b], k[b, :, :length], v[b, :, :length])
        np.testing.assert_allclose(out[b], ref, atol=tol(ref))
    np.testing.assert_allclose(attention(q, k, v, kv_lengths=jnp.asarray(lengths)), out, atol=tol(out))


def fully_masked_case(rng, dtype):
    """Inputs whose mask leaves rows (batch 0, head 1, queries 0 and 3) with no key."""
    q, k, v = qkv(rng, dtype=dtype)
    m = np.array(random_mask(rng, (B, H, N, S)))
    m[0, 1, [0, 3], :] = False
    return q, k, v, jnp.asarray(m), normal(rng, (B, H, N, S), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fully_masked_rows_are_zero_with_finite_gradients(rng, np_attention, dtype):
    q, k, v, mask, bias = fully_masked_case(rng, dtype)
    out, weights = attention(q, k, v, mask, bias, return_weights=True)
    assert out.dtype == dtype
    for x in (out, weights):
        assert np.all(np.isfinite(np.asarray(x, np.float32)))
        np.testing.assert_array_equal(np.asarray(x[0, 1, [0, 3]], np.float32), 0.0)
    ref, _ = np_attention(*(x.astype(jnp.float32) for x in (q, k, v)), mask, bias.astype(jnp.float32))
    if dtype == jnp.float32:
        np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=tol(ref))
    else:
        np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=0.05, atol=0.05)

    r = normal(rng, out.shape, jnp.float32)

    def loss(q, k, v, bias):
        o, w = attention(q, k, v, mask, bias, return_weights=True)
        return jnp.sum(o.astype(jnp.float32) * r) + jnp.sum(attention_entropy(w))

    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias)
    for g, x in zip(grads, (q, k, v, bias)):
        assert g.dtype == x.dtype and g.shape == x.shape
        assert np.all(np.isfinite(np.asarray(g, np.float32)))
    # Those rows do not depend on their query or bias at all: gradient exactly zero.
    np.testing.assert_array_equal(np.asarray(grads[0][0, 1, [0, 3]], np.float32), 0.0)
    np.testing.assert_array_equal(np.asarray(grads[3][0, 1, [0, 3]], np.float32), 0.0)
    assert np.any(np.asarray(grads[0], np.float32) != 0)


def test_causal_with_more_queries_than_keys_has_zero_leading_rows(rng):
    """causal_mask(N, S) with N > S leaves the first N - S queries with no key."""
    q, k, v = qkv(rng, n=S, s=N)
    out, w = attention(q, k, v, is_causal=True, return_weights=True)
    np.testing.assert_array_equal(out[..., : S - N, :], 0.0)
    np.testing.assert_array_equal(w[..., : S - N, :], 0.0)
    g = jax.grad(lambda k: jnp.sum(attention(q, k, v, is_causal=True) ** 2))(k)
    assert np.all(np.isfinite(g))


# --------------------------------------------------------------------------- entropy


def test_attention_entropy_matches_numpy(rng):
    w = np.asarray(jax.nn.softmax(normal(rng, (B, H, N, S)), axis=-1), np.float64)
    w[0, 0, 0] = 0.0  # a fully masked row: 0·log 0 = 0
    w[0, 1, 2] = np.eye(S)[4]  # one-hot: entropy 0
    w[1, 2, 3] = 1.0 / S  # uniform: ln S
    w[1, 0, 1, :3] = 0.0  # some zeros in a row
    w[1, 0, 1] /= w[1, 0, 1].sum()
    with np.errstate(divide="ignore", invalid="ignore"):
        expected = -np.sum(np.where(w > 0, w * np.log(w), 0.0), axis=-1)
    ent = attention_entropy(jnp.asarray(w, jnp.float32))
    np.testing.assert_allclose(ent, expected, atol=tol(expected, S))  # a float32 sum over S
    assert ent[0, 0, 0] == 0.0 and abs(ent[0, 1, 2]) < 1e-6
    np.testing.assert_allclose(ent[1, 2, 3], np.log(S), atol=tol(np.log(S), S))
    g = jax.grad(lambda w: jnp.sum(attention_entropy(w)))(jnp.asarray(w, jnp.float32))
    assert np.all(np.isfinite(g))


# --------------------------------------------------------------------------- dropout


def test_dropout_deterministic_ignores_rate(rng):
    q, k, v = qkv(rng)
    key = jax.random.key(3)
    plain = attention(q, k, v)
    np.testing.assert_array_equal(attention(q, k, v, dropout_rate=0.5, dropout_rng=key, deterministic=True), plain)
    np.testing.assert_array_equal(attention(q, k, v, dropout_rate=0.5), plain)  # no key needed


def test_dropout_changes_output_and_is_reproducible(rng):
    q, k, v = qkv(rng)
    drop = lambda key: attention(
        q, k, v, dropout_rate=0.5, dropout_rng=key, deterministic=False, return_weights=True
    )
    out1, w1 = drop(jax.random.key(1))
    out1b, _ = drop(jax.random.key(1))
    out2, _ = drop(jax.random.key(2))
    np.testing.assert_array_equal(out1, out1b)
    assert not np.allclose(out1, attention(q, k, v), atol=1e-3)
    assert not np.allclose(out1, out2, atol=1e-3)
    # The returned weights are the dropped ones that were applied to v.
    want = jnp.einsum("bhns,bhsd->bhnd", w1, v)
    np.testing.assert_allclose(out1, want, atol=tol(want, S))
    frac_zero = float(jnp.mean(w1 == 0))
    assert 0.35 < frac_zero < 0.65  # rate 0.5 over 210 entries: ±4 standard deviations


def test_dropout_is_unbiased(rng):
    q, k, v = qkv(rng, b=(1,), h=2, kv=2, n=3, s=5)
    _, w = attention(q, k, v, return_weights=True)
    keys = jax.random.split(jax.random.key(0), 4000)
    dropped = jax.jit(jax.vmap(  # one program (eager, each batched operation compiles)
        lambda key: attention(q, k, v, dropout_rate=0.3, dropout_rng=key, deterministic=False, return_weights=True)[1]
    ))(keys)
    # Each entry is w/0.7 with probability 0.7: std of the mean <= 0.66/sqrt(4000) ~ 0.01.
    np.testing.assert_allclose(jnp.mean(dropped, axis=0), w, atol=0.05)


# ------------------------------------------------------------------------- retracing


def test_jit_does_not_retrace_for_same_shapes(rng):
    chex.clear_trace_counter()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def f(q, k, v, mask):
        return attention(q, k, v, mask, is_causal=True)

    mask = random_mask(rng, (B, 1, N, S))
    f(*qkv(rng), mask)
    f(*qkv(rng), mask)  # new values, same shapes: no retrace
    with pytest.raises(AssertionError):
        f(*qkv(rng, n=N + 2), mask[..., :1, :])  # new shapes must retrace, and the check fires


# ------------------------------------------------------------------------ ValueErrors


def test_split_heads_errors(rng):
    with pytest.raises(ValueError, match=r"last dim 10 .* not divisible by num_heads=3"):
        split_heads(normal(rng, (B, N, 10)), 3)
    with pytest.raises(ValueError, match=r"rank 1 shape \(10,\)"):
        split_heads(normal(rng, (10,)), 2)
    with pytest.raises(ValueError, match=r"rank 2 shape \(5, 6\)"):
        combine_heads(normal(rng, (5, 6)))


def test_attention_shape_errors(rng):
    q, k, v = qkv(rng)
    with pytest.raises(ValueError, match=r"q must have shape .*got shape \(5, 11\)"):
        attention(q[0, 0], k, v)
    with pytest.raises(ValueError, match=r"key length 7, value length 5"):
        attention(q, k, normal(rng, (B, H, 5, DV)))
    with pytest.raises(ValueError, match=r"num_heads=3 of q is not divisible by num_kv_heads=2"):
        attention(q, k[:, :2], v[:, :2])
    with pytest.raises(ValueError, match=r"head dims differ.*D=11.*D=13"):
        attention(q, normal(rng, (B, H, S, 13)), v)
    with pytest.raises(ValueError, match=r"batch dims differ"):
        attention(q, k[:1], v[:1])
    with pytest.raises(ValueError, match=r"same rank"):
        attention(q, k[0], v[0])


def test_attention_mask_and_bias_errors(rng):
    q, k, v = qkv(rng)
    bad = jnp.ones((N, S + 1), bool)
    with pytest.raises(ValueError, match=re.escape("mask of shape (5, 8) does not broadcast to (B…, H, N, S) = (2, 3, 5, 7)")):
        attention(q, k, v, bad)
    with pytest.raises(ValueError, match=re.escape("bias of shape (3, 5) does not broadcast to (B…, H, N, S) = (2, 3, 5, 7)")):
        attention(q, k, v, bias=jnp.ones((3, 5)))
    with pytest.raises(ValueError, match=r"mask must be boolean.*float32"):
        attention(q, k, v, jnp.ones((N, S)))
    with pytest.raises(ValueError, match=r"kv_lengths of shape \(3,\)"):
        attention(q, k, v, kv_lengths=jnp.array([1, 2, 3]))
    with pytest.raises(ValueError, match=r"\(B, S\), got \(2, 3, 7\)"):
        padding_mask(jnp.ones((2, 3, 7), bool))


def test_attention_option_errors(rng):
    q, k, v = qkv(rng)
    with pytest.raises(ValueError, match=r"dropout_rate=0.25 with deterministic=False needs a dropout_rng"):
        attention(q, k, v, dropout_rate=0.25, deterministic=False)
    with pytest.raises(ValueError, match=r"dropout_rate must be in \[0, 1\), got 1.5"):
        attention(q, k, v, dropout_rate=1.5)
    with pytest.raises(ValueError, match=r"implementation must be one of .*got 'flash'"):
        attention(q, k, v, implementation="flash")
    with pytest.raises(ValueError, match=r"return_weights=True needs implementation='xla'"):
        attention(q, k, v, implementation="blockwise", return_weights=True)
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match=r"implementation='cudnn' needs a GPU"):
            attention(q, k, v, implementation="cudnn")


def test_auto_implementation_on_small_inputs_matches_xla(rng):
    q, k, v = qkv(rng)
    want = attention(q, k, v, implementation="xla", is_causal=True)
    np.testing.assert_allclose(attention(q, k, v, implementation="auto", is_causal=True), want, atol=tol(want))


# ---------------------------------------------------------------------------------
# Bad inputs that once escaped as raw errors, batch size 0, strict dtype promotion.
# ---------------------------------------------------------------------------------


def test_split_and_combine_heads_reject_non_arrays():
    with pytest.raises(TypeError, match="split_heads expects an array .* got list"):
        split_heads([[1.0, 2.0]], 1)
    with pytest.raises(TypeError, match="combine_heads expects an array .* got list"):
        combine_heads([[[1.0]]])


def test_lengths_mask_rejects_negative_s():
    with pytest.raises(ValueError, match="s=-1"):
        lengths_mask(jnp.array([1, 2]), s=-1)


def test_run_blockwise_takes_only_a_description(rng):
    """The internal entry point; the public `blockwise_attention` is `attention`'s
    blockwise path (tests/core/test_bad_inputs.py)."""
    from jax_mha.paths.blockwise import run_blockwise

    q = normal(rng, (B, H, N, D))
    with pytest.raises(TypeError, match="mask"):  # the keyword form: a one-line TypeError naming it
        run_blockwise(q, q, q, mask=jnp.ones((N, N)), scale=1.0)
    with pytest.raises(TypeError, match="Visibility .* got dict"):
        run_blockwise(q, q, q, {"is_causal": True}, scale=1.0)


@pytest.mark.parametrize("implementation", ["xla", "blockwise", "auto"])
@pytest.mark.parametrize("return_weights", [False, True])
def test_batch_size_zero_returns_the_empty_result(rng, implementation, return_weights):
    if implementation == "blockwise" and return_weights:
        pytest.skip("the blockwise path never returns weights")
    q, k = jnp.zeros((0, H, N, D)), jnp.zeros((0, 1, S, D))
    kw = dict(is_causal=True, kv_lengths=jnp.zeros((0,), jnp.int32), q_segment_ids=jnp.zeros((0, N), jnp.int32),
              kv_segment_ids=jnp.zeros((0, S), jnp.int32))
    result = attention(q, k, k, implementation=implementation, return_weights=return_weights, **kw)
    out = result[0] if return_weights else result
    chex.assert_shape(out, (0, H, N, D))
    if return_weights:
        chex.assert_shape(result[1], (0, H, N, S))
    grad = jax.grad(lambda q: jnp.sum(attention(q, k, k, implementation=implementation, **kw)))(q)
    chex.assert_shape(grad, q.shape)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("implementation", ["xla", "blockwise", "weights"])
def test_strict_dtype_promotion_works_on_every_path(rng, dtype, implementation, np_attention):
    q, k, v = (normal(rng, shape, dtype) for shape in ((B, H, N, D), (B, 1, S, D), (B, 1, S, DV)))
    bias = normal(rng, (N, S), dtype)
    ids = jnp.asarray(np.sort(rng.integers(0, 2, (B, N))))
    kv_ids = jnp.asarray(np.sort(rng.integers(0, 2, (B, S))))
    kw = dict(bias=bias, is_causal=True, local_window_size=(3, None), kv_lengths=jnp.array([S, 4]),
              q_segment_ids=ids, kv_segment_ids=kv_ids)
    path = dict(implementation="xla", return_weights=True) if implementation == "weights" else dict(
        implementation=implementation)
    # Jitted (the promotion mode is read while tracing): op-by-op it took 8-12 s a case.
    with jax.numpy_dtype_promotion("strict"):
        result = jax.jit(lambda q, k, v: attention(q, k, v, **kw, **path))(q, k, v)
        grads = jax.jit(jax.grad(lambda q, k, v, b: jnp.sum(attention(q, k, v, **{**kw, "bias": b}, implementation=path[
            "implementation"]).astype(jnp.float32)), argnums=(0, 1, 2, 3)))(q, k, v, bias)
    out = result[0] if implementation == "weights" else result
    assert out.dtype == jnp.dtype(dtype)
    assert all(g.dtype == jnp.dtype(dtype) and bool(jnp.all(jnp.isfinite(g))) for g in grads)
    f64 = lambda x: np.asarray(x, np.float64)
    pos = np.arange(N)[:, None] + S - N
    key = np.arange(S)[None, :]
    allowed = (key <= pos) & (key >= pos - 3) & (key < np.array([S, 4])[:, None, None, None])
    allowed = allowed & (f64(ids)[:, None, :, None] == f64(kv_ids)[:, None, None, :])
    expected, _ = np_attention(f64(q), f64(k), f64(v), mask=allowed, bias=f64(bias))
    if dtype == "float32":
        np.testing.assert_allclose(f64(out), expected, atol=tol(expected))
    else:
        np.testing.assert_allclose(f64(out), expected, atol=3e-2, rtol=3e-2)


# ---------------------------------------------------------------------------------
# "auto" by platform, and the dispatch point of the Pallas kernels.
# ---------------------------------------------------------------------------------


