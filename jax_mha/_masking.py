"""The one description of which (query, key) pairs may attend, and with what logits.

`jax_mha.attention` validates its arguments and builds one `Visibility` (a frozen
dataclass, a pytree whose arrays are leaves): a `Pattern` (who may attend: causality,
window, lengths, segments, dense mask, `mask_mod`), extended by what changes the logits
(bias, `score_mod`, soft cap, sinks); the rest of a call (shapes, dtypes, platform,
outputs) is a `Call`. Key ranges and block schedules read only the `Pattern`. Every
path reads the description: the
reference builds the pattern whole (`dense_allowed`), the blockwise engine evaluates it
one `(rows, keys)` block at a time (`block_allowed`) and skips the key blocks it rules
out (`key_range`, segment-id ranges), and the cuDNN path translates it to
`jax.nn.dot_product_attention`'s arguments. Decoding with a cache reads it too, with
the query offset set to the cache index (`jax_mha._attend`).

Query `i` sits at key position `i + offset`, by default `offset = S - N`: the queries
are the last N of S positions (bottom-right alignment, as `causal_mask`; `jax.nn`
aligns top-left, which is the same when N == S). Then key `j` is visible to query `i`
iff all of:

* `j <= i + offset`                              (is_causal)
* `i + offset - left <= j <= i + offset + right`  (local_window_size, a side None = unbounded)
* `i < q_lengths[b]` and `j < kv_lengths[b]`      (per-sequence lengths)
* `q_segment_ids[b, i] == kv_segment_ids[b, j]`   (packed sequences)
* `mask[..., i, j]`                               (explicit boolean mask)
* `mask_mod(b, h, i, j)`                          (a mask function, FlexAttention's)

and the logit of a visible pair is, in this order (`score_logits`):
scale · q·k → + bias → `score_mod(score, b, h, i, j)` → `c · tanh(· / c)`
(`logits_soft_cap = c`, Gemma 2) → masked. A logit that is `-inf` after `score_mod`
masks its key (soft-capping keeps it `-inf`). The mods are called with broadcastable
int32 index arrays: `b` the flattened batch index (row-major over `B…`), `h` the query
head (0…H-1), `i` the query row (0…N-1, its key position is `i + offset`), `j` the key.

A query row beyond its `q_lengths` is padding: its output is zero whatever the
`empty_rows` policy.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp


class Window(NamedTuple):
    """`local_window_size` in canonical form: a side of None is unbounded."""

    left: int | None
    right: int | None


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["mask", "q_lengths", "kv_lengths", "q_segment_ids", "kv_segment_ids", "q_offset", "q_start",
                 "schedule"],
    meta_fields=["n", "s", "is_causal", "window", "mask_mod", "batch_shape", "num_heads", "segments_shared"],
)
@dataclasses.dataclass(frozen=True)
class Pattern:
    """Who may attend: which (query, key) pairs are visible. Static parts are Python
    values (pytree metadata); arrays are leaves (traced under jit). Key ranges, block
    skipping and block schedules read only this (`key_range`, `block_allowed`,
    `jax_mha.paths.schedules`); `Visibility` adds what changes the logits.

    Attributes:
      n, s: query and key lengths N and S.
      is_causal: the causal pattern (bottom-right aligned, see `offset`).
      window: a `Window`, or None for no window.
      mask: bool broadcastable to `(B…, H, N, S)`, True = may attend, or None.
      q_lengths, kv_lengths: int32 `(B…|1, 1, 1, 1)` (`lengths_at_rank`), or None.
      q_segment_ids: int32 `(B…|1, 1, N, 1)`; kv_segment_ids: int32 `(B…|1, 1, 1, S)`
        (`segments_at_rank`); both or neither.
      q_offset: the key position of query 0, an int or a traced int32 scalar; None
        means `S - N`. Decoding sets it to the cache index.
      q_start: the `q_idx` the mods see for query row 0 (an int or a traced int32
        scalar; None means 0). Decoding sets it to the cache index, so that the mods
        see the positions of the full pass; ring attention to the device's first row.
      mask_mod: `mask_mod(batch, head, q_idx, kv_idx) -> bool`, or None. Callables
        are static metadata: they hash by identity, so jit caches per function.
      batch_shape, num_heads: `B…` and H, for the mods' index arrays (`dense_heads`).
      segments_shared: the keys' segment ids are the queries' own array (given once,
        for self-attention): a kernel that reads one id array for both may take them
        even when they are traced.
      schedule: a `jax_mha.block_schedule` built once for this pattern and passed to
        every layer (the library's kernel reads it instead of building its own when its
        blocks fit), or None.
    """

    n: int
    s: int
    is_causal: bool = False
    window: Window | None = None
    mask: jax.Array | None = None
    q_lengths: jax.Array | None = None
    kv_lengths: jax.Array | None = None
    q_segment_ids: jax.Array | None = None
    kv_segment_ids: jax.Array | None = None
    q_offset: int | jax.Array | None = None
    q_start: int | jax.Array | None = None
    mask_mod: object = None
    batch_shape: tuple = ()
    num_heads: int = 1
    segments_shared: bool = False
    schedule: object = None

    @property
    def offset(self):
        """Key position of query 0: `q_offset`, by default S - N (the queries are the
        last N positions)."""
        return self.s - self.n if self.q_offset is None else self.q_offset

    @property
    def start(self):
        """The mods' `q_idx` of query row 0 (`q_start`, by default 0)."""
        return 0 if self.q_start is None else self.q_start

    @property
    def segmented(self) -> bool:
        return self.q_segment_ids is not None

    @property
    def has_pattern(self) -> bool:
        """True when causality or a window restricts the pairs by position."""
        return self.is_causal or self.window is not None

    @property
    def every_row_sees_a_key(self) -> bool:
        """True when, statically, no query row can be empty: only causality and the
        window restrict (no mask, no lengths) and they leave every row a key. The
        visible range `[lo, hi)` of row `i` moves right with `i` and keeps its
        unclipped width, so rows 0 and N - 1 are the only ones that can lose it."""
        if (self.mask is not None or self.q_lengths is not None or self.kv_lengths is not None or self.segmented
                or self.mask_mod is not None):
            return False
        if not isinstance(self.offset, int):
            return False
        if self.n == 0 or self.s == 0:
            return False
        ranges = (key_range(self, row, row, self.s) for row in (0, self.n - 1))
        return all(lo < hi for lo, hi in ranges)

    @property
    def has_mods(self) -> bool:
        """True when a function of the indices is called (`mask_mod`; `Visibility`
        adds `score_mod`): the mods need batch and head indices."""
        return self.mask_mod is not None

    @property
    def restricts(self) -> bool:
        """False when every pair may attend (nothing to evaluate)."""
        return (
            self.has_pattern or self.mask is not None or self.segmented
            or self.q_lengths is not None or self.kv_lengths is not None or self.mask_mod is not None
        )


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["mask", "q_lengths", "kv_lengths", "q_segment_ids", "kv_segment_ids", "q_offset", "q_start",
                 "schedule", "bias", "sinks"],
    meta_fields=["n", "s", "is_causal", "window", "mask_mod", "batch_shape", "num_heads", "segments_shared",
                 "score_mod", "logits_soft_cap"],
)
@dataclasses.dataclass(frozen=True)
class Visibility(Pattern):
    """The one description of a call: its `Pattern` (who may attend), and what changes
    the logits of the visible pairs. `jax_mha.attention` builds it once, in the public
    layout (`public`); the blockwise engine keeps a copy of the arrays in its own
    layout (`jax_mha.paths.engine`). What the call asks beyond it (shapes, dtypes,
    platform, outputs) is a `Call`.

    Attributes (besides `Pattern`'s):
      bias: float broadcastable to `(B…, H, N, S)`, added to the scaled logits, or None.
      score_mod: `score_mod(score, batch, head, q_idx, kv_idx) -> score`, or None (static).
      logits_soft_cap: c > 0 (a Python float) or None.
      sinks: float `(H,)`, one logit per query head for a virtual key whose value is
        zero (attention sinks; `sinks = 0` is the "off-by-one" softmax), in the space
        of the scaled logits after the mods; or None. It takes part in every row's
        softmax denominator and is never masked.
    """

    bias: jax.Array | None = None
    score_mod: object = None
    logits_soft_cap: float | None = None
    sinks: jax.Array | None = None

    @property
    def has_mods(self) -> bool:
        return self.score_mod is not None or Pattern.has_mods.fget(self)

    @property
    def changes_scores(self) -> bool:
        """True when `score_logits` changes a logit (a `score_mod` or the soft cap)."""
        return self.score_mod is not None or self.logits_soft_cap is not None

    @property
    def every_row_sees_a_key(self) -> bool:
        """`Pattern.every_row_sees_a_key`, and no `score_mod` (which may mask a key by
        returning -inf)."""
        return self.score_mod is None and Pattern.every_row_sees_a_key.fget(self)


