"""Head types, measured: previous-token, induction and first-token ("sink") heads.

Every score is a pure function of causal self-attention weights
`(num_layers, B, H, T, T)` (what `jax_mha.lab.analysis.attention_weights` returns) and,
for induction, the tokens that produced them; no model is needed, so any model's
weights plug in. Scores are means over query positions `t >= 1` (query 0 can only
attend to itself, which would count for every pattern) and over the batch, giving one
number per head, `(num_layers, H)`. The score functions are jittable; the classifier
and the table are NumPy (they return strings).

- previous-token score: mean weight on key `t - 1`.
- induction score (Olsson et al. 2022, "In-context learning and induction heads"):
  mean weight from a query whose token occurred earlier to the key right after that
  earlier occurrence. Measured on repeated random tokens (`repeated_random_tokens`),
  where the second copy of each token has exactly one earlier occurrence and no model
  can predict it except by looking back.
- first-token score: mean weight on key 0, the "attention sink" (Xiao et al. 2023).
- mean entropy of each query's attention (nats, `jax_mha.attention_entropy`), and the
  same normalised by uniform causal attention over the same queries (1.0 = uniform).

A head's type is the pattern with the highest score among those that pass their
threshold; a head that passes none is "diffuse" if its normalised entropy passes
`DIFFUSE_THRESHOLD`, else "other".
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jax_mha.functional import attention_entropy
from jax_mha.nn.linen import MultiHeadAttention

# More than half of a head's attention, averaged over queries, on the one key the
# pattern names: that key then outweighs all other keys together, so the pattern is
# what the head mainly does. Chance is far below: uniform causal attention over T = 128
# keys puts (ln T)/T ~ 0.03 on any one pattern key.
INDUCTION_THRESHOLD = 0.5
PREVIOUS_TOKEN_THRESHOLD = 0.5
FIRST_TOKEN_THRESHOLD = 0.5
# Normalised entropy at least that of uniform attention over half the visible keys
# (1 - ln 2 / mean ln(t + 1) ~ 0.82 at T = 128): a head that spreads its weight too
# widely to be reading any one position.
DIFFUSE_THRESHOLD = 0.8

PATTERNS = ("induction", "previous_token", "first_token")  # ties go to the earlier (more specific) one
HEAD_TYPES = PATTERNS + ("diffuse", "other")
_THRESHOLDS = {
    "induction": INDUCTION_THRESHOLD,
    "previous_token": PREVIOUS_TOKEN_THRESHOLD,
    "first_token": FIRST_TOKEN_THRESHOLD,
    "diffuse": DIFFUSE_THRESHOLD,
}
_MIN_INDUCTION_GAP = 3  # an earlier occurrence at t-1 or t-2 makes the "next key" the query or key t-1


class HeadScores(NamedTuple):
    """Every score of every head, each `(num_layers, H)` float32 (a pytree: jit returns it)."""

    previous_token: jax.Array
    induction: jax.Array
    first_token: jax.Array
    entropy: jax.Array  # mean nats per query
    normalized_entropy: jax.Array  # entropy / that of uniform causal attention on the same queries


def _concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _check_weights(weights: jax.Array, name: str = "weights") -> tuple[int, int, int, int]:
    """Returns `(L, B, H, T)`; ValueError naming the shape unless causal self-attention weights."""
    if weights.ndim != 5 or weights.shape[-1] != weights.shape[-2]:
        raise ValueError(f"{name} must have shape (num_layers, B, H, T, T), got {weights.shape}")
    if not jnp.issubdtype(weights.dtype, jnp.floating):
        raise ValueError(f"{name} must be floating point, got dtype {weights.dtype}")
    if weights.shape[-1] < 2:
        raise ValueError(f"{name} has T={weights.shape[-1]}: scores need T >= 2 (query 0 is excluded)")
    return weights.shape[:4]


def _check_batch_array(x, shape: tuple[int, int], name: str) -> jax.Array:
    x = jnp.asarray(x)
    if x.shape != shape:
        raise ValueError(f"{name} must have shape (B, T)={shape}, got {x.shape}")
    return x


def _query_mean(values: jax.Array, keep: jax.Array, what: str) -> jax.Array:
    """Mean of `values (L, B, H, T)` over batch and the queries where `keep (B, T)`; `(L, H)`.

    With no query kept the mean is undefined: ValueError for concrete input, NaN under jit.
    """
    w = keep.astype(jnp.float32)[None, :, None, :]  # (1, B, 1, T)
    count = jnp.sum(keep)
    if _concrete(count) and int(count) == 0:
        raise ValueError(f"no query to average the {what} over (every query is masked out or excluded)")
    return jnp.sum(values.astype(jnp.float32) * w, axis=(1, 3)) / count


def _keep(batch: int, t: int, query_mask) -> jax.Array:
    """Queries t >= 1, AND-ed with `query_mask (B, T)` if given; bool `(B, T)`."""
    keep = jnp.broadcast_to(jnp.arange(t) >= 1, (batch, t))
    if query_mask is None:
        return keep
    mask = _check_batch_array(query_mask, (batch, t), "query_mask")
    if mask.dtype != jnp.bool_:
        raise ValueError(f"query_mask must be bool, got dtype {mask.dtype}")
    return keep & mask


def previous_token_score(weights: jax.Array, query_mask: jax.Array | None = None) -> jax.Array:
    """Mean weight on key `t - 1`, over queries `t >= 1` (and `query_mask`).

    Args:
      weights: `(num_layers, B, H, T, T)` causal self-attention weights.
      query_mask: optional bool `(B, T)`, the queries to average over (e.g. not padding).

    Returns:
      float32 `(num_layers, H)` in [0, 1]: 1.0 for a head that always reads the previous key.

    Raises:
      ValueError: naming the shape or dtype of a bad argument.
    """
    _, b, _, t = _check_weights(weights)
    previous = jnp.diagonal(weights, offset=-1, axis1=-2, axis2=-1)  # (L, B, H, T-1): query t+1, key t
    previous = jnp.pad(previous, [(0, 0)] * 3 + [(1, 0)])  # (L, B, H, T): query 0 has none
    return _query_mean(previous, _keep(b, t, query_mask), "previous-token score")


def first_token_score(weights: jax.Array, query_mask: jax.Array | None = None) -> jax.Array:
    """Mean weight on key 0 (the attention sink), over queries `t >= 1`; `(num_layers, H)`.

    Args, Raises: as `previous_token_score`.
    """
    _, b, _, t = _check_weights(weights)
    return _query_mean(weights[..., 0], _keep(b, t, query_mask), "first-token score")


def mean_entropy(weights: jax.Array, query_mask: jax.Array | None = None) -> jax.Array:
    """Mean attention entropy in nats over queries `t >= 1`; `(num_layers, H)`.

    Args, Raises: as `previous_token_score`.
    """
    _, b, _, t = _check_weights(weights)
    return _query_mean(attention_entropy(weights), _keep(b, t, query_mask), "entropy")


def normalized_entropy(weights: jax.Array, query_mask: jax.Array | None = None) -> jax.Array:
    """`mean_entropy` divided by that of uniform causal attention on the same queries.

    Query `t` of uniform causal attention has entropy `ln(t + 1)`, the most it can have,
    so the result is in [0, 1]: 1.0 uniform, 0.0 one key per query. Dividing makes heads
    comparable across sequence lengths. `(num_layers, H)`; Args, Raises as
    `previous_token_score`.
    """
    l, b, h, t = _check_weights(weights)
    keep = _keep(b, t, query_mask)
    uniform = jnp.broadcast_to(jnp.log1p(jnp.arange(t, dtype=jnp.float32)), (1, b, 1, t))
    return mean_entropy(weights, query_mask) / _query_mean(uniform, keep, "entropy")


def induction_targets(tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """For each query, the key right after the most recent earlier occurrence of its token.

    Only occurrences at least 3 positions back count: at `t - 1` the "next key" would be
    the query itself, at `t - 2` it would be key `t - 1`, which `previous_token_score`
    measures; so a pure previous-token head scores exactly 0 on induction.

    Args:
      tokens: int `(B, T)`.

    Returns:
      `(target, has)`: int32 `(B, T)` key index (0 where none) and bool `(B, T)`, True
      where the query's token occurred at least 3 positions earlier.
    """
    t = tokens.shape[-1]
    pos = jnp.arange(t)
    early_enough = pos[None, :] <= pos[:, None] - _MIN_INDUCTION_GAP  # (Tq, Tk)
    same = (tokens[:, :, None] == tokens[:, None, :]) & early_enough[None]  # (B, Tq, Tk)
    recent = jnp.max(jnp.where(same, pos[None, None, :], -1), axis=-1)  # (B, Tq)
    has = recent >= 0
    return jnp.where(has, recent + 1, 0).astype(jnp.int32), has


def induction_score(weights: jax.Array, tokens: jax.Array, query_mask: jax.Array | None = None) -> jax.Array:
    """Mean weight on the key after the most recent earlier occurrence of the query's token.

    Averaged over the queries whose token did occur at least 3 positions earlier (see
    `induction_targets`) and `query_mask`. On `repeated_random_tokens` these are the
    second copy's queries, and the key is the one after the token's first occurrence.

    Args:
      weights: `(num_layers, B, H, T, T)`, computed on `tokens`.
      tokens: int `(B, T)`.
      query_mask: optional bool `(B, T)`.

    Returns:
      float32 `(num_layers, H)` in [0, 1].

    Raises:
      ValueError: naming a bad shape or dtype, or (for concrete input) if no token recurs.
    """
    l, b, h, t = _check_weights(weights)
    tokens = _check_batch_array(tokens, (b, t), "tokens")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be integer ids, got dtype {tokens.dtype}")
    target, has = induction_targets(tokens)
    index = jnp.broadcast_to(target[None, :, None, :, None], (l, b, h, t, 1))
    values = jnp.take_along_axis(weights, index, axis=-1)[..., 0]  # (L, B, H, T)
    return _query_mean(values, _keep(b, t, query_mask) & has, "induction score")


def repeated_random_tokens(
    key: jax.Array, batch_size: int, repeat_length: int, vocab_size: int, *, low: int = 0, prefix=None
) -> jax.Array:
    """`prefix`, then R random tokens, then the same R again: the induction-head probe.

    The R tokens of a row are distinct (drawn without replacement from `[low,
    vocab_size)`), so each second-copy token has exactly one earlier occurrence in the
    copies and its successor there is the only way to predict the next token.
    Jittable with the sizes static.

    Args:
      key: PRNG key.
      batch_size: B.
      repeat_length: R, at least 3 (see `induction_targets`) and at most `vocab_size - low`.
      vocab_size: ids are `< vocab_size`.
      low: the smallest id drawn, e.g. the first content symbol (skipping PAD, BOS…).
      prefix: optional int `(P,)` put before every row (e.g. a BOS id, or real text).

    Returns:
      int32 `(B, P + 2R)`.

    Raises:
      ValueError: naming a size out of range, or a prefix id outside `[0, vocab_size)`.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if not 0 <= low < vocab_size:
        raise ValueError(f"low={low} must be in [0, vocab_size={vocab_size})")
    if not _MIN_INDUCTION_GAP <= repeat_length <= vocab_size - low:
        raise ValueError(
            f"repeat_length={repeat_length} must be in [{_MIN_INDUCTION_GAP}, vocab_size - low = {vocab_size - low}]"
        )
    prefix = jnp.zeros((0,), jnp.int32) if prefix is None else jnp.asarray(prefix)
    if prefix.ndim != 1 or not jnp.issubdtype(prefix.dtype, jnp.integer):
        raise ValueError(f"prefix must be a 1-D integer array, got shape {prefix.shape} dtype {prefix.dtype}")
    if _concrete(prefix) and prefix.size and not (0 <= int(prefix.min()) and int(prefix.max()) < vocab_size):
        raise ValueError(f"prefix ids {np.asarray(prefix).tolist()} must be in [0, vocab_size={vocab_size})")
    # The first R of a random permutation per row: distinct tokens.
    order = jnp.argsort(jax.random.uniform(key, (batch_size, vocab_size - low)), axis=1)
    seq = (order[:, :repeat_length] + low).astype(jnp.int32)  # (B, R)
    head = jnp.broadcast_to(prefix.astype(jnp.int32), (batch_size, prefix.shape[0]))
    return jnp.concatenate([head, seq, seq], axis=1)


