"""Which heads matter: importance, single-head ablation, iterative pruning, attention
statistics — for any model with head gates.

A model is a `jax_mha.lab.patching.HeadModel`: a function `apply(params, inputs, gates,
*, attention_fn=None) -> logits` with its number of layers and heads, so a user's own
linen or NNX model plugs in (docs/results/own_model.md); the trainer's
`jax_mha.lab.models.Decoder` is accepted as it is (`patching.as_head_model` wraps it).
Importance, the oracle, pruning and bpc call `apply` with gates only; attention maps
read the weights through `attention_fn` (`patching.run_with_cache`).

Every head of every layer has a gate ξ(l, h) (`head_mask`, shape `(num_layers, H)`,
all ones by default) multiplying its output before the heads are combined. Setting a
gate to 0 removes the head; the gradient of the loss w.r.t. a gate is Michel et al.
(2019), "Are Sixteen Heads Really Better than One?", eq. 2:

    I(l, h) = E_x | ∂L(x) / ∂ξ(l, h) |

a first-order estimate of how much the loss changes when the head is removed.

Compiled functions here take the `HeadModel` as a static argument (compared by
identity; a `Decoder`'s is cached per decoder) and params, batch and gates as traced
ones, so repeated calls with the same shapes (every step of `prune_heads_iteratively`)
reuse one compilation.

Batches are the dicts every task's `batch` returns (`jax_mha.lab.data.Task`): int
`inputs (B, T)`, int `targets (B, T)`, bool `scored (B, T)`; losses and accuracies are
taken over the scored positions (`train.scored_loss`), so the same functions serve the
copy task and a language model.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_mha.lab import head_types
from jax_mha.lab.models import Decoder
from jax_mha.lab.patching import HeadModel, as_head_model, check_gates, run_with_cache
from jax_mha.lab.text import bits_per_character
from jax_mha.lab.train import scored_loss

ORDERS = ("importance", "oracle")


Model = HeadModel | Decoder  # what every function here takes as `model`


def gate_shape(model: Model) -> tuple[int, int]:
    """`(num_layers, num_heads)`, the shape of the model's head gates."""
    return as_head_model(model).gate_shape


def _gates_or_ones(model: Model, gates) -> jax.Array:
    return check_gates(as_head_model(model), gates)


def _loss_and_accuracy(params, model: HeadModel, batch: dict, gates: jax.Array):
    """Teacher-forced scored loss and token accuracy of the gated model on `batch`."""
    logits = model.apply(params, batch["inputs"], gates)  # (B, T, V)
    return scored_loss(logits, batch)


# ----------------------------------------------------------------- gate evaluation


@functools.partial(jax.jit, static_argnames=("model", "chunk_size"))
def _gate_metrics(params, model, batch, gate_stack, chunk_size):
    fn = lambda g: _loss_and_accuracy(params, model, batch, g)
    if chunk_size is None:
        loss, acc = jax.vmap(fn)(gate_stack)
    else:  # vmap over chunks of the stack: same program, bounded memory
        loss, acc = jax.lax.map(fn, gate_stack, batch_size=chunk_size)
    return acc, loss


