"""The description translated for splash attention, the TPU's Pallas FlashAttention
kernel (`jax.experimental.pallas.ops.tpu.splash_attention`, the one MaxText runs).

What it expresses: causality and local windows (left, right or both) as splash's
static masks, with our bottom-right alignment as their `offset`; segment ids as
splash's `SegmentIds`; `q_lengths`/`kv_lengths` and the padding to whole blocks as
segment ids no real token has; GQA/MQA natively (`make_splash_mqa`, one call per
key/value head with its group of query heads); `logits_soft_cap` (Gemma 2's
`c · tanh(logits / c)`). It refuses, naming them, a dense `mask`, a `bias`,
`return_weights` and dropout.

Off a TPU it runs in Pallas interpret mode: a correctness tool (seconds for one small
call on a CPU), not a fast path. Differentiable in reverse mode (`grad`, `vjp`: the
kernel's own custom VJP); forward mode (`jvp`, `jacfwd`) raises JAX's TypeError for
custom-VJP functions: use `implementation="xla"` or `"blockwise"` there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_mha import _pallas_common as common

BLOCK = 512  # splash's own default block (MaxText's sa_block_* default 512 too)
MIN_BLOCK = 128  # the TPU's lane width: blocks are multiples of it


def _mask(n: int, s: int, offset: int, heads: int, *, is_causal: bool, window):
    """splash's static `MultiHeadMask` over the padded `(n, s)` scores; `offset` is the
    real S - N (the padding sits past the real rows and keys, so it stays bottom-right)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    if window is not None:
        left, right = window
        if is_causal:
            right = 0 if right is None else min(right, 0)
        one = masks.LocalMask((n, s), (left, right), offset)
    elif is_causal:
        one = masks.CausalMask((n, s), offset)
    else:
        one = masks.FullMask((n, s))
    return masks.MultiHeadMask([one] * heads)


@functools.lru_cache(maxsize=64)
def _kernel(n: int, s: int, offset: int, group: int, is_causal: bool, window, block_q: int, block_kv: int,
            logits_soft_cap, interpret: bool):
    """A splash MQA kernel for one key/value head and its `group` query heads (cached:
    building the mask's block tables is NumPy work)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

    blocks = splash.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv,
                               block_q_dkv=block_q, block_kv_dkv=block_kv, block_kv_dkv_compute=block_kv,
                               block_q_dq=block_q, block_kv_dq=block_kv)
    return splash.make_splash_mqa(_mask(n, s, offset, group, is_causal=is_causal, window=window), block_sizes=blocks,
                                  attn_logits_soft_cap=logits_soft_cap, head_shards=1, q_seq_shards=1,
                                  interpret=interpret)


def _block(n: int) -> int:
    return min(BLOCK, common.round_up(max(n, 1), MIN_BLOCK))


def pallas_tpu_attention(q, k, v, *, scale, is_causal, local_window_size, q_segment_ids, kv_segment_ids,
                         q_lengths, kv_lengths, mask, bias, return_weights, dropout_rate, deterministic,
                         interpret=None, logits_soft_cap=None):
    """Attention through splash attention.

    Args:
      q: `(B…, H, N, D)`; k, v: `(B…, K, S, D)`, K dividing H.
      scale: the logit scale (applied to q before the kernel, which does not scale).
      is_causal, local_window_size: bottom-right aligned, as `jax_mha.attention`
        (a window is `(left, right)`, a side None unbounded).
      q_segment_ids, kv_segment_ids: int `(B…, N)` / `(B…, S)`, or None.
      q_lengths, kv_lengths: int broadcastable to `(B…)`, or None.
      mask, bias, return_weights, dropout_rate, deterministic: refused unless
        absent / off (ValueError naming the part).
      interpret: Pallas interpret mode; None: unless running on a TPU.
      logits_soft_cap: `c` of `c · tanh(logits / c)`, or None.

    Returns:
      `(B…, H, N, D)` in q's dtype; zeros for a query that may see no key.

    Raises:
      ValueError: naming a part of the description splash cannot express.
    """
    common.refuse("pallas_tpu", mask=mask, bias=bias, return_weights=return_weights, dropout_rate=dropout_rate,
                  deterministic=deterministic)
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be > 0, got {logits_soft_cap!r}")
    interpret = jax.default_backend() != "tpu" if interpret is None else interpret
    window = None if local_window_size is None else tuple(local_window_size)
    *_, h, n, d = q.shape
    kh, s = k.shape[-3], k.shape[-2]
    batch = jnp.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    if 0 in batch or n == 0 or s == 0:
        return jnp.zeros(batch + (h, n, v.shape[-1]), q.dtype)
    block_q, block_kv = _block(n), _block(s)
    n_pad, s_pad = common.round_up(n, block_q), common.round_up(s, block_kv)
    q_ids = kv_ids = None
    if common.needs_ids(n, s, n_pad, s_pad, q_segment_ids, kv_segment_ids, q_lengths, kv_lengths):
        q_ids = common.segment_ids(q_segment_ids, q_lengths, batch, n, n_pad, pad_offset=1)
        kv_ids = common.segment_ids(kv_segment_ids, kv_lengths, batch, s, s_pad, pad_offset=2)

    # (B, K, G, N, D): splash's MQA layout, one call per key/value head.
    group = h // kh
    qf = common.flat_batch((q.astype(jnp.float32) * scale).astype(q.dtype), batch, 3)
    qf = qf.reshape(-1, kh, group, n, d)
    kf, vf = (common.flat_batch(x, batch, 3) for x in (k, v))
    pad = lambda x, to: jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, to - x.shape[-2]), (0, 0)])
    qf, kf, vf = pad(qf, n_pad), pad(kf, s_pad), pad(vf, s_pad)
    kernel = _kernel(n_pad, s_pad, s - n, group, is_causal, window, block_q, block_kv, logits_soft_cap, interpret)

    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

    def one_example(q_b, k_b, v_b, ids):  # (K, G, Np, D), (K, Sp, D), (K, Sp, D)
        segments = None if ids is None else splash.SegmentIds(q=ids[0], kv=ids[1])
        return jax.vmap(lambda q_h, k_h, v_h: kernel(q_h, k_h, v_h, segment_ids=segments))(q_b, k_b, v_b)

    ids = None if q_ids is None else (q_ids, kv_ids)
    out = jax.vmap(one_example)(qf, kf, vf, ids)[..., :n, :]  # (B, K, G, N, D)
    valid = common.valid_rows(n, s, is_causal=is_causal, window=window, q_ids=q_ids, kv_ids=kv_ids)
    if valid is not None:
        out = jnp.where(valid[:, None, None, :, None], out, 0)
    return out.reshape(batch + (h, n, v.shape[-1])).astype(q.dtype)
