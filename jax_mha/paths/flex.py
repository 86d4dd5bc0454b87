"""The library's own flash kernel in Pallas: the whole description and the mods, forward
and backward, skipping blocks by a schedule (FlexAttention for JAX).

One kernel body serves `"pallas_gpu"` (Triton) and `"pallas_tpu"` (Mosaic), and runs
in interpret mode on a CPU. Per `(batch, query head, query block)` program it walks the
key blocks the block schedule lists (`schedules.build_schedule`: fully visible blocks
skip the per-element mask, partial ones evaluate it), forms each block's logits in the
library's order (`_masking`: scale · q·kᵀ → + bias → `score_mod` → soft cap → masked)
and folds them in with the one online-softmax step (`_softmax.online_step`).

* Mods run inside the kernel on index tiles (`kernel_mods.evaluate`): what they close
  over is passed in whole and read where indexed, at the tile's indices.
* GQA is native: the program of query head h reads kv head h // G; K/V are never
  repeated. Any N and S: both are padded to whole blocks and the padding keys masked
  inside (a padded query row is computed and dropped); the mods see indices clamped to
  the real lengths.
* Outputs: `out (b, H, N, Dv)`, the row log-sum-exp `lse (b, H, N)` float32 (-inf on a
  row with nothing visible) and `touched (b, H, N)` (a row saw a key marked bad).
  Sinks are merged after the kernel from its lse (`_softmax.with_sinks`).
* Backward (FlashAttention-2): `Δ = rowsum(g ⊙ out) - g_lse`; a dq program per query
  block (it also writes the bias gradient's blocks and adds the gradients of the
  floating values `score_mod` read), a dk/dv program per key block that walks the
  transposed schedule over the G query heads of its kv head.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_mha import _masking
from jax_mha._softmax import logits_grad, online_step, output_delta
from jax_mha.paths import kernel_mods, schedules
from jax_mha.paths.engine import Mod, trace_mod
from jax_mha.paths.kernel_common import kernel_segment_ids, static_int

_LOG2E = math.log2(math.e)
BLOCK = 64  # queries and keys per block
# 64 x 64 on an H200 (docs/results/composed_attention.md): 64 x 128 ran plain causal
# 0.88x the time at D = 64 but packed documents by a mask_mod 2.1x and the soft cap
# 1.07x; at D = 128 it was 1.7x the time on plain causal.
NUM_WARPS, NUM_STAGES = 4, 2  # Triton's launch: warps per program, software-pipelined stages
MIN_BLOCK = 16  # the smallest tile Triton's tl.dot takes
# The parts of a call (`jax_mha._path.PARTS`) the kernel expresses.
TAKES = frozenset({"bias", "score_mod", "mask_mod", "logits_soft_cap", "sinks", "window", "kv_lengths", "q_lengths",
                   "segment_ids", "query_offset", "traced_offset", "return_residual"})
_NT = (((1,), (1,)), ((), ()))  # a · bᵀ
_TN = (((0,), (0,)), ((), ()))  # aᵀ · b


class Config(NamedTuple):
    """The static description of one kernel call."""

    n: int
    s: int
    q_block: int
    k_block: int
    batch: int  # b, the flattened batch
    kv_heads: int  # K
    groups: int  # G = H // K
    scale: float
    is_causal: bool
    window: _masking.Window | None
    offset: int | None  # key position of query row 0; None: traced (the kernel reads `Inputs.pos`)
    start: int | None  # the mods' q_idx of row 0; None: traced
    soft_cap: float | None
    score_mod: Mod | None
    mask_mod: Mod | None
    bias_shape: tuple | None  # (Bb, Hb) of the bias, each 1 or the full size
    q_lengths: bool
    kv_lengths: bool
    segmented: bool
    sched_shape: tuple  # (Bs, Hs) of the schedule
    score_grads: tuple  # per score_mod const: whether it takes a gradient (floating)
    interpret: bool
    backend: str  # "triton" (a GPU) or "mosaic" (a TPU), when compiled

    @property
    def atomic(self) -> bool:
        """Accumulated gradients by atomic adds: compiled for a GPU, whose programs run
        at once (interpreted or on a TPU they run one after another)."""
        return self.backend == "triton" and not self.interpret

    @property
    def n_pad(self) -> int:
        return -(-self.n // self.q_block) * self.q_block

    @property
    def s_pad(self) -> int:
        return -(-self.s // self.k_block) * self.k_block



class Inputs(NamedTuple):
    """The kernel's array inputs besides q, k, v (padded, flattened over the batch)."""

    bad: jax.Array  # float32 (b, K, S_pad): 1 on keys whose key or value was not finite
    bias: jax.Array | None  # (Bb, Hb, N_pad, S_pad)
    q_len: jax.Array | None  # int32 (b,)
    kv_len: jax.Array | None  # int32 (b,)
    pos: jax.Array | None  # int32 (2,): the traced offset and start, when either is traced
    q_ids: jax.Array | None  # int32 (b, N_pad)
    kv_ids: jax.Array | None  # int32 (b, S_pad)
    schedule: schedules.BlockSchedule
    score_consts: tuple
    mask_consts: tuple


