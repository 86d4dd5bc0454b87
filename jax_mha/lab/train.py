"""Training and evaluation of the decoder on any task, with optax: the one trainer.

The unit of work is a *chunk*: `steps_per_call` optimizer steps fused into one
compiled call with `jax.lax.scan`, vmapped over a leading seed axis so that all seeds
of one configuration train in one program. Randomness is explicit: each seed's key is
split once into a data key and a dropout key, and step `t` uses `fold_in(key, t)` of
each (big_vision's convention), so a run resumed from a saved state at step `t`
continues exactly as if it had never stopped.

The task (`jax_mha.lab.data.Task`) supplies the batches, its held-out metrics and the
metric early stopping watches; the loss is the cross-entropy over the positions the
batch marks as `scored`. This module also does the one `jax.jit` over a device mesh:
`jax_mha.parallel` only says where each array goes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.experimental import multihost_utils

from jax_mha import parallel
from jax_mha.functional import attention_entropy
from jax_mha.lab import checkpoint
from jax_mha.lab.data import Batch, Decoding, Task, task_to_dict
from jax_mha.lab.models import Decoder, ModelConfig, decode_step, empty_cache, model_to_dict

_POSITIVE_INTS = ("batch_size", "num_steps", "steps_per_call", "eval_every", "eval_size", "early_stop_evals")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How to train; defaults are the `full` head-ablation budget."""

    batch_size: int = 64  # sequences per step
    num_steps: int = 3000  # upper bound (a multiple of steps_per_call); early stopping usually ends sooner
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
        """Raises ValueError (TypeError for a non-int count) naming the bad field."""
        for field in _POSITIVE_INTS + ("warmup_steps",):
            value = getattr(self, field)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise TypeError(f"{field} must be an int, got {value!r}")
        for field in _POSITIVE_INTS:
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        # Written so that NaN fails every check.
        checks = (
            ("learning_rate", 0 < self.learning_rate < math.inf, "a finite number > 0"),
            ("warmup_steps", self.warmup_steps >= 0, ">= 0"),
            ("end_lr_ratio", 0 <= self.end_lr_ratio <= 1, "in [0, 1]"),
            ("weight_decay", 0 <= self.weight_decay < math.inf, "a finite number >= 0"),
            ("grad_clip_norm", 0 < self.grad_clip_norm < math.inf, "a finite number > 0"),
            ("target_accuracy", 0 < self.target_accuracy <= 1, "in (0, 1]"),
        )
        for field, ok, want in checks:
            if not ok:
                raise ValueError(f"{field} must be {want}, got {getattr(self, field)}")
        for field in ("eval_every", "num_steps"):
            if getattr(self, field) % self.steps_per_call:
                raise ValueError(f"{field}={getattr(self, field)} must be a multiple of steps_per_call={self.steps_per_call}")


class TrainState(struct.PyTreeNode):
    """Everything that changes during training; a pytree, so it vmaps over seeds."""

    step: jax.Array  # int32 scalar
    params: Any
    opt_state: Any


def weight_decay_mask(params) -> Any:
    """True on the leaves AdamW decays: matrices (kernels, the token and position
    embeddings), False on vectors (LayerNorm scales and biases, every bias).

    nanoGPT's rule (`configure_optimizers`: decay parameters with `dim >= 2`):
    shrinking a LayerNorm scale towards 0 or a bias towards 0 is not a penalty on
    model complexity, only a pull away from the identity/zero the layer needs.
    """
    return jax.tree.map(lambda x: jnp.ndim(x) >= 2, params)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with linear warmup and cosine decay; norms
    and biases are exempt from weight decay (`weight_decay_mask`)."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
        decay_steps=max(cfg.num_steps, cfg.warmup_steps + 1),
        end_value=cfg.learning_rate * cfg.end_lr_ratio,
    )
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip_norm),
        optax.adamw(schedule, weight_decay=cfg.weight_decay, mask=weight_decay_mask),
    )


def init_state(key: jax.Array, model: Decoder, optimizer: optax.GradientTransformation) -> TrainState:
    """Initial parameters and optimizer state for one seed."""
    tokens = jnp.zeros((1, model.config.max_len), jnp.int32)
    params = model.init(key, tokens)["params"]
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))


