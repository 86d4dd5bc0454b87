"""The `"cudnn"` path: the visibility description translated to the arguments of
`jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN's fused kernel (GPU).

What jax.nn's cuDNN call takes natively (`jax/_src/nn/functions.py`,
`jax/_src/cudnn/fused_attention_stablehlo.py`): float16/bfloat16, head_dim a multiple
of 8 up to 128 (256 from Hopper on), GQA, per-sequence lengths, the causal mask and a
left-only sliding window, both aligned top-left; anything else only as one dense
`(B, H, N, S)` bias (a boolean mask becomes a large negative bias, and the backward
pass then also returns that bias' gradient). `plan` decides which parts go in
natively and which through that dense mask:

* causal and a left window go in natively when N == S (top-left equals our
  bottom-right alignment then) and the window needs no right side (causal, or a
  window `(left, 0)`) and no lengths come with it (jax's own tests cover cuDNN's
  sliding window without a padding mask only); otherwise the pattern is evaluated
  into the dense mask;
* segment ids, a boolean mask and a mask function always go through the dense mask: jax.nn
  exposes no segment ids or sequence offsets (its cuDNN call's `q_offsets` are
  private and Hopper-only);
* the dense mask (and a bias) is built only up to `DENSE_MAX_ELEMENTS`; `refusal`
  names the parts beyond, so `"auto"` moves on;
* odd N and S are padded to even by one row (dropped after) and one key no real row
  sees: jax's check for cuDNN's backward ("Unsupported sequence length") reads the
  zero-size placeholder jax passes for a missing bias as a bias, so every training call
  with an odd length raises, with a bias or without (jax 0.10.2 and 0.11.2; seen on an
  H200, where the causal N = S = 251 gradient raised it).

Like jax.nn's cuDNN kernel this path has a custom VJP only: reverse mode (`grad`,
`vjp`), no `jvp`/`jacfwd`; use `"xla"` or `"blockwise"` for those. What jax.nn's
call has no argument for, the path does not take (`PATH.takes`): its refusal names it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_mha._masking import MASK_PARTS, PARTS, Call, Visibility, Window, dense_allowed, parts
from jax_mha._path import Path, fallback
from jax_mha.paths.kernel_common import kernel_run, this_gpu

# The most elements of the dense (B, H, N, S) mask or bias this path builds: with the
# bias cuDNN is given and the gradient it returns, a few bytes each.
DENSE_MAX_ELEMENTS = 2**24


class Plan(NamedTuple):
    """How one description reaches jax.nn's cuDNN call.

    Attributes:
      is_causal: jax.nn's `is_causal` (top-left).
      local_window_size: jax.nn's `(left, 0)` window, or None.
      pattern_native: causal/window go in as the two arguments above; False: they are
        part of the dense mask.
      dense: the parts evaluated into the dense mask, each named for a refusal.
    """

    is_causal: bool
    local_window_size: tuple[int, int] | None
    pattern_native: bool
    dense: tuple[str, ...]


def plan(vis: Visibility) -> Plan:
    """Which parts of `vis` go to jax.nn's cuDNN call natively, which as a dense mask."""
    # What only the dense mask carries: the mask parts but the pattern jax.nn may take natively.
    dense = ["a boolean mask" if name == "mask" else PARTS[name].describe(vis) for name in parts(vis, Call(None, None, None))
             if name in MASK_PARTS - {"window", "kv_lengths", "q_lengths", "segment_ids"}]
    if vis.segmented:
        dense.append("segment ids (jax.nn takes no segment ids or offsets)")
    window = vis.window if vis.window != Window(None, None) else None
    if not vis.is_causal and window is None:
        return Plan(False, None, True, tuple(dense))
    named = (["is_causal"] if vis.is_causal else []) + ([] if window is None else [f"local_window_size={tuple(window)}"])
    pattern = " and ".join(named)
    left = None if window is None else window.left
    lengths = vis.q_lengths is not None or vis.kv_lengths is not None
    why = None
    if vis.n != vis.s:
        why = f"{pattern} with N != S (jax.nn aligns it top-left, this library bottom-right)"
    elif not vis.is_causal and window.right != 0:
        why = f"{pattern} (cuDNN's sliding window is left-only: jax.nn raises \"cuDNN doesn't support right window\")"
    elif left is not None and lengths:
        why = f"{pattern} with q_lengths/kv_lengths (a sliding window with cuDNN's padding mask is untested in jax)"
    if why is not None:
        return Plan(False, None, False, (*dense, why))
    # Causal, or a window (left, 0): both are the causal mask cut on the left.
    return Plan(True, None if left is None else (left, 0), True, tuple(dense))


