"""Pure functional multi-head attention: no parameters, no state, no Flax.

The public layer of the core. Beneath it (each file tested against the one below):

  _dense.py   the plain attention, one screen: the source of truth every path is
                  tested against, and the path that returns the weights (dropout on
                  them is applied here, in `_weights_path`)
  _masking.py     the one description of which (query, key) pairs may attend
  _flash.py       the tuned engine: query blocks x key blocks, online softmax, one
                  custom JVP whose transpose is the FlashAttention-2 backward
  blockwise.py    "blockwise": the engine in blocks (memory linear in N); also "xla"
                  once the whole scores would be too big (`WHOLE_SCORES_MAX_BYTES`)
  _cudnn.py       "cudnn": the description translated for jax.nn's cuDNN kernel

Axis letters used in shapes and einsum strings:
  B… any leading batch dims, N query length, S key/value length,
  H query heads, K key/value heads (H % K == 0), G = H // K heads per group,
  D head dim.

Every function here is safe under jit, vmap, grad, vjp, jvp, jacfwd and hessian,
except the vendor-kernel paths of `attention`: `"cudnn"` (and the Pallas kernels,
as their translators document) have a custom VJP only, so reverse mode (`grad`,
`vjp`) but no `jvp`/`jacfwd`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import operator

import jax
import jax.numpy as jnp

from jax_mha import _masking
from jax_mha._cudnn import cudnn_attention, cudnn_problem
from jax_mha._dense import mix, reference_weights
from jax_mha.blockwise import run_blockwise

IMPLEMENTATIONS = ("xla", "blockwise", "cudnn", "pallas_tpu", "pallas_gpu", "auto")
EMPTY_ROWS = ("zero", "uniform")

# The "xla" path builds the whole float32 scores `(B…, H, N, S)` (the reference, plain
# autodiff: what jax.nn's "xla" does) up to this many bytes, and beyond runs the
# blockwise engine. Forward+backward on a 2-core CPU, whole vs engine, ms, of the core
# at (B, H, N, D) = (64, 8, 34, 32) causal (2.4 MB, the copy task): 8.4 vs 22.8;
# (8, 8, 128, 32): 11.5 vs 16.7; (4, 4, 512, 128) (16 MiB): 66 vs 80; (1, 8, 2048, 64)
# (128 MiB): 383 vs 288. At 32 MiB, (4, 8, 512, 64), the two were within noise of each
# other for the core and the engine was faster in the layer (186 vs 176 ms, one run).
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


class DTypeError(TypeError, ValueError):
    """An input of the wrong dtype (a TypeError; also a ValueError, which the first
    release raised for a non-boolean mask)."""


def _index(name: str, value) -> int:
    """`value` as a Python int, or a TypeError naming it (bools and floats refused)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r}") from None


