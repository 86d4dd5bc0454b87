"""The description translated for the Pallas GPU (Triton) FlashAttention kernel,
`jax.experimental.pallas.ops.gpu.attention.mha`.

What it expresses: causality and segment ids (one id array shared by queries and keys,
so self-attention with N == S), GQA/MQA (the key/value heads repeated for the kernel),
and the padding to whole blocks (as segment ids no real token has). Its causal mask is
top-left aligned, the same as ours when N == S. It refuses, naming them, N != S where
masking is needed, local windows, separate query and key segment ids, lengths (pass
them as segment ids), a dense `mask`, a `bias`, `return_weights`, dropout and a
`logits_soft_cap`.

Off a GPU it runs in Pallas interpret mode: a correctness tool (seconds for one small
call on a CPU), not a fast path. Differentiable in reverse mode (the kernel's own
custom VJP); forward mode (`jvp`, `jacfwd`) raises JAX's TypeError for custom-VJP
functions: use `implementation="xla"` or `"blockwise"` there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_mha import _pallas_common as common

BLOCK = 128  # the kernel's own default block_q = block_k
MIN_BLOCK = 16  # Triton's smallest dot tile


def _block(n: int) -> int:
    return min(BLOCK, max(MIN_BLOCK, 1 << max(n - 1, 0).bit_length()))


def pallas_gpu_attention(q, k, v, *, scale, is_causal, local_window_size, q_segment_ids, kv_segment_ids,
                         q_lengths, kv_lengths, mask, bias, return_weights, dropout_rate, deterministic,
                         interpret=None, logits_soft_cap=None):
    """Attention through the Pallas GPU (Triton) FlashAttention kernel.

    Args:
      q: `(B…, H, N, D)`; k, v: `(B…, K, S, D)`, K dividing H.
      scale: the logit scale (the kernel's `sm_scale`).
      is_causal: causal (N == S: top-left and bottom-right agree).
      q_segment_ids: int `(B…, N)` or None; `kv_segment_ids` must be None or the same
        array (the kernel takes one id array for both).
      local_window_size, q_lengths, kv_lengths, mask, bias, return_weights,
        dropout_rate, deterministic, logits_soft_cap: refused unless absent / off.
      interpret: Pallas interpret mode; None: unless running on a GPU.

    Returns:
      `(B…, H, N, D)` in q's dtype.

    Raises:
      ValueError: naming a part of the description the kernel cannot express.
    """
    path = "pallas_gpu"
    common.refuse(path, mask=mask, bias=bias, return_weights=return_weights, dropout_rate=dropout_rate,
                  deterministic=deterministic)
    for name, value in (("local_window_size", local_window_size), ("q_lengths", q_lengths),
                        ("kv_lengths", kv_lengths), ("logits_soft_cap", logits_soft_cap)):
        if value is not None:
            hint = " (express padding as q_segment_ids)" if name.endswith("lengths") else ""
            raise ValueError(f"implementation={path!r} cannot express {name}{hint}; use 'xla' or 'blockwise'")
    if kv_segment_ids is not None and kv_segment_ids is not q_segment_ids:
        raise ValueError(f"implementation={path!r} takes one segment-id array for queries and keys: "
                         "kv_segment_ids must be q_segment_ids (self-attention)")
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    *_, h, n, d = q.shape
    kh, s = k.shape[-3], k.shape[-2]
    batch = jnp.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    if 0 in batch or n == 0 or s == 0:
        return jnp.zeros(batch + (h, n, v.shape[-1]), q.dtype)
    block = _block(max(n, s))
    n_pad = common.round_up(n, block)
    masked = is_causal or q_segment_ids is not None or n_pad != n or common.round_up(s, block) != s
    if masked and n != s:
        raise ValueError(f"implementation={path!r} masks (causal, segment ids, padding to its {block}-row blocks) "
                         f"only for N == S, got N={n}, S={s}; use 'xla' or 'blockwise'")
    ids = None
    if q_segment_ids is not None or n_pad != n:
        ids = common.segment_ids(q_segment_ids, None, batch, n, n_pad, pad_offset=1)
    # (B, N, H, D): the kernel's layout; key/value heads repeated for its MHA.
    to_kernel = lambda x: jnp.swapaxes(common.flat_batch(x, batch, 3), 1, 2)
    qf, kf, vf = to_kernel(q), to_kernel(jnp.repeat(k, h // kh, axis=-3)), to_kernel(jnp.repeat(v, h // kh, axis=-3))
    pad = lambda x: jnp.pad(x, ((0, 0), (0, n_pad - x.shape[1]), (0, 0), (0, 0)))
    from jax.experimental.pallas.ops.gpu import attention as triton

    blocks = triton.BlockSizes(block_q=block, block_k=block, block_q_dkv=block, block_kv_dkv=block,
                               block_q_dq=block, block_kv_dq=block)
    out = triton.mha(pad(qf), pad(kf), pad(vf), segment_ids=ids, sm_scale=scale, causal=is_causal,
                     block_sizes=blocks, interpret=interpret)[:, :n]  # (B, N, H, D)
    out = jnp.swapaxes(out, 1, 2)  # (B, H, N, D)
    valid = common.valid_rows(n, s, is_causal=is_causal, window=None, q_ids=ids, kv_ids=ids)
    if valid is not None:
        out = jnp.where(valid[:, None, :, None], out, 0)
    return out.reshape(batch + (h, n, v.shape[-1])).astype(q.dtype)
