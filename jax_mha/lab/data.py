"""Tasks: what a decoder is trained on, as the trainer and the analysis see it.

A task is a small frozen config with three duties (the `Task` protocol):

* `batch(key, batch_size)` samples a training batch, jittable: int `inputs (B, T)`,
  int `targets (B, T)` (the next tokens) and bool `scored (B, T)` (where the loss counts);
* `eval_batch(key, batch_size)` the held-out batch the trainer evaluates on (the copy
  task: fresh sequences from the evaluation key; the language model: windows of its
  dev split, the one every choice is made on);
* `eval_metrics(decoding, logits, batch)` adds the task's own held-out metrics to
  the generic ones (loss, token accuracy, attention statistics);
* `stop_metric` names the metric early stopping watches (None: never stop early).

Every task shares that batch layout, so one trainer, one loss (`train.scored_loss`)
and one analysis serve them all; a new task (e.g. a character language model) is a
new config class registered in `TASKS`. Registered: "copy" (below) and "lm", the
character language model of `jax_mha.lab.text.TextTaskConfig` (no early stopping: its
`stop_metric` is None; its held-out metric is dev bits per character, `bpc`); "mqar",
"repeat" and "markov" (in-context learning of Markov chains), below.

The delayed copy task (Katharopoulos et al. 2020; Jelassi et al. 2024): a sequence
is `BOS x1 … xL SEP x1 … xL EOS` (then PAD up to the longest L). A decoder reads it
left to right; the loss is scored only on the second copy and EOS, whose tokens can
only be known by looking back L+1 positions: no attention, no copy. A
position-aligned copy (output_i = input_i) would be solved by the residual stream
alone and measure nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jax_mha.lab.text import TextTaskConfig

PAD, BOS, SEP, EOS = 0, 1, 2, 3
FIRST_SYMBOL = 4  # content symbols are FIRST_SYMBOL … FIRST_SYMBOL + num_symbols - 1

Batch = dict[str, jax.Array]
LogitsFn = Callable[[jax.Array], jax.Array]  # int (B, T) -> float (B, T, V)
StepFn = Callable[[Any, jax.Array], tuple[Any, jax.Array]]  # (cache, int (B, 1)) -> (cache, float (B, 1, V))


class Decoding(NamedTuple):
    """How an evaluation may run a causal model: whole sequences (`logits`) and, when
    `step` is given, one token at a time through a KV cache that starts as `cache`."""

    logits: LogitsFn
    step: StepFn | None = None
    cache: Any = None


class Task(Protocol):
    """What the trainer, the evaluation and the analysis need from a task."""

    name: ClassVar[str]  # the key in TASKS, and --task on the command line
    stop_metric: ClassVar[str | None]  # eval metric early stopping compares with target_accuracy

    @property
    def vocab_size(self) -> int: ...

    @property
    def seq_len(self) -> int:
        """T, the length of `inputs` (what the model reads)."""

    def batch(self, key: jax.Array, batch_size: int) -> Batch: ...

    def eval_batch(self, key: jax.Array, batch_size: int) -> Batch: ...

    def eval_metrics(self, decoding: Decoding | LogitsFn, logits: jax.Array, batch: Batch) -> dict[str, jax.Array]: ...


@dataclasses.dataclass(frozen=True)
class CopyTaskConfig:
    """What copy-task sequences look like."""

    name: ClassVar[str] = "copy"
    stop_metric: ClassVar[str | None] = "exact_accuracy"  # solved = the whole second copy decoded right

    length: int = 16  # L, symbols per copy (the longest, when min_length is set)
    min_length: int | None = None  # None: every example has L symbols; else L ~ U{min_length … length}, padded
    num_symbols: int = 10  # content vocabulary: chance accuracy on a symbol is 1/num_symbols
    reverse: bool = False  # the second half is x_L … x_1: the offset now varies per position

    def __post_init__(self):
        for field in ("length", "num_symbols"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{field} must be an int, got {value!r}")
        if self.length < 1 or self.num_symbols < 2:
            raise ValueError(f"need length >= 1 and num_symbols >= 2, got length={self.length}, num_symbols={self.num_symbols}")
        if self.min_length is not None and not 1 <= self.min_length <= self.length:
            raise ValueError(f"min_length={self.min_length} must be in [1, length={self.length}]")

    @property
    def vocab_size(self) -> int:
        return FIRST_SYMBOL + self.num_symbols

    @property
    def seq_len(self) -> int:
        """T, the model's input length: `2L + 2` (the `2L + 3` tokens minus the last)."""
        return 2 * self.length + 2

    def batch(self, key: jax.Array, batch_size: int) -> Batch:
        """`make_batch(key, self, batch_size)`."""
        return make_batch(key, self, batch_size)

    def eval_batch(self, key: jax.Array, batch_size: int) -> Batch:
        """Held-out sequences: the same distribution, from a key training never uses."""
        return make_batch(key, self, batch_size)

    def eval_metrics(self, decoding: Decoding | LogitsFn, logits: jax.Array, batch: Batch) -> dict[str, jax.Array]:
        """`exact_accuracy`: the fraction of sequences whose greedy, autoregressive
        decoding of the second copy and EOS is right at every scored position."""
        del logits  # teacher-forced logits say nothing about free-running decoding
        decoded = greedy_decode(decoding, batch)
        exact = jnp.all(jnp.where(batch["scored"], decoded == batch["targets"], True), axis=-1)
        return {"exact_accuracy": exact.mean()}