def _refs_of(cfg: Config, refs):
    """Names for the kernel's input refs, in `_flat_inputs`' order."""
    it = iter(refs)
    take = lambda present: next(it) if present else None
    sched = tuple(next(it) for _ in range(6))
    out = dict(sched=sched, q=next(it), k=next(it), v=next(it), bad=next(it), bias=take(cfg.bias_shape is not None),
               q_len=take(cfg.q_lengths), kv_len=take(cfg.kv_lengths), pos=take(_traced(cfg)), q_ids=take(cfg.segmented),
               kv_ids=take(cfg.segmented))
    out["score"] = tuple(next(it) for _ in range(0 if cfg.score_mod is None else len(cfg.score_mod.jaxpr.constvars)))
    out["mask"] = tuple(next(it) for _ in range(0 if cfg.mask_mod is None else len(cfg.mask_mod.jaxpr.constvars)))
    return out, list(it)


def _flat_inputs(q, k, v, x: Inputs) -> list:
    sched = x.schedule
    parts = [sched.kv_count, sched.kv_index, sched.kv_full, sched.q_count, sched.q_index, sched.q_full, q, k, v,
             x.bad, x.bias, x.q_len, x.kv_len, x.pos, x.q_ids, x.kv_ids, *x.score_consts, *x.mask_consts]
    return [p for p in parts if p is not None]


def _traced(cfg: Config) -> bool:
    return cfg.offset is None or cfg.start is None


def _pattern(cfg: Config, r) -> _masking.Pattern:
    """Causality and the window at the call's offset (static, or read in the kernel)."""
    offset = r["pos"][0] if cfg.offset is None else cfg.offset
    return _masking.Pattern(cfg.n, cfg.s, cfg.is_causal, cfg.window, q_offset=offset)


def _start(cfg: Config, r):
    return r["pos"][1] if cfg.start is None else cfg.start


def _whole(x):
    """A BlockSpec giving every program the whole array (indexed inside)."""
    return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


class _Tile(NamedTuple):
    """One (query block, key block) pair of one (batch, head)."""

    b: jax.Array
    h: jax.Array
    i: jax.Array  # query block
    j: jax.Array  # key block


def _sched_at(cfg: Config, tile_b, h):
    """The schedule's (batch, head) indices for a program (0 where it broadcasts)."""
    bs, hs = cfg.sched_shape
    return (tile_b if bs > 1 else 0), (h if hs > 1 else 0)


def _logits(cfg: Config, r, q, k, t: _Tile, full, given=None):
    """`(s0, s1, masked s, reads)`: the block's logits before the mods (scaled, biased),
    after `score_mod`, and after the soft cap and the mask; `reads` what score_mod read."""
    bq, bk = cfg.q_block, cfg.k_block
    s0 = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32) * cfg.scale
    if r["bias"] is not None:
        bb, hb = cfg.bias_shape
        s0 = s0 + r["bias"][t.b if bb > 1 else 0, t.h if hb > 1 else 0, pl.ds(t.i * bq, bq),
                            pl.ds(t.j * bk, bk)].astype(jnp.float32)
    rows = kernel_mods.lane_indices(t.i * bq, bq, 0, cfg.n)
    cols = kernel_mods.lane_indices(t.j * bk, bk, 1, cfg.s)
    heads = (jnp.full((1, 1), t.b, jnp.int32), jnp.full((1, 1), t.h, jnp.int32))
    s1, reads = s0, []
    if cfg.score_mod is not None:
        s1, reads = kernel_mods.evaluate(cfg.score_mod, r["score"], (s0, *heads, rows + _start(cfg, r), cols), given)
        s1 = s1.astype(jnp.float32)
    s2 = _masking.soft_cap(s1, cfg.soft_cap)
    masked = lax.cond(full != 0, lambda: s2, lambda: jnp.where(_visible(cfg, r, t, heads, rows, cols), s2, -jnp.inf))
    return s0, s1, masked, reads