def _device_refusal(call: Call) -> str | None:
    """The GPU's own limits: CUDA only, Ampere or later, head_dim and dtype."""
    name = "implementation='cudnn'"
    if call.platform != "gpu":
        return f"{name} needs a GPU, this call runs on {call.platform!r}; {fallback()}"
    gpu = this_gpu()
    if gpu is not None and gpu[0] != "cuda":
        return f"{name} needs an NVIDIA GPU (jax registers its cuDNN attention for CUDA only), this one is ROCm; {fallback()}"
    if gpu is not None and gpu[1] and gpu[1] < (8, 0):
        return f"{name} needs compute capability >= 8.0 (cuDNN flash attention), got {gpu[1]}; {fallback()}"
    if jnp.dtype(call.q.dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        return f"{name} needs float16 or bfloat16 inputs, got {call.q.dtype}; {fallback()}"
    d = call.q.shape[-1]
    most = 256 if gpu is not None and gpu[1] >= (9, 0) else 128
    if d > most or d % 8:
        return f"{name} needs head_dim <= {most} and a multiple of 8 (256 from Hopper on), got D={d}; {fallback()}"
    if call.v.shape[-1] != d:
        return f"{name} needs equal q/k and v head dims, got {d} and {call.v.shape[-1]}; {fallback()}"
    return None


def limits(vis: Visibility, call: Call) -> str | None:
    """What jax.nn's cuDNN kernel cannot take beyond its parts (`PATH.takes`): the
    GPU's own limits, and a dense mask or bias past `DENSE_MAX_ELEMENTS`."""
    why = _device_refusal(call)
    if why is not None:
        return why
    parts = plan(vis).dense + (("a bias",) if vis.bias is not None else ())
    if parts:
        batch = jnp.broadcast_shapes(call.q.shape[:-3], call.k.shape[:-3])
        shape = (*batch, call.q.shape[-3], vis.n, vis.s)
        if math.prod(shape) > DENSE_MAX_ELEMENTS:
            return (f"implementation='cudnn' takes {', '.join(parts)} only as a dense (B…, H, N, S) = {shape} mask, "
                    f"{math.prod(shape):,} elements > 2**24; {fallback()}")
    return None


def lowers(lowering: str) -> bool:
    """jax.nn's cuDNN call reads the cuDNN version and the GPU while it is traced: it
    lowers for CUDA only from a process whose default device is a CUDA GPU."""
    return lowering == "cuda" and (this_gpu() or ("",))[0] == "cuda"


def _pad_even(q, k, v, mask, bias, kv_lengths, future_hidden: bool):
    """`(q, k, v, mask, bias, kv_lengths)` with odd N padded by a query row (dropped
    after) and odd S by a key no real row sees: the dense mask hides it where there is
    one; else causality (`future_hidden`: causal or a `(left, 0)` window, N == S, so the
    added key is every real row's future); else the kv lengths, which stop before it.
    q `(B, N, H, D)`, k/v `(B, S, K, D)`, mask bool and bias `(B, H, N, S)` or None,
    kv_lengths `(B,)` int32 or None."""
    n, s = q.shape[1], k.shape[1]
    dn, ds = n % 2, s % 2
    if not (dn or ds):
        return q, k, v, mask, bias, kv_lengths
    if ds and mask is None and bias is not None:
        mask = jnp.ones((1, 1, n, s), bool)
    if ds and mask is None and not future_hidden and kv_lengths is None:
        kv_lengths = jnp.full((q.shape[0],), s, jnp.int32)
    rows = lambda x: jnp.pad(x, ((0, 0), (0, dn), (0, 0), (0, 0)))
    keys = lambda x: jnp.pad(x, ((0, 0), (0, ds), (0, 0), (0, 0)))
    pairs = lambda x, fill: None if x is None else jnp.pad(x, ((0, 0), (0, 0), (0, dn), (0, ds)), constant_values=fill)
    return rows(q), keys(k), keys(v), pairs(mask, False), pairs(bias, 0), kv_lengths


def cudnn_attention(q, k, v, vis: Visibility, *, scale, interpret: bool = False):
    """`out (B…, H, N, D)` of finite `q (B…, H, N, D)`, `k, v (B…, K, S, D)`, as
    `plan` translates `vis`; rows with no visible key are left to the dispatcher
    (`_masking.dense_rows`). cuDNN has no interpret mode (`interpret` is unused)."""
    del interpret
    *batch, h, n, d = q.shape
    s = k.shape[-2]
    how = plan(vis)
    full = lambda x: None if x is None else jnp.broadcast_to(x, (*batch, h, n, s)).reshape(-1, h, n, s)
    lengths = lambda x: None if x is None else jnp.broadcast_to(x, (*batch, 1, 1, 1)).reshape(-1)
    # What jax.nn does not take natively goes in as one mask, built by `_masking`.
    as_mask = dataclasses.replace(vis, q_lengths=None, kv_lengths=None, bias=None)
    if how.pattern_native:
        as_mask = dataclasses.replace(as_mask, is_causal=False, window=None)
    mask = full(dense_allowed(as_mask, len(batch) + 3))
    bias = None if vis.bias is None else full(vis.bias.astype(q.dtype))
    flat = lambda x: jnp.swapaxes(jnp.broadcast_to(x, (*batch, *x.shape[-3:])).reshape(-1, *x.shape[-3:]), -3, -2)
    fq, fk, fv = flat(q), flat(k), flat(v)  # (B, N, H, D), (B, S, K, D)
    future_hidden = how.pattern_native and (how.is_causal or how.local_window_size is not None)
    fq, fk, fv, mask, bias, kv_lengths = _pad_even(fq, fk, fv, mask, bias, lengths(vis.kv_lengths), future_hidden)
    out = jax.nn.dot_product_attention(
        fq, fk, fv, bias=bias, mask=mask, scale=scale, is_causal=how.is_causal,
        query_seq_lengths=lengths(vis.q_lengths), key_value_seq_lengths=kv_lengths,
        local_window_size=how.local_window_size, implementation="cudnn",
    )  # (B, N', H, D)
    return jnp.swapaxes(out[:, :n], -3, -2).reshape(*batch, h, n, d)


# cuDNN takes who may attend (natively, or as one dense mask) at the default offset;
# nothing that changes the logits but a bias.
PATH = Path("cudnn", kernel_run(cudnn_attention), platforms=("gpu",), limits=limits, lowers=lowers,
            takes=MASK_PARTS | {"bias"})
refusal = PATH.refusal

__all__ = ["DENSE_MAX_ELEMENTS", "PATH", "Plan", "cudnn_attention", "plan", "refusal", "this_gpu"]