def head_scores(
    text_weights: jax.Array,
    induction_weights: jax.Array,
    induction_tokens: jax.Array,
    *,
    text_query_mask: jax.Array | None = None,
) -> HeadScores:
    """Every score of every head; jittable.

    Args:
      text_weights: `(num_layers, B, H, T, T)` on the model's own data (e.g. validation
        text): previous-token, first-token and entropy scores come from these.
      induction_weights: `(num_layers, B', H, T', T')` on `induction_tokens`.
      induction_tokens: int `(B', T')`, usually `repeated_random_tokens`.
      text_query_mask: optional bool `(B, T)` for `text_weights`.

    Returns:
      `HeadScores`, each field `(num_layers, H)`. Pass the same weights and tokens twice
      to measure everything on one batch.

    Raises:
      ValueError: if the two weights disagree in layers or heads, or as the scores do.
    """
    layers_and_heads = lambda w: (w.shape[0], w.shape[2]) if w.ndim == 5 else w.shape
    if layers_and_heads(text_weights) != layers_and_heads(induction_weights):
        raise ValueError(
            f"text_weights {text_weights.shape} and induction_weights {induction_weights.shape} "
            "must have the same num_layers and H (axes 0 and 2)"
        )
    return HeadScores(
        previous_token=previous_token_score(text_weights, text_query_mask),
        induction=induction_score(induction_weights, induction_tokens),
        first_token=first_token_score(text_weights, text_query_mask),
        entropy=mean_entropy(text_weights, text_query_mask),
        normalized_entropy=normalized_entropy(text_weights, text_query_mask),
    )


