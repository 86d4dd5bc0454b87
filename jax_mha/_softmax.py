"""The softmax recurrence every path shares, and the steps around it.

- `online_step`: one block of scores folded into a row's running maximum and
  normaliser (the online softmax of FlashAttention), called by the library's kernel
  (`flex`) and the statistics (`_statistics`), and through `fold_block` (the step
  with the output and the rows that see a bad key) by the blockwise engine (`engine`)
  and ring attention (`ring`); `output_delta` and `logits_grad`, its backward (the
  engine, the kernel and ring).
- `close` / `close_lse`: attention over the real keys merged with what the description
  adds to every row's denominator, each head's sink: a key of logit `sinks[h]` and value
  zero (`merge_attentions` with a zero part). Every path calls it, or its kernel does
  the same itself.
- `sanitize` / `sanitize_description` before any path and `finish` / `finish_lse` after it: non-finite inputs
  replaced and the rows that see them marked, then those rows NaN, the empty-row
  policy, zeros past `q_lengths`. A non-finite sink is a non-finite input of every row
  of its head: those rows are NaN on every path.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def online_step(m, l, s, exp=jnp.exp, keepdims: bool = False):
    """Folds a block of scores into the running softmax of each row.

    Args:
      m: the running maximum `(…, rows)` (-inf on a row that has seen nothing).
      l: the running normaliser `(…, rows)`, relative to `m`.
      s: the block's logits `(…, rows, keys)`, -inf where masked.
      exp: the exponential (the GPU kernel passes its faster one, `flex.exp_of`).
      keepdims: `m`, `l` and the correction are `(…, rows, 1)` (a TPU kernel keeps
        rows on sublanes: Mosaic's vectors are 2-D).

    Returns:
      `(m_new, l_new, p (…, rows, keys), correction (…, rows))`: `p = exp(s - m_new)`
      (0 where masked) and `correction = exp(m - m_new)`, which rescales anything
      accumulated against the old maximum (`acc * correction + p · v`).
    """
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=keepdims))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no -inf - -inf on a row with nothing yet
    p = exp(s - (m_safe if keepdims else m_safe[..., None]))
    correction = exp(m - m_safe)
    return m_new, l * correction + jnp.sum(p, axis=-1, keepdims=keepdims), p, correction


def fold_block(carry, s, v, mix: str, seen=None):
    """One block folded into each row's running softmax and output: the step the
    blockwise engine and ring attention run for every block they visit.

    Args:
      carry: `(m, l, acc (…, rows, Dv), touched)`: `online_step`'s maximum and
        normaliser, the output accumulated against `m` (in the accumulation dtype), and
        bool `(…, rows)`, the rows that may see a bad key so far.
      s: the block's logits `(…, rows, keys)`, -inf where masked.
      v: the block's values, in the caller's layout and dtype.
      mix: the einsum of the weights and `v` in that layout (`"…ns,…sd->…nd"`).
      seen: bool `(…, rows, keys)`, the visible keys that are bad, or None.

    Returns:
      The carry with the block folded in. The weights enter the product in v's dtype
      (FlashAttention's half-precision matmul), accumulated in acc's.
    """
    m, l, acc, touched = carry
    m, l, p, correction = online_step(m, l, s)
    pv = jnp.einsum(mix, p.astype(v.dtype), v, preferred_element_type=acc.dtype)
    if seen is not None:
        touched = touched | jnp.any(seen, axis=-1)
    return m, l, acc * correction[..., None] + pv, touched


def output_delta(g, out, g_lse):
    """`Δ = rowsum(g ⊙ out) - g_lse` `(…, rows)`: what every logit of a row gives back
    through the softmax in the backward (FlashAttention-2's D), from the output's
    cotangent `g (…, rows, Dv)`, the output and the log-sum-exp's cotangent."""
    return jnp.sum(g * out, axis=-1) - g_lse


def logits_grad(p, dp, delta):
    """The gradient of one block's logits, `dS = P ⊙ (dP - Δ)`: `p` the weights (0
    where masked), `dp = g vᵀ`, `delta` broadcast to the block. Selected, not
    multiplied, where `p` is 0, so a non-finite `dp` there never becomes NaN."""
    return jnp.where(p > 0, p * (dp - delta), 0.0)


def close(out, lse, vis, weights=None):
    """Attention over the real keys closed with what the description adds to every
    row's denominator: each head's sink (`vis.sinks (H,)`, finite after
    `sanitize_description`), a key of that logit and value zero. out (and the weights)
    shrink by the sink's share, lse gains its term. Differentiable in all of them.
    A row with no visible key (lse -inf) becomes the sink alone: out 0, lse `sinks[h]`.

    Args:
      out: `(B…, H, N, Dv)`; lse: `(B…, H, N)`, over the real keys; vis: the
        description; weights: `(B…, H, N, S)` or None.

    Returns:
      `(out, lse)`, or `(out, weights, lse)` when weights are given; the inputs when
      the description has no sink.
    """
    if closes_rows(vis):
        closed = close_lse(lse, vis)
        share = jnp.exp(lse - closed)[..., None]  # the real keys' part of each row
        out, lse = out * share.astype(out.dtype), closed
        weights = None if weights is None else weights * share.astype(weights.dtype)
    return (out, lse) if weights is None else (out, weights, lse)


def closes_rows(vis) -> bool:
    """Whether `close` changes anything: the description adds a term to every row's
    denominator (a sink)."""
    return vis.sinks is not None


def close_lse(lse, vis):
    """Each row's log-sum-exp `(B…, H, N)` with its head's sink logit added to the
    denominator (`logaddexp(lse, sinks[h])`); `lse` itself without a sink."""
    if vis.sinks is None:
        return lse
    return jnp.logaddexp(lse, jax.lax.broadcast_to_rank(vis.sinks.astype(lse.dtype)[:, None], lse.ndim))


def sanitize(q, k, v):
    """Zeroes non-finite entries so no matmul ever multiplies 0 by NaN or inf.

    Returns:
      `(q, k, v, bad_q (B…, H, N), bad_kv (B…, K, S))`: the finite arrays, the query
      rows with a non-finite entry and the keys whose key or value has one. A row
      that may see a bad key, or whose query is bad, is set to NaN by `finish`; every
      other row is exactly what it would be without them.
    """
    finite = [jnp.isfinite(x) for x in (q, k, v)]
    clean = [jnp.where(ok, x, jnp.zeros((), x.dtype)) for ok, x in zip(finite, (q, k, v))]
    bad_q = ~jnp.all(finite[0], axis=-1)
    bad_kv = ~(jnp.all(finite[1], axis=-1) & jnp.all(finite[2], axis=-1))
    return (*clean, bad_q, bad_kv)


def sanitize_description(vis):
    """`(vis, bad_heads)`: the description with its non-finite sinks `(H,)` replaced
    by 0, and bool `(H, 1)` marking their heads, every row of which `finish` sets to
    NaN (a row's softmax always includes its sink); `(vis, False)` without sinks."""
    if vis.sinks is None:
        return vis, False
    finite = jnp.isfinite(vis.sinks)
    sinks = jnp.where(finite, vis.sinks, jnp.zeros((), vis.sinks.dtype))
    return dataclasses.replace(vis, sinks=sinks), ~finite[:, None]


def poisoned_rows(touched, bad_q, empty, bad_heads=False):
    """bool `(B…, H, N)`: the rows `finish` sets to NaN: those that may see a bad key
    (`touched`) or whose query is bad, unless they see no key at all (`empty`), and
    every row of a head whose sink is non-finite (`bad_heads (H, 1)`)."""
    rows = (touched | bad_q) & ~empty
    return rows if bad_heads is False else rows | jax.lax.broadcast_to_rank(bad_heads, rows.ndim)


def finish(out, weights, empty, poisoned, v, bad_kv, vis, empty_rows):
    """The empty-row policy, NaN for `poisoned` rows (`poisoned_rows`), zeros past
    the description's `q_lengths`.

    With sinks no row is empty (the sink is always visible): a row with no real key
    attends to its sink alone, output 0, under either policy, so `empty_rows` never
    contradicts the row's log-sum-exp.

    Args:
      out: `(B…, H, N, Dv)`; weights: `(B…, H, N, S)` or None; empty, poisoned: bool
      `(B…, H, N)`; v: `(B…, K, S, Dv)` (finite); bad_kv: bool `(B…, K, S)`;
      vis: the description (its `q_lengths` int32 `(B…|1, 1, 1, 1)` or None).
    """
    *batch, h, n, _ = out.shape
    s = v.shape[-2]
    if empty_rows == "uniform" and s and vis.sinks is None:
        groups = h // v.shape[-3]
        mean_v = jnp.repeat(jnp.mean(v.astype(out.dtype), axis=-2, keepdims=True), groups, axis=-3)
        out = jnp.where(empty[..., None], mean_v, out)  # (B…, H, N, Dv)
        if weights is not None:
            weights = jnp.where(empty[..., None], jnp.asarray(1.0 / s, weights.dtype), weights)
        # A uniform row averages every key and value, the non-finite ones too.
        head_bad = jnp.repeat(jnp.any(bad_kv, axis=-1), groups, axis=-1)[..., None]  # (B…, H, 1)
        poisoned = poisoned | (empty & head_bad)
    # A poisoned row is a constant NaN: gradients flow only through the clean rows.
    poisoned = poisoned[..., None]
    out = jnp.where(poisoned, jnp.nan, out)
    if weights is not None:
        weights = jnp.where(poisoned, jnp.nan, weights)
    if vis.q_lengths is not None:
        row_ok = _before_length(n, vis.q_lengths)
        out = jnp.where(row_ok[..., None], out, 0.0)
        if weights is not None:
            weights = jnp.where(row_ok[..., None], weights, 0.0)
    return out, weights


def finish_lse(lse, poisoned, q_lengths, n: int):
    """The log-sum-exp, float32: NaN on poisoned rows, -inf past `q_lengths`."""
    lse = jnp.where(poisoned, jnp.nan, lse.astype(jnp.float32))
    if q_lengths is not None:
        lse = jnp.where(_before_length(n, q_lengths), lse, -jnp.inf)
    return lse


def _before_length(n: int, q_lengths):
    """bool `(B…|1, 1, N)`: query rows before `q_lengths` (int32 `(B…|1, 1, 1, 1)`)."""
    lengths = q_lengths[..., 0]  # (B…|1, 1, 1)
    return jax.lax.broadcast_to_rank(jnp.arange(n), lengths.ndim) < lengths


def empty_attention(q, k, v, return_weights: bool, dtype):
    """`(out, weights or None, lse)` for N == 0, S == 0 or an empty batch: zeros, lse -inf."""
    batch = jnp.broadcast_shapes(q.shape[:-3], k.shape[:-3])
    out = jnp.zeros(batch + q.shape[-3:-1] + v.shape[-1:], dtype)
    weights = jnp.zeros(batch + q.shape[-3:-1] + (k.shape[-2],), out.dtype) if return_weights else None
    return out, weights, jnp.full(out.shape[:-1], -jnp.inf, jnp.float32)
