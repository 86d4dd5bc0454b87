"""`score_mod` and `mask_mod` inside a Pallas kernel body.

A mod is traced once for the kernel's tiles (`engine.trace_mod`): its jaxpr, and the
arrays it closes over as `consts`. The kernel receives each const as a whole-array
input (a `Ref`), and `evaluate` runs the jaxpr on the tile's values, reading a const
only where the mod indexes it: `x[i, j]` with index arrays computed from the tile's
`(b, h, q_idx, kv_idx)` becomes one load of the tile's elements from the const's
memory (a pointer gather on a GPU), never a copy of the whole array. That covers what
mods close over in practice: per-(batch, head) scalars (ALiBi slopes `slopes[h]`),
per-position vectors (document ids `doc[b, q_idx]`), small tables read at a computed
index (relative-position buckets `table[h, bucket(kv_idx - q_idx)]`). Any other use of
a captured array loads it whole, which interpret mode runs and a compiled kernel may
refuse to lower (`gathers_only` tells the kernel paths to refuse it by name first).

Gradients: `evaluate` records each const read (`Read`: which const, its index arrays,
the values read); `evaluate(..., reads=values)` runs the mod with those values given,
so the VJP of the mod with respect to what it read is ordinary `jax.vjp`, and each
read's cotangent is added back into the const's gradient at the same indices
(`scatter_add`, an atomic add on a GPU).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Literal


class _Captured:
    """A const not loaded: its kernel `ref` and the const's shape."""

    def __init__(self, ref, shape, index: int):
        self.ref, self.shape, self.index = ref, tuple(shape), index


class _Trailing:
    """`x[..., None]`, kept apart: jnp's indexing builds `x[i, j]`'s index array by
    stacking the index components on a trailing axis, which a kernel need not build."""

    def __init__(self, parts):
        self.parts = list(parts)


# A read that reaches at most this many entries of a const (a relative-position table's
# row of buckets) adds its cotangent entry by entry: summed over the tile first, then
# one add per entry. Per element, every pair of the tile would add into those few
# addresses, and a GPU's atomics on one address run one after another.
PER_ENTRY_MAX = 64


class _Uniform:
    """`x` of size 1 broadcast to `shape`, kept small: jnp's indexing broadcasts every
    index array to one shape, and a gather index that is one value over the tile (the
    head in `table[h, bucket]`) must stay known as one (`_per_entry`)."""

    def __init__(self, x, shape):
        self.x, self.shape, self.ndim = x, tuple(shape), len(shape)


class Read(NamedTuple):
    """One read of a const: `values = const[indices]` (indices int32, broadcast to
    the values' shape; `parts` the same indices before broadcasting)."""

    const: int
    indices: tuple
    values: jax.Array
    parts: tuple


def _materialize(x):
    if isinstance(x, _Captured):
        return x.ref[...]
    if isinstance(x, _Uniform):
        return jnp.broadcast_to(x.x, x.shape)
    if isinstance(x, _Trailing):
        return jnp.stack([_materialize(p) for p in x.parts], axis=-1)
    return x


def _is_simple_gather(eqn, operand: _Captured, parts) -> bool:
    """`operand[parts[0], parts[1], …]` elementwise: one index per operand axis, every
    slice of size 1, no batching."""
    dnums = eqn.params["dimension_numbers"]
    axes = tuple(range(len(operand.shape)))
    return (len(parts) == len(operand.shape) and dnums.offset_dims == () and dnums.collapsed_slice_dims == axes
            and dnums.start_index_map == axes and not dnums.operand_batching_dims
            and all(size == 1 for size in eqn.params["slice_sizes"]))


def _gather(eqn, operand: _Captured, parts, state):
    """The gathered values: given (`state.reads` set) or loaded from the ref."""
    shape = jnp.broadcast_shapes(*(p.shape for p in parts))
    # Out-of-range indices are clamped: a kernel must not read past the array.
    small = lambda p: p.x if isinstance(p, _Uniform) else p
    clipped = tuple(jnp.clip(small(p).astype(jnp.int32), 0, dim - 1) for p, dim in zip(parts, operand.shape))
    indices = tuple(jnp.broadcast_to(p, shape) for p in clipped)
    if state.given is not None:
        values = state.given[len(state.reads)]
    else:
        values = operand.ref[indices] if indices else operand.ref[...]
    state.reads.append(Read(operand.index, indices, values, clipped))
    return values


class _State:
    def __init__(self, given):
        self.given, self.reads = given, []


def _eval(jaxpr, consts, args, state):
    env = {}

    def read(atom):
        return atom.val if isinstance(atom, Literal) else env[atom]

    for var, x in zip(jaxpr.constvars, consts):
        env[var] = x
    for var, x in zip(jaxpr.invars, args):
        env[var] = x
    for eqn in jaxpr.eqns:
        ins = [read(a) for a in eqn.invars]
        outs = _eval_eqn(eqn, ins, state)
        for var, x in zip(eqn.outvars, outs):
            env[var] = x
    return [_materialize(read(a)) for a in jaxpr.outvars]


