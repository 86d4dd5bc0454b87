"""Tests for `jax_mha.interop`: PyTorch and flax weights in and out.

The round trips and mask conversions need no torch. The parity tests against
`torch.nn.MultiheadAttention` import torch and skip with a reason when it is absent
(`pip install -e ".[torch]"` installs the pinned CPU build).
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import numpy as np
import pytest
from conftest import f32_tolerance
from flax import nnx

from jax_mha import (
    MultiHeadAttention,
    causal_mask,
    from_flax,
    from_torch_state_dict,
    mask_from_torch,
    to_flax,
    to_torch_state_dict,
)
from jax_mha import nnx as jnnx

# B, N, S, H, D: distinct primes; E = H * D.
B, N, S, H, D = 2, 5, 7, 3, 4
E = H * D
# The float32 sums of the layers compared, for the tolerances: the q/k/v projections
# (up to 24 wide), the q/k norms and the logits over D, the softmax sum and weights @ v
# over up to S + 2 keys (torch's extra keys), the output projection.
LAYER_TERMS = 24 + 3 * D + 2 * (S + 2) + 24


def tol(want):
    """`f32_tolerance` at `want`'s size."""
    return f32_tolerance(terms=LAYER_TERMS, magnitude=want)


def np_normal(rng, shape):
    return (0.5 * rng.standard_normal(shape)).astype(np.float32)


def torch_like_state_dict(rng, *, kdim=E, vdim=E, bias=True, add_bias_kv=False):
    """Random arrays with `torch.nn.MultiheadAttention.state_dict()`'s names and shapes."""
    sd = {}
    if kdim == vdim == E:
        sd["in_proj_weight"] = np_normal(rng, (3 * E, E))
    else:
        sd.update(q_proj_weight=np_normal(rng, (E, E)), k_proj_weight=np_normal(rng, (E, kdim)),
                  v_proj_weight=np_normal(rng, (E, vdim)))
    if bias:
        sd["in_proj_bias"] = np_normal(rng, (3 * E,))
    sd["out_proj.weight"] = np_normal(rng, (E, E))
    if bias:
        sd["out_proj.bias"] = np_normal(rng, (E,))
    if add_bias_kv:
        sd.update(bias_k=np_normal(rng, (1, 1, E)), bias_v=np_normal(rng, (1, 1, E)))
    return sd


# ------------------------------------------------------------------ torch, no torch needed


@pytest.mark.parametrize("layout", [dict(), dict(kdim=11, vdim=13), dict(bias=False, add_bias_kv=True)])
def test_torch_state_dict_round_trips_exactly(rng, layout):
    sd = torch_like_state_dict(rng, **layout)
    params = from_torch_state_dict({"attn." + k: v for k, v in sd.items()}, prefix="attn.")
    assert params["query"]["kernel"].shape == (E, E)
    assert params["key"]["kernel"].shape == (layout.get("kdim", E), E)  # torch's (out, in), transposed
    np.testing.assert_array_equal(params["out"]["kernel"], sd["out_proj.weight"].T)
    back = to_torch_state_dict(params)
    assert back.keys() == sd.keys()
    for name in sd:
        np.testing.assert_array_equal(back[name], sd[name], err_msg=name)
    # ours -> torch -> ours, and the arrays are copies, not views of the input.
    again = from_torch_state_dict(back)
    jax.tree_util.tree_map(np.testing.assert_array_equal, again, params)
    back["out_proj.weight"][:] = 0
    assert np.any(params["out"]["kernel"] != 0)


