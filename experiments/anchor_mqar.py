"""Anchor (b): attention solves multi-query associative recall at every model width
of Zoology's Figure 2 (Arora et al. 2023), on a scaled-down grid.

Zoology's attention baseline is 2 layers of one-head attention with no MLP (its state
mixer is the identity), trained on MQAR with single-token keys at d_model 64–512 and
sequence lengths 64–512. Here: the same architecture (`ModelConfig(d_ff=0)`, one head,
learned positions), on the harness's MQAR with single-token keys and queries that repeat
keys (`RecallTaskConfig(key_tokens=1)`, T = 33), at d_model 8, 16, 32 and 64 — the
paper's smallest width and three below it — with one fixed step budget and learning
rate for every width (Zoology takes the best of four rates). The outcome per width is
the share of seeds that solve the task (final held-out recall accuracy >= 0.9) with
Wilson's interval, and the final accuracy with a t interval over seeds.

    python -m experiments.anchor_mqar                   # the page's run (standard)
    python -m experiments.anchor_mqar --preset tiny --out /tmp/b   # seconds, a smoke test

Output (--out, default results/anchors/mqar): results.json (curves per seed; a rerun
skips the widths already there), artifact.json, summary.md, anchor_mqar.png. The standard
preset also writes the artifact to docs/results/data/anchor_mqar.json and the figure
beside the page (docs/results/anchor_mqar.png).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import numpy as np

from experiments import common, common_anchors
from experiments.common import save_figure
from jax_mha.lab.data import RecallTaskConfig, task_to_dict
from jax_mha.lab.models import ModelConfig
from jax_mha.lab.train import TrainConfig

MODULE = "experiments.anchor_mqar"
NAME = "mqar"


@dataclasses.dataclass(frozen=True)
class AnchorConfig:
    """Widths compared on MQAR, everything else fixed."""

    widths: tuple[int, ...]  # d_model values, each divisible by model.num_heads
    num_seeds: int
    task: RecallTaskConfig
    model: ModelConfig  # d_model replaced by each width; d_ff = 0 (attention only), as Zoology's
    train: TrainConfig
    solved_accuracy: float = 0.9  # a seed solves the task at this final held-out recall accuracy
    reference_rows: int = 4096  # rows behind the no-lookup reference line

    @property
    def seeds(self) -> list[int]:
        return list(range(self.num_seeds))


def _preset(task: RecallTaskConfig, widths, steps: int, every: int, seeds: int, batch: int,
            eval_size: int) -> AnchorConfig:
    model = ModelConfig(vocab_size=task.vocab_size, max_len=task.seq_len, d_model=max(widths), num_heads=1,
                        num_layers=2, d_ff=0)
    train = TrainConfig(batch_size=batch, num_steps=steps, learning_rate=3e-3, warmup_steps=min(50, steps // 4),
                        steps_per_call=every, eval_every=every, eval_size=eval_size, early_stop=False)
    return AnchorConfig(widths=tuple(widths), num_seeds=seeds, task=task, model=model, train=train)


def standard() -> AnchorConfig:
    """d_model 8, 16, 32, 64 x 5 seeds; 8 pairs, 8 queries, 32 keys, 32 values (T = 33);
    batch 64, 1,500 steps at lr 3e-3 (cosine), evaluated every 50 steps on 512 rows."""
    task = RecallTaskConfig(num_pairs=8, num_queries=8, num_key_symbols=32, num_values=32, key_tokens=1)
    return _preset(task, (8, 16, 32, 64), 1500, 50, 5, 64, 512)


def tiny() -> AnchorConfig:
    """A smoke test in seconds: 3 pairs, d_model 4 and 8, 10 steps, 2 seeds."""
    task = RecallTaskConfig(num_pairs=3, num_queries=3, num_key_symbols=4, num_values=4, key_tokens=1)
    return dataclasses.replace(_preset(task, (4, 8), 10, 10, 2, 8, 16), reference_rows=256)


PRESETS: dict[str, Callable[[], AnchorConfig]] = {"standard": standard, "tiny": tiny}


def parse(argv):
    return common_anchors.parse(argv, MODULE, __doc__, NAME, PRESETS, "widths", "d_model values", "width")


def value_mode_accuracy(task: RecallTaskConfig, rows: int = 4096, seed: int = 0) -> float:
    """Expected accuracy of answering every query with the most common value among the
    row's pairs (ties split evenly): what reading values without any key lookup reaches."""
    import jax

    batch = jax.tree.map(np.asarray, task.batch(jax.random.PRNGKey(seed), rows))
    g, n = task.key_tokens + 1, task.num_pairs
    tokens = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)
    values = tokens[:, 1 + (g - 1) : 1 + g * n : g] - task.first_value  # (rows, N)
    counts = np.stack([np.bincount(v, minlength=task.num_values) for v in values])  # (rows, V)
    modes = counts == counts.max(-1, keepdims=True)
    targets = batch["targets"][batch["scored"]].reshape(rows, -1) - task.first_value  # (rows, Q)
    return float((np.take_along_axis(modes, targets, axis=1) / modes.sum(-1, keepdims=True)).mean())



