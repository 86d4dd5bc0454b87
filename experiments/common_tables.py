"""The tables of the results pages, rendered from their data (the per-seed values a
study writes as `artifact.json`, committed as docs/results/data/*.json).

Shared by `experiments.report` (which regenerates the pages) and the studies that print
the same tables in their own summary, so a page and the study's summary cannot differ.
The kinds of data and their blocks are described in `experiments.report`.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

from jax_mha.lab import stats
from jax_mha.lab.head_types import HEAD_TYPES

DASH = "–"


# ----------------------------------------------------------------- number formats


def num(x: Any, digits: int, sign: bool = False) -> str:
    """`x` to `digits` decimals with a typographic minus (the pages' style); "–" for None/NaN."""
    if x is None or not math.isfinite(float(x)):
        return DASH
    text = f"{float(x):+.{digits}f}" if sign else f"{float(x):.{digits}f}"
    return text.replace("-", "−")


def grouped(x: Any) -> str:
    """An integer with thousands separators; "–" for None/NaN."""
    return DASH if x is None or not math.isfinite(float(x)) else f"{round(float(x)):,}"


def interval(iv: stats.Interval, digits: int, sign: bool = False) -> str:
    """'m [lo, hi]'; 'm' alone with one value (no spread), '–' with none."""
    if iv.n == 0:
        return DASH
    if iv.n < 2:
        return num(iv.mean, digits, sign)
    return f"{num(iv.mean, digits, sign)} [{num(iv.low, digits, sign)}, {num(iv.high, digits, sign)}]"


def mean_std_interval(values: Sequence[float | None], digits: int) -> str:
    """'m ± s [lo, hi]' of per-seed values; 'm ± –' for one seed (no spread)."""
    iv = stats.t_interval(values)
    if iv.n == 0:
        return DASH
    spread = num(iv.std, digits) if iv.n > 1 else DASH
    bounds = f" [{num(iv.low, digits - 1)}, {num(iv.high, digits - 1)}]" if iv.n > 1 else ""
    return f"{num(iv.mean, digits)} ± {spread}{bounds}"


def p_value(p: float) -> str:
    """A p value to 2 significant digits ('<0.001' below that); "–" for NaN."""
    if not math.isfinite(p):
        return DASH
    return "<0.001" if p < 0.001 else f"{p:#.2g}"  # "#": 0.040, not 0.04


def share(flags: Sequence[bool]) -> str:
    """'k/n [low, high]': how many are True, with Wilson's 95 % interval."""
    k, n = sum(bool(f) for f in flags), len(flags)
    if n == 0:
        return DASH
    low, high = stats.wilson_interval(k, n)
    return f"{k}/{n} [{num(low, 2)}, {num(high, 2)}]"


def steps_cell(steps: Sequence[int | None]) -> str:
    """Median and range of the steps that exist, and how many seeds have one."""
    have = sorted(s for s in steps if s is not None)
    if not have:
        return f"never (0/{len(steps)})"
    mid = have[len(have) // 2] if len(have) % 2 else (have[len(have) // 2 - 1] + have[len(have) // 2]) / 2
    return f"{mid:g} ({have[0]}–{have[-1]}; {len(have)}/{len(steps)})"


def table(header: Sequence[str], align: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table; `align` per column: 'l' or 'r'."""
    rule = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    return "\n".join(["| " + " | ".join(header) + " |", rule] + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def comparison_lines(family: dict[str, stats.Comparison], digits: int) -> str:
    """One bullet per comparison: difference [95 % t], paired t test p, Holm-adjusted p."""
    equals = lambda p: f"< {p_value(p)[1:]}" if p_value(p).startswith("<") else f"= {p_value(p)}"
    lines = [f"- {name}: {interval(c.difference, digits, sign=True)}, p {equals(c.p)}, Holm p {equals(c.p_holm)}"
             for name, c in family.items()]
    return "\n".join(lines)


def sweep_family(per_seed: dict[int, Sequence[float | None]]) -> dict[str, stats.Comparison]:
    """Seed-paired comparisons of every h against the fewest heads and of neighbours,
    Holm-adjusted together (the family one page reports)."""
    heads = sorted(per_seed)
    pairs = [(h, heads[0]) for h in heads[1:]] + [(b, a) for a, b in zip(heads[1:], heads[2:])]
    return stats.paired_comparisons({f"h = {a} − h = {b}": (per_seed[a], per_seed[b]) for a, b in pairs})


# ----------------------------------------------------------------- kinds


def _heads(data: dict) -> list[tuple[int, dict]]:
    return sorted(((int(k), v) for k, v in data["heads"].items()), key=lambda kv: kv[0])


def lm_sweep_table(data: dict) -> str:
    """heads | head size | bpc mean ± std [95 % t] | per seed | gap | characters/seed | wall s | characters/s."""
    rows, has_chars = [], any("characters_per_seed" in r for _, r in _heads(data))
    for h, r in _heads(data):
        gaps = r.get("gap")
        gap = num(stats.mean_std(gaps)[0], 3, sign=True) if gaps is not None else num(r.get("gap_mean"), 3, sign=True)
        row = [h, r["head_dim"], mean_std_interval(r["final_bpc"], 4), ", ".join(num(x, 4) for x in r["final_bpc"]), gap]
        if has_chars:
            row.append(grouped(r.get("characters_per_seed")))
        rows.append(row + [grouped(r.get("wall_seconds")), grouped(r.get("tokens_per_second"))])
    n = max(len(r["final_bpc"]) for _, r in _heads(data))
    split = data.get("split", "test")
    header = ["heads", "head size", f"{split} bpc, mean ± std [95 % t]", "per seed", "gap"]
    header += ["characters/seed"] if has_chars else []
    header += [f"wall s ({n} seeds)", "characters/s"]
    return table(header, ["r", "r", "r", "l", "r"] + ["r"] * (len(header) - 5), rows)


def lm_sweep_comparisons(data: dict) -> str:
    family = sweep_family({h: r["final_bpc"] for h, r in _heads(data)})
    return comparison_lines(family, 4)


def induction_control_table(data: dict) -> str:
    """Prefix matching per (layer, head) of the positive control; the best in bold."""
    scores = np.asarray(data["prefix_matching"])
    best = np.unravel_index(np.argmax(scores), scores.shape)
    rows = [[layer, *(f"**{num(v, 3)}**" if (layer, h) == best else num(v, 3) for h, v in enumerate(row))]
            for layer, row in enumerate(scores)]
    return table(["layer", *(f"head {h}" for h in range(scores.shape[1]))], ["r"] * (scores.shape[1] + 1), rows)


def induction_control_summary(data: dict) -> str:
    """The control's numbers beside the probe's chance level and threshold, and its run."""
    scores = np.asarray(data["prefix_matching"])
    layer, head = np.unravel_index(np.argmax(scores), scores.shape)
    meta = data.get("metadata", {})
    return (f"Uniform attention scores {num(data['chance'], 3)} on this probe "
            f"(`head_types.prefix_matching_chance({data['probe_repeat']})`); the library's threshold is "
            f"{data['threshold']:g}; the best head, ({layer}, {head}), scores {num(scores.max(), 3)}, "
            f"{scores.max() / data['chance']:.1f}× chance. On held-out rows the second copy is predicted with token "
            f"accuracy {num(data['heldout_token_accuracy'], 3)}; on the probe, second-copy loss "
            f"{num(data['second_copy_loss'], 3)} nats (uniform over the {data['task']['vocab_size']} tokens: "
            f"{num(math.log(data['task']['vocab_size']), 2)}), first-copy loss {num(data['first_copy_loss'], 3)} nats, "
            f"copying difference {num(data['copying'], 3)} nats. Seed {data['seed']}, {data['seconds']:.0f} s on "
            f"{meta.get('cpu', 'an unnamed CPU')} ({meta.get('cpu_count', '?')} cores), commit "
            f"`{str(meta.get('commit'))[:7]}`{' with uncommitted changes' if meta.get('dirty') else ''}.")


# The difference a powered LM sweep is sized for, in bpc, and the power asked.
POWER_DIFFERENCE = 0.02
POWER = 0.8


def lm_sweep_power(data: dict) -> str:
    """Per comparison of the family: the sample std of its seed-paired differences, the
    seeds a two-sided paired t test needs to detect POWER_DIFFERENCE with POWER at
    Holm's strictest level (5 % over the family's size), and the smallest difference
    the file's own seed count detects with that power at that level."""
    per_seed = {h: r["final_bpc"] for h, r in _heads(data)}
    heads = sorted(per_seed)
    pairs = [(h, heads[0]) for h in heads[1:]] + [(b, a) for a, b in zip(heads[1:], heads[2:])]
    alpha = 0.05 / len(pairs)
    rows = []
    for a, b in pairs:
        d = [x - y for x, y in zip(per_seed[a], per_seed[b]) if x is not None and y is not None]
        sd = stats.sample_std(d)
        needed = stats.seeds_for_power(POWER_DIFFERENCE, sd, alpha, POWER) if sd > 0 else 2
        detectable = stats.detectable_difference(len(d), sd, alpha, POWER) if sd > 0 and len(d) > 1 else math.nan
        rows.append([f"h = {a} − h = {b}", len(d), num(float(np.mean(d)), 4, sign=True), num(sd, 4),
                     DASH if needed is None else needed, num(detectable, 3)])
    header = ["comparison", "seeds", "mean difference (bpc)", "std of the differences",
              f"seeds for {POWER * 100:.0f} % power at {POWER_DIFFERENCE} bpc",
              f"difference detected with {POWER * 100:.0f} % power"]
    note = (f"Two-sided paired t test at α = 0.05/{len(pairs)} = {alpha:.4f} (Holm's first, strictest step over the "
            f"family of {len(pairs)}), `jax_mha.lab.stats.seeds_for_power`.")
    return table(header, ["l", "r", "r", "r", "r", "r"], rows) + "\n\n" + note


def recall_reference(data: dict) -> str:
    """The lines a model must pass, measured on the task's generator; of the two answers
    that read values without any key lookup, the higher is named the best such line."""
    ref, task = data["reference"], data["task"]
    no_lookup = sorted([("always the most common value among the row's pairs", ref["value_mode"]),
                        ("the elimination strategy (the most common value among pairs not yet asked)",
                         ref["elimination"])], key=lambda line: -line[1])
    (best, best_value), (other, other_value) = no_lookup
    return (f"Reference lines on the same generator ({ref['rows']:,} rows): chance {num(1 / task['num_values'], 3)}; "
            f"the best line without any key lookup, {best}, {num(best_value, 3)}, and below it {other} "
            f"{num(other_value, 3)}; a lookup of only the key's first token {num(ref['one_token_a'], 3)}, only its "
            f"second {num(ref['one_token_b'], 3)}; the two-token lookup 1.")


# A recall seed escapes the no-lookup plateau when its accuracy reaches this much above
# the best line without any key lookup (`recall_reference`): the plateau's seeds scatter
# about 0.01 around it, a one-token lookup sits about 0.3 above it.
ESCAPE_MARGIN = 0.1


def recall_escape_line(data: dict) -> float:
    """The accuracy at which a recall seed counts as escaped: the best no-lookup line plus the margin."""
    ref = data["reference"]
    return max(ref["value_mode"], ref["elimination"]) + data.get("escape_margin", ESCAPE_MARGIN)


def _recall_outcomes(data: dict, r: dict) -> dict[str, list[bool]]:
    acc = [a if a is not None else -1.0 for a in r["final_accuracy"]]
    return {"solved": [a >= data["solved_accuracy"] for a in acc],
            "escaped": [a >= recall_escape_line(data) for a in acc]}


def recall_table(data: dict) -> str:
    """heads | head dim | lr | solved k/n | escaped k/n [Wilson 95 %] | escape step | AUC [95 % t] |
    final accuracy [95 % t] | per-seed accuracy | wall s."""
    rows, threshold = [], data["solved_accuracy"]
    with_steps = any("escape_step" in r for _, r in _heads(data))
    for h, r in _heads(data):
        acc, outcomes = r["final_accuracy"], _recall_outcomes(data, r)
        row = [h, r["head_dim"], rate(r["learning_rate"]) if "learning_rate" in r else DASH,
               share(outcomes["solved"]), share(outcomes["escaped"])]
        if with_steps:
            row.append(steps_cell(r.get("escape_step", [])))
        rows.append(row + [interval(stats.t_interval(r["auc_loss"]), 3), interval(stats.t_interval(acc), 3),
                           ", ".join(num(a, 3) for a in acc), grouped(r.get("wall_seconds"))])
    header = ["heads", "head dim", "peak lr", f"seeds solved (accuracy ≥ {threshold:g}) [Wilson 95 %]",
              f"seeds escaped (accuracy ≥ {num(recall_escape_line(data), 3)}) [Wilson 95 %]"]
    if with_steps:
        header.append("first step escaped: median (range; seeds)")
    header += ["area under held-out loss (nats) [95 % t]", "final recall accuracy [95 % t]", "per seed", "wall s"]
    return table(header, ["r"] * (len(header) - 2) + ["l", "r"], rows)


def recall_comparisons(data: dict) -> str:
    """AUC and final accuracy of every h against the fewest heads: one family of 2(k - 1)."""
    heads = _heads(data)
    base_h, base = heads[0]
    family = {}
    for h, r in heads[1:]:
        family[f"AUC, h = {h} − h = {base_h}"] = (r["auc_loss"], base["auc_loss"])
        family[f"accuracy, h = {h} − h = {base_h}"] = (r["final_accuracy"], base["final_accuracy"])
    return comparison_lines(stats.paired_comparisons(family), 3)


def recall_exact(data: dict) -> str:
    """The bimodal outcomes compared as shares: the seeds that solve and the seeds that
    escape the no-lookup plateau, every h against the fewest heads, by Fisher's exact
    test (two-sided), Holm-adjusted over the family of 2(k - 1)."""
    heads = _heads(data)
    base_h, base = heads[0]
    base_outcomes = _recall_outcomes(data, base)
    tests = []
    for h, r in heads[1:]:
        outcomes = _recall_outcomes(data, r)
        for name in ("solved", "escaped"):
            a, b = outcomes[name], base_outcomes[name]
            tests.append((f"{name}, h = {h} against h = {base_h}: {sum(a)}/{len(a)} against {sum(b)}/{len(b)}",
                          stats.fisher_exact(sum(a), len(a), sum(b), len(b))))
    adjusted = stats.holm([p for _, p in tests])
    equals = lambda p: f"< {p_value(p)[1:]}" if p_value(p).startswith("<") else f"= {p_value(p)}"
    return "\n".join(f"- {name}, Fisher p {equals(p)}, Holm p {equals(q)}" for (name, p), q in zip(tests, adjusted))


def lm_pruning_table(data: dict) -> str:
    rows = []
    for s in data["seeds"]:
        total = s["total_heads"]
        pair = lambda d, digits, suffix="": f"{num(d['importance'], digits, sign=bool(suffix))}{suffix} / " \
                                            f"{num(d['oracle'], digits, sign=bool(suffix))}{suffix}"
        rows.append([s["seed"], num(s["unpruned_bpc"], 4), num(s["all_off_bpc"], 3),
                     f"{s['prunable']['importance']} of {total}", f"{s['prunable']['oracle']} of {total}",
                     pair(s["first_rise_pct"], 1, " %"), pair(s["half_pruned_bpc"], 3), num(s["spearman"], 3)])
    header = ["seed", "unpruned bpc", "every head off", "heads removable at ≤ 1 %, importance order",
              "same, oracle order", "bpc rise from the first head removed, importance / oracle",
              "bpc with half of the heads removed, importance / oracle", "Spearman(importance, oracle)"]
    return table(header, ["r"] * len(header), rows)


def lm_pruning_spearman(data: dict) -> str:
    values = [s["spearman"] for s in data["seeds"]]
    iv = stats.t_interval(values)
    return (f"Spearman over the {iv.n} seeds: {num(iv.mean, 3)} ± {num(iv.std, 3) if iv.n > 1 else DASH}, "
            f"95 % t interval [{num(iv.low, 3)}, {num(iv.high, 3)}].")


def lm_pruning_induction(data: dict) -> str:
    """Losses with no head gated / the top-2 gated / the bottom-2 gated, and where the
    artifact has them, the matched controls' mean and the share of control draws that
    raise the second-copy loss at least as much as the top-2 do."""
    rows, controlled = [], all("controls" in s["induction"] for s in data["seeds"])
    for s in data["seeds"]:
        arms = s["induction"]
        means = {key: float(np.mean(arms["controls"][key])) for key in arms.get("controls", {}) if key != "heads"}

        def cell(key):
            values = [arms[a][key] for a in ("none", "top", "bottom")] + ([means[key]] if controlled else [])
            return " / ".join(num(v, 3) for v in values)

        row = [s["seed"], ", ".join(f"({l}, {h})" for l, h in arms["top"]["heads"]),
               cell("second_copy_loss"), cell("late_loss"), cell("early_loss")]
        if controlled:
            c = np.asarray(arms["controls"]["second_copy_loss"])
            row.append(f"{int((c >= arms['top']['second_copy_loss']).sum())} of {c.size}")
        rows.append(row)
    header = ["seed", "top-2 heads", "second copy", "late positions", "early positions"]
    if controlled:
        header.append("controls ≥ top-2, second copy")
    return table(header, ["r", "l", "l", "l", "l"] + (["r"] if controlled else []), rows)


def ngram_table(data: dict) -> str:
    """One row per split the file holds: the dev split's (where choices are made) when
    present, then the reported split's."""
    orders = sorted(data["bpc"], key=int)
    chars = data.get("characters", {})
    label = lambda split: f"{split} bpc" + (f" ({chars[split]:,} characters)" if split in chars else "")
    rows = [[label("dev"), *(num(data["dev_bpc"][n], 3) for n in orders)]] if "dev_bpc" in data else []
    rows.append([label(data.get("split", "test")), *(num(data["bpc"][n], 3) for n in orders)])
    return table(["n-gram order", *orders], ["l"] + ["r"] * len(orders), rows)


def literal_block(data: dict, block: str) -> str:
    t = data["tables"][block]
    return table(t["header"], t["align"], t["rows"])


def induction_definitions(seq_len: int) -> str:
    """What the induction table's columns mean, for windows of `seq_len` characters (the
    ICL positions scale with T, as `jax_mha.lab.text.induction_metrics` takes them)."""
    early, late = (max(1, seq_len // 16), max(2, seq_len // 8)), max(1, seq_len // 8)
    return ("Induction evidence at the last evaluation (`jax_mha.lab.text.induction_metrics`). Prefix matching: "
            "mean weight on the key after the query's first occurrence, over the second copy of 32 repeated rows "
            "(real dev spans; distinct frequent characters); 'x chance' divides by uniform causal attention's "
            "score. Copying: first-copy minus second-copy loss (nats; positive = the repeat is predicted better). "
            f"ICL score: mean loss at the last {late} positions minus positions {early[0]}–{early[1] - 1} of "
            f"{seq_len}-character dev windows (T/8 and T/16 … T/8 − 1; nats; negative = the later context helps).")


def lm_sweep_induction(data: dict) -> str:
    """One row per model: its best prefix-matching head and the other induction evidence."""
    rows = [[r["heads"], r["seed"], f"({r['best_head_spans'][0]}, {r['best_head_spans'][1]})",
             num(r["prefix_matching_spans"], 3), num(r["prefix_matching_spans"] / r["chance"], 1),
             num(r["prefix_matching_frequent"], 3), num(r["copying_spans"], 3, sign=True),
             num(r["copying_frequent"], 3, sign=True), num(r["icl_score"], 3, sign=True)] for r in data["induction"]]
    return table(["heads", "seed", "best head, spans (layer, head)", "prefix matching, spans", "x chance",
                  "best, frequent", "copying, spans", "copying, frequent", "ICL score"],
                 ["r", "r", "l", "r", "r", "r", "r", "r", "r"], rows)


def lm_sweep_head_types(data: dict) -> str:
    """Per head count: how many heads of all its seeds' models each type holds
    (`jax_mha.lab.head_types`); "–" where a run was not typed."""
    rows = []
    for h, r in _heads(data):
        counts = r.get("head_type_counts") or []
        if not counts or any(c is None for c in counts):
            rows.append([h, len(r["final_bpc"]), DASH] + [DASH] * len(HEAD_TYPES))
            continue
        total = [sum(c.get(kind, 0) for c in counts) for kind in HEAD_TYPES]
        rows.append([h, len(counts), sum(total), *total])
    return table(["heads", "models", "heads in all", *(k.replace("_", "-") for k in HEAD_TYPES)],
                 ["r"] * (3 + len(HEAD_TYPES)), rows)


def lm_sweep_rates(data: dict) -> str:
    """The peak learning rate each head count trained at."""
    rates = data.get("learning_rates") or {}
    return table(["heads", *sorted(rates, key=int)], ["l"] + ["r"] * len(rates),
                 [["peak lr", *(rate(rates[h]) if rates[h] is not None else DASH for h in sorted(rates, key=int))]])


def rate(lr: float) -> str:
    """A learning rate as people write it: 1e-3, 2.5e-3, 3e-2."""
    mantissa, exponent = f"{lr:e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def best_rates(data: dict) -> dict[int, tuple[float, bool]]:
    """Per head count of an `lr_grid` file: `(rate of the best mean, bracketed)`, where
    bracketed means a lower and a higher rate were also tried (the best is not at an
    edge of the grid)."""
    better = min if data["lower_is_better"] else max
    out = {}
    for h in sorted({c["heads"] for c in data["cells"]}):
        cells = {c["lr"]: float(np.mean(c["values"])) for c in data["cells"] if c["heads"] == h}
        best = better(cells, key=cells.get)
        out[h] = (best, min(cells) < best < max(cells))
    return out


def _grid_rows(data: dict, key: str) -> tuple[list[float], dict, list[list]]:
    """`(rates, {(h, lr): values}, rows)` of an `lr_grid` file: per head count, its
    cells' `key` values as 'mean ± sample std', the rate dev chose in bold, '–' where
    the grid has no cell."""
    rates = sorted({c["lr"] for c in data["cells"]})
    cells = {(c["heads"], c["lr"]): c.get(key) for c in data["cells"]}
    rows = []
    for h, (chosen, _) in best_rates(data).items():
        row = [h]
        for lr in rates:
            values = cells.get((h, lr))
            if not values:
                row.append(DASH)
                continue
            iv = stats.t_interval(values)
            text = f"{num(iv.mean, 3)} ± {num(iv.std, 3) if iv.n > 1 else DASH}"
            row.append(f"**{text}**" if lr == chosen else text)
        rows.append(row)
    return rates, cells, rows


def lr_grid_table(data: dict) -> str:
    """Rows: head counts; columns: rates, each mean ± sample std over seeds of the
    selection metric (the best of each row in bold); then the chosen rate and whether
    the grid brackets it."""
    rates, _, rows = _grid_rows(data, "values")
    rows = [row + [rate(chosen), "yes" if bracketed else "no (edge of the grid)"]
            for row, (chosen, bracketed) in zip(rows, best_rates(data).values())]
    header = ["heads", *(f"lr {rate(lr)}" for lr in rates), "chosen", "bracketed"]
    return table(header, ["r"] * len(header), rows)


def lr_grid_test(data: dict) -> str:
    """The same grid scored on the test split (`test` per cell, read by no choice): mean
    ± sample std per (h, rate), the dev-chosen rate in bold, and per rate the head
    counts from best to worst, so the ranking's dependence on the rate shows."""
    if not any(c.get("test") for c in data["cells"]):
        raise ValueError("this lr_grid file has no test values (written before lm_sizing scored the test split)")
    rates, cells, rows = _grid_rows(data, "test")
    best = best_rates(data)
    ranking = ["best first"]
    for lr in rates:
        means = {h: float(np.mean(cells[(h, lr)])) for h in best if cells.get((h, lr))}
        ranking.append(" < ".join(str(h) for h in sorted(means, key=means.get)) if means else DASH)
    header = ["heads", *(f"lr {rate(lr)}" for lr in rates)]
    return table(header, ["r"] * len(header), rows + [ranking])


RENDERERS: dict[str, dict[str, Callable[[dict], str]]] = {
    "lm_sweep": {"table": lm_sweep_table, "comparisons": lm_sweep_comparisons, "induction": lm_sweep_induction,
                 "rates": lm_sweep_rates, "head_types": lm_sweep_head_types, "power": lm_sweep_power},
    "recall": {"reference": recall_reference, "table": recall_table, "comparisons": recall_comparisons,
               "exact": recall_exact},
    "lm_pruning": {"table": lm_pruning_table, "spearman": lm_pruning_spearman, "induction": lm_pruning_induction},
    "ngram": {"table": ngram_table},
    "induction_control": {"table": induction_control_table, "summary": induction_control_summary},
    "lr_grid": {"table": lr_grid_table, "test": lr_grid_test},
}


def render(data: dict, block: str) -> str:
    """The Markdown of one block of one data file.

    Raises:
      ValueError: for an unknown kind or a block the kind does not have.
    """
    kind = data.get("kind")
    if kind == "literal":
        if block not in data.get("tables", {}):
            raise ValueError(f"literal data has no table {block!r}; it has {sorted(data.get('tables', {}))}")
        return literal_block(data, block)
    if kind not in RENDERERS:
        raise ValueError(f"unknown data kind {kind!r}; known: {sorted(RENDERERS) + ['literal']}")
    if block not in RENDERERS[kind]:
        raise ValueError(f"a {kind} file has no block {block!r}; it has {sorted(RENDERERS[kind])}")
    return RENDERERS[kind][block](data)
