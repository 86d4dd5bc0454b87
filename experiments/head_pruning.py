"""Head importance and iterative head pruning (seed 004, exercise E12.3; Michel et al. 2019).

Takes a trained copy-task model (by default the `head_ablation --preset full` model
with 8 heads, seed 0), scores every head two ways — the gradient proxy
I(l,h) = mean_n |∂L_n/∂ξ(l,h)| and the "oracle" accuracy drop when the head alone is
removed — then prunes heads one at a time in each order, re-ranking the remaining
heads after every step, and reports how many can go before accuracy falls more than
1 point below the unpruned model.

    python -m experiments.head_pruning                      # the full preset's h=8 seed-0 model
    python -m experiments.head_pruning --preset quick       # the quick ablation's h=8 model
    python -m experiments.head_pruning --checkpoint results/head_ablation/full/checkpoints/h8_seed1.msgpack

The first line of output names the model and why it is the one: --checkpoint if
given; else the preset's model from results/head_ablation/<preset>/checkpoints/ (or
one this study or attention_maps trained), whose configuration is checked against the
preset (a mismatch is skipped, with a line saying so); failing those, the preset's
model is trained (resumably) and saved to <out>/checkpoints/.

Writes to --out (default results/head_pruning/<preset>/): results.json,
pruning_curves.png, importance_heatmap.png, surviving_heads_importance.png,
surviving_heads_oracle.png.

With `--task lm` it prunes a character language model of `head_ablation --task lm`
(default: 8 heads, seed 0) until validation bits per character rise more than
--max-drop (relative: 0.01 = 1 %) above the unpruned model's; the oracle then ranks
heads by the loss increase when each is removed. It reports the surviving heads'
types (`jax_mha.lab.head_types`). Writes results.json and pruning_curves.png to
results/head_pruning/lm-<preset>/.

    python -m experiments.head_pruning --task lm --preset quick
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common, plotting
from experiments.common import Interrupted, save_figure, write_json
from jax_mha.lab import analysis, head_types
from jax_mha.lab.data import EOS, chance_accuracy, task_to_dict
from jax_mha.lab.models import Decoder

MODULE = "experiments.head_pruning"
ORDER_LABELS = {"importance": "by gradient importance I(l,h)", "oracle": "by oracle (accuracy drop)"}


@dataclasses.dataclass(frozen=True)
class PruningConfig:
    """How the heads are scored and pruned."""

    eval_size: int = 512  # sequences scoring every accuracy: 1 point = ~87 of 8,704 tokens at L=16
    score_size: int = 256  # other sequences, for the rankings: heads are not chosen on the eval set
    eval_seed: int = common.ANALYSIS_EVAL_SEED  # apart from training and train's eval set (2**31 - 1)
    score_seed: int = 2**31 - 5
    max_drop: float = 0.01  # the stop rule: 1 accuracy point below the unpruned model (loss criterion: 1 % above it)
    criterion: str = "accuracy"  # "accuracy" (absolute drop) or "loss" (relative rise; the LM's bpc)
    heads_per_step: int = 1  # 16 heads: one at a time gives the whole curve
    chunk_size: int | None = 6  # gate configurations per vmap chunk: bounds memory of the 17-way ablation
    example_index: int = 0  # the eval sequence whose attention maps are drawn

    def __post_init__(self):
        if min(self.eval_size, self.score_size, self.heads_per_step) < 1 or (self.chunk_size or 1) < 1:
            raise ValueError(f"eval_size={self.eval_size}, score_size={self.score_size}, heads_per_step="
                             f"{self.heads_per_step} and chunk_size={self.chunk_size} must be >= 1")
        if not 0 <= self.max_drop <= 1:
            raise ValueError(f"max_drop must be in [0, 1] (accuracy is in [0, 1]), got {self.max_drop}")
        if self.criterion not in analysis.CRITERIA:
            raise ValueError(f"criterion must be one of {analysis.CRITERIA}, got {self.criterion!r}")
        if not 0 <= self.example_index < self.eval_size:
            raise ValueError(f"example_index={self.example_index} must be in [0, eval_size={self.eval_size})")


# The tiny preset's ranking batch has the eval batch's shape: every compiled function is reused.
PRUNING = {"quick": PruningConfig(), "full": PruningConfig(),
           "tiny": PruningConfig(eval_size=23, score_size=23, chunk_size=None)}
# The LM: validation windows score (128 x 64 = 8,192 characters at quick), training windows rank.
LM_PRUNING = {"quick": PruningConfig(eval_size=128, score_size=64, criterion="loss"),
              "standard": PruningConfig(eval_size=128, score_size=64, criterion="loss"),
              "full": PruningConfig(eval_size=128, score_size=64, criterion="loss"),
              "tiny": PruningConfig(eval_size=8, score_size=8, criterion="loss", chunk_size=None)}


def build_parser():
    p = common.parser(MODULE, "Rank the heads of a trained copy-task model (gradient importance and oracle "
                              "ablation), prune them iteratively in both orders, and report how many can go before "
                              "accuracy drops more than --max-drop below the unpruned model (--task lm: until "
                              "validation bpc rises more than --max-drop, relative).", common.PRESETS,
                      common.LM_PRESETS)
    common.add_model_args(p)
    p.add_argument("--max-drop", type=common.unit_interval,
                   help="stop rule: largest tolerated accuracy loss, absolute, in [0, 1] (default 0.01 = 1 point)")
    p.add_argument("--heads-per-step", type=common.positive_int, help="heads removed per pruning step (default 1)")
    p.add_argument("--eval-size", type=common.positive_int, help="held-out sequences every accuracy is measured on (default 512)")
    p.add_argument("--score-size", type=common.positive_int, help="other held-out sequences the rankings are computed on (default 256)")
    p.add_argument("--no-normalize", action="store_true",
                   help="skip Michel et al.'s per-layer l2 normalisation of the importance scores")
    p.add_argument("--out", type=Path, help="output folder (default results/head_pruning/<preset>)")
    return p


def parse(argv):
    """`(args, ModelSpec, PruningConfig)`; every bad value ends in `error:` and exit 2."""
    p = build_parser()
    args = p.parse_args(argv)
    spec = common.build_or_exit(p, lambda: common.model_spec(args))
    overrides = {k: getattr(args, k) for k in ("max_drop", "heads_per_step", "eval_size", "score_size")}
    cfg = common.build_or_exit(p, lambda: dataclasses.replace(
        (LM_PRUNING if args.task == "lm" else PRUNING)[args.preset], **{k: v for k, v in overrides.items() if v is not None}))
    if args.out is None:
        args.out = common.default_out("head_pruning", args.preset, args.task)
    return args, spec, cfg


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


def accuracy_breakdown(params, model: Decoder, batch: dict, gates) -> dict:
    """Teacher-forced accuracy on scored positions, split into content symbols and EOS."""
    logits = jax.jit(lambda p, x, g: model.apply({"params": p}, x, head_mask=g))(params, batch["inputs"], jnp.asarray(gates))
    correct = np.asarray(jnp.argmax(logits, -1) == batch["targets"])
    scored, eos = np.asarray(batch["scored"]), np.asarray(batch["targets"] == EOS)
    return {"accuracy": float(correct[scored].mean()), "symbol_accuracy": float(correct[scored & ~eos].mean()),
            "eos_accuracy": float(correct[scored & eos].mean())}


def score_heads(m: common.StudyModel, model: Decoder, batches: dict, cfg: PruningConfig, normalize: bool) -> dict:
    """Accuracy with all heads and with none, and every head's importance and oracle drop."""
    shape = analysis.gate_shape(model)
    accuracy = analysis.make_accuracy_fn(m.params, model, batches["eval"])
    all_off = accuracy_breakdown(m.params, model, batches["eval"], np.zeros(shape, np.float32))
    # Without attention a position sees only its own token and place: it can still put
    # EOS right, but a symbol only by luck (1/num_symbols): chance_accuracy.
    all_off["chance_symbol_accuracy"] = 1.0 / m.task.num_symbols
    score = batches["score"]
    return {
        "base_accuracy": accuracy(jnp.ones(shape)), "all_heads_off_accuracy": accuracy(jnp.zeros(shape)),
        "all_heads_off": all_off, "chance_accuracy": chance_accuracy(m.task),
        "importance": np.asarray(analysis.head_importance(m.params, model, score, normalize=normalize)),
        "importance_raw": np.asarray(analysis.head_importance(m.params, model, score, normalize=False)),
        "oracle_drop_score_batch": np.asarray(analysis.ablate_each_head(m.params, model, score, chunk_size=cfg.chunk_size)),
        "oracle_drop_eval_batch": np.asarray(
            analysis.ablate_each_head(m.params, model, batches["eval"], chunk_size=cfg.chunk_size)),
    }