@dataclasses.dataclass(frozen=True)
class RecallTaskConfig:
    """Multi-query associative recall with two-token keys (Arora et al. 2023, "Zoology").

    A sequence is `BOS (a1 b1 v1) … (aN bN vN) SEP (a b v)_q1 … (a b v)_qQ`: N pairs,
    each a two-token key `(a, b)` (both from one alphabet of `num_key_symbols`, so
    `(a, b)` and `(b, a)` are different keys) followed by its value `v`, then Q of
    those keys again, each followed by its value. The loss is scored where the input is
    a query's `b` and the target its `v`: the value of the context pair whose key is the
    two tokens just read. Keys are distinct within a row; values are independent.
    With `key_tokens=1` a key is one token, as in Zoology's MQAR: `BOS (k1 v1) … (kN vN)
    SEP (k v)_q1 …`, scored where the input is a query's key.

    Queries. Each query draws one of the N keys uniformly, independently of the others
    (repeats allowed; Zoology's own generator asks each key once, at power-law gaps, which
    the query-after-all-pairs layout here cannot copy without the shortcut below). The earlier variant,
    every key asked exactly once (`queries_with_replacement=False`, Q = N), had a
    shortcut: the answer is a value of a pair not yet asked, so "the most common value
    among the pairs not yet asked" beats chance without any key lookup. With repeats an
    asked key can be asked again, so setting asked pairs aside can discard the answer:
    at the defaults the elimination strategy scores above chance (1/8) but below simply
    answering the row's most common value, the best answer without key lookup
    (`experiments.associative_recall.reference_lines`; the scores are in
    docs/results/associative_recall.md, with its reference lines, from
    docs/results/data/recall_mqar.json).

    Why one head is not enough: to answer, the query position must find the context
    position whose *two* preceding tokens match its own two, by content. In a small
    decoder that means gathering `(a_j, b_j)` into the value's position (offsets -1 and
    -2) and `a` into the query's (offset -1), then one content match: a single head
    averaging offsets -1 and -2 sums the two embeddings and cannot tell `(a, b)` from
    `(b, a)`, so half of the keys become ambiguous. The copy task, by contrast, is one
    fixed offset that one head expresses exactly.
    """

    name: ClassVar[str] = "mqar"
    stop_metric: ClassVar[str | None] = None  # a fixed step budget; the area under the loss curve is the measure

    num_pairs: int = 8  # N key-value pairs in context
    num_queries: int = 8  # Q keys asked back, each drawn uniformly from the N
    num_key_symbols: int = 6  # K: K*K = 36 possible keys, 8 of them per row
    num_values: int = 8  # V: chance accuracy 1/V
    key_tokens: int = 2  # tokens per key: 2 (the two-token keys above) or 1 (Zoology's single-token keys)
    # True: queries draw keys with repeats (no elimination shortcut); False: Q distinct
    # keys in random order, the earlier variant (kept so its results can be reproduced).
    queries_with_replacement: bool = True

    def __post_init__(self):
        for field in ("num_pairs", "num_queries", "num_key_symbols", "num_values"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field} must be an int >= 1, got {value!r}")
        if not isinstance(self.queries_with_replacement, bool):
            raise TypeError(f"queries_with_replacement must be a bool, got {self.queries_with_replacement!r}")
        if self.key_tokens not in (1, 2) or isinstance(self.key_tokens, bool):
            raise ValueError(f"key_tokens must be 1 or 2, got {self.key_tokens!r}")
        keys = self.num_key_symbols**self.key_tokens
        if self.num_pairs > keys:
            raise ValueError(f"num_pairs={self.num_pairs} distinct keys need num_key_symbols**key_tokens >= num_pairs, "
                             f"got {self.num_key_symbols}**{self.key_tokens} = {keys}")
        if not self.queries_with_replacement and self.num_queries > self.num_pairs:
            raise ValueError(f"num_queries={self.num_queries} distinct keys must be <= num_pairs={self.num_pairs} "
                             "(or draw them with queries_with_replacement=True)")

    @property
    def first_value(self) -> int:
        """The id of value 0: keys are FIRST_SYMBOL … FIRST_SYMBOL + K - 1, values follow."""
        return FIRST_SYMBOL + self.num_key_symbols

    @property
    def vocab_size(self) -> int:
        return self.first_value + self.num_values

    @property
    def seq_len(self) -> int:
        """T = g(N + Q) + 1 with g = key_tokens + 1 tokens per pair (3N + 3Q + 1 for
        two-token keys): the `g(N + Q) + 2` tokens minus the last."""
        return (self.key_tokens + 1) * (self.num_pairs + self.num_queries) + 1

    def batch(self, key: jax.Array, batch_size: int) -> Batch:
        """`make_recall_batch(key, self, batch_size)`."""
        return make_recall_batch(key, self, batch_size)

    def eval_batch(self, key: jax.Array, batch_size: int) -> Batch:
        """Held-out rows: the same distribution from a key training never uses."""
        return make_recall_batch(key, self, batch_size)

    def eval_metrics(self, decoding, logits: jax.Array, batch: Batch) -> dict[str, jax.Array]:
        """`recall_accuracy`: argmax right on a query's value (teacher forcing is exact
        here: no target depends on an earlier prediction) and `query_exact`: every
        query of the row right."""
        del decoding
        right = (jnp.argmax(logits, -1) == batch["targets"]) | ~batch["scored"]
        count = jnp.maximum(batch["scored"].sum(), 1)
        return {"recall_accuracy": (right & batch["scored"]).sum() / count,
                "query_exact": jnp.all(right, axis=-1).mean()}


