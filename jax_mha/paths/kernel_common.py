"""What the kernel paths share (`cudnn`, `pallas_gpu`, `pallas_tpu`, their decode
kernels, `pallas_mgpu`); no kernel module imports another.

`kernel_run` turns a kernel's `fn(q, k, v, vis, *, scale, interpret) -> out` into a
path's `run`; `pallas_limits` are the limits every Pallas kernel shares (the rest of
their refusals derive from what each takes, `jax_mha._path`); `engine_backward` gives
a forward-only kernel the blockwise engine's gradient; `visible_interval` is the key
interval of a one-query decoding step; `this_gpu` the GPU the process runs on.

The Pallas kernels take integer segment ids and let a query see a key only when the
ids match. Lengths, padding to the kernel's block size and the library's segment ids
all fold into those arrays (`kernel_segment_ids`), so no sequence length is refused.
`without_x64` is their tracing under `jax_enable_x64`, `kernel_mesh` / `mesh_refusal`
the mesh a kernel call is split over by `shard_map` (a Pallas kernel cannot be
partitioned automatically).
"""

from __future__ import annotations

import functools
import importlib
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jax_mha import _masking
from jax_mha._path import fallback
from jax_mha.paths import blockwise


@functools.cache
def this_gpu() -> tuple[str, tuple[int, ...]] | None:
    """`("cuda" | "rocm", compute capability)` of the default device when it is a GPU
    (capability `()` when unreadable), else None: a call described for a GPU from
    another backend (the tests, `experiments/accelerator_table.py`)."""
    if jax.default_backend() != "gpu":
        return None
    device = jax.devices()[0]
    vendor = "cuda" if "cuda" in str(device.client.platform_version).lower() else "rocm"
    try:
        capability = tuple(int(x) for x in str(device.compute_capability).split("."))
    except (AttributeError, ValueError):
        capability = ()
    return vendor, capability


def kernel_run(fn):
    """A kernel's `fn(q, k, v, vis, *, scale, interpret) -> out (B…, H, N, Dv)` as a
    path's `run` (`jax_mha._path.Path`): traced under standard dtype promotion (the
    kernels are jax's code; a user's `jax.numpy_dtype_promotion("strict")` is for their
    own arithmetic), interpreted when the call runs on a CPU, and the rows that see no
    key (where kernels average v or leave anything) and those that see a bad key read
    from the description (`_masking.dense_rows`)."""

    def run(q, k, v, bad_kv, vis: _masking.Visibility, call: _masking.Call, *, scale: float, **_):
        with jax.numpy_dtype_promotion("standard"):
            out = fn(q, k, v, vis, scale=scale, interpret=call.platform == "cpu")
        empty, touched = _masking.dense_rows(vis, bad_kv, q.shape[-3])
        out = jnp.where(empty[..., None], 0.0, out.astype(_masking.compute_dtype(q.dtype)))
        return out, None, None, empty, touched

    return run


def pallas_limits(label: str, call: _masking.Call) -> str | None:
    """What every Pallas kernel refuses beyond its parts: mixed dtypes, float64 inputs
    (their softmax is float32) and kv heads K not dividing the query heads H."""
    dtypes = {jnp.dtype(x.dtype) for x in (call.q, call.k, call.v)}
    if len(dtypes) > 1:
        return f"{label} needs one dtype for q, k and v, got {sorted(map(str, dtypes))}; {fallback()}"
    if jnp.dtype(call.q.dtype) == jnp.float64:
        return f"{label} computes its softmax in float32, too coarse for float64 inputs; {fallback()}"
    h, kh = call.q.shape[-3], call.k.shape[-3]
    if kh == 0 or h % kh:
        return f"{label} needs kv heads K dividing query heads H, got H={h}, K={kh}; {fallback()}"
    return None


def decode_limits(label: str, vis: _masking.Visibility, call: _masking.Call) -> str | None:
    """What every decode kernel refuses beyond its parts: more than one query row, and
    `pallas_limits`."""
    if vis.n != 1:
        return f"{label}'s decode kernel takes one query row, got N={vis.n}"
    return pallas_limits(label, call)


