"""Pure functional multi-head attention: no parameters, no state, no Flax.

The public layer of the core. Beneath it, each file with one job:

  _validate.py     the input checks, and `describe`: the arguments as one description
  _masking.py      the one description of which (query, key) pairs may attend
  _path.py         a path as an object: what it takes, its limits, its refusal
  _dispatch.py     the registry of paths (`REGISTRY`), `"auto"`'s choice, and the call
                   of a path between the steps every path shares
  _softmax.py      those steps (non-finite inputs isolated, empty rows, padding rows),
                   the sink merge, the online-softmax step and its backward
  _statistics.py   entropy, largest weight and received weight, on any path's recurrence
  paths/           one module per path (see `jax_mha.paths`): `dense` (the whole
                   scores; the path that returns the weights), `blockwise` over
                   `engine` (query x key blocks, the FlashAttention-2 backward),
                   `cudnn`, the Pallas kernels over the library's own `flex`, the
                   decode kernels; `kernel_common` is what the kernels share
  parallel/        ring attention, Ulysses and the mesh rules (`jax_mha.parallel`)
  nn/              the Flax modules that wrap this layer (linen and NNX)

Axis letters used in shapes and einsum strings:
  B… any leading batch dims, N query length, S key/value length,
  H query heads, K key/value heads (H % K == 0), G = H // K heads per group,
  D head dim.

Every function here is safe under jit, vmap, grad, vjp, jvp, jacfwd and hessian,
except the vendor-kernel paths of `attention`: `"cudnn"` and the Pallas kernels have a
custom VJP only, so reverse mode (`grad`, `vjp`) but no `jvp`/`jacfwd`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_mha import _dispatch, _masking
from jax_mha._dispatch import IMPLEMENTATIONS, WHOLE_SCORES_MAX_BYTES, whole_scores_fit
from jax_mha._statistics import attention_statistics
from jax_mha._validate import (
    EMPTY_ROWS,
    DTypeError,
    as_index,
    check_layout,
    check_lengths,
    check_options,
    describe,
)
from jax_mha.paths import flex, schedules


def split_heads(x: jax.Array, num_heads: int) -> jax.Array:
    """Splits the feature axis into heads.

    Args:
      x: `(B…, N, H*D)`.
      num_heads: H.

    Returns:
      `(B…, H, N, D)`; head `h` is features `h*D:(h+1)*D` of `x`.

    Raises:
      ValueError: if `x` has rank < 2 or its last dim is not divisible by `num_heads`.
    """
    num_heads = as_index("num_heads", num_heads)
    if not hasattr(x, "ndim") or not hasattr(x, "reshape"):
        raise TypeError(f"split_heads expects an array (B…, N, H*D), got {type(x).__name__}")
    if x.ndim < 2:
        raise ValueError(f"split_heads expects (B…, N, H*D), got rank {x.ndim} shape {x.shape}")
    if num_heads < 1 or x.shape[-1] % num_heads:
        raise ValueError(
            f"last dim {x.shape[-1]} of x (shape {x.shape}) is not divisible by "
            f"num_heads={num_heads}"
        )
    *lead, n, features = x.shape
    x = x.reshape(*lead, n, num_heads, features // num_heads)  # (B…, N, H, D)
    return jnp.swapaxes(x, -3, -2)  # (B…, H, N, D)


def combine_heads(x: jax.Array) -> jax.Array:
    """Concatenates heads back into features: the inverse of `split_heads`.

    Args:
      x: `(B…, H, N, D)`.

    Returns:
      `(B…, N, H*D)`.

    Raises:
      ValueError: if `x` has rank < 3.
    """
    if not hasattr(x, "ndim") or not hasattr(x, "reshape"):
        raise TypeError(f"combine_heads expects an array (B…, H, N, D), got {type(x).__name__}")
    if x.ndim < 3:
        raise ValueError(f"combine_heads expects (B…, H, N, D), got rank {x.ndim} shape {x.shape}")
    *lead, h, n, d = x.shape
    return jnp.swapaxes(x, -3, -2).reshape(*lead, n, h * d)  # (B…, N, H*D)


def causal_mask(n: int, s: int | None = None) -> jax.Array:
    """Boolean causal mask, True where the query may attend.

    Args:
      n: number of queries N.
      s: number of keys S (defaults to `n`). When `s > n` the queries are the last
        `n` positions of the key sequence (decoding with a cache).

    Returns:
      bool `(n, s)`: `mask[i, j] = j <= i + (s - n)`.

    Raises:
      TypeError: if a size is not an int. ValueError: if a size is negative.
    """
    n = as_index("causal_mask n", n)
    s = n if s is None else as_index("causal_mask s", s)
    if n < 0 or s < 0:
        raise ValueError(f"causal_mask needs non-negative sizes, got n={n}, s={s}")
    return jnp.arange(s)[None, :] <= jnp.arange(n)[:, None] + (s - n)


def padding_mask(valid: jax.Array) -> jax.Array:
    """Turns per-key validity into an attention mask.

    Args:
      valid: bool `(B, S)`, True for real (non-padding) keys.

    Returns:
      bool `(B, 1, 1, S)`, broadcastable against `(B, H, N, S)`.

    Raises:
      ValueError: if `valid` is not rank 2.
    """
    valid = jnp.asarray(valid)
    if valid.ndim != 2:
        raise ValueError(f"padding_mask expects valid of shape (B, S), got {valid.shape}")
    if not (valid.dtype == jnp.bool_ or jnp.issubdtype(valid.dtype, jnp.integer)):
        raise DTypeError(f"padding_mask expects bool (or 0/1 integer) valid, got dtype {valid.dtype}")
    return valid.astype(bool)[:, None, None, :]


def lengths_mask(kv_lengths: jax.Array, s: int) -> jax.Array:
    """Padding mask from per-sequence valid key counts.

    Args:
      kv_lengths: int `(B…)`, number of valid keys of each sequence.
      s: S, the padded key length.

    Returns:
      bool `(B…, 1, 1, S)`, True for keys at positions `< kv_lengths`.

    Raises:
      TypeError: if `kv_lengths` is not integer or `s` not an int.
      ValueError: if `s` is negative.
    """
    s = as_index("lengths_mask s", s)
    if s < 0:
        raise ValueError(f"lengths_mask needs a non-negative key length, got s={s}")
    kv_lengths = check_lengths("kv_lengths", kv_lengths, None)[..., None, None, None]  # (B…, 1, 1, 1)
    # Explicit ranks: the library runs under jax_numpy_rank_promotion="raise".
    return jax.lax.broadcast_to_rank(jnp.arange(s), kv_lengths.ndim) < kv_lengths



def attention_entropy(weights: jax.Array) -> jax.Array:
    """Entropy of each attention distribution, in nats, with `0·log 0 = 0`.

    Args:
      weights: `(B…, H, N, S)`, rows summing to 1 (or all zero for fully masked rows,
        whose entropy is 0). A NaN weight makes its row's entropy NaN.

    Returns:
      float32 `(B…, H, N)` (float64 for float64 weights).

    Raises:
      TypeError: for non-floating weights.
    """
    weights = jnp.asarray(weights)
    if not jnp.issubdtype(weights.dtype, jnp.floating):
        raise DTypeError(f"attention_entropy expects floating weights, got dtype {weights.dtype}")
    w = weights.astype(_masking.compute_dtype(weights.dtype))
    zero = w == 0
    # The inner where keeps log's gradient finite at w == 0; NaN is not 0, so it stays.
    w_log_w = jnp.where(zero, 0.0, w * jnp.log(jnp.where(zero, 1.0, w)))
    return -jnp.sum(w_log_w, axis=-1)


def rotary_embedding(x: jax.Array, positions: jax.Array, base: float = 10000.0) -> jax.Array:
    """Rotary position embedding (RoPE; Su et al. 2021), rotate-half layout.

    Feature pairs `(x[..., i], x[..., i + D/2])` are rotated by the angle
    `position · base^(-2i/D)` (the pairing of GPT-NeoX, LLaMA and Gemma; the paper
    pairs neighbours `(2i, 2i+1)`, an equivalent permutation of the weights). Applied
    to q and k, their dot product depends only on the position difference.

    Args:
      x: `(B…, heads, N, D)`, D even.
      positions: int or float `(N,)` or `(B…, N)`: the position of each token (e.g.
        offset by the cache index when decoding).
      base: the wavelength base, > 0.

    Returns:
      `(B…, heads, N, D)` in `x`'s dtype; angles and products computed in float32.

    Raises:
      ValueError: for an odd D, a rank < 3 `x`, positions that do not match N, or base <= 0.
      TypeError: for non-floating `x`.
    """
    x = jnp.asarray(x)
    positions = jnp.asarray(positions)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise DTypeError(f"rotary_embedding expects floating x, got dtype {x.dtype}")
    if x.ndim < 3 or x.shape[-1] % 2:
        raise ValueError(f"rotary_embedding expects x of shape (B…, heads, N, D) with D even, got {x.shape}")
    if positions.ndim < 1 or positions.shape[-1] != x.shape[-2] or positions.ndim > x.ndim - 1:
        raise ValueError(f"positions must be (N,) or (B…, N) with N={x.shape[-2]}, got shape {positions.shape}")
    if not base > 0:
        raise ValueError(f"base must be > 0, got {base}")
    half = x.shape[-1] // 2
    dtype = _masking.compute_dtype(x.dtype)
    freq = jnp.asarray(base, dtype) ** (-jnp.arange(half, dtype=dtype) * 2 / x.shape[-1])  # (D/2,)
    angle = positions.astype(dtype)[..., None] * jax.lax.broadcast_to_rank(freq, positions.ndim + 1)  # (B…, N, D/2)
    angle = jax.lax.broadcast_to_rank(angle[..., None, :, :], x.ndim)  # (B…, 1, N, D/2)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :half].astype(dtype), x[..., half:].astype(dtype)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    local_window_size: int | tuple[int | None, int | None] | None = None,
    q_lengths: jax.Array | None = None,
    kv_lengths: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    empty_rows: str = "zero",
    score_mod=None,
    mask_mod=None,
    logits_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    block_schedule=None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    deterministic: bool = True,
    return_weights: bool = False,
    return_residual: bool = False,
    implementation: str | None = "xla",
    query_block_size: int | None = None,
    key_block_size: int | None = None,
    layout: str = "BHND",
):
    """Scaled dot-product attention for all heads at once (GQA/MQA included):
    `softmax(masked(cap(score_mod(scale · q kᵀ + bias)))) v`, soft-maxed in float32
    (float64 for float64 inputs). Every path reads one description of who may attend.

    Details (alignment, dtypes, transformations, mods, sinks, edge rows, paths, blocks):
    see docs/usage.md#who-may-attend-one-description-for-every-path and the sections
    after it; each path's refusals: docs/accelerators.md.

    Args:
      q: `(B…, H, N, D)` queries, real floating point.
      k: `(B…, K, S, D)` keys, `H % K == 0`; query head h reads key/value head `h // (H // K)`.
      v: `(B…, K, S, Dv)` values; q, k, v share one dtype and one batch shape.
      mask: bool, broadcastable to `(B…, H, N, S)`, True = may attend. Default None.
      bias: float, broadcastable to `(B…, H, N, S)`, added to the scaled logits; `-inf`
        masks a key; differentiable. Default None.
      is_causal: key `j` visible to query `i` only if `j <= i + S - N`. Default False.
      scale: the logit scale, a static number. Default None: `1/sqrt(D)`.
      local_window_size: `(left, right)`, or `w` for `(w, w)`: key `j` visible only if
        `i + S - N - left <= j <= i + S - N + right`; a None side is unbounded. Default None.
      q_lengths: int, broadcastable to `(B…)`: valid queries per sequence; rows past it output 0. Default None.
      kv_lengths: int, broadcastable to `(B…)`: valid keys per sequence. Default None.
      q_segment_ids: int `(B…, N)`: packed sequences, query `i` sees key `j` only when
        `q_segment_ids[i] == kv_segment_ids[j]`. Default None.
      kv_segment_ids: int `(B…, S)`. Default None: `q_segment_ids` (N == S only).
      empty_rows: what a query with no visible key outputs: `"zero"` (default) or
        `"uniform"` (the mean of v, as flax and jax.nn).
      score_mod: `score_mod(score, batch, head, q_idx, kv_idx) -> score`, as PyTorch
        FlexAttention's. Default None.
      mask_mod: `mask_mod(batch, head, q_idx, kv_idx) -> bool`, True = may attend. Default None.
      logits_soft_cap: a static `c > 0`: logits become `c · tanh(logits / c)`. Default None.
      sinks: float `(H,)`: per query head, the logit of a virtual key of value zero. Default None.
      block_schedule: `block_schedule(...)` of this call's pattern, built once and given
        to every layer (FlexAttention's block mask), read by the library's kernel; it
        must describe the same pattern. Default None: the kernel builds its own.
      dropout_rate: dropout on the weights, when `deterministic=False`. Default 0.0.
      dropout_rng: the dropout's PRNG key, needed when dropout is on. Default None.
      deterministic: disables dropout. Default True.
      return_weights: also return the weights `(B…, H, N, S)`, after dropout. Default False.
      return_residual: also return `lse (B…, H, N)` float32, each row's log-sum-exp.
        Default False.
      implementation: `"xla"` (default), `"blockwise"`, `"cudnn"`, `"pallas_tpu"`,
        `"pallas_gpu"`, `"pallas_mgpu"`, or `"auto"`/None (`resolve_implementation`).
      query_block_size: the blockwise path's query block. Default None: `blockwise.default_blocks`.
      key_block_size: the blockwise path's key block. Default None: `blockwise.default_blocks`.
      layout: `"BHND"` (default) or `"BNHD"`: q, k, v and the output `(B…, N, H, D)`;
        masks, biases and the weights stay `(B…, H, N, S)`.

    Returns:
      `out (B…, H, N, Dv)` (`(B…, N, H, Dv)` with `"BNHD"`) in q's dtype; `(out, weights)`,
      `(out, lse)` or `(out, weights, lse)` with `return_weights`/`return_residual`.

    Raises:
      TypeError: a non-floating or mixed dtype, a non-boolean mask, a non-floating bias,
        non-integer lengths or ids, a bad window, a mod not callable or of the wrong
        result dtype, a soft-cap not a number.
      ValueError: shapes that do not fit, `kv_segment_ids` missing when N != S, an
        unknown implementation or a named one's refusal, a mod result of the wrong
        shape, a soft-cap not positive and finite, a bad option, dropout without a key.
    """
    q, k, v = check_layout(layout, q, k, v)
    vis = describe(q, k, v, mask, bias, is_causal=is_causal, local_window_size=local_window_size,
                   q_lengths=q_lengths, kv_lengths=kv_lengths, q_segment_ids=q_segment_ids,
                   kv_segment_ids=kv_segment_ids, score_mod=score_mod, mask_mod=mask_mod,
                   logits_soft_cap=logits_soft_cap, sinks=sinks, block_schedule=block_schedule)
    result = attention_from_description(
        q, k, v, vis, scale=scale, empty_rows=empty_rows, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
        deterministic=deterministic, return_weights=return_weights, return_residual=return_residual,
        implementation=implementation, query_block_size=query_block_size, key_block_size=key_block_size,
    )
    if layout == "BHND":
        return result
    if return_weights or return_residual:
        return (jnp.swapaxes(result[0], -3, -2), *result[1:])
    return jnp.swapaxes(result, -3, -2)


def block_schedule(q, k, *, is_causal: bool = False, local_window_size=None, q_lengths=None, kv_lengths=None,
                   q_segment_ids=None, kv_segment_ids=None, mask_mod=None):
    """The library kernel's block schedule of one pattern, built once and passed to
    every layer's `attention(..., block_schedule=...)` (PyTorch FlexAttention's
    `create_block_mask`): per query block, the key blocks that hold a visible pair and
    which of them are fully visible, from causality, the window, lengths, segment ids
    and `mask_mod` (evaluated one query block at a time, never an N × S array).

    Args:
      q: `(B…, H, N, D)`, k: `(B…, K, S, D)`: arrays or `jax.ShapeDtypeStruct`s (only
        their shapes and dtypes are read).
      is_causal: as for `attention`.
      local_window_size: as for `attention`.
      q_lengths: as for `attention`.
      kv_lengths: as for `attention`.
      q_segment_ids: as for `attention`.
      kv_segment_ids: as for `attention`.
      mask_mod: as for `attention`. The call that reads the schedule must give the same
        pattern (a schedule of another pattern gives wrong rows, as a block mask does
        in FlexAttention).

    Returns:
      A `BlockSchedule` (a pytree of int32 arrays: it passes through jit, scan and remat).
      A path other than the library's kernel ignores it; the kernel builds its own when
      the blocks, batch or heads do not fit.
    """
    vis = describe(q, k, k, is_causal=is_causal, local_window_size=local_window_size, q_lengths=q_lengths,
                   kv_lengths=kv_lengths, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                   mask_mod=mask_mod)
    return schedules.build_schedule(vis, *flex.blocks(vis.n, vis.s))


def _block_sizes(query_block_size, key_block_size) -> tuple[int | None, int | None]:
    """The blockwise path's block sizes, validated (None: `blockwise.default_blocks`)."""
    q_block = None if query_block_size is None else as_index("query_block_size", query_block_size)
    k_block = None if key_block_size is None else as_index("key_block_size", key_block_size)
    if any(b is not None and b < 1 for b in (q_block, k_block)):
        raise ValueError(f"block sizes must be >= 1, got query_block_size={q_block}, key_block_size={k_block}")
    return q_block, k_block


