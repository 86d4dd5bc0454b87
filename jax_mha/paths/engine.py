"""The tuned attention engine: blocks of queries against blocks of keys, online softmax.

`"blockwise"` runs it (`jax_mha.paths.blockwise` chooses the blocks), and so does `"xla"`
once its whole scores would be too big (`WHOLE_SCORES_MAX_BYTES`); memory stays
linear in N.

* Forward (`_forward`): the FlashAttention recurrence (Dao et al. 2022, Alg. 1; Rabe &
  Staats 2021). Per query block, a running row maximum `m`, normaliser `l` and
  accumulator are rescaled by `exp(m_old - m_new)` as key blocks arrive; key blocks
  that causality, the window, the lengths, the segment ids, the mask or `mask_mod`
  rule out are never computed. Saves only `out` and the row log-sum-exp `lse`.
* Derivatives: a `jax.custom_jvp` whose tangent is a linear map of `(dq, dk, dv,
  dbias, d consts)` (`_Derivative`, through `jax_mha.paths.linear_map.linear_call`), with its
  transpose written out:

      forward mode (`_tangent`), each block's weights `P = exp(S - lse)` recomputed:
      dS = scale·(dq kᵀ + q dkᵀ) + dbias,   A = P ⊙ dS,   c = rowsum(A)
      d out = A v + P dv - c·out,             d lse = c

      reverse mode (`_backward`), the FlashAttention-2 backward (Dao 2023, Alg. 2):
      Δ = rowsum(g_out ⊙ out) - g_lse,   dS = P ⊙ (g_out vᵀ - Δ)
      dq = scale·dS k  (a pass over key blocks per query block, `_dq_rows`)
      dk = scale·dSᵀ q, dv = Pᵀ g_out  (a pass over query blocks per key block, `_dkv_cols`)

  Both backward passes skip exactly the blocks the forward skips (the same
  `_visible` test; the key-block pass finds its query blocks with `_query_start`),
  so packed documents and windows save in the backward what they save in the
  forward, and the backward keeps O((N + S)·D) besides a bias's own gradient.
  `jax.jvp`/`jacfwd` evaluate the tangent; `grad`/`vjp` run the backward;
  `jax.hessian` differentiates the backward in forward mode.

Layout inside the engine (`B` = flattened batch, `K` key/value heads, `G` query heads
per key/value head, `R = G·Np` query rows of all G heads stacked, so GQA is one
batched matmul per block and k/v are never repeated):
  q (B, K, R, D)   k (B, K, Sp, D)   v (B, K, Sp, Dv)
  bias, mask (B|1, K|1, G|1, Np|1, Sp|1)   q_len, kv_len (B|1, 1, 1, 1) int32
Masked scores are -inf, selected with `where`; a row with no visible key has
`m = -inf` and `lse = +inf` and outputs 0. A row that may attend to a non-finite
value outputs NaN; the value matmuls see only finite values, so a NaN in a masked
value never reaches another row.

Mask functions. A `mask_mod` is evaluated block by block, never as an `(N, S)` array.
When every value it reads is known before the call runs (it closes over nothing
traced, and `q_start` is an int), each query block's range of key blocks holding a
visible key is computed from those values at this call (`mask_mod_ranges`, kept under
a key of the traced computation and the values, never of the function object;
FlexAttention's block mask, reduced to one range per query block), so the key loop is
as short as the widest range; inside the range each block is tested on its own index
grid and skipped when empty. A `mask_mod` closing over traced values (document ids
passed into a jitted function, a vmapped argument) gets only that per-block test:
every block of the band is tested, none is ruled out beforehand.

Query row 0 sits at key position `offset` and the mods see it as `q_idx = start`
(`Visibility.q_offset`, `q_start`): static ints in the plan, or traced int32
scalars in `Arrays` (decoding passes the cache index); a traced offset makes the
static loop lengths conservative (`_bands`), the skipping stays exact.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from jax_mha._masking import (
    Pattern,
    Visibility,
    Window,
    block_allowed,
    compute_dtype,
    key_block_range,
    key_range,
    score_logits,
    static_part,
)
from jax_mha._softmax import fold_block, logits_grad, output_delta
from jax_mha.paths.linear_map import linear_call

_SCORES = "bkqd,bkcd->bkqc"  # q kᵀ per block (also dq kᵀ, q dkᵀ, g vᵀ)
_MIX = "bkqc,bkcd->bkqd"  # p v per block (also a v, p dv, dS k)
_BACK = "bkqc,bkqd->bkcd"  # Pᵀ g and dSᵀ q per block


class Mod:
    """A score or mask function traced once for the engine's block shapes, every value
    it closes over (traced or not) moved into explicit inputs: `mod(*args, *consts)`.
    Hashes and compares by the text of its jaxpr (the computation, the consts' types,
    any literal it read), never by the Python function, so a plan made for one call
    is reused only for the same computation and never keeps a stale value."""

    __slots__ = ("jaxpr", "key")

    def __init__(self, jaxpr):
        self.jaxpr = jaxpr
        self.key = str(jaxpr)

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, Mod) and other.key == self.key

    def __call__(self, *args):
        num_consts = len(self.jaxpr.constvars)
        split = len(args) - num_consts
        return jax.core.eval_jaxpr(self.jaxpr, args[split:], *args[:split])[0]


def trace_mod(fn, *avals) -> tuple[Mod, tuple]:
    """`(Mod, consts)`: `fn` traced at `avals` (`jax.ShapeDtypeStruct`s), the values it
    closes over (outer tracers of any dtype, concrete arrays) returned as `consts`.
    Traced afresh each time (a new wrapper: JAX keeps traces of a function object,
    which would keep the values of the globals it read the first time)."""
    closed = jax.make_jaxpr(lambda *args: fn(*args))(*avals)
    return Mod(closed.jaxpr), tuple(closed.consts)


class Plan(NamedTuple):
    """Static (hashable) configuration of one engine call."""

    n: int  # N before padding
    s: int  # S before padding
    n_pad: int  # N padded to a multiple of q_block
    s_pad: int  # S padded to a multiple of k_block
    groups: int  # G = H // K
    q_block: int
    k_block: int
    band: int  # the most key blocks any query block visits (static loop length)
    is_causal: bool
    window: Window | None
    scale: float
    dtype: str  # accumulation dtype: "float32", or "float64" for float64 inputs
    per_head: bool = True  # one (sequence, head) at a time (`_head`), or all B·K together
    # The mods, traced (`trace_mod`) for this plan's block shapes:
    # `score_mod(score, b, h, q_idx, kv_idx, *Arrays.score_consts)`, likewise mask_mod.
    score_mod: Mod | None = None
    mask_mod: Mod | None = None
    static: Visibility | None = None  # the description without arrays or mods (`_masking.static_part`)
    mask_ranges: tuple | None = None  # per query block, mask_mod's key blocks [first, last)
    q_band: int = 1  # the most query blocks (of one head) any key block is seen by
    offset: int | None = None  # key position of query row 0; None: traced (`Arrays.offset`)
    start: int | None = 0  # the mods' q_idx of row 0; None: traced (`Arrays.start`)
    # The mods traced again for transposed blocks `(…, bk, bq)` (q_idx `(1, 1, 1, bq)`,
    # kv_idx `(1, 1, bk, 1)`), for the dk/dv pass; `transposable` False when that trace
    # read other values than the first (that pass then multiplies transposed operands).
    score_mod_t: Mod | None = None
    mask_mod_t: Mod | None = None
    transposable: bool = True

    @property
    def num_row_blocks(self) -> int:
        return self.groups * self.n_pad // self.q_block

    @property
    def num_key_blocks(self) -> int:
        return self.s_pad // self.k_block


class Arrays(NamedTuple):
    """The engine's array inputs (q, k, v finite; bias differentiable; the rest not)."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    bias: jax.Array | None
    mask: jax.Array | None
    q_len: jax.Array | None
    kv_len: jax.Array | None
    bad_kv: jax.Array | None  # bool (B, K, Sp): keys whose key or value had a non-finite entry
    q_ids: jax.Array | None = None  # int32 (B|1, 1, Np): query segment ids, padded with the last id
    kv_ids: jax.Array | None = None  # int32 (B|1, 1, Sp)
    b_idx: jax.Array | None = None  # int32 (B, 1, 1, 1): the flat batch index, for the mods
    k_idx: jax.Array | None = None  # int32 (1, K, 1, 1): the key/value head index, for the mods
    score_consts: tuple = ()  # what score_mod closes over (differentiable where floating)
    mask_consts: tuple = ()  # what mask_mod closes over
    offset: jax.Array | None = None  # int32 (): traced key position of query row 0
    start: jax.Array | None = None  # int32 (): traced q_idx of query row 0