def test_torch_conversion_errors(rng):
    sd = torch_like_state_dict(rng)
    with pytest.raises(ValueError, match=re.escape("unexpected keys ['in_proj.weight']")):
        from_torch_state_dict({**sd, "in_proj.weight": sd["in_proj_weight"]})
    with pytest.raises(ValueError, match=re.escape("missing keys ['out_proj.weight']")):
        from_torch_state_dict({"in_proj_weight": sd["in_proj_weight"]})
    params = from_torch_state_dict(sd)
    gqa = {**params, "key": {"kernel": params["key"]["kernel"][:, :D], "bias": params["key"]["bias"][:D]}}
    with pytest.raises(ValueError, match="no grouped-query attention"):
        to_torch_state_dict(gqa)
    with pytest.raises(ValueError, match="one `bias` flag"):
        to_torch_state_dict({**params, "out": {"kernel": params["out"]["kernel"]}})
    with pytest.raises(ValueError, match=re.escape("no parameters like ['key_ln', 'query_ln']")):
        to_torch_state_dict({**params, "query_ln": {"scale": np.ones(D)}, "key_ln": {"scale": np.ones(D)}})
    wide = {**params, "out": {"kernel": np.ones((E, 5)), "bias": np.ones(5)}}
    with pytest.raises(ValueError, match="query and output widths equal to embed_dim=12"):
        to_torch_state_dict(wide)
    # Ours -> torch: a parameter torch has no place for is refused, naming the option it came from.
    with pytest.raises(ValueError, match=re.escape("no parameters like ['sinks'] (from sinks=True)")):
        to_torch_state_dict({**params, "sinks": np.zeros(H)})
    with pytest.raises(ValueError, match=re.escape("params['query']: unexpected keys ['scale']")):
        to_torch_state_dict({**params, "query": {**params["query"], "scale": np.ones(D)}})


def np_torch_mha(sd, query, key, value, np_attention):
    """`torch.nn.MultiheadAttention`'s forward pass from its state dict, in float64,
    written from PyTorch's documentation (biases added after each projection,
    `bias_k`/`bias_v` appended as one more key and value)."""
    f = lambda a: np.asarray(a, np.float64)
    w = np.split(f(sd["in_proj_weight"]), 3) if "in_proj_weight" in sd else [f(sd[f"{c}_proj_weight"]) for c in "qkv"]
    b = np.split(f(sd["in_proj_bias"]), 3) if "in_proj_bias" in sd else [0.0] * 3
    q, k, v = (f(x) @ wi.T + bi for x, wi, bi in zip((query, key, value), w, b))  # (B, L, E)
    if "bias_k" in sd:
        k = np.concatenate([k, np.broadcast_to(f(sd["bias_k"]), (len(k), 1, E))], axis=1)
        v = np.concatenate([v, np.broadcast_to(f(sd["bias_v"]), (len(v), 1, E))], axis=1)
    heads = lambda x: x.reshape(*x.shape[:2], H, D).swapaxes(1, 2)  # (B, H, L, D)
    out, _ = np_attention(heads(q), heads(k), heads(v))
    out = out.swapaxes(1, 2).reshape(*query.shape[:2], E) @ f(sd["out_proj.weight"]).T
    return out + (f(sd["out_proj.bias"]) if "out_proj.bias" in sd else 0.0)


