"""Pure functional multi-head attention: no parameters, no state, no Flax.

Axis letters used in shapes and einsum strings:
  B… any leading batch dims, N query length, S key/value length,
  H query heads, K key/value heads (H % K == 0), G = H // K heads per group,
  D head dim.

Every function here is jit-, vmap- and grad-safe.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_mha.blockwise import blockwise_attention

IMPLEMENTATIONS = ("xla", "blockwise", "cudnn", "auto")

# Sequences with at least this many query x key pairs per head go to the blockwise
# path under implementation="auto". Below it the plain path (which computes a block
# of query rows at a time) wins; from it on the blockwise path is faster for
# forward+backward on a 2-core CPU (B=1, H=8, d_model=512, N=2048: 193 vs 245 ms,
# experiments/benchmark.py) and its memory stays linear in N, while the plain path
# keeps the (B, H, N, S) weights for the gradient. (The plain forward alone is still
# ~1.2x faster at N=2048; training is what the default is chosen for.)
AUTO_BLOCKWISE_MIN_SCORES = 2048 * 2048

# The plain path computes the float32 scores of at most this many bytes at a time
# (a lax.map over blocks of query rows; see `_chunked_attention_core`).
XLA_CHUNK_SCORE_BYTES = 8 * 2**20


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
    """
    s = n if s is None else s
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
    if valid.ndim != 2:
        raise ValueError(f"padding_mask expects valid of shape (B, S), got {valid.shape}")
    return valid.astype(bool)[:, None, None, :]


def lengths_mask(kv_lengths: jax.Array, s: int) -> jax.Array:
    """Padding mask from per-sequence valid key counts.

    Args:
      kv_lengths: int `(B…)`, number of valid keys of each sequence.
      s: S, the padded key length.

    Returns:
      bool `(B…, 1, 1, S)`, True for keys at positions `< kv_lengths`.
    """
    kv_lengths = jnp.asarray(kv_lengths)[..., None, None, None]  # (B…, 1, 1, 1)
    # Explicit ranks: the library runs under jax_numpy_rank_promotion="raise".
    return jax.lax.broadcast_to_rank(jnp.arange(s), kv_lengths.ndim) < kv_lengths


def attention_entropy(weights: jax.Array) -> jax.Array:
    """Entropy of each attention distribution, in nats, with `0·log 0 = 0`.

    Args:
      weights: `(B…, H, N, S)`, rows summing to 1 (or all zero for fully masked rows,
        whose entropy is 0).

    Returns:
      float32 `(B…, H, N)`.
    """
    w = weights.astype(jnp.float32)
    positive = w > 0
    # The inner where keeps log's gradient finite at w == 0.
    w_log_w = jnp.where(positive, w * jnp.log(jnp.where(positive, w, 1.0)), 0.0)
    return -jnp.sum(w_log_w, axis=-1)


