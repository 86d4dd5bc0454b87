"""Ring attention (Liu et al. 2023): the sequence split across the devices of a mesh axis.

Each of the P devices holds N/P queries and N/P keys and values. The key/value blocks
travel around the ring (`lax.ppermute`, one hop per step) while every device keeps its
queries and folds each visiting block into an online softmax (running max, sum and
weighted values, as in FlashAttention), so no device ever holds more than its own block
and one visiting block: memory O(N/P · D), plus one `(chunk, chunk)` score tile per head
(the block is itself walked in tiles, FlashAttention's loop; tiles with no visible pair
are skipped).

The derivative is written out (`jax.custom_vjp`) rather than left to autodiff, which
would keep every visiting block for the backward pass (O(N · D) per device). The
backward runs the ring again: each device recomputes its scores against each visiting
block from the saved log-sum-exp, keeps its query gradient, and sends the key/value
gradients around the ring with the blocks they belong to, so they arrive home.

Which pairs may attend is worked out from the global positions of the queries and of
the visiting keys (causal, a window `(left, right)`, `kv_lengths`), so every layout
below gives the same result as `jax_mha.attention`.

Layouts. With `is_causal` and no window, the contiguous split leaves the first device
idle for most steps (its keys come first) and the last one busy at every step. The
striped layout (Brandon et al. 2023, "Striped Attention") gives device `d` the positions
`d, d + P, d + 2P, …`, so every step is about half masked on every device; one
`all_to_all` before the ring and one after move the arrays between the caller's
contiguous order and the striped one. With a window the contiguous split is kept and
the ring stops after the last step any window reaches (a left-only window of `w` keys
needs `ceil(w / (N/P)) + 1` steps, not P).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

QUERY_CHUNK = 512  # rows and keys per score tile inside a ring step (memory: chunk² per head)


class _Ring(NamedTuple):
    """The static plan of one ring: sizes, layout and the visibility rule."""

    axis_name: str
    size: int  # P
    steps: int  # ring steps that can meet a visible key (P, or fewer with a window)
    local: int  # N/P
    striped: bool
    is_causal: bool
    left: int | None
    right: int | None
    scale: float
    chunk: int


def _positions(ring: _Ring, device) -> jax.Array:
    """Global positions `(N/P,)` of the rows a device holds."""
    t = jnp.arange(ring.local)
    return t * ring.size + device if ring.striped else device * ring.local + t


def _visible(ring: _Ring, q_pos, k_pos, kv_lengths) -> jax.Array:
    """bool `(B|1, 1, 1, n, s)`: which (query, key) pairs may attend, from global positions."""
    q_pos, k_pos = q_pos[:, None], k_pos[None, :]
    ok = jnp.ones((q_pos.shape[0], k_pos.shape[1]), bool)
    if ring.is_causal:
        ok &= k_pos <= q_pos
    if ring.left is not None:
        ok &= k_pos >= q_pos - ring.left
    if ring.right is not None:
        ok &= k_pos <= q_pos + ring.right
    ok = ok[None, None, None]  # (1, 1, 1, n, s)
    if kv_lengths is not None:
        ok = ok & (k_pos[None, None, None] < kv_lengths[:, None, None, None, None])  # (B, 1, 1, n, s)
    return ok


def _scores(ring: _Ring, q, k, ok):
    """float32 logits `(B, K, G, n, s)` with the invisible pairs at -inf."""
    s = jnp.einsum("bkgnd,bksd->bkgns", q, k, preferred_element_type=jnp.float32) * ring.scale
    return jnp.where(ok, s, -jnp.inf)


def _chunks(ring: _Ring, x):
    """`(…, N/P, D)` → `(C, …, chunk, D)`: query chunks to scan over (bounds score memory)."""
    *lead, n, d = x.shape
    return jnp.moveaxis(x.reshape(*lead, n // ring.chunk, ring.chunk, d), -3, 0)


def _key_chunks(ring: _Ring, k, v, k_pos):
    """The visiting block as `(k, v, positions)` chunks to scan over."""
    return _chunks(ring, k), _chunks(ring, v), k_pos.reshape(-1, ring.chunk)


def _unchunk(x):
    c, *lead, chunk, d = x.shape
    return jnp.moveaxis(x, 0, -3).reshape(*lead, c * chunk, d)


def _shift(ring: _Ring, xs, hops: int = 1):
    """Sends each device's arrays `hops` devices on (device i → i + hops)."""
    perm = [(i, (i + hops) % ring.size) for i in range(ring.size)]
    return jax.tree_util.tree_map(lambda x: lax.ppermute(x, ring.axis_name, perm), xs)


