"""A task where one head is not enough: multi-query associative recall.

The copy task is solved by every head count (one fixed offset, which one head with
learned positions expresses exactly): a null by construction. Here the keys are two
tokens long (`jax_mha.lab.data.RecallTaskConfig`, after Arora et al. 2023,
"Zoology"), so a small decoder must gather both key tokens by position and then
match them by content. Queries draw keys with repeats, so elimination ("a value of
a pair not yet asked") is no shortcut: it scores below answering the row's most common
value, the best answer without key lookup (`reference_lines`). Every head count trains
the same fixed step budget, d_model fixed (small: 16-64), several seeds in one vmapped
program. The outcome per h is the share of seeds that solve the task (final held-out
recall accuracy >= 0.9) and the share that escape the no-lookup plateau (0.1 above the
best answer without key lookup), each with a Wilson interval and compared against the
fewest heads by Fisher's exact test (outcomes are bimodal); beside it the area under the held-out
loss curve (the mean held-out loss over the evaluations, which rewards learning
early) and the final recall accuracy, with 95 % t intervals over seeds, and
seed-paired differences against the fewest heads with paired t tests, Holm-adjusted
over the family (a seed draws the same batches at every h).

    python -m experiments.associative_recall                   # quick: h = 1 2 4 8, 3 seeds
    python -m experiments.associative_recall --preset standard # h = 1 2 4 8, 10 seeds, each h at its dev rate
    python -m experiments.associative_recall --preset powered --lr 1e-2  # d_model 64, 10 seeds, one rate for all h
    python -m experiments.associative_recall --preset tiny     # seconds, a smoke test
    python -m experiments.associative_recall --heads 1 4 --seeds 5 --steps 2000 --d-model 32

Output (--out, default results/associative_recall/<preset>/): results.json,
artifact.json (the per-seed values `experiments.report` renders the page from),
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
from jax_mha.lab.models import ModelConfig, model_to_dict
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
    # A seed solves the task at this final accuracy: above every reference line a
    # shortcut reaches (`reference_lines`; measured in docs/results/associative_recall.md),
    # short of perfect.
    solved_accuracy: float = 0.9
    seed: int = 0  # seeds are seed, seed + 1, ...: the learning-rate grid uses others than the reported runs
    # (heads, peak lr) pairs overriding train.learning_rate: each h at its own best rate
    # (chosen on the dev evaluation set by `--eval-on dev` runs; docs/results/associative_recall.md)
    learning_rates: tuple[tuple[int, float], ...] = ()

    @property
    def seeds(self) -> list[int]:
        return list(range(self.seed, self.seed + self.num_seeds))

    def train_for(self, heads: int) -> TrainConfig:
        """`train`, with this head count's learning rate if `learning_rates` names one."""
        rate = dict(self.learning_rates).get(heads)
        return self.train if rate is None else dataclasses.replace(self.train, learning_rate=rate)


# The evaluation sets: the trainer's held-out rows are drawn from this key. "dev" (every
# choice: the learning rate) and "test" (what a page reports) are disjoint draws, and
# both are apart from every training seed's batches.
EVAL_SEEDS = {"test": TrainConfig.eval_seed, "dev": TrainConfig.eval_seed - 1}


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


# The standard preset's peak learning rate per head count: the best area under the dev
# loss curve in the grid of docs/results/data/recall_lr_grid.json (seeds 100 and 101,
# the dev evaluation set; tests/studies/test_report.py checks they agree).
STANDARD_RATES: tuple[tuple[int, float], ...] = ((1, 1e-2), (2, 3e-3), (4, 1e-2), (8, 1e-2))


def standard() -> RecallStudyConfig:
    """The quick preset's models with 10 seeds per h, so that the share of seeds that
    solve the task is measured, each h at its own rate (`STANDARD_RATES`, chosen on the
    dev set), reported on the test set (the results page's preset)."""
    return dataclasses.replace(_preset(32, 1200, 50, (1, 2, 4, 8), 10), learning_rates=STANDARD_RATES)


