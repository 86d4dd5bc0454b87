"""Tests for `jax_mha.nn.linen`: parameter layout and counts, parity with flax's
`MultiHeadDotProductAttention` and with hand-written compositions of the parameters,
KV-cache decoding, RoPE, QK-norm and the options passed through to the core."""

from __future__ import annotations

import inspect
import re

import chex
import flax.errors
import flax.linen as nn
import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import f32_tolerance, normal, randomize

from jax_mha import FeedForward, MultiHeadAttention, TransformerBlock, causal_mask, padding_mask
from jax_mha.nn.projection import projection_dot_general


@pytest.fixture(autouse=True)
def promotion(request):
    """Every test of this suite runs under strict dtype promotion (equinox's suite runs
    strict; a library that promotes implicitly breaks there). Strict promotion only
    forbids implicit promotions, so what runs under it is the same program under
    standard promotion (tests/nn/test_strict_promotion.py checks the values agree); a
    test that names `promotion` runs under both. unittest-style classes (chex's
    `TestCase`) take no fixtures: they run under standard promotion."""
    mode = getattr(request, "param", "strict")
    with jax.numpy_dtype_promotion(mode):
        yield mode


def pytest_generate_tests(metafunc):
    if "promotion" in inspect.signature(metafunc.function).parameters:
        metafunc.parametrize("promotion", ["standard", "strict"], indirect=True)


# B, N, S, H, D: distinct primes; d_model = H * D.
B, N, S, H, D = 2, 5, 7, 3, 11
D_MODEL = H * D  # 33
# The float32 sums of the module, for the tolerances: the q/k/v projections over
# d_model, the logits over D, the softmax sum and weights @ v over (up to 11) keys, the
# output projection; a TransformerBlock adds two layer norms (mean and variance) and
# the feed-forward layer (d_model, then d_ff <= 13).
MODULE_TERMS = D_MODEL + D + 2 * 11 + D_MODEL
BLOCK_TERMS = MODULE_TERMS + 2 * 2 * D_MODEL + D_MODEL + 13


def tol(want, terms=MODULE_TERMS):
    """`f32_tolerance` at `want`'s size."""
    return f32_tolerance(terms=terms, magnitude=want)


def init_params(model, *inputs, seed=0):
    """Random parameters with the structure `model.init` would give, without running it."""
    return randomize(jax.eval_shape(model.init, jax.random.key(0), *inputs), seed)


def count(params) -> int:
    return sum(x.size for x in jax.tree_util.tree_leaves(params))


def np_mha(p, query, key, value, num_heads, num_kv_heads, np_attention, mask=None):
    """MultiHeadAttention by hand in float64 from its parameter dict."""
    dense = lambda x, name: np.asarray(x, np.float64) @ np.asarray(p[name]["kernel"], np.float64) + (
        np.asarray(p[name]["bias"], np.float64) if "bias" in p[name] else 0.0
    )
    heads = lambda x, h: x.reshape(*x.shape[:-1], h, -1).swapaxes(-3, -2)  # (B, h, L, D)
    q = heads(dense(query, "query"), num_heads)
    k = heads(dense(key, "key"), num_kv_heads)
    v = heads(dense(value, "value"), num_kv_heads)
    out, weights = np_attention(q, k, v, mask)
    out = out.swapaxes(-3, -2).reshape(*out.shape[:-3], out.shape[-2], -1)  # (B, N, H*D)
    return dense(out, "out"), weights


# --------------------------------------------------------------------------- shapes


class ShapeTest(chex.TestCase):
    """Output shapes, with and without jit."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_self_attention(self):
        x = normal(np.random.default_rng(0), (B, N, D_MODEL))
        model = MultiHeadAttention(num_heads=H)
        params = init_params(model, x)
        out, weights = self.variant(lambda p, x: model.apply(p, x, return_weights=True))(params, x)
        chex.assert_shape(out, (B, N, D_MODEL))
        chex.assert_shape(weights, (B, H, N, N))

    @chex.variants(with_jit=True, without_jit=True)
    def test_cross_attention_gqa(self):
        rng = np.random.default_rng(1)
        q, kv = normal(rng, (B, N, 13)), normal(rng, (B, S, 17))
        model = MultiHeadAttention(num_heads=6, d_model=30, num_kv_heads=2)
        params = init_params(model, q, kv)
        out, weights = self.variant(lambda p, q, kv: model.apply(p, q, kv, return_weights=True))(params, q, kv)
        chex.assert_shape(out, (B, N, 30))
        chex.assert_shape(weights, (B, 6, N, S))

    @chex.variants(with_jit=True, without_jit=True)
    def test_transformer_block(self):
        x = normal(np.random.default_rng(2), (B, N, D_MODEL))
        block = TransformerBlock(num_heads=H, d_ff=13)
        params = init_params(block, x)
        y, weights = self.variant(lambda p, x: block.apply(p, x, is_causal=True, return_weights=True))(params, x)
        chex.assert_shape(y, (B, N, D_MODEL))
        chex.assert_shape(weights, (B, H, N, N))


# --------------------------------------------------------------- parameters & layout


def test_parameter_count_with_biases():
    model = MultiHeadAttention(num_heads=8, d_model=64, qkv_bias=True, out_bias=True)
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((1, 3, 64)))
    assert count(params) == 16_640


@pytest.mark.parametrize("d_model,heads", [(512, 8), (D_MODEL, H)])
def test_parameter_count_without_biases(d_model, heads):
    model = MultiHeadAttention(num_heads=heads, d_model=d_model, qkv_bias=False, out_bias=False)
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((1, 3, d_model)))
    assert count(params) == 4 * d_model**2


def test_parameter_shapes_cross_attention_gqa():
    d_q, d_k, d_v, heads, kv_heads, d_model = 7, 11, 13, 6, 2, 30  # D = 5
    model = MultiHeadAttention(num_heads=heads, d_model=d_model, num_kv_heads=kv_heads, qkv_bias=True)
    params = jax.eval_shape(
        model.init, jax.random.key(0), jnp.ones((B, N, d_q)), jnp.ones((B, S, d_k)), jnp.ones((B, S, d_v))
    )["params"]
    shapes = jax.tree_util.tree_map(lambda x: x.shape, params)
    assert shapes == {
        "query": {"kernel": (d_q, d_model), "bias": (d_model,)},
        "key": {"kernel": (d_k, kv_heads * 5), "bias": (kv_heads * 5,)},
        "value": {"kernel": (d_v, kv_heads * 5), "bias": (kv_heads * 5,)},
        "out": {"kernel": (d_model, d_model), "bias": (d_model,)},
    }
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))


def test_head_h_owns_query_columns(rng):
    """Perturbing query-kernel columns h*D:(h+1)*D changes only head h's weights."""
    x = normal(rng, (B, N, D_MODEL))
    model = MultiHeadAttention(num_heads=H)
    params = init_params(model, x)
    _, w = model.apply(params, x, return_weights=True)
    h = 1
    kernel = params["params"]["query"]["kernel"]
    bumped = jax.tree_util.tree_map(lambda a: a, params)
    bumped["params"]["query"]["kernel"] = kernel.at[:, h * D : (h + 1) * D].add(normal(rng, (D_MODEL, D)))
    _, w2 = model.apply(bumped, x, return_weights=True)
    changed = np.abs(np.asarray(w2 - w)).max(axis=(0, 2, 3))
    assert changed[h] > 1e-3
    np.testing.assert_array_equal(np.delete(changed, h), 0.0)


# ---------------------------------------------------------------- reference parity


