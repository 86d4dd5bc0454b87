"""What the linen and NNX attention layers share, between their projections.

Pure functions of arrays: no parameters, no Flax, and no attention math (that is
`jax_mha.functional.attention`). The modules (`jax_mha.modules`, `jax_mha.nnx`) create
the parameters, project, normalise and keep the cache variables; `attend` does the
rest: rotary embeddings, the decoding cache step, PyTorch's extra keys, the call into
the functional core and the head gates.

Shapes: `q (B…, H, N, D)`, `k (B…, K, S, D)`, `v (B…, K, S, Dv)` after `split_heads`;
the cache holds `(B…, K, L, D)` keys and values, L the maximum decoding length.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_mha._masking import canonical_window, fits
from jax_mha.functional import attention, rotary_embedding


class Cache(NamedTuple):
    """A decoding cache (flax's `cached_key`, `cached_value`, `cache_index`)."""

    key: jax.Array  # (B…, K, L, D), keys after projection, QK-norm and RoPE
    value: jax.Array  # (B…, K, L, Dv)
    index: jax.Array  # int32 scalar: the number of tokens written so far


def check_inputs(query, key=None, value=None):
    """`(key, value)` with flax's defaults (key = query, value = key), validated.

    Raises:
      ValueError: naming the shapes, for rank < 2 inputs, a key/value length mismatch
        or batch dims that differ.
    """
    key = query if key is None else key
    value = key if value is None else value
    for name, x in (("query", query), ("key", key), ("value", value)):
        if jnp.ndim(x) < 2:
            raise ValueError(f"{name} must have shape (B…, length, features), got shape {jnp.shape(x)}")
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(
            f"key length {key.shape[-2]} != value length {value.shape[-2]} (key {key.shape}, value {value.shape})"
        )
    if not query.shape[:-2] == key.shape[:-2] == value.shape[:-2]:
        raise ValueError(f"query, key, value batch dims differ: {query.shape}, {key.shape}, {value.shape}")
    return key, value


def check_dropout_rate(rate, name: str = "dropout_rate"):
    """`rate`, validated: a real number (not a bool) with `0 <= rate < 1`.

    Raises:
      ValueError: naming the attribute and the value (a rate of 1 or more drops
        everything: the outputs would be silently all zero).
    """
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not 0.0 <= rate < 1.0:
        raise ValueError(f"{name} must be a number with 0 <= {name} < 1, got {rate!r}")
    return rate


def check_size(name: str, value, *, optional: bool = False):
    """`value`, validated as a positive int (None passes when `optional`).

    Raises:
      TypeError: naming the attribute, for a bool, float or other non-integer.
      ValueError: naming the attribute, for zero or a negative size (a width of 0 would
        reach the initialisers as a division by zero, a negative one XLA's shape check).
    """
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return int(value)


def layer_norm(norm, x: jax.Array, dtype, param_dtype) -> jax.Array:
    """`norm(x)` (a flax LayerNorm built with `dtype=None`) with its result in `dtype`.

    flax's LayerNorm with a float16/bfloat16 `dtype` promotes against float32 inside
    (`jnp.promote_types`), which `jax_numpy_dtype_promotion="strict"` refuses. It
    computes in float32 either way, so widening `x` to the parameters' dtype first and
    casting the result after gives the same values under every promotion mode.
    (Half-precision *parameters* remain out of reach under strict promotion: flax
    promotes them against float32 statistics itself.)
    """
    if jnp.finfo(x.dtype).bits < jnp.finfo(param_dtype).bits:  # never narrows
        x = x.astype(param_dtype)
    y = norm(x)
    return y if dtype is None else y.astype(dtype)


def check_widths(inputs, widths) -> None:
    """Each input's feature width against the width its projection was built for.

    Args:
      inputs: `{name: array}` (query, key, value).
      widths: `{name: in_features or None}`; None (no parameters yet) is not checked.

    Raises:
      ValueError: `"{name} has {w} features, the module was built for {k}"`.
    """
    for name, x in inputs.items():
        built = widths.get(name)
        if built is not None and x.shape[-1] != built:
            raise ValueError(f"{name} has {x.shape[-1]} features, the module was built for {built} "
                             f"(shape {x.shape})")


def head_sizes(num_heads: int, d_model: int, num_kv_heads: int | None) -> tuple[int, int]:
    """`(num_kv_heads, head_dim)` for `d_model = num_heads * head_dim`, validated.

    Raises:
      ValueError: naming the numbers, when they do not divide.
    """
    check_size("num_heads", num_heads)
    check_size("d_model", d_model)
    num_kv_heads = num_heads if num_kv_heads is None else check_size("num_kv_heads", num_kv_heads)
    if d_model % num_heads:
        raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}")
    return num_kv_heads, d_model // num_heads