def _visible(cfg: Config, r, t: _Tile, heads, rows, cols):
    """bool `(bq, bk)`: the pairs of a partial block that may attend."""
    bq, bk = cfg.q_block, cfg.k_block
    raw_rows = t.i * bq + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
    raw_cols = t.j * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    ok = jnp.broadcast_to(raw_cols < cfg.s, (bq, bk))
    pattern = _masking.positional(_pattern(cfg, r), raw_rows, raw_cols)
    if pattern is not None:
        ok = ok & pattern
    if r["q_len"] is not None:
        ok = ok & (raw_rows < r["q_len"][t.b])
    if r["kv_len"] is not None:
        ok = ok & (raw_cols < r["kv_len"][t.b])
    if r["q_ids"] is not None:
        q_ids = r["q_ids"][t.b, pl.ds(t.i * bq, bq)][:, None]
        kv_ids = r["kv_ids"][t.b, pl.ds(t.j * bk, bk)][None, :]
        ok = ok & (q_ids == kv_ids)
    if cfg.mask_mod is not None:
        allowed, _ = kernel_mods.evaluate(cfg.mask_mod, r["mask"], (*heads, rows + _start(cfg, r), cols))
        ok = ok & allowed
    return ok


def exp_of(cfg: Config):
    """The exponential of the kernel's scores. On Triton `exp2(x · log2 e)`: Pallas
    lowers float32 `exp` to libdevice's accurate `__nv_expf` (several instructions
    around one `ex2.approx`) and `exp2` to `__nv_exp2f` (the `ex2.approx` alone), and a
    tile's exponentials are most of its elementwise work beside the two matmuls, as in
    every Triton FlashAttention. Relative error of order 1e-7 · |x|, far inside a
    bfloat16 kernel's; elsewhere (Mosaic) `exp`."""
    return (lambda x: jnp.exp2(x * _LOG2E)) if cfg.backend == "triton" else jnp.exp


def _touched(touched, s, bad):
    """Each row's running flag of a visible bad key, updated by one block: `s (bq, bk)`
    its logits (-inf where masked), `bad (bk,)` its keys' flags. Evaluated per pair only
    when the block holds a bad key, so a call without one (nearly every call) pays a
    reduction over `bk` flags per block, not three passes over its `bq × bk` pairs."""
    seen = lambda: jnp.maximum(touched, jnp.max(jnp.where(s > -jnp.inf, bad[None, :], 0.0), axis=1))
    return lax.cond(jnp.max(bad) > 0.0, seen, lambda: touched)


