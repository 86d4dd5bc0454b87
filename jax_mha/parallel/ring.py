"""Ring attention (Liu et al. 2023): the sequence split across the devices of a mesh axis.

Each of the P devices holds N/P queries and N/P keys and values. The key/value blocks
travel around the ring (`lax.ppermute`, one hop per step) while every device keeps its
queries and folds each visiting block into an online softmax (running max, sum and
weighted values, as in FlashAttention), so no device ever holds more than its own block
and one visiting block: memory O(N/P · D), plus one `(chunk, chunk)` score tile per head
(the block is itself walked in tiles, FlashAttention's loop).

The derivative is written out (`jax.custom_vjp` around the whole ring) rather than
left to autodiff, which would keep every visiting block for the backward pass (O(N · D)
per device). The backward runs the ring again: each device recomputes its scores
against each visiting block from the saved log-sum-exp, keeps its query gradient, and
sends the key/value gradients around the ring with the blocks they belong to, so they
arrive home. Gradients also reach the floating values a `score_mod` closes over (ALiBi
slopes, a relative-bias table): the mods are traced once at the tile's shapes and every
array they close over becomes an explicit input of the custom VJP (`_hoist`), whose
gradient each device sums over its tiles before one `psum`. What the description adds
to every row's denominator beyond its keys (a sink) needs no ring step: the rows are
closed after the ring from its differentiable log-sum-exp (`_softmax.close`), as every
path closes them.

Which pairs may attend, and with what logit, is read from the one description
(`jax_mha._masking.Visibility`, built as `jax_mha.attention` builds it, for the global
problem N = S): each tile calls `block_allowed` and `score_logits` with the global
positions of its queries and keys, so the mods see global indices (`q_idx`, `kv_idx`
positions in the whole sequence, `batch` the global batch index, `head` the global
query head, whatever is split over the mesh). Segment ids travel around the ring with
their key/value block; a ring step whose key ids cannot meet the device's query ids
(`[min, max]` ranges, per sequence) is skipped, and so is every tile with no visible
pair.

Layouts. With `is_causal` and no window, the contiguous split leaves the first device
idle for most steps (its keys come first) and the last one busy at every step. The
striped layout (Brandon et al. 2023, "Striped Attention") gives device `d` the positions
`d, d + P, d + 2P, …`, so every step is about half masked on every device; one
`all_to_all` before the ring and one after move the arrays (and the segment ids)
between the caller's contiguous order and the striped one. With a window the
contiguous split is kept and the ring stops after the last step any window reaches
(`_steps`, from `jax_mha._masking.key_range`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_mha import _masking, _softmax, _validate
from jax_mha._masking import Call, Visibility, block_allowed, key_range, score_logits

QUERY_CHUNK = 512  # rows and keys per score tile inside a ring step (memory: chunk² per head)


class _Ring(NamedTuple):
    """The static plan of one ring: mesh, sizes, layout and the static part of the
    description (hashable: the custom VJP's non-differentiable argument)."""

    mesh: Mesh
    axis_name: str
    batch_axis: str | None
    head_axis: str | None
    size: int  # P
    steps: int  # ring steps that can meet a visible key (P, or fewer with a window)
    local: int  # N/P
    striped: bool
    chunk: int
    # The description of the global problem (N, causality, window, soft cap, B and H)
    # without its arrays (`_masking.static_part`), its mods with every closed-over array
    # hoisted out (`_hoist`), called with them last:
    # `score_mod(score, b, h, q_idx, kv_idx, *score_consts)`, the mask's with `mask_consts`.
    static: Visibility
    scale: float
    dtype: str  # accumulation dtype
    score_floats: tuple  # indices of the floating score consts (they get gradients)


class _Arrays(NamedTuple):
    """The ring's array inputs, global (sharded) outside `shard_map`, per device inside.

    q `(B, H, N, D)`, k `(B, K, N, D)`, v `(B, K, N, Dv)`; q_len, kv_len int32 `(B,)`;
    q_ids, kv_ids int32 `(B, N)`; the consts are replicated; bad_kv bool `(B, K, N)`, the keys whose key or value was not finite
    (`_softmax.sanitize`), split like the keys."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    q_len: jax.Array | None
    kv_len: jax.Array | None
    q_ids: jax.Array | None
    kv_ids: jax.Array | None
    score_consts: tuple
    mask_consts: tuple
    bad_kv: jax.Array | None = None


class _Device(NamedTuple):
    """What one device knows about itself inside the ring."""

    index: jax.Array  # its place on the ring
    q_pos: jax.Array  # int32 (N/P,): global positions of its query rows
    heads: tuple | None  # (global batch index (B, 1, 1, 1), global query head (1, H, 1, 1)), for the mods


def _F(ring: _Ring):
    return jnp.dtype(ring.dtype)


# ---------------------------------------------------------------------------------
# The description, per device.
# ---------------------------------------------------------------------------------


def _bound(fn, consts):
    return None if fn is None else (lambda *args: fn(*args, *consts))


def _visibility(ring: _Ring, a: _Arrays, score_consts: tuple | None = None) -> Visibility:
    """The description of the global problem (N = S) with this device's lengths
    `(B, 1, 1, 1)` (tile rank 4) and the hoisted mods bound to their consts."""
    lengths = lambda x: None if x is None else x.reshape(-1, 1, 1, 1)
    consts = (a.score_consts if score_consts is None else score_consts, a.mask_consts)  # in `_masking.MODS` order
    mods = {name: _bound(getattr(ring.static, name), c) for name, c in zip(_masking.MODS, consts)}
    return dataclasses.replace(ring.static, q_lengths=lengths(a.q_len), kv_lengths=lengths(a.kv_len), **mods)


def _positions(ring: _Ring, device) -> jax.Array:
    """Global positions `(N/P,)` int32 of the rows a device holds."""
    t = jnp.arange(ring.local, dtype=jnp.int32)
    return t * ring.size + device if ring.striped else device * ring.local + t


def _device(ring: _Ring, a: _Arrays) -> _Device:
    index = lax.axis_index(ring.axis_name).astype(jnp.int32)
    heads = None
    if ring.static.has_mods:
        b, h = a.q.shape[:2]
        first = lambda axis, count: 0 if axis is None else lax.axis_index(axis).astype(jnp.int32) * count
        heads = ((first(ring.batch_axis, b) + jnp.arange(b, dtype=jnp.int32)).reshape(b, 1, 1, 1),
                 (first(ring.head_axis, h) + jnp.arange(h, dtype=jnp.int32)).reshape(1, h, 1, 1))
    return _Device(index, _positions(ring, index), heads)


def _with_floats(ring: _Ring, consts: tuple, floats) -> tuple:
    """`consts` with the floating ones (`ring.score_floats`) replaced by `floats`."""
    consts = list(consts)
    for i, x in zip(ring.score_floats, floats):
        consts[i] = x
    return tuple(consts)


# ---------------------------------------------------------------------------------
# One tile: `(chunk, chunk)` scores of every head.
# ---------------------------------------------------------------------------------


class _Tile(NamedTuple):
    """One query chunk against one key chunk (per device layout, G query heads per
    key/value head): q `(B, K, G, c, D)`, k `(B, K, c, D)`, v `(B, K, c, Dv)`, global
    positions `(c,)`, segment ids `(B, c)` or None, the bad keys `(B, K, c)` or None."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    q_pos: jax.Array
    k_pos: jax.Array
    q_ids: jax.Array | None
    k_ids: jax.Array | None
    bad: jax.Array | None = None

    def rows_cols(self):
        return self.q_pos[:, None], self.k_pos[None, :]


def _allowed(vis: Visibility, dev: _Device, tile: _Tile):
    """bool broadcastable to `(B, H, c, c)`, or None when every pair may attend."""
    segments = None if tile.q_ids is None else (tile.q_ids[:, None, :, None], tile.k_ids[:, None, None, :])
    return block_allowed(vis, *tile.rows_cols(), None, 4, segments, dev.heads)


def _raw_scores(ring: _Ring, tile: _Tile) -> jax.Array:
    """`scale · q kᵀ` of one tile, `(B, H, c, c)` in the accumulation dtype (the G
    query heads of each key/value head stacked: global head order)."""
    x = jnp.einsum("bkgnd,bksd->bkgns", tile.q, tile.k, preferred_element_type=_F(ring))
    x = x * jnp.asarray(ring.scale, _F(ring))
    return x.reshape((x.shape[0], -1) + x.shape[-2:])


def _when_any(allowed, fn, carry):
    """`fn(carry)`, skipped (carry unchanged) when `allowed` rules out every pair."""
    if allowed is None:
        return fn(carry)
    return lax.cond(jnp.any(allowed), fn, lambda c: c, carry)


def _fold(ring: _Ring, vis: Visibility, dev: _Device, state, tile: _Tile):
    """Folds one tile into the online softmax `(m, l, acc)` `(B, K, G, c[, Dv])` and
    `touched` `(B, K, G, c)`, the rows that may see a bad key (the engine's rule)."""
    allowed = _allowed(vis, dev, tile)

    def update(state):
        s = score_logits(vis, _raw_scores(ring, tile), dev.heads, *tile.rows_cols())
        s = s if allowed is None else jnp.where(allowed, s, -jnp.inf)
        s = s.reshape(state[0].shape + s.shape[-1:])  # (B, K, G, c, c)
        seen = None
        if tile.bad is not None:
            seen = tile.bad[:, :, None, None, :]
            if allowed is not None:
                b, kh, g = s.shape[:3]
                seen = seen & jnp.broadcast_to(allowed, (b, kh * g) + s.shape[-2:]).reshape(s.shape)
        return _softmax.fold_block(state, s, tile.v, "bkgns,bksd->bkgnd", seen)

    return _when_any(allowed, update, state)


def _logits_and_pullback(ring: _Ring, a: _Arrays, dev: _Device, x, tile: _Tile):
    """`(logits, pullback)`: the mods on raw scores `x`, and the VJP that takes a
    cotangent of the logits to `(d x, *d floating score consts)`; pullback None when
    there are no mods (the logits are `x`)."""
    if not ring.static.changes_scores:
        return x, None
    rows, cols = tile.rows_cols()

    def post(x, *floats):
        vis = _visibility(ring, a, _with_floats(ring, a.score_consts, floats))
        return score_logits(vis, x, dev.heads, rows, cols)

    return jax.vjp(post, x, *(a.score_consts[i] for i in ring.score_floats))


def _tile_grads(ring: _Ring, a: _Arrays, vis: Visibility, dev: _Device, carry, tile: _Tile, do, delta, lse):
    """Adds one tile's share to `(dq (B, K, G, c, D), dk (B, K, c, D), dv (B, K, c, Dv),
    d floats)`; `do` `(B, K, G, c, Dv)`, `delta` and `lse` `(B, K, G, c)` (lse +inf on
    rows that saw no key, so their weights are 0)."""
    allowed = _allowed(vis, dev, tile)
    f = lambda x: x.astype(_F(ring))

    def grads(carry):
        dq, dk, dv, d_floats = carry
        x = _raw_scores(ring, tile)
        logits, pullback = _logits_and_pullback(ring, a, dev, x, tile)
        s = logits if allowed is None else jnp.where(allowed, logits, -jnp.inf)
        s = s.reshape(lse.shape + s.shape[-1:])  # (B, K, G, c, c)
        p = jnp.exp(s - lse[..., None])
        dv = dv + jnp.einsum("bkgns,bkgnd->bksd", p, do)
        ds = _softmax.logits_grad(p, jnp.einsum("bkgnd,bksd->bkgns", do, f(tile.v)), delta[..., None])
        if pullback is not None:
            dx, *d_consts = pullback(ds.reshape(x.shape))
            ds = dx.reshape(ds.shape)
            d_floats = tuple(acc + d.astype(acc.dtype) for acc, d in zip(d_floats, d_consts))
        ds = ds * jnp.asarray(ring.scale, _F(ring))
        dk = dk + jnp.einsum("bkgns,bkgnd->bksd", ds, f(tile.q))
        return dq + jnp.einsum("bkgns,bksd->bkgnd", ds, f(tile.k)), dk, dv, d_floats

    return _when_any(allowed, grads, carry)


# ---------------------------------------------------------------------------------
# The ring, per device.
# ---------------------------------------------------------------------------------


def _chunks(x, chunk: int, axis: int):
    """Splits `axis` into chunks of `chunk` and moves the chunk index first:
    `(…, n, …)` → `(n / chunk, …, chunk, …)`; None stays None."""
    if x is None:
        return None
    x = x.reshape(x.shape[:axis] + (x.shape[axis] // chunk, chunk) + x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)


def _unchunk(x, axis: int):
    """The inverse of `_chunks`."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])


def _key_chunks(ring: _Ring, dev: _Device, t, k, v, kv_ids):
    """The block visiting at step `t` as chunks `(k, v, positions, ids)` to scan over."""
    c = ring.chunk
    k_pos = _positions(ring, (dev.index - t) % ring.size)
    return _chunks(k, c, 2), _chunks(v, c, 2), k_pos.reshape(-1, c), _chunks(kv_ids, c, 1)


def _shift(ring: _Ring, xs, hops: int = 1):
    """Sends each device's arrays `hops` devices on (device i → i + hops)."""
    perm = [(i, (i + hops) % ring.size) for i in range(ring.size)]
    return jax.tree_util.tree_map(lambda x: lax.ppermute(x, ring.axis_name, perm), xs)


def _around(ring: _Ring, attend, carry, travel):
    """Runs `attend(t, carry, travel) -> (carry, travel)` at each ring step `t`,
    passing `travel` (the visiting block, and its gradients) on between steps; after
    the last step `travel` is `steps - 1` hops from home."""

    def step(t, state):
        carry, travel = attend(t, *state)
        return carry, _shift(ring, travel)

    return attend(ring.steps - 1, *lax.fori_loop(0, ring.steps - 1, step, (carry, travel)))


def _when_segments_meet(q_ids, kv_ids, fn, carry):
    """`fn(carry)`, skipped when no sequence's query id range `[min, max]` meets the
    visiting block's (exact for sorted ids; for unsorted ones a superset)."""
    if q_ids is None:
        return fn(carry)
    meet = (q_ids.min(-1) <= kv_ids.max(-1)) & (kv_ids.min(-1) <= q_ids.max(-1))  # (B,)
    return lax.cond(jnp.any(meet), fn, lambda c: c, carry)


def _forward(ring: _Ring, a: _Arrays):
    """Per device, in the ring's layout: `(out (B, H, N/P, Dv), lse (B, H, N/P),
    touched, empty)`, lse the natural log of each row's softmax denominator over the
    keys, `-inf` on a row that sees no key (its output is 0); touched and empty bool `(B, H, N/P)`: the rows that may see a bad key
    (`a.bad_kv`), and those that see no key."""
    dev, vis, c = _device(ring, a), _visibility(ring, a), ring.chunk
    b, h, n, _ = a.q.shape
    kh = a.k.shape[1]
    queries = (_chunks(a.q.reshape(b, kh, h // kh, n, -1), c, 3), dev.q_pos.reshape(-1, c), _chunks(a.q_ids, c, 1))
    rows = (n // c, b, kh, h // kh, c)
    carry = (jnp.full(rows, -jnp.inf, _F(ring)), jnp.zeros(rows, _F(ring)), jnp.zeros(rows + a.v.shape[-1:], _F(ring)),
             jnp.zeros(rows, bool))

    def attend(t, carry, travel):
        keys = (*_key_chunks(ring, dev, t, *travel[:3]), _chunks(travel[3], c, 2))

        def one_query_chunk(args):
            (q_c, pos_c, ids_c), state = args[:3], args[3:]

            def one_key_chunk(state, key):
                tile = _Tile(q_c, key[0], key[1], pos_c, key[2], ids_c, key[3], key[4])
                return _fold(ring, vis, dev, state, tile), None

            return lax.scan(one_key_chunk, tuple(state), keys)[0]

        run = lambda carry: lax.map(one_query_chunk, (*queries, *carry))
        return _when_segments_meet(a.q_ids, travel[2], run, carry), travel

    (m, l, acc, touched), _ = _around(ring, attend, carry, (a.k, a.v, a.kv_ids, a.bad_kv))
    seen = l > 0
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
    heads = lambda x: _unchunk(x, 3).reshape((b, h, n) + x.shape[5:])  # (B, K, G, n, …) → (B, H, n, …)
    return heads(out), heads(lse), heads(touched), heads(~seen)


def _backward_step(ring: _Ring, a: _Arrays, dev: _Device, queries, t, state, travel):
    """One ring step of the backward pass: the visiting block's share of dq and of the
    floating consts' gradients (`state`), and of its own dk, dv (which travel)."""
    vis = _visibility(ring, a)
    k, v, kv_ids, dk, dv = travel
    keys = _key_chunks(ring, dev, t, k, v, kv_ids)

    def run(state):
        dq, d_floats, dk, dv = state

        def one_query_chunk(carry, args):
            dk, dv, d_floats = carry
            q_c, do_c, delta_c, lse_c, pos_c, ids_c = args

            def one_key_chunk(carry, key):
                dq_c, d_floats = carry
                k_c, v_c, k_pos, k_ids, dk_c, dv_c = key
                tile = _Tile(q_c, k_c, v_c, pos_c, k_pos, ids_c, k_ids)
                dq_c, dk_c, dv_c, d_floats = _tile_grads(ring, a, vis, dev, (dq_c, dk_c, dv_c, d_floats), tile,
                                                         do_c, delta_c, lse_c)
                return (dq_c, d_floats), (dk_c, dv_c)

            (dq_c, d_floats), (dk, dv) = lax.scan(one_key_chunk, (jnp.zeros_like(q_c, _F(ring)), d_floats),
                                                  (*keys, dk, dv))
            return (dk, dv, d_floats), dq_c

        c = ring.chunk
        (dk, dv, d_floats), dq_step = lax.scan(one_query_chunk, (_chunks(dk, c, 2), _chunks(dv, c, 2), d_floats),
                                               queries)
        return dq + dq_step, d_floats, _unchunk(dk, 2), _unchunk(dv, 2)

    dq, d_floats, dk, dv = _when_segments_meet(a.q_ids, kv_ids, run, (*state, dk, dv))
    return (dq, d_floats), (k, v, kv_ids, dk, dv)


def _backward(ring: _Ring, a: _Arrays, out, lse, d_out, d_lse):
    """The ring again, per device in the ring's layout: dq stays, (k, v, dk, dv)
    travel. Returns `(dq, dk, dv, d floats)`, the floats' gradient summed over the
    devices."""
    dev, c = _device(ring, a), ring.chunk
    b, h, n, _ = a.q.shape
    kh = a.k.shape[1]
    grouped = lambda x: x.astype(_F(ring)).reshape((b, kh, h // kh) + x.shape[2:])  # (B, H, …) → (B, K, G, …)
    d_out = grouped(d_out)
    delta = _softmax.output_delta(d_out, grouped(out), grouped(d_lse))
    lse = grouped(lse)
    lse = jnp.where(jnp.isfinite(lse), lse, jnp.inf)  # rows that saw no key: p = 0
    queries = (_chunks(grouped(a.q), c, 3), _chunks(d_out, c, 3), _chunks(delta, c, 3), _chunks(lse, c, 3),
               dev.q_pos.reshape(-1, c), _chunks(a.q_ids, c, 1))
    d_floats = tuple(jnp.zeros(a.score_consts[i].shape, _masking.compute_dtype(a.score_consts[i].dtype))
                     for i in ring.score_floats)
    state = (jnp.zeros(queries[0].shape, _F(ring)), d_floats)
    travel = (a.k, a.v, a.kv_ids, jnp.zeros(a.k.shape, _F(ring)), jnp.zeros(a.v.shape, _F(ring)))
    attend = functools.partial(_backward_step, ring, a, dev, queries)
    (dq, d_floats), (_, _, _, dk, dv) = _around(ring, attend, state, travel)
    home = (-(ring.steps - 1)) % ring.size  # the gradients rode steps - 1 hops with their block: back home
    if home:
        dk, dv = _shift(ring, (dk, dv), home)
    axes = tuple(x for x in (ring.axis_name, ring.batch_axis, ring.head_axis) if x is not None)
    d_floats = tuple(lax.psum(x, axes) for x in d_floats)
    dq = _unchunk(dq, 3).reshape(a.q.shape)
    return dq.astype(a.q.dtype), dk.astype(a.k.dtype), dv.astype(a.v.dtype), d_floats


# ---------------------------------------------------------------------------------
# Layout (striped or contiguous) and the custom VJP around the sharded ring.
# ---------------------------------------------------------------------------------


def _to_striped(ring: _Ring, x, axis: int):
    """Contiguous rows `d·N/P + r` along `axis` → striped rows `t·P + d` (one all_to_all)."""
    if x is None or not ring.striped:
        return x
    shape = x.shape
    x = x.reshape(shape[:axis] + (shape[axis] // ring.size, ring.size) + shape[axis + 1:])  # row m·P + j → device j
    x = lax.all_to_all(x, ring.axis_name, split_axis=axis + 1, concat_axis=axis, tiled=True)
    return x.reshape(shape)


def _from_striped(ring: _Ring, x, axis: int):
    """The inverse of `_to_striped`."""
    if not ring.striped:
        return x
    shape = x.shape
    x = x.reshape(shape[:axis + 1] + (1,) + shape[axis + 1:])  # rows (P_src, m): block i goes back to device i
    x = lax.all_to_all(x, ring.axis_name, split_axis=axis, concat_axis=axis + 1, tiled=True)
    return x.reshape(shape)


def _in_ring_layout(ring: _Ring, a: _Arrays) -> _Arrays:
    return a._replace(q=_to_striped(ring, a.q, 2), k=_to_striped(ring, a.k, 2), v=_to_striped(ring, a.v, 2),
                      bad_kv=_to_striped(ring, a.bad_kv, 2),
                      q_ids=_to_striped(ring, a.q_ids, 1), kv_ids=_to_striped(ring, a.kv_ids, 1))


def _specs(ring: _Ring, a: _Arrays):
    """`(specs of a, of (B, H, N, …) arrays, of (B, H, N) arrays)`."""
    seq = PartitionSpec(ring.batch_axis, ring.head_axis, ring.axis_name, None)
    given = lambda x, spec: None if x is None else spec
    rows, ids = PartitionSpec(ring.batch_axis), PartitionSpec(ring.batch_axis, ring.axis_name)
    replicated = lambda xs: tuple(PartitionSpec() for _ in xs)
    specs = _Arrays(seq, seq, seq, given(a.q_len, rows), given(a.kv_len, rows), given(a.q_ids, ids),
                    given(a.kv_ids, ids), replicated(a.score_consts), replicated(a.mask_consts),
                    given(a.bad_kv, PartitionSpec(ring.batch_axis, ring.head_axis, ring.axis_name)))
    return specs, seq, PartitionSpec(ring.batch_axis, ring.head_axis, ring.axis_name)


def _sharded_forward(ring: _Ring, a: _Arrays):
    specs, seq, rows = _specs(ring, a)

    def per_device(a):
        return tuple(_from_striped(ring, x, 2) for x in _forward(ring, _in_ring_layout(ring, a)))

    return jax.shard_map(per_device, mesh=ring.mesh, in_specs=(specs,), out_specs=(seq, rows, rows, rows),
                         check_vma=False)(a)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(ring: _Ring, a: _Arrays):
    """`(out (B, H, N, Dv), lse float (B, H, N), touched, empty)`, in the caller's
    layout (`_forward`)."""
    return _sharded_forward(ring, a)


def _ring_fwd(ring: _Ring, a: _Arrays):
    out, lse, touched, empty = _sharded_forward(ring, a)
    return (out, lse, touched, empty), (a, out, lse)


def _ring_bwd(ring: _Ring, residuals, cotangents):
    a, out, lse = residuals
    cotangents = cotangents[:2]  # touched and empty are boolean
    specs, seq, rows = _specs(ring, a)

    def per_device(a, out, lse, d_out, d_lse):
        stripe = lambda x: _to_striped(ring, x, 2)
        dq, dk, dv, d_floats = _backward(ring, _in_ring_layout(ring, a), *map(stripe, (out, lse, d_out, d_lse)))
        return (*(_from_striped(ring, x, 2) for x in (dq, dk, dv)), d_floats)

    floats_specs = tuple(PartitionSpec() for _ in ring.score_floats)
    dq, dk, dv, d_floats = jax.shard_map(
        per_device, mesh=ring.mesh, in_specs=(specs, seq, rows, seq, rows),
        out_specs=(seq, seq, seq, floats_specs), check_vma=False)(
        a, out, lse, *_placed(ring, tuple(cotangents), (seq, rows)))
    d_consts = [None] * len(a.score_consts)
    for i, d in zip(ring.score_floats, d_floats):
        d_consts[i] = d.astype(a.score_consts[i].dtype)
    return (_Arrays(dq, dk, dv, None, None, None, None, tuple(d_consts), (None,) * len(a.mask_consts)),)


_ring.defvjp(_ring_fwd, _ring_bwd)


# ---------------------------------------------------------------------------------
# From the public arguments to the plan.
# ---------------------------------------------------------------------------------


def refusal(vis: Visibility, call: Call) -> str | None:
    """Why ring attention cannot run a call, or None when it can: the one list of what
    it refuses, read by `ring_attention` and `ring_attention_fn` alike.

    Args:
      vis: the description (`jax_mha._masking.Visibility`, public layout).
      call: what the call asks beyond it (`jax_mha._masking.Call`).

    Returns:
      A one-line message naming every refused part, or None.
    """
    parts = [name for name, x in (("mask", vis.mask), ("bias", vis.bias)) if x is not None]
    if call.return_weights:
        parts.append("return_weights=True")
    if call.dropout:
        parts.append("attention dropout")
    if call.empty_rows != "zero":
        parts.append(f"empty_rows={call.empty_rows!r}")
    if not parts:
        return None
    return (f"ring attention (jax_mha.parallel.ring) cannot take {', '.join(parts)}: a dense (B, H, N, N) array or the "
            f"weights would defeat the split; express a mask as a mask function or segment ids, and a bias as a score function")


def _check_mesh(mesh: Mesh, axis_name, batch_axis_name, head_axis_name) -> None:
    for arg, name in (("axis_name", axis_name), ("batch_axis_name", batch_axis_name),
                      ("head_axis_name", head_axis_name)):
        if (name is not None or arg == "axis_name") and name not in mesh.shape:
            raise ValueError(f"{arg}={name!r} is not an axis of the mesh (axes {tuple(mesh.shape)})")
    if axis_name in (batch_axis_name, head_axis_name) or (batch_axis_name and batch_axis_name == head_axis_name):
        raise ValueError(f"axis_name={axis_name!r}, batch_axis_name={batch_axis_name!r} and "
                         f"head_axis_name={head_axis_name!r} must be different mesh axes")


def _check_qkv(q, k, v) -> None:
    """Ring attention is self-attention on `(B, heads, N, D)` arrays of one dtype."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"ring_attention {name} must be a real floating array, got {getattr(x, 'dtype', type(x))}")
        if x.ndim != 4:
            raise ValueError(f"ring_attention expects {name} of shape (B, heads, N, D), got {x.shape}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"ring_attention q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    b, h, n, d = q.shape
    if k.shape[:3] != v.shape[:3] or k.shape[0] != b or k.shape[2] != n or k.shape[3] != d:
        raise ValueError(f"ring_attention is self-attention: k and v must be (B, K, N, D) and (B, K, N, Dv) with "
                         f"(B, N, D) = ({b}, {n}, {d}) from q, got k {k.shape}, v {v.shape}")
    if h % k.shape[1]:
        raise ValueError(f"num_heads={h} of q is not divisible by num_kv_heads={k.shape[1]} of k/v")


def _steps(vis: Visibility, size: int, local: int, striped: bool) -> int:
    """Ring steps that can meet a visible key: P, or fewer when causality or the
    window keep every device's rows off the blocks ahead of their own (the ring would
    reach those only by wrapping round) and off the blocks far behind."""
    if striped or not vis.has_pattern:
        return size
    steps = 1
    for d in range(size):
        lo, hi = key_range(vis, d * local, (d + 1) * local - 1, size * local)
        if hi <= lo:
            continue
        if (hi - 1) // local > d:
            return size
        steps = max(steps, d - lo // local + 1)
    return steps


def _hoist(fn, *avals):
    """`(fn', consts)`: `fn` traced once at the tile's shapes `avals`, every array it
    closes over (traced or not, floating or integer) hoisted out as trailing arguments
    (`fn'(*args, *consts)`), so that they enter the custom VJP and `shard_map` as
    inputs; `(None, ())` for no function."""
    if fn is None:
        return None, ()
    closed = jax.make_jaxpr(fn)(*avals)
    return functools.partial(_call_jaxpr, closed.jaxpr, len(avals)), tuple(closed.consts)


def _call_jaxpr(jaxpr, num_args: int, *args):
    return jax.core.eval_jaxpr(jaxpr, args[num_args:], *args[:num_args])[0]


def _check_divisible(n: int, size: int, striped: bool, axis_name: str) -> None:
    multiple = size * size if striped else size
    if n % multiple:
        what = "the ring size squared (striped causal layout)" if striped else "the ring size"
        raise ValueError(f"sequence length N={n} is not a multiple of {what} {multiple} "
                         f"(mesh axis {axis_name!r} has {size} devices); pad the sequence and pass kv_lengths")


def _plan(vis: Visibility, q, k, v, bad_kv, *, mesh, axis_name, scale, query_chunk_size, batch_axis_name,
          head_axis_name) -> tuple[_Ring, _Arrays]:
    """`(the static plan, the global arrays)` of one call."""
    b, h, n, _ = q.shape
    for arg, axis, count, what in (("batch_axis_name", batch_axis_name, b, "batch size B"),
                                   ("head_axis_name", head_axis_name, k.shape[1], "num_kv_heads K")):
        if axis is not None and count % mesh.shape[axis]:
            raise ValueError(f"{what}={count} is not a multiple of the {mesh.shape[axis]} devices of {arg}={axis!r}")
    if isinstance(query_chunk_size, bool) or not isinstance(query_chunk_size, int) or query_chunk_size < 1:
        raise ValueError(f"query_chunk_size must be a positive int, got {query_chunk_size!r}")
    size = mesh.shape[axis_name]
    striped = vis.is_causal and vis.window is None and size > 1
    _check_divisible(n, size, striped, axis_name)
    local = n // size
    chunk = math.gcd(local, query_chunk_size)
    here = lambda count, axis: count // (1 if axis is None else mesh.shape[axis])
    b_here, h_here = here(b, batch_axis_name), here(h, head_axis_name)
    dtype = _masking.compute_dtype(q.dtype)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    idx = (i32(b_here, 1, 1, 1), i32(1, h_here, 1, 1), i32(1, 1, chunk, 1), i32(1, 1, 1, chunk))
    leading = {"score_mod": (jax.ShapeDtypeStruct((b_here, h_here, chunk, chunk), dtype),)}  # the score tile
    hoisted = {name: _hoist(getattr(vis, name), *leading.get(name, ()), *idx) for name in _masking.MODS}
    score_consts, mask_consts = (hoisted[name][1] for name in _masking.MODS)
    static = dataclasses.replace(_masking.static_part(vis), **{name: fn for name, (fn, _) in hoisted.items()})
    floats = tuple(i for i, x in enumerate(score_consts) if jnp.issubdtype(x.dtype, jnp.floating))
    ring = _Ring(mesh, axis_name, batch_axis_name, head_axis_name, size, _steps(vis, size, local, striped), local,
                 striped, chunk, static, float(scale), jnp.dtype(dtype).name, floats)
    lengths = lambda x: None if x is None else jnp.broadcast_to(x.reshape(-1), (b,))
    ids = lambda x: None if x is None else jnp.broadcast_to(x.reshape(x.shape[0], n), (b, n))
    a = _Arrays(q, k, v, lengths(vis.q_lengths), lengths(vis.kv_lengths), ids(vis.q_segment_ids),
                ids(vis.kv_segment_ids), score_consts, mask_consts, bad_kv)
    return ring, _placed(ring, a)


def _placed(ring: _Ring, tree, specs=None):
    """`tree` resharded to `specs` (default: the ring's specs of an `_Arrays`) when the
    mesh has Explicit axes, whose `shard_map` takes only inputs already laid out as
    its specs say; as it is on an Auto mesh."""
    if all(t != jax.sharding.AxisType.Explicit for t in getattr(ring.mesh, "axis_types", ())):
        return tree
    specs = _specs(ring, tree)[0] if specs is None else specs
    return jax.tree.map(lambda x, spec: jax.reshard(x, NamedSharding(ring.mesh, spec)), tree, specs,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def _attend(q, k, v, call: Call, *, mask=None, bias=None, mesh: Mesh, axis_name: str, scale, query_chunk_size,
            batch_axis_name, head_axis_name, **description):
    """Validates, reads `refusal`, plans and runs the ring; returns `(out (B, H, N, Dv)
    in q's dtype, lse (B, H, N) float32)`, lse -inf past `q_lengths`."""
    _validate.check_description_keywords("ring_attention", description)
    _check_mesh(mesh, axis_name, batch_axis_name, head_axis_name)
    _check_qkv(q, k, v)
    vis = _validate.describe(q, k, v, mask, bias, **description)  # attention's checks and messages
    reason = refusal(vis, call)
    if reason is not None:
        raise ValueError(reason)
    scale = _validate.check_options(scale, 0.0, None, True, "zero", vis.is_causal, q.shape[-1])
    vis, bad_heads = _softmax.sanitize_description(vis)
    q, k, v, bad_q, bad_kv = _softmax.sanitize(q, k, v)  # the steps every path runs between (`_dispatch`)
    ring, a = _plan(vis, q, k, v, bad_kv, mesh=mesh, axis_name=axis_name, scale=scale,
                    query_chunk_size=query_chunk_size, batch_axis_name=batch_axis_name, head_axis_name=head_axis_name)
    out, lse, touched, empty = _ring(ring, a)
    out, lse = _softmax.close(out, lse, vis)
    poisoned = _softmax.poisoned_rows(touched, bad_q, empty, bad_heads)
    out, _ = _softmax.finish(out, None, empty, poisoned, v, bad_kv, vis, "zero")
    return out.astype(q.dtype), _softmax.finish_lse(lse, poisoned, vis.q_lengths, vis.n)


# ---------------------------------------------------------------------------------
# Public entry points.
# ---------------------------------------------------------------------------------


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    mesh: Mesh,
    axis_name: str = "sequence",
    scale: float | None = None,
    return_residual: bool = False,
    query_chunk_size: int = QUERY_CHUNK,
    batch_axis_name: str | None = None,
    head_axis_name: str | None = None,
    **description,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Self-attention with the sequence split over the mesh axis `axis_name`.

    Equals `jax_mha.attention(q, k, v, ...)` with the same keywords (to float32
    rounding, values and gradients) while each of the P devices of `axis_name` holds
    only N/P rows of q, k and v (see the module docstring for how). The description
    keywords mean what they mean for `attention`, on the whole sequence: positions,
    `q_idx` and `kv_idx` are global, `batch` the index into the whole batch, `head` the
    query head of all H. A dense `mask` or `bias` has no place here (it would be
    `(B, H, N, N)`): write it as a mask function, segment ids or a score function (the
    modules' `attention_fn`, `ring_attention_fn`, refuses them by name, see `refusal`).
    Segment ids travel around the ring with their key/value block, and a step or tile
    whose id ranges cannot meet is skipped (sorted ids skip best). The mods are called
    on each `(B/…, H/…, chunk, chunk)` tile with global int32 indices and may close over
    arrays, traced ones included; gradients reach the floating arrays a score function
    closes over, and the sink logits.

    Args:
      q: `(B, H, N, D)` queries, in the caller's (contiguous) order, typically sharded
        with `PartitionSpec(None, None, axis_name, None)`.
      k: `(B, K, N, D)` keys; GQA when `K < H` (groups of `H // K` query heads).
      v: `(B, K, N, Dv)` values.
      mask: refused by name (a `ValueError`): taken only so that a call written for
        `attention` fails with the reason.
      bias: refused by name, as `mask`.
      mesh: the device mesh; `axis_name` must be one of its axes.
      axis_name: the mesh axis the sequence is split over.
      scale: logit scale; default `1/sqrt(D)`.
      return_residual: also return each row's log-sum-exp.
      query_chunk_size: query rows and keys per score tile inside a ring step (bounds
        the `(chunk, chunk)` scores a device holds at once).
      batch_axis_name: a mesh axis the batch B is split over inside the ring (e.g.
        "data"), so each device attends only its own sequences; None (default) gives
        every device of the ring the whole batch. B must be a multiple of its size.
      head_axis_name: a mesh axis the key/value heads K (and their query heads) are
        split over inside the ring (e.g. "model"); None: all heads on every device.
        K must be a multiple of its size.
      **description: `attention`'s keywords of who may attend and of the logits
        (`jax_mha._validate.DESCRIPTION_KEYWORDS`: `is_causal`, `local_window_size`,
        lengths `(B,)`, segment ids `(B, N)` or `(N,)`, the mods, the soft cap, the sink
        logits `(H,)`), with their meaning and checks.

    Returns:
      `out (B, H, N, Dv)` in q's dtype, sharded like q. A query that may see no key
      gets zeros (value and gradient), as `attention` does. With `return_residual`,
      `(out, lse)`: `lse (B, H, N)` float32, sharded like out along N, the natural log
      of each row's softmax denominator (a sink's term included), -inf on a row with
      nothing in its denominator and past `q_lengths`; differentiable.

    Raises:
      ValueError: naming the numbers, when an axis is not a mesh axis, N is not a
        multiple of the ring size (of its square for striped causal attention, where
        each device splits its rows once more), shapes disagree, K does not divide H;
        and every `ValueError` of `attention` for the description.
      TypeError: for integer or complex inputs, a keyword that is not `attention`'s
        description, and every `TypeError` of `attention` for the description.

    Differentiable in reverse mode (`grad`, `vjp`; a custom VJP that runs the ring
    again); forward mode (`jvp`) is not supported by the custom VJP.
    """
    out, lse = _attend(
        q, k, v, Call(q, k, v, return_residual=bool(return_residual)), mask=mask, bias=bias, mesh=mesh,
        axis_name=axis_name, scale=scale, query_chunk_size=query_chunk_size, batch_axis_name=batch_axis_name,
        head_axis_name=head_axis_name, **description)
    return (out, lse) if return_residual else out


def _ring_attention_fn(
    q, k, v, mask=None, bias=None, *, mesh, axis_name, query_chunk_size, scale=None, empty_rows="zero",
    dropout_rate=0.0, dropout_rng=None, deterministic=True, return_weights=False, implementation=None,
    query_block_size=None, key_block_size=None, return_residual=False, **description,
):
    del implementation, query_block_size, key_block_size  # the ring walks its own tiles
    _validate.check_options(scale, dropout_rate, dropout_rng, deterministic, empty_rows,
                            description.get("is_causal", False), jnp.shape(q)[-1])  # attention's messages first
    call = Call(q, k, v, return_weights=bool(return_weights), dropout=dropout_rate > 0 and not deterministic,
                empty_rows=empty_rows, return_residual=bool(return_residual))
    out, lse = _attend(
        q, k, v, call, mask=mask, bias=bias, mesh=mesh, axis_name=axis_name, scale=scale,
        query_chunk_size=query_chunk_size, batch_axis_name=_divides(mesh, "data", jnp.shape(q)[0]),
        head_axis_name=_divides(mesh, "model", jnp.shape(k)[1]), **description)
    return (out, lse) if return_residual else out


def _divides(mesh: Mesh, axis: str, count: int) -> str | None:
    """`axis` when the mesh has it with more than one device and they split `count`
    evenly (the ring then splits that dimension too), else None."""
    size = mesh.shape.get(axis, 1)
    return axis if size > 1 and count % size == 0 else None


def ring_attention_fn(mesh: Mesh, axis_name: str = "sequence", *, query_chunk_size: int = QUERY_CHUNK) -> Callable:
    """`ring_attention` as a module's `attention_fn`: sequence parallelism in a model.

    `MultiHeadAttention(attention_fn=ring_attention_fn(mesh))` (linen or NNX, or
    `TransformerBlock`, `jax_mha.lab.models.Decoder`) runs its self-attention as ring
    attention over the mesh axis `axis_name`, with the heads `(B, H, N, D)` split
    along N; the rest of a Transformer block is position-wise and runs on each
    device's N/P tokens as they are. Constrain the activations (or the token batch)
    to `PartitionSpec(..., axis_name)` along N so XLA keeps them split (the
    `("length", "sequence")` rule of `jax_mha.parallel.DEFAULT_RULES` does, through
    `batch_sharding`).

    The batch is split over the mesh's "data" axis and the key/value heads over
    "model" inside the ring when those axes divide them.

    The returned callable takes `jax_mha.attention`'s keywords: `scale`,
    `return_residual` and the whole description (`_validate.DESCRIPTION_KEYWORDS`,
    segment ids as the modules' `segment_ids`) go to the ring;
    `implementation` and the block sizes are ignored (the ring walks its own tiles);
    what ring attention cannot do is refused by name at trace time (ValueError,
    `refusal`): a dense `mask` or `bias`, `return_weights=True`, attention dropout,
    `empty_rows="uniform"`. N must be a multiple of P (P² when causal, see
    `jax_mha.parallel.check_sequence_divisible`).

    Args:
      mesh: the device mesh; `axis_name` must be one of its axes.
      axis_name: the mesh axis the sequence is split over.
      query_chunk_size: rows per score tile inside a ring step (`ring_attention`).

    Returns:
      `attention_fn(q, k, v, mask=None, bias=None, **keywords) -> (B, H, N, Dv)`, or
      `(out, lse (B, H, N))` with `return_residual=True`.

    Raises:
      ValueError: when `axis_name` is not an axis of the mesh.
    """
    if axis_name not in mesh.shape:
        raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh (axes {tuple(mesh.shape)})")
    return functools.partial(_ring_attention_fn, mesh=mesh, axis_name=axis_name, query_chunk_size=query_chunk_size)


__all__ = ["QUERY_CHUNK", "refusal", "ring_attention", "ring_attention_fn"]