def engine_backward(kernel, scale: float):
    """`kernel(q, k, v, vis) -> out` (a forward-only kernel) as a function of the same
    arguments whose gradient is the blockwise engine's (`blockwise.run_blockwise`),
    which recomputes the forward: for kernels with no backward of their own.

    Args:
      kernel: q `(B…, H, N, D)`, k `(B…, K, S, D)`, v `(B…, K, S, Dv)`, `vis` ->
        out `(B…, H, N, Dv)`.
      scale: the softmax scale both use.
    """

    @jax.custom_vjp
    def call(q, k, v, vis):
        return kernel(q, k, v, vis)

    def forward(q, k, v, vis):
        return kernel(q, k, v, vis), (q, k, v, vis)

    def backward(saved, g):
        q, k, v, vis = saved
        engine = lambda q, k, v: blockwise.run_blockwise(q, k, v, vis, scale=scale)[0].astype(g.dtype)
        _, pull = jax.vjp(engine, q, k, v)
        return (*pull(g), None)  # the description (lengths, offsets) takes no gradient

    call.defvjp(forward, backward)
    return call


def visible_interval(vis: _masking.Visibility, batch: tuple):
    """`(start, stop)` int32 `(b,)` over the flattened `batch`: the keys `[start, stop)`
    the one query row may see (causality and window from `_masking.key_range`, cut at
    `kv_lengths`); traced when the offset or the lengths are."""
    b = math.prod(batch)
    lo, hi = _masking.key_range(vis, 0, 0, vis.s)
    hi = jnp.asarray(hi, jnp.int32)
    if vis.kv_lengths is not None:
        lengths = jnp.broadcast_to(vis.kv_lengths.reshape(vis.kv_lengths.shape[:-3]), batch).reshape(b)
        hi = jnp.minimum(hi, lengths.astype(jnp.int32))
    return jnp.broadcast_to(jnp.asarray(lo, jnp.int32), (b,)), jnp.broadcast_to(hi, (b,))


def static_int(x) -> int | None:
    """`x` as a Python int, or None when it is traced (known only at run time)."""
    if isinstance(x, jax.core.Tracer):
        return None
    return int(np.asarray(x))


def is_traced(x) -> bool:
    """Whether `x` is a tracer (its value unknown while tracing)."""
    return isinstance(x, jax.core.Tracer)


# The mesh axes a kernel call is split over by `shard_map` (MaxText's names): the
# flattened batch over "data", the heads (query and kv alike) over "model".
BATCH_AXIS, HEAD_AXIS = "data", "model"