def gate_metrics(
    params, model: Model, batch: dict, gate_stack: jax.Array, *, chunk_size: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """Accuracy and loss of the model under each gate configuration of a stack.

    All configurations run in one compiled call (vmap over the stack), compiled once
    per stack shape.

    Args:
      params: the model's parameters.
      model: a `HeadModel` or `Decoder` (`patching.as_head_model`).
      batch: `inputs`, `targets`, `scored`, each `(B, T)`.
      gate_stack: float `(G, num_layers, H)`.
      chunk_size: if set, vmap over chunks of this many configurations (a
        `lax.map`), trading speed for memory.

    Returns:
      `(accuracy (G,), loss (G,))`: scored-token accuracy (teacher forced) and mean
      cross-entropy on scored positions.

    Raises:
      ValueError: if `gate_stack` is not `(G, num_layers, H)`.
    """
    model = as_head_model(model)
    gate_stack = jnp.asarray(gate_stack, jnp.float32)
    if gate_stack.ndim != 3 or gate_stack.shape[1:] != gate_shape(model):
        raise ValueError(
            f"gate_stack must have shape (G, num_layers, num_heads) = (G, {gate_shape(model)[0]}, "
            f"{gate_shape(model)[1]}), got {gate_stack.shape}"
        )
    return _gate_metrics(params, model, batch, gate_stack, chunk_size)


def make_accuracy_fn(params, model: Model, batch: dict) -> Callable[[Any], float]:
    """`accuracy(gates) -> float`: scored-token accuracy under `(num_layers, H)` gates.

    Compiled once (on the first call); later calls with any gate values reuse it.
    """

    def accuracy(gates) -> float:
        acc, _ = gate_metrics(params, model, batch, _gates_or_ones(model, gates)[None])
        return float(acc[0])

    return accuracy


def single_head_off_gates(gates: jax.Array) -> jax.Array:
    """Every configuration with one more head switched off.

    Args:
      gates: `(num_layers, H)`.

    Returns:
      `(num_layers * H, num_layers, H)`: entry `l * H + h` is `gates` with `(l, h)`
      set to 0 (identical to `gates` where that head was already off).
    """
    n_layers, n_heads = gates.shape
    eye = jnp.eye(n_layers * n_heads, dtype=gates.dtype).reshape(n_layers * n_heads, n_layers, n_heads)
    return gates[None] * (1.0 - eye)  # (L*H, L, H)


def ablate_each_head(
    params, model: Model, batch: dict, *, gates: jax.Array | None = None,
    chunk_size: int | None = None,
) -> jax.Array:
    """Michel et al.'s "oracle": the accuracy lost when each single head is removed.

    All `num_layers * H` configurations are evaluated in one vmapped, jitted call.

    Args:
      params: the model's parameters.
      model: a `HeadModel` or `Decoder` (`patching.as_head_model`).
      batch: `inputs`, `targets`, `scored`, each `(B, T)`.
      gates: `(num_layers, H)`, the model to start from (default: all heads on).
      chunk_size: see `gate_metrics`.

    Returns:
      `(num_layers, H)`: accuracy with `gates` minus accuracy with head `(l, h)`
      also off; 0 for heads already off.

    Raises:
      ValueError: if `gates` has the wrong shape.
    """
    drops, _ = _ablation(params, as_head_model(model), batch, _gates_or_ones(model, gates), chunk_size)
    return drops


@functools.partial(jax.jit, static_argnames=("model", "chunk_size"))
def _ablation(params, model, batch, gates, chunk_size):
    """(accuracy drops, loss increases), both `(num_layers, H)`, in one compiled call."""
    stack = jnp.concatenate([gates[None], single_head_off_gates(gates)])  # (1 + L*H, L, H)
    acc, loss = _gate_metrics(params, model, batch, stack, chunk_size)
    shape = gates.shape
    return (acc[0] - acc[1:]).reshape(shape), (loss[1:] - loss[0]).reshape(shape)


# ----------------------------------------------------------------- head importance


def per_example_gate_gradients(params, model: Model, batch: dict, gates: jax.Array) -> jax.Array:
    """∂L_n/∂ξ for every example n: `(B, num_layers, H)`; jitted.

    `L_n` is the mean cross-entropy over example n's scored positions
    (`train.scored_loss` on a batch of one); gradients are taken per example with
    `vmap(grad(·))`, not from the batch-summed loss, so that positive and negative
    contributions of different examples do not cancel before the absolute value.
    """
    return _per_example_gate_gradients(params, as_head_model(model), batch, gates)


@functools.partial(jax.jit, static_argnames=("model",))
def _per_example_gate_gradients(params, model: HeadModel, batch: dict, gates: jax.Array) -> jax.Array:
    def example_loss(g, example):
        one = jax.tree.map(lambda x: x[None], example)  # a batch of one: (1, T)
        loss, _ = _loss_and_accuracy(params, model, one, g)
        return loss

    return jax.vmap(jax.grad(example_loss), in_axes=(None, 0))(gates, batch)  # (B, L, H)


def normalize_per_layer(scores: jax.Array, eps: float = 1e-20) -> jax.Array:
    """Divides each layer's row of `(num_layers, H)` scores by its ℓ2 norm (Michel et
    al. §4.1, after Molchanov et al. 2017); an all-zero row stays zero."""
    norm = jnp.sqrt(jnp.sum(jnp.square(scores), axis=-1, keepdims=True))  # (L, 1)
    return scores / jnp.maximum(norm, eps)


def head_importance(
    params, model: Model, batch: dict, *, gates: jax.Array | None = None, normalize: bool = True
) -> jax.Array:
    """Michel et al. 2019's importance proxy `I(l, h) = mean_n |∂L_n/∂ξ(l, h)|`.

    Args:
      params: the model's parameters.
      model: a `HeadModel` or `Decoder` (`patching.as_head_model`).
      batch: `inputs`, `targets`, `scored`, each `(B, T)`; every example counts
        equally.
      gates: `(num_layers, H)` gates the gradient is taken at (default all ones: the
        full model). Heads whose gate is 0 are not part of the model: they get
        importance 0 and do not enter their layer's normalisation.
      normalize: divide each layer's scores by their ℓ2 norm (Michel et al.'s
        default), which makes scores comparable across layers.

    Returns:
      float32 `(num_layers, H)`.

    Raises:
      ValueError: if `gates` has the wrong shape.
    """
    return _importance(params, as_head_model(model), batch, _gates_or_ones(model, gates), normalize)


@functools.partial(jax.jit, static_argnames=("model", "normalize"))
def _importance(params, model, batch, gates, normalize):
    grads = _per_example_gate_gradients(params, model, batch, gates)  # (B, L, H)
    scores = jnp.mean(jnp.abs(grads), axis=0) * (gates != 0)  # (L, H)
    return normalize_per_layer(scores) if normalize else scores


# ----------------------------------------------------------------- iterative pruning


CRITERIA = ("accuracy", "loss")


@dataclasses.dataclass
class PruningStep:
    """The model after one pruning step."""

    num_pruned: int  # heads off in total
    removed: list[tuple[int, int]]  # (layer, head) switched off at this step ([] at step 0)
    gates: np.ndarray  # (num_layers, H), 1 = kept
    accuracy: float  # scored-token accuracy (teacher forced) on the evaluation batch
    loss: float  # scored cross-entropy on the evaluation batch
    scores: np.ndarray | None  # (num_layers, H) the ranking this step's choice came from (None at step 0)
    within_rule: bool  # inside the stop rule (see prune_heads_iteratively's criterion)


@dataclasses.dataclass
class PruningResult:
    """What `prune_heads_iteratively` returns."""

    order: str
    total_heads: int
    base_accuracy: float  # the unpruned model
    max_drop: float
    steps: list[PruningStep]
    heads_prunable: int  # heads off at the last step before the stop rule first fired
    stop_rule_fired: bool  # False: every recorded step stayed within max_drop
    criterion: str = "accuracy"  # what max_drop bounds, see prune_heads_iteratively

    @property
    def fractions(self) -> np.ndarray:
        """Fraction of heads pruned at each recorded step."""
        return np.asarray([s.num_pruned / self.total_heads for s in self.steps])

    @property
    def accuracies(self) -> np.ndarray:
        return np.asarray([s.accuracy for s in self.steps])

    def surviving_gates(self) -> np.ndarray:
        """Gates of the most-pruned model still within the stop rule."""
        return next(s.gates for s in self.steps if s.num_pruned == self.heads_prunable)

    def to_dict(self) -> dict:
        """Plain Python (for JSON)."""
        out = dataclasses.asdict(self)
        for step in out["steps"]:
            step["gates"] = np.asarray(step["gates"]).tolist()
            step["scores"] = None if step["scores"] is None else np.asarray(step["scores"]).tolist()
            step["removed"] = [list(x) for x in step["removed"]]
        out["fractions"] = self.fractions.tolist()
        return out


def _lowest(scores: np.ndarray, alive: np.ndarray, k: int, tiebreak: np.ndarray | None = None) -> list[tuple[int, int]]:
    """The `k` alive heads with the smallest scores (ties: smaller `tiebreak`, then
    lower layer and head index).

    Raises:
      FloatingPointError: if an alive head's score (or tiebreak) is not finite: a
        ranking of NaNs would pick no head and the pruning would never end.
    """
    for name, values in (("score", scores), ("tiebreak", tiebreak)):
        if values is not None and not np.all(np.isfinite(values[alive])):
            bad = [divmod(int(i), scores.shape[1]) for i in np.flatnonzero(alive & ~np.isfinite(values))]
            raise FloatingPointError(
                f"head {name}s are not finite for (layer, head) {bad[:4]}: the model or the batch gives "
                "NaN/inf losses; pruning cannot rank the heads")
    flat_scores = np.where(alive, scores, np.inf).ravel()
    keys = (np.zeros_like(flat_scores) if tiebreak is None else np.where(alive, tiebreak, 0).ravel(), flat_scores)
    order = np.lexsort(keys)  # last key is primary
    n_heads = scores.shape[1]
    return [divmod(int(i), n_heads) for i in order[: min(k, int(alive.sum()))]]


def _rank(params, model, score_batch, gates: np.ndarray, order: str, k: int, normalize: bool, chunk_size,
          criterion: str = "accuracy"):
    """`(heads to remove, the scores they were chosen by)` for one pruning step. The
    oracle ranks by what the stop rule measures: the accuracy drop (ties broken by the
    loss increase) or, for the loss criterion, the loss increase itself."""
    alive = gates > 0
    if order == "importance":
        scores = np.asarray(head_importance(params, model, score_batch, gates=jnp.asarray(gates), normalize=normalize))
        return _lowest(scores, alive, k), scores
    drops, loss_up = _ablation(params, model, score_batch, jnp.asarray(gates), chunk_size)
    if criterion == "loss":
        scores = np.asarray(loss_up)
        return _lowest(scores, alive, k), scores
    scores = np.asarray(drops)
    return _lowest(scores, alive, k, tiebreak=np.asarray(loss_up)), scores


def _within_rule(criterion: str, max_drop: float, base: tuple[float, float], now: tuple[float, float]) -> bool:
    """`base`, `now`: (accuracy, loss). Accuracy: at most `max_drop` below the
    unpruned model (absolute); loss: at most a fraction `max_drop` above it."""
    if criterion == "accuracy":
        return now[0] >= base[0] - max_drop
    return now[1] <= base[1] * (1.0 + max_drop)


def _check_pruning_args(order: str, criterion: str, max_drop: float, heads_per_step: int) -> None:
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if criterion not in CRITERIA:
        raise ValueError(f"criterion must be one of {CRITERIA}, got {criterion!r}")
    if heads_per_step < 1:
        raise ValueError(f"heads_per_step must be >= 1, got {heads_per_step}")
    if not 0 <= max_drop <= (1 if criterion == "accuracy" else np.inf):  # NaN fails too
        raise ValueError(f"max_drop must be in [0, 1] for the accuracy criterion and >= 0 for the loss, got {max_drop}")


def prune_heads_iteratively(
    params,
    model: Model,
    batch: dict,
    *,
    order: str = "importance",
    max_drop: float = 0.01,
    criterion: str = "accuracy",
    heads_per_step: int = 1,
    score_batch: dict | None = None,
    normalize: bool = True,
    run_to_end: bool = False,
    chunk_size: int | None = None,
    callback: Callable[[PruningStep], None] | None = None,
) -> PruningResult:
    """Removes the least important heads step by step (Michel et al. 2019, §4).

    Each step recomputes the ranking on the model pruned so far and switches off the
    `heads_per_step` lowest-ranked heads still on:

    - `order="importance"`: by `head_importance` (per-example gate gradients);
    - `order="oracle"`: by `ablate_each_head`, the accuracy actually lost when the
      head is removed (ties, common once a model is perfect, broken by the loss
      increase); with `criterion="loss"`, by the loss increase when it is removed.

    The stop rule fires at the first step outside `max_drop`: with
    `criterion="accuracy"`, accuracy more than `max_drop` (absolute, accuracy in
    [0, 1]) below the unpruned model's; with `criterion="loss"`, a loss more than the
    fraction `max_drop` above it (0.01 = 1 %, e.g. bits per character).

    Args:
      params: the model's parameters.
      model: a `HeadModel` or `Decoder` (`patching.as_head_model`).
      batch: the evaluation batch: every recorded accuracy is measured on it.
      order: "importance" or "oracle".
      max_drop: the stop rule's tolerance.
      criterion: "accuracy" or "loss".
      heads_per_step: heads switched off per step.
      score_batch: the batch the rankings are computed on (default `batch`); keep it
        apart from `batch` so the heads are not chosen on the examples that score them.
      normalize: per-layer ℓ2 normalisation of the importance scores.
      run_to_end: keep pruning after the stop rule fired, down to zero heads (for a
        full accuracy-vs-pruned curve); `heads_prunable` is unaffected.
      chunk_size: see `gate_metrics`.
      callback: called with each recorded step (progress bars).

    Returns:
      A `PruningResult`; `steps[0]` is the unpruned model.

    Raises:
      ValueError: for an unknown order or criterion, `heads_per_step < 1` or a
        `max_drop` out of range.
      FloatingPointError: as soon as a ranking contains NaN or inf.
    """
    _check_pruning_args(order, criterion, max_drop, heads_per_step)
    model = as_head_model(model)
    score_batch = batch if score_batch is None else score_batch
    shape = gate_shape(model)

    def record(gates, removed, scores, base):
        acc, loss = gate_metrics(params, model, batch, jnp.asarray(gates)[None], chunk_size=chunk_size)
        now = (float(acc[0]), float(loss[0]))
        ok = base is None or _within_rule(criterion, max_drop, base, now)
        step = PruningStep(int(gates.size - gates.sum()), removed, gates.copy(), *now, scores, ok)
        if callback is not None:
            callback(step)
        return step

    gates = np.ones(shape, np.float32)
    steps = [record(gates, [], None, None)]
    base = (steps[0].accuracy, steps[0].loss)
    heads_prunable, fired = 0, False
    while gates.sum() > 0 and (run_to_end or not fired):
        removed, scores = _rank(params, model, score_batch, gates, order, heads_per_step, normalize, chunk_size,
                                criterion)
        for layer, head in removed:
            gates[layer, head] = 0.0
        steps.append(record(gates, removed, scores, base))
        if steps[-1].within_rule and not fired:
            heads_prunable = steps[-1].num_pruned
        fired = fired or not steps[-1].within_rule
    return PruningResult(order, gates.size, base[0], max_drop, steps, heads_prunable, fired, criterion)


# ----------------------------------------------------------------- attention statistics


def attention_weights(params, model: Model, inputs: jax.Array, gates: jax.Array | None = None) -> jax.Array:
    """Attention weights of every layer under `gates` (default all on), jitted.

    Read through the model's `attention_fn` hook (`patching.run_with_cache`), so any
    `HeadModel` whose `apply` passes it on has maps.

    Args:
      params: the model's parameters.
      model: a `HeadModel` or `Decoder`.
      inputs: int `(B, T)`.
      gates: `(num_layers, H)` or None.

    Returns:
      `(num_layers, B, H, T, T)`. A gated-off head still has weights (its output is
      what the gate removes); later layers see the effect of earlier gates.

    Raises:
      ValueError: for gates of the wrong shape or a model that does not pass
        `attention_fn` to each of its layers.
    """
    _, cache = run_with_cache(model, params, inputs, gates=gates, weights=True)
    return jnp.stack(cache.weights)


def offset_profile(weights: jax.Array, query_mask: jax.Array | None = None) -> jax.Array:
    """Mean attention weight at each query−key offset.

    Args:
      weights: `(B, H, T, T)` (or with more leading axes, e.g. `(layers, B, H, T, T)`),
        causal self-attention weights.
      query_mask: bool `(B, T)`, the queries to average over (default all). Only
        queries `t >= offset` count towards offset `offset`.

    Returns:
      `(…, H, T)` (batch axis averaged out): entry `o` is the mean over chosen
      queries t ≥ o of `weights[..., t, t - o]`.
    """
    t_len = weights.shape[-1]
    q_idx = jnp.arange(t_len)[:, None]  # (T, 1)
    offsets = jnp.arange(t_len)[None, :]  # (1, T)
    k_idx = jnp.clip(q_idx - offsets, 0, t_len - 1)  # (T_query, T_offset)
    valid = (q_idx - offsets >= 0).astype(jnp.float32)  # (T, T)
    gathered = jnp.take_along_axis(
        weights.astype(jnp.float32), jax.lax.broadcast_to_rank(k_idx, weights.ndim), axis=-1
    )  # (…, B, H, T_query, T_offset)
    qm = jnp.ones(weights.shape[-4:-3] + (t_len,), jnp.float32) if query_mask is None else query_mask.astype(jnp.float32)
    w = qm[:, None, :, None] * valid[None, None]  # (B, 1, T, T)
    w = jax.lax.broadcast_to_rank(w, weights.ndim)
    batch_axis = weights.ndim - 4
    total = jnp.sum(gathered * w, axis=(batch_axis, -2))  # (…, H, T)
    count = jnp.sum(jnp.broadcast_to(w, gathered.shape), axis=(batch_axis, -2))
    return total / jnp.maximum(count, 1.0)


def diagonal_weight(weights: jax.Array, offset: int, query_mask: jax.Array | None = None) -> jax.Array:
    """Mean weight each head puts on key = query − `offset` (a stripe in the maps).

    Args and averaging as in `offset_profile`; returns `(…, H)`.
    """
    return offset_profile(weights, query_mask)[..., offset]


# ----------------------------------------------------------------- language models: bpc and head types


@functools.partial(jax.jit, static_argnames=("model",))
def _split_losses(params, model: HeadModel, batches: dict, gates: jax.Array) -> jax.Array:
    return jax.lax.map(lambda b: _loss_and_accuracy(params, model, b, gates)[0], batches)  # (num_batches,)


def split_bpc(params, model: Model, batches: dict, *, gates: jax.Array | None = None) -> float:
    """Bits per character over a whole split (`jax_mha.lab.text.validation_batches`).

    Args:
      params: the model's parameters.
      model: a `HeadModel` or `Decoder`.
      batches: `inputs`, `targets`, `scored`, each `(num_batches, B, T)`.
      gates: optional `(num_layers, H)` head gates.

    Returns:
      the mean over every scored character of the cross-entropy in bits (batches
      weighted by how many characters they score).
    """
    losses = _split_losses(params, as_head_model(model), batches, _gates_or_ones(model, gates))
    return float(bits_per_character(losses, num_scored=jnp.sum(batches["scored"], axis=(1, 2))))


def model_head_scores(
    params, model: Model, text_inputs: jax.Array, *, key: jax.Array, num_sequences: int = 32, low: int = 0,
) -> head_types.HeadScores:
    """Every head's previous-token, first-token and entropy scores on real text and
    its induction score on repeated random tokens (`jax_mha.lab.head_types`).

    Args:
      params: the model's parameters.
      model: a `HeadModel` or `Decoder`.
      text_inputs: int `(B, T)`, e.g. validation windows.
      key: PRNG key of the repeated random tokens.
      num_sequences: rows of the induction probe, each `R = T // 2` distinct random
        tokens twice (`2R <= max_len`).
      low: the smallest token id the probe draws.

    Returns:
      `HeadScores`, each field `(num_layers, H)`.
    """
    model = as_head_model(model)
    if model.vocab_size is None:
        raise ValueError("model_head_scores draws random tokens: give the HeadModel its vocab_size")
    repeat = text_inputs.shape[-1] // 2
    probe = head_types.repeated_random_tokens(key, num_sequences, repeat, model.vocab_size, low=low)
    text_weights = attention_weights(params, model, text_inputs)  # (L, B, H, T, T)
    probe_weights = attention_weights(params, model, probe)  # (L, B', H, 2R, 2R)
    return head_types.head_scores(text_weights, probe_weights, probe)


# ----------------------------------------------------------------- oracle in loss, and the causal induction check


def ablate_each_head_loss(
    params, model: Model, batch: dict, *, gates: jax.Array | None = None, chunk_size: int | None = None,
) -> jax.Array:
    """The oracle for a language model: the rise in scored loss (nats) when each single
    head is removed, `(num_layers, H)` (the loss-side twin of `ablate_each_head`)."""
    _, rises = _ablation(params, as_head_model(model), batch, _gates_or_ones(model, gates), chunk_size)
    return rises


def top_heads(scores, k: int) -> list[tuple[int, int]]:
    """The `k` (layer, head) pairs of highest score, highest first."""
    scores = np.asarray(scores)
    flat = np.argsort(-scores.ravel(), kind="stable")[:k]
    return [tuple(int(i) for i in np.unravel_index(f, scores.shape)) for f in flat]


def gates_without(shape: tuple[int, int], heads) -> np.ndarray:
    """All-ones float32 gates `shape` with the listed `(layer, head)` pairs at 0."""
    gates = np.ones(shape, np.float32)
    for layer, head in heads:
        gates[layer, head] = 0.0
    return gates


def same_layer_controls(scores, heads, draws: int, seed: int = 0) -> list[list[tuple[int, int]]]:
    """Matched controls for gating `heads`: `draws` random sets of as many other heads,
    each drawn from the same layers in the same numbers (a layer holding two of `heads`
    gives two of its other heads), so a control removes as much of each layer as the arm
    it is compared with. Sets repeat when a layer has few other heads.

    Args:
      scores: `(num_layers, H)`; only its shape is read.
      heads: the (layer, head) pairs of the arm to match.
      draws: how many control sets.
      seed: NumPy seed of the draws.

    Raises:
      ValueError: if a layer has fewer other heads than the arm takes from it.
    """
    shape = np.shape(scores)
    rng = np.random.default_rng(seed)
    taken = {layer: [h for (l, h) in heads if l == layer] for layer in {l for l, _ in heads}}
    for layer, hs in taken.items():
        if shape[1] - len(hs) < len(hs):
            raise ValueError(f"layer {layer} has {shape[1] - len(hs)} other heads, fewer than the {len(hs)} "
                             f"to match; gate fewer heads (k)")
    return [[(layer, int(h)) for layer, hs in sorted(taken.items())
             for h in rng.choice([h for h in range(shape[1]) if h not in hs], size=len(hs), replace=False)]
            for _ in range(draws)]


_ARM_LOSSES = ("second_copy_loss", "first_copy_loss", "early_loss", "late_loss")


def _gated_losses(params, model: HeadModel, heads, probe, repeat_length, text_inputs, early, late_from_end) -> dict:
    gates = jnp.asarray(gates_without(model.gate_shape, heads))
    losses = jax.device_get(_gated_loss_values(params, gates, probe, text_inputs, model=model,
                                               repeat_length=repeat_length, early=early, late_from_end=late_from_end))
    return {"heads": [tuple(h) for h in heads], **{name: float(x) for name, x in zip(_ARM_LOSSES, losses)}}


@functools.partial(jax.jit, static_argnames=("model", "repeat_length", "early", "late_from_end"))
def _gated_loss_values(params, gates, probe, text_inputs, *, model, repeat_length, early, late_from_end) -> tuple:
    """The `_ARM_LOSSES` with `gates`, one program for every arm and control (a tuple:
    a dict would come back in sorted key order)."""
    copying = head_types.copying_effect(model.apply(params, probe, gates), probe, repeat_length)
    nll = head_types.token_losses(model.apply(params, text_inputs, gates), text_inputs)
    tt = nll.shape[1]  # T - 1 scored positions
    return (copying["second_copy_loss"], copying["first_copy_loss"], nll[:, early[0] : early[1]].mean(),
            nll[:, tt - late_from_end :].mean())


def induction_gating_check(
    params, model: Model, probe: jax.Array, repeat_length: int, text_inputs: jax.Array, scores, *, k: int = 2,
    early: tuple[int, int] | None = None, late_from_end: int | None = None, controls: int = 0, seed: int = 0,
) -> dict:
    """Olsson et al.'s causal test: gate (zero-ablate) the `k` heads of highest
    prefix-matching score and see what breaks, against gating the `k` heads of lowest
    score, and against `controls` matched controls: random heads of the same layers
    (`same_layer_controls`), which remove as much of each layer as the top arm does.

    If those heads do induction, gating them should raise the second-copy loss of the
    repeated probe and the loss at late positions of real text (where earlier context
    can be copied) more than a matched control does, and leave the early positions
    (little context) about where they were.

    Args:
      params: the trained decoder's parameters.
      model: a `HeadModel` or `Decoder`.
      probe: int `(B, 2R)` repeated rows (`head_types.repeated_spans` or `repeated_symbols`).
      repeat_length: R.
      text_inputs: int `(B', T)` held-out text windows (their next characters are the
        targets: the last position is not scored).
      scores: `(num_layers, H)` prefix-matching scores, measured on the probe.
      k: heads gated in each arm.
      early: the early positions `[a, b)` (default `(T // 16, T // 8)`, as the trainer's ICL score).
      late_from_end: the late positions, the last this many scored ones (default `T // 8`).
      controls: matched control draws (0: none).
      seed: seed of the control draws.

    Returns:
      dict with, for arms "none", "top" and "bottom": `second_copy_loss`,
      `first_copy_loss`, `early_loss`, `late_loss` (nats), and `heads` of each arm;
      with `controls`, "controls": a list of such dicts, one per draw.
    """
    t = text_inputs.shape[1]
    early = tuple(map(int, early or (max(1, t // 16), max(2, t // 8))))  # static: hashable
    late_from_end = int(late_from_end or max(1, t // 8))
    model = as_head_model(model)
    order = top_heads(scores, int(np.prod(model.gate_shape)))
    arms = {"none": [], "top": order[:k], "bottom": order[::-1][:k]}
    run = lambda heads: _gated_losses(params, model, heads, probe, repeat_length, text_inputs, early, late_from_end)
    out = {name: run(heads) for name, heads in arms.items()}
    if controls:
        out["controls"] = [run(heads) for heads in same_layer_controls(scores, arms["top"], controls, seed)]
    return out
