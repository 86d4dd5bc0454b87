"""Anchor (b): attention solves multi-query associative recall at every width and
sequence length, where a gated convolution needs a width that grows with the sequence
(Zoology's Figure 2, Arora et al. 2023), on a scaled-down grid.

Two arms, as in Zoology: 2 layers of one-head attention with no MLP (its state mixer is
the identity), and a gated convolution in the same frame (`ModelConfig(mixer="gated_conv")`,
`jax_mha.lab.models.GatedConvMixer`: short causal convolutions, a long causal filter and
a multiplicative gate, H3-style). Each trains on the harness's MQAR with single-token
keys and queries that repeat keys (`RecallTaskConfig(key_tokens=1)`; N pairs, then Q
queries, each of the N keys drawn with repeats, T = 2(N + Q) + 1) at every width and length of the grid, several seeds per cell in one
vmapped program. The outcome per cell is the share of seeds that solve the task (final
held-out recall accuracy at the registered threshold) with Wilson's interval, and the
final accuracy with a t interval over seeds.

The grid, training and rule come from the registration,
experiments/preregistration/anchor_mqar.toml (committed before the run; the run refuses
to start while it has uncommitted changes, and its data record the file and its commit).

    python -m experiments.anchor_mqar                   # the registered run (standard): hours
    python -m experiments.anchor_mqar --preset quick    # minutes: the page's shape, none of its statistics
    python -m experiments.anchor_mqar --preset tiny --out /tmp/b   # seconds, a smoke test

Output (--out, default results/anchors/mqar[-<preset>]): results.json (curves per seed; a
rerun skips the cells already there), artifact.json, summary.md, anchor_mqar.png. The
registered preset also writes the artifact to docs/results/data/anchor_mqar.json and
the figure beside the page (docs/results/anchor_mqar.png).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from experiments import common, common_anchors
from experiments.common import save_figure
from jax_mha.lab.data import RecallTaskConfig, task_to_dict
from jax_mha.lab.models import MIXERS, ModelConfig
from jax_mha.lab.train import TrainConfig

MODULE = "experiments.anchor_mqar"
NAME = "mqar"
REGISTRATION = common_anchors.registration_path(NAME)  # read at each parse (a test may point it elsewhere)


@dataclasses.dataclass(frozen=True)
class AnchorConfig:
    """Sequence mixers x lengths x widths on MQAR, everything else fixed."""

    arms: tuple[str, ...]  # sequence mixers (ModelConfig.mixer): "attention", "gated_conv"
    widths: tuple[int, ...]  # d_model values, each divisible by model.num_heads
    lengths: tuple[tuple[int, int], ...]  # (N pairs, Q queries) per row, one length each: T = 2(N + Q) + 1
    num_seeds: int
    task: RecallTaskConfig  # the alphabets; num_pairs and num_queries replaced by each length's
    model: ModelConfig  # shared by the arms; mixer, d_model and max_len replaced per cell; d_ff = 0
    train: TrainConfig
    solved_accuracy: float  # a seed solves a cell at this final held-out recall accuracy (the rule)
    min_drop: float  # the conv arm's fall with length that must occur at one width at least (the rule)
    reference_rows: int = 4096  # rows behind the no-lookup reference line

    def __post_init__(self):
        bad = [a for a in self.arms if a not in MIXERS]
        if bad or not self.arms or not self.widths or not self.lengths or self.num_seeds < 1:
            raise ValueError(f"need arms among {MIXERS}, widths, lengths and num_seeds >= 1; got arms {self.arms}, "
                             f"widths {self.widths}, lengths {self.lengths}, num_seeds {self.num_seeds}")
        for w in self.widths:  # each cell's config checks itself; build them all now, before any training
            for length in self.lengths:
                for arm in self.arms:
                    self.model_for(arm, length, w)

    @property
    def seeds(self) -> list[int]:
        return list(range(self.num_seeds))

    def task_for(self, length: tuple[int, int]) -> RecallTaskConfig:
        pairs, queries = length
        return dataclasses.replace(self.task, num_pairs=pairs, num_queries=queries)

    def model_for(self, arm: str, length: tuple[int, int], width: int) -> ModelConfig:
        return dataclasses.replace(self.model, mixer=arm, d_model=width, max_len=self.task_for(length).seq_len)

    def cells(self) -> list[tuple[str, int, int]]:
        """`(arm, (pairs, queries), width)` in training order: each length, then each arm, widths rising."""
        return [(arm, length, w) for length in self.lengths for arm in self.arms for w in self.widths]


def cell_key(arm: str, seq_len: int, width: int) -> str:
    return f"{arm} T={seq_len} d={width}"


def from_preset(preset: dict, rule: dict) -> AnchorConfig:
    """An `AnchorConfig` from a preset table of the registration file and its `[rule]`."""
    lengths = tuple((int(length["pairs"]), int(length["queries"])) for length in preset["lengths"])
    longest = max(lengths, key=sum)
    task = RecallTaskConfig(num_pairs=longest[0], num_queries=longest[1], key_tokens=1, **preset["task"])
    model = ModelConfig(vocab_size=task.vocab_size, max_len=task.seq_len, d_model=max(preset["widths"]),
                        **preset["model"])
    return AnchorConfig(arms=tuple(preset["arms"]), widths=tuple(preset["widths"]), lengths=lengths,
                        num_seeds=preset["seeds"], task=task, model=model, train=TrainConfig(**preset["train"]),
                        solved_accuracy=float(rule["solved_accuracy"]), min_drop=float(rule["min_drop"]),
                        reference_rows=preset.get("reference_rows", 4096))


def parse(argv):
    return common_anchors.parse(argv, MODULE, __doc__, NAME, REGISTRATION, from_preset, "widths", "d_model values",
                                "cell")


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



def train_cell(cell: tuple[str, int, int], cfg: AnchorConfig, progress: bool) -> dict:
    """All seeds of one (arm, (pairs, queries), width) cell; the curves per seed and the values the page reports."""
    arm, length, width = cell
    task = cfg.task_for(length)
    label = f"{common_anchors.MIXER_NAMES[arm]:>10} T={task.seq_len:>3} d={width:>3}"
    result = common_anchors.train_arm(cfg.model_for(arm, length, width), cfg, label, progress, task=task)
    ev, steps = result.evals, result.evals["step"]
    runs = [{"seed": seed, "eval_loss": ev["loss"][i], "recall_accuracy": ev["recall_accuracy"][i],
             "final_accuracy": float(ev["recall_accuracy"][i, -1]), "final_loss": float(ev["loss"][i, -1]),
             "solve_step": common_anchors.first_step(steps, ev["recall_accuracy"][i], cfg.solved_accuracy)}
            for i, seed in enumerate(result.seeds)]
    return {"arm": arm, "num_pairs": task.num_pairs, "num_queries": task.num_queries, "seq_len": task.seq_len,
            "d_model": width, "eval_step": steps,
            "wall_seconds": result.wall_seconds, "train_seconds": result.train_seconds, "runs": runs}


def artifact(results: dict) -> dict:
    """The per-seed values the page is rendered from (kind "anchor_mqar", with "cells":
    `cells[arm][str(seq_len)][str(d_model)]`): no curves."""
    cfg = results["config"]
    cells: dict = {}
    for arm in results["arms"].values():
        cells.setdefault(arm["arm"], {}).setdefault(str(arm["seq_len"]), {})[str(arm["d_model"])] = {
            "seeds": [r["seed"] for r in arm["runs"]], "wall_seconds": arm["wall_seconds"],
            **{k: [r[k] for r in arm["runs"]] for k in ("final_accuracy", "final_loss", "solve_step")}}
    return {"kind": "anchor_mqar", "preregistration": cfg["preregistration"],
            "solved_accuracy": cfg["solved_accuracy"], "min_drop": cfg["min_drop"],
            "arms": cfg["arms"], "widths": results["widths"], "lengths": results["lengths"],
            "task": {k: v for k, v in cfg["task"].items() if k not in ("num_pairs", "num_queries")},
            "model": {k: cfg["model"][k] for k in ("num_layers", "num_heads", "d_ff", "positional", "pre_norm",
                                                   "conv_kernel")},
            "train": {k: cfg["train"][k] for k in ("batch_size", "num_steps", "learning_rate", "warmup_steps",
                                                   "end_lr_ratio", "eval_every", "eval_size")},
            "reference": results["reference"],
            "metadata": {k: results["metadata"].get(k) for k in ("cpu", "cpu_count", "load_average", "commit",
                                                                  "dirty", "argv")},
            "cells": cells}


def plot(results: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    cfg, meta = results["config"], results["metadata"]
    lengths = [length["seq_len"] for length in results["lengths"]]
    arms = [a for a in results["arms"].values()]
    fig, axes = plt.subplots(1, 1 + len(lengths), figsize=(6 + 5 * len(lengths), 5.0), layout="constrained",
                             squeeze=False)
    axes = axes[0]
    colors = {arm: f"C{i}" for i, arm in enumerate(cfg["arms"])}
    styles = ["-", "--", ":", "-."]
    for arm in cfg["arms"]:
        for j, t in enumerate(lengths):
            cells = sorted((a for a in arms if a["arm"] == arm and a["seq_len"] == t), key=lambda a: a["d_model"])
            if not cells:
                continue
            widths = [c["d_model"] for c in cells]
            finals = [[r["final_accuracy"] for r in c["runs"]] for c in cells]
            axes[0].plot(widths, [np.mean(f) for f in finals], marker="o", color=colors[arm], ls=styles[j % 4],
                         label=f"{common_anchors.MIXER_NAMES[arm]}, T = {t}")
            for w, f in zip(widths, finals):
                axes[0].scatter(np.full(len(f), w), f, color=colors[arm], s=12, alpha=0.5)
            for k, c in enumerate(cells):
                curve = np.mean([r["recall_accuracy"] for r in c["runs"]], axis=0)
                axes[1 + j].plot(c["eval_step"], curve, color=colors[arm], alpha=0.35 + 0.65 * (k + 1) / len(cells),
                                 label=f"{common_anchors.MIXER_NAMES[arm]}, d = {c['d_model']}")
    for j, t in enumerate(lengths):
        ref = results["reference"][str(t)]
        ax = axes[1 + j]
        ax.axhline(ref["value_mode"], color="grey", ls="--", label="most common value, no key lookup")
        ax.set(xlabel="optimizer step", ylabel="held-out recall accuracy (mean over seeds)", ylim=(0, 1.02),
               title=f"T = {t} ({results['lengths'][j]['num_pairs']} pairs, {results['lengths'][j]['num_queries']} "
                     "queries)")
    axes[0].set(xscale="log", xlabel="d_model", ylabel="final held-out recall accuracy", ylim=(0, 1.02),
                title="Final accuracy against width (dots: seeds)")
    trained = sorted({a["d_model"] for a in arms})
    axes[0].set_xticks(trained, [str(w) for w in trained])
    axes[0].minorticks_off()
    for ax in axes:
        ax.axhline(cfg["solved_accuracy"], color="black", lw=0.8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    t = cfg["task"]
    fig.suptitle(f"MQAR, single-token keys ({t['num_key_symbols']} keys, {t['num_values']} values), attention vs gated "
                 f"convolution, {cfg['model']['num_layers']} layers, no MLP; {cfg['num_seeds']} seed(s) per cell, "
                 f"preset {cfg['preregistration']['preset']}\nmachine: {meta['cpu']}, {meta['cpu_count']} cores (shared)")
    save_figure(fig, path)


def main(argv=None) -> dict:
    args, cfg = parse(argv)
    replotted = common_anchors.start(args, NAME, artifact, plot)
    if replotted is not None:
        return replotted
    # The widths are not part of the configuration: a rerun may add widths to the same folder.
    config = {"task": task_to_dict(cfg.task), "model": dataclasses.asdict(cfg.model), "train": dataclasses.asdict(cfg.train),
              "arms": list(cfg.arms), "lengths": [list(x) for x in cfg.lengths], "num_seeds": cfg.num_seeds,
              "solved_accuracy": cfg.solved_accuracy, "min_drop": cfg.min_drop}
    for key in ("d_model", "max_len", "mixer"):
        del config["model"][key]  # set per cell
    lengths = [{"num_pairs": n, "num_queries": q, "seq_len": cfg.task_for((n, q)).seq_len} for n, q in cfg.lengths]
    reference = {str(cfg.task_for(x).seq_len): {"chance": 1.0 / cfg.task.num_values, "rows": cfg.reference_rows,
                                                "value_mode": value_mode_accuracy(cfg.task_for(x), cfg.reference_rows)}
                 for x in cfg.lengths}
    results = common_anchors.begin(args, config, widths=list(cfg.widths), lengths=lengths, reference=reference)
    print(f"anchor {NAME}: {', '.join(cfg.arms)} x T = {[x['seq_len'] for x in lengths]} x d_model {list(cfg.widths)}, "
          f"{cfg.num_seeds} seeds, {cfg.train.num_steps} steps; writing to {args.out}/", flush=True)
    items = [(cell_key(arm, cfg.task_for(length).seq_len, w), (arm, length, w)) for arm, length, w in cfg.cells()]
    common_anchors.train_arms(results, items, lambda cell: train_cell(cell, cfg, not args.no_progress), args.out,
                              lambda cell: cell_key(cell[0], cfg.task_for(cell[1]).seq_len, cell[2]), "cells")
    common_anchors.finish(results, args, NAME, artifact, plot)
    return results


if __name__ == "__main__":
    common.cli(main, MODULE)
