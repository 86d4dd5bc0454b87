"""Device meshes and partitioning rules: head-parallel and data-parallel training.

The seeds "divide and conquer" attention across heads; here the heads are divided
across devices (Megatron-LM's tensor parallelism, Shoeybi et al. 2019, §3): the
query/key/value kernels are split along their output (heads) columns, the output
kernel along its input (heads) rows, so each device computes whole heads locally and
one all-reduce after the output projection combines them. The batch is split across
a second mesh axis (data parallelism; gradients are all-reduced by XLA).

Two names per parameter axis, as in flax's logical partitioning:

* **logical** names say what an axis *is* (`"embed"`, `"heads"`, `"kv_heads"`,
  `"mlp"`, `"vocab"`, `"batch"`), fixed by `PARAM_LOGICAL_AXES`;
* **rules** say where a logical name goes on the mesh, e.g. `("heads", "model")`.
  `DEFAULT_RULES` shards heads (and the feed-forward width) over `"model"` and the
  batch over `"data"`; pass your own rules to remap (`(("heads", None), ...)` turns
  head parallelism off). The mapping is `flax.linen.logical_to_mesh_axes`.

Why logical names come from a path-based rule rather than `nn.with_logical_partitioning`
boxes on the kernels: boxes change what `init` returns (`nn.LogicallyPartitioned`
leaves), so every non-sharded user, checkpoint, optimizer and analysis would have to
`nn.meta.unbox` first, and the parameter tree fixed by the API would no longer be plain
arrays. A rule over paths keeps the tree untouched, and because it matches path
*suffixes* (`.../query/kernel`), the same rule also partitions optimizer states that
mirror the parameters (Adam's `mu/…/query/kernel`), and stacked (seed-vmapped) states,
whose extra leading axes it leaves unsharded. Trees that do carry flax boxes are
honoured too: a boxed leaf keeps its own logical names.

This module only works out *where* arrays go: meshes, partition specs, shardings.
The one `jax.jit` over them lives in the trainer (`jax_mha.lab.train`), big_vision's
shape — `jit(step, out_shardings=..., donate_argnums=(0,))` — so imports point one
way (`train` imports `parallel`, never the reverse)::

    from jax_mha import parallel
    from jax_mha.lab import train
    mesh = parallel.make_mesh(**parallel.parse_mesh_spec("data=2,model=2"))
    state = parallel.shard(train.init_state(key, model, optimizer), mesh)
    step = train.jit_train_step(model, optimizer, mesh=mesh)
    state, metrics = step(state, batch, rng)   # the batch is split over "data"

and `train.train_seeds(..., mesh=mesh)` runs the seed-vmapped, scanned chunks the
same way. On a CPU host, `XLA_FLAGS=--xla_force_host_platform_device_count=4` (set
before jax is imported) gives four devices to try it.
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "sequence", "model")

Rules = Sequence[tuple[str, Any]]

# Logical name -> mesh axis (None: replicated). Megatron's layout: heads and the
# feed-forward width across "model", the batch across "data", the rest replicated.
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", "data"),
    ("heads", "model"),  # query/out kernels: whole heads per device
    ("kv_heads", "model"),  # key/value kernels; remap to None for MQA (1 kv head)
    ("mlp", "model"),  # feed-forward hidden width (Megatron's column/row split)
    ("embed", None),  # d_model stays whole: each device holds full activations
    ("vocab", None),  # 14 tokens: nothing to gain
    ("length", "sequence"),  # tokens of a sequence: split only on a mesh with sequence > 1 (ring attention)
)

# (regex over the "/"-joined path, logical names of the leaf's trailing axes). The
# first match wins; a leaf with more axes than names (a stacked seed or layer axis)
# gets None in front; a leaf no pattern matches is replicated.
PARAM_LOGICAL_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"(^|/)query/kernel$", ("embed", "heads")),  # (d_q, H*D): head h owns columns h*D:(h+1)*D
    (r"(^|/)query/bias$", ("heads",)),
    (r"(^|/)(key|value)/kernel$", ("embed", "kv_heads")),  # (d_k, K*D)
    (r"(^|/)(key|value)/bias$", ("kv_heads",)),
    (r"(^|/)out/kernel$", ("heads", "embed")),  # (H*D, d_model): rows by head
    (r"(^|/)hidden/kernel$", ("embed", "mlp")),  # FeedForward (d_model, d_ff)
    (r"(^|/)hidden/bias$", ("mlp",)),
    (r"(^|/)output/kernel$", ("mlp", "embed")),  # FeedForward (d_ff, d_model)
    (r"(^|/)embed/embedding$", ("vocab", "embed")),
    (r"(^|/)logits/kernel$", ("embed", "vocab")),
)


# ---------------------------------------------------------------------------------
# Meshes.
# ---------------------------------------------------------------------------------


def parse_mesh_spec(spec: str | None) -> dict[str, int]:
    """Parses a command-line mesh such as `"data=2,model=2"` or `"data=1,sequence=4"`.

    Args:
      spec: comma-separated `axis=size` for axes in `("data", "sequence", "model")`;
        `""` or None means all devices on "data".

    Returns:
      `{axis: size}` with the axes given, ready for `make_mesh(**…)`.

    Raises:
      ValueError: on an unknown axis, a repeated axis, or a size that is not a positive int.
    """
    out: dict[str, int] = {}
    for part in (spec or "").replace(" ", "").split(","):
        if not part:
            continue
        name, sep, value = part.partition("=")
        if not sep or name not in MESH_AXES:
            raise ValueError(f"mesh spec entries must be 'data=N', 'sequence=N' or 'model=N', got {part!r} in {spec!r}")
        if name in out:
            raise ValueError(f"mesh axis {name!r} given twice in {spec!r}")
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"mesh axis {name!r} needs a positive integer size, got {value!r} in {spec!r}")
        out[name] = int(value)
    return out


def make_mesh(data: int | None = None, model: int | None = None, *, sequence: int = 1,
              devices: Sequence[Any] | None = None) -> Mesh:
    """A `("data", "sequence", "model")` mesh over the first `data * sequence * model` devices.

    | axis | what it splits | used by |
    | --- | --- | --- |
    | `"data"` | the batch | `batch_sharding`, the trainer (gradients all-reduced by XLA) |
    | `"sequence"` | the sequence (N) | `ring_attention(..., axis_name="sequence")` |
    | `"model"` | the heads and the feed-forward width | `DEFAULT_RULES` (Megatron's layout) |

    Built by `jax.make_mesh`, which orders the devices by the machine's topology.

    Args:
      data: devices along the batch; default: all devices not used by the others.
      model: devices along the heads; default 1.
      sequence: devices along the sequence; default 1.
      devices: default `jax.devices()`.

    Returns:
      `jax.sharding.Mesh` of shape `(data, sequence, model)`, axis types Auto (XLA
      propagates shardings from the parameters and inputs).

    Raises:
      ValueError: if a size is < 1, the devices do not divide evenly, or more
        devices are asked for than exist.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    model = 1 if model is None else model
    if model < 1 or sequence < 1 or (data is not None and data < 1):
        raise ValueError(f"mesh sizes must be >= 1, got data={data}, sequence={sequence}, model={model}")
    if data is None:
        if n % (model * sequence):
            raise ValueError(f"{n} devices cannot be split into sequence={sequence} x model={model} groups")
        data = n // (model * sequence)
    total = data * sequence * model
    if total > n:
        raise ValueError(f"mesh data={data} x sequence={sequence} x model={model} needs {total} devices, "
                         f"only {n} available")
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return jax.make_mesh((data, sequence, model), MESH_AXES, axis_types=auto, devices=devices[:total])


# ---------------------------------------------------------------------------------
# Partitioning rules.
# ---------------------------------------------------------------------------------


def _path_str(path) -> str:
    """`(DictKey('params'), GetAttrKey('mu'), SequenceKey(0))` -> `"params/mu/0"`."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def _is_box(x) -> bool:
    return isinstance(x, nn.meta.AxisMetadata)


def logical_axes(tree: Any, patterns: Sequence[tuple[str, tuple]] = PARAM_LOGICAL_AXES) -> Any:
    """Logical axis names of every leaf, from its path.

    Args:
      tree: parameters, an optimizer state, a `TrainState` — any pytree of arrays or
        `jax.ShapeDtypeStruct`s (flax `nn.LogicallyPartitioned` leaves keep theirs).
      patterns: `(regex, names)` pairs matched (`re.search`) against the
        "/"-joined path; first match wins.

    Returns:
      A tree of the same structure (boxes unboxed) whose leaves are `PartitionSpec`s of
      logical names, one per axis of the leaf.
    """
    compiled = [(re.compile(rx), tuple(names)) for rx, names in patterns]

    def one(path, leaf):
        if _is_box(leaf):
            names = tuple(leaf.get_partition_spec()) if hasattr(leaf, "get_partition_spec") else ()
            ndim = jnp.ndim(leaf.unbox())
        else:
            ndim = len(np.shape(leaf)) if not hasattr(leaf, "ndim") else leaf.ndim
            key = _path_str(path)
            names = next((n for rx, n in compiled if rx.search(key)), ())
            if len(names) > ndim:  # e.g. a scalar that shares a name: replicate
                names = ()
        return PartitionSpec(*((None,) * (ndim - len(names)) + tuple(names)))

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=_is_box)


def partition_specs(
    tree: Any, rules: Rules = DEFAULT_RULES, patterns: Sequence[tuple[str, tuple]] = PARAM_LOGICAL_AXES
) -> Any:
    """Mesh `PartitionSpec` of every leaf: `logical_axes` mapped through `rules`.

    Logical names with no rule are replicated (flax's `logical_to_mesh_axes`).
    """
    return jax.tree.map(
        lambda spec: nn.logical_to_mesh_axes(tuple(spec), rules),
        logical_axes(tree, patterns),
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def _axis_size(mesh: Mesh, entry) -> int:
    """Devices along a PartitionSpec entry (None, an axis name or a tuple of them)."""
    if entry is None:
        return 1
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh.shape[a] for a in names)


def logical_axis_size(mesh: Mesh, name: str, rules: Rules = DEFAULT_RULES) -> int:
    """How many devices the logical axis `name` is split over under `rules`."""
    return _axis_size(mesh, nn.logical_to_mesh_axes((name,), rules)[0])


def tree_shardings(
    tree: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES,
    patterns: Sequence[tuple[str, tuple]] = PARAM_LOGICAL_AXES,
) -> Any:
    """`NamedSharding` of every leaf, checking that each sharded axis divides evenly.

    Raises:
      ValueError: naming the leaf, its shape and the mesh axis, when an axis size is
        not divisible by the number of devices it is split over.
    """
    specs = partition_specs(tree, rules, patterns)
    leaves = jax.tree_util.tree_leaves_with_path(nn.meta.unbox(tree))
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    for (path, leaf), spec in zip(leaves, spec_leaves):
        for dim, entry in zip(np.shape(leaf), spec):
            size = _axis_size(mesh, entry)
            if dim % size:
                raise ValueError(
                    f"{_path_str(path)} of shape {tuple(np.shape(leaf))}: axis of size {dim} is not "
                    f"divisible by mesh axis {entry!r} of size {size}"
                )
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def check_heads_divisible(num_heads: int, mesh: Mesh, rules: Rules = DEFAULT_RULES, num_kv_heads: int | None = None) -> None:
    """Head parallelism splits whole heads: `num_heads` must divide by the devices
    along "heads" (and `num_kv_heads` along "kv_heads").

    Raises:
      ValueError: naming the head count and the mesh axis size.
    """
    for name, count in (("heads", num_heads), ("kv_heads", num_kv_heads)):
        if count is None:
            continue
        size = logical_axis_size(mesh, name, rules)
        if count % size:
            axis = nn.logical_to_mesh_axes((name,), rules)[0]
            field = "num_heads" if name == "heads" else "num_kv_heads"
            raise ValueError(
                f"{field}={count} is not divisible by mesh axis {axis!r} of size {size}: "
                f"head parallelism needs whole {name} per device"
            )


def check_batch_divisible(batch_size: int, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> None:
    """Raises ValueError naming both numbers if the batch does not split evenly."""
    size = logical_axis_size(mesh, "batch", rules)
    if batch_size % size:
        axis = nn.logical_to_mesh_axes(("batch",), rules)[0]
        raise ValueError(f"batch size {batch_size} is not divisible by mesh axis {axis!r} of size {size}")


# ---------------------------------------------------------------------------------
# Placing data: what the trainer jits with.
# ---------------------------------------------------------------------------------


def replicated(mesh: Mesh) -> NamedSharding:
    """A copy on every device (scalars, PRNG keys, metrics)."""
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, rules: Rules = DEFAULT_RULES, leading_axes: int = 0) -> NamedSharding:
    """Sharding of a `(…, B, T)` batch array: B over the "batch" rule's mesh axis."""
    spec = nn.logical_to_mesh_axes((None,) * leading_axes + ("batch", "length"), rules)
    return NamedSharding(mesh, spec)


def shard_batch(batch: Mapping[str, jax.Array], mesh: Mesh, rules: Rules = DEFAULT_RULES) -> dict[str, jax.Array]:
    """Places every `(B, T)` array of a batch with B split over "data".

    Raises:
      ValueError: if B is not divisible by the data axis.
    """
    batch_size = next(iter(batch.values())).shape[0]
    check_batch_divisible(batch_size, mesh, rules)
    return jax.device_put(dict(batch), batch_sharding(mesh, rules))


def shard(tree: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
    """Moves a pytree (parameters, a `train.TrainState`, a stack of them over seeds)
    onto the mesh: leaves matched by `PARAM_LOGICAL_AXES` (and the optimizer moments
    that mirror them) are split by `rules`, everything else is replicated.

    The result never aliases `tree`'s buffers, so donating it to a sharded step
    leaves the original usable (`device_put` alone may reuse the buffer of a
    replicated leaf for the shard on its own device).

    Raises:
      ValueError: if a sharded axis does not divide evenly (naming leaf and sizes).
    """
    shardings = tree_shardings(tree, mesh, rules)
    return jax.device_put(jax.tree.map(jnp.copy, tree), shardings)


# ---------------------------------------------------------------------------------
# Sequence parallelism: the ring itself lives in `jax_mha.parallel.ring`; what the trainer
# needs to size it stays here.
# ---------------------------------------------------------------------------------


def sequence_size(mesh: Mesh | None, axis_name: str = "sequence") -> int:
    """Devices along the mesh axis `axis_name` (1 without a mesh or without that axis)."""
    return 1 if mesh is None else int(dict(mesh.shape).get(axis_name, 1))


def check_sequence_divisible(length: int, size: int | Mesh, *, is_causal: bool = True,
                             axis_name: str = "sequence") -> None:
    """Ring attention splits N into P blocks (P² for causal attention, whose striped
    layout splits each block once more): `length` must divide.

    Args:
      length: N, tokens per sequence.
      size: P, or a mesh whose `axis_name` axis gives P (1 when it has none).
      is_causal: whether the attention is causal (the striped layout).
      axis_name: the mesh axis the sequence is split over.

    Raises:
      ValueError: naming the length, the multiple it needs and the mesh axis size.
    """
    p = size if isinstance(size, int) else sequence_size(size, axis_name)
    multiple = p * p if is_causal and p > 1 else p
    if length % multiple:
        need = f"{p}² = {multiple} (causal attention, striped layout)" if multiple != p else str(p)
        raise ValueError(f"sequence length {length} is not a multiple of {need}: mesh axis {axis_name!r} has "
                         f"{p} devices")