def _forward(ring: _Ring, q, k, v, kv_lengths):
    """Per device: `q (B, K, G, N/P, D)`, `k, v (B, K, N/P, D)` → `(out, lse)`."""
    device = lax.axis_index(ring.axis_name)
    q_pos = _positions(ring, device)
    q_chunks, pos_chunks = _chunks(ring, q), q_pos.reshape(-1, ring.chunk)
    b, kh, g = q.shape[:3]
    stats = jnp.full((q_chunks.shape[0], b, kh, g, ring.chunk), -jnp.inf, jnp.float32)
    acc = jnp.zeros(q_chunks.shape[:-1] + v.shape[-1:], jnp.float32)
    carry = (stats, jnp.zeros_like(stats), acc)  # running max, running sum, weighted values

    def attend(t, carry, k, v):
        keys = _key_chunks(ring, k, v, _positions(ring, (device - t) % ring.size))

        def one_query_chunk(args):
            q_c, pos_c, *state = args

            def one_key_chunk(state, key_chunk):
                k_c, v_c, k_pos = key_chunk
                ok = _visible(ring, pos_c, k_pos, kv_lengths)

                def update(state):
                    m_c, l_c, acc_c = state
                    s = _scores(ring, q_c, k_c, ok)
                    m_new = jnp.maximum(m_c, s.max(-1))
                    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # rows with nothing seen yet
                    p = jnp.exp(s - m_safe[..., None])
                    correction = jnp.exp(m_c - m_safe)
                    pv = jnp.einsum("bkgns,bksd->bkgnd", p, v_c.astype(jnp.float32))
                    return m_new, l_c * correction + p.sum(-1), acc_c * correction[..., None] + pv

                return lax.cond(ok.any(), update, lambda state: state, tuple(state)), None  # skip empty tiles

            return lax.scan(one_key_chunk, tuple(state), keys)[0]

        m, l, acc = carry
        return lax.map(one_query_chunk, (q_chunks, pos_chunks, m, l, acc))

    def step(t, state):  # attend to the visiting block, then pass it on
        carry, kv = state
        return attend(t, carry, *kv), _shift(ring, kv)

    carry, (k, v) = lax.fori_loop(0, ring.steps - 1, step, (carry, (k, v)))
    m, l, acc = attend(ring.steps - 1, carry, k, v)  # the last block goes no further
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)  # -inf: a row that saw no key
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return _unchunk(out).astype(q.dtype), lse


