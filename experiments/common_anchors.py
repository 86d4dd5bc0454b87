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

Registration. Each anchor's rule and configuration are committed before its run in
`experiments/preregistration/anchor_<name>.toml` (`registration_path`): the study builds
its configuration from a preset of that file only, refuses to start while the file has
uncommitted changes (one argparse `error:` line, exit 2), and its data record
`preregistration: {file, commit, preset, registered, overrides}` (`commit`: the last
commit that touched the file). Every verdict ends with `registration_note`: registered,
not the registered run (another preset, or command-line overrides), or not registered
(data written before the files existed).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from experiments.common_tables import DASH, interval, num, share, steps_cell, table
from jax_mha.lab import stats
from jax_mha.lab.train import train_seeds

# ----------------------------------------------------------------- shared pieces


def t_cell(values: Sequence[float | None], digits: int) -> str:
    """'m [lo, hi]' (95 % t over seeds) of the values that exist; '–' without any."""
    return interval(stats.t_interval([v for v in values if v is not None]), digits)


def _arms(data: dict, key: str = "arms") -> list[tuple[int, dict]]:
    return sorted(((int(k), v) for k, v in data[key].items()), key=lambda kv: kv[0])


def _machine(data: dict) -> str:
    meta = data.get("metadata", {})
    load = meta.get("load_average")
    load_text = f", load average {load[0]:.1f} at the start" if load else ""
    return f"{meta.get('cpu', 'unknown CPU')}, {meta.get('cpu_count', '?')} cores{load_text}"


REGISTRATIONS = Path(__file__).resolve().parent / "preregistration"


def registration_path(name: str) -> Path:
    """The registration file of anchor `name` (`experiments/preregistration/anchor_<name>.toml`)."""
    return REGISTRATIONS / f"anchor_{name}.toml"


def read_registration(path: Path) -> dict:
    """The parsed TOML of a registration file.

    Raises:
      OSError, ValueError (tomllib.TOMLDecodeError): unreadable or not TOML.
      KeyError: without `registered_preset`, `[rule]` or `[presets]`, or with a
        `registered_preset` that is not among the presets.
    """
    import tomllib

    reg = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    for key in ("registered_preset", "rule", "presets"):
        if key not in reg:
            raise KeyError(f"{path} has no {key!r}")
    if reg["registered_preset"] not in reg["presets"]:
        raise KeyError(f"{path}: registered_preset {reg['registered_preset']!r} is not among its presets")
    return reg


