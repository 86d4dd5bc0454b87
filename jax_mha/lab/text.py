"""Real text with no download: a character-level corpus and its next-character batches.

The default corpus is the Python Language Reference that every Python installation
ships for `help()`: `pydoc_data.topics.topics`, a dict of 79 topics (on Python 3.11,
464,970 characters of English prose, grammar and code examples). It is always present,
needs no network, and is real sentences a person can read in an attention map. The
exact size depends on the Python version; `TextCorpus.source` records which one.

Three splits: `train`, `dev` (also called `validation`: the trainer's evaluations, and
every choice of learning rate, steps or preset is made on it) and `test` (the numbers a
study reports, measured once at the end).

Split without leaks. The reference's topics quote each other (`attribute-access` lies
inside `specialnames`, `exceptions` inside `execmodel`, ...): a split by topic alone puts
held-out text that is a verbatim copy of training text on the held-out side
(docs/results/index.md gives the share). So topics
that share any run of `LEAK_WIDTH` = 64 characters are joined into one group
(transitively: a union-find over shared windows, `leak_free_groups`), and whole groups
are split: visited in the order of `zlib.crc32` of their first name (stable across runs
and platforms, unlike `hash`), a group joins test while it still fits under
`test_fraction` of all characters, else dev under `validation_fraction`, else training.
So dev and test each hold at most their fraction (0.1 by default), and no held-out
character lies inside a 64-character window that also occurs in training, since no
group straddles two splits (`verbatim_overlap` measures it; the tests check it). A user's own file (`--text FILE`) has no topics: its
last `test_fraction` of characters is the test split and the `validation_fraction`
before it the dev split (nanoGPT's convention, twice). Topics (or the file's parts)
are joined with a newline.

Vocabulary: characters, not bytes. Every token is one character a person can read on
the axes of an attention map, the evaluation is then exactly bits per *character*, and the vocabulary stays small (103 symbols for the reference) where bytes
would need 256 and split the curly quotes of the reference into three tokens each. The
vocabulary is the sorted set of characters of the whole text (every split), as in
char-rnn and nanoGPT's `shakespeare_char`: only the character set is shared with the
held-out splits, never their text, and every held-out character has an id. Files are
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
# Shortest verbatim run that counts as a leak between splits: a sentence or a code line,
# longer than the phrases ("the value of the", "is an error") every English page shares.
LEAK_WIDTH = 64


@dataclasses.dataclass(frozen=True)
class TextTaskConfig:
    """Which text and how long a window; hashable, so it can be a static jit argument.

    Also the character language-model task the trainer consumes (`jax_mha.lab.data.Task`,
    registered as "lm"): `batch` samples training windows, `eval_batch` takes evenly
    spaced dev windows and `eval_metrics` reports their bits per character (`bpc`);
    `windows("test", B)` are the test split's. Its corpus is loaded once per config and cached (`corpus`), never per step.
    """

    name: ClassVar[str] = "lm"
    # No early stopping: a language model has no "solved" accuracy; it trains its budget.
    stop_metric: ClassVar[str | None] = None

    seq_len: int = 128  # T, characters per window: ~2.5 lines of the reference (52 characters a line)
    validation_fraction: float = 0.1  # at most this share of characters is the dev split (the trainer's evaluations)
    text_file: str | None = None  # None: the Python Language Reference; else a UTF-8 file (--text FILE)
    # Also measure, at every evaluation, the induction evidence of `induction_metrics`
    # (prefix matching, copying, ICL score), so a phase change shows in the curves.
    track_induction: bool = False
    test_fraction: float = 0.1  # at most this share is the test split, the one a study reports

    def __post_init__(self):
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, numbers.Integral):
            raise TypeError(f"seq_len must be an int, got {self.seq_len!r}")
        if self.seq_len < 1:
            raise ValueError(f"seq_len={self.seq_len} must be >= 1")
        for field in ("validation_fraction", "test_fraction"):
            if not 0.0 < getattr(self, field) < 1.0:
                raise ValueError(f"{field}={getattr(self, field)} must be in (0, 1)")
        if self.validation_fraction + self.test_fraction >= 1.0:
            raise ValueError(f"validation_fraction + test_fraction = {self.validation_fraction + self.test_fraction} "
                             "must be < 1: training needs the rest")
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
        """`windows("dev", batch_size)`: the trainer's evaluation reads the dev split
        only; the test split is kept for the final measurement a study reports. `key`
        is unused (the windows are deterministic)."""
        del key
        return self.windows("dev", batch_size)

    def windows(self, split: str, batch_size: int) -> dict[str, jax.Array]:
        """`batch_size` windows of one split at evenly spaced offsets over all of it
        (every topic of the split is sampled); deterministic.

        Args:
          split: "train", "dev" (or "validation") or "test".
          batch_size: B.

        Returns:
          int32 `inputs (B, T)`, int32 `targets (B, T)`, bool `scored (B, T)` (all True).

        Raises:
          ValueError: for an unknown split, batch_size < 1 or a split shorter than T + 1.
        """
        tokens = np.asarray(self.corpus.split(split))
        _check_tokens(jnp.asarray(tokens), self, batch_size, split)
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
    from jax_mha.lab.head_types import logits_and_attention_weights

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
    """A character corpus split into training, dev and test token arrays.

    Attributes:
      vocabulary: the characters in id order (id `i` is `vocabulary[i]`), sorted.
      train: int32 `(num_train_chars,)`, the training split as ids.
      dev: int32 `(num_dev_chars,)`, the split every choice is made on (`validation`).
      test: int32 `(num_test_chars,)`, the split a study reports.
      source: where the text came from, e.g. "pydoc_data.topics (Python 3.11.7)".
      dev_topics, test_topics: the held-out topic names (reference corpus), else ().
    """

    vocabulary: str
    train: np.ndarray
    dev: np.ndarray
    test: np.ndarray
    source: str
    dev_topics: tuple[str, ...] = ()
    test_topics: tuple[str, ...] = ()

    @property
    def validation(self) -> np.ndarray:
        """The dev split under its older name (the trainer's evaluation windows)."""
        return self.dev

    @property
    def validation_topics(self) -> tuple[str, ...]:
        return self.dev_topics

    @property
    def vocab_size(self) -> int:
        return len(self.vocabulary)

    def split(self, name: str) -> np.ndarray:
        """The ids of split `name` ("train", "dev" or "validation", "test").

        Raises:
          ValueError: naming an unknown split.
        """
        splits = {"train": self.train, "dev": self.dev, "validation": self.dev, "test": self.test}
        if name not in splits:
            raise ValueError(f"split must be one of {sorted(splits)}, got {name!r}")
        return splits[name]

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


def _build(texts: tuple[str, str, str], config: TextTaskConfig, source: str, topics=((), ())) -> TextCorpus:
    """Vocabulary from every split, ids, and the minimum-size check shared by every source.

    Args:
      texts: `(train, dev, test)` text.
      topics: `(dev topic names, test topic names)`.
    """
    if min(map(len, texts)) < config.min_split_chars:
        raise ValueError(
            f"{source} is too short: its splits have {len(texts[0])} training, {len(texts[1])} dev and "
            f"{len(texts[2])} test characters (validation_fraction={config.validation_fraction}, test_fraction="
            f"{config.test_fraction}), each needs at least seq_len + 1 = {config.min_split_chars}; use a longer "
            f"text or a smaller seq_len"
        )
    vocabulary = "".join(sorted(set().union(*map(set, texts))))
    index = {ch: i for i, ch in enumerate(vocabulary)}
    to_ids = lambda s: np.fromiter((index[ch] for ch in s), np.int32, len(s))
    return TextCorpus(vocabulary, *map(to_ids, texts), source, *map(tuple, topics))


def split_topics(topics: dict[str, str], validation_fraction: float) -> tuple[list[str], list[str]]:
    """Deterministic split of named documents: `(train_names, held_names)`, each sorted.

    Names are visited in `zlib.crc32` order; one is held out while it still fits
    under `validation_fraction` of all characters, so the held-out part holds at most
    that share. It knows nothing of text shared between documents: the reference
    corpus is split by `split_documents`, which groups documents that quote each other.
    """
    train, held = _fill({name: [name] for name in topics}, {n: len(t) for n, t in topics.items()},
                           (validation_fraction,))
    return train, held


def _fill(groups: dict[str, list[str]], sizes: dict[str, int], fractions) -> tuple[list[str], ...]:
    """Whole groups, in `zlib.crc32` order of their key, into held-out parts under
    `fractions` of all characters (the first part that still has room), else training.

    Returns:
      `(train_names, part_0_names, part_1_names, …)`, each sorted.
    """
    total = sum(sizes.values())
    budgets, parts = [f * total for f in fractions], [[] for _ in fractions]
    train = []
    for key in sorted(groups, key=lambda k: (zlib.crc32(k.encode()), k)):
        size = sum(sizes[n] for n in groups[key])
        room = next((i for i, budget in enumerate(budgets) if size <= budget), None)
        if room is None:
            train += groups[key]
        else:
            budgets[room] -= size
            parts[room] += groups[key]
    return (sorted(train), *map(sorted, parts))


def leak_free_groups(topics: dict[str, str], width: int = LEAK_WIDTH) -> list[list[str]]:
    """Topics joined when they share a run of `width` characters, transitively.

    Every window of `width` characters of every topic is hashed (`window_hashes`);
    two topics holding one hash are joined (union-find), so a split that keeps each
    group on one side has no shared window across sides.

    Returns:
      the groups, each a sorted list of names, ordered by their first name.
    """
    names = sorted(topics)
    hashes = [np.unique(window_hashes(_code_points(topics[n]), width)) for n in names]
    flat = np.concatenate(hashes)
    owner = np.concatenate([np.full(h.size, i) for i, h in enumerate(hashes)])
    order = np.argsort(flat, kind="stable")
    flat, owner = flat[order], owner[order]
    parent = list(range(len(names)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]  # path halving: the trees stay flat
            i = parent[i]
        return i

    for i in np.flatnonzero(flat[1:] == flat[:-1]):  # one window in two topics (unique per topic)
        a, b = root(int(owner[i])), root(int(owner[i + 1]))
        parent[max(a, b)] = min(a, b)
    groups: dict[int, list[str]] = {}
    for i, name in enumerate(names):
        groups.setdefault(root(i), []).append(name)
    return sorted(groups.values())


def split_documents(topics: dict[str, str], validation_fraction: float, test_fraction: float,
                    width: int = LEAK_WIDTH) -> tuple[list[str], list[str], list[str]]:
    """`(train_names, dev_names, test_names)`, each sorted: whole `leak_free_groups`,
    visited in `zlib.crc32` order of their first name, go to test while they fit under
    `test_fraction` of all characters, else to dev under `validation_fraction`, else
    to training. No two splits share a window of `width` characters."""
    groups = {group[0]: group for group in leak_free_groups(topics, width)}
    train, test, dev = _fill(groups, {n: len(t) for n, t in topics.items()}, (test_fraction, validation_fraction))
    return train, dev, test


# ----------------------------------------------------------------- leaks between splits


def _code_points(text) -> np.ndarray:
    """A str as its code points, or integer ids as they are: int `(N,)`."""
    if isinstance(text, str):
        return np.frombuffer(text.encode("utf-32-le"), np.uint32)
    ids = np.asarray(text)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"text must be a str or 1-D integer ids, got shape {ids.shape} dtype {ids.dtype}")
    return ids


def window_hashes(ids, width: int) -> np.ndarray:
    """A 64-bit polynomial hash of every window of `width` consecutive symbols.

    `hash(i) = Σ_k ids[i + k] · b^-k mod 2^64` with b odd (so invertible mod 2^64):
    one cumulative sum and one product per window, all in wrapping uint64 arithmetic,
    vectorised over the corpus. Two equal windows have equal hashes;
    unequal windows collide with probability about 2^-64 per pair.

    Args:
      ids: int `(N,)`, or a str (its code points).
      width: window length >= 1.

    Returns:
      uint64 `(max(N - width + 1, 0),)`, entry i the hash of `ids[i : i + width]`.

    Raises:
      ValueError: for width < 1 or ids that are not 1-D integers.
    """
    if isinstance(width, bool) or not isinstance(width, numbers.Integral) or width < 1:
        raise ValueError(f"width must be an int >= 1, got {width!r}")
    ids = _code_points(ids).astype(np.uint64)
    n = ids.size - width + 1
    if n <= 0:
        return np.zeros(0, np.uint64)
    base = 1_000_003
    with np.errstate(over="ignore"):  # wrapping mod 2^64 is the arithmetic intended
        inverse_powers = np.cumprod(np.full(ids.size, pow(base, -1, 2**64), np.uint64)) * np.uint64(base)  # b^-k
        powers = np.cumprod(np.full(n, base, np.uint64)) * np.uint64(pow(base, -1, 2**64))  # b^i
        prefix = np.concatenate([np.zeros(1, np.uint64), np.cumsum(ids * inverse_powers, dtype=np.uint64)])
        return (prefix[width:] - prefix[:n]) * powers


def verbatim_overlap(reference, other, width: int = LEAK_WIDTH) -> float:
    """The share of `other`'s characters that lie inside a run of `width` characters
    also found verbatim in `reference`: 0 for a split with nothing copied from the
    other.

    Every window of `reference` is hashed into a sorted table, every window of `other`
    looked up in it; a character counts once if any matching window covers it.

    Args:
      reference: str, or int `(N,)` ids of one vocabulary (e.g. `corpus.train`).
      other: the same kind as `reference` (e.g. `corpus.test`).
      width: the shortest run that counts.

    Returns:
      a float in [0, 1] (0 when `other` is shorter than `width`).

    Raises:
      ValueError: for width < 1 or an input that is neither a str nor 1-D integer ids.
    """
    table = np.unique(window_hashes(reference, width))
    probe = window_hashes(other, width)
    size = _code_points(other).size
    if probe.size == 0:
        return 0.0
    found = np.isin(probe, table, assume_unique=False)  # (size - width + 1,)
    count = np.concatenate([[0], np.cumsum(found)])  # windows matched among starts < i
    chars = np.arange(size)
    first, last = np.clip(chars - width + 1, 0, found.size), np.clip(chars + 1, 0, found.size)
    return float(np.mean(count[last] - count[first] > 0))  # a start in [c - width + 1, c] matched


def reference_corpus(config: TextTaskConfig = TextTaskConfig()) -> TextCorpus:
    """The Python Language Reference (`pydoc_data.topics`), split by `split_documents`.

    Raises:
      ValueError: if `config.seq_len` is too long for a split.
    """
    import sys
    from pydoc_data.topics import topics  # ships with CPython; imported here so `import jax_mha.lab.text` stays cheap

    train, dev, test = split_documents(topics, config.validation_fraction, config.test_fraction)
    join = lambda names: "\n".join(topics[n] for n in names)
    source = f"{REFERENCE_SOURCE} (Python {sys.version.split()[0]})"
    return _build((join(train), join(dev), join(test)), config, source, (dev, test))


def corpus_from_text(text: str, config: TextTaskConfig = TextTaskConfig(), *, source: str = "<string>") -> TextCorpus:
    """A corpus from one string: its last `test_fraction` of characters is the test
    split, the `validation_fraction` before it the dev split, the rest training.

    Raises:
      TypeError: if `text` is not a str.
      ValueError: if it is empty, or a split is shorter than `seq_len + 1` characters.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if not text:
        raise ValueError(f"{source} is empty")
    test_cut = len(text) - round(len(text) * config.test_fraction)
    dev_cut = test_cut - round(len(text) * config.validation_fraction)
    return _build((text[:dev_cut], text[dev_cut:test_cut], text[test_cut:]), config, source)


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
    """A whole held-out split as a fixed stack of batches; every character scored once.

    Window k predicts characters `kT + 1 … kT + T` from the T before them (a fresh
    context every T characters, as in nanoGPT's evaluation). The last window is
    end-aligned and scores only characters no earlier window scored; rows that only
    pad the last batch repeat window 0 with nothing scored. No PAD token is needed:
    every row is real text.

    Args:
      tokens: int `(num_chars,)`: `corpus.test` for a reported number, `corpus.dev`
        while choosing.
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


def ngram_baselines(corpus: TextCorpus, orders=(1, 2, 3, 4, 5), split: str = "dev") -> dict[int, float]:
    """`{n: ngram_bpc(corpus.train, corpus.split(split), n)}`: the lines a model must
    pass, on the split its own bpc is measured on ("dev" while choosing, "test" beside
    a reported number)."""
    held = corpus.split(split)
    return {n: ngram_bpc(corpus.train, held, n, corpus.vocab_size) for n in orders}
