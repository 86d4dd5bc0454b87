"""Pure functional multi-head attention: no parameters, no state, no Flax.

The public layer of the core. Beneath it, each file with one job:

  _validate.py    the input checks, and `describe`: the arguments as one description
  _masking.py     the one description of which (query, key) pairs may attend
  _dispatch.py    which path runs a call (each path's refusal), and the steps every
                  path shares: non-finite inputs isolated, empty rows, padding rows
  _dense.py       the whole scores, one screen: the truth every path is tested against
                  and the path that returns the weights
  _flash.py       the blockwise engine: query blocks x key blocks, online softmax, a
                  custom JVP whose tangent's transpose is written by hand (_linear.py):
                  the two-pass FlashAttention-2 backward; blockwise.py its blocks
  _cudnn.py, _pallas_tpu.py, _pallas_gpu.py, _pallas_gpu_decode.py, _pallas_mgpu.py
                  the description translated for a kernel

Axis letters used in shapes and einsum strings:
  B… any leading batch dims, N query length, S key/value length,
  H query heads, K key/value heads (H % K == 0), G = H // K heads per group,
  D head dim.

Every function here is safe under jit, vmap, grad, vjp, jvp, jacfwd and hessian,
except the vendor-kernel paths of `attention`: `"cudnn"` and the Pallas kernels have a
custom VJP only, so reverse mode (`grad`, `vjp`) but no `jvp`/`jacfwd`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_mha import _dispatch, _masking
from jax_mha._dispatch import IMPLEMENTATIONS, WHOLE_SCORES_MAX_BYTES, whole_scores_fit
from jax_mha._statistics import attention_statistics
from jax_mha._validate import (
    EMPTY_ROWS,
    DTypeError,
    as_index,
    check_layout,
    check_lengths,
    check_options,
    describe,
)


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
    num_heads = as_index("num_heads", num_heads)
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
    n = as_index("causal_mask n", n)
    s = n if s is None else as_index("causal_mask s", s)
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
    s = as_index("lengths_mask s", s)
    if s < 0:
        raise ValueError(f"lengths_mask needs a non-negative key length, got s={s}")
    kv_lengths = check_lengths("kv_lengths", kv_lengths, None)[..., None, None, None]  # (B…, 1, 1, 1)
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
    sinks: jax.Array | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    deterministic: bool = True,
    return_weights: bool = False,
    return_residual: bool = False,
    implementation: str | None = "xla",
    query_block_size: int | None = None,
    key_block_size: int | None = None,
    layout: str = "BHND",
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
        query row (0…N-1; its key position is `q_idx + S - N`; when decoding, the
        token's position counted from the first cached token, as in the full pass),
        `kv_idx` the key. It
        must return the score's shape and dtype (float32, float64 for float64 inputs);
        a `-inf` masks the key. The order on the logits is: scale → `bias` →
        `score_mod` → `logits_soft_cap` → masks. Gradients reach what it closes over
        (a T5 relative-bias table, ALiBi slopes), on every path: the blockwise path
        traces the function (`_flash.trace_mod`) and makes every value it closes over
        an input of its custom derivative. Never builds an `(N, S)` array on the
        blockwise path.
      mask_mod: `mask_mod(batch, head, q_idx, kv_idx) -> bool` (FlexAttention's), or
        None: True = may attend, AND-ed with every other part. Same index arrays; its
        result must be boolean and broadcast to the scores. The blockwise path skips
        the key blocks it rules out: for a function of the indices and of concrete
        values, each query block's range of key blocks holding a visible key is
        computed from the values it reads at that call (kept only under a key of the
        traced computation and those values: a global read by the function may
        change between calls), so the key loop is as short as the
        built-in pattern's (a `mask_mod` window runs like `local_window_size`); every
        block in range is tested on its own `(q_block, k_block)` index grid and
        skipped when empty. Both mods may close over anything traced (ints, bools,
        floats, arrays, e.g. document ids under jit); a `mask_mod` that reads traced
        values gets the per-block test only (it visits every block of the band).
      logits_soft_cap: `c > 0`: logits become `c · tanh(logits / c)` (Gemma 2), after
        `score_mod`, before masking. A static number.
      sinks: float `(H,)`, one logit per query head for a virtual key whose value
        is zero (attention sinks, as gpt-oss; `sinks = 0` is the "off-by-one"
        softmax), in the space of the logits after the mods: each row's softmax
        denominator gains `exp(sinks[h])`, so its weights sum to less than one.
        Never masked; gradients reach it. None: no sink.
      empty_rows: what a query with no visible key outputs: `"zero"` (default; zeros
        in the output, the weights and every gradient) or `"uniform"` (the mean of all
        S values, weights 1/S: what flax and jax.nn return).
      dropout_rate: dropout on the attention weights, applied only when
        `deterministic=False`; needs `dropout_rng` then.
      dropout_rng: PRNG key for the dropout.
      deterministic: disables dropout.
      return_weights: also return the weights (after dropout, as applied to `v`).
      return_residual: also return each row's log-sum-exp `lse (B…, H, N)`,
        float32 (jax.nn's name): the natural log of the softmax denominator, the
        sink's term included; -inf on a row with no visible key (and no sink), NaN
        on a row that sees a non-finite input, -inf past `q_lengths`.
        Differentiable. Parts over disjoint keys merge exactly with
        `merge_attentions`.
      implementation: `"xla"` (the whole scores built and differentiated as written,
        as jax.nn's "xla"; the blockwise engine once they would pass
        `WHOLE_SCORES_MAX_BYTES`), `"blockwise"` (memory linear in N; skips blocks that
        causality, the window, the lengths or the segment ids rule out), `"cudnn"`
        (jax.nn's fused GPU kernel; reverse-mode only), `"pallas_tpu"` (splash
        attention) or `"pallas_gpu"` (the Triton FlashAttention kernel; its decode
        kernel for one query row), each of which runs in Pallas interpret mode off
        its platform, or `"pallas_mgpu"` (the Hopper FlashAttention-3 kernel, float16,
        compiled only, on a GPU of compute capability 9.0). A named path that
        cannot run the call raises its refusal (a ValueError naming the part);
        `"auto"`/None walks the platform's chain of kernels and takes the first that
        does not refuse, else `"xla"`/`"blockwise"` (`resolve_implementation`;
        docs/accelerators.md has the table).
      query_block_size: the blockwise path's block size over queries; None picks
        it (`jax_mha.blockwise.default_blocks`: 2048 x 256, 512 x 512 when causal or
        windowed, smaller for a narrow window).
      key_block_size: its block size over keys; None picks it likewise.
      layout: `"BHND"` (default: q `(B…, H, N, D)`, the seeds' order) or `"BNHD"`
        (jax.nn's and flax's `(B…, N, H, D)`: q, k, v and the output have the length
        before the heads; masks, biases and the weights keep `(B…, H, N, S)`).

    Returns:
      `out (B…, H, N, Dv)` (`(B…, N, H, Dv)` with `layout="BNHD"`) in `q`'s dtype;
      `(out, weights (B…, H, N, S))` with `return_weights=True`, `(out, lse)` with
      `return_residual=True`, `(out, weights, lse)` with both. N == 0 or S == 0
      gives zeros of that shape. A row that may attend to a NaN or infinite input is
      NaN; no other row is touched by it.

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
    q, k, v = check_layout(layout, q, k, v)
    vis = describe(q, k, v, mask, bias, is_causal=is_causal, local_window_size=local_window_size,
                   q_lengths=q_lengths, kv_lengths=kv_lengths, q_segment_ids=q_segment_ids,
                   kv_segment_ids=kv_segment_ids, score_mod=score_mod, mask_mod=mask_mod,
                   logits_soft_cap=logits_soft_cap, sinks=sinks)
    result = attention_from_description(
        q, k, v, vis, scale=scale, empty_rows=empty_rows, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
        deterministic=deterministic, return_weights=return_weights, return_residual=return_residual,
        implementation=implementation, query_block_size=query_block_size, key_block_size=key_block_size,
    )
    if layout == "BHND":
        return result
    if return_weights or return_residual:
        return (jnp.swapaxes(result[0], -3, -2), *result[1:])
    return jnp.swapaxes(result, -3, -2)


def _block_sizes(query_block_size, key_block_size) -> tuple[int | None, int | None]:
    """The blockwise path's block sizes, validated (None: `blockwise.default_blocks`)."""
    q_block = None if query_block_size is None else as_index("query_block_size", query_block_size)
    k_block = None if key_block_size is None else as_index("key_block_size", key_block_size)
    if any(b is not None and b < 1 for b in (q_block, k_block)):
        raise ValueError(f"block sizes must be >= 1, got query_block_size={q_block}, key_block_size={k_block}")
    return q_block, k_block


