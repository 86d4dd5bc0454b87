"""`implementation="pallas_gpu"`: the one attention description translated to the Pallas
Triton FlashAttention kernel (`jax.experimental.pallas.ops.gpu.attention.mha`, layout
`(batch, seq, heads, head_dim)`, reached here by transposes).

The kernel knows one sequence axis: query and key positions are compared on it (its
causal rule is top-left, `q_pos >= k_pos`) and ONE segment-id array is read at both
(a query takes the id of the key at its position). The translation (`layout`):

* causal, bottom-right: query i sits at key position i + offset (offset = S - N by
  default, or a static `q_offset` with N + offset <= S). Rows with i + offset < 0 see
  no key and are not computed; for offset > 0 the first `offset` positions hold dummy
  queries, computed and dropped: the kernel takes no offset, and splitting the keys
  into a fully visible part and a causal part would need the kernel's log-sum-exp,
  which its custom_vjp does not differentiate;
* not causal: the queries sit on the keys' positions, in chunks of at most S rows
  folded into the batch when N > S (a query on a padding key's position would take its
  never-matching id);
* both lengths are padded to multiples of power-of-two blocks (Triton's lowering takes
  only power-of-two tiles); padding keys carry an id no real token has. A query that
  does not need the keys' length is not padded to it; the fused backward then pairs
  each block of up to 128 keys with a block of queries;
* segment ids: the kernel reads the keys' ids at every query's position, so a query
  whose own id differs from that (distinct query and key ids) cannot be expressed. With
  concrete ids `limits` checks it; traced ids are taken only for self-attention
  (N == S, query i at position i), and a row whose ids disagree comes back NaN;
* GQA/MQA: k/v heads are repeated, because the kernel's BlockSpecs index q and k/v by
  the same head.

Refused (the path's refusal, one line naming the part, unless the path's decode
kernel, `_pallas_gpu_decode`, takes a one-row call): every part of the call that
`PATH.takes` leaves out (a window and kv_lengths among them: one id array cannot cut
keys while the queries at those positions stay), and by `limits` float64 (the kernel's
softmax is float32), Dv != D, and on a GPU head_dim outside 9..256 (interpret mode
takes any).
q_lengths need nothing: the dispatcher zeroes the rows past them.

Float32 inputs: on a GPU the kernel's dots run at JAX's default matmul precision
(TF32 on recent NVIDIA GPUs). Transformations: jit, vmap, grad, vjp (a custom_vjp,
which also traces the kernel with 64-bit types off: `without_x64`).
Forward mode raises JAX's `TypeError: can't apply forward-mode autodiff (jvp) to a
custom_vjp function.`; use implementation='xla' for jvp/jacfwd.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_mha import _masking
from jax_mha._pallas_common import (
    causal_past_last_key,
    flat_batch,
    flat_ids,
    gpu_op,
    is_traced,
    kernel_run,
    next_pow2,
    pallas_limits,
    round_up,
    sentinels,
    static_int,
    without_x64,
)
from jax_mha._path import Path, fallback

NAME = "implementation='pallas_gpu'"
DEFAULT_BLOCK = 128  # the kernel's own forward block (BlockSizes.get_default())
MIN_BLOCK = 16  # the smallest tile Triton's tl.dot takes
MAX_HEAD_DIM = 256


def backward_blocks(head_dim: int) -> tuple[int, int]:
    """`(outer, inner)` of the fused backward: a dK/dV program holds `outer` keys and
    sweeps the queries `inner` at a time, a dQ program the reverse. The rule: (128, 64)
    up to D = 64, (64, 64) beyond, the fastest pair of the sweep at each head size it
    ran (`experiments/pallas_gpu_blocks.py`; its timings are in
    docs/results/data/pallas_gpu_blocks.json, tabled in docs/results/gpu_kernels.md,
    section 4). Head dims above 128 (padded to 256) take (64, 64), unmeasured."""
    return (128, 64) if next_pow2(head_dim) <= 64 else (64, 64)


class Layout(NamedTuple):
    """Where the computed queries and the keys sit on the kernel's sequence axis.

    Attributes:
      skip: leading query rows not computed (causal, they see no key).
      front: dummy query positions before the first computed row (causal offset > 0).
      chunks: query chunks folded into the batch (not causal, N > S).
      rows: computed query rows per chunk.
      t_q, t_k: the kernel's query and key lengths.
      sizes: the kernel's `BlockSizes` fields, in order.
    """

    skip: int
    front: int
    chunks: int
    rows: int
    t_q: int
    t_k: int
    sizes: tuple


def layout(n: int, s: int, is_causal: bool, offset: int, head_dim: int) -> Layout:
    """The static placement for N queries, S keys, the query offset (an int) and the
    head dim (which sets the backward's blocks)."""
    if is_causal:
        skip = min(max(-offset, 0), n)
        front, chunks, rows = max(offset, 0), 1, n - skip
    else:
        skip = front = 0
        rows = min(n, s)
        chunks = -(-n // rows)
    block_k = min(DEFAULT_BLOCK, next_pow2(s, MIN_BLOCK))
    t_k = round_up(s, block_k)
    # The fused backward gives one program a block of keys AND a block of queries:
    # both sides need the same number of blocks.
    outer, inner = backward_blocks(head_dim)
    bwd_k = min(outer, t_k)
    programs = t_k // bwd_k
    bwd_q = next_pow2(-(-(front + rows) // programs), MIN_BLOCK)
    t_q = programs * bwd_q
    block_q = min(DEFAULT_BLOCK, t_q & -t_q)  # the largest power of two dividing t_q
    sizes = (block_q, block_k, min(inner, bwd_q), bwd_k, bwd_q, min(inner, bwd_k))
    return Layout(skip, front, chunks, rows, t_q, t_k, sizes)


def positions(lay: Layout, n: int) -> np.ndarray:
    """int `(N - skip,)`: the kernel position (within its chunk) of each computed row."""
    return lay.front + np.arange(n - lay.skip) % max(lay.rows, 1)


def limits(vis: _masking.Visibility, call: _masking.Call) -> str | None:
    """What the Triton kernel cannot take beyond its parts (`PATH.takes`): one line
    naming it and the paths to use instead, or None. See the module docstring."""
    use = fallback()
    why = pallas_limits(NAME, call)
    if why is not None:
        return why
    d, dv = call.q.shape[-1], call.v.shape[-1]
    if dv != d:
        return f"{NAME} needs equal q/k and v head dims, got {d} and {dv}; {use}"
    if call.platform == "gpu" and (next_pow2(d) < MIN_BLOCK or d > MAX_HEAD_DIM):  # compiled only
        return f"{NAME} needs head_dim in 9..{MAX_HEAD_DIM} on a GPU (Triton's dot tiles), got D={d}; {use}"
    n, s = vis.n, vis.s
    if n == 0 or s == 0:
        return None
    offset = static_int(vis.offset)
    past = causal_past_last_key(vis, NAME, use)
    if past is not None:
        return past
    return _segment_refusal(vis, layout(n, s, vis.is_causal, offset, call.q.shape[-1]))


def _segment_refusal(vis: _masking.Visibility, lay: Layout) -> str | None:
    """Refuses segment ids the kernel's one array cannot carry (see the module docstring)."""
    if not vis.segmented:
        return None
    n, s = vis.n, vis.s
    pos = positions(lay, n)
    if is_traced(vis.q_segment_ids) or is_traced(vis.kv_segment_ids):
        if n == s and vis.segments_shared and np.array_equal(pos, np.arange(lay.skip, n)):
            return None  # self-attention with the keys' ids the queries' own array
        return (f"{NAME} reads one segment-id array for queries and keys; traced ids are taken only for "
                f"self-attention with kv_segment_ids left out (here N={n}, S={s}); {fallback()}")
    q_ids = np.asarray(vis.q_segment_ids)[..., 0, :, 0]  # (B…|1, N)
    kv_ids = np.asarray(vis.kv_segment_ids)[..., 0, 0, :]  # (B…|1, S)
    q_ids, kv_ids = np.broadcast_arrays(q_ids[..., lay.skip:], kv_ids[..., pos])
    bad = np.argwhere(q_ids != kv_ids)
    if len(bad):
        i = tuple(bad[0])
        return (f"{NAME} reads one segment-id array for queries and keys: query row {i[-1] + lay.skip} has id "
                f"{q_ids[i]} but sits on key {pos[i[-1]]} of id {kv_ids[i]}; {fallback()}")
    return None


def run(q, k, v, vis: _masking.Visibility, *, scale: float, interpret: bool) -> jax.Array:
    """Triton FlashAttention of finite q `(B…, H, N, D)`, k `(B…, K, S, D)`,
    v `(B…, K, S, D)` under `vis` (which `PATH` does not refuse).

    Returns:
      out `(B…, H, N, D)` in q's dtype. Rows with no visible key hold anything
      finite (the dispatcher fills them); rows whose query and key segment ids
      disagree at the query's position (traced ids only) are NaN.
    """
    batch, qf, kf, vf = flat_batch(q, k, v)  # (b, H, N, D), (b, K, S, D)
    b, h, n, d = qf.shape
    lay = layout(n, kf.shape[2], vis.is_causal, static_int(vis.offset), d)
    if lay.rows == 0:  # causal, every query before the first key
        return jnp.zeros(batch + (h, n, d), q.dtype)
    ids, wrong = _kernel_ids(vis, batch, lay)
    config = (float(scale), bool(vis.is_causal), lay.sizes, bool(interpret))
    kernel = without_x64(functools.partial(_mha, config=config))
    out = kernel(_queries_in(qf, lay), _keys_in(kf, h, lay), _keys_in(vf, h, lay), ids)
    out = _queries_out(out, lay, n)  # (b, H, N, D)
    if wrong is not None:
        out = jnp.where(wrong[:, None, :, None], jnp.nan, out)
    return out.reshape(batch + (h, n, d)).astype(q.dtype)


def _kernel_ids(vis: _masking.Visibility, batch: tuple, lay: Layout):
    """`(ids (b·chunks, t_k) int32 or None, wrong (b, N) bool or None)`: the one id
    array (the keys' ids, padding keys a sentinel) and the rows whose own id is not the
    id at their position."""
    b, s = math.prod(batch), vis.s
    ids = flat_ids(vis, batch)
    if ids is None and lay.t_k == s:
        return None, None
    kv = jnp.zeros((b, s), jnp.int32) if ids is None else ids[1]
    kv = jnp.concatenate([kv, jnp.broadcast_to(sentinels(ids)[1], (b, lay.t_k - s))], axis=1)  # (b, t_k)
    wrong = None
    if ids is not None:
        wrong = ids[0][:, lay.skip:] != kv[:, positions(lay, vis.n)]  # (b, N - skip)
        wrong = jnp.pad(wrong, ((0, 0), (lay.skip, 0)))
    return jnp.repeat(kv, lay.chunks, axis=0), wrong


def _queries_in(q, lay: Layout):
    """`(b, H, N, D)` -> the kernel's `(b·chunks, t_q, H, D)`."""
    b, h, _, d = q.shape
    x = q[:, :, lay.skip:]
    x = jnp.pad(x, ((0, 0), (0, 0), (0, lay.chunks * lay.rows - x.shape[2]), (0, 0)))
    x = x.reshape(b, h, lay.chunks, lay.rows, d)
    x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (lay.front, lay.t_q - lay.front - lay.rows), (0, 0)))
    return x.transpose(0, 2, 3, 1, 4).reshape(b * lay.chunks, lay.t_q, h, d)


def _queries_out(out, lay: Layout, n: int):
    """The kernel's `(b·chunks, t_q, H, D)` -> `(b, H, N, D)`, skipped rows zero."""
    _, t, h, d = out.shape
    x = out.reshape(-1, lay.chunks, t, h, d)[:, :, lay.front:lay.front + lay.rows]
    x = x.transpose(0, 3, 1, 2, 4).reshape(x.shape[0], h, lay.chunks * lay.rows, d)[:, :, :n - lay.skip]
    return jnp.pad(x, ((0, 0), (0, 0), (lay.skip, 0), (0, 0)))


def _keys_in(x, h: int, lay: Layout):
    """k or v `(b, K, S, D)` -> the kernel's `(b·chunks, t_k, H, D)`: heads repeated
    (the kernel has no grouping), padded, and broadcast over the query chunks."""
    b, kh, s, d = x.shape
    x = jnp.repeat(x, h // kh, axis=1).transpose(0, 2, 1, 3)  # (b, S, H, D)
    x = jnp.pad(x, ((0, 0), (0, lay.t_k - s), (0, 0), (0, 0)))
    x = jnp.broadcast_to(x[:, None], (b, lay.chunks) + x.shape[1:])
    return x.reshape((b * lay.chunks,) + x.shape[2:])


def _mha(q, k, v, ids, *, config):
    gpu_attention = gpu_op("attention")
    scale, causal, sizes, interpret = config
    return gpu_attention.mha(q, k, v, ids, sm_scale=scale, causal=causal,
                             block_sizes=gpu_attention.BlockSizes(*sizes), interpret=interpret)


# The kernel's one segment-id array carries segment ids and q_lengths (a padding query
# takes a sentinel); it cannot cut keys (kv_lengths) or hold a window, and takes a
# static query offset only.
PATH = Path("pallas_gpu", kernel_run(run), platforms=("gpu",), interprets=True, limits=limits,
            takes=frozenset({"segment_ids", "q_lengths", "query_offset"}))
refusal = PATH.refusal