def static_part(vis: Visibility) -> Visibility:
    """The description without its arrays and mods: hashable, for a plan that is a
    static argument (causality, window, the soft cap, the shapes); a plan keeps the
    arrays, and the mods traced for its blocks, beside it."""
    return dataclasses.replace(jax.tree.map(lambda x: None, vis), score_mod=None, mask_mod=None)


# The description's functions of the indices (FlexAttention's), each called with
# `(…, batch, head, q_idx, kv_idx)`: the indices last.
MODS = ("score_mod", "mask_mod")
# Its arrays with one entry per query head `(H,)`: split with the heads.
PER_HEAD = ("sinks",)


def shift_indices(fn, batch=0, head=0, query=0):
    """`fn` (one of `MODS`) called with its batch, head and query indices offset by
    `batch`, `head`, `query` (ints or traced int32 scalars): a mod seen from a part of
    the problem (a device's heads, a decoding step's rows) with the whole problem's
    indices. None stays None."""
    if fn is None:
        return None
    return lambda *args: fn(*args[:-4], args[-4] + batch, args[-3] + head, args[-2] + query, args[-1])


def positional(vis: Pattern, rows: jax.Array, cols: jax.Array) -> jax.Array | None:
    """Causal and window constraints for query positions `rows` and key positions
    `cols` (broadcasting int arrays, e.g. `(bq, 1)` and `(1, bk)`), or None."""
    diagonal = rows + vis.offset  # the key position of each query
    ok = None

    def both(a, b):
        return b if a is None else a & b

    if vis.is_causal:
        ok = both(ok, cols <= diagonal)
    if vis.window is not None:
        if vis.window.left is not None:
            ok = both(ok, cols >= diagonal - vis.window.left)
        if vis.window.right is not None:
            ok = both(ok, cols <= diagonal + vis.window.right)
    return ok