def abstract_state(model: Decoder, optimizer: optax.GradientTransformation, num_seeds: int | None = None):
    """Shapes of the (seed-stacked, if `num_seeds`) state, without computing it."""
    one = lambda key: init_state(key, model, optimizer)
    if num_seeds is None:
        return jax.eval_shape(one, jax.random.PRNGKey(0))
    return jax.eval_shape(jax.vmap(one), jnp.zeros((num_seeds, 2), jnp.uint32))


def scored_loss(logits: jax.Array, batch: Batch) -> tuple[jax.Array, jax.Array]:
    """Mean cross-entropy and token accuracy over scored positions.

    Args:
      logits: `(B, T, V)`.
      batch: `targets (B, T)` int, `scored (B, T)` bool.

    Returns:
      `(loss, accuracy)`, scalars (0 and 0 when nothing is scored).
    """
    weight = batch["scored"].astype(jnp.float32)
    count = jnp.maximum(weight.sum(), 1.0)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    correct = (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32)
    return (nll * weight).sum() / count, (correct * weight).sum() / count


def make_train_step(
    model: Decoder, optimizer: optax.GradientTransformation, *, loss_fn: Callable = scored_loss,
    batch_sharding: jax.sharding.Sharding | None = None,
) -> Callable:
    """`train_step(state, batch, rng) -> (state, metrics)`, pure; `jit_train_step`
    jits it. `loss_fn(logits, batch) -> (loss, accuracy)`; `batch_sharding`, if
    given, constrains the batch (how it is split over a mesh)."""

    def train_step(state: TrainState, batch: Batch, rng: jax.Array):
        if batch_sharding is not None:
            batch = jax.lax.with_sharding_constraint(batch, batch_sharding)

        def loss(params):
            logits = model.apply({"params": params}, batch["inputs"], deterministic=False, rngs={"dropout": rng})
            return loss_fn(logits, batch)

        (value, accuracy), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, {"loss": value, "accuracy": accuracy, "grad_norm": optax.tree.norm(grads)}

    return train_step


SEQUENCE_PARALLEL = ("ring", "ulysses")


def sequence_parallel(model: Decoder, mesh: jax.sharding.Mesh | None, kind: str = "ring") -> Decoder:
    """The model to train on `mesh`: on a "sequence" axis of P > 1 devices its
    attention runs as ring attention (`kind="ring"`, `parallel.ring_attention_fn`)
    or Ulysses (`"ulysses"`, `parallel.ulysses_attention_fn`: every head count a
    multiple of P) with every batch's tokens split over that axis
    (`parallel.batch_sharding`), the same parameters and the same result; otherwise
    `model` itself. Evaluation keeps `model` (it reads the attention weights).

    Raises:
      ValueError: for another `kind`.
    """
    if kind not in SEQUENCE_PARALLEL:
        raise ValueError(f"sequence parallelism must be one of {SEQUENCE_PARALLEL}, got {kind!r}")
    if parallel.sequence_size(mesh) == 1 or model.attention_fn is not None:
        return model
    make = parallel.ring_attention_fn if kind == "ring" else parallel.ulysses_attention_fn
    return model.clone(attention_fn=make(mesh))


def _jit(fn: Callable, model: Decoder, optimizer, num_seeds: int | None, mesh, rules) -> Callable:
    """The one jit: the state donated and, on a mesh, kept sharded by `parallel`."""
    if mesh is None:
        return jax.jit(fn, donate_argnums=(0,))
    state_sh = parallel.tree_shardings(abstract_state(model, optimizer, num_seeds), mesh, rules)
    return jax.jit(fn, out_shardings=(state_sh, parallel.replicated(mesh)), donate_argnums=(0,))


