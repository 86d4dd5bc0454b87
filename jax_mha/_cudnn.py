"""The `"cudnn"` path: the visibility description translated to the arguments of
`jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN's fused kernel (GPU).

jax.nn aligns `is_causal` and `local_window_size` top-left; ours are bottom-right
(`jax_mha._masking`). They agree when N == S; otherwise the pattern goes in as an
explicit mask. Like jax.nn's cuDNN kernel this path has a custom VJP only: reverse
mode (`grad`, `vjp`), no `jvp`/`jacfwd`; use `"xla"` or `"blockwise"` for those.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_mha._masking import Visibility, Window, dense_allowed, lengths_at_rank, positional


def cudnn_problem(q, k, v, dropout: bool, return_weights: bool) -> str | None:
    """Why cuDNN's fused kernel cannot run these inputs, or None if it can."""
    if jax.default_backend() != "gpu":
        return f"the cudnn implementation needs a GPU backend, this one is {jax.default_backend()!r}"
    if q.dtype not in (jnp.float16, jnp.bfloat16):
        return f"the cudnn implementation needs float16 or bfloat16 inputs, got {q.dtype}"
    d = q.shape[-1]
    if d > 128 or d % 8:
        return f"the cudnn implementation needs head_dim <= 128 and a multiple of 8, got D={d}"
    if v.shape[-1] != d:
        return f"the cudnn implementation needs equal q/k and v head dims, got {d} and {v.shape[-1]}"
    if return_weights:
        return "the cudnn implementation never builds the weights: return_weights=True needs 'xla'"
    if dropout:
        return "the cudnn implementation here does not apply dropout: use 'xla'"
    return None


def cudnn_attention(q, k, v, *, bias, mask, q_lengths, kv_lengths, is_causal, window, scale, bad_kv):
    """Returns `(out (B…, H, N, D), empty (B…, H, N), touched (B…, H, N))`: `empty`
    marks rows with no visible key, `touched` rows that may see a `bad_kv` key (both
    evaluated from the description, fused by XLA, never stored)."""
    *batch, h, n, d = q.shape
    s = k.shape[-2]
    vis = Visibility(n, s, is_causal, window, mask)
    native = n == s
    if not native and vis.has_pattern:
        pattern = positional(vis, jnp.arange(n)[:, None], jnp.arange(s)[None, :])
        mask = pattern if mask is None else jnp.logical_and(mask, jax.lax.broadcast_to_rank(pattern, mask.ndim))
    flat = lambda x: jnp.swapaxes(jnp.broadcast_to(x, (*batch, *x.shape[-3:])).reshape(-1, *x.shape[-3:]), -3, -2)
    full = lambda x: None if x is None else jnp.broadcast_to(x, (*batch, h, n, s)).reshape(-1, h, n, s)
    lengths = lambda x: None if x is None else jnp.broadcast_to(x, tuple(batch)).reshape(-1).astype(jnp.int32)
    local = None
    if native and window is not None:
        local = (s if window.left is None else window.left, s if window.right is None else window.right)
    out = jax.nn.dot_product_attention(
        flat(q), flat(k), flat(v), bias=full(bias), mask=full(mask), scale=scale,
        is_causal=native and is_causal, query_seq_lengths=lengths(q_lengths),
        key_value_seq_lengths=lengths(kv_lengths), local_window_size=local, implementation="cudnn",
    )  # (B, N, H, D)
    out = jnp.swapaxes(out, -3, -2).reshape(*batch, h, n, d)
    full_vis = Visibility(n, s, is_causal, window, mask if not native else vis.mask,
                          lengths_at_rank(q_lengths, len(batch)), lengths_at_rank(kv_lengths, len(batch)))
    allowed = jnp.broadcast_to(
        True if (allowed := dense_allowed(full_vis, len(batch) + 3)) is None else allowed, (*batch, h, n, s))
    sees_bad = jnp.repeat(bad_kv, h // k.shape[-3], axis=-2)[..., None, :]  # (B…, H, 1, S)
    return out, ~jnp.any(allowed, axis=-1), jnp.any(allowed & sees_bad, axis=-1)


__all__ = ["Window", "cudnn_attention", "cudnn_problem"]