def _check_broadcast(name: str, x, target: tuple) -> None:
    if x is not None and (jnp.ndim(x) > len(target) or not fits(jnp.shape(x), target)):
        raise ValueError(f"{name} of shape {jnp.shape(x)} does not broadcast to (B…, H, N, S) = {target}")


def _and(a, b):
    """Logical and of two masks of any ranks (explicit ranks: rank promotion may raise)."""
    if a is None:
        return b
    rank = max(jnp.ndim(a), jnp.ndim(b))
    return jax.lax.broadcast_to_rank(jnp.asarray(a), rank) & jax.lax.broadcast_to_rank(b, rank)


def rotate(q, k, positions, start, base: float):
    """RoPE on q and k (Su et al. 2021), via `jax_mha.rotary_embedding`.

    Positions: `positions` for both when given (self-attention, N == S); else
    `start + arange(N)` when decoding from cache index `start`; else keys at
    `0 … S-1` and queries at the last N of them (the core's bottom-right alignment).
    """
    n, s = q.shape[-2], k.shape[-2]
    if positions is not None:
        if n != s:
            raise ValueError(f"positions gives one position per token of a self-attention call; got N={n} "
                             f"queries and S={s} keys")
        q_pos = k_pos = jnp.asarray(positions)
    elif start is not None:
        q_pos = k_pos = start + jnp.arange(n)
    else:
        q_pos, k_pos = jnp.arange(s - n, s), jnp.arange(s)
    return rotary_embedding(q, q_pos, base), rotary_embedding(k, k_pos, base)


def _concrete_int(x) -> int | None:
    """`x` as a Python int, or None when it is traced (inside jit)."""
    try:
        return int(x)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError, TypeError):
        return None


def write_cache(cache: Cache, k, v):
    """Writes n new keys/values at `cache.index`.

    Returns:
      `(new cache, overflow)`: overflow is a traced bool, True when the n tokens did
      not fit (then `dynamic_update_slice` has clamped the write: the cache is wrong).

    Raises:
      ValueError: for shapes that do not match the cache, or, when the index is
        concrete (outside jit), for writing past the cache length.
    """
    length, n = cache.key.shape[-2], k.shape[-2]
    for name, new, old in (("key", k, cache.key), ("value", v, cache.value)):
        if new.shape[:-2] != old.shape[:-2] or new.shape[-1] != old.shape[-1]:
            raise ValueError(f"decoding {name} of shape {new.shape} does not fit the cache of shape {old.shape} "
                             "(B…, K, L, D): batch, heads and head dim must match the input given to init")
    index = _concrete_int(cache.index)
    if n > length or (index is not None and index + n > length):
        raise ValueError(f"decoding past the cache: cache_index={index} + {n} new tokens > cache length {length} "
                         "(the length of the input given to init)")
    start = (0,) * (k.ndim - 2) + (cache.index, 0)
    new = Cache(
        jax.lax.dynamic_update_slice(cache.key, k.astype(cache.key.dtype), start),
        jax.lax.dynamic_update_slice(cache.value, v.astype(cache.value.dtype), start),
        cache.index + n,
    )
    return new, cache.index + n > length


def decode_visibility(index, n: int, length: int, window) -> jax.Array:
    """bool `(n, L)`: key j is visible to new token t (at position index + t) iff
    `j <= index + t` and, with a window, `j >= index + t - left`.

    The core aligns queries bottom-right (at `L - n + t`); the cache puts them at
    `index + t`, so decoding passes this pattern as a mask instead of `is_causal`.
    A window's right side never matters here: causality is stricter.
    """
    rows = index + jnp.arange(n)[:, None]  # (n, 1): the tokens' positions
    cols = jnp.arange(length)[None, :]  # (1, L)
    visible = cols <= rows
    if window is not None and window.left is not None:
        visible = visible & (cols >= rows - window.left)
    return visible


def prepend_extra_keys(k, v, mask, bias, kv_lengths, bias_kv, add_zero_attn: bool):
    """PyTorch's `add_bias_kv` (a learned key/value) and `add_zero_attn` (a zero
    key/value) as extra keys that every query sees.

    They go *first*, so the core's bottom-right causal alignment still lines the
    queries up with the real keys; the caller moves their weight columns last, where
    PyTorch reports them.

    Returns:
      `(k, v, mask, bias, kv_lengths, e)`, e the number of keys added (0, 1 or 2).
    """
    extra_k, extra_v = [], []
    if bias_kv is not None:
        for extra, bias_param, x in ((extra_k, bias_kv[0], k), (extra_v, bias_kv[1], v)):
            per_head = bias_param.reshape(x.shape[-3], 1, x.shape[-1]).astype(x.dtype)  # (K, 1, D)
            extra.append(jnp.broadcast_to(per_head, x.shape[:-2] + (1, x.shape[-1])))
    if add_zero_attn:
        extra_k.append(jnp.zeros(k.shape[:-2] + (1, k.shape[-1]), k.dtype))
        extra_v.append(jnp.zeros(v.shape[:-2] + (1, v.shape[-1]), v.dtype))
    e = len(extra_k)
    if not e:
        return k, v, mask, bias, kv_lengths, 0
    s = k.shape[-2]

    def pad(x, fill):
        x = jnp.asarray(x)
        x = jnp.broadcast_to(x, x.shape[:-1] + (s,)) if x.ndim else jnp.broadcast_to(x, (s,))
        return jnp.concatenate([jnp.full(x.shape[:-1] + (e,), fill, x.dtype), x], axis=-1)

    k = jnp.concatenate(extra_k + [k], axis=-2)  # (B…, K, e + S, D)
    v = jnp.concatenate(extra_v + [v], axis=-2)
    mask = None if mask is None else pad(mask, True)
    bias = None if bias is None else pad(bias, 0)
    kv_lengths = None if kv_lengths is None else jnp.asarray(kv_lengths) + e
    return k, v, mask, bias, kv_lengths, e


