"""Per-head attention statistics without the weights: entropy, peak, received weight, lse.

`attention_statistics` measures what an analysis usually reads off the `(B…, H, N, S)`
weights (how spread each query's attention is, how much the strongest key takes, how
much attention each key receives) in memory linear in N and S. Each query block makes
two passes over the key blocks it may see (Milakov & Gimelshein 2018's online softmax,
as in FlashAttention):

1. the row maximum and normaliser, online, give `lse` (the log of the softmax
   denominator, a sink included);
2. each block's weights `p = exp(s - lse)` are recomputed exactly and reduced at once:
   `entropy -= Σ p·(s - lse)` (so `log p` is never taken of a rounded `p`), the row
   maximum of `p`, and the column sums of `p` into a `(B, H, S)` accumulator carried
   from one query block to the next.

Who may attend and the logits come from the one description (`jax_mha._masking`):
`block_allowed` and `score_logits` evaluate it per block, `key_range` bounds each query
block's key loop, and a block with no visible pair is skipped. GQA: query head `h`
reads key head `h // (H // K)` inside a block's matmul; k is never repeated.

Layout inside (`B` the flattened batch, `G = H // K`): q `(B, K, G, Np, D)`, k
`(B, K, Sp, D)`, scores and mask/bias blocks `(B|1, H|1, bq, bk)`, rows `(B, H, bq)`;
N and S are padded to whole blocks, and padded rows and keys never attend.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_mha import _dispatch, _masking, _softmax, _validate

# "auto" and the paths whose statistics are computed here (`Path.statistics`).
IMPLEMENTATIONS = ("auto",) + tuple(name for name, path in _dispatch.REGISTRY.items() if path.statistics)
BLOCK_SIZE = 512  # default query and key block of the blockwise path
BLOCK_ELEMENTS = 2**22  # the default query block halves (down to 64 rows) until B·H·bq·bk fits this


class _Plan(NamedTuple):
    """Static configuration of one call."""

    n: int
    s: int
    n_pad: int
    s_pad: int
    heads: int
    groups: int
    q_block: int
    k_block: int
    scale: float
    dtype: str  # "float32", or "float64" for float64 inputs


def _rows_cols(plan: _Plan, i0, j0):
    """int32 `(rows (bq, 1), cols (1, bk))` of one block."""
    rows = i0 + lax.broadcasted_iota(jnp.int32, (plan.q_block, 1), 0)
    cols = j0 + lax.broadcasted_iota(jnp.int32, (1, plan.k_block), 1)
    return rows, cols


def _pair_block(x, plan: _Plan, i0, j0):
    """Rows `i0…` and keys `j0…` of a `(B|1, H|1, Np|1, Sp|1)` mask or bias."""
    if x is None:
        return None
    if x.shape[2] != 1:
        x = lax.dynamic_slice_in_dim(x, i0, plan.q_block, axis=2)
    if x.shape[3] != 1:
        x = lax.dynamic_slice_in_dim(x, j0, plan.k_block, axis=3)
    return x


def _allowed(plan: _Plan, vis: _masking.Visibility, i0, j0):
    """bool `(B|1, H|1, bq, bk)` of one block (None: every pair), padding never."""
    rows, cols = _rows_cols(plan, i0, j0)
    segments = None
    if vis.segmented:
        segments = (lax.dynamic_slice_in_dim(vis.q_segment_ids, i0, plan.q_block, axis=2),
                    lax.dynamic_slice_in_dim(vis.kv_segment_ids, j0, plan.k_block, axis=3))
    heads = _masking.dense_heads(vis, 4)
    allowed = _masking.block_allowed(vis, rows, cols, _pair_block(vis.mask, plan, i0, j0), 4, segments, heads)
    if plan.n_pad != plan.n or plan.s_pad != plan.s:
        inside = lax.broadcast_to_rank((rows < plan.n) & (cols < plan.s), 4)
        allowed = inside if allowed is None else allowed & inside
    return allowed


def _logits(plan: _Plan, vis: _masking.Visibility, q_i, k, i0, j0, allowed):
    """float `(B, H, bq, bk)`: scaled, biased, modded logits, `-inf` where not allowed."""
    k_j = lax.dynamic_slice_in_dim(k, j0, plan.k_block, axis=2)
    s = jnp.einsum("bkgqd,bkcd->bkgqc", q_i, k_j, preferred_element_type=jnp.dtype(plan.dtype))
    s = s.reshape(s.shape[0], plan.heads, plan.q_block, plan.k_block) * jnp.asarray(plan.scale, plan.dtype)
    bias = _pair_block(vis.bias, plan, i0, j0)
    if bias is not None:
        s = s + bias.astype(plan.dtype)
    rows, cols = _rows_cols(plan, i0, j0)
    s = _masking.score_logits(vis, s, _masking.dense_heads(vis, 4), rows, cols)
    return s if allowed is None else jnp.where(allowed, s, -jnp.inf)


def _key_blocks(plan: _Plan, vis: _masking.Visibility, i0):
    """Key blocks `[lo, hi)` query rows `i0…` may see: by causality and the window
    (`key_range`), past no sequence's `kv_lengths`, none for rows past every
    `q_lengths`. A bound only: each block is still tested pair by pair."""
    return _masking.key_block_range(vis, i0, plan.q_block, plan.k_block, plan.s_pad, vis.q_lengths, vis.kv_lengths)


def _over_keys(plan: _Plan, vis, i0, update, carry):
    """`update(j0, allowed, carry) -> carry` over the key blocks of query rows `i0…`,
    skipping those with no visible pair; one block (the whole keys) runs unlooped."""
    def body(j, carry):
        j0 = j * plan.k_block
        allowed = _allowed(plan, vis, i0, j0)
        if allowed is None:
            return update(j0, None, carry)
        return lax.cond(jnp.any(allowed), lambda c: update(j0, allowed, c), lambda c: c, carry)

    if plan.s_pad == plan.k_block:
        return body(0, carry)
    lo, hi = _key_blocks(plan, vis, i0)
    return lax.fori_loop(lo, hi, body, carry)


def _first_pass(plan: _Plan, vis, q_i, k, bad_kv, i0):
    """Online row maximum `m` and normaliser `l` over the real keys, and `touched`:
    rows that may see a key in `bad_kv` (bool `(B, K, Sp)` or None); each `(B, H, bq)`."""
    f = jnp.dtype(plan.dtype)

    def update(j0, allowed, carry):
        m, l, touched = carry
        s = _logits(plan, vis, q_i, k, i0, j0, allowed)
        m_new, l, _, _ = _softmax.online_step(m, l, s)
        if bad_kv is not None:
            bad = jnp.repeat(lax.dynamic_slice_in_dim(bad_kv, j0, plan.k_block, axis=2), plan.groups, axis=1)
            seen = bad[:, :, None, :] if allowed is None else allowed & bad[:, :, None, :]  # (B, H, bq, bk)
            touched = touched | jnp.any(seen, axis=-1)
        return m_new, l, touched

    rows = (q_i.shape[0], plan.heads, plan.q_block)
    init = (jnp.full(rows, -jnp.inf, f), jnp.zeros(rows, f), jnp.zeros(rows, bool))
    return _over_keys(plan, vis, i0, update, init)


def _second_pass(plan: _Plan, vis, q_i, k, lse, poisoned, received, i0):
    """Entropy and maximum of each row's weights `p = exp(s - lse)` (`(B, H, bq)`), and
    their column sums added into `received` `(B, H, Sp)`; a `poisoned` row adds NaN to
    every key it may see."""
    f = jnp.dtype(plan.dtype)
    lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]  # a row without keys has p = 0 anyway

    def update(j0, allowed, carry):
        entropy, top, received = carry
        s = _logits(plan, vis, q_i, k, i0, j0, allowed)
        log_p = s - lse_safe
        p = jnp.exp(log_p)  # 0 where masked
        entropy = entropy - jnp.sum(jnp.where(p > 0, p * log_p, 0.0), axis=-1)  # select: 0·(-inf) never summed
        top = jnp.maximum(top, jnp.max(p, axis=-1))
        if poisoned is not None:
            seen = poisoned[..., None] if allowed is None else poisoned[..., None] & allowed
            p = jnp.where(seen, jnp.nan, p)
        cols = lax.dynamic_slice_in_dim(received, j0, plan.k_block, axis=2) + jnp.sum(p, axis=-2)
        return entropy, top, lax.dynamic_update_slice_in_dim(received, cols, j0, axis=2)

    zeros = jnp.zeros(lse.shape, f)
    return _over_keys(plan, vis, i0, update, (zeros, zeros, received))


def _row_lse(plan: _Plan, vis, m, l, i0):
    """`(lse, empty)` of rows `i0…` from the online `(m, l)`: `lse` closed as the
    description says (`_softmax.close_lse`), -inf on a padding row (past `q_lengths`)
    and on a row with nothing in its denominator; `empty` marks rows with no visible key."""
    empty = m == -jnp.inf
    lse = _softmax.close_lse(jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l))), vis)
    if vis.q_lengths is not None:
        rows = lax.broadcast_to_rank(i0 + jnp.arange(plan.q_block, dtype=jnp.int32), 3)  # (1, 1, bq)
        lse = jnp.where(rows < vis.q_lengths[..., 0], lse, -jnp.inf)
    return lse, empty


def _query_block(plan: _Plan, vis, q, k, bad_q, bad_kv, received, r):
    """Both passes for query block `r`: `(received, (entropy, max_weight, lse))`, rows `(B, H, bq)`."""
    i0 = r * plan.q_block
    q_i = lax.dynamic_slice_in_dim(q, i0, plan.q_block, axis=3)  # (B, K, G, bq, D)
    m, l, touched = _first_pass(plan, vis, q_i, k, bad_kv, i0)
    lse, empty = _row_lse(plan, vis, m, l, i0)
    poisoned = None
    if bad_q is not None:
        # As `attention`: a row with no visible key is never NaN (nor a padding row, which sees none).
        poisoned = (touched | lax.dynamic_slice_in_dim(bad_q, i0, plan.q_block, axis=2)) & ~empty
    entropy, top, received = _second_pass(plan, vis, q_i, k, lse, poisoned, received, i0)
    if poisoned is not None:
        entropy, top, lse = (jnp.where(poisoned, jnp.nan, x) for x in (entropy, top, lse))
    return received, (entropy, top, lse)


def _statistics(plan: _Plan, vis, q, k, bad_q, bad_kv):
    """`(entropy, max_weight, lse (B, H, Np), received (B, H, Sp))` in the engine layout."""
    received = jnp.zeros((q.shape[0], plan.heads, plan.s_pad), plan.dtype)
    step = lambda carry, r: _query_block(plan, vis, q, k, bad_q, bad_kv, carry, r)
    if plan.n_pad == plan.q_block:
        received, rows = step(received, 0)
        return (*rows, received)
    received, rows = lax.scan(step, received, jnp.arange(plan.n_pad // plan.q_block, dtype=jnp.int32))
    unblock = lambda x: jnp.moveaxis(x, 0, 2).reshape(x.shape[1:3] + (plan.n_pad,))  # (nr, B, H, bq) -> (B, H, Np)
    return (*(unblock(x) for x in rows), received)


# Compiled once per plan, description and shapes, so that eager calls reuse it.
_statistics_jit = jax.jit(_statistics, static_argnums=0)


# ---------------------------------------------------------------------------------
# From the public layout to the engine's, and the public function.
# ---------------------------------------------------------------------------------


def _flat_batch(x, batch: tuple, tail: int):
    """`(B…|1, …)` (rank `len(batch) + tail`, lower ranks padded with 1s in front) ->
    `(B|1, …)`: the batch dims flattened, or one size-1 axis when they all broadcast."""
    x = x.reshape((1,) * (len(batch) + tail - x.ndim) + x.shape)
    rest = x.shape[len(batch):]
    if all(d == 1 for d in x.shape[:len(batch)]):
        return x.reshape((1,) + rest)
    return jnp.broadcast_to(x, batch + rest).reshape((-1,) + rest)


def _pad(x, axis: int, size: int, value):
    """`x` padded at the end of `axis` to `size` (a size-1, broadcast axis left alone)."""
    if x is None or x.shape[axis] in (1, size):
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _engine_description(vis: _masking.Visibility, batch: tuple, plan: _Plan) -> _masking.Visibility:
    """The description with its arrays in the engine layout (batch flattened, N and S padded)."""
    flat = lambda x, tail: None if x is None else _flat_batch(x, batch, tail)
    return dataclasses.replace(
        vis,
        mask=_pad(_pad(flat(vis.mask, 3), 2, plan.n_pad, False), 3, plan.s_pad, False),
        bias=_pad(_pad(flat(vis.bias, 3), 2, plan.n_pad, 0.0), 3, plan.s_pad, 0.0),
        q_lengths=flat(vis.q_lengths, 3), kv_lengths=flat(vis.kv_lengths, 3),
        q_segment_ids=_pad(flat(vis.q_segment_ids, 3), 2, plan.n_pad, 0),
        kv_segment_ids=_pad(flat(vis.kv_segment_ids, 3), 3, plan.s_pad, 0),
        batch_shape=(math.prod(batch),),
    )


def _check_blocks(implementation, query_block_size, key_block_size) -> str:
    """The implementation name (None is "auto"), the block sizes checked.

    Raises:
      ValueError: for an unknown name or a block size below 1. TypeError: for a non-int size.
    """
    implementation = "auto" if implementation is None else implementation
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
    for name, size in (("query_block_size", query_block_size), ("key_block_size", key_block_size)):
        if size is not None and _validate.as_index(name, size) < 1:
            raise ValueError(f"{name} must be >= 1, got {size}")
    return implementation


def _blocks(path: str, n: int, s: int, rows: int, query_block_size, key_block_size) -> tuple[int, int]:
    """`(q_block, k_block)`: the whole N x S on a path of whole scores
    (`Path.statistics == "whole"`); in blocks the sizes given, else `BLOCK_SIZE` square
    blocks, the query block halved (not below 64) while the `rows` (B·H) score blocks
    hold more than `BLOCK_ELEMENTS`; clamped to N and S."""
    if _dispatch.REGISTRY[path].statistics == "whole":
        return n, s
    k_block = min(s, BLOCK_SIZE if key_block_size is None else int(key_block_size))
    if query_block_size is not None:
        return min(n, int(query_block_size)), k_block
    q_block = BLOCK_SIZE
    while q_block > 64 and rows * q_block * k_block > BLOCK_ELEMENTS:
        q_block //= 2
    return min(n, q_block), k_block


def _empty_result(q, k, vis, dtype) -> dict:
    """The statistics when N, S or the batch is empty: no weights, so zeros; `lse`
    -inf closed as the description says on every row (`_softmax.close_lse`: a sink's
    logit), -inf past `q_lengths`."""
    batch, (h, n), s = q.shape[:-3], q.shape[-3:-1], k.shape[-2]
    rows = batch + (h, n)
    lse = _softmax.close_lse(jnp.full(rows, -jnp.inf, dtype), vis).astype(dtype)
    if vis.q_lengths is not None:
        inside = lax.broadcast_to_rank(jnp.arange(n, dtype=jnp.int32), len(rows)) < vis.q_lengths[..., 0]
        lse = jnp.where(inside, lse, -jnp.inf)
    zeros = jnp.zeros(rows, dtype)
    return {"entropy": zeros, "max_weight": zeros, "received": jnp.zeros(batch + (h, s), dtype), "lse": lse}


def _run(path, q, k, v, vis, scale, blocks) -> dict:
    """`path` (one of `IMPLEMENTATIONS` but "auto") on validated inputs; the public
    layout in and out. Every row of a head whose sink is not finite is NaN
    (`_softmax.sanitize_description`)."""
    batch, (heads, n, d), (kv_heads, s) = q.shape[:-3], q.shape[-3:], k.shape[-3:-1]
    b = math.prod(batch)
    dtype = _masking.compute_dtype(q.dtype)
    q, k, v, bad_q, bad_kv = _softmax.sanitize(q, k, v)
    vis, bad_heads = _softmax.sanitize_description(vis)
    if bad_heads is not False:
        bad_q = bad_q | lax.broadcast_to_rank(bad_heads, bad_q.ndim)
    q_block, k_block = _blocks(path, n, s, b * heads, *blocks)
    plan = _Plan(n, s, -(-n // q_block) * q_block, -(-s // k_block) * k_block, heads, heads // kv_heads, q_block,
                 k_block, float(scale), dtype.name)
    q_e = _pad(q.reshape(b, kv_heads, plan.groups, n, d), 3, plan.n_pad, 0)  # (B, K, G, Np, D)
    k_e = _pad(k.reshape(b, kv_heads, s, d), 2, plan.s_pad, 0)  # (B, K, Sp, D)
    bad_q = _pad(bad_q.reshape(b, heads, n), 2, plan.n_pad, False)  # (B, H, Np)
    bad_kv = _pad(bad_kv.reshape(b, kv_heads, s), 2, plan.s_pad, False)  # (B, K, Sp)
    entropy, top, lse, received = _statistics_jit(plan, _engine_description(vis, batch, plan), q_e, k_e, bad_q,
                                                  bad_kv)
    rows = lambda x: x[..., :n].reshape(batch + (heads, n))
    entropy, top, lse = rows(entropy), rows(top), rows(lse)
    if bad_heads is not False:  # a bad sink's head: every row, also those that see no key
        bad = lax.broadcast_to_rank(bad_heads, entropy.ndim)
        entropy, top, lse = (jnp.where(bad, jnp.nan, x) for x in (entropy, top, lse))
    # Rounding can step just past the bounds (a one-hot row's entropy of -1e-8).
    entropy = jnp.clip(entropy, 0.0, math.log(s))
    top = jnp.clip(top, 0.0, 1.0)
    return {"entropy": entropy, "max_weight": top, "received": received[..., :s].reshape(batch + (heads, s)),
            "lse": lse}


def attention_statistics(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    scale: float | None = None,
    implementation: str | None = "auto",
    query_block_size: int | None = None,
    key_block_size: int | None = None,
    **description,
) -> dict[str, jax.Array]:
    """Per-head statistics of the attention weights, without building them on the
    blockwise path.

    The weights are those of `jax_mha.attention` with the same arguments (`w = softmax`
    over the visible keys, `empty_rows="zero"`); the statistics equal what one would
    compute from `attention(..., return_weights=True)`: `attention_entropy(w)`,
    `w.max(-1)`, `w.sum(-2)`, and the log of the softmax denominator. On the blockwise
    path no `(N, S)` array exists: memory is `O(B·H·(N + S) + B·H·q_block·k_block)`
    besides the inputs (measured in docs/performance.md, "Head statistics at long
    context"), and key blocks that causality, the window or the lengths rule out are
    not computed.

    With a sink per head (gpt-oss's, a virtual key of value zero), the real keys'
    weights sum to one minus the sink's share, `exp(sink - lse)`; `entropy`,
    `max_weight` and `received` are over the real keys only (not renormalised; the
    sink's own term is not in the entropy), as `attention_entropy` of the weights
    `attention` returns with the same sink logits.

    Rows: a row with no visible key has entropy 0, max_weight 0, and lse `-inf` (with
    a sink, the sink's logit: it takes all the weight). A row past `q_lengths` is
    padding, not a query: its statistics are 0, lse `-inf` even with a sink, and it adds
    nothing to `received`. Non-finite inputs, as in `attention`: a row that may attend
    to a key or value with a NaN or infinite entry, or whose own query has one, gets NaN
    entropy, max_weight and lse, and adds NaN to `received` of every key it may attend
    (and only those); rows without a visible key are never NaN; every other number is
    exactly what it would be without the bad entries. Entropy stays in `[0, log S]` and
    weights in `[0, 1]`.

    Not differentiable: the outputs are measurements. q, k, v, `bias` and the sink logits pass
    through `jax.lax.stop_gradient`, so the statistics can be computed inside a
    differentiated function (e.g. logged from a training step) and carry zero gradient;
    values a `score_mod` closes over are not stopped, and differentiating through them
    is unsupported. Works under `jax.jit` and `jax.vmap`.

    Args:
      q: `(B…, H, N, D)` queries, real floating point.
      k: `(B…, K, S, D)` keys, `H % K == 0`; query head `h` reads key head
        `h // (H // K)` (GQA), inside each block's matmul, never repeated.
      v: `(B…, K, S, Dv)` values: the weights do not depend on them, but a row that may
        attend to a non-finite value is NaN, as in `attention`.
      mask: bool broadcastable to `(B…, H, N, S)`, True = may attend.
      bias: float broadcastable to `(B…, H, N, S)`, added to the scaled logits.
      scale: the logit scale (a static number), default `1/sqrt(D)`.
      implementation: `"xla"` (the whole `(B…, H, N, S)` scores in one block),
        `"blockwise"` (query blocks x key blocks, memory linear in N and S), or
        `"auto"`/None: `"xla"` while the whole scores fit
        `WHOLE_SCORES_MAX_BYTES`, else `"blockwise"`.
      query_block_size: the blockwise path's query block (None: 512, halved down to 64
        while `B·H·q_block·k_block` exceeds 2**22 elements); ignored by `"xla"`.
      key_block_size: the blockwise path's key block (None: 512); ignored by `"xla"`.
      **description: `attention`'s keywords of who may attend and of the logits
        (`jax_mha._validate.DESCRIPTION_KEYWORDS`: causality, window, lengths, segment
        ids, the mods, the soft cap, the sink logits), with their meaning and checks.

    Returns:
      A dict of float32 arrays (float64 for float64 inputs):
        `entropy` `(B…, H, N)`: nats, `-Σ_j w_j log w_j` with `0·log 0 = 0`;
        `max_weight` `(B…, H, N)`: the largest weight of each row;
        `received` `(B…, H, S)`: the weight each key receives, summed over queries;
        `lse` `(B…, H, N)`: the natural log of each row's softmax denominator, the
        sink included.

    Raises:
      TypeError: as `attention` (integer, complex or mixed dtypes, a non-boolean mask,
        bad lengths, ids or mods, non-floating sink logits, ...); a keyword that is not
        `attention`'s description; a non-int block size.
      ValueError: as `attention` for shapes that do not fit or non-finite concrete
        sink logits; an unknown implementation; a block size below 1.
    """
    path = _check_blocks(implementation, query_block_size, key_block_size)
    _validate.check_description_keywords("attention_statistics", description)
    q, k, v = (lax.stop_gradient(jnp.asarray(x)) for x in (q, k, v))
    bias = None if bias is None else lax.stop_gradient(jnp.asarray(bias))
    vis = _validate.describe(q, k, v, mask, bias, **description)
    vis = jax.tree.map(lax.stop_gradient, vis)
    scale = _validate.check_options(scale, 0.0, None, True, "zero", vis.is_causal, q.shape[-1])
    if path == "auto":
        path = _dispatch.pure_path(vis, _masking.Call(q, k, v))
    if q.shape[-2] == 0 or k.shape[-2] == 0 or 0 in q.shape[:-3]:
        return _empty_result(q, k, vis, _masking.compute_dtype(q.dtype))
    return _run(path, q, k, v, vis, scale, (query_block_size, key_block_size))


__all__ = ["IMPLEMENTATIONS", "attention_statistics"]
