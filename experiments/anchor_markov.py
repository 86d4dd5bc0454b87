"""Anchor (c): on in-context Markov chains, a 2-layer attention-only transformer
passes through a unigram stage before the bigram (statistical induction head)
solution (Edelman et al. 2024), at CPU scale.

Every row is drawn from its own Markov chain (`MarkovTaskConfig`: transition rows from
Dirichlet(1), first state from the stationary distribution). Attention-only decoders
(`ModelConfig(d_ff=0)`, one head per layer) of two layers, and of one layer as a control,
train on next-state prediction at every position. At every evaluation the model's
held-out loss is set beside the loss of three strategies on the same held-out rows
(`jax_mha.lab.data.in_context_strategies`: uniform; in-context unigram counts; in-context
bigram counts), and the KL divergence of each strategy to the model says which one the
model is closest to. The true chain's loss (the oracle, from the transition matrices of
the same rows) is the floor.

    python -m experiments.anchor_markov                   # the registered run (standard)
    python -m experiments.anchor_markov --preset tiny --out /tmp/c   # seconds, a smoke test

The configuration (the evaluation schedule included: from step 0, log-spaced) and the
rule come from the registration, experiments/preregistration/anchor_markov.toml
(committed before the run; the run refuses to start while it has uncommitted changes,
and its data record the file and its commit).

Output (--out, default results/anchors/markov[-<preset>]): results.json (curves per seed; a rerun
skips the depths already there), artifact.json, summary.md, anchor_markov.png. The
registered preset also writes the artifact to docs/results/data/anchor_markov.json and the
figure beside the page (docs/results/anchor_markov.png).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from experiments import common, common_anchors
from experiments.common import save_figure
from jax_mha.lab.data import MarkovTaskConfig, in_context_strategies, sample_markov_chains, task_to_dict
from jax_mha.lab.models import ModelConfig
from jax_mha.lab.train import TrainConfig

MODULE = "experiments.anchor_markov"
NAME = "markov"
REGISTRATION = common_anchors.registration_path(NAME)  # read at each parse (a test may point it elsewhere)
STRATEGIES = ("uniform", "unigram", "bigram")


@dataclasses.dataclass(frozen=True)
class AnchorConfig:
    """Depths compared on in-context Markov chains, everything else fixed."""

    layers: tuple[int, ...]
    num_seeds: int
    task: MarkovTaskConfig
    model: ModelConfig  # num_layers replaced by each depth; d_ff = 0 (attention only)
    train: TrainConfig
    # Held-out evaluations besides train.eval_every: from step 0 (the initial parameters),
    # log-spaced, so that each stage, the first uniform one included, is seen.
    eval_steps: tuple[int, ...] = ()
    paper_rows: int = 4096  # rows behind the strategy lines of the paper's code setting (0: none)

    def __post_init__(self):
        off = [s for s in self.eval_steps if s % self.train.steps_per_call or not 0 <= s <= self.train.num_steps]
        if off:
            raise ValueError(f"eval_steps {off} are not multiples of steps_per_call={self.train.steps_per_call} in "
                             f"[0, num_steps={self.train.num_steps}]")

    @property
    def seeds(self) -> list[int]:
        return list(range(self.num_seeds))


def from_preset(preset: dict, rule: dict) -> AnchorConfig:
    """An `AnchorConfig` from a preset table of the registration file (the rule has no
    numbers: `common_anchors.markov_staged` is it)."""
    task = MarkovTaskConfig(**preset["task"])
    model = ModelConfig(vocab_size=task.vocab_size, max_len=task.seq_len, num_layers=max(preset["layers"]),
                        **preset["model"])
    return AnchorConfig(layers=tuple(preset["layers"]), num_seeds=preset["seeds"], task=task, model=model,
                        train=TrainConfig(**preset["train"]), eval_steps=tuple(preset["eval_steps"]),
                        paper_rows=preset.get("paper_rows", 4096))


def parse(argv):
    return common_anchors.parse(argv, MODULE, __doc__, NAME, REGISTRATION, from_preset, "layers",
                                "depths (default 1 2)", "depth")


def strategy_losses(task: MarkovTaskConfig, key, rows: int) -> dict[str, float]:
    """Mean cross-entropy (nats) over every position of `rows` rows drawn with `key`: each
    strategy of `in_context_strategies`, and `oracle`, the true chain's transition
    probabilities (the rows' own matrices)."""
    transitions, tokens = (np.asarray(x) for x in sample_markov_chains(key, task, rows))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    out = {"rows": rows}
    for name, probs in in_context_strategies(inputs, task.num_states).items():
        out[name] = float(-np.log(np.take_along_axis(np.asarray(probs), targets[..., None], -1)).mean())
    true = transitions[np.arange(rows)[:, None], inputs]  # (rows, T, k): row x_t of each row's matrix
    out["oracle"] = float(-np.log(np.take_along_axis(true, targets[..., None], -1)).mean())
    return out


def stages(steps, kls: dict[str, np.ndarray]) -> list[tuple[str, int]]:
    """`[(strategy, step), …]`: the strategy closest to the model (least KL(strategy ||
    model)) at each evaluation, one entry per change, with the step it began."""
    closest = np.argmin(np.stack([np.asarray(kls[s]) for s in STRATEGIES]), axis=0)  # (E,)
    out = []
    for step, i in zip(steps, closest):
        if not out or out[-1][0] != STRATEGIES[i]:
            out.append((STRATEGIES[i], int(step)))
    return out


def train_depth(layers: int, cfg: AnchorConfig, progress: bool) -> dict:
    model = dataclasses.replace(cfg.model, num_layers=layers)
    result = common_anchors.train_arm(model, cfg, f"{layers} layer{'s' if layers > 1 else ''}", progress)
    ev, steps = result.evals, result.evals["step"]
    runs = []
    for i, seed in enumerate(result.seeds):
        kls = {s: ev[f"kl_{s}"][i] for s in STRATEGIES}
        runs.append({"seed": seed, "eval_loss": ev["loss"][i], **{f"kl_{s}": kls[s] for s in STRATEGIES},
                     "stages": stages(steps, kls), "final_loss": float(ev["loss"][i, -1]),
                     **{f"final_kl_{s}": float(kls[s][-1]) for s in STRATEGIES}})
    lines = {s: float(ev[f"{s}_loss"][0, -1]) for s in STRATEGIES}  # the same held-out rows for every seed
    return {"layers": layers, "eval_step": steps, "strategy_losses": lines, "wall_seconds": result.wall_seconds,
            "train_seconds": result.train_seconds, "runs": runs}


def artifact(results: dict) -> dict:
    """The per-seed values the page is rendered from (kind "anchor_markov"): no curves."""
    cfg = results["config"]
    keys = ("stages", "final_loss", "final_kl_uniform", "final_kl_unigram", "final_kl_bigram")
    return {"kind": "anchor_markov", "preregistration": cfg["preregistration"], "task": cfg["task"],
            "model": {k: cfg["model"][k] for k in ("d_model", "num_heads", "d_ff", "positional", "pre_norm")},
            "train": {**{k: cfg["train"][k] for k in ("batch_size", "num_steps", "learning_rate", "warmup_steps",
                                                      "eval_every", "eval_size")}, "eval_steps": cfg["eval_steps"]},
            "reference": results["reference"], "paper_setting": results["paper_setting"],
            "metadata": {k: results["metadata"].get(k) for k in ("cpu", "cpu_count", "load_average", "commit",
                                                                  "dirty", "argv")},
            "arms": {key: {"seeds": [r["seed"] for r in arm["runs"]], "wall_seconds": arm["wall_seconds"],
                           **{k: [r[k] for r in arm["runs"]] for k in keys}} for key, arm in results["arms"].items()}}


def plot(results: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    cfg, meta, ref = results["config"], results["metadata"], results["reference"]
    t, m = cfg["task"], cfg["model"]
    arms = {int(k): v for k, v in results["arms"].items()}
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2), layout="constrained")
    for i, (layers, arm) in enumerate(sorted(arms.items())):
        for j, run in enumerate(arm["runs"]):
            axes[0].plot(arm["eval_step"], run["eval_loss"], color=f"C{i}", alpha=0.8,
                         label=f"model, {layers} layer{'s' if layers > 1 else ''}" if j == 0 else None)
    styles = {"uniform": ":", "unigram": "--", "bigram": "-.", "oracle": "-"}
    for name, ls in styles.items():
        label = "true chain (oracle)" if name == "oracle" else f"{name} strategy"
        axes[0].axhline(ref[name], color="black", ls=ls, lw=0.9, label=f"{label} {ref[name]:.3f}")
    two = arms.get(max(arms))
    for name, color in (("unigram", "C2"), ("bigram", "C3"), ("uniform", "C7")):
        for j, run in enumerate(two["runs"]):
            axes[1].plot(two["eval_step"], run[f"kl_{name}"], color=color, alpha=0.8,
                         label=f"KL({name} ‖ model)" if j == 0 else None)
    axes[0].set(xlabel="optimizer step", ylabel="held-out loss (nats per token)",
                ylim=(ref["oracle"] - 0.02, ref["uniform"] + 0.04), title="Held-out loss and the strategies' losses")
    axes[1].set(xlabel="optimizer step", ylabel="KL(strategy ‖ model), nats", yscale="log",
                title=f"Which strategy the {max(arms)}-layer model is closest to (one line per seed)")
    for ax in axes:
        if cfg.get("eval_steps"):  # log-spaced from step 0: a linear axis up to 20, logarithmic beyond
            ax.set_xscale("symlog", linthresh=20)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"In-context Markov chains (k = {t['num_states']}, T = {t['seq_len']}, Dirichlet("
                 f"{t['concentration']:g}) rows), attention-only, d_model {m['d_model']}, {m['num_heads']} head per "
                 f"layer; {cfg['num_seeds']} seeds per depth\nmachine: {meta['cpu']}, {meta['cpu_count']} cores (shared)")
    save_figure(fig, path)