# (torch layout, a module without a place for some of it, what the refusal says)
REFUSALS = {
    "qkv_biases": (dict(), dict(qkv_bias=False), "have ['key/bias', 'query/bias', 'value/bias'], which the module "
                                                  "has no place for and would drop: build it with qkv_bias=True"),
    "out_bias": (dict(), dict(out_bias=False), "have ['out/bias'], which the module has no place for and would "
                                                "drop: build it with out_bias=True"),
    "bias_kv": (dict(bias=False, add_bias_kv=True), dict(add_bias_kv=False),
                "have ['bias_k', 'bias_v'], which the module has no place for and would drop: "
                "build it with add_bias_kv=True"),
    "missing_out_bias": (dict(bias=False), dict(out_bias=True),
                         "needs ['out/bias'], which the weights lack: build it with out_bias=False"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_loading_refuses_torch_parameters_the_module_has_no_place_for(rng, np_attention, case):
    """Flax ignores given parameters a module does not read: loading torch's biases into
    a module without `qkv_bias=True` used to drop them silently."""
    layout, wrong, message = REFUSALS[case]
    sd = torch_like_state_dict(rng, **layout)  # every entry nonzero, the biases included
    params = from_torch_state_dict(sd)
    x = np_normal(rng, (B, N, E))
    bias = layout.get("bias", True)
    right = dict(qkv_bias=bias, out_bias=bias, add_bias_kv=layout.get("add_bias_kv", False))

    with pytest.raises(ValueError, match=re.escape(message)):
        MultiHeadAttention(num_heads=H, **{**right, **wrong}).apply({"params": params}, x)
    with pytest.raises(ValueError, match=re.escape(message)):
        jnnx.from_linen_params(jnnx.MultiHeadAttention(H, E, **{**right, **wrong}, rngs=nnx.Rngs(0)), params)
    if case == "qkv_biases":  # presence decides, not value: torch's zero-initialised biases are refused too
        zero = from_torch_state_dict({**sd, "in_proj_bias": np.zeros(3 * E, np.float32)})
        with pytest.raises(ValueError, match="qkv_bias=True"):
            MultiHeadAttention(num_heads=H, **{**right, **wrong}).apply({"params": zero}, x)

    # The module the weights ask for reproduces torch's layer (linen and NNX alike).
    expected = np_torch_mha(sd, x, x, x, np_attention)
    out = MultiHeadAttention(num_heads=H, **right).apply({"params": params}, x)
    np.testing.assert_allclose(out, expected, atol=tol(expected))
    twin = jnnx.from_linen_params(jnnx.MultiHeadAttention(H, E, **right, rngs=nnx.Rngs(0)), params)
    np.testing.assert_allclose(twin(x), out, atol=tol(out))


def test_mask_from_torch_conventions():
    blocked = np.array([[False, True, True], [False, False, True]])  # (N=2, S=3), torch: True = blocked
    mask, bias = mask_from_torch(blocked)
    np.testing.assert_array_equal(mask, ~blocked)
    assert bias is None
    additive = np.where(blocked, -np.inf, 0.5).astype(np.float32)
    padding = np.array([[False, False, True], [False, False, False]])  # (B=2, S=3)
    mask, bias = mask_from_torch(additive, padding)
    np.testing.assert_array_equal(mask, ~padding[:, None, None, :])  # (B, 1, 1, S)
    np.testing.assert_array_equal(bias, additive)
    per_head = np.arange(2 * 3 * 2 * 3).reshape(6, 2, 3) % 2 == 0  # (B*H, N, S) with H = 3
    mask, _ = mask_from_torch(per_head, padding, num_heads=3)
    np.testing.assert_array_equal(mask, ~per_head.reshape(2, 3, 2, 3) & ~padding[:, None, None, :])
    with pytest.raises(ValueError, match=re.escape("pass a num_heads that divides 6, got num_heads=4")):
        mask_from_torch(per_head, num_heads=4)
    with pytest.raises(TypeError, match="complex"):
        mask_from_torch(np.ones((2, 3), np.complex64))


# -------------------------------------------------------------- torch parity (needs torch)


def torch_cases():
    return {
        "self": (dict(), dict(), "self"),
        "causal_no_bias": (dict(bias=False), dict(), "causal"),
        "cross_kdim_vdim_padded": (dict(kdim=11, vdim=13), dict(), "padded"),
        "bias_kv_zero_attn_float_mask": (dict(add_bias_kv=True, add_zero_attn=True), dict(), "float+padded"),
        # Everything at once: cross-attention from other widths, both extra keys, causal + padding, no biases.
        "cross_kdim_vdim_bias_kv_zero_attn_causal_padded_no_bias": (
            dict(kdim=11, vdim=13, add_bias_kv=True, add_zero_attn=True, bias=False), dict(), "causal+padded"
        ),
    }


@pytest.mark.parametrize("case", list(torch_cases()))
def test_outputs_equal_torch_multihead_attention(rng, case):
    torch = pytest.importorskip("torch", reason="PyTorch is optional: pip install -e '.[torch]'")
    options, _, masks = torch_cases()[case]
    torch.manual_seed(0)
    layer = torch.nn.MultiheadAttention(E, H, batch_first=True, **options).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.4)  # also the zero-initialised biases
    params = from_torch_state_dict({k: v.numpy() for k, v in layer.state_dict().items()})
    cross = "kdim" in options
    query = np_normal(rng, (B, N, E))
    key, value = (np_normal(rng, (B, S, options.get("kdim", E))), np_normal(rng, (B, S, options.get("vdim", E)))) \
        if cross else (query, query)
    length = S if cross else N
    attn_mask = key_padding_mask = None
    if masks in ("causal", "float+padded", "causal+padded"):
        attn_mask = ~np.asarray(causal_mask(N, length))  # torch: True = blocked
    if masks == "float+padded":
        attn_mask = np.where(attn_mask, -np.inf, 0.1 * rng.standard_normal((N, length))).astype(np.float32)
    if masks in ("padded", "float+padded", "causal+padded"):
        key_padding_mask = np.arange(length)[None] >= np.array([[length], [3]])
    if masks == "float+padded":
        key_padding_mask = np.where(key_padding_mask, -np.inf, 0.0).astype(np.float32)  # torch wants one type

    as_tensor = lambda x: None if x is None else torch.from_numpy(np.ascontiguousarray(x))
    with torch.no_grad():
        expected, expected_w = layer(as_tensor(query), as_tensor(key), as_tensor(value), attn_mask=as_tensor(attn_mask),
                                     key_padding_mask=as_tensor(key_padding_mask), average_attn_weights=False)
    bias = options.get("bias", True)
    model = MultiHeadAttention(num_heads=H, qkv_bias=bias, out_bias=bias, add_bias_kv=options.get("add_bias_kv", False),
                               add_zero_attn=options.get("add_zero_attn", False))
    mask, additive = mask_from_torch(attn_mask, key_padding_mask)
    out, weights = model.apply({"params": params}, query, key, value, mask, bias=additive, return_weights=True)
    np.testing.assert_allclose(out, expected.numpy(), atol=tol(expected.numpy()))
    np.testing.assert_allclose(weights, expected_w.numpy(), atol=tol(1.0))


# -------------------------------------------------------------------------------- flax


def test_from_flax_equals_multi_head_dot_product_attention_with_qk_norm(rng):
    query, memory = np_normal(rng, (B, N, 11)), np_normal(rng, (B, S, 13))
    mask = np.asarray(rng.random((B, 1, N, S)) < 0.7)
    mask[..., 0] = True  # flax gives uniform weights to fully masked rows, we give zeros
    ref = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=E, out_features=17, normalize_qk=True)
    shapes = jax.eval_shape(ref.init, jax.random.key(0), query, memory)["params"]
    flax_params = jax.tree_util.tree_map(lambda s: np_normal(rng, s.shape) + (s.shape == (D,)), shapes)
    expected = jax.jit(lambda p: ref.apply({"params": p}, query, memory, mask=mask))(flax_params)

    params = from_flax(flax_params)
    assert params["query"]["kernel"].shape == (11, E) and params["out"]["kernel"].shape == (E, 17)
    model = MultiHeadAttention(num_heads=H, d_model=E, qkv_bias=True, out_features=17, normalize_qk=True)
    out = jax.jit(lambda p: model.apply({"params": p}, query, memory, mask=mask))(params)
    np.testing.assert_allclose(out, expected, atol=tol(expected))
    back = to_flax(params, num_heads=H)
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, flax_params)