def registration_note(data: dict, name: str) -> str:
    """One sentence: which registration the data were run under, if any."""
    reg = data.get("preregistration")
    if reg is None:
        return (f"Not registered: these data record no registration (they predate "
                f"`experiments/preregistration/anchor_{name}.toml`), so the rule was not fixed in a committed file "
                "before the run.")
    where = f"`{reg['file']}` at commit `{str(reg['commit'])[:10]}`"
    if reg.get("registered"):
        return f"Registered: the rule and configuration of {where} (preset {reg['preset']}), committed before the run."
    changed = "".join(f", --{k} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                      for k, v in (reg.get("overrides") or {}).items())
    return (f"Not the registered run: preset {reg['preset']}{changed} of {where} (registered: preset "
            f"{reg.get('registered_preset', 'standard')} as committed); it shows the page's shape, not the registered "
            "test.")


def verdict_word(data: dict, ok: bool) -> str:
    """**Reproduced** / **Not reproduced**; for a run that is not the registered one, no
    verdict, only what the rule's arithmetic gives on it."""
    reg = data.get("preregistration")
    if reg is not None and not reg.get("registered"):
        return f"**No verdict** (not the registered run; the rule's arithmetic on it: {'reproduced' if ok else 'not reproduced'})"
    return f"**{'Reproduced' if ok else 'Not reproduced'}**"


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
        return f"Not decided: the run has not trained both depths. {registration_note(data, 'induction')}"
    none_in_one = not any(induction_has_head(data, arms[1]))
    all_in_two = all(induction_has_head(data, arms[2]))
    ok = none_in_one and all_in_two
    return (f"{verdict_word(data, ok)} by the page's rule (no one-layer seed with a head at "
            f"prefix matching ≥ {data['threshold']:g}, every two-layer seed with one): one layer "
            f"{share(induction_has_head(data, arms[1]))}, two layers {share(induction_has_head(data, arms[2]))}. "
            f"Machine: {_machine(data)}. {registration_note(data, 'induction')}")


def induction_curves(data: dict) -> str:
    """When, over training, the means over seeds cross the lines the page reads: the
    two-layer loss below the one-layer model's final loss and below ten times its own
    final loss, the two-layer best head's prefix matching past twice its first value
    (the rise) and past the threshold; the one-layer best head's highest value."""
    curves = {int(k): v for k, v in data.get("curves", {}).items()}
    if 1 not in curves or 2 not in curves:
        return "No curves of both depths in this run's data."
    one, two = curves[1], curves[2]
    step = lambda c, key, test: next((s for s, v in zip(c["step"], c[key]) if test(v)), None)
    after = lambda c, key, test: next((s for i, s in enumerate(c["step"]) if all(test(v) for v in c[key][i:])), None)
    below_one = after(two, "loss", lambda v: v < one["loss"][-1])
    below_tenth = after(two, "loss", lambda v: v < 10 * two["loss"][-1])
    rise = step(two, "best_prefix_matching", lambda v: v > 2 * two["best_prefix_matching"][0])
    rise_value = two["best_prefix_matching"][two["step"].index(rise)] if rise is not None else None
    passes = step(two, "best_prefix_matching", lambda v: v >= data["threshold"])
    fmt_step = lambda s: "never" if s is None else f"step {s:,}"
    return (f"Over training (means over seeds, evaluated every {data['train']['eval_every']} steps from step "
            f"{one['step'][0]}): the loss on the repeated half starts at {num(one['loss'][0], 2)} nats with one layer "
            f"and {num(two['loss'][0], 2)} with two; the two-layer loss stays below the one-layer model's final "
            f"{num(one['loss'][-1], 2)} from {fmt_step(below_one)} and below ten times its own final "
            f"({num(10 * two['loss'][-1], 2)}) from {fmt_step(below_tenth)}. The two-layer best head's prefix "
            f"matching starts at {num(two['best_prefix_matching'][0], 3)}, passes twice that at {fmt_step(rise)} "
            f"({num(rise_value, 3)}), passes {data['threshold']:g} at {fmt_step(passes)} and ends at "
            f"{num(two['best_prefix_matching'][-1], 3)}; the one-layer model's best head peaks at "
            f"{num(max(one['best_prefix_matching_max']), 3)} (the highest of any seed at any evaluation).")


# ----------------------------------------------------------------- (b) Zoology: MQAR accuracy vs width

ZOOLOGY = "Arora et al. 2023, Figure 2; grid from the authors' iclr24_zoology_figure2/configs.py"
MIXER_NAMES = {"attention": "attention", "gated_conv": "gated conv"}


def mqar_solved(data: dict, arm: dict) -> list[bool]:
    """Per seed of one cell (or, in data before the arms, one width): final held-out
    recall accuracy at or above the rule's threshold."""
    return [a is not None and a >= data["solved_accuracy"] for a in arm["final_accuracy"]]


# Data written before the registration (kind anchor_mqar without "cells"): attention only,
# one length, per width under "widths". Rendered as they were, with the verdict saying
# they are not registered.


def _mqar_table_v1(data: dict) -> str:
    rows = []
    for width, arm in _arms(data, "widths"):
        rows.append([width, width // data["model"]["num_heads"], share(mqar_solved(data, arm)),
                     t_cell(arm["final_accuracy"], 3), ", ".join(num(a, 3) for a in arm["final_accuracy"]),
                     steps_cell(arm["solve_step"]), round(arm["wall_seconds"])])
    header = ["d_model", "head dim", f"seeds solved (accuracy ≥ {data['solved_accuracy']:g}) [Wilson 95 %]",
              "final recall accuracy [95 % t]", "per seed", "step reaching it: median (range; seeds)", "wall s"]
    return table(header, ["r"] * 7, rows)


def _mqar_paper_v1(data: dict) -> str:
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


def _mqar_reference_v1(data: dict) -> str:
    ref = data["reference"]
    return (f"Reference lines on the same generator ({ref['rows']:,} rows): chance {num(ref['chance'], 3)}; answering "
            f"every query with the row's most common value (reading values, no key lookup) {num(ref['value_mode'], 3)}; "
            "the key lookup 1.")


def _mqar_verdict_v1(data: dict) -> str:
    widths = dict(_arms(data, "widths"))
    at_64 = widths.get(64)
    if at_64 is None:
        return f"Not decided: the run has no d_model = 64, the paper's smallest width. {registration_note(data, 'mqar')}"
    ok = all(mqar_solved(data, at_64))
    below = [f"d={w}: {share(mqar_solved(data, a))}" for w, a in sorted(widths.items()) if w < 64]
    return (f"{verdict_word(data, ok)} by the page's rule (every seed at d_model = 64, the "
            f"paper's smallest width, ends at recall accuracy ≥ {data['solved_accuracy']:g}): "
            f"{share(mqar_solved(data, at_64))}. Below the paper's grid (our extension, same step budget): "
            f"{'; '.join(below) if below else DASH}. Machine: {_machine(data)}. {registration_note(data, 'mqar')}")


# Registered data ("cells"): arms x lengths x widths, cells[arm][str(seq_len)][str(width)].


def _mqar_cell(data: dict, arm: str, seq_len: int, width: int) -> dict | None:
    return data["cells"].get(arm, {}).get(str(seq_len), {}).get(str(width))


def _mqar_lengths(data: dict) -> list[int]:
    return [length["seq_len"] for length in data["lengths"]]


def _mean(values: Sequence[float | None]) -> float:
    return stats.t_interval([v for v in values if v is not None]).mean


def mqar_rule(data: dict) -> dict | None:
    """The registered rule's parts on the data (None while a cell is missing): `a`
    (attention: every seed of every cell solved), `drops` (per consecutive pair of lengths
    and width: the conv arm's mean at the shorter and at the longer length, and whether
    that width passes: lower at the longer length, or both solved), `big_drop` (somewhere,
    a mean at the shorter length at least `min_drop` above that length's no-lookup line,
    i.e. some key lookup, that falls by at least `min_drop` at the longer length), `b`
    (every width passes and a big drop), `ok`."""
    lengths, widths, solved = _mqar_lengths(data), data["widths"], data["solved_accuracy"]
    if any(_mqar_cell(data, arm, t, w) is None for arm in ("attention", "gated_conv") for t in lengths for w in widths):
        return None
    a_runs = [ok for t in lengths for w in widths for ok in mqar_solved(data, _mqar_cell(data, "attention", t, w))]
    drops = []
    for short, long in zip(lengths, lengths[1:]):
        floor = data["reference"][str(short)]["value_mode"]
        for w in widths:
            ms = _mean(_mqar_cell(data, "gated_conv", short, w)["final_accuracy"])
            ml = _mean(_mqar_cell(data, "gated_conv", long, w)["final_accuracy"])
            drops.append({"short": short, "long": long, "width": w, "mean_short": ms, "mean_long": ml,
                          "passes": bool(ml < ms or (ms >= solved and ml >= solved)),
                          "big": bool(ms >= floor + data["min_drop"] and ms - ml >= data["min_drop"])})
    big = any(d["big"] for d in drops)
    a, b = all(a_runs), all(d["passes"] for d in drops) and big
    return {"a": a, "a_runs": a_runs, "drops": drops, "big_drop": big, "b": b, "ok": a and b}


def _smallest_solving_width(data: dict, arm: str, seq_len: int) -> str:
    for w in data["widths"]:
        cell = _mqar_cell(data, arm, seq_len, w)
        if cell is not None and _mean(cell["final_accuracy"]) >= data["solved_accuracy"]:
            return str(w)
    return "never"


def mqar_table(data: dict) -> str:
    if "cells" not in data:
        return _mqar_table_v1(data)
    rows = []
    for arm in data["arms"]:
        for length in data["lengths"]:
            for w in data["widths"]:
                cell = _mqar_cell(data, arm, length["seq_len"], w)
                if cell is None:
                    continue
                rows.append([MIXER_NAMES.get(arm, arm), f"{length['seq_len']} ({length['num_pairs']})", w,
                             share(mqar_solved(data, cell)), t_cell(cell["final_accuracy"], 3),
                             ", ".join(num(a, 3) for a in cell["final_accuracy"]), steps_cell(cell["solve_step"]),
                             round(cell["wall_seconds"])])
    header = ["sequence mixer", "T (pairs)", "d_model", f"seeds solved (accuracy ≥ {data['solved_accuracy']:g}) "
              "[Wilson 95 %]", "final recall accuracy [95 % t]", "per seed", "step reaching it: median (range; seeds)",
              "wall s"]
    return table(header, ["l", "r", "r", "r", "r", "r", "r", "r"], rows)


def mqar_reference(data: dict) -> str:
    if "cells" not in data:
        return _mqar_reference_v1(data)
    ref = data["reference"]
    modes = "; ".join(f"T = {t}: {num(ref[str(t)]['value_mode'], 3)}" for t in _mqar_lengths(data))
    rows = ref[str(_mqar_lengths(data)[0])]["rows"]
    return (f"Reference lines on the same generator ({rows:,} rows per length): chance "
            f"{num(ref[str(_mqar_lengths(data)[0])]['chance'], 4)}; answering every query with the row's most common "
            f"value (reading values, no key lookup) {modes}; the key lookup 1.")


def mqar_paper(data: dict) -> str:
    if "cells" not in data:
        return _mqar_paper_v1(data)
    t, m, tr = data["task"], data["model"], data["train"]
    lengths = _mqar_lengths(data)
    per_width = lambda arm: "; ".join(
        f"T={length}: " + ", ".join(f"d={w} {num(_mean(c['final_accuracy']), 2)}" for w in data["widths"]
                                    if (c := _mqar_cell(data, arm, length, w)) is not None) for length in lengths)
    rows = [
        ["task", "MQAR: single-token keys and values from a vocabulary of 8,192 (keys from one half, values from "
         "the other); key-value pairs first, then each key queried once at power-law-distributed gaps",
         f"MQAR of `RecallTaskConfig(key_tokens=1)`: N pairs of single-token keys ({t['num_key_symbols']} key "
         f"symbols, {t['num_values']} values), then Q queries, each one of the N keys drawn with repeats, back to "
         f"back (vocabulary {4 + t['num_key_symbols'] + t['num_values']})"],
        ["sequence length / key-value pairs", "64/4, 128/8, 256/16, 512/64",
         ", ".join(f"{length['seq_len']}/{length['num_pairs']} ({length['num_queries']} queries)"
                   for length in data["lengths"])],
        ["models", "attention: 2 layers (1 head, dropout 0.1), learned positions; gated convolutions (H3, Hyena, "
         "BaseConv): 4 layers, no positions; no MLP in any (state mixer: identity)",
         f"both: {m['num_layers']} layers, no MLP (`d_ff=0`), learned positions, pre-norm; attention: "
         f"{m['num_heads']} head; gated conv (`mixer='gated_conv'`): short causal convolutions of "
         f"{m['conv_kernel']} taps on q, k, v, a long causal filter on k ⊙ v, gated by q"],
        ["widths", "d_model 64, 128, 256, 512", "d_model " + ", ".join(str(w) for w in data["widths"])],
        ["training", "100,000 examples × 64 epochs, batch 512 (seq ≤ 128), best of 4 learning rates in "
         "[1e-4, 1e-2]; accuracy on 3,000 test examples",
         f"{tr['num_steps']} steps × batch {tr['batch_size']} of fresh rows, one learning rate "
         f"{tr['learning_rate']:g}; accuracy on {tr['eval_size']} held-out rows"],
        ["attention's accuracy", "≈ 1 at every width and length of the figure (read off the figure, not a printed "
         "number)", "mean final accuracy: " + per_width("attention")],
        ["gated convolutions' accuracy", "falls as the sequence grows at a fixed width; the width they need grows "
         "with the sequence (read off the figure)", "mean final accuracy: " + per_width("gated_conv")],
    ]
    return table(["", f"paper ({ZOOLOGY})", "ours"], ["l", "l", "l"], rows)


def mqar_verdict(data: dict) -> str:
    if "cells" not in data:
        return _mqar_verdict_v1(data)
    rule = mqar_rule(data)
    if rule is None:
        return f"Not decided: the run has not trained every cell of the grid. {registration_note(data, 'mqar')}"
    solved, lengths = data["solved_accuracy"], _mqar_lengths(data)
    falls = "; ".join(f"d={d['width']}: {num(d['mean_short'], 3)} → {num(d['mean_long'], 3)}"
                      f"{'' if d['passes'] else ' (does not fall)'}" for d in rule["drops"])
    smallest = "; ".join(f"T = {t}: {_smallest_solving_width(data, 'gated_conv', t)}" for t in lengths)
    return (f"{verdict_word(data, rule['ok'])} by the registered rule. (A) attention solves every cell "
            f"(every seed ≥ {solved:g}): {'yes' if rule['a'] else 'no'}, {share(rule['a_runs'])} runs. (B) the gated "
            f"conv's mean final accuracy falls from T = {lengths[0]} to T = {lengths[-1]} at every width (unless both "
            f"≥ {solved:g}), and at one width at least from ≥ {data['min_drop']:g} above the no-lookup line by "
            f"≥ {data['min_drop']:g}: {'yes' if rule['b'] else 'no'} ({falls}; such a fall: "
            f"{'yes' if rule['big_drop'] else 'no'}). Not part of the verdict: the "
            f"smallest width at which the gated conv's mean reaches {solved:g}: {smallest}. Machine: {_machine(data)}. "
            f"{registration_note(data, 'mqar')}")


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


def markov_first_eval(data: dict) -> int:
    """The step of the first evaluation: the registered schedule's first (0: before any
    update), or, for data without one, the evaluation interval."""
    steps = data["train"].get("eval_steps")
    return steps[0] if steps else data["train"]["eval_every"]


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
              f"seeds closest to uniform at the first evaluation (step {markov_first_eval(data)})",
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
        return f"Not decided: the run has not trained the two-layer model. {registration_note(data, 'markov')}"
    two = arms[2]
    two_ok = all(markov_staged(two))
    text = (f"{verdict_word(data, two_ok)} by the page's rule (every two-layer seed's "
            f"closest strategy goes uniform → unigram → bigram and ends at bigram): {share(markov_staged(two))}.")
    late = [st[0][0] != "uniform" for st in two["stages"]]
    if not two_ok and any(late):
        text += (f" In {sum(late)} of {len(late)} seeds the model was already closer to unigram than to uniform at "
                 f"the first evaluation (step {markov_first_eval(data)}), so a uniform stage, if any, was shorter "
                 "than that. Read after the run, without the uniform stage: unigram, then bigram, ending at bigram in "
                 f"{share(markov_unigram_then_bigram(two))} seeds.")
    if "eval_steps" in data["train"]:
        left = [next((step for s, step in st if s != "uniform"), None) for st in two["stages"]]
        text += f" First evaluation closest to another strategy than uniform, per seed: {', '.join(map(str, left))}."
    if 1 in arms:
        stays = [s[-1][0] != "bigram" for s in arms[1]["stages"]]
        text += f" One layer does not end closest to bigram in {share(stays)} seeds."
    return text + f" Machine: {_machine(data)}. {registration_note(data, 'markov')}"


RENDERERS: dict[str, dict[str, Callable[[dict], str]]] = {
    "anchor_induction": {"paper": induction_paper, "table": induction_table, "verdict": induction_verdict,
                         "curves": induction_curves},
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
    resume, the registration included: a registration committed anew starts a new
    folder), the first session's metadata, `fields`, the arms `--out` already holds,
    and under "resumed" each later session's machine and load."""
    from experiments import common

    config = json.loads(json.dumps({**config, "preregistration": args.preregistration}))  # tuples to lists
    saved, metadata = common.saved_results(args.out / "results.json", config, "arms"), common.run_metadata()
    results = {"config": config, "metadata": saved.get("metadata", metadata), **fields, "arms": saved.get("arms", {})}
    if saved:
        results["resumed"] = saved.get("resumed", []) + [metadata]
    return results


def train_arm(model, cfg, label: str, progress: bool, task=None):
    """All of `cfg.seeds` for one arm's model in one vmapped run (`train_seeds`) on
    `task` (default `cfg.task`), evaluated also at `cfg.eval_steps` if it has them, with
    a bar."""
    from experiments import common

    bar = common.TrainingBar(cfg.train.num_steps, label, not progress)
    try:
        return train_seeds(model, cfg.task if task is None else task, cfg.train, cfg.seeds, callback=bar,
                           eval_steps=getattr(cfg, "eval_steps", ()))
    finally:
        bar.close()


def train_arms(results: dict, items: Sequence[tuple[str, Any]], train_one: Callable[[Any], dict], out: Path,
               label: Callable[[Any], str], plural: str) -> None:
    """Trains each arm (`items`: `(key, value)`, e.g. `("2", 2)` for a depth) whose key is
    not yet in `results["arms"]`, saving `out`/results.json after each; Ctrl-C ends in
    one line naming the arms saved."""
    from experiments import common

    for key, value in items:
        if key in results["arms"]:
            print(f"{label(value)}: already in {out}/results.json", flush=True)
            continue
        try:
            results["arms"][key] = train_one(value)
        except KeyboardInterrupt:
            done = list(results["arms"])
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


def parse(argv, module: str, doc: str, name: str, registration: Path, from_preset: Callable[[dict, dict], Any],
          sweep: str, sweep_help: str, seeds_per: str):
    """An anchor's command line: `(args, config)`. The presets are those of the
    registration file (`registration`, `read_registration`); `from_preset(preset, rule)`
    builds the anchor's config from one. `sweep` is the config field the anchor varies
    (`layers`, `widths`), given as `--<sweep>`; `--<sweep>`, `--seeds` and `--steps`
    override the preset, which makes the run not the registered one (recorded). The
    registered preset also writes its artifact to docs/results/data/anchor_<name>.json
    (the figure beside the page).

    `args.preregistration` is what the data record: `{file, commit, preset,
    registered_preset, registered, overrides}`. A bad value, an unreadable registration
    file, or one with uncommitted changes (or outside a git checkout: no commit to
    record) ends in one argparse `error:` line (exit 2); `--replot` reads nothing of it."""
    import dataclasses

    from experiments import common

    p = common.parser(module, doc.split("\n\n")[0].replace("\n", " "))
    try:
        reg = read_registration(registration)
    except (OSError, ValueError, KeyError, TypeError) as e:
        p.error(f"cannot read the registration {registration}: {e}")
    presets, registered = reg["presets"], reg["registered_preset"]
    p.epilog = (f"presets (from {registration.name}; the registered run is {registered}):\n" + "\n".join(
        textwrap.fill(str(t.get("description", "")), 88, initial_indent=f"  {n:<9} ", subsequent_indent=" " * 12)
        for n, t in presets.items()))
    p.add_argument("--preset", choices=sorted(presets), default=registered,
                   help=f"configuration (default {registered}, the registered run)")
    p.add_argument(f"--{sweep}", type=common.positive_int, nargs="+", help=sweep_help + " (overrides the preset)")
    p.add_argument("--seeds", type=common.positive_int, help=f"seeds per {seeds_per} (overrides the preset)")
    p.add_argument("--steps", type=common.positive_int,
                   help="optimizer steps (a multiple of the evaluation interval; overrides the preset)")
    p.add_argument("--out", type=Path, help=f"output folder (default results/anchors/{name}[-<preset>])")
    p.add_argument("--artifact", type=Path, help="also write the artifact here (default for the registered preset: "
                   f"docs/results/data/anchor_{name}.json, the figure beside the page)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--replot", action="store_true", help="redo the artifact, summary and figure from --out's results.json")
    args = p.parse_args(argv)
    overrides = {key: value for key, value in ((sweep, getattr(args, sweep)), ("seeds", args.seeds),
                                               ("steps", args.steps)) if value is not None}
    args.preregistration = None
    if not args.replot:
        state = common.file_state(registration)
        if state["dirty"] is None:
            p.error(f"{registration} is not in a git checkout: no commit can register the run")
        if state["dirty"] or state["commit"] is None:
            p.error(f"{state['file']} has uncommitted changes: commit the registration before the run "
                    "(its data record the commit)")
        args.preregistration = {"file": state["file"], "commit": state["commit"], "preset": args.preset,
                                "registered_preset": registered,
                                "registered": args.preset == registered and not overrides, "overrides": overrides}

    def build():
        try:
            cfg = from_preset(presets[args.preset], reg["rule"])
        except KeyError as e:
            raise ValueError(f"preset {args.preset} of {registration.name} lacks {e}") from None
        train = cfg.train if args.steps is None else dataclasses.replace(cfg.train, num_steps=args.steps)
        swept = getattr(args, sweep)
        return dataclasses.replace(cfg, train=train, num_seeds=args.seeds or cfg.num_seeds,
                                   **{sweep: tuple(swept) if swept else getattr(cfg, sweep)})

    cfg = common.build_or_exit(p, build)
    args.out = args.out or Path("results") / "anchors" / (name if args.preset == registered else f"{name}-{args.preset}")
    if args.artifact is None and args.preset == registered and not overrides:
        args.artifact = common.CHECKOUT / "docs" / "results" / "data" / f"anchor_{name}.json"
    return args, cfg
