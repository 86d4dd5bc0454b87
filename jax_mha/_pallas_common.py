"""Shared translation helpers for the Pallas kernel paths (`_pallas_tpu`, `_pallas_gpu`).

Both kernels take one integer segment id per query and per key and let a query see a key
only when the ids match. Lengths, padding to the kernel's block size and the library's
segment ids all fold into that one pair of arrays, so nothing is refused for shape.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def refuse(path: str, *, mask, bias, return_weights, dropout_rate, deterministic) -> None:
    """Raises ValueError naming the first part of the description `path` cannot express
    (a kernel that silently dropped it would return wrong numbers)."""
    if bias is not None:
        raise ValueError(f"{path} cannot express an additive bias (got shape {np.shape(bias)}); use implementation='xla'")
    if mask is not None:
        raise ValueError(f"{path} cannot express a dense mask (got shape {np.shape(mask)}); "
                         "use segment ids / lengths, or implementation='xla'")
    if return_weights:
        raise ValueError(f"{path} cannot return attention weights (return_weights=True); use implementation='xla'")
    if dropout_rate and not deterministic:
        raise ValueError(f"{path} cannot apply dropout (dropout_rate={dropout_rate}, deterministic=False); "
                         "use implementation='xla'")


def default_interpret(interpret, platform: str) -> bool:
    """`interpret=None`: compile only on the kernel's own platform, interpret elsewhere."""
    if interpret is None:
        return jax.default_backend() != platform
    if not isinstance(interpret, bool):
        raise TypeError(f"interpret must be None or a bool, got {interpret!r}")
    return interpret


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def kernel_segment_ids(batch, n, s, n_pad, s_pad, q_segment_ids, kv_segment_ids, q_lengths, kv_lengths):
    """Per-(flat batch) int32 ids `(B, n_pad)`, `(B, s_pad)` that encode segments, lengths
    and padding together, plus a bool `(B, n_pad)` "may this query see any id-matching
    key at all" used to zero empty rows.

    Padding and out-of-length positions get sentinels below every real id (queries one
    value, keys another) so they never match anything: a padded or cut query then sees
    no key (its row is zeroed) and a padded or cut key is seen by nobody.
    """
    b = int(np.prod(batch, dtype=np.int64))
    if kv_segment_ids is None and n == s:
        kv_segment_ids = q_segment_ids  # self-attention: the library's default
    qs = jnp.zeros((*batch, n), jnp.int32) if q_segment_ids is None else jnp.asarray(q_segment_ids)
    ks = jnp.zeros((*batch, s), jnp.int32) if kv_segment_ids is None else jnp.asarray(kv_segment_ids)
    for name, ids, want in (("q_segment_ids", qs, (*batch, n)), ("kv_segment_ids", ks, (*batch, s))):
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array, got dtype {ids.dtype}")
        if ids.shape != tuple(want) and np.broadcast_shapes(ids.shape, want) != tuple(want):
            raise ValueError(f"{name} must broadcast to {tuple(want)}, got shape {ids.shape}")
    qs = jnp.broadcast_to(qs, (*batch, n)).reshape(b, n).astype(jnp.int32)
    ks = jnp.broadcast_to(ks, (*batch, s)).reshape(b, s).astype(jnp.int32)
    lo = jnp.minimum(jnp.min(qs, axis=1, initial=0), jnp.min(ks, axis=1, initial=0))[:, None]
    q_sent, kv_sent = lo - 1, lo - 2
    if q_lengths is not None:
        ql = jnp.broadcast_to(jnp.asarray(q_lengths), batch).reshape(b, 1)
        qs = jnp.where(jnp.arange(n)[None] < ql, qs, q_sent)
    if kv_lengths is not None:
        kl = jnp.broadcast_to(jnp.asarray(kv_lengths), batch).reshape(b, 1)
        ks = jnp.where(jnp.arange(s)[None] < kl, ks, kv_sent)
    qs = jnp.concatenate([qs, jnp.broadcast_to(q_sent, (b, n_pad - n))], axis=1)
    ks = jnp.concatenate([ks, jnp.broadcast_to(kv_sent, (b, s_pad - s))], axis=1)
    return qs, ks


def row_has_key(qs, ks, n, s, is_causal, window):
    """bool `(B, n_pad)`: True where query i may see at least one key under segment ids,
    causality and the window (bottom-right offset S - N). O(N·S) booleans without
    gradient: the kernels give a finite average of V for an empty row, never zeros."""
    n_pad, s_pad = qs.shape[1], ks.shape[1]
    pos = jnp.arange(n_pad)[:, None] + (s - n)
    key = jnp.arange(s_pad)[None, :]
    ok = jnp.ones((n_pad, s_pad), bool)
    if is_causal:
        ok &= key <= pos
    if window is not None:
        if window.left is not None:
            ok &= key >= pos - window.left
        if window.right is not None:
            ok &= key <= pos + window.right
    same = qs[:, :, None] == ks[:, None, :]
    return jnp.any(same & ok[None], axis=-1)
