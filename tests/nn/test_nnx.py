"""Tests for `jax_mha.nnx`: the NNX twins equal the linen modules on identical weights,
decode with their cache, sow, drop out, and convert parameters both ways; every test
under strict dtype promotion, as tests/nn/test_modules.py runs the linen suite."""

from __future__ import annotations

import re

import chex
import flax.errors
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import f32_tolerance, normal, randomize
from flax import nnx

import jax_mha
from jax_mha import nnx as jnnx

# B, N, d_model: primes where they can be; H=6 heads of D=6 (RoPE needs D even).
B, N, D_MODEL, H = 2, 5, 36, 6
# The float32 sums of a module, for the tolerances: the q/k/v projections over
# d_model, the logits over D, the softmax sum and weights @ v over up to 13 keys, the
# output projection; a block adds two layer norms (mean and variance) and its
# feed-forward layer (d_model, then d_ff 13).
MODULE_TERMS = D_MODEL + D_MODEL // H + 2 * 13 + D_MODEL
BLOCK_TERMS = MODULE_TERMS + 2 * 2 * D_MODEL + D_MODEL + 13


@pytest.fixture(autouse=True)
def strict_promotion():
    """Strict promotion (equinox's suite runs in it) turns every implicit mixing of
    dtypes into an error; what runs under it is the same program under standard
    promotion (tests/nn/test_strict_promotion.py checks the values agree)."""
    with jax.numpy_dtype_promotion("strict"):
        yield


def tol(want, terms=MODULE_TERMS):
    """`f32_tolerance` at `want`'s size."""
    return f32_tolerance(terms=terms, magnitude=want)


def randomize_module(module, seed=0):
    """Fresh N(0, 0.3²) parameters in place (zero-initialised biases then matter):
    conftest's `randomize` on the module's linen-layout parameters."""
    params = randomize(jnnx.to_linen_params(module), seed)
    return jnnx.from_linen_params(module, params)


MHA_OPTIONS = dict(num_kv_heads=2, qkv_bias=True, normalize_qk=True, rope=True, add_bias_kv=True,
                   add_zero_attn=True, out_features=7)


def test_multi_head_attention_equals_linen_on_identical_weights(rng):
    query, memory = normal(rng, (B, N, D_MODEL)), normal(rng, (B, 11, 13))
    ours = randomize_module(jnnx.MultiHeadAttention(H, D_MODEL, in_kv_features=13, rngs=nnx.Rngs(0), **MHA_OPTIONS))
    linen = jax_mha.MultiHeadAttention(num_heads=H, **MHA_OPTIONS)
    params = jnnx.to_linen_params(ours)
    expected_shapes = jax.eval_shape(linen.init, jax.random.key(0), query, memory)["params"]
    chex.assert_trees_all_equal_shapes(params, expected_shapes)

    kv_lengths = jnp.array([11, 6])
    # One jit each: cheaper than running every primitive of this many options un-jitted.
    out, weights = nnx.jit(lambda m: m(query, memory, kv_lengths=kv_lengths, return_weights=True))(ours)
    ref, ref_w = jax.jit(lambda p: linen.apply({"params": p}, query, memory, kv_lengths=kv_lengths,
                                               return_weights=True))(params)
    np.testing.assert_allclose(out, ref, atol=tol(ref))
    np.testing.assert_allclose(weights, ref_w, atol=tol(1.0))
    chex.assert_shape(out, (B, N, 7))


@pytest.mark.parametrize("pre_norm", [False, True])
def test_transformer_block_equals_linen_and_loads_linen_weights(rng, pre_norm):
    x = normal(rng, (B, N, D_MODEL))
    linen = jax_mha.TransformerBlock(num_heads=H, d_ff=13, num_kv_heads=3, pre_norm=pre_norm, rope=True)
    shapes = jax.eval_shape(linen.init, jax.random.key(0), x)["params"]
    params = jax.tree_util.tree_map(lambda s: 0.3 * rng.standard_normal(s.shape), shapes)
    block = jnnx.TransformerBlock(D_MODEL, H, 13, num_kv_heads=3, pre_norm=pre_norm, rope=True, rngs=nnx.Rngs(1))
    jnnx.from_linen_params(block, params)
    want = jax.jit(lambda p: linen.apply({"params": p}, x, is_causal=True))(params)
    np.testing.assert_allclose(nnx.jit(lambda m: m(x, is_causal=True))(block), want, atol=tol(want, BLOCK_TERMS))


