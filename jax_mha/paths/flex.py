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
  The rows are closed after the kernel, from its lse (`_softmax.close`).
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
from jax_mha._masking import EVERY_PART
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
# On a TPU: keys by 128, the lanes of a vreg (the minor axis of every score tile), and
# queries by 128 (splash's smallest block), or N rounded up to 16 (a bfloat16 sublane tile).
TPU_BLOCK, TPU_MIN_Q_BLOCK = 128, 16
# The parts of a call (`jax_mha._masking.PARTS`) the kernel expresses: all but those that
# need the whole weights, or a dense mask (an (N, S) array it would read block by block).
TAKES = EVERY_PART - {"return_weights", "dropout", "mask"}
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
    score_reads: tuple  # Mosaic: per score_mod const `(shape, forms)` (`kernel_mods.tpu_forms`); else ()
    mask_reads: tuple  # the same for mask_mod's consts
    interpret: bool | str  # False: compiled; True: Pallas' generic interpret mode; "tpu": TPU interpret mode
    backend: str  # "triton" (a GPU) or "mosaic" (a TPU), when compiled
    tpu_form: bool  # Mosaic's memory layout (`mosaic`): compiled or in TPU interpret mode, the mods' reads have one

    @property
    def atomic(self) -> bool:
        """Accumulated gradients by atomic adds: compiled for a GPU, whose programs run
        at once (interpreted or on a TPU they run one after another)."""
        return self.backend == "triton" and not self.interpret

    @property
    def mosaic(self) -> bool:
        """The TPU form of the kernel (compiled or in TPU interpret mode): the schedule and
        the scalars in SMEM, tiles copied from HBM into VMEM buffers (`_load`), row
        statistics and per-position vectors kept 2-D (`(rows, 1)`, `(1, keys)`)."""
        return self.tpu_form

    @property
    def n_pad(self) -> int:
        return -(-self.n // self.q_block) * self.q_block

    @property
    def s_pad(self) -> int:
        return -(-self.s // self.k_block) * self.k_block



class Inputs(NamedTuple):
    """The kernel's array inputs besides q, k, v (padded, flattened over the batch)."""

    bad: jax.Array  # float32 (b, K, S_pad) (Mosaic: (b, K, 1, S_pad)): 1 on keys whose key or value was not finite
    bad_blocks: jax.Array | None  # int32 (b, K, nk), Mosaic only: 1 on key blocks holding a bad key
    bias: jax.Array | None  # (Bb, Hb, N_pad, S_pad)
    q_len: jax.Array | None  # int32 (b,)
    kv_len: jax.Array | None  # int32 (b,)
    pos: jax.Array | None  # int32 (2,): the traced offset and start, when either is traced
    q_ids: jax.Array | None  # int32 (b, N_pad) (Mosaic: (b, N_pad, 1))
    kv_ids: jax.Array | None  # int32 (b, S_pad) (Mosaic: (b, 1, S_pad))
    schedule: schedules.BlockSchedule
    score_consts: tuple
    mask_consts: tuple


_SCHEDULE = ("kv_count", "kv_index", "kv_full", "q_count", "q_index", "q_full")
# Read as scalars: in SMEM on a TPU.
_SCALARS = frozenset(_SCHEDULE) | {"bad_blocks", "q_len", "kv_len", "pos"}


def _named_inputs(cfg: Config, q, k, v, x: Inputs) -> list:
    """`(name, array)` of the kernel's inputs, those absent (None) left out; a mod's
    consts are named `("score", i)` and `("mask", i)`, on Mosaic one input per form in
    which the kernel reads them, `("score", i, form)` (`_const_forms`)."""
    parts = [(name, getattr(x.schedule, name)) for name in _SCHEDULE]
    parts += [("q", q), ("k", k), ("v", v), ("bad", x.bad), ("bad_blocks", x.bad_blocks), ("bias", x.bias),
              ("q_len", x.q_len), ("kv_len", x.kv_len), ("pos", x.pos), ("q_ids", x.q_ids), ("kv_ids", x.kv_ids)]
    for kind, consts, reads in (("score", x.score_consts, cfg.score_reads), ("mask", x.mask_consts, cfg.mask_reads)):
        parts += _const_forms(cfg, kind, consts, reads) if cfg.mosaic else [((kind, i), c) for i, c in enumerate(consts)]
    return [(name, a) for name, a in parts if a is not None]


def _const_forms(cfg: Config, kind: str, consts, reads) -> list:
    """(Mosaic) `((kind, i, form), array)` per const and form it is read in: 32-bit in
    SMEM for scalar reads, else a column or row form padded by a block
    (`kernel_mods.tpu_form_array`)."""
    out = []
    for i, (c, (_, forms)) in enumerate(zip(consts, reads)):
        for form in forms:
            if form == "smem":
                wide = jnp.float32 if jnp.issubdtype(c.dtype, jnp.floating) else jnp.int32
                out.append(((kind, i, form), c.astype(wide)))
            else:
                size = cfg.q_block if form[0] == "col" else cfg.k_block
                out.append(((kind, i, form), kernel_mods.tpu_form_array(c, form, size)))
    return out


def _refs_of(cfg: Config, names: tuple, buffers: tuple, refs):
    """`(r, outputs)`: the kernel's input refs by name (`r.get(name)` None when absent;
    `r["sched"]`, `r["score"]`, `r["mask"]` tuples; `r["buf"]` the VMEM buffers by
    name), and its output refs."""
    split = len(refs) - len(buffers)
    r = dict(zip(names, refs[:len(names)]))
    r["buf"] = dict(zip(buffers, refs[split:]))
    r["sched"] = tuple(r[name] for name in _SCHEDULE)
    for kind in ("score", "mask"):
        named = [(name, ref) for name, ref in zip(names, refs) if isinstance(name, tuple) and name[0] == kind]
        if named and len(named[0][0]) == 3:  # Mosaic: per const its refs (and buffers) by form
            shapes = cfg.score_reads if kind == "score" else cfg.mask_reads
            consts = {i: {"shape": shape} for i, (shape, _) in enumerate(shapes)}
            for (_, i, form), ref in named:
                consts[i][form] = (ref, r["buf"].get((kind, i, form)))
            r[kind] = tuple(consts[i] for i in sorted(consts))
        else:
            r[kind] = tuple(ref for _, ref in named)
    return r, list(refs[len(names):split])


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


def _span(cfg: Config, block, size: int):
    """`pl.ds` of block `block` of `size` rows (Mosaic's copies told it is aligned)."""
    start = block * size
    return pl.ds(pl.multiple_of(start, size) if cfg.mosaic else start, size)


def _load(cfg: Config, r, name, at):
    """The block `at` of input `name`: read in place (Triton), or copied from HBM into
    the input's VMEM buffer first (Mosaic: a TPU core computes on VMEM alone)."""
    if not cfg.mosaic:
        return r[name][at]
    from jax.experimental.pallas import tpu as pltpu

    pltpu.sync_copy(r[name].at[at], r["buf"][name])
    return r["buf"][name][...]


def _vector(cfg: Config, r, name, lead: tuple, span, axis: int):
    """The window `span` of per-position vector `name` at leading indices `lead`, as a
    column `(size, 1)` (axis 0) or a row `(1, size)` (axis 1). Triton's vectors are
    `(…, L)`; Mosaic's keep the unit axis (`(…, L, 1)` or `(…, 1, L)`, `_tpu_vector`)."""
    if not cfg.mosaic:
        x = r[name][(*lead, span)]
        return x[:, None] if axis == 0 else x[None, :]
    whole = slice(None)
    return _load(cfg, r, name, (*lead, span, whole) if axis == 0 else (*lead, whole, span))


def _column(cfg: Config, x):
    """A row statistic as a `(rows, 1)` column (Mosaic keeps them so already)."""
    return x if cfg.mosaic else x[:, None]


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
    if r.get("bias") is not None:
        bb, hb = cfg.bias_shape
        at = (t.b if bb > 1 else 0, t.h if hb > 1 else 0, _span(cfg, t.i, bq), _span(cfg, t.j, bk))
        s0 = s0 + _load(cfg, r, "bias", at).astype(jnp.float32)
    s1, reads = s0, []
    if cfg.score_mod is not None:
        s1, reads = kernel_mods.evaluate(cfg.score_mod, r["score"], (s0, *_mod_args(cfg, r, t)), given)
        s1 = s1.astype(jnp.float32)
    s2 = _masking.soft_cap(s1, cfg.soft_cap)
    masked = lax.cond(full != 0, lambda: s2, lambda: jnp.where(_visible(cfg, r, t), s2, -jnp.inf))
    return s0, s1, masked, reads


def _mod_args(cfg: Config, r, t: _Tile) -> tuple:
    """The mods' `(b, h, q_idx, kv_idx)` on a tile: `(1, 1)`, `(1, 1)`, `(bq, 1)` and
    `(1, bk)` int32, the indices clamped to the real lengths (on Mosaic the symbolic
    scalars and windows of `kernel_mods.tpu_indices`)."""
    bq, bk, start = cfg.q_block, cfg.k_block, _start(cfg, r)
    if cfg.mosaic:
        return kernel_mods.tpu_indices(t.b, t.h, t.i * bq + start, cfg.n - 1 + start, bq, t.j * bk, cfg.s - 1, bk)
    heads = (jnp.full((1, 1), t.b, jnp.int32), jnp.full((1, 1), t.h, jnp.int32))
    rows = kernel_mods.lane_indices(t.i * bq, bq, 0, cfg.n)
    return (*heads, rows + start, kernel_mods.lane_indices(t.j * bk, bk, 1, cfg.s))


def _visible(cfg: Config, r, t: _Tile):
    """bool `(bq, bk)`: the pairs of a partial block that may attend."""
    bq, bk = cfg.q_block, cfg.k_block
    raw_rows = t.i * bq + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
    raw_cols = t.j * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    ok = jnp.broadcast_to(raw_cols < cfg.s, (bq, bk))
    pattern = _masking.positional(_pattern(cfg, r), raw_rows, raw_cols)
    if pattern is not None:
        ok = ok & pattern
    if r.get("q_len") is not None:
        ok = ok & (raw_rows < r["q_len"][t.b])
    if r.get("kv_len") is not None:
        ok = ok & (raw_cols < r["kv_len"][t.b])
    if r.get("q_ids") is not None:
        q_ids = _vector(cfg, r, "q_ids", (t.b,), _span(cfg, t.i, bq), 0)
        kv_ids = _vector(cfg, r, "kv_ids", (t.b,), _span(cfg, t.j, bk), 1)
        ok = ok & (q_ids == kv_ids)
    if cfg.mask_mod is not None:
        allowed, _ = kernel_mods.evaluate(cfg.mask_mod, r["mask"], _mod_args(cfg, r, t))
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


def _touched(cfg: Config, r, touched, s, b, kv_head, j):
    """Each row's running flag of a visible bad key, updated by key block `j`: `s
    (bq, bk)` its logits (-inf where masked). Evaluated per pair only when the block
    holds a bad key, so a call without one (nearly every call) pays a reduction over
    `bk` flags per block (on Mosaic one SMEM read), not three passes over its pairs."""
    bad = lambda: _vector(cfg, r, "bad", (b, kv_head), _span(cfg, j, cfg.k_block), 1)  # (1, bk)
    seen = lambda x: jnp.maximum(touched, jnp.max(jnp.where(s > -jnp.inf, x, 0.0), axis=1, keepdims=cfg.mosaic))
    if cfg.mosaic:  # a scalar predicate; the flags copied only for a block that has one
        return lax.cond(r["bad_blocks"][b, kv_head, j] > 0, lambda: seen(bad()), lambda: touched)
    flags = bad()
    return lax.cond(jnp.max(flags) > 0.0, lambda: seen(flags), lambda: touched)


def _forward_kernel(cfg: Config, names: tuple, buffers: tuple, *refs):
    r, (o_ref, lse_ref, touched_ref) = _refs_of(cfg, names, buffers, refs)
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv_count, kv_index, kv_full = r["sched"][:3]
    sb, sh = _sched_at(cfg, b, h)
    kv_head = lax.div(h, cfg.groups)  # jnp's // lowers through sign, which Mosaic lowers only on a TPU
    bq, bk = cfg.q_block, cfg.k_block
    q = _load(cfg, r, "q", (b, h, _span(cfg, i, bq), slice(None)))

    def body(t, carry):
        m, l, acc, touched = carry
        j, full = kv_index[sb, sh, i, t], kv_full[sb, sh, i, t]
        k = _load(cfg, r, "k", (b, kv_head, _span(cfg, j, bk), slice(None)))
        _, _, s, _ = _logits(cfg, r, q, k, _Tile(b, h, i, j), full)
        m, l, p, correction = online_step(m, l, s, exp_of(cfg), keepdims=cfg.mosaic)
        v = _load(cfg, r, "v", (b, kv_head, _span(cfg, j, bk), slice(None)))
        acc = acc * _column(cfg, correction) + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m, l, acc, _touched(cfg, r, touched, s, b, kv_head, j)

    dv = o_ref.shape[-1]
    stat = (bq, 1) if cfg.mosaic else (bq,)
    init = (jnp.full(stat, -jnp.inf, jnp.float32), jnp.zeros(stat, jnp.float32), jnp.zeros((bq, dv), jnp.float32),
            jnp.zeros(stat, jnp.float32))
    m, l, acc, touched = lax.fori_loop(0, kv_count[sb, sh, i], body, init)
    seen = l > 0.0
    o_ref[...] = (acc / _column(cfg, jnp.where(seen, l, 1.0))).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    touched_ref[...] = touched


def _backward_tile(cfg: Config, r, q, k, v, g, lse, delta, t: _Tile, full, with_reads: bool):
    """`(p, ds0, reads, read cotangents)` of one block (`lse`, `delta` `(bq, 1)`): the
    weights and the logits' gradient before the mods (`ds0`, what q, k and the bias receive)."""
    s0, s1, s, reads = _logits(cfg, r, q, k, t, full)
    p = exp_of(cfg)(s - jnp.where(lse == -jnp.inf, jnp.inf, lse))
    dp = lax.dot_general(g, v, _NT, preferred_element_type=jnp.float32)
    ds = logits_grad(p, dp, delta)  # the gradient of the capped logits
    if cfg.soft_cap is not None:
        ds = ds * (1.0 - jnp.square(jnp.tanh(s1 / cfg.soft_cap)))
    if cfg.score_mod is None:
        return p, ds, reads, ()
    values = tuple(read.values for read in reads)

    def mod(s0, *values):
        out, _ = kernel_mods.evaluate(cfg.score_mod, r["score"], (s0, *_mod_args(cfg, r, t)), values)
        return out.astype(jnp.float32)

    if not with_reads:
        _, pull = jax.vjp(lambda x: mod(x, *values), s0)
        return p, pull(ds)[0], reads, ()
    _, pull = jax.vjp(mod, s0, *values)
    ds0, *cts = pull(ds)
    return p, ds0, reads, tuple(cts)


def _dq_kernel(cfg: Config, names: tuple, buffers: tuple, *refs):
    r, outs = _refs_of(cfg, names, buffers, refs)
    dq_ref, dbias_ref, const_refs = _backward_outs(cfg, outs)
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv_count, kv_index, kv_full = r["sched"][:3]
    sb, sh = _sched_at(cfg, b, h)
    kv_head = lax.div(h, cfg.groups)
    bq, bk = cfg.q_block, cfg.k_block
    rows = _span(cfg, i, bq)
    q, g = (_load(cfg, r, name, (b, h, rows, slice(None))) for name in ("q", "g"))
    lse, delta = (_vector(cfg, r, name, (b, h), rows, 0) for name in ("lse", "delta"))
    with_reads = any(ref is not None for ref in const_refs)
    if cfg.mosaic and with_reads:
        pl.when((b == 0) & (h == 0) & (i == 0))(lambda: _zero_smem([ref for ref in const_refs if ref is not None]))

    def body(t, dq):
        j, full = kv_index[sb, sh, i, t], kv_full[sb, sh, i, t]
        cols = _span(cfg, j, bk)
        k, v = (_load(cfg, r, name, (b, kv_head, cols, slice(None))) for name in ("k", "v"))
        tile = _Tile(b, h, i, j)
        _, ds0, reads, cts = _backward_tile(cfg, r, q, k, v, g, lse, delta, tile, full, with_reads)
        if dbias_ref is not None:
            _add_bias_grad(cfg, r, dbias_ref, tile, ds0)
        if with_reads:
            kernel_mods.scatter_add(const_refs, reads, cts, cfg.atomic)
        return dq + jnp.dot(ds0.astype(k.dtype), k, preferred_element_type=jnp.float32)

    dq = lax.fori_loop(0, kv_count[sb, sh, i], body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _zero_smem(refs):
    """Zeroes SMEM refs entry by entry (the gradients of a mod's scalars, accumulated
    by the dq kernel's programs, which run one after another on a TPU core)."""
    for ref in refs:
        shape = ref.shape

        def zero(e, _, ref=ref, shape=shape):
            idx = []
            for dim in reversed(shape):
                idx.append(lax.rem(e, dim))
                e = lax.div(e, dim)
            ref[tuple(reversed(idx))] = jnp.float32(0.0)
            return 0

        lax.fori_loop(0, math.prod(shape), zero, 0)


def _backward_outs(cfg: Config, outs):
    """`(dq ref, dbias ref or None, per score_mod const its gradient ref or None)`."""
    it = iter(outs)
    dq = next(it)
    dbias = next(it) if cfg.bias_shape is not None else None
    consts = tuple(next(it) if takes else None for takes in cfg.score_grads)
    return dq, dbias, consts


def _add_bias_grad(cfg: Config, r, dbias_ref, t: _Tile, ds0):
    """The bias gradient of one block: stored when the bias has this (batch, head)'s own
    entry, else added to the shared one (atomically on a GPU; on a TPU, whose programs
    run one after another, through the VMEM buffer `dbias` and back to HBM)."""
    bb, hb = cfg.bias_shape
    at = (t.b if bb > 1 else 0, t.h if hb > 1 else 0, _span(cfg, t.i, cfg.q_block), _span(cfg, t.j, cfg.k_block))
    own = bb == cfg.batch and hb == cfg.groups * cfg.kv_heads  # no other program writes this block
    if cfg.mosaic:
        from jax.experimental.pallas import tpu as pltpu

        buf = r["buf"]["dbias"]
        if own:
            buf[...] = ds0
        else:
            pltpu.sync_copy(dbias_ref.at[at], buf)
            buf[...] = buf[...] + ds0
        pltpu.sync_copy(buf, dbias_ref.at[at])
    elif own:
        dbias_ref[at] = ds0
    elif cfg.atomic:
        from jax.experimental.pallas import triton as plgpu

        plgpu.atomic_add(dbias_ref, at, ds0)
    else:
        dbias_ref[at] = dbias_ref[at] + ds0


def _dkv_kernel(cfg: Config, names: tuple, buffers: tuple, *refs):
    r, (dk_ref, dv_ref) = _refs_of(cfg, names, buffers, refs)
    b, kv_head, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q_count, q_index, q_full = r["sched"][3:]
    bq, bk = cfg.q_block, cfg.k_block
    cols = _span(cfg, j, bk)
    k, v = (_load(cfg, r, name, (b, kv_head, cols, slice(None))) for name in ("k", "v"))

    def head(g_in_group, acc):
        h = kv_head * cfg.groups + g_in_group
        sb, sh = _sched_at(cfg, b, h)

        def body(t, acc):
            dk, dv = acc
            i, full = q_index[sb, sh, j, t], q_full[sb, sh, j, t]
            rows = _span(cfg, i, bq)
            q, g = (_load(cfg, r, name, (b, h, rows, slice(None))) for name in ("q", "g"))
            lse, delta = (_vector(cfg, r, name, (b, h), rows, 0) for name in ("lse", "delta"))
            p, ds0, _, _ = _backward_tile(cfg, r, q, k, v, g, lse, delta, _Tile(b, h, i, j), full, False)
            dv = dv + lax.dot_general(p.astype(g.dtype), g, _TN, preferred_element_type=jnp.float32)
            dk = dk + lax.dot_general(ds0.astype(q.dtype), q, _TN, preferred_element_type=jnp.float32)
            return dk, dv

        return lax.fori_loop(0, q_count[sb, sh, j], body, acc)

    init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dk, dv = lax.fori_loop(0, cfg.groups, head, init)
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _call(cfg: Config, kernel, grid, named: list, out_shape, out_specs, aliases=None, buffers=None):
    """`kernel` over `grid` on the `(name, array)` inputs; on Mosaic with a VMEM buffer
    per tiled input (`_buffers`) and `buffers` (name -> `(shape, dtype)`) besides."""
    names, inputs = zip(*named)
    scratch = {} if not cfg.mosaic else {**_buffers(cfg, dict(named)), **(buffers or {})}
    with jax.enable_x64(False):
        return pl.pallas_call(functools.partial(kernel, cfg, names, tuple(scratch)), grid=grid,
                              in_specs=[_in_spec(cfg, name, x) for name, x in named], out_specs=out_specs,
                              out_shape=out_shape, scratch_shapes=_vmem(scratch), interpret=_interpret(cfg),
                              input_output_aliases=aliases or {}, name=kernel.__name__.strip("_"),
                              compiler_params=_compiler_params(cfg))(*inputs)


def _in_spec(cfg: Config, name, x):
    """The whole array (Triton); on Mosaic SMEM for what is read as scalars, else left
    in HBM (`pl.ANY`) for `_load` to copy from."""
    if not cfg.mosaic:
        return _whole(x)
    from jax.experimental.pallas import tpu as pltpu

    scalar = name in _SCALARS or (isinstance(name, tuple) and name[-1] == "smem")
    return pl.BlockSpec(memory_space=pltpu.SMEM if scalar else pl.ANY)


def _buffers(cfg: Config, arrays: dict) -> dict:
    """name -> `(shape, dtype)` of the VMEM buffer each tiled input of `arrays` is
    copied into (Mosaic): one block of rows or keys, or one tile."""
    bq, bk = cfg.q_block, cfg.k_block
    tiles = {"q": (bq, None), "g": (bq, None), "k": (bk, None), "v": (bk, None), "bias": (bq, bk), "bad": (1, bk),
             "q_ids": (bq, 1), "kv_ids": (1, bk), "lse": (bq, 1), "delta": (bq, 1)}
    out = {name: ((rows, arrays[name].shape[-1] if cols is None else cols), arrays[name].dtype)
           for name, (rows, cols) in tiles.items() if name in arrays}
    for name, x in arrays.items():  # a mod's const read as windows: one column or row
        if isinstance(name, tuple) and len(name) == 3 and name[2] != "smem":
            out[name] = ((bq, 1) if name[2][0] == "col" else (1, bk)), x.dtype
    return out


def _vmem(buffers: dict) -> list:
    if not buffers:
        return []
    from jax.experimental.pallas import tpu as pltpu

    return [pltpu.VMEM(shape, dtype) for shape, dtype in buffers.values()]


def _interpret(cfg: Config):
    """Pallas' `interpret`: off when compiled; TPU interpret mode for the Mosaic form (it
    emulates SMEM, VMEM and the copies between them), else the generic one (which,
    unlike TPU interpret mode's callbacks, may sit in a `platform_dependent` branch)."""
    if not cfg.interpret:
        return False
    if not cfg.mosaic:
        return True
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams()


def _compiler_params(cfg: Config):
    if cfg.backend == "triton":
        from jax.experimental.pallas import triton as plgpu

        return plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.CompilerParams(dimension_semantics=("arbitrary",) * 3)


def _forward(cfg: Config, q, k, v, x: Inputs):
    b, h, n_pad, _ = q.shape
    dv = v.shape[-1]
    stat = (1,) if cfg.mosaic else ()  # Mosaic's blocks are 2-D: (bq, 1)
    rows = pl.BlockSpec((None, None, cfg.q_block, *stat), lambda b, h, i: (b, h, i, *(0,) * len(stat)))
    out_shape = (jax.ShapeDtypeStruct((b, h, n_pad, dv), q.dtype),
                 jax.ShapeDtypeStruct((b, h, n_pad, *stat), jnp.float32),
                 jax.ShapeDtypeStruct((b, h, n_pad, *stat), jnp.float32))
    out_specs = (pl.BlockSpec((None, None, cfg.q_block, dv), lambda b, h, i: (b, h, i, 0)), rows, rows)
    out, lse, touched = _call(cfg, _forward_kernel, (b, h, n_pad // cfg.q_block), _named_inputs(cfg, q, k, v, x),
                              out_shape, out_specs)
    return out, lse.reshape(b, h, n_pad), touched.reshape(b, h, n_pad)


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
    column = (lambda y: y[..., None]) if cfg.mosaic else (lambda y: y)  # Mosaic's (…, N_pad, 1)
    inputs = _named_inputs(cfg, q, k, v, x) + [("g", g.astype(q.dtype)), ("lse", column(lse)), ("delta", column(delta))]
    dq, dbias, dconsts = _dq(cfg, q, inputs, x)
    dk, dv = _dkv(cfg, k, v, inputs)
    d_inputs = Inputs(None, None, dbias, None, None, None, None, None, None, dconsts,
                      tuple(None for _ in x.mask_consts))
    return dq, dk, dv, d_inputs


def _dq(cfg: Config, q, inputs, x: Inputs):
    b, h, n_pad, d = q.shape
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    out_specs = [pl.BlockSpec((None, None, cfg.q_block, d), lambda b, h, i: (b, h, i, 0))]
    aliases, extra = {}, []
    accumulated = [] if x.bias is None else [x.bias]
    accumulated += [c for c, takes in zip(x.score_consts, cfg.score_grads) if takes]
    for c in accumulated:  # zero-initialised outputs, written block by block or added to
        if not cfg.mosaic or c is x.bias:  # (Mosaic's SMEM outputs are not read in: zeroed by the kernel)
            aliases[len(inputs) + len(extra)] = len(out_shape)
            extra.append((("zeros", len(extra)), jnp.zeros(c.shape, jnp.float32)))
        out_shape.append(jax.ShapeDtypeStruct(c.shape, jnp.float32))
        out_specs.append(_accumulated_spec(cfg, c, c is not x.bias))
    buffers = {"dbias": ((cfg.q_block, cfg.k_block), jnp.float32)} if x.bias is not None else {}
    outs = _call(cfg, _dq_kernel, (b, h, n_pad // cfg.q_block), inputs + extra, tuple(out_shape), tuple(out_specs),
                 aliases, buffers)
    dq, rest = outs[0], list(outs[1:])
    dbias = None if x.bias is None else rest.pop(0).astype(x.bias.dtype)
    dconsts = tuple(rest.pop(0).astype(c.dtype) if takes else None for c, takes in zip(x.score_consts, cfg.score_grads))
    return dq, dbias, dconsts


def _accumulated_spec(cfg: Config, c, scalar_reads: bool):
    """The spec of an accumulated gradient: whole (Triton); on Mosaic in HBM (the bias's,
    written tile by tile) or in SMEM (a score_mod const's, read as scalars)."""
    if not cfg.mosaic:
        return _whole(c)
    from jax.experimental.pallas import tpu as pltpu

    return pl.BlockSpec(memory_space=pltpu.SMEM if scalar_reads else pl.ANY)


def _dkv(cfg: Config, k, v, inputs):
    b, kv_heads, s_pad, d = k.shape
    keys = lambda width: pl.BlockSpec((None, None, cfg.k_block, width), lambda b, h, j: (b, h, j, 0))
    out_shape = (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype))
    return _call(cfg, _dkv_kernel, (b, kv_heads, s_pad // cfg.k_block), inputs, out_shape,
                 (keys(d), keys(v.shape[-1])))


_attend.defvjp(_attend_fwd, _attend_bwd)


def attend(q, k, v, bad_kv, vis: _masking.Visibility, *, scale: float, q_block: int, k_block: int,
           interpret: bool | str, backend: str):
    """The kernel on q `(B…, H, N, D)`, k `(B…, K, S, D)`, v `(B…, K, S, Dv)` (finite)
    under `vis` (its rows closed by the caller, `_softmax.close`), `bad_kv` bool `(B…, K, S)`;
    `interpret` False (compiled), True (Pallas' interpret mode, the whole-array form) or
    `"tpu"` (backend "mosaic": its TPU form in TPU interpret mode).

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
    cfg = _config(vis, batch, h, kf.shape[1], scale, (q_block, k_block), interpret, backend, (score_mod, mask_mod),
                  (score_consts, mask_consts), schedule.kv_count.shape[:2])
    pad = lambda x, size, axis, value=0: jnp.pad(x, [(0, size - x.shape[axis]) if a == axis else (0, 0)
                                                     for a in range(x.ndim)], constant_values=value)
    qf = pad(qf, cfg.n_pad, 2)
    kf, vf = pad(kf, cfg.s_pad, 2), pad(vf, cfg.s_pad, 2)
    bad = pad(jnp.broadcast_to(bad_kv, batch + bad_kv.shape[-2:]).reshape(b, -1, s).astype(jnp.float32), cfg.s_pad, 2)
    pos = jnp.stack([jnp.asarray(vis.offset, jnp.int32), jnp.asarray(vis.start, jnp.int32)]) if _traced(cfg) else None
    q_ids, kv_ids = _ids(vis, batch, cfg)
    bad_blocks = None
    if cfg.mosaic:
        bad_blocks = (jnp.max(bad.reshape(b, -1, cfg.s_pad // cfg.k_block, cfg.k_block), axis=-1) > 0).astype(jnp.int32)
        bad, q_ids, kv_ids = _tpu_vector(bad, 1), _tpu_vector(q_ids, 0), _tpu_vector(kv_ids, 1)
    x = Inputs(bad, bad_blocks, _bias(vis, cfg, batch), *_lengths(vis, batch), pos, q_ids, kv_ids,
               schedule=schedule, score_consts=score_consts, mask_consts=mask_consts)
    out, lse, touched = _attend(cfg, qf, kf, vf, x)
    unflat = lambda y: y[:, :, :n].reshape(batch + y.shape[1:2] + (n,) + y.shape[3:])
    return unflat(out), unflat(lse), unflat(touched) > 0


def _tpu_vector(x, axis: int):
    """Per-position vectors `(…, L)` as Mosaic reads them (`_vector`): `(…, L, 1)` to be
    read as columns (axis 0), `(…, 1, L)` as rows (axis 1); None stays None."""
    if x is None:
        return None
    return x[..., None] if axis == 0 else x[..., None, :]


def tpu_blocks(n: int) -> tuple[int, int]:
    """`(q_block, k_block)` on a TPU (`TPU_BLOCK`): 128 by 128, or N rounded up to 16
    queries when shorter."""
    return min(TPU_BLOCK, -(-n // TPU_MIN_Q_BLOCK) * TPU_MIN_Q_BLOCK), TPU_BLOCK


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


def _config(vis, batch, h, kv_heads, scale, blocks, interpret, backend, mods, consts, sched) -> Config:
    """The call's `Config`; `mods` `(score_mod, mask_mod)` traced, `consts` theirs.

    Raises:
      ValueError: compiled for a TPU, a mod reads what a TPU kernel cannot (`tpu_reads`).
    """
    score_mod, mask_mod = mods
    reads = _tpu_reads(mods, consts, *blocks) if backend == "mosaic" else ((), ())
    why = _tpu_obstacle(reads, consts[0]) if backend == "mosaic" else None
    if why is not None and not interpret:
        raise ValueError(f"the library's kernel compiled for a TPU cannot take {why}")
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
        score_grads=tuple(jnp.issubdtype(c.dtype, jnp.floating) for c in consts[0]), score_reads=reads[0],
        mask_reads=reads[1], interpret=interpret, backend=backend,
        tpu_form=backend == "mosaic" and why is None and interpret in (False, "tpu"))


def _tpu_obstacle(reads, score_consts) -> str | None:
    """What in the mods' reads (`Config.score_reads`, `mask_reads`) has no TPU form,
    as a phrase, or None: a read at a computed index, a use of a whole array, a
    per-position vector score_mod reads that takes a gradient."""
    for kind, per_const in zip(("score_mod", "mask_mod"), reads):
        for i, (_, forms) in enumerate(per_const):
            if "gather" in forms:
                return (f"a table indexed by a computed index ({kind} reads an array it closes over at an index "
                        "computed from its arguments: a gather, which a TPU kernel cannot do)")
            if "whole" in forms:
                return f"an array {kind} closes over and uses whole (not read at its arguments)"
            floating = kind == "score_mod" and jnp.issubdtype(score_consts[i].dtype, jnp.floating)
            if floating and any(f != "smem" for f in forms):
                return "the gradient of a floating per-position vector score_mod reads (only per-(batch, head) scalars)"
    return None


def tpu_refusal(vis: _masking.Visibility) -> str | None:
    """What the mods of `vis` read that the kernel compiled for a TPU cannot (a phrase
    for a refusal: `_tpu_obstacle`), or None."""
    bq, bk = tpu_blocks(vis.n)
    (score_mod, score_consts), (mask_mod, mask_consts) = (_trace(vis.score_mod, bq, bk, score=True),
                                                          _trace(vis.mask_mod, bq, bk, score=False))
    consts = (score_consts, mask_consts)
    return _tpu_obstacle(_tpu_reads((score_mod, mask_mod), consts, bq, bk), score_consts)


def _tpu_reads(mods, consts, bq: int, bk: int) -> tuple:
    """Per mod (score_mod, mask_mod), per const `(shape, forms)`: how a TPU kernel reads
    it (`kernel_mods.tpu_forms`)."""
    return tuple(tuple((c.shape, forms) for c, forms in zip(cs, kernel_mods.tpu_forms(mod, cs, bq, bk, score=i == 0)))
                 for i, (mod, cs) in enumerate(zip(mods, consts)))


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
