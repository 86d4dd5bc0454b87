"""A task where one head is not enough: multi-query associative recall (issue 22, item 4).

The copy task is solved by every head count (one fixed offset, which one head with
learned positions expresses exactly): a null by construction. Here the keys are two
tokens long (`jax_mha.lab.data.RecallTaskConfig`, after Arora et al. 2023,
"Zoology"), so a small decoder must gather both key tokens by position and then
match them by content. Every head count trains the same fixed step budget, d_model
fixed (small: 16-64), several seeds in one vmapped program; the measures are the
area under the held-out loss curve (the mean held-out loss over the evaluations,
which rewards learning early) and the final recall accuracy, with 95 % t intervals
over seeds and seed-paired differences against h = 1 (a seed draws the same
batches at every h).

    python -m experiments.associative_recall                   # quick: h = 1 2 4 8, 3 seeds
    python -m experiments.associative_recall --preset tiny     # seconds, a smoke test
    python -m experiments.associative_recall --heads 1 4 --seeds 5 --steps 2000 --d-model 32

Output (--out, default results/associative_recall/<preset>/): results.json,
summary.md, recall_curves.png, recall_vs_heads.png.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable

import numpy as np

from experiments import common
from experiments.common import save_figure, write_atomic, write_json
from jax_mha.lab import stats
from jax_mha.lab.data import RecallTaskConfig, task_to_dict
from jax_mha.lab.models import ModelConfig
from jax_mha.lab.train import TrainConfig, train_seeds

MODULE = "experiments.associative_recall"


@dataclasses.dataclass(frozen=True)
class RecallStudyConfig:
    """One sweep over head counts on the recall task."""

    heads: tuple[int, ...]  # head counts, each dividing model.d_model
    num_seeds: int  # seeds per head count (one vmapped program)
    task: RecallTaskConfig
    model: ModelConfig  # num_heads replaced by each h
    train: TrainConfig  # early_stop is off: every h trains the same budget

    @property
    def seeds(self) -> list[int]:
        return list(range(self.num_seeds))


def _preset(d_model: int, steps: int, eval_every: int, heads, seeds, task=RecallTaskConfig(), layers: int = 2,
            batch: int = 64, lr: float = 3e-3) -> RecallStudyConfig:
    model = ModelConfig(vocab_size=task.vocab_size, max_len=task.seq_len, d_model=d_model, d_ff=4 * d_model,
                        num_heads=1, num_layers=layers)
    train = TrainConfig(batch_size=batch, num_steps=steps, learning_rate=lr, warmup_steps=min(100, steps // 10),
                        steps_per_call=eval_every, eval_every=eval_every, eval_size=512, early_stop=False)
    return RecallStudyConfig(heads=tuple(heads), num_seeds=seeds, task=task, model=model, train=train)


def quick() -> RecallStudyConfig:
    """h = 1, 2, 4, 8 at d_model=32, 2 layers, 3 seeds; sized to about 10 CPU-minutes
    on a 2-core CPU (measured: see docs/results/associative_recall.md)."""
    return _preset(32, 1200, 50, (1, 2, 4, 8), 3)


def tiny() -> RecallStudyConfig:
    """A smoke test in seconds: 3 pairs, d_model=8, one layer, 20 steps."""
    task = RecallTaskConfig(num_pairs=3, num_queries=2, num_key_symbols=3, num_values=4)
    return _preset(8, 20, 10, (1, 2), 2, task=task, layers=1, batch=8)


PRESETS: dict[str, Callable[[], RecallStudyConfig]] = {"quick": quick, "tiny": tiny}


def build_parser():
    p = common.parser(MODULE, "Head counts on multi-query associative recall with two-token keys (fixed d_model, "
                              "fixed step budget): area under the held-out loss curve and final recall accuracy.")
    p.add_argument("--preset", choices=sorted(PRESETS), default="quick", help="base configuration (default quick)")
    p.add_argument("--heads", type=common.positive_int, nargs="+", help="head counts (each must divide d_model)")
    p.add_argument("--seeds", type=common.positive_int, help="seeds per head count")
    p.add_argument("--steps", type=common.positive_int, help="optimizer steps (a multiple of the evaluation interval)")
    p.add_argument("--d-model", type=common.positive_int, help="model width (d_ff = 4 d_model)")
    p.add_argument("--lr", type=common.positive_float, help="peak AdamW learning rate")
    p.add_argument("--out", type=Path, help="output folder (default results/associative_recall/<preset>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--replot", action="store_true", help="redo summary.md and the figures from --out's results.json")
    return p


def build_config(args) -> RecallStudyConfig:
    cfg = PRESETS[args.preset]()
    model, train = cfg.model, cfg.train
    if args.d_model is not None:
        model = dataclasses.replace(model, d_model=args.d_model, d_ff=4 * args.d_model)
    if args.steps is not None:
        train = dataclasses.replace(train, num_steps=args.steps)
    if args.lr is not None:
        train = dataclasses.replace(train, learning_rate=args.lr)
    heads = tuple(args.heads) if args.heads else cfg.heads
    for h in heads:
        if model.d_model % h:
            raise ValueError(f"d_model={model.d_model} is not divisible by num_heads={h}")
    return dataclasses.replace(cfg, heads=heads, model=model, train=train, num_seeds=args.seeds or cfg.num_seeds)


def parse(argv):
    p = build_parser()
    args = p.parse_args(argv)
    cfg = common.build_or_exit(p, lambda: build_config(args))
    args.out = args.out or Path("results") / "associative_recall" / args.preset
    return args, cfg


def area_under_loss(steps: np.ndarray, loss: np.ndarray) -> float:
    """Mean held-out loss over the run: the trapezoid area under loss(step) from the
    first evaluation to the last, divided by the steps between them (nats). Lower is
    better; it rewards learning early as well as ending low."""
    steps, loss = np.asarray(steps, float), np.asarray(loss, float)
    if steps.size < 2:
        return float(loss.mean())
    return float(np.sum((loss[1:] + loss[:-1]) / 2 * np.diff(steps)) / (steps[-1] - steps[0]))


def one_token_accuracy(task: RecallTaskConfig, which: str, rows: int = 4096, seed: int = 0) -> float:
    """Expected held-out accuracy of a lookup that matches only ONE key token.

    For each query, the candidates are the context pairs whose `which` token ("a" or
    "b") equals the query's; answering with a uniformly chosen candidate's value is
    right with probability (candidates with the right value) / (candidates). A model
    on this line has learned a one-token lookup, not the two-token one the task asks.
    """
    import jax

    batch = jax.tree.map(np.asarray, task.batch(jax.random.PRNGKey(seed), rows))
    n, q = task.num_pairs, task.num_queries
    tokens = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)
    pairs = tokens[:, 1 : 1 + 3 * n].reshape(rows, n, 3)  # (B, N, [a, b, v])
    queries = tokens[:, 2 + 3 * n :].reshape(rows, q, 3)
    col = {"a": 0, "b": 1}[which]
    same = pairs[:, None, :, col] == queries[:, :, None, col]  # (B, Q, N)
    right = same & (pairs[:, None, :, 2] == queries[:, :, None, 2])
    return float((right.sum(-1) / same.sum(-1)).mean())


def train_heads(h: int, cfg: RecallStudyConfig, progress: bool) -> dict:
    model = dataclasses.replace(cfg.model, num_heads=h)
    bar = common.TrainingBar(cfg.train.num_steps, f"h={h:>2}", not progress)
    try:
        result = train_seeds(model, cfg.task, cfg.train, cfg.seeds, callback=bar)
    finally:
        bar.close()
    ev = result.evals
    runs = [{"seed": seed,
             "eval_step": ev["step"], "eval_loss": ev["loss"][i], "recall_accuracy": ev["recall_accuracy"][i],
             "auc_loss": area_under_loss(ev["step"], ev["loss"][i]),
             "final_recall_accuracy": float(ev["recall_accuracy"][i, -1]),
             "final_query_exact": float(ev["query_exact"][i, -1]),
             "final_loss": float(ev["loss"][i, -1])} for i, seed in enumerate(result.seeds)]
    return {"heads": h, "head_dim": cfg.model.d_model // h, "wall_seconds": result.wall_seconds,
            "train_seconds": result.train_seconds, "runs": runs}


def summarize(results: dict) -> dict:
    """Per h: t intervals of AUC and final accuracy; seed-paired differences vs the fewest heads."""
    records = {int(k): v for k, v in results["heads"].items()}
    base = min(records)
    out = {}
    for h, r in sorted(records.items()):
        auc = [run["auc_loss"] for run in r["runs"]]
        acc = [run["final_recall_accuracy"] for run in r["runs"]]
        row = {"auc": stats.t_interval(auc), "accuracy": stats.t_interval(acc)}
        if h != base:
            b = records[base]["runs"]
            row["auc_minus_base"] = stats.paired_difference(auc, [run["auc_loss"] for run in b])
            row["accuracy_minus_base"] = stats.paired_difference(acc, [run["final_recall_accuracy"] for run in b])
        out[h] = row
    return out


def summary_markdown(results: dict) -> str:
    cfg, s = results["config"], summarize(results)
    base = min(s)
    t, m, tr = cfg["task"], cfg["model"], cfg["train"]
    chance = 1.0 / t["num_values"]
    lines = [f"Multi-query associative recall, {t['num_pairs']} pairs, {t['num_queries']} queries, two-token keys "
             f"from {t['num_key_symbols']} symbols, {t['num_values']} values (chance {chance:.3f}); d_model="
             f"{m['d_model']}, {m['num_layers']} layers, batch {tr['batch_size']}, {tr['num_steps']} steps, lr "
             f"{tr['learning_rate']:g}, held-out evaluation every {tr['eval_every']} steps on {tr['eval_size']} rows; "
             f"{cfg['num_seeds']} seeds. Mean [95 % t interval, n-1 dof]; differences are seed-paired against "
             f"h={base}.", "",
             f"| heads | head dim | area under held-out loss (nats) | final recall accuracy | AUC − AUC(h={base}) "
             f"| accuracy − accuracy(h={base}) | wall s |", "|---:|---:|---:|---:|---:|---:|---:|"]
    task = RecallTaskConfig(**{k: v for k, v in t.items() if k != "name"})
    lines.insert(1, f"\nReference lines (4,096 generated rows): matching only the key's first token gives "
                    f"{one_token_accuracy(task, 'a'):.3f} accuracy, only its second token "
                    f"{one_token_accuracy(task, 'b'):.3f}; the full two-token match gives 1.")
    for h, row in s.items():
        r = results["heads"][str(h)]
        diff = lambda key: row[key].format(3) if key in row else "–"
        lines.append(f"| {h} | {r['head_dim']} | {row['auc'].format(3)} | {row['accuracy'].format(3)} | "
                     f"{diff('auc_minus_base')} | {diff('accuracy_minus_base')} | {r['wall_seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, out: Path) -> None:
    import matplotlib.pyplot as plt

    cfg = results["config"]
    t, m = cfg["task"], cfg["model"]
    setting = (f"{t['num_pairs']} pairs, two-token keys; d_model={m['d_model']}, {m['num_layers']} layers; "
               f"{cfg['num_seeds']} seeds")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    for i, key in enumerate(sorted(results["heads"], key=int)):
        for j, run in enumerate(results["heads"][key]["runs"]):
            axes[0].plot(run["eval_step"], run["eval_loss"], color=f"C{i}", alpha=0.8,
                         label=f"h={key}" if j == 0 else None)
            axes[1].plot(run["eval_step"], run["recall_accuracy"], color=f"C{i}", alpha=0.8,
                         label=f"h={key}" if j == 0 else None)
    axes[0].set(xlabel="optimizer step", ylabel="held-out loss on query values (nats)",
                title=f"Held-out loss (one line per seed)\n{setting}")
    axes[1].axhline(1.0 / t["num_values"], color="grey", ls=":", label="chance")
    axes[1].set(xlabel="optimizer step", ylabel="held-out recall accuracy", ylim=(0, 1.02),
                title=f"Held-out recall accuracy (one line per seed)\n{setting}")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    save_figure(fig, out / "recall_curves.png")

    s = summarize(results)
    heads = np.asarray(sorted(s))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, key, label in ((axes[0], "auc", "area under held-out loss (nats, lower is better)"),
                           (axes[1], "accuracy", "final held-out recall accuracy")):
        iv = [s[h][key] for h in heads]
        ax.errorbar(heads, [x.mean for x in iv], yerr=[0 if x.n < 2 else x.half_width for x in iv], marker="o",
                    capsize=5, label="mean, 95 % t interval")
        for h in heads:
            vals = [run["auc_loss" if key == "auc" else "final_recall_accuracy"] for run in results["heads"][str(h)]["runs"]]
            ax.scatter(np.full(len(vals), h), vals, color="grey", s=14, zorder=3,
                       label="single seed" if h == heads[0] else None)
        ax.set(xscale="log", xlabel="number of heads h (d_model fixed)", ylabel=label, title=f"{label} vs heads\n{setting}")
        ax.set_xticks(heads, [str(h) for h in heads])
        ax.grid(alpha=0.3)
        ax.legend()
    save_figure(fig, out / "recall_vs_heads.png")


def main(argv=None) -> dict:
    args, cfg = parse(argv)
    common.use_agg_backend()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        results = json.loads((args.out / "results.json").read_text())
        write_atomic(args.out / "summary.md", summary_markdown(results))
        plot(results, args.out)
        print(summary_markdown(results))
        return results
    results = {"config": {"task": task_to_dict(cfg.task), "model": dataclasses.asdict(cfg.model),
                          "train": dataclasses.asdict(cfg.train), "num_seeds": cfg.num_seeds},
               "metadata": common.run_metadata(), "heads": {}}
    print(f"recall task: {cfg.task}; d_model={cfg.model.d_model}, heads {cfg.heads}, {cfg.num_seeds} seeds; "
          f"writing to {args.out}/", flush=True)
    for h in cfg.heads:
        results["heads"][str(h)] = train_heads(h, cfg, not args.no_progress)
        write_json(args.out / "results.json", results)
    text = summary_markdown(results)
    write_atomic(args.out / "summary.md", text)
    plot(results, args.out)
    print("\n" + text)
    return results


if __name__ == "__main__":
    common.cli(main, MODULE)
