"""Anchor (a): induction heads form in 2-layer but not in 1-layer attention-only
transformers (Elhage et al. 2021; Olsson et al. 2022), at CPU scale.

Attention-only decoders (`ModelConfig(d_ff=0)`: no MLP, so any circuit is made of heads)
of one and of two layers train on repeated random sequences of varying length
(`RepeatTaskConfig`: R distinct random symbols, the same R again; R varies per row, so
no fixed offset finds the answer; the loss is scored on the repeated half). Every
evaluation records the held-out loss on the repeated half and each head's
prefix-matching score on a fixed probe (`RepeatTaskConfig(track_induction=True)`), so
the curves show when, and whether, an induction head forms. Several seeds per depth in
one vmapped program each.

    python -m experiments.anchor_induction                   # the registered run (standard)
    python -m experiments.anchor_induction --preset tiny --out /tmp/a   # seconds, a smoke test

The configuration and the rule come from the registration,
experiments/preregistration/anchor_induction.toml (committed before the run; the run
refuses to start while it has uncommitted changes, and its data record the file and
its commit).

Output (--out, default results/anchors/induction[-<preset>]): results.json (curves per seed;
a rerun skips the depths already there), artifact.json (per-seed values), summary.md,
anchor_induction.png. The registered preset also writes the artifact to
docs/results/data/anchor_induction.json and the figure beside the page
(docs/results/anchor_induction.png), which `experiments.report` renders the page from.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from experiments import common, common_anchors
from experiments.common import save_figure
from jax_mha.lab import head_types
from jax_mha.lab.data import RepeatTaskConfig, task_to_dict
from jax_mha.lab.models import ModelConfig
from jax_mha.lab.train import TrainConfig

MODULE = "experiments.anchor_induction"
NAME = "induction"
REGISTRATION = common_anchors.registration_path(NAME)  # read at each parse (a test may point it elsewhere)


@dataclasses.dataclass(frozen=True)
class AnchorConfig:
    """Depths compared on the repeated-sequence task, everything else fixed."""

    layers: tuple[int, ...]  # depths trained, each with num_seeds seeds
    num_seeds: int
    task: RepeatTaskConfig
    model: ModelConfig  # num_layers replaced by each depth; d_ff = 0 (attention only)
    train: TrainConfig
    threshold: float = head_types.INDUCTION_THRESHOLD  # a head is an induction head at this prefix matching (the rule)

    @property
    def seeds(self) -> list[int]:
        return list(range(self.num_seeds))


def from_preset(preset: dict, rule: dict) -> AnchorConfig:
    """An `AnchorConfig` from a preset table of the registration file and its `[rule]`."""
    task = RepeatTaskConfig(**preset["task"])
    model = ModelConfig(vocab_size=task.vocab_size, max_len=task.seq_len, num_layers=max(preset["layers"]),
                        **preset["model"])
    return AnchorConfig(layers=tuple(preset["layers"]), num_seeds=preset["seeds"], task=task, model=model,
                        train=TrainConfig(**preset["train"]), threshold=float(rule["threshold"]))


def parse(argv):
    return common_anchors.parse(argv, MODULE, __doc__, NAME, REGISTRATION, from_preset, "layers",
                                "depths (default 1 2)", "depth")


def train_depth(layers: int, cfg: AnchorConfig, progress: bool) -> dict:
    """All seeds of one depth; the curves per seed and the values the page reports."""
    model = dataclasses.replace(cfg.model, num_layers=layers)
    result = common_anchors.train_arm(model, cfg, f"{layers} layer{'s' if layers > 1 else ''}", progress)
    ev, steps = result.evals, result.evals["step"]
    runs = []
    for i, seed in enumerate(result.seeds):
        pm = ev["prefix_matching"][i]  # (E, layers, H)
        best = pm.max(axis=(1, 2))  # (E,)
        final = pm[-1]
        runs.append({"seed": seed, "eval_loss": ev["loss"][i], "eval_accuracy": ev["token_accuracy"][i],
                     "prefix_matching": pm, "copying": ev["copying"][i],
                     "final_loss": float(ev["loss"][i, -1]), "final_accuracy": float(ev["token_accuracy"][i, -1]),
                     "max_prefix_matching": float(final.max()),
                     "best_head": [int(x) for x in np.unravel_index(final.argmax(), final.shape)],
                     "formation_step": common_anchors.first_step(steps, best, cfg.threshold),
                     "half_accuracy_step": common_anchors.first_step(steps, ev["token_accuracy"][i], 0.5),
                     "final_copying": float(ev["copying"][i, -1])})
    return {"layers": layers, "eval_step": steps, "wall_seconds": result.wall_seconds,
            "train_seconds": result.train_seconds, "runs": runs}


def artifact(results: dict) -> dict:
    """The per-seed values the page is rendered from (`experiments.common_anchors`, kind
    "anchor_induction"), and per depth the curves' means over seeds (held-out loss on the
    repeated half, the best head's prefix matching) at every evaluation step."""
    cfg = results["config"]
    keys = ("final_loss", "final_accuracy", "max_prefix_matching", "best_head", "formation_step",
            "half_accuracy_step", "final_copying")
    return {"kind": "anchor_induction", "preregistration": cfg["preregistration"], "task": cfg["task"],
            "model": {k: cfg["model"][k] for k in ("d_model", "num_heads", "d_ff", "positional", "pre_norm")},
            "train": {k: cfg["train"][k] for k in ("batch_size", "num_steps", "learning_rate", "warmup_steps",
                                                   "eval_every", "eval_size")},
            "threshold": cfg["threshold"], "probe_repeat": results["probe_repeat"], "chance": results["chance"],
            "metadata": {k: results["metadata"].get(k) for k in ("cpu", "cpu_count", "load_average", "commit",
                                                                  "dirty", "argv")},
            "arms": {key: {"seeds": [r["seed"] for r in arm["runs"]], "wall_seconds": arm["wall_seconds"],
                           **{k: [r[k] for r in arm["runs"]] for k in keys}} for key, arm in results["arms"].items()},
            "curves": {key: _mean_curves(arm) for key, arm in results["arms"].items()}}