@pytest.mark.parametrize("use_mask", [False, True])
def test_matches_flax_multi_head_dot_product_attention(rng, use_mask):
    d_q, d_k, d_v = 7, 11, 13
    query, key, value = normal(rng, (B, N, d_q)), normal(rng, (B, S, d_k)), normal(rng, (B, S, d_v))
    mask = None
    if use_mask:
        m = rng.random((B, 1, N, S)) < 0.6
        m[..., 0] = True  # flax gives uniform (not zero) weights to fully masked rows
        mask = jnp.asarray(np.broadcast_to(m, (B, H, N, S)))
    ref_model = nn.MultiHeadDotProductAttention(
        num_heads=H, qkv_features=D_MODEL, out_features=D_MODEL, use_bias=True,
        deterministic=True,
    )
    ref_params = init_params(ref_model, query, key, value)["params"]
    expected = ref_model.apply({"params": ref_params}, query, key, value, mask=mask)

    # flax's DenseGeneral kernels are (d_in, H, D) and (H, D, d_out): flatten the
    # (H, D) axes in that order, which is exactly the split_heads column layout.
    ours = {
        name: {
            "kernel": ref_params[name]["kernel"].reshape(-1, D_MODEL),
            "bias": ref_params[name]["bias"].reshape(D_MODEL),
        }
        for name in ("query", "key", "value")
    }
    ours["out"] = {"kernel": ref_params["out"]["kernel"].reshape(D_MODEL, D_MODEL), "bias": ref_params["out"]["bias"]}
    model = MultiHeadAttention(num_heads=H, d_model=D_MODEL, qkv_bias=True, out_bias=True)
    got = model.apply({"params": ours}, query, key, value, mask)
    np.testing.assert_allclose(got, expected, atol=tol(expected))


def test_cross_attention_matches_numpy(rng, np_attention):
    d_q, d_k, d_v, heads, d_model = 7, 11, 13, 5, 15  # D = 3, S != N
    query, key, value = normal(rng, (B, N, d_q)), normal(rng, (B, S, d_k)), normal(rng, (B, S, d_v))
    mask = padding_mask(jnp.asarray(np.arange(S)[None] < np.array([[4], [S]])))
    model = MultiHeadAttention(num_heads=heads, d_model=d_model, qkv_bias=True)
    params = init_params(model, query, key, value)
    out, weights = model.apply(params, query, key, value, mask, return_weights=True)
    ref_out, ref_w = np_mha(params["params"], query, key, value, heads, heads, np_attention, mask)
    np.testing.assert_allclose(out, ref_out, atol=tol(ref_out))
    np.testing.assert_allclose(weights, ref_w, atol=tol(1.0, D_MODEL + D + S))


def test_value_defaults_to_key_and_key_to_query(rng):
    x, kv = normal(rng, (B, N, D_MODEL)), normal(rng, (B, S, D_MODEL))
    model = MultiHeadAttention(num_heads=H)
    params = init_params(model, x)
    np.testing.assert_array_equal(model.apply(params, x), model.apply(params, x, x, x))
    np.testing.assert_array_equal(model.apply(params, x, kv), model.apply(params, x, kv, kv))