def test_transformer_block_head_dim_equals_linen(rng):
    # 5 heads of size 7 on d_model 36: the attention is 35 wide, 5 does not divide 36.
    x = normal(rng, (B, N, D_MODEL))
    linen = jax_mha.TransformerBlock(num_heads=5, d_ff=13, head_dim=7)
    shapes = jax.eval_shape(linen.init, jax.random.key(0), x)["params"]
    params = jax.tree_util.tree_map(lambda s: 0.3 * rng.standard_normal(s.shape), shapes)
    block = jnnx.from_linen_params(jnnx.TransformerBlock(D_MODEL, 5, 13, head_dim=7, rngs=nnx.Rngs(1)), params)
    assert block.attention.query.kernel.shape == (D_MODEL, 35) and block.attention.out.kernel.shape == (35, D_MODEL)
    want = jax.jit(lambda p: linen.apply({"params": p}, x))(params)
    np.testing.assert_allclose(nnx.jit(lambda m: m(x))(block), want, atol=tol(want, BLOCK_TERMS))


@pytest.mark.parametrize("make", [
    lambda rngs: jnnx.MultiHeadAttention(H, D_MODEL, dropout_rate=0.5, rngs=rngs),
    lambda rngs: jnnx.FeedForward(D_MODEL, 7, dropout_rate=0.5, rngs=rngs),
    lambda rngs: jnnx.TransformerBlock(D_MODEL, H, 7, dropout_rate=0.5, rngs=rngs),
], ids=["mha", "ffn", "block"])
def test_dropout_without_a_dropout_stream_says_what_to_pass(rng, make):
    # Building with nnx.Rngs(params=...) and dropout_rate > 0 used to raise flax's
    # AttributeError/KeyError "No RngStream named 'dropout'" at construction.
    x = normal(rng, (B, N, D_MODEL))
    model = make(nnx.Rngs(params=0))
    msg = 'dropout_rate=0.5 with deterministic=False needs a "dropout" rng: build it with rngs=nnx.Rngs(params=..., '
    with pytest.raises(ValueError, match=re.escape(msg)):
        model(x, deterministic=False)
    model.train()
    with pytest.raises(ValueError, match=re.escape(msg)):
        model(x)
    if isinstance(model, jnnx.MultiHeadAttention):  # a stream given to the call is enough
        assert not np.allclose(model(x, rngs=nnx.Rngs(dropout=1)), model(x, deterministic=True), atol=1e-3)


def test_decoding_inside_a_plain_jax_transform_says_to_use_nnx_jit(rng):
    # It surfaced flax's TraceContextError "Cannot mutate Cache from a different trace level".
    x = normal(rng, (B, N, D_MODEL))
    decoder = jnnx.MultiHeadAttention(H, D_MODEL, decode=True, rngs=nnx.Rngs(0))
    decoder.init_cache(x.shape)
    with pytest.raises(ValueError, match=re.escape("which a plain jax transform cannot: use nnx.jit")) as caught:
        jax.jit(lambda token: decoder(token))(x[:, :1])
    assert isinstance(caught.value, flax.errors.TraceContextError)  # still caught as flax's error
    assert int(decoder.cache_index[...]) == 0  # nothing written
    nnx.jit(lambda m, token: m(token))(decoder, x[:, :1])
    assert int(decoder.cache_index[...]) == 1