def _backward(ring: _Ring, q, k, v, kv_lengths, out, lse, d_out):
    """The ring again: dq stays, (k, v, dk, dv) travel; returns `(dq, dk, dv)`."""
    device = lax.axis_index(ring.axis_name)
    q_pos = _positions(ring, device)
    f32 = lambda x: x.astype(jnp.float32)
    q_chunks, pos_chunks = _chunks(ring, q), q_pos.reshape(-1, ring.chunk)
    do_chunks = _chunks(ring, f32(d_out))
    delta = (do_chunks * _chunks(ring, f32(out))).sum(-1)  # (C, B, K, G, chunk): rowsum(dO ∘ O)
    lse_safe = jnp.where(jnp.isfinite(lse), lse, jnp.inf)  # rows that saw no key: p = 0
    dq = jnp.zeros(q_chunks.shape, jnp.float32)

    def attend(t, dq, k, v, dk, dv):
        keys = _key_chunks(ring, k, v, _positions(ring, (device - t) % ring.size))
        dk, dv = _chunks(ring, dk), _chunks(ring, dv)  # (Ck, B, K, chunk, D)

        def one_query_chunk(key_grads, args):
            q_c, pos_c, do_c, delta_c, lse_c = args

            def one_key_chunk(dq_c, key_chunk):
                k_c, v_c, k_pos, dk_c, dv_c = key_chunk
                ok = _visible(ring, pos_c, k_pos, kv_lengths)

                def grads(carry):
                    dq_c, dk_c, dv_c = carry
                    s = _scores(ring, q_c, k_c, ok)
                    p = jnp.exp(s - lse_c[..., None])  # (B, K, G, chunk, chunk)
                    dv_c = dv_c + jnp.einsum("bkgns,bkgnd->bksd", p, do_c)
                    dp = jnp.einsum("bkgnd,bksd->bkgns", do_c, f32(v_c))
                    ds = p * (dp - delta_c[..., None]) * ring.scale
                    dk_c = dk_c + jnp.einsum("bkgns,bkgnd->bksd", ds, f32(q_c))
                    return dq_c + jnp.einsum("bkgns,bksd->bkgnd", ds, f32(k_c)), dk_c, dv_c

                dq_c, dk_c, dv_c = lax.cond(ok.any(), grads, lambda c: c, (dq_c, dk_c, dv_c))
                return dq_c, (dk_c, dv_c)

            dq_c, key_grads = lax.scan(one_key_chunk, jnp.zeros(q_c.shape, jnp.float32), (*keys, *key_grads))
            return key_grads, dq_c

        (dk, dv), dq_step = lax.scan(one_query_chunk, (dk, dv), (q_chunks, pos_chunks, do_chunks, delta, lse_safe))
        return dq + dq_step, _unchunk(dk), _unchunk(dv)

    def step(t, state):  # the block's gradients travel with it
        dq, (k, v, dk, dv) = state
        dq, dk, dv = attend(t, dq, k, v, dk, dv)
        return dq, _shift(ring, (k, v, dk, dv))

    travel = (k, v, jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dq, (k, v, dk, dv) = lax.fori_loop(0, ring.steps - 1, step, (dq, travel))
    dq, dk, dv = attend(ring.steps - 1, dq, k, v, dk, dv)
    home = (-(ring.steps - 1)) % ring.size  # the gradients ride steps - 1 hops with their block: back home
    if home:
        dk, dv = _shift(ring, (dk, dv), home)
    return _unchunk(dq).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_core(ring: _Ring, q, k, v, kv_lengths):
    return _forward(ring, q, k, v, kv_lengths)[0]


def _ring_core_fwd(ring, q, k, v, kv_lengths):
    out, lse = _forward(ring, q, k, v, kv_lengths)
    return out, (q, k, v, kv_lengths, out, lse)


def _ring_core_bwd(ring, residuals, d_out):
    q, k, v, kv_lengths, out, lse = residuals
    dq, dk, dv = _backward(ring, q, k, v, kv_lengths, out, lse, d_out)
    return dq, dk, dv, None


_ring_core.defvjp(_ring_core_fwd, _ring_core_bwd)


def _to_striped(x, axis_name: str, size: int):
    """Contiguous `(B, K, N/P, D)` rows `d·N/P + r` → striped rows `t·P + d` (one all_to_all)."""
    b, h, n, d = x.shape
    x = x.reshape(b, h, n // size, size, d)  # (B, K, m, P, D): row m·P + j goes to device j
    x = lax.all_to_all(x, axis_name, split_axis=3, concat_axis=2, tiled=True)  # (B, K, P_src·m, 1, D)
    return x.reshape(b, h, n, d)


def _from_striped(x, axis_name: str, size: int):
    """The inverse of `_to_striped`."""
    b, h, n, d = x.shape
    x = x.reshape(b, h, n, 1, d)  # rows (P_src, m): block i goes back to device i
    x = lax.all_to_all(x, axis_name, split_axis=2, concat_axis=3, tiled=True)  # (B, H, m, P, D)
    return x.reshape(b, h, n, d)


def _window(local_window_size):
    if local_window_size is None:
        return None, None
    if isinstance(local_window_size, int) and not isinstance(local_window_size, bool):
        local_window_size = (local_window_size, local_window_size)
    try:
        left, right = local_window_size
    except (TypeError, ValueError):
        raise ValueError(f"local_window_size must be an int or a (left, right) pair, got {local_window_size!r}") from None
    for side in (left, right):
        if side is not None and (isinstance(side, bool) or not isinstance(side, int) or side < 0):
            raise ValueError(f"local_window_size sides must be ints >= 0 or None, got {local_window_size!r}")
    return left, right


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mesh: Mesh,
    axis_name: str = "sequence",
    is_causal: bool = False,
    scale: float | None = None,
    local_window_size: int | tuple[int | None, int | None] | None = None,
    kv_lengths: jax.Array | None = None,
    query_chunk_size: int = QUERY_CHUNK,
    batch_axis_name: str | None = None,
    head_axis_name: str | None = None,
) -> jax.Array:
    """Self-attention with the sequence split over the mesh axis `axis_name`.

    Equals `jax_mha.attention(q, k, v, is_causal=..., scale=..., local_window_size=...,
    kv_lengths=...)` (to float32 rounding) while each of the P devices of `axis_name`
    holds only N/P rows of q, k and v (see the module docstring for how). Other mesh
    axes are left alone: the batch and heads may be sharded over them as usual.

    Args:
      q: `(B, H, N, D)` queries, in the caller's (contiguous) order, typically sharded
        with `PartitionSpec(None, None, axis_name, None)`.
      k, v: `(B, K, N, D)`; GQA when `K < H` (groups of `H // K` query heads).
      mesh: the device mesh; `axis_name` must be one of its axes.
      axis_name: the mesh axis the sequence is split over.
      is_causal: key `j` visible to query `i` only when `j <= i` (self-attention:
        N == S, so the library's bottom-right alignment is the ordinary one).
      scale: logit scale; default `1/sqrt(D)`.
      local_window_size: `(left, right)` keys each query sees around itself (jax.nn's
        meaning; a side None is unbounded; an int w means (w, w)).
      kv_lengths: int `(B,)`: keys at positions `>= kv_lengths[b]` are padding.
      query_chunk_size: query rows and keys per score tile inside a ring step (bounds
        the `(chunk, chunk)` scores a device holds at once).
      batch_axis_name, head_axis_name: mesh axes the batch B and the key/value heads K
        are split over inside the ring (e.g. "data" and "model"), so each device
        attends only its own sequences and heads; None (default) gives every device
        of the ring the whole batch and all heads. B, resp. K, must be a multiple of
        that axis' size.

    Returns:
      `(B, H, N, D)` in q's dtype, sharded like q. A query that may see no key gets
      zeros (value and gradient), as `attention` does.

    Raises:
      ValueError: naming the numbers, when `axis_name` is not a mesh axis, N is not a
        multiple of the ring size (of its square for striped causal attention, where
        each device splits its rows once more), shapes disagree, or K does not divide H.
      TypeError: for integer or complex inputs.

    Differentiable in reverse mode (`grad`, `vjp`; a custom VJP that runs the ring
    again); forward mode (`jvp`) is not supported by the custom VJP.
    """
    for arg, name in (("axis_name", axis_name), ("batch_axis_name", batch_axis_name),
                      ("head_axis_name", head_axis_name)):
        if (name is not None or arg == "axis_name") and name not in mesh.shape:
            raise ValueError(f"{arg}={name!r} is not an axis of the mesh (axes {tuple(mesh.shape)})")
    if axis_name in (batch_axis_name, head_axis_name) or (batch_axis_name and batch_axis_name == head_axis_name):
        raise ValueError(f"axis_name={axis_name!r}, batch_axis_name={batch_axis_name!r} and "
                         f"head_axis_name={head_axis_name!r} must be different mesh axes")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"ring_attention {name} must be a real floating array, got {getattr(x, 'dtype', type(x))}")
        if x.ndim != 4:
            raise ValueError(f"ring_attention expects {name} of shape (B, heads, N, D), got {x.shape}")
    b, h, n, d = q.shape
    kh = k.shape[1]
    if k.shape != v.shape or k.shape[0] != b or k.shape[2] != n or k.shape[3] != d:
        raise ValueError(f"ring_attention is self-attention: k and v must be (B, K, N, D) = ({b}, K, {n}, {d}), "
                         f"got k {k.shape}, v {v.shape}")
    if kh < 1 or h % kh:
        raise ValueError(f"num_heads={h} of q is not divisible by num_kv_heads={kh} of k/v")
    for arg, axis, count, what in (("batch_axis_name", batch_axis_name, b, "batch size B"),
                                   ("head_axis_name", head_axis_name, kh, "num_kv_heads K")):
        if axis is not None and count % mesh.shape[axis]:
            raise ValueError(f"{what}={count} is not a multiple of the {mesh.shape[axis]} devices of "
                             f"{arg}={axis!r}")
    left, right = _window(local_window_size)
    size = mesh.shape[axis_name]
    striped = is_causal and left is None and right is None and size > 1
    multiple = size * size if striped else size
    if n % multiple:
        what = "the ring size squared (striped causal layout)" if striped else "the ring size"
        raise ValueError(f"sequence length N={n} is not a multiple of {what} {multiple} "
                         f"(mesh axis {axis_name!r} has {size} devices); pad the sequence and pass kv_lengths")
    local = n // size
    steps = size
    if not striped and left is not None and (is_causal or right == 0):
        steps = min(size, math.ceil(left / local) + 1)  # blocks further back are outside every window
    chunk = math.gcd(local, max(1, query_chunk_size))
    ring = _Ring(axis_name, size, steps, local, striped, is_causal, left, right,
                 float(1.0 / math.sqrt(d) if scale is None else scale), chunk)

    if kv_lengths is not None:
        kv_lengths = jnp.broadcast_to(jnp.asarray(kv_lengths, jnp.int32), (b,))
    seq = PartitionSpec(batch_axis_name, head_axis_name, axis_name, None)

    def per_device(q, k, v, kv_lengths):
        if striped:
            q, k, v = (_to_striped(x, axis_name, size) for x in (q, k, v))
        b_here, h_here, kh_here = q.shape[0], q.shape[1], k.shape[1]  # this device's share
        qg = q.reshape(b_here, kh_here, h_here // kh_here, local, d)  # (B, K, G, N/P, D)
        out = _ring_core(ring, qg, k, v, kv_lengths).reshape(b_here, h_here, local, d)
        return _from_striped(out, axis_name, size) if striped else out

    lengths_spec = None if kv_lengths is None else PartitionSpec(batch_axis_name)
    return jax.shard_map(
        per_device, mesh=mesh, in_specs=(seq, seq, seq, lengths_spec), out_specs=seq, check_vma=False,
    )(q, k, v, kv_lengths)
