"""Bad inputs found by trying the library as a new user would: each is a one-line
`ValueError`/`TypeError` naming the argument, never a raw `ZeroDivisionError`, an
MLIR/XLA error or a `KeyError`; and empty batches return the empty result on every path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import f32_tolerance
from flax import nnx

from jax_mha import FeedForward, MultiHeadAttention, TransformerBlock, attention, combine_heads, split_heads
from jax_mha import nnx as jax_mha_nnx
from jax_mha.functional import blockwise_attention, lengths_mask

X = jnp.ones((2, 5, 12))  # (B, N, d_model)


def one_line(excinfo, *names):
    message = str(excinfo.value)
    assert "\n" not in message, message
    for name in names:
        assert name in message, (name, message)


@pytest.mark.parametrize(
    "options, names",
    [
        (dict(d_model=0), ["d_model", "0"]),
        (dict(d_model=-4), ["d_model", "-4"]),
        (dict(out_features=0), ["out_features", "0"]),
        (dict(num_kv_heads=-1), ["num_kv_heads", "-1"]),
    ],
)
def test_attention_module_sizes(options, names):
    with pytest.raises(ValueError) as excinfo:
        MultiHeadAttention(num_heads=3, **options).init(jax.random.key(0), X)
    one_line(excinfo, *names)


@pytest.mark.parametrize("num_heads", [0, -3])
def test_attention_module_head_count(num_heads):
    with pytest.raises(ValueError) as excinfo:
        MultiHeadAttention(num_heads=num_heads)
    one_line(excinfo, "num_heads", str(num_heads))


def test_sizes_must_be_ints():
    with pytest.raises(TypeError) as excinfo:
        MultiHeadAttention(num_heads=3, d_model=12.0)
    one_line(excinfo, "d_model", "12.0")
    with pytest.raises(TypeError) as excinfo:
        TransformerBlock(num_heads=True, d_ff=8)
    one_line(excinfo, "num_heads", "True")


@pytest.mark.parametrize("d_ff", [0, -3])
def test_feed_forward_width(d_ff):
    for build in (lambda: TransformerBlock(num_heads=3, d_ff=d_ff), lambda: FeedForward(d_ff=d_ff)):
        with pytest.raises(ValueError) as excinfo:
            build().init(jax.random.key(0), X)
        one_line(excinfo, "d_ff", str(d_ff))
    with pytest.raises(ValueError) as excinfo:
        jax_mha_nnx.TransformerBlock(12, 3, d_ff, rngs=nnx.Rngs(0))
    one_line(excinfo, "d_ff", str(d_ff))


def test_nnx_sizes():
    with pytest.raises(ValueError) as excinfo:
        jax_mha_nnx.MultiHeadAttention(num_heads=3, in_features=12, d_model=0, rngs=nnx.Rngs(0))
    one_line(excinfo, "d_model", "0")
    with pytest.raises(ValueError) as excinfo:
        jax_mha_nnx.MultiHeadAttention(num_heads=3, in_features=12, out_features=-2, rngs=nnx.Rngs(0))
    one_line(excinfo, "out_features", "-2")


@pytest.mark.parametrize("value", [[[1.0, 2.0]], (1.0, 2.0), 3.0])
def test_heads_need_arrays(value):
    with pytest.raises(TypeError) as excinfo:
        split_heads(value, 2)
    one_line(excinfo, "split_heads", type(value).__name__)
    with pytest.raises(TypeError) as excinfo:
        combine_heads(value)
    one_line(excinfo, "combine_heads", type(value).__name__)


def test_heads_accept_numpy():
    x = np.arange(24.0).reshape(2, 12)
    np.testing.assert_array_equal(combine_heads(split_heads(x, 3)), x)


def test_lengths_mask_negative_length():
    with pytest.raises(ValueError) as excinfo:
        lengths_mask(jnp.array([2]), s=-1)
    one_line(excinfo, "s", "-1")


def test_blockwise_attention_is_attention():
    """The public blockwise entry point validates like `attention` and equals it."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 3, 5, 4)), jnp.float32)
    k = v = jnp.asarray(rng.standard_normal((2, 3, 7, 4)), jnp.float32)
    with pytest.raises(TypeError) as excinfo:
        blockwise_attention(q, k, v, mask=jnp.ones((5, 7)))  # float, not bool
    one_line(excinfo, "mask")
    mask = jnp.asarray(rng.random((5, 7)) > 0.3)
    got = blockwise_attention(q, k, v, mask=mask, is_causal=True, query_block_size=2, key_block_size=3)
    want = attention(q, k, v, mask=mask, is_causal=True, implementation="xla")
    np.testing.assert_allclose(got, want, atol=f32_tolerance(terms=4 + 2 * 7, magnitude=want))  # sums over D and S


@pytest.mark.parametrize("path", ["xla", "blockwise", "auto"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_empty_batch_returns_the_empty_result(path, is_causal):
    q = k = v = jnp.ones((0, 3, 5, 4))
    out = attention(q, k, v, is_causal=is_causal, implementation=path)
    assert out.shape == (0, 3, 5, 4)
    grads = jax.grad(lambda q: attention(q, k, v, is_causal=is_causal, implementation=path).sum())(q)
    assert grads.shape == (0, 3, 5, 4)
    if path != "blockwise":  # which refuses return_weights whatever the batch
        out, weights = attention(q, k, v, is_causal=is_causal, implementation=path, return_weights=True)
        assert out.shape == (0, 3, 5, 4) and weights.shape == (0, 3, 5, 5)


def test_zero_heads_are_refused():
    q = k = v = jnp.ones((2, 0, 5, 4))
    with pytest.raises(ValueError) as excinfo:
        attention(q, k, v)
    one_line(excinfo, "num_heads=0")


def test_module_with_empty_batch():
    x = jnp.ones((0, 5, 12))
    mha = MultiHeadAttention(num_heads=3, implementation="blockwise")
    params = mha.init(jax.random.key(0), jnp.ones((1, 5, 12)))
    assert mha.apply(params, x, is_causal=True).shape == (0, 5, 12)
