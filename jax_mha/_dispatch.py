"""Which path runs a call, and what every path's output goes through.

The paths, each with its one `refusal(vis, call) -> str | None` beside it:

  "xla"         whole scores (`_dense`), or the blockwise engine once they would pass
                `WHOLE_SCORES_MAX_BYTES`; refuses nothing: the path of last resort
  "blockwise"   the engine in blocks (`blockwise`, `_flash`)
  "cudnn"       jax.nn's fused GPU kernel (`_cudnn`)
  "pallas_tpu"  splash attention (`_pallas_tpu`; decoding steps on the paged-attention
                kernel: `_pallas_tpu_decode`); "pallas_gpu" Triton (`_pallas_gpu`, decoding
                steps on its decode kernel: `_pallas_gpu_decode`)
  "pallas_mgpu" the Hopper FlashAttention-3 kernel (`_pallas_mgpu`), named only

`"auto"` walks the chain of its platform (`AUTO_CHAIN`) and takes the first kernel
that does not refuse, else the pure-JAX path; an explicit choice raises the path's
refusal as a ValueError.

The platform `"auto"` chooses for is the one the computation is lowered for, not the
process's default backend: `choose` walks the chain of every lowering platform
(`LOWERING_PLATFORMS`, each chain with that platform's refusals) and `run` stages one
branch per distinct choice with `jax.lax.platform_dependent`, which keeps only the
branch of the platform it is lowered for. So `jax.export(..., platforms=["cuda"])` or
`["tpu"]` on a CPU holds the compiled kernel, while the same jitted function run on a
CPU runs the pure-JAX path; interpret mode belongs to kernels named explicitly. Calls
every kernel refuses stage no branches; eager calls run only their own branch.
cuDNN is the exception: jax.nn's cuDNN call reads the installed cuDNN version and the
GPU's compute capability while it is traced, so the `"cuda"` branch takes cuDNN only
when the process's default backend is a CUDA GPU; lowered for CUDA from any other
host it holds the Triton kernel (or the pure-JAX path) instead. Under `jit` every
distinct branch is traced but only the lowering platform's is compiled, so `jvp` of a
jitted `"auto"` call works wherever its own branch supports it (on a CPU: always); a
kernel branch is one cached jitted function (`_kernel_branch`), traced once per shapes
and configuration. jax lowers each kept branch for every platform of an export, and a
compiled Pallas kernel has no lowering off its platform: export one platform at a time.

Every path then runs between the same two steps: `sanitize`
(non-finite entries replaced, the rows that see them marked) and `finish` (those rows
NaN, the empty-row policy, zeros past `q_lengths`), so every path isolates NaNs the
same way.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_mha import _cudnn, _masking, blockwise
from jax_mha._dense import dense_attention

PATHS = ("xla", "blockwise", "cudnn", "pallas_tpu", "pallas_gpu", "pallas_mgpu")
IMPLEMENTATIONS = PATHS + ("auto",)
# The kernels "auto" tries, in order, on each platform; the pure-JAX path comes last.
AUTO_CHAIN = {"tpu": ("pallas_tpu",), "gpu": ("cudnn", "pallas_gpu"), "cpu": ()}
# The module behind a Pallas path, where it is not `_<path>`.
MODULES = {"pallas_gpu": "pallas_gpu_decode", "pallas_tpu": "pallas_tpu_decode"}
# The lowering platforms (`jax.lax.platform_dependent`'s names) `"auto"` stages a branch
# for, each with the `AUTO_CHAIN` key (and `Call.platform`) it reads; any other gets
# the pure-JAX path.
LOWERING_PLATFORMS = {"cpu": "cpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}

# The "xla" path builds the whole float32 scores `(B…, H, N, S)` up to this many bytes
# and runs the blockwise engine beyond (measurements: docs/performance.md).
WHOLE_SCORES_MAX_BYTES = 16 * 2**20


def whole_scores_fit(q, k) -> bool:
    """Whether `"xla"` builds the whole scores for these `q (B…, H, N, D)` and
    `k (B…, K, S, D)` (arrays or shape structs): float32 or float64 inputs whose
    float32 scores take at most `WHOLE_SCORES_MAX_BYTES`. bfloat16 and float16 inputs
    go to the engine, which multiplies them in their own dtype with float32
    accumulation; the whole-scores route computes in float32 throughout."""
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64)):
        return False
    batch = jnp.broadcast_shapes(q.shape[:-3], k.shape[:-3])
    return math.prod(batch + q.shape[-3:-1] + k.shape[-2:-1]) * 4 <= WHOLE_SCORES_MAX_BYTES


def platform() -> str:
    """`"cpu"`, `"gpu"` or `"tpu"`: the default backend's platform."""
    backend = jax.default_backend()
    return "gpu" if backend in ("cuda", "rocm") else backend