def test_from_flax_nnx_grouped_query_attention(rng):
    x = np_normal(rng, (B, N, E))
    ref = nnx.MultiHeadAttention(num_heads=6, in_features=E, qkv_features=24, num_kv_heads=2, decode=False,
                                 rngs=nnx.Rngs(0))
    params = from_flax(nnx.to_pure_dict(nnx.state(ref, nnx.Param)))
    assert params["key"]["kernel"].shape == (E, 8)  # 2 kv heads of D = 4
    model = MultiHeadAttention(num_heads=6, d_model=24, num_kv_heads=2, qkv_bias=True, out_features=E)
    expected = nnx.jit(lambda m: m(x))(ref)
    np.testing.assert_allclose(jax.jit(lambda p: model.apply({"params": p}, x))(params), expected, atol=tol(expected))


def test_flax_conversion_errors(rng):
    params = from_flax({name: {"kernel": np.ones((E, H, D) if name != "out" else (H, D, E))}
                        for name in ("query", "key", "value", "out")})
    with pytest.raises(ValueError, match=re.escape("query kernel width 12 is not divisible by num_heads=5")):
        to_flax(params, num_heads=5)
    with pytest.raises(ValueError, match="one `use_bias` flag"):
        to_flax({**params, "out": {"kernel": params["out"]["kernel"], "bias": np.ones(E)}}, num_heads=H)
    with pytest.raises(ValueError, match=re.escape("flax query/kernel must be 3-D (DenseGeneral), got shape (12, 12)")):
        from_flax({**params, "query": {"kernel": np.ones((E, E))}})
    with pytest.raises(ValueError, match=re.escape("unexpected keys ['bias_k']")):
        to_flax({**params, "bias_k": np.ones(E)}, num_heads=H)
    # flax's one use_bias=True into our default module (no query/key/value biases): refused, not dropped.
    biased = from_flax({name: {"kernel": np.ones((E, H, D) if name != "out" else (H, D, E)),
                               "bias": np.ones((H, D) if name != "out" else (E,))} for name in params})
    with pytest.raises(ValueError, match=re.escape("['key/bias', 'query/bias', 'value/bias']") + ".*qkv_bias=True"):
        MultiHeadAttention(num_heads=H).apply({"params": biased}, np.ones((B, N, E), np.float32))