def _check_inputs(q, k, v, mask, bias, kv_lengths):
    """Validates shapes; returns (H, K, N, S) as Python ints."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim < 3:
            raise ValueError(f"{name} must have shape (B…, heads, length, D), got rank {x.ndim} shape {x.shape}")
    if not q.ndim == k.ndim == v.ndim:
        raise ValueError(f"q, k, v must have the same rank, got shapes {q.shape}, {k.shape}, {v.shape}")
    *_, h, n, d = q.shape
    *_, kh, s, dk = k.shape
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
    target = q.shape[:-3] + (h, n, s)
    for name, x in (("mask", mask), ("bias", bias)):
        if x is None:
            continue
        try:
            ok = np.broadcast_shapes(jnp.shape(x), target) == target
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"{name} of shape {jnp.shape(x)} does not broadcast to (B…, H, N, S) = {target}")
    if mask is not None and jnp.asarray(mask).dtype != jnp.bool_:
        raise ValueError(f"mask must be boolean (True = may attend), got dtype {jnp.asarray(mask).dtype}")
    if kv_lengths is not None:
        try:
            ok = np.broadcast_shapes(jnp.shape(kv_lengths), q.shape[:-3]) == q.shape[:-3]
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"kv_lengths of shape {jnp.shape(kv_lengths)} does not broadcast to the batch dims {q.shape[:-3]}")
    return h, kh, n, s


def _combined_mask(mask, kv_lengths, is_causal, n, s):
    """AND of the explicit mask, the length mask and the causal pattern, or None."""
    parts = [m for m in (mask,) if m is not None]
    if kv_lengths is not None:
        parts.append(lengths_mask(kv_lengths, s))
    if is_causal:
        parts.append(causal_mask(n, s))
    if not parts:
        return None
    rank = max(jnp.ndim(m) for m in parts)
    parts = [jax.lax.broadcast_to_rank(jnp.asarray(m), rank) for m in parts]  # explicit ranks
    out = parts[0]
    for m in parts[1:]:
        out = jnp.logical_and(out, m)
    return out


# Einsum strings of the plain path, by layout: without GQA (G == 1) the heads stay one
# axis, as reshaping N x S arrays between (K, G) and H costs XLA a copy of each (and
# of each gradient); with GQA, K/V are shared by the G query heads of a group.
_SCORES = {False: "...hnd,...hsd->...hns", True: "...kgnd,...ksd->...kgns"}  # q·k
_MIX = {False: "...hns,...hsd->...hnd", True: "...kgns,...ksd->...kgnd"}  # weights·v, dS·k
_MIX_T = {False: "...hns,...hnd->...hsd", True: "...kgns,...kgnd->...ksd"}  # weightsᵀ·dO, dSᵀ·q


def _masked_softmax(logits, mask):
    """float32 softmax over the last axis; masked entries and fully masked rows are 0."""
    if mask is None:
        # Written out (not jax.nn.softmax) so that XLA:CPU fuses scores, softmax and
        # weights·v into one kernel; l >= 1 since the row maximum contributes exp(0).
        p = jnp.exp(logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True)))
        return p * (1.0 / jnp.sum(p, axis=-1, keepdims=True))
    # A finite floor (not -inf) keeps fully masked rows NaN-free; they come out
    # uniform and the second where() zeroes them (other rows' masked entries are
    # already exp(-huge) = 0).
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    p = jnp.exp(logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True)))
    return jnp.where(mask, p * (1.0 / jnp.sum(p, axis=-1, keepdims=True)), 0.0)


def _reduce_to(x, shape):
    """Sums `x` over the axes where `shape` (same rank) has size 1: a broadcast's transpose."""
    axes = tuple(i for i, (a, b) in enumerate(zip(x.shape, shape)) if b == 1 and a != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def _weights(grouped, q, k, mask, bias):
    """float32 attention weights; q pre-scaled, layouts and mask/bias ranks as the logits."""
    logits = jnp.einsum(_SCORES[grouped], q, k, preferred_element_type=jnp.float32)
    if bias is not None:
        logits = logits + bias
    return _masked_softmax(logits, mask)


def _core_forward(grouped, q, k, v, mask, bias):
    """`(out, weights)`; q pre-scaled, layouts and mask/bias ranks as the logits."""
    weights = _weights(grouped, q, k, mask, bias)
    return jnp.einsum(_MIX[grouped], weights.astype(v.dtype), v), weights


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention_core(grouped, q, k, v, mask, bias):
    """softmax(q kᵀ + bias, mask) v with a hand-written backward pass.

    Autodiff of the softmax walks the N x S arrays about ten times and keeps several of
    them alive; this VJP (the FlashAttention-2 backward, Dao 2023, in one block) keeps
    only the weights W and needs three N x S passes: dW = dO vᵀ, then
    dS = W ⊙ (dW - rowsum(dO ⊙ O)), read by dq = dS k and dk = dSᵀ q. On CPU every
    fresh N x S buffer also costs page faults, so fewer of them is most of the gain.
    Reverse mode only, like any custom VJP: `jax.jvp` through `attention` needs the
    weights path (`return_weights=True`).
    """
    return _core_forward(grouped, q, k, v, mask, bias)[0]


def _attention_core_fwd(grouped, q, k, v, mask, bias):
    out, weights = _core_forward(grouped, q, k, v, mask, bias)
    return out, (q, k, v, mask, bias, weights, out)


def _attention_core_bwd(grouped, res, d_out):
    q, k, v, mask, bias, weights, out = res
    # rowsum(dW ⊙ W) = dO · O, an N x D product instead of an N x S one.
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
    dv = jnp.einsum(_MIX_T[grouped], weights.astype(v.dtype), d_out.astype(v.dtype))
    dw = jnp.einsum(_SCORES[grouped], d_out, v, preferred_element_type=jnp.float32)
    ds = weights * (dw - delta)  # d loss / d logits; 0 where masked and in fully masked rows
    dq = jnp.einsum(_MIX[grouped], ds.astype(k.dtype), k)
    dk = jnp.einsum(_MIX_T[grouped], ds.astype(q.dtype), q)
    dbias = None if bias is None else _reduce_to(ds, bias.shape).astype(bias.dtype)
    # The mask is boolean: no cotangent.
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, dbias


_attention_core.defvjp(_attention_core_fwd, _attention_core_bwd)


def _chunked_attention_core(grouped, q, k, v, mask, bias):
    """`_attention_core` over blocks of query rows (a `lax.map`), each block's float32
    scores (all heads, all keys) at most XLA_CHUNK_SCORE_BYTES.

    Query rows are independent given all the keys, so this is the same function; what
    changes is memory. The whole (B…, H, N, S) scores (32 MB at B=4, H=8, N=S=512) are
    too big for the allocator to recycle: glibc serves blocks of 32 MB and more from
    mmap and hands them back, so every call page-faults them in anew, which on CPU
    costs more than the attention arithmetic. Blocks of a few MB come from the heap,
    are reused, and stay in cache: on a 2-core CPU the attention runs 1.2-1.5x faster
    forward and 1.1-1.4x forward+backward at N >= 512 than in one block.
    Blocking the query axis, not the heads, keeps every (B…, H) axis whole, so a batch
    sharded over "data" and heads over "model" (`jax_mha.parallel`) stay sharded inside
    the loop without any all-gather (blocks of heads need one per block).

    Layouts as `_attention_core`; N is padded up to a whole number of blocks and the
    padded rows dropped.
    """
    n, s = q.shape[-2], k.shape[-2]
    per_row = math.prod(q.shape[:-2]) * s * 4  # float32 scores of one query row, every head
    rows = max(1, XLA_CHUNK_SCORE_BYTES // max(per_row, 1))
    if rows >= n:
        return _attention_core(grouped, q, k, v, mask, bias)
    num_blocks = -(-n // rows)
    rows = -(-n // num_blocks)  # same block count, fewest padded rows
    pad = num_blocks * rows - n

    def blocks(x, fill):
        """`(…, N, X) -> (num_blocks, …, rows, X)`."""
        if pad:
            x = jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, pad), (0, 0)], constant_values=fill)
        x = x.reshape(x.shape[:-2] + (num_blocks, rows, x.shape[-1]))
        return jnp.moveaxis(x, -3, 0)

    def pairwise(x, fill):
        """(per-block slices, shared array): a mask/bias without a query axis is shared."""
        if x is None:
            return None, None
        return (None, x) if x.shape[-2] == 1 else (blocks(x, fill), None)

    (mask_blocks, mask_shared), (bias_blocks, bias_shared) = pairwise(mask, True), pairwise(bias, 0.0)

    def one(block):
        q_i, mask_i, bias_i = block
        return _attention_core(
            grouped, q_i, k, v,
            mask_shared if mask_i is None else mask_i, bias_shared if bias_i is None else bias_i,
        )

    out = jax.lax.map(one, (blocks(q, 0), mask_blocks, bias_blocks))  # (num_blocks, …, rows, Dv)
    out = jnp.moveaxis(out, 0, -3).reshape(q.shape[:-2] + (num_blocks * rows, v.shape[-1]))
    return out[..., :n, :]


def _xla_attention(q, k, v, mask, bias, scale, dropout_rate, dropout_rng, deterministic, need_weights=True):
    """Plain path: materialises the `(B…, H, N, S)` weights. Returns (out, weights).

    Without dropout and when the caller does not need the weights, the work goes to
    `_chunked_attention_core` (same function, in blocks of queries, with a leaner
    gradient) and `weights` is None.
    """
    *batch, h, n, d = q.shape
    kh, s = k.shape[-3], k.shape[-2]
    groups = h // kh
    grouped = groups > 1
    # Scale q (N·D values) rather than the N·S scores, as flax does: fewer multiplies.
    q = q * jnp.asarray(scale, q.dtype)
    rank = q.ndim  # of (B…, H, N, S)
    if bias is not None:
        bias = jax.lax.broadcast_to_rank(jnp.asarray(bias, jnp.float32), rank)
    if mask is not None:
        mask = jax.lax.broadcast_to_rank(mask, rank)
    if grouped:
        # GQA without repeating k/v: query heads h = kv_head * G + g share kv_head.
        q = q.reshape(*batch, kh, groups, n, d)  # (B…, K, G, N, D)
        to_groups = lambda x: x.reshape(
            x.shape[:-3] + ((kh, groups) if x.shape[-3] != 1 else (1, 1)) + x.shape[-2:]
        )  # (B…, K|1, G|1, N|1, S|1)
        bias = None if bias is None else to_groups(bias)
        mask = None if mask is None else to_groups(mask)
    dropout_active = dropout_rate > 0.0 and not deterministic
    if not (need_weights or dropout_active):
        out = _chunked_attention_core(grouped, q, k, v, mask, bias)
        return out.reshape(*batch, h, n, v.shape[-1]), None  # (B…, H, N, Dv)

    weights = _weights(grouped, q, k, mask, bias)
    if dropout_active:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
        weights = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
    weights = weights.astype(v.dtype)
    out = jnp.einsum(_MIX[grouped], weights, v)
    # (B…, H, N, Dv) and (B…, H, N, S)
    return out.reshape(*batch, h, n, v.shape[-1]), weights.reshape(*batch, h, n, s)


def _cudnn_problem(q, k, v, dropout_active, return_weights) -> str | None:
    """Why the cuDNN fused kernel cannot run these inputs, or None if it can."""
    if jax.default_backend() != "gpu":
        return f"the cudnn implementation needs a GPU backend, this one is {jax.default_backend()!r}"
    if q.dtype not in (jnp.float16, jnp.bfloat16):
        return f"the cudnn implementation needs float16 or bfloat16 inputs, got {q.dtype}"
    d = q.shape[-1]
    if d > 128 or d % 8:
        return f"the cudnn implementation needs head_dim <= 128 and a multiple of 8, got D={d}"
    if v.shape[-1] != d:
        return f"the cudnn implementation needs equal q/k and v head dims, got {d} and {v.shape[-1]}"
    if return_weights:
        return "the cudnn implementation never builds the weights: return_weights=True needs 'xla'"
    if dropout_active:
        return "the cudnn implementation here does not apply dropout: use 'xla'"
    return None


def _cudnn_attention(q, k, v, mask, bias, kv_lengths, is_causal, scale):
    """Delegates to `jax.nn.dot_product_attention(implementation="cudnn")`."""
    *batch, h, n, d = q.shape
    if is_causal and n != k.shape[-2]:
        # jax.nn aligns its causal pattern top-left; ours puts the queries last
        # (causal_mask), so pass it as an explicit mask there.
        mask = _combined_mask(mask, None, True, n, k.shape[-2])
        is_causal = False
    flat = lambda x: jnp.swapaxes(x.reshape(-1, *x.shape[-3:]), -3, -2)  # (B, L, heads, D)
    full = lambda x: None if x is None else jnp.broadcast_to(x, (*batch, h, n, k.shape[-2])).reshape(-1, h, n, k.shape[-2])
    lengths = None if kv_lengths is None else jnp.broadcast_to(kv_lengths, tuple(batch)).reshape(-1).astype(jnp.int32)
    out = jax.nn.dot_product_attention(
        flat(q), flat(k), flat(v), bias=full(bias), mask=full(mask), scale=scale,
        is_causal=is_causal, key_value_seq_lengths=lengths, implementation="cudnn",
    )  # (B, N, H, D)
    return jnp.swapaxes(out, -3, -2).reshape(*batch, h, n, d)


def resolve_implementation(
    q, k, v, *, implementation: str | None = "auto", return_weights: bool = False, dropout: bool = False
) -> str:
    """The path `attention` takes for these inputs: `implementation` itself, or for
    `"auto"`/None the fastest valid one (cuDNN on a GPU when the inputs allow it,
    `"blockwise"` from N·S >= AUTO_BLOCKWISE_MIN_SCORES, else `"xla"`).

    Args:
      q, k, v: arrays or `jax.ShapeDtypeStruct`s shaped as for `attention`.
      implementation: as for `attention`.
      return_weights: whether the caller needs the weights (only `"xla"` builds them).
      dropout: whether dropout on the weights is active.

    Returns:
      One of `"xla"`, `"blockwise"`, `"cudnn"`.

    Raises:
      ValueError: for an unknown implementation name.
    """
    if implementation is None:
        implementation = "auto"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
    if implementation != "auto":
        return implementation
    if _cudnn_problem(q, k, v, dropout, return_weights) is None:
        return "cudnn"
    if not (return_weights or dropout) and q.shape[-2] * k.shape[-2] >= AUTO_BLOCKWISE_MIN_SCORES:
        return "blockwise"
    return "xla"


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    deterministic: bool = True,
    return_weights: bool = False,
    implementation: str | None = "xla",
    kv_lengths: jax.Array | None = None,
    query_block_size: int = 128,
    key_block_size: int = 512,
):
    """Scaled dot-product attention for all heads at once.

    `softmax(q kᵀ · scale + bias, masked) v`, with the softmax in float32 whatever the
    input dtype. Query rows with no key left to attend give zeros (never NaN), in the
    output, the weights and every gradient.

    Args:
      q: `(B…, H, N, D)` queries.
      k: `(B…, K, S, D)` keys, `H % K == 0`; query heads `h*G:(h+1)*G` (G = H // K)
        share key/value head `h` (GQA; `K == 1` is MQA). K/V are never repeated.
      v: `(B…, K, S, Dv)` values.
      mask: bool, broadcastable to `(B…, H, N, S)`; True = may attend.
      bias: float, broadcastable to `(B…, H, N, S)`, added to the logits.
      is_causal: AND the `causal_mask(N, S)` pattern into the mask.
      scale: logit scale, default `1/sqrt(D)`.
      dropout_rate: dropout on the attention weights, applied only when
        `deterministic=False`.
      dropout_rng: PRNG key, required when dropout is active.
      deterministic: disables dropout.
      return_weights: also return the weights (after dropout, as applied to `v`).
      implementation: `"xla"` (materialises the weights), `"blockwise"` (online
        softmax, memory linear in N; see `jax_mha.blockwise`), `"cudnn"` (fused GPU
        kernel via `jax.nn.dot_product_attention`), or `"auto"`/None (the fastest
        valid one).
      kv_lengths: int, broadcastable to `(B…)`: the number of valid keys of each
        sequence (a padding mask that the blockwise path never materialises).
      query_block_size, key_block_size: block sizes of the blockwise path.

    Returns:
      `out (B…, H, N, Dv)` in `q`'s dtype, or `(out, weights (B…, H, N, S))` when
      `return_weights=True`.

    Raises:
      ValueError: on inconsistent shapes (naming them), a mask or bias that does not
        broadcast, an unknown implementation or one that cannot run these inputs, or
        dropout requested without `dropout_rng`.
    """
    h, kh, n, s = _check_inputs(q, k, v, mask, bias, kv_lengths)
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
    dropout_active = dropout_rate > 0.0 and not deterministic
    if dropout_active and dropout_rng is None:
        raise ValueError(
            f"dropout_rate={dropout_rate} with deterministic=False needs a dropout_rng key"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    implementation = resolve_implementation(
        q, k, v, implementation=implementation, return_weights=return_weights, dropout=dropout_active
    )

    if implementation == "cudnn":
        problem = _cudnn_problem(q, k, v, dropout_active, return_weights)
        if problem is not None:
            raise ValueError(problem)
        return _cudnn_attention(q, k, v, mask, bias, kv_lengths, is_causal, scale)

    if implementation == "blockwise":
        if return_weights:
            raise ValueError(
                "return_weights=True needs implementation='xla': the blockwise path "
                "exists to never build the (B…, H, N, S) weights"
            )
        if dropout_active:
            raise ValueError("dropout on the weights is not supported by implementation='blockwise'; use 'xla'")
        return blockwise_attention(
            q, k, v, mask=mask, bias=bias, kv_lengths=kv_lengths, is_causal=is_causal,
            scale=scale, query_block_size=query_block_size, key_block_size=key_block_size,
        )

    full_mask = _combined_mask(mask, kv_lengths, is_causal, n, s)
    out, weights = _xla_attention(
        q, k, v, full_mask, bias, scale, dropout_rate, dropout_rng, deterministic, need_weights=return_weights
    )
    out = out.astype(q.dtype)
    return (out, weights) if return_weights else out
