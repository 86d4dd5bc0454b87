"""The tables of docs/results, regenerated from committed data (docs/results/data/*.json).

A results page marks each generated block with two comments,

    <!-- report: lm_quick#table -->
    ...the table, as this module renders it...
    <!-- /report -->

naming a data file (`docs/results/data/lm_quick.json`) and one of the blocks its
kind renders. The data files hold per-seed values (small: no curves, no weights), so
every mean, spread, interval and p value on a page is computed here, by committed code:

    python -m experiments.report            # rewrite every block of every page from its data
    python -m experiments.report --check    # change nothing; exit 1 naming each block that disagrees
    python -m experiments.report --merge results/head_pruning/lm-quick-seed*/artifact.json \\
        -o docs/results/data/lm_pruning.json   # one file from the per-seed artifacts of a study

A study writes its artifact (`artifact.json` in its output folder, the format of these
files) when it completes; copying it to docs/results/data/ and running this module
updates the page. Kinds (rendered by `experiments.common_tables`, which the studies
also print their summaries with):

- `lm_sweep`: a head-count sweep of the character LM (`experiments.head_ablation --task
  lm`): per h, per-seed held-out bpc (and gap, characters, wall time, throughput), the
  peak rate and per model its induction evidence and head-type counts. Blocks `table`,
  `comparisons` (seed-paired, Holm-adjusted over the family), `rates`, `induction` and
  `head_types`.
- `recall`: associative recall (`experiments.associative_recall`): per h, per-seed area
  under the loss curve and final accuracy; blocks `reference`, `table`, `comparisons`.
- `lm_pruning`: per-seed pruning records (`experiments.head_pruning --task lm`);
  blocks `table`, `spearman`, `induction`.
- `ngram`: the n-gram baselines of the dev and test splits (`experiments.ngram_lines`); block `table`.
- `lr_grid`: a learning-rate grid per head count (`experiments.lm_sizing`, or
  `experiments.associative_recall --eval-on dev` runs merged): per (h, lr) cell the
  per-seed values of the selection metric on the dev set; block `table` (the chosen
  rate per h and whether the grid brackets it).
- `literal`: tables whose cells are stored as printed, for numbers whose per-seed values
  were never recorded; each says so (`traced: false` and a `note`), blocks named by the file.
- `anchor_induction`, `anchor_mqar`, `anchor_markov`: the published anchors
  (`experiments.anchor_*`), rendered by `experiments.common_anchors`; blocks `paper`,
  `table`, `verdict`, and `reference` for MQAR and the Markov chains.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Sequence

from experiments import common_anchors, common_device
from experiments.common_tables import (  # noqa: F401  (re-exported: the renderers of every kind)
    RENDERERS,
    lm_pruning_induction,
    lm_pruning_spearman,
    lm_pruning_table,
    lm_sweep_comparisons,
    lm_sweep_table,
    lr_grid_table,
    ngram_table,
    recall_comparisons,
    recall_reference,
    recall_table,
)
from experiments.common_tables import render as _render_study

ROOT = Path(__file__).resolve().parents[1]
PAGES = ROOT / "docs" / "results"
DATA = PAGES / "data"
BLOCK = re.compile(r"<!-- report: (?P<name>[\w.-]+)#(?P<block>[\w-]+) -->\n(?P<body>.*?)<!-- /report -->", re.S)


# ----------------------------------------------------------------- pages


def render(data: dict, block: str) -> str:
    """The Markdown of one block: the anchors' kinds by `experiments.common_anchors`, the
    accelerators' by `experiments.common_device`, every other kind by
    `experiments.common_tables.render`.

    Raises:
      ValueError: for an unknown kind or a block the kind does not have.
    """
    if data.get("kind") in common_anchors.RENDERERS:
        return common_anchors.render(data, block)
    if data.get("kind") in common_device.RENDERERS:
        return common_device.render(data, block)
    return _render_study(data, block)


def regenerate(text: str, data_dir: Path) -> tuple[str, list[str], set[str]]:
    """`(page with every block rendered, problems, data names used)`; a block whose
    data is missing or broken is left as it is and named among the problems."""
    problems, used, cache = [], set(), {}

    def replace(match: re.Match) -> str:
        name, block = match["name"], match["block"]
        used.add(name)
        try:
            if name not in cache:
                cache[name] = json.loads((data_dir / f"{name}.json").read_text(encoding="utf-8"))
            body = render(cache[name], block)
        except (OSError, ValueError, KeyError, TypeError) as e:
            problems.append(f"{name}#{block}: {type(e).__name__}: {e}")
            return match[0]
        return f"<!-- report: {name}#{block} -->\n{body}\n<!-- /report -->"

    return BLOCK.sub(replace, text), problems, used


def run(pages_dir: Path = PAGES, data_dir: Path | None = None, check: bool = False) -> list[str]:
    """Renders (or, with `check`, compares) every page of `pages_dir`; returns the problems
    (disagreeing blocks, broken data, data files no page uses)."""
    data_dir = data_dir or pages_dir / "data"
    problems, used = [], set()
    for page in sorted(pages_dir.glob("*.md")):
        text = page.read_text(encoding="utf-8")
        new, page_problems, page_used = regenerate(text, data_dir)
        used |= page_used
        problems += [f"{page.name}: {p}" for p in page_problems]
        if new != text:
            if check:
                stale = [f"{m['name']}#{m['block']}" for m, n in zip(BLOCK.finditer(text), BLOCK.finditer(new))
                         if m[0] != n[0]]
                problems.append(f"{page.name}: disagrees with its data in {', '.join(stale)}")
            else:
                page.write_text(new, encoding="utf-8")
    unused = sorted(p.stem for p in data_dir.glob("*.json") if p.stem not in used)
    problems += [f"data/{name}.json: no page shows it" for name in unused]
    return problems


def merge(paths: Sequence[Path]) -> dict:
    """One data file from per-seed artifacts of one kind (`seeds` lists concatenated,
    ordered by seed).

    Raises:
      ValueError: for artifacts of different kinds or a kind without `seeds`.
    """
    parts = [json.loads(Path(p).read_text(encoding="utf-8")) for p in paths]
    kinds = {p.get("kind") for p in parts}
    if kinds == {"lr_grid"}:  # several runs of one grid: their cells side by side
        merged = {k: v for k, v in parts[0].items() if k != "cells"}
        merged["cells"] = sorted((c for p in parts for c in p["cells"]), key=lambda c: (c["heads"], c["lr"]))
        return merged
    if len(kinds) != 1 or "seeds" not in parts[0]:
        raise ValueError(f"--merge needs artifacts of one kind with per-seed records, got kinds {sorted(map(str, kinds))}")
    merged = {k: v for k, v in parts[0].items() if k != "seeds"}
    merged["seeds"] = sorted((s for p in parts for s in p["seeds"]), key=lambda s: s["seed"])
    return merged


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.report", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a page disagrees with its data")
    p.add_argument("--pages", type=Path, default=PAGES, help="folder of the pages (default docs/results)")
    p.add_argument("--merge", type=Path, nargs="+", metavar="ARTIFACT", help="merge per-seed artifacts into -o")
    p.add_argument("--junit", type=Path, metavar="XML",
                   help="turn pytest's --junitxml report of `pytest -m device` into -o (with --device, --versions)")
    p.add_argument("--device", help="the device the --junit report ran on")
    p.add_argument("--versions", help="the software the --junit report ran with (jax, CUDA, ...)")
    p.add_argument("-o", "--output", type=Path, help="the data file written (with --merge or --junit)")
    args = p.parse_args(argv)
    if args.junit:
        if args.output is None or not args.device or not args.versions:
            p.error("--junit needs -o FILE, --device and --versions")
        try:
            data = common_device.device_tests_from_junit(args.junit.read_text(encoding="utf-8"), args.device,
                                                         args.versions)
        except (OSError, ET.ParseError) as e:
            p.error(f"cannot read {args.junit}: {e}")
        args.output.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.output} ({len(data['tests'])} tests)")
        return 0
    if args.merge:
        if args.output is None:
            p.error("--merge needs -o FILE")
        try:
            data = merge(args.merge)
        except (OSError, ValueError) as e:
            p.error(str(e))
        args.output.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"wrote {args.output} ({len(data.get('seeds', data.get('cells', [])))} records)")
        return 0
    problems = run(args.pages, check=args.check)
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print("every page agrees with its data" if args.check else f"regenerated the pages of {args.pages}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
