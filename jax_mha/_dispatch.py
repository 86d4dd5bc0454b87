"""Which path runs a call: the registry of paths, `"auto"`'s choice, and the steps
every path runs between.

The paths are `jax_mha._path.Path` objects, each defined in its own module and
registered here in `"auto"`'s order (`REGISTRY`): the pure-JAX paths first (`"xla"`:
whole scores, or the blockwise engine once they would pass `WHOLE_SCORES_MAX_BYTES`;
`"blockwise"`: the engine), then the kernels, each with the platforms it runs on.
`"auto"` walks the kernels of its platform in that order and takes the first that
does not refuse, else the pure-JAX path; an explicit choice raises the path's refusal
as a ValueError. Nothing outside a path's own module spells its name.

The platform `"auto"` chooses for is the one the computation is lowered for, not the
process's default backend: `choose` walks the chain of every lowering platform
(`LOWERING_PLATFORMS`, each chain with that platform's refusals) and `run` stages one
branch per distinct choice with `jax.lax.platform_dependent`, which keeps only the
branch of the platform it is lowered for. So `jax.export(..., platforms=["cuda"])` or
`["tpu"]` on a CPU holds the compiled kernel, while the same jitted function run on a
CPU runs the pure-JAX path; interpret mode belongs to kernels named explicitly. Calls
every kernel refuses stage no branches; eager calls run only their own branch. A path
that reads the device while it is traced says so in its `lowers` (jax.nn's cuDNN call
reads the GPU: the `"cuda"` branch takes it only when the default backend is a CUDA
GPU). Under `jit` every distinct branch is traced but only the lowering platform's is
compiled, so `jvp` of a jitted `"auto"` call works wherever its own branch supports it
(on a CPU: always); a kernel branch is one cached jitted function (`_kernel_branch`),
traced once per shapes and configuration. jax lowers each kept branch for every
platform of an export, and a compiled Pallas kernel has no lowering off its platform:
export one platform at a time.

Every path then runs between the same steps of `jax_mha._softmax`: `sanitize` and
`sanitize_description` (non-finite entries replaced, the rows that see them marked) and `finish`
(those rows NaN, the empty-row policy, zeros past `q_lengths`), so every path isolates
NaNs the same way.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_mha import _masking, _path, _softmax
from jax_mha.paths import (
    blockwise,
    cudnn,
    dense,
    pallas_gpu,
    pallas_gpu_decode,
    pallas_mgpu,
    pallas_tpu,
    pallas_tpu_decode,
)
from jax_mha.paths.dense import WHOLE_SCORES_MAX_BYTES, whole_scores_fit

# Every path, in "auto"'s order: the pure-JAX paths, then each platform's kernels.
for _registered in (dense.PATH, blockwise.PATH, cudnn.PATH,
                    dataclasses.replace(pallas_tpu.PATH, decode=pallas_tpu_decode.DECODE),
                    dataclasses.replace(pallas_gpu.PATH, decode=pallas_gpu_decode.DECODE),
                    pallas_mgpu.PATH):
    _path.register(_registered)
REGISTRY = _path.REGISTRY
PATHS = tuple(REGISTRY)
IMPLEMENTATIONS = PATHS + ("auto",)
# The lowering platforms (`jax.lax.platform_dependent`'s names) `"auto"` stages a branch
# for, each with the platform (`Call.platform`) whose kernels it tries; any other gets
# the pure-JAX path.
LOWERING_PLATFORMS = {"cpu": "cpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}


def auto_chain(platform: str) -> tuple[str, ...]:
    """The kernels `"auto"` tries on `platform` (`"gpu"`, `"tpu"`), in order."""
    return tuple(p.name for p in REGISTRY.values() if p.auto and platform in p.platforms)


def platform() -> str:
    """`"cpu"`, `"gpu"` or `"tpu"`: the default backend's platform."""
    backend = jax.default_backend()
    return "gpu" if backend in ("cuda", "rocm") else backend


def refusal(path: str, vis: _masking.Visibility, call: _masking.Call) -> str | None:
    """Why `path` cannot run this call, or None: the registered path's `refusal`."""
    return REGISTRY[path].refusal(vis, call)


class AutoChoice(str):
    """`"auto"`'s choice: the string is the path taken on the call's own platform
    (`Call.platform`, what `resolve_implementation` and the tables report), and
    `per_platform` maps each key of `LOWERING_PLATFORMS`, and None for any other
    platform, to the path taken when the computation is lowered for it (`run`)."""

    def __new__(cls, path: str, per_platform: dict):
        choice = super().__new__(cls, path)
        choice.per_platform = dict(per_platform)
        return choice


def lowering_chain(lowering: str) -> tuple[str, ...]:
    """The kernels `"auto"` tries, in order, when lowering for `lowering` (`"cuda"`,
    `"tpu"`, ...): its platform's chain, less the paths this host cannot lower for it
    (`Path.lowers`)."""
    chain = auto_chain(LOWERING_PLATFORMS.get(lowering, ""))
    return tuple(name for name in chain if REGISTRY[name].lowers is None or REGISTRY[name].lowers(lowering))