def references(cfg: AnchorConfig) -> tuple[dict, dict]:
    """The strategy lines on the trainer's own held-out rows (same key and size), and on
    `paper_rows` rows of the paper's code setting (T = 100, k = 2 and 3)."""
    import jax

    ours = strategy_losses(cfg.task, jax.random.key(cfg.train.eval_seed), cfg.train.eval_size)
    paper = {f"k={k}, T=100": strategy_losses(MarkovTaskConfig(seq_len=100, num_states=k), jax.random.key(k),
                                              cfg.paper_rows) for k in (2, 3) if cfg.paper_rows}
    return ours, paper


def main(argv=None) -> dict:
    args, cfg = parse(argv)
    replotted = common_anchors.start(args, NAME, artifact, plot)
    if replotted is not None:
        return replotted
    # The depths are the variable, not part of the configuration: a rerun may add depths to the folder.
    config = {"task": task_to_dict(cfg.task), "model": dataclasses.asdict(cfg.model),
              "train": dataclasses.asdict(cfg.train), "eval_steps": list(cfg.eval_steps), "num_seeds": cfg.num_seeds}
    ours, paper = references(cfg)
    results = common_anchors.begin(args, config, reference=ours, paper_setting=paper)
    print(f"anchor {NAME}: depths {cfg.layers}, {cfg.num_seeds} seeds, {cfg.train.num_steps} steps; strategy "
          f"losses on the held-out rows: " + ", ".join(f"{k} {v:.4f}" for k, v in ours.items() if k != "rows")
          + f"; writing to {args.out}/", flush=True)
    common_anchors.train_arms(results, [(str(n), n) for n in cfg.layers],
                              lambda v: train_depth(v, cfg, not args.no_progress), args.out,
                              lambda n: f"{n} layer(s)", "depths")
    common_anchors.finish(results, args, NAME, artifact, plot)
    return results


if __name__ == "__main__":
    common.cli(main, MODULE)