def block_allowed(
    vis: Pattern, rows: jax.Array, cols: jax.Array, mask_block: jax.Array | None, rank: int,
    segments: tuple[jax.Array, jax.Array] | None = None, heads: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array | None:
    """Bool for one block of scores, or None when every pair in it may attend.

    Args:
      vis: the description (its lengths broadcast against the block).
      rows: int `(bq, 1)`, query positions of the block.
      cols: int `(1, bk)`, key positions of the block.
      mask_block: the explicit mask already sliced to this block (rank `rank`), or None.
      rank: rank of the score block, e.g. 4 for `(B, K, bq, bk)`.
      segments: `(q ids (…, bq, 1), kv ids (…, 1, bk))` sliced to this block, or None.
      heads: `(batch index, query head index)`, int32 of rank `rank`, for `mask_mod`.

    Returns:
      bool broadcastable to the score block, True = may attend.
    """
    lift = lambda x: jax.lax.broadcast_to_rank(x, rank)  # explicit ranks (rank promotion raises)
    parts = []
    pattern = positional(vis, rows, cols)
    if pattern is not None:
        parts.append(lift(pattern))
    if vis.q_lengths is not None:
        parts.append(lift(rows) < vis.q_lengths)
    if vis.kv_lengths is not None:
        parts.append(lift(cols) < vis.kv_lengths)
    if segments is not None:
        parts.append(lift(segments[0]) == lift(segments[1]))
    if mask_block is not None:
        parts.append(lift(mask_block))
    if vis.mask_mod is not None:
        q_idx = (lift(rows) + vis.start).astype(jnp.int32)
        parts.append(vis.mask_mod(heads[0], heads[1], q_idx, lift(cols).astype(jnp.int32)))
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out = out & p
    return out


def dense_allowed(vis: Pattern, rank: int) -> jax.Array | None:
    """The whole `(…, N, S)` boolean pattern of rank `rank` (the reference path,
    cuDNN's translation, decoding), or None when every pair may attend."""
    rows = jnp.arange(vis.n)[:, None]
    cols = jnp.arange(vis.s)[None, :]
    segments = (vis.q_segment_ids, vis.kv_segment_ids) if vis.segmented else None
    return block_allowed(vis, rows, cols, vis.mask, rank, segments, dense_heads(vis, rank))


def dense_rows(vis: Visibility, bad_kv: jax.Array, heads: int) -> tuple[jax.Array, jax.Array]:
    """`(empty, touched)`, bool `(B…, H, N)`: rows with no visible key, and rows that
    may see a key in `bad_kv` (bool `(B…, K, S)`, keys or values with a non-finite
    entry). For the kernel paths, whose kernels return neither.

    Where only causality and a window restrict (`every_row_sees_a_key`), no row is
    empty and each row sees one interval of keys `[lo, hi)` (`key_range`): whether it
    holds a bad key is a difference of prefix counts, O(N + S). Otherwise a
    `(B…, H, N, S)` reduction that XLA fuses into its two outputs (evaluated, never
    stored): O(B·H·N·S) work, not free next to a kernel (what it cost the cuDNN path
    before the interval route existed: docs/results/gpu_kernels.md, section 3).
    A `score_mod` that returns `-inf` is not consulted (the kernel paths take none)."""
    batch = jnp.broadcast_shapes(tuple(vis.batch_shape), bad_kv.shape[:-2])
    if vis.every_row_sees_a_key:
        rows = jnp.arange(vis.n)
        lo, hi = (jnp.broadcast_to(jnp.asarray(x, jnp.int32), (vis.n,)) for x in key_range(vis, rows, rows, vis.s))
        count = jnp.cumsum(bad_kv, axis=-1, dtype=jnp.int32)
        count = jnp.concatenate([jnp.zeros(count.shape[:-1] + (1,), jnp.int32), count], axis=-1)  # (B…, K, S + 1)
        seen = jnp.take(count, hi, axis=-1) > jnp.take(count, lo, axis=-1)  # (B…, K, N)
        touched = jnp.repeat(seen, heads // bad_kv.shape[-2], axis=-2)
        shape = tuple(batch) + (heads, vis.n)
        return jnp.zeros(shape, bool), jnp.broadcast_to(touched, shape)
    rank = bad_kv.ndim + 1
    allowed = dense_allowed(vis, rank)
    shape = tuple(batch) + (heads, vis.n, vis.s)
    allowed = jnp.broadcast_to(True if allowed is None else allowed, shape)
    sees_bad = jnp.repeat(bad_kv, heads // bad_kv.shape[-2], axis=-2)[..., None, :]  # (B…, H, 1, S)
    return ~jnp.any(allowed, axis=-1), jnp.any(allowed & sees_bad, axis=-1)


class Call(NamedTuple):
    """What a call asks of a path beyond the description: read by each path's
    `refusal(vis, call) -> str | None` (one per path, beside it) and by the dispatcher.

    Attributes:
      q, k, v: the inputs' shapes and dtypes (`jax.ShapeDtypeStruct` or arrays):
        `(B…, H, N, D)`, `(B…, K, S, D)`, `(B…, K, S, Dv)`.
      return_weights: the caller needs the `(B…, H, N, S)` weights.
      dropout: dropout on the weights is active.
      empty_rows: `"zero"` or `"uniform"`.
      platform: `"cpu"`, `"gpu"` or `"tpu"`, where the call runs.
      return_residual: the caller needs each row's log-sum-exp `(B…, H, N)`.
    """

    q: object
    k: object
    v: object
    return_weights: bool = False
    dropout: bool = False
    empty_rows: str = "zero"
    platform: str = "cpu"
    return_residual: bool = False


def _traced(x) -> bool:
    return isinstance(x, jax.core.Tracer)


class Part(NamedTuple):
    """One optional part of a call: `name` in a refusal's "X needs ..." clause,
    `describe(vis)` the phrase naming it in "cannot express ...", `present(vis, call)`,
    and its `job`: `"pattern"` (who may attend), `"logits"` (what changes the logits)
    or `"call"` (what the call asks for)."""

    name: str
    describe: Callable
    present: Callable
    job: str


def _part(name: str, phrase: str, present: Callable, job: str) -> Part:
    return Part(name, lambda vis: phrase, present, job)


# Their order is the order in which a refusal looks for the first part a path does not take.
PARTS = {
    "return_weights": _part("return_weights=True", "return_weights=True (the (B…, H, N, S) weights)",
                            lambda vis, call: call.return_weights, "call"),
    "dropout": _part("dropout", "dropout on the weights", lambda vis, call: call.dropout, "call"),
    "bias": _part("an additive bias", "an additive bias", lambda vis, call: vis.bias is not None, "logits"),
    "mask": _part("a dense mask", "a dense mask", lambda vis, call: vis.mask is not None, "pattern"),
    "score_mod": _part("score_mod", "score_mod", lambda vis, call: vis.score_mod is not None, "logits"),
    "mask_mod": _part("mask_mod", "mask_mod", lambda vis, call: vis.mask_mod is not None, "pattern"),
    "logits_soft_cap": Part("logits_soft_cap", lambda vis: f"logits_soft_cap={vis.logits_soft_cap!r}",
                            lambda vis, call: vis.logits_soft_cap is not None, "logits"),
    "sinks": _part("sinks", "sinks (attention sinks)", lambda vis, call: vis.sinks is not None, "logits"),
    "window": Part("a local window", lambda vis: f"a local window {tuple(vis.window)}",
                   lambda vis, call: vis.window is not None, "pattern"),
    "kv_lengths": _part("kv_lengths", "kv_lengths", lambda vis, call: vis.kv_lengths is not None, "pattern"),
    "q_lengths": _part("q_lengths", "q_lengths", lambda vis, call: vis.q_lengths is not None, "pattern"),
    "segment_ids": _part("segment ids", "segment ids", lambda vis, call: vis.segmented, "pattern"),
    "query_offset": _part("a query offset", "a query offset (decoding from a cache index)",
                          lambda vis, call: vis.q_offset is not None or vis.q_start is not None, "pattern"),
    "traced_offset": _part("a traced query offset",
                           "a traced query offset (decoding under jit: the pattern is not static)",
                           lambda vis, call: vis.q_offset is not None and _traced(vis.q_offset), "pattern"),
    "return_residual": _part("return_residual=True", "return_residual=True (the log-sum-exp)",
                             lambda vis, call: call.return_residual, "call"),
}
EVERY_PART = frozenset(PARTS)
# Who may attend, whatever the positions: what a dense (N, S) mask can hold (the
# pattern's parts but the query offsets, which move it).
MASK_PARTS = frozenset(name for name, part in PARTS.items() if part.job == "pattern") - {"query_offset",
                                                                                           "traced_offset"}


def parts(vis: Visibility, call: Call) -> tuple[str, ...]:
    """The parts this call has, in `PARTS`' order."""
    return tuple(name for name, part in PARTS.items() if part.present(vis, call))


def dense_heads(vis: Pattern, rank: int, batch: tuple | None = None, heads: int | None = None):
    """`(batch index (B…, 1, 1, 1), head index (1…, H, 1, 1))` int32 for the mods,
    from the shapes in `batch`/`heads` (None: read from `vis.batch_shape`); None when
    there is no mod (`has_mods`)."""
    if not vis.has_mods:
        return None
    batch = vis.batch_shape if batch is None else batch
    heads = vis.num_heads if heads is None else heads
    b = jnp.arange(math.prod(batch), dtype=jnp.int32).reshape(tuple(batch) + (1, 1, 1))
    h = jnp.arange(heads, dtype=jnp.int32).reshape((heads, 1, 1))
    return jax.lax.broadcast_to_rank(b, rank), jax.lax.broadcast_to_rank(h, rank)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """`cap · tanh(x / cap)` (Gemma 2), keeping `-inf` (a masked logit) at `-inf`."""
    if cap is None:
        return x
    c = jnp.asarray(cap, x.dtype)
    capped = c * jnp.tanh(x / c)
    return jnp.where(x == -jnp.inf, x, capped)


def score_logits(vis: Visibility, s: jax.Array, heads, rows, cols) -> jax.Array:
    """The mods applied to scaled, biased logits `s` (rank r): `score_mod`, then the
    soft-cap; `heads`, `rows`, `cols` as for `block_allowed`."""
    if vis.score_mod is not None:
        lift = lambda x: jax.lax.broadcast_to_rank(x, s.ndim).astype(jnp.int32)
        s = vis.score_mod(s, heads[0], heads[1], lift(rows + vis.start), lift(cols))
    return soft_cap(s, vis.logits_soft_cap)


def key_range(vis: Pattern, first_row, last_row, s: int):
    """Key positions `[lo, hi)` that queries `first_row … last_row` can see by
    causality and window (lengths and masks are not consulted). Python ints in give
    Python ints out; traced ints give traced ints, clipped to `[0, s]`."""
    lo, hi = 0, s
    if vis.window is not None and vis.window.left is not None:
        lo = first_row + vis.offset - vis.window.left
    reach = []
    if vis.is_causal:
        reach.append(0)
    if vis.window is not None and vis.window.right is not None:
        reach.append(vis.window.right)
    if reach:
        hi = last_row + vis.offset + min(reach) + 1
    if isinstance(lo, int) and isinstance(hi, int):
        return min(max(lo, 0), s), min(max(hi, 0), s)
    return jnp.clip(lo, 0, s), jnp.clip(hi, 0, s)


def key_block_range(vis: Pattern, first_row, q_block: int, k_block: int, s_pad: int, q_lengths=None,
                    kv_lengths=None):
    """Key blocks `[lo, hi)` (int32 scalars) that query rows `first_row …
    first_row + q_block - 1` may see: by causality and the window (`key_range`),
    past no sequence's `kv_lengths`, and none for rows past every `q_lengths`
    (lengths as arrays of any shape, or None). A bound: every block in it is still
    tested pair by pair."""
    lo, hi = key_range(vis, first_row, first_row + q_block - 1, s_pad)
    lo, hi = jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)
    if kv_lengths is not None:
        hi = jnp.minimum(hi, jnp.max(kv_lengths))
    if q_lengths is not None:
        hi = jnp.where(first_row >= jnp.max(q_lengths), lo, hi)
    lo, hi = lo // k_block, (hi + k_block - 1) // k_block
    return lo, jnp.maximum(hi, lo)


def canonical_window(local_window_size) -> Window | None:
    """`None`, an int `w` (= `(w, w)`) or a pair of ints/None -> `Window` or None.

    Raises:
      TypeError, ValueError: naming the value, for anything else or a negative side.
    """
    if local_window_size is None:
        return None
    if isinstance(local_window_size, (int,)) and not isinstance(local_window_size, bool):
        local_window_size = (local_window_size, local_window_size)
    if not isinstance(local_window_size, (tuple, list)) or len(local_window_size) != 2:
        raise TypeError(
            f"local_window_size must be None, an int or a (left, right) pair of ints or None, "
            f"got {local_window_size!r}"
        )
    sides = []
    for name, side in zip(("left", "right"), local_window_size):
        if side is not None:
            if isinstance(side, bool) or not isinstance(side, (int,)) and not hasattr(side, "__index__"):
                raise TypeError(f"local_window_size {name} side must be an int or None, got {side!r}")
            side = int(side.__index__())
            if side < 0:
                raise ValueError(f"local_window_size {name} side must be >= 0, got {side}")
        sides.append(side)
    return Window(*sides)


def lengths_at_rank(lengths, batch_rank: int):
    """int lengths broadcastable to `(B…)` (rank <= batch_rank) -> int32 of rank
    `batch_rank + 3`, broadcasting against `(B…, H, N, S)` scores; None stays None."""
    if lengths is None:
        return None
    lengths = jnp.asarray(lengths).astype(jnp.int32)
    return lengths.reshape((1,) * (batch_rank - lengths.ndim) + lengths.shape + (1, 1, 1))


def segments_at_rank(q_ids, kv_ids, batch_rank: int):
    """int ids `(B…|…, N)` and `(B…|…, S)` -> int32 `(B…|1, 1, N, 1)` and
    `(B…|1, 1, 1, S)`, broadcasting against `(B…, H, N, S)` scores; None stays None."""
    if q_ids is None:
        return None, None
    lift = lambda x: x.astype(jnp.int32).reshape((1,) * (batch_rank + 1 - x.ndim) + x.shape[:-1] + (1, 1) + x.shape[-1:])
    q = lift(jnp.asarray(q_ids))  # (B…|1, 1, 1, N)
    return jnp.swapaxes(q, -1, -2), lift(jnp.asarray(kv_ids))


def compute_dtype(dtype):
    """float32, or float64 for float64 inputs: the dtype softmax and accumulation run
    in. (Not `jnp.promote_types(dtype, float32)`, which raises under
    `jax_numpy_dtype_promotion="strict"` for float16 and bfloat16.)"""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def fits(shape, target) -> bool:
    """Whether `shape` broadcasts to exactly `target`."""
    try:
        return tuple(jnp.broadcast_shapes(tuple(shape), tuple(target))) == tuple(target)
    except ValueError:
        return False


def num_blocks(length: int, block: int) -> int:
    """ceil(length / block)."""
    return -(-length // block) if length else 0


__all__ = [
    "Visibility", "Window", "block_allowed", "canonical_window", "compute_dtype", "dense_allowed", "fits",
    "key_block_range", "key_range", "lengths_at_rank", "num_blocks", "positional", "segments_at_rank",
    "MODS", "PER_HEAD", "dense_heads", "score_logits", "shift_indices", "soft_cap", "static_part", "dense_rows",
    "Call", "EVERY_PART", "MASK_PARTS", "PARTS", "Part", "parts",
]
