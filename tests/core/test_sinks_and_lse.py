"""Attention sinks, the log-sum-exp out (`return_residual`) and `merge_attentions`,
against the float64 reference of tests/conftest.py (a sink is one more key there,
never masked, of value zero)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import f32_tolerance, jax_reference, normal, np_allowed, x64
from flax import nnx

import jax_mha
import jax_mha.nnx
from jax_mha import attention, merge_attentions

B, H, K, N, S, D = 2, 6, 3, 7, 11, 5
SINKS = np.array([0.3, -1.0, 2.0, 0.0, -0.5, 1.0])
# The float32 sums, for the tolerances: the logits over D, the softmax sum (the lse)
# and weights @ v over the S keys; backward adds sums over D, the keys, the rows of
# the H/K query heads that share a key head, and (for the sinks) the batch's rows.
LSE_TERMS = D + S
FORWARD_TERMS = D + 2 * S
BACKWARD_TERMS = FORWARD_TERMS + D + S + N * (H // K) + B * N


def qkv(rng, dtype=jnp.float32):
    return normal(rng, (B, H, N, D), dtype), normal(rng, (B, K, S, D), dtype), normal(rng, (B, K, S, D), dtype)


def reference(q, k, v, allowed, sinks=None):
    with x64():
        f64 = lambda x: None if x is None else jnp.asarray(x, jnp.float64)
        return jax_reference(f64(q), f64(k), f64(v), allowed=allowed, sinks=f64(sinks), return_lse=True)


@pytest.mark.parametrize("path", ["xla", "weights", "blockwise"])
def test_sinks_and_lse_match_the_reference(rng, path):
    q, k, v = qkv(rng)
    allowed = np_allowed((B, H, N, S), is_causal=True, kv_lengths=np.array([S, 3]))
    blocks = dict(query_block_size=4, key_block_size=4) if path == "blockwise" else {}
    kw = dict(is_causal=True, kv_lengths=jnp.array([S, 3]), sinks=jnp.asarray(SINKS, jnp.float32),
              return_residual=True, implementation="blockwise" if path == "blockwise" else "xla",
              return_weights=path == "weights", **blocks)
    result = attention(q, k, v, **kw)
    out, lse = result[0], result[-1]
    want_out, want_lse = reference(q, k, v, allowed, SINKS)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out),
                               atol=f32_tolerance(terms=FORWARD_TERMS, magnitude=want_out))
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse),
                               atol=f32_tolerance(terms=LSE_TERMS, magnitude=want_lse))
    assert lse.dtype == jnp.float32 and lse.shape == (B, H, N)
    if path == "weights":  # the sink takes its share: rows sum to less than one
        assert bool(jnp.all(result[1].sum(-1) < 1.0))


def test_zero_sinks_are_the_off_by_one_softmax(rng):
    q, k, v = qkv(rng)
    _, weights = attention(q, k, v, sinks=jnp.zeros(H), return_weights=True)
    logits = np.einsum("bhnd,bhsd->bhns", np.asarray(q, np.float64), np.repeat(np.asarray(k, np.float64), 2, 1))
    e = np.exp(logits / np.sqrt(D))
    np.testing.assert_allclose(np.asarray(weights), e / (1.0 + e.sum(-1, keepdims=True)),
                               atol=f32_tolerance(terms=LSE_TERMS, magnitude=1.0))


@pytest.mark.parametrize("path", ["xla", "blockwise"])
def test_gradients_reach_the_sinks_and_flow_through_lse(rng, path):
    q, k, v = qkv(rng)
    allowed = np_allowed((B, H, N, S), window=(3, 1))
    w = normal(rng, (B, H, N, D))

    def loss(attn):
        def f(q, k, v, sinks):
            out, lse = attn(q, k, v, sinks)
            return jnp.sum(out * w.astype(out.dtype)) + jnp.sum(jnp.sin(lse))
        return f

    ours = loss(lambda q, k, v, s: attention(q, k, v, local_window_size=(3, 1), sinks=s, return_residual=True,
                                             implementation=path))
    got = jax.grad(ours, argnums=(0, 1, 2, 3))(q, k, v, jnp.asarray(SINKS, jnp.float32))
    with x64():
        ref = loss(lambda q, k, v, s: jax_reference(q, k, v, allowed=allowed, sinks=s, return_lse=True))
        want = jax.grad(ref, argnums=(0, 1, 2, 3))(*(jnp.asarray(x, jnp.float64) for x in (q, k, v, SINKS)))
    for g, h in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(h), atol=f32_tolerance(terms=BACKWARD_TERMS, magnitude=h))


def test_empty_rows_lse_and_padding_rows(rng):
    q, k, v = qkv(rng)
    out, lse = attention(q, k, v, kv_lengths=jnp.array([S, 0]), q_lengths=jnp.array([4, N]), return_residual=True)
    assert np.all(np.isneginf(np.asarray(lse[1])))  # sequence 1 sees no key
    assert np.all(np.isneginf(np.asarray(lse[0, :, 4:])))  # padding queries
    assert np.all(np.isfinite(np.asarray(lse[0, :, :4])))
    _, lse_sink = attention(q, k, v, kv_lengths=jnp.array([S, 0]), sinks=jnp.asarray(SINKS, jnp.float32),
                            return_residual=True)
    np.testing.assert_allclose(np.asarray(lse_sink[1]), np.broadcast_to(SINKS[:, None], (H, N)), atol=1e-6)


@pytest.mark.parametrize("path", ["xla", "blockwise"])
def test_merge_attentions_over_disjoint_key_sets_is_exact(rng, path):
    """Keys split three ways (one part empty for sequence 1), each part's (out, lse),
    merged: the attention over all keys, values and gradients."""
    q, k, v = qkv(rng)
    blocks = dict(query_block_size=4, key_block_size=4) if path == "blockwise" else {}
    parts_of = (np.arange(S) % 3)  # key j belongs to part j % 3

    def merged(q, k, v):
        parts = []
        for p in range(3):
            lengths = jnp.array([S, S if p < 2 else 0])
            keep = jnp.asarray(parts_of == p)
            ids_q = jnp.zeros((B, N), jnp.int32)
            ids_kv = jnp.where(keep, 0, 1)[None].repeat(B, 0).astype(jnp.int32)  # keys of other parts: another id
            parts.append(attention(q, k, v, is_causal=True, kv_lengths=lengths, q_segment_ids=ids_q,
                                   kv_segment_ids=ids_kv, return_residual=True, implementation=path, **blocks))
        return merge_attentions(parts)

    out, lse = jax.jit(merged)(q, k, v)  # jitted: eager, each operation would compile
    allowed = np_allowed((B, H, N, S), is_causal=True)
    allowed[1] &= np.broadcast_to(parts_of < 2, allowed[1].shape)  # sequence 1: part 2 is empty
    want_out, want_lse = reference(q, k, v, allowed)
    # Each part's sums, then the merge's over the 3 parts.
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out),
                               atol=f32_tolerance(terms=FORWARD_TERMS + 3, magnitude=want_out))
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse),
                               atol=f32_tolerance(terms=LSE_TERMS + 3, magnitude=want_lse))
    g = jax.jit(jax.grad(lambda q: jnp.sum(merged(q, k, v)[0] ** 2)))(q)
    with x64():
        f64 = lambda x: jnp.asarray(x, jnp.float64)
        g_want = jax.jit(jax.grad(lambda q: jnp.sum(jax_reference(q, f64(k), f64(v), allowed=allowed) ** 2)))(f64(q))
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_want),
                               atol=f32_tolerance(terms=BACKWARD_TERMS + 3, magnitude=g_want))


def test_merge_of_all_empty_parts_is_zero():
    out = jnp.ones((2, 3, 4))
    lse = jnp.full((2, 3), -jnp.inf)
    merged, merged_lse = merge_attentions([(out, lse), (2 * out, lse)])
    assert np.all(np.asarray(merged) == 0) and np.all(np.isneginf(np.asarray(merged_lse)))


def test_bad_sinks_and_parts_raise_naming_them(rng):
    q, k, v = qkv(rng)
    with pytest.raises(ValueError, match=r"sinks must have shape \(H,\) = \(6,\).*\(5,\)"):
        attention(q, k, v, sinks=jnp.zeros(5))
    with pytest.raises(TypeError, match="sinks must be floating"):
        attention(q, k, v, sinks=jnp.zeros(H, jnp.int32))
    with pytest.raises(ValueError, match="at least one"):
        merge_attentions([])
    with pytest.raises(ValueError, match=r"part 1 of merge_attentions must be an \(out, lse\) pair"):
        merge_attentions([(q, q[..., 0]), q])
    with pytest.raises(ValueError, match="part 0: out"):
        merge_attentions([(q, q)])


def test_modules_own_a_sinks_parameter(rng):
    x = normal(rng, (B, N, 12))
    linen = jax_mha.MultiHeadAttention(num_heads=3, sinks=True)
    params = linen.init(jax.random.key(0), x)
    np.testing.assert_array_equal(np.asarray(params["params"]["sinks"]), np.zeros(3))
    params = jax.tree_util.tree_map(lambda a: a + 0.3, params)
    ours = jax_mha.nnx.MultiHeadAttention(3, 12, sinks=True, rngs=nnx.Rngs(0))
    ours = jax_mha.nnx.from_linen_params(ours, params["params"])
    want = np.asarray(jax.jit(linen.apply)(params, x))  # projections over d_model=12 in and out, attention's sums
    np.testing.assert_allclose(np.asarray(ours(x)), want, atol=f32_tolerance(terms=4 * 12 + 4 + 2 * N, magnitude=want))
    g = jax.jit(jax.grad(lambda p: jnp.sum(linen.apply(p, x) ** 2)))(params)
    assert float(jnp.abs(g["params"]["sinks"]).sum()) > 0
    with pytest.raises(ValueError, match="sinks"):  # weights with sinks into a module without them
        jax_mha.MultiHeadAttention(num_heads=3).apply(params, x)
