"""The tuned attention engine: blocks of queries against blocks of keys, online softmax.

`"blockwise"` runs it (`jax_mha.blockwise` chooses the blocks), and so does `"xla"`
once its whole scores would be too big (`jax_mha.functional.WHOLE_SCORES_MAX_BYTES`);
memory stays linear in N.

* Forward (`_forward`): the FlashAttention recurrence (Dao et al. 2022, Alg. 1; Rabe &
  Staats 2021). Per query block, a running row maximum `m`, normaliser `l` and
  accumulator are rescaled by `exp(m_old - m_new)` as key blocks arrive; key blocks
  that causality or the window rule out are never visited. Saves only `out` and the
  row log-sum-exp `lse`.
* Derivatives (`_tangent`): a `jax.custom_jvp` whose tangent is linear in
  `(dq, dk, dv, dbias)` and recomputes each block's weights `P = exp(S - lse)` from
  the saved `lse`:

      dS = scale·(dq kᵀ + q dkᵀ) + dbias,   A = P ⊙ dS,   c = rowsum(A)
      d out = A v + P dv - c·out,             d lse = c

  `jax.jvp`/`jacfwd` evaluate it directly; for `grad`/`vjp` JAX transposes it, which
  gives the FlashAttention-2 backward (Dao 2023, Alg. 2: dv = Pᵀ g, dS = P ⊙ (g vᵀ -
  rowsum(g ⊙ out)), dq = scale·dS k, dk = scale·dSᵀ q) with every block body
  rematerialised (`jax.checkpoint`), so the backward also keeps only O((N + S)·D).
  Forward-over-reverse (`jax.hessian`) differentiates that backward in turn.

Layout inside the engine (`B` = flattened batch, `K` key/value heads, `G` query heads
per key/value head, `R = G·Np` query rows of all G heads stacked, so GQA is one
batched matmul per block and k/v are never repeated):
  q (B, K, R, D)   k (B, K, Sp, D)   v (B, K, Sp, Dv)
  bias, mask (B|1, K|1, G|1, Np|1, Sp|1)   q_len, kv_len (B|1, 1, 1, 1) int32
Masked scores are -inf, selected with `where`; a row with no visible key has
`m = -inf` and `lse = +inf` and outputs 0. A row that may attend to a non-finite
value outputs NaN; the value matmuls see only finite values, so a NaN in a masked
value never reaches another row.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from jax_mha._masking import Visibility, Window, block_allowed, compute_dtype, key_block_band, key_range, score_logits

_SCORES = "bkqd,bkcd->bkqc"  # q kᵀ per block (also dq kᵀ, q dkᵀ)
_MIX = "bkqc,bkcd->bkqd"  # p v per block (also a v, p dv)


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
    # The mods, closure-converted (`_convert_mods`) for this plan's block shapes:
    # `score_mod(score, b, h, q_idx, kv_idx, *Arrays.score_consts)`, likewise mask_mod.
    score_mod: object = None
    mask_mod: object = None
    soft_cap: float | None = None
    mask_ranges: tuple | None = None  # per query block, mask_mod's key blocks [first, last)

    @property
    def num_row_blocks(self) -> int:
        return self.groups * self.n_pad // self.q_block


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


_PER_HEAD_FIELDS = ("q", "k", "v", "bias", "mask", "q_len", "kv_len", "bad_kv", "q_ids", "kv_ids", "b_idx", "k_idx")


def _mod_heads(plan: Plan, a: Arrays, g):
    """`(batch index, query head index)` int32 of rank 4 for the mods' calls."""
    return a.b_idx, (a.k_idx * plan.groups + g).astype(jnp.int32)  # int32 under x64 too (the converted avals)


def _bound(fn, consts):
    return None if fn is None else (lambda *args: fn(*args, *consts))


def _visibility(plan: Plan, a: Arrays) -> Visibility:
    """The description with the engine-layout arrays (one batch entry and head when
    `plan.per_head`), for `block_allowed` and `key_range`."""
    return Visibility(plan.n, plan.s, plan.is_causal, plan.window, mask=a.mask, q_lengths=a.q_len,
                      kv_lengths=a.kv_len, score_mod=_bound(plan.score_mod, a.score_consts),
                      mask_mod=_bound(plan.mask_mod, a.mask_consts), logits_soft_cap=plan.soft_cap)


