"""The plain attention every other path is tested against: one screen, no tuning.

scores -> mask -> float32 softmax -> zeros for empty rows -> weights · v. The math runs
in float32 whatever the input dtype (float64 stays float64), so gradients cannot
overflow in float16. It is also the path that returns the weights (dropout on them is
applied by the caller, `jax_mha.functional._weights_path`).
Inputs are finite here: the dispatcher (`jax_mha.functional`) replaces non-finite
entries and marks the rows that see them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_mha._masking import compute_dtype, soft_cap


def reference_weights(q, k, allowed=None, bias=None, *, scale: float, rows_see_keys: bool = False, score_fn=None,
                      logits_soft_cap=None):
    """Softmax weights with the whole `(B…, H, N, S)` built.

    Args:
      q: `(B…, H, N, D)`; k: `(B…, K, S, D)`; query head h reads key head `h // (H // K)`.
      allowed: bool broadcastable to `(B…, H, N, S)` (True = may attend), or None.
      bias: float broadcastable to `(B…, H, N, S)`, added to the scaled logits.
      scale: multiplies q·k in the compute dtype, after the matmul (as jax.nn: more
        accurate in bfloat16 than scaling q first).
      rows_see_keys: the caller knows statically that `allowed` leaves every row a
        key (`Visibility.every_row_sees_a_key`); without a bias the empty-row
        bookkeeping is then skipped (it cost the copy-task training step ~5 ms of 190).
      score_fn: `logits (B…, H, N, S) -> logits`, applied after the bias (the
        description's `score_mod` bound to its index arrays), or None.
      logits_soft_cap: c: `c · tanh(logits / c)` after `score_fn`, or None.

    Returns:
      `(weights (B…, H, N, S), empty (B…, H, N))`; weights in float32 (float64 for
      float64 inputs). `empty` marks rows with no key left (all masked, or every
      logit -inf); their weights are 0.
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
    if bias is not None or score_fn is not None:  # a -inf bias masks a key, as PyTorch users write masks
        ok = logits != -jnp.inf if ok is None else ok & (logits != -jnp.inf)
    logits = soft_cap(logits, logits_soft_cap)
    no_empty_rows = jnp.zeros(logits.shape[:-1], bool)
    if ok is None:
        return jax.nn.softmax(logits, axis=-1), no_empty_rows
    masked = jnp.where(ok, logits, -jnp.inf)  # select, so a NaN where masked stays out
    if rows_see_keys and bias is None and score_fn is None:  # a -inf bias could still empty a row
        return jax.nn.softmax(masked, axis=-1), no_empty_rows
    empty = ~jnp.any(ok, axis=-1, keepdims=True)
    weights = jnp.where(empty, 0.0, jax.nn.softmax(jnp.where(empty, 0.0, masked), axis=-1))
    empty = jnp.broadcast_to(empty[..., 0], logits.shape[:-1])
    return weights, empty


def mix(weights, v):
    """`weights (B…, H, N, S) · v (B…, K, S, Dv) -> (B…, H, N, Dv)` in the weights'
    dtype, v repeated per query head (query head h reads value head `h // (H // K)`)."""
    v = jnp.repeat(v, weights.shape[-3] // v.shape[-3], axis=-3).astype(weights.dtype)  # (B…, H, S, Dv)
    return jnp.einsum("...hns,...hsd->...hnd", weights, v)