def jit_train_step(
    model: Decoder, optimizer: optax.GradientTransformation, *, mesh: jax.sharding.Mesh | None = None,
    rules: parallel.Rules = parallel.DEFAULT_RULES, sequence_parallel_kind: str = "ring",
) -> Callable:
    """The jitted single step; the input state's buffers are donated (reused in place).

    With a `mesh`, pass a state placed by `parallel.shard`; heads are split over its
    "model" axis, each batch over "data" and its tokens over "sequence" (ring
    attention, see `sequence_parallel`), and the state stays sharded.

    Raises:
      ValueError: if `num_heads` does not divide by the "model" axis (at once), the
        batch size by the "data" axis or the sequence length by the "sequence" axis
        (at the first call).
    """
    if mesh is None:
        return _jit(make_train_step(model, optimizer), model, optimizer, None, None, rules)
    parallel.check_heads_divisible(model.config.num_heads, mesh, rules)
    step = make_train_step(sequence_parallel(model, mesh, sequence_parallel_kind), optimizer,
                           batch_sharding=parallel.batch_sharding(mesh, rules))

    def checked_step(state, batch, rng):
        parallel.check_batch_divisible(batch["inputs"].shape[0], mesh, rules)  # while tracing: shapes are known
        parallel.check_sequence_divisible(batch["inputs"].shape[-1], mesh)
        return step(state, batch, rng)

    return _jit(checked_step, model, optimizer, None, mesh, rules)


def make_train_chunk(
    model: Decoder, optimizer: optax.GradientTransformation, task: Task, batch_size: int, num_steps: int,
    *, batch_sharding: jax.sharding.Sharding | None = None,
) -> Callable:
    """`chunk(state, run_key) -> (state, metrics)`: `num_steps` steps in one `lax.scan`.

    Step `t`'s batch is `task.batch(fold_in(data_key, t), batch_size)` and its dropout
    key `fold_in(dropout_key, t)`, with `data_key, dropout_key = split(run_key)`, so a
    run is reproducible from its seed and resumable from any saved state. Metrics
    come back per step, `(num_steps,)` each.
    """
    train_step = make_train_step(model, optimizer, batch_sharding=batch_sharding)

    def chunk(state: TrainState, run_key: jax.Array):
        data_key, dropout_key = jax.random.split(run_key)

        def body(state, _):
            batch = task.batch(jax.random.fold_in(data_key, state.step), batch_size)
            return train_step(state, batch, jax.random.fold_in(dropout_key, state.step))

        return jax.lax.scan(body, state, None, length=num_steps)

    return chunk


def jit_train_chunk(
    model: Decoder, optimizer: optax.GradientTransformation, task: Task, batch_size: int, num_steps: int,
    *, num_seeds: int | None = None, mesh: jax.sharding.Mesh | None = None,
    rules: parallel.Rules = parallel.DEFAULT_RULES, sequence_parallel_kind: str = "ring",
) -> Callable:
    """`make_train_chunk` jitted with the state donated, `vmap`ped over a leading
    seed axis when `num_seeds` is given; with a `mesh`, sharded as `jit_train_step`.

    Raises:
      ValueError: if `num_heads`, `batch_size` or the task's `seq_len` do not divide
        by their mesh axes.
    """
    sharding, train_model = None, model
    if mesh is not None:
        parallel.check_heads_divisible(model.config.num_heads, mesh, rules)
        parallel.check_batch_divisible(batch_size, mesh, rules)
        parallel.check_sequence_divisible(task.seq_len, mesh)
        sharding = parallel.batch_sharding(mesh, rules)
        train_model = sequence_parallel(model, mesh, sequence_parallel_kind)
    chunk = make_train_chunk(train_model, optimizer, task, batch_size, num_steps, batch_sharding=sharding)
    return _jit(chunk if num_seeds is None else jax.vmap(chunk), model, optimizer, num_seeds, mesh, rules)


