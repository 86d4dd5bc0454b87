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

from jax_mha._masking import Call, Visibility, dense_allowed


def refusal(vis: Visibility, call: Call) -> str | None:
    """Why jax.nn's cuDNN kernel cannot run this call (one line naming the part and
    what to use instead), or None. The one place that decides it: `"auto"` reads it
    to move on, an explicit `implementation="cudnn"` raises it."""
    use = "use implementation='xla' or 'blockwise'"
    if call.platform != "gpu":
        return f"implementation='cudnn' needs a GPU, this call runs on {call.platform!r}; {use}"
    if jnp.dtype(call.q.dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        return f"implementation='cudnn' needs float16 or bfloat16 inputs, got {call.q.dtype}; {use}"
    d = call.q.shape[-1]
    if d > 128 or d % 8:
        return f"implementation='cudnn' needs head_dim <= 128 and a multiple of 8, got D={d}; {use}"
    if call.v.shape[-1] != d:
        return f"implementation='cudnn' needs equal q/k and v head dims, got {d} and {call.v.shape[-1]}; {use}"
    if call.return_weights:
        return "implementation='cudnn' never builds the weights: return_weights=True needs implementation='xla'"
    if call.dropout:
        return "implementation='cudnn' does not apply dropout here: use implementation='xla'"
    if vis.score_mod is not None:
        return f"implementation='cudnn' cannot express score_mod; {use}"
    if vis.logits_soft_cap is not None:
        return f"implementation='cudnn' cannot express logits_soft_cap (cuDNN has no soft-cap); {use}"
    if vis.sinks is not None:
        return f"implementation='cudnn' cannot express sinks (attention sinks); {use}"
    if call.return_residual:
        return f"implementation='cudnn' does not return the log-sum-exp here (return_residual=True); {use}"
    if vis.q_offset is not None or vis.q_start is not None:
        return f"implementation='cudnn' cannot take a query offset (decoding from a cache index); {use}"
    return None


def cudnn_attention(q, k, v, vis: Visibility, *, scale):
    """`out (B…, H, N, D)` of finite `q (B…, H, N, D)`, `k, v (B…, K, S, D)`; rows
    with no visible key are left to the dispatcher (`_masking.dense_rows`).

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
    return jnp.swapaxes(out, -3, -2).reshape(*batch, h, n, d)


__all__ = ["cudnn_attention", "refusal"]