@pytest.mark.parametrize("kv_heads", [1, 2])  # MQA, GQA with groups of 3
def test_gqa_module_equals_mha_with_repeated_kv_kernels(rng, np_attention, kv_heads):
    heads, d_model = 6, 30  # D = 5
    x = normal(rng, (B, N, d_model))
    gqa = MultiHeadAttention(num_heads=heads, num_kv_heads=kv_heads, qkv_bias=True)
    params = init_params(gqa, x)["params"]

    def repeat_heads(a):  # (..., K*D) -> (..., H*D), kv head k serves query heads k*G:(k+1)*G
        a = a.reshape(*a.shape[:-1], kv_heads, d_model // heads)
        return jnp.repeat(a, heads // kv_heads, axis=-2).reshape(*a.shape[:-2], d_model)

    full = {name: params[name] for name in ("query", "out")}
    for name in ("key", "value"):
        full[name] = {p: repeat_heads(a) for p, a in params[name].items()}
    mha = MultiHeadAttention(num_heads=heads, qkv_bias=True)
    out, w = gqa.apply({"params": params}, x, is_causal=True, return_weights=True)
    out_full, w_full = mha.apply({"params": full}, x, is_causal=True, return_weights=True)
    np.testing.assert_allclose(out, out_full, atol=tol(out_full))
    np.testing.assert_allclose(w, w_full, atol=tol(1.0, D_MODEL + D + S))
    ref, _ = np_mha(params, x, x, x, heads, kv_heads, np_attention, causal_mask(N))
    np.testing.assert_allclose(out, ref, atol=tol(ref))


def test_is_causal_equals_causal_mask_in_module(rng):
    x = normal(rng, (B, N, D_MODEL))
    model = MultiHeadAttention(num_heads=H)
    params = init_params(model, x)
    want = model.apply(params, x, mask=causal_mask(N))
    np.testing.assert_allclose(model.apply(params, x, is_causal=True), want, atol=tol(want))


# ------------------------------------------------------------------------ head_mask


def test_head_mask_zero_equals_zeroing_out_kernel_rows(rng):
    x = normal(rng, (B, N, D_MODEL))
    model = MultiHeadAttention(num_heads=H)
    params = init_params(model, x)
    h = 2
    gated = model.apply(params, x, head_mask=jnp.ones(H).at[h].set(0.0))
    pruned = jax.tree_util.tree_map(lambda a: a, params)
    kernel = params["params"]["out"]["kernel"]
    pruned["params"]["out"]["kernel"] = kernel.at[h * D : (h + 1) * D, :].set(0.0)
    want = model.apply(pruned, x)
    np.testing.assert_allclose(gated, want, atol=tol(want))
    assert not np.allclose(gated, model.apply(params, x), atol=1e-3)
    np.testing.assert_array_equal(model.apply(params, x, head_mask=jnp.ones(H)), model.apply(params, x))


def test_per_example_head_mask(rng):
    x = normal(rng, (B, N, D_MODEL))
    model = MultiHeadAttention(num_heads=H)
    params = init_params(model, x)
    gates = jnp.asarray(rng.random((B, H)), jnp.float32)
    out = model.apply(params, x, head_mask=gates)
    for b in range(B):
        want = model.apply(params, x[b], head_mask=gates[b])
        np.testing.assert_allclose(out[b], want, atol=tol(want))


def test_head_mask_gradient_is_finite_and_nonzero(rng):
    x = normal(rng, (B, N, D_MODEL))
    model = MultiHeadAttention(num_heads=H)
    params = init_params(model, x)
    g = jax.grad(lambda m: jnp.sum(model.apply(params, x, head_mask=m) ** 2))(jnp.ones(H))
    chex.assert_shape(g, (H,))
    assert np.all(np.isfinite(g)) and np.all(g != 0)


# --------------------------------------------------------------------------- dropout


def test_module_dropout(rng):
    x = normal(rng, (B, N, D_MODEL))
    model = MultiHeadAttention(num_heads=H, dropout_rate=0.5)
    params = init_params(model, x)
    plain = MultiHeadAttention(num_heads=H).apply(params, x)
    np.testing.assert_array_equal(model.apply(params, x), plain)  # deterministic by default
    drop = lambda seed: model.apply(params, x, deterministic=False, rngs={"dropout": jax.random.key(seed)})
    np.testing.assert_array_equal(drop(1), drop(1))
    assert not np.allclose(drop(1), plain, atol=1e-3)
    assert not np.allclose(drop(1), drop(2), atol=1e-3)


@pytest.mark.parametrize("make", [
    lambda: MultiHeadAttention(num_heads=H, dropout_rate=0.5),
    lambda: FeedForward(d_ff=7, dropout_rate=0.5),
    lambda: TransformerBlock(num_heads=H, d_ff=7, dropout_rate=0.5),
    lambda: TransformerBlock(num_heads=H, d_ff=7, attention_dropout_rate=0.5),
], ids=["mha", "ffn", "block", "block_attention"])
def test_dropout_without_a_dropout_rng_says_what_to_pass(rng, make):
    # It used to surface flax's 'None needs PRNG for "dropout"'.
    x = normal(rng, (B, N, D_MODEL))
    model = make()
    params = init_params(model, x)
    msg = 'dropout_rate=0.5 with deterministic=False needs a "dropout" rng: pass apply(..., rngs={"dropout": key})'
    with pytest.raises(ValueError, match=re.escape(msg)) as caught:
        model.apply(params, x, deterministic=False)
    assert isinstance(caught.value, flax.errors.InvalidRngError) and "\n" not in str(caught.value)  # flax's type too
    if isinstance(model, TransformerBlock) and model.dropout_rate:  # with the rng it drops out (the ffn's too)
        dropped = model.apply(params, x, deterministic=False, rngs={"dropout": jax.random.key(0)})
        assert not np.allclose(dropped, model.apply(params, x), atol=1e-3)


def test_params_the_module_has_no_place_for_or_lacks_are_refused(rng):
    # flax ignores given parameters a module never reads: these were dropped silently.
    x = normal(rng, (B, N, D_MODEL))
    rich = init_params(MultiHeadAttention(num_heads=H, qkv_bias=True, normalize_qk=True, add_bias_kv=True), x)
    msg = ("have ['bias_k', 'bias_v', 'key/bias', 'key_ln/scale', 'query/bias', 'query_ln/scale', 'value/bias'], "
           "which the module has no place for and would drop: build it with add_bias_kv=True, normalize_qk=True, "
           "qkv_bias=True")
    with pytest.raises(ValueError, match=re.escape(msg)):
        MultiHeadAttention(num_heads=H).apply(rich, x)
    plain = init_params(MultiHeadAttention(num_heads=H, out_bias=False), x)
    msg = "needs ['key_ln/scale', 'out/bias', 'query_ln/scale'], which the weights lack: build it with "
    with pytest.raises(ValueError, match=re.escape(msg + "normalize_qk=False, out_bias=False")):
        MultiHeadAttention(num_heads=H, normalize_qk=True).apply(plain, x)
    block = TransformerBlock(num_heads=H, d_ff=7)
    params = init_params(block, x)
    params["params"]["attention"]["out"].pop("bias")
    with pytest.raises(ValueError, match=re.escape("needs ['out/bias']")):
        block.apply(params, x)


BAD_RATES = [2.0, 1.0, -0.1, float("nan"), True, "0.1"]


@pytest.mark.parametrize("rate", BAD_RATES, ids=repr)
@pytest.mark.parametrize("make", [
    lambda r: MultiHeadAttention(num_heads=H, dropout_rate=r),
    lambda r: FeedForward(d_ff=7, dropout_rate=r),
    lambda r: TransformerBlock(num_heads=H, d_ff=7, dropout_rate=r),
], ids=["mha", "ffn", "block"])
def test_dropout_rate_outside_zero_one_raises_at_construction(make, rate):
    # A rate >= 1 used to give all-zero outputs with deterministic=False, silently.
    with pytest.raises(ValueError, match=re.escape(f"0 <= dropout_rate < 1, got {rate!r}")):
        make(rate)


def test_attention_dropout_rate_of_the_block_is_checked_and_good_rates_pass():
    with pytest.raises(ValueError, match=re.escape("0 <= attention_dropout_rate < 1, got 1.5")):
        TransformerBlock(num_heads=H, d_ff=7, attention_dropout_rate=1.5)
    block = TransformerBlock(num_heads=H, d_ff=7, dropout_rate=np.float32(0.5), attention_dropout_rate=0)
    assert block.clone(dropout_rate=0.0).dropout_rate == 0.0  # clone re-validates, valid rates pass


# -------------------------------------------------------------------------- bfloat16


def _all_eqns(jaxpr):
    """Every equation, including those inside custom-VJP and other sub-jaxprs."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jex.core.jaxprs_in_params(eqn.params):
            yield from _all_eqns(sub)


def test_bfloat16_compute_with_float32_params(rng, np_attention):
    x = normal(rng, (B, N, D_MODEL))
    model = MultiHeadAttention(num_heads=H, dtype=jnp.bfloat16)
    params = init_params(model, x)
    assert all(a.dtype == jnp.float32 for a in jax.tree_util.tree_leaves(params))
    out, weights = model.apply(params, x, return_weights=True)
    assert out.dtype == jnp.bfloat16 and weights.dtype == jnp.bfloat16
    # Every matmul this CPU runs is on bfloat16 operands: read from the module lowered for
    # it, since "auto" also stages (unlowered) kernel branches for other platforms.
    hlo = jax.jit(lambda p, x: model.apply(p, x)).lower(params, x).as_text()
    dots = [line for line in hlo.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) >= 6  # q, k, v projections, q·k, w·v, out projection
    for line in dots:
        operands = line.rsplit(":", 1)[1].split("->")[0]
        assert operands.count("xbf16>") == 2, line
    ref, _ = np_mha(params["params"], x, x, x, H, H, np_attention)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=0.05, atol=0.08)
    f32 = MultiHeadAttention(num_heads=H).apply(params, x)
    assert not np.array_equal(np.asarray(out, np.float32), np.asarray(f32))


# ---------------------------------------------------------------- TransformerBlock


def layer_norm(x, p, eps=1e-6):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * np.asarray(p["scale"]) + np.asarray(p["bias"])


def dense(x, p):
    return x @ np.asarray(p["kernel"], np.float64) + np.asarray(p["bias"], np.float64)


def gelu(x):
    return np.asarray(jax.nn.gelu(jnp.asarray(x, jnp.float32), approximate=False), np.float64)


@pytest.mark.parametrize("pre_norm", [False, True])
def test_transformer_block_matches_hand_composition(rng, np_attention, pre_norm):
    x = normal(rng, (B, N, D_MODEL))
    mask = padding_mask(jnp.asarray(np.arange(N)[None] < np.array([[3], [N]])))
    block = TransformerBlock(num_heads=H, d_ff=13, pre_norm=pre_norm)
    params = init_params(block, x)
    p = params["params"]
    assert set(p) == {"attention", "norm1", "norm2", "ffn"}

    attn = lambda y: np_mha(p["attention"], y, y, y, H, H, np_attention, mask)[0]
    ffn = lambda y: dense(gelu(dense(y, p["ffn"]["hidden"])), p["ffn"]["output"])
    x64 = np.asarray(x, np.float64)
    if pre_norm:
        y = x64 + attn(layer_norm(x64, p["norm1"]))
        expected = y + ffn(layer_norm(y, p["norm2"]))
    else:
        y = layer_norm(x64 + attn(x64), p["norm1"])
        expected = layer_norm(y + ffn(y), p["norm2"])
    got = block.apply(params, x, mask)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)

    other = TransformerBlock(num_heads=H, d_ff=13, pre_norm=not pre_norm).apply(params, x, mask)
    assert not np.allclose(got, other, atol=1e-2)


def test_transformer_block_head_dim_sets_the_attention_width(rng, np_attention):
    # 5 heads of size 7 on d_model 33: 5 does not divide 33, the attention is 35 wide.
    x = normal(rng, (B, N, D_MODEL))
    block = TransformerBlock(num_heads=5, d_ff=13, head_dim=7, pre_norm=True)
    params = init_params(block, x)
    p = params["params"]
    for name in ("query", "key", "value"):
        assert p["attention"][name]["kernel"].shape == (D_MODEL, 35)
    assert p["attention"]["out"]["kernel"].shape == (35, D_MODEL)

    x64 = np.asarray(x, np.float64)
    y = x64 + np_mha(p["attention"], *(layer_norm(x64, p["norm1"]),) * 3, 5, 5, np_attention)[0]
    expected = y + dense(gelu(dense(layer_norm(y, p["norm2"]), p["ffn"]["hidden"])), p["ffn"]["output"])
    np.testing.assert_allclose(block.apply(params, x), expected, rtol=1e-4, atol=1e-4)
    # head_dim = d_model // num_heads is the default block, parameter for parameter.
    shared = init_params(TransformerBlock(num_heads=H, d_ff=13), x)
    np.testing.assert_array_equal(TransformerBlock(num_heads=H, d_ff=13, head_dim=D).apply(shared, x),
                                  TransformerBlock(num_heads=H, d_ff=13).apply(shared, x))
    with pytest.raises(ValueError, match=re.escape("head_dim must be a positive int, got 0")):
        TransformerBlock(num_heads=H, d_ff=13, head_dim=0)


def test_transformer_block_return_weights(rng):
    x = normal(rng, (B, N, D_MODEL))
    block = TransformerBlock(num_heads=H, d_ff=13, num_kv_heads=1)
    params = init_params(block, x)
    y, w = block.apply(params, x, is_causal=True, return_weights=True)
    chex.assert_shape(y, (B, N, D_MODEL))
    chex.assert_shape(w, (B, H, N, N))
    np.testing.assert_allclose(jnp.sum(w, -1), np.ones((B, H, N)), atol=tol(1.0, 2 * D_MODEL + D + 2 * N))
    np.testing.assert_array_equal(np.asarray(w)[..., ~np.asarray(causal_mask(N))], 0.0)
    want = block.apply(params, x, is_causal=True)
    np.testing.assert_allclose(y, want, atol=tol(want, BLOCK_TERMS))


# ---------------------------------------------------------------- gradient flow


def nonzero_finite_grads(grads, skip=()):
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    assert flat
    for path, g in flat:
        name = jax.tree_util.keystr(path)
        assert np.all(np.isfinite(g)), name
        if not any(s in name for s in skip):
            assert np.any(np.abs(g) > 1e-8), f"zero gradient for {name}"
    return {jax.tree_util.keystr(p): g for p, g in flat}


def test_every_mha_parameter_gets_a_gradient(rng):
    x = normal(rng, (B, N, D_MODEL))
    target = normal(rng, (B, N, D_MODEL))
    model = MultiHeadAttention(num_heads=H, qkv_bias=True, out_bias=True)
    params = jax.jit(model.init)(jax.random.key(0), x)  # the real initialisers: zero biases
    loss = lambda p: jnp.sum((model.apply(p, x, is_causal=True) - target) ** 2)
    grads = nonzero_finite_grads(jax.grad(loss)(params), skip=("['key']['bias']",))
    assert len(grads) == 8
    # Adding the same vector to every key shifts a whole softmax row by a constant:
    # the key bias cannot change the output, so its gradient is (numerically) zero.
    np.testing.assert_allclose(grads["['params']['key']['bias']"], 0.0, atol=1e-4)


@pytest.mark.parametrize("pre_norm", [False, True])
def test_every_transformer_block_parameter_gets_a_gradient(rng, pre_norm):
    x = normal(rng, (B, N, D_MODEL))
    target = normal(rng, (B, N, D_MODEL))
    block = TransformerBlock(num_heads=H, d_ff=13, pre_norm=pre_norm)
    params = jax.jit(block.init)(jax.random.key(0), x)  # the real initialisers: zero biases
    loss = lambda p: jnp.sum((block.apply(p, x, is_causal=True) - target) ** 2)

    grads = nonzero_finite_grads(jax.grad(loss)(params))
    assert len(grads) == 13  # 4 kernels + out bias, 2 LayerNorms x 2, 2 Dense x 2


# ------------------------------------------------------------------ jit and vmap


def test_jitted_apply_does_not_retrace(rng):
    chex.clear_trace_counter()
    model = MultiHeadAttention(num_heads=H)
    x = normal(rng, (B, N, D_MODEL))
    params = init_params(model, x)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def apply(params, x):
        return model.apply(params, x, is_causal=True)

    apply(params, x)
    apply(randomize(params), normal(rng, (B, N, D_MODEL)))  # same shapes: cached
    with pytest.raises(AssertionError):
        apply(params, normal(rng, (B, N + 2, D_MODEL)))


def test_vmap_over_batch_equals_batched_apply(rng):
    model = MultiHeadAttention(num_heads=H)
    x = normal(rng, (B, N, D_MODEL))
    params = init_params(model, x)
    vmapped = jax.vmap(lambda x: model.apply(params, x, is_causal=True))(x)
    want = model.apply(params, x, is_causal=True)
    np.testing.assert_allclose(vmapped, want, atol=tol(want))


# ------------------------------------------------------------------------ ValueErrors


def test_d_model_not_divisible_by_num_heads():
    model = MultiHeadAttention(num_heads=7, d_model=768)
    with pytest.raises(ValueError, match=re.escape("d_model=768 is not divisible by num_heads=7")):
        model.init(jax.random.key(0), jnp.ones((1, 3, 768)))
    with pytest.raises(ValueError, match=re.escape("d_model=10 is not divisible by num_heads=3")):
        MultiHeadAttention(num_heads=3).init(jax.random.key(0), jnp.ones((1, 3, 10)))


def test_num_heads_not_divisible_by_num_kv_heads():
    model = MultiHeadAttention(num_heads=6, num_kv_heads=4, d_model=30)
    with pytest.raises(ValueError, match=re.escape("num_heads=6 is not divisible by num_kv_heads=4")):
        model.init(jax.random.key(0), jnp.ones((1, 3, 30)))


def test_module_input_errors(rng):
    model = MultiHeadAttention(num_heads=H)
    x = normal(rng, (B, N, D_MODEL))
    params = init_params(model, x)
    with pytest.raises(ValueError, match=re.escape("key length 7 != value length 5")):
        model.apply(params, x, normal(rng, (B, S, D_MODEL)), normal(rng, (B, 5, D_MODEL)))
    with pytest.raises(ValueError, match=re.escape("query must have shape (B…, length, features), got shape (33,)")):
        model.apply(params, x[0, 0])
    with pytest.raises(ValueError, match=r"batch dims differ"):
        model.apply(params, x, normal(rng, (3, S, D_MODEL)))
    with pytest.raises(ValueError, match=re.escape("mask of shape (2, 4) does not broadcast to (B…, H, N, S) = (2, 3, 5, 5)")):
        model.apply(params, x, mask=jnp.ones((2, 4), bool))
    with pytest.raises(ValueError, match=re.escape("head_mask of shape (2,) does not broadcast to (B…, H) = (2, 3)")):
        model.apply(params, x, head_mask=jnp.ones(2))
    with pytest.raises(ValueError, match=r"return_weights=True needs implementation='xla'"):
        MultiHeadAttention(num_heads=H, implementation="blockwise").apply(params, x, return_weights=True)
    with pytest.raises(ValueError, match=r"implementation must be one of .*got 'fast'"):
        MultiHeadAttention(num_heads=H, implementation="fast").apply(params, x)


def test_input_width_other_than_the_kernels_raises(rng):
    # Not flax's ScopeParamShapeError naming kernel shapes: the NNX twin's message.
    x, memory = normal(rng, (B, N, D_MODEL)), normal(rng, (B, S, 13))
    model = MultiHeadAttention(num_heads=H)
    params = init_params(model, x, memory)
    assert params["params"]["key"]["kernel"].shape == (13, D_MODEL)
    with pytest.raises(ValueError, match=re.escape("query has 31 features, the module was built for 33 (shape (2, 5, 31))")):
        model.apply(params, normal(rng, (B, N, 31)), memory)
    with pytest.raises(ValueError, match=re.escape("key has 33 features, the module was built for 13")):
        model.apply(params, x)  # key defaults to query
    with pytest.raises(ValueError, match=re.escape("value has 17 features, the module was built for 13")):
        model.apply(params, x, memory, normal(rng, (B, S, 17)))
    with pytest.raises(ValueError, match=re.escape("query has 31 features, the module was built for 33")):
        jax.jit(lambda p, q: model.apply(p, q, memory))(params, normal(rng, (B, N, 31)))
    block = TransformerBlock(num_heads=H, d_ff=7)
    block_params = init_params(block, x)
    with pytest.raises(ValueError, match=re.escape("query has 31 features, the module was built for 33")):
        block.apply(block_params, normal(rng, (B, N, 31)))


# ------------------------------------------------------------- decoding with a cache


def decode_variables(model, x, seed=0):
    """Random parameters and an empty cache, as `model.init(key, x)` would shape them."""
    shapes = jax.eval_shape(model.init, jax.random.key(0), x)
    cache = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])
    return randomize(shapes["params"], seed), cache


def decode(model, params, cache, x, chunks, **kwargs):
    """Feeds `x (B, L, d)` chunk by chunk (`chunks`: lengths summing to L); returns
    the concatenated outputs and the final cache. One jit, one trace per chunk length."""
    step = jax.jit(lambda c, x: model.apply({"params": params, "cache": c}, x, mutable=["cache"], **kwargs))
    outs, start = [], 0
    for n in chunks:
        y, mutated = step(cache, x[:, start : start + n])
        cache, start = mutated["cache"], start + n
        outs.append(y)
    return jnp.concatenate(outs, axis=1), cache


DECODE_CASES = {
    # name: (module options, call options, dtype, tolerance; None: float32's, from f32_tolerance)
    "mha_rope_extra_keys": (dict(num_heads=3, rope=True, add_bias_kv=True, add_zero_attn=True), {}, jnp.float32,
                            None),
    "gqa_rope_window_bias": (
        dict(num_heads=6, num_kv_heads=2, rope=True, qkv_bias=True), dict(local_window_size=(2, None)), jnp.float32, None
    ),
    "mqa_rope_qknorm_bf16": (
        dict(num_heads=6, num_kv_heads=1, rope=True, normalize_qk=True, dtype=jnp.bfloat16), {}, jnp.bfloat16, 3e-2
    ),
}


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decoding_token_by_token_and_in_chunks_equals_causal_forward(rng, case):
    options, call, dtype, half_tol = DECODE_CASES[case]
    L, d = 7, 30 if options["num_heads"] == 3 else 36  # head dim 10 or 6 (RoPE needs it even)
    x = normal(rng, (B, L, d))
    params, cache = decode_variables(MultiHeadAttention(decode=True, **options), x)
    kv_heads = options.get("num_kv_heads", options["num_heads"])
    chex.assert_shape([cache["cached_key"], cache["cached_value"]], (B, kv_heads, L, d // options["num_heads"]))
    assert cache["cached_key"].dtype == dtype and cache["cache_index"] == 0

    forward = jax.jit(lambda x: MultiHeadAttention(**options).apply({"params": params}, x, is_causal=True, **call))
    full = forward(x)
    decoder = MultiHeadAttention(decode=True, **options)
    by_token, final = decode(decoder, params, cache, x, [1] * L, **call)
    in_chunks, chunked_final = decode(decoder, params, cache, x, [3, 3, 1], **call)
    assert by_token.dtype == full.dtype == dtype and int(final["cache_index"]) == L
    if dtype == jnp.float32:  # the module's sums (d_model 30 or 36, up to 9 keys) at each array's size
        terms = 2 * d + d // options["num_heads"] + 2 * (L + 2)
        for got in (by_token, in_chunks):
            np.testing.assert_allclose(got, full, atol=f32_tolerance(terms=terms, magnitude=full))
        for got, want in zip(jax.tree.leaves(final), jax.tree.leaves(chunked_final)):  # the same keys, however fed
            np.testing.assert_allclose(got, want, atol=f32_tolerance(terms=d, magnitude=want))
    else:
        f32 = lambda x: x.astype(jnp.float32)
        chex.assert_trees_all_close(f32(by_token), f32(full), atol=half_tol, rtol=half_tol)
        chex.assert_trees_all_close(f32(in_chunks), f32(full), atol=half_tol, rtol=half_tol)
        chex.assert_trees_all_close(final, chunked_final, atol=half_tol, rtol=half_tol)  # the same keys, however fed


def test_transformer_block_decoding_equals_causal_forward(rng):
    L, d = 6, 36
    x = normal(rng, (B, L, d))
    options = dict(num_heads=6, d_ff=13, num_kv_heads=3, pre_norm=True, rope=True, normalize_qk=True)
    params, cache = decode_variables(TransformerBlock(decode=True, **options), x)
    full = jax.jit(lambda x: TransformerBlock(**options).apply({"params": params}, x, is_causal=True))(x)
    by_token, _ = decode(TransformerBlock(decode=True, **options), params, cache, x, [1] * L)
    np.testing.assert_allclose(by_token, full, atol=tol(full, BLOCK_TERMS))


def test_decoding_past_the_cache(rng):
    L = 4
    x = normal(rng, (B, L, D_MODEL))
    model = MultiHeadAttention(num_heads=H, decode=True)
    params, cache = decode_variables(model, x)
    apply = lambda cache, x: model.apply({"params": params, "cache": cache}, x, mutable=["cache"])
    three_in = {**cache, "cache_index": jnp.array(3, jnp.int32)}
    msg = "decoding past the cache: cache_index=3 + 2 new tokens > cache length 4"
    with pytest.raises(ValueError, match=re.escape(msg)):
        apply(three_in, x[:, :2])
    # Under jit the index is traced: the overflowing call returns NaN, never a silent answer.
    step = jax.jit(apply)
    y, mutated = step(three_in, x[:, :1])
    assert np.all(np.isfinite(y)) and mutated["cache"]["cache_index"] == L
    y, _ = step(mutated["cache"], x[:, :1])
    assert np.all(np.isnan(y))
    with pytest.raises(ValueError, match=re.escape("decoding key of shape (3, 3, 1, 11) does not fit the cache")):
        apply(cache, normal(rng, (3, 1, D_MODEL)))


@pytest.mark.parametrize("block", [False, True], ids=["mha", "block"])
def test_decoding_without_the_cache_or_its_mutability_raises(rng, block):
    # Without the cache it used to run a plain non-causal pass and create a 1-token cache;
    # without mutable=["cache"] it surfaced flax's ModifyScopeVariableError.
    L = 5
    x = normal(rng, (B, L, D_MODEL))
    model = TransformerBlock(num_heads=H, d_ff=7, decode=True) if block else MultiHeadAttention(num_heads=H, decode=True)
    params, cache = decode_variables(model, x)
    msg = 'decode=True needs the "cache" collection from init (with an input of the maximum length)'
    with pytest.raises(ValueError, match=re.escape(msg)):
        model.apply({"params": params}, x[:, :1], mutable=["cache"])
    with pytest.raises(ValueError, match=re.escape(msg)):
        model.apply({"params": params}, x[:, :1])
    msg = 'writes the "cache" collection at every step: call apply(variables, x, mutable=["cache"])'
    with pytest.raises(ValueError, match=re.escape(msg)) as caught:
        model.apply({"params": params, "cache": cache}, x[:, :1])
    assert isinstance(caught.value, flax.errors.ModifyScopeVariableError)  # still caught as flax's error
    y, mutated = model.apply({"params": params, "cache": cache}, x[:, :1], mutable=["cache"])  # with it: fine
    assert y.shape == (B, 1, D_MODEL)
    index = mutated["cache"]["attention"]["cache_index"] if block else mutated["cache"]["cache_index"]
    assert index == 1


# -------------------------------------------------------------------------------- RoPE


def np_rope(x, positions, base=10000.0):
    """Rotate-half RoPE in float64: pairs (i, i + D/2) turn by position * base^(-2i/D)."""
    x = np.asarray(x, np.float64)
    half = x.shape[-1] // 2
    angle = np.asarray(positions, np.float64)[:, None] * base ** (-2.0 * np.arange(half) / x.shape[-1])
    cos, sin = np.cos(angle), np.sin(angle)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def test_rope_matches_float64_reference_and_sees_only_offsets(rng, np_attention):
    x = normal(rng, (B, N, 30))  # H = 3, D = 10
    model = MultiHeadAttention(num_heads=3, rope=True, rope_base=100.0)
    params = init_params(model, x)
    out, weights = model.apply(params, x, is_causal=True, return_weights=True)

    p = params["params"]
    heads = lambda name: np.asarray(x, np.float64) @ np.asarray(p[name]["kernel"], np.float64)
    split = lambda a: a.reshape(B, N, 3, 10).swapaxes(1, 2)  # (B, H, N, D)
    q, k = (np_rope(split(heads(n)), np.arange(N), base=100.0) for n in ("query", "key"))
    ref_out, ref_w = np_attention(q, k, split(heads("value")), causal_mask(N))
    ref_out = ref_out.swapaxes(1, 2).reshape(B, N, 30) @ np.asarray(p["out"]["kernel"]) + np.asarray(p["out"]["bias"])
    np.testing.assert_allclose(weights, ref_w, atol=tol(1.0, 30 + 10 + N))  # projections over 30, RoPE, D=10
    np.testing.assert_allclose(out, ref_out, atol=tol(ref_out))

    # Shifting every position by one offset leaves the logits (so the weights) unchanged
    # (up to float32 angles: the rotations themselves change a lot)...
    shifted, w_shifted = model.apply(params, x, is_causal=True, return_weights=True, positions=np.arange(N) + 997)
    np.testing.assert_allclose(w_shifted, weights, atol=1e-4)
    np.testing.assert_allclose(shifted, out, rtol=1e-4, atol=1e-4)
    # ...while changing the spacing changes them, and RoPE differs from no RoPE.
    _, w_spread = model.apply(params, x, is_causal=True, return_weights=True, positions=np.arange(N) * 3)
    _, w_plain = MultiHeadAttention(num_heads=3).apply(params, x, is_causal=True, return_weights=True)
    assert not np.allclose(w_spread, weights, atol=1e-3) and not np.allclose(w_plain, weights, atol=1e-3)


# ------------------------------------------------------- options passed to the core


def test_bias_window_and_lengths_through_the_module(rng, np_attention):
    x = normal(rng, (B, N, D_MODEL))
    model = MultiHeadAttention(num_heads=H, qkv_bias=True)
    params = init_params(model, x)
    alibi = -0.5 * np.abs(np.arange(N)[:, None] - np.arange(N)[None, :]) * np.array([1.0, 2.0, 3.0])[:, None, None]
    q_lengths, kv_lengths = np.array([N, 3]), np.array([4, N])
    out, weights = model.apply(
        params, x, bias=jnp.asarray(alibi, jnp.float32), local_window_size=(1, 2), q_lengths=q_lengths,
        kv_lengths=kv_lengths, return_weights=True,
    )
    i, j = np.arange(N)[:, None], np.arange(N)[None, :]
    allowed = (j >= i - 1) & (j <= i + 2) & (j[None] < kv_lengths[:, None, None])  # (B, N, N)
    ref, ref_w = np_mha(params["params"], x, x, x, H, H, lambda q, k, v, m: np_attention(q, k, v, m, alibi),
                        allowed[:, None])
    valid_rows = np.arange(N)[None, :, None] < q_lengths[:, None, None]  # rows past q_lengths: attention 0
    out_bias = np.asarray(params["params"]["out"]["bias"])
    np.testing.assert_allclose(out, np.where(valid_rows, ref, out_bias), atol=tol(ref))
    np.testing.assert_allclose(weights, np.where(valid_rows[:, None], ref_w, 0.0), atol=tol(1.0, D_MODEL + D + N))


def test_extra_keys_of_pytorch_match_numpy(rng, np_attention):
    """add_bias_kv and add_zero_attn: two more keys every query sees (PyTorch's layer)."""
    x = normal(rng, (B, N, D_MODEL))
    model = MultiHeadAttention(num_heads=H, qkv_bias=True, add_bias_kv=True, add_zero_attn=True)
    params = init_params(model, x)
    p = params["params"]
    assert p["bias_k"].shape == p["bias_v"].shape == (D_MODEL,)
    out, weights = model.apply(params, x, is_causal=True, return_weights=True)
    chex.assert_shape(weights, (B, H, N, N + 2))

    dense = lambda name: np.asarray(x, np.float64) @ np.asarray(p[name]["kernel"]) + np.asarray(p[name]["bias"])
    split = lambda a: a.reshape(*a.shape[:-1], H, D).swapaxes(-3, -2)  # (B, H, len, D)
    extra = lambda name: np.broadcast_to(split(np.stack([np.asarray(p[name]), np.zeros(D_MODEL)])), (B, H, 2, D))
    k = np.concatenate([split(dense("key")), extra("bias_k")], axis=-2)  # extra keys last, as torch
    v = np.concatenate([split(dense("value")), extra("bias_v")], axis=-2)
    mask = np.concatenate([np.asarray(causal_mask(N)), np.ones((N, 2), bool)], axis=-1)
    ref_out, ref_w = np_attention(split(dense("query")), k, v, mask)
    ref_out = ref_out.swapaxes(1, 2).reshape(B, N, D_MODEL) @ np.asarray(p["out"]["kernel"]) + np.asarray(p["out"]["bias"])
    np.testing.assert_allclose(weights, ref_w, atol=tol(1.0, D_MODEL + D + N + 2))
    np.testing.assert_allclose(out, ref_out, atol=tol(ref_out))
    with pytest.raises(ValueError, match="local_window_size cannot be combined with add_bias_kv"):
        model.apply(params, x, local_window_size=2)


def test_dropout_rng_argument_and_sown_weights(rng):
    x = normal(rng, (B, N, D_MODEL))
    model = MultiHeadAttention(num_heads=H, dropout_rate=0.3)
    params = init_params(model, x)
    key = jax.random.key(7)
    by_arg, w = model.apply(params, x, deterministic=False, dropout_rng=key, return_weights=True)
    # The argument needs no "dropout" rng collection and takes precedence over one (as in flax).
    with_rngs = model.apply(params, x, deterministic=False, dropout_rng=key, rngs={"dropout": jax.random.key(9)})
    np.testing.assert_array_equal(by_arg, with_rngs)
    assert np.mean(np.asarray(w) == 0) > 0.1  # dropped out
    assert not np.allclose(by_arg, model.apply(params, x, deterministic=False, dropout_rng=jax.random.key(8)))

    _, state = model.apply(params, x, deterministic=False, dropout_rng=key, sow_weights=True,
                           mutable=["intermediates"])
    np.testing.assert_array_equal(state["intermediates"]["attention_weights"][0], w)
    block = TransformerBlock(num_heads=H, d_ff=13, sow_weights=True)
    block_params = init_params(block, x)
    y, state = block.apply(block_params, x, is_causal=True, mutable=["intermediates"])
    (sown,) = state["intermediates"]["attention"]["attention_weights"]
    np.testing.assert_array_equal(sown, block.apply(block_params, x, is_causal=True, return_weights=True)[1])


def test_out_features_initialisers_and_precision(rng):
    x = normal(rng, (B, N, D_MODEL))
    model = MultiHeadAttention(
        num_heads=H, out_features=17, out_kernel_init=nn.initializers.constant(0.5),
        out_bias_init=nn.initializers.constant(-2.0), precision=jax.lax.Precision.HIGHEST,
    )
    params = jax.jit(model.init)(jax.random.key(0), x)["params"]
    assert params["out"]["kernel"].shape == (D_MODEL, 17) and params["query"]["kernel"].shape == (D_MODEL, D_MODEL)
    np.testing.assert_array_equal(params["out"]["kernel"], 0.5)
    np.testing.assert_array_equal(params["out"]["bias"], -2.0)
    assert np.std(params["query"]["kernel"]) > 0.05  # the default kernel_init elsewhere
    chex.assert_shape(model.apply({"params": params}, x), (B, N, 17))
    jaxpr = jax.make_jaxpr(lambda p: model.apply({"params": p}, x))(params)
    precisions = [e.params["precision"] for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    # the four projections at HIGHEST; the attention's own matmuls (q·k, w·v) at the default
    assert precisions.count((jax.lax.Precision.HIGHEST,) * 2) == 4, precisions
    assert all(p in ((jax.lax.Precision.HIGHEST,) * 2, None) for p in precisions), precisions


def test_forward_mode_autodiff_through_the_module(rng):
    """jvp agrees with vjp: <w, J t> computed both ways (no custom_vjp in the way)."""
    x, t, w = normal(rng, (B, N, D_MODEL)), normal(rng, (B, N, D_MODEL)), normal(rng, (B, N, D_MODEL))
    model = MultiHeadAttention(num_heads=H)
    params = init_params(model, x)
    f = lambda x: model.apply(params, x, is_causal=True)
    forward_mode = jax.jit(lambda x, t: jnp.sum(w * jax.jvp(f, (x,), (t,))[1]))
    reverse_mode = jax.jit(lambda x, t: jnp.sum(jax.vjp(f, x)[1](w)[0] * t))
    np.testing.assert_allclose(forward_mode(x, t), reverse_mode(x, t), rtol=1e-4)


# ---------------------------------------------------- the projections' custom gradient


def test_projection_dot_general_value_and_derivatives_equal_autodiff(rng):
    """The CPU fast-gradient matmul of the Dense layers is `dot_general` to rounding, in
    value, reverse mode (dx and dw), forward mode and second order."""
    x, w, t_x, t_w = normal(rng, (B, N, 7)), normal(rng, (7, 11)), normal(rng, (B, N, 7)), normal(rng, (7, 11))
    dims = (((2,), (0,)), ((), ()))
    ours = lambda x, w: jnp.sum(jnp.sin(projection_dot_general(x, w, dims)))
    plain = lambda x, w: jnp.sum(jnp.sin(jax.lax.dot_general(x, w, dims)))
    assert jax.default_backend() != "cpu" or "custom_jvp" in str(jax.make_jaxpr(ours)(x, w))

    def close(got, want, terms):  # each leaf at its own size
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(g, w, atol=tol(w, terms))

    # The matmul's sums over 7, the loss's over the B*N*11 outputs, dw's over the B*N rows.
    close(ours(x, w), plain(x, w), 7 + B * N * 11)
    close(jax.grad(ours, (0, 1))(x, w), jax.grad(plain, (0, 1))(x, w), 7 + 11 + B * N)
    close(jax.grad(ours, 1)(x, w), jax.grad(plain, 1)(x, w), 7 + B * N)
    close(jax.jvp(ours, (x, w), (t_x, t_w)), jax.jvp(plain, (x, w), (t_x, t_w)), 2 * 7 + B * N * 11)
    hvp = lambda f: jax.jvp(jax.grad(f, 1), (x, w), (t_x, t_w))[1]  # forward-over-reverse
    chex.assert_trees_all_close(hvp(ours), hvp(plain), rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------- widths, strict promotion, segment ids


@pytest.mark.parametrize("make, error, message", [
    (lambda: MultiHeadAttention(num_heads=H, d_model=0), ValueError, "d_model must be a positive int, got 0"),
    (lambda: MultiHeadAttention(num_heads=H, d_model=-6), ValueError, "d_model must be a positive int, got -6"),
    (lambda: MultiHeadAttention(num_heads=H, d_model=6.0), TypeError, "d_model must be a positive int, got 6.0"),
    (lambda: MultiHeadAttention(num_heads=0), ValueError, "num_heads must be a positive int, got 0"),
    (lambda: MultiHeadAttention(num_heads=H, num_kv_heads=-1), ValueError, "num_kv_heads must be a positive int"),
    (lambda: FeedForward(d_ff=0), ValueError, "d_ff must be a positive int, got 0"),
    (lambda: TransformerBlock(num_heads=H, d_ff=-3), ValueError, "d_ff must be a positive int, got -3"),
    (lambda: TransformerBlock(num_heads=H, d_ff=None), TypeError, "d_ff must be a positive int, got None"),
])
def test_bad_widths_raise_naming_them(make, error, message):
    with pytest.raises(error, match=re.escape(message)):
        make()


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_half_precision_modules_run_under_strict_promotion(rng, dtype, promotion):
    """float32 parameters, `dtype` compute, QK-norm and the block's LayerNorms (whose
    flax statistics promote implicitly): forward, gradient and decoding."""
    x = normal(rng, (B, N, D_MODEL), dtype)
    mha = MultiHeadAttention(num_heads=H, normalize_qk=True, dtype=dtype)
    block = TransformerBlock(num_heads=H, d_ff=7, dtype=dtype)
    decoder = MultiHeadAttention(num_heads=H, decode=True, dtype=dtype)
    dparams, cache = decode_variables(decoder, x)

    # One program per dtype (the promotion mode is read while tracing, so all of it is
    # jitted): forward, gradient, the block, decoding in chunks of 2 and 3 through the
    # cache, and the full causal pass it must equal.
    @jax.jit
    def run(params, block_params, dparams, cache, x):
        y = mha.apply(params, x, is_causal=True)
        grads = jax.grad(lambda p: jnp.sum(mha.apply(p, x).astype(jnp.float32)))(params)
        outs = []
        for start, n in ((0, 2), (2, 3)):
            out, mutated = decoder.apply({"params": dparams, "cache": cache}, x[:, start:start + n], mutable=["cache"])
            outs.append(out)
            cache = mutated["cache"]
        full = MultiHeadAttention(num_heads=H, dtype=dtype).apply({"params": dparams}, x, is_causal=True)
        return y, grads, block.apply(block_params, x), jnp.concatenate(outs, axis=1), full

    y, grads, block_out, out, full = run(init_params(mha, x), init_params(block, x), dparams, cache, x)
    assert y.dtype == dtype
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree_util.tree_leaves(grads))
    assert block_out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(full, np.float32),
                               atol=3e-2 if dtype != jnp.float32 else tol(out))


def segment_mask(ids):
    """The dense `(B, 1, N, N)` mask that `segment_ids` stand for."""
    return ids[:, None, :, None] == ids[:, None, None, :]


def test_segment_ids_through_the_module_equal_their_mask(rng):
    x = normal(rng, (B, 11, D_MODEL))
    ids = jnp.array([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7]])
    for model in (MultiHeadAttention(num_heads=H), TransformerBlock(num_heads=H, d_ff=7)):
        params = init_params(model, x)
        got = model.apply(params, x, is_causal=True, segment_ids=ids)
        want = model.apply(params, x, mask=segment_mask(ids), is_causal=True)
        np.testing.assert_allclose(got, want, atol=tol(want, BLOCK_TERMS))
    cross = MultiHeadAttention(num_heads=H)
    cross_params = init_params(cross, x[:, :5], x[:, :7])
    with pytest.raises(ValueError, match="N=5 queries and S=7 keys"):  # segment_ids are for self-attention
        cross.apply(cross_params, x[:, :5], x[:, :7], segment_ids=ids[:, :5])


def test_decoding_keeps_each_rows_segment(rng):
    """Two documents packed in one row, decoded token by token: each token sees only
    its own document's cached tokens, as the causal forward pass with segment ids."""
    L = 7
    x = normal(rng, (B, L, D_MODEL))
    ids = jnp.array([[0, 0, 0, 1, 1, 1, 1], [3, 3, 3, 3, 3, 4, 4]])
    decoder = MultiHeadAttention(num_heads=H, decode=True, rope=False)
    shapes = jax.eval_shape(lambda key, x: decoder.init(key, x, segment_ids=ids), jax.random.key(0), x)
    params = randomize(shapes["params"])
    cache = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])
    chex.assert_shape(cache["cached_segment_ids"], (B, L))
    step = jax.jit(lambda c, x, i: decoder.apply({"params": params, "cache": c}, x, segment_ids=i, mutable=["cache"]))
    outs = []
    for t in range(L):
        y, mutated = step(cache, x[:, t : t + 1], ids[:, t : t + 1])
        cache = mutated["cache"]
        outs.append(y)
    full = MultiHeadAttention(num_heads=H).apply({"params": params}, x, is_causal=True, segment_ids=ids)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, atol=tol(full))
    np.testing.assert_array_equal(cache["cached_segment_ids"], ids)
    plain_params, plain_cache = decode_variables(decoder, x)
    with pytest.raises(ValueError, match="segment_ids when decoding needs a cache made with segment_ids"):
        decoder.apply({"params": plain_params, "cache": plain_cache}, x[:, :1], segment_ids=ids[:, :1],
                      mutable=["cache"])


