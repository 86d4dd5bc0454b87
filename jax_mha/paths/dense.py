"""The plain attention every other path is tested against: one screen, no tuning.

scores -> mask -> float32 softmax -> zeros for empty rows -> weights · v. The math runs
in float32 whatever the input dtype (float64 stays float64), so gradients cannot
overflow in float16. It is also the path that returns the weights, with dropout on them (`dense_attention`).
Inputs are finite here: the dispatcher (`jax_mha.functional`) replaces non-finite
entries and marks the rows that see them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jax_mha import _masking, _softmax
from jax_mha._masking import compute_dtype
from jax_mha._path import Path
from jax_mha.paths import blockwise

# The "xla" path builds the whole float32 scores `(B…, H, N, S)` up to this many bytes
# and runs the blockwise engine beyond (measurements: docs/performance.md).
WHOLE_SCORES_MAX_BYTES = 16 * 2**20


def whole_scores_fit(q, k) -> bool:
    """Whether `"xla"` builds the whole scores for these `q (B…, H, N, D)` and
    `k (B…, K, S, D)` (arrays or shape structs): float32 or float64 inputs whose
    float32 scores take at most `WHOLE_SCORES_MAX_BYTES`. bfloat16 and float16 inputs
    go to the engine, which multiplies them in their own dtype with float32
    accumulation; the whole-scores route computes in float32 throughout."""
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64)):
        return False
    batch = jnp.broadcast_shapes(q.shape[:-3], k.shape[:-3])
    return math.prod(batch + q.shape[-3:-1] + k.shape[-2:-1]) * 4 <= WHOLE_SCORES_MAX_BYTES


def reference_weights(q, k, allowed=None, bias=None, *, scale: float, rows_see_keys: bool = False, score_fn=None,
                      score_masks: bool = True, return_lse: bool = False):
    """Softmax weights with the whole `(B…, H, N, S)` built.

    Args:
      q: `(B…, H, N, D)`; k: `(B…, K, S, D)`; query head h reads key head `h // (H // K)`.
      allowed: bool broadcastable to `(B…, H, N, S)` (True = may attend), or None.
      bias: float broadcastable to `(B…, H, N, S)`, added to the scaled logits.
      scale: multiplies q·k in the compute dtype, after the matmul (as jax.nn: more
        accurate in bfloat16 than scaling q first).
      rows_see_keys: the caller knows statically that `allowed` leaves every row a
        key (`Visibility.every_row_sees_a_key`); without a bias the empty-row
        bookkeeping is then skipped (its reductions are a visible part of a small training step).
      score_fn: `logits (B…, H, N, S) -> logits`, applied after the bias (the
        description's `score_logits` bound to its index arrays), or None.
      score_masks: `score_fn` may return `-inf`, which masks its key (a `score_mod`
        may; a soft cap alone never does).
      return_lse: also return each row's log-sum-exp.

    Returns:
      `(weights (B…, H, N, S), empty (B…, H, N))`, and `lse (B…, H, N)` when
      `return_lse`; weights in float32 (float64 for float64 inputs). `empty` marks
      rows with no key left (all masked, or every logit -inf); their weights are 0,
      their lse -inf.
    """
    dtype = compute_dtype(q.dtype)
    k = jnp.repeat(k, q.shape[-3] // k.shape[-3], axis=-3)  # (B…, H, S, D)
    logits = jnp.einsum("...hnd,...hsd->...hns", q.astype(dtype), k.astype(dtype))
    logits = logits * jnp.asarray(scale, dtype)
    if bias is not None:
        logits = logits + bias.astype(dtype)
    if score_fn is not None:
        logits = score_fn(logits)
    ok = allowed
    masks = bias is not None or (score_fn is not None and score_masks)
    if masks:  # a -inf bias masks a key, as PyTorch users write masks
        ok = logits != -jnp.inf if ok is None else ok & (logits != -jnp.inf)
    if return_lse:
        masked = logits if ok is None else jnp.where(ok, logits, -jnp.inf)
        weights, lse = softmax_with_lse(masked)
        empty = jnp.broadcast_to(False if ok is None else ~jnp.any(ok, axis=-1), logits.shape[:-1])
        return weights, empty, lse
    no_empty_rows = jnp.zeros(logits.shape[:-1], bool)
    if ok is None:
        return jax.nn.softmax(logits, axis=-1), no_empty_rows
    masked = jnp.where(ok, logits, -jnp.inf)  # select, so a NaN where masked stays out
    if rows_see_keys and not masks:  # a -inf bias could still empty a row
        return jax.nn.softmax(masked, axis=-1), no_empty_rows
    empty = ~jnp.any(ok, axis=-1, keepdims=True)
    weights = jnp.where(empty, 0.0, jax.nn.softmax(jnp.where(empty, 0.0, masked), axis=-1))
    empty = jnp.broadcast_to(empty[..., 0], logits.shape[:-1])
    return weights, empty


def softmax_with_lse(masked):
    """Softmax over the last axis of logits `masked (B…, H, N, S)` (-inf where masked).

    Returns:
      `(weights (B…, H, N, S), lse (B…, H, N))`: a row with nothing visible has zero
      weights and lse -inf.
    """
    m = jnp.max(masked, axis=-1, keepdims=True)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))  # any shift gives the same softmax
    e = jnp.exp(masked - m)
    total = jnp.sum(e, axis=-1, keepdims=True)
    seen = total > 0
    weights = e / jnp.where(seen, total, 1.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
    return weights, lse[..., 0]


def mix(weights, v):
    """`weights (B…, H, N, S) · v (B…, K, S, Dv) -> (B…, H, N, Dv)` in the weights'
    dtype, v repeated per query head (query head h reads value head `h // (H // K)`)."""
    v = jnp.repeat(v, weights.shape[-3] // v.shape[-3], axis=-3).astype(weights.dtype)  # (B…, H, S, Dv)
    return jnp.einsum("...hns,...hsd->...hnd", weights, v)



def dense_attention(q, k, v, bad_kv, vis: _masking.Visibility, *, scale: float, dropout_rate: float = 0.0,
                    dropout_rng=None, return_lse: bool = False):
    """The whole-scores path: the description evaluated whole, then `reference_weights`.

    Args:
      q: `(B…, H, N, D)`; k: `(B…, K, S, D)`; v: `(B…, K, S, Dv)`, finite.
      bad_kv: bool `(B…, K, S)`, keys whose key or value had a non-finite entry.
      vis: the description; scale: the logit scale.
      dropout_rate, dropout_rng: dropout on the weights (rate 0: none).
      return_lse: compute each row's log-sum-exp (else `lse` is None).

    Returns:
      `(out (B…, H, N, Dv), weights (B…, H, N, S), lse (B…, H, N), empty (B…, H, N),
      touched (B…, H, N))` in the compute dtype: `lse` each row's log-sum-exp (closed
      as the description says, `_softmax.close`), `empty` rows see no key, `touched` rows see a bad key.
    """
    allowed = _masking.dense_allowed(vis, q.ndim)
    bias = None if vis.bias is None else jax.lax.broadcast_to_rank(vis.bias, q.ndim)
    score_fn = None
    if vis.changes_scores:
        heads = _masking.dense_heads(vis, q.ndim)
        rows, cols = jnp.arange(vis.n)[:, None], jnp.arange(vis.s)[None, :]
        score_fn = lambda x: _masking.score_logits(vis, x, heads, rows, cols)
    closing = _softmax.closes_rows(vis)  # each row's denominator has a term beyond its keys
    weights, empty, *lse = reference_weights(q, k, allowed, bias, scale=scale,
                                             rows_see_keys=vis.every_row_sees_a_key, score_fn=score_fn,
                                             score_masks=vis.score_mod is not None, return_lse=return_lse or closing)
    lse = lse[0] if lse else None
    if dropout_rate > 0.0:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
        weights = jnp.where(keep, weights / jnp.asarray(1.0 - dropout_rate, weights.dtype), 0.0)
    groups = q.shape[-3] // k.shape[-3]
    out = mix(weights, v)  # (B…, H, N, Dv)
    if closing:
        out, weights, lse = _softmax.close(out, lse, vis, weights)
    sees_bad = jnp.repeat(bad_kv, groups, axis=-2)[..., None, :]  # (B…, H, 1, S)
    touched = jnp.any(sees_bad if allowed is None else allowed & sees_bad, axis=-1)
    return out, weights, lse, empty, jnp.broadcast_to(touched, empty.shape)


def run(q, k, v, bad_kv, vis: _masking.Visibility, call: _masking.Call, *, scale: float, dropout_rate: float,
        dropout_rng, blocks):
    """The `"xla"` path (`Path.run`): the whole scores when the call needs the weights
    or dropout or they fit `WHOLE_SCORES_MAX_BYTES`, else the blockwise engine with
    its default blocks (`blocks` are the blockwise path's alone)."""
    del blocks
    if not (call.return_weights or call.dropout or whole_scores_fit(q, k)):
        return blockwise.run(q, k, v, bad_kv, vis, call, scale=scale, blocks=(None, None))
    out, weights, lse, empty, touched = dense_attention(
        q, k, v, bad_kv, vis, scale=scale, dropout_rate=dropout_rate if call.dropout else 0.0,
        dropout_rng=dropout_rng, return_lse=call.return_residual)
    return out, weights if call.return_weights else None, lse, empty, touched


# The path of last resort: it takes every part of every call, on every platform.
PATH = Path("xla", run, statistics="whole")

