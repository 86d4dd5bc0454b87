"""Which path runs a call, and what every path's output goes through.

The paths, each with its one `refusal(vis, call) -> str | None` beside it:

  "xla"         whole scores (`_dense`), or the blockwise engine once they would pass
                `WHOLE_SCORES_MAX_BYTES`; refuses nothing: the path of last resort
  "blockwise"   the engine in blocks (`blockwise`, `_flash`)
  "cudnn"       jax.nn's fused GPU kernel (`_cudnn`)
  "pallas_tpu"  splash attention (`_pallas_tpu`); "pallas_gpu" Triton (`_pallas_gpu`)

`"auto"` walks the chain of its platform (`AUTO_CHAIN`) and takes the first kernel
that does not refuse, else the pure-JAX path; an explicit choice raises the path's
refusal as a ValueError. Every path then runs between the same two steps: `sanitize`
(non-finite entries replaced, the rows that see them marked) and `finish` (those rows
NaN, the empty-row policy, zeros past `q_lengths`), so every path isolates NaNs the
same way.
"""

from __future__ import annotations

import importlib
import importlib.util
import math

import jax
import jax.numpy as jnp

from jax_mha import _cudnn, _masking, blockwise
from jax_mha._dense import dense_attention

PATHS = ("xla", "blockwise", "cudnn", "pallas_tpu", "pallas_gpu")
IMPLEMENTATIONS = PATHS + ("auto",)
# The kernels "auto" tries, in order, on each platform; the pure-JAX path comes last.
AUTO_CHAIN = {"tpu": ("pallas_tpu",), "gpu": ("cudnn", "pallas_gpu"), "cpu": ()}

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
    return importlib.import_module(f"jax_mha._{path}")


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


def choose(vis: _masking.Visibility, call: _masking.Call, implementation: str | None) -> str:
    """The path for this call: `implementation`, or for `"auto"`/None the first of
    the platform's kernels that does not refuse, else `"xla"` while the whole scores
    fit (or the weights or dropout are needed) and `"blockwise"` beyond.

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
    for path in AUTO_CHAIN.get(call.platform, ()):
        if refusal(path, vis, call) is None:
            return path
    if call.return_weights or call.dropout or whole_scores_fit(call.q, call.k):
        return "xla"
    return "blockwise"


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


def _run_path(path, q, k, v, bad_kv, vis, call, *, scale, dropout_rate, dropout_rng, blocks):
    """`(out, weights or None, lse or None, empty, touched)` from the chosen path, on
    finite inputs; lse (when the call asks for it) -inf on rows with nothing to see."""
    if call.return_weights or call.dropout or (path == "xla" and whole_scores_fit(q, k)):
        out, weights, lse, empty, touched = dense_attention(
            q, k, v, bad_kv, vis, scale=scale, dropout_rate=dropout_rate if call.dropout else 0.0,
            dropout_rng=dropout_rng, return_lse=call.return_residual)
        return out, weights if call.return_weights else None, lse, empty, touched
    if path in ("cudnn", "pallas_tpu", "pallas_gpu"):
        if path == "cudnn":
            out = _cudnn.cudnn_attention(q, k, v, vis, scale=scale)
        else:
            interpret = call.platform != path[len("pallas_"):]
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