def _named(name: str, vis: _masking.Visibility, call: _masking.Call) -> str:
    """An explicitly chosen path; a kernel interpreted on this CPU as an `AutoChoice`:
    interpreted in the CPU branch only, compiled in the branches of its own platforms
    that it takes compiled, so an export for them holds the kernel, not its emulation;
    any other platform gets the pure-JAX path."""
    path = REGISTRY[name]
    if not (path.interprets and call.platform == "cpu"):
        return name
    pure = pure_path(vis, call)
    takes = lambda home: home == "cpu" or (
        home in path.platforms and path.refusal(vis, call._replace(platform=home)) is None)
    per_platform = {lowering: name if takes(home) else pure for lowering, home in LOWERING_PLATFORMS.items()}
    return AutoChoice(name, {**per_platform, None: pure})


def _first_taker(vis: _masking.Visibility, call: _masking.Call, chain) -> str:
    """The first path of `chain` that `"auto"` may take, else the pure-JAX path:
    the first registered one that takes the whole call, the engine once the whole
    scores would not fit."""
    for name in chain:
        if REGISTRY[name].auto_refusal(vis, call) is None:
            return name
    pure = [p for p in REGISTRY.values() if not p.platforms and p.refusal(vis, call) is None]
    if call.return_weights or call.dropout or whole_scores_fit(call.q, call.k):
        return pure[0].name
    return pure[-1].name


def pure_path(vis: _masking.Visibility, call: _masking.Call) -> str:
    """The pure-JAX path `"auto"` falls back to for this call."""
    return _first_taker(vis, call, ())


def choose(vis: _masking.Visibility, call: _masking.Call, implementation: str | None) -> str:
    """The path for this call: `implementation`, or for `"auto"`/None an `AutoChoice`:
    the first of the platform's kernels that does not refuse, else `"xla"` while the
    whole scores fit (or the weights or dropout are needed) and `"blockwise"` beyond,
    with that choice made again for every lowering platform.

    Raises:
      ValueError: for an unknown name, or the refusal of an explicitly chosen path.
    """
    if implementation is None:
        implementation = "auto"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
    if implementation != "auto":
        why = refusal(implementation, vis, call)
        if why is not None:
            raise ValueError(why)
        return _named(implementation, vis, call)
    per_platform = {lowering: _first_taker(vis, call._replace(platform=home), lowering_chain(lowering))
                    for lowering, home in LOWERING_PLATFORMS.items()}
    per_platform[None] = _first_taker(vis, call, ())
    return AutoChoice(_first_taker(vis, call, auto_chain(call.platform)), per_platform)


def _run_auto(choice: AutoChoice, q, k, v, bad_kv, vis, call, **options):
    """`_run_path` of `choice`'s path for the platform the computation is lowered for:
    one `jax.lax.platform_dependent` branch per distinct path (a kernel's branch sees
    `Call.platform` of its own platform, so it runs compiled, never interpreted)."""
    paths = dict(choice.per_platform)
    homes = {lowering: LOWERING_PLATFORMS.get(lowering, call.platform) if REGISTRY[path].platforms else None
             for lowering, path in paths.items()}
    if len({(paths[x], homes[x]) for x in paths}) == 1:  # one branch for all: nothing to stage per platform
        return _run_path(str(paths[None]), q, k, v, bad_kv, vis, call, **options)
    dtype = _masking.compute_dtype(q.dtype)

    def branch(path, home):
        def run_branch(q, k, v, bad_kv):
            if not REGISTRY[path].platforms:
                out, weights, lse, empty, touched = _run_path(path, q, k, v, bad_kv, vis, call, **options)
            else:
                arrays, static = _split_static(vis)
                out, weights, lse, empty, touched = _kernel_branch(
                    q, k, v, bad_kv, arrays, path=path, call=_static_call(call, home), static=static,
                    scale=options["scale"])
            rows = out.shape[:-1]  # (B…, H, N): every branch returns the same types
            return (out.astype(dtype), weights if call.return_weights else None,
                    lse if call.return_residual else None, jnp.broadcast_to(empty, rows),
                    jnp.broadcast_to(touched, rows))
        return run_branch

    branches, per_platform = {}, {}
    for lowering, path in paths.items():
        key = (path, homes[lowering])  # one pure-JAX branch for all
        per_platform[lowering] = branches.setdefault(key, branch(path, homes[lowering] or call.platform))
    default = per_platform.pop(None)
    return jax.lax.platform_dependent(q, k, v, bad_kv, default=default, **per_platform)


