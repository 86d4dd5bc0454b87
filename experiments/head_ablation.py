"""Head-count ablation on the delayed copy task (seed 004, exercise E12.2).

Trains the copy-task decoder at several head counts with d_model fixed, several
seeds each (all seeds of one head count in one vmapped program), and reports
convergence speed, final accuracy and per-head attention entropy.

    python -m experiments.head_ablation                   # quick preset, under a minute on 2 CPU cores
    python -m experiments.head_ablation --preset full     # d_model=256, 3 seeds, <= 60 min on 2 CPU cores
    python -m experiments.head_ablation --heads 1 8 --seeds 2 --steps 3000 --d-model 128 --out DIR

Results go to --out (default results/head_ablation/): results.json, summary.md,
learning_curves.png, accuracy_vs_heads.png, entropy_per_head.png, and one
checkpoint per trained model in checkpoints/h{H}_seed{S}.msgpack. They are written
after every head count; a rerun with the same --out and configuration skips the
head counts already done (--force retrains them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

from experiments.common import run_metadata, save_figure, use_agg_backend, write_atomic, write_json
from jax_mha.checkpoint import save_checkpoint
from jax_mha.data import CopyTaskConfig, chance_accuracy
from jax_mha.models import ModelConfig
from jax_mha.train import SeedsResult, TrainConfig, train_seeds


@dataclasses.dataclass(frozen=True)
class AblationConfig:
    """One sweep: the task, the model (num_heads is swept), training, seeds."""

    heads: tuple[int, ...]
    num_seeds: int
    task: CopyTaskConfig
    model: ModelConfig
    train: TrainConfig

    def fingerprint(self) -> dict:
        """Everything that makes two runs comparable; the head list is not part of it,
        so a sweep can be extended with more head counts into the same folder."""
        out = {"num_seeds": self.num_seeds, "task": dataclasses.asdict(self.task),
               "model": dataclasses.asdict(self.model), "train": dataclasses.asdict(self.train)}
        del out["model"]["num_heads"]
        return out


def quick() -> AblationConfig:
    """`python -m experiments.head_ablation`: under a minute on a 2-core CPU, all five
    head counts, small enough that compile time is a good part of it."""
    task = CopyTaskConfig(length=8)
    return AblationConfig(
        heads=(1, 2, 4, 8, 16),
        num_seeds=2,
        task=task,
        model=ModelConfig(vocab_size=task.vocab_size, max_len=task.seq_len, d_model=64, d_ff=256),
        train=TrainConfig(batch_size=32, num_steps=600, learning_rate=3e-3, warmup_steps=50,
                          steps_per_call=50, eval_every=100, eval_size=128),
    )


def full() -> AblationConfig:
    """`python -m experiments.head_ablation --preset full`: seed 004's E12.2 at
    d_model=256, 2 layers, 3 seeds, L=16; early stopping once every seed holds 99%
    exact-sequence accuracy keeps it under an hour on a 2-core CPU."""
    task = CopyTaskConfig(length=16)
    return AblationConfig(
        heads=(1, 2, 4, 8, 16),
        num_seeds=3,
        task=task,
        model=ModelConfig(vocab_size=task.vocab_size, max_len=task.seq_len, d_model=256, d_ff=1024),
        train=TrainConfig(batch_size=64, num_steps=1500, learning_rate=1e-3, warmup_steps=100,
                          steps_per_call=50, eval_every=50, eval_size=256),
    )


PRESETS = {"quick": quick, "full": full}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m experiments.head_ablation",
        description="Train the delayed copy task at several head counts (fixed d_model) and compare.",
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="quick",
                   help="base configuration: quick (default, <1 min on CPU) or full (d_model=256, 3 seeds)")
    p.add_argument("--heads", type=int, nargs="+", help="head counts to sweep (each must divide d_model)")
    p.add_argument("--seeds", type=int, help="number of seeds per head count (seeds 0..n-1, trained together by vmap)")
    p.add_argument("--steps", type=int, help="maximum optimizer steps per head count (a multiple of --steps-per-call)")
    p.add_argument("--d-model", type=int, help="model width, fixed across head counts")
    p.add_argument("--layers", type=int, help="number of Transformer blocks")
    p.add_argument("--length", type=int, help="L, symbols per copy (sequences are 2L+3 tokens)")
    p.add_argument("--reverse", action="store_true", help="the reverse variant: the second half is reversed")
    p.add_argument("--batch-size", type=int, help="sequences per optimizer step")
    p.add_argument("--lr", type=float, help="peak AdamW learning rate")
    p.add_argument("--steps-per-call", type=int, help="optimizer steps fused into one compiled call")
    p.add_argument("--eval-every", type=int, help="steps between held-out evaluations")
    p.add_argument("--no-early-stop", action="store_true", help="always run --steps steps")
    p.add_argument("--out", type=Path, default=Path("results/head_ablation"), help="output folder")
    p.add_argument("--force", action="store_true", help="retrain head counts already in --out")
    p.add_argument("--measure-vmap-speedup", action="store_true",
                   help="also time vmap over seeds against a Python loop over seeds (4 chunks each, largest head count)")
    p.add_argument("--mesh", help="run sharded on a device mesh, e.g. 'data=2,model=2' (heads split over "
                   "'model', the batch over 'data'; on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=4)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> AblationConfig:
    """The preset with command-line overrides applied."""
    base = PRESETS[args.preset]()
    task = dataclasses.replace(
        base.task,
        **{k: v for k, v in (("length", args.length), ("reverse", args.reverse or None)) if v is not None},
    )
    model = dataclasses.replace(
        base.model, vocab_size=task.vocab_size, max_len=task.seq_len,
        **{k: v for k, v in (("d_model", args.d_model), ("num_layers", args.layers)) if v is not None},
    )
    if args.d_model is not None:
        model = dataclasses.replace(model, d_ff=4 * args.d_model)
    overrides = {"num_steps": args.steps, "batch_size": args.batch_size, "learning_rate": args.lr,
                 "steps_per_call": args.steps_per_call, "eval_every": args.eval_every}
    if args.no_early_stop:
        overrides["early_stop"] = False
    train = base.train
    if args.steps_per_call is not None and args.eval_every is None:
        overrides["eval_every"] = max(train.eval_every // args.steps_per_call, 1) * args.steps_per_call
    train = dataclasses.replace(train, **{k: v for k, v in overrides.items() if v is not None})
    heads = tuple(args.heads) if args.heads else base.heads
    bad = [h for h in heads if h < 1 or model.d_model % h]
    if bad:
        raise SystemExit(f"error: d_model={model.d_model} is not divisible by num_heads={bad[0]}")
    return AblationConfig(heads=heads, num_seeds=args.seeds or base.num_seeds, task=task, model=model, train=train)


def summarize_heads(h: int, result: SeedsResult, cfg: AblationConfig) -> dict:
    """The JSON record of one head count: per-seed runs plus timings."""
    ev = result.evals
    runs = []
    for i, seed in enumerate(result.seeds):
        runs.append({
            "seed": seed,
            "steps_to_target": result.steps_to_target[i],
            "final_token_accuracy": float(ev["token_accuracy"][i, -1]),
            "final_exact_accuracy": float(ev["exact_accuracy"][i, -1]),
            "final_loss": float(ev["loss"][i, -1]),
            "entropy": ev["entropy"][i, -1],  # (layers, H) nats
            "entropy_normalized": ev["entropy_normalized"][i, -1],  # (layers, H), / ln(visible keys)
            "confidence": ev["confidence"][i, -1],  # (layers, H) mean max weight
            "curve": {"step": result.curve["step"], "loss": result.curve["loss"][i],
                      "accuracy": result.curve["accuracy"][i]},
            "eval_curve": {"step": ev["step"], "token_accuracy": ev["token_accuracy"][i],
                           "exact_accuracy": ev["exact_accuracy"][i], "loss": ev["loss"][i]},
        })
    return {
        "heads": h,
        "head_dim": cfg.model.d_model // h,
        "steps_run": result.steps_run,
        "wall_seconds": result.wall_seconds,
        "train_seconds": result.train_seconds,
        "tokens_per_second": result.tokens_per_second,
        # One program step advances every seed by one optimizer step.
        "program_steps_per_second": result.tokens_per_second / (cfg.train.batch_size * cfg.task.seq_len * len(result.seeds)),
        "runs": runs,
    }


def mean_std(values) -> tuple[float, float]:
    v = np.asarray([np.nan if x is None else x for x in values], dtype=float)
    return float(np.nanmean(v)) if np.any(np.isfinite(v)) else float("nan"), float(np.nanstd(v)) if np.any(np.isfinite(v)) else float("nan")


def summary_table(results: dict) -> str:
    """Markdown table, one row per head count (mean ± std over seeds)."""
    cfg = results["config"]
    lines = [
        f"Delayed copy, L={cfg['task']['length']}{' (reversed)' if cfg['task']['reverse'] else ''}, "
        f"d_model={cfg['model']['d_model']}, {cfg['model']['num_layers']} layers, {cfg['num_seeds']} seeds, "
        f"batch {cfg['train']['batch_size']}, ≤ {cfg['train']['num_steps']} steps. Mean ± std over seeds.",
        "",
        "| heads | head dim | steps to 99% token acc | final token acc | final exact-seq acc | norm. entropy (mean over heads) | steps run | wall s | tokens/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key in sorted(results["heads"], key=int):
        r = results["heads"][key]
        runs = r["runs"]
        reached = [x["steps_to_target"] for x in runs]
        s_mean, s_std = mean_std(reached)
        n_reached = sum(x is not None for x in reached)
        steps = f"{s_mean:.0f} ± {s_std:.0f}" if n_reached else "never"
        if 0 < n_reached < len(runs):
            steps += f" ({n_reached}/{len(runs)} seeds)"
        tok = mean_std([x["final_token_accuracy"] for x in runs])
        ex = mean_std([x["final_exact_accuracy"] for x in runs])
        ent = mean_std([np.mean(x["entropy_normalized"]) for x in runs])
        lines.append(
            f"| {r['heads']} | {r['head_dim']} | {steps} | {tok[0]:.4f} ± {tok[1]:.4f} | {ex[0]:.4f} ± {ex[1]:.4f} "
            f"| {ent[0]:.3f} ± {ent[1]:.3f} | {r['steps_run']} | {r['wall_seconds']:.0f} | {r['tokens_per_second']:,.0f} |"
        )
    if "vmap_speedup" in results:
        v = results["vmap_speedup"]
        lines += ["", f"vmap over {v['num_seeds']} seeds vs a Python loop over seeds (h={v['heads']}): "
                      f"{v['vmap_tokens_per_second']:,.0f} vs {v['loop_tokens_per_second']:,.0f} tokens/s, "
                      f"speed-up {v['speedup']:.2f}x."]
    return "\n".join(lines) + "\n"


def plot_results(results: dict, out: Path) -> None:
    """learning_curves.png, accuracy_vs_heads.png, entropy_per_head.png."""
    import matplotlib.pyplot as plt

    keys = sorted(results["heads"], key=int)
    colors = plt.cm.viridis(np.linspace(0, 0.9, max(len(keys), 1)))

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for color, key in zip(colors, keys):
        runs = results["heads"][key]["runs"]
        for ax, field, curve_name in ((axes[0], "loss", "curve"), (axes[1], "exact_accuracy", "eval_curve")):
            steps = np.asarray(runs[0][curve_name]["step"])
            values = np.asarray([r[curve_name][field] for r in runs], dtype=float)
            mean = values.mean(0)
            ax.plot(steps, mean, color=color, label=f"h={key}")
            ax.fill_between(steps, values.min(0), values.max(0), color=color, alpha=0.2)
    axes[0].set(yscale="log", xlabel="optimizer step", ylabel="training loss (scored positions)",
                title="Training loss (mean, band = min–max over seeds)")
    axes[1].set(xlabel="optimizer step", ylabel="held-out exact-sequence accuracy", ylim=(-0.02, 1.02),
                title="Greedy-decoded copy accuracy (held out)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(title="heads")
    save_figure(fig, out / "learning_curves.png")

    heads = np.asarray([int(k) for k in keys])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for field, label, marker in (("final_token_accuracy", "token accuracy (teacher forced)", "o"),
                                 ("final_exact_accuracy", "exact-sequence accuracy (greedy)", "s")):
        stats = np.asarray([mean_std([r[field] for r in results["heads"][k]["runs"]]) for k in keys])
        axes[0].errorbar(heads, stats[:, 0], yerr=stats[:, 1], marker=marker, capsize=4, label=label)
    chance = chance_accuracy(CopyTaskConfig(**results["config"]["task"]))
    axes[0].axhline(chance, color="grey", ls=":", label=f"no-attention chance ({chance:.2f})")
    axes[0].set(xscale="log", xlabel="number of heads h (d_model fixed)", ylabel="final held-out accuracy",
                title="Final accuracy vs head count", ylim=(0, 1.05))
    axes[0].set_xticks(heads, [str(h) for h in heads])
    axes[0].legend(loc="lower right")
    steps_stats = []
    for k in keys:
        reached = [r["steps_to_target"] for r in results["heads"][k]["runs"]]
        steps_stats.append(mean_std(reached))
    steps_stats = np.asarray(steps_stats)
    axes[1].errorbar(heads, steps_stats[:, 0], yerr=steps_stats[:, 1], marker="o", capsize=4)
    axes[1].set(xscale="log", xlabel="number of heads h (d_model fixed)", ylabel="steps to 99% held-out token accuracy",
                title="Convergence speed (missing point = never reached)")
    axes[1].set_xticks(heads, [str(h) for h in heads])
    for ax in axes:
        ax.grid(alpha=0.3)
    save_figure(fig, out / "accuracy_vs_heads.png")

    layers = results["config"]["model"]["num_layers"]
    fig, axes = plt.subplots(len(keys), 1, figsize=(10, 1.9 * len(keys) + 0.9), squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        h = int(key)
        # Head indices are arbitrary (any permutation is the same model), so heads are
        # ranked by entropy within each seed and layer before averaging over seeds.
        ent = np.sort(np.asarray([r["entropy_normalized"] for r in results["heads"][key]["runs"]]), axis=-1)
        width = 0.8 / layers
        for layer in range(layers):
            x = np.arange(h) + (layer - (layers - 1) / 2) * width
            ax.bar(x, ent[:, layer].mean(0), width, yerr=ent[:, layer].std(0), capsize=2,
                   label=f"layer {layer}", color=plt.cm.tab10(layer))
        ax.set(ylim=(0, 1), ylabel=f"h={h}", xticks=np.arange(h))
        ax.grid(alpha=0.3, axis="y")
    axes[0, 0].legend(ncol=layers, loc="upper left", fontsize=8)
    axes[-1, 0].set_xlabel("head rank within its layer (0 = most focused)")
    fig.suptitle("Attention entropy per head at scored queries, normalised by ln(#visible keys)\n"
                 "(0 = attends to one key, 1 = uniform; mean ± std over seeds)")
    save_figure(fig, out / "entropy_per_head.png")


def load_existing(path: Path, cfg: AblationConfig, force: bool) -> dict | None:
    """The finished part of an earlier run with the same configuration, if any."""
    if force or not path.exists():
        return None
    try:
        old = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise SystemExit(f"error: {path} is not valid JSON; rerun with --force to overwrite it") from None
    if old.get("config") != json.loads(json.dumps(cfg.fingerprint())):
        raise SystemExit(
            f"error: {path} holds results of a different configuration; use another --out or --force to overwrite"
        )
    return old


def measure_vmap_speedup(cfg: AblationConfig, heads: int) -> dict:
    """Training throughput of all seeds in one vmapped program vs a loop over seeds."""
    train = dataclasses.replace(cfg.train, num_steps=4 * cfg.train.steps_per_call, early_stop=False,
                                eval_every=4 * cfg.train.steps_per_call)
    model = dataclasses.replace(cfg.model, num_heads=heads)
    seeds = list(range(cfg.num_seeds))
    vm = train_seeds(model, cfg.task, train, seeds, use_vmap=True)
    loop = train_seeds(model, cfg.task, train, seeds, use_vmap=False)
    return {"heads": heads, "num_seeds": len(seeds), "timed_steps": 3 * train.steps_per_call,
            "vmap_tokens_per_second": vm.tokens_per_second, "loop_tokens_per_second": loop.tokens_per_second,
            "speedup": vm.tokens_per_second / loop.tokens_per_second}


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg = build_config(args)
    use_agg_backend()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    results = load_existing(results_path, cfg, args.force) or {
        "config": cfg.fingerprint(), "metadata": run_metadata(), "heads": {},
    }

    from tqdm.auto import tqdm

    mesh = None
    if args.mesh:
        from jax_mha import parallel

        try:
            mesh = parallel.make_mesh(**parallel.parse_mesh_spec(args.mesh))
            for h in cfg.heads:
                parallel.check_heads_divisible(h, mesh)
            parallel.check_batch_divisible(cfg.train.batch_size, mesh)
        except ValueError as e:
            raise SystemExit(f"error: --mesh {args.mesh}: {e}") from None

    def finish():
        write_json(results_path, results)
        write_atomic(out / "summary.md", summary_table(results))
        plot_results(results, out)

    for h in cfg.heads:
        if str(h) in results["heads"]:
            print(f"h={h}: already in {results_path}, skipped (--force retrains)")
            continue
        model = dataclasses.replace(cfg.model, num_heads=h)
        bar = tqdm(total=cfg.train.num_steps, desc=f"h={h:>2}", disable=args.no_progress, unit="step", leave=True)
        held_out = {}

        def progress(report):
            if "eval" in report:
                held_out["exact"] = float(np.mean(report["eval"]["exact_accuracy"]))
            bar.update(report["step"] - bar.n)
            bar.set_postfix(loss=f"{report['loss']:.4f}", acc=f"{report['accuracy']:.3f}",
                            heldout_exact=f"{held_out.get('exact', float('nan')):.3f}")

        result = train_seeds(model, cfg.task, cfg.train, range(cfg.num_seeds), mesh=mesh, callback=progress)
        bar.close()
        for i, seed in enumerate(result.seeds):
            params = jax.tree.map(lambda x: x[i], result.state.params)
            save_checkpoint(out / "checkpoints" / f"h{h}_seed{seed}.msgpack", params, model,
                            {"task": dataclasses.asdict(cfg.task), "heads": h, "seed": seed})
        results["heads"][str(h)] = summarize_heads(h, result, cfg)
        finish()

    if args.measure_vmap_speedup:
        results["vmap_speedup"] = measure_vmap_speedup(cfg, max(cfg.heads))
        finish()
    elif results["heads"]:
        finish()
    print()
    print(summary_table(results))
    print(f"wrote {results_path}, summary.md and plots to {out}/")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
