"""Training and evaluation of the copy-task decoder with optax.

One trainer for every experiment. The unit of work is a *chunk*: `steps_per_call`
optimizer steps fused into one compiled call with `jax.lax.scan`, vmapped over a
leading seed axis so that all seeds of one configuration train in one program.
Randomness is explicit: each seed's key is split once into a data key and a dropout
key, and step `t` uses `fold_in(key, t)` of each (big_vision's convention).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from jax_mha.data import CopyTaskConfig, make_batch
from jax_mha.functional import attention_entropy
from jax_mha.models import CopyTransformer, ModelConfig


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How to train; defaults are the `full` head-ablation budget."""

    batch_size: int = 64  # sequences per step
    num_steps: int = 3000  # upper bound; early stopping usually ends sooner
    learning_rate: float = 1e-3  # AdamW peak; fine for pre-norm blocks at d_model <= 512
    warmup_steps: int = 100  # linear warmup avoids Adam's large first steps
    end_lr_ratio: float = 0.01  # cosine decays to this fraction of the peak
    weight_decay: float = 0.01  # mild: fresh data every step, little to overfit
    grad_clip_norm: float = 1.0  # global-norm clipping, guards the post-warmup spikes
    steps_per_call: int = 50  # optimizer steps fused per compiled call (lax.scan)
    eval_every: int = 100  # steps between held-out evaluations (a multiple of steps_per_call)
    eval_size: int = 256  # held-out sequences; 1/256 resolution on exact-sequence accuracy
    eval_seed: int = 2**31 - 1  # the held-out set's key, apart from every training seed
    target_accuracy: float = 0.99  # the "solved" threshold for steps-to-target and early stop
    early_stop: bool = True  # stop once every seed holds the target ...
    early_stop_evals: int = 2  # ... on this many consecutive held-out evaluations

    def __post_init__(self):
        if self.eval_every % self.steps_per_call:
            raise ValueError(
                f"eval_every={self.eval_every} must be a multiple of steps_per_call={self.steps_per_call}"
            )
        if min(self.batch_size, self.num_steps, self.steps_per_call, self.eval_size) < 1:
            raise ValueError(
                f"batch_size={self.batch_size}, num_steps={self.num_steps}, steps_per_call="
                f"{self.steps_per_call} and eval_size={self.eval_size} must all be >= 1"
            )


class TrainState(struct.PyTreeNode):
    """Everything that changes during training; a pytree, so it vmaps over seeds."""

    step: jax.Array  # int32 scalar
    params: Any
    opt_state: Any


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with linear warmup and cosine decay."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
        decay_steps=max(cfg.num_steps, cfg.warmup_steps + 1),
        end_value=cfg.learning_rate * cfg.end_lr_ratio,
    )
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip_norm),
        optax.adamw(schedule, weight_decay=cfg.weight_decay),
    )


def init_state(key: jax.Array, model: CopyTransformer, optimizer: optax.GradientTransformation) -> TrainState:
    """Initial parameters and optimizer state for one seed."""
    tokens = jnp.zeros((1, model.config.max_len), jnp.int32)
    params = model.init(key, tokens)["params"]
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))