def attention_from_description(q, k, v, vis: _masking.Visibility, *, scale=None, empty_rows="zero",
                               dropout_rate=0.0, dropout_rng=None, deterministic=True, return_weights=False,
                               return_residual=False, implementation="xla", query_block_size=None,
                               key_block_size=None):
    """`attention` for a description already built (`_validate.describe`): what
    decoding calls with the cache index as the query offset. Arguments as `attention`."""
    scale = check_options(scale, dropout_rate, dropout_rng, deterministic, empty_rows, vis.is_causal, q.shape[-1])
    dropout = dropout_rate > 0.0 and not deterministic
    call = _masking.Call(q, k, v, bool(return_weights), dropout, empty_rows, _dispatch.platform(),
                         bool(return_residual))
    path = _dispatch.choose(vis, call, implementation)
    blocks = _block_sizes(query_block_size, key_block_size)
    return _dispatch.run(path, q, k, v, vis, call, scale=scale, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                         blocks=blocks, empty_rows=empty_rows)


def resolve_implementation(q, k, v, vis: _masking.Visibility | None = None, *, implementation: str | None = "auto",
                           return_weights: bool = False, dropout: bool = False, empty_rows: str = "zero") -> str:
    """The path `attention` takes for these inputs (`_dispatch.choose`): `implementation`
    itself, or for `"auto"`/None the first of the platform's kernels (`_dispatch.REGISTRY`
    order, `Path.auto`) that `"auto"` may take (`Path.auto_refusal`), else `"xla"` while the
    whole scores fit (or the weights or dropout are needed), else `"blockwise"`.

    Args:
      q, k, v: arrays or `jax.ShapeDtypeStruct`s shaped as for `attention`.
      vis: the description (None: every pair may attend).
      implementation, return_weights, empty_rows: as for `attention`.
      dropout: whether dropout on the weights is active.

    Returns:
      One of `IMPLEMENTATIONS` other than `"auto"`.

    Raises:
      ValueError: for an unknown implementation name, or the refusal of a named one.
    """
    vis = _masking.Visibility(q.shape[-2], k.shape[-2]) if vis is None else vis
    call = _masking.Call(q, k, v, return_weights, dropout, empty_rows, _dispatch.platform())
    return _dispatch.choose(vis, call, implementation)