def _thresholds(overrides: dict[str, float]) -> dict[str, float]:
    unknown = sorted(set(overrides) - set(_THRESHOLDS))
    if unknown:
        raise ValueError(f"unknown thresholds {unknown}; known: {sorted(_THRESHOLDS)}")
    merged = {**_THRESHOLDS, **overrides}
    for name, value in merged.items():
        if not 0.0 < value <= 1.0:
            raise ValueError(f"threshold {name}={value} must be in (0, 1]")
    return merged


def classify_heads(scores: HeadScores, **thresholds: float) -> np.ndarray:
    """Each head's type: its highest-scoring pattern among those at or above threshold.

    Args:
      scores: `HeadScores`, fields `(num_layers, H)`.
      **thresholds: overrides of the defaults, by type name: `induction`,
        `previous_token`, `first_token` (attention fractions) and `diffuse` (normalised
        entropy); each in (0, 1].

    Returns:
      str array `(num_layers, H)` of `HEAD_TYPES`: a pattern name; else "diffuse" when
      `normalized_entropy >= diffuse`; else "other". Ties go to the earlier of `PATTERNS`.

    Raises:
      ValueError: naming an unknown or out-of-range threshold, or a head whose score is NaN.
    """
    limits = _thresholds(thresholds)
    fields = {name: np.asarray(getattr(scores, name), np.float64) for name in PATTERNS + ("normalized_entropy",)}
    for name, values in fields.items():
        if np.isnan(values).any():
            layer, head = np.argwhere(np.isnan(values))[0]
            raise ValueError(f"{name} score of layer {layer} head {head} is NaN; cannot classify")
    pattern = np.stack([fields[p] for p in PATTERNS])  # (P, L, H)
    passing = pattern >= np.array([limits[p] for p in PATTERNS])[:, None, None]
    best = np.argmax(np.where(passing, pattern, -np.inf), axis=0)  # (L, H)
    fallback = np.where(fields["normalized_entropy"] >= limits["diffuse"], "diffuse", "other")
    return np.where(passing.any(axis=0), np.array(PATTERNS)[best], fallback)


