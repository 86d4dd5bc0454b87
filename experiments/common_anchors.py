"""The tables of the anchor pages (docs/results/anchor_*.md), rendered from their data.

Three published results the head studies lean on, each reproduced at CPU scale by one
study (`experiments.anchor_induction`, `anchor_mqar`, `anchor_markov`), which writes the
per-seed values as an artifact (`docs/results/data/anchor_<name>.json`, kinds
`anchor_induction`, `anchor_mqar`, `anchor_markov`). `experiments.report` renders the
marked blocks of the pages from those files with the functions here, and the studies print
their summaries with the same functions, so a page and a run's summary cannot differ.

Blocks of every kind: `paper` (the published claim beside ours, row by row), `table`
(per arm: intervals over seeds, shares of seeds with Wilson's interval) and `verdict` (one
paragraph: reproduced or not, by the rule the page states). `anchor_mqar` and `anchor_markov` also have
`reference` (the lines a model is compared with: chance and no-lookup accuracy; the strategy losses).

The published side is quoted text, kept here as constants: what each paper states and
where (figure, section); where a value was read off a figure rather than printed, the
text says so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from experiments.common_tables import DASH, interval, num, table
from jax_mha.lab import stats
from jax_mha.lab.train import train_seeds

# ----------------------------------------------------------------- shared pieces


def share(flags: Sequence[bool]) -> str:
    """'k/n [low, high]': how many are True, with Wilson's 95 % interval."""
    k, n = sum(bool(f) for f in flags), len(flags)
    if n == 0:
        return DASH
    low, high = stats.wilson_interval(k, n)
    return f"{k}/{n} [{num(low, 2)}, {num(high, 2)}]"


def t_cell(values: Sequence[float | None], digits: int) -> str:
    """'m [lo, hi]' (95 % t over seeds) of the values that exist; '–' without any."""
    return interval(stats.t_interval([v for v in values if v is not None]), digits)