def prune_both_orders(m: common.StudyModel, model: Decoder, batches: dict, cfg: PruningConfig, normalize: bool,
                      progress: bool) -> dict[str, analysis.PruningResult]:
    """Iterative pruning by importance and by oracle under `cfg.criterion`, to the end
    (for whole curves); the bar shows accuracy, or bpc under the loss criterion."""
    from tqdm.auto import tqdm

    def shown(step):
        return {"bpc": f"{step.loss * BITS:.4f}"} if cfg.criterion == "loss" else {"acc": f"{step.accuracy:.4f}"}

    records = {}
    for order in analysis.ORDERS:
        bar = tqdm(total=int(np.prod(analysis.gate_shape(model))), desc=f"pruning by {order}", unit="head",
                   disable=not progress)
        callback = lambda step, bar=bar: (bar.update(step.num_pruned - bar.n), bar.set_postfix(shown(step)))
        try:
            records[order] = analysis.prune_heads_iteratively(
                m.params, model, batches["eval"], order=order, max_drop=cfg.max_drop, criterion=cfg.criterion,
                heads_per_step=cfg.heads_per_step, score_batch=batches["score"], normalize=normalize,
                run_to_end=True, chunk_size=cfg.chunk_size, callback=callback)
        except FloatingPointError as e:
            raise SystemExit(f"error: pruning by {order}: {e}") from None
        finally:
            bar.close()
    return records