def kernel_module(path: str):
    """The translator module of a Pallas path, or None when this jax has no Pallas
    (imported only when asked: it pulls in jax.experimental.pallas)."""
    if importlib.util.find_spec("jax.experimental.pallas") is None:
        return None
    return importlib.import_module(f"jax_mha._{MODULES.get(path, path)}")


def refusal(path: str, vis: _masking.Visibility, call: _masking.Call) -> str | None:
    """Why `path` cannot run this call, or None: each path's own `refusal`."""
    if path == "xla":
        return None
    if path == "blockwise":
        return blockwise.refusal(vis, call)
    if path == "cudnn":
        return _cudnn.refusal(vis, call)
    module = kernel_module(path)
    if module is None:
        return f"implementation={path!r} needs jax.experimental.pallas, which this jax does not have"
    return module.refusal(vis, call)


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
    `"tpu"`, ...): its `AUTO_CHAIN`, with cuDNN only for CUDA and only when the default
    device is a CUDA GPU (jax.nn's cuDNN call reads the cuDNN version and the GPU
    while it is traced). `jax.default_backend()` names a CUDA GPU `"gpu"`, like a
    ROCm one: `_cudnn.this_gpu` tells them apart."""
    chain = AUTO_CHAIN.get(LOWERING_PLATFORMS.get(lowering, ""), ())
    if lowering != "cuda" or (_cudnn.this_gpu() or ("",))[0] != "cuda":
        chain = tuple(path for path in chain if path != "cudnn")
    return chain


def _first_taker(vis: _masking.Visibility, call: _masking.Call, chain) -> str:
    """The first path of `chain` that does not refuse, else the pure-JAX path."""
    for path in chain:
        if refusal(path, vis, call) is None:
            return path
    if call.return_weights or call.dropout or whole_scores_fit(call.q, call.k):
        return "xla"
    return "blockwise"


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
        return implementation
    per_platform = {lowering: _first_taker(vis, call._replace(platform=home), lowering_chain(lowering))
                    for lowering, home in LOWERING_PLATFORMS.items()}
    per_platform[None] = _first_taker(vis, call, ())
    return AutoChoice(_first_taker(vis, call, AUTO_CHAIN.get(call.platform, ())), per_platform)


def sanitize(q, k, v):
    """Zeroes non-finite entries so no matmul ever multiplies 0 by NaN or inf.

    Returns:
      `(q, k, v, bad_q (B…, H, N), bad_kv (B…, K, S))`: the finite arrays, the query
      rows with a non-finite entry and the keys whose key or value has one. A row
      that may see a bad key, or whose query is bad, is set to NaN by `finish`; every
      other row is exactly what it would be without them.
    """
    finite = [jnp.isfinite(x) for x in (q, k, v)]
    clean = [jnp.where(ok, x, jnp.zeros((), x.dtype)) for ok, x in zip(finite, (q, k, v))]
    bad_q = ~jnp.all(finite[0], axis=-1)
    bad_kv = ~(jnp.all(finite[1], axis=-1) & jnp.all(finite[2], axis=-1))
    return (*clean, bad_q, bad_kv)


def finish(out, weights, empty, poisoned, v, bad_kv, q_lengths, empty_rows):
    """The empty-row policy, NaN for poisoned rows, zeros past `q_lengths` (int32
    `(B…|1, 1, 1, 1)`, the description's, or None).

    Args:
      out: `(B…, H, N, Dv)`; weights: `(B…, H, N, S)` or None; empty, poisoned: bool
      `(B…, H, N)`; v: `(B…, K, S, Dv)` (finite); bad_kv: bool `(B…, K, S)`.
    """
    *batch, h, n, _ = out.shape
    s = v.shape[-2]
    poisoned = poisoned & ~empty
    if empty_rows == "uniform" and s:
        groups = h // v.shape[-3]
        mean_v = jnp.repeat(jnp.mean(v.astype(out.dtype), axis=-2, keepdims=True), groups, axis=-3)
        out = jnp.where(empty[..., None], mean_v, out)  # (B…, H, N, Dv)
        if weights is not None:
            weights = jnp.where(empty[..., None], jnp.asarray(1.0 / s, weights.dtype), weights)
        # A uniform row averages every key and value, the non-finite ones too.
        head_bad = jnp.repeat(jnp.any(bad_kv, axis=-1), groups, axis=-1)[..., None]  # (B…, H, 1)
        poisoned = poisoned | (empty & head_bad)
    # A poisoned row is a constant NaN: gradients flow only through the clean rows.
    poisoned = poisoned[..., None]
    out = jnp.where(poisoned, jnp.nan, out)
    if weights is not None:
        weights = jnp.where(poisoned, jnp.nan, weights)
    if q_lengths is not None:
        lengths = q_lengths[..., 0]  # (B…|1, 1, 1)
        row_ok = jax.lax.broadcast_to_rank(jnp.arange(n), lengths.ndim) < lengths  # (B…, 1, N)
        out = jnp.where(row_ok[..., None], out, 0.0)
        if weights is not None:
            weights = jnp.where(row_ok[..., None], weights, 0.0)
    return out, weights


def _zeros(q, k, v, return_weights):
    """`(out, weights, lse)` for N == 0, S == 0 or an empty batch."""
    batch = jnp.broadcast_shapes(q.shape[:-3], k.shape[:-3])
    out = jnp.zeros(batch + q.shape[-3:-1] + v.shape[-1:], _masking.compute_dtype(q.dtype))
    weights = jnp.zeros(batch + q.shape[-3:-1] + (k.shape[-2],), out.dtype) if return_weights else None
    return out, weights, jnp.full(out.shape[:-1], -jnp.inf, jnp.float32)


def _run_auto(choice: AutoChoice, q, k, v, bad_kv, vis, call, **options):
    """`_run_path` of `choice`'s path for the platform the computation is lowered for:
    one `jax.lax.platform_dependent` branch per distinct path (a kernel's branch sees
    `Call.platform` of its own platform, so it runs compiled, never interpreted)."""
    paths = dict(choice.per_platform)
    if len(set(paths.values())) == 1:  # every kernel refused: nothing to stage per platform
        return _run_path(paths[None], q, k, v, bad_kv, vis, call, **options)
    dtype = _masking.compute_dtype(q.dtype)

    def branch(path, home):
        def run_branch(q, k, v, bad_kv):
            if path in ("xla", "blockwise"):
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
        home = LOWERING_PLATFORMS.get(lowering, call.platform)
        key = (path, home) if path not in ("xla", "blockwise") else (path, None)  # one pure-JAX branch for all
        per_platform[lowering] = branches.setdefault(key, branch(path, home))
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
    finite inputs; lse (when the call asks for it) -inf on rows with nothing to see.
    An `AutoChoice` runs the path of the platform it is lowered for (`_run_auto`)."""
    if isinstance(path, AutoChoice):
        return _run_auto(path, q, k, v, bad_kv, vis, call, scale=scale, dropout_rate=dropout_rate,
                         dropout_rng=dropout_rng, blocks=blocks)
    if call.return_weights or call.dropout or (path == "xla" and whole_scores_fit(q, k)):
        out, weights, lse, empty, touched = dense_attention(
            q, k, v, bad_kv, vis, scale=scale, dropout_rate=dropout_rate if call.dropout else 0.0,
            dropout_rng=dropout_rng, return_lse=call.return_residual)
        return out, weights if call.return_weights else None, lse, empty, touched
    if path in ("cudnn", "pallas_tpu", "pallas_gpu", "pallas_mgpu"):
        # The kernels are jax's code, written for standard promotion: a user's strict
        # setting (`jax.numpy_dtype_promotion("strict")`) is for their own arithmetic.
        with jax.numpy_dtype_promotion("standard"):
            if path == "cudnn":
                out = _cudnn.cudnn_attention(q, k, v, vis, scale=scale)
            else:
                interpret = call.platform == "cpu"  # a kernel runs on its own platform or interpreted
                out = kernel_module(path).run(q, k, v, vis, scale=scale, interpret=interpret)
        empty, touched = _masking.dense_rows(vis, bad_kv, q.shape[-3])
        out = jnp.where(empty[..., None], 0.0, out.astype(_masking.compute_dtype(q.dtype)))  # kernels average v there
        return out, None, None, empty, touched
    q_block, k_block = blocks if path == "blockwise" else (None, None)  # "xla" past the limit: default blocks
    out, lse, touched = blockwise.run_blockwise(q, k, v, vis, query_block_size=q_block, key_block_size=k_block,
                                                scale=scale, bad_kv=bad_kv)
    empty = lse == jnp.inf  # the engine's mark of a row with no visible key
    out, lse = with_sinks(out, jnp.where(empty, -jnp.inf, lse), vis.sinks)
    return out, None, lse, empty, touched


def with_sinks(out, lse, sinks):
    """Attention over the real keys `(out (B…, H, N, Dv), lse (B…, H, N))` merged with
    each head's sink, a key of logit `sinks[h]` and value zero (`merge_attentions`
    with a zero part): out shrinks by the sink's share, lse gains its term.
    Differentiable in all three; `sinks` None returns the inputs."""
    if sinks is None:
        return out, lse
    sink = jnp.broadcast_to(jax.lax.broadcast_to_rank(sinks.astype(lse.dtype)[:, None], lse.ndim), lse.shape)
    merged = jnp.logaddexp(lse, sink)
    return out * jnp.exp(lse - merged)[..., None].astype(out.dtype), merged


def _finish_lse(lse, poisoned, q_lengths, n):
    """The log-sum-exp, float32: NaN on poisoned rows, -inf past `q_lengths`."""
    lse = jnp.where(poisoned, jnp.nan, lse.astype(jnp.float32))
    if q_lengths is not None:
        lengths = q_lengths[..., 0]  # (B…|1, 1, 1)
        lse = jnp.where(jax.lax.broadcast_to_rank(jnp.arange(n), lengths.ndim) < lengths, lse, -jnp.inf)
    return lse


def run(path, q, k, v, vis, call, *, scale, dropout_rate=0.0, dropout_rng=None, blocks=(None, None),
        empty_rows="zero"):
    """`path` on `q (B…, H, N, D)`, `k (B…, K, S, D)`, `v (B…, K, S, Dv)` between
    `sanitize` and `finish`.

    Returns:
      `out (B…, H, N, Dv)` in q's dtype; with `call.return_weights` also the weights
      `(B…, H, N, S)`, with `call.return_residual` also `lse (B…, H, N)` float32, in
      that order: `out`, `(out, weights)`, `(out, lse)` or `(out, weights, lse)`.
    """
    dtype = q.dtype
    batch = jnp.broadcast_shapes(q.shape[:-3], k.shape[:-3])
    if q.shape[-2] == 0 or k.shape[-2] == 0 or 0 in batch:  # zeros under either empty-row policy
        out, weights, lse = _zeros(q, k, v, call.return_weights)
        return _result(call, out.astype(dtype), weights, lse)
    q, k, v, bad_q, bad_kv = sanitize(q, k, v)
    out, weights, lse, empty, touched = _run_path(path, q, k, v, bad_kv, vis, call, scale=scale,
                                                  dropout_rate=dropout_rate, dropout_rng=dropout_rng, blocks=blocks)
    poisoned = touched | bad_q
    out, weights = finish(out, weights, empty, poisoned, v, bad_kv, vis.q_lengths, empty_rows)
    if lse is not None:
        lse = _finish_lse(lse, poisoned & ~empty, vis.q_lengths, q.shape[-2])
    return _result(call, out.astype(dtype), None if weights is None else weights.astype(dtype), lse)


def _result(call, out, weights, lse):
    parts = (out,) + ((weights,) if call.return_weights else ()) + ((lse,) if call.return_residual else ())
    return parts[0] if len(parts) == 1 else parts