def kernel_mesh(x):
    """`(mesh, batch axis or None, head axis or None)` for a kernel call on `x` (an
    array, a tracer or a shape struct): the context mesh (`jax.set_mesh`,
    `jax.sharding.use_mesh`), else the mesh of `x`'s NamedSharding (a concrete array
    or an explicitly sharded tracer), with its `BATCH_AXIS` and `HEAD_AXIS` when it
    has them and they are not already manual (inside a `shard_map`); None when it has
    neither."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        if is_traced(x):
            sharding = jax.typeof(x).sharding
        else:
            sharding = getattr(x, "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if mesh is None or mesh.empty:
            return None
    manual = set(getattr(mesh, "manual_axes", ()))
    axes = [name if name in mesh.axis_names and name not in manual else None for name in (BATCH_AXIS, HEAD_AXIS)]
    return None if axes == [None, None] else (mesh, *axes)


def mesh_refusal(name: str, call: _masking.Call) -> str | None:
    """Why `kernel_mesh`'s split cannot take this call: the flattened batch or the
    kv heads not dividing their mesh axis; None when it can (or there is no mesh)."""
    found = kernel_mesh(call.q)
    if found is None:
        return None
    mesh, batch_axis, head_axis = found
    batch = math.prod(jnp.broadcast_shapes(call.q.shape[:-3], call.k.shape[:-3], call.v.shape[:-3]))
    h, kh = call.q.shape[-3], call.k.shape[-3]
    if batch_axis is not None and batch % mesh.shape[batch_axis]:
        return (f"{name} splits the batch over the mesh axis {batch_axis!r} of size {mesh.shape[batch_axis]}, which "
                f"does not divide the flattened batch {batch}; {fallback()}")
    if head_axis is not None and kh % mesh.shape[head_axis]:
        return (f"{name} splits the heads over the mesh axis {head_axis!r} of size {mesh.shape[head_axis]}, which "
                f"does not divide the kv heads K={kh} (H={h}); {fallback()}")
    return None


def without_x64(fn):
    """`fn(*arrays)`, a Pallas kernel call with its own custom_vjp, traced forward and
    backward with 64-bit types off. Both kernels mix int32 program ids with Python
    ints in `lax.div`, which raises under `jax_enable_x64` (the ints become int64);
    their inputs here are float32/bfloat16/float16 and int32 already."""

    @jax.custom_vjp
    def call(*args):
        with jax.enable_x64(False):
            return fn(*args)

    def forward(*args):
        with jax.enable_x64(False):
            return jax.vjp(fn, *args)  # (out, the kernel's own backward as a pytree)

    def backward(pull, g):
        with jax.enable_x64(False):
            return pull(g)

    call.defvjp(forward, backward)
    return call


def next_pow2(x: int, least: int = 1) -> int:
    """The smallest power of two >= max(x, least)."""
    return max(least, 1 << max(int(x) - 1, 0).bit_length())


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def flat_batch(q, k, v):
    """q `(B…, H, N, D)`, k `(B…, K, S, D)`, v `(B…, K, S, Dv)` broadcast to one batch
    shape and flattened: `(batch, (b, H, N, D), (b, K, S, D), (b, K, S, Dv))`."""
    batch = tuple(jnp.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3]))
    b = math.prod(batch)
    flat = lambda x: jnp.broadcast_to(x, batch + x.shape[-3:]).reshape((b,) + x.shape[-3:])
    return batch, flat(q), flat(k), flat(v)


def flat_ids(vis: _masking.Visibility, batch: tuple):
    """The description's segment ids flattened over `batch`: int32 `(b, N)` and
    `(b, S)`, or None when unsegmented."""
    if not vis.segmented:
        return None
    b = math.prod(batch)
    q_ids = jnp.broadcast_to(vis.q_segment_ids[..., 0], batch + (1, vis.n)).reshape(b, vis.n)  # (b, N)
    kv_ids = jnp.broadcast_to(vis.kv_segment_ids[..., 0, :], batch + (1, vis.s)).reshape(b, vis.s)  # (b, S)
    return q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)


def sentinels(ids):
    """`(q sentinel, kv sentinel)` int32 `(b, 1)`: two values below every id in `ids`
    (a pair of `(b, ·)` arrays, or None) and below 0, so they never match a real id."""
    lo = jnp.zeros((), jnp.int32) if ids is None else jnp.minimum(jnp.min(ids[0], axis=1, initial=0),
                                                                   jnp.min(ids[1], axis=1, initial=0))[:, None]
    return lo - 1, lo - 2


def kernel_segment_ids(vis: _masking.Visibility, batch: tuple, n_pad: int, s_pad: int):
    """Per-(flat batch) int32 ids `(b, n_pad)`, `(b, s_pad)` that encode segments,
    lengths and padding together.

    Padding and out-of-length positions get sentinels below every real id (queries one
    value, keys another) so they never match anything: a padded or cut query then sees
    no key (the dispatcher fills that row) and a padded or cut key is seen by nobody.
    """
    b, n, s = math.prod(batch), vis.n, vis.s
    ids = flat_ids(vis, batch)
    qs, ks = (jnp.zeros((b, n), jnp.int32), jnp.zeros((b, s), jnp.int32)) if ids is None else ids
    q_sent, kv_sent = (jnp.broadcast_to(x, (b, 1)) for x in sentinels(ids))
    qs = _cut(qs, vis.q_lengths, batch, q_sent)
    ks = _cut(ks, vis.kv_lengths, batch, kv_sent)
    qs = jnp.concatenate([qs, jnp.broadcast_to(q_sent, (b, n_pad - n))], axis=1)
    ks = jnp.concatenate([ks, jnp.broadcast_to(kv_sent, (b, s_pad - s))], axis=1)
    return qs, ks


def _cut(ids, lengths, batch: tuple, sentinel):
    """`ids (b, L)` with the positions at or past `lengths` (int32 `(B…|1, 1, 1, 1)`,
    or None) set to `sentinel (b, 1)`."""
    if lengths is None:
        return ids
    cut = jnp.broadcast_to(lengths.reshape(lengths.shape[:-3]), batch).reshape(-1, 1)  # (b, 1)
    return jnp.where(jnp.arange(ids.shape[1], dtype=jnp.int32)[None] < cut, ids, sentinel)


def causal_past_last_key(vis: _masking.Visibility, name: str, use: str) -> str | None:
    """The refusal of a kernel that places queries on the keys' axis (causal by front
    padding) when `vis.offset` puts causal queries past the last key, else None."""
    n, s, offset = vis.n, vis.s, static_int(vis.offset)
    if vis.is_causal and -offset < n and n + offset > s:
        return (f"{name} places queries on the keys' axis: q_offset={offset} puts causal queries past the last key "
                f"(N + offset = {n + offset} > S = {s}); {use}")
    return None


def gpu_op(name: str):
    """`jax.experimental.pallas.ops.gpu.<name>`, imported without the DeprecationWarning
    jax 0.11 raises for its Triton `attention` and `decode_attention` (it points users to
    tokamax): the kernel is this library's choice, not its user's, and the warning would
    be printed at a user's first attention call."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return importlib.import_module(f"jax.experimental.pallas.ops.gpu.{name}")
