"""Ulysses sequence parallelism (Jacobs et al. 2023, "DeepSpeed Ulysses"): the sequence
split across the devices of a mesh axis, exchanged for a split over the heads.

Each of the P devices of `axis_name` holds N/P rows of q, k and v for every head. One
`lax.all_to_all` per array turns that into every row of H/P heads (`(B, H, N/P, D)` →
`(B, H/P, N, D)`); each device then runs plain `jax_mha.attention` on its heads over
the whole sequence, so every feature of `attention` (causal, windows, lengths, packed
segment ids, every part of the description, GQA, any path) works unchanged, and one more
all-to-all brings the output back to the sequence split. Gradients are autodiff's:
the transpose of an all-to-all is the all-to-all the other way.

Each device sends about (P-1)/P of its share of q, k, v and the output per layer
forward (four all-to-alls) and the same again backward: the bytes per device fall as
1/P, while ring attention (`jax_mha.parallel.ring`) sends (P-1) key/value blocks per device
(its total stays about the whole of K and V). The price: the heads are the unit of
the split, so P must divide H (and K, the key/value heads), and each device holds the
whole sequence for its heads (its local attention's memory, linear in N on the
blockwise path). docs/scaling.md compares the two, measured.

Global indices. The mods see the whole problem's indices: `q_idx`, `kv_idx` are
positions in the whole sequence (each device has it all), `head` the query head of
all H (the device's heads are offset by its place on the axis, a traced value the
wrapped mods close over), `batch` the index into the whole batch.

Beside the sequence, the batch may be split over another mesh axis
(`batch_axis_name`, e.g. "data") and the heads over a third (`head_axis_name`, e.g.
"model"; each of its devices then splits its own heads once more over `axis_name`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_mha import _masking
from jax_mha.functional import attention

# Keywords whose arrays are split over the mesh (by batch and/or head); every other
# array keyword is given whole (replicated) to every device.
_LENGTHS = ("q_lengths", "kv_lengths")
_SEGMENTS = ("q_segment_ids", "kv_segment_ids")
_PAIRWISE = ("mask", "bias")
_SPLIT = (*_LENGTHS, *_SEGMENTS, *_PAIRWISE, *_masking.PER_HEAD)


class _Plan(NamedTuple):
    """The static part of one call: mesh axes and global sizes."""

    mesh: Mesh
    axis_name: str
    batch_axis: str | None
    head_axis: str | None
    batch: int  # B, global
    heads: int  # H, global
    local_batch: int  # B on each device
    local_heads: int  # H on each device inside (after the all-to-all)


def _check_mesh(mesh: Mesh, axis_name, batch_axis_name, head_axis_name) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"ulysses_attention needs a jax.sharding.Mesh as mesh, got {mesh!r}")
    for arg, name in (("axis_name", axis_name), ("batch_axis_name", batch_axis_name),
                      ("head_axis_name", head_axis_name)):
        if (name is not None or arg == "axis_name") and name not in mesh.shape:
            raise ValueError(f"{arg}={name!r} is not an axis of the mesh (axes {tuple(mesh.shape)})")
    names = [x for x in (axis_name, batch_axis_name, head_axis_name) if x is not None]
    if len(set(names)) != len(names):
        raise ValueError(f"axis_name={axis_name!r}, batch_axis_name={batch_axis_name!r} and "
                         f"head_axis_name={head_axis_name!r} must be different mesh axes")


def _check_inputs(q, k, v, keywords: dict) -> None:
    """What the split needs beyond `attention`'s own checks: `(B, heads, length, D)`
    arrays in the BHND layout."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"ulysses_attention expects {name} of shape (B, heads, length, D), got "
                             f"{getattr(x, 'shape', type(x))}")
    if keywords.get("layout", "BHND") != "BHND":
        raise ValueError(f"ulysses_attention takes q, k, v as (B, H, N, D): layout={keywords['layout']!r} is not "
                         f"supported; swap the axes before the call")


def _check_no_dropout(keywords: dict) -> None:
    if keywords.get("dropout_rate", 0.0) > 0.0 and not keywords.get("deterministic", True):
        raise ValueError(f"ulysses_attention cannot take attention dropout (dropout_rate="
                         f"{keywords['dropout_rate']}, deterministic=False): each device would draw its own mask, "
                         f"not the one-device draw")