def head_type_table(scores: HeadScores, labels: np.ndarray | None = None) -> list[dict]:
    """One row per head, layer-major: `layer`, `head`, `type` and every score as a float.

    Args:
      scores: `HeadScores`, fields `(num_layers, H)`.
      labels: str `(num_layers, H)`, default `classify_heads(scores)`.

    Returns:
      list of `num_layers * H` dicts, JSON-ready.
    """
    labels = classify_heads(scores) if labels is None else np.asarray(labels)
    values = {name: np.asarray(v, np.float64) for name, v in scores._asdict().items()}
    if labels.shape != values["induction"].shape:
        raise ValueError(f"labels have shape {labels.shape}, scores {values['induction'].shape}")
    return [
        {"layer": int(l), "head": int(h), "type": str(labels[l, h]), **{k: float(v[l, h]) for k, v in values.items()}}
        for l, h in np.ndindex(*labels.shape)
    ]


def count_head_types(labels: np.ndarray) -> dict[str, int]:
    """How many heads of each type, every type listed (zeros included), in `HEAD_TYPES` order.

    Raises:
      ValueError: naming a label that is not one of `HEAD_TYPES`.
    """
    labels = np.asarray(labels).ravel().tolist()
    unknown = sorted(set(labels) - set(HEAD_TYPES))
    if unknown:
        raise ValueError(f"unknown head types {unknown}; known: {list(HEAD_TYPES)}")
    return {name: labels.count(name) for name in HEAD_TYPES}