def merge_attentions(parts) -> tuple[jax.Array, jax.Array]:
    """Attention over a union of disjoint key sets, from the attention over each.

    `attention(q, k, v, return_residual=True)` over keys split into disjoint sets
    (split-KV decoding, chunked prefill, context parallelism by hand) gives one
    `(out_i, lse_i)` per set; their union's attention is
    `out = Σ_i exp(lse_i - lse) out_i` with `lse = log Σ_i exp(lse_i)`, exactly (to
    rounding). A part with no visible key (`lse_i = -inf`) contributes nothing;
    if every part is empty the row is zeros with lse -inf. Sinks belong to one
    part only (each part's lse counts its sink).

    Args:
      parts: a non-empty sequence of `(out (B…, H, N, Dv), lse (B…, H, N))`, each
        part's arrays of one shape.

    Returns:
      `(out (B…, H, N, Dv) in the parts' dtype, lse (B…, H, N) float32)`.
      Differentiable.

    Raises:
      ValueError: for no parts, a part that is not an `(out, lse)` pair, or shapes
        that differ.
    """
    parts = list(parts)
    if not parts:
        raise ValueError("merge_attentions needs at least one (out, lse) part, got none")
    for i, part in enumerate(parts):
        if not isinstance(part, (tuple, list)) or len(part) != 2:
            raise ValueError(f"part {i} of merge_attentions must be an (out, lse) pair, got {type(part).__name__}")
        out, lse = jnp.asarray(part[0]), jnp.asarray(part[1])
        if out.shape[:-1] != lse.shape or out.shape != jnp.shape(parts[0][0]):
            raise ValueError(f"part {i}: out {out.shape} and lse {lse.shape} must be (B…, H, N, Dv) and (B…, H, N), "
                             f"the same for every part (part 0 out {jnp.shape(parts[0][0])})")
    outs = jnp.stack([jnp.asarray(o).astype(jnp.float32) for o, _ in parts])  # (P, B…, H, N, Dv)
    lses = jnp.stack([jnp.asarray(x).astype(jnp.float32) for _, x in parts])  # (P, B…, H, N)
    top = jax.lax.stop_gradient(jnp.max(lses, axis=0))
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    scale = jnp.exp(lses - top[None])  # (P, B…, H, N); 0 for an empty part
    total = jnp.sum(scale, axis=0)
    seen = total > 0
    out = jnp.sum(scale[..., None] * outs, axis=0) / jnp.where(seen, total, 1.0)[..., None]
    lse = jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
    return out.astype(jnp.asarray(parts[0][0]).dtype), lse