def make_recall_batch(key: jax.Array, config: RecallTaskConfig, batch_size: int) -> Batch:
    """Samples a batch of `RecallTaskConfig`; jittable (config and batch_size static).

    Returns:
      dict with int32 `inputs (B, T)`, int32 `targets (B, T)` (the next tokens) and bool
      `scored (B, T)`: True exactly where the input is a query's last key token.

    Raises:
      ValueError: if batch_size < 1.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    n, q, k, g = config.num_pairs, config.num_queries, config.num_key_symbols, config.key_tokens + 1
    key_key, value_key, query_key = jax.random.split(key, 3)
    # The first N of a random permutation of the K**key_tokens keys: distinct keys per row.
    pair = jnp.argsort(jax.random.uniform(key_key, (batch_size, k**config.key_tokens)), axis=1)[:, :n]  # (B, N)
    key_columns = [FIRST_SYMBOL + pair // k, FIRST_SYMBOL + pair % k] if g == 3 else [FIRST_SYMBOL + pair]
    v = jax.random.randint(value_key, (batch_size, n), 0, config.num_values) + config.first_value
    if config.queries_with_replacement:
        asked = jax.random.randint(query_key, (batch_size, q), 0, n)  # (B, Q) pair indices, repeats allowed
    else:
        asked = jnp.argsort(jax.random.uniform(query_key, (batch_size, n)), axis=1)[:, :q]  # (B, Q) distinct
    take = lambda x: jnp.take_along_axis(x, asked, axis=1)
    groups = lambda *xs: jnp.stack(xs, axis=-1).reshape(batch_size, -1)  # (B, g·count): a b v a b v … or k v k v …
    column = lambda token: jnp.full((batch_size, 1), token, jnp.int32)
    tokens = jnp.concatenate([column(BOS), groups(*key_columns, v), column(SEP),
                              groups(*map(take, key_columns), take(v))], axis=1).astype(jnp.int32)  # (B, g(N+Q)+2)
    pos = jnp.arange(tokens.shape[1])
    query_value = (pos >= g * n + 2) & ((pos - (g * n + 2)) % g == g - 1)  # token positions of the queries' values
    scored = jnp.broadcast_to(query_value[1:], (batch_size, tokens.shape[1] - 1))
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "scored": scored}


@dataclasses.dataclass(frozen=True)
class RepeatTaskConfig:
    """Repeated random sequences of varying length: the induction heads' positive control.

    A row is R distinct random symbols, the same R again, then fresh random symbols up
    to the window, with R drawn per row from [min_repeat, max_repeat]. The loss is
    scored on the second copy (from its second token on). Because R varies, no fixed
    offset finds the answer: the model has to look up where the current token occurred
    before and read what came next, which is what an induction head does (Olsson et al.
    2022). A model trained on it must score high on the prefix-matching probe; if it
    does not, the probe is broken.
    """

    name: ClassVar[str] = "repeat"
    stop_metric: ClassVar[str | None] = None

    seq_len: int = 32  # T, tokens the model reads
    min_repeat: int = 4
    max_repeat: int = 16  # at most T // 2
    num_symbols: int = 24  # at least max_repeat (distinct symbols per copy)
    # Also measure, at every evaluation, each head's prefix-matching score and the
    # copying effect on a fixed probe (`eval_metrics`): how induction heads form.
    track_induction: bool = False

    def __post_init__(self):
        if not 2 <= self.min_repeat <= self.max_repeat <= min(self.seq_len // 2, self.num_symbols):
            raise ValueError(f"need 2 <= min_repeat <= max_repeat <= min(seq_len // 2, num_symbols), got "
                             f"{self.min_repeat}, {self.max_repeat}, seq_len={self.seq_len}, num_symbols={self.num_symbols}")
        if not isinstance(self.track_induction, bool):
            raise TypeError(f"track_induction must be a bool, got {self.track_induction!r}")

    @property
    def probe_repeat(self) -> int:
        """R of the induction probe: the middle of the trained range [min_repeat, max_repeat]."""
        return (self.min_repeat + self.max_repeat) // 2

    @property
    def vocab_size(self) -> int:
        return FIRST_SYMBOL + self.num_symbols

    def batch(self, key: jax.Array, batch_size: int) -> Batch:
        """Rows as described above; jittable. Scored: targets x_2 … x_R of the second copy."""
        order_key, length_key, fill_key = jax.random.split(key, 3)
        seq = jnp.argsort(jax.random.uniform(order_key, (batch_size, self.num_symbols)), axis=1)  # distinct
        r = jax.random.randint(length_key, (batch_size, 1), self.min_repeat, self.max_repeat + 1)
        fill = jax.random.randint(fill_key, (batch_size, self.seq_len + 1), 0, self.num_symbols)
        pos = jnp.arange(self.seq_len + 1)[None, :]
        copy_index = jnp.clip(jnp.where(pos < r, pos, pos - r), 0, self.num_symbols - 1)
        repeated = jnp.take_along_axis(seq, copy_index, axis=1)
        tokens = (FIRST_SYMBOL + jnp.where(pos < 2 * r, repeated, fill)).astype(jnp.int32)
        target_pos = pos[:, 1:]  # target t is token t + 1
        scored = (target_pos > r) & (target_pos < 2 * r)
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "scored": scored}

    def eval_batch(self, key: jax.Array, batch_size: int) -> Batch:
        return self.batch(key, batch_size)

    def eval_metrics(self, decoding, logits: jax.Array, batch: Batch) -> dict[str, jax.Array]:
        """Nothing beyond the generic metrics (token accuracy on the scored second copy
        says it all), unless `track_induction`: then `prefix_matching` `(num_layers, H)`,
        `second_copy_loss` and `copying` (nats) on `induction_probe()` (see
        `jax_mha.lab.head_types.prefix_matching_score` and `copying_effect`)."""
        del logits, batch
        if not self.track_induction:
            return {}
        from jax_mha.lab import head_types  # here: head_types is not needed to build batches

        probe, r = jnp.asarray(self.induction_probe()), self.probe_repeat
        probe_logits, weights = head_types.logits_and_attention_weights(getattr(decoding, "logits", decoding), probe)
        copying = head_types.copying_effect(probe_logits, probe, r)
        return {"prefix_matching": head_types.prefix_matching_score(weights, r),
                "second_copy_loss": copying["second_copy_loss"], "copying": copying["copying"]}

    def induction_probe(self, rows: int = 32) -> np.ndarray:
        """int32 `(rows, 2R)`, R = `probe_repeat`: R distinct symbols, then the same R
        again. NumPy with a fixed seed, not jax.random: it is built while the trainer's
        evaluation is traced, and must be the same probe at every evaluation."""
        rng = np.random.default_rng(PROBE_SEED)
        seq = np.stack([rng.permutation(self.num_symbols)[: self.probe_repeat] for _ in range(rows)])
        return (FIRST_SYMBOL + np.concatenate([seq, seq], axis=1)).astype(np.int32)


PROBE_SEED = 2**31 - 3  # the induction probe's rows: fixed, apart from every training and evaluation key


@dataclasses.dataclass(frozen=True)
class MarkovTaskConfig:
    """In-context learning of Markov chains (Edelman et al. 2024, "ICL-MC").

    Every row is a fresh Markov chain on `num_states` states: each row of its
    transition matrix is drawn from a symmetric Dirichlet(`concentration`), the first
    state from the chain's stationary distribution, then `seq_len` transitions (as the
    paper's code does). Tokens are the states, `0 … k-1` (no special tokens), and the
    loss is scored at every position: predicting x_{t+1} from x_0 … x_t. No fixed
    table can do well (the chain is new in every row); what can be learned is a rule
    that reads the context: the in-context unigram frequencies, then the in-context
    bigram (transition) counts, which a statistical induction head computes
    (`in_context_strategies`). Evaluations report the loss and the KL divergence to
    the model of each strategy on the same held-out rows (`eval_metrics`).
    """

    name: ClassVar[str] = "markov"
    stop_metric: ClassVar[str | None] = None  # a fixed budget: the stages of the loss curve are the measure

    seq_len: int = 64  # T, tokens the model reads (the paper's code default: 100)
    num_states: int = 3  # k, the vocabulary (the paper's code default: 2)
    concentration: float = 1.0  # 1: every transition row uniform on the simplex, the paper's prior

    def __post_init__(self):
        for field, low in (("seq_len", 2), ("num_states", 2)):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{field} must be an int >= {low}, got {value!r}")
        c = self.concentration
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 < c < float("inf"):  # NaN fails too
            raise ValueError(f"concentration must be a finite number > 0, got {self.concentration!r}")

    @property
    def vocab_size(self) -> int:
        return self.num_states

    def chains(self, key: jax.Array, batch_size: int) -> tuple[jax.Array, jax.Array]:
        """`sample_markov_chains(key, self, batch_size)`: `(transitions (B, k, k), tokens (B, T + 1))`."""
        return sample_markov_chains(key, self, batch_size)

    def batch(self, key: jax.Array, batch_size: int) -> Batch:
        """`inputs = tokens[:, :-1]`, `targets = tokens[:, 1:]`, every position scored; jittable."""
        _, tokens = self.chains(key, batch_size)
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
                "scored": jnp.ones((batch_size, self.seq_len), bool)}

    def eval_batch(self, key: jax.Array, batch_size: int) -> Batch:
        return self.batch(key, batch_size)

    def eval_metrics(self, decoding, logits: jax.Array, batch: Batch) -> dict[str, jax.Array]:
        """On the held-out rows, for each strategy S of `in_context_strategies`: `S_loss`,
        its cross-entropy on the targets (nats, the positions the model's `loss`
        averages), and `kl_S`, the mean KL(S || model) (nats): which strategy the model
        is closest to, as in the paper's Figure 1 (right)."""
        del decoding
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # (B, T, k)
        weight = batch["scored"].astype(jnp.float32)
        mean = lambda x: (x * weight).sum() / jnp.maximum(weight.sum(), 1.0)
        out = {}
        for name, probs in in_context_strategies(batch["inputs"], self.num_states).items():
            logq = jnp.log(probs)
            out[f"{name}_loss"] = mean(-jnp.take_along_axis(logq, batch["targets"][..., None], axis=-1)[..., 0])
            out[f"kl_{name}"] = mean(jnp.sum(probs * (logq - logp), axis=-1))
        return out


