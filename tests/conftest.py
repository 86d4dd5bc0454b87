"""Shared test configuration and an independent float64 NumPy reference.

`jax_numpy_rank_promotion="raise"` turns every implicit rank broadcast (e.g. adding a
`(N, S)` bias to `(B, H, N, S)` logits) into an error, so the library has to broadcast
explicitly and a silently swapped or missing axis cannot slip through.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")


def np_attention(q, k, v, mask=None, bias=None, scale=None):
    """Float64 reference attention that loops over batch entries, heads and query rows.

    Written independently of `jax_mha`: no einsum, no reshape of heads into groups.
    Query head `h` reads key/value head `h // (H // K)`. Fully masked rows give zero
    weights and a zero output.

    Args:
      q: `(B…, H, N, D)`; k: `(B…, K, S, D)`; v: `(B…, K, S, Dv)`.
      mask: bool broadcastable to `(B…, H, N, S)`, True = may attend.
      bias: float broadcastable to `(B…, H, N, S)`.
      scale: logit scale, default `1/sqrt(D)`.

    Returns:
      `(out (B…, H, N, Dv), weights (B…, H, N, S))`, float64.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    *batch, h, n, d = q.shape
    kv_heads, s = k.shape[-3], k.shape[-2]
    group = h // kv_heads
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    full = (*batch, h, n, s)
    mask = np.broadcast_to(np.ones((), bool) if mask is None else np.asarray(mask), full)
    bias = np.broadcast_to(np.zeros(()) if bias is None else np.asarray(bias, np.float64), full)
    out = np.zeros((*batch, h, n, v.shape[-1]))
    weights = np.zeros(full)
    for b in np.ndindex(*batch):
        for head in range(h):
            kv = head // group
            for i in range(n):
                allowed = mask[b + (head, i)]
                if not allowed.any():
                    continue  # fully masked row: zeros
                logits = np.array([q[b + (head, i)] @ k[b + (kv, j)] for j in range(s)])
                logits = logits * scale + bias[b + (head, i)]
                logits = np.where(allowed, logits, -np.inf)
                e = np.exp(logits - logits.max())
                weights[b + (head, i)] = e / e.sum()
                out[b + (head, i)] = weights[b + (head, i)] @ v[b + (kv,)]
    return out, weights


@pytest.fixture(name="np_attention")
def np_attention_fixture():
    """The float64 NumPy reference `np_attention`."""
    return np_attention


@pytest.fixture
def rng():
    """A fresh NumPy generator per test (fixed seed: failures reproduce)."""
    return np.random.default_rng(0)