def _segment_block(a: Arrays, plan: Plan, i0, j0):
    """`(q ids (B|1, 1, bq, 1), kv ids (B|1, 1, 1, bk))` of one block, or None."""
    if a.q_ids is None:
        return None
    q_ids = lax.dynamic_slice_in_dim(a.q_ids, i0, plan.q_block, axis=2)
    kv_ids = lax.dynamic_slice_in_dim(a.kv_ids, j0, plan.k_block, axis=2)
    return q_ids[..., None], kv_ids[..., None, :]


def _pair_block(x: jax.Array | None, plan: Plan, g, i0, j0) -> jax.Array | None:
    """Head `g`, rows `i0…`, keys `j0…` of a `(B|1, K|1, G|1, Np|1, Sp|1)` mask or
    bias, as `(B|1, K|1, bq|1, bk|1)`; size-1 axes stay size 1."""
    if x is None:
        return None
    x = lax.dynamic_index_in_dim(x, g if x.shape[2] != 1 else 0, axis=2, keepdims=False)
    if x.shape[-2] != 1:
        x = lax.dynamic_slice_in_dim(x, i0, plan.q_block, axis=2)
    if x.shape[-1] != 1:
        x = lax.dynamic_slice_in_dim(x, j0, plan.k_block, axis=3)
    return x


def _row_origin(plan: Plan, r):
    """Query block `r` of the stacked rows -> (its head g, its first query position)."""
    r0 = r * plan.q_block
    return r0 // plan.n_pad, r0 % plan.n_pad