def evaluate(params, model: Decoder, task: Task, batch: Batch, head_mask=None) -> dict[str, jax.Array]:
    """Held-out metrics of one model; jittable.

    Returns a dict of:
      loss, token_accuracy: teacher-forced, over scored positions;
      the task's own metrics (`task.eval_metrics`, e.g. the copy task's
        `exact_accuracy` from greedy decoding, the language model's `bpc`);
      entropy, entropy_normalized, confidence: `(num_layers, H)`, mean over scored
        queries of each head's attention entropy (nats), of the entropy divided by
        ln(number of keys the query may see), and of the max weight (attention
        models only: a `mixer="gated_conv"` model has no heads, and no KV-cache
        decoding for the task's metrics either).
    """
    if model.config.mixer != "attention":
        logits = model.apply({"params": params}, batch["inputs"])
        loss, token_accuracy = scored_loss(logits, batch)
        logits_fn = lambda tokens: model.apply({"params": params}, tokens)
        return {"loss": loss, "token_accuracy": token_accuracy,
                **task.eval_metrics(Decoding(logits_fn), logits, batch)}
    logits, weights = model.apply({"params": params}, batch["inputs"], head_mask=head_mask, return_weights=True)
    loss, token_accuracy = scored_loss(logits, batch)
    logits_fn = lambda tokens: model.apply({"params": params}, tokens, head_mask=head_mask)
    b, t_len = batch["inputs"].shape
    decoding = Decoding(logits_fn, decode_step(params, model.config, head_mask), empty_cache(model.config, b, t_len))
    # weights: (layers, B, H, T, T); query t sees t + 1 keys under the causal mask.
    entropy = attention_entropy(weights)  # (layers, B, H, T)
    log_keys = jnp.log(jnp.arange(1, t_len + 1, dtype=jnp.float32))
    normalized = entropy / jnp.where(log_keys > 0, log_keys, 1.0)[None, None, None, :]
    confidence = weights.max(-1).astype(jnp.float32)
    query_weight = batch["scored"][None, :, None, :].astype(jnp.float32)  # (1, B, 1, T)
    per_head = lambda x: (x * query_weight).sum((1, 3)) / jnp.maximum(query_weight.sum((1, 3)), 1.0)
    return {
        "loss": loss,
        "token_accuracy": token_accuracy,
        **task.eval_metrics(decoding, logits, batch),
        "entropy": per_head(entropy),
        "entropy_normalized": per_head(normalized),
        "confidence": per_head(confidence),
    }


# ----------------------------------------------------------------- many seeds, resumable


@dataclasses.dataclass
class SeedsResult:
    """What `train_seeds` returns; arrays carry a leading seed axis."""

    seeds: list[int]
    state: TrainState  # final states, stacked over seeds
    curve: dict[str, np.ndarray]  # "step" (C,), "loss"/"accuracy" (seeds, C): training means of each chunk
    evals: dict[str, np.ndarray]  # "step" (E,), then each evaluate() metric stacked (seeds, E, …)
    steps_to_target: list[int | None]  # first eval step with held-out token accuracy >= target, per seed (None without a stop_metric)
    steps_run: int
    stop_reason: str  # "target reached" (early stop) or "step limit"
    resumed_from: int  # the step a saved state was resumed at (0: a fresh run)
    wall_seconds: float  # everything, over every process of the run: compile, training, evaluation
    train_seconds: float  # training calls after each process's first (compile excluded)
    tokens_per_second: float  # sum over seeds, from train_seconds


@dataclasses.dataclass(frozen=True)
class _Programs:
    """The compiled pieces of one run, all over the stacked seed axis."""

    init: Callable  # (init_keys (S, 2)) -> state
    chunk: Callable  # (state, run_keys (S, 2)) -> (state, metrics (S, steps_per_call))
    evaluate: Callable  # (params) -> metrics (S, …)
    place: Callable  # state as loaded -> state where `chunk` wants it