_PER_HEAD_FIELDS = ("q", "k", "v", "bias", "mask", "q_len", "kv_len", "bad_kv", "q_ids", "kv_ids", "b_idx", "k_idx")


def _mod_heads(plan: Plan, a: Arrays, g):
    """`(batch index, query head index)` int32 of rank 4 for the mods' calls."""
    return a.b_idx, (a.k_idx * plan.groups + g).astype(jnp.int32)  # int32 under x64 too (the traced avals)


def _bound(fn, consts):
    return None if fn is None else (lambda *args: fn(*args, *consts))


def _visibility(plan: Plan, a: Arrays, score_consts=None, transposed: bool = False) -> Visibility:
    """The description with the engine-layout arrays (one batch entry and head when
    `plan.per_head`), for `block_allowed`, `score_logits` and `key_range`; the
    offsets static or traced. `score_consts` replaces `a.score_consts` (the mods'
    derivatives); `transposed` gives the mods traced for transposed blocks."""
    consts = a.score_consts if score_consts is None else score_consts
    score_mod, mask_mod = (plan.score_mod_t, plan.mask_mod_t) if transposed else (plan.score_mod, plan.mask_mod)
    return dataclasses.replace(plan.static, mask=a.mask, q_lengths=a.q_len, kv_lengths=a.kv_len,
                               q_offset=a.offset if plan.offset is None else plan.offset,
                               q_start=a.start if plan.start is None else plan.start,
                               score_mod=_bound(score_mod, consts), mask_mod=_bound(mask_mod, a.mask_consts))


def _segment_block(a: Arrays, plan: Plan, i0, j0, transposed: bool = False):
    """`(q ids (B|1, 1, bq, 1), kv ids (B|1, 1, 1, bk))` of one block (transposed:
    `(…, 1, bq)` and `(…, bk, 1)`), or None."""
    if a.q_ids is None:
        return None
    q_ids = lax.dynamic_slice_in_dim(a.q_ids, i0, plan.q_block, axis=2)
    kv_ids = lax.dynamic_slice_in_dim(a.kv_ids, j0, plan.k_block, axis=2)
    if transposed:
        return q_ids[..., None, :], kv_ids[..., None]
    return q_ids[..., None], kv_ids[..., None, :]


def _pair_block(x: jax.Array | None, plan: Plan, g, i0, j0, transposed: bool = False) -> jax.Array | None:
    """Head `g`, rows `i0…`, keys `j0…` of a `(B|1, K|1, G|1, Np|1, Sp|1)` mask or
    bias, as `(B|1, K|1, bq|1, bk|1)` (transposed: `(…, bk|1, bq|1)`); size-1 axes
    stay size 1."""
    if x is None:
        return None
    x = lax.dynamic_index_in_dim(x, g if x.shape[2] != 1 else 0, axis=2, keepdims=False)
    if x.shape[-2] != 1:
        x = lax.dynamic_slice_in_dim(x, i0, plan.q_block, axis=2)
    if x.shape[-1] != 1:
        x = lax.dynamic_slice_in_dim(x, j0, plan.k_block, axis=3)
    return jnp.swapaxes(x, 2, 3) if transposed else x


def _row_origin(plan: Plan, r):
    """Query block `r` of the stacked rows -> (its head g, its first query position)."""
    r0 = r * plan.q_block
    return r0 // plan.n_pad, r0 % plan.n_pad


