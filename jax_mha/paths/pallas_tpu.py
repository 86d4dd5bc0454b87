"""`implementation="pallas_tpu"`: the one attention description translated to splash
attention (`jax.experimental.pallas.ops.tpu.splash_attention`, the kernel MaxText uses)
for what splash takes (`SPLASH_TAKES`), and the library's own kernel (`flex`, its Mosaic
form) for the composed calls splash cannot take: an additive bias, the mods,
`return_residual=True` (the log-sum-exp), a traced query offset, with 128 x 128 blocks
(`flex.tpu_blocks`). Compiled for a TPU, a mod that reads an array it closes over at an
index computed from its arguments (a relative-position table, `table[h, bucket(kv - q)]`:
a gather) is refused by name (`limits`); off a TPU it runs in interpret mode.

Translation: causal and local windows become splash's lazy `CausalMask` / `LocalMask`
(no pattern: `FullMask`) with `offset` = the description's query offset (query i at key
position i + offset, `S - N` by default, or a static `q_offset`). Splash sorts every
`(block_q, block_kv)` block into empty, full or partial before the call; the masks here
(`_ranged_mask`) answer that for the blocks the description's `key_range` shows wholly
visible or wholly hidden without evaluating them, so building a kernel costs about one
mask evaluation per diagonal block, not N x S; the kernel evaluates the pattern itself
in the partial blocks, and no `(N, S)` array exists on the host. Segment ids, q/kv
lengths and the padding of S to the block size fold into splash's `SegmentIds`
(`kernel_segment_ids`), passed only when a call has segments or lengths, or when a
real query could see a padding key (the causal pattern alone hides them).
GQA/MQA runs natively (splash groups `H // K` consecutive query heads per kv head);
logits_soft_cap is splash's `attn_logits_soft_cap`; the scale is folded into q (splash
does not scale). Dv may differ from D. Attention sinks are splash's own `sinks` argument,
unchanged (they live in the scaled-logit space, which is what splash's logits are once
the scale is in q); splash's backward returns their gradient. The backward is splash's
fused kernel (dq, dk and dv in one pass) while S spans at most `FUSED_BWD_MAX_KV_BLOCKS`
key blocks: it writes one partial dq per key block, in q's dtype, and sums them after,
so beyond that the two-kernel backward (dq accumulated in float32) is used.

Meshes (`kernel_mesh`): under a mesh with axes "data" and/or "model" (the context mesh
of `jax.set_mesh` / `jax.sharding.use_mesh`, or the inputs' NamedSharding) the kernel
runs in a `shard_map`, the flattened batch split over "data" and the query and kv heads
over "model" (a Mosaic kernel cannot be partitioned automatically); `limits` names a
batch or a number of kv heads the axis does not divide.

Splash itself takes no bias, mods, traced offset or `return_residual=True` (it computes
the log-sum-exp, `save_residuals=True`, but its custom VJP then refuses to
differentiate, and an lse whose cotangent reaches q and k needs the backward kernels fed
`rowsum(o ∘ dO) - d lse`, which only its private functions take): those go to `flex`.
Refused (the path's refusal, one line naming the part, unless the path's decode kernel,
`pallas_tpu_decode`, takes a one-row call): a dense mask, return_weights, dropout,
float64 and float16 inputs, and on a TPU a mod's gather (above).

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
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_mha import _masking
from jax_mha._path import Path, fallback, parts
from jax_mha._softmax import close
from jax_mha.paths import flex
from jax_mha.paths.kernel_common import (
    flat_batch,
    kernel_mesh,
    kernel_run,
    kernel_segment_ids,
    mesh_refusal,
    pallas_limits,
    round_up,
    static_int,
    without_x64,
)

NAME = "implementation='pallas_tpu'"
# MaxText's default splash block (sa_block_q = sa_block_kv = 512); 128 is the smallest
# TPU tile, so short sequences use their own length rounded up to 128.
DEFAULT_BLOCK = 512
MIN_BLOCK = 128
# The fused backward keeps one partial dq `(H, N, D)` per key block: up to this many.
FUSED_BWD_MAX_KV_BLOCKS = 4


def limits(vis: _masking.Visibility, call: _masking.Call) -> str | None:
    """What the path cannot take beyond its parts (`PATH.takes`): float64 and float16
    inputs, on a TPU a mod's read the library's kernel has no TPU form for
    (`flex.tpu_refusal`), and a mesh whose axes do not divide the batch or kv heads; or None."""
    why = pallas_limits(NAME, call)
    if why is not None:
        return why
    if jnp.dtype(call.q.dtype) == jnp.float16:
        return f"{NAME} takes bfloat16 or float32 inputs (TPUs have no float16 units), got float16; {fallback()}"
    if call.platform == "tpu" and _own_kernel(vis, call):
        why = flex.tpu_refusal(vis)
        if why is None and kernel_mesh(call.q) is not None:  # splash alone runs in a shard_map
            why = "a call splash cannot take (the library's kernel runs in no shard_map yet) under a mesh"
        if why is not None:
            return f"{NAME} cannot take {why} on a TPU; {fallback()}"
    return mesh_refusal(NAME, call)


@functools.lru_cache(maxsize=16)
def _constant_block(value: bool, shape: tuple[int, int]) -> np.ndarray:
    """A read-only `shape` block of `value` whose `any()` and `all()` take no time
    (splash asks both of every block while it sorts them)."""
    block = np.broadcast_to(np.bool_(value), shape).view(_Constant)
    block.value = bool(value)
    return block


class _Constant(np.ndarray):
    """A broadcast constant block (`_constant_block`); views of it reduce as usual."""

    value = None

    def __array_finalize__(self, obj):
        self.value = None

    def any(self, *args, **kwargs):
        if self.value is None or args or kwargs:
            return super().any(*args, **kwargs)
        return self.value and self.size > 0

    def all(self, *args, **kwargs):
        if self.value is None or args or kwargs:
            return super().all(*args, **kwargs)
        return self.value or self.size == 0


@functools.cache
def _ranged_mask_class():
    """The class of `_ranged_mask` (built on first use: it subclasses splash's `Mask`)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    class RangedMask(sm.Mask):
        """A splash mask answering for the blocks its key ranges decide; `inner`
        (and its in-kernel `mask_function`, when it has one) for the rest."""

        def __init__(self, inner, lo, hi):
            self.inner, self.lo, self.hi = inner, lo, hi
            self.bounds = functools.lru_cache(maxsize=None)(self._bounds)
            if hasattr(inner, "mask_function"):
                self.q_sequence, self.mask_function = inner.q_sequence, inner.mask_function

        @property
        def shape(self):
            return self.inner.shape

        def _bounds(self, r0, r1):
            """`(max lo, min hi, min lo, max hi)` over rows `r0 … r1 - 1`."""
            lo, hi = self.lo[r0:r1], self.hi[r0:r1]
            return lo.max(), hi.min(), lo.min(), hi.max()

        def __getitem__(self, idx):
            rows, cols = idx
            if not isinstance(rows, slice) or not isinstance(cols, slice) or rows.step or cols.step:
                return self.inner[idx]
            (r0, r1), (c0, c1) = (sl.indices(size)[:2] for sl, size in zip(idx, self.shape))
            if r1 <= r0 or c1 <= c0:
                return self.inner[idx]
            lo_max, hi_min, lo_min, hi_max = self.bounds(r0, r1)
            if lo_max <= c0 and hi_min >= c1:  # every row sees every key of the block
                return _constant_block(True, (r1 - r0, c1 - c0))
            lo, hi = self.lo[r0:r1], self.hi[r0:r1]
            if hi_max <= c0 or lo_min >= c1 or np.all((hi <= c0) | (lo >= c1)):  # no row sees any
                return _constant_block(False, (r1 - r0, c1 - c0))
            return self.inner[idx]

        def __eq__(self, other):
            return type(other) is type(self) and self.inner == other.inner

        def __hash__(self):
            return hash((type(self), self.inner))

    return RangedMask


def _ranged_mask(inner, pattern: _masking.Pattern):
    """`inner` (a splash mask of shape `(n_pad, s_pad)`) with each row's visible keys
    `[lo, hi)` read from `pattern`'s `key_range` (causality and the window only)."""
    n_pad, s_pad = inner.shape
    rows = np.arange(n_pad)
    lo, hi = (np.broadcast_to(np.asarray(x), (n_pad,)) for x in _masking.key_range(pattern, rows, rows, s_pad))
    return _ranged_mask_class()(inner, lo, hi)


@functools.lru_cache(maxsize=64)
def _kernel(n_pad, s_pad, heads, is_causal, window, offset, block_q, block_kv, soft_cap, interpret, fused):
    """The splash kernel for one static configuration (cached: its block tables are
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
    pattern = _masking.Pattern(n_pad, s_pad, is_causal, None if window is None else _masking.Window(*window),
                               q_offset=offset)
    mask = _ranged_mask(mask, pattern)
    dq_blocks = {} if fused else dict(block_q_dq=block_q, block_kv_dq=block_kv)
    sizes = sk.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv,
                          block_q_dkv=block_q, block_kv_dkv=block_kv, block_kv_dkv_compute=block_kv,
                          use_fused_bwd_kernel=fused, **dq_blocks)
    kernel = sk.make_splash_mha(sm.MultiHeadMask([mask] * heads), block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                attn_logits_soft_cap=soft_cap, interpret=interpret)
    # Its block tables as NumPy constants: arrays made under one mesh context would carry
    # that mesh into every later call (and a shard_map cannot close over explicit ones).
    return jax.tree.map(np.asarray, kernel)


@jax.custom_vjp
def _float32_cotangent(x):
    """`x` (float32); its cotangent cast to float32 (splash returns the sinks' in q's
    dtype, which `grad` would pass on as the gradient of a float32 array)."""
    return x


_float32_cotangent.defvjp(lambda x: (x, None), lambda _, g: (g.astype(jnp.float32),))


def run(q, k, v, vis: _masking.Visibility, *, scale: float, interpret: bool) -> jax.Array:
    """Splash attention of finite q `(B…, H, N, D)`, k `(B…, K, S, D)`,
    v `(B…, K, S, Dv)` under `vis` (for which `refusal` returned None), in a
    `shard_map` over the mesh's "data" and "model" axes when there is one.

    Returns:
      out `(B…, H, N, Dv)` in q's dtype. Rows with no visible key hold anything (the
      dispatcher fills them).
    """
    batch, qf, kf, vf = flat_batch(q, k, v)  # (b, H, N, D), (b, K, S, D), (b, K, S, Dv)
    _, h, n, _ = qf.shape
    s = kf.shape[2]
    block_q = min(DEFAULT_BLOCK, round_up(n, MIN_BLOCK))
    block_kv = min(DEFAULT_BLOCK, round_up(s, MIN_BLOCK))
    n_pad, s_pad = round_up(n, block_q), round_up(s, block_kv)
    found = kernel_mesh(q)
    mesh, batch_axis, head_axis = (None, None, None) if found is None else found
    local_heads = h // (1 if head_axis is None else mesh.shape[head_axis])
    offset = static_int(vis.offset)
    # Built eagerly even under jit: the kernel is cached across calls, and tables it made
    # inside one trace would leak that trace's tracers into the next.
    with jax.ensure_compile_time_eval():
        kernel = _kernel(n_pad, s_pad, local_heads, bool(vis.is_causal),
                         None if vis.window is None else tuple(vis.window), offset, block_q, block_kv,
                         vis.logits_soft_cap, bool(interpret), s_pad // block_kv <= FUSED_BWD_MAX_KV_BLOCKS)
    pattern = _masking.Pattern(n, s, vis.is_causal, vis.window, q_offset=offset)
    seen_pad = s_pad > s and _masking.key_range(pattern, n - 1, n - 1, s_pad)[1] > s  # a real query sees padding
    arrays = {}
    if vis.segmented or vis.q_lengths is not None or vis.kv_lengths is not None or seen_pad:
        arrays["ids"] = kernel_segment_ids(vis, batch, n_pad, s_pad)  # (b, n_pad), (b, s_pad)
    # One rounding to q's dtype (the scale itself is not rounded to bfloat16 first).
    qf = (qf.astype(jnp.float32) * scale).astype(q.dtype)
    arrays["q"] = jnp.pad(qf, ((0, 0), (0, 0), (0, n_pad - n), (0, 0)))
    arrays["k"], arrays["v"] = (jnp.pad(x, ((0, 0), (0, 0), (0, s_pad - s), (0, 0))) for x in (kf, vf))
    # Splash adds the sinks to its denominators itself, in float32 and in the scaled-logit
    # space (as the description's), and returns their gradient, in q's dtype.
    if vis.sinks is not None:
        arrays["sinks"] = _float32_cotangent(vis.sinks.astype(jnp.float32))
    call = functools.partial(_call_kernel, kernel)
    if mesh is not None:
        specs = {"q": P(batch_axis, head_axis), "k": P(batch_axis, head_axis), "v": P(batch_axis, head_axis),
                 "ids": (P(batch_axis), P(batch_axis)), "sinks": P(head_axis)}
        specs = {name: specs[name] for name in arrays}
        call = jax.shard_map(call, mesh=mesh, in_specs=(specs,), out_specs=P(batch_axis, head_axis), check_vma=False)
        if set(mesh.explicit_axes) & {batch_axis, head_axis}:  # typed shardings: in to the specs, out as q was
            call = _resharded(call, mesh, specs, jax.typeof(arrays["q"]).sharding.spec)
    out = call(arrays)  # (b, H, n_pad, Dv)
    return out[:, :, :n].reshape(batch + (h, n, vf.shape[-1])).astype(q.dtype)


def _resharded(call, mesh, specs, out_spec):
    """`call(arrays)` with `arrays` resharded to `specs` on `mesh` first and its output
    to `out_spec` after (under explicit mesh axes a sharding is part of the type)."""
    on = lambda spec: jax.sharding.NamedSharding(mesh, spec)

    def run(arrays):
        arrays = jax.tree.map(lambda x, spec: jax.sharding.reshard(x, on(spec)), arrays, specs)
        return jax.sharding.reshard(call(arrays), on(out_spec))
    return run


def _call_kernel(kernel, arrays):
    """`kernel` on each sequence of `arrays` (`q (b, H, n_pad, D)`, `k`, `v`, and the
    optional `ids`, `sinks`), with 64-bit types off."""
    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import SegmentIds

    def one(qb, kb, vb, seg, sinks):
        return kernel(qb, kb, vb, segment_ids=None if seg is None else SegmentIds(q=seg[0], kv=seg[1]), sinks=sinks)

    return without_x64(jax.vmap(one, in_axes=(0, 0, 0, 0, None)))(
        arrays["q"], arrays["k"], arrays["v"], arrays.get("ids"), arrays.get("sinks"))


# Splash takes the pattern, lengths, segment ids, the soft-cap and sinks, and a static
# query offset; no per-pair values or functions, no log-sum-exp (see above).
SPLASH_TAKES = frozenset({"logits_soft_cap", "sinks", "window", "kv_lengths", "q_lengths", "segment_ids",
                          "query_offset"})
_splash = kernel_run(run)


def _own_kernel(vis: _masking.Visibility, call: _masking.Call) -> bool:
    """Whether the call needs the library's own kernel (`jax_mha.paths.flex`): a part splash
    does not take."""
    return not set(parts(vis, call)) <= SPLASH_TAKES


def _run(q, k, v, bad_kv, vis: _masking.Visibility, call: _masking.Call, *, scale: float, **options):
    """Splash for what it takes, else the library's own kernel (its Mosaic form; in
    interpret mode off a TPU)."""
    if not _own_kernel(vis, call):
        return _splash(q, k, v, bad_kv, vis, call, scale=scale, **options)
    q_block, k_block = flex.tpu_blocks(vis.n)
    with jax.numpy_dtype_promotion("standard"):
        out, lse, touched = flex.attend(q, k, v, bad_kv, vis, scale=scale, q_block=q_block, k_block=k_block,
                                         interpret=call.platform == "cpu", backend="mosaic")
    empty = lse == -jnp.inf
    out, lse = close(out.astype(_masking.compute_dtype(q.dtype)), lse, vis)
    return out, None, lse, empty, touched


# Compiled or interpreted, what the library's kernel takes (splash's parts among them:
# SPLASH_TAKES <= flex.TAKES); a mod's gather is refused on a TPU by `limits`.
PATH = Path("pallas_tpu", _run, platforms=("tpu",), interprets=True, limits=limits, takes=flex.TAKES)
refusal = PATH.refusal