def _check_divisible(mesh: Mesh, q, k, axis_name, batch_axis_name, head_axis_name) -> None:
    """P (times the head axis) must divide H and K, P the lengths N and S, the batch
    axis B."""
    size = mesh.shape[axis_name]
    split = size * (1 if head_axis_name is None else mesh.shape[head_axis_name])
    over = f"{split} (axis_name={axis_name!r} has {size} devices" + (
        ")" if head_axis_name is None else f", times {split // size} of head_axis_name={head_axis_name!r})")
    (b, h, n, _), (kh, s) = q.shape, k.shape[1:3]
    for what, count in (("num_heads H", h), ("num_kv_heads K", kh)):
        if count % split:
            raise ValueError(f"ulysses_attention splits the heads: {what}={count} is not a multiple of {over}; "
                             f"use ring_attention (jax_mha.parallel.ring) or fewer devices")
    for what, count in (("query length N", n), ("key length S", s)):
        if count % size:
            raise ValueError(f"{what}={count} is not a multiple of the {size} devices of axis_name={axis_name!r}; "
                             f"pad the sequence and pass kv_lengths")
    if batch_axis_name is not None and b % mesh.shape[batch_axis_name]:
        raise ValueError(f"batch size B={b} is not a multiple of the {mesh.shape[batch_axis_name]} devices of "
                         f"batch_axis_name={batch_axis_name!r}")


def _global_result(q, k, v, keywords: dict):
    """`attention`'s result structure at the global shapes (ShapeDtypeStructs), which
    also runs all of its checks with the caller's numbers in the messages. Arrays
    enter unsharded (abstract), so an Explicit mesh's shardings play no part."""
    arrays = {name: x for name, x in keywords.items() if isinstance(x, (jax.Array, jax.ShapeDtypeStruct))}
    others = {name: x for name, x in keywords.items() if name not in arrays}
    plain = lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype)
    fn = lambda q, k, v, arrays: attention(q, k, v, **others, **arrays)
    return jax.eval_shape(fn, plain(q), plain(k), plain(v), {name: plain(x) for name, x in arrays.items()})


