"""Real text with no download: a character-level corpus and its next-character batches.

The default corpus is the Python Language Reference that every Python installation
ships for `help()`: `pydoc_data.topics.topics`, a dict of 79 topics (on Python 3.11,
464,970 characters of English prose, grammar and code examples). It is always present,
needs no network, and is real sentences a person can read in an attention map. The
exact size depends on the Python version; `TextCorpus.source` records which one.

Split. The reference is split *by topic* so that the validation text is unseen, not
merely a different window of the same paragraph: topics are visited in the order of
`zlib.crc32` of their names (stable across runs and platforms, unlike `hash`), and a
topic joins the validation split if it still fits under `validation_fraction` of all
characters; the rest is training text. With the default 0.1 that holds out 22 topics,
about 10 % of the characters. A user's own file (`--text FILE`) has no topics: its
last `validation_fraction` of characters is the validation split (nanoGPT's
convention). Topics (or the file's two parts) are joined with a newline.

Vocabulary: characters, not bytes. Every token is one character a person can read on
the axes of an attention map, the evaluation is then exactly bits per *character*
(issue 10), and the vocabulary stays small (103 symbols for the reference) where bytes
would need 256 and split the curly quotes of the reference into three tokens each. The
vocabulary is the sorted set of characters of the whole text (both splits), as in
char-rnn and nanoGPT's `shakespeare_char`: only the character set is shared with the
validation split, never its text, and every validation character has an id. Files are
read as UTF-8 (a byte-order mark is dropped, line endings become `\\n`), so any text
file works; a file that is not UTF-8 is an error naming the file and the byte.

Batches have the copy task's layout (`jax_mha.lab.data.make_batch`): int32 `inputs (B, T)`,
int32 `targets (B, T)` = the next characters, bool `scored (B, T)`, so the same trainer
and `scored_loss` consume them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import zlib
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

REFERENCE_SOURCE = "pydoc_data.topics"  # TextCorpus.source prefix of the default corpus


@dataclasses.dataclass(frozen=True)
class TextTaskConfig:
    """Which text and how long a window; hashable, so it can be a static jit argument.

    Also the character language-model task the trainer consumes (`jax_mha.lab.data.Task`,
    registered as "lm"): `batch` samples training windows, `eval_batch` takes evenly
    spaced validation windows and `eval_metrics` reports validation bits per character
    (`bpc`). Its corpus is loaded once per config and cached (`corpus`), never per step.
    """

    name: ClassVar[str] = "lm"
    # No early stopping: a language model has no "solved" accuracy; it trains its budget.
    stop_metric: ClassVar[str | None] = None

    seq_len: int = 128  # T, characters per window: ~2.5 lines of the reference (52 characters a line)
    validation_fraction: float = 0.1  # share of characters held out: 46,437 of the reference (22 of its 79 topics)
    text_file: str | None = None  # None: the Python Language Reference; else a UTF-8 file (--text FILE)
    # Also measure, at every evaluation, the induction evidence of `induction_metrics`
    # (prefix matching, copying, ICL score), so a phase change shows in the curves.
    track_induction: bool = False

    def __post_init__(self):
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, numbers.Integral):
            raise TypeError(f"seq_len must be an int, got {self.seq_len!r}")
        if self.seq_len < 1:
            raise ValueError(f"seq_len={self.seq_len} must be >= 1")
        if not 0.0 < self.validation_fraction < 1.0:
            raise ValueError(f"validation_fraction={self.validation_fraction} must be in (0, 1)")
        if self.text_file is not None and (not isinstance(self.text_file, str) or not self.text_file):
            raise ValueError(f"text_file={self.text_file!r} must be None or a non-empty path")

    @property
    def min_split_chars(self) -> int:
        """Characters each split needs: one window of T inputs plus its last target."""
        return self.seq_len + 1

    @property
    def corpus(self) -> TextCorpus:
        """The corpus, loaded on first use and cached per config (`cached_corpus`)."""
        return cached_corpus(self)

    @property
    def vocab_size(self) -> int:
        return self.corpus.vocab_size

    def batch(self, key: jax.Array, batch_size: int) -> dict[str, jax.Array]:
        """Random training windows, `make_text_batch` on `corpus.train`; jittable.

        Inside jit the training ids become a constant of the program (4 bytes a
        character: 1.7 MB for the reference), built once per compilation.
        """
        return make_text_batch(key, jnp.asarray(self.corpus.train), self, batch_size)

    def eval_batch(self, key: jax.Array, batch_size: int) -> dict[str, jax.Array]:
        """`batch_size` validation windows at evenly spaced offsets over the whole
        validation split (every held-out topic is sampled); deterministic, `key` unused.

        Returns:
          int32 `inputs (B, T)`, int32 `targets (B, T)`, bool `scored (B, T)` (all True).
        """
        del key
        _check_tokens(jnp.asarray(self.corpus.validation), self, batch_size, "validation")
        tokens = np.asarray(self.corpus.validation)
        t = self.seq_len
        starts = np.linspace(0, tokens.shape[0] - t - 1, batch_size).round().astype(np.int64)
        rows = np.stack([tokens[s : s + t + 1] for s in starts]).astype(np.int32)  # (B, T+1)
        return {"inputs": jnp.asarray(rows[:, :-1]), "targets": jnp.asarray(rows[:, 1:]),
                "scored": jnp.ones((batch_size, t), bool)}

    def eval_metrics(self, decoding, logits: jax.Array, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """`bpc`: mean cross-entropy over scored characters in bits (teacher forced).

        Args:
          decoding: unused (bits per character need no decoding).
          logits: float `(B, T, V)`; batch: `targets (B, T)`, `scored (B, T)`.
        """
        metrics = {"bpc": scored_nats(logits, batch) / math.log(2.0)}
        if self.track_induction:
            metrics.update(induction_metrics(self, getattr(decoding, "logits", decoding), logits, batch))
        return metrics


PROBE_ROWS = 32  # rows of each induction probe at every evaluation
PROBE_KEY = 2**31 - 3  # the frequent-character probe's key: fixed, apart from training and the eval windows


def probe_repeat_length(seq_len: int) -> int:
    """R of the induction probes: half the window, at most 32 (so that 2R distinct
    frequent characters exist in a 103-symbol corpus)."""
    return max(2, min(seq_len // 2, 32))


@functools.lru_cache(maxsize=8)
def induction_probes(config: TextTaskConfig) -> dict[str, np.ndarray]:
    """The two probes, int32 `(PROBE_ROWS, 2R)` each: `frequent` (R distinct characters
    drawn from the 2R most frequent training characters, then again) and `spans`
    (repeated real validation spans). Deterministic for a config, built once."""
    from jax_mha.lab import head_types  # here: head_types imports nothing of text, but keep text cheap to import

    corpus, r = config.corpus, probe_repeat_length(config.seq_len)
    pool = head_types.frequent_symbols(corpus.train, corpus.vocab_size, min(2 * r, int((np.bincount(corpus.train) > 0).sum())))
    # NumPy, not jax.random: this runs while the trainer's evaluation is being traced.
    rng = np.random.default_rng(PROBE_KEY)
    seq = np.stack([rng.permutation(pool)[: min(r, pool.size)] for _ in range(PROBE_ROWS)]).astype(np.int32)
    return {"frequent": np.concatenate([seq, seq], axis=1),
            "spans": head_types.repeated_spans(corpus.validation, PROBE_ROWS, r)}


def induction_metrics(config: TextTaskConfig, logits_fn, logits: jax.Array, batch: dict[str, jax.Array]) -> dict:
    """Induction evidence of a model, for `eval_metrics`; jittable.

    Returns:
      `icl_score` (nats, late minus early positions of the eval windows; negative =
      the context helps), and for each probe P in (frequent, spans):
      `prefix_matching_P` `(num_layers, H)`, `copying_P` (first- minus second-copy
      loss, nats), `second_copy_loss_P`; plus `prefix_matching_chance` (uniform attention's score).
    """
    from jax_mha.lab import head_types
    from jax_mha.lab.models import logits_and_attention_weights

    t = logits.shape[1]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]  # (B, T)
    early = (max(1, t // 16), max(2, t // 8))
    out = {"icl_score": head_types.icl_score(nll, early, max(1, t // 8))}
    for name, probe in induction_probes(config).items():
        r = probe.shape[1] // 2
        probe_logits, weights = logits_and_attention_weights(logits_fn, jnp.asarray(probe))
        copying = head_types.copying_effect(probe_logits, jnp.asarray(probe), r)
        out[f"prefix_matching_{name}"] = head_types.prefix_matching_score(weights, r)
        out[f"copying_{name}"] = copying["copying"]
        out[f"second_copy_loss_{name}"] = copying["second_copy_loss"]
    out["prefix_matching_chance"] = jnp.float32(head_types.prefix_matching_chance(probe_repeat_length(t)))
    return out


def scored_nats(logits: jax.Array, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean cross-entropy (nats) over scored positions: logits `(B, T, V)` -> scalar."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]  # (B, T)
    weight = batch["scored"].astype(jnp.float32)
    return (nll * weight).sum() / jnp.maximum(weight.sum(), 1.0)


@dataclasses.dataclass(frozen=True, eq=False)
class TextCorpus:
    """A character corpus split into training and validation token arrays.

    Attributes:
      vocabulary: the characters in id order (id `i` is `vocabulary[i]`), sorted.
      train: int32 `(num_train_chars,)`, the training split as ids.
      validation: int32 `(num_validation_chars,)`, the held-out split as ids.
      source: where the text came from, e.g. "pydoc_data.topics (Python 3.11.7)".
      validation_topics: the held-out topic names (reference corpus), else ().
    """

    vocabulary: str
    train: np.ndarray
    validation: np.ndarray
    source: str
    validation_topics: tuple[str, ...] = ()

    @property
    def vocab_size(self) -> int:
        return len(self.vocabulary)

    def encode(self, text: str) -> np.ndarray:
        """`str` of length N -> int32 `(N,)`; ValueError naming a character not in the vocabulary."""
        index = {ch: i for i, ch in enumerate(self.vocabulary)}
        missing = sorted(set(text) - index.keys())
        if missing:
            raise ValueError(f"characters {missing!r} are not in this corpus's vocabulary ({self.source})")
        return np.fromiter((index[ch] for ch in text), np.int32, len(text))

    def decode(self, ids) -> str:
        """int `(N,)` -> `str` of length N; ValueError naming an id outside `[0, vocab_size)`."""
        ids = np.asarray(ids)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"ids must be a 1-D integer array, got shape {ids.shape} dtype {ids.dtype}")
        bad = ids[(ids < 0) | (ids >= self.vocab_size)]
        if bad.size:
            raise ValueError(f"id {int(bad[0])} is outside the vocabulary [0, {self.vocab_size})")
        return "".join(self.vocabulary[i] for i in ids.tolist())


def _build(train_text: str, validation_text: str, config: TextTaskConfig, source: str, topics=()) -> TextCorpus:
    """Vocabulary from both splits, ids, and the minimum-size check shared by every source."""
    sizes = (len(train_text), len(validation_text))
    if min(sizes) < config.min_split_chars:
        raise ValueError(
            f"{source} is too short: its splits have {sizes[0]} training and {sizes[1]} validation "
            f"characters (validation_fraction={config.validation_fraction}), each needs at least "
            f"seq_len + 1 = {config.min_split_chars}; use a longer text or a smaller seq_len"
        )
    vocabulary = "".join(sorted(set(train_text) | set(validation_text)))
    index = {ch: i for i, ch in enumerate(vocabulary)}
    to_ids = lambda s: np.fromiter((index[ch] for ch in s), np.int32, len(s))
    return TextCorpus(vocabulary, to_ids(train_text), to_ids(validation_text), source, tuple(topics))


def split_topics(topics: dict[str, str], validation_fraction: float) -> tuple[list[str], list[str]]:
    """Deterministic split of named documents: `(train_names, validation_names)`, each sorted.

    Names are visited in `zlib.crc32` order; one joins validation while it still fits
    under `validation_fraction` of all characters, so validation holds at most that share.
    """
    budget = validation_fraction * sum(len(t) for t in topics.values())
    held, used = [], 0
    for name in sorted(topics, key=lambda n: (zlib.crc32(n.encode()), n)):
        if used + len(topics[name]) <= budget:
            held.append(name)
            used += len(topics[name])
    return sorted(set(topics) - set(held)), sorted(held)


def reference_corpus(config: TextTaskConfig = TextTaskConfig()) -> TextCorpus:
    """The Python Language Reference (`pydoc_data.topics`), split by topic.

    Raises:
      ValueError: if `config.seq_len` is too long for a split.
    """
    import sys
    from pydoc_data.topics import topics  # ships with CPython; imported here so `import jax_mha.lab.text` stays cheap

    train_names, held = split_topics(topics, config.validation_fraction)
    join = lambda names: "\n".join(topics[n] for n in names)
    source = f"{REFERENCE_SOURCE} (Python {sys.version.split()[0]})"
    return _build(join(train_names), join(held), config, source, held)


def corpus_from_text(text: str, config: TextTaskConfig = TextTaskConfig(), *, source: str = "<string>") -> TextCorpus:
    """A corpus from one string: the last `validation_fraction` of its characters is validation.

    Raises:
      TypeError: if `text` is not a str.
      ValueError: if it is empty, or a split is shorter than `seq_len + 1` characters.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if not text:
        raise ValueError(f"{source} is empty")
    num_validation = round(len(text) * config.validation_fraction)
    cut = len(text) - num_validation
    return _build(text[:cut], text[cut:], config, source)


def corpus_from_file(path: str | Path, config: TextTaskConfig = TextTaskConfig()) -> TextCorpus:
    """A corpus from a UTF-8 text file (`--text FILE`), split as in `corpus_from_text`.

    Raises:
      ValueError: naming the file, if it is missing, a directory, unreadable, not UTF-8,
        empty, or too short for `config.seq_len`.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"text file {str(path)!r} does not exist")
    if path.is_dir():
        raise ValueError(f"text file {str(path)!r} is a directory, not a file")
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ValueError(f"cannot read text file {str(path)!r}: {err.strerror}") from err
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ValueError(f"text file {str(path)!r} is not UTF-8: byte {err.start} is {raw[err.start]:#04x}") from err
    # Universal newlines, as text-mode `open` would: one `\n` per line break on every platform.
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return corpus_from_text(text, config, source=f"text file {str(path)!r}")


def load_corpus(config: TextTaskConfig = TextTaskConfig()) -> TextCorpus:
    """`config.text_file`'s corpus, or the Python Language Reference when it is None."""
    return reference_corpus(config) if config.text_file is None else corpus_from_file(config.text_file, config)


@functools.lru_cache(maxsize=8)
def cached_corpus(config: TextTaskConfig) -> TextCorpus:
    """`load_corpus(config)`, built once per config (configs are hashable)."""
    return load_corpus(config)


def _check_tokens(tokens: jax.Array, config: TextTaskConfig, batch_size: int, name: str) -> None:
    """Static (trace-time) checks, so a bad call fails with a message, never an XLA error."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be an int >= 1")
    if tokens.ndim != 1 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"{name} must be a 1-D integer array of ids, got shape {tokens.shape} dtype {tokens.dtype}")
    if tokens.shape[0] < config.min_split_chars:
        raise ValueError(
            f"{name} has {tokens.shape[0]} characters, fewer than seq_len + 1 = {config.min_split_chars}"
        )


def make_text_batch(key: jax.Array, tokens: jax.Array, config: TextTaskConfig, batch_size: int) -> dict[str, jax.Array]:
    """Random windows of `tokens` for next-character prediction; jittable (config, batch_size static).

    Each row is a window of T + 1 consecutive characters starting at a uniform random
    offset (windows may cross topic boundaries, as text does).

    Args:
      key: PRNG key; the same key gives the same batch.
      tokens: int `(num_chars,)`, usually `corpus.train`; pass it as an argument rather
        than closing over it, so jit does not embed it as a constant.
      config: the task (only `seq_len` is read here).
      batch_size: B.

    Returns:
      dict with int32 `inputs (B, T)`, int32 `targets (B, T)` = inputs shifted left by
      one (the next characters), bool `scored (B, T)`, all True: every position is a
      prediction.

    Raises:
      ValueError: if `tokens` is not 1-D integer or shorter than T + 1, or batch_size < 1.
    """
    _check_tokens(tokens, config, batch_size, "tokens")
    t = config.seq_len
    starts = jax.random.randint(key, (batch_size, 1), 0, tokens.shape[0] - t, jnp.int32)  # last start n - T - 1
    windows = jnp.take(tokens, starts + jnp.arange(t + 1)[None, :], axis=0).astype(jnp.int32)  # (B, T+1)
    return {"inputs": windows[:, :-1], "targets": windows[:, 1:], "scored": jnp.ones((batch_size, t), bool)}


def _window_starts(num_chars: int, seq_len: int) -> list[int]:
    """Starts of windows whose targets cover characters 1 … num_chars - 1; the last is end-aligned."""
    starts = list(range(0, num_chars - 1 - seq_len + 1, seq_len))  # full, non-overlapping targets
    if not starts or starts[-1] + seq_len < num_chars - 1:
        starts.append(num_chars - 1 - seq_len)
    return starts


def validation_batches(tokens, config: TextTaskConfig, batch_size: int) -> dict[str, jax.Array]:
    """The whole validation split as a fixed stack of batches; every character scored once.

    Window k predicts characters `kT + 1 … kT + T` from the T before them (a fresh
    context every T characters, as in nanoGPT's evaluation). The last window is
    end-aligned and scores only characters no earlier window scored; rows that only
    pad the last batch repeat window 0 with nothing scored. No PAD token is needed:
    every row is real text.

    Args:
      tokens: int `(num_chars,)`, usually `corpus.validation`.
      config: the task (`seq_len`).
      batch_size: B, rows per batch.

    Returns:
      dict with int32 `inputs (num_batches, B, T)`, int32 `targets (num_batches, B, T)`,
      bool `scored (num_batches, B, T)`; `scored.sum() == num_chars - 1`. Evaluate each
      `batches[i]` with the trainer's loss and combine with `bits_per_character(losses,
      num_scored=scored.sum((1, 2)))`: the last batch scores fewer characters.

    Raises:
      ValueError: as `make_text_batch`.
    """
    tokens = np.asarray(tokens)
    _check_tokens(tokens, config, batch_size, "tokens")
    t, n = config.seq_len, tokens.shape[0]
    starts = _window_starts(n, t)
    rows = np.stack([tokens[s : s + t + 1] for s in starts]).astype(np.int32)  # (W, T+1)
    first_target = np.array([0] + [s + t for s in starts[:-1]])  # characters up to here are scored already
    scored = np.array(starts)[:, None] + 1 + np.arange(t)[None, :] > first_target[:, None]  # (W, T)
    pad = -len(starts) % batch_size
    rows = np.concatenate([rows, np.repeat(rows[:1], pad, axis=0)])
    scored = np.concatenate([scored, np.zeros((pad, t), bool)])
    stack = lambda x: jnp.asarray(x.reshape(-1, batch_size, t))
    return {"inputs": stack(rows[:, :-1]), "targets": stack(rows[:, 1:]), "scored": stack(scored)}


def bits_per_character(loss_nats, num_scored=None):
    """Cross-entropy in nats per character -> bits per character (divide by ln 2).

    Args:
      loss_nats: scalar mean loss, or `(num_batches,)` per-batch means (the trainer's
        `scored_loss` over each of `validation_batches`).
      num_scored: None, or `(num_batches,)` scored characters per batch; with it the
        result is the exact mean over every scored character (batches weighted by their
        counts), a scalar.

    Returns:
      bits per character, the shape of `loss_nats` (a scalar with `num_scored`).

    Raises:
      ValueError: for concrete inputs, if a loss is negative or not finite, or the counts
        do not match the losses or sum to zero.
    """
    loss = jnp.asarray(loss_nats, jnp.float32)
    if not isinstance(loss, jax.core.Tracer):
        values = np.asarray(loss)
        if not np.all(np.isfinite(values)) or np.any(values < 0):
            raise ValueError(f"loss_nats={values.tolist()} must be finite and >= 0")
    if num_scored is not None:
        counts = jnp.asarray(num_scored, jnp.float32)
        if counts.shape != loss.shape:
            raise ValueError(f"num_scored has shape {counts.shape}, loss_nats {loss.shape}: they must match")
        if not isinstance(counts, jax.core.Tracer) and not float(np.sum(counts)) > 0:
            raise ValueError(f"num_scored={np.asarray(counts).tolist()} must sum to more than 0")
        loss = jnp.sum(loss * counts) / jnp.sum(counts)
    return loss / math.log(2.0)


# ----------------------------------------------------------------- n-gram baselines


def _context_keys(tokens: np.ndarray, end: np.ndarray, length: int, vocab_size: int) -> np.ndarray:
    """int64 key of the `length` tokens before each index in `end` (base-`vocab_size` digits)."""
    keys = np.zeros(end.shape, np.int64)
    for j in range(length, 0, -1):
        keys = keys * vocab_size + tokens[end - j]
    return keys


def ngram_bpc(train, validation, order: int, vocab_size: int) -> float:
    """Bits per character of an interpolated n-gram model fitted on `train`, scored on `validation`.

    Witten-Bell interpolation (Witten & Bell 1991; Chen & Goodman 1998, §2.5), which
    has no parameters to tune on held-out text: with c(h, w) the count of character w
    after context h (the n - 1 characters before it), c(h) = Σ_w c(h, w) and T(h) the
    number of distinct characters seen after h,

        p_n(w | h) = (c(h, w) + T(h) · p_{n-1}(w | h')) / (c(h) + T(h)),

    h' being h without its oldest character, p_0 uniform over the vocabulary, and
    p_n = p_{n-1} for a context never seen in training (or, at the first n - 1
    validation characters, not yet available). Every character from the second on
    is scored, as the models score it.

    Args:
      train: int `(N,)` ids in `[0, vocab_size)`, the text the table is fitted on.
      validation: int `(M,)` ids, the text it is scored on.
      order: n >= 1 (1: unigram, 2: bigram, ...).
      vocab_size: V.

    Returns:
      mean -log2 p_n over validation characters 1 … M - 1.

    Raises:
      ValueError: for order < 1, ids outside the vocabulary, or `vocab_size ** order`
        too large for int64 keys.
    """
    train, validation = np.asarray(train, np.int64), np.asarray(validation, np.int64)
    if isinstance(order, bool) or not isinstance(order, numbers.Integral) or order < 1:
        raise ValueError(f"order must be an int >= 1, got {order!r}")
    if order * math.log2(max(vocab_size, 2)) > 62:
        raise ValueError(f"vocab_size={vocab_size} ** order={order} does not fit int64 keys")
    for name, ids in (("train", train), ("validation", validation)):
        if ids.ndim != 1 or ids.size < 2 or ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"{name} must be 1-D ids in [0, {vocab_size}) with at least 2 characters")
    targets = np.arange(1, validation.size)  # validation positions scored
    prob = np.full(targets.shape, 1.0 / vocab_size)  # p_0
    for context in range(order):  # context length n - 1 = 0 … order - 1
        ends = np.arange(context, train.size)
        ctx = _context_keys(train, ends, context, vocab_size)
        full, full_counts = np.unique(ctx * vocab_size + train[ends], return_counts=True)
        seen, seen_counts = np.unique(ctx, return_counts=True)
        distinct = np.unique(full // vocab_size, return_counts=True)[1]  # T(h), in the order of `seen`
        have = targets >= context
        v_ctx = _context_keys(validation, np.maximum(targets, context), context, vocab_size)
        at = np.clip(np.searchsorted(seen, v_ctx), 0, seen.size - 1)
        known = have & (seen[at] == v_ctx)
        key = v_ctx * vocab_size + validation[targets]
        at_full = np.clip(np.searchsorted(full, key), 0, full.size - 1)
        c_hw = np.where(full[at_full] == key, full_counts[at_full], 0)
        c_h, t_h = seen_counts[at], distinct[at]
        prob = np.where(known, (c_hw + t_h * prob) / np.maximum(c_h + t_h, 1), prob)
    return float(-np.mean(np.log2(prob)))


def ngram_baselines(corpus: TextCorpus, orders=(1, 2, 3, 4, 5)) -> dict[int, float]:
    """`{n: ngram_bpc(corpus.train, corpus.validation, n)}`: the lines a model must pass."""
    return {n: ngram_bpc(corpus.train, corpus.validation, n, corpus.vocab_size) for n in orders}