def survivors(m: common.StudyModel, model: Decoder, batches: dict, rec: analysis.PruningResult, cfg: PruningConfig):
    """The heads left when the stop rule fires, with their dominant offsets, and the
    attention maps of the example sequence under the pruned gates (upstream pruning
    changes what later layers see): `(record, maps (n, T, T), titles)`."""
    gates = rec.surviving_gates()
    batch = batches["eval"]
    w_all = np.asarray(analysis.attention_weights(m.params, model, batch["inputs"], jnp.asarray(gates)))
    offset, weight = head_offsets(w_all, np.asarray(batch["scored"]))
    heads = [(int(l), int(h)) for l, h in zip(*np.nonzero(gates))]
    record = {
        "gates": gates, "heads": heads,
        "accuracy": next(s.accuracy for s in rec.steps if s.num_pruned == rec.heads_prunable),
        "dominant_offset": {f"L{l}H{h}": int(offset[l, h]) for l, h in heads},
        "weight_at_dominant_offset": {f"L{l}H{h}": float(weight[l, h]) for l, h in heads},
    }
    maps = np.stack([w_all[l, cfg.example_index, h] for l, h in heads]) if heads else None
    titles = [f"layer {l} head {h}: offset {offset[l, h]} ({weight[l, h]:.2f})" for l, h in heads]
    return record, maps, titles


def draw(out: Path, m, model, batches, cfg, scores, records, kept: dict, normalize: bool) -> None:
    """pruning_curves.png, importance_heatmap.png and surviving_heads_<order>.png."""
    shape = analysis.gate_shape(model)
    total = shape[0] * shape[1]
    tokens = np.asarray(batches["eval"]["inputs"][cfg.example_index])
    for order, (record, maps, titles) in kept.items():
        if maps is None:
            continue
        save_figure(plotting.attention_grid(
            maps, tokens, titles=titles, ncols=min(4, len(titles)), stripe_offset=m.task.length,
            suptitle=(f"The {len(titles)} of {total} heads left after pruning by {order} (accuracy "
                      f"{record['accuracy']:.4f}, unpruned {scores['base_accuracy']:.4f})\ntitle: dominant query−key "
                      f"offset at scored queries (mean weight); dotted: key = query − L, L={m.task.length}")),
            out / f"surviving_heads_{order}.png")
    save_figure(plotting.pruning_curves(
        {ORDER_LABELS[o]: (r.fractions, r.accuracies) for o, r in records.items()},
        base_accuracy=scores["base_accuracy"], max_drop=cfg.max_drop, chance=scores["chance_accuracy"],
        heads_prunable={ORDER_LABELS[o]: r.heads_prunable for o, r in records.items()}, total_heads=total,
        title=f"Iterative head pruning, {shape[0]} layers × {shape[1]} heads, copy L={m.task.length} "
              f"({cfg.eval_size} held-out sequences)"), out / "pruning_curves.png")
    save_figure(plotting.layer_head_heatmaps(
        [(scores["importance"], "importance I(l,h) = mean$_n$ |∂L$_n$/∂ξ(l,h)|"
          + ("\n(ℓ2-normalised per layer)" if normalize else ""), "I(l,h)"),
         (100 * scores["oracle_drop_score_batch"], "oracle: accuracy drop\nwhen removed alone", "accuracy points")],
        suptitle=(f"Head scores of the full model on {cfg.score_size} ranking sequences\n"
                  "cyan frame: heads left when importance pruning stops"),
        marks=records["importance"].surviving_gates() > 0), out / "importance_heatmap.png")


