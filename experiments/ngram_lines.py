"""The n-gram lines of the character language model's corpus: interpolated (Witten-Bell)
n-gram tables fitted on the training split and scored on every character of the dev
split (where choices are made) and of the test split (where results are reported), in
bits per character. They are the lines a model must pass to show it learned more than
a table of counts (`jax_mha.lab.text.ngram_bpc`).

    python -m experiments.ngram_lines                       # the default corpus; seconds
    python -m experiments.ngram_lines --text FILE           # a UTF-8 file of your own

Writes docs/results/data/ngram_reference.json (--out to write elsewhere), which
`python -m experiments.report` renders on docs/results/lm_heads.md.
"""

from __future__ import annotations

from pathlib import Path

from experiments import common
from jax_mha.lab.text import TextTaskConfig, ngram_baselines

MODULE = "experiments.ngram_lines"
ORDERS = (1, 2, 3, 4, 5)


def build_parser():
    p = common.parser(MODULE, "Interpolated n-gram bpc of the corpus's dev and test splits (fitted on train).")
    p.add_argument("--text", type=Path, help="a UTF-8 text file as corpus (default: the Python Language Reference)")
    p.add_argument("--out", type=Path, default=Path("docs") / "results" / "data" / "ngram_reference.json",
                   help="the data file written (default docs/results/data/ngram_reference.json)")
    return p


def lines(task: TextTaskConfig) -> dict:
    """The kind "ngram" record: per split, `{n: bpc}`, and the split sizes."""
    corpus = task.corpus
    return {"kind": "ngram", "split": "test", "text": task.text_file or "pydoc_data.topics (Python Language Reference)",
            "characters": {name: int(len(corpus.split(name))) for name in ("train", "dev", "test")},
            "bpc": ngram_baselines(corpus, ORDERS, split="test"), "dev_bpc": ngram_baselines(corpus, ORDERS, split="dev"),
            "metadata": {k: v for k, v in common.run_metadata().items() if k in ("cpu", "commit", "dirty", "argv")}}


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    task = TextTaskConfig(seq_len=64, text_file=str(args.text) if args.text else None)
    data = lines(task)
    common.write_json(args.out, data)
    for split, key in (("dev", "dev_bpc"), ("test", "bpc")):
        print(f"{split} ({data['characters'][split]:,} characters): "
              + ", ".join(f"{n}-gram {b:.3f}" for n, b in data[key].items()))
    print(f"wrote {args.out}")
    return data


if __name__ == "__main__":
    common.cli(main, MODULE)
