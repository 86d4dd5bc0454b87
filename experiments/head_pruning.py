"""Head importance and iterative head pruning (seed 004, exercise E12.3; Michel et al. 2019).

Takes a trained 8-head, 2-layer copy-task model, scores every head two ways — the
gradient proxy I(l,h) = mean_n |∂L_n/∂ξ(l,h)| and the "oracle" accuracy drop when the
head alone is removed — then prunes heads one at a time in each order, re-ranking the
remaining heads after every step, and reports how many can go before accuracy falls
more than 1 point below the unpruned model.

    python -m experiments.head_pruning                      # quick preset (a few minutes on 2 CPU cores)
    python -m experiments.head_pruning --checkpoint results/head_ablation/checkpoints/h8_seed1.msgpack
    python -m experiments.head_pruning --retrain --train-steps 1000 --out DIR

The model comes from --checkpoint; without it, from the first of the preset's
default checkpoints that exists (the head-ablation run's h8_seed0, then one trained
earlier by this study or by experiments.attention_maps); failing those, a fresh model
is trained with `jax_mha.train.train_seeds` and saved to <out>/checkpoints/.

Writes to --out (default results/head_pruning/): results.json, pruning_curves.png,
importance_heatmap.png, surviving_heads_importance.png, surviving_heads_oracle.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from experiments import plotting
from experiments.common import run_metadata, save_figure, use_agg_backend, write_json
from jax_mha import analysis
from jax_mha.checkpoint import load_checkpoint, save_checkpoint
from jax_mha.data import EOS, CopyTaskConfig, chance_accuracy, make_batch
from jax_mha.models import CopyTransformer, ModelConfig
from jax_mha.train import TrainConfig, train_seeds

ABLATION_CHECKPOINT = "results/head_ablation/checkpoints/h8_seed0.msgpack"


@dataclasses.dataclass(frozen=True)
class PruningConfig:
    """One pruning study: where the model comes from and how it is scored."""

    task: CopyTaskConfig  # used when training; a loaded checkpoint's own task wins
    model: ModelConfig  # the model trained when no checkpoint is found
    train: TrainConfig  # the fallback training budget
    default_checkpoints: tuple[str, ...]  # tried in order when --checkpoint is not given
    seed: int = 0  # training seed of the fallback model
    eval_size: int = 512  # sequences scoring every accuracy: 1 point = ~87 of 8,704 tokens at L=16
    score_size: int = 256  # other sequences, for the rankings: heads are not chosen on the eval set
    eval_seed: int = 2**31 - 3  # apart from training (PRNGKey(seed) streams) and train's eval set (2**31 - 1)
    score_seed: int = 2**31 - 5
    max_drop: float = 0.01  # the stop rule: more than 1 accuracy point below the unpruned model
    heads_per_step: int = 1  # 16 heads: one at a time gives the whole curve
    chunk_size: int | None = 6  # gate configurations per vmap chunk: bounds memory of the 17-way ablation
    example_index: int = 0  # the eval sequence whose attention maps are drawn


def quick() -> PruningConfig:
    """Default: seed 004's setting (L=16, d_model=256, 8 heads, 2 layers), the same as
    `experiments.head_ablation --preset full`; fallback training stops early at 99%
    exact-sequence accuracy, about 2 minutes on 2 CPU cores."""
    task = CopyTaskConfig(length=16)
    return PruningConfig(
        task=task,
        model=ModelConfig(vocab_size=task.vocab_size, max_len=task.seq_len, d_model=256, d_ff=1024,
                          num_heads=8, num_layers=2),
        train=TrainConfig(batch_size=64, num_steps=1500, learning_rate=1e-3, warmup_steps=100,
                          steps_per_call=50, eval_every=100, eval_size=256),
        # The ablation's model, else one trained earlier by this study or by attention_maps.
        default_checkpoints=(ABLATION_CHECKPOINT, "results/head_pruning/checkpoints/h8_seed0.msgpack",
                             "results/attention_maps/checkpoints/h8_seed0.msgpack"),
    )


def tiny() -> PruningConfig:
    """Smoke test (seconds): a 3-head, 2-layer model barely trained on L=5."""
    task = CopyTaskConfig(length=5, num_symbols=7)
    return PruningConfig(
        task=task,
        model=ModelConfig(vocab_size=task.vocab_size, max_len=task.seq_len, d_model=15, d_ff=22,
                          num_heads=3, num_layers=2),
        train=TrainConfig(batch_size=11, num_steps=20, warmup_steps=5, steps_per_call=10, eval_every=10,
                          eval_size=13),
        default_checkpoints=(),
        eval_size=23,
        score_size=23,  # same shapes as the eval batch: every compiled function is reused
        chunk_size=None,
    )


PRESETS = {"quick": quick, "tiny": tiny}


def add_model_source_args(p: argparse.ArgumentParser) -> None:
    """The options choosing the model, shared with experiments.attention_maps."""
    p.add_argument("--preset", choices=sorted(PRESETS), default="quick",
                   help="quick (default): 8 heads, 2 layers, d_model=256, L=16; tiny: a seconds-long smoke test")
    p.add_argument("--checkpoint", type=Path,
                   help="a checkpoint written by jax_mha.checkpoint.save_checkpoint (e.g. by "
                        f"experiments.head_ablation); default: the first existing of {quick().default_checkpoints}, "
                        "else a freshly trained model")
    p.add_argument("--retrain", action="store_true",
                   help="ignore default checkpoints and train a fresh model (saved to <out>/checkpoints/)")
    p.add_argument("--train-steps", type=int,
                   help="maximum steps of the fallback training (multiple of the preset's steps_per_call, 50 for quick)")
    p.add_argument("--seed", type=int, help="seed of the fallback training")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m experiments.head_pruning",
        description="Rank the heads of a trained copy-task model (gradient importance and oracle ablation), "
                    "prune them iteratively in both orders, and report how many can go before accuracy "
                    "drops more than --max-drop below the unpruned model.",
    )
    add_model_source_args(p)
    p.add_argument("--max-drop", type=float,
                   help="stop rule: largest tolerated accuracy loss, absolute, accuracy in [0, 1] (default 0.01 = 1 point)")
    p.add_argument("--heads-per-step", type=int, help="heads removed per pruning step (default 1)")
    p.add_argument("--eval-size", type=int, help="held-out sequences every accuracy is measured on")
    p.add_argument("--score-size", type=int, help="other held-out sequences the rankings are computed on")
    p.add_argument("--no-normalize", action="store_true",
                   help="skip Michel et al.'s per-layer l2 normalisation of the importance scores")
    p.add_argument("--out", type=Path, default=Path("results/head_pruning"), help="output folder")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> PruningConfig:
    """The preset with command-line overrides."""
    cfg = PRESETS[args.preset]()
    if args.train_steps is not None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, num_steps=args.train_steps))
    overrides = {name: getattr(args, name, None) for name in ("seed", "max_drop", "heads_per_step", "eval_size", "score_size")}
    return dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})


# ----------------------------------------------------------------- model source


def _task_of(metadata: dict, fallback: CopyTaskConfig) -> CopyTaskConfig:
    return CopyTaskConfig(**metadata["task"]) if "task" in metadata else fallback


def _check_fits(model_cfg: ModelConfig, task: CopyTaskConfig, where: str) -> None:
    if model_cfg.vocab_size != task.vocab_size or model_cfg.max_len < task.seq_len:
        raise ValueError(
            f"{where}: model (vocab_size={model_cfg.vocab_size}, max_len={model_cfg.max_len}) does not fit the task "
            f"(vocab_size={task.vocab_size}, seq_len={task.seq_len})"
        )


def load_or_train(cfg: PruningConfig, *, checkpoint: Path | None, retrain: bool, out: Path,
                  progress: bool = True) -> tuple:
    """The model to analyse: `(params, ModelConfig, CopyTaskConfig, source dict)`.

    Order: `checkpoint` (must load); else, unless `retrain`, the first existing of
    `cfg.default_checkpoints` and `<out>/checkpoints/h{H}_seed{S}.msgpack`; else a model
    trained with `train_seeds` on `cfg` and saved to that last path.

    Raises:
      ValueError: naming the file, if a checkpoint cannot be used.
    """
    own = out / "checkpoints" / f"h{cfg.model.num_heads}_seed{cfg.seed}.msgpack"
    candidates = [checkpoint] if checkpoint is not None else ([] if retrain else [*map(Path, cfg.default_checkpoints), own])
    for path in candidates:
        if checkpoint is None and not path.exists():
            continue
        params, model_cfg, metadata = load_checkpoint(path)
        task = _task_of(metadata, cfg.task)
        _check_fits(model_cfg, task, str(path))
        return params, model_cfg, task, {"kind": "checkpoint", "path": str(path), "metadata": metadata}

    from tqdm.auto import tqdm

    bar = tqdm(total=cfg.train.num_steps, desc=f"training h={cfg.model.num_heads}", unit="step", disable=not progress)

    def callback(report):
        bar.update(report["step"] - bar.n)
        bar.set_postfix(loss=f"{report['loss']:.4f}", acc=f"{report['accuracy']:.3f}")

    start = time.perf_counter()
    result = train_seeds(cfg.model, cfg.task, cfg.train, [cfg.seed], callback=callback)
    bar.close()
    params = jax.tree.map(lambda x: x[0], result.state.params)
    metadata = {"task": dataclasses.asdict(cfg.task), "heads": cfg.model.num_heads, "seed": cfg.seed,
                "steps_run": result.steps_run, "train": dataclasses.asdict(cfg.train)}
    save_checkpoint(own, params, cfg.model, metadata)
    source = {"kind": "trained", "path": str(own), "metadata": metadata,
              "wall_seconds": time.perf_counter() - start,
              "final_exact_accuracy": float(result.evals["exact_accuracy"][0, -1]),
              "final_token_accuracy": float(result.evals["token_accuracy"][0, -1])}
    return params, cfg.model, cfg.task, source


# ----------------------------------------------------------------- analysis


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman rank correlation (average ranks for ties)."""

    def ranks(x):
        x = np.asarray(x, float).ravel()
        order = np.argsort(x, kind="stable")
        r = np.empty_like(x)
        r[order] = np.arange(len(x), dtype=float)
        for v in np.unique(x):  # average ranks of ties
            r[x == v] = r[x == v].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def head_offsets(weights: np.ndarray, scored: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each head's dominant query−key offset at scored queries and the mean weight on it.

    Args:
      weights: `(layers, B, H, T, T)`; scored: `(B, T)`.

    Returns:
      `(offset (layers, H) int, weight (layers, H))`.
    """
    profile = np.asarray(analysis.offset_profile(jnp.asarray(weights), jnp.asarray(scored)))  # (layers, H, T)
    return profile.argmax(-1), profile.max(-1)


def accuracy_breakdown(params, model: CopyTransformer, batch: dict, gates) -> dict:
    """Teacher-forced accuracy on scored positions, split into content symbols and EOS."""
    logits = jax.jit(lambda p, x, g: model.apply({"params": p}, x, head_mask=g))(params, batch["inputs"], jnp.asarray(gates))
    correct = np.asarray(jnp.argmax(logits, -1) == batch["targets"])
    scored, eos = np.asarray(batch["scored"]), np.asarray(batch["targets"] == EOS)
    return {"accuracy": float(correct[scored].mean()), "symbol_accuracy": float(correct[scored & ~eos].mean()),
            "eos_accuracy": float(correct[scored & eos].mean())}


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg = build_config(args)
    use_agg_backend()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    from tqdm.auto import tqdm

    params, model_cfg, task, source = load_or_train(
        cfg, checkpoint=args.checkpoint, retrain=args.retrain, out=out, progress=not args.no_progress)
    model = CopyTransformer(model_cfg)
    batch_fn = jax.jit(make_batch, static_argnums=(1, 2))  # eager make_batch compiles op by op
    eval_batch = batch_fn(jax.random.key(cfg.eval_seed), task, cfg.eval_size)
    score_batch = batch_fn(jax.random.key(cfg.score_seed), task, cfg.score_size)
    shape = analysis.gate_shape(model)
    total = shape[0] * shape[1]
    normalize = not args.no_normalize

    start = time.perf_counter()
    accuracy = analysis.make_accuracy_fn(params, model, eval_batch)
    base_acc = accuracy(jnp.ones(shape))
    off_acc = accuracy(jnp.zeros(shape))
    # Without attention a position sees only its own token and place: it can still put
    # EOS right, but a symbol only by luck (1/num_symbols) — chance_accuracy.
    all_off = accuracy_breakdown(params, model, eval_batch, np.zeros(shape, np.float32))
    all_off["chance_symbol_accuracy"] = 1.0 / task.num_symbols
    chance = chance_accuracy(task)
    importance = np.asarray(analysis.head_importance(params, model, score_batch, normalize=normalize))
    importance_raw = np.asarray(analysis.head_importance(params, model, score_batch, normalize=False))
    oracle = np.asarray(analysis.ablate_each_head(params, model, score_batch, chunk_size=cfg.chunk_size))
    oracle_eval = np.asarray(analysis.ablate_each_head(params, model, eval_batch, chunk_size=cfg.chunk_size))

    records = {}
    for order in analysis.ORDERS:
        bar = tqdm(total=total, desc=f"pruning by {order}", unit="head", disable=args.no_progress)
        callback = lambda step, bar=bar: (bar.update(step.num_pruned - bar.n), bar.set_postfix(acc=f"{step.accuracy:.4f}"))
        records[order] = analysis.prune_heads_iteratively(
            params, model, eval_batch, order=order, max_drop=cfg.max_drop, heads_per_step=cfg.heads_per_step,
            score_batch=score_batch, normalize=normalize, run_to_end=True, chunk_size=cfg.chunk_size,
            callback=callback,
        )
        bar.close()
    analysis_seconds = time.perf_counter() - start

    # Attention of the surviving heads, under the pruned gates (upstream pruning
    # changes what later layers see).
    example_tokens = np.asarray(eval_batch["inputs"][cfg.example_index])
    survivors = {}
    for order, rec in records.items():
        gates = rec.surviving_gates()
        w_all = analysis.attention_weights(params, model, eval_batch["inputs"], jnp.asarray(gates))
        offset, weight = head_offsets(np.asarray(w_all), np.asarray(eval_batch["scored"]))
        w_one = np.asarray(w_all)[:, cfg.example_index : cfg.example_index + 1]
        heads = [(int(l), int(h)) for l, h in zip(*np.nonzero(gates))]
        survivors[order] = {
            "gates": gates, "heads": heads, "accuracy": next(s.accuracy for s in rec.steps if s.num_pruned == rec.heads_prunable),
            "dominant_offset": {f"L{l}H{h}": int(offset[l, h]) for l, h in heads},
            "weight_at_dominant_offset": {f"L{l}H{h}": float(weight[l, h]) for l, h in heads},
        }
        if heads:
            maps = np.stack([np.asarray(w_one)[l, 0, h] for l, h in heads])
            titles = [f"layer {l} head {h}: offset {offset[l, h]} ({weight[l, h]:.2f})" for l, h in heads]
            fig = plotting.attention_grid(
                maps, example_tokens, titles=titles, ncols=min(4, len(heads)),
                stripe_offset=task.length,
                suptitle=(f"The {len(heads)} of {total} heads left after pruning by {order} "
                          f"(accuracy {survivors[order]['accuracy']:.4f}, unpruned {base_acc:.4f})\n"
                          f"title: dominant query−key offset at scored queries (mean weight); "
                          f"dotted: key = query − L, L={task.length}"),
            )
            save_figure(fig, out / f"surviving_heads_{order}.png")

    label = {"importance": "by gradient importance I(l,h)", "oracle": "by oracle (accuracy drop)"}
    fig = plotting.pruning_curves(
        {label[o]: (r.fractions, r.accuracies) for o, r in records.items()},
        base_accuracy=base_acc, max_drop=cfg.max_drop, chance=chance,
        heads_prunable={label[o]: r.heads_prunable for o, r in records.items()}, total_heads=total,
        title=(f"Iterative head pruning, {shape[0]} layers × {shape[1]} heads, copy L={task.length} "
               f"({cfg.eval_size} held-out sequences)"),
    )
    save_figure(fig, out / "pruning_curves.png")
    fig = plotting.layer_head_heatmaps(
        [(importance, "importance I(l,h) = mean$_n$ |∂L$_n$/∂ξ(l,h)|" + ("\n(ℓ2-normalised per layer)" if normalize else ""), "I(l,h)"),
         (100 * oracle, "oracle: accuracy drop\nwhen removed alone", "accuracy points")],
        suptitle=(f"Head scores of the full model on {cfg.score_size} ranking sequences\n"
                  "cyan frame: heads left when importance pruning stops"),
        marks=records["importance"].surviving_gates() > 0, fmt="{:.2f}",
    )
    save_figure(fig, out / "importance_heatmap.png")

    results = {
        "config": dataclasses.asdict(cfg) | {"task": dataclasses.asdict(task), "model": dataclasses.asdict(model_cfg),
                                             "normalize": normalize},
        "metadata": run_metadata(),
        "source": source,
        "total_heads": total,
        "base_accuracy": base_acc,
        "all_heads_off_accuracy": off_acc,
        "all_heads_off": all_off,
        "chance_accuracy": chance,
        "importance": importance,
        "importance_raw": importance_raw,
        "oracle_drop_score_batch": oracle,
        "oracle_drop_eval_batch": oracle_eval,
        "spearman_importance_vs_oracle": spearman(importance, oracle),
        "heads_prunable": {o: r.heads_prunable for o, r in records.items()},
        "pruning": {o: r.to_dict() for o, r in records.items()},
        "survivors": survivors,
        "analysis_seconds": analysis_seconds,
    }
    write_json(out / "results.json", results)

    print(f"\nmodel: {source['kind']} {source['path']}  ({shape[0]} layers x {shape[1]} heads, L={task.length})")
    print(f"unpruned accuracy {base_acc:.4f}; all heads off {off_acc:.4f} (no-attention chance {chance:.4f}); "
          f"all off: symbols {all_off['symbol_accuracy']:.4f} (chance {1 / task.num_symbols:.4f}), "
          f"EOS {all_off['eos_accuracy']:.4f}")
    print(f"Spearman(importance, oracle drop) = {results['spearman_importance_vs_oracle']:.3f}")
    print("\n| order | heads prunable (stop: > %g pt drop) | accuracy then | next step's accuracy |" % (100 * cfg.max_drop))
    print("|---|---:|---:|---:|")
    for o, r in records.items():
        k = r.heads_prunable
        after = next((s.accuracy for s in r.steps if s.num_pruned > k), float("nan"))
        print(f"| {o} | {k}/{total} | {survivors[o]['accuracy']:.4f} | {after:.4f} |")
    for o in records:
        print(f"survivors ({o}): {survivors[o]['dominant_offset']}")
    print(f"\nwrote {out}/results.json and plots ({analysis_seconds:.0f} s of analysis)")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
