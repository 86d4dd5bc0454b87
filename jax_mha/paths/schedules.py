"""The block schedule of the Pallas flash kernels: per query block, the key blocks to
visit and which of them are fully visible (FlexAttention's `BlockMask`, built by its
`create_block_mask`), and the same transposed for the backward's dK/dV pass.

A kernel walks `kv_index[b, h, r, :kv_count[b, h, r]]` for query block `r`; on a
block with `kv_full` set it skips the per-element mask (every real pair is visible),
on the others it evaluates `_masking.block_allowed` as before. Which pairs are visible
is read from the description's pattern, `_masking.Pattern` (who may attend); this module only bounds it
per block, from four sources that are each cheap:

* positions, lengths and tails: analytic from each block's first and last row and key
  (`key_range`, O(nq·nk));
* segment ids: each block's id range `[min, max]` (O(N + S));
* `mask_mod`: evaluated one query block at a time, a `(Bs, Hs, q_block, S)` tile at
  most, reduced to per-key-block any/all (never an N × S array).

A block is full iff it is full under every source (exact: every pair visible under
each source is every pair visible under all), and visited iff visited under every
source (an upper bound: a block two sources each allow may still hold no pair both
allow; the kernel's per-element mask then hides it).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.interpreters import partial_eval as pe

from jax_mha._masking import Pattern, key_range, num_blocks

_ARRAYS = ["kv_count", "kv_index", "kv_full", "q_count", "q_index", "q_full"]


@functools.partial(jax.tree_util.register_dataclass, data_fields=_ARRAYS,
                   meta_fields=["n", "s", "q_block", "k_block"])
@dataclasses.dataclass(frozen=True)
class BlockSchedule:
    """The blocks a flash kernel visits, per (batch, head) and block; a pytree whose
    arrays are leaves and whose sizes are static.

    `nq = ceil(N / q_block)`, `nk = ceil(S / k_block)`; `Bs` is the flattened batch
    `prod(B…)` (row-major) or 1 and `Hs` the query heads H or 1, 1 when no source
    depends on it: a kernel reads entry `(b if Bs > 1 else 0, h if Hs > 1 else 0)`.
    Entries past a count repeat the last valid index (0 for a count of 0), so that a
    kernel may prefetch one entry ahead without reading out of range; their full is 0.

    Attributes:
      n, s, q_block, k_block: N, S and the block sizes the schedule was built for.
      kv_count: int32 `(Bs, Hs, nq)`, key blocks visited by each query block.
      kv_index: int32 `(Bs, Hs, nq, nk)`, those key blocks in increasing order.
      kv_full: int32 `(Bs, Hs, nq, nk)`, 1 where `kv_index[..., t]` is fully visible.
      q_count: int32 `(Bs, Hs, nk)`, query blocks visiting each key block.
      q_index: int32 `(Bs, Hs, nk, nq)`, those query blocks in increasing order.
      q_full: int32 `(Bs, Hs, nk, nq)`, 1 where `q_index[..., t]` is fully visible.
    """

    n: int
    s: int
    q_block: int
    k_block: int
    kv_count: jax.Array
    kv_index: jax.Array
    kv_full: jax.Array
    q_count: jax.Array
    q_index: jax.Array
    q_full: jax.Array


def _flat_batch(x: jax.Array, batch: tuple) -> jax.Array:
    """`(B…|1, a, b, c)` -> `(prod(B…)|1, a, b, c)`: 1 when `x` holds one batch entry."""
    tail = x.shape[-3:]
    if math.prod(x.shape[:-3]) == 1:
        return x.reshape((1,) + tail)
    return jnp.broadcast_to(x, tuple(batch) + tail).reshape((math.prod(batch),) + tail)


def _range_classes(vis: Pattern, q_block: int, k_block: int) -> tuple[jax.Array, jax.Array]:
    """`(visited, full)`, bool `(Bs|1, 1, nq, nk)`, by causality, the window, the
    lengths and the tails: exact for these together.

    Rows `r0 … r1` are a block's real rows (< N); keys `c0 … c1` its keys, padding
    included (keys >= S are invisible, `key_range` clips its bounds to S). The keys
    a row sees by position form an interval moving right with the row at constant
    width, so rows `r0 … r1` see together `key_range(r0, r1)` (contiguous), and each
    of them sees `key_range(r1, r0)` (the last row's start, the first row's end)."""
    i32 = jnp.int32
    r0 = (jnp.arange(num_blocks(vis.n, q_block), dtype=i32) * q_block).reshape(1, 1, -1, 1)
    r1 = jnp.minimum(r0 + q_block, vis.n) - 1
    c0 = (jnp.arange(num_blocks(vis.s, k_block), dtype=i32) * k_block).reshape(1, 1, 1, -1)
    c1 = c0 + k_block - 1
    lengths = lambda x, default: default if x is None else _flat_batch(x, vis.batch_shape)  # (Bs|1, 1, 1, 1)
    q_len, kv_len = lengths(vis.q_lengths, vis.n), lengths(vis.kv_lengths, vis.s)
    lo, hi = key_range(vis, r0, jnp.minimum(r1, q_len - 1), vis.s)
    visited = (r0 < q_len) & (jnp.maximum(lo, c0) < jnp.minimum(jnp.minimum(hi, kv_len), c1 + 1))
    lo, hi = key_range(vis, r1, r0, vis.s)
    full = (r1 < q_len) & (lo <= c0) & (c1 < jnp.minimum(hi, kv_len))
    return visited, full


def _id_ranges(ids: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """int ids `(B, L)` -> their `(min, max)` per block of `block`, each `(B, ceil(L / block))`.
    The last block is padded with its own last id, which changes neither."""
    count = num_blocks(ids.shape[-1], block)
    padded = jnp.pad(ids, ((0, 0), (0, count * block - ids.shape[-1])), mode="edge")
    blocks = padded.reshape(ids.shape[0], count, block)
    return jnp.min(blocks, axis=-1), jnp.max(blocks, axis=-1)


def _segment_classes(vis: Pattern, q_block: int, k_block: int) -> tuple[jax.Array, jax.Array]:
    """`(visited, full)`, bool `(Bs|1, 1, nq, nk)`, by the segment ids: visited iff
    the blocks' id ranges overlap (exact for sorted ids that no document skips), full
    iff both blocks hold one id and it is the same. Padding keys are left to
    `_range_classes`."""
    q = _flat_batch(vis.q_segment_ids, vis.batch_shape)  # (Bs|1, 1, N, 1)
    kv = _flat_batch(vis.kv_segment_ids, vis.batch_shape)  # (Bs|1, 1, 1, S)
    q_lo, q_hi = (x[:, None, :, None] for x in _id_ranges(q.reshape(q.shape[0], vis.n), q_block))  # (Bs|1, 1, nq, 1)
    kv_lo, kv_hi = (x[:, None, None, :] for x in _id_ranges(kv.reshape(kv.shape[0], vis.s), k_block))  # (…, 1, nk)
    visited = (q_lo <= kv_hi) & (kv_lo <= q_hi)
    full = (q_lo == q_hi) & (kv_lo == kv_hi) & (q_lo == kv_lo)
    return visited, full


def _mod_extent(vis: Pattern, q_block: int, s_pad: int) -> tuple[int, int]:
    """`(Bs, Hs)`: `prod(B…)` if `mask_mod`'s result depends on its batch index, else
    1, and likewise H for its head index: read from its jaxpr after dead-code
    elimination, so a mod that takes `b` and ignores it costs no batch axis."""
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    batch, heads = math.prod(vis.batch_shape), vis.num_heads
    # A fresh wrapper: make_jaxpr caches per function object, keeping stale globals.
    closed = jax.make_jaxpr(lambda *idx: vis.mask_mod(*idx))(
        i32(batch, 1, 1, 1), i32(1, heads, 1, 1), i32(1, 1, q_block, 1), i32(1, 1, 1, s_pad))
    _, used = pe.dce_jaxpr(closed.jaxpr, [True], instantiate=False)
    return (batch if used[0] else 1), (heads if used[1] else 1)


def _mod_classes(vis: Pattern, q_block: int, k_block: int) -> tuple[jax.Array, jax.Array]:
    """`(visited, full)`, bool `(Bs, Hs, nq, nk)`, by `mask_mod`: evaluated on one
    query block's `(Bs, Hs, q_block, S)` tile at a time (`lax.map`), so that the
    schedule never holds an N × S array, and reduced per key block to any over the
    real rows and keys and all over the real rows (`_range_classes` makes a block
    holding padding keys partial)."""
    nq, nk = num_blocks(vis.n, q_block), num_blocks(vis.s, k_block)
    bs, hs = _mod_extent(vis, q_block, nk * k_block)
    b = jnp.arange(bs, dtype=jnp.int32).reshape(bs, 1, 1, 1)
    h = jnp.arange(hs, dtype=jnp.int32).reshape(1, hs, 1, 1)
    cols = jnp.arange(nk * k_block, dtype=jnp.int32).reshape(1, 1, 1, -1)
    real_col = (cols < vis.s).reshape(1, 1, 1, nk, k_block)

    def row_block(r):
        rows = (r * q_block + jnp.arange(q_block, dtype=jnp.int32)).reshape(1, 1, -1, 1)
        ok = vis.mask_mod(b, h, (rows + vis.start).astype(jnp.int32), cols)
        ok = jnp.broadcast_to(ok, (bs, hs, q_block, nk * k_block)).reshape(bs, hs, q_block, nk, k_block)
        real_row = (rows < vis.n).reshape(1, 1, q_block, 1, 1)
        visited = jnp.any(ok & real_row & real_col, axis=(2, 4))
        full = jnp.all(ok | ~real_row, axis=(2, 4))
        return visited, full  # (Bs, Hs, nk) each

    visited, full = lax.map(row_block, jnp.arange(nq, dtype=jnp.int32))  # (nq, Bs, Hs, nk)
    return jnp.moveaxis(visited, 0, 2), jnp.moveaxis(full, 0, 2)


def _compact(visited: jax.Array, full: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """bool `(…, m)` per-block classes -> `(count (…), index (…, m), full (…, m))`
    int32: the visited blocks first, in increasing order, then the last of them
    repeated (0 when none), so that a prefetch one entry ahead stays in range."""
    count = jnp.sum(visited, axis=-1, dtype=jnp.int32)
    order = jnp.argsort(~visited, axis=-1, stable=True).astype(jnp.int32)  # visited first, each part ascending
    t = lax.broadcasted_iota(jnp.int32, order.shape, order.ndim - 1)
    valid = t < count[..., None]
    last = jnp.take_along_axis(order, jnp.maximum(count - 1, 0)[..., None], axis=-1)
    last = jnp.where(count[..., None] > 0, last, 0)
    index = jnp.where(valid, order, last)
    full = jnp.take_along_axis(full, order, axis=-1) & valid
    return count, index, full.astype(jnp.int32)


def _check(vis: Pattern, q_block: int, k_block: int) -> None:
    """Raises ValueError for what the kernels cannot take or a bad block size."""
    if vis.mask is not None:
        raise ValueError(f"build_schedule takes no dense `mask` (got shape {tuple(vis.mask.shape)}); the flash "
                         "kernels read visibility from mask_mod, segment ids, lengths, causality and the window")
    for name, size in (("q_block", q_block), ("k_block", k_block)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be a positive int, got {size!r}")


def build_schedule(vis: Pattern, q_block: int, k_block: int) -> BlockSchedule:
    """The block schedule of `vis` for blocks of `q_block` queries and `k_block` keys.

    Built once and reused (FlexAttention's `create_block_mask`): it depends on the
    pattern only (N, S, causality, window, offset, lengths, segment ids, `mask_mod`)
    and the block sizes, never on q, k or v, so a model whose layers share a pattern
    builds it once per batch, beside the embedding, and hands the same object to
    every layer's kernel. It is a pytree (arrays as leaves, sizes static): it crosses
    `jax.jit`, a `lax.scan` over layers and remat as an argument, and is jit-safe with
    traced lengths, segment ids, offset and values a `mask_mod` closes over. A kernel
    given a schedule checks its `n`, `s`, `q_block` and `k_block` against its own.
    `bias` and `score_mod` are not consulted (they change logits, not visibility).

    Args:
      vis: the description; batch `vis.batch_shape`, query heads `vis.num_heads`.
      q_block, k_block: the kernel's block sizes (positive ints).

    Returns:
      A `BlockSchedule`: per query block `(Bs, Hs, nq[, nk])` the key blocks, and
      per key block `(Bs, Hs, nk[, nq])` the query blocks, from the same classes.

    Raises:
      ValueError: `vis` has a dense `mask`, or a block size is not a positive int.
    """
    _check(vis, q_block, k_block)
    sources = [_range_classes(vis, q_block, k_block)]
    if vis.segmented:
        sources.append(_segment_classes(vis, q_block, k_block))
    if vis.mask_mod is not None:
        sources.append(_mod_classes(vis, q_block, k_block))
    visited = functools.reduce(jnp.logical_and, (v for v, _ in sources))  # (Bs, Hs, nq, nk)
    full = functools.reduce(jnp.logical_and, (f for _, f in sources), visited)
    by_query = _compact(visited, full)
    by_key = _compact(jnp.swapaxes(visited, -1, -2), jnp.swapaxes(full, -1, -2))
    return BlockSchedule(vis.n, vis.s, q_block, k_block, *by_query, *by_key)


__all__ = ["BlockSchedule", "build_schedule"]