def stationary_distribution(transitions: jax.Array, squarings: int = 24) -> jax.Array:
    """`pi` with `pi @ P = pi` for row-stochastic `P (…, k, k)` with positive entries:
    any row of `P^(2^squarings)` (rows renormalised after each squaring against
    float32 drift). Returns `(…, k)`."""
    power = transitions
    for _ in range(squarings):
        power = power @ power
        power = power / power.sum(-1, keepdims=True)
    return power.mean(-2)


def sample_markov_chains(key: jax.Array, config: MarkovTaskConfig, batch_size: int) -> tuple[jax.Array, jax.Array]:
    """One Markov chain per row and a sequence from it; jittable (config, batch_size static).

    Returns:
      `(transitions, tokens)`: float32 `(B, k, k)`, row i the distribution of the state
      after i; int32 `(B, T + 1)` states, the first from the stationary distribution.

    Raises:
      ValueError: if batch_size < 1.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    k = config.num_states
    p_key, start_key, step_key = jax.random.split(key, 3)
    transitions = jax.random.dirichlet(p_key, jnp.full((k,), config.concentration, jnp.float32), (batch_size, k))
    logp = jnp.log(transitions)  # (B, k, k); a zero entry is -inf, which categorical never draws
    first = jax.random.categorical(start_key, jnp.log(stationary_distribution(transitions)))  # (B,)

    def step(state, step_key):
        row = jnp.take_along_axis(logp, state[:, None, None], axis=1)[:, 0]  # (B, k)
        nxt = jax.random.categorical(step_key, row)
        return nxt, nxt

    _, rest = jax.lax.scan(step, first, jax.random.split(step_key, config.seq_len))  # (T, B)
    return transitions, jnp.concatenate([first[:, None], rest.T], axis=1).astype(jnp.int32)


def in_context_strategies(inputs: jax.Array, num_states: int) -> dict[str, jax.Array]:
    """Next-state distributions of the strategies of Edelman et al. 2024 at every position.

    With counts taken over the context x_0 … x_t (add-one smoothing, as the paper's
    code does):
      `uniform`: 1/k;
      `unigram`: (n_j + 1) / (t + 1 + k), n_j the occurrences of state j;
      `bigram`: (n_{x_t -> j} + 1) / (n_{x_t -> .} + k), the transitions out of the
        current state seen so far: the Bayes posterior mean of P[x_t] under the
        Dirichlet(1) prior, what a statistical induction head computes.

    Args:
      inputs: int `(B, T)`, states in `[0, num_states)`.

    Returns:
      dict of float32 `(B, T, k)` distributions.
    """
    k, t = num_states, inputs.shape[-1]
    one_hot = jax.nn.one_hot(inputs, k, dtype=jnp.float32)  # (B, T, k)
    seen = jnp.cumsum(one_hot, axis=1)  # (B, T, k): occurrences in x_0 … x_t
    unigram = (seen + 1.0) / (jnp.arange(1, t + 1, dtype=jnp.float32)[None, :, None] + k)
    pairs = one_hot[:, :-1, :, None] * one_hot[:, 1:, None, :]  # (B, T-1, k, k): the transition into s + 1
    counts = jnp.concatenate([jnp.zeros_like(pairs[:, :1]), jnp.cumsum(pairs, axis=1)], axis=1)  # (B, T, k, k)
    out_of_current = jnp.einsum("btk,btkj->btj", one_hot, counts)  # (B, T, k)
    bigram = (out_of_current + 1.0) / (out_of_current.sum(-1, keepdims=True) + k)
    return {"uniform": jnp.full_like(unigram, 1.0 / k), "unigram": unigram, "bigram": bigram}


TASKS: dict[str, type] = {CopyTaskConfig.name: CopyTaskConfig, TextTaskConfig.name: TextTaskConfig,
                          RecallTaskConfig.name: RecallTaskConfig, RepeatTaskConfig.name: RepeatTaskConfig,
                          MarkovTaskConfig.name: MarkovTaskConfig}
LMTaskConfig = TextTaskConfig  # the language-model task under its task name


# Fields added after results were saved, left out of `task_to_dict` at their default, so
# the dicts (and the fingerprints of saved runs that hold them) of tasks that do not use
# them are what they were; `task_from_dict` restores the default.
_LATER_FIELDS = {"mqar": {"key_tokens": 2}, "repeat": {"track_induction": False}}


def task_to_dict(task: Task) -> dict[str, Any]:
    """The task as plain data (for checkpoints and results.json): its fields plus `name`
    (a field of `_LATER_FIELDS` only when it is not its default)."""
    later = _LATER_FIELDS.get(task.name, {})
    fields = {k: v for k, v in dataclasses.asdict(task).items() if k not in later or v != later[k]}
    return {"name": task.name, **fields}


def task_from_dict(data: dict[str, Any]) -> Task:
    """Inverse of `task_to_dict`; a dict without `name` is a copy task, a recall task
    without `queries_with_replacement` asked distinct keys (older files). A language
    model's dict without `test_fraction` was split in two by topic; it loads with the
    three-way leak-free split, which its numbers were not measured on.

    Raises:
      ValueError: for an unknown task name or fields the task does not have.
    """
    data = dict(data)
    name = data.pop("name", CopyTaskConfig.name)
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {sorted(TASKS)}")
    if name == RecallTaskConfig.name:
        data.setdefault("queries_with_replacement", False)
    try:
        return TASKS[name](**data)
    except TypeError as e:
        raise ValueError(f"task {name!r} cannot be built from {data}: {e}") from None


def make_batch(key: jax.Array, config: CopyTaskConfig, batch_size: int) -> Batch:
    """Samples a batch of the copy task; jittable (config and batch_size static).

    Args:
      key: PRNG key; the same key gives the same batch.
      config: the task.
      batch_size: B >= 1.

    Returns:
      dict with int32 `inputs (B, T)` = tokens[:-1], int32 `targets (B, T)` =
      tokens[1:], bool `scored (B, T)`: True where the target is a second-copy symbol
      or EOS. `T = 2L + 2`.

    Raises:
      ValueError: if batch_size < 1.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    max_len = config.length
    symbols_key, length_key = jax.random.split(key)
    symbols = jax.random.randint(
        symbols_key, (batch_size, max_len), FIRST_SYMBOL, FIRST_SYMBOL + config.num_symbols, jnp.int32
    )
    if config.min_length is None:
        lengths = jnp.full((batch_size, 1), max_len, jnp.int32)
    else:
        lengths = jax.random.randint(length_key, (batch_size, 1), config.min_length, max_len + 1, jnp.int32)

    pos = jnp.arange(2 * max_len + 3)[None, :]  # token positions, (1, 2L+3)
    first = (pos >= 1) & (pos <= lengths)
    second = (pos >= lengths + 2) & (pos <= 2 * lengths + 1)
    offset = pos - lengths - 2  # index into the second copy
    source = jnp.where(config.reverse, lengths - 1 - offset, offset)
    gather = lambda idx: jnp.take_along_axis(symbols, jnp.clip(idx, 0, max_len - 1), axis=1)
    tokens = jnp.select(
        [pos == 0, first, pos == lengths + 1, second, pos == 2 * lengths + 2],
        [jnp.full_like(pos, BOS), gather(pos - 1), jnp.full_like(pos, SEP), gather(source), jnp.full_like(pos, EOS)],
        PAD,
    ).astype(jnp.int32)  # (B, 2L+3)
    scored = (pos >= lengths + 2) & (pos <= 2 * lengths + 2)  # targets x1…xL and EOS
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "scored": scored[:, 1:]}