def _key_blocks(plan: Plan, a: Arrays, i0):
    """Key blocks `[lo, hi)` that query rows `i0 … i0 + q_block - 1` can see: by
    causality and window, and by the lengths (keys past every sequence's
    `kv_lengths` are masked; rows past every `q_lengths` see nothing), and by
    `mask_mod`'s block ranges. The engine runs one batch entry at a time on one
    device, so "every sequence" is that sequence."""
    lo, hi = key_block_range(_visibility(plan, a), i0, plan.q_block, plan.k_block, plan.s_pad, a.q_len, a.kv_len)
    if plan.mask_ranges is not None:  # the mask function's own block range (`mask_mod_ranges`)
        ranges = jnp.asarray(plan.mask_ranges, jnp.int32)  # (Np / bq, 2)
        first, last = ranges[i0 // plan.q_block, 0], ranges[i0 // plan.q_block, 1]
        lo, hi = jnp.maximum(lo, first), jnp.minimum(hi, last)
    return lo, jnp.maximum(hi, lo)


def _block_indices(plan: Plan, i0, j0, transposed: bool = False):
    """int32 `(rows (bq, 1), cols (1, bk))` of one block; transposed `(1, bq)`, `(bk, 1)`."""
    rows = (i0 + lax.broadcasted_iota(jnp.int32, (plan.q_block, 1), 0)).astype(jnp.int32)
    cols = (j0 + lax.broadcasted_iota(jnp.int32, (1, plan.k_block), 1)).astype(jnp.int32)
    return (rows.T, cols.T) if transposed else (rows, cols)


def _F(plan: Plan):
    """The accumulation dtype."""
    return jnp.dtype(plan.dtype)


# ---------------------------------------------------------------------------------
# mask_mod's block ranges: computed from the values it reads at this call.
# ---------------------------------------------------------------------------------

_RANGES: dict = {}  # (computation, values, shapes) -> ranges; the newest _RANGES_KEPT entries
_RANGES_KEPT = 32


def _fingerprint(consts) -> str | None:
    """A digest of concrete values (dtype, shape and bytes), or None if any is traced."""
    digest = hashlib.sha256()
    for c in consts:
        if isinstance(c, jax.core.Tracer):
            return None
        x = np.asarray(c)
        digest.update(f"{x.dtype}{x.shape}".encode())
        digest.update(np.ascontiguousarray(x).tobytes())
    return digest.hexdigest()


@functools.partial(jax.jit, static_argnums=(0, 1))
def _range_table(mod: Mod, shapes: tuple, consts):
    """bool `(Np / bq, Sp / bk)`: whether each block holds a key `mod` allows for
    some batch entry and head; one query block at a time, never an (N, S) array."""
    batch, heads, n, s, n_pad, s_pad, q_block, k_block, start = shapes
    b = jnp.arange(batch, dtype=jnp.int32).reshape(-1, 1, 1, 1)
    h = jnp.arange(heads, dtype=jnp.int32).reshape(1, -1, 1, 1)
    cols = jnp.arange(s_pad, dtype=jnp.int32).reshape(1, 1, 1, -1)

    def row_block(r):
        rows = (r * q_block + jnp.arange(q_block, dtype=jnp.int32)).reshape(1, 1, -1, 1)
        ok = mod(b, h, rows + start, cols, *consts) & (rows < n) & (cols < s)
        ok = jnp.any(jnp.broadcast_to(ok, ok.shape[:2] + (q_block, s_pad)), axis=(0, 1, 2))  # (Sp,)
        return jnp.any(ok.reshape(s_pad // k_block, k_block), axis=-1)

    return lax.map(row_block, jnp.arange(n_pad // q_block, dtype=jnp.int32))


def mask_mod_ranges(mask_mod, batch: int, heads: int, n: int, s: int, n_pad: int, s_pad: int, q_block: int,
                    k_block: int, start) -> tuple[tuple[int, int], ...] | None:
    """Per query block, the key blocks `[first, last)` holding a key `mask_mod` allows
    for some batch entry and head (FlexAttention's block mask, one range per query
    block), or None when it cannot be known before the call runs: `mask_mod` closes
    over a traced value, or `start` (the q_idx of row 0) is traced. The engine then
    tests every block of its band on the block's index grid instead (`_visible`).

    Computed from the values `mask_mod` reads at this call, and kept under a key of
    its traced computation and those values, never of the function object: a mask
    reading a global that has since been reassigned gets fresh ranges."""
    if not isinstance(start, (int, np.integer)) or isinstance(start, bool):
        return None
    start = int(start)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    mod, consts = trace_mod(mask_mod, i32(batch, 1, 1, 1), i32(1, heads, 1, 1), i32(1, 1, q_block, 1),
                            i32(1, 1, 1, s_pad))
    values = _fingerprint(consts)
    if values is None:
        return None
    shapes = (batch, heads, n, s, n_pad, s_pad, q_block, k_block, start)
    key = (mod, values, shapes)
    if key not in _RANGES:
        with jax.ensure_compile_time_eval():
            seen = np.asarray(_range_table(mod, shapes, tuple(jnp.asarray(c) for c in consts)))
        out = []
        for row in seen:
            idx = np.flatnonzero(row)
            out.append((int(idx[0]), int(idx[-1]) + 1) if idx.size else (0, 0))
        while len(_RANGES) >= _RANGES_KEPT:
            _RANGES.pop(next(iter(_RANGES)))
        _RANGES[key] = tuple(out)
    return _RANGES[key]


def mask_span(vis: Visibility, n: int, s: int, block: int):
    """`(span, sparse)` of the description's `mask_mod`, or None without one or when
    its block ranges cannot be known before the call runs (`mask_mod_ranges`): the
    widest run of keys (in `block`-key blocks, minus one block) a `block`-row query
    block sees, and whether under 3/4 of the blocks hold a visible key. Evaluated
    `block` rows at a time on the values the mask reads at this call; the blockwise
    path's default blocks follow it."""
    if vis.mask_mod is None:
        return None
    bq, bk = min(block, n), min(block, s)
    n_pad, s_pad = -(-n // bq) * bq, -(-s // bk) * bk
    ranges = mask_mod_ranges(vis.mask_mod, math.prod(vis.batch_shape), vis.num_heads, n, s, n_pad, s_pad, bq, bk,
                             0 if vis.q_start is None else vis.q_start)
    if ranges is None:
        return None
    widths = [hi - lo for lo, hi in ranges]
    return max(0, max(widths) - 1) * bk, sum(widths) < 0.75 * len(ranges) * (s_pad // bk)


# ---------------------------------------------------------------------------------
# One block: scores, the mods and their derivatives.
# ---------------------------------------------------------------------------------


def _logits_fn(plan: Plan, a: Arrays, g, rows, cols, transposed: bool = False):
    """`(post, floats)`: `post(s, *float consts)` applies score_mod and the soft-cap
    to one block of scaled, biased scores; `floats` are the indices of score_mod's
    floating consts. None when there is nothing to apply."""
    if plan.score_mod is None and not plan.static.changes_scores:
        return None, []
    heads = _mod_heads(plan, a, g)
    floats = [i for i, c in enumerate(a.score_consts) if jnp.issubdtype(jnp.result_type(c), jnp.floating)]

    def post(x, *fc):
        consts = list(a.score_consts)
        for i, c in zip(floats, fc):
            consts[i] = c
        return score_logits(_visibility(plan, a, tuple(consts), transposed), x, heads, rows, cols)

    return post, floats


def _mods(plan: Plan, a: Arrays, s, g, rows, cols, ds=None, d_consts=None):
    """`(logits, d logits)`: score_mod and the soft-cap on one block of scaled, biased
    scores `s`, and their tangent (a JVP through the mods) given the tangent `ds` of
    `s` and `d_consts` of score_mod's floating constants (each None = zero)."""
    post, floats = _logits_fn(plan, a, g, rows, cols)
    if post is None:
        return s, ds
    primals = tuple(a.score_consts[i] for i in floats)
    live = [] if d_consts is None else [d_consts[i] for i in floats]
    if ds is None and all(t is None for t in live):
        return post(s, *primals), None
    tangents = [jnp.zeros_like(s) if ds is None else ds]
    tangents += [jnp.zeros_like(c) if t is None else t.astype(c.dtype)
                 for c, t in zip(primals, live or [None] * len(floats))]
    return jax.jvp(post, (s, *primals), tuple(tangents))


def _raw_scores(plan: Plan, a: Arrays, q_i, k_j, g, i0, j0, transposed: bool = False):
    """float scaled, biased scores of one block, before the mods: `(B, K, bq, bk)`,
    or `(B, K, bk, bq)` transposed (computed so: k qᵀ, no transpose)."""
    if transposed:
        s = jnp.einsum(_SCORES, k_j, q_i, preferred_element_type=_F(plan))
    else:
        s = jnp.einsum(_SCORES, q_i, k_j, preferred_element_type=_F(plan))
    s = s * jnp.asarray(plan.scale, _F(plan))
    bias = _pair_block(a.bias, plan, g, i0, j0, transposed)
    return s if bias is None else s + bias.astype(_F(plan))


def _allowed(plan: Plan, a: Arrays, g, i0, j0, transposed: bool = False):
    """bool of one block (or None: every pair may attend): the description, and the
    keys added by padding never."""
    rows, cols = _block_indices(plan, i0, j0, transposed)
    allowed = block_allowed(_visibility(plan, a, transposed=transposed), rows, cols,
                            _pair_block(a.mask, plan, g, i0, j0, transposed), 4,
                            _segment_block(a, plan, i0, j0, transposed), _mod_heads(plan, a, g))
    if plan.s_pad != plan.s:
        pad_ok = lax.broadcast_to_rank(cols < plan.s, 4)
        allowed = pad_ok if allowed is None else allowed & pad_ok
    return allowed


def _scores(plan: Plan, a: Arrays, q_i, k_j, g, i0, j0):
    """float32 scores of one block with -inf where masked, and the allowed mask."""
    s, allowed, _ = _scores_and_tangent(plan, a, q_i, k_j, g, i0, j0)
    return s, allowed


def _scores_and_tangent(plan: Plan, a: Arrays, q_i, k_j, g, i0, j0, ds=None, d_consts=None):
    """`_scores`, and the tangent of the logits through the mods (`_mods`)."""
    s = _raw_scores(plan, a, q_i, k_j, g, i0, j0)
    rows, cols = (lax.broadcast_to_rank(x, 4) for x in _block_indices(plan, i0, j0))
    s, ds = _mods(plan, a, s, g, rows, cols, ds, d_consts)
    allowed = _allowed(plan, a, g, i0, j0)
    if allowed is not None:
        s = jnp.where(allowed, s, -jnp.inf)
    return s, allowed, ds


# ---------------------------------------------------------------------------------
# Forward.
# ---------------------------------------------------------------------------------


class KeyBand(NamedTuple):
    """The keys' arrays (and their tangents) of the `plan.band` key blocks one query
    block may visit, `(1, 1, band·k_block, …)`; block `t` of the loop is rows
    `t·k_block …` of them."""

    k: jax.Array
    v: jax.Array
    bad_kv: jax.Array | None
    dk: jax.Array | None = None
    dv: jax.Array | None = None

    def block(self, name: str, t, k_block: int):
        x = getattr(self, name)
        return None if x is None else lax.dynamic_slice_in_dim(x, t * k_block, k_block, axis=2)


def _key_loop(plan: Plan, a: Arrays, g, i0, body, init, da: Arrays | None = None, remat: bool = False,
              y_zero=None):
    """Runs `body(j, t, band, carry) -> carry` over the key blocks query rows `i0…`
    of head `g` can see: `j` the key block, `t` its index in `band` (a `KeyBand`).

    A scan of the static length `plan.band` starting at the first visible block,
    each step under `lax.cond`, so blocks that causality, the window, the lengths or
    an all-False mask block rule out cost nothing. The keys are sliced to the band
    once, before the loop. `remat` rematerialises each step when the loop is
    reverse-differentiated (forward mode differentiated again), so its residuals are
    O(block). With `y_zero` (a pytree of arrays), `body` returns `(carry, y)`, a
    skipped step gives `y_zero`, and the loop returns `(carry, ys (band, …), start)`,
    block `t` of `ys` being key block `start + t`.
    """
    lo, hi = _key_blocks(plan, a, i0)
    start = jnp.clip(lo, 0, plan.num_key_blocks - plan.band)
    cut = lambda x: None if x is None else lax.dynamic_slice_in_dim(x, start * plan.k_block,
                                                                     plan.band * plan.k_block, axis=2)
    band = KeyBand(cut(a.k), cut(a.v), cut(a.bad_kv), *((cut(da.k), cut(da.v)) if da is not None else ()))

    def step(carry, t):
        j = start + t
        visible = _visible(plan, a, g, i0, j, lo, hi)
        if y_zero is None:
            return lax.cond(visible, lambda c: body(j, t, band, c), lambda c: c, carry), None
        return lax.cond(visible, lambda c: body(j, t, band, c), lambda c: (c, y_zero), carry)

    step = jax.checkpoint(step, policy=jax.checkpoint_policies.nothing_saveable) if remat else step
    carry, ys = lax.scan(step, init, jnp.arange(plan.band, dtype=jnp.int32))
    return carry if y_zero is None else (carry, ys, start)


def _visible(plan: Plan, a: Arrays, g, i0, j, lo, hi):
    """Whether key block `j` may hold a visible key for query rows `i0…` of head `g`:
    inside `[lo, hi)` (`_key_blocks`), not all-False in the mask, and, with segment
    ids, the block's id range `[min, max]` meets the query block's (exact for
    sorted ids; for unsorted ones a superset, so never wrong, only less skipping).
    A `mask_mod` is evaluated on the block's (q_block x k_block) index grid: O(block)
    comparisons, far cheaper than the block's matmuls, and never an (N, S) array."""
    ok = (j >= lo) & (j < hi)
    if a.mask is not None:
        ok = ok & jnp.any(_pair_block(a.mask, plan, g, i0, j * plan.k_block))
    segments = _segment_block(a, plan, i0, j * plan.k_block)
    if segments is not None:
        q_ids, kv_ids = segments
        ok = ok & (jnp.min(q_ids) <= jnp.max(kv_ids)) & (jnp.min(kv_ids) <= jnp.max(q_ids))
    if plan.mask_mod is not None:
        vis = _visibility(plan, a)
        only_mod = Pattern(vis.n, vis.s, mask_mod=vis.mask_mod, q_start=vis.q_start)
        rows, cols = _block_indices(plan, i0, j * plan.k_block)
        ok = ok & jnp.any(block_allowed(only_mod, rows, cols, None, 4, None, _mod_heads(plan, a, g)))
    return ok


def _forward_rows(plan: Plan, a: Arrays, r):
    """One query block: `(out (B, K, bq, Dv), lse (B, K, bq), touched (B, K, bq))`,
    `touched` marking rows that may see a key in `a.bad_kv`."""
    g, i0 = _row_origin(plan, r)
    q_i = lax.dynamic_slice_in_dim(a.q, r * plan.q_block, plan.q_block, axis=2)
    bk = plan.k_block

    def key_block(j, t, band, carry):
        k_j, v_j = band.block("k", t, bk), band.block("v", t, bk)
        s, allowed = _scores(plan, a, q_i, k_j, g, i0, j * bk)
        seen = None
        if a.bad_kv is not None:
            seen = band.block("bad_kv", t, bk)[:, :, None, :]
            seen = seen if allowed is None else allowed & seen
        return fold_block(carry, s, v_j, _MIX, seen)

    rows = a.q.shape[:2] + (plan.q_block,)
    init = (
        jnp.full(rows, -jnp.inf, _F(plan)), jnp.zeros(rows, _F(plan)),
        jnp.zeros(rows + (a.v.shape[-1],), _F(plan)), jnp.zeros(rows, bool),
    )
    m, l, acc, touched = _key_loop(plan, a, g, i0, key_block, init)
    empty = m == -jnp.inf
    out = jnp.where(empty[..., None], 0.0, acc / jnp.where(empty, 1.0, l)[..., None])
    return out, jnp.where(empty, jnp.inf, m + jnp.log(l)), touched


def _forward(plan: Plan, a: Arrays):
    """`(out (B, K, R, Dv), lse (B, K, R), touched (B, K, R))`."""
    if not plan.per_head:
        out, lse, touched = lax.map(functools.partial(_forward_rows, plan, a),
                                    jnp.arange(plan.num_row_blocks, dtype=jnp.int32))
        return tuple(_unblock(x) for x in (out, lse, touched))
    b, k = a.q.shape[:2]

    def block(f):
        return _forward_rows(plan, _head(a, f // plan.num_row_blocks, k), f % plan.num_row_blocks)

    out, lse, touched = lax.map(block, jnp.arange(b * k * plan.num_row_blocks, dtype=jnp.int32))
    return tuple(_unstack(x, b, k) for x in (out, lse, touched))


def _head(a: Arrays, h, num_kv_heads: int) -> Arrays:
    """The arrays of key/value head `h` of the flattened `B·K`, with B = K = 1.

    On one CPU device the engine runs one head's query block at a time (one flat loop
    over heads and blocks): XLA:CPU runs one head's 2-D matmuls at least as fast as
    the batched matmuls of all B·K heads, and one head's score block stays in cache
    (docs/performance.md). Elsewhere (`Plan.per_head` False: GPUs, where batched
    matmuls are fast; several devices, where slicing a head out of an axis sharded
    over "model" would all-gather it; heads wider than `PER_HEAD_MAX_DIM`) all B·K
    heads go together. A single flat loop (rather than a loop over heads around a
    loop over blocks) keeps every step dependent on its index, so JAX's partial
    evaluation never hoists head-invariant block work out of a rematerialised loop
    into O(N·S) arrays.
    """
    return a._replace(**{f: _head_of(h // num_kv_heads, h % num_kv_heads, getattr(a, f)) for f in _PER_HEAD_FIELDS})


def _head_of(b_index, k_index, x):
    """Batch entry `b_index`, key/value head `k_index` of a `(B|1, K|1, …)` array
    (lengths: `(B|1, 1, 1, 1)`), keeping size-1 axes: `(1, 1, …)`."""
    if x is None:
        return None
    if x.shape[0] != 1:
        x = lax.dynamic_slice_in_dim(x, b_index, 1, axis=0)
    if x.shape[1] != 1:
        x = lax.dynamic_slice_in_dim(x, k_index, 1, axis=1)
    return x


def _unblock(x: jax.Array) -> jax.Array:
    """`(nr, B, K, bq, …) -> (B, K, nr·bq, …)` (all heads together)."""
    x = jnp.moveaxis(x, 0, 2)
    return x.reshape(x.shape[:2] + (-1,) + x.shape[4:])


def _blocks(x: jax.Array, plan: Plan) -> jax.Array:
    """`(B, K, R, …) -> (nr, B, K, bq, …)`: the inverse of `_unblock`."""
    x = x.reshape(x.shape[:2] + (plan.num_row_blocks, plan.q_block) + x.shape[3:])
    return jnp.moveaxis(x, 2, 0)


def _stack(x: jax.Array, plan: Plan) -> jax.Array:
    """`(B, K, R, …) -> (B·K·nr, 1, 1, bq, …)`: one entry per step of the flat loop
    (a reshape: rows are contiguous after B and K)."""
    return x.reshape((-1, 1, 1, plan.q_block) + x.shape[3:])


def _unstack(x: jax.Array, b: int, k: int) -> jax.Array:
    """`(B·K·nr, 1, 1, bq, …) -> (B, K, R, …)`."""
    return x.reshape((b, k, -1) + x.shape[4:])


# ---------------------------------------------------------------------------------
# Which blocks the loops visit (tests and studies of block skipping).
# ---------------------------------------------------------------------------------


def visited_blocks(q, k, v, vis: Visibility, *, q_block: int, k_block: int, by: str = "queries") -> int:
    """How many (query block, key block) pairs the engine computes for these inputs,
    summed over every batch entry and head (`visited_table`'s True entries)."""
    return int(jnp.sum(visited_table(q, k, v, vis, q_block=q_block, k_block=k_block, by=by)))


def visited_table(q, k, v, vis: Visibility, *, q_block: int, k_block: int, by: str = "queries") -> np.ndarray:
    """Which (query block, key block) pairs the engine computes, from the same
    decisions its loops take.

    Args:
      q: `(B…, H, N, D)`; k: `(B…, K, S, D)`; v: `(B…, K, S, Dv)`.
      vis: the description (public layout); q_block, k_block: the block sizes.
      by: `"queries"`, the forward's and the dq pass's loops (key blocks per query
        block), or `"keys"`, the dk/dv pass's (query blocks per key block); the two
        must agree.

    Returns:
      bool `(B·K, G·Np / q_block, Sp / k_block)`.

    Raises:
      ValueError: for another `by`.
    """
    if by not in ("queries", "keys"):
        raise ValueError(f"by must be 'queries' or 'keys', got {by!r}")
    plan, a = _prepare(q, k, v, vis, scale=1.0, q_block=q_block, k_block=k_block, bad_kv=None, per_head=True)
    kv_heads = a.q.shape[1]
    nr, nk, nrg = plan.num_row_blocks, plan.num_key_blocks, plan.n_pad // plan.q_block

    def by_queries(head):
        def row(r):
            g, i0 = _row_origin(plan, r)
            lo, hi = _key_blocks(plan, head, i0)
            js = jnp.clip(lo, 0, nk - plan.band) + jnp.arange(plan.band, dtype=jnp.int32)
            seen = jax.vmap(lambda j: _visible(plan, head, g, i0, j, lo, hi))(js)
            return jnp.zeros(nk, bool).at[js].max(seen)
        return jax.vmap(row)(jnp.arange(nr, dtype=jnp.int32))

    def by_keys(head):
        ranges = _row_ranges(plan, head)

        def col(j):
            start = _query_start(plan, ranges, j)
            ts = jnp.arange(plan.groups * plan.q_band, dtype=jnp.int32)
            g, i = ts // plan.q_band, start + ts % plan.q_band
            seen = jax.vmap(lambda g, i: _visible(plan, head, g, i * plan.q_block, j, *ranges[:, i]))(g, i)
            return jnp.zeros(nr, bool).at[g * nrg + i].max(seen)
        return jax.vmap(col, out_axes=1)(jnp.arange(nk, dtype=jnp.int32))

    heads = jnp.arange(a.q.shape[0] * kv_heads, dtype=jnp.int32)
    table = lax.map(lambda h: (by_queries if by == "queries" else by_keys)(_head(a, h, kv_heads)), heads)
    return np.asarray(table)


# ---------------------------------------------------------------------------------
# Tangent (forward mode).
# ---------------------------------------------------------------------------------


def _tangent_block(plan: Plan, a: Arrays, da: Arrays, band: KeyBand, q_i, dq_i, lse_i, g, i0, j, t):
    """Contribution of key block `j` (block `t` of `band`) to one query block:
    `(A v + P dv, rowsum(A))`."""
    bk = plan.k_block
    k_j = band.block("k", t, bk)
    ds = None
    if dq_i is not None:
        ds = jnp.einsum(_SCORES, dq_i, k_j, preferred_element_type=_F(plan))
    if da.k is not None:
        dk_j = band.block("dk", t, bk)
        term = jnp.einsum(_SCORES, q_i, dk_j, preferred_element_type=_F(plan))
        ds = term if ds is None else ds + term
    ds = None if ds is None else ds * jnp.asarray(plan.scale, _F(plan))
    dbias = _pair_block(da.bias, plan, g, i0, j * bk)
    if dbias is not None:
        ds = dbias.astype(_F(plan)) if ds is None else ds + dbias.astype(_F(plan))
    s, allowed, ds = _scores_and_tangent(plan, a, q_i, k_j, g, i0, j * bk, ds, da.score_consts or None)
    p = jnp.exp(s - lse_i[..., None])  # the softmax weights; 0 where masked or empty
    if ds is not None and (plan.score_mod is not None or plan.static.changes_scores):
        ds = jnp.where(s == -jnp.inf, 0.0, ds)  # a mod's tangent at a -inf logit never meets p = 0
    rows = q_i.shape[:3]
    mixed = jnp.zeros(rows + (a.v.shape[-1],), _F(plan))
    c = jnp.zeros(rows, _F(plan))
    # The tangents and every product with them are in the accumulation dtype, so
    # nothing rounds to bfloat16 or overflows float16 between blocks.
    if ds is not None:
        prod = p * ds
        w = prod if allowed is None else jnp.where(allowed, prod, 0.0)  # select, never 0·NaN
        v_j = band.block("v", t, bk).astype(_F(plan))
        mixed = jnp.einsum(_MIX, w, v_j)
        c = jnp.sum(w, axis=-1)
    if da.v is not None:
        mixed = mixed + jnp.einsum(_MIX, p, band.block("dv", t, bk))
    return mixed, c


def _tangent_rows(plan: Plan, a: Arrays, da: Arrays, block):
    """One query block's `(d out, d lse)`; each key block is rematerialised when the
    tangent is reverse-differentiated, so its residuals are O(block), not O(N·S)."""
    r, q_i, dq_i, out_i, lse_i = block
    g, i0 = _row_origin(plan, r)

    def key_block(j, t, band, carry):
        mixed, c = _tangent_block(plan, a, da, band, q_i, dq_i, lse_i, g, i0, j, t)
        return carry[0] + mixed, carry[1] + c

    init = (jnp.zeros(out_i.shape, _F(plan)), jnp.zeros(lse_i.shape, _F(plan)))
    mixed, c = _key_loop(plan, a, g, i0, key_block, init, da=da, remat=True)
    return mixed - c[..., None] * out_i, c


def _tangent(plan: Plan, a: Arrays, da: Arrays, out, lse):
    """`(d out (B, K, R, Dv), d lse (B, K, R))`, linear in the tangents `da`."""
    rows_of = jnp.arange(plan.num_row_blocks, dtype=jnp.int32)
    if not plan.per_head:
        blocks = lambda x: None if x is None else _blocks(x, plan)
        xs = (rows_of, blocks(a.q), blocks(da.q), blocks(out), blocks(lse))
        d_out, d_lse = lax.map(functools.partial(_tangent_rows, plan, a, da), xs)
        return _unblock(d_out), _unblock(d_lse)
    b, k = a.q.shape[:2]
    heads = lambda x: None if x is None else x.reshape((b * k, 1, 1) + x.shape[2:])
    rows = lambda x: None if x is None else _stack(x, plan)

    def one_head(x):
        h, q, k_, v, bad, dq, dk, dv, out_h, lse_h = x
        head = _head(a, h, k)._replace(q=q, k=k_, v=v, bad_kv=bad)
        dhead = Arrays(None, dk, dv, _head_of(h // k, h % k, da.bias), None, None, None, None,
                       score_consts=da.score_consts)
        xs = (rows_of, rows(q), rows(dq), rows(out_h), rows(lse_h))
        d_out, d_lse = lax.map(functools.partial(_tangent_rows, plan, head, dhead), xs)
        return _unstack(d_out, 1, 1), _unstack(d_lse, 1, 1)

    xs = (jnp.arange(b * k, dtype=jnp.int32), *(heads(x) for x in (a.q, a.k, a.v, a.bad_kv, da.q, da.k, da.v,
                                                                    out, lse)))
    d_out, d_lse = lax.map(one_head, xs)
    return d_out.reshape(out.shape), d_lse.reshape(lse.shape)


# ---------------------------------------------------------------------------------
# Backward (reverse mode): the FlashAttention-2 passes.
# ---------------------------------------------------------------------------------


class Cotangents(NamedTuple):
    """What the backward reads per query row: `g` the output cotangent `(…, Dv)`,
    `delta` = rowsum(g ⊙ out) - g_lse, and `lse`, all in the accumulation dtype."""

    g: jax.Array
    delta: jax.Array
    lse: jax.Array

    def rows(self, r0, size: int) -> Cotangents:
        return Cotangents(*(lax.dynamic_slice_in_dim(x, r0, size, axis=2) for x in self))


def _grad_block(plan: Plan, a: Arrays, q_i, k_j, v_j, ct: Cotangents, g, i0, j0, transposed: bool = False):
    """`(P, dS, d float consts)` of one block: the weights, the cotangent of the
    scaled, biased scores (through score_mod and the soft-cap), and of score_mod's
    floating constants; `(B, K, bq, bk)`, or `(B, K, bk, bq)` transposed. q_i, k_j,
    v_j, ct in the accumulation dtype."""
    s = _raw_scores(plan, a, q_i, k_j, g, i0, j0, transposed)
    rows, cols = (lax.broadcast_to_rank(x, 4) for x in _block_indices(plan, i0, j0, transposed))
    post, floats = _logits_fn(plan, a, g, rows, cols, transposed)
    pull = None
    if post is not None:
        s, pull = jax.vjp(post, s, *(a.score_consts[i] for i in floats))
    allowed = _allowed(plan, a, g, i0, j0, transposed)
    if allowed is not None:
        s = jnp.where(allowed, s, -jnp.inf)
    row = (lambda x: x[..., None, :]) if transposed else (lambda x: x[..., None])
    p = jnp.exp(s - row(ct.lse))  # 0 where masked or the row is empty
    dp = jnp.einsum(_SCORES, v_j, ct.g) if transposed else jnp.einsum(_SCORES, ct.g, v_j)
    ds = logits_grad(p, dp, row(ct.delta))
    if pull is None:
        return p, ds, ()
    ds, *d_consts = pull(ds)
    return p, ds, tuple(x.astype(_F(plan)) for x in d_consts)


def _reduce_to(x: jax.Array, shape: tuple) -> jax.Array:
    """`x` summed over the axes where `shape` (same rank) is 1 and x is not."""
    axes = tuple(i for i, (have, want) in enumerate(zip(x.shape, shape)) if want == 1 and have != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def _dq_rows(plan: Plan, a: Arrays, cts: Cotangents, wants: frozenset, r):
    """One query block's pass over its key blocks: `(dq (B, K, bq, D), d consts, dbias
    slab (B|1, K|1, bq|1, Sp|1) or None)`."""
    g, i0 = _row_origin(plan, r)
    f = _F(plan)
    q_i = lax.dynamic_slice_in_dim(a.q, r * plan.q_block, plan.q_block, axis=2).astype(f)
    ct = cts.rows(r * plan.q_block, plan.q_block)
    bias_block = _pair_block(a.bias, plan, g, i0, 0).shape if "bias" in wants else None
    scale = jnp.asarray(plan.scale, f)

    def key_block(j, t, band, carry):
        dq, d_consts = carry
        k_j = band.block("k", t, plan.k_block).astype(f)
        p, ds, d_block = _grad_block(plan, a, q_i, k_j, band.block("v", t, plan.k_block).astype(f), ct, g, i0,
                                     j * plan.k_block)
        dq = dq + scale * jnp.einsum(_MIX, ds, k_j)
        d_consts = tuple(x + y for x, y in zip(d_consts, d_block))
        return (dq, d_consts), (() if bias_block is None else _reduce_to(ds, bias_block))

    floats = [c for c in a.score_consts if jnp.issubdtype(jnp.result_type(c), jnp.floating)]
    init = (jnp.zeros(q_i.shape, f), tuple(jnp.zeros(jnp.shape(c), f) for c in floats) if plan.score_mod else ())
    y_zero = () if bias_block is None else jnp.zeros(bias_block, f)
    (dq, d_consts), ys, start = _key_loop(plan, a, g, i0, key_block, init, y_zero=y_zero)
    return dq, d_consts, None if bias_block is None else _bias_slab(plan, ys, start, bias_block)


def _bias_slab(plan: Plan, ys, start, block: tuple):
    """The band's bias cotangent blocks `(band, B|1, K|1, bq|1, bk|1)` placed at key
    block `start` of a `(B|1, K|1, bq|1, Sp|1)` slab (summed when bias has no key axis)."""
    if block[-1] == 1:
        return jnp.sum(ys, axis=0)
    band = jnp.moveaxis(ys, 0, -2).reshape(block[:-1] + (plan.band * plan.k_block,))
    slab = jnp.zeros(block[:-1] + (plan.s_pad,), ys.dtype)
    return lax.dynamic_update_slice_in_dim(slab, band, start * plan.k_block, axis=3)


def _row_ranges(plan: Plan, a: Arrays) -> jax.Array:
    """int32 `(2, Np / bq)`: `_key_blocks` of every query block of one head."""
    firsts = jnp.arange(plan.n_pad // plan.q_block, dtype=jnp.int32) * plan.q_block
    return jnp.stack(jax.vmap(lambda i0: _key_blocks(plan, a, i0))(firsts))


def _query_start(plan: Plan, ranges: jax.Array, j):
    """The first query block (of each head) of the `plan.q_band` the key-block pass
    visits for key block `j`: the query blocks whose `_key_blocks` range holds `j`
    lie within `q_band` blocks of the first of them (`_bands`)."""
    sees = (ranges[0] <= j) & (j < ranges[1])
    first = jnp.argmax(sees).astype(jnp.int32)  # 0 when none sees j (every step is then skipped)
    return jnp.clip(first, 0, plan.n_pad // plan.q_block - plan.q_band)


def _dkv_cols(plan: Plan, a: Arrays, cts: Cotangents, ranges, j):
    """Key block `j`'s pass over the query blocks (of all G heads) that see it:
    `(dk (B, K, bk, D), dv (B, K, bk, Dv))`, each step under `lax.cond` with the
    forward's own test (`_visible`)."""
    f = _F(plan)
    k_j = lax.dynamic_slice_in_dim(a.k, j * plan.k_block, plan.k_block, axis=2).astype(f)
    v_j = lax.dynamic_slice_in_dim(a.v, j * plan.k_block, plan.k_block, axis=2).astype(f)
    start = _query_start(plan, ranges, j)
    scale = jnp.asarray(plan.scale, f)
    # The rows of the loop's query blocks, cut once before it (as the forward cuts its
    # key band): step t reads rows t·q_block … of `(B, K, G·q_band·bq, …)`. Slicing
    # the whole rows inside the loop made XLA copy a head's q and g (O(N·D)) at every
    # key block of the one-head-at-a-time loop, which dominated narrow windows.
    rows_cut = plan.q_band * plan.q_block

    def cut(x):
        x = x.reshape(x.shape[:2] + (plan.groups, plan.n_pad) + x.shape[3:])
        x = lax.dynamic_slice_in_dim(x, start * plan.q_block, rows_cut, axis=3)
        return x.reshape(x.shape[:2] + (plan.groups * rows_cut,) + x.shape[4:])

    q_band, ct_band = cut(a.q), Cotangents(*(cut(x) for x in cts))

    # Transposed blocks (k qᵀ): Pᵀ g and dSᵀ q are then plain matmuls, which XLA:CPU
    # runs far faster than products with a transposed operand (docs/performance.md).
    mix = _MIX if plan.transposable else _BACK

    def body(g, i, t, carry):
        dk, dv = carry
        q_i = lax.dynamic_slice_in_dim(q_band, t * plan.q_block, plan.q_block, axis=2).astype(f)
        ct = ct_band.rows(t * plan.q_block, plan.q_block)
        p, ds, _ = _grad_block(plan, a, q_i, k_j, v_j, ct, g, i * plan.q_block, j * plan.k_block, plan.transposable)
        return dk + scale * jnp.einsum(mix, ds, q_i), dv + jnp.einsum(mix, p, ct.g)

    def step(carry, t):
        g, i = t // plan.q_band, start + t % plan.q_band
        visible = _visible(plan, a, g, i * plan.q_block, j, ranges[0, i], ranges[1, i])
        return lax.cond(visible, lambda c: body(g, i, t, c), lambda c: c, carry), None

    init = (jnp.zeros(k_j.shape, f), jnp.zeros(v_j.shape, f))
    return lax.scan(step, init, jnp.arange(plan.groups * plan.q_band, dtype=jnp.int32))[0]


def _dq_pass(plan: Plan, a: Arrays, cts: Cotangents, wants: frozenset):
    """`(dq (B, K, R, D), d float consts, dbias (a.bias's shape) or None)`."""
    nr = plan.num_row_blocks
    floats = [c for c in a.score_consts if jnp.issubdtype(jnp.result_type(c), jnp.floating)]
    init = tuple(jnp.zeros(jnp.shape(c), _F(plan)) for c in floats) if plan.score_mod else ()
    b, k = a.q.shape[:2]

    def step(d_consts, f):
        if plan.per_head:
            h, r = f // nr, f % nr
            head, ct = _head(a, h, k), Cotangents(*(_head_of(h // k, h % k, x) for x in cts))
        else:
            head, ct, r = a, cts, f
        dq, d_block, slab = _dq_rows(plan, head, ct, wants, r)
        return tuple(x + y for x, y in zip(d_consts, d_block)), (dq, () if slab is None else slab)

    steps = b * k * nr if plan.per_head else nr
    d_consts, (dq, slabs) = lax.scan(step, init, jnp.arange(steps, dtype=jnp.int32))
    dq = _unstack(dq, b, k) if plan.per_head else _unblock(dq)
    dbias = None if "bias" not in wants else _bias_grad(plan, slabs, a.bias.shape, (b, k) if plan.per_head else None)
    return dq, d_consts, dbias


def _bias_grad(plan: Plan, slabs, shape: tuple, heads: tuple | None):
    """The bias cotangent of shape `shape` `(B|1, K|1, G|1, Np|1, Sp|1)` from the dq
    pass's slabs: `(B·K·nr, 1, 1, bq|1, Sp|1)` one head at a time (`heads` = (B, K)),
    or `(nr, B|1, K|1, bq|1, Sp|1)` all heads together (`heads` None)."""
    nrg = plan.n_pad // plan.q_block
    if heads is not None:
        x = slabs.reshape(heads + (plan.groups, nrg) + slabs.shape[-2:])
    else:
        x = slabs.reshape((plan.groups, nrg) + slabs.shape[1:]).transpose(2, 3, 0, 1, 4, 5)
    if shape[3] != 1:
        x = x.reshape(x.shape[:3] + (plan.n_pad, x.shape[-1]))
    else:
        x = jnp.sum(x, axis=(3, 4))[:, :, :, None, :]
    return _reduce_to(x, shape)


def _dkv_pass(plan: Plan, a: Arrays, cts: Cotangents):
    """`(dk (B, K, Sp, D), dv (B, K, Sp, Dv))`: one pass per key block."""
    nk = plan.num_key_blocks
    if not plan.per_head:
        ranges = _row_ranges(plan, a)
        dk, dv = lax.map(lambda j: _dkv_cols(plan, a, cts, ranges, j), jnp.arange(nk, dtype=jnp.int32))
        return _unblock(dk), _unblock(dv)
    b, k = a.q.shape[:2]

    def col(f):
        h = f // nk
        head = _head(a, h, k)
        ct = Cotangents(*(_head_of(h // k, h % k, x) for x in cts))
        return _dkv_cols(plan, head, ct, _row_ranges(plan, head), f % nk)

    dk, dv = lax.map(col, jnp.arange(b * k * nk, dtype=jnp.int32))
    return _unstack(dk, b, k), _unstack(dv, b, k)


def _backward(plan: Plan, a: Arrays, out, lse, g_out, g_lse, live: tuple) -> list:
    """The cotangents of the live inputs (`_Derivative.live`, in that order) from the
    output cotangents `g_out (B, K, R, Dv)` and `g_lse (B, K, R)`: the dq pass when
    q, bias or score_mod's constants need one, the dk/dv pass when k or v do."""
    f = _F(plan)
    g_out = g_out.astype(f)
    cts = Cotangents(g_out, output_delta(g_out, out, g_lse.astype(f)), lse)
    wants = frozenset(x for x in live if isinstance(x, str))
    dq = d_consts = dbias = dk = dv = None
    if wants & {"q", "bias"} or any(isinstance(x, int) for x in live):
        dq, d_consts, dbias = _dq_pass(plan, a, cts, wants)
    if wants & {"k", "v"}:
        dk, dv = _dkv_pass(plan, a, cts)
    named = dict(q=dq, k=dk, v=dv, bias=dbias)
    floats = [i for i, c in enumerate(a.score_consts) if jnp.issubdtype(jnp.result_type(c), jnp.floating)]
    return [named[x] if isinstance(x, str) else d_consts[floats.index(x)] for x in live]


# ---------------------------------------------------------------------------------
# The custom derivative.
# ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Derivative:
    """The engine's derivative as a linear map (`jax_mha.paths.linear_map.linear_call`): the
    tangent `(d out, d lse)` of the live input tangents (`_tangent`), or, transposed,
    their cotangents from `(g out, g lse)` (`_backward`). `live` names the inputs with
    a tangent, in the order of the linear arguments: "q", "k", "v", "bias", and the
    index of each floating constant of score_mod; the residuals are the flattened
    `(Arrays, out, lse)` (`res_tree`)."""

    plan: Plan
    live: tuple
    res_tree: object
    transposed: bool = False

    def apply(self, res, lin):
        a, out, lse = jax.tree.unflatten(self.res_tree, res)
        if self.transposed:
            return _backward(self.plan, a, out, lse, *lin, self.live)
        named = dict(zip(self.live, lin))
        consts = tuple(named.get(i) for i in range(len(a.score_consts)))
        da = Arrays(named.get("q"), named.get("k"), named.get("v"), named.get("bias"), None, None, None, None,
                    score_consts=consts if any(t is not None for t in consts) else ())
        return list(_tangent(self.plan, a, da, out, lse))

    def transpose(self) -> _Derivative:
        return dataclasses.replace(self, transposed=not self.transposed)

    def out_avals(self, res_avals, lin_avals):
        a, out, lse = jax.tree.unflatten(self.res_tree, res_avals)
        f = _F(self.plan)
        if not self.transposed:
            return [jax.ShapeDtypeStruct(out.shape, f), jax.ShapeDtypeStruct(lse.shape, f)]
        shape = lambda x: a.score_consts[x].shape if isinstance(x, int) else getattr(a, x).shape
        return [jax.ShapeDtypeStruct(shape(x), f) for x in self.live]


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def flash_attention(plan: Plan, a: Arrays):
    """`(out (B, K, R, Dv), lse (B, K, R), touched (B, K, R))` for the engine layout;
    out and lse in the accumulation dtype."""
    return _forward(plan, a)


# Jitted with the plan static, so that eager calls compile once per plan and shape
# (inside an outer jit this is inlined).
_flash_jit = jax.jit(flash_attention, static_argnums=0)


@functools.partial(flash_attention.defjvp, symbolic_zeros=True)
def _flash_attention_jvp(plan, primals, tangents):
    (a,), (da,) = primals, tangents
    f = _F(plan)
    given = lambda t: t is not None and type(t) is not SymbolicZero
    live, lin = [], []
    for name in ("q", "k", "v", "bias"):
        if given(getattr(da, name)):
            live.append(name)
            lin.append(getattr(da, name).astype(f))
    for i, (c, t) in enumerate(zip(a.score_consts, da.score_consts)):
        if jnp.issubdtype(jnp.result_type(c), jnp.floating) and given(t):
            live.append(i)
            lin.append(t.astype(f))
    out, lse, touched = _forward(plan, a)
    no_tangent = np.zeros(touched.shape, jax.dtypes.float0)  # touched is boolean
    if not live:
        return (out, lse, touched), (jnp.zeros_like(out), jnp.zeros_like(lse), no_tangent)
    res, tree = jax.tree.flatten((a, out, lse))
    d_out, d_lse = linear_call(_Derivative(plan, tuple(live), tree), res, lin)
    return (out, lse, touched), (d_out, d_lse, no_tangent)


# ---------------------------------------------------------------------------------
# From the public layout to the engine's and back.
# ---------------------------------------------------------------------------------


def _pad(x: jax.Array, axis: int, size: int, value) -> jax.Array:
    """Pads `axis` at the end up to `size` (size-1 axes are broadcast: left alone)."""
    extra = size - x.shape[axis]
    if extra <= 0 or x.shape[axis] == 1:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _pairwise(x, batch, heads, groups, n_pad, s_pad, fill):
    """mask/bias broadcastable to `(B…, H, N, S)` -> `(B|1, K|1, G|1, Np|1, Sp|1)`."""
    if x is None:
        return None
    x = x.reshape((1,) * (len(batch) + 3 - x.ndim) + x.shape)  # (B…|1, H|1, N|1, S|1)
    lead = x.shape[: len(batch)]
    if all(d == 1 for d in lead):
        x = x.reshape((1,) + x.shape[len(batch):])
    else:
        x = jnp.broadcast_to(x, batch + x.shape[len(batch):]).reshape((-1,) + x.shape[len(batch):])
    split = (heads // groups, groups) if x.shape[1] != 1 else (1, 1)
    x = x.reshape(x.shape[:1] + split + x.shape[2:])  # (B|1, K|1, G|1, N|1, S|1)
    return _pad(_pad(x, 3, n_pad, fill), 4, s_pad, fill)


def _lengths(x, batch):
    """int32 lengths `(B…|1, 1, 1, 1)` (the description's) -> `(B|1, 1, 1, 1)`."""
    if x is None:
        return None
    if x.size == 1:
        return x.reshape(1, 1, 1, 1)
    return jnp.broadcast_to(x[..., 0, 0, 0], batch).reshape(-1, 1, 1, 1)


def _segments(x, batch, length_pad):
    """int32 ids `(B…|1, 1, L, 1)` or `(B…|1, 1, 1, L)` -> `(B|1, 1, Lp)`, padded with
    the last id (so that padding never widens a block's id range)."""
    if x is None:
        return None
    x = x.reshape(x.shape[:-3] + (-1,))  # (B…|1, L)
    x = x.reshape(1, -1) if all(d == 1 for d in x.shape[:-1]) else jnp.broadcast_to(x, batch + x.shape[-1:]).reshape(
        -1, x.shape[-1])
    return jnp.pad(x, ((0, 0), (0, length_pad - x.shape[-1])), mode="edge")[:, None, :]


# Head dims up to this run one head at a time on one CPU device (`_head`; measured in
# docs/performance.md, "One (sequence, head) at a time").
PER_HEAD_MAX_DIM = 128


def one_cpu_device() -> bool:
    """Whether the engine runs one head at a time (`Plan.per_head`, see `_head`)."""
    return jax.default_backend() == "cpu" and jax.device_count() == 1


def check_description(vis) -> None:
    """TypeError unless `vis` is a `Visibility` (user-facing callers of the engine
    go through `jax_mha.attention`, which validates and builds it)."""
    if not isinstance(vis, Visibility):
        raise TypeError(f"the engine takes a jax_mha._masking.Visibility (built by jax_mha.attention), got "
                        f"{type(vis).__name__}; call jax_mha.attention(..., implementation='blockwise')")


def _convert_mods(vis: Visibility, plan: Plan, b: int, kv_heads: int):
    """`(plan with the traced mods, score consts, mask consts)`.

    Every value a mod closes over, traced or concrete, of any dtype (a learned
    relative-bias table, ALiBi slopes, document ids passed into a jitted function),
    becomes an explicit input of the engine (`trace_mod`): floating ones enter its
    custom derivative, so gradients reach them; the others ride along. The traced
    mod is specialised to the argument shapes, which are the same for every block of
    a plan: the score block `(B|1, K|1, bq, bk)` and the index arrays of rank 4."""
    plan = plan._replace(static=static_part(vis))
    if vis.score_mod is None and vis.mask_mod is None:
        return plan, (), ()
    lead = (1, 1) if plan.per_head else (b, kv_heads)
    i32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    idx = (i32((lead[0], 1, 1, 1)), i32((1, lead[1], 1, 1)), i32((1, 1, plan.q_block, 1)), i32((1, 1, 1, plan.k_block)))
    idx_t = idx[:2] + (i32((1, 1, 1, plan.q_block)), i32((1, 1, plan.k_block, 1)))
    fns, consts, same = {}, {}, True
    for name, fn in (("score_mod", vis.score_mod), ("mask_mod", vis.mask_mod)):
        if fn is None:
            continue
        extra = (jax.ShapeDtypeStruct(lead + (plan.q_block, plan.k_block), jnp.dtype(plan.dtype)),) * (
            name == "score_mod")
        fns[name], consts[name] = trace_mod(fn, *extra, *idx)
        extra_t = tuple(jax.ShapeDtypeStruct(x.shape[:-2] + x.shape[:-3:-1], x.dtype) for x in extra)
        try:
            fns[name + "_t"], again = trace_mod(fn, *extra_t, *idx_t)
            out = fns[name + "_t"].jaxpr.outvars[0].aval.shape
            fits = jnp.broadcast_shapes(out, (1, 1, plan.k_block, plan.q_block))[-2:] == (plan.k_block, plan.q_block)
        except Exception:  # noqa: BLE001 - a mod written for one orientation only: keep the plain blocks
            fits = False
        same = same and fits and _same_values(consts[name], again)
    plan = plan._replace(**fns, transposable=same)
    return plan, consts.get("score_mod", ()), consts.get("mask_mod", ())


def _same_values(first: tuple, second: tuple) -> bool:
    """Whether two traces of one mod read the same values (the same objects, or equal
    concrete arrays)."""
    if len(first) != len(second):
        return False
    for x, y in zip(first, second):
        if x is y:
            continue
        if isinstance(x, jax.core.Tracer) or isinstance(y, jax.core.Tracer):
            return False
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype != y.dtype or x.shape != y.shape or not np.array_equal(x, y):
            return False
    return True


def _static_or_traced(x, default: int):
    """`(static int or None, traced int32 scalar or None)` of an offset."""
    if x is None:
        return default, None
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return int(x), None
    return None, jnp.asarray(x).astype(jnp.int32)


def _widest(lo: np.ndarray, hi: np.ndarray, num_key_blocks: int) -> tuple[int, int]:
    """`(band, q_band)` of per-query-block key block ranges `[lo, hi)`: the widest
    range, and the most query blocks between the first and the last that hold one
    key block."""
    band = int(max(1, np.max(hi - lo, initial=0)))
    holds = (lo[:, None] <= np.arange(num_key_blocks)[None]) & (np.arange(num_key_blocks)[None] < hi[:, None])
    seen = holds.any(axis=0)
    first = np.argmax(holds, axis=0)
    last = holds.shape[0] - 1 - np.argmax(holds[::-1], axis=0)
    return band, int(max(1, np.max((last - first + 1)[seen], initial=1)))


def _traced_offset_bands(plan: Plan) -> tuple[int, int]:
    """`(band, q_band)` that hold whatever the (traced) offset: from the width of one
    row's visible keys (`key_range` far from either end), the keys a query block sees
    and the rows that see a key block, at the worst alignment to the blocks."""
    nk, nrg = plan.num_key_blocks, plan.n_pad // plan.q_block
    far = 4 * (plan.n_pad + plan.s_pad)
    lo, hi = key_range(Pattern(1, 8 * far, plan.is_causal, plan.window, q_offset=far), 0, 0, 8 * far)
    width = hi - lo
    if width >= far:  # unbounded on one side
        return nk, nrg
    keys, rows = plan.q_block + width - 1, plan.k_block + width - 1
    return (max(1, min(nk, (keys + plan.k_block - 2) // plan.k_block + 1)),
            max(1, min(nrg, (rows + plan.q_block - 2) // plan.q_block + 1)))


def _bands(plan: Plan) -> tuple[int, int]:
    """`(band, q_band)`: the static lengths of the key loop (key blocks per query
    block) and of the key-block pass (query blocks of one head per key block), from
    causality, the window and mask_mod's block ranges; with a traced offset, lengths
    that hold for any offset."""
    nk = plan.num_key_blocks
    table = None if plan.mask_ranges is None else np.asarray(plan.mask_ranges, np.int64).reshape(-1, 2)
    if plan.offset is None and (plan.is_causal or plan.window is not None):
        band, q_band = _traced_offset_bands(plan)
        if table is not None:
            by_table = _widest(table[:, 0], np.maximum(table[:, 1], table[:, 0]), nk)
            band, q_band = min(band, by_table[0]), min(q_band, by_table[1])
        return band, q_band
    vis = Pattern(plan.n, plan.s, plan.is_causal, plan.window, q_offset=plan.offset or 0)
    ranges = np.array([key_range(vis, i0, i0 + plan.q_block - 1, plan.s_pad)
                       for i0 in range(0, plan.n_pad, plan.q_block)], np.int64)
    lo, hi = ranges[:, 0] // plan.k_block, -(-ranges[:, 1] // plan.k_block)
    if table is not None:
        lo, hi = np.maximum(lo, table[:, 0]), np.minimum(hi, table[:, 1])
    return _widest(lo, np.maximum(hi, lo), nk)


def _prepare(q, k, v, vis: Visibility, *, scale, q_block: int, k_block: int, bad_kv, per_head: bool | None = None):
    """`(Plan, Arrays)`: the public layout moved into the engine's (`per_head` None:
    `one_cpu_device()` decides)."""
    batch = tuple(jnp.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3]))
    (heads, n, d), (kv_heads, s, _) = q.shape[-3:], v.shape[-3:]
    n_pad, s_pad = -(-n // q_block) * q_block, -(-s // k_block) * k_block
    offset, offset_traced = _static_or_traced(vis.q_offset, s - n)
    start, start_traced = _static_or_traced(vis.q_start, 0)
    plan = Plan(n, s, n_pad, s_pad, heads // kv_heads, q_block, k_block, 1, vis.is_causal, vis.window,
                float(scale), compute_dtype(q.dtype).name,
                one_cpu_device() and d <= PER_HEAD_MAX_DIM if per_head is None else per_head,
                offset=offset, start=start)
    b_flat = int(np.prod(batch, dtype=np.int64))
    plan, score_consts, mask_consts = _convert_mods(vis, plan, b_flat, kv_heads)
    if vis.mask_mod is not None:
        plan = plan._replace(mask_ranges=mask_mod_ranges(vis.mask_mod, b_flat, heads, n, s, n_pad, s_pad, q_block,
                                                         k_block, start))
    band, q_band = _bands(plan)
    plan = plan._replace(band=band, q_band=q_band)
    flat = lambda x: jnp.broadcast_to(x, batch + x.shape[-3:]).reshape((-1,) + x.shape[-3:])
    q_e = _pad(flat(q).reshape(-1, kv_heads, plan.groups, n, d), 3, n_pad, 0)
    q_e = q_e.reshape(q_e.shape[0], kv_heads, plan.groups * n_pad, d)  # (B, K, G·Np, D)
    k_e, v_e = (_pad(flat(x), 2, s_pad, 0) for x in (k, v))  # (B, K, Sp, D|Dv)
    a = Arrays(
        q_e, k_e, v_e,
        _pairwise(vis.bias, batch, heads, plan.groups, n_pad, s_pad, 0),
        _pairwise(vis.mask, batch, heads, plan.groups, n_pad, s_pad, False),
        _lengths(vis.q_lengths, batch), _lengths(vis.kv_lengths, batch),
        None if bad_kv is None else _pad(flat(bad_kv[..., None])[..., 0], 2, s_pad, False),
        _segments(vis.q_segment_ids, batch, n_pad), _segments(vis.kv_segment_ids, batch, s_pad),
        jnp.arange(b_flat, dtype=jnp.int32).reshape(-1, 1, 1, 1),
        jnp.arange(kv_heads, dtype=jnp.int32).reshape(1, -1, 1, 1),
        score_consts, mask_consts, offset_traced, start_traced,
    )
    return plan, a


def run_engine(q, k, v, vis: Visibility, *, scale: float, q_block: int, k_block: int, bad_kv=None):
    """The engine on public layouts.

    Args:
      q: `(B…, H, N, D)`; k: `(B…, K, S, D)`; v: `(B…, K, S, Dv)`; batch dims broadcast.
      vis: the validated description (`jax_mha._masking.Visibility`, public layout);
        its `q_offset` and `q_start` may be ints or traced integer scalars.
      scale: the logit scale.
      q_block, k_block: block sizes, at most N and S.
      bad_kv: bool broadcastable to `(B…, K, S)`, keys whose key or value had a
        non-finite entry (q, k, v themselves must be finite), or None.

    Returns:
      `(out (B…, H, N, Dv), lse (B…, H, N), touched (B…, H, N))`: out and lse (the
      row log-sum-exp of the scaled logits) in the accumulation dtype (float32, or
      float64 for float64 inputs), lse +inf on rows with no visible key, touched
      marking rows that may see a `bad_kv` key.

    Raises:
      TypeError: for a description that is not a `Visibility`.
    """
    check_description(vis)
    batch = tuple(jnp.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3]))
    (heads, n, _), (kv_heads, _, dv) = q.shape[-3:], v.shape[-3:]
    groups = heads // kv_heads
    plan, a = _prepare(q, k, v, vis, scale=scale, q_block=q_block, k_block=k_block, bad_kv=bad_kv)
    n_pad = plan.n_pad
    out, lse, touched = _flash_jit(plan, a)
    rows = lambda x: x.reshape(-1, kv_heads, groups, n_pad)[..., :n].reshape(batch + (heads, n))
    out = out.reshape(-1, kv_heads, groups, n_pad, dv)[..., :n, :].reshape(batch + (heads, n, dv))
    return out, rows(lse), rows(touched)