def print_summary(results: dict, m: common.StudyModel, records: dict, out: Path) -> None:
    total, task = results["total_heads"], m.task
    off = results["all_heads_off"]
    print(f"\nmodel: {m.source['path']} ({describe(m)})")
    print(f"unpruned accuracy {results['base_accuracy']:.4f}; all heads off {results['all_heads_off_accuracy']:.4f} "
          f"(no-attention chance {results['chance_accuracy']:.4f}); all off: symbols {off['symbol_accuracy']:.4f} "
          f"(chance {1 / task.num_symbols:.4f}), EOS {off['eos_accuracy']:.4f}")
    print(f"Spearman(importance, oracle drop) = {results['spearman_importance_vs_oracle']:.3f}")
    print("\n| order | heads prunable (stop: > %g pt drop) | accuracy then | next step's accuracy |"
          % (100 * records["importance"].max_drop))
    print("|---|---:|---:|---:|")
    for o, r in records.items():
        after = next((s.accuracy for s in r.steps if s.num_pruned > r.heads_prunable), float("nan"))
        print(f"| {o} | {r.heads_prunable}/{total} | {results['survivors'][o]['accuracy']:.4f} | {after:.4f} |")
    for o in records:
        print(f"survivors ({o}): {results['survivors'][o]['dominant_offset']}")
    print(f"\nwrote {out}/results.json and plots ({results['analysis_seconds']:.0f} s of analysis)")


def describe(m: common.StudyModel) -> str:
    return common.describe_model(m.config, m.task)


def analyse(m: common.StudyModel, args, cfg: PruningConfig) -> dict:
    """Scores, prunes, draws and writes; returns the results record."""
    model, normalize, start = Decoder(m.config), not args.no_normalize, time.perf_counter()
    batch_fn = jax.jit(lambda key, size: m.task.batch(key, size), static_argnums=1)  # eager compiles op by op
    batches = {"eval": batch_fn(jax.random.key(cfg.eval_seed), cfg.eval_size),
               "score": batch_fn(jax.random.key(cfg.score_seed), cfg.score_size)}
    print(f"scoring every head (gradient importance, single-head ablation) on {cfg.score_size} + {cfg.eval_size} "
          "held-out sequences", flush=True)
    scores = score_heads(m, model, batches, cfg, normalize)
    records = prune_both_orders(m, model, batches, cfg, normalize, not args.no_progress)
    kept = {order: survivors(m, model, batches, rec, cfg) for order, rec in records.items()}
    analysis_seconds = time.perf_counter() - start
    draw(args.out, m, model, batches, cfg, scores, records, kept, normalize)
    results = {
        "config": dataclasses.asdict(cfg) | {"task": task_to_dict(m.task), "model": dataclasses.asdict(m.config),
                                             "normalize": normalize, "preset": args.preset},
        "metadata": common.run_metadata(), "source": m.source, "total_heads": int(np.prod(analysis.gate_shape(model))),
        **scores,
        "spearman_importance_vs_oracle": spearman(scores["importance"], scores["oracle_drop_score_batch"]),
        "heads_prunable": {o: r.heads_prunable for o, r in records.items()},
        "pruning": {o: r.to_dict() for o, r in records.items()},
        "survivors": {order: record for order, (record, _, _) in kept.items()},
        "analysis_seconds": analysis_seconds,
    }
    write_json(args.out / "results.json", results)
    print_summary(results, m, records, args.out)
    return results


# ----------------------------------------------------------------- the language model (--task lm)

BITS = 1.0 / np.log(2.0)  # nats -> bits


