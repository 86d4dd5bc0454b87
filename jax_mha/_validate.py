"""Input checks of `jax_mha.attention`: one place, one error message per bad value.

Each check takes the user's argument and returns it validated (as the description in
`jax_mha._masking` wants it), or raises a one-line `TypeError`/`ValueError` naming the
value and, where there is one, what to pass instead. `describe` runs them all and
builds the one description (`_masking.Visibility`) every path reads.
"""

from __future__ import annotations

import inspect
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np

from jax_mha import _masking
from jax_mha.paths.schedules import BlockSchedule

EMPTY_ROWS = ("zero", "uniform")
LAYOUTS = ("BHND", "BNHD")


class DTypeError(TypeError, ValueError):
    """An input of the wrong dtype (a TypeError; also a ValueError, which the first
    release raised for a non-boolean mask)."""


def as_index(name: str, value) -> int:
    """`value` as a Python int, or a TypeError naming it (bools and floats refused)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r}") from None


def check_qkv(q, k, v):
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


def check_pairwise(name: str, x, target: tuple, floating: bool):
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


def check_lengths(name: str, x, batch: tuple | None):
    """Integer lengths broadcastable to the batch dims `batch` (any when None), or None."""
    if x is None:
        return None
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise DTypeError(f"{name} must be integers, got dtype {x.dtype}")
    if batch is not None and (x.ndim > len(batch) or not _masking.fits(x.shape, batch)):
        raise ValueError(f"{name} of shape {x.shape} does not broadcast to the batch dims {batch}")
    return x


def check_segments(q_ids, kv_ids, batch: tuple, n: int, s: int):
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


def _probe(name: str, fn, args):
    """`jax.eval_shape(fn, *args)`, a mod called with the wrong number of arguments
    turned into an error that names the signature it must have."""
    signature = "(score, batch, head, q_idx, kv_idx)" if name == "score_mod" else "(batch, head, q_idx, kv_idx)"
    try:
        return jax.eval_shape(fn, *args)
    except TypeError as e:
        if "argument" not in str(e):
            raise
        raise TypeError(f"{name} must take {len(args)} arguments {signature} (FlexAttention's signature), "
                        f"but calling it that way failed: {e}") from None


def check_mods(score_mod, mask_mod, logits_soft_cap, dtype):
    """The mods, checked once by abstract evaluation on small index arrays (nothing
    runs); returns the soft-cap as a Python float or None.

    Raises:
      TypeError: a non-callable mod, one with the wrong number of arguments, a
        score_mod not returning the score's dtype, a mask_mod not returning bool, a
        soft-cap that is not a number.
      ValueError: a mod whose result does not broadcast to the scores, a soft-cap
        that is not positive and finite.
    """
    dtype = _masking.compute_dtype(dtype)
    shape = (2, 3, 5, 7)  # (batch, head, q, kv): distinct sizes, so a swapped axis shows
    idx = [jax.ShapeDtypeStruct(tuple(d if a == i else 1 for a in range(4)), jnp.int32) for i, d in enumerate(shape)]
    for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be a callable or None, got {type(fn).__name__}")
    if score_mod is not None:
        out = _probe("score_mod", score_mod, [jax.ShapeDtypeStruct(shape, dtype), *idx])
        got = getattr(out, "dtype", type(out).__name__)
        if got == jnp.bool_:
            raise TypeError("score_mod returned booleans: it must return the modified float score "
                            f"({dtype}); a function deciding who may attend is a mask_mod")
        if got != dtype:
            raise TypeError(f"score_mod must return the score's dtype {dtype}, got {got}")
        if out.shape != shape:
            raise ValueError("score_mod must return one score per (batch, head, q_idx, kv_idx), shaped like its "
                             "`score` argument; its result broadcast differently (did it drop `score`?)")
    if mask_mod is not None:
        out = _probe("mask_mod", mask_mod, idx)
        if not hasattr(out, "dtype") or out.dtype != jnp.bool_:
            raise TypeError(f"mask_mod must return booleans (True = may attend), got "
                            f"{getattr(out, 'dtype', type(out).__name__)}")
        if not _masking.fits(out.shape, shape):
            raise ValueError("mask_mod's result does not broadcast against its index arguments (batch, head, "
                             "q_idx, kv_idx): combine them elementwise only")
    return check_soft_cap(logits_soft_cap)


def check_soft_cap(logits_soft_cap) -> float | None:
    """The soft-cap as a Python float (or None).

    Raises:
      TypeError: for a non-number or a traced value. ValueError: unless positive and finite.
    """
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


def check_options(scale, dropout_rate, dropout_rng, deterministic, empty_rows, is_causal, d):
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




def check_layout(layout: str, q, k, v):
    """`(q, k, v)` in the library's `(B…, heads, length, D)` order, from `layout`:
    `"BHND"` (ours, the seeds') as they are, `"BNHD"` (jax.nn's and flax's
    `(B…, length, heads, D)`) with the two axes swapped.

    Raises:
      ValueError: for another layout, or arrays of rank < 3.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS} (heads before length, or length before heads), got "
                         f"{layout!r}")
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    if layout == "BHND":
        return q, k, v
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim < 3:
            raise ValueError(f"{name} must have shape (B…, length, heads, D) with layout='BNHD', got shape {x.shape}")
    return tuple(jnp.swapaxes(x, -3, -2) for x in (q, k, v))


