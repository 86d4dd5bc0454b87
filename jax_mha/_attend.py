"""What the linen and NNX attention layers share, between their projections.

Pure functions of arrays: no parameters, no Flax, and no attention math (that is
`jax_mha.functional.attention`). The modules (`jax_mha.nn.linen`, `jax_mha.nnx`) create
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

from jax_mha import _masking
from jax_mha._validate import DESCRIPTION_KEYWORDS, check_pairwise, describe
from jax_mha.functional import attention, attention_from_description, rotary_embedding


class Cache(NamedTuple):
    """A decoding cache (flax's `cached_key`, `cached_value`, `cache_index`)."""

    key: jax.Array  # (B…, K, L, D), keys after projection, QK-norm and RoPE
    value: jax.Array  # (B…, K, L, Dv)
    index: jax.Array  # int32 scalar: the number of tokens written so far
    segment_ids: jax.Array | None = None  # int32 (B…, L): each cached token's segment, when kept


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


def _half(dtype) -> bool:
    return dtype is not None and jnp.dtype(dtype).itemsize < 4


def norm_dtype(dtype):
    """The `dtype` to build a flax LayerNorm with: None for float16/bfloat16 (see
    `layer_norm`), else `dtype`."""
    return None if _half(dtype) else dtype


def layer_norm(norm, x, dtype):
    """`norm(x)` for a flax LayerNorm (linen or NNX) built with `norm_dtype(dtype)`.

    flax computes the statistics in `promote_types(norm.dtype or x.dtype, float32)`,
    which raises under `jax_numpy_dtype_promotion="strict"` for half precision. So a
    half-precision `x` or `dtype` is normalised as float32 and cast to `dtype`
    afterwards: the same float32 arithmetic and final cast that flax does under
    standard promotion."""
    if not (_half(dtype) or _half(x.dtype)):
        return norm(x)
    y = norm(x.astype(jnp.float32))
    return y if dtype is None else y.astype(dtype)


def check_width(name: str, value, allow_none: bool = False):
    """`value`, validated as a positive int (a layer width such as `d_model`, `d_ff`).

    Raises:
      TypeError: naming it, for a non-integer. ValueError: naming it, for value <= 0.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a positive int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return int(value)


def head_sizes(num_heads: int, d_model: int, num_kv_heads: int | None) -> tuple[int, int]:
    """`(num_kv_heads, head_dim)` for `d_model = num_heads * head_dim`, validated.

    Raises:
      ValueError, TypeError: naming the numbers, when one is not a positive int or
        they do not divide.
    """
    num_heads = check_width("num_heads", num_heads)
    d_model = check_width("d_model", d_model)
    num_kv_heads = num_heads if num_kv_heads is None else check_width("num_kv_heads", num_kv_heads)
    if num_heads < 1 or d_model % num_heads:
        raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}")
    return num_kv_heads, d_model // num_heads


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


def write_cache(cache: Cache, k, v, segment_ids=None):
    """Writes n new keys/values (and their segment ids, when the cache keeps them) at
    `cache.index`.

    Returns:
      `(new cache, overflow)`: overflow is a traced bool, True when the n tokens did
      not fit (then `dynamic_update_slice` has clamped the write: the cache is wrong).

    Raises:
      ValueError: for shapes that do not match the cache, segment ids given to a
        cache without them (or the reverse), or, when the index is concrete (outside
        jit), for writing past the cache length.
    """
    length, n = cache.key.shape[-2], k.shape[-2]
    for name, new, old in (("key", k, cache.key), ("value", v, cache.value)):
        if new.shape[:-2] != old.shape[:-2] or new.shape[-1] != old.shape[-1]:
            raise ValueError(f"decoding {name} of shape {new.shape} does not fit the cache of shape {old.shape} "
                             "(B…, K, L, D): batch, heads and head dim must match the input given to init")
    if (segment_ids is None) != (cache.segment_ids is None):
        raise ValueError("segment_ids when decoding needs a cache made with segment_ids (and a cache made with "
                         f"them needs them on every call): got segment_ids={'None' if segment_ids is None else 'ids'}, "
                         f"cache keeps them: {cache.segment_ids is not None}")
    index = _concrete_int(cache.index)
    if n > length or (index is not None and index + n > length):
        raise ValueError(f"decoding past the cache: cache_index={index} + {n} new tokens > cache length {length} "
                         "(the length of the input given to init)")
    index = jnp.asarray(cache.index)
    zero = jnp.zeros((), index.dtype)  # one index dtype (Python ints are int64 under jax_enable_x64)
    start = (zero,) * (k.ndim - 2) + (index, zero)
    ids = cache.segment_ids
    if ids is not None:
        segment_ids = jnp.broadcast_to(jnp.asarray(segment_ids, jnp.int32), ids.shape[:-1] + (n,))
        ids = jax.lax.dynamic_update_slice(ids, segment_ids, (zero,) * (ids.ndim - 1) + (index,))
    new = Cache(
        jax.lax.dynamic_update_slice(cache.key, k.astype(cache.key.dtype), start),
        jax.lax.dynamic_update_slice(cache.value, v.astype(cache.value.dtype), start),
        cache.index + n, ids,
    )
    return new, cache.index + n > length


def decode_pattern(offset, n: int, length: int, local_window_size) -> jax.Array:
    """bool `(n, L)`: who new token t (at key position `offset + t`) may see, read from
    `_masking`: causal, and the window. Only for a caller's own `attention_fn`, which
    takes no query offset; the library's path reads the offset from the description."""
    window = _masking.canonical_window(local_window_size)
    vis = _masking.Pattern(n, length, is_causal=True, window=window, q_offset=offset)
    return _masking.dense_allowed(vis, 2)


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


def check_attention_fn(attention_fn):
    """`attention_fn`, validated: None (the default, `jax_mha.attention`) or a callable.

    Raises:
      TypeError: naming the value, when it is neither.
    """
    if attention_fn is not None and not callable(attention_fn):
        raise TypeError(f"attention_fn must be a callable with jax_mha.attention's signature (or None for "
                        f"jax_mha.attention), got {attention_fn!r}")
    return attention_fn


def _decode_step(q, k, v, cache: Cache, segment_ids):
    """Writes the new tokens into the cache: `(k, v, q ids, kv ids, cache, overflow,
    index)` with k, v the whole cache and index the position of the first new token."""
    if k.shape[-2] != q.shape[-2]:
        raise ValueError(f"decoding feeds as many keys as queries, got N={q.shape[-2]}, S={k.shape[-2]}")
    index = cache.index
    cache, overflow = write_cache(cache, k, v, segment_ids)
    q_ids, kv_ids = (None, None) if segment_ids is None else (segment_ids, cache.segment_ids)
    return cache.key, cache.value, q_ids, kv_ids, cache, overflow, index


def _call_core(q, k, v, *, attention_fn, offset, start, need_weights, keywords, mods, core_options):
    """The core (or the caller's `attention_fn`) on the heads. When decoding
    (`offset` not None), the library's path gets the cache offset in its description;
    an `attention_fn`, which takes no offset, gets the pattern as a dense mask and the
    mods shifted to the positions of the full pass."""
    if offset is None:
        fn = attention if attention_fn is None else attention_fn
        return fn(q, k, v, **keywords, return_weights=need_weights, **core_options, **mods)
    if attention_fn is None:
        vis = describe(q, k, v, **keywords, **mods, q_offset=offset, q_start=start)
        return attention_from_description(q, k, v, vis, return_weights=need_weights, **core_options)
    pattern = decode_pattern(offset, q.shape[-2], k.shape[-2], keywords["local_window_size"])
    # A caller's own attention_fn sees the new tokens as rows 0…n-1: the mods count q_idx from `start`.
    mods = dict(mods, **{name: _masking.shift_indices(mods[name], query=start) for name in _masking.MODS
                         if name in mods})
    keywords = dict(keywords, mask=_and(keywords["mask"], pattern), is_causal=False, local_window_size=None)
    return attention_fn(q, k, v, **keywords, return_weights=need_weights, **core_options, **mods)


def attend(
    q, k, v, *, mask=None, bias=None, is_causal=False, local_window_size=None, q_lengths=None,
    kv_lengths=None, segment_ids=None, positions=None, rope_base=None, cache: Cache | None = None, bias_kv=None,
    add_zero_attn=False, head_mask=None, need_weights=False, attention_fn=None, **options,
):
    """Everything between the projections and the output projection.

    Args:
      q: `(B…, H, N, D)`; k: `(B…, K, S, D)`; v: `(B…, K, S, Dv)` (after QK-norm).
      mask, bias, is_causal, local_window_size, q_lengths, kv_lengths: as for
        `jax_mha.attention`. When decoding, S is the cache length L and the pattern is
        causal from `cache.index` whatever `is_causal` says: the description gets the
        cache index as its query offset, so the mods see the positions of the full
        pass and no dense mask is built.
      segment_ids: int `(B…, N)` of a self-attention call (the core's
        `q_segment_ids`, keys the same); when decoding, the new tokens' ids, matched
        against the ids the cache keeps for every cached token.
      positions: RoPE positions `(N,)` or `(B…, N)`; see `rotate`.
      rope_base: None for no RoPE, else its wavelength base.
      cache: the decoding cache (k and v are then the N new tokens' keys and values).
      bias_kv: `(bias_k, bias_v)`, each `(K*D,)`, or None; add_zero_attn: PyTorch's.
      head_mask: gates on the heads, see `gate_heads`.
      need_weights: also return the weights.
      attention_fn: called instead of `jax_mha.attention` (None: that one), as
        `attention_fn(q, k, v, mask=, bias=, is_causal=, local_window_size=,
        q_lengths=, kv_lengths=, q_segment_ids=, kv_segment_ids=, return_weights=,
        **core_options)` and the description's other keywords when not None.
      **options: `attention`'s other keywords: the core options (dropout_rate,
        dropout_rng, deterministic, implementation) and the rest of the description
        (`_validate.DESCRIPTION_KEYWORDS`: the mods, the soft cap, the sink logits),
        these passed on only when not None (so an `attention_fn` without them keeps
        working).

    Returns:
      `(out (B…, H, N, Dv), weights (B…, H, N, S + extra keys) or None, new cache
      or None)`. Under jit, an overflowing cache write makes `out` NaN.
    """
    if rope_base is not None:
        q, k = rotate(q, k, positions, None if cache is None else cache.index, rope_base)
    extras = bias_kv is not None or add_zero_attn
    if cache is not None or extras:
        # This layer grows the keys (the cache, the extra keys): check the mask and the
        # bias against the keys the caller knows first (the core checks every other call).
        scores = q.shape[:-1] + ((k if cache is None else cache.key).shape[-2],)  # (B…, H, N, S)
        mask = check_pairwise("mask", mask, scores, floating=False)
        bias = check_pairwise("bias", bias, scores, floating=True)
    if extras and (local_window_size is not None or segment_ids is not None):
        what = "local_window_size" if local_window_size is not None else "segment_ids"
        raise ValueError(f"{what} cannot be combined with add_bias_kv or add_zero_attn: their extra keys belong to no "
                         "window or segment")
    overflow = offset = start = None
    q_ids, kv_ids = segment_ids, None
    if cache is not None:
        k, v, q_ids, kv_ids, cache, overflow, start = _decode_step(q, k, v, cache, segment_ids)
        is_causal = True
    k, v, mask, bias, kv_lengths, extra = prepend_extra_keys(k, v, mask, bias, kv_lengths, bias_kv, add_zero_attn)
    if start is not None:
        offset = start + extra  # the extra keys go first, before position 0
    mods = {name: options.pop(name) for name in DESCRIPTION_KEYWORDS if name in options}
    mods = {name: x for name, x in mods.items() if x is not None}
    core_options = options
    keywords = dict(mask=mask, bias=bias, is_causal=is_causal, local_window_size=local_window_size,
                    q_lengths=q_lengths, kv_lengths=kv_lengths, q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    result = _call_core(q, k, v, attention_fn=attention_fn, offset=offset, start=start, need_weights=need_weights,
                        keywords=keywords, mods=mods, core_options=core_options)
    out, weights = result if need_weights else (result, None)
    if extra and weights is not None:
        weights = jnp.concatenate([weights[..., extra:], weights[..., :extra]], axis=-1)  # extras last, as torch
    if overflow is not None:
        out = jnp.where(overflow, jnp.asarray(jnp.nan, out.dtype), out)
    return gate_heads(out, head_mask), weights, cache
