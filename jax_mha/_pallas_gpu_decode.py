"""`implementation="pallas_gpu"` as the dispatcher reaches it: a decoding step (one query
row against a cache) on the Pallas Triton decode kernel
(`jax.experimental.pallas.ops.gpu.decode_attention.gqa`), every other call on the
Triton FlashAttention translation (`jax_mha._pallas_gpu`), whose refusal is the one
reported when the decode kernel refuses too.

A decoding step (`jax_mha._attend`) describes its one new token with the cache index
as query offset (`q_offset`, traced under jit) over the whole cache of length L: the
keys it may see form one interval `[lo, hi)`, read from the description by
`_masking.key_range` (causality and the window) and cut at `kv_lengths`. The kernel
takes that interval per sequence as arrays (`start_idx`, `kv_seq_len`) at run time, so
unlike the FlashAttention kernel it needs no static offset. The translation:

* any call with N == 1 and no segment ids, decoding or not;
* GQA/MQA natively: q `(b, H, D)` against keys `(b, S, K, D)`, no repeated k/v heads;
* the keys in `splits` chunks of `split` keys, a power of two >= 16 (Triton's tiles;
  the kernel merges the chunks' partial softmaxes), padded with zero keys past S that
  `kv_seq_len` excludes: a cache of length `splits * split` is not copied;
* head dims padded with zeros to one power of two >= 16 (Triton's tiles): q and k to
  the same width change no logit, and v's padded columns are dropped, so Dv != D works.

Refused by `decode_refusal` (the call then goes to `_pallas_gpu`): N != 1, segment ids,
head dims over 256 on a GPU, and what every Pallas path refuses (`common_refusal`)
but a traced query offset. Gradients: the kernel has no backward; reverse mode runs
the blockwise engine's (`_pallas_mgpu.engine_backward`). Float32 inputs: the kernel's
dots run at JAX's default matmul precision on a GPU (TF32 on recent NVIDIA GPUs); its
per-chunk partial outputs are stored in the input dtype before they are merged.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jax_mha import _masking, _pallas_gpu
from jax_mha._pallas_common import common_refusal, decode_router, flat_batch, gpu_op, next_pow2
from jax_mha._pallas_mgpu import engine_backward

NAME = "implementation='pallas_gpu'"
MIN_TILE = 16  # Triton's smallest dot tile, and the kernel's smallest chunk of keys
MAX_SPLITS = 16  # chunks of keys, run in parallel (the kernel's default k_splits)
MAX_BLOCK_K = 128  # keys per step inside a chunk (the kernel's default block_k)
MAX_HEAD_DIM = 256


def key_splits(s: int) -> tuple[int, int]:
    """`(split, splits)`: S keys in `splits <= MAX_SPLITS` chunks of `split` keys, a
    power of two >= `MIN_TILE`, covering S."""
    split = next_pow2(-(-s // MAX_SPLITS), MIN_TILE)
    return split, -(-s // split)


def decode_refusal(vis: _masking.Visibility, call: _masking.Call) -> str | None:
    """Why the decode kernel cannot run this call (one line), or None."""
    if vis.n != 1:
        return f"{NAME}'s decode kernel takes one query row, got N={vis.n}"
    # The kernel reads the visible interval at run time: a traced offset is fine here.
    why = common_refusal("pallas_gpu", dataclasses.replace(vis, q_offset=None), call)
    if why is not None:
        return why
    if vis.segmented:
        return f"{NAME}'s decode kernel cannot express segment ids (it masks one interval of keys)"
    width = next_pow2(max(call.q.shape[-1], call.v.shape[-1]), MIN_TILE)
    if call.platform == "gpu" and width > MAX_HEAD_DIM:  # compiled only
        return f"{NAME}'s decode kernel takes head dims up to {MAX_HEAD_DIM} on a GPU, got a padded width of {width}"
    return None




def visible_interval(vis: _masking.Visibility, batch: tuple):
    """`(start, stop)` int32 `(b,)` over the flattened `batch`: the keys `[start, stop)`
    the one query row may see (causality and window from `_masking.key_range`, cut at
    `kv_lengths`); traced when the offset or the lengths are."""
    b = math.prod(batch)
    lo, hi = _masking.key_range(vis, 0, 0, vis.s)
    hi = jnp.asarray(hi, jnp.int32)
    if vis.kv_lengths is not None:
        lengths = jnp.broadcast_to(vis.kv_lengths.reshape(vis.kv_lengths.shape[:-3]), batch).reshape(b)
        hi = jnp.minimum(hi, lengths.astype(jnp.int32))
    return jnp.broadcast_to(jnp.asarray(lo, jnp.int32), (b,)), jnp.broadcast_to(hi, (b,))


def _decode(q, k, v, vis, *, scale: float, interpret: bool):
    """The decode kernel on q `(B…, H, 1, D)`, k `(B…, K, S, D)`, v `(B…, K, S, Dv)`:
    out `(B…, H, 1, Dv)` in q's dtype."""
    decode_attention = gpu_op("decode_attention")

    batch, qf, kf, vf = flat_batch(q, k, v)  # (b, H, 1, D), (b, K, S, D), (b, K, S, Dv)
    h, d, s, dv = qf.shape[1], qf.shape[-1], kf.shape[2], vf.shape[-1]
    width = next_pow2(max(d, dv), MIN_TILE)
    split, splits = key_splits(s)
    start, stop = visible_interval(vis, batch)

    def keys(x):  # (b, K, S, ·) -> the kernel's (b, splits·split, K, width)
        x = jnp.pad(x, ((0, 0), (0, 0), (0, split * splits - s), (0, width - x.shape[-1])))
        return x.transpose(0, 2, 1, 3)

    with jax.enable_x64(False):  # the kernel mixes int32 program ids with Python ints
        out = decode_attention.gqa(jnp.pad(qf[:, :, 0], ((0, 0), (0, 0), (0, width - d))), keys(kf), keys(vf),
                                   start, stop, sm_scale=scale, block_k=min(MAX_BLOCK_K, split), k_splits=splits,
                                   interpret=interpret)  # (b, H, width)
    return out[..., :dv].reshape(batch + (h, 1, dv)).astype(q.dtype)


# The path's `refusal` and `run`: decoding steps on the decode kernel, every other call
# (and every refused step) on `_pallas_gpu`.
refusal, run = decode_router(decode_refusal, _pallas_gpu, _decode, "gpu", engine_backward)
