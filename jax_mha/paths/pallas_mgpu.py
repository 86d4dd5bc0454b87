"""`implementation="pallas_mgpu"`: the one attention description translated to the
Hopper FlashAttention-3 kernel written in Pallas' Mosaic GPU dialect
(`jax.experimental.pallas.ops.gpu.attention_mgpu.attention`, layout
`(batch, seq, heads, head_dim)`, reached here by transposes).

The kernel runs compiled only, on a GPU of compute capability 9.0 (wgmma and the
tensor-memory accelerator): Mosaic GPU's interpreter does not take its accumulators
(`run_state`), so there is no interpret mode and this path refuses every call off a GPU.
From a CPU it still lowers for CUDA (`jax.export(..., platforms=["cuda"])`) once jax can
read a CUDA runtime version, which the kernel asks for while tracing.

What the kernel takes, and the translation (`layout`):

* float16 only: its shared-memory tiles are float16, and bfloat16 operands fail Mosaic's
  lowering (a mixed-dtype wgmma);
* no softmax scale: q is multiplied by `scale` before the kernel, in float16;
* head_dim a multiple of 64 (zeros pad it: they change no logit, and the padded output
  columns are dropped), at most 256 after padding (shared memory);
* queries in tiles of 128 (two warpgroups of 64 rows), keys in blocks of 64 or 128:
  padding queries are computed and dropped; padding keys, which the kernel has no mask
  for, get one extra q/k column (a spare one of the head-dim padding when there is one)
  holding `PAD_Q` in every query and `PAD_K` in every padding key, so a padding key's
  logit is `PAD_Q * PAD_K` and its weight underflows to zero (causal calls need none:
  no real query reaches a padding key);
* causal, top-left on the kernel's one axis: query i sits at key position i + offset
  (offset = S - N, or a static `q_offset` with N + offset <= S), the first `offset`
  positions holding dummy queries and rows with i + offset < 0 (no key) not computed,
  as for `pallas_gpu`;
* GQA/MQA natively (the kernel maps query head h to kv head h // (H / K)).

Gradients: without causality, the kernel's own backward (dq and dk/dv kernels). The
kernel has no causal backward, so a causal call differentiates through the blockwise
engine (`jax_mha.paths.blockwise`), recomputing the forward there: the forward on the
kernel, the backward at the engine's speed. Reverse mode only (custom_vjp).

Refused (the path's refusal, one line naming the part): off a GPU (no interpret mode); a GPU whose compute capability
is not 9.0 (when one is present: described from another backend, as for a CUDA export,
the capability is not checked); no CUDA runtime version readable (the kernel reads it
while tracing); causal on a CUDA runtime in 12.8.0..12.9.0 (the kernel refuses it: a
ptxas miscompilation); any dtype but float16; Dv != D; head_dim over 256 (or 256 with
keys to pad); causal queries past the last key; and every part of the call that
`PATH.takes` leaves out (it masks nothing but causality). q_lengths need nothing: the
dispatcher zeroes the rows past them.

Registered with `auto=False`: `"auto"` never picks this path (its causal backward
runs on the blockwise engine); name it to use it. Its device tests pass on an H200
(docs/results/gpu_kernels.md).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_mha import _masking
from jax_mha._path import Path, fallback
from jax_mha.paths.kernel_common import (
    causal_past_last_key,
    engine_backward,
    flat_batch,
    kernel_run,
    round_up,
    static_int,
    this_gpu,
    without_x64,
)

NAME = "implementation='pallas_mgpu'"
BLOCK_Q = 64  # rows per compute warpgroup; the kernel runs two, so queries come in tiles of 128
HEAD_DIM_TILE = 64  # the kernel's head_dim must be a multiple of this
MAX_HEAD_DIM = 256  # shared memory holds q, two k and two v tiles of this width
PAD_Q, PAD_K = 256.0, -65504.0  # float16 values: a padding key's logit is about -1.7e7
# The kernel refuses causal masking on these CUDA runtimes (a ptxas miscompilation).
BAD_CAUSAL_CUDA = (12080, 12091)


class Layout(NamedTuple):
    """Where the computed queries and the keys sit on the kernel's sequence axis.

    Attributes:
      skip: leading query rows not computed (causal, they see no key).
      front: dummy query positions before the first computed row (causal offset > 0).
      rows: computed query rows.
      t_q, t_k: the kernel's query and key lengths.
      d_pad: the kernel's head dim.
      block_kv: the kernel's key block.
      pad_column: padding keys are masked by the last of the `d_pad` columns.
    """

    skip: int
    front: int
    rows: int
    t_q: int
    t_k: int
    d_pad: int
    block_kv: int
    pad_column: bool


def layout(n: int, s: int, d: int, is_causal: bool, offset: int) -> Layout:
    """The static placement for N queries, S keys of head dim D and the query offset (an int)."""
    if is_causal:
        skip = min(max(-offset, 0), n)
        front, rows = max(offset, 0), n - skip
    else:
        skip = front = 0
        rows = n
    t_q = round_up(front + rows, 2 * BLOCK_Q)
    t_k = round_up(s, HEAD_DIM_TILE)
    if is_causal:  # the kernel streams the keys up to the end of each query tile
        t_k = max(t_k, t_q)
    pad_column = not is_causal and t_k > s
    d_pad = round_up(d + pad_column, HEAD_DIM_TILE)
    block_kv = 128 if d_pad <= 128 and t_k % 128 == 0 else 64
    return Layout(skip, front, rows, t_q, t_k, d_pad, block_kv, pad_column)


def shape_limits(vis: _masking.Visibility, call: _masking.Call) -> str | None:
    """What the kernel cannot take beyond its parts (`PATH.takes`), read from the call
    alone (the machine is `device_refusal`'s): one line naming it, or None."""
    d, dv = call.q.shape[-1], call.v.shape[-1]
    if dv != d:
        return f"{NAME} needs equal q/k and v head dims, got {d} and {dv}; {fallback()}"
    if jnp.dtype(call.q.dtype) != jnp.float16:
        return (f"{NAME} takes float16 only (its shared-memory tiles are float16; bfloat16 fails Mosaic's "
                f"lowering), got {call.q.dtype}; {fallback()}")
    n, s = vis.n, vis.s
    if n == 0 or s == 0:
        return None
    offset = static_int(vis.offset)
    past = causal_past_last_key(vis, NAME, fallback())
    if past is not None:
        return past
    lay = layout(n, s, d, vis.is_causal, offset)
    if lay.d_pad > MAX_HEAD_DIM:
        extra = f" (head_dim {d} plus the column that masks padding keys, S={s} not a multiple of 64)" * lay.pad_column
        return f"{NAME} takes head_dim up to {MAX_HEAD_DIM} after padding to a multiple of 64, got {lay.d_pad}{extra}; {fallback()}"
    return None


def _cuda_runtime_version() -> int | None:
    """The CUDA runtime version as the kernel reads it while tracing (12080 for
    12.8.0), or None when jax has no CUDA plugin to ask."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    versions = attention_mgpu.cuda_versions
    return None if versions is None else int(versions.cuda_runtime_get_version())


def device_refusal(is_causal: bool) -> str | None:
    """What this machine lacks for the kernel: a GPU of compute capability 9.0 (when
    the default backend is a GPU), a readable CUDA runtime, one without the causal
    miscompilation; or None."""
    gpu = this_gpu()
    if gpu is not None and gpu[0] != "cuda":
        return f"{NAME} needs an NVIDIA Hopper GPU, this one is ROCm; {fallback()}"
    if gpu is not None and gpu[1] != (9, 0):
        got = ".".join(map(str, gpu[1])) or "unreadable"
        return f"{NAME} needs compute capability 9.0 (Hopper's wgmma), got {got}; {fallback()}"
    version = _cuda_runtime_version()
    if version is None:
        return f"{NAME} needs jax's CUDA plugin: the kernel reads the CUDA runtime's version while tracing; {fallback()}"
    if is_causal and BAD_CAUSAL_CUDA[0] <= version < BAD_CAUSAL_CUDA[1]:
        return (f"{NAME} cannot mask causally on CUDA runtime {version} (the kernel refuses 12.8.0 up to 12.9.1: a "
                f"ptxas miscompilation); {fallback()}")
    return None


def run(q, k, v, vis: _masking.Visibility, *, scale: float, interpret: bool) -> jax.Array:
    """The Hopper kernel on finite float16 q `(B…, H, N, D)`, k `(B…, K, S, D)`,
    v `(B…, K, S, D)` under `vis` (which `PATH` does not refuse).

    Returns:
      out `(B…, H, N, D)` float16. Rows with no visible key hold zeros or anything
      finite (the dispatcher fills them).

    Raises:
      ValueError: for `interpret=True` (this kernel has no interpret mode).
    """
    if interpret:
        raise ValueError(f"{NAME} has no interpret mode (Mosaic GPU cannot interpret this kernel); {fallback()}")
    n, s, d = q.shape[-2], k.shape[-2], q.shape[-1]
    lay = layout(n, s, d, vis.is_causal, static_int(vis.offset))
    kernel = functools.partial(_translated, lay=lay, scale=float(scale), causal=bool(vis.is_causal))
    if not vis.is_causal:
        return kernel(q, k, v, vis)  # differentiates through the kernel's own backward
    return engine_backward(kernel, scale)(q, k, v, vis)


def _translated(q, k, v, vis, *, lay: Layout, scale: float, causal: bool):
    """q, k, v in the library's layout through the kernel and back: `(B…, H, N, D)`."""
    del vis  # everything the kernel needs is static, in `lay`
    batch, qf, kf, vf = flat_batch(q, k, v)  # (b, H, N, D), (b, K, S, D)
    b, h, n, d = qf.shape
    if lay.rows == 0:  # causal, every query before the first key
        return jnp.zeros(batch + (h, n, d), q.dtype)
    config = _config(lay, causal)
    kernel = without_x64(functools.partial(_attention, config=config))
    out = kernel(_queries_in(qf, scale, lay), _keys_in(kf, lay, PAD_K), _keys_in(vf, lay, 0.0))
    out = out[:, lay.front:lay.front + lay.rows, :, :d].transpose(0, 2, 1, 3)  # (b, H, rows, D)
    out = jnp.pad(out, ((0, 0), (0, 0), (lay.skip, 0), (0, 0)))
    return out.reshape(batch + (h, n, d))


def _queries_in(q, scale: float, lay: Layout):
    """`(b, H, N, D)` -> the kernel's `(b, t_q, H, d_pad)`, scaled (the kernel has no scale)."""
    d = q.shape[-1]
    x = (q[:, :, lay.skip:].astype(jnp.float32) * scale).astype(q.dtype)
    x = jnp.pad(x, ((0, 0), (0, 0), (lay.front, lay.t_q - lay.front - lay.rows), (0, lay.d_pad - d)))
    if lay.pad_column:
        x = x.at[..., -1].set(PAD_Q)
    return x.transpose(0, 2, 1, 3)


def _keys_in(x, lay: Layout, pad_key: float):
    """k or v `(b, K, S, D)` -> the kernel's `(b, t_k, K, d_pad)`; padding keys hold
    `pad_key` in the masking column."""
    s, d = x.shape[-2:]
    x = jnp.pad(x, ((0, 0), (0, 0), (0, lay.t_k - s), (0, lay.d_pad - d)))
    if lay.pad_column and pad_key:
        x = x.at[:, :, s:, -1].set(pad_key)
    return x.transpose(0, 2, 1, 3)


def _config(lay: Layout, causal: bool):
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    backward = {} if causal else dict(block_q_dkv=BLOCK_Q, block_kv_dkv=64, block_q_dq=BLOCK_Q, block_kv_dq=64)
    return attention_mgpu.TuningConfig(block_q=BLOCK_Q, block_kv=lay.block_kv, max_concurrent_steps=2, causal=causal,
                                       **backward)


def _attention(q, k, v, *, config):
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    return attention_mgpu.attention(q, k, v, config)


def _limits(vis: _masking.Visibility, call: _masking.Call) -> str | None:
    return shape_limits(vis, call) or device_refusal(vis.is_causal)


# Named only (`auto=False`): its causal backward runs on the blockwise engine. It masks
# nothing but causality (q_lengths need nothing: the dispatcher zeroes those rows).
PATH = Path("pallas_mgpu", kernel_run(run), platforms=("gpu",), limits=_limits, auto=False,
            takes=frozenset({"q_lengths", "query_offset"}))
refusal = PATH.refusal


def kernel_refusal(vis: _masking.Visibility, call: _masking.Call) -> str | None:
    """The path's refusal without the machine (`device_refusal`): what the kernel
    cannot express in this call, read from the call alone."""
    return dataclasses.replace(PATH, limits=shape_limits).refusal(vis, call)