def _key_blocks(plan: Plan, a: Arrays, i0):
    """Key blocks `[lo, hi)` that query rows `i0 … i0 + q_block - 1` can see: by
    causality and window, and by the lengths (keys past every sequence's
    `kv_lengths` are masked; rows past every `q_lengths` see nothing). The engine
    runs one batch entry at a time, so "every sequence" is that sequence."""
    lo, hi = key_range(_visibility(plan, a), i0, i0 + plan.q_block - 1, plan.s_pad)
    if a.kv_len is not None:
        hi = jnp.minimum(hi, jnp.max(a.kv_len))
    if a.q_len is not None:
        hi = jnp.where(i0 >= jnp.max(a.q_len), lo, hi)
    lo, hi = lo // plan.k_block, (hi + plan.k_block - 1) // plan.k_block
    if plan.mask_ranges is not None:  # the mask function's own block range (`_mask_mod_ranges`)
        ranges = jnp.asarray(plan.mask_ranges, jnp.int32)  # (Np / bq, 2)
        first, last = ranges[i0 // plan.q_block, 0], ranges[i0 // plan.q_block, 1]
        lo, hi = jnp.maximum(lo, first), jnp.minimum(hi, last)
        hi = jnp.maximum(hi, lo)
    return lo, hi


@functools.lru_cache(maxsize=32)
def _mask_mod_ranges(mask_mod, batch: int, heads: int, n: int, s: int, n_pad: int, s_pad: int, q_block: int,
                     k_block: int) -> tuple[tuple[int, int], ...]:
    """Per query block, the key blocks `[first, last)` holding a key `mask_mod` allows
    for some batch entry and head: FlexAttention's block mask, reduced to one range
    per query block, computed once per (function, shapes) (cached: `mask_mod` must
    be a pure function of its indices) one query block at a time, never an (N, S)
    array. The engine's loop is then as long as the widest range, so a mask function
    written as a window runs the loop of the built-in window; blocks inside a range
    are still tested one by one (`_visible`)."""
    nk = s_pad // k_block

    @jax.jit
    def table():
        b = jnp.arange(batch, dtype=jnp.int32).reshape(-1, 1, 1, 1)
        h = jnp.arange(heads, dtype=jnp.int32).reshape(1, -1, 1, 1)
        cols = jnp.arange(s_pad, dtype=jnp.int32).reshape(1, 1, 1, -1)

        def row_block(r):
            rows = (r * q_block + jnp.arange(q_block, dtype=jnp.int32)).reshape(1, 1, -1, 1)
            ok = mask_mod(b, h, rows, cols) & (rows < n) & (cols < s)
            ok = jnp.any(jnp.broadcast_to(ok, ok.shape[:2] + (q_block, s_pad)), axis=(0, 1, 2))  # (Sp,)
            return jnp.any(ok.reshape(nk, k_block), axis=-1)

        return lax.map(row_block, jnp.arange(n_pad // q_block))

    with jax.ensure_compile_time_eval():
        seen = np.asarray(table())  # (Np / bq, nk)
    out = []
    for row in seen:
        idx = np.flatnonzero(row)
        out.append((int(idx[0]), int(idx[-1]) + 1) if idx.size else (0, 0))
    return tuple(out)


def _block_indices(plan: Plan, i0, j0):
    rows = (i0 + lax.broadcasted_iota(jnp.int32, (plan.q_block, 1), 0)).astype(jnp.int32)
    cols = (j0 + lax.broadcasted_iota(jnp.int32, (1, plan.k_block), 1)).astype(jnp.int32)
    return rows, cols


def _mods(plan: Plan, a: Arrays, s, g, rows, cols, ds=None, d_consts=None):
    """`(logits, d logits)`: score_mod and the soft-cap on one block of scaled, biased
    scores `s`, and their tangent (a JVP through the mods) given the tangent `ds` of
    `s` and `d_consts` of score_mod's floating constants (each None = zero)."""
    if plan.score_mod is None and plan.soft_cap is None:
        return s, ds
    vis = _visibility(plan, a)
    heads = _mod_heads(plan, a, g)
    floats = [i for i, c in enumerate(a.score_consts) if jnp.issubdtype(c.dtype, jnp.floating)]

    def post(x, *fc):
        consts = list(a.score_consts)
        for i, c in zip(floats, fc):
            consts[i] = c
        v = vis if plan.score_mod is None else Visibility(
            vis.n, vis.s, score_mod=_bound(plan.score_mod, consts), logits_soft_cap=plan.soft_cap)
        return score_logits(v, x, heads, rows, cols)

    live = [] if d_consts is None else [d_consts[i] for i in floats]
    if ds is None and all(t is None for t in live):
        return post(s, *(a.score_consts[i] for i in floats)), None
    tangents = [jnp.zeros_like(s) if ds is None else ds]
    tangents += [jnp.zeros_like(a.score_consts[i]) if t is None else t.astype(a.score_consts[i].dtype)
                 for i, t in zip(floats, live or [None] * len(floats))]
    return jax.jvp(post, (s, *(a.score_consts[i] for i in floats)), tuple(tangents))


def _scores(plan: Plan, a: Arrays, q_i, k_j, g, i0, j0):
    """float32 scores of one block with -inf where masked, and the allowed mask."""
    s, allowed, _ = _scores_and_tangent(plan, a, q_i, k_j, g, i0, j0)
    return s, allowed


def _scores_and_tangent(plan: Plan, a: Arrays, q_i, k_j, g, i0, j0, ds=None, d_consts=None):
    """`_scores`, and the tangent of the logits through the mods (`_mods`)."""
    s = jnp.einsum(_SCORES, q_i, k_j, preferred_element_type=_F(plan))
    s = s * jnp.asarray(plan.scale, _F(plan))
    bias = _pair_block(a.bias, plan, g, i0, j0)
    if bias is not None:
        s = s + bias.astype(_F(plan))
    rows, cols = _block_indices(plan, i0, j0)
    s, ds = _mods(plan, a, s, g, lax.broadcast_to_rank(rows, 4), lax.broadcast_to_rank(cols, 4), ds, d_consts)
    allowed = block_allowed(_visibility(plan, a), rows, cols, _pair_block(a.mask, plan, g, i0, j0), 4,
                            _segment_block(a, plan, i0, j0), _mod_heads(plan, a, g))
    if plan.s_pad != plan.s:  # keys added by padding never take part
        pad_ok = lax.broadcast_to_rank(cols < plan.s, 4)
        allowed = pad_ok if allowed is None else allowed & pad_ok
    if allowed is not None:
        s = jnp.where(allowed, s, -jnp.inf)
    return s, allowed, ds


def _F(plan: Plan):
    """The accumulation dtype."""
    return jnp.dtype(plan.dtype)


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


def _key_loop(plan: Plan, a: Arrays, g, i0, body, init, da: Arrays | None = None, remat: bool = False):
    """Runs `body(j, t, band, carry) -> carry` over the key blocks query rows `i0…`
    of head `g` can see: `j` the key block, `t` its index in `band` (a `KeyBand`).

    A scan of the static length `plan.band` starting at the first visible block,
    each step under `lax.cond`, so blocks that causality, the window, the lengths or
    an all-False mask block rule out cost nothing, and the loop stays differentiable
    in every mode (a `fori_loop` with traced bounds is not reverse-differentiable).
    The keys are sliced to the band once, before the loop: a step then reads (and,
    transposed, writes its gradient into) band-sized arrays, not S-sized ones, so a
    narrow window's backward does O(window) work per step, not O(S). `remat`
    rematerialises each step in the backward pass (`jax.checkpoint`), so its
    residuals are O(block).
    """
    lo, hi = _key_blocks(plan, a, i0)
    start = jnp.clip(lo, 0, plan.s_pad // plan.k_block - plan.band)
    cut = lambda x: None if x is None else lax.dynamic_slice_in_dim(x, start * plan.k_block,
                                                                     plan.band * plan.k_block, axis=2)
    band = KeyBand(cut(a.k), cut(a.v), cut(a.bad_kv), *((cut(da.k), cut(da.v)) if da is not None else ()))

    def step(carry, t):
        j = start + t
        return lax.cond(_visible(plan, a, g, i0, j, lo, hi), lambda c: body(j, t, band, c), lambda c: c, carry), None

    step = jax.checkpoint(step, policy=jax.checkpoint_policies.nothing_saveable) if remat else step
    return lax.scan(step, init, jnp.arange(plan.band))[0]


def _visible(plan: Plan, a: Arrays, g, i0, j, lo, hi):
    """Whether key block `j` may hold a visible key for query rows `i0…` of head `g`:
    inside `[lo, hi)` (`_key_blocks`), not all-False in the mask, and, with segment
    ids, the block's id range `[min, max]` meets the query block's (exact for
    sorted ids; for unsorted ones a superset, so never wrong, only less skipping)."""
    ok = (j >= lo) & (j < hi)
    if a.mask is not None:
        ok = ok & jnp.any(_pair_block(a.mask, plan, g, i0, j * plan.k_block))
    segments = _segment_block(a, plan, i0, j * plan.k_block)
    if segments is not None:
        q_ids, kv_ids = segments
        ok = ok & (jnp.min(q_ids) <= jnp.max(kv_ids)) & (jnp.min(kv_ids) <= jnp.max(q_ids))
    if plan.mask_mod is not None:
        # The mask function on the block's (q_block x k_block) index grid: O(block)
        # comparisons, far cheaper than the block's matmuls, and never an (N, S) array.
        rows, cols = _block_indices(plan, i0, j * plan.k_block)
        b, h = _mod_heads(plan, a, g)
        ok = ok & jnp.any(plan.mask_mod(b, h, lax.broadcast_to_rank(rows, 4), lax.broadcast_to_rank(cols, 4),
                                        *a.mask_consts))
    return ok


def visited_blocks(q, k, v, vis: Visibility, *, q_block: int, k_block: int) -> int:
    """How many (query block, key block) pairs the engine computes for these inputs:
    the same `_key_blocks` and `_visible` decisions the loop takes, summed over every
    batch entry and head (for tests and studies of block skipping)."""
    plan, a = _prepare(q, k, v, vis, scale=1.0, q_block=q_block, k_block=k_block, bad_kv=None, per_head=True)
    b, kv_heads = a.q.shape[:2]

    def count(f):
        head = _head(a, f // plan.num_row_blocks, kv_heads)
        g, i0 = _row_origin(plan, f % plan.num_row_blocks)
        lo, hi = _key_blocks(plan, head, i0)
        start = jnp.clip(lo, 0, plan.s_pad // plan.k_block - plan.band)
        js = start + jnp.arange(plan.band)
        return jnp.sum(jax.vmap(lambda j: _visible(plan, head, g, i0, j, lo, hi))(js))

    return int(jnp.sum(lax.map(count, jnp.arange(b * kv_heads * plan.num_row_blocks))))


def _forward_rows(plan: Plan, a: Arrays, r):
    """One query block: `(out (B, K, bq, Dv), lse (B, K, bq), touched (B, K, bq))`,
    `touched` marking rows that may see a key in `a.bad_kv`."""
    g, i0 = _row_origin(plan, r)
    q_i = lax.dynamic_slice_in_dim(a.q, r * plan.q_block, plan.q_block, axis=2)
    bk = plan.k_block

    def key_block(j, t, band, carry):
        m, l, acc, touched = carry
        k_j, v_j = band.block("k", t, bk), band.block("v", t, bk)
        s, allowed = _scores(plan, a, q_i, k_j, g, i0, j * bk)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no -inf - -inf
        p = jnp.exp(s - m_safe[..., None])
        correction = jnp.exp(m - m_safe)
        pv = jnp.einsum(_MIX, p.astype(v_j.dtype), v_j, preferred_element_type=_F(plan))
        if a.bad_kv is not None:
            bad_j = band.block("bad_kv", t, bk)[:, :, None, :]
            seen = bad_j if allowed is None else allowed & bad_j
            touched = touched | jnp.any(seen, axis=-1)
        return m_new, l * correction + jnp.sum(p, -1), acc * correction[..., None] + pv, touched

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
        out, lse, touched = lax.map(functools.partial(_forward_rows, plan, a), jnp.arange(plan.num_row_blocks))
        return tuple(_unblock(x) for x in (out, lse, touched))
    b, k = a.q.shape[:2]

    def block(f):
        return _forward_rows(plan, _head(a, f // plan.num_row_blocks, k), f % plan.num_row_blocks)

    out, lse, touched = lax.map(block, jnp.arange(b * k * plan.num_row_blocks))
    return tuple(_unstack(x, b, k) for x in (out, lse, touched))


def _head(a: Arrays, h, num_kv_heads: int) -> Arrays:
    """The arrays of key/value head `h` of the flattened `B·K`, with B = K = 1.

    On one CPU device the engine runs one head's query block at a time (one flat loop
    over heads and blocks): with the 512 x 1024 blocks used until 2026-11, XLA:CPU ran
    the batched matmuls of all B·K heads at once 1.5-2x slower than one head's 2-D
    matmuls, and one head's score block stays in cache; with today's default blocks
    the two layouts measured within 5% (2-core CPU, forward+backward). Elsewhere
    (`Plan.per_head` False: GPUs, where batched matmuls are fast; several devices,
    where slicing a head out of an axis sharded over "model" would all-gather it;
    heads wider than `PER_HEAD_MAX_DIM`) all B·K heads go together. A
    single flat loop (rather than a loop over heads around a loop over blocks) keeps
    every step dependent on its index, so JAX's partial evaluation never hoists
    head-invariant block work out of the rematerialised backward into O(N·S) arrays.
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
# Tangent (and, transposed by JAX, the backward pass).
# ---------------------------------------------------------------------------------


def _tangent_block(plan: Plan, a: Arrays, da: Arrays, band: KeyBand, q_i, dq_i, lse_i, g, i0, j, t):
    """Contribution of key block `j` (block `t` of `band`) to one query block:
    `(A v + P dv, rowsum(A))`."""
    bk = plan.k_block
    k_j = band.block("k", t, bk)
    p = None
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
    if ds is not None and (plan.score_mod is not None or plan.soft_cap is not None):
        ds = jnp.where(s == -jnp.inf, 0.0, ds)  # a mod's tangent at a -inf logit never meets p = 0
    rows = q_i.shape[:3]
    mixed = jnp.zeros(rows + (a.v.shape[-1],), _F(plan))
    c = jnp.zeros(rows, _F(plan))
    # The tangents and every product with them are in the accumulation dtype: their
    # transposes (the gradients) then never round to bfloat16 or overflow float16
    # between blocks; only the final gradient is cast to the input dtype.
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
    """One query block's `(d out, d lse)`; each key block is rematerialised in the
    backward pass, so its residuals are O(block), not O(N·S)."""
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
    if not plan.per_head:
        blocks = lambda x: None if x is None else _blocks(x, plan)
        xs = (jnp.arange(plan.num_row_blocks), blocks(a.q), blocks(da.q), blocks(out), blocks(lse))
        d_out, d_lse = lax.map(functools.partial(_tangent_rows, plan, a, da), xs)
        return _unblock(d_out), _unblock(d_lse)
    b, k = a.q.shape[:2]
    heads = lambda x: None if x is None else x.reshape((b * k, 1, 1) + x.shape[2:])
    rows = lambda x: None if x is None else _stack(x, plan)

    def one_head(x):
        h, q, k_, v, bad, dq, dk, dv, out_h, lse_h = x
        pick = functools.partial(_head_of, h // k, h % k)
        head = Arrays(q, k_, v, pick(a.bias), pick(a.mask), pick(a.q_len), pick(a.kv_len), bad,
                      pick(a.q_ids), pick(a.kv_ids), pick(a.b_idx), pick(a.k_idx), a.score_consts, a.mask_consts)
        dhead = Arrays(None, dk, dv, pick(da.bias), None, None, None, None, score_consts=da.score_consts)
        xs = (jnp.arange(plan.num_row_blocks), rows(q), rows(dq), rows(out_h), rows(lse_h))
        d_out, d_lse = lax.map(functools.partial(_tangent_rows, plan, head, dhead), xs)
        return _unstack(d_out, 1, 1), _unstack(d_lse, 1, 1)

    xs = (jnp.arange(b * k), *(heads(x) for x in (a.q, a.k, a.v, a.bad_kv, da.q, da.k, da.v, out, lse)))
    d_out, d_lse = lax.map(one_head, xs)
    return d_out.reshape(out.shape), d_lse.reshape(lse.shape)


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
    live = lambda t: None if t is None or type(t) is SymbolicZero else t.astype(_F(plan))
    consts = tuple(live(t) if jnp.issubdtype(c.dtype, jnp.floating) else None
                   for c, t in zip(a.score_consts, da.score_consts))
    da = Arrays(live(da.q), live(da.k), live(da.v), live(da.bias), None, None, None, None,
                score_consts=consts if any(t is not None for t in consts) else ())
    out, lse, touched = _forward(plan, a)
    no_tangent = np.zeros(touched.shape, jax.dtypes.float0)  # touched is boolean
    if all(t is None for t in da[:4]) and not da.score_consts:
        return (out, lse, touched), (jnp.zeros_like(out), jnp.zeros_like(lse), no_tangent)
    return (out, lse, touched), (*_tangent(plan, a, da, out, lse), no_tangent)


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


# Head dims up to this run one head at a time on CPU: measured forward+backward of
# MultiHeadAttention on a 2-core CPU, (B, N, d, H) = (4, 512, 512, 8), D = 64: 203 ms
# one head at a time vs 223 ms all together; (4, 512, 512, 1), D = 512: 199 vs 172 ms.
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
    """`(plan with the converted mods, score consts, mask consts)`.

    `jax.closure_convert` hoists the traced values a mod closes over (a learned
    relative-bias table, ALiBi slopes) into explicit arguments: they enter the
    engine's custom JVP as inputs, so gradients reach them. The converted function is
    specialised to the argument shapes, which are the same for every block of a plan:
    the score block `(B|1, K|1, bq, bk)` and the index arrays of rank 4."""
    if vis.score_mod is None and vis.mask_mod is None:
        return plan._replace(soft_cap=vis.logits_soft_cap), (), ()
    lead = (1, 1) if plan.per_head else (b, kv_heads)
    i32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    idx = (i32((lead[0], 1, 1, 1)), i32((1, lead[1], 1, 1)), i32((1, 1, plan.q_block, 1)), i32((1, 1, 1, plan.k_block)))
    score_fn = mask_fn = None
    score_consts = mask_consts = ()
    if vis.score_mod is not None:
        score = jax.ShapeDtypeStruct(lead + (plan.q_block, plan.k_block), jnp.dtype(plan.dtype))
        score_fn, score_consts = jax.closure_convert(vis.score_mod, score, *idx)
    if vis.mask_mod is not None:
        mask_fn, mask_consts = jax.closure_convert(vis.mask_mod, *idx)
    plan = plan._replace(score_mod=score_fn, mask_mod=mask_fn, soft_cap=vis.logits_soft_cap)
    return plan, tuple(score_consts), tuple(mask_consts)


def _prepare(q, k, v, vis: Visibility, *, scale, q_block: int, k_block: int, bad_kv, per_head: bool | None = None):
    """`(Plan, Arrays)`: the public layout moved into the engine's (`per_head` None:
    `one_cpu_device()` decides)."""
    batch = tuple(jnp.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3]))
    (heads, n, d), (kv_heads, s, _) = q.shape[-3:], v.shape[-3:]
    groups = heads // kv_heads
    n_pad, s_pad = -(-n // q_block) * q_block, -(-s // k_block) * k_block
    dtype = compute_dtype(q.dtype)
    band = key_block_band(vis, n_pad, q_block, k_block, s_pad // k_block)
    plan = Plan(n, s, n_pad, s_pad, groups, q_block, k_block, band, vis.is_causal, vis.window,
                float(scale), jnp.dtype(dtype).name,
                one_cpu_device() and d <= PER_HEAD_MAX_DIM if per_head is None else per_head)
    b_flat = 1
    for size in batch:
        b_flat *= size
    plan, score_consts, mask_consts = _convert_mods(vis, plan, b_flat, kv_heads)
    if vis.mask_mod is not None and not mask_consts:  # a concrete function: its block ranges once
        ranges = _mask_mod_ranges(vis.mask_mod, b_flat, heads, n, s, n_pad, s_pad, q_block, k_block)
        widest = max(hi - lo for lo, hi in ranges)
        plan = plan._replace(mask_ranges=ranges, band=max(1, min(plan.band, widest)))
    flat = lambda x: jnp.broadcast_to(x, batch + x.shape[-3:]).reshape((-1,) + x.shape[-3:])
    q_e = _pad(flat(q).reshape(-1, kv_heads, groups, n, d), 3, n_pad, 0)
    q_e = q_e.reshape(q_e.shape[0], kv_heads, groups * n_pad, d)  # (B, K, G·Np, D)
    k_e, v_e = (_pad(flat(x), 2, s_pad, 0) for x in (k, v))  # (B, K, Sp, D|Dv)
    a = Arrays(
        q_e, k_e, v_e,
        _pairwise(vis.bias, batch, heads, groups, n_pad, s_pad, 0),
        _pairwise(vis.mask, batch, heads, groups, n_pad, s_pad, False),
        _lengths(vis.q_lengths, batch), _lengths(vis.kv_lengths, batch),
        None if bad_kv is None else _pad(flat(bad_kv[..., None])[..., 0], 2, s_pad, False),
        _segments(vis.q_segment_ids, batch, n_pad), _segments(vis.kv_segment_ids, batch, s_pad),
        jnp.arange(b_flat, dtype=jnp.int32).reshape(-1, 1, 1, 1), jnp.arange(kv_heads, dtype=jnp.int32).reshape(1, -1, 1, 1),
        score_consts, mask_consts,
    )
    return plan, a


def run_engine(q, k, v, vis: Visibility, *, scale: float, q_block: int, k_block: int, bad_kv=None):
    """The engine on public layouts.

    Args:
      q: `(B…, H, N, D)`; k: `(B…, K, S, D)`; v: `(B…, K, S, Dv)`; batch dims broadcast.
      vis: the validated description (`jax_mha._masking.Visibility`, public layout,
        default query offset S - N).
      scale: the logit scale.
      q_block, k_block: block sizes, at most N and S.
      bad_kv: bool broadcastable to `(B…, K, S)`, keys whose key or value had a
        non-finite entry (q, k, v themselves must be finite), or None.

    Returns:
      `(out (B…, H, N, Dv), lse (B…, H, N), touched (B…, H, N))`: out and lse (the
      row log-sum-exp of the scaled logits) in the accumulation dtype (float32, or
      float64 for float64 inputs), lse +inf on rows with no visible key, touched
      marking rows that may see a `bad_kv` key.
    """
    check_description(vis)
    if vis.q_offset is not None:
        raise ValueError("the engine aligns queries at S - N; a q_offset needs the dense pattern (dense_allowed)")
    batch = tuple(jnp.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3]))
    (heads, n, _), (kv_heads, _, dv) = q.shape[-3:], v.shape[-3:]
    groups = heads // kv_heads
    plan, a = _prepare(q, k, v, vis, scale=scale, q_block=q_block, k_block=k_block, bad_kv=bad_kv)
    n_pad = plan.n_pad
    out, lse, touched = _flash_jit(plan, a)
    rows = lambda x: x.reshape(-1, kv_heads, groups, n_pad)[..., :n].reshape(batch + (heads, n))
    out = out.reshape(-1, kv_heads, groups, n_pad, dv)[..., :n, :].reshape(batch + (heads, n, dv))
    return out, rows(lse), rows(touched)