def attention_from_description(q, k, v, vis: _masking.Visibility, *, scale=None, empty_rows="zero",
                               dropout_rate=0.0, dropout_rng=None, deterministic=True, return_weights=False,
                               return_residual=False, implementation="xla", query_block_size=None,
                               key_block_size=None):
    """`attention` for a description already built (`_validate.describe`): what
    decoding calls with the cache index as the query offset. Arguments as `attention`."""
    scale = check_options(scale, dropout_rate, dropout_rng, deterministic, empty_rows, vis.is_causal, q.shape[-1])
    dropout = dropout_rate > 0.0 and not deterministic
    call = _masking.Call(q, k, v, bool(return_weights), dropout, empty_rows, _dispatch.platform(),
                         bool(return_residual))
    path = _dispatch.choose(vis, call, implementation)
    blocks = _block_sizes(query_block_size, key_block_size)
    return _dispatch.run(path, q, k, v, vis, call, scale=scale, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                         blocks=blocks, empty_rows=empty_rows)


def resolve_implementation(q, k, v, vis: _masking.Visibility | None = None, *, implementation: str | None = "auto",
                           return_weights: bool = False, dropout: bool = False, empty_rows: str = "zero") -> str:
    """The path `attention` takes for these inputs (`_dispatch.choose`): `implementation`
    itself, or for `"auto"`/None the first kernel of the platform's chain that does not
    refuse the call, else `"xla"` while the whole scores fit, else `"blockwise"`.

    Args:
      q, k, v: arrays or `jax.ShapeDtypeStruct`s shaped as for `attention`.
      vis: the description (None: every pair may attend).
      implementation, return_weights, empty_rows: as for `attention`.
      dropout: whether dropout on the weights is active.

    Returns:
      One of `IMPLEMENTATIONS` other than `"auto"`.

    Raises:
      ValueError: for an unknown implementation name, or the refusal of a named one.
    """
    vis = _masking.Visibility(q.shape[-2], k.shape[-2]) if vis is None else vis
    call = _masking.Call(q, k, v, return_weights, dropout, empty_rows, _dispatch.platform())
    return _dispatch.choose(vis, call, implementation)


