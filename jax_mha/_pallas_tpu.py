"""`implementation="pallas_tpu"`: the one attention description translated to splash
attention (`jax.experimental.pallas.ops.tpu.splash_attention`, the kernel MaxText uses).

Supported: causal (bottom-right: `offset = S - N` in splash's `q + offset >= kv`), local
windows (left/right/both, splash `LocalMask` with the same offset), segment ids, q/kv
lengths (folded into segment ids), GQA/MQA (splash's MQA kernel vmapped over kv heads),
any N and S (padded to the block size with ids no real token has), logits soft-cap.
Refused with a ValueError naming the part: an additive bias, a dense mask,
return_weights, dropout with deterministic=False, and (in `jax_mha.attention`) a
`score_mod` or `mask_mod`.

Transformations: jit, vmap, grad, vjp (splash has a custom_vjp). Forward mode (jvp,
jacfwd) has no rule: the kernel is a `jax.custom_vjp`, so JAX raises
`TypeError: can't apply forward-mode autodiff (jvp) to a custom_vjp function.` at trace
time (tested); use implementation='xla' for jvp/jacfwd. On anything but a TPU the kernel runs in Pallas interpret mode: a
correctness tool, very slow.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_mha import _masking
from jax_mha._pallas_common import default_interpret, kernel_segment_ids, refuse, round_up, row_has_key

# MaxText's default splash block (sa_block_q = sa_block_kv = 512); 128 is the smallest
# TPU tile, so short sequences use their own length rounded up to 128.
DEFAULT_BLOCK = 512
MIN_BLOCK = 128



@functools.lru_cache(maxsize=64)
def _kernel(n_pad, s_pad, heads, mqa, is_causal, window, offset, block_q, block_kv, soft_cap, interpret):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    shape = (n_pad, s_pad)
    if window is not None:
        left, right = window
        if is_causal:
            right = 0 if right is None else min(right, 0)
        m = sm.LocalMask(shape, (left, right), offset=offset)
    elif is_causal:
        m = sm.CausalMask(shape, offset=offset)
    else:
        m = sm.FullMask(shape)
    mask = sm.MultiHeadMask([m] * heads)
    bs = sk.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv,
                       block_q_dkv=block_q, block_kv_dkv=block_kv, block_kv_dkv_compute=block_kv,
                       block_q_dq=block_q, block_kv_dq=block_kv)
    make = sk.make_splash_mqa if mqa else sk.make_splash_mha
    return make(mask, block_sizes=bs, head_shards=1, q_seq_shards=1,
                attn_logits_soft_cap=soft_cap, interpret=interpret)


def pallas_tpu_attention(q, k, v, *, scale, is_causal, local_window_size, q_segment_ids, kv_segment_ids,
                         q_lengths, kv_lengths, mask, bias, return_weights, dropout_rate, deterministic,
                         interpret=None, logits_soft_cap=None, block_size=None):
    """Splash attention for q `(B…, H, N, D)`, k/v `(B…, K, S, D)`; returns `(B…, H, N, D)`
    in q's dtype. Rows that may see no key give zeros (value and gradient).

    `interpret=None` compiles on TPU and interprets elsewhere. `block_size` overrides the
    default (512, clamped to the sequence rounded up to 128). Reverse mode only: jvp and
    jacfwd raise JAX's custom_vjp TypeError.

    Raises:
      ValueError: for a bias, a dense mask, return_weights, dropout, mismatched shapes or
        heads K not dividing H. TypeError: for non-integer segment ids or a non-bool
        interpret.
    """
    refuse("pallas_tpu", mask=mask, bias=bias, return_weights=return_weights,
           dropout_rate=dropout_rate, deterministic=deterministic)
    interpret = default_interpret(interpret, "tpu")
    if q.ndim < 3 or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError(f"pallas_tpu needs q (B…, H, N, D), k/v (B…, K, S, D) of one rank, got "
                         f"{q.shape}, {k.shape}, {v.shape}")
    *batch, h, n, d = q.shape
    kh, s = k.shape[-3], k.shape[-2]
    if tuple(k.shape[:-3]) != tuple(batch) or v.shape != k.shape or k.shape[-1] != d:
        raise ValueError(f"pallas_tpu needs matching batch dims and head_dim, got q {q.shape}, k {k.shape}, v {v.shape}")
    if kh == 0 or h % kh:
        raise ValueError(f"pallas_tpu needs kv heads K dividing query heads H, got H={h}, K={kh}")
    if logits_soft_cap is not None and not (isinstance(logits_soft_cap, (int, float)) and logits_soft_cap > 0):
        raise ValueError(f"logits_soft_cap must be None or a positive number, got {logits_soft_cap!r}")
    window = _masking.canonical_window(local_window_size)
    if n == 0 or s == 0:
        return jnp.zeros(q.shape, q.dtype)
    block = block_size or DEFAULT_BLOCK
    bq = min(block, round_up(n, MIN_BLOCK))
    bkv = min(block, round_up(s, MIN_BLOCK))
    n_pad, s_pad = round_up(n, bq), round_up(s, bkv)
    qs, ks = kernel_segment_ids(tuple(batch), n, s, n_pad, s_pad, q_segment_ids, kv_segment_ids, q_lengths, kv_lengths)
    has_key = jax.lax.stop_gradient(row_has_key(qs, ks, n, s, is_causal, window))
    b = qs.shape[0]
    g = h // kh
    mqa = kh != h
    # Built eagerly even under jit: the kernel is cached across calls, and tables it made
    # inside one trace would leak that trace's tracers into the next.
    with jax.ensure_compile_time_eval():
        kernel = _kernel(n_pad, s_pad, g if mqa else h, mqa, bool(is_causal),
                         None if window is None else tuple(window), s - n, bq, bkv,
                         None if logits_soft_cap is None else float(logits_soft_cap), interpret)

    # splash does not scale the logits: fold the scale into q (exact, and differentiable).
    qf = (q * jnp.asarray(scale, q.dtype)).reshape(b, h, n, d)
    kf, vf = k.reshape(b, kh, s, d), v.reshape(b, kh, s, d)
    qf = jnp.pad(qf, ((0, 0), (0, 0), (0, n_pad - n), (0, 0)))
    kf = jnp.pad(kf, ((0, 0), (0, 0), (0, s_pad - s), (0, 0)))
    vf = jnp.pad(vf, ((0, 0), (0, 0), (0, s_pad - s), (0, 0)))

    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import SegmentIds

    def one(qb, kb, vb, qsb, ksb):
        seg = SegmentIds(q=qsb, kv=ksb)
        if not mqa:
            return kernel(qb, kb, vb, segment_ids=seg)
        # MQA kernel per kv head over its group of H // K consecutive query heads.
        qg = qb.reshape(kh, g, n_pad, d)
        out = jax.vmap(lambda qq, kk, vv: kernel(qq, kk, vv, segment_ids=seg))(qg, kb, vb)
        return out.reshape(h, n_pad, d)

    out = jax.vmap(one)(qf, kf, vf, qs, ks)
    out = jnp.where(has_key[:, None, :, None], out, 0).astype(q.dtype)
    return out[:, :, :n].reshape(q.shape)