# ----------------------------------------------------------------- induction, copying, in-context learning
#
# The probe of `induction_score` drew its tokens from the whole vocabulary; on the
# reference corpus many characters are rare in training (counted in
# docs/results/induction.md, "What is measured"), so their embeddings are barely
# trained and a real induction head can fail to show.
# These scores run on two probes that avoid that: repeated sequences of *frequent*
# characters, and repeated *real* held-out spans; each is a row `x x` (R tokens,
# twice), optionally after a prefix. They also measure what attention should cause
# (the copying effect: lower loss on the second copy) and the in-context-learning
# score of Olsson et al. 2022 on ordinary held-out text.

ICL_EARLY = (8, 16)  # query positions of the "early" loss: a few characters of context
ICL_LATE_FROM_END = 16  # the "late" loss: the last 16 positions of a window


def frequent_symbols(train_ids, vocab_size: int, count: int) -> np.ndarray:
    """The `count` most frequent ids of `train_ids` (ties by id), int32 `(count,)`.

    Raises:
      ValueError: if fewer than `count` distinct ids occur.
    """
    counts = np.bincount(np.asarray(train_ids).ravel(), minlength=vocab_size)
    if int((counts > 0).sum()) < count:
        raise ValueError(f"only {int((counts > 0).sum())} distinct ids occur, fewer than count={count}")
    return np.argsort(-counts, kind="stable")[:count].astype(np.int32)


def repeated_symbols(key: jax.Array, batch_size: int, repeat_length: int, symbols, prefix=None) -> jax.Array:
    """`prefix`, then R distinct tokens drawn from `symbols`, then the same R again.

    Args:
      key: PRNG key.
      batch_size: B.
      repeat_length: R <= len(symbols).
      symbols: int `(S,)`, the ids to draw from (e.g. `frequent_symbols`).
      prefix: optional int `(P,)` before every row.

    Returns:
      int32 `(B, P + 2R)`.

    Raises:
      ValueError: if R is not in [2, len(symbols)].
    """
    symbols = jnp.asarray(symbols, jnp.int32)
    if not 2 <= repeat_length <= symbols.shape[0]:
        raise ValueError(f"repeat_length={repeat_length} must be in [2, len(symbols)={symbols.shape[0]}]")
    order = jnp.argsort(jax.random.uniform(key, (batch_size, symbols.shape[0])), axis=1)[:, :repeat_length]
    seq = symbols[order]  # (B, R)
    prefix = jnp.zeros((0,), jnp.int32) if prefix is None else jnp.asarray(prefix, jnp.int32)
    head = jnp.broadcast_to(prefix, (batch_size, prefix.shape[0]))
    return jnp.concatenate([head, seq, seq], axis=1)


def repeated_spans(tokens, batch_size: int, repeat_length: int) -> np.ndarray:
    """Real text twice: `batch_size` spans of R characters at evenly spaced offsets of
    `tokens` (e.g. the validation split), each followed by itself. int32 `(B, 2R)`.

    Raises:
      ValueError: if `tokens` is shorter than R.
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or tokens.shape[0] < repeat_length or repeat_length < 2:
        raise ValueError(f"need 1-D tokens of at least R={repeat_length} >= 2 ids, got shape {tokens.shape}")
    starts = np.linspace(0, tokens.shape[0] - repeat_length, batch_size).round().astype(np.int64)
    spans = np.stack([tokens[s : s + repeat_length] for s in starts]).astype(np.int32)
    return np.concatenate([spans, spans], axis=1)


def _repeat_queries(t: int, repeat_length: int, prefix_length: int) -> tuple[jax.Array, jax.Array]:
    """For a row `prefix x x` of length t: bool `(T,)` second-copy queries and int32
    `(T,)` the key each should read, the position after its token's first occurrence."""
    pos = jnp.arange(t)
    second = (pos >= prefix_length + repeat_length) & (pos < prefix_length + 2 * repeat_length)
    return second, jnp.where(second, pos - repeat_length + 1, 0).astype(jnp.int32)


