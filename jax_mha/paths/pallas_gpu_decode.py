"""`implementation="pallas_gpu"` as the dispatcher reaches it: a decoding step (one query
row against a cache) on the Pallas Triton decode kernel
(`jax.experimental.pallas.ops.gpu.decode_attention.gqa`): the `decode` of the
`"pallas_gpu"` path (`jax_mha._path.Path`), which sends every other call to the
Triton FlashAttention translation (`jax_mha.paths.pallas_gpu`).

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

Refused (the call then goes to `pallas_gpu`): N != 1, float64, head dims over 256 on
a GPU, and every part `DECODE.takes` leaves out (segment ids among them: it masks one
interval of keys). Gradients: the kernel has no backward; reverse
mode runs the blockwise engine's (`kernel_common.engine_backward`). Float32 inputs: the kernel's
dots run at JAX's default matmul precision on a GPU (TF32 on recent NVIDIA GPUs); its
per-chunk partial outputs are stored in the input dtype before they are merged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_mha import _masking
from jax_mha._path import Path
from jax_mha.paths.kernel_common import (
    decode_limits,
    engine_backward,
    flat_batch,
    gpu_op,
    kernel_run,
    next_pow2,
    visible_interval,
)

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


def limits(vis: _masking.Visibility, call: _masking.Call) -> str | None:
    """What the decode kernel cannot take beyond its parts (`DECODE.takes`), or None."""
    why = decode_limits(NAME, vis, call)
    if why is not None:
        return why
    width = next_pow2(max(call.q.shape[-1], call.v.shape[-1]), MIN_TILE)
    if call.platform == "gpu" and width > MAX_HEAD_DIM:  # compiled only
        return f"{NAME}'s decode kernel takes head dims up to {MAX_HEAD_DIM} on a GPU, got a padded width of {width}"
    return None


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


def run(q, k, v, vis: _masking.Visibility, *, scale: float, interpret: bool):
    """The decode kernel's forward, with the blockwise engine's gradient."""
    kernel = functools.partial(_decode, scale=float(scale), interpret=bool(interpret))
    return engine_backward(kernel, scale)(q, k, v, vis)


# `"pallas_gpu"`'s decoding steps (`Path.decode`): the kernel reads the visible key
# interval at run time, so a traced offset is fine; it masks one interval of keys, so no
# segment ids.
DECODE = Path("pallas_gpu", kernel_run(run), platforms=("gpu",), interprets=True, limits=limits,
              takes=frozenset({"window", "kv_lengths", "q_lengths", "query_offset", "traced_offset"}))
decode_refusal = DECODE.refusal