def greedy_decode(decoding: Decoding | LogitsFn, batch: Batch) -> jax.Array:
    """Greedy autoregressive decoding of every scored position (no teacher forcing).

    Position `t` of the scored region is the argmax of the model run on what has been
    decoded so far, fed back as the input at `t + 1`. Tokens after a sequence's EOS
    are never read by the scored positions, as attention is causal. With a
    `Decoding.step` every token is one step through the KV cache (O(T) work per
    token); with a bare logits function (the reference) every scored position re-runs
    the whole buffer. Both give the same tokens. Jittable.

    Args:
      decoding: a `Decoding`, or a causal `logits_fn`: int `(B, T)` -> float `(B, T, V)`.
      batch: `inputs (B, T)` and `scored (B, T)`.

    Returns:
      int `(B, T)`: the decoded next token at every position from the first scored
      one on (zeros before it); compare with `targets` where `scored`.
    """
    decoding = decoding if isinstance(decoding, Decoding) else Decoding(decoding)
    inputs, scored = batch["inputs"], batch["scored"]
    t_len = inputs.shape[-1]
    first = jnp.min(jnp.where(scored, jnp.arange(t_len), t_len))  # before it everything is given
    if decoding.step is not None:
        return _greedy_decode_cached(decoding, inputs, scored, first)

    def body(t, state):
        buffer, decoded = state
        pred = jnp.argmax(decoding.logits(buffer)[:, t], -1).astype(buffer.dtype)  # (B,)
        decoded = decoded.at[:, t].set(pred)
        nxt = jnp.minimum(t + 1, t_len - 1)
        write = scored[:, t] & (t + 1 < t_len)  # feed the prediction back where it is scored
        buffer = buffer.at[:, nxt].set(jnp.where(write, pred, buffer[:, nxt]))
        return buffer, decoded

    _, decoded = jax.lax.fori_loop(first, t_len, body, (inputs, jnp.zeros_like(inputs)))
    return decoded


