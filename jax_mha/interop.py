"""Weights and masks in and out of PyTorch and flax, as NumPy arrays.

Nothing here imports torch: pass `{k: v.numpy() for k, v in m.state_dict().items()}`
(or the tensors themselves, which NumPy converts) and get NumPy arrays back.

* `torch.nn.MultiheadAttention(E, H, bias=b, add_bias_kv=..., add_zero_attn=...,
  kdim=..., vdim=...)` ↔ `jax_mha.MultiHeadAttention(num_heads=H, qkv_bias=b,
  out_bias=b, add_bias_kv=..., add_zero_attn=...)`: torch's `(out, in)` weights are
  our transposed kernels, and its head split (E = H·D, head-major) is `split_heads`.
* `flax.linen.MultiHeadDotProductAttention` (and `flax.nnx.MultiHeadAttention`):
  DenseGeneral kernels `(d_in, H, D)` / `(H, D, d_out)` ↔ our `(d_in, H*D)` /
  `(H*D, d_out)` by a reshape; `query_ln`/`key_ln` scales are shared as they are.

Loading refuses what it would drop. A converted parameter needs a module built with
the option that gives it a place: `query/key/value` biases need `qkv_bias=True`, an
`out` bias `out_bias=True`, `bias_k`/`bias_v` `add_bias_kv=True`, `query_ln`/`key_ln`
`normalize_qk=True`. The rule is presence, not value: a bias that is zero (PyTorch
initialises its biases to zero) is still a trained parameter and is refused all the
same, and a parameter the module has but the weights lack is refused the other way
(build with the option off). `jax_mha.MultiHeadAttention.apply` and
`jax_mha.nnx.from_linen_params` raise a one-line `ValueError` naming the option;
`to_torch_state_dict` and `to_flax` refuse parameters the other library has no place
for.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

_TORCH_KEYS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias",
               "out_proj.weight", "out_proj.bias", "bias_k", "bias_v")
_PROJECTIONS = ("query", "key", "value", "out")
# The MultiHeadAttention option that gives each optional parameter its place, keyed by
# the tail of the parameter's path (so a path inside a whole model, under a block's
# "attention", finds it too). `sinks`: the per-head sink logits of `sinks=True`.
_OPTIONS = {
    ("query", "bias"): "qkv_bias", ("key", "bias"): "qkv_bias", ("value", "bias"): "qkv_bias",
    ("out", "bias"): "out_bias", ("query_ln", "scale"): "normalize_qk", ("key_ln", "scale"): "normalize_qk",
    ("bias_k",): "add_bias_kv", ("bias_v",): "add_bias_kv", ("sinks",): "sinks",
}


def _array(x) -> np.ndarray:
    return np.array(x, copy=True)  # a copy: never alias the caller's (e.g. torch's) memory


def _check_keys(what: str, keys, allowed, required=()) -> None:
    unknown = sorted(set(keys) - set(allowed))
    missing = sorted(set(required) - set(keys))
    if unknown or missing:
        raise ValueError(f"{what}: unexpected keys {unknown}, missing keys {missing} (expected among {list(allowed)})")


def _option_of(path: tuple[str, ...]) -> str | None:
    """The `MultiHeadAttention` option that creates the parameter at `path`, or None."""
    for tail, option in _OPTIONS.items():
        if tuple(path[-len(tail):]) == tail:
            return option
    return None


def _attention_parameters(options: Mapping[str, bool]) -> set[tuple[str, ...]]:
    """Paths of the parameters a `MultiHeadAttention` with these flags (`qkv_bias`,
    `out_bias`, `normalize_qk`, `add_bias_kv`, `sinks`) owns."""
    paths = {(name, "kernel") for name in _PROJECTIONS}
    return paths | {path for path, option in _OPTIONS.items() if options.get(option, False)}


def _placement_problem(unexpected, missing) -> str | None:
    """One line saying which parameters a module has no place for (`unexpected`, it
    would drop them) or lacks (`missing`), with the option to change; None if neither.

    Args:
      unexpected, missing: iterables of parameter paths (tuples of names).
    """
    def fix(paths, on: bool) -> str:
        options = sorted({f"{_option_of(p)}={on}" for p in paths if _option_of(p)})
        return f"build it with {', '.join(options)}" if options else "no MultiHeadAttention option changes that"

    names = lambda paths: sorted("/".join(p) for p in paths)
    parts = []
    if unexpected:
        parts.append(f"the weights have {names(unexpected)}, which the module has no place for and would drop: "
                     f"{fix(unexpected, True)}")
    if missing:
        parts.append(f"the module needs {names(missing)}, which the weights lack: {fix(missing, False)}")
    return "; ".join(parts) or None


def from_torch_state_dict(state_dict: Mapping, *, prefix: str = "") -> dict:
    """Parameters of `jax_mha.MultiHeadAttention` from a `torch.nn.MultiheadAttention`
    state dict.

    Args:
      state_dict: name → array (NumPy, or CPU tensors). Packed `in_proj_weight (3E, E)`
        or, when kdim/vdim differ from E, `q_proj_weight (E, E)`, `k_proj_weight
        (E, kdim)`, `v_proj_weight (E, vdim)`; `in_proj_bias (3E,)`, `out_proj.weight
        (E, E)`, `out_proj.bias (E,)` (with `bias=True`); `bias_k`, `bias_v (1, 1, E)`
        (with `add_bias_kv=True`).
      prefix: read only keys starting with it (e.g. `"encoder.attn."`), stripped.

    Returns:
      The `params` dict (NumPy): `query/kernel (E, E)`, `key/kernel (kdim, E)`,
      `value/kernel (vdim, E)`, `out/kernel (E, E)`, biases `(E,)`, `bias_k`/`bias_v
      (E,)`. Load it into `MultiHeadAttention(num_heads=H, qkv_bias=bias,
      out_bias=bias, add_bias_kv=..., add_zero_attn=...)`; a module built without
      `qkv_bias=True` (or `out_bias`, `add_bias_kv`) for weights that have those
      parameters refuses them when applied (see the module docstring).

    Raises:
      ValueError: naming the keys, for unknown or missing entries.
    """
    sd = {k[len(prefix):]: np.asarray(v) for k, v in state_dict.items() if k.startswith(prefix)}
    packed = "in_proj_weight" in sd
    required = ("in_proj_weight",) if packed else ("q_proj_weight", "k_proj_weight", "v_proj_weight")
    _check_keys("torch state dict", sd, _TORCH_KEYS, required + ("out_proj.weight",))
    weights = np.split(sd["in_proj_weight"], 3) if packed else [sd[f"{c}_proj_weight"] for c in "qkv"]
    params = {name: {"kernel": _array(w.T)} for name, w in zip(_PROJECTIONS, weights)}
    params["out"] = {"kernel": _array(sd["out_proj.weight"].T)}
    if "in_proj_bias" in sd:
        for name, b in zip(_PROJECTIONS, np.split(sd["in_proj_bias"], 3)):
            params[name]["bias"] = _array(b)
    if "out_proj.bias" in sd:
        params["out"]["bias"] = _array(sd["out_proj.bias"])
    for name in ("bias_k", "bias_v"):
        if name in sd:
            params[name] = _array(sd[name].reshape(-1))
    return params


def _torch_layout_problem(params: Mapping) -> str | None:
    """Why these parameters have no `torch.nn.MultiheadAttention` equivalent, or None."""
    extra = sorted(set(params) - set(_PROJECTIONS) - {"bias_k", "bias_v"})
    if extra:
        options = sorted({f"{_option_of((name,)) or _option_of((name, 'scale'))}=True" for name in extra})
        return f"torch.nn.MultiheadAttention has no parameters like {extra} (from {', '.join(options)})"
    e = params["query"]["kernel"].shape[1]
    shapes = {name: tuple(params[name]["kernel"].shape) for name in _PROJECTIONS}
    if shapes["query"][0] != e or shapes["out"] != (e, e):
        return f"torch.nn.MultiheadAttention needs query and output widths equal to embed_dim={e}, got kernels {shapes}"
    if shapes["key"][1] != e or shapes["value"][1] != e:
        return (f"torch.nn.MultiheadAttention has no grouped-query attention: key/value kernels {shapes['key']}, "
                f"{shapes['value']} have fewer than embed_dim={e} columns")
    with_bias = {name: "bias" in params[name] for name in _PROJECTIONS}
    if len(set(with_bias.values())) > 1:
        return f"torch.nn.MultiheadAttention has one `bias` flag for all projections, got biases {with_bias}"
    if ("bias_k" in params) != ("bias_v" in params):
        return "bias_k and bias_v come together (torch's add_bias_kv)"
    return None


def to_torch_state_dict(params: Mapping, *, prefix: str = "") -> dict:
    """A `torch.nn.MultiheadAttention` state dict from `jax_mha.MultiHeadAttention`
    parameters: the inverse of `from_torch_state_dict` (exact round trip).

    Args:
      params: the `params` dict of a module with `num_kv_heads == num_heads`,
        `qkv_bias == out_bias`, no QK-norm, and query/output widths = d_model.
      prefix: prepended to every key.

    Returns:
      name → NumPy array; packed `in_proj_weight` when key and value widths equal E
      (torch's `_qkv_same_embed_dim`), else `q/k/v_proj_weight`. Load with
      `m.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()})`.

    Raises:
      ValueError: naming the shapes or the parameters, when torch has no equivalent
        layer (QK-norm, GQA, output widths, one bias flag) or no place for a parameter.
    """
    _check_keys("params", params, _PROJECTIONS + ("bias_k", "bias_v", "query_ln", "key_ln", "sinks"), _PROJECTIONS)
    for name in _PROJECTIONS:
        _check_keys(f"params[{name!r}]", params[name], ("kernel", "bias"), ("kernel",))
    problem = _torch_layout_problem(params)
    if problem:
        raise ValueError(problem)
    weights = [np.asarray(params[name]["kernel"]).T for name in _PROJECTIONS[:3]]  # torch's (out, in)
    e = weights[0].shape[0]
    if all(w.shape[1] == e for w in weights):
        sd = {"in_proj_weight": _array(np.concatenate(weights))}
    else:
        sd = {f"{c}_proj_weight": _array(w) for c, w in zip("qkv", weights)}
    if "bias" in params["query"]:
        sd["in_proj_bias"] = _array(np.concatenate([np.asarray(params[n]["bias"]) for n in _PROJECTIONS[:3]]))
    sd["out_proj.weight"] = _array(np.asarray(params["out"]["kernel"]).T)
    if "bias" in params["out"]:
        sd["out_proj.bias"] = _array(params["out"]["bias"])
    for name in ("bias_k", "bias_v"):
        if name in params:
            sd[name] = _array(np.asarray(params[name]).reshape(1, 1, e))
    return {prefix + k: v for k, v in sd.items()}


def _from_torch_mask(name: str, x) -> tuple[np.ndarray | None, np.ndarray | None]:
    """One torch mask → `(allowed, bias)`: bool (or legacy uint8) True = blocked,
    float = added to the logits."""
    x = np.asarray(x)
    if x.dtype == np.bool_ or np.issubdtype(x.dtype, np.integer):
        return ~x.astype(bool), None
    if np.issubdtype(x.dtype, np.floating):
        return None, x
    raise TypeError(f"{name} must be bool, integer or floating, got dtype {x.dtype}")


def mask_from_torch(attn_mask=None, key_padding_mask=None, *, num_heads: int | None = None):
    """PyTorch's attention masks as this library's `(mask, bias)`.

    PyTorch blocks where a boolean mask is True and adds float masks to the logits;
    here `mask` is True where a query *may* attend and `bias` is added (a `-inf` entry
    masks its key, as in PyTorch). One difference: a query with every key blocked
    gets NaN in PyTorch and zeros here.

    Args:
      attn_mask: `(N, S)` or `(B*num_heads, N, S)` (torch's layout), bool or float.
      key_padding_mask: `(B, S)` (or `(S,)` unbatched), True (or -inf) = padding.
      num_heads: H, needed to unfold a 3-D `attn_mask`.

    Returns:
      `(mask, bias)`, NumPy arrays broadcastable to `(B, H, N, S)`, each None when
      no input contributes to it; pass them as `mask=` and `bias=`.

    Raises:
      ValueError: for a 3-D attn_mask without a num_heads that divides it, or bad ranks.
      TypeError: for masks that are neither bool, integer nor floating.
    """
    parts = []
    if attn_mask is not None:
        attn_mask = np.asarray(attn_mask)
        if attn_mask.ndim == 3:
            if num_heads is None or attn_mask.shape[0] % num_heads:
                raise ValueError(f"a 3-D attn_mask of shape {attn_mask.shape} is (B*num_heads, N, S): pass a "
                                 f"num_heads that divides {attn_mask.shape[0]}, got num_heads={num_heads}")
            attn_mask = attn_mask.reshape(-1, num_heads, *attn_mask.shape[1:])  # (B, H, N, S)
        elif attn_mask.ndim != 2:
            raise ValueError(f"attn_mask must be (N, S) or (B*num_heads, N, S), got shape {attn_mask.shape}")
        parts.append(_from_torch_mask("attn_mask", attn_mask))
    if key_padding_mask is not None:
        key_padding_mask = np.asarray(key_padding_mask)
        if key_padding_mask.ndim not in (1, 2):
            raise ValueError(f"key_padding_mask must be (B, S) or (S,), got shape {key_padding_mask.shape}")
        if key_padding_mask.ndim == 2:
            key_padding_mask = key_padding_mask[:, None, None, :]  # (B, 1, 1, S)
        parts.append(_from_torch_mask("key_padding_mask", key_padding_mask))
    mask = bias = None
    for allowed, add in parts:
        if allowed is not None:
            mask = allowed if mask is None else mask & allowed
        if add is not None:
            bias = add if bias is None else bias + add
    return mask, bias


def from_flax(params: Mapping) -> dict:
    """Parameters of `jax_mha.MultiHeadAttention` from those of
    `flax.linen.MultiHeadDotProductAttention` (or `flax.nnx.MultiHeadAttention`'s,
    as a pure dict).

    Args:
      params: `query/kernel (d_q, H, D)`, `key/kernel (d_k, K, D)`, `value/kernel
        (d_v, K, D)`, biases `(H, D)`/`(K, D)`, `out/kernel (H, D, d_out)`, `out/bias
        (d_out,)`; with QK-norm `query_ln/scale (D,)`, `key_ln/scale (D,)`.

    Returns:
      The `params` dict (NumPy) for `MultiHeadAttention(num_heads=H, num_kv_heads=K,
      qkv_bias=use_bias, out_bias=use_bias, out_features=d_out,
      normalize_qk=normalize_qk)`.

    Raises:
      ValueError: for unknown or missing entries, or kernels of the wrong rank.
    """
    _check_keys("flax params", params, _PROJECTIONS + ("query_ln", "key_ln"), _PROJECTIONS)
    ours = {}
    for name in _PROJECTIONS:
        _check_keys(f"flax params[{name!r}]", params[name], ("kernel", "bias"), ("kernel",))
        kernel = np.asarray(params[name]["kernel"])
        if kernel.ndim != 3:
            raise ValueError(f"flax {name}/kernel must be 3-D (DenseGeneral), got shape {kernel.shape}")
        shape = (-1, kernel.shape[-1]) if name == "out" else (kernel.shape[0], -1)  # (H*D, d_out), (d, heads*D)
        ours[name] = {"kernel": _array(kernel.reshape(shape))}
        if "bias" in params[name]:
            ours[name]["bias"] = _array(np.asarray(params[name]["bias"]).reshape(-1))
    for name in ("query_ln", "key_ln"):
        if name in params:
            _check_keys(f"flax params[{name!r}]", params[name], ("scale",), ("scale",))
            ours[name] = {"scale": _array(params[name]["scale"])}
    return ours


def to_flax(params: Mapping, num_heads: int) -> dict:
    """`flax.linen.MultiHeadDotProductAttention` parameters (NumPy) from ours: the
    inverse of `from_flax` (exact round trip).

    Args:
      params: a `jax_mha.MultiHeadAttention`'s `params`, with `qkv_bias == out_bias`
        (flax's single `use_bias`) and no `bias_k`/`bias_v`. With `num_kv_heads < H`
        the result fits `flax.nnx.MultiHeadAttention(num_kv_heads=K)` (linen's
        module has no GQA).
      num_heads: H.

    Returns:
      `query/kernel (d_q, H, D)`, `key`/`value` `(d, K, D)`, biases `(heads, D)`,
      `out/kernel (H, D, d_out)`, `out/bias (d_out,)`, and `query_ln`/`key_ln`.

    Raises:
      ValueError: naming the numbers, when flax has no equivalent layer.
    """
    _check_keys("params for flax (no bias_k/bias_v there)", params, _PROJECTIONS + ("query_ln", "key_ln"),
                _PROJECTIONS)
    for name in _PROJECTIONS:
        _check_keys(f"params[{name!r}]", params[name], ("kernel", "bias"), ("kernel",))
    with_bias = {name: "bias" in params[name] for name in _PROJECTIONS}
    if len(set(with_bias.values())) > 1:
        raise ValueError(f"flax has one `use_bias` flag for all projections, got biases {with_bias}")
    width = np.shape(params["query"]["kernel"])[1]
    if num_heads < 1 or width % num_heads:
        raise ValueError(f"query kernel width {width} is not divisible by num_heads={num_heads}")
    head_dim = width // num_heads
    flax_params = {}
    for name in _PROJECTIONS:
        kernel = np.asarray(params[name]["kernel"])
        if name == "out":
            flax_params[name] = {"kernel": _array(kernel.reshape(-1, head_dim, kernel.shape[-1]))}
        else:
            flax_params[name] = {"kernel": _array(kernel.reshape(kernel.shape[0], -1, head_dim))}
        if with_bias[name]:
            bias = np.asarray(params[name]["bias"])
            flax_params[name]["bias"] = _array(bias if name == "out" else bias.reshape(-1, head_dim))
    for name in ("query_ln", "key_ln"):
        if name in params:
            flax_params[name] = {"scale": _array(params[name]["scale"])}
    return flax_params
