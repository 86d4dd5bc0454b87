"""`implementation="pallas_gpu"`: the library's own flash kernel (`jax_mha.paths.flex`) on
Pallas' Triton backend: every NVIDIA GPU from compute capability 8.0, and Pallas
interpret mode on a CPU.

It takes the whole description but a dense mask: causality and two-sided windows at
any query offset (a traced one too: decoding from a cache index under jit), q/kv lengths, segment ids (queries' and keys' apart, traced
or not), the mods (`_masking.MODS`, traced into the kernel on index tiles; what they
close over is read where they index it), an additive bias (with its gradient), the
logit soft cap, what adds to every row's denominator (`_softmax.close`, from the
kernel's log-sum-exp) and `return_residual`.
GQA is native. Blocks: `flex.blocks` (64 queries by 64 keys, fewer for short
sequences: Triton's tiles are powers of two, at least 16); N and S are padded to whole
blocks inside, never to a power of two.

Refused (the path's refusal, one line naming the part; one-query decoding steps go to
its decode kernel, `pallas_gpu_decode`, where it takes them): a dense mask (give it as
a mask function or a bias), return_weights, dropout;
by `limits`: float64 (the kernel's softmax is float32), mixed dtypes, kv heads not
dividing the query heads, and on a GPU head dims above `MAX_HEAD_DIM`.

Float32 inputs: on a GPU the kernel's dots run at JAX's default matmul precision
(TF32 on recent NVIDIA GPUs). Transformations: jit, vmap, grad, vjp (a custom_vjp).
Forward mode raises JAX's `TypeError: can't apply forward-mode autodiff (jvp) to a
custom_vjp function.`; use implementation='xla' for jvp/jacfwd.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_mha import _masking
from jax_mha._path import Path, fallback
from jax_mha._softmax import close
from jax_mha.paths import flex
from jax_mha.paths.kernel_common import next_pow2, pallas_limits

NAME = "implementation='pallas_gpu'"
MIN_BLOCK = flex.MIN_BLOCK
MAX_HEAD_DIM = 256


def limits(vis: _masking.Visibility, call: _masking.Call) -> str | None:
    """What the kernel cannot take beyond its parts (`PATH.takes`): one line naming it
    and the paths to use instead, or None."""
    why = pallas_limits(NAME, call)
    if why is not None:
        return why
    d, dv = call.q.shape[-1], call.v.shape[-1]
    if call.platform == "gpu" and max(d, dv) > MAX_HEAD_DIM:
        return f"{NAME} needs head dims up to {MAX_HEAD_DIM} on a GPU, got D={d}, Dv={dv}; {fallback()}"
    return None


# The kernel's blocks, `flex.blocks` (`experiments/pallas_gpu_blocks.py` sweeps others).
blocks = flex.blocks


def run(q, k, v, bad_kv, vis: _masking.Visibility, call: _masking.Call, *, scale: float, **_):
    """The path's `run` (`jax_mha._path.Path`): the kernel, then its rows closed (`_softmax.close`)."""
    interpret = call.platform == "cpu"
    dv = v.shape[-1]
    if not interpret:  # Triton's tiles: head dims a power of two, at least 16 (zeros add nothing)
        width = lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, next_pow2(x.shape[-1], MIN_BLOCK) - x.shape[-1])])
        q, k, v = width(q), width(k), width(v)
    q_block, k_block = blocks(vis.n, vis.s)
    with jax.numpy_dtype_promotion("standard"):
        out, lse, touched = flex.attend(q, k, v, bad_kv, vis, scale=scale, q_block=q_block, k_block=k_block,
                                         interpret=interpret, backend="triton")
    empty = lse == -jnp.inf
    out, lse = close(out[..., :dv].astype(_masking.compute_dtype(q.dtype)), lse, vis)
    return out, None, lse, empty, touched


PATH = Path("pallas_gpu", run, platforms=("gpu",), interprets=True, limits=limits,
            takes=flex.TAKES)
refusal = PATH.refusal