def _greedy_decode_cached(decoding: Decoding, inputs, scored, first) -> jax.Array:
    """`greedy_decode` one token a step: token t is the input, or the prediction at
    t - 1 where t - 1 is scored; `(B, T)` predictions from `first` on."""

    def body(t, state):
        cache, previous, decoded = state
        fed_back = (t > 0) & scored[:, jnp.maximum(t - 1, 0)]
        token = jnp.where(fed_back, previous, inputs[:, t])  # (B,)
        cache, logits = decoding.step(cache, token[:, None])
        pred = jnp.argmax(logits[:, -1], -1).astype(inputs.dtype)  # (B,)
        return cache, pred, decoded.at[:, t].set(jnp.where(t >= first, pred, 0))

    init = (decoding.cache, jnp.zeros(inputs.shape[:1], inputs.dtype), jnp.zeros_like(inputs))
    return jax.lax.fori_loop(0, inputs.shape[-1], body, init)[2]


def chance_accuracy(config: CopyTaskConfig) -> float:
    """Scored-token accuracy of a model that knows positions but sees no content.

    It can place EOS (1 of L+1 scored tokens per example, at the longest L) and guess
    each symbol with probability 1/num_symbols.
    """
    l = config.length
    return (l / config.num_symbols + 1) / (l + 1)