def _mean_curves(arm: dict) -> dict:
    """Means over seeds at each evaluation: loss (E,), best head's prefix matching (E,),
    and that best head's maximum over seeds (E,); 5 decimals."""
    best = np.stack([np.asarray(r["prefix_matching"]).max(axis=(1, 2)) for r in arm["runs"]])  # (seeds, E)
    loss = np.stack([np.asarray(r["eval_loss"]) for r in arm["runs"]])
    rounded = lambda x: [round(float(v), 5) for v in x]
    return {"step": list(arm["eval_step"]), "loss": rounded(loss.mean(0)),
            "best_prefix_matching": rounded(best.mean(0)), "best_prefix_matching_max": rounded(best.max(0))}


def plot(results: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    cfg, meta = results["config"], results["metadata"]
    t, m = cfg["task"], cfg["model"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.0), layout="constrained")
    for i, key in enumerate(sorted(results["arms"], key=int)):
        arm = results["arms"][key]
        for j, run in enumerate(arm["runs"]):
            label = f"{key} layer{'s' if int(key) > 1 else ''}" if j == 0 else None
            axes[0].plot(arm["eval_step"], run["eval_loss"], color=f"C{i}", alpha=0.8, label=label)
            best = np.asarray(run["prefix_matching"]).max(axis=(1, 2))
            axes[1].plot(arm["eval_step"], best, color=f"C{i}", alpha=0.8, label=label)
    axes[0].set(xlabel="optimizer step", ylabel="held-out loss on the repeated half (nats)",
                title="Loss on the repeated half (one line per seed)")
    axes[1].axhline(cfg["threshold"], color="grey", ls="--", label=f"induction threshold {cfg['threshold']:g}")
    axes[1].axhline(results["chance"], color="grey", ls=":", label="uniform attention")
    axes[1].set(xlabel="optimizer step", ylabel="best head's prefix-matching score", ylim=(0, 1.02),
                title=f"Prefix matching on a fixed probe (R = {results['probe_repeat']})")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"Induction heads, attention-only decoders (d_model {m['d_model']}, {m['num_heads']} heads, no MLP) "
                 f"on repeated random sequences (T = {t['seq_len']}, R ∈ [{t['min_repeat']}, {t['max_repeat']}])\n"
                 f"{cfg['num_seeds']} seeds per depth; machine: {meta['cpu']}, {meta['cpu_count']} cores (shared)")
    save_figure(fig, path)




def main(argv=None) -> dict:
    args, cfg = parse(argv)
    replotted = common_anchors.start(args, NAME, artifact, plot)
    if replotted is not None:
        return replotted
    # The depths are the variable, not part of the configuration: a rerun may add depths to the folder.
    config = {"task": task_to_dict(cfg.task), "model": dataclasses.asdict(cfg.model),
              "train": dataclasses.asdict(cfg.train), "num_seeds": cfg.num_seeds, "threshold": cfg.threshold}
    results = common_anchors.begin(args, config, probe_repeat=cfg.task.probe_repeat,
                                   chance=head_types.prefix_matching_chance(cfg.task.probe_repeat))
    print(f"anchor {NAME}: depths {cfg.layers}, {cfg.num_seeds} seeds, {cfg.train.num_steps} steps; writing to "
          f"{args.out}/", flush=True)
    common_anchors.train_arms(results, [(str(n), n) for n in cfg.layers],
                              lambda v: train_depth(v, cfg, not args.no_progress), args.out,
                              lambda n: f"{n} layer(s)", "depths")
    common_anchors.finish(results, args, NAME, artifact, plot)
    return results


if __name__ == "__main__":
    common.cli(main, MODULE)