def test_decoding_token_by_token_equals_causal_forward(rng):
    x = normal(rng, (B, N, D_MODEL))
    options = dict(num_kv_heads=2, rope=True, normalize_qk=True, rngs=nnx.Rngs(0))
    full = randomize_module(jnnx.MultiHeadAttention(H, D_MODEL, **options))
    decoder = jnnx.MultiHeadAttention(H, D_MODEL, decode=True, **options)
    jnnx.from_linen_params(decoder, jnnx.to_linen_params(full))
    with pytest.raises(ValueError, match=re.escape("decode=True needs a cache: call init_cache(input_shape) first")):
        decoder(x[:, :1])
    decoder.init_cache(x.shape)
    chex.assert_shape(decoder.cached_key[...], (B, 2, N, D_MODEL // H))  # (B, K, L, D)

    step = nnx.jit(lambda m, token: m(token))
    by_token = jnp.concatenate([step(decoder, x[:, t : t + 1]) for t in range(N)], axis=1)
    want = nnx.jit(lambda m, x: m(x, is_causal=True))(full, x)
    np.testing.assert_allclose(by_token, want, atol=tol(want))
    assert int(decoder.cache_index[...]) == N
    with pytest.raises(ValueError, match="decoding past the cache"):
        decoder(x[:, :1])


def test_sown_weights_and_dropout(rng):
    x = normal(rng, (B, N, D_MODEL))
    model = jnnx.MultiHeadAttention(H, D_MODEL, dropout_rate=0.5, sow_weights=True, rngs=nnx.Rngs(0))
    (plain, weights), sown = nnx.capture(model, nnx.Intermediate)(x, return_weights=True)  # no dropout before train()
    np.testing.assert_array_equal(sown["attention_weights"][0], weights)
    model.sow_weights = False  # sowing outside nnx.capture is deprecated in flax

    model.train()
    dropped = model(x)
    assert not np.allclose(dropped, plain, atol=1e-3)
    key = jax.random.key(3)
    np.testing.assert_array_equal(model(x, dropout_rng=key), model(x, dropout_rng=key))
    model.eval()
    np.testing.assert_array_equal(model(x, return_weights=True)[0], plain)


def test_parameter_conversion_errors():
    model = jnnx.MultiHeadAttention(H, D_MODEL, rngs=nnx.Rngs(0))
    params = jnnx.to_linen_params(model)
    params["query"]["kernel"] = params["query"]["kernel"][:, :-1]
    with pytest.raises(ValueError, match=re.escape("differ: [('query/kernel', (36, 35), (36, 36))]")):
        jnnx.from_linen_params(model, params)
    with pytest.raises(ValueError, match=re.escape("key has 7 features, the module was built for 36")):
        model(jnp.ones((B, N, D_MODEL)), jnp.ones((B, 3, 7)))
    with pytest.raises(ValueError, match=re.escape("num_heads=6 is not divisible by num_kv_heads=4")):
        jnnx.MultiHeadAttention(H, D_MODEL, num_kv_heads=4, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("rate", [2.0, 1.0, -0.1, float("nan"), True], ids=repr)
@pytest.mark.parametrize("make", [
    lambda r: jnnx.MultiHeadAttention(H, D_MODEL, dropout_rate=r, rngs=nnx.Rngs(0)),
    lambda r: jnnx.FeedForward(D_MODEL, 7, dropout_rate=r, rngs=nnx.Rngs(0)),
    lambda r: jnnx.TransformerBlock(D_MODEL, H, 7, dropout_rate=r, rngs=nnx.Rngs(0)),
], ids=["mha", "ffn", "block"])
def test_dropout_rate_outside_zero_one_raises_at_construction(make, rate):
    # A rate >= 1 used to give all-zero outputs in train(), silently.
    with pytest.raises(ValueError, match=re.escape(f"0 <= dropout_rate < 1, got {rate!r}")):
        make(rate)


def test_attention_dropout_rate_of_the_block_is_checked():
    with pytest.raises(ValueError, match=re.escape("0 <= attention_dropout_rate < 1, got 1.5")):
        jnnx.TransformerBlock(D_MODEL, H, 7, attention_dropout_rate=1.5, rngs=nnx.Rngs(0))


def test_segment_ids_and_decoding_with_them_match_linen(rng):
    """NNX takes `segment_ids` like linen; `init_cache(..., segment_ids=True)` keeps
    each cached token's segment, so token-by-token decoding equals the causal pass."""
    x = normal(rng, (B, N, D_MODEL))
    ids = jnp.array([[0, 0, 1, 1, 1], [2, 2, 2, 2, 9]])
    model = jnnx.MultiHeadAttention(H, D_MODEL, rngs=nnx.Rngs(0))
    full = model(x, is_causal=True, segment_ids=ids)
    mask = ids[:, None, :, None] == ids[:, None, None, :]
    want = model(x, mask=mask, is_causal=True)
    np.testing.assert_allclose(full, want, atol=tol(want))
    model.init_cache(x.shape, segment_ids=True)
    outs = [model(x[:, t : t + 1], segment_ids=ids[:, t : t + 1], decode=True) for t in range(N)]
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, atol=tol(full))
    np.testing.assert_array_equal(model.cached_segment_ids[...], ids)


def test_bad_widths_raise_naming_them():
    with pytest.raises(ValueError, match="d_model must be a positive int, got 0"):
        jnnx.MultiHeadAttention(H, D_MODEL, d_model=0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="d_ff must be a positive int, got 0"):
        jnnx.TransformerBlock(D_MODEL, H, 0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="d_ff must be a positive int, got -2"):
        jnnx.FeedForward(D_MODEL, -2, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_precision_under_strict_promotion(rng, dtype):
    x = normal(rng, (B, N, D_MODEL)).astype(dtype)
    with jax.numpy_dtype_promotion("strict"):
        block = jnnx.TransformerBlock(D_MODEL, H, 7, dtype=dtype, rngs=nnx.Rngs(0))
        assert block(x, is_causal=True).dtype == dtype
        mha = jnnx.MultiHeadAttention(H, D_MODEL, normalize_qk=True, dtype=dtype, rngs=nnx.Rngs(0))
        assert mha(x).dtype == dtype


class Spy:
    """An `attention_fn`: records each call's keywords, returns `scale` x `attention`."""

    def __init__(self, scale=1.0):
        self.scale, self.calls = scale, []

    def __call__(self, q, k, v, **kwargs):
        self.calls.append(kwargs)
        core = {name: x for name, x in kwargs.items() if name not in ("score_mod", "mask_mod", "logits_soft_cap")}
        return self.scale * jax_mha.attention(q, k, v, **core)


def test_attention_fn_replaces_the_core_as_in_linen(rng):
    x = normal(rng, (B, N, D_MODEL))
    spy = Spy(scale=3.0)
    ours = randomize_module(jnnx.MultiHeadAttention(H, D_MODEL, attention_fn=spy, rngs=nnx.Rngs(0)))
    linen = jax_mha.MultiHeadAttention(num_heads=H, attention_fn=Spy(scale=3.0))
    plain = jax_mha.MultiHeadAttention(num_heads=H)
    params = jnnx.to_linen_params(ours)
    out = nnx.jit(lambda m: m(x, is_causal=True, logits_soft_cap=20.0))(ours)  # the hook survives nnx.jit
    want = linen.apply({"params": params}, x, is_causal=True)
    np.testing.assert_allclose(out, want, atol=tol(want))
    # Independent of the hook's plumbing: 3 x the heads before a linear output projection.
    bias = np.asarray(params["out"]["bias"])  # NumPy: broadcasting allowed
    want = 3.0 * (np.asarray(plain.apply({"params": params}, x, is_causal=True)) - bias)
    np.testing.assert_allclose(np.asarray(out) - bias, want, atol=tol(want))
    assert spy.calls[-1]["logits_soft_cap"] == 20.0 and spy.calls[-1]["is_causal"] is True
    assert "score_mod" not in spy.calls[-1]


def test_transformer_block_forwards_mods_to_attention_fn(rng):
    x = normal(rng, (B, N, D_MODEL))
    spy = Spy()
    block = jnnx.TransformerBlock(D_MODEL, H, 7, attention_fn=spy, rngs=nnx.Rngs(0))
    mask_mod = lambda b, h, i, j: j <= i
    out = block(x, is_causal=True, mask_mod=mask_mod, local_window_size=(2, 0))
    assert spy.calls[-1]["mask_mod"] is mask_mod and spy.calls[-1]["local_window_size"] == (2, 0)
    block.attention.attention_fn = None  # the default core on the same weights
    want = block(x, is_causal=True, local_window_size=(2, 0))
    np.testing.assert_allclose(out, want, atol=tol(want, BLOCK_TERMS))


def test_attention_fn_that_is_not_callable_raises_naming_it():
    for make in (lambda f: jnnx.MultiHeadAttention(H, D_MODEL, attention_fn=f, rngs=nnx.Rngs(0)),
                 lambda f: jnnx.TransformerBlock(D_MODEL, H, 7, attention_fn=f, rngs=nnx.Rngs(0))):
        with pytest.raises(TypeError, match="attention_fn must be a callable .*got 'xla'"):
            make("xla")