def steps_cell(steps: Sequence[int | None]) -> str:
    """Median and range of the steps that exist, and how many seeds have one."""
    have = sorted(s for s in steps if s is not None)
    if not have:
        return f"never (0/{len(steps)})"
    mid = have[len(have) // 2] if len(have) % 2 else (have[len(have) // 2 - 1] + have[len(have) // 2]) / 2
    return f"{mid:g} ({have[0]}–{have[-1]}; {len(have)}/{len(steps)})"


def _arms(data: dict, key: str = "arms") -> list[tuple[int, dict]]:
    return sorted(((int(k), v) for k, v in data[key].items()), key=lambda kv: kv[0])


def _machine(data: dict) -> str:
    meta = data.get("metadata", {})
    load = meta.get("load_average")
    load_text = f", load average {load[0]:.1f} at the start" if load else ""
    return f"{meta.get('cpu', 'unknown CPU')}, {meta.get('cpu_count', '?')} cores{load_text}"


# ----------------------------------------------------------------- (a) induction heads: 1 vs 2 layers

OLSSON = "Olsson et al. 2022, Argument 1"
ELHAGE = "Elhage et al. 2021, one- and two-layer attention-only models"


def induction_has_head(data: dict, arm: dict) -> list[bool]:
    """Per seed: some head's final prefix-matching score is at or above the threshold."""
    return [x is not None and x >= data["threshold"] for x in arm["max_prefix_matching"]]


def induction_table(data: dict) -> str:
    rows = []
    for layers, arm in _arms(data):
        rows.append([layers, share(induction_has_head(data, arm)), t_cell(arm["max_prefix_matching"], 3),
                     ", ".join(f"{num(x, 2)} (L{h[0]}H{h[1]})" for x, h in zip(arm["max_prefix_matching"], arm["best_head"])),
                     t_cell(arm["final_loss"], 3), t_cell(arm["final_accuracy"], 3),
                     steps_cell(arm["formation_step"]), round(arm["wall_seconds"])])
    header = ["layers", f"seeds with an induction head (prefix matching ≥ {data['threshold']:g}) [Wilson 95 %]",
              "best head's prefix matching [95 % t]", "per seed (layer, head)", "repeated-half loss, nats [95 % t]",
              "repeated-half accuracy [95 % t]", "step of formation: median (range; seeds)", "wall s"]
    return table(header, ["r"] * 4 + ["r"] * 4, rows)


def _coincidence(arm: dict) -> list[int]:
    """Per seed with both: step where prefix matching crossed the threshold minus the
    step where the repeated half first reached half accuracy."""
    return [f - a for f, a in zip(arm["formation_step"], arm["half_accuracy_step"]) if f is not None and a is not None]


def induction_paper(data: dict) -> str:
    arms = dict(_arms(data))
    one, two = arms.get(1), arms.get(2)
    gap = _coincidence(two) if two else []
    rows = [
        ["1-layer attention-only model: no induction head",
         f"{ELHAGE}: one layer is an ensemble of bigram and skip-trigram terms; an induction head needs a "
         "second head composed with a previous-token head. Olsson et al.: no phase change in one-layer models",
         DASH if one is None else f"seeds with a head at ≥ {data['threshold']:g}: {share(induction_has_head(data, one))}; "
         f"best prefix matching {t_cell(one['max_prefix_matching'], 3)} (uniform attention: {num(data['chance'], 3)})"],
        ["2-layer attention-only model: an induction head forms",
         f"{ELHAGE}; {OLSSON}: induction heads form in every model with two or more layers",
         DASH if two is None else f"{share(induction_has_head(data, two))}; best prefix matching "
         f"{t_cell(two['max_prefix_matching'], 3)}"],
        ["it forms when the loss on repeated tokens falls (the phase change)",
         f"{OLSSON}: induction heads appear in the same short window of training as the in-context-learning "
         "score improves (shown as curves; no step numbers quoted)",
         DASH if not gap else f"formation step minus the step the repeated half reached half accuracy, per seed: "
         f"{', '.join(f'{g:+d}' for g in gap)} (evaluations every {data['train']['eval_every']} steps)"],
        ["repeated-half loss, 2 layers vs 1",
         f"{ELHAGE}: on repeated random tokens only the two-layer model predicts the repeat (shown as curves)",
         DASH if one is None or two is None else f"{t_cell(two['final_loss'], 3)} vs {t_cell(one['final_loss'], 3)} nats"],
    ]
    return table(["claim", "paper (where)", "ours (this page's run)"], ["l", "l", "l"], rows)


def induction_verdict(data: dict) -> str:
    arms = dict(_arms(data))
    if 1 not in arms or 2 not in arms:
        return "Not decided: the run has not trained both depths."
    none_in_one = not any(induction_has_head(data, arms[1]))
    all_in_two = all(induction_has_head(data, arms[2]))
    ok = none_in_one and all_in_two
    return (f"**{'Reproduced' if ok else 'Not reproduced'}** by the page's rule (no one-layer seed with a head at "
            f"prefix matching ≥ {data['threshold']:g}, every two-layer seed with one): one layer "
            f"{share(induction_has_head(data, arms[1]))}, two layers {share(induction_has_head(data, arms[2]))}. "
            f"Machine: {_machine(data)}.")


# ----------------------------------------------------------------- (b) Zoology: MQAR accuracy vs width

ZOOLOGY = "Arora et al. 2023, Figure 2; grid from the authors' iclr24_zoology_figure2/configs.py"


def mqar_solved(data: dict, arm: dict) -> list[bool]:
    return [a is not None and a >= data["solved_accuracy"] for a in arm["final_accuracy"]]


def mqar_table(data: dict) -> str:
    rows = []
    for width, arm in _arms(data, "widths"):
        rows.append([width, width // data["model"]["num_heads"], share(mqar_solved(data, arm)),
                     t_cell(arm["final_accuracy"], 3), ", ".join(num(a, 3) for a in arm["final_accuracy"]),
                     steps_cell(arm["solve_step"]), round(arm["wall_seconds"])])
    header = ["d_model", "head dim", f"seeds solved (accuracy ≥ {data['solved_accuracy']:g}) [Wilson 95 %]",
              "final recall accuracy [95 % t]", "per seed", "step reaching it: median (range; seeds)", "wall s"]
    return table(header, ["r"] * 7, rows)


def mqar_paper(data: dict) -> str:
    t, m, tr = data["task"], data["model"], data["train"]
    widths = _arms(data, "widths")
    rows = [
        ["task", "MQAR: single-token keys and values from a vocabulary of 8,192 (keys from one half, values from "
         "the other); key-value pairs first, then each key queried once at power-law-distributed gaps",
         f"MQAR of `RecallTaskConfig(key_tokens=1)`: {t['num_pairs']} pairs of single-token keys "
         f"({t['num_key_symbols']} key symbols, {t['num_values']} values), then {t['num_queries']} queries drawn "
         "with repeats, back to back (vocabulary "
         f"{4 + t['num_key_symbols'] + t['num_values']})"],
        ["sequence length / key-value pairs", "64/4, 128/8, 256/16, 512/64",
         f"{(t['num_pairs'] + t['num_queries']) * 2 + 1}/{t['num_pairs']}"],
        ["model", "2 layers of attention (1 head, dropout 0.1), no MLP (state mixer: identity), learned positions",
         f"{m['num_layers']} layers of attention ({m['num_heads']} head), no MLP (`d_ff=0`), learned positions, "
         "pre-norm"],
        ["widths", "d_model 64, 128, 256, 512", "d_model " + ", ".join(str(w) for w, _ in widths)],
        ["training", "100,000 examples × 64 epochs, batch 512 (seq ≤ 128), best of 4 learning rates in "
         "[1e-4, 1e-2]; accuracy on 3,000 test examples",
         f"{tr['num_steps']} steps × batch {tr['batch_size']} of fresh rows, one learning rate "
         f"{tr['learning_rate']:g}; accuracy on {tr['eval_size']} held-out rows"],
        ["attention's accuracy", "high at every width and sequence length of the figure (≈ 1, read off the figure, "
         "not a printed number); the gated convolutions need a width that grows with the sequence, attention does not",
         "; ".join(f"d={w}: {t_cell(a['final_accuracy'], 3)}" for w, a in widths)],
    ]
    return table(["", f"paper ({ZOOLOGY})", "ours"], ["l", "l", "l"], rows)


def mqar_reference(data: dict) -> str:
    ref = data["reference"]
    return (f"Reference lines on the same generator ({ref['rows']:,} rows): chance {num(ref['chance'], 3)}; answering "
            f"every query with the row's most common value (reading values, no key lookup) {num(ref['value_mode'], 3)}; "
            "the key lookup 1.")


def mqar_verdict(data: dict) -> str:
    widths = dict(_arms(data, "widths"))
    at_64 = widths.get(64)
    if at_64 is None:
        return "Not decided: the run has no d_model = 64, the paper's smallest width."
    ok = all(mqar_solved(data, at_64))
    below = [f"d={w}: {share(mqar_solved(data, a))}" for w, a in sorted(widths.items()) if w < 64]
    return (f"**{'Reproduced' if ok else 'Not reproduced'}** by the page's rule (every seed at d_model = 64, the "
            f"paper's smallest width, ends at recall accuracy ≥ {data['solved_accuracy']:g}): "
            f"{share(mqar_solved(data, at_64))}. Below the paper's grid (our extension, same step budget): "
            f"{'; '.join(below) if below else DASH}. Machine: {_machine(data)}.")


# ----------------------------------------------------------------- (c) Edelman et al.: ICL of Markov chains

EDELMAN = "Edelman et al. 2024"
STAGES = ("uniform", "unigram", "bigram")


def markov_staged(arm: dict) -> list[bool]:
    """Per seed: the closest strategy went uniform → unigram → bigram, in that order,
    and bigram at the end (`stages` lists each change with its step)."""
    out = []
    for stages in arm["stages"]:
        names = [s for s, _ in stages]
        firsts = [names.index(s) if s in names else None for s in STAGES]
        out.append(None not in firsts and firsts == sorted(firsts) and names[-1] == "bigram")
    return out


def markov_unigram_then_bigram(arm: dict) -> list[bool]:
    """Per seed: closest to unigram at some evaluation before it is first closest to
    bigram, and bigram at the end (the order of `markov_staged` without the uniform
    stage, which may end before the first evaluation)."""
    out = []
    for stages in arm["stages"]:
        names = [s for s, _ in stages]
        out.append("unigram" in names and "bigram" in names and names.index("unigram") < names.index("bigram")
                   and names[-1] == "bigram")
    return out


def _stage_step(arm: dict, stage: str) -> list[int | None]:
    return [next((step for s, step in stages if s == stage), None) for stages in arm["stages"]]


def markov_reference(data: dict) -> str:
    ref, t = data["reference"], data["task"]
    rows = [[f"our held-out rows (k = {t['num_states']}, T = {t['seq_len']}, {ref['rows']} rows)",
             *(num(ref[s], 4) for s in (*STAGES, "oracle"))]]
    for name, r in sorted(data.get("paper_setting", {}).items()):
        rows.append([f"the paper's code setting {name} ({r['rows']} rows, our generator)",
                     *(num(r[s], 4) for s in (*STAGES, "oracle"))])
    return table(["rows", "uniform (ln k)", "unigram strategy", "bigram strategy", "true chain (oracle)"],
                 ["l", "r", "r", "r", "r"], rows)


def markov_table(data: dict) -> str:
    rows = []
    for layers, arm in _arms(data):
        rows.append([layers, share(markov_staged(arm)), share(markov_unigram_then_bigram(arm)),
                     share([st[0][0] == "uniform" for st in arm["stages"]]), steps_cell(_stage_step(arm, "unigram")),
                     steps_cell(_stage_step(arm, "bigram")), t_cell(arm["final_loss"], 4),
                     t_cell(arm["final_kl_unigram"], 4), t_cell(arm["final_kl_bigram"], 4),
                     ", ".join(s[-1][0] for s in arm["stages"]), round(arm["wall_seconds"])])
    header = ["layers", "seeds going uniform → unigram → bigram [Wilson 95 %]",
              "seeds going unigram → bigram (read after the run) [Wilson 95 %]",
              f"seeds closest to uniform at the first evaluation (step {data['train']['eval_every']})",
              "step closest to unigram first",
              "step closest to bigram first", "final held-out loss, nats [95 % t]", "final KL(unigram ‖ model) [95 % t]",
              "final KL(bigram ‖ model) [95 % t]", "closest at the end, per seed", "wall s"]
    return table(header, ["r"] * 11, rows)


def markov_paper(data: dict) -> str:
    t, m, tr = data["task"], data["model"], data["train"]
    arms = dict(_arms(data))
    two, one = arms.get(2), arms.get(1)
    ref = data["reference"]
    rows = [
        ["task", "each sequence from its own Markov chain, transition rows ~ Dirichlet(1), first state from the "
         "stationary distribution; code default k = 2 states, T = 100",
         f"the same generator (`MarkovTaskConfig`): k = {t['num_states']}, T = {t['seq_len']}, Dirichlet"
         f"({t['concentration']:g})"],
        ["model", "2-layer attention-only transformer, 1 head per layer, width 16, dropout 0.1, relative positions "
         "(code defaults); minGPT's AdamW trainer, lr 5e-4 constant, batch 64",
         f"{'- and '.join(str(k) for k, _ in _arms(data))}-layer attention-only decoders (`d_ff=0`), "
         f"{m['num_heads']} head per layer, width "
         f"{m['d_model']}, learned absolute positions, no dropout; AdamW lr {tr['learning_rate']:g} (constant after "
         f"{tr['warmup_steps']} warmup steps), batch {tr['batch_size']}, {tr['num_steps']} steps"],
        ["stages of training (2 layers)", f"{EDELMAN}, abstract and Figure 1 (right): uniform predictions, then "
         "the in-context unigram strategy, then a rapid transition to the in-context bigram strategy",
         DASH if two is None else f"all three in that order: {share(markov_staged(two))} seeds; unigram, then "
         f"bigram: {share(markov_unigram_then_bigram(two))}; closest to unigram first at step "
         f"{steps_cell(_stage_step(two, 'unigram'))}, to bigram first at {steps_cell(_stage_step(two, 'bigram'))}"],
        ["end point (2 layers)", "near the bigram strategy (the Bayes-optimal statistical induction head); shown "
         "as curves; no number quoted", DASH if two is None else
         f"loss {t_cell(two['final_loss'], 4)} vs bigram strategy {num(ref['bigram'], 4)}, unigram "
         f"{num(ref['unigram'], 4)}, true chain {num(ref['oracle'], 4)}; KL(bigram ‖ model) "
         f"{t_cell(two['final_kl_bigram'], 4)}"],
        ["one layer (our control)", "the bigram solution needs a previous-token head under the induction head: "
         "two layers", DASH if one is None else
         f"closest at the end: {', '.join(s[-1][0] for s in one['stages'])}; loss {t_cell(one['final_loss'], 4)}"],
    ]
    return table(["", f"paper ({EDELMAN})", "ours"], ["l", "l", "l"], rows)


def markov_verdict(data: dict) -> str:
    arms = dict(_arms(data))
    if 2 not in arms:
        return "Not decided: the run has not trained the two-layer model."
    two = arms[2]
    two_ok = all(markov_staged(two))
    text = (f"**{'Reproduced' if two_ok else 'Not reproduced'}** by the page's rule (every two-layer seed's "
            f"closest strategy goes uniform → unigram → bigram and ends at bigram): {share(markov_staged(two))}.")
    late = [st[0][0] != "uniform" for st in two["stages"]]
    if not two_ok and any(late):
        text += (f" In {sum(late)} of {len(late)} seeds the model was already closer to unigram than to uniform at "
                 f"the first evaluation (step {data['train']['eval_every']}), so a uniform stage, if any, was shorter "
                 "than that. Read after the run, without the uniform stage: unigram, then bigram, ending at bigram in "
                 f"{share(markov_unigram_then_bigram(two))} seeds.")
    if 1 in arms:
        stays = [s[-1][0] != "bigram" for s in arms[1]["stages"]]
        text += f" One layer does not end closest to bigram in {share(stays)} seeds."
    return text + f" Machine: {_machine(data)}."


RENDERERS: dict[str, dict[str, Callable[[dict], str]]] = {
    "anchor_induction": {"paper": induction_paper, "table": induction_table, "verdict": induction_verdict},
    "anchor_mqar": {"reference": mqar_reference, "paper": mqar_paper, "table": mqar_table, "verdict": mqar_verdict},
    "anchor_markov": {"reference": markov_reference, "paper": markov_paper, "table": markov_table,
                      "verdict": markov_verdict},
}


def render(data: dict[str, Any], block: str) -> str:
    """The Markdown of one block of an anchor's data.

    Raises:
      ValueError: for a kind that is not an anchor's, or a block it does not have.
    """
    kind = data.get("kind")
    if kind not in RENDERERS:
        raise ValueError(f"not an anchor's data: kind {kind!r}; anchors: {sorted(RENDERERS)}")
    if block not in RENDERERS[kind]:
        raise ValueError(f"a {kind} file has no block {block!r}; it has {sorted(RENDERERS[kind])}")
    return RENDERERS[kind][block](data)


def summary(data: dict) -> str:
    """Every block of an artifact, one after another (what a study prints at the end)."""
    return "\n\n".join(render(data, block) for block in RENDERERS[data["kind"]]) + "\n"


def first_step(steps, values, threshold: float) -> int | None:
    """The first evaluation step whose value is at or above `threshold`, else None."""
    hit = np.flatnonzero(np.asarray(values) >= threshold)
    return int(steps[hit[0]]) if hit.size else None


def start(args, name: str, artifact: Callable[[dict], dict], plot: Callable[[dict, Path], None]) -> dict | None:
    """Starts an anchor's run; with `--replot`, redoes its artifact, summary and figure
    from `--out`'s results.json and returns those results (None otherwise)."""
    from experiments import common

    common.start_study()
    common.use_agg_backend()
    if not args.replot:
        return None
    results = json.loads((args.out / "results.json").read_text())
    finish(results, args, name, artifact, plot)
    return results


def begin(args, config: dict, **fields) -> dict:
    """The results record of an anchor run: `config` (what must match for a rerun to
    resume), the first session's metadata, `fields`, the arms `--out` already holds,
    and under "resumed" each later session's machine and load."""
    from experiments import common

    config = json.loads(json.dumps(config))  # tuples to lists, as read back
    saved, metadata = common.saved_results(args.out / "results.json", config, "arms"), common.run_metadata()
    results = {"config": config, "metadata": saved.get("metadata", metadata), **fields, "arms": saved.get("arms", {})}
    if saved:
        results["resumed"] = saved.get("resumed", []) + [metadata]
    return results


def train_arm(model, cfg, label: str, progress: bool):
    """All of `cfg.seeds` for one arm's model in one vmapped run (`train_seeds`), with a bar."""
    from experiments import common

    bar = common.TrainingBar(cfg.train.num_steps, label, not progress)
    try:
        return train_seeds(model, cfg.task, cfg.train, cfg.seeds, callback=bar)
    finally:
        bar.close()


def train_arms(results: dict, values: Sequence[int], train_one: Callable[[int], dict], out: Path,
               label: Callable[[int], str], plural: str) -> None:
    """Trains each arm (`values`: depths, widths) not yet in `results["arms"]`, saving
    `out`/results.json after each; Ctrl-C ends in one line naming the arms saved."""
    from experiments import common

    for value in values:
        if str(value) in results["arms"]:
            print(f"{label(value)}: already in {out}/results.json", flush=True)
            continue
        try:
            results["arms"][str(value)] = train_one(value)
        except KeyboardInterrupt:
            done = sorted(results["arms"], key=int)
            saved = f"{plural} {done} are saved in {out}/results.json" if done else f"no {plural[:-1]} had finished"
            raise common.Interrupted(saved) from None
        common.write_json(out / "results.json", results)


def finish(results: dict, args, name: str, artifact: Callable[[dict], dict],
           plot: Callable[[dict, Path], None]) -> None:
    """An anchor's artifact, summary and figure from its complete results (also
    `--replot`); with `args.artifact`, the artifact there too and the figure beside the
    page (docs/results/data/x.json: docs/results/anchor_<name>.png)."""
    from experiments.common import write_atomic, write_json

    data = artifact(results)
    text = summary(data)
    write_json(args.out / "artifact.json", data)
    write_atomic(args.out / "summary.md", text)
    plot(results, args.out / f"anchor_{name}.png")
    if args.artifact is not None:
        write_json(args.artifact, data)
        beside = args.artifact.parent.parent if args.artifact.parent.name == "data" else args.artifact.parent
        plot(results, beside / f"anchor_{name}.png")
    print("\n" + text)


def parse(argv, module: str, doc: str, name: str, presets: dict, sweep: str, sweep_help: str, seeds_per: str):
    """An anchor's command line: `(args, config)`. `sweep` is the config field the anchor
    varies (`layers`, `widths`), given as `--<sweep>`; the standard preset also writes
    its artifact to docs/results/data/anchor_<name>.json (the figure beside the page).
    A bad value ends in one argparse `error:` line (exit 2)."""
    import dataclasses

    from experiments import common

    p = common.parser(module, doc.split("\n\n")[0].replace("\n", " "))
    p.epilog = "presets:\n" + "\n".join(f"  {n:<9} {' '.join(f.__doc__.split())}" for n, f in presets.items())
    p.add_argument("--preset", choices=sorted(presets), default="standard", help="configuration (default standard)")
    p.add_argument(f"--{sweep}", type=common.positive_int, nargs="+", help=sweep_help)
    p.add_argument("--seeds", type=common.positive_int, help=f"seeds per {seeds_per}")
    p.add_argument("--steps", type=common.positive_int, help="optimizer steps (a multiple of the evaluation interval)")
    p.add_argument("--out", type=Path, help=f"output folder (default results/anchors/{name}[-<preset>])")
    p.add_argument("--artifact", type=Path, help="also write the artifact here (default for the standard preset: "
                   f"docs/results/data/anchor_{name}.json, the figure beside the page)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--replot", action="store_true", help="redo the artifact, summary and figure from --out's results.json")
    args = p.parse_args(argv)

    def build():
        cfg = presets[args.preset]()
        train = cfg.train if args.steps is None else dataclasses.replace(cfg.train, num_steps=args.steps)
        swept = getattr(args, sweep)
        return dataclasses.replace(cfg, train=train, num_seeds=args.seeds or cfg.num_seeds,
                                   **{sweep: tuple(swept) if swept else getattr(cfg, sweep)})

    cfg = common.build_or_exit(p, build)
    args.out = args.out or Path("results") / "anchors" / (name if args.preset == "standard" else f"{name}-{args.preset}")
    if args.artifact is None and args.preset == "standard":
        args.artifact = common.CHECKOUT / "docs" / "results" / "data" / f"anchor_{name}.json"
    return args, cfg
