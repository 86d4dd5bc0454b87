"""Head-count ablation on the delayed copy task (seed 004, exercise E12.2).

Trains the decoder at several head counts with d_model fixed, several seeds each (all
seeds of one head count in one vmapped program), and reports convergence speed, final
accuracy and per-head attention entropy.

    python -m experiments.head_ablation                   # quick preset, about a minute on 2 CPU cores
    python -m experiments.head_ablation --preset full     # d_model=256, 3 seeds, 8-18 min on 2 CPU cores
    python -m experiments.head_ablation --heads 1 8 --seeds 2 --steps 3000 --d-model 128 --out DIR
    python -m experiments.head_ablation --task lm --preset quick      # character LM, d_model=64, h = 1 … 16, 3 seeds, <= 15 min
    python -m experiments.head_ablation --task lm --preset standard   # d_model=128, T=128, 800 steps: the results pages'
    python -m experiments.head_ablation --task lm --preset quick --head-dim 32   # the head-size control: heads of 32
    python -m experiments.head_ablation --task lm --text FILE     # your own UTF-8 corpus
    XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
        python -m experiments.head_ablation --task lm --preset tiny --mesh data=1,sequence=4   # ring attention

With --task lm the models are character language
models of the Python Language Reference (`jax_mha.lab.text`); there is no early stopping.
After training, every model is measured on the whole test split (bits per
character; the trainer's evaluations read the dev split) and its heads are typed (`jax_mha.lab.head_types`): results.json,
summary.md (bpc and head-type counts per head count), head_types.md (every head),
head_types/h{H}_seed{S}.png, bpc_curves.png, bpc_vs_heads.png, and sample lines of
the best model (greedy and temperature 0.8, through the KV cache). Output goes to
results/head_ablation/lm-<preset>/.

Results go to --out (default results/head_ablation/<preset>/): results.json,
summary.md, learning_curves.png, accuracy_vs_heads.png, entropy_per_head.png, and one
checkpoint per trained model in checkpoints/h{H}_seed{S}.msgpack. Results and
checkpoints are written after every head count, the plots at the end; while a head count trains, its state (parameters, optimizer,
curves) is saved at every evaluation to the orbax folder checkpoints/h{H}_state/. A rerun with
the same --out and configuration skips the finished head counts and continues an
interrupted one from its last saved step (--force starts over).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from pathlib import Path

import jax
import numpy as np

from experiments import common, plotting
from experiments.common import AblationConfig, Interrupted, fmt, fmt_mean_std, save_figure, write_atomic, write_json
from jax_mha import parallel
from jax_mha.lab import analysis, distributed, head_types, stats
from jax_mha.lab.checkpoint import load_checkpoint, save_checkpoint, saved_train_step
from jax_mha.lab.data import chance_accuracy, task_from_dict, task_to_dict
from jax_mha.lab.models import Decoder, generate
from jax_mha.lab.text import ngram_baselines, validation_batches
from jax_mha.lab.train import SeedsResult, train_seeds

MODULE = "experiments.head_ablation"
RECORD_KEYS = {"heads", "head_dim", "steps_run", "wall_seconds", "tokens_per_second", "runs"}
RUN_KEYS = {"seed", "steps_to_target", "final_token_accuracy", "final_exact_accuracy", "entropy_normalized",
            "curve", "eval_curve"}
LM_RUN_KEYS = {"seed", "final_eval_bpc", "entropy_normalized", "curve", "eval_curve"}


def _mesh_spec(text: str) -> dict[str, int]:
    try:
        spec = parallel.parse_mesh_spec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def build_parser():
    p = common.parser(MODULE, "Train the delayed copy task (or, with --task lm, a character language model) at "
                              "several head counts (fixed d_model) and compare. On a 2-core CPU: --task lm --preset "
                              "quick is sized for <= 15 minutes (all five head counts, 3 seeds), --task lm --preset "
                              "standard took 32.5 minutes (docs/results/lm_heads.md).",
                      common.PRESETS, common.LM_PRESETS)
    p.add_argument("--task", choices=common.TASK_CHOICES, default="copy", help="what the models learn (default copy)")
    p.add_argument("--preset", choices=sorted(set(common.PRESETS) | set(common.LM_PRESETS)), default="quick",
                   help="base configuration (default quick; every preset's values are listed below)")
    p.add_argument("--heads", type=common.positive_int, nargs="+", help="head counts to sweep (each must divide d_model)")
    p.add_argument("--seeds", type=common.positive_int, help="seeds per head count, trained together by vmap")
    p.add_argument("--seed", type=common.nonnegative_int, help="first seed (default 0): seeds are --seed, --seed + 1, ...")
    p.add_argument("--steps", type=common.positive_int, help="maximum optimizer steps per head count (a multiple of --steps-per-call)")
    p.add_argument("--d-model", type=common.positive_int, help="model width, fixed across head counts (d_ff = 4 d_model)")
    p.add_argument("--layers", type=common.positive_int, help="number of Transformer blocks")
    p.add_argument("--head-dim", type=common.positive_int,
                   help="fix each head's size D: h heads project to h*D (default: heads share d_model, D = d_model/h)")
    p.add_argument("--length", type=common.positive_int,
                   help="L, symbols per copy: sequences have 2L+3 tokens, the model reads T = 2L+2")
    p.add_argument("--reverse", action="store_true", help="the reverse variant: the second half is reversed")
    p.add_argument("--seq-len", type=common.positive_int, help="--task lm: characters per training window T")
    p.add_argument("--text", type=Path, help="--task lm: a UTF-8 text file as corpus (default: the Python Language "
                   "Reference from pydoc_data; its last 20%% is held out: 10%% dev, then 10%% test)")
    p.add_argument("--batch-size", type=common.positive_int, help="sequences per optimizer step")
    p.add_argument("--lr", type=common.positive_float, help="peak AdamW learning rate")
    p.add_argument("--steps-per-call", type=common.positive_int, help="optimizer steps fused into one compiled call")
    p.add_argument("--eval-every", type=common.positive_int, help="steps between held-out evaluations (a multiple of --steps-per-call)")
    p.add_argument("--no-early-stop", action="store_true", help="always run --steps steps")
    p.add_argument("--out", type=Path, help="output folder (default results/head_ablation/<preset>, -reverse appended)")
    p.add_argument("--force", action="store_true", help="discard what --out holds and train every head count again")
    p.add_argument("--measure-vmap-speedup", action="store_true",
                   help="also time vmap over seeds against a Python loop over seeds (4 chunks each, largest head count)")
    p.add_argument("--mesh", type=_mesh_spec, help="run sharded on a device mesh, e.g. 'data=2,model=2' (heads split over "
                   "'model', the batch over 'data') or 'data=1,sequence=4' (the tokens of each sequence over "
                   "'sequence', ring attention: T a multiple of P², 16 for sequence=4); on CPU set "
                   "XLA_FLAGS=--xla_force_host_platform_device_count=4")
    common.add_sequence_parallel_arg(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    common.add_distributed_args(p)
    p.add_argument("--tensorboard", type=Path, metavar="DIR", help="also write every evaluation's metrics as "
                   "TensorBoard events under DIR, one run per head count and seed (needs the tensorboard extra)")
    return p


def build_config(args) -> AblationConfig:
    """The preset with command-line overrides applied (ValueError on a bad mix)."""
    base = common.preset_for(args.task, args.preset)
    heads = tuple(args.heads) if args.heads else base.heads
    analysis = base.analysis_heads if base.analysis_heads in heads else max(heads)
    task = _task(base.task, args)
    model = dataclasses.replace(base.model, vocab_size=task.vocab_size, max_len=task.seq_len, num_heads=analysis,
                                **_given(d_model=args.d_model, num_layers=args.layers, head_dim=args.head_dim))
    if args.d_model is not None:
        model = dataclasses.replace(model, d_ff=4 * args.d_model)
    train = base.train
    overrides = _given(num_steps=args.steps, batch_size=args.batch_size, learning_rate=args.lr,
                       steps_per_call=args.steps_per_call, eval_every=args.eval_every,
                       early_stop=False if args.no_early_stop else None)
    if args.steps_per_call is not None and args.eval_every is None:
        overrides["eval_every"] = max(train.eval_every // args.steps_per_call, 1) * args.steps_per_call
    train = dataclasses.replace(train, **overrides)
    # An explicit --lr is one rate for every head count; else the preset's per-h rates stand.
    rates = () if args.lr is not None else base.learning_rates
    return AblationConfig(heads=heads, num_seeds=args.seeds or base.num_seeds, task=task, model=model, train=train,
                          seed=base.seed if args.seed is None else args.seed, analysis_heads=analysis,
                          learning_rates=rates)


def _task(base, args):
    """The preset's task with the task's own options (ValueError for another task's option)."""
    if base.name == "lm":
        if args.length is not None or args.reverse:
            raise ValueError("--length and --reverse are copy-task options; with --task lm use --seq-len")
        return dataclasses.replace(base, **_given(seq_len=args.seq_len, text_file=args.text and str(args.text)))
    if args.seq_len is not None or args.text is not None:
        raise ValueError("--seq-len and --text need --task lm")
    return dataclasses.replace(base, **_given(length=args.length, reverse=args.reverse or None))


def _given(**kw):
    return {k: v for k, v in kw.items() if v is not None}


def _make_mesh(args, cfg: AblationConfig):
    try:  # before the mesh: a wrong length is refused on any number of devices
        parallel.check_sequence_divisible(cfg.task.seq_len, args.mesh.get("sequence", 1))
    except ValueError as e:
        fix = "--seq-len" if cfg.task.name == "lm" else "--length (the model reads T = 2L+2)"
        raise ValueError(f"--mesh sequence={args.mesh['sequence']} (ring attention): {e}; choose {fix} to fit") from None
    mesh = parallel.make_mesh(**args.mesh)
    for h in cfg.heads:
        parallel.check_heads_divisible(h, mesh)
        common.check_sequence_parallel(args.sequence_parallel, h, mesh)
    parallel.check_batch_divisible(cfg.train.batch_size, mesh)
    return mesh


def parse(argv):
    """`(args, config, mesh or None)`; every bad value ends in `error:` and exit 2."""
    p = build_parser()
    args = p.parse_args(argv)
    common.start_distributed(p, args)  # before the mesh: jax.devices() then lists every process's devices
    cfg = common.build_or_exit(p, lambda: build_config(args))
    mesh = common.build_or_exit(p, lambda: _make_mesh(args, cfg)) if args.mesh else None
    if args.out is None:
        args.out = common.default_out("head_ablation", args.preset, args.task, args.reverse)
        if args.head_dim is not None:  # the head-size control: its own folder beside the fixed-width sweep
            args.out = args.out.with_name(f"{args.out.name}-head-dim{args.head_dim}")
    return args, cfg, mesh


# ----------------------------------------------------------------- results


def _lm_runs(result: SeedsResult, cfg: AblationConfig) -> list[dict]:
    """Per-seed records of a language model: validation bpc (eval windows) over training."""
    ev = result.evals
    return [{
        "seed": seed, "steps_to_target": None,
        "final_eval_bpc": float(ev["bpc"][i, -1]),  # on the eval windows; final_bpc (whole split) comes after training
        "final_token_accuracy": float(ev["token_accuracy"][i, -1]),
        "final_loss": float(ev["loss"][i, -1]),
        "entropy": ev["entropy"][i, -1], "entropy_normalized": ev["entropy_normalized"][i, -1],
        "confidence": ev["confidence"][i, -1],
        "curve": {"step": result.curve["step"], "loss": result.curve["loss"][i], "accuracy": result.curve["accuracy"][i]},
        "eval_curve": {"step": ev["step"], "bpc": ev["bpc"][i], "token_accuracy": ev["token_accuracy"][i],
                       "loss": ev["loss"][i], **{k: ev[k][i] for k in INDUCTION_CURVES if k in ev}},
        # The training side of the train-validation gap: the last chunk's mean training loss.
        "final_train_bpc": float(result.curve["loss"][i, -1] / np.log(2.0)),
        "characters_seen": int(result.steps_run * cfg.train.batch_size * cfg.task.seq_len),
    } for i, seed in enumerate(result.seeds)]


# Induction evidence the LM task records at every evaluation when it tracks it (text.induction_metrics).
INDUCTION_CURVES = ("icl_score", "prefix_matching_frequent", "prefix_matching_spans", "copying_frequent",
                    "copying_spans", "second_copy_loss_frequent", "second_copy_loss_spans", "prefix_matching_chance")



def summarize_heads(h: int, result: SeedsResult, cfg: AblationConfig) -> dict:
    """The JSON record of one head count: per-seed runs plus timings."""
    ev = result.evals
    runs = _lm_runs(result, cfg) if cfg.task.name == "lm" else [{
        "seed": seed,
        "steps_to_target": result.steps_to_target[i],
        "final_token_accuracy": float(ev["token_accuracy"][i, -1]),
        "final_exact_accuracy": float(ev["exact_accuracy"][i, -1]),
        "final_loss": float(ev["loss"][i, -1]),
        "entropy": ev["entropy"][i, -1],  # (layers, H) nats
        "entropy_normalized": ev["entropy_normalized"][i, -1],  # (layers, H), / ln(visible keys)
        "confidence": ev["confidence"][i, -1],  # (layers, H) mean max weight
        "curve": {"step": result.curve["step"], "loss": result.curve["loss"][i], "accuracy": result.curve["accuracy"][i]},
        "eval_curve": {"step": ev["step"], "token_accuracy": ev["token_accuracy"][i],
                       "exact_accuracy": ev["exact_accuracy"][i], "loss": ev["loss"][i]},
    } for i, seed in enumerate(result.seeds)]
    tokens_per_program_step = cfg.train.batch_size * cfg.task.seq_len * len(result.seeds)
    return {
        "heads": h, "head_dim": cfg.model_for(h).size_per_head, "learning_rate": cfg.train_for(h).learning_rate,
        "steps_run": result.steps_run,
        "stop_reason": result.stop_reason, "resumed_from": result.resumed_from,
        "wall_seconds": result.wall_seconds, "train_seconds": result.train_seconds,
        "tokens_per_second": result.tokens_per_second,
        # One program step advances every seed by one optimizer step.
        "program_steps_per_second": (None if result.tokens_per_second is None
                                     else result.tokens_per_second / tokens_per_program_step),
        "runs": runs,
    }


# The seeds' spread is the sample std (ddof=1): the population std understated it by
# sqrt(n / (n - 1)) = 1.22x at 3 seeds.
mean_std = stats.mean_std


def _table_row(r: dict) -> str:
    runs = r["runs"]
    reached = [x["steps_to_target"] for x in runs]
    n_reached = sum(x is not None for x in reached)
    s_mean, s_std = mean_std(reached)
    steps = fmt_mean_std(s_mean, s_std, ".0f") if n_reached else "never"
    if 0 < n_reached < len(runs):
        steps += f" ({n_reached}/{len(runs)} seeds)"
    tok = mean_std([x["final_token_accuracy"] for x in runs])
    ex = mean_std([x["final_exact_accuracy"] for x in runs])
    ent = mean_std([np.mean(np.asarray(x["entropy_normalized"], float)) for x in runs])  # a null reads as NaN
    # Every number below may be null in a results.json read back (NaN is stored as null;
    # a head count trained in one chunk has no timed chunk): fmt prints "–" for it.
    return (f"| {r['heads']} | {r['head_dim']} | {steps} | {fmt_mean_std(*tok, '.4f')} | {fmt_mean_std(*ex, '.4f')} "
            f"| {fmt_mean_std(*ent, '.3f')} | {r['steps_run']} | {fmt(r['wall_seconds'], '.0f')} "
            f"| {fmt(r['tokens_per_second'], ',.0f')} |")


def summary_table(results: dict) -> str:
    """Markdown table, one row per head count (mean ± std over seeds)."""
    cfg = results["config"]
    t = cfg["task"]
    lines = [
        f"Delayed copy, L={t['length']}{' (reversed)' if t['reverse'] else ''} (the model reads T={2 * t['length'] + 2} "
        f"tokens), d_model={cfg['model']['d_model']}, {cfg['model']['num_layers']} layers, {cfg['num_seeds']} seeds "
        f"from {cfg['seed']}, batch {cfg['train']['batch_size']}, ≤ {cfg['train']['num_steps']} steps. "
        "Mean ± sample std (ddof=1) over seeds.",
        "",
        "| heads | head dim | steps to 99% token acc | final token acc | final exact-seq acc | norm. entropy (mean over heads) | steps run | wall s | tokens/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [_table_row(results["heads"][key]) for key in sorted(results["heads"], key=int)]
    if "vmap_speedup" in results:
        v = results["vmap_speedup"]
        lines += ["", f"vmap over {v['num_seeds']} seeds vs a Python loop over seeds (h={v['heads']}): "
                      f"{fmt(v['vmap_tokens_per_second'], ',.0f')} vs {fmt(v['loop_tokens_per_second'], ',.0f')} "
                      f"tokens/s, speed-up {fmt(v['speedup'], '.2f')}x."]
    return "\n".join(lines) + "\n"


def plot_results(results: dict, out: Path) -> None:
    """learning_curves.png, accuracy_vs_heads.png, entropy_per_head.png."""
    runs = {int(k): r["runs"] for k, r in results["heads"].items()}
    curves = {h: {"step": rs[0]["curve"]["step"], "loss": [r["curve"]["loss"] for r in rs],
                  "eval_step": rs[0]["eval_curve"]["step"], "exact_accuracy": [r["eval_curve"]["exact_accuracy"] for r in rs]}
              for h, rs in runs.items()}
    save_figure(plotting.learning_curves(curves), out / "learning_curves.png")
    chance = chance_accuracy(task_from_dict(results["config"]["task"]))
    summary = {h: {field: mean_std([r[field] for r in rs]) for field in
                 ("final_token_accuracy", "final_exact_accuracy", "steps_to_target")} for h, rs in runs.items()}
    save_figure(plotting.accuracy_vs_heads(summary, chance), out / "accuracy_vs_heads.png")
    entropy = {h: np.asarray([r["entropy_normalized"] for r in rs]) for h, rs in runs.items()}
    save_figure(plotting.entropy_per_head(entropy), out / "entropy_per_head.png")


def _results_problem(data) -> str | None:
    """What makes a loaded results.json unusable, or None."""
    if not isinstance(data, dict):
        return f"it holds a JSON {type(data).__name__}, not an object"
    for key, kind in (("config", dict), ("metadata", dict), ("heads", dict)):
        if not isinstance(data.get(key), kind):
            return f"its {key!r} entry is missing or not an object"
    lm = isinstance(data["config"].get("task"), dict) and data["config"]["task"].get("name") == "lm"
    run_keys = LM_RUN_KEYS if lm else RUN_KEYS
    for h, record in data["heads"].items():
        if not (isinstance(record, dict) and RECORD_KEYS <= set(record) and isinstance(record["runs"], list)
                and record["runs"] and all(isinstance(r, dict) and run_keys <= set(r) for r in record["runs"])):
            return f"the record of h={h} is incomplete"
    return None


def start_results(path: Path, cfg: AblationConfig, force: bool) -> dict:
    """The finished part of an earlier run with the same configuration, or a fresh
    record. Exits with one line if the file is damaged or of another configuration."""
    fresh = {"config": cfg.fingerprint(), "metadata": common.run_metadata(), "heads": {}}
    if force and common.is_writer():
        for stale in path.parent.glob("checkpoints/h*_state"):
            shutil.rmtree(stale)
        (path.parent / "metrics.jsonl").unlink(missing_ok=True)  # the evaluations of the run thrown away
    if force or not path.exists():
        return fresh
    old = common.read_results(path, _results_problem)
    if old["config"] != fresh["config"]:
        differ = sorted(k for k in fresh["config"] if old["config"].get(k) != fresh["config"][k])
        raise SystemExit(f"error: {path} holds results of a different configuration (differs in {differ}); "
                         "use another --out, or --force to overwrite")
    return old


# ----------------------------------------------------------------- training


def train_head_count(h: int, cfg: AblationConfig, args, mesh, status: dict) -> dict:
    """Trains (or resumes) every seed of one head count, saves one checkpoint per
    seed, and returns its results record; `status` says which training state folder
    holds the run until the record is saved."""
    model = cfg.model_for(h)
    state_dir = args.out / "checkpoints" / f"h{h}_state"
    if saved_train_step(state_dir) is not None:
        print(f"h={h}: resuming from the training state saved in {state_dir}", flush=True)
    log = common.MetricsLog(args.out / "metrics.jsonl", cfg.seeds, {"heads": h}, getattr(args, "tensorboard", None))
    bar = common.TrainingBar(cfg.train.num_steps, f"h={h:>2}", args.no_progress, log=log)
    status.update(heads=h, state_dir=state_dir)
    try:
        result = train_seeds(model, cfg.task, cfg.train_for(h), cfg.seeds, mesh=mesh, callback=bar,
                             state_dir=state_dir, sequence_parallel_kind=getattr(args, "sequence_parallel", "ring"))
    except ValueError as e:  # a saved state of another run, or damaged
        raise SystemExit(f"error: {e}; or rerun with --force") from None
    finally:
        bar.close()
    for i, seed in enumerate(result.seeds if common.is_writer() else ()):
        params = jax.tree.map(lambda x: x[i], result.state.params)
        save_checkpoint(args.out / "checkpoints" / f"h{h}_seed{seed}.msgpack", params, model,
                        {"task": task_to_dict(cfg.task), "heads": h, "seed": seed, "steps_run": result.steps_run})
    return summarize_heads(h, result, cfg)


def measure_vmap_speedup(cfg: AblationConfig, heads: int) -> dict:
    """Training throughput of all seeds in one vmapped program vs a loop over seeds."""
    train = dataclasses.replace(cfg.train, num_steps=4 * cfg.train.steps_per_call, early_stop=False,
                                eval_every=4 * cfg.train.steps_per_call)
    model = cfg.model_for(heads)
    vm = train_seeds(model, cfg.task, train, cfg.seeds, use_vmap=True)
    loop = train_seeds(model, cfg.task, train, cfg.seeds, use_vmap=False)
    return {"heads": heads, "num_seeds": cfg.num_seeds, "timed_steps": 3 * train.steps_per_call,
            "vmap_tokens_per_second": vm.tokens_per_second, "loop_tokens_per_second": loop.tokens_per_second,
            "speedup": vm.tokens_per_second / loop.tokens_per_second}


def describe_saved(results: dict, path: Path, status: dict) -> str:
    """The Ctrl-C line's account of what is on disk (the training state folder itself
    says which step it holds: a save can land just before the interrupt)."""
    done = sorted(map(int, results["heads"]))
    finished = (f"head count {done[0]} is" if len(done) == 1 else f"head counts {', '.join(map(str, done))} are")
    parts = [f"{finished} finished in {path}" if done else "no head count finished"]
    step = None if status.get("heads") is None else saved_train_step(status["state_dir"])
    if step is not None:
        parts.append(f"h={status['heads']} is saved at step {step}")
    return "; ".join(parts)


def main(argv=None) -> dict:
    common.start_study()
    args, cfg, mesh = parse(argv)
    common.use_agg_backend()
    out: Path = args.out
    results_path = out / "results.json"
    results = start_results(results_path, cfg, args.force)
    distributed.barrier("head_ablation: results read")  # --force's deletions done before any process resumes
    print(f"{cfg.task.name} task: {common.describe_preset(cfg)}; writing to {out}/", flush=True)

    lm = cfg.task.name == "lm"

    def save():
        write_json(results_path, results)
        write_atomic(out / "summary.md", lm_summary_table(results) if lm else summary_table(results))

    status: dict = {}
    todo = [h for h in cfg.heads if str(h) not in results["heads"]]
    for h in sorted(set(cfg.heads) - set(todo)):
        print(f"h={h}: already in {results_path}, skipped (--force retrains)")
    try:
        for h in todo:
            results["heads"][str(h)] = train_head_count(h, cfg, args, mesh, status)
            save()
            if common.is_writer():
                shutil.rmtree(status["state_dir"], ignore_errors=True)
                # all it held is in results.json and the checkpoints now
            status.update(heads=None)
        if args.measure_vmap_speedup:
            results["vmap_speedup"] = measure_vmap_speedup(cfg, max(cfg.heads))
            save()
        if lm and results["heads"] and common.is_writer():  # analyses on one device: process 0 alone
            finish_lm(results, cfg, out, save)
    except KeyboardInterrupt:
        raise Interrupted(describe_saved(results, results_path, status)) from None
    if lm:
        return results
    if results["heads"]:
        plot_results(results, out)  # once, at the end (a rerun redraws them from results.json)
    print("\n" + summary_table(results))
    print(f"wrote {results_path}, summary.md and plots to {out}/")
    return results


# ----------------------------------------------------------------- the language model (--task lm)

SAMPLE_PROMPTS = 3  # dev sentences the best model continues
SAMPLE_TEMPERATURE = 0.8  # below 1: fewer misspellings than sampling the raw distribution, still varied
HEAD_TYPE_SEQUENCES = 32  # test windows and repeated-random-token rows the head scores average over


def _models(results: dict, out: Path):
    """`(h, run record, params, ModelConfig)` of every trained model, from its checkpoint."""
    for key in sorted(results["heads"], key=int):
        for run in results["heads"][key]["runs"]:
            params, config, _ = load_checkpoint(out / "checkpoints" / f"h{key}_seed{run['seed']}.msgpack")
            yield int(key), run, params, config


def measure_lm_models(results: dict, cfg: AblationConfig, out: Path) -> None:
    """Fills every run with `final_bpc` (the whole test split), its head scores,
    types and counts, and draws head_types/h{H}_seed{S}.png; skips runs already done."""
    task = cfg.task
    val = validation_batches(task.corpus.test, task, 64)  # the reported number: test, read once
    text = task.windows("test", HEAD_TYPE_SEQUENCES)["inputs"]
    for h, run, params, config in _models(results, out):
        if "head_types" in run:
            continue
        model = Decoder(config)
        run["final_bpc"] = analysis.split_bpc(params, model, val)
        scores = analysis.model_head_scores(params, model, text, key=jax.random.key(common.ANALYSIS_EVAL_SEED),
                                            num_sequences=HEAD_TYPE_SEQUENCES)
        labels = head_types.classify_heads(scores)
        run["head_types"] = head_types.head_type_table(scores, labels)
        run["head_type_counts"] = head_types.count_head_types(labels)
        fields = ("previous_token", "induction", "first_token", "normalized_entropy")
        save_figure(plotting.head_type_heatmap(
            {f: np.asarray(getattr(scores, f)) for f in fields}, labels,
            suptitle=(f"Head types, {h}-head character LM (seed {run['seed']}, test bpc {run['final_bpc']:.3f})\n"
                      f"previous-token / first-token / entropy on test text, induction on repeated random "
                      f"characters; threshold {head_types.INDUCTION_THRESHOLD}")),
            out / "head_types" / f"h{h}_seed{run['seed']}.png")


def lm_samples(results: dict, cfg: AblationConfig, out: Path) -> dict:
    """Greedy and temperature continuations of dev sentences by the model of
    lowest test bpc, through the KV cache (`jax_mha.lab.models.generate`)."""
    best = min(((run["final_bpc"], h, run["seed"]) for h, r in results["heads"].items() for run in r["runs"]))
    params, config, _ = load_checkpoint(out / "checkpoints" / f"h{best[1]}_seed{best[2]}.msgpack")
    corpus, t = cfg.task.corpus, cfg.task.seq_len
    prompt_len = max(1, t // 4)
    prompts = common.sentence_windows(cfg.task, prompt_len, SAMPLE_PROMPTS)  # (P, prompt_len)
    model, lines = Decoder(config), []
    for name, temperature in (("greedy", 0.0), (f"temperature {SAMPLE_TEMPERATURE}", SAMPLE_TEMPERATURE)):
        tokens = generate(params, model, prompts, t - prompt_len, temperature=temperature,
                          key=jax.random.key(common.ANALYSIS_EVAL_SEED))
        for row in np.asarray(tokens):
            lines.append({"sampling": name, "prompt": corpus.decode(row[:prompt_len]),
                          "continuation": corpus.decode(row[prompt_len:])})
    return {"model": {"heads": int(best[1]), "seed": int(best[2]), "final_bpc": best[0]}, "lines": lines}


def held_out_name(task: dict) -> str:
    """The split `final_bpc` was measured on: "test", or "validation" in results made
    before the three-way split (their task has no `test_fraction`)."""
    return "test" if "test_fraction" in task else "validation"


def lm_comparisons(results: dict) -> dict[str, stats.Comparison]:
    """The family of seed-paired comparisons a summary reports: every h against the
    fewest heads, and every pair of neighbours, Holm-adjusted together."""
    bpc = {int(k): [run.get("final_bpc") for run in r["runs"]] for k, r in results["heads"].items()}
    heads = sorted(bpc)
    pairs = [(h, heads[0]) for h in heads[1:]] + [(b, a) for a, b in zip(heads[1:], heads[2:])]
    return stats.paired_comparisons({f"h={a} − h={b}": (bpc[a], bpc[b]) for a, b in pairs})


def lm_summary_table(results: dict) -> str:
    """Markdown: held-out bpc (95 % t interval), train-held-out gap, characters seen,
    head-type counts per head count, beside the n-gram baselines of the same split, and
    the seed-paired comparisons with Holm-adjusted p values."""
    cfg, m = results["config"], results["config"]["model"]
    split = held_out_name(cfg["task"])
    width = f"head size {m['head_dim']} (attention h x {m['head_dim']})" if m.get("head_dim") else "the width shared by the heads"
    lines = [f"Character LM, T={cfg['task']['seq_len']}, d_model={m['d_model']}, {width}, {m['num_layers']} layers, "
             f"{cfg['num_seeds']} seeds from {cfg['seed']}, batch {cfg['train']['batch_size']}, "
             f"{cfg['train']['num_steps']} steps. Mean ± sample std (ddof=1) over seeds [95 % t interval]; bpc on "
             f"the whole {split} split; gap = {split} bpc minus the last 50 steps' training bpc.", ""]
    if "ngram_bpc" in results:
        lines += [f"Interpolated (Witten-Bell) n-gram baselines fitted on this training split, scored on its {split} "
                  "split: " + ", ".join(f"{n}-gram {b:.3f}" for n, b in sorted(results["ngram_bpc"].items())) + " bpc.", ""]
    lines += [f"| heads | head dim | {split} bpc | gap | characters/seed | induction heads | previous-token heads "
              "| first-token heads | wall s | tokens/s |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key in sorted(results["heads"], key=int):
        r = results["heads"][key]
        bpc = stats.t_interval([run.get("final_bpc") for run in r["runs"]])
        gap = stats.mean_std([run["final_bpc"] - run["final_train_bpc"] for run in r["runs"]
                              if run.get("final_bpc") is not None and run.get("final_train_bpc") is not None])
        chars = r["runs"][0].get("characters_seen")
        counts = lambda t: "–" if "head_type_counts" not in r["runs"][0] else (
            fmt_mean_std(*mean_std([run["head_type_counts"][t] for run in r["runs"]]), ".1f"))
        interval = "" if bpc.n < 2 else f" [{bpc.low:.3f}, {bpc.high:.3f}]"  # one seed: no spread, no interval
        lines.append(f"| {key} | {r['head_dim']} | {fmt_mean_std(bpc.mean, bpc.std, '.4f')}{interval} | "
                     f"{fmt(gap[0], '+.3f')} | {fmt(chars, ',')} | {counts('induction')} | "
                     f"{counts('previous_token')} | {counts('first_token')} | {fmt(r['wall_seconds'], '.0f')} | "
                     f"{fmt(r['tokens_per_second'], ',.0f')} |")
    if len(results["heads"]) > 1 and all("final_bpc" in run for r in results["heads"].values() for run in r["runs"]):
        family = lm_comparisons(results)
        lines += ["", f"Seed-paired differences in {split} bpc (a seed reads the same batches at every h), mean "
                  f"[95 % t interval], paired t test p, and p Holm-adjusted over these {len(family)} comparisons:", ""]
        lines += [f"- {name}: {c.format(4)}" for name, c in family.items()]
    for line in results.get("samples", {}).get("lines", []):
        shown = lambda text: text.replace("\n", "↵")
        lines.append(f"\n{line['sampling']}: `{shown(line['prompt'])}` → `{shown(line['continuation'])}`")
    return "\n".join(lines) + "\n"


def head_type_markdown(results: dict) -> str:
    """Markdown: every head of every model, its type and scores."""
    lines = ["| heads | seed | layer | head | type | previous-token | induction | first-token | norm. entropy |",
             "|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for key in sorted(results["heads"], key=int):
        for run in results["heads"][key]["runs"]:
            for row in run.get("head_types", []):
                lines.append(f"| {key} | {run['seed']} | {row['layer']} | {row['head']} | {row['type']} | "
                             f"{row['previous_token']:.3f} | {row['induction']:.3f} | {row['first_token']:.3f} | "
                             f"{row['normalized_entropy']:.3f} |")
    return "\n".join(lines) + "\n"


def induction_records(results: dict) -> list[dict]:
    """Per model with induction tracking, its evidence at the last evaluation: the best
    head on each probe, uniform attention's score, the copying effects and the ICL score."""
    rows = []
    for key in sorted(results["heads"], key=int):
        for run in results["heads"][key]["runs"]:
            ev = run["eval_curve"]
            if "icl_score" not in ev:
                continue
            spans, freq = np.asarray(ev["prefix_matching_spans"][-1]), np.asarray(ev["prefix_matching_frequent"][-1])
            layer, head = np.unravel_index(int(spans.argmax()), spans.shape)
            rows.append({"heads": int(key), "seed": run["seed"], "best_head_spans": [int(layer), int(head)],
                         "prefix_matching_spans": float(spans.max()), "prefix_matching_frequent": float(freq.max()),
                         "chance": float(np.asarray(ev["prefix_matching_chance"])[-1]),
                         "copying_spans": float(ev["copying_spans"][-1]),
                         "copying_frequent": float(ev["copying_frequent"][-1]), "icl_score": float(ev["icl_score"][-1])})
    return rows


def induction_markdown(results: dict) -> str:
    """Markdown: at the last evaluation, every model's best prefix-matching head on each
    probe against uniform attention's score, the copying effect and the ICL score
    (the table `experiments.report` renders from the artifact, with its definitions)."""
    from experiments import common_tables

    data = {"seq_len": results["config"]["task"]["seq_len"], "induction": induction_records(results)}
    return common_tables.induction_definitions(data["seq_len"]) + "\n\n" + common_tables.lm_sweep_induction(data) + "\n"


def plot_lm_results(results: dict, out: Path) -> None:
    """bpc_curves.png and bpc_vs_heads.png."""
    c, m = results["config"], results["config"]["model"]
    fixed = f"head size {m['head_dim']} fixed" if m.get("head_dim") else "d_model fixed"
    width = f"d_model={m['d_model']}" + (f", head size {m['head_dim']}" if m.get("head_dim") else "")
    machine = (f"char LM, {width}, {m['num_layers']} layers, T={c['task']['seq_len']}, "
               f"{c['num_seeds']} seeds, {c['train']['num_steps']} steps; {results['metadata']['cpu']}, "
               f"{results['metadata']['cpu_count']} cores")
    curves = {int(k): {"step": r["runs"][0]["eval_curve"]["step"], "head_dim": r["head_dim"],
                       "bpc": [run["eval_curve"]["bpc"] for run in r["runs"]]} for k, r in results["heads"].items()}
    save_figure(plotting.bpc_curves(curves, title=f"Validation bpc during training ({len(curves)} head counts)\n"
                                                  f"{results['config']['train']['eval_size']} dev windows; {machine}"),
                out / "bpc_curves.png")
    final = {int(k): [np.nan if run["final_bpc"] is None else run["final_bpc"] for run in r["runs"]]
             for k, r in results["heads"].items()}
    split = held_out_name(c["task"])
    save_figure(plotting.bpc_vs_heads(final, title=f"Final {split} bpc (whole split) vs heads\n{machine}",
                                      fixed=fixed, split=split),
                out / "bpc_vs_heads.png")
    first = next(iter(results["heads"].values()))["runs"][0]["eval_curve"]
    if "icl_score" in first:
        save_figure(plotting.induction_curves(
            {int(k): {"characters": np.asarray(r["runs"][0]["eval_curve"]["step"]) * c["train"]["batch_size"]
                      * c["task"]["seq_len"], **{f: [run["eval_curve"][f] for run in r["runs"]] for f in INDUCTION_CURVES}}
             for k, r in results["heads"].items()},
            title=f"Induction evidence during training\n{machine}"), out / "induction_curves.png")


def lm_artifact(results: dict) -> dict:
    """The per-seed values a results page is rendered from (`experiments.report`, kind
    "lm_sweep"): small, no curves."""
    meta = results["metadata"]
    heads = {}
    for key, r in results["heads"].items():
        runs = r["runs"]
        gap = lambda run: (None if run.get("final_bpc") is None or run.get("final_train_bpc") is None
                           else run["final_bpc"] - run["final_train_bpc"])
        heads[key] = {"head_dim": r["head_dim"], "seeds": [run["seed"] for run in runs],
                      "final_bpc": [run.get("final_bpc") for run in runs], "gap": [gap(run) for run in runs],
                      "characters_per_seed": runs[0].get("characters_seen"), "wall_seconds": r["wall_seconds"],
                      "tokens_per_second": r["tokens_per_second"],
                      "head_type_counts": [run.get("head_type_counts") for run in runs]}
    return {"kind": "lm_sweep", "split": held_out_name(results["config"]["task"]), "task": results["config"]["task"],
            "command": " ".join(["python -m", MODULE, *meta.get("argv", [])[1:]]), "machine": meta.get("cpu"),
            "commit": meta.get("commit"), "dirty": meta.get("dirty"), "heads": heads,
            "learning_rates": {key: r.get("learning_rate") for key, r in results["heads"].items()},
            "seq_len": results["config"]["task"]["seq_len"], "induction": induction_records(results)}


def finish_lm(results: dict, cfg: AblationConfig, out: Path, save) -> None:
    """After training: bpc on the whole split, head types, samples, tables, plots, and
    artifact.json (what docs/results/data/ takes, `experiments.report`)."""
    measure_lm_models(results, cfg, out)
    results["ngram_bpc"] = ngram_baselines(cfg.task.corpus, split="test")  # the lines to pass, on the split reported
    results["samples"] = lm_samples(results, cfg, out)
    save()
    write_json(out / "artifact.json", lm_artifact(results))
    write_atomic(out / "head_types.md", head_type_markdown(results))
    if any("icl_score" in run["eval_curve"] for r in results["heads"].values() for run in r["runs"]):
        write_atomic(out / "induction.md", induction_markdown(results))
    plot_lm_results(results, out)
    print("\n" + lm_summary_table(results))
    print(f"wrote {out}/results.json, artifact.json, summary.md, head_types.md, bpc_curves.png, bpc_vs_heads.png, "
          "head_types/*.png")


if __name__ == "__main__":
    common.cli(main, MODULE)