def check_offset(name: str, x):
    """A query offset (`q_offset`, `q_start`): None, an int, or an integer scalar
    array (traced when decoding under jit)."""
    if x is None or (isinstance(x, int) and not isinstance(x, bool)):
        return x
    x = jnp.asarray(x)
    if x.ndim or not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an int or an integer scalar, got {x.dtype} of shape {x.shape}")
    return x


def check_schedule(schedule, n: int, s: int):
    """A `block_schedule` built for N queries and S keys, or None.

    Raises:
      TypeError: for anything but a `jax_mha.block_schedule` result.
      ValueError: for one built for other lengths.
    """
    if schedule is None:
        return None
    if not isinstance(schedule, BlockSchedule):
        raise TypeError(f"block_schedule must be the result of jax_mha.block_schedule, got {type(schedule).__name__}")
    if (schedule.n, schedule.s) != (n, s):
        raise ValueError(f"block_schedule was built for N={schedule.n}, S={schedule.s}; this call has N={n}, S={s}")
    return schedule


def check_sinks(sinks, num_heads: int):
    """Attention sinks: None, or float `(H,)`, one logit per query head.

    Raises:
      TypeError: for a non-floating dtype. ValueError: for another shape, or a
        concrete non-finite sink (traced ones make every row of their head NaN on
        every path: `jax_mha._softmax.sanitize_description`).
    """
    if sinks is None:
        return None
    sinks = jnp.asarray(sinks)
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise DTypeError(f"sinks must be floating (one logit per head), got dtype {sinks.dtype}")
    if sinks.shape != (num_heads,):
        raise ValueError(f"sinks must have shape (H,) = ({num_heads},), one logit per query head, got {sinks.shape}")
    if not isinstance(sinks, jax.core.Tracer):
        bad = np.flatnonzero(~np.isfinite(np.asarray(sinks, np.float64)))
        if bad.size:
            raise ValueError(f"sinks must be finite, got {float(sinks[bad[0]])} for head {bad[0]} (a head without a "
                             "sink is not expressible: leave sinks out, or give it a very negative logit)")
    return sinks


def check_description_keywords(caller: str, keywords: dict) -> None:
    """For the entry points that take `attention`'s description as `**description`.

    Raises:
      TypeError: naming the first keyword `describe` does not take, as Python would.
    """
    unknown = sorted(set(keywords) - set(DESCRIPTION_KEYWORDS))
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}; it takes attention's "
                        f"description keywords {', '.join(DESCRIPTION_KEYWORDS)}")


def describe(q, k, v, mask=None, bias=None, *, is_causal=False, local_window_size=None, q_lengths=None,
             kv_lengths=None, q_segment_ids=None, kv_segment_ids=None, score_mod=None, mask_mod=None,
             logits_soft_cap=None, sinks=None, q_offset=None, q_start=None, block_schedule=None) -> _masking.Visibility:
    """Every argument of `attention` that says who may attend, validated, as the one
    description (`_masking.Visibility`) every path reads.

    Args:
      q: `(B…, H, N, D)`; k: `(B…, K, S, D)`; v: `(B…, K, S, Dv)`.
      mask, bias, …: as for `jax_mha.attention`.
      q_offset: the key position of query 0 (None: S - N); q_start: the mods' q_idx
        of query 0 (None: 0). Decoding sets both to the cache index.

    Raises:
      TypeError, ValueError: naming the bad argument (see `jax_mha.attention`).
    """
    batch = check_qkv(q, k, v)
    n, s = q.shape[-2], k.shape[-2]
    scores = batch + q.shape[-3:-1] + (s,)
    q_ids, kv_ids = check_segments(q_segment_ids, kv_segment_ids, batch, n, s)
    rank = len(batch)
    if not isinstance(is_causal, (bool, type(jnp.bool_(True)))):
        raise TypeError(f"is_causal must be a Python bool, got {is_causal!r}")
    cap = check_mods(score_mod, mask_mod, logits_soft_cap, q.dtype)
    q_ids, kv_ids = _masking.segments_at_rank(q_ids, kv_ids, rank)
    return _masking.Visibility(
        n, s, bool(is_causal), _masking.canonical_window(local_window_size),
        mask=check_pairwise("mask", mask, scores, floating=False),
        bias=check_pairwise("bias", bias, scores, floating=True),
        q_lengths=_masking.lengths_at_rank(check_lengths("q_lengths", q_lengths, batch), rank),
        kv_lengths=_masking.lengths_at_rank(check_lengths("kv_lengths", kv_lengths, batch), rank),
        q_segment_ids=q_ids, kv_segment_ids=kv_ids, q_offset=check_offset("q_offset", q_offset),
        q_start=check_offset("q_start", q_start), sinks=check_sinks(sinks, q.shape[-3]), score_mod=score_mod, mask_mod=mask_mod, logits_soft_cap=cap,
        batch_shape=tuple(batch), num_heads=q.shape[-3],
        segments_shared=q_segment_ids is not None and (kv_segment_ids is None or kv_segment_ids is q_segment_ids),
        schedule=check_schedule(block_schedule, n, s),
    )


# `attention`'s keywords that describe who may attend and the logits (all of `describe`'s
# but the offsets decoding sets): what `attention_statistics` and the parallel entry
# points take as `**description`.
DESCRIPTION_KEYWORDS = tuple(name for name, p in inspect.signature(describe).parameters.items()
                             if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in ("q_offset", "q_start"))