def gate_heads(out, head_mask):
    """`out (B…, H, N, D)` times `head_mask` `(H,)` or broadcastable to `(B…, H)`.

    Raises:
      ValueError: for a head_mask that does not broadcast to `(B…, H)`.
    """
    if head_mask is None:
        return out
    head_mask = jnp.asarray(head_mask)
    target = out.shape[:-2]  # (B…, H)
    try:
        ok = np.broadcast_shapes(head_mask.shape, target) == target
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"head_mask of shape {head_mask.shape} does not broadcast to (B…, H) = {target}")
    gate = jax.lax.broadcast_to_rank(head_mask[..., None, None], out.ndim)  # (B…, H, 1, 1)
    return out * gate.astype(out.dtype)


def attend(
    q, k, v, *, mask=None, bias=None, is_causal=False, local_window_size=None, q_lengths=None,
    kv_lengths=None, positions=None, rope_base=None, cache: Cache | None = None, bias_kv=None,
    add_zero_attn=False, head_mask=None, need_weights=False, **core_options,
):
    """Everything between the projections and the output projection.

    Args:
      q: `(B…, H, N, D)`; k: `(B…, K, S, D)`; v: `(B…, K, S, Dv)` (after QK-norm).
      mask, bias, is_causal, local_window_size, q_lengths, kv_lengths: as for
        `jax_mha.attention`. When decoding, S is the cache length L and the pattern is
        causal from `cache.index` whatever `is_causal` says.
      positions: RoPE positions `(N,)` or `(B…, N)`; see `rotate`.
      rope_base: None for no RoPE, else its wavelength base.
      cache: the decoding cache (k and v are then the N new tokens' keys and values).
      bias_kv: `(bias_k, bias_v)`, each `(K*D,)`, or None; add_zero_attn: PyTorch's.
      head_mask: gates on the heads, see `gate_heads`.
      need_weights: also return the weights.
      **core_options: dropout_rate, dropout_rng, deterministic, implementation.

    Returns:
      `(out (B…, H, N, Dv), weights (B…, H, N, S + extra keys) or None, new cache
      or None)`. Under jit, an overflowing cache write makes `out` NaN.
    """
    if rope_base is not None:
        q, k = rotate(q, k, positions, None if cache is None else cache.index, rope_base)
    overflow = None
    scores = q.shape[:-1] + ((cache.key if cache is not None else k).shape[-2],)  # (B…, H, N, S)
    _check_broadcast("mask", mask, scores)
    _check_broadcast("bias", bias, scores)
    if cache is not None:
        if k.shape[-2] != q.shape[-2]:
            raise ValueError(f"decoding feeds as many keys as queries, got N={q.shape[-2]}, S={k.shape[-2]}")
        window = canonical_window(local_window_size)
        old_index = cache.index
        cache, overflow = write_cache(cache, k, v)
        k, v = cache.key, cache.value
        mask = _and(mask, decode_visibility(old_index, q.shape[-2], k.shape[-2], window))
        is_causal, local_window_size = False, None
    elif local_window_size is not None and (bias_kv is not None or add_zero_attn):
        raise ValueError("local_window_size cannot be combined with add_bias_kv or add_zero_attn: the window "
                         "would hide their extra keys from most queries")
    k, v, mask, bias, kv_lengths, extra = prepend_extra_keys(k, v, mask, bias, kv_lengths, bias_kv, add_zero_attn)
    result = attention(
        q, k, v, mask, bias, is_causal=is_causal, local_window_size=local_window_size,
        q_lengths=q_lengths, kv_lengths=kv_lengths, return_weights=need_weights, **core_options,
    )
    out, weights = result if need_weights else (result, None)
    if extra and weights is not None:
        weights = jnp.concatenate([weights[..., extra:], weights[..., :extra]], axis=-1)  # extras last, as torch
    if overflow is not None:
        out = jnp.where(overflow, jnp.asarray(jnp.nan, out.dtype), out)
    return gate_heads(out, head_mask), weights, cache