def _plan(mesh, q, axis_name, batch_axis_name, head_axis_name) -> _Plan:
    b, h = q.shape[:2]
    size = lambda axis: 1 if axis is None else mesh.shape[axis]
    local_heads = h // (size(head_axis_name) * mesh.shape[axis_name])
    return _Plan(mesh, axis_name, batch_axis_name, head_axis_name, b, h, b // size(batch_axis_name), local_heads)


def _head_spec(plan: _Plan):
    """The mesh axes a head dimension is split over inside: the head axis (major),
    then the sequence axis."""
    return plan.axis_name if plan.head_axis is None else (plan.head_axis, plan.axis_name)


def _arrays_and_specs(plan: _Plan, keywords: dict) -> tuple[dict, dict]:
    """The array keywords, in the layout each device is given, and their specs:
    lengths `(B,)` and segment ids `(B, length)` split by batch; a dense mask or bias,
    brought to rank 4, by batch and head where it has those dimensions; the
    description's per-head arrays `(H,)` (`_masking.PER_HEAD`) by head; any other
    array whole."""
    arrays, specs = {}, {}
    for name, x in keywords.items():
        if not isinstance(x, jax.Array):
            continue
        if name in _LENGTHS:
            x, spec = jnp.broadcast_to(jnp.reshape(x, (-1,)), (plan.batch,)), PartitionSpec(plan.batch_axis)
        elif name in _SEGMENTS:
            x, spec = jnp.broadcast_to(x, (plan.batch, x.shape[-1])), PartitionSpec(plan.batch_axis, None)
        elif name in _PAIRWISE:
            x = lax.broadcast_to_rank(x, 4)
            spec = PartitionSpec(plan.batch_axis if x.shape[0] == plan.batch > 1 else None,
                                 _head_spec(plan) if x.shape[1] == plan.heads > 1 else None, None, None)
        elif name in _masking.PER_HEAD:
            spec = PartitionSpec(_head_spec(plan))
        else:
            spec = PartitionSpec()
        arrays[name], specs[name] = x, spec
    return arrays, specs


def _offsets(plan: _Plan) -> tuple[Any, Any]:
    """`(first global batch index, first global query head)` of this device inside
    `shard_map`: traced int32 scalars (0 for an axis not split)."""
    index = lambda axis: lax.axis_index(axis).astype(jnp.int32)
    batch = 0 if plan.batch_axis is None else index(plan.batch_axis) * plan.local_batch
    group = index(plan.axis_name)
    if plan.head_axis is not None:
        group = index(plan.head_axis) * plan.mesh.shape[plan.axis_name] + group
    return batch, group * plan.local_heads


def _global_mods(keywords: dict, batch_offset, head_offset) -> dict:
    """The mods (`_masking.MODS`) called with global batch and head indices."""
    return {name: _masking.shift_indices(keywords[name], batch_offset, head_offset)
            for name in _masking.MODS if keywords.get(name) is not None}


def _placed(mesh: Mesh, tree, specs):
    """`tree` resharded to `specs` on a mesh with Explicit axes, whose `shard_map`
    takes only inputs laid out as its specs say; as it is on an Auto mesh."""
    if all(t != jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
        return tree
    return jax.tree.map(lambda x, spec: jax.reshard(x, NamedSharding(mesh, spec)), tree, specs,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def _run(plan: _Plan, q, k, v, keywords: dict, result_shapes):
    """The sharded program: all-to-all to heads, local `attention`, all-to-all back.
    Every leaf of the result is `(B, H, N, …)` (the output, the weights, the lse)."""
    for leaf in jax.tree.leaves(result_shapes):
        if leaf.shape[:3] != (plan.batch, plan.heads, q.shape[2]):
            raise ValueError(f"ulysses_attention can return only (B, H, N, …) arrays, attention gave {leaf.shape}")
    arrays, array_specs = _arrays_and_specs(plan, keywords)
    statics = {name: x for name, x in keywords.items() if name not in arrays}
    seq = PartitionSpec(plan.batch_axis, plan.head_axis, plan.axis_name, None)
    rows = lambda leaf: PartitionSpec(plan.batch_axis, plan.head_axis, plan.axis_name, *(None,) * (leaf.ndim - 3))
    to_heads = lambda x: lax.all_to_all(x, plan.axis_name, split_axis=1, concat_axis=2, tiled=True)
    to_rows = lambda x: lax.all_to_all(x, plan.axis_name, split_axis=2, concat_axis=1, tiled=True)

    def per_device(q, k, v, arrays):
        mods = _global_mods(statics, *_offsets(plan))
        result = attention(to_heads(q), to_heads(k), to_heads(v), **{**statics, **mods, **arrays})
        return jax.tree.map(to_rows, result)

    # check_vma=False: the local paths were written for plain arrays (a `lax.cond` whose
    # branches differ in which values vary over the mesh is fine there, refused here).
    run = jax.shard_map(per_device, mesh=plan.mesh, in_specs=(seq, seq, seq, array_specs),
                        out_specs=jax.tree.map(rows, result_shapes), check_vma=False)
    return run(*_placed(plan.mesh, (q, k, v), (seq, seq, seq)), _placed(plan.mesh, arrays, array_specs))


def ulysses_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mesh: Mesh,
    axis_name: str = "sequence",
    batch_axis_name: str | None = None,
    head_axis_name: str | None = None,
    **attention_keywords,
):
    """Attention with the sequence split over the mesh axis `axis_name`, by
    all-to-all over the heads (see the module docstring).

    Equals `jax_mha.attention(q, k, v, **attention_keywords)` (to float32 rounding,
    values and gradients) while each of the P devices of `axis_name` holds N/P rows
    of q, k, v and of the output, and attends with H/P heads over the whole sequence.
    The keywords are `attention`'s (`mask`, `bias`, `scale`, the description,
    `empty_rows`, `return_weights`, `implementation`, block sizes, ...), passed on to
    each device's call: the mods with global batch and head indices; lengths, segment
    ids and per-head arrays split by batch or head and otherwise given whole to every
    device (ids `(B, N)` are
    gathered along N, a small int array); a dense `mask` or `bias` (broadcastable to
    `(B, H, N, S)`) likewise, each device holding its heads' `(N, S)` slices.

    Args:
      q: `(B, H, N, D)` queries in the caller's (contiguous) order, typically sharded
        with `PartitionSpec(None, None, axis_name, None)`.
      k: `(B, K, S, D)` keys (S = N for self-attention; GQA when K < H).
      v: `(B, K, S, Dv)` values.
      mesh: the device mesh; `axis_name` must be one of its axes.
      axis_name: the mesh axis the sequence is split over (P devices).
      batch_axis_name: a mesh axis B is split over (e.g. "data"), or None.
      head_axis_name: a mesh axis the heads are split over beside (e.g. "model"),
        or None; each of its M devices splits its H/M heads over `axis_name`.
      **attention_keywords: `jax_mha.attention`'s keywords.

    Returns:
      What `attention` returns, every array `(B, H, N, …)` split along N like q: the
      output `(B, H, N, Dv)` in q's dtype; with `return_weights=True`
      `(out, weights (B, H, N, S))`, with `return_residual=True` `(out, lse (B, H, N))`,
      with both `(out, weights, lse)`.

    Raises:
      ValueError: naming the numbers, when an axis is not a mesh axis or two are the
        same, q, k, v are not rank 4, P (times the head axis's size) does not divide
        H or K, P does not divide N or S, the batch axis does not divide B,
        `layout="BNHD"`, attention dropout is on; and every `ValueError` of
        `attention`, with the global shapes in its message.
      TypeError: for a mesh that is not a `Mesh`, and every `TypeError` of `attention`.
    """
    _check_mesh(mesh, axis_name, batch_axis_name, head_axis_name)
    _check_inputs(q, k, v, attention_keywords)
    attention_keywords = {name: jnp.asarray(x) if name in _SPLIT and x is not None else x
                          for name, x in attention_keywords.items()}  # lists and NumPy arrays, to be split
    result_shapes = _global_result(q, k, v, attention_keywords)  # attention's own checks, global numbers
    _check_no_dropout(attention_keywords)
    _check_divisible(mesh, q, k, axis_name, batch_axis_name, head_axis_name)
    plan = _plan(mesh, q, axis_name, batch_axis_name, head_axis_name)
    return _run(plan, q, k, v, attention_keywords, result_shapes)


def _split_axis(mesh: Mesh, axis: str, axis_name: str, multiple: int, *counts: int) -> str | None:
    """`axis` when the mesh has it with more than one device, it is not the sequence
    axis, and `multiple` times its size divides every count; else None."""
    size = mesh.shape.get(axis, 1)
    return axis if size > 1 and axis != axis_name and all(c % (size * multiple) == 0 for c in counts) else None


def _ulysses_attention_fn(q, k, v, *, mesh: Mesh, axis_name: str, **keywords):
    """`ulysses_attention` with the batch over "data" and the heads over "model"
    where those axes divide them."""
    (b, h), kh = jnp.shape(q)[:2], jnp.shape(k)[1]
    return ulysses_attention(q, k, v, mesh=mesh, axis_name=axis_name,
                             batch_axis_name=_split_axis(mesh, "data", axis_name, 1, b),
                             head_axis_name=_split_axis(mesh, "model", axis_name, mesh.shape[axis_name], h, kh),
                             **keywords)


def ulysses_attention_fn(mesh: Mesh, axis_name: str = "sequence") -> Callable:
    """`ulysses_attention` as a module's `attention_fn`: sequence parallelism in a model.

    `MultiHeadAttention(attention_fn=ulysses_attention_fn(mesh))` (linen or NNX, or
    `TransformerBlock`, `jax_mha.lab.models.Decoder`) runs its attention core split
    over the mesh axis `axis_name`, like `jax_mha.parallel.ring_attention_fn`, with
    the heads exchanged for the sequence inside. The batch is split over the mesh's
    "data" axis and the heads over "model" when those axes divide them (for the
    heads: H and K divisible by P times the "model" size). Every keyword of
    `attention` passes on (see `ulysses_attention`); attention dropout is refused
    by name.

    Args:
      mesh: the device mesh; `axis_name` must be one of its axes.
      axis_name: the mesh axis the sequence is split over.

    Returns:
      `attention_fn(q, k, v, mask=None, bias=None, **keywords) -> (B, H, N, Dv)`
      (or what `attention` returns for those keywords).

    Raises:
      ValueError: when `axis_name` is not an axis of the mesh.
      TypeError: when `mesh` is not a `jax.sharding.Mesh`.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"ulysses_attention_fn needs a jax.sharding.Mesh as mesh, got {mesh!r}")
    if axis_name not in mesh.shape:
        raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh (axes {tuple(mesh.shape)})")
    return functools.partial(_ulysses_attention_fn, mesh=mesh, axis_name=axis_name)


__all__ = ["ulysses_attention", "ulysses_attention_fn"]