# --------------------------------------------------------------------------- attention_fn


class Spy:
    """An `attention_fn`: records the keywords of each call and returns `scale` times
    `jax_mha.attention` (called without the mods, which it may not know)."""

    def __init__(self, scale=1.0):
        self.scale, self.calls = scale, []

    def __call__(self, q, k, v, **kwargs):
        from jax_mha import attention

        self.calls.append(kwargs)
        core = {name: x for name, x in kwargs.items() if name not in ("score_mod", "mask_mod", "logits_soft_cap")}
        out = attention(q, k, v, **core)
        if core.get("return_weights"):
            return out[0] * self.scale, out[1]
        return out * self.scale


def test_attention_fn_is_called_instead_of_the_core(rng, np_attention):
    x = normal(rng, (B, N, D_MODEL))
    spy = Spy(scale=2.0)
    model = MultiHeadAttention(num_heads=H, qkv_bias=True, attention_fn=spy)
    params = init_params(model, x)
    spy.calls.clear()  # init's call
    out = model.apply(params, x, is_causal=True, local_window_size=(2, 0), kv_lengths=jnp.array([N, 3]))
    allowed = np.arange(N)[None, :] <= np.arange(N)[:, None]
    allowed = allowed & (np.arange(N)[None, :] >= np.arange(N)[:, None] - 2)
    allowed = allowed[None, None] & (np.arange(N) < np.array([N, 3])[:, None])[:, None, None, :]  # (B, 1, N, N)
    doubled = lambda q, k, v, m: (2.0 * np_attention(q, k, v, m)[0], None)
    ref, _ = np_mha(params["params"], x, x, x, H, H, doubled, allowed)
    np.testing.assert_allclose(out, ref, atol=tol(ref))
    (call,) = spy.calls
    assert call["is_causal"] is True and call["local_window_size"] == (2, 0)
    assert call["implementation"] == "auto" and call["return_weights"] is False
    assert not {"score_mod", "mask_mod", "logits_soft_cap"} & set(call)  # not given: not passed


