"""Short character-LM runs that size the presets and check the learning rate per head count.

Trains one model per (heads, learning rate) pair for a few hundred steps, all seeds of
a pair in one vmapped program, and reports validation bpc (the trainer's evaluation
windows on the dev split: what a rate is chosen by), characters seen and throughput,
beside the interpolated n-gram baselines of the same split
(`jax_mha.lab.text.ngram_baselines`). Each final model is also scored on the whole test
split, so a results page can show how the ranking of head counts depends on the rate;
no choice reads it. It answers two questions before the long runs: does the best
learning rate depend on the head size, and how many steps does a preset need to pass a
baseline.

The grid's seeds start at 100 (`--seed`), so that they are disjoint from the seeds a
sweep reports (`experiments.head_ablation` starts at 0): a rate is never chosen on the
models it is then reported on.

    python -m experiments.lm_sizing --heads 1 16 --lrs 1e-3 3e-3 6e-3 --steps 300
    python -m experiments.lm_sizing --heads 1 4 16 --lrs 3e-3 --steps 600 --d-model 128 --seq-len 128

Output (--out, default results/lm_sizing/): results.json, summary.md, sizing_curves.png.
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import numpy as np

from experiments import common
from experiments.common import fmt, save_figure, write_atomic, write_json
from jax_mha.lab import analysis, stats
from jax_mha.lab.models import Decoder, ModelConfig
from jax_mha.lab.text import TextTaskConfig, ngram_baselines, validation_batches
from jax_mha.lab.train import TrainConfig, train_seeds

MODULE = "experiments.lm_sizing"
GRID_FIRST_SEED = 100


def build_parser():
    p = common.parser(MODULE, "Short character-LM runs over head counts and learning rates: validation bpc, "
                              "characters seen, throughput, and the n-gram baselines of the same split.")
    p.add_argument("--heads", type=common.positive_int, nargs="+", default=[1, 16])
    p.add_argument("--lrs", type=common.positive_float, nargs="+", default=[1e-3, 3e-3, 6e-3])
    p.add_argument("--steps", type=common.positive_int, default=300, help="steps per run (a multiple of 50)")
    p.add_argument("--seeds", type=common.positive_int, default=1)
    p.add_argument("--seed", type=common.nonnegative_int, default=GRID_FIRST_SEED,
                   help=f"first seed (default {GRID_FIRST_SEED}, disjoint from the seeds sweeps report, which start at 0)")
    p.add_argument("--d-model", type=common.positive_int, default=128)
    p.add_argument("--layers", type=common.positive_int, default=2)
    p.add_argument("--seq-len", type=common.positive_int, default=128)
    p.add_argument("--batch-size", type=common.positive_int, default=32)
    p.add_argument("--warmup", type=common.nonnegative_int, default=50)
    p.add_argument("--out", type=Path, default=Path("results") / "lm_sizing")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    common.use_agg_backend()
    task = TextTaskConfig(seq_len=args.seq_len)
    baselines = ngram_baselines(task.corpus)
    results = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "metadata": common.run_metadata(), "ngram_bpc": baselines, "runs": _finished(args)}
    print("n-gram bpc on this split: " + ", ".join(f"{n}-gram {b:.3f}" for n, b in baselines.items()), flush=True)
    done = {(r["heads"], r["lr"]) for r in results["runs"]}
    seeds = list(range(args.seed, args.seed + args.seeds))
    test = validation_batches(task.corpus.test, task, 64)  # scored after training only; no choice reads it
    for h in args.heads:
        for lr in args.lrs:
            if (h, lr) in done:
                continue
            model = ModelConfig(vocab_size=task.vocab_size, max_len=args.seq_len, d_model=args.d_model,
                                d_ff=4 * args.d_model, num_heads=h, num_layers=args.layers)
            train = TrainConfig(batch_size=args.batch_size, num_steps=args.steps, learning_rate=lr,
                                warmup_steps=args.warmup, steps_per_call=50, eval_every=50, eval_size=64,
                                early_stop=False)
            bar = common.TrainingBar(args.steps, f"h={h} lr={lr:g}", args.no_progress)
            start = time.perf_counter()
            try:
                r = train_seeds(model, task, train, seeds, callback=bar)
            finally:
                bar.close()
            decoder = Decoder(model)
            test_bpc = [analysis.split_bpc(jax.tree.map(lambda x, i=i: x[i], r.state.params), decoder, test)
                        for i in range(len(seeds))]
            bpc = r.evals["bpc"]  # (seeds, E)
            train_bpc = r.curve["loss"][:, -1] / np.log(2)  # last chunk's mean training loss
            results["runs"].append({
                "heads": h, "lr": lr, "seeds": seeds, "steps": r.steps_run, "eval_step": r.evals["step"], "bpc": bpc,
                "final_bpc": bpc[:, -1], "test_bpc": test_bpc, "train_bpc": train_bpc,
                "characters_per_seed": r.steps_run * args.batch_size * args.seq_len,
                "wall_seconds": time.perf_counter() - start, "tokens_per_second": r.tokens_per_second})
            write_json(args.out / "results.json", results)
    text = summary(results)
    write_json(args.out / "artifact.json", artifact(results))  # what docs/results/data/ takes (experiments.report)
    write_atomic(args.out / "summary.md", text)
    plot(results, args.out)
    print("\n" + text)
    return results


# The arguments that make two runs of the same (heads, lr) pair comparable.
_SAME_RUN = ("steps", "seeds", "seed", "d_model", "layers", "seq_len", "batch_size", "warmup")


def _finished(args) -> list[dict]:
    """The runs `--out` already holds from the same settings (a rerun resumes, and
    more head counts or rates extend the grid); none when the settings differ."""
    path = args.out / "results.json"
    if not path.exists():
        return []
    saved = common.read_results(path, lambda d: None if isinstance(d, dict) and "runs" in d else "it has no runs")
    if any(saved["args"].get(k) != getattr(args, k) for k in _SAME_RUN):
        raise SystemExit(f"error: {path} holds runs with other settings; pass another --out")
    return saved["runs"]


def artifact(results: dict) -> dict:
    """The learning-rate grid as the results pages read it (`experiments.report`, kind
    "lr_grid"): per (heads, lr), the seed ids, each seed's final dev bpc (`values`, what
    a rate is chosen by) and its bpc on the whole test split (`test`)."""
    return {"kind": "lr_grid", "metric": "dev bpc (64 windows, last evaluation)", "lower_is_better": True,
            "test_metric": "test bpc (the whole test split, final model)",
            "settings": {k: results["args"][k] for k in _SAME_RUN},
            "metadata": {k: results["metadata"].get(k) for k in ("cpu", "cpu_count", "commit", "dirty", "argv")},
            "cells": [{"heads": r["heads"], "lr": r["lr"], "seeds": r["seeds"], "values": list(r["final_bpc"]),
                       "test": list(r["test_bpc"])} for r in results["runs"]]}


def summary(results: dict) -> str:
    a = results["args"]
    lines = [f"Character LM sizing: d_model={a['d_model']}, {a['layers']} layers, T={a['seq_len']}, batch "
             f"{a['batch_size']}, warmup {a['warmup']}, cosine to 1 %, {a['seeds']} seed(s) from {a['seed']}; validation "
             f"bpc on 64 evenly spaced windows of the dev split (what a rate is chosen by); test bpc on the whole "
             f"test split (read by no choice); "
             f"{results['metadata']['cpu']}.",
             "N-gram bpc on the same (dev) split: " + ", ".join(f"{n}-gram {b:.3f}" for n, b in results["ngram_bpc"].items())
             + ".", "",
             "| heads | lr | steps | characters/seed | validation bpc | test bpc | train bpc (last 50 steps) | gap | wall s | chars/s |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results["runs"]:
        iv, tr = stats.t_interval(r["final_bpc"]), stats.t_interval(r["train_bpc"])
        test = stats.t_interval(r["test_bpc"]).format(3)
        lines.append(f"| {r['heads']} | {r['lr']:g} | {r['steps']} | {r['characters_per_seed']:,} | {iv.format(3)} | "
                     f"{test} | {tr.format(3)} | {fmt(iv.mean - tr.mean, '+.3f')} | {fmt(r['wall_seconds'], '.0f')} | "
                     f"{fmt(r['tokens_per_second'], ',.0f')} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, out: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for i, r in enumerate(results["runs"]):
        bpc = np.asarray(r["bpc"])
        ax.plot(r["eval_step"], bpc.mean(0), marker=".", color=f"C{i}", label=f"h={r['heads']}, lr={r['lr']:g}")
    for n, b in results["ngram_bpc"].items():
        if n >= 2:
            ax.axhline(b, color="grey", ls=":", lw=1)
            ax.text(ax.get_xlim()[0], b, f" {n}-gram", va="bottom", fontsize=8, color="grey")
    a = results["args"]
    ax.set(xlabel="optimizer step", ylabel="validation bits per character",
           title=f"Sizing runs: d_model={a['d_model']}, T={a['seq_len']}, batch {a['batch_size']}\n"
                 f"dotted: interpolated n-gram baselines of the same split")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, out / "sizing_curves.png")


if __name__ == "__main__":
    common.cli(main, MODULE)
