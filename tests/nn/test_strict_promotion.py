"""The modules and blocks under `jax_numpy_dtype_promotion="strict"` (every attention
path is checked under it against float64 in tests/core/test_functional.py).

Strict promotion (equinox's own test suite runs in it) turns every implicit mixing of
dtypes, e.g. float16 activations times float32 scales, into an error. The linen and NNX
suites (tests/nn/test_modules.py, tests/nn/test_nnx.py) run whole under it; the cases
below check half precision, and that strict mode changes no value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import randomize
from flax import nnx

from jax_mha import MultiHeadAttention, TransformerBlock
from jax_mha import nnx as jax_mha_nnx


@pytest.fixture(autouse=True)
def strict_promotion():
    with jax.numpy_dtype_promotion("strict"):
        yield


HALF = [jnp.float16, jnp.bfloat16, jnp.float32]


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("pre_norm", [False, True])
def test_blocks_in_strict_mode_match_standard(dtype, pre_norm):
    """linen and NNX blocks with QK-norm and RoPE: float32 parameters, `dtype` compute."""
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 5, 12)), dtype)
    options = dict(dtype=dtype, pre_norm=pre_norm, normalize_qk=True, rope=True)
    linen = TransformerBlock(num_heads=3, d_ff=10, **options)
    params = randomize(jax.eval_shape(linen.init, jax.random.key(0), x))  # NumPy draws: nothing to compile
    block = jax_mha_nnx.TransformerBlock(12, 3, 10, **options, rngs=nnx.Rngs(0))
    # Jitted (the promotion mode is read while tracing, so each mode compiles its own).
    run = lambda: (jax.jit(lambda p, x: linen.apply(p, x, is_causal=True))(params, x),
                   nnx.jit(lambda m, x: m(x, is_causal=True))(block, x))
    y, z = run()
    with jax.numpy_dtype_promotion("standard"):
        y_standard, z_standard = run()
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
    params = randomize(jax.eval_shape(mha.init, jax.random.key(0), x))
    y, weights = jax.jit(lambda p, x: mha.apply(p, x, is_causal=True, return_weights=True))(params, x)
    assert y.dtype == weights.dtype == dtype
    assert bool(jnp.all(jnp.isfinite(y.astype(jnp.float32))))