def powered() -> RecallStudyConfig:
    """Every h at one rate for all (3e-3 unless `--lr`; the page runs 3e-3 and 1e-2, so
    rate and head count are not confounded), d_model 64 (the width at which the MQAR
    anchor's one head solved single-token-key recall in 5 of 5 seeds), 10 seeds per h."""
    return _preset(64, 1200, 50, (1, 2, 4, 8), 10)


def tiny() -> RecallStudyConfig:
    """A smoke test in seconds: 3 pairs, d_model=8, one layer, 20 steps."""
    task = RecallTaskConfig(num_pairs=3, num_queries=3, num_key_symbols=3, num_values=4)
    return _preset(8, 20, 10, (1, 2), 2, task=task, layers=1, batch=8)


PRESETS: dict[str, Callable[[], RecallStudyConfig]] = {"quick": quick, "standard": standard, "powered": powered,
                                                       "tiny": tiny}


def build_parser():
    p = common.parser(MODULE, "Head counts on multi-query associative recall with two-token keys (fixed d_model, "
                              "fixed step budget): the share of seeds that solve it, area under the held-out loss "
                              "curve and final recall accuracy.")
    p.add_argument("--preset", choices=sorted(PRESETS), default="quick", help="base configuration (default quick)")
    p.add_argument("--heads", type=common.positive_int, nargs="+", help="head counts (each must divide d_model)")
    p.add_argument("--seeds", type=common.positive_int, help="seeds per head count")
    p.add_argument("--steps", type=common.positive_int, help="optimizer steps (a multiple of the evaluation interval)")
    p.add_argument("--d-model", type=common.positive_int, help="model width (d_ff = 4 d_model)")
    p.add_argument("--lr", type=common.positive_float,
                   help="peak AdamW learning rate for every h (default: the preset's rate for each h)")
    p.add_argument("--seed", type=common.nonnegative_int, help="first seed (default 0)")
    p.add_argument("--eval-on", choices=sorted(EVAL_SEEDS), default="test",
                   help="the held-out rows evaluated: dev for choices such as the learning rate, test (default) "
                        "for what is reported")
    p.add_argument("--out", type=Path,
                   help="output folder (default results/associative_recall/<preset>, -lr<LR> appended with --lr)")
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
    rates = cfg.learning_rates
    if args.lr is not None:  # one rate for every h
        train, rates = dataclasses.replace(train, learning_rate=args.lr), ()
    train = dataclasses.replace(train, eval_seed=EVAL_SEEDS[args.eval_on])
    heads = tuple(args.heads) if args.heads else cfg.heads
    for h in heads:
        if model.d_model % h:
            raise ValueError(f"d_model={model.d_model} is not divisible by num_heads={h}")
    return dataclasses.replace(cfg, heads=heads, model=model, train=train, num_seeds=args.seeds or cfg.num_seeds,
                               seed=cfg.seed if args.seed is None else args.seed, learning_rates=rates)


def parse(argv):
    p = build_parser()
    args = p.parse_args(argv)
    cfg = common.build_or_exit(p, lambda: build_config(args))
    args.out = args.out or Path("results") / "associative_recall" / (
        args.preset + ("" if args.lr is None else f"-lr{args.lr:g}"))
    return args, cfg


def area_under_loss(steps: np.ndarray, loss: np.ndarray) -> float:
    """Mean held-out loss over the run: the trapezoid area under loss(step) from the
    first evaluation to the last, divided by the steps between them (nats). Lower is
    better; it rewards learning early as well as ending low."""
    steps, loss = np.asarray(steps, float), np.asarray(loss, float)
    if steps.size < 2:
        return float(loss.mean())
    return float(np.sum((loss[1:] + loss[:-1]) / 2 * np.diff(steps)) / (steps[-1] - steps[0]))


