"""`implementation="pallas_tpu"` as the dispatcher reaches it: a decoding step (one query
row against a cache) on the Pallas TPU paged-attention kernel
(`jax.experimental.pallas.ops.tpu.paged_attention`): the `decode` of the
`"pallas_tpu"` path (`jax_mha._path.Path`), which sends every other call to splash
attention (`jax_mha.paths.pallas_tpu`).

A decoding step (`jax_mha._attend`) describes its one new token with the cache index
as query offset (`q_offset`, traced under jit) over the whole cache of length L. The
paged kernel sees the keys `[0, length)` of each sequence, `length` an int32 array read
at run time, so it needs no static offset: `length` is the end of the visible interval
from `_masking.key_range` (causality, a window's right side) cut at `kv_lengths`. It
has no start, so a window whose left edge may cut keys is refused. The translation:

* the library's cache is contiguous, the kernel's is pages: k `(b, K, S, D)` is read as
  `b · K` sequences of one kv head each, `(1, b · K · pages, page_size, D)`, a reshape
  (no copy), with the trivial page table `arange` per sequence; the query heads
  `(b, H, D)` become `(b · K, H // K, D)` likewise (GQA: query head h reads kv head
  `h // (H // K)`, the library's grouping);
* pages of `page_size` keys, the largest power of two up to `MAX_PAGE` dividing the
  cache, at least `MIN_PAGE` (TPU sublane tiles): a cache whose length is not a
  multiple of `MIN_PAGE` is padded with zero keys (a copy) that `length` excludes;
* the scale folded into q (the kernel does not scale); `logits_soft_cap` is the
  kernel's `attn_logits_soft_cap`, applied to the scaled logits as the description's.

Refused (the call then goes to `pallas_tpu`): N != 1, a window whose left edge may
cut keys, Dv != D (the kernel takes one head dim), a mesh (the kernel runs outside a
`shard_map`), float16 and float64, and every part `DECODE.takes` leaves out (segment
ids among them: it sees the keys [0, length) of a sequence). Precision: the kernel rounds k
and v to bfloat16 in VMEM whatever their dtype, so float32 inputs get bfloat16-rounded
keys and values; `"auto"` therefore leaves float32 steps to the float32 paths
(`precision_refusal`), and only `implementation="pallas_tpu"` named explicitly runs
them here. Gradients: the kernel has no backward; reverse mode runs the blockwise
engine's (`kernel_common.engine_backward`). Off a TPU the kernel runs in TPU interpret
mode (`pltpu.force_tpu_interpret_mode`: the kernel takes no `interpret` argument).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

from jax_mha import _masking
from jax_mha._path import Path
from jax_mha.paths.kernel_common import (
    decode_limits,
    engine_backward,
    flat_batch,
    is_traced,
    kernel_mesh,
    kernel_run,
    round_up,
    visible_interval,
)

NAME = "implementation='pallas_tpu'"
MIN_PAGE = 16  # bfloat16's sublane tile: a page reshapes into the kernel's key block as is
MAX_PAGE = 128
MAX_BLOCK_KEYS = 512  # keys per step of the kernel (pages_per_compute_block · page_size)


def pages(s: int) -> tuple[int, int, int]:
    """`(page_size, pages, pages_per_block)` for a cache of `s` keys: `pages` of
    `page_size` keys cover `s` rounded up to `MIN_PAGE`, taken `pages_per_block` (a
    divisor of `pages`) at a time, at most `MAX_BLOCK_KEYS` keys."""
    s_pad = round_up(max(s, 1), MIN_PAGE)
    size = MAX_PAGE
    while s_pad % size:
        size //= 2
    count = s_pad // size
    per_block = max(p for p in range(1, count + 1) if count % p == 0 and p * size <= max(MAX_BLOCK_KEYS, size))
    return size, count, per_block


def limits(vis: _masking.Visibility, call: _masking.Call) -> str | None:
    """What the paged kernel cannot take beyond its parts (`DECODE.takes`), or None."""
    why = decode_limits(NAME, vis, call)
    if why is not None:
        return why
    if jnp.dtype(call.q.dtype) == jnp.float16:
        return f"{NAME}'s decode kernel takes bfloat16 or float32 inputs (TPUs have no float16 units), got float16"
    left = vis.window is not None and vis.window.left is not None
    if left and (is_traced(lo := _masking.key_range(vis, 0, 0, vis.s)[0]) or lo != 0):
        return (f"{NAME}'s decode kernel cannot express a window whose left edge cuts keys (window="
                f"{tuple(vis.window)}): it sees the keys [0, length) of a sequence")
    if call.q.shape[-1] != call.v.shape[-1]:
        return f"{NAME}'s decode kernel takes one head dim for q, k and v, got D={call.q.shape[-1]}, Dv={call.v.shape[-1]}"
    if kernel_mesh(call.q) is not None:
        return f"{NAME}'s decode kernel does not run under a mesh (it is not split by shard_map)"
    return None


def precision_refusal(vis: _masking.Visibility, call: _masking.Call) -> str | None:
    """`"auto"` does not take the kernel for float32 inputs: it rounds k and v to
    bfloat16 (8 significant bits against float32's 24: a relative rounding of up to
    2^-8 per entry); naming the path explicitly accepts that."""
    del vis
    if jnp.dtype(call.q.dtype) == jnp.float32:
        return (f"{NAME}'s decode kernel rounds float32 keys and values to bfloat16; \"auto\" keeps float32 "
                "(name implementation='pallas_tpu' to accept the rounding)")
    return None


def paged(x, page_size: int, count: int):
    """The cache `x (b, K, S, D)` as the kernel's pages `(1, b · K · count, page_size, D)`
    (zero keys appended up to `count · page_size`; a reshape when there are none)."""
    b, kh, s, d = x.shape
    if count * page_size > s:
        x = jnp.pad(x, ((0, 0), (0, 0), (0, count * page_size - s), (0, 0)))
    return x.reshape(1, b * kh * count, page_size, d)


def _decode(q, k, v, vis, *, scale: float, interpret: bool):
    """The paged kernel on q `(B…, H, 1, D)`, k `(B…, K, S, D)`, v `(B…, K, S, D)`:
    out `(B…, H, 1, D)` in q's dtype."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    batch, qf, kf, vf = flat_batch(q, k, v)  # (b, H, 1, D), (b, K, S, D), (b, K, S, D)
    b, h, _, d = qf.shape
    kh, s = kf.shape[1], kf.shape[2]
    size, count, per_block = pages(s)
    _, stop = visible_interval(vis, batch)  # (b,): the start is 0 (decode_refusal)
    lengths = jnp.repeat(stop, kh)  # (b · K,): one sequence per (sequence, kv head)
    table = jnp.arange(b * kh * count, dtype=jnp.int32).reshape(b * kh, count)
    # One rounding to q's dtype (the scale itself is not rounded to bfloat16 first).
    qs = (qf.astype(jnp.float32) * scale).astype(q.dtype).reshape(b * kh, h // kh, d)
    mode = pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext()
    with jax.enable_x64(False), mode:  # the kernel mixes int32 program ids with Python ints
        out = paged_attention(qs, paged(kf, size, count), paged(vf, size, count), lengths, table,
                              attn_logits_soft_cap=vis.logits_soft_cap, pages_per_compute_block=per_block)
    return out.reshape(batch + (h, 1, d)).astype(q.dtype)


def run(q, k, v, vis: _masking.Visibility, *, scale: float, interpret: bool):
    """The paged kernel's forward, with the blockwise engine's gradient."""
    kernel = functools.partial(_decode, scale=float(scale), interpret=bool(interpret))
    return engine_backward(kernel, scale)(q, k, v, vis)


# `"pallas_tpu"`'s decoding steps (`Path.decode`): the kernel reads the visible length
# at run time, so a traced offset is fine; it sees the keys [0, length) of a sequence,
# so no segment ids (and no left window edge: `limits`).
DECODE = Path("pallas_tpu", kernel_run(run), platforms=("tpu",), interprets=True, limits=limits,
              auto_limits=precision_refusal,
              takes=frozenset({"logits_soft_cap", "window", "kv_lengths", "q_lengths", "query_offset",
                               "traced_offset"}))
decode_refusal = DECODE.refusal