def train_width(width: int, cfg: AnchorConfig, progress: bool) -> dict:
    model = dataclasses.replace(cfg.model, d_model=width)
    result = common_anchors.train_arm(model, cfg, f"d_model={width:>3}", progress)
    ev, steps = result.evals, result.evals["step"]
    runs = [{"seed": seed, "eval_loss": ev["loss"][i], "recall_accuracy": ev["recall_accuracy"][i],
             "final_accuracy": float(ev["recall_accuracy"][i, -1]), "final_loss": float(ev["loss"][i, -1]),
             "solve_step": common_anchors.first_step(steps, ev["recall_accuracy"][i], cfg.solved_accuracy)}
            for i, seed in enumerate(result.seeds)]
    return {"d_model": width, "eval_step": steps, "wall_seconds": result.wall_seconds,
            "train_seconds": result.train_seconds, "runs": runs}


def artifact(results: dict) -> dict:
    """The per-seed values the page is rendered from (kind "anchor_mqar"): no curves."""
    cfg = results["config"]
    return {"kind": "anchor_mqar", "task": cfg["task"],
            "model": {k: cfg["model"][k] for k in ("num_layers", "num_heads", "d_ff", "positional", "pre_norm")},
            "train": {k: cfg["train"][k] for k in ("batch_size", "num_steps", "learning_rate", "warmup_steps",
                                                   "eval_every", "eval_size")},
            "solved_accuracy": cfg["solved_accuracy"], "reference": results["reference"],
            "metadata": {k: results["metadata"].get(k) for k in ("cpu", "cpu_count", "load_average", "commit",
                                                                  "dirty", "argv")},
            "widths": {key: {"seeds": [r["seed"] for r in arm["runs"]], "wall_seconds": arm["wall_seconds"],
                             **{k: [r[k] for r in arm["runs"]] for k in ("final_accuracy", "final_loss", "solve_step")}}
                       for key, arm in results["arms"].items()}}


def plot(results: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    cfg, meta, ref = results["config"], results["metadata"], results["reference"]
    t = cfg["task"]
    widths = sorted(results["arms"], key=int)
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.0), layout="constrained")
    for i, key in enumerate(widths):
        arm = results["arms"][key]
        for j, run in enumerate(arm["runs"]):
            axes[0].plot(arm["eval_step"], run["recall_accuracy"], color=f"C{i}", alpha=0.8,
                         label=f"d_model = {key}" if j == 0 else None)
        accs = [run["final_accuracy"] for run in arm["runs"]]
        axes[1].scatter(np.full(len(accs), int(key)), accs, color="grey", s=16, zorder=3,
                        label="one seed" if i == 0 else None)
    means = [np.mean([r["final_accuracy"] for r in results["arms"][k]["runs"]]) for k in widths]
    axes[1].plot([int(k) for k in widths], means, marker="o", color="C0", label="mean over seeds")
    axes[1].axvspan(64, max(512, int(widths[-1])), color="C2", alpha=0.12, label="Zoology Fig. 2 widths (64–512)")
    for ax in axes:
        ax.axhline(ref["chance"], color="grey", ls=":", label="chance")
        ax.axhline(ref["value_mode"], color="grey", ls="--", label="most common value, no key lookup")
        ax.axhline(cfg["solved_accuracy"], color="black", lw=0.8, label=f"solved ({cfg['solved_accuracy']:g})")
        ax.grid(alpha=0.3)
    axes[0].set(xlabel="optimizer step", ylabel="held-out recall accuracy", ylim=(0, 1.02),
                title="Held-out recall accuracy (one line per seed)")
    axes[1].set(xscale="log", xlabel="d_model (one head: head dim = d_model)", ylabel="final held-out recall accuracy",
                ylim=(0, 1.02), xlim=(int(widths[0]) / 1.5, 600), title="Final accuracy vs width")
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"MQAR, single-token keys ({t['num_pairs']} pairs, {t['num_queries']} queries, T = "
                 f"{results['seq_len']}), 2-layer 1-head attention, no MLP; {cfg['num_seeds']} seeds per width\n"
                 f"machine: {meta['cpu']}, {meta['cpu_count']} cores (shared)")
    save_figure(fig, path)




def main(argv=None) -> dict:
    args, cfg = parse(argv)
    replotted = common_anchors.start(args, NAME, artifact, plot)
    if replotted is not None:
        return replotted
    config = {"task": task_to_dict(cfg.task), "model": dataclasses.asdict(cfg.model),
              "train": dataclasses.asdict(cfg.train), "num_seeds": cfg.num_seeds, "solved_accuracy": cfg.solved_accuracy}
    del config["model"]["d_model"]  # the variable: a rerun may add widths to the same folder
    results = common_anchors.begin(args, config, seq_len=cfg.task.seq_len, reference={
        "chance": 1.0 / cfg.task.num_values, "rows": cfg.reference_rows,
        "value_mode": value_mode_accuracy(cfg.task, cfg.reference_rows)})
    print(f"anchor {NAME}: widths {cfg.widths}, {cfg.num_seeds} seeds, {cfg.train.num_steps} steps, T = "
          f"{cfg.task.seq_len}; writing to {args.out}/", flush=True)
    common_anchors.train_arms(results, cfg.widths, lambda v: train_width(v, cfg, not args.no_progress), args.out,
                              lambda w: f"d_model={w}", "widths")
    common_anchors.finish(results, args, NAME, artifact, plot)
    return results


if __name__ == "__main__":
    common.cli(main, MODULE)