def _stack(trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _unstack(tree, n: int):
    return [jax.tree.map(lambda x: x[i], tree) for i in range(n)]


def _programs(model, optimizer, task, cfg: TrainConfig, num_seeds: int, use_vmap: bool, mesh,
              sequence_parallel_kind: str = "ring") -> _Programs:
    eval_batch = task.eval_batch(jax.random.key(cfg.eval_seed), cfg.eval_size)  # eager: its ops stay compiled across runs
    eval_one = lambda params: evaluate(params, model, task, eval_batch)
    # One seed at a time: the values are the same (jax.random is vmap-invariant), and
    # XLA:CPU compiles one seed's initialiser a little faster than the vmapped one
    # (docs/performance.md, "Design choices and what they measured").
    one_init = jax.jit(lambda key: init_state(key, model, optimizer))
    init = lambda keys: _stack([one_init(k) for k in keys])
    if use_vmap:
        place = (lambda s: s) if mesh is None else (lambda s: parallel.shard(s, mesh))
        return _Programs(
            init=lambda keys: place(init(keys)),
            chunk=jit_train_chunk(model, optimizer, task, cfg.batch_size, cfg.steps_per_call,
                                  num_seeds=num_seeds, mesh=mesh, sequence_parallel_kind=sequence_parallel_kind),
            # Replicated metrics: every process can read them (a head-sharded output
            # spanning several processes cannot be fetched by any one of them).
            evaluate=jax.jit(jax.vmap(eval_one), out_shardings=None if mesh is None else parallel.replicated(mesh)),
            place=place)
    if mesh is not None:
        raise ValueError("a mesh needs use_vmap=True: the sharded program is the vmapped one")
    one_chunk = jit_train_chunk(model, optimizer, task, cfg.batch_size, cfg.steps_per_call)
    one_eval = jax.jit(eval_one)
    return _Programs(
        init=init,
        chunk=lambda states, keys: _stack([one_chunk(s, k) for s, k in zip(_unstack(states, num_seeds), keys)]),
        evaluate=lambda params: _stack([one_eval(p) for p in _unstack(params, num_seeds)]),
        place=lambda s: s)


def _gathered(state):
    """`state` as host arrays every process holds whole. Under several processes a
    sharded leaf spans devices no one process can read; `process_allgather` is a
    collective, so every process must call this at the same point."""
    if jax.process_count() == 1:
        return state
    return multihost_utils.process_allgather(state, tiled=True)


def _fresh_history(fingerprint: dict) -> dict:
    """What a run has measured so far; saved beside the state, so a resumed run's
    curves, timings and early-stopping count carry on."""
    return {"fingerprint": fingerprint, "step": 0, "consecutive": 0, "stop_reason": None,
            "curve": {"step": [], "loss": [], "accuracy": []}, "evals": {"step": []},
            "train_seconds": 0.0, "timed_steps": 0, "wall_seconds": 0.0}


def _restored_history(saved: dict) -> dict:
    """A history read back from JSON: the per-chunk and per-evaluation values as
    float32 arrays again (`_result` stacks them with the ones still to come)."""
    for part in ("curve", "evals"):
        saved[part] = {k: v if k == "step" else [np.asarray(x, np.float32) for x in v] for k, v in saved[part].items()}
    return saved


def _restore_target(shapes, mesh: jax.sharding.Mesh | None):
    """`shapes` with the sharding each leaf has in training, so that a saved state
    is read straight into place (each process reading only its own shards)."""
    if mesh is None:
        shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.local_devices()[0]), shapes)
    else:
        shardings = parallel.tree_shardings(shapes, mesh)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings)


def _start(programs: _Programs, init_keys, manager, fingerprint: dict, target):
    """A fresh state, or the newest one saved by the same run under `manager`
    (None: nothing saved), restored into `target`'s shardings.

    Raises:
      ValueError: naming the folder, if it was saved by another run or does not
        match this one's state.
    """
    history = None if manager is None else checkpoint.train_history(manager)
    if history is None:
        return programs.init(init_keys), _fresh_history(fingerprint)
    saved = history.get("fingerprint")
    if saved != fingerprint:
        keys = sorted(k for k in fingerprint if not isinstance(saved, dict) or saved.get(k) != fingerprint[k])
        raise ValueError(f"{manager.directory} was saved by another run (it differs in {keys}); "
                         "delete it to start over")
    return programs.place(checkpoint.restore_train_state(manager, target)), _restored_history(history)


def _advance(programs: _Programs, state, run_keys, history: dict, seeds: list[int], timed: bool):
    """One chunk of training; its means go into `history`. Raises RuntimeError at
    once, naming the step and seed, if a loss is not finite."""
    t0 = time.perf_counter()
    state, metrics = programs.chunk(state, run_keys)
    loss = np.asarray(metrics["loss"])  # (seeds, steps_per_call); waits for the call
    if timed:
        history["train_seconds"] += time.perf_counter() - t0
        history["timed_steps"] += loss.shape[1]
    if not np.all(np.isfinite(loss)):
        seed_idx, offset = np.argwhere(~np.isfinite(loss))[0]
        raise RuntimeError(
            f"non-finite loss {loss[seed_idx, offset]} at step {history['step'] + offset} (seed {seeds[seed_idx]})")
    accuracy = np.asarray(metrics["accuracy"])
    history["step"] += loss.shape[1]
    for name, value in (("step", history["step"]), ("loss", loss.mean(-1)), ("accuracy", accuracy.mean(-1))):
        history["curve"][name].append(value)
    return state, {"step": history["step"], "loss": float(loss.mean()), "accuracy": float(accuracy.mean())}