def lm_survivors(rec: analysis.PruningResult, labels: np.ndarray) -> dict:
    """The heads left when the bpc rule fires, with their types (measured on the full model)."""
    gates = rec.surviving_gates()
    heads = [(int(l), int(h)) for l, h in zip(*np.nonzero(gates))]
    step = next(s for s in rec.steps if s.num_pruned == rec.heads_prunable)
    return {"gates": gates, "heads": heads, "bpc": step.loss * BITS,
            "types": {f"L{l}H{h}": str(labels[l, h]) for l, h in heads},
            "type_counts": head_types.count_head_types(np.asarray([labels[l, h] for l, h in heads] or [], str))}


def lm_analyse(m: common.StudyModel, args, cfg: PruningConfig) -> dict:
    """Scores, prunes (bpc criterion), draws and writes the LM's pruning record."""
    model, normalize, start = Decoder(m.config), not args.no_normalize, time.perf_counter()
    # Reported numbers are measured on test windows; the rankings on training windows.
    batches = {"eval": m.task.windows("test", cfg.eval_size),
               "score": jax.jit(lambda key: m.task.batch(key, cfg.score_size))(jax.random.key(cfg.score_seed))}
    scores = analysis.model_head_scores(m.params, model, batches["eval"]["inputs"][:32],
                                        key=jax.random.key(common.ANALYSIS_EVAL_SEED))
    labels = head_types.classify_heads(scores)
    records = prune_both_orders(m, model, batches, cfg, normalize, not args.no_progress)
    shape = analysis.gate_shape(model)
    total, base = shape[0] * shape[1], records["importance"].steps[0].loss * BITS
    importance = np.asarray(analysis.head_importance(m.params, model, batches["score"], normalize=normalize))
    oracle = np.asarray(analysis.ablate_each_head_loss(m.params, model, batches["score"], chunk_size=cfg.chunk_size))
    induction = lm_induction_check(m, model)
    results = {
        "config": dataclasses.asdict(cfg) | {"task": task_to_dict(m.task), "model": dataclasses.asdict(m.config),
                                             "normalize": normalize, "preset": args.preset},
        "metadata": common.run_metadata(), "source": m.source, "total_heads": total, "base_bpc": base,
        "all_heads_off_bpc": records["importance"].steps[-1].loss * BITS,
        "head_types": head_types.head_type_table(scores, labels),
        "importance": importance, "oracle_loss_rise_score_batch": oracle,
        "spearman_importance_vs_oracle": spearman(importance, oracle),
        "stop_rules": STOP_RULES, "induction_check": induction,
        "heads_prunable": {o: r.heads_prunable for o, r in records.items()},
        "pruning": {o: r.to_dict() for o, r in records.items()},
        "bpc_curves": {o: [s.loss * BITS for s in r.steps] for o, r in records.items()},
        "survivors": {o: lm_survivors(r, labels) for o, r in records.items()},
        "analysis_seconds": time.perf_counter() - start,
    }
    save_figure(plotting.bpc_pruning_curves(
        {ORDER_LABELS_LM[o]: (r.fractions, np.asarray(results["bpc_curves"][o])) for o, r in records.items()},
        base_bpc=base, max_rise=cfg.max_drop, total_heads=total, all_off_bpc=results["all_heads_off_bpc"],
        heads_prunable={ORDER_LABELS_LM[o]: r.heads_prunable for o, r in records.items()},
        title=(f"Iterative head pruning of the {shape[1]}-head character LM ({shape[0]} layers)\n"
               f"{cfg.eval_size} test windows; {common.cpu_model()}"), split="test"), args.out / "pruning_curves.png")
    write_json(args.out / "results.json", results)
    write_json(args.out / "artifact.json", lm_artifact(results, m))  # docs/results/data/ (experiments.report --merge)
    print(f"\nmodel: {m.source['path']} ({describe(m)}); unpruned bpc {base:.4f}, all heads off "
          f"{results['all_heads_off_bpc']:.4f}")
    print(f"Spearman(importance, oracle bpc rise) over {total} heads: {results['spearman_importance_vs_oracle']:.3f}")
    print("stop rules: " + "; ".join(f"{task}: {rule}" for task, rule in STOP_RULES.items()))
    top, none = induction["arms"]["top"], induction["arms"]["none"]
    print(f"gating the top induction heads {top['heads']}: second-copy loss {none['second_copy_loss']:.3f} -> "
          f"{top['second_copy_loss']:.3f}, late {none['late_loss']:.3f} -> {top['late_loss']:.3f}, early "
          f"{none['early_loss']:.3f} -> {top['early_loss']:.3f} nats")
    for o, r in records.items():
        sv = results["survivors"][o]
        print(f"{o}: {r.heads_prunable}/{total} heads pruned before bpc rose > {100 * cfg.max_drop:g} % "
              f"(bpc then {sv['bpc']:.4f}); survivors: {sv['types']}")
    print(f"wrote {args.out}/results.json and pruning_curves.png ({results['analysis_seconds']:.0f} s of analysis)")
    return results


