"""The description's mods (`jax_mha._masking.MODS`) inside a Pallas kernel body.

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

On a TPU (Mosaic) no gather exists: there `evaluate` gets the tile's indices as
`tpu_indices` (b and h as scalars, q_idx and kv_idx as windows `start + iota`) and
each const in the forms `tpu_forms` found for it before the call: a read at scalar
indices (`slopes[h]`) is a scalar read from SMEM, a read along q_idx or kv_idx shifted
by a scalar (`doc[b, q_idx + c]`) is one copy of a contiguous window from HBM, and any
other read (`table[h, bucket(kv_idx - q_idx)]`, a gather) has no TPU form.

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
from jax.experimental import pallas as pl
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


class _Scalar:
    """(Mosaic) a value equal at every element of `shape`, held as one 0-d scalar (a
    head index, a slope read from SMEM): arithmetic among scalars stays scalar."""

    def __init__(self, x, shape):
        self.x, self.shape, self.ndim = x, tuple(shape), len(shape)


class _Window:
    """(Mosaic) positions `start + iota` along `axis` of a `(size, 1)` (axis 0) or
    `(1, size)` tile: the tile's q_idx or kv_idx shifted by scalars; `hi` clamps them
    where they are used as values (`lane_indices`)."""

    def __init__(self, start, hi, axis: int, size: int):
        self.start, self.hi, self.axis, self.size = start, hi, axis, size
        self.shape, self.ndim = ((size, 1) if axis == 0 else (1, size)), 2


class _Negative:
    """(Mosaic) `window < 0`: jnp's normalisation of a negative index, which a window
    read drops (its padding clamps as a gather clamps)."""

    def __init__(self, window: _Window):
        self.window, self.shape, self.ndim = window, window.shape, 2


def _materialize(x):
    if isinstance(x, _Scalar):
        return jnp.full(x.shape, x.x)
    if isinstance(x, _Window):
        return jnp.minimum(x.start + lax.broadcasted_iota(jnp.int32, x.shape, x.axis), x.hi)
    if isinstance(x, _Negative):
        return _materialize(x.window) < 0
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
    def __init__(self, given, forms=None, tpu=False):
        # forms: per const the set of read forms seen (`tpu_forms`), when classifying;
        # tpu: the Mosaic form (scalars and windows kept symbolic)
        self.given, self.reads, self.forms, self.tpu = given, [], forms, tpu


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
    constant = name == "broadcast_in_dim" and len(ins) == 1 and _scalar(ins[0]) is not None
    if state.tpu and (constant or any(isinstance(x, (_Scalar, _Window, _Negative)) for x in ins)):
        out = _eval_tpu(eqn, ins)
        if out is not None:
            return [out]
    if name == "gather" and isinstance(ins[0], _Captured) and (state.forms is not None or isinstance(ins[0].ref, dict)):
        idx = ins[1] if isinstance(ins[1], _Trailing) else _materialize(ins[1])
        parts = idx.parts if isinstance(idx, _Trailing) else [idx[..., i] for i in range(idx.shape[-1])]
        if _is_simple_gather(eqn, ins[0], parts):
            return [_gather_tpu(ins[0], parts, state, eqn.outvars[0].aval)]
    if name == "broadcast_in_dim" and not isinstance(ins[0], (_Captured, _Trailing)):
        x = ins[0]
        shape, dims = tuple(eqn.params["shape"]), tuple(eqn.params["broadcast_dimensions"])
        x_shape = tuple(jnp.shape(x)) if not isinstance(x, _Uniform) else x.shape  # a literal has no .shape
        if shape == x_shape + (1,) and dims == tuple(range(len(x_shape))):
            return [_Trailing([x])]
        if math.prod(x_shape) == 1 and len(shape) == len(x_shape) and dims == tuple(range(len(x_shape))) \
                and len(eqn.invars) == 1:
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


_SCALAR_OPS = frozenset({"add", "sub", "mul", "div", "rem", "max", "min", "neg", "lt", "le", "gt", "ge", "eq", "ne",
                         "and", "or", "not", "select_n", "convert_element_type", "clamp"})


def _scalar(x):
    """`x` as a 0-d value when it is one (`_Scalar`, a literal), else None."""
    if isinstance(x, _Scalar):
        return x.x
    return x if not isinstance(x, (_Window, _Negative, _Captured, _Trailing, _Uniform)) and jnp.ndim(x) == 0 else None


def _eval_tpu(eqn, ins):
    """(Mosaic) one equation on scalars and windows, kept symbolic where it can be:
    scalar arithmetic stays scalar, a window shifted by a scalar stays a window, jnp's
    normalisation of a negative window index is dropped; else None (materialised)."""
    name, out = eqn.primitive.name, eqn.outvars[0].aval
    scalars = [_scalar(x) for x in ins]
    if name == "broadcast_in_dim" and scalars[0] is not None and len(ins) == 1:
        x = ins[0] if isinstance(ins[0], _Scalar) else _Scalar(scalars[0], ())
        return _Trailing([x]) if tuple(out.shape) == x.shape + (1,) else _Scalar(x.x, out.shape)
    if name in _SCALAR_OPS and all(x is not None for x in scalars):
        return _Scalar(eqn.primitive.bind(*scalars, **eqn.primitive.get_bind_params(eqn.params)), out.shape)
    window = next((x for x in ins if isinstance(x, _Window)), None)
    if name == "broadcast_in_dim" and window is not None and tuple(out.shape) == window.shape + (1,):
        return _Trailing([window])
    if name in ("add", "sub") and window is not None and len(ins) == 2:
        other = scalars[1] if ins[0] is window else scalars[0]
        if other is not None and (name == "add" or ins[0] is window):
            shift = other if name == "add" else -other
            return _Window(window.start + shift, window.hi + shift, window.axis, window.size)
    if name == "lt" and isinstance(ins[0], _Window) and scalars[1] is not None and _is_zero(scalars[1]):
        return _Negative(ins[0])
    if name == "select_n" and isinstance(ins[0], _Negative) and ins[1] is ins[0].window:
        return ins[1]
    return None


def _is_zero(x) -> bool:
    try:
        return int(x) == 0
    except (TypeError, jax.errors.ConcretizationTypeError):
        return False


def _tpu_form(operand: _Captured, parts):
    """How a read of `operand` at `parts` runs on a TPU: `"smem"` (every index a
    scalar), `("col" | "row", const axis)` (one index a window of q_idx or kv_idx, the
    others scalars), or None (a gather at computed indices)."""
    windows = [a for a, p in enumerate(parts) if isinstance(p, _Window)]
    if not all(isinstance(p, (_Scalar, _Window)) for p in parts) or len(windows) > 1:
        return None
    if not windows:
        return "smem"
    return ("col" if parts[windows[0]].axis == 0 else "row", windows[0])


def _gather_tpu(operand: _Captured, parts, state, aval):
    """(Mosaic) `operand[parts]`: read from SMEM or copied as a window (or recorded,
    when classifying: `state.forms`)."""
    form = _tpu_form(operand, parts)
    if state.forms is not None:
        state.forms[operand.index].add(form or "gather")
        return jnp.zeros(aval.shape, aval.dtype)
    clip = lambda p, dim: jnp.clip(p.x, 0, dim - 1).astype(jnp.int32)
    lead = tuple(clip(p, dim) for a, (p, dim) in enumerate(zip(parts, operand.shape)) if form == "smem" or a != form[1])
    if state.given is not None:
        values = state.given[len(state.reads)]
    elif form == "smem":
        values = operand.ref[form][0][lead].astype(aval.dtype)
    else:
        values = _window(operand, form, lead, parts[form[1]]).astype(aval.dtype)
    state.reads.append(Read(operand.index, lead, values, form))
    return _Scalar(values, aval.shape) if form == "smem" else values


def _window(operand: _Captured, form, lead: tuple, window: _Window):
    """The `(size, 1)` or `(1, size)` window of a const's column or row form
    (`tpu_form_array`: padded by `size` on both sides), copied into its VMEM buffer."""
    from jax.experimental.pallas import tpu as pltpu

    ref, buf = operand.ref[form]
    length = ref.shape[-2] if form[0] == "col" else ref.shape[-1]
    start = jnp.clip(window.start + window.size, 0, length - window.size)  # beyond the padding: clamped
    span = pl.ds(start, window.size)
    pltpu.sync_copy(ref.at[(*lead, span, slice(None)) if form[0] == "col" else (*lead, slice(None), span)], buf)
    return buf[...]


def tpu_indices(b, h, q_first, q_last, bq: int, kv_first, kv_last, bk: int) -> tuple:
    """(Mosaic) a tile's `(b, h, q_idx, kv_idx)` for `evaluate`: scalars `b`, `h`; the
    windows `q_first + iota (bq, 1)` and `kv_first + iota (1, bk)`, clamped to
    `q_last`, `kv_last` where used as values."""
    return (_Scalar(b, (1, 1)), _Scalar(h, (1, 1)), _Window(q_first, q_last, 0, bq), _Window(kv_first, kv_last, 1, bk))


def tpu_forms(mod, consts, bq: int, bk: int, score: bool) -> tuple:
    """Per const of a mod traced for `(bq, bk)` tiles, the sorted forms in which a TPU
    kernel reads it (`_tpu_form`; `"gather"` a read at computed indices, `"whole"` a
    use of the whole array): found by evaluating the mod on abstract indices."""
    if mod is None:
        return ()
    forms = [set() for _ in consts]

    def run(b, h, q0, k0):
        state = _State(None, forms, tpu=True)
        captured = [_Captured(_Whole(forms[i], c), c.shape, i) for i, c in enumerate(consts)]
        args = tpu_indices(b, h, q0, q0, bq, k0, k0, bk)
        _eval(mod.jaxpr, captured, ([jnp.zeros((bq, bk), jnp.float32)] if score else []) + list(args), state)

    jax.make_jaxpr(run)(*(jax.ShapeDtypeStruct((), jnp.int32),) * 4)
    return tuple(tuple(sorted(f, key=str)) for f in forms)


class _Whole:
    """(Classifying) a const's ref whose whole-array load is recorded as `"whole"`."""

    def __init__(self, forms: set, const):
        self.forms, self.shape, self.dtype = forms, const.shape, const.dtype

    def __getitem__(self, idx):
        self.forms.add("whole")
        return jnp.zeros(self.shape, self.dtype)