def _rows(task: RecallTaskConfig, rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`(pairs (rows, N, 3), queries (rows, Q, 3))` of generated rows, columns a, b, v."""
    import jax

    batch = jax.tree.map(np.asarray, task.batch(jax.random.PRNGKey(seed), rows))
    n, q = task.num_pairs, task.num_queries
    tokens = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)
    return tokens[:, 1 : 1 + 3 * n].reshape(rows, n, 3), tokens[:, 2 + 3 * n :].reshape(rows, q, 3)


def one_token_accuracy(task: RecallTaskConfig, which: str, rows: int = 4096, seed: int = 0) -> float:
    """Expected held-out accuracy of a lookup that matches only ONE key token.

    For each query, the candidates are the context pairs whose `which` token ("a" or
    "b") equals the query's; answering with a uniformly chosen candidate's value is
    right with probability (candidates with the right value) / (candidates). A model
    on this line has learned a one-token lookup, not the two-token one the task asks.
    """
    pairs, queries = _rows(task, rows, seed)
    col = {"a": 0, "b": 1}[which]
    same = pairs[:, None, :, col] == queries[:, :, None, col]  # (B, Q, N)
    right = same & (pairs[:, None, :, 2] == queries[:, :, None, 2])
    return float((right.sum(-1) / same.sum(-1)).mean())


def context_value_accuracy(task: RecallTaskConfig, strategy: str, rows: int = 4096, seed: int = 0) -> float:
    """Expected accuracy of an answer that reads values but matches no key.

    `strategy="mode"`: the most common value among the row's N pairs. `"elimination"`:
    the most common value among the pairs whose key was not asked by an earlier query
    (the shortcut of the variant that asked every key once: there the answer is always
    among them). Ties are broken uniformly: a query scores (target among the tied
    values) / (number tied).

    Raises:
      ValueError: for an unknown strategy.
    """
    if strategy not in ("mode", "elimination"):
        raise ValueError(f"strategy must be 'mode' or 'elimination', got {strategy!r}")
    pairs, queries = _rows(task, rows, seed)
    key = lambda x: x[..., 0] * task.vocab_size + x[..., 1]
    candidate = np.ones((rows, task.num_queries, task.num_pairs), bool)  # (B, Q, N)
    if strategy == "elimination":
        asked = key(pairs)[:, None, :] == key(queries)[:, :, None]  # (B, Q, N): pair n is query j's key
        candidate[:, 1:] = ~np.logical_or.accumulate(asked, axis=1)[:, :-1]  # asked by a query before j
    values = np.eye(task.num_values)[pairs[..., 2] - task.first_value]  # (B, N, V)
    counts = np.einsum("bqn,bnv->bqv", candidate.astype(float), values)
    modes = counts == counts.max(-1, keepdims=True)
    target = queries[..., 2] - task.first_value  # (B, Q)
    return float((np.take_along_axis(modes, target[..., None], -1)[..., 0] / modes.sum(-1)).mean())


def reference_lines(task: RecallTaskConfig, rows: int = 4096) -> dict:
    """The accuracies a model must pass, on the task's own generator."""
    return {"rows": rows, "chance": 1.0 / task.num_values,
            "value_mode": context_value_accuracy(task, "mode", rows),
            "elimination": context_value_accuracy(task, "elimination", rows),
            "one_token_a": one_token_accuracy(task, "a", rows), "one_token_b": one_token_accuracy(task, "b", rows)}


def train_heads(h: int, cfg: RecallStudyConfig, progress: bool) -> dict:
    model = dataclasses.replace(cfg.model, num_heads=h)
    bar = common.TrainingBar(cfg.train.num_steps, f"h={h:>2}", not progress)
    try:
        result = train_seeds(model, cfg.task, cfg.train_for(h), cfg.seeds, callback=bar)
    finally:
        bar.close()
    ev = result.evals
    runs = [{"seed": seed,
             "eval_step": ev["step"], "eval_loss": ev["loss"][i], "recall_accuracy": ev["recall_accuracy"][i],
             "auc_loss": area_under_loss(ev["step"], ev["loss"][i]),
             "final_recall_accuracy": float(ev["recall_accuracy"][i, -1]),
             "final_query_exact": float(ev["query_exact"][i, -1]),
             "final_loss": float(ev["loss"][i, -1])} for i, seed in enumerate(result.seeds)]
    return {"heads": h, "head_dim": cfg.model.d_model // h, "learning_rate": cfg.train_for(h).learning_rate,
            "wall_seconds": result.wall_seconds,
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


def artifact(results: dict) -> dict:
    """The per-seed values the results page is rendered from (`experiments.report`, kind
    "recall"): small, no curves. A run evaluated on dev (`--eval-on dev`: the
    learning-rate grid) gives a kind "lr_grid" file instead: per (h, lr), each seed's
    area under the dev loss curve, the selection metric."""
    cfg = results["config"]
    if cfg.get("eval_on") == "dev":
        return {"kind": "lr_grid", "metric": "area under the dev loss curve (nats)", "lower_is_better": True,
                "metadata": {k: results["metadata"].get(k) for k in ("cpu", "cpu_count", "commit", "dirty", "argv")},
                "cells": [{"heads": int(h), "lr": r.get("learning_rate", cfg["train"]["learning_rate"]),
                           "seeds": [run["seed"] for run in r["runs"]], "values": [run["auc_loss"] for run in r["runs"]],
                           "final_accuracy": [run["final_recall_accuracy"] for run in r["runs"]]}
                          for h, r in results["heads"].items()]}
    return recall_data(results)


def recall_data(results: dict) -> dict:
    """The kind "recall" record of `results` (what the page's tables and the summary read)."""
    from experiments.common_tables import ESCAPE_MARGIN

    cfg = results["config"]
    task = RecallTaskConfig(**{k: v for k, v in cfg["task"].items() if k != "name"})
    reference = results.get("reference") or reference_lines(task)
    line = max(reference["value_mode"], reference["elimination"]) + ESCAPE_MARGIN
    escape = lambda run: next((int(s) for s, a in zip(run["eval_step"], run["recall_accuracy"]) if a >= line), None)
    return {"kind": "recall", "task": cfg["task"], "model": {k: cfg["model"][k] for k in ("d_model", "num_layers")},
            "train": {k: cfg["train"][k] for k in ("batch_size", "num_steps", "learning_rate", "eval_every", "eval_size")},
            "solved_accuracy": cfg.get("solved_accuracy", RecallStudyConfig.solved_accuracy),
            "reference": reference, "escape_margin": ESCAPE_MARGIN,
            "metadata": {k: results["metadata"].get(k) for k in ("cpu", "cpu_count", "commit", "dirty", "argv")},
            "eval_on": cfg.get("eval_on", "test"),
            "heads": {h: {"head_dim": r["head_dim"], "learning_rate": r.get("learning_rate", cfg["train"]["learning_rate"]),
                          "seeds": [run["seed"] for run in r["runs"]],
                          "auc_loss": [run["auc_loss"] for run in r["runs"]],
                          "final_accuracy": [run["final_recall_accuracy"] for run in r["runs"]],
                          "escape_step": [escape(run) for run in r["runs"]],
                          "wall_seconds": r["wall_seconds"]} for h, r in results["heads"].items()}}


def summary_markdown(results: dict) -> str:
    from experiments import common_tables as report

    cfg, data = results["config"], recall_data(results)
    t, m, tr = cfg["task"], cfg["model"], cfg["train"]
    sampling = "with repeats" if t.get("queries_with_replacement", False) else "each key once"
    lines = [f"Multi-query associative recall, {t['num_pairs']} pairs, {t['num_queries']} queries ({sampling}), "
             f"two-token keys from {t['num_key_symbols']} symbols, {t['num_values']} values; d_model={m['d_model']}, "
             f"{m['num_layers']} layers, batch {tr['batch_size']}, {tr['num_steps']} steps, lr " + _rates(data) + ", "
             f"held-out evaluation every {tr['eval_every']} steps on {tr['eval_size']} rows; {cfg['num_seeds']} seeds. "
             "Mean [95 % t interval, n-1 dof]; a share of seeds with Wilson's 95 % interval.", "",
             report.recall_reference(data), "", report.recall_table(data)]
    if len(results["heads"]) > 1:
        lines += ["", f"Seed-paired differences against h={min(map(int, results['heads']))}, mean [95 % t interval], "
                  "paired t test p and p Holm-adjusted over the family:", "", report.recall_comparisons(data), "",
                  "The shares that solve and that escape, against the fewest heads (Fisher's exact test, two-sided, "
                  "Holm-adjusted over the family):", "", report.recall_exact(data)]
    return "\n".join(lines) + "\n"


def _rates(data: dict) -> str:
    """'3e-3' when every h shares one peak rate, else 'h=1: 1e-3, h=2: 3e-3, ...'."""
    rates = {int(h): r["learning_rate"] for h, r in data["heads"].items()}
    if len(set(rates.values())) == 1:
        return f"{next(iter(rates.values())):g}"
    return ", ".join(f"h={h}: {lr:g}" for h, lr in sorted(rates.items()))


def plot(results: dict, out: Path) -> None:
    import matplotlib.pyplot as plt

    cfg = results["config"]
    t, m = cfg["task"], cfg["model"]
    rates = sorted({h["learning_rate"] for h in results["heads"].values()})
    setting = (f"{t['num_pairs']} pairs, two-token keys; d_model={m['d_model']}, {m['num_layers']} layers\n"
               f"{cfg['num_seeds']} seeds per h, peak lr {', '.join(f'{r:g}' for r in rates)}\n"
               f"{results.get('metadata', {}).get('cpu', 'machine not recorded')}")
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for i, key in enumerate(sorted(results["heads"], key=int)):
        for j, run in enumerate(results["heads"][key]["runs"]):
            axes[0].plot(run["eval_step"], run["eval_loss"], color=f"C{i}", alpha=0.8,
                         label=f"h={key}" if j == 0 else None)
            axes[1].plot(run["eval_step"], run["recall_accuracy"], color=f"C{i}", alpha=0.8,
                         label=f"h={key}" if j == 0 else None)
    axes[0].set(xlabel="optimizer step", ylabel="held-out loss on query values (nats)",
                title=f"Held-out loss (one line per seed)\n{setting}")
    axes[1].axhline(1.0 / t["num_values"], color="grey", ls=":", label="chance")
    if "reference" in results:  # what reading values without any key lookup reaches
        axes[1].axhline(results["reference"]["value_mode"], color="grey", ls="--", label="most common value")
    axes[1].set(xlabel="optimizer step", ylabel="held-out recall accuracy", ylim=(0, 1.02),
                title=f"Held-out recall accuracy (one line per seed)\n{setting}")
    axes[0].legend(loc="lower left")
    axes[1].legend(loc="upper left", ncol=3)  # across the top, where only a solving seed's curve runs
    for ax in axes:
        ax.grid(alpha=0.3)
    save_figure(fig, out / "recall_curves.png")

    s = summarize(results)
    heads = np.asarray(sorted(s))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
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


def _finished(path: Path, config: dict) -> dict:
    """The head counts `path` already holds from the same configuration (a rerun resumes
    where it stopped); SystemExit naming the file when it holds another configuration."""
    return common.saved_results(path, config, "heads").get("heads", {})


def main(argv=None) -> dict:
    args, cfg = parse(argv)
    common.use_agg_backend()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        results = json.loads((args.out / "results.json").read_text())
        write_json(args.out / "artifact.json", artifact(results))
        write_atomic(args.out / "summary.md", summary_markdown(results))
        plot(results, args.out)
        print(summary_markdown(results))
        return results
    config = json.loads(json.dumps({"task": task_to_dict(cfg.task), "model": model_to_dict(cfg.model),
                                    "train": dataclasses.asdict(cfg.train), "num_seeds": cfg.num_seeds,
                                    "seed": cfg.seed, "learning_rates": cfg.learning_rates,
                                    "eval_on": args.eval_on, "solved_accuracy": cfg.solved_accuracy}))
    results = {"config": config, "metadata": common.run_metadata(), "reference": reference_lines(cfg.task),
               "heads": _finished(args.out / "results.json", config)}
    print(f"recall task: {cfg.task}; d_model={cfg.model.d_model}, heads {cfg.heads}, {cfg.num_seeds} seeds, "
          f"evaluated on {args.eval_on}; writing to {args.out}/", flush=True)
    for h in cfg.heads:
        if str(h) in results["heads"]:
            continue
        results["heads"][str(h)] = train_heads(h, cfg, not args.no_progress)
        write_json(args.out / "results.json", results)
    text = summary_markdown(results)
    write_json(args.out / "artifact.json", artifact(results))  # what docs/results/data/ takes (experiments.report)
    write_atomic(args.out / "summary.md", text)
    plot(results, args.out)
    print("\n" + text)
    print(f"wrote {args.out}/results.json, artifact.json, summary.md and the figures")
    return results


if __name__ == "__main__":
    common.cli(main, MODULE)