def _evaluate(programs: _Programs, state, history: dict, cfg: TrainConfig, task: Task) -> dict:
    """Held-out metrics into `history`; counts evaluations in a row at the target."""
    result = jax.tree.map(np.asarray, programs.evaluate(state.params))
    history["evals"]["step"].append(history["step"])
    for name, value in result.items():
        history["evals"].setdefault(name, []).append(value)
    if task.stop_metric is not None:
        solved = bool(np.all(result[task.stop_metric] >= cfg.target_accuracy))
        history["consecutive"] = history["consecutive"] + 1 if solved else 0
        if cfg.early_stop and history["consecutive"] >= cfg.early_stop_evals:
            history["stop_reason"] = "target reached"
    return result


def _result(seeds, state, history: dict, cfg: TrainConfig, task: Task, resumed_from: int) -> SeedsResult:
    """Curves stacked to (seeds, C), eval metrics to (seeds, E, …)."""
    evals = {"step": np.asarray(history["evals"]["step"])}
    evals.update({k: np.stack(v, axis=1) for k, v in history["evals"].items() if k != "step"})
    curve = {"step": np.asarray(history["curve"]["step"])}
    curve.update({k: np.stack(history["curve"][k], 1) for k in ("loss", "accuracy")})
    hit = evals["token_accuracy"] >= cfg.target_accuracy  # (seeds, E)
    if task.stop_metric is None:  # no target to reach (a language model): no steps-to-target either
        hit = np.zeros_like(hit)
    tokens = history["timed_steps"] * cfg.batch_size * task.seq_len * len(seeds)
    return SeedsResult(
        seeds=seeds, state=state, curve=curve, evals=evals,
        steps_to_target=[int(evals["step"][row.argmax()]) if row.any() else None for row in hit],
        steps_run=history["step"], stop_reason=history["stop_reason"] or "step limit", resumed_from=resumed_from,
        wall_seconds=history["wall_seconds"], train_seconds=history["train_seconds"],
        tokens_per_second=tokens / history["train_seconds"] if history["train_seconds"] > 0 else float("nan"),
    )


def _check_run(model_cfg: ModelConfig, task: Task, seeds: list[int]) -> None:
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be a non-empty list of distinct ints, got {seeds}")
    if model_cfg.vocab_size != task.vocab_size or model_cfg.max_len < task.seq_len:
        raise ValueError(
            f"model (vocab_size={model_cfg.vocab_size}, max_len={model_cfg.max_len}) does not fit the "
            f"{task.name} task (vocab_size={task.vocab_size}, seq_len={task.seq_len})")