def tpu_form_array(const, form, size: int):
    """A const as the kernel's input for one form: 32-bit for SMEM; for a window form
    the read axis moved last, edge-padded by `size` on both sides (a window past either
    end reads the clamped entries, as a gather would) and given its unit axis."""
    kind, axis = form
    x = jnp.moveaxis(const, axis, -1)
    x = x.astype(jnp.int32) if x.dtype == jnp.bool_ else x
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(size, size)], mode="edge")
    return x[..., None] if kind == "col" else x[..., None, :]


def evaluate(mod, const_refs, args, given=None):
    """`(mod(*args), reads)`: the traced mod (`engine.Mod`) on the tile's `args`, its
    consts read from `const_refs` (the kernel's refs, in the mod's const order)
    where it indexes them, or taken from `given` (one array per read, in the order
    `reads` lists them)."""
    consts = [_Captured(ref, _shape_of(ref), i) for i, ref in enumerate(const_refs)]
    state = _State(given, tpu=any(isinstance(ref, dict) for ref in const_refs) or isinstance(args[-1], _Window))
    (out,) = _eval(mod.jaxpr, consts, list(args), state)
    return out, state.reads


def _shape_of(ref) -> tuple:
    """A const's shape: its ref's, or (Mosaic: refs by form) the one given with them."""
    return ref["shape"] if isinstance(ref, dict) else ref.shape


def scatter_add(grad_refs, reads, cotangents, atomic: bool):
    """Adds each read's cotangent into its const's gradient ref at the read's indices
    (`grad_refs[i]` None for a const that takes no gradient)."""
    for read, ct in zip(reads, cotangents):
        ref = grad_refs[read.const]
        if ref is None:
            continue
        if read.parts == "smem":  # Mosaic: the summed cotangent of a scalar read, into SMEM
            ref[read.indices] = ref[read.indices] + jnp.sum(ct).astype(ref.dtype)
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