def _forward_kernel(cfg: Config, *refs):
    r, (o_ref, lse_ref, touched_ref) = _refs_of(cfg, refs)
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv_count, kv_index, kv_full = r["sched"][:3]
    sb, sh = _sched_at(cfg, b, h)
    kv_head = h // cfg.groups
    bq, bk = cfg.q_block, cfg.k_block
    q = r["q"][b, h, pl.ds(i * bq, bq), :]

    def body(t, carry):
        m, l, acc, touched = carry
        j, full = kv_index[sb, sh, i, t], kv_full[sb, sh, i, t]
        k = r["k"][b, kv_head, pl.ds(j * bk, bk), :]
        _, _, s, _ = _logits(cfg, r, q, k, _Tile(b, h, i, j), full)
        m, l, p, correction = online_step(m, l, s, exp_of(cfg))
        v = r["v"][b, kv_head, pl.ds(j * bk, bk), :]
        acc = acc * correction[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m, l, acc, _touched(touched, s, r["bad"][b, kv_head, pl.ds(j * bk, bk)])

    dv = o_ref.shape[-1]
    init = (jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32), jnp.zeros((bq, dv), jnp.float32),
            jnp.zeros((bq,), jnp.float32))
    m, l, acc, touched = lax.fori_loop(0, kv_count[sb, sh, i], body, init)
    seen = l > 0.0
    o_ref[...] = (acc / jnp.where(seen, l, 1.0)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    touched_ref[...] = touched


def _backward_tile(cfg: Config, r, q, k, v, g, lse, delta, t: _Tile, full, with_reads: bool):
    """`(p, ds0, reads, read cotangents)` of one block: the weights and the logits'
    gradient before the mods (`ds0`, what q, k and the bias receive)."""
    s0, s1, s, reads = _logits(cfg, r, q, k, t, full)
    p = exp_of(cfg)(s - jnp.where(lse == -jnp.inf, jnp.inf, lse)[:, None])
    dp = lax.dot_general(g, v, _NT, preferred_element_type=jnp.float32)
    ds = logits_grad(p, dp, delta[:, None])  # the gradient of the capped logits
    if cfg.soft_cap is not None:
        ds = ds * (1.0 - jnp.square(jnp.tanh(s1 / cfg.soft_cap)))
    if cfg.score_mod is None:
        return p, ds, reads, ()
    heads = (jnp.full((1, 1), t.b, jnp.int32), jnp.full((1, 1), t.h, jnp.int32))
    rows = kernel_mods.lane_indices(t.i * cfg.q_block, cfg.q_block, 0, cfg.n)
    cols = kernel_mods.lane_indices(t.j * cfg.k_block, cfg.k_block, 1, cfg.s)
    values = tuple(read.values for read in reads)

    def mod(s0, *values):
        out, _ = kernel_mods.evaluate(cfg.score_mod, r["score"], (s0, *heads, rows + _start(cfg, r), cols), values)
        return out.astype(jnp.float32)

    if not with_reads:
        _, pull = jax.vjp(lambda x: mod(x, *values), s0)
        return p, pull(ds)[0], reads, ()
    _, pull = jax.vjp(mod, s0, *values)
    ds0, *cts = pull(ds)
    return p, ds0, reads, tuple(cts)


def _dq_kernel(cfg: Config, *refs):
    r, rest = _refs_of(cfg, refs)
    g_ref, lse_ref, delta_ref, *outs = rest
    # The zero-initialised inputs aliased to the accumulated outputs come first: skip them.
    dq_ref, dbias_ref, const_refs = _backward_outs(cfg, outs[_accumulated(cfg):])
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv_count, kv_index, kv_full = r["sched"][:3]
    sb, sh = _sched_at(cfg, b, h)
    kv_head = h // cfg.groups
    bq, bk = cfg.q_block, cfg.k_block
    rows = pl.ds(i * bq, bq)
    q, g = r["q"][b, h, rows, :], g_ref[b, h, rows, :]
    lse, delta = lse_ref[b, h, rows], delta_ref[b, h, rows]
    with_reads = any(ref is not None for ref in const_refs)

    def body(t, dq):
        j, full = kv_index[sb, sh, i, t], kv_full[sb, sh, i, t]
        cols = pl.ds(j * bk, bk)
        k, v = r["k"][b, kv_head, cols, :], r["v"][b, kv_head, cols, :]
        tile = _Tile(b, h, i, j)
        _, ds0, reads, cts = _backward_tile(cfg, r, q, k, v, g, lse, delta, tile, full, with_reads)
        if dbias_ref is not None:
            _add_bias_grad(cfg, dbias_ref, tile, ds0)
        if with_reads:
            kernel_mods.scatter_add(const_refs, reads, cts, cfg.atomic)
        return dq + jnp.dot(ds0.astype(k.dtype), k, preferred_element_type=jnp.float32)

    dq = lax.fori_loop(0, kv_count[sb, sh, i], body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _accumulated(cfg: Config) -> int:
    """How many of the dq kernel's outputs are accumulated: the bias gradient and those
    of the floating values score_mod reads."""
    return (cfg.bias_shape is not None) + sum(cfg.score_grads)


def _backward_outs(cfg: Config, outs):
    """`(dq ref, dbias ref or None, per score_mod const its gradient ref or None)`."""
    it = iter(outs)
    dq = next(it)
    dbias = next(it) if cfg.bias_shape is not None else None
    consts = tuple(next(it) if takes else None for takes in cfg.score_grads)
    return dq, dbias, consts


def _add_bias_grad(cfg: Config, dbias_ref, t: _Tile, ds0):
    """The bias gradient of one block: stored when the bias has this (batch, head)'s own
    entry, else added to the shared one (atomically on a GPU)."""
    bb, hb = cfg.bias_shape
    at = (t.b if bb > 1 else 0, t.h if hb > 1 else 0, pl.ds(t.i * cfg.q_block, cfg.q_block),
          pl.ds(t.j * cfg.k_block, cfg.k_block))
    if bb == cfg.batch and hb == cfg.groups * cfg.kv_heads:  # no other program writes this block
        dbias_ref[at] = ds0
    elif cfg.atomic:
        from jax.experimental.pallas import triton as plgpu

        plgpu.atomic_add(dbias_ref, at, ds0)
    else:
        dbias_ref[at] = dbias_ref[at] + ds0


def _dkv_kernel(cfg: Config, *refs):
    r, (g_ref, lse_ref, delta_ref, dk_ref, dv_ref) = _refs_of(cfg, refs)
    b, kv_head, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q_count, q_index, q_full = r["sched"][3:]
    bq, bk = cfg.q_block, cfg.k_block
    cols = pl.ds(j * bk, bk)
    k, v = r["k"][b, kv_head, cols, :], r["v"][b, kv_head, cols, :]

    def head(g_in_group, acc):
        h = kv_head * cfg.groups + g_in_group
        sb, sh = _sched_at(cfg, b, h)

        def body(t, acc):
            dk, dv = acc
            i, full = q_index[sb, sh, j, t], q_full[sb, sh, j, t]
            rows = pl.ds(i * bq, bq)
            q, g = r["q"][b, h, rows, :], g_ref[b, h, rows, :]
            p, ds0, _, _ = _backward_tile(cfg, r, q, k, v, g, lse_ref[b, h, rows], delta_ref[b, h, rows],
                                          _Tile(b, h, i, j), full, False)
            dv = dv + lax.dot_general(p.astype(g.dtype), g, _TN, preferred_element_type=jnp.float32)
            dk = dk + lax.dot_general(ds0.astype(q.dtype), q, _TN, preferred_element_type=jnp.float32)
            return dk, dv

        return lax.fori_loop(0, q_count[sb, sh, j], body, acc)

    init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dk, dv = lax.fori_loop(0, cfg.groups, head, init)
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _call(cfg: Config, kernel, grid, inputs, out_shape, out_specs, aliases=None):
    with jax.enable_x64(False):
        return pl.pallas_call(functools.partial(kernel, cfg), grid=grid, in_specs=[_whole(x) for x in inputs],
                              out_specs=out_specs, out_shape=out_shape, interpret=cfg.interpret,
                              input_output_aliases=aliases or {}, name=kernel.__name__.strip("_"),
                              compiler_params=_compiler_params(cfg))(*inputs)


def _compiler_params(cfg: Config):
    if cfg.backend == "triton":
        from jax.experimental.pallas import triton as plgpu

        return plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.CompilerParams(dimension_semantics=("arbitrary",) * 3)


def _forward(cfg: Config, q, k, v, x: Inputs):
    b, h, n_pad, _ = q.shape
    dv = v.shape[-1]
    rows = pl.BlockSpec((None, None, cfg.q_block), lambda b, h, i: (b, h, i))
    out_shape = (jax.ShapeDtypeStruct((b, h, n_pad, dv), q.dtype),
                 jax.ShapeDtypeStruct((b, h, n_pad), jnp.float32), jax.ShapeDtypeStruct((b, h, n_pad), jnp.float32))
    out_specs = (pl.BlockSpec((None, None, cfg.q_block, dv), lambda b, h, i: (b, h, i, 0)), rows, rows)
    return _call(cfg, _forward_kernel, (b, h, n_pad // cfg.q_block), _flat_inputs(q, k, v, x), out_shape, out_specs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(cfg: Config, q, k, v, x: Inputs):
    return _forward(cfg, q, k, v, x)


def _attend_fwd(cfg: Config, q, k, v, x: Inputs):
    out, lse, touched = _forward(cfg, q, k, v, x)
    return (out, lse, touched), (q, k, v, x, out, lse)


def _attend_bwd(cfg: Config, saved, cotangents):
    q, k, v, x, out, lse = saved
    g, g_lse, _ = cotangents
    delta = output_delta(g.astype(jnp.float32), out.astype(jnp.float32), g_lse)
    inputs = _flat_inputs(q, k, v, x) + [g.astype(q.dtype), lse, delta]
    dq, dbias, dconsts = _dq(cfg, q, inputs, x)
    dk, dv = _dkv(cfg, k, v, inputs)
    d_inputs = Inputs(None, dbias, None, None, None, None, None, None, dconsts, tuple(None for _ in x.mask_consts))
    return dq, dk, dv, d_inputs


def _dq(cfg: Config, q, inputs, x: Inputs):
    b, h, n_pad, d = q.shape
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    out_specs = [pl.BlockSpec((None, None, cfg.q_block, d), lambda b, h, i: (b, h, i, 0))]
    aliases, extra = {}, []
    accumulated = [] if x.bias is None else [x.bias]
    accumulated += [c for c, takes in zip(x.score_consts, cfg.score_grads) if takes]
    for c in accumulated:  # zero-initialised outputs, written block by block or added to
        aliases[len(inputs) + len(extra)] = len(out_shape)
        extra.append(jnp.zeros(c.shape, jnp.float32))
        out_shape.append(jax.ShapeDtypeStruct(c.shape, jnp.float32))
        out_specs.append(_whole(c))
    outs = _call(cfg, _dq_kernel, (b, h, n_pad // cfg.q_block), inputs + extra, tuple(out_shape), tuple(out_specs),
                 aliases)
    dq, rest = outs[0], list(outs[1:])
    dbias = None if x.bias is None else rest.pop(0).astype(x.bias.dtype)
    dconsts = tuple(rest.pop(0).astype(c.dtype) if takes else None for c, takes in zip(x.score_consts, cfg.score_grads))
    return dq, dbias, dconsts


def _dkv(cfg: Config, k, v, inputs):
    b, kv_heads, s_pad, d = k.shape
    keys = lambda width: pl.BlockSpec((None, None, cfg.k_block, width), lambda b, h, j: (b, h, j, 0))
    out_shape = (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype))
    return _call(cfg, _dkv_kernel, (b, kv_heads, s_pad // cfg.k_block), inputs, out_shape,
                 (keys(d), keys(v.shape[-1])))


_attend.defvjp(_attend_fwd, _attend_bwd)


def attend(q, k, v, bad_kv, vis: _masking.Visibility, *, scale: float, q_block: int, k_block: int,
           interpret: bool, backend: str):
    """The kernel on q `(B…, H, N, D)`, k `(B…, K, S, D)`, v `(B…, K, S, Dv)` (finite)
    under `vis` (its sinks excepted: merged by the caller), `bad_kv` bool `(B…, K, S)`.

    Returns:
      `(out (B…, H, N, Dv), lse (B…, H, N) float32, touched (B…, H, N) bool)`; a row
      with no visible key has lse -inf and out 0.
    """
    batch = tuple(jnp.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3]))
    b = math.prod(batch)
    flat = lambda x: jnp.broadcast_to(x, batch + x.shape[-3:]).reshape((b,) + x.shape[-3:])
    qf, kf, vf = flat(q), flat(k), flat(v)
    h, n, s = qf.shape[1], qf.shape[2], kf.shape[2]
    score_mod, score_consts = _trace(vis.score_mod, q_block, k_block, score=True)
    mask_mod, mask_consts = _trace(vis.mask_mod, q_block, k_block, score=False)
    schedule = vis.schedule if fits(vis.schedule, vis, b, h, q_block, k_block) else (
        schedules.build_schedule(vis, q_block, k_block))
    cfg = _config(vis, batch, h, kf.shape[1], scale, (q_block, k_block), interpret, backend, score_mod, mask_mod,
                  score_consts, schedule.kv_count.shape[:2])
    pad = lambda x, size, axis, value=0: jnp.pad(x, [(0, size - x.shape[axis]) if a == axis else (0, 0)
                                                     for a in range(x.ndim)], constant_values=value)
    qf = pad(qf, cfg.n_pad, 2)
    kf, vf = pad(kf, cfg.s_pad, 2), pad(vf, cfg.s_pad, 2)
    bad = pad(jnp.broadcast_to(bad_kv, batch + bad_kv.shape[-2:]).reshape(b, -1, s).astype(jnp.float32), cfg.s_pad, 2)
    pos = jnp.stack([jnp.asarray(vis.offset, jnp.int32), jnp.asarray(vis.start, jnp.int32)]) if _traced(cfg) else None
    x = Inputs(bad, _bias(vis, cfg, batch), *_lengths(vis, batch), pos, *_ids(vis, batch, cfg),
               schedule=schedule, score_consts=score_consts, mask_consts=mask_consts)
    out, lse, touched = _attend(cfg, qf, kf, vf, x)
    unflat = lambda y: y[:, :, :n].reshape(batch + y.shape[1:2] + (n,) + y.shape[3:])
    return unflat(out), unflat(lse), unflat(touched) > 0


def blocks(n: int, s: int) -> tuple[int, int]:
    """`(q_block, k_block)`: `BLOCK` queries by `BLOCK` keys, or a sequence's own length
    rounded up to a power of two (at least 16: Triton's smallest dot tile) when shorter."""
    pow2 = lambda x: max(MIN_BLOCK, 1 << max(int(x) - 1, 0).bit_length())
    return min(BLOCK, pow2(n)), min(BLOCK, pow2(s))


def fits(schedule, vis: _masking.Visibility, batch: int, heads: int, q_block: int, k_block: int) -> bool:
    """Whether a given `block_schedule` serves this call: the same lengths and blocks,
    and a batch and head count it covers (else the kernel builds its own)."""
    if schedule is None:
        return False
    bs, hs = schedule.kv_count.shape[:2]
    return ((schedule.n, schedule.s, schedule.q_block, schedule.k_block) == (vis.n, vis.s, q_block, k_block)
            and bs in (1, batch) and hs in (1, heads))


def _trace(mod, bq: int, bk: int, score: bool):
    """`(Mod, consts)` of a mod traced for the kernel's `(bq, bk)` tiles (the score
    float32, b and h `(1, 1)`, q_idx `(bq, 1)`, kv_idx `(1, bk)`), or `(None, ())`."""
    if mod is None:
        return None, ()
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    idx = (i32(1, 1), i32(1, 1), i32(bq, 1), i32(1, bk))
    avals = ((jax.ShapeDtypeStruct((bq, bk), jnp.float32),) if score else ()) + idx
    return trace_mod(mod, *avals)


def _config(vis, batch, h, kv_heads, scale, blocks, interpret, backend, score_mod, mask_mod, score_consts,
            sched) -> Config:
    bias_shape = None
    if vis.bias is not None:
        bias = lax.broadcast_to_rank(vis.bias, len(batch) + 3)
        bias_shape = (1 if all(d == 1 for d in bias.shape[:-3]) else math.prod(batch), bias.shape[-3])
    return Config(
        n=vis.n, s=vis.s, q_block=blocks[0], k_block=blocks[1], batch=math.prod(batch), kv_heads=kv_heads,
        groups=h // kv_heads, scale=float(scale), is_causal=bool(vis.is_causal), window=vis.window,
        offset=static_int(vis.offset), start=static_int(vis.start), soft_cap=vis.logits_soft_cap, score_mod=score_mod,
        mask_mod=mask_mod, bias_shape=bias_shape, q_lengths=vis.q_lengths is not None,
        kv_lengths=vis.kv_lengths is not None, segmented=vis.segmented, sched_shape=tuple(sched),
        score_grads=tuple(jnp.issubdtype(c.dtype, jnp.floating) for c in score_consts), interpret=interpret,
        backend=backend)


def _bias(vis, cfg: Config, batch):
    """The bias as `(Bb, Hb, N_pad, S_pad)`, zero-padded, or None."""
    if vis.bias is None:
        return None
    bb, hb = cfg.bias_shape
    bias = lax.broadcast_to_rank(vis.bias, len(batch) + 3)
    bias = jnp.broadcast_to(bias, (batch if bb > 1 else (1,) * len(batch)) + (hb, cfg.n, cfg.s))
    bias = bias.reshape((bb, hb, cfg.n, cfg.s))
    return jnp.pad(bias, ((0, 0), (0, 0), (0, cfg.n_pad - cfg.n), (0, cfg.s_pad - cfg.s)))


def _lengths(vis, batch):
    """int32 `(b,)` q and kv lengths (or None)."""
    flat = lambda x: None if x is None else jnp.broadcast_to(x.reshape(x.shape[:-3]), batch).reshape(-1)
    return flat(vis.q_lengths), flat(vis.kv_lengths)


def _ids(vis, batch, cfg: Config):
    """int32 `(b, N_pad)` and `(b, S_pad)` segment ids, padding keys a never-matching id
    (`kernel_common.kernel_segment_ids`), or `(None, None)`."""
    if not vis.segmented:
        return None, None
    return kernel_segment_ids(vis, batch, cfg.n_pad, cfg.s_pad)
