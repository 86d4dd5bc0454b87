"""`implementation="pallas_tpu"`: the one attention description translated to splash
attention (`jax.experimental.pallas.ops.tpu.splash_attention`, the kernel MaxText uses).

Translation: causal and local windows become splash's `CausalMask` / `LocalMask` with
`offset` = the description's query offset (query i at key position i + offset,
`S - N` by default, or a static `q_offset`); segment ids, q/kv lengths and the padding
of N and S to the block size fold into splash's `SegmentIds` (`kernel_segment_ids`);
GQA/MQA runs natively (splash groups `H // K` consecutive query heads per kv head);
logits_soft_cap is splash's `attn_logits_soft_cap`; the scale is folded into q (splash
does not scale). Dv may differ from D. Attention sinks are splash's own `sinks` argument,
unchanged (they live in the scaled-logit space, which is what splash's logits are once
the scale is in q); splash's backward returns their gradient.

Refused (`refusal`, one line naming the part): an additive bias, a dense mask,
score_mod/mask_mod, return_weights, dropout, a traced query offset (splash builds its
mask tables at trace time), float64 and float16 inputs, and `return_residual=True`:
splash computes the log-sum-exp (`save_residuals=True`), but its custom VJP then
refuses to differentiate, and an lse whose cotangent reaches q and k needs the
backward kernels fed `rowsum(o ∘ dO) - d lse`, which only its private functions take.

Transformations: jit, vmap, grad, vjp (splash's custom_vjp, traced with 64-bit types
off: `without_x64`). Forward mode raises
JAX's `TypeError: can't apply forward-mode autodiff (jvp) to a custom_vjp function.`;
use implementation='xla' for jvp/jacfwd. Off a TPU the kernel runs in Pallas interpret
mode: a correctness tool, very slow.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_mha import _masking
from jax_mha._pallas_common import (
    common_refusal,
    flat_batch,
    kernel_segment_ids,
    round_up,
    static_int,
    without_x64,
)

NAME = "implementation='pallas_tpu'"
# MaxText's default splash block (sa_block_q = sa_block_kv = 512); 128 is the smallest
# TPU tile, so short sequences use their own length rounded up to 128.
DEFAULT_BLOCK = 512
MIN_BLOCK = 128


def refusal(vis: _masking.Visibility, call: _masking.Call) -> str | None:
    """Why splash attention cannot run this call (one line naming the part and the
    path to use instead), or None. See the module docstring for the list."""
    why = common_refusal("pallas_tpu", vis, call, takes=("logits_soft_cap", "sinks"))
    if why is not None:
        return why
    if jnp.dtype(call.q.dtype) == jnp.float16:
        return f"{NAME} takes bfloat16 or float32 inputs (TPUs have no float16 units), got float16; use 'xla' or 'blockwise'"
    return None


@functools.lru_cache(maxsize=64)
def _kernel(n_pad, s_pad, heads, is_causal, window, offset, block_q, block_kv, soft_cap, interpret):
    """The splash kernel for one static configuration (cached: its mask tables are
    built in NumPy at trace time)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    shape = (n_pad, s_pad)
    if window is not None:
        left, right = window
        if is_causal:  # both: the window's right side clipped at the diagonal
            right = 0 if right is None else min(right, 0)
        mask = sm.LocalMask(shape, (left, right), offset=offset)
    elif is_causal:
        mask = sm.CausalMask(shape, offset=offset)
    else:
        mask = sm.FullMask(shape)
    sizes = sk.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv,
                          block_q_dkv=block_q, block_kv_dkv=block_kv, block_kv_dkv_compute=block_kv,
                          block_q_dq=block_q, block_kv_dq=block_kv)
    return sk.make_splash_mha(sm.MultiHeadMask([mask] * heads), block_sizes=sizes, head_shards=1, q_seq_shards=1,
                              attn_logits_soft_cap=soft_cap, interpret=interpret)


@jax.custom_vjp
def _float32_cotangent(x):
    """`x` (float32); its cotangent cast to float32 (splash returns the sinks' in q's
    dtype, which `grad` would pass on as the gradient of a float32 array)."""
    return x


_float32_cotangent.defvjp(lambda x: (x, None), lambda _, g: (g.astype(jnp.float32),))


def run(q, k, v, vis: _masking.Visibility, *, scale: float, interpret: bool) -> jax.Array:
    """Splash attention of finite q `(B…, H, N, D)`, k `(B…, K, S, D)`,
    v `(B…, K, S, Dv)` under `vis` (for which `refusal` returned None).

    Returns:
      out `(B…, H, N, Dv)` in q's dtype. Rows with no visible key hold anything (the
      dispatcher fills them).
    """
    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import SegmentIds

    batch, qf, kf, vf = flat_batch(q, k, v)  # (b, H, N, D), (b, K, S, D), (b, K, S, Dv)
    _, h, n, _ = qf.shape
    s = kf.shape[2]
    block_q = min(DEFAULT_BLOCK, round_up(n, MIN_BLOCK))
    block_kv = min(DEFAULT_BLOCK, round_up(s, MIN_BLOCK))
    n_pad, s_pad = round_up(n, block_q), round_up(s, block_kv)
    # Built eagerly even under jit: the kernel is cached across calls, and tables it made
    # inside one trace would leak that trace's tracers into the next.
    with jax.ensure_compile_time_eval():
        kernel = _kernel(n_pad, s_pad, h, bool(vis.is_causal), None if vis.window is None else tuple(vis.window),
                         static_int(vis.offset), block_q, block_kv, vis.logits_soft_cap, bool(interpret))
    ids = None
    if vis.segmented or vis.q_lengths is not None or vis.kv_lengths is not None or s_pad > s:
        ids = kernel_segment_ids(vis, batch, n_pad, s_pad)  # (b, n_pad), (b, s_pad)
    # One rounding to q's dtype (the scale itself is not rounded to bfloat16 first).
    qf = (qf.astype(jnp.float32) * scale).astype(q.dtype)
    qf = jnp.pad(qf, ((0, 0), (0, 0), (0, n_pad - n), (0, 0)))
    kf, vf = (jnp.pad(x, ((0, 0), (0, 0), (0, s_pad - s), (0, 0))) for x in (kf, vf))

    # Splash adds the sinks to its denominators itself, in float32 and in the scaled-logit
    # space (as the description's), and returns their gradient, in q's dtype.
    sinks = None if vis.sinks is None else _float32_cotangent(vis.sinks.astype(jnp.float32))

    def one(qb, kb, vb, seg, sinks):
        return kernel(qb, kb, vb, segment_ids=None if seg is None else SegmentIds(q=seg[0], kv=seg[1]), sinks=sinks)

    out = without_x64(jax.vmap(one, in_axes=(0, 0, 0, 0, None)))(qf, kf, vf, ids, sinks)  # (b, H, n_pad, Dv)
    return out[:, :, :n].reshape(batch + (h, n, vf.shape[-1])).astype(q.dtype)