def split_heads(x: jax.Array, num_heads: int) -> jax.Array:
    """Splits the feature axis into heads.

    Args:
      x: `(B…, N, H*D)`.
      num_heads: H.

    Returns:
      `(B…, H, N, D)`; head `h` is features `h*D:(h+1)*D` of `x`.

    Raises:
      ValueError: if `x` has rank < 2 or its last dim is not divisible by `num_heads`.
    """
    num_heads = _index("num_heads", num_heads)
    if not hasattr(x, "ndim") or not hasattr(x, "reshape"):
        raise TypeError(f"split_heads expects an array (B…, N, H*D), got {type(x).__name__}")
    if x.ndim < 2:
        raise ValueError(f"split_heads expects (B…, N, H*D), got rank {x.ndim} shape {x.shape}")
    if num_heads < 1 or x.shape[-1] % num_heads:
        raise ValueError(
            f"last dim {x.shape[-1]} of x (shape {x.shape}) is not divisible by "
            f"num_heads={num_heads}"
        )
    *lead, n, features = x.shape
    x = x.reshape(*lead, n, num_heads, features // num_heads)  # (B…, N, H, D)
    return jnp.swapaxes(x, -3, -2)  # (B…, H, N, D)


def combine_heads(x: jax.Array) -> jax.Array:
    """Concatenates heads back into features: the inverse of `split_heads`.

    Args:
      x: `(B…, H, N, D)`.

    Returns:
      `(B…, N, H*D)`.

    Raises:
      ValueError: if `x` has rank < 3.
    """
    if not hasattr(x, "ndim") or not hasattr(x, "reshape"):
        raise TypeError(f"combine_heads expects an array (B…, H, N, D), got {type(x).__name__}")
    if x.ndim < 3:
        raise ValueError(f"combine_heads expects (B…, H, N, D), got rank {x.ndim} shape {x.shape}")
    *lead, h, n, d = x.shape
    return jnp.swapaxes(x, -3, -2).reshape(*lead, n, h * d)  # (B…, N, H*D)


def causal_mask(n: int, s: int | None = None) -> jax.Array:
    """Boolean causal mask, True where the query may attend.

    Args:
      n: number of queries N.
      s: number of keys S (defaults to `n`). When `s > n` the queries are the last
        `n` positions of the key sequence (decoding with a cache).

    Returns:
      bool `(n, s)`: `mask[i, j] = j <= i + (s - n)`.

    Raises:
      TypeError: if a size is not an int. ValueError: if a size is negative.
    """
    n = _index("causal_mask n", n)
    s = n if s is None else _index("causal_mask s", s)
    if n < 0 or s < 0:
        raise ValueError(f"causal_mask needs non-negative sizes, got n={n}, s={s}")
    return jnp.arange(s)[None, :] <= jnp.arange(n)[:, None] + (s - n)


def padding_mask(valid: jax.Array) -> jax.Array:
    """Turns per-key validity into an attention mask.

    Args:
      valid: bool `(B, S)`, True for real (non-padding) keys.

    Returns:
      bool `(B, 1, 1, S)`, broadcastable against `(B, H, N, S)`.

    Raises:
      ValueError: if `valid` is not rank 2.
    """
    valid = jnp.asarray(valid)
    if valid.ndim != 2:
        raise ValueError(f"padding_mask expects valid of shape (B, S), got {valid.shape}")
    if not (valid.dtype == jnp.bool_ or jnp.issubdtype(valid.dtype, jnp.integer)):
        raise DTypeError(f"padding_mask expects bool (or 0/1 integer) valid, got dtype {valid.dtype}")
    return valid.astype(bool)[:, None, None, :]


def lengths_mask(kv_lengths: jax.Array, s: int) -> jax.Array:
    """Padding mask from per-sequence valid key counts.

    Args:
      kv_lengths: int `(B…)`, number of valid keys of each sequence.
      s: S, the padded key length.

    Returns:
      bool `(B…, 1, 1, S)`, True for keys at positions `< kv_lengths`.

    Raises:
      TypeError: if `kv_lengths` is not integer or `s` not an int.
      ValueError: if `s` is negative.
    """
    s = _index("lengths_mask s", s)
    if s < 0:
        raise ValueError(f"lengths_mask needs a non-negative key length, got s={s}")
    kv_lengths = _check_lengths("kv_lengths", kv_lengths, None)[..., None, None, None]  # (B…, 1, 1, 1)
    # Explicit ranks: the library runs under jax_numpy_rank_promotion="raise".
    return jax.lax.broadcast_to_rank(jnp.arange(s), kv_lengths.ndim) < kv_lengths



def attention_entropy(weights: jax.Array) -> jax.Array:
    """Entropy of each attention distribution, in nats, with `0·log 0 = 0`.

    Args:
      weights: `(B…, H, N, S)`, rows summing to 1 (or all zero for fully masked rows,
        whose entropy is 0). A NaN weight makes its row's entropy NaN.

    Returns:
      float32 `(B…, H, N)` (float64 for float64 weights).

    Raises:
      TypeError: for non-floating weights.
    """
    weights = jnp.asarray(weights)
    if not jnp.issubdtype(weights.dtype, jnp.floating):
        raise DTypeError(f"attention_entropy expects floating weights, got dtype {weights.dtype}")
    w = weights.astype(_masking.compute_dtype(weights.dtype))
    zero = w == 0
    # The inner where keeps log's gradient finite at w == 0; NaN is not 0, so it stays.
    w_log_w = jnp.where(zero, 0.0, w * jnp.log(jnp.where(zero, 1.0, w)))
    return -jnp.sum(w_log_w, axis=-1)


def rotary_embedding(x: jax.Array, positions: jax.Array, base: float = 10000.0) -> jax.Array:
    """Rotary position embedding (RoPE; Su et al. 2021), rotate-half layout.

    Feature pairs `(x[..., i], x[..., i + D/2])` are rotated by the angle
    `position · base^(-2i/D)` (the pairing of GPT-NeoX, LLaMA and Gemma; the paper
    pairs neighbours `(2i, 2i+1)`, an equivalent permutation of the weights). Applied
    to q and k, their dot product depends only on the position difference.

    Args:
      x: `(B…, heads, N, D)`, D even.
      positions: int or float `(N,)` or `(B…, N)`: the position of each token (e.g.
        offset by the cache index when decoding).
      base: the wavelength base, > 0.

    Returns:
      `(B…, heads, N, D)` in `x`'s dtype; angles and products computed in float32.

    Raises:
      ValueError: for an odd D, a rank < 3 `x`, positions that do not match N, or base <= 0.
      TypeError: for non-floating `x`.
    """
    x = jnp.asarray(x)
    positions = jnp.asarray(positions)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise DTypeError(f"rotary_embedding expects floating x, got dtype {x.dtype}")
    if x.ndim < 3 or x.shape[-1] % 2:
        raise ValueError(f"rotary_embedding expects x of shape (B…, heads, N, D) with D even, got {x.shape}")
    if positions.ndim < 1 or positions.shape[-1] != x.shape[-2] or positions.ndim > x.ndim - 1:
        raise ValueError(f"positions must be (N,) or (B…, N) with N={x.shape[-2]}, got shape {positions.shape}")
    if not base > 0:
        raise ValueError(f"base must be > 0, got {base}")
    half = x.shape[-1] // 2
    dtype = _masking.compute_dtype(x.dtype)
    freq = jnp.asarray(base, dtype) ** (-jnp.arange(half, dtype=dtype) * 2 / x.shape[-1])  # (D/2,)
    angle = positions.astype(dtype)[..., None] * jax.lax.broadcast_to_rank(freq, positions.ndim + 1)  # (B…, N, D/2)
    angle = jax.lax.broadcast_to_rank(angle[..., None, :, :], x.ndim)  # (B…, 1, N, D/2)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :half].astype(dtype), x[..., half:].astype(dtype)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


# ---------------------------------------------------------------------------------
# Input checks of `attention`: one place, the same for every path.
# ---------------------------------------------------------------------------------


def _check_qkv(q, k, v):
    """Dtypes and shapes of q, k, v (one batch shape, as flax and jax.nn); returns it."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise DTypeError(f"{name} must be a real floating-point array, got dtype {x.dtype}")
        if x.ndim < 3:
            raise ValueError(f"{name} must have shape (B…, heads, length, D), got shape {x.shape}")
    if not q.dtype == k.dtype == v.dtype:
        raise DTypeError(f"q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.ndim == k.ndim == v.ndim:
        raise ValueError(f"q, k, v must have the same rank, got shapes {q.shape}, {k.shape}, {v.shape}")
    (h, _, d), (kh, s, dk) = q.shape[-3:], k.shape[-3:]
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"k and v must agree in batch, heads and length: k {k.shape} vs v {v.shape} "
            f"(key length {s}, value length {v.shape[-2]})"
        )
    if dk != d:
        raise ValueError(f"q and k head dims differ: q {q.shape} (D={d}) vs k {k.shape} (D={dk})")
    if q.shape[:-3] != k.shape[:-3]:
        raise ValueError(f"q and k batch dims differ: q {q.shape} vs k {k.shape}")
    if kh < 1 or h % kh:
        raise ValueError(f"num_heads={h} of q is not divisible by num_kv_heads={kh} of k/v")
    return q.shape[:-3]


def _check_pairwise(name: str, x, target: tuple, floating: bool):
    """A mask (bool) or bias (float) broadcastable to the scores `target`, or None."""
    if x is None:
        return None
    x = jnp.asarray(x)
    if floating and not jnp.issubdtype(x.dtype, jnp.floating):
        raise DTypeError(f"{name} must be floating (added to the logits), got dtype {x.dtype}; a boolean "
                         "mask goes in `mask`")
    if not floating and x.dtype != jnp.bool_:
        raise DTypeError(f"{name} must be boolean (True = may attend), got dtype {x.dtype}; "
                         "an additive mask goes in `bias`")
    if x.ndim > len(target) or not _masking.fits(x.shape, target):
        raise ValueError(f"{name} of shape {x.shape} does not broadcast to (B…, H, N, S) = {target}")
    return x


def _check_lengths(name: str, x, batch: tuple | None):
    """Integer lengths broadcastable to the batch dims `batch` (any when None), or None."""
    if x is None:
        return None
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise DTypeError(f"{name} must be integers, got dtype {x.dtype}")
    if batch is not None and (x.ndim > len(batch) or not _masking.fits(x.shape, batch)):
        raise ValueError(f"{name} of shape {x.shape} does not broadcast to the batch dims {batch}")
    return x


def _check_segments(q_ids, kv_ids, batch: tuple, n: int, s: int):
    """`(q ids (B…|…, N), kv ids (B…|…, S))` validated, kv defaulting to q when
    N == S; `(None, None)` when neither is given."""
    if q_ids is None and kv_ids is None:
        return None, None
    if q_ids is None:
        raise ValueError("kv_segment_ids needs q_segment_ids too (a query's segment is not known otherwise)")
    if kv_ids is None:
        if n != s:
            raise ValueError(f"kv_segment_ids defaults to q_segment_ids only for self-attention (N == S); got "
                             f"N={n} queries and S={s} keys: pass kv_segment_ids")
        kv_ids = q_ids
    out = []
    for name, ids, length in (("q_segment_ids", q_ids, n), ("kv_segment_ids", kv_ids, s)):
        ids = jnp.asarray(ids)
        if not jnp.issubdtype(ids.dtype, jnp.integer) or ids.dtype == jnp.bool_:
            raise DTypeError(f"{name} must be integers, got dtype {ids.dtype}")
        if ids.ndim < 1 or ids.shape[-1] != length or ids.ndim - 1 > len(batch) or not _masking.fits(
                ids.shape[:-1], batch[len(batch) - ids.ndim + 1:]):
            letter = "N" if name.startswith("q") else "S"
            raise ValueError(f"{name} of shape {ids.shape} does not broadcast to (B…, {letter}) = {batch + (length,)}")
        out.append(ids)
    return tuple(out)


def _check_mods(score_mod, mask_mod, logits_soft_cap, dtype):
    """The mods, checked once by abstract evaluation on small index arrays (nothing
    runs); returns the soft-cap as a Python float or None.

    Raises:
      TypeError: a non-callable mod, a score_mod not returning the score's dtype, a
        mask_mod not returning bool, a soft-cap that is not a number.
      ValueError: a mod whose result does not have (broadcast to) the score's shape,
        a soft-cap that is not positive and finite.
    """
    dtype = _masking.compute_dtype(dtype)
    shape = (2, 3, 5, 7)  # (batch, head, q, kv): distinct sizes, so a swapped axis shows
    idx = [jax.ShapeDtypeStruct(tuple(d if a == i else 1 for a in range(4)), jnp.int32) for i, d in enumerate(shape)]
    for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be a callable or None, got {type(fn).__name__}")
    if score_mod is not None:
        out = jax.eval_shape(score_mod, jax.ShapeDtypeStruct(shape, dtype), *idx)
        if not hasattr(out, "shape") or out.shape != shape:
            raise ValueError(f"score_mod must return the score's shape (here {shape}), got "
                             f"{getattr(out, 'shape', type(out).__name__)}")
        if out.dtype != dtype:
            raise TypeError(f"score_mod must return the score's dtype {dtype}, got {out.dtype}")
    if mask_mod is not None:
        out = jax.eval_shape(mask_mod, *idx)
        if not hasattr(out, "dtype") or out.dtype != jnp.bool_:
            raise TypeError(f"mask_mod must return booleans (True = may attend), got "
                            f"{getattr(out, 'dtype', type(out).__name__)}")
        if not _masking.fits(out.shape, shape):
            raise ValueError(f"mask_mod's result of shape {out.shape} does not broadcast to the scores {shape}")
    if logits_soft_cap is None:
        return None
    if isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap, (int, float)) and not (
            hasattr(logits_soft_cap, "ndim") and logits_soft_cap.ndim == 0):
        raise TypeError(f"logits_soft_cap must be None or a positive number, got {logits_soft_cap!r}")
    try:
        cap = float(logits_soft_cap)
    except (TypeError, jax.errors.ConcretizationTypeError):
        raise TypeError(f"logits_soft_cap must be a static number (not traced), got {logits_soft_cap!r}") from None
    if not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"logits_soft_cap must be a positive finite number, got {logits_soft_cap!r}")
    return cap


def _check_options(scale, dropout_rate, dropout_rng, deterministic, empty_rows, is_causal, d):
    """The scalar options; returns the scale as a Python float."""
    if empty_rows not in EMPTY_ROWS:
        raise ValueError(f"empty_rows must be one of {EMPTY_ROWS}, got {empty_rows!r}")
    if not isinstance(is_causal, (bool, type(jnp.bool_(True)))):
        raise TypeError(f"is_causal must be a Python bool, got {is_causal!r}")
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
    if dropout_rate > 0.0 and not deterministic and dropout_rng is None:
        raise ValueError(f"dropout_rate={dropout_rate} with deterministic=False needs a dropout_rng key")
    if scale is None:
        return 1.0 / math.sqrt(d) if d else 1.0
    if isinstance(scale, bool):
        raise TypeError(f"scale must be a real number, got {scale!r}")
    try:
        scale = float(scale)
    except (TypeError, jax.errors.ConcretizationTypeError):
        raise TypeError(f"scale must be a static real number (not traced), got {scale!r}") from None
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def _platform() -> str:
    """The default backend's platform, `"cpu"`, `"gpu"` or `"tpu"` (a function so that
    tests can pretend to be on another platform)."""
    return jax.default_backend()


def _kernel_available(path: str) -> bool:
    """Whether the translator module of a Pallas path is present (it lands from its
    own branch; until then "auto" keeps to the paths that exist)."""
    return importlib.util.find_spec(f"jax_mha._{path}") is not None


def resolve_implementation(
    q, k, v, *, implementation: str | None = "auto", return_weights: bool = False, dropout: bool = False,
    unfused: bool = False, cudnn_ok: bool = True,
) -> str:
    """The path `attention` takes for these inputs: `implementation` itself, or for
    `"auto"`/None the fastest valid one by platform: on a TPU `"pallas_tpu"`; on a GPU
    `"cudnn"` when the inputs allow it, else `"pallas_gpu"`; elsewhere, and whenever
    the caller needs the weights, dropout or a part a kernel cannot express (`unfused`),
    `"xla"` while the whole scores fit `WHOLE_SCORES_MAX_BYTES`, else `"blockwise"`.

    Args:
      q, k, v: arrays or `jax.ShapeDtypeStruct`s shaped as for `attention`.
      implementation: as for `attention`.
      return_weights: whether the caller needs the weights (only `"xla"` builds them).
      dropout: whether dropout on the weights is active.
      unfused: whether the description has a part the Pallas kernels refuse (a dense
        mask or bias, a score_mod or mask_mod); "auto" then keeps to the pure-JAX paths.
      cudnn_ok: False when the description has a part cuDNN refuses (score_mod,
        logits_soft_cap).

    Returns:
      One of `IMPLEMENTATIONS` other than `"auto"`.

    Raises:
      ValueError: for an unknown implementation name.
    """
    if implementation is None:
        implementation = "auto"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
    if implementation != "auto":
        return implementation
    platform = _platform()
    plain = not (return_weights or dropout)
    if platform == "gpu" and cudnn_ok and cudnn_problem(q, k, v, dropout, return_weights) is None:
        return "cudnn"
    if plain and not unfused and platform in ("tpu", "gpu") and _kernel_available("pallas_" + platform):
        return "pallas_" + platform
    if plain and not whole_scores_fit(q, k):
        return "blockwise"
    return "xla"


def _kernel_cannot_express(vis: _masking.Visibility, empty_rows: str) -> bool:
    """Whether `"auto"` must keep away from the Pallas kernel of this platform: a
    dense mask or bias, the uniform empty-row policy (neither kernel), and on a GPU
    also a window or lengths (the Triton kernel takes causality and segment ids only)."""
    if vis.mask is not None or vis.bias is not None or empty_rows != "zero":
        return True
    if vis.score_mod is not None or vis.mask_mod is not None:
        return True
    return _platform() == "gpu" and (vis.window is not None or vis.q_lengths is not None
                                     or vis.kv_lengths is not None or vis.logits_soft_cap is not None)


def _cudnn_refusal(vis) -> str | None:
    """The part of the description jax.nn's cuDNN call cannot take, or None. (A
    `mask_mod` it can: evaluated into its dense mask, as segment ids are.)"""
    if vis.score_mod is not None:
        return "implementation='cudnn' cannot express score_mod; use 'xla' or 'blockwise'"
    if vis.logits_soft_cap is not None:
        return "implementation='cudnn' cannot express logits_soft_cap (cuDNN has no soft-cap); use 'xla' or 'blockwise'"
    return None


def _check_path(path, q, k, v, dropout, return_weights, vis=None):
    """Raises ValueError when the chosen path cannot run these inputs."""
    if path == "cudnn" and vis is not None and _cudnn_refusal(vis) is not None:
        raise ValueError(_cudnn_refusal(vis))
    if path == "cudnn":
        problem = cudnn_problem(q, k, v, dropout, return_weights)
        if problem is not None:
            raise ValueError(problem)
    if path == "blockwise" and return_weights:
        raise ValueError("return_weights=True needs implementation='xla': the blockwise path "
                         "exists to never build the (B…, H, N, S) weights")
    if path == "blockwise" and dropout:
        raise ValueError("dropout on the weights is not supported by implementation='blockwise'; use 'xla'")


# ---------------------------------------------------------------------------------
# The paths, and what happens to every path's output: non-finite inputs, empty rows.
# ---------------------------------------------------------------------------------


def _sanitize(q, k, v):
    """Zeroes non-finite entries so no matmul ever multiplies 0 by NaN or inf.

    Returns:
      `(q, k, v, bad_q (B…, H, N), bad_kv (B…, K, S))`: the finite arrays, the query
      rows with a non-finite entry and the keys whose key or value has one. A row
      that may see a bad key, or whose query is bad, is set to NaN afterwards
      (`_finish`); every other row is exactly what it would be without them.
    """
    finite = [jnp.isfinite(x) for x in (q, k, v)]
    clean = [jnp.where(ok, x, jnp.zeros((), x.dtype)) for ok, x in zip(finite, (q, k, v))]
    bad_q = ~jnp.all(finite[0], axis=-1)
    bad_kv = ~(jnp.all(finite[1], axis=-1) & jnp.all(finite[2], axis=-1))
    return (*clean, bad_q, bad_kv)


def _weights_path(q, k, v, bad_kv, vis, scale, dropout_rate, dropout_rng):
    """The reference path: `(out, weights, empty, touched)`, dropout on the weights."""
    allowed = _masking.dense_allowed(vis, q.ndim)
    bias = None if vis.bias is None else jax.lax.broadcast_to_rank(vis.bias, q.ndim)
    score_fn = None
    if vis.score_mod is not None:
        heads = _masking.dense_heads(vis, q.ndim)
        rows, cols = jnp.arange(vis.n)[:, None], jnp.arange(vis.s)[None, :]
        score_fn = lambda x: _masking.score_logits(dataclasses.replace(vis, logits_soft_cap=None), x, heads, rows, cols)
    weights, empty = reference_weights(q, k, allowed, bias, scale=scale, rows_see_keys=vis.every_row_sees_a_key,
                                       score_fn=score_fn, logits_soft_cap=vis.logits_soft_cap)
    if dropout_rate > 0.0:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
        weights = jnp.where(keep, weights / jnp.asarray(1.0 - dropout_rate, weights.dtype), 0.0)
    groups = q.shape[-3] // k.shape[-3]
    out = mix(weights, v)  # (B…, H, N, Dv)
    sees_bad = jnp.repeat(bad_kv, groups, axis=-2)[..., None, :]  # (B…, H, 1, S)
    touched = jnp.any(sees_bad if allowed is None else allowed & sees_bad, axis=-1)
    return out, weights, empty, jnp.broadcast_to(touched, empty.shape)


def _finish(out, weights, empty, poisoned, v, bad_kv, q_lengths, empty_rows):
    """The empty-row policy, NaN for poisoned rows, zeros past `q_lengths` (int32
    `(B…|1, 1, 1, 1)`, the description's, or None)."""
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


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    local_window_size: int | tuple[int | None, int | None] | None = None,
    q_lengths: jax.Array | None = None,
    kv_lengths: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    empty_rows: str = "zero",
    score_mod=None,
    mask_mod=None,
    logits_soft_cap: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    deterministic: bool = True,
    return_weights: bool = False,
    implementation: str | None = "xla",
    query_block_size: int | None = None,
    key_block_size: int | None = None,
):
    """Scaled dot-product attention for all heads at once.

    `softmax(cap(score_mod(q kᵀ · scale + bias)), masked) v`. The logits are scaled and soft-maxed in
    float32 whatever the input dtype (float64 in float64); the output has q's dtype.
    Every path (`implementation`) reads the same description of who may attend
    (`jax_mha._masking`), so they agree to rounding, edge cases included.

    Query `i` sits at key position `i + S - N` (the queries are the last N positions:
    `causal_mask`, decoding with a cache). jax.nn aligns `is_causal` and
    `local_window_size` top-left instead; the two agree when N == S.

    Args:
      q: `(B…, H, N, D)` queries, real floating point.
      k: `(B…, K, S, D)` keys, `H % K == 0`; query heads `h*G:(h+1)*G` (G = H // K)
        share key/value head `h` (GQA; `K == 1` is MQA). K/V are never repeated.
      v: `(B…, K, S, Dv)` values. q, k, v share one dtype and one batch shape.
      mask: bool, broadcastable to `(B…, H, N, S)`; True = may attend.
      bias: float, broadcastable to `(B…, H, N, S)`, added to the scaled logits; a
        `-inf` entry masks its key (a row of `-inf` is an empty row). Differentiable.
      is_causal: key `j` visible to query `i` only if `j <= i + S - N`.
      scale: logit scale (a static number), default `1/sqrt(D)`.
      local_window_size: `(left, right)` (jax.nn's name and meaning) or an int `w`
        for `(w, w)`: key `j` visible only if `i + S - N - left <= j <= i + S - N +
        right`; a side of None is unbounded.
      q_lengths: int, broadcastable to `(B…)`: valid queries per sequence; rows past
        it are padding and output 0 (as jax.nn's `query_seq_lengths`).
      kv_lengths: int, broadcastable to `(B…)`: valid keys per sequence (jax.nn's
        `key_value_seq_lengths`); never materialised as a mask on the tuned paths.
      q_segment_ids: int `(B…, N)` (leading dims broadcast): the segment (document)
        of each query, for packed sequences; query `i` sees key `j` only when
        `q_segment_ids[i] == kv_segment_ids[j]`. Never materialised as an `(N, S)`
        mask on the blockwise path, which skips key blocks whose id range cannot meet
        the query block's (see `jax_mha.blockwise`).
      kv_segment_ids: int `(B…, S)`; defaults to `q_segment_ids` when N == S.
      score_mod: `score_mod(score, batch, head, q_idx, kv_idx) -> score` (PyTorch
        FlexAttention's name and signature), or None. Called with broadcastable int32
        index arrays of the scores' rank (scalar-style code works by broadcasting):
        `batch` the flattened index over all leading dims `B…` (row-major: for
        `B… = (2, 3)`, entry `(1, 2)` is 5), `head` the query head (0…H-1), `q_idx` the
        query row (0…N-1; its key position is `q_idx + S - N`), `kv_idx` the key. It
        must return the score's shape and dtype (float32, float64 for float64 inputs);
        a `-inf` masks the key. The order on the logits is: scale → `bias` →
        `score_mod` → `logits_soft_cap` → masks. Gradients reach what it closes over
        (a T5 relative-bias table, ALiBi slopes), on every path: the blockwise path
        hoists those values out of the closure (`jax.closure_convert`) into inputs of
        its custom derivative. Never builds an `(N, S)` array on the blockwise path.
      mask_mod: `mask_mod(batch, head, q_idx, kv_idx) -> bool` (FlexAttention's), or
        None: True = may attend, AND-ed with every other part. Same index arrays; its
        result must be boolean and broadcast to the scores. The blockwise path skips
        the key blocks it rules out: for a function of the indices alone (closing over
        no traced value), each query block's range of key blocks holding a visible
        key is computed once per (function, shapes) and cached, so the key loop is as
        short as the built-in pattern's (a `mask_mod` window runs like
        `local_window_size`); every block in range is then tested on its own
        `(q_block, k_block)` index grid and skipped when empty. A `mask_mod` closing
        over traced values (e.g. document ids under jit) gets only the per-block test.
        It must be a pure function of its arguments: the cache keys on its identity.
      logits_soft_cap: `c > 0`: logits become `c · tanh(logits / c)` (Gemma 2), after
        `score_mod`, before masking. A static number.
      empty_rows: what a query with no visible key outputs: `"zero"` (default; zeros
        in the output, the weights and every gradient) or `"uniform"` (the mean of all
        S values, weights 1/S: what flax and jax.nn return).
      dropout_rate: dropout on the attention weights, applied only when
        `deterministic=False`; needs `dropout_rng` then.
      dropout_rng: PRNG key for the dropout.
      deterministic: disables dropout.
      return_weights: also return the weights (after dropout, as applied to `v`).
      implementation: `"xla"` (the whole scores built and differentiated as written,
        as jax.nn's "xla"; the blockwise engine once they would pass
        `WHOLE_SCORES_MAX_BYTES`), `"blockwise"` (memory linear in N; skips blocks that
        causality, the window, the lengths or the segment ids rule out), `"cudnn"`
        (jax.nn's fused GPU kernel; reverse-mode only), `"pallas_tpu"` (splash
        attention) or `"pallas_gpu"` (the Triton FlashAttention kernel), each of
        which runs in Pallas interpret mode off its platform and raises ValueError
        naming a part of the description it cannot express, or `"auto"`/None
        (`resolve_implementation`: by platform; on CPU `"xla"`).
      query_block_size: the blockwise path's block size over queries; None picks
        it (`jax_mha.blockwise.default_blocks`: 2048 x 256, 512 x 512 when causal or
        windowed, smaller for a narrow window).
      key_block_size: its block size over keys; None picks it likewise.

    Returns:
      `out (B…, H, N, Dv)` in `q`'s dtype, or `(out, weights (B…, H, N, S))` when
      `return_weights=True`. N == 0 or S == 0 gives zeros of that shape. A row that
      may attend to a NaN or infinite input is NaN; no other row is touched by it.

    Raises:
      TypeError: for integer, complex or mixed dtypes, a non-boolean mask, a
        non-floating bias, non-integer lengths or segment ids, a bad
        `local_window_size`, a non-callable mod, a `score_mod` returning another
        dtype, a `mask_mod` returning non-booleans, a non-number soft-cap.
      ValueError: for shapes that do not fit (naming them), `kv_segment_ids` left
        out when N != S, an unknown implementation or one that cannot run these inputs
        (cuDNN refuses `score_mod` and `logits_soft_cap`; both Pallas kernels refuse
        the mods, the Triton one the soft-cap too; splash takes the soft-cap), a
        mod whose result has the wrong shape, a soft-cap not positive and finite, a
        bad option, or dropout without a key.
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    batch = _check_qkv(q, k, v)
    n, s = q.shape[-2], k.shape[-2]
    scores = batch + q.shape[-3:-1] + (s,)
    q_ids, kv_ids = _check_segments(q_segment_ids, kv_segment_ids, batch, n, s)
    q_lengths = _check_lengths("q_lengths", q_lengths, batch)
    kv_lengths = _check_lengths("kv_lengths", kv_lengths, batch)
    rank = len(batch)
    cap = _check_mods(score_mod, mask_mod, logits_soft_cap, q.dtype)
    vis = _masking.Visibility(
        n, s, bool(is_causal), _masking.canonical_window(local_window_size),
        mask=_check_pairwise("mask", mask, scores, floating=False),
        bias=_check_pairwise("bias", bias, scores, floating=True),
        q_lengths=_masking.lengths_at_rank(q_lengths, rank), kv_lengths=_masking.lengths_at_rank(kv_lengths, rank),
        **dict(zip(("q_segment_ids", "kv_segment_ids"), _masking.segments_at_rank(q_ids, kv_ids, rank))),
        score_mod=score_mod, mask_mod=mask_mod, logits_soft_cap=cap, batch_shape=tuple(batch),
        num_heads=q.shape[-3],
    )
    scale = _check_options(scale, dropout_rate, dropout_rng, deterministic, empty_rows, is_causal, q.shape[-1])
    dropout = dropout_rate > 0.0 and not deterministic
    path = resolve_implementation(q, k, v, implementation=implementation, return_weights=return_weights,
                                  dropout=dropout, unfused=_kernel_cannot_express(vis, empty_rows),
                                  cudnn_ok=_cudnn_refusal(vis) is None)
    _check_path(path, q, k, v, dropout, return_weights, vis)
    if path.startswith("pallas_"):
        return _pallas(path, q, k, v, vis, scale=scale, q_ids=q_ids, kv_ids=kv_ids, q_lengths=q_lengths,
                       kv_lengths=kv_lengths, return_weights=return_weights, dropout_rate=dropout_rate,
                       deterministic=deterministic, empty_rows=empty_rows)
    dtype = q.dtype
    q, k, v, bad_q, bad_kv = _sanitize(q, k, v)
    out, weights, empty, touched = _run_path(
        path, q, k, v, bad_kv, vis, scale, dropout_rate if dropout else 0.0, dropout_rng,
        return_weights, query_block_size, key_block_size,
    )
    out, weights = _finish(out, weights, empty, touched | bad_q, v, bad_kv, vis.q_lengths, empty_rows)
    return (out.astype(dtype), weights.astype(dtype)) if return_weights else out.astype(dtype)


# ---------------------------------------------------------------------------------
# The Pallas kernels' dispatch point. Their translators live in `_pallas_tpu.py` and
# `_pallas_gpu.py`, imported only when chosen: they pull in jax.experimental.pallas,
# and a checkout without them still imports and runs every other path.
# ---------------------------------------------------------------------------------


def _pallas(path, q, k, v, vis, *, scale, q_ids, kv_ids, q_lengths, kv_lengths, return_weights,
            dropout_rate, deterministic, empty_rows):
    """Hands the validated description to a Pallas translator, which raises
    ValueError naming any part it cannot express. Off the kernel's platform it runs
    in Pallas interpret mode (a correctness tool: slow)."""
    if path == "pallas_tpu":
        from jax_mha._pallas_tpu import pallas_tpu_attention as kernel
    else:
        from jax_mha._pallas_gpu import pallas_gpu_attention as kernel
    if empty_rows != "zero":
        raise ValueError(f"empty_rows={empty_rows!r} is not supported by implementation={path!r}; use 'xla' "
                         "or 'blockwise'")
    for name in ("score_mod", "mask_mod"):
        if getattr(vis, name) is not None:
            raise ValueError(f"implementation={path!r} cannot express {name} (the kernel takes no functions of "
                             "the scores); use 'xla' or 'blockwise'")
    if path == "pallas_gpu" and vis.logits_soft_cap is not None:
        raise ValueError("implementation='pallas_gpu' cannot express logits_soft_cap (the Triton kernel has no "
                         "soft-cap); use 'xla', 'blockwise' or 'pallas_tpu'")
    window = None if vis.window is None else tuple(vis.window)
    return kernel(
        q, k, v, scale=scale, is_causal=vis.is_causal, local_window_size=window,
        q_segment_ids=q_ids, kv_segment_ids=kv_ids, q_lengths=q_lengths, kv_lengths=kv_lengths,
        mask=vis.mask, bias=vis.bias, return_weights=return_weights, dropout_rate=dropout_rate,
        deterministic=deterministic, interpret=_platform() != path[len("pallas_"):],
        **({} if vis.logits_soft_cap is None else {"logits_soft_cap": vis.logits_soft_cap}),
    )


def _run_path(path, q, k, v, bad_kv, vis, scale, dropout_rate, dropout_rng, return_weights, q_block, k_block):
    """`(out, weights or None, empty, touched)` from the chosen path."""
    batch = jnp.broadcast_shapes(q.shape[:-3], k.shape[:-3])
    n, s = q.shape[-2], k.shape[-2]
    if n == 0 or s == 0 or 0 in batch:  # zeros under either empty-row policy
        out = jnp.zeros(batch + q.shape[-3:-1] + v.shape[-1:], _masking.compute_dtype(q.dtype))
        weights = jnp.zeros(batch + q.shape[-3:-1] + (s,), out.dtype) if return_weights else None
        no_rows = jnp.zeros(out.shape[:-1], bool)
        return out, weights, no_rows, no_rows
    if return_weights or dropout_rate > 0.0 or (path == "xla" and whole_scores_fit(q, k)):
        out, weights, empty, touched = _weights_path(q, k, v, bad_kv, vis, scale, dropout_rate, dropout_rng)
        return out, weights if return_weights else None, empty, touched
    if path == "cudnn":
        out, empty, touched = cudnn_attention(q, k, v, vis, scale=scale, bad_kv=bad_kv)
        return out, None, empty, touched
    if path == "blockwise":  # "xla" too big for the whole scores takes the default blocks
        q_block = None if q_block is None else _index("query_block_size", q_block)
        k_block = None if k_block is None else _index("key_block_size", k_block)
        if any(b is not None and b < 1 for b in (q_block, k_block)):
            raise ValueError(f"block sizes must be >= 1, got query_block_size={q_block}, key_block_size={k_block}")
    else:
        q_block = k_block = None
    out, lse, touched = run_blockwise(
        q, k, v, vis, query_block_size=q_block, key_block_size=k_block, scale=scale, bad_kv=bad_kv
    )
    return out, None, lse == jnp.inf, touched