def scored_loss(logits: jax.Array, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Mean cross-entropy and token accuracy over scored positions.

    Args:
      logits: `(B, T, V)`.
      batch: `targets (B, T)` int, `scored (B, T)` bool.

    Returns:
      `(loss, accuracy)`, scalars.
    """
    weight = batch["scored"].astype(jnp.float32)
    count = jnp.maximum(weight.sum(), 1.0)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    correct = (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32)
    return (nll * weight).sum() / count, (correct * weight).sum() / count


def make_train_step(model: CopyTransformer, optimizer: optax.GradientTransformation) -> Callable:
    """`train_step(state, batch, rng) -> (state, metrics)`, pure; jit it with
    `donate_argnums=(0,)` (see `jit_train_step`)."""

    def train_step(state: TrainState, batch: dict[str, jax.Array], rng: jax.Array):
        def loss_fn(params):
            logits = model.apply({"params": params}, batch["inputs"], deterministic=False, rngs={"dropout": rng})
            return scored_loss(logits, batch)

        (loss, accuracy), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, {"loss": loss, "accuracy": accuracy, "grad_norm": optax.tree.norm(grads)}

    return train_step


def jit_train_step(model: CopyTransformer, optimizer: optax.GradientTransformation) -> Callable:
    """The jitted single step; the input state's buffers are donated (reused in place)."""
    return jax.jit(make_train_step(model, optimizer), donate_argnums=(0,))


def make_train_chunk(
    model: CopyTransformer, optimizer: optax.GradientTransformation, task: CopyTaskConfig,
    batch_size: int, num_steps: int, *, batch_sharding: jax.sharding.Sharding | None = None,
) -> Callable:
    """`chunk(state, run_key) -> (state, metrics)`: `num_steps` steps in one `lax.scan`.

    Step `t`'s batch is `make_batch(fold_in(data_key, t))` and its dropout key
    `fold_in(dropout_key, t)`, with `data_key, dropout_key = split(run_key)`, so a
    run is reproducible whatever the chunking. Metrics carry a leading `(num_steps,)`
    axis. `batch_sharding`, if given, constrains every generated batch (see
    `jax_mha.parallel`).
    """
    train_step = make_train_step(model, optimizer)

    def chunk(state: TrainState, run_key: jax.Array):
        data_key, dropout_key = jax.random.split(run_key)

        def body(state, _):
            batch = make_batch(jax.random.fold_in(data_key, state.step), task, batch_size)
            if batch_sharding is not None:
                batch = jax.lax.with_sharding_constraint(batch, batch_sharding)
            return train_step(state, batch, jax.random.fold_in(dropout_key, state.step))

        return jax.lax.scan(body, state, None, length=num_steps)

    return chunk


def greedy_decode(params, model: CopyTransformer, batch: dict[str, jax.Array], head_mask=None) -> jax.Array:
    """Greedy autoregressive decoding of every scored position.

    Starting from the inputs with the scored region unknown, position `t` of the
    second copy is filled with the argmax of the model run on what has been decoded
    so far (no teacher forcing). Tokens after a sequence's EOS are never read by the
    scored positions, as attention is causal.

    Returns:
      int `(B, T)`: the decoded next token at every position (compare with
      `targets` where `scored`).
    """
    inputs, scored = batch["inputs"], batch["scored"]
    t_len = inputs.shape[-1]
    # The first scored target sits at t = L + 1; before it everything is given.
    first = jnp.min(jnp.where(scored, jnp.arange(t_len), t_len))

    def body(t, state):
        buffer, decoded = state
        logits = model.apply({"params": params}, buffer, head_mask=head_mask)
        pred = jnp.argmax(logits[:, t], -1).astype(buffer.dtype)  # (B,)
        decoded = decoded.at[:, t].set(pred)
        # Feed the prediction back as the next input where this position is scored.
        if_scored = scored[:, t]
        nxt = jnp.minimum(t + 1, t_len - 1)
        write = if_scored & (t + 1 < t_len)
        buffer = buffer.at[:, nxt].set(jnp.where(write, pred, buffer[:, nxt]))
        return buffer, decoded

    _, decoded = jax.lax.fori_loop(first, t_len, body, (inputs, jnp.zeros_like(inputs)))
    return decoded


def evaluate(params, model: CopyTransformer, batch: dict[str, jax.Array], head_mask=None) -> dict[str, jax.Array]:
    """Held-out metrics of one model.

    Returns a dict of:
      loss, token_accuracy: teacher-forced, over scored positions;
      exact_accuracy: fraction of sequences whose greedy decoding is right at every
        scored position;
      entropy, entropy_normalized, confidence: `(num_layers, H)`, mean over scored
        queries of each head's attention entropy (nats), of the entropy divided by
        ln(number of keys the query may see), and of the max weight.
    """
    logits, weights = model.apply({"params": params}, batch["inputs"], head_mask=head_mask, return_weights=True)
    loss, token_accuracy = scored_loss(logits, batch)
    decoded = greedy_decode(params, model, batch, head_mask)
    exact = jnp.all(jnp.where(batch["scored"], decoded == batch["targets"], True), axis=-1)

    # weights: (layers, B, H, T, T); query t sees t + 1 keys under the causal mask.
    t_len = batch["inputs"].shape[-1]
    entropy = attention_entropy(weights)  # (layers, B, H, T)
    log_keys = jnp.log(jnp.arange(1, t_len + 1, dtype=jnp.float32))
    normalized = entropy / jnp.where(log_keys > 0, log_keys, 1.0)[None, None, None, :]
    confidence = weights.max(-1).astype(jnp.float32)
    query_weight = batch["scored"][None, :, None, :].astype(jnp.float32)  # (1, B, 1, T)
    per_head = lambda x: (x * query_weight).sum((1, 3)) / jnp.maximum(query_weight.sum((1, 3)), 1.0)
    return {
        "loss": loss,
        "token_accuracy": token_accuracy,
        "exact_accuracy": exact.mean(),
        "entropy": per_head(entropy),
        "entropy_normalized": per_head(normalized),
        "confidence": per_head(confidence),
    }


@dataclasses.dataclass
class SeedsResult:
    """What `train_seeds` returns; arrays carry a leading seed axis."""

    seeds: list[int]
    state: TrainState  # final states, stacked over seeds
    curve: dict[str, np.ndarray]  # "step" (C,), "loss"/"accuracy" (seeds, C): training means of each chunk
    evals: dict[str, np.ndarray]  # "step" (E,), then each evaluate() metric stacked (seeds, E, …)
    steps_to_target: list[int | None]  # first eval step with held-out token accuracy >= target, per seed
    steps_run: int
    wall_seconds: float  # everything: compile, training, evaluation
    train_seconds: float  # training calls after the first (compile excluded)
    tokens_per_second: float  # sum over seeds, from train_seconds


def train_seeds(
    model_cfg: ModelConfig,
    task: CopyTaskConfig,
    cfg: TrainConfig,
    seeds: Sequence[int],
    *,
    use_vmap: bool = True,
    mesh: jax.sharding.Mesh | None = None,
    callback: Callable[[dict[str, Any]], None] | None = None,
) -> SeedsResult:
    """Trains one model per seed: all seeds in one vmapped program (or, with
    `use_vmap=False`, one after another, for comparison).

    With a `mesh` (`jax_mha.parallel.make_mesh`), the vmapped program runs sharded:
    heads across its "model" axis, each batch across "data"; the results are the same.

    `callback`, if given, receives after every chunk a dict with `step`, `loss`,
    `accuracy` (means over seeds of the chunk) and, at evaluation points, `eval`
    (the metrics of `evaluate`, stacked over seeds): progress bars live there.

    Raises:
      RuntimeError: at once, naming the step and seed, if a loss is not finite.
    """
    if cfg.num_steps % cfg.steps_per_call:
        raise ValueError(f"num_steps={cfg.num_steps} must be a multiple of steps_per_call={cfg.steps_per_call}")
    start = time.perf_counter()
    model = CopyTransformer(model_cfg)
    optimizer = make_optimizer(cfg)
    seeds = list(seeds)
    # Raw uint32 keys: plain arrays, so they stack and vmap like any other input.
    keys = jax.vmap(jax.random.split)(jnp.stack([jax.random.PRNGKey(s) for s in seeds]))  # (seeds, 2, 2)
    init_keys, run_keys = keys[:, 0], keys[:, 1]
    eval_batch = make_batch(jax.random.key(cfg.eval_seed), task, cfg.eval_size)

    chunk = make_train_chunk(model, optimizer, task, cfg.batch_size, cfg.steps_per_call)
    eval_fn = lambda params: evaluate(params, model, eval_batch)
    if mesh is not None:
        if not use_vmap:
            raise ValueError("a mesh needs use_vmap=True: the sharded program is the vmapped one")
        from jax_mha import parallel  # parallel builds on this module; imported late to keep imports one-way

        chunk_fn = parallel.make_sharded_train_chunk(
            model, optimizer, task, cfg.batch_size, cfg.steps_per_call, mesh, num_seeds=len(seeds)
        )
        eval_all = jax.jit(jax.vmap(eval_fn))
        state = parallel.shard_train_state(jax.jit(jax.vmap(lambda k: init_state(k, model, optimizer)))(init_keys), mesh)
    elif use_vmap:
        chunk_fn = jax.jit(jax.vmap(chunk), donate_argnums=(0,))
        eval_all = jax.jit(jax.vmap(eval_fn))
        state = jax.jit(jax.vmap(lambda k: init_state(k, model, optimizer)))(init_keys)
    else:
        one_chunk, one_eval = jax.jit(chunk, donate_argnums=(0,)), jax.jit(eval_fn)
        unstack = lambda tree: [jax.tree.map(lambda x: x[i], tree) for i in range(len(seeds))]
        stack = lambda trees: jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
        chunk_fn = lambda states, ks: stack([one_chunk(s, k) for s, k in zip(unstack(states), ks)])
        eval_all = lambda params: stack([one_eval(p) for p in unstack(params)])
        init_one = jax.jit(lambda k: init_state(k, model, optimizer))
        state = stack([init_one(k) for k in init_keys])

    train_seconds = 0.0
    curve = {"step": [], "loss": [], "accuracy": []}
    evals: dict[str, list] = {"step": []}
    consecutive = 0
    step = 0
    for call in range(cfg.num_steps // cfg.steps_per_call):
        t0 = time.perf_counter()
        state, metrics = chunk_fn(state, run_keys)
        loss = np.asarray(metrics["loss"])  # (seeds, steps_per_call); waits for the call
        if call > 0:
            train_seconds += time.perf_counter() - t0
        if not np.all(np.isfinite(loss)):
            seed_idx, offset = np.argwhere(~np.isfinite(loss))[0]
            raise RuntimeError(
                f"non-finite loss {loss[seed_idx, offset]} at step {step + offset} (seed {seeds[seed_idx]})"
            )
        step += cfg.steps_per_call
        report = {"step": step, "loss": float(loss.mean()), "accuracy": float(np.mean(metrics["accuracy"]))}
        curve["step"].append(step)
        curve["loss"].append(loss.mean(-1))
        curve["accuracy"].append(np.asarray(metrics["accuracy"]).mean(-1))
        if step % cfg.eval_every == 0 or step == cfg.num_steps:
            result = jax.tree.map(np.asarray, eval_all(state.params))
            evals["step"].append(step)
            for name, value in result.items():
                evals.setdefault(name, []).append(value)
            report["eval"] = result
            solved = np.all(result["exact_accuracy"] >= cfg.target_accuracy)
            consecutive = consecutive + 1 if solved else 0
        if callback is not None:
            callback(report)
        if cfg.early_stop and consecutive >= cfg.early_stop_evals:
            break

    # Stack eval metrics to (seeds, E, …) and curves to (seeds, C).
    stacked = {"step": np.asarray(evals.pop("step"))}
    stacked.update({name: np.stack(vals, axis=1) for name, vals in evals.items()})
    curve_arr = {"step": np.asarray(curve["step"]), "loss": np.stack(curve["loss"], 1), "accuracy": np.stack(curve["accuracy"], 1)}
    hit = stacked["token_accuracy"] >= cfg.target_accuracy  # (seeds, E)
    steps_to_target = [int(stacked["step"][row.argmax()]) if row.any() else None for row in hit]
    trained_calls = step // cfg.steps_per_call - 1
    tokens = trained_calls * cfg.steps_per_call * cfg.batch_size * task.seq_len * len(seeds)
    return SeedsResult(
        seeds=seeds, state=state, curve=curve_arr, evals=stacked, steps_to_target=steps_to_target,
        steps_run=step, wall_seconds=time.perf_counter() - start, train_seconds=train_seconds,
        tokens_per_second=tokens / train_seconds if train_seconds > 0 else float("nan"),
    )
