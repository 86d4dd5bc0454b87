"""The `"cudnn"` path: the visibility description translated to the arguments of
`jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN's fused kernel (GPU).

jax.nn aligns `is_causal` and `local_window_size` top-left; ours are bottom-right
(`jax_mha._masking`). They agree when N == S; otherwise the pattern goes in as an
explicit mask. Like jax.nn's cuDNN kernel this path has a custom VJP only: reverse
mode (`grad`, `vjp`), no `jvp`/`jacfwd`; use `"xla"` or `"blockwise"` for those.
A `mask_mod` goes in evaluated into that dense mask (as segment ids do); `score_mod`
and `logits_soft_cap` cuDNN cannot express: `attention` refuses them by name.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_mha._masking import Visibility, dense_allowed


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


def cudnn_attention(q, k, v, vis: Visibility, *, scale, bad_kv):
    """Returns `(out (B…, H, N, D), empty (B…, H, N), touched (B…, H, N))`: `empty`
    marks rows with no visible key, `touched` rows that may see a `bad_kv` key (both
    evaluated from the description, fused by XLA, never stored).

    jax.nn's cuDNN call has no segment ids: they go in as part of the dense mask
    (`dense_allowed`), as does the pattern when N != S (its alignment differs)."""
    *batch, h, n, d = q.shape
    s = k.shape[-2]
    native = n == s and not vis.segmented
    full = lambda x: None if x is None else jnp.broadcast_to(x, (*batch, h, n, s)).reshape(-1, h, n, s)
    lengths = lambda x: None if x is None else jnp.broadcast_to(x, (*batch, 1, 1, 1)).reshape(-1)
    # What jax.nn does not take natively goes in as one mask, built by `_masking`.
    as_mask = dataclasses.replace(vis, q_lengths=None, kv_lengths=None, bias=None)
    if native:
        as_mask = dataclasses.replace(as_mask, is_causal=False, window=None)
    mask = dense_allowed(as_mask, len(batch) + 3)
    flat = lambda x: jnp.swapaxes(jnp.broadcast_to(x, (*batch, *x.shape[-3:])).reshape(-1, *x.shape[-3:]), -3, -2)
    local = None
    if native and vis.window is not None:
        local = (s if vis.window.left is None else vis.window.left, s if vis.window.right is None else vis.window.right)
    out = jax.nn.dot_product_attention(
        flat(q), flat(k), flat(v), bias=full(vis.bias), mask=full(mask), scale=scale,
        is_causal=native and vis.is_causal, query_seq_lengths=lengths(vis.q_lengths),
        key_value_seq_lengths=lengths(vis.kv_lengths), local_window_size=local, implementation="cudnn",
    )  # (B, N, H, D)
    out = jnp.swapaxes(out, -3, -2).reshape(*batch, h, n, d)
    allowed = dense_allowed(vis, len(batch) + 3)
    allowed = jnp.broadcast_to(True if allowed is None else allowed, (*batch, h, n, s))
    sees_bad = jnp.repeat(bad_kv, h // k.shape[-3], axis=-2)[..., None, :]  # (B…, H, 1, S)
    return out, ~jnp.any(allowed, axis=-1), jnp.any(allowed & sees_bad, axis=-1)


__all__ = ["cudnn_attention", "cudnn_problem"]
