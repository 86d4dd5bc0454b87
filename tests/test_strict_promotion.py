"""The NNX modules and every attention path under `jax_numpy_dtype_promotion="strict"`.

Strict promotion (equinox's own test suite runs in it) turns every implicit mixing of
dtypes, e.g. float16 activations times float32 scales, into an error. The NNX module
suite is collected again here and runs whole under it (tests/test_modules.py runs the
linen suite under both modes itself); the half-precision cases below check that strict
mode changes no value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

# The whole NNX suite, re-collected in this file: the autouse fixture below runs each
# of its tests under strict promotion.
from test_nnx import *  # noqa: E402,F401,F403

from jax_mha import MultiHeadAttention, TransformerBlock, attention
from jax_mha import nnx as jax_mha_nnx


@pytest.fixture(autouse=True)
def strict_promotion():
    with jax.numpy_dtype_promotion("strict"):
        yield


HALF = [jnp.float16, jnp.bfloat16, jnp.float32]
PATHS = ["xla", "blockwise"]


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("path", PATHS)
def test_attention_paths_in_strict_mode_match_standard(dtype, path):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 6, 5, 4)), dtype)  # (B, H, N, D)
    k, v = (jnp.asarray(rng.standard_normal((2, 3, 7, 4)), dtype) for _ in range(2))  # GQA, S = 7
    bias = jnp.asarray(rng.standard_normal((5, 7)), dtype)

    def loss(q, k, v):
        out = attention(q, k, v, bias=bias, is_causal=True, kv_lengths=jnp.array([7, 3]), implementation=path)
        return out.astype(jnp.float32).sum(), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    with jax.numpy_dtype_promotion("standard"):
        (_, want), want_grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    for g, w in zip(grads, want_grads):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("pre_norm", [False, True])
def test_blocks_in_strict_mode_match_standard(dtype, pre_norm):
    """linen and NNX blocks with QK-norm and RoPE: float32 parameters, `dtype` compute."""
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 5, 12)), dtype)
    options = dict(dtype=dtype, pre_norm=pre_norm, normalize_qk=True, rope=True)
    linen = TransformerBlock(num_heads=3, d_ff=10, **options)
    params = linen.init(jax.random.key(0), x)
    y = linen.apply(params, x, is_causal=True)
    block = jax_mha_nnx.TransformerBlock(12, 3, 10, **options, rngs=nnx.Rngs(0))
    z = block(x, is_causal=True)
    with jax.numpy_dtype_promotion("standard"):
        y_standard = linen.apply(params, x, is_causal=True)
        z_standard = block(x, is_causal=True)
    assert y.dtype == z.dtype == dtype
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_standard, np.float32))
    np.testing.assert_array_equal(np.asarray(z, np.float32), np.asarray(z_standard, np.float32))


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: jnp.dtype(d).name)
def test_attention_module_in_half_precision_parameters(dtype):
    """Parameters and compute both in `dtype` (what equinox's strict suite builds).

    Without QK-norm: flax's LayerNorm with half-precision parameters cannot run under
    strict promotion (its statistics promote them against float32 internally).
    """
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 5, 12)), dtype)
    mha = MultiHeadAttention(num_heads=3, num_kv_heads=1, dtype=dtype, param_dtype=dtype, rope=True)
    params = mha.init(jax.random.key(0), x)
    y, weights = mha.apply(params, x, is_causal=True, return_weights=True)
    assert y.dtype == weights.dtype == dtype
    assert bool(jnp.all(jnp.isfinite(y.astype(jnp.float32))))
