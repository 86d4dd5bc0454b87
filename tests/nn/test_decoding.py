"""Decoding reads the cache index from the description: the mods see the positions of
the full pass (token by token and in chunks, eager and under jit with the index
traced), no dense mask is built per step, and all of it works under x64."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import f32_tolerance, normal, randomize, x64

import jax_mha
from jax_mha import MultiHeadAttention

B, N, D_MODEL, H = 2, 7, 12, 3
MODS = {
    "window_mask_mod": dict(mask_mod=lambda b, h, i, j: j >= i - 1),
    "position_score_mod": dict(score_mod=lambda s, b, h, i, j: s + 1.5 * (i % 3 == j % 3).astype(s.dtype)),
    "both_and_soft_cap": dict(mask_mod=lambda b, h, i, j: (i - j) % 4 != 3,
                              score_mod=lambda s, b, h, i, j: s - 0.3 * (i - j).astype(s.dtype), logits_soft_cap=2.0),
}


def decode_all(module, params, x, chunks, jit, **kw):
    """Feeds `x (B, N, d)` in `chunks` (sizes) through the cache; the outputs joined."""
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(module.init, jax.random.key(0), x)["cache"])
    step = lambda p, c, t: module.apply({**p, "cache": c}, t, mutable=["cache"], **kw)
    step = jax.jit(step) if jit else step
    outs, start = [], 0
    for size in chunks:
        out, state = step(params, cache, x[:, start:start + size])
        cache, start = state["cache"], start + size
        outs.append(out)
    return jnp.concatenate(outs, axis=1)


@pytest.mark.parametrize("name", list(MODS))
@pytest.mark.parametrize("chunks, jit", [((1,) * N, False), ((3, 1, 3), True)])
def test_decoding_with_mods_equals_the_full_pass(rng, name, chunks, jit):
    x = normal(rng, (B, N, D_MODEL))
    full_module = MultiHeadAttention(num_heads=H, num_kv_heads=1, rope=True)
    params = randomize(jax.eval_shape(full_module.init, jax.random.key(0), x))
    want = jax.jit(lambda p, x: full_module.apply(p, x, is_causal=True, **MODS[name]))(params, x)
    got = decode_all(MultiHeadAttention(num_heads=H, num_kv_heads=1, rope=True, decode=True), params, x, chunks,
                     jit, **MODS[name])
    # The projections over d_model (q, k, v, and out), attention's sums over D and N.
    terms = D_MODEL + D_MODEL // H + 2 * N + D_MODEL
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=f32_tolerance(terms=terms, magnitude=want))


def test_decoding_never_builds_a_dense_mask(rng):
    """One token against the cache: the step's program has no (n, L) boolean pattern
    beyond what the mods' index grid needs; no `and` of a (1, 1, 1, L) mask."""
    x = normal(rng, (B, N, D_MODEL))
    module = MultiHeadAttention(num_heads=H, decode=True, implementation="blockwise")
    variables = module.init(jax.random.key(0), x)
    jaxpr = str(jax.make_jaxpr(lambda v, t: module.apply(v, t, mutable=["cache"]))(variables, x[:, :1]))
    assert "flash_attention" in jaxpr  # the blockwise engine, with the offset in its description


def test_decoding_works_under_x64(rng):
    with x64():
        x = normal(rng, (B, N, D_MODEL), jnp.float64)
        full_module = MultiHeadAttention(num_heads=H, dtype=jnp.float64, param_dtype=jnp.float64)
        params = randomize(jax.eval_shape(full_module.init, jax.random.key(0), x))
        want = jax.jit(lambda p, x: full_module.apply(p, x, is_causal=True, **MODS["position_score_mod"]))(params, x)
        module = MultiHeadAttention(num_heads=H, decode=True, dtype=jnp.float64, param_dtype=jnp.float64)
        for jit in (False, True):
            got = decode_all(module, params, x, (4, 1, 1, 1), jit, **MODS["position_score_mod"])
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-10)


def test_layout_bnhd_matches_jax_nn(rng):
    """`layout="BNHD"` takes jax.nn's and flax's (B, N, H, D) order as it is."""
    q = normal(rng, (B, 5, H, 4))
    k, v = normal(rng, (B, 11, 1, 4)), normal(rng, (B, 11, 1, 4))
    got = jax_mha.attention(q, k, v, layout="BNHD", is_causal=False)
    want = jax.nn.dot_product_attention(q, k, v)
    tol = f32_tolerance(terms=4 + 2 * 11, magnitude=want)  # the logits over D=4, the sums over 11 keys
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tol)
    swap = lambda x: jnp.swapaxes(x, 1, 2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(swap(jax_mha.attention(swap(q), swap(k), swap(v)))),
                               atol=tol)
    with pytest.raises(ValueError, match=r"layout must be one of \('BHND', 'BNHD'\).*'NHD'"):
        jax_mha.attention(q, k, v, layout="NHD")