def _eval_eqn(eqn, ins, state):
    name = eqn.primitive.name
    if name in ("pjit", "jit", "closed_call") and "jaxpr" in eqn.params:
        inner = eqn.params["jaxpr"]
        return _eval(inner.jaxpr, inner.consts, ins, state)
    if name == "broadcast_in_dim" and not isinstance(ins[0], (_Captured, _Trailing)):
        x = ins[0]
        shape, dims = tuple(eqn.params["shape"]), tuple(eqn.params["broadcast_dimensions"])
        if shape == tuple(x.shape) + (1,) and dims == tuple(range(x.ndim)):
            return [_Trailing([x])]
        if math.prod(x.shape) == 1 and len(shape) == x.ndim and dims == tuple(range(x.ndim)) and len(eqn.invars) == 1:
            return [_Uniform(x.x if isinstance(x, _Uniform) else x, shape)]
    if name == "concatenate" and all(isinstance(x, _Trailing) for x in ins) \
            and eqn.params["dimension"] == eqn.outvars[0].aval.ndim - 1:
        return [_Trailing([p for x in ins for p in x.parts])]
    if name == "gather" and isinstance(ins[0], _Captured):
        idx = ins[1] if isinstance(ins[1], _Trailing) else _materialize(ins[1])
        parts = idx.parts if isinstance(idx, _Trailing) else [idx[..., i] for i in range(idx.shape[-1])]
        if _is_simple_gather(eqn, ins[0], parts):
            return [_gather(eqn, ins[0], parts, state)]
    ins = [_materialize(x) for x in ins]
    out = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
    return out if eqn.primitive.multiple_results else [out]


def evaluate(mod, const_refs, args, given=None):
    """`(mod(*args), reads)`: the traced mod (`engine.Mod`) on the tile's `args`, its
    consts read from `const_refs` (the kernel's refs, in the mod's const order)
    where it indexes them, or taken from `given` (one array per read, in the order
    `reads` lists them)."""
    consts = [_Captured(ref, ref.shape, i) for i, ref in enumerate(const_refs)]
    state = _State(given)
    (out,) = _eval(mod.jaxpr, consts, list(args), state)
    return out, state.reads


def scatter_add(grad_refs, reads, cotangents, atomic: bool):
    """Adds each read's cotangent into its const's gradient ref at the read's indices
    (`grad_refs[i]` None for a const that takes no gradient)."""
    for read, ct in zip(reads, cotangents):
        ref = grad_refs[read.const]
        if ref is None:
            continue
        indices, ct = _per_entry(read, ref.shape, jnp.broadcast_to(ct, read.values.shape).astype(ref.dtype))
        if atomic:
            from jax.experimental.pallas import triton as plgpu

            plgpu.atomic_add(ref, indices, ct)
        else:  # one program at a time: a scatter-add of the whole array (indices may repeat)
            ref[...] = ref[...].at[indices].add(ct) if indices else ref[...] + ct


def _per_entry(read: Read, shape: tuple, ct):
    """`(indices, cotangents)` to add for one read: as read, or, when the tile's indices
    reach at most `PER_ENTRY_MAX` entries of the const, `(1, E)` with one sum per entry
    (E a power of two, as Triton's tiles; lanes past the entries add 0 to the last)."""
    varying = [a for a, p in enumerate(read.parts) if p.size > 1]
    entries = math.prod(shape[a] for a in varying)
    if not varying or entries > PER_ENTRY_MAX or entries >= ct.size:
        return read.indices, ct
    flat = 0
    for a in varying:
        flat = flat * shape[a] + read.parts[a]
    lanes = 1 << max(entries - 1, 0).bit_length()
    lane = lax.broadcasted_iota(jnp.int32, (1, lanes), 1)
    sums = jnp.zeros((1, lanes), ct.dtype)
    for e in range(entries):
        sums = jnp.where(lane == e, jnp.sum(jnp.where(flat == e, ct, 0.0)), sums)
    rest, coords = jnp.minimum(lane, entries - 1), {}
    for a in reversed(varying):
        coords[a], rest = rest % shape[a], rest // shape[a]
    indices = tuple(coords[a] if a in coords else jnp.broadcast_to(p.reshape(1, 1), (1, lanes))
                    for a, p in enumerate(read.parts))
    return indices, sums


def lane_indices(first, size: int, axis: int, length: int):
    """int32 `(size, 1)` (axis 0) or `(1, size)` (axis 1): positions `first + i`,
    clamped to `length - 1` so a padded tail never indexes past a mod's arrays."""
    shape = (size, 1) if axis == 0 else (1, size)
    return jnp.minimum(first + lax.broadcasted_iota(jnp.int32, shape, axis), length - 1)