def checkpoint_seed(path: str | None) -> int | None:
    """The seed in a checkpoint's name (`h8_seed2.msgpack` -> 2), None if it has none."""
    import re

    found = re.search(r"_seed(\d+)", Path(path).name) if path else None
    return int(found[1]) if found else None


def lm_artifact(results: dict, m: common.StudyModel) -> dict:
    """One seed's row of the results page (`experiments.report`, kind "lm_pruning"):
    the values its tables show, no curves."""
    base, total = results["base_bpc"], results["total_heads"]
    steps = {o: results["pruning"][o]["steps"] for o in analysis.ORDERS}
    at = lambda o, k: next((results["bpc_curves"][o][i] for i, s in enumerate(steps[o]) if s["num_pruned"] == k), None)
    keys = ("heads", "second_copy_loss", "late_loss", "early_loss")
    arms = {name: {key: arm[key] for key in keys} for name, arm in results["induction_check"]["arms"].items()
            if name != "controls"}
    if "controls" in results["induction_check"]["arms"]:  # the matched controls' per-draw losses
        arms["controls"] = {key: [c[key] for c in results["induction_check"]["arms"]["controls"]] for key in keys}
    return {"kind": "lm_pruning", "split": "test", "task": results["config"]["task"], "machine": common.cpu_model(),
            "seeds": [{"seed": checkpoint_seed(m.source.get("path")), "checkpoint": m.source.get("path"),
                       "total_heads": total, "unpruned_bpc": base, "all_off_bpc": results["all_heads_off_bpc"],
                       "prunable": dict(results["heads_prunable"]),
                       "first_rise_pct": {o: None if at(o, 1) is None else 100 * (at(o, 1) / base - 1) for o in analysis.ORDERS},
                       "half_pruned_bpc": {o: at(o, total // 2) for o in analysis.ORDERS},
                       "spearman": results["spearman_importance_vs_oracle"], "induction": arms}]}


ORDER_LABELS_LM = {"importance": "by gradient importance I(l,h)", "oracle": "by oracle (bpc rise)"}
# The two tasks' rules are not alike, and the results say so side by side.
STOP_RULES = {"copy": "stop before held-out token accuracy falls more than 1 point (absolute) below the unpruned model",
              "lm": "stop before validation bpc rises more than 1 % (relative) above the unpruned model"}
INDUCTION_GATED = 2  # heads gated in the causal induction check (and, as control, as many of the lowest)
INDUCTION_CONTROLS = 20  # matched control draws: as many random heads of the same layers


def lm_induction_check(m: common.StudyModel, model: Decoder) -> dict:
    """Prefix matching on repeated real validation spans, then Olsson et al.'s causal
    check: gate the top heads, against the bottom ones and against random heads of the
    same layers (the matched control)."""
    from jax_mha.lab.text import PROBE_ROWS, induction_probes

    probe = jnp.asarray(induction_probes(m.task)["spans"])
    r = probe.shape[1] // 2
    weights = analysis.attention_weights(m.params, model, probe)
    scores = np.asarray(head_types.prefix_matching_score(weights, r))
    text = m.task.windows("test", PROBE_ROWS)["inputs"]
    arms = analysis.induction_gating_check(m.params, model, probe, r, text, scores, k=INDUCTION_GATED,
                                            controls=INDUCTION_CONTROLS)
    return {"prefix_matching_spans": scores, "chance": head_types.prefix_matching_chance(r), "arms": arms}


def main(argv=None) -> dict:
    common.start_study()
    args, spec, cfg = parse(argv)
    common.use_agg_backend()
    args.out.mkdir(parents=True, exist_ok=True)
    m = common.find_model(spec, args.out, args.checkpoint, args.retrain) or common.train_model(
        spec, args.out, not args.no_progress)
    try:
        return lm_analyse(m, args, cfg) if m.task.name == "lm" else analyse(m, args, cfg)
    except KeyboardInterrupt:
        raise Interrupted(f"the model is saved in {m.source['path']}; the analysis (a few minutes) was not "
                          "finished and starts again", resumes=False) from None


if __name__ == "__main__":
    common.cli(main, MODULE)