def blockwise_attention(q, k, v, mask=None, bias=None, *, query_block_size=None, key_block_size=None, **kwargs):
    """`attention(..., implementation="blockwise")`: the memory-efficient path.

    Args:
      q, k, v, mask, bias: as in `attention` (`q (B…, H, N, D)`, `k, v (B…, K, S, D)`).
      query_block_size: the largest query block; None: `blockwise.default_blocks`.
      key_block_size: the largest key block; None: `blockwise.default_blocks`.
      **kwargs: every other keyword of `attention`.

    Returns:
      `out (B…, H, N, D)`, as `attention` does.

    Raises:
      ValueError: as `attention`, naming the bad argument.
      TypeError: as `attention`; also for an `implementation` argument.
    """
    if "implementation" in kwargs:
        raise TypeError("blockwise_attention always runs implementation='blockwise'; drop the implementation argument")
    return attention(q, k, v, mask, bias, implementation="blockwise", query_block_size=query_block_size,
                     key_block_size=key_block_size, **kwargs)


__all__ = [
    "EMPTY_ROWS", "IMPLEMENTATIONS", "WHOLE_SCORES_MAX_BYTES", "DTypeError", "attention", "attention_entropy",
    "attention_statistics",
    "blockwise_attention", "causal_mask", "combine_heads", "lengths_mask", "merge_attentions", "padding_mask",
    "resolve_implementation",
    "rotary_embedding", "split_heads", "whole_scores_fit",
]