def prefix_matching_score(weights: jax.Array, repeat_length: int, prefix_length: int = 0) -> jax.Array:
    """Mean weight of each head, over second-copy queries, on the key right after the
    query's token in the first copy (Olsson et al. 2022's prefix matching).

    Unlike `induction_score` the target is fixed by position, so it holds on real
    spans whose characters repeat inside a copy.

    Args:
      weights: `(num_layers, B, H, T, T)` on rows `prefix x x` (`T >= P + 2R`).
      repeat_length: R.
      prefix_length: P.

    Returns:
      float32 `(num_layers, H)` in [0, 1].

    Raises:
      ValueError: for bad weights, or rows shorter than P + 2R.
    """
    l, b, h, t = _check_weights(weights)
    if prefix_length + 2 * repeat_length > t or repeat_length < 2:
        raise ValueError(f"rows of T={t} cannot hold prefix {prefix_length} + 2 x {repeat_length}")
    second, target = _repeat_queries(t, repeat_length, prefix_length)
    index = jnp.broadcast_to(target[None, None, None, :, None], (l, b, h, t, 1))
    values = jnp.take_along_axis(weights, index, axis=-1)[..., 0]  # (L, B, H, T)
    return _query_mean(values, jnp.broadcast_to(second, (b, t)), "prefix-matching score")


def prefix_matching_chance(repeat_length: int, prefix_length: int = 0) -> float:
    """The score uniform causal attention gets: the mean of 1 / (t + 1) over the
    second-copy queries t; a head is 'above chance' by its ratio to this."""
    t = np.arange(prefix_length + repeat_length, prefix_length + 2 * repeat_length)
    return float(np.mean(1.0 / (t + 1)))


def token_losses(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Next-token cross-entropy (nats) at every position but the last: `(B, T - 1)`."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def copying_effect(logits: jax.Array, tokens: jax.Array, repeat_length: int, prefix_length: int = 0) -> dict:
    """Mean loss predicting the first copy vs the second copy of rows `prefix x x`.

    The first token of each copy is excluded (nothing can predict it). A model that
    copies has a much lower second-copy loss; `copying = first - second` (nats) is
    positive by that much.

    Args:
      logits: `(B, T, V)` on `tokens`; tokens: int `(B, T)`.

    Returns:
      dict of scalars `first_copy_loss`, `second_copy_loss`, `copying`.
    """
    nll = token_losses(logits, tokens)  # position t predicts token t + 1
    pos = jnp.arange(nll.shape[1])
    p, r = prefix_length, repeat_length
    first = (pos >= p) & (pos < p + r - 1)  # predicting x_2 … x_R of the first copy
    second = (pos >= p + r) & (pos < p + 2 * r - 1)  # … of the second copy
    mean = lambda m: jnp.sum(nll * m[None, :]) / (nll.shape[0] * jnp.sum(m))
    f, s = mean(first), mean(second)
    return {"first_copy_loss": f, "second_copy_loss": s, "copying": f - s}


def icl_score(nll: jax.Array, early: tuple[int, int] = ICL_EARLY, late_from_end: int = ICL_LATE_FROM_END) -> jax.Array:
    """Olsson et al. 2022's in-context-learning score: mean loss at late positions minus
    mean loss at early positions of held-out text (nats; negative = the context helps).

    Their version compares token 500 with token 50; windows here are shorter, so the
    early positions are `early` (default 8 … 15) and the late ones the last
    `late_from_end` of the window.

    Args:
      nll: `(B, T)` per-position losses (e.g. `token_losses` or the eval cross-entropy).

    Raises:
      ValueError: if the window is too short for the two ranges not to overlap.
    """
    t = nll.shape[-1]
    if not 0 <= early[0] < early[1] <= t - late_from_end:
        raise ValueError(f"a window of {t} positions cannot hold early {early} before the last {late_from_end}")
    return nll[:, t - late_from_end :].mean() - nll[:, early[0] : early[1]].mean()


def logits_and_attention_weights(logits_fn, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Runs `logits_fn(tokens)` and also returns every attention layer's weights.

    For code that only holds a logits function (a task's `eval_metrics` gets the
    trainer's `Decoding.logits`): flax's `intercept_methods` asks each
    `MultiHeadAttention` call for its weights on the way, so the probe needs no second
    model and the trainer no change. Layers come back in call order.

    Args:
      logits_fn: int `(B, T)` -> float `(B, T, V)`, a `Decoder` applied to its params.
      tokens: int `(B, T)`.

    Returns:
      `(logits (B, T, V), weights (num_layers, B, H, T, T))`.
    """
    captured = []

    def interceptor(next_fun, args, kwargs, context):
        if not (isinstance(context.module, MultiHeadAttention) and context.method_name == "__call__"):
            return next_fun(*args, **kwargs)
        out, weights = next_fun(*args, **{**kwargs, "return_weights": True})
        captured.append(weights)
        return (out, weights) if kwargs.get("return_weights") else out

    with nn.intercept_methods(interceptor):
        logits = logits_fn(tokens)
    return logits, jnp.stack(captured)