def test_attention_fn_receives_the_mods_and_a_partial_equals_the_default(rng):
    from functools import partial

    from jax_mha import attention

    x = normal(rng, (B, N, D_MODEL))
    spy = Spy()
    score_mod, mask_mod = (lambda s, b, h, i, j: s), (lambda b, h, i, j: j <= i)
    params = init_params(MultiHeadAttention(num_heads=H), x)
    MultiHeadAttention(num_heads=H, attention_fn=spy).apply(params, x, score_mod=score_mod, mask_mod=mask_mod,
                                                            logits_soft_cap=30.0)
    assert spy.calls[0]["score_mod"] is score_mod and spy.calls[0]["mask_mod"] is mask_mod
    assert spy.calls[0]["logits_soft_cap"] == 30.0
    blockwise = MultiHeadAttention(num_heads=H, attention_fn=partial(attention, implementation="blockwise"))
    want = MultiHeadAttention(num_heads=H).apply(params, x, is_causal=True)
    np.testing.assert_allclose(blockwise.apply(params, x, is_causal=True), want, atol=tol(want))


@pytest.mark.parametrize("make", [lambda f: MultiHeadAttention(num_heads=H, attention_fn=f),
                                  lambda f: TransformerBlock(num_heads=H, d_ff=7, attention_fn=f)])
def test_attention_fn_that_is_not_callable_raises_naming_it(make):
    with pytest.raises(TypeError, match="attention_fn must be a callable .*got 'blockwise'"):
        make("blockwise")


def test_transformer_block_forwards_attention_options_and_attention_fn(rng):
    x = normal(rng, (B, N, D_MODEL))
    spy = Spy()
    block = TransformerBlock(num_heads=H, d_ff=7, attention_fn=spy)
    params = init_params(block, x)
    spy.calls.clear()  # init's call
    options = dict(is_causal=True, local_window_size=(1, 0), kv_lengths=jnp.array([4, N]))
    out = block.apply(params, x, logits_soft_cap=5.0, **options)
    (call,) = spy.calls
    assert call["logits_soft_cap"] == 5.0 and call["local_window_size"] == (1, 0) and call["is_causal"]
    want = TransformerBlock(num_heads=H, d_ff=7).apply(params, x, **options)
    np.testing.assert_allclose(out, want, atol=tol(want, BLOCK_TERMS))
    with pytest.raises(TypeError, match="windows"):
        block.apply(params, x, windows=3)