def train_seeds(
    model_cfg: ModelConfig, task: Task, cfg: TrainConfig, seeds: Sequence[int], *, use_vmap: bool = True,
    mesh: jax.sharding.Mesh | None = None, callback: Callable[[dict[str, Any]], None] | None = None,
    state_dir: str | Path | None = None, sequence_parallel_kind: str = "ring", eval_steps: Sequence[int] = (),
) -> SeedsResult:
    """Trains one model per seed: all seeds in one vmapped program (or, with
    `use_vmap=False`, one after another, for comparison).

    With a `mesh` (`jax_mha.parallel.make_mesh`), the vmapped program runs sharded:
    heads across its "model" axis, each batch across "data", and its tokens across
    "sequence" by ring attention or Ulysses (`sequence_parallel_kind`, see
    `sequence_parallel`); the results are the same.
    Under `jax.distributed` (several processes, `jax_mha.lab.distributed`) the mesh may
    span every process: each builds the same batches from the same keys inside the
    program, every process calls `train_seeds` alike, and each gets back the whole
    final state as host arrays; with a `state_dir`, every process saves its own
    shards there through orbax (on a filesystem all processes share, since each
    resumes from it).

    With a `state_dir`, the state (parameters, optimizer state, step) and everything
    measured so far are saved there at every evaluation through orbax
    (`jax_mha.lab.checkpoint.train_state_manager`: in the background, the newest two
    steps kept, sharded as on the mesh), and a run that finds a saved step (of the
    same configuration and seeds) continues from the newest, on this run's mesh,
    which may differ from the saving run's. Saves under way are completed before
    this returns or raises (Ctrl-C included). The folder is left in place (delete it
    when the results are safe elsewhere).

    `eval_steps`: evaluate at these steps too, besides every `cfg.eval_every` and the
    last (each a multiple of `cfg.steps_per_call`; 0 evaluates the initial parameters,
    before any update), e.g. a log-spaced schedule that resolves the first few steps.

    `callback`, if given, receives after every chunk a dict with `step`, `loss`,
    `accuracy` (means over seeds of the chunk), at evaluation points `eval` (the
    metrics of `evaluate`, stacked over seeds) and, once, `stopped` (why the run
    ended): progress bars live there.

    Raises:
      ValueError: for seeds that are not distinct, a model that does not fit the
        task, `eval_steps` off the chunk grid or beyond `cfg.num_steps`, or a
        `state_dir` that is damaged or belongs to another run.
      RuntimeError: at once, naming the step and seed, if a loss is not finite.
    """
    start, seeds = time.perf_counter(), [int(s) for s in seeds]
    _check_run(model_cfg, task, seeds)
    eval_steps = sorted({int(s) for s in eval_steps})
    off = [s for s in eval_steps if s % cfg.steps_per_call or not 0 <= s <= cfg.num_steps]
    if off:
        raise ValueError(f"eval_steps {off} are not multiples of steps_per_call={cfg.steps_per_call} in "
                         f"[0, num_steps={cfg.num_steps}]")
    model, optimizer = Decoder(model_cfg), make_optimizer(cfg)
    programs = _programs(model, optimizer, task, cfg, len(seeds), use_vmap, mesh, sequence_parallel_kind)
    # Raw uint32 keys: plain arrays, so they stack and vmap like any other input.
    keys = jax.vmap(jax.random.split)(jnp.stack([jax.random.PRNGKey(s) for s in seeds]))  # (seeds, 2, 2)
    fingerprint = {"model": model_to_dict(model_cfg), "task": task_to_dict(task),
                   "train": dataclasses.asdict(cfg), "seeds": seeds}
    if eval_steps:  # only when given, so the fingerprints of runs saved before it existed still match
        fingerprint["eval_steps"] = eval_steps
    fingerprint = json.loads(json.dumps(fingerprint, default=str))  # as it reads back from the saved JSON
    target = _restore_target(abstract_state(model, optimizer, len(seeds)), mesh)
    manager = None if state_dir is None else checkpoint.train_state_manager(state_dir)
    try:
        state, history = _start(programs, keys[:, 0], manager, fingerprint, target)
        resumed_from, wall_before, calls = history["step"], history["wall_seconds"], 0
        if 0 in eval_steps and not history["evals"]["step"]:  # the initial parameters, once
            report = {"step": 0, "eval": _evaluate(programs, state, history, cfg, task)}
            if callback is not None:
                callback(report)
        while history["step"] < cfg.num_steps and history["stop_reason"] is None:
            state, report = _advance(programs, state, keys[:, 1], history, seeds, timed=calls > 0)
            calls += 1
            if (history["step"] % cfg.eval_every == 0 or history["step"] == cfg.num_steps
                    or history["step"] in eval_steps):
                report["eval"] = _evaluate(programs, state, history, cfg, task)
                history["wall_seconds"] = wall_before + time.perf_counter() - start
                if manager is not None:  # every process calls it: orbax has each write its own shards
                    checkpoint.save_train_state(manager, history["step"], state, history)
            if history["stop_reason"] is not None or history["step"] >= cfg.num_steps:
                report["stopped"] = history["stop_reason"] or "step limit"
            if callback is not None:
                callback(report)
    finally:  # also on Ctrl-C and errors: the save under way is completed, not left half-written
        if manager is not None:
            checkpoint.close_train_state(manager)
    history["wall_seconds"] = wall_before + time.perf_counter() - start
    return _result(seeds, _gathered(state), history, cfg, task, resumed_from)
