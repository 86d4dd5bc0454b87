"""Attention and training across devices: one public namespace, three modules.

* `partitioning`: meshes and the rules that place parameters, batches and optimizer
  states on them (head- and data-parallel training; `make_mesh`, `shard`, ...).
* `ring`: ring attention, the sequence split over a mesh axis and key/value blocks
  passed around it (`ring_attention`, `ring_attention_fn`).
* `ulysses`: the sequence split over a mesh axis and exchanged for heads by an
  all-to-all (`ulysses_attention`, `ulysses_attention_fn`).

Everything public is importable from here: `from jax_mha import parallel`.
"""

from jax_mha.parallel.partitioning import (
    DEFAULT_RULES,
    MESH_AXES,
    PARAM_LOGICAL_AXES,
    Rules,
    batch_sharding,
    check_batch_divisible,
    check_heads_divisible,
    check_sequence_divisible,
    logical_axes,
    logical_axis_size,
    make_mesh,
    parse_mesh_spec,
    partition_specs,
    replicated,
    sequence_size,
    shard,
    shard_batch,
    tree_shardings,
)
from jax_mha.parallel.ring import ring_attention, ring_attention_fn
from jax_mha.parallel.ulysses import ulysses_attention, ulysses_attention_fn

__all__ = [
    "DEFAULT_RULES",
    "MESH_AXES",
    "PARAM_LOGICAL_AXES",
    "Rules",
    "batch_sharding",
    "check_batch_divisible",
    "check_heads_divisible",
    "check_sequence_divisible",
    "logical_axes",
    "logical_axis_size",
    "make_mesh",
    "parse_mesh_spec",
    "partition_specs",
    "replicated",
    "ring_attention",
    "ring_attention_fn",
    "sequence_size",
    "shard",
    "shard_batch",
    "tree_shardings",
    "ulysses_attention",
    "ulysses_attention_fn",
]
