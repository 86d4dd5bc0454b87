"""`implementation="pallas_gpu"`: the one attention description translated to the Pallas
Triton FlashAttention kernel (`jax.experimental.pallas.ops.gpu.attention.mha`, layout
`(batch, seq, heads, head_dim)`, reached here by transposes).

Supported: causal with the library's bottom-right offset (the kernel's causal is
top-left, `q_pos >= k_pos`, so queries are shifted by padding: S > N puts S - N dummy
queries in front, N > S puts N - S never-matching keys in front), segment ids for
self-attention, GQA/MQA (k/v heads repeated: the kernel has no native grouping), any N
and S (padded to the block with an id no real token has).
Refused with a ValueError naming the part: a window, lengths, distinct q/kv segment ids
(the kernel reads ONE segment-id array for queries and keys), an additive bias, a dense
mask, return_weights, dropout with deterministic=False, soft-cap.

Transformations: jit, vmap, grad, vjp (the kernel has a custom_vjp). Forward mode (jvp,
jacfwd) raises JAX's `TypeError: can't apply forward-mode autodiff (jvp) to a
custom_vjp function.` at trace time (tested); use implementation='xla' for jvp/jacfwd. On anything but a GPU the
kernel runs in Pallas interpret mode: a correctness tool, very slow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_mha import _masking
from jax_mha._pallas_common import default_interpret, refuse, round_up, row_has_key

# The kernel's own default forward block (BlockSizes.get_default(): 128 x 128).
DEFAULT_BLOCK = 128
MIN_BLOCK = 16  # smallest tile Triton's tl.dot accepts



def _same_ids(a, b) -> bool:
    if a is None or b is None or a is b:
        return True
    if isinstance(a, jax.core.Tracer) or isinstance(b, jax.core.Tracer):
        return False
    return np.shape(a) == np.shape(b) and bool(np.array_equal(np.asarray(a), np.asarray(b)))


def pallas_gpu_attention(q, k, v, *, scale, is_causal, local_window_size, q_segment_ids, kv_segment_ids,
                         q_lengths, kv_lengths, mask, bias, return_weights, dropout_rate, deterministic,
                         interpret=None, logits_soft_cap=None, block_size=None):
    """Triton FlashAttention for q `(B…, H, N, D)`, k/v `(B…, K, S, D)`; returns
    `(B…, H, N, D)` in q's dtype. Rows that may see no key give zeros.

    `interpret=None` compiles on GPU and interprets elsewhere. Reverse mode only: jvp and
    jacfwd raise JAX's custom_vjp TypeError. Segment ids must be one array for queries and keys (the same
    object, or equal concrete arrays): the kernel indexes a single array by both.

    Raises:
      ValueError: for any part listed as refused in the module docstring, mismatched
        shapes, or K not dividing H. TypeError: non-integer segment ids, non-bool interpret.
    """
    refuse("pallas_gpu", mask=mask, bias=bias, return_weights=return_weights,
           dropout_rate=dropout_rate, deterministic=deterministic)
    if _masking.canonical_window(local_window_size) is not None:
        raise ValueError(f"pallas_gpu cannot express a local window (got local_window_size={local_window_size!r}); "
                         "use implementation='pallas_tpu' or 'xla'")
    if q_lengths is not None or kv_lengths is not None:
        raise ValueError("pallas_gpu cannot express q_lengths/kv_lengths (its one segment-id array serves queries "
                         "and keys alike); use implementation='xla' or 'blockwise'")
    if logits_soft_cap is not None:
        raise ValueError(f"pallas_gpu cannot express logits_soft_cap={logits_soft_cap!r}; use implementation='xla'")
    interpret = default_interpret(interpret, "gpu")
    if q.ndim < 3 or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError(f"pallas_gpu needs q (B…, H, N, D), k/v (B…, K, S, D) of one rank, got "
                         f"{q.shape}, {k.shape}, {v.shape}")
    *batch, h, n, d = q.shape
    kh, s = k.shape[-3], k.shape[-2]
    if tuple(k.shape[:-3]) != tuple(batch) or v.shape != k.shape or k.shape[-1] != d:
        raise ValueError(f"pallas_gpu needs matching batch dims and head_dim, got q {q.shape}, k {k.shape}, v {v.shape}")
    if kh == 0 or h % kh:
        raise ValueError(f"pallas_gpu needs kv heads K dividing query heads H, got H={h}, K={kh}")
    if (q_segment_ids is not None or kv_segment_ids is not None) and n != s:
        raise ValueError(f"pallas_gpu takes segment ids only for self-attention (N == S), got N={n}, S={s}")
    if not _same_ids(q_segment_ids, kv_segment_ids):
        raise ValueError("pallas_gpu's kernel reads one segment-id array for queries and keys: q_segment_ids and "
                         "kv_segment_ids must be the same array; use implementation='pallas_tpu' or 'xla'")
    ids = q_segment_ids if q_segment_ids is not None else kv_segment_ids
    if n == 0 or s == 0:
        return jnp.zeros(q.shape, q.dtype)
    b = int(np.prod(batch, dtype=np.int64))

    # Bottom-right causal on a top-left kernel: query i sits at key position i + S - N.
    q_front, k_front = max(s - n, 0), max(n - s, 0)
    length = max(n, s)
    block = min(block_size or DEFAULT_BLOCK, round_up(length, MIN_BLOCK))
    total = round_up(length, block)
    if ids is None:
        seg = jnp.zeros((b, length), jnp.int32)
    else:
        if not jnp.issubdtype(jnp.asarray(ids).dtype, jnp.integer):
            raise TypeError(f"segment ids must be an integer array, got dtype {jnp.asarray(ids).dtype}")
        if np.broadcast_shapes(np.shape(ids), (*batch, n)) != (*batch, n):
            raise ValueError(f"segment ids must broadcast to {(*batch, n)}, got shape {np.shape(ids)}")
        seg = jnp.broadcast_to(jnp.asarray(ids), (*batch, n)).reshape(b, n).astype(jnp.int32)
    sentinel = jnp.min(seg, axis=1, keepdims=True, initial=0) - 1
    # Front keys (N > S) and tail padding carry an id no real token has: never seen.
    seg = jnp.concatenate([jnp.broadcast_to(sentinel, (b, k_front)), seg,
                           jnp.broadcast_to(sentinel, (b, total - length))], axis=1)
    need_ids = ids is not None or k_front > 0 or total > length

    qf = jnp.pad(q.reshape(b, h, n, d), ((0, 0), (0, 0), (q_front, total - n - q_front), (0, 0)))
    kf = jnp.repeat(k.reshape(b, kh, s, d), h // kh, axis=1)
    vf = jnp.repeat(v.reshape(b, kh, s, d), h // kh, axis=1)
    kf = jnp.pad(kf, ((0, 0), (0, 0), (k_front, total - s - k_front), (0, 0)))
    vf = jnp.pad(vf, ((0, 0), (0, 0), (k_front, total - s - k_front), (0, 0)))

    from jax.experimental.pallas.ops.gpu import attention as gpu_attention

    sizes = gpu_attention.BlockSizes(block_q=block, block_k=block, block_q_dkv=min(32, block),
                                     block_kv_dkv=min(32, block), block_q_dq=min(32, block),
                                     block_kv_dq=min(32, block))

    def run(a, b_, c, sg):
        t = lambda x: jnp.swapaxes(x, 1, 2)  # (B, H, T, D) <-> the kernel's (B, T, H, D)
        out = gpu_attention.mha(t(a), t(b_), t(c), sg if need_ids else None, sm_scale=float(scale),
                                causal=bool(is_causal), block_sizes=sizes, interpret=interpret)
        return t(out)

    out = run(qf, kf, vf, seg)[:, :, q_front:q_front + n]
    # Rows that see no key (causal N > S, padding): the kernel would average V; zero them.
    q_ids = seg[:, k_front:k_front + n]
    kv_ids = seg[:, k_front:k_front + s] if n == s else jnp.zeros((b, s), jnp.int32)
    if ids is None:
        q_ids, kv_ids = jnp.zeros((b, n), jnp.int32), jnp.zeros((b, s), jnp.int32)
    has_key = jax.lax.stop_gradient(row_has_key(q_ids, kv_ids, n, s, is_causal, None))
    out = jnp.where(has_key[:, None, :, None], out, 0).astype(q.dtype)
    return out.reshape(q.shape)