def merge_attentions(parts) -> tuple[jax.Array, jax.Array]:
    """Attention over a union of disjoint key sets, from the attention over each.

    `attention(q, k, v, return_residual=True)` over keys split into disjoint sets
    (split-KV decoding, chunked prefill, context parallelism by hand) gives one
    `(out_i, lse_i)` per set; their union's attention is
    `out = Σ_i exp(lse_i - lse) out_i` with `lse = log Σ_i exp(lse_i)`, exactly (to
    rounding). A part with no visible key (`lse_i = -inf`) contributes nothing;
    if every part is empty the row is zeros with lse -inf. Sinks belong to one
    part only (each part's lse counts its sink).

    Args:
      parts: a non-empty sequence of `(out (B…, H, N, Dv), lse (B…, H, N))`, each
        part's arrays of one shape.

    Returns:
      `(out (B…, H, N, Dv) in the parts' dtype, lse (B…, H, N) float32)`.
      Differentiable.

    Raises:
      ValueError: for no parts, a part that is not an `(out, lse)` pair, or shapes
        that differ.
    """
    parts = list(parts)
    if not parts:
        raise ValueError("merge_attentions needs at least one (out, lse) part, got none")
    for i, part in enumerate(parts):
        if not isinstance(part, (tuple, list)) or len(part) != 2:
            raise ValueError(f"part {i} of merge_attentions must be an (out, lse) pair, got {type(part).__name__}")
        out, lse = jnp.asarray(part[0]), jnp.asarray(part[1])
        if out.shape[:-1] != lse.shape or out.shape != jnp.shape(parts[0][0]):
            raise ValueError(f"part {i}: out {out.shape} and lse {lse.shape} must be (B…, H, N, Dv) and (B…, H, N), "
                             f"the same for every part (part 0 out {jnp.shape(parts[0][0])})")
    outs = jnp.stack([jnp.asarray(o).astype(jnp.float32) for o, _ in parts])  # (P, B…, H, N, Dv)
    lses = jnp.stack([jnp.asarray(x).astype(jnp.float32) for _, x in parts])  # (P, B…, H, N)
    top = jax.lax.stop_gradient(jnp.max(lses, axis=0))
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    scale = jnp.exp(lses - top[None])  # (P, B…, H, N); 0 for an empty part
    total = jnp.sum(scale, axis=0)
    seen = total > 0
    out = jnp.sum(scale[..., None] * outs, axis=0) / jnp.where(seen, total, 1.0)[..., None]
    lse = jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
    return out.astype(jnp.asarray(parts[0][0]).dtype), lse


def blockwise_attention(q, k, v, mask=None, bias=None, *, query_block_size=None, key_block_size=None, **kwargs):
    """`attention(..., implementation="blockwise")`: the memory-efficient path.

    Args:
      q, k, v, mask, bias: as in `attention` (`q (B…, H, N, D)`, `k, v (B…, K, S, D)`).
      query_block_size: the largest query block; None: `blockwise.default_blocks`.
      key_block_size: the largest key block; None: `blockwise.default_blocks`.
      **kwargs: every other keyword of `attention`.

    Returns:
      `out (B…, H, N, D)`, as `attention` does.

    Raises:
      ValueError: as `attention`, naming the bad argument.
      TypeError: as `attention`; also for an `implementation` argument.
    """
    if "implementation" in kwargs:
        raise TypeError("blockwise_attention always runs implementation='blockwise'; drop the implementation argument")
    return attention(q, k, v, mask, bias, implementation="blockwise", query_block_size=query_block_size,
                     key_block_size=key_block_size, **kwargs)


__all__ = [
    "EMPTY_ROWS", "IMPLEMENTATIONS", "WHOLE_SCORES_MAX_BYTES", "DTypeError", "attention", "attention_entropy",
    "attention_statistics",
    "blockwise_attention", "causal_mask", "combine_heads", "lengths_mask", "merge_attentions", "padding_mask",
    "resolve_implementation",
    "rotary_embedding", "split_heads", "whole_scores_fit",
]