def _split_static(tree):
    """`(arrays, static)`: the array leaves of `tree` (a description) and the rest,
    hashable: its treedef and its scalars known now, as Python numbers (a query offset
    the kernel's refusal read as static stays static inside the jitted branch)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    known = lambda x: not isinstance(x, jax.core.Tracer) and np.ndim(x) == 0
    is_array = tuple(not known(x) for x in leaves)
    static = tuple(None if array else np.asarray(x).item() for array, x in zip(is_array, leaves))
    return [x for array, x in zip(is_array, leaves) if array], (treedef, is_array, static)


def _join_static(arrays, static):
    """The tree `_split_static` took apart."""
    treedef, is_array, scalars = static
    arrays = iter(arrays)
    return treedef.unflatten([next(arrays) if array else x for array, x in zip(is_array, scalars)])


def _static_call(call: _masking.Call, platform: str) -> _masking.Call:
    """`call` on `platform`, hashable: shape structs in place of its arrays."""
    struct = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    return call._replace(q=struct(call.q), k=struct(call.k), v=struct(call.v), platform=platform)


@functools.partial(jax.jit, static_argnames=("path", "call", "static", "scale"))
def _kernel_branch(q, k, v, bad_kv, arrays, *, path, call, static, scale):
    """A kernel path's `_run_path` as one jitted function of its arrays: traced once
    per shapes and configuration, and its derivatives with it, however many `"auto"`
    calls stage it (every layer of a model, every new `jit` of the same step)."""
    return _run_path(path, q, k, v, bad_kv, _join_static(arrays, static), call, scale=scale, dropout_rate=0.0,
                     dropout_rng=None, blocks=(None, None))


def _run_path(path, q, k, v, bad_kv, vis, call, *, scale, dropout_rate, dropout_rng, blocks):
    """`(out, weights or None, lse or None, empty, touched)` from the chosen path, on
    finite inputs (`Path.run`); an `AutoChoice` runs the path of the platform it is
    lowered for (`_run_auto`)."""
    if isinstance(path, AutoChoice):
        return _run_auto(path, q, k, v, bad_kv, vis, call, scale=scale, dropout_rate=dropout_rate,
                         dropout_rng=dropout_rng, blocks=blocks)
    chosen = REGISTRY[path].pick(vis, call)
    return chosen.run(q, k, v, bad_kv, vis, call, scale=scale, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                      blocks=blocks)


def run(path, q, k, v, vis, call, *, scale, dropout_rate=0.0, dropout_rng=None, blocks=(None, None),
        empty_rows="zero"):
    """`path` on `q (B…, H, N, D)`, `k (B…, K, S, D)`, `v (B…, K, S, Dv)` between
    `_softmax.sanitize` and `_softmax.finish`.

    Returns:
      `out (B…, H, N, Dv)` in q's dtype; with `call.return_weights` also the weights
      `(B…, H, N, S)`, with `call.return_residual` also `lse (B…, H, N)` float32, in
      that order: `out`, `(out, weights)`, `(out, lse)` or `(out, weights, lse)`.
    """
    dtype = q.dtype
    batch = jnp.broadcast_shapes(q.shape[:-3], k.shape[:-3])
    vis, bad_heads = _softmax.sanitize_description(vis)
    if q.shape[-2] == 0 or k.shape[-2] == 0 or 0 in batch:
        return _result(call, *_without_keys(q, k, v, vis, call, bad_heads, dtype))
    q, k, v, bad_q, bad_kv = _softmax.sanitize(q, k, v)
    out, weights, lse, empty, touched = _run_path(path, q, k, v, bad_kv, vis, call, scale=scale,
                                                  dropout_rate=dropout_rate, dropout_rng=dropout_rng, blocks=blocks)
    poisoned = _softmax.poisoned_rows(touched, bad_q, empty, bad_heads)
    out, weights = _softmax.finish(out, weights, empty, poisoned, v, bad_kv, vis, empty_rows)
    if lse is not None:
        lse = _softmax.finish_lse(lse, poisoned, vis.q_lengths, q.shape[-2])
    return _result(call, out.astype(dtype), None if weights is None else weights.astype(dtype), lse)


def _without_keys(q, k, v, vis, call, bad_heads, dtype):
    """`(out, weights, lse)` for N == 0, S == 0 or an empty batch: zeros under either
    empty-row policy; each row closed as the description says (`_softmax.close_lse`:
    with a sink, the sink alone), NaN where that is not finite."""
    out, weights, lse = _softmax.empty_attention(q, k, v, call.return_weights, dtype)
    rows = jnp.zeros(lse.shape, bool)
    poisoned = _softmax.poisoned_rows(rows, rows, rows, bad_heads)
    out, weights = _softmax.finish(out, weights, rows, poisoned, v, jnp.zeros(k.shape[:-1], bool), vis, "zero")
    return out, weights, _softmax.finish_lse(_softmax.close_lse(lse, vis), poisoned, vis.q_lengths, q.shape[-2])


def _result(call, out, weights, lse):
    parts = (out,) + ((weights,) if call.return_weights else ()) + ((lse,) if call.return_residual else ())
    return parts[0] if len(parts) == 1 else parts


__all__ = ["IMPLEMENTATIONS", "PATHS", "REGISTRY", "WHOLE_SCORES_MAX_BYTES", "choose", "run", "whole_scores_fit"]
