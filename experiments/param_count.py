"""Parameter counts of multi-head attention (seed 004, exercise E12.1).

Counted from real modules: `jax.eval_shape` of `MultiHeadAttention.init` and
`TransformerBlock.init` gives every parameter's shape without allocating or computing
anything, so the numbers are what the library builds, not a formula. The formula
(`4·d_model²` weights, `+ 4·d_model` biases, whatever h) is checked against them.

    python -m experiments.param_count                     # d_model=512, h=8 (and 1, 2, 4, 16), d_ff=2048
    python -m experiments.param_count --d-model 256 --heads 1 4 --d-ff 1024

Writes to --out (default results/param_count/): results.json, table.md, params.png.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common, plotting
from experiments.common import run_metadata, save_figure, use_agg_backend, write_atomic, write_json
from jax_mha.nn.linen import FeedForward, MultiHeadAttention, TransformerBlock

PROJECTIONS = ("query", "key", "value", "out")
NAMES = {"query": "W_Q", "key": "W_K", "value": "W_V", "out": "W_O"}


def param_shapes(module, x_shape: tuple[int, ...]) -> dict:
    """The parameter tree of `module.init` on an input of `x_shape`, as ShapeDtypeStructs."""
    return jax.eval_shape(module.init, jax.random.PRNGKey(0), jnp.zeros(x_shape, jnp.float32))["params"]


def count(tree) -> int:
    """Number of scalars in a tree of arrays or ShapeDtypeStructs."""
    return int(sum(np.prod(x.shape, dtype=np.int64) for x in jax.tree.leaves(tree)))


def attention_counts(d_model: int, heads: int, bias: bool) -> dict:
    """Parameters of W_Q, W_K, W_V, W_O (kernel + bias each) of one MultiHeadAttention."""
    shapes = param_shapes(MultiHeadAttention(num_heads=heads, qkv_bias=bias, out_bias=bias), (1, 3, d_model))
    row = {"heads": heads, "d_k": d_model // heads, "bias": bias}
    for name in PROJECTIONS:
        row[NAMES[name]] = count(shapes[name])
        row[NAMES[name] + "_shape"] = list(shapes[name]["kernel"].shape)
    # Head i owns columns i*d_k:(i+1)*d_k of the Q, K and V kernels (the split_heads layout).
    row["per_head_QKV"] = 3 * d_model * (d_model // heads) + (3 * (d_model // heads) if bias else 0)
    row["total"] = count(shapes)
    row["formula"] = 4 * d_model**2 + (4 * d_model if bias else 0)
    return row


def block_counts(d_model: int, heads: int, d_ff: int) -> dict:
    """One TransformerBlock (the library's default biases: none on Q/K/V, one on the
    output projection), split into attention, feed-forward and LayerNorms."""
    shapes = param_shapes(TransformerBlock(num_heads=heads, d_ff=d_ff), (1, 3, d_model))
    parts = {"attention": count(shapes["attention"]), "feed-forward": count(shapes["ffn"]),
             "LayerNorm": count(shapes["norm1"]) + count(shapes["norm2"])}
    assert sum(parts.values()) == count(shapes), "a block parameter outside attention, ffn and norms"
    total = count(shapes)
    return {"parts": parts, "total": total, "fractions": {k: v / total for k, v in parts.items()},
            "attention_over_ffn": parts["attention"] / parts["feed-forward"]}


def decoder_layer_counts(d_model: int, heads: int, d_ff: int) -> dict:
    """An encoder–decoder decoder layer of Vaswani et al. (self-attention,
    cross-attention, feed-forward, 3 LayerNorms), from the same modules."""
    mha = count(param_shapes(MultiHeadAttention(num_heads=heads), (1, 3, d_model)))
    ffn = count(param_shapes(FeedForward(d_ff=d_ff), (1, 3, d_model)))
    norms = 3 * 2 * d_model
    total = 2 * mha + ffn + norms
    return {"attention": 2 * mha, "feed-forward": ffn, "LayerNorm": norms, "total": total,
            "attention_fraction": 2 * mha / total, "ffn_fraction": ffn / total}


def parse_args(argv=None) -> argparse.Namespace:
    """Every bad value ends in `error:` and exit 2."""
    p = common.parser("experiments.param_count",
                      "Count the parameters of W_Q, W_K, W_V, W_O for several head counts (with and without "
                      "biases) and the attention / feed-forward split of one Transformer block.")
    p.add_argument("--d-model", type=common.positive_int, default=512, help="model width (default 512, the base Transformer)")
    p.add_argument("--heads", type=common.positive_int, nargs="+", default=[1, 2, 4, 8, 16],
                   help="head counts to count (each must divide --d-model; default 1 2 4 8 16)")
    p.add_argument("--block-heads", type=common.positive_int, default=8, help="head count of the Transformer block (default 8)")
    p.add_argument("--d-ff", type=common.positive_int, default=2048, help="feed-forward hidden width (default 2048)")
    p.add_argument("--out", type=Path, default=Path("results/param_count"), help="output folder")
    args = p.parse_args(argv)
    bad = [h for h in [*args.heads, args.block_heads] if args.d_model % h]
    if bad:
        p.error(f"d_model={args.d_model} is not divisible by num_heads={bad[0]}")
    return args


def table(rows: list[dict], block: dict, decoder: dict, d_model: int, d_ff: int, block_heads: int) -> str:
    """Markdown tables of the counts."""
    lines = [f"Multi-head attention, d_model = {d_model}", "",
             "| h | d_k = d_v | biases | W_Q | W_K | W_V | W_O | total | 4·d² (+4·d) | one head's Q, K, V |",
             "|---:|---:|:---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['heads']} | {r['d_k']} | {'yes' if r['bias'] else 'no'} | {r['W_Q']:,} | {r['W_K']:,} | "
                     f"{r['W_V']:,} | {r['W_O']:,} | {r['total']:,} | {r['formula']:,} | {r['per_head_QKV']:,} |")
    p, f = block["parts"], block["fractions"]
    lines += ["", f"One Transformer block (d_model = {d_model}, h = {block_heads}, d_ff = {d_ff}; "
                  "no Q/K/V biases, biased W_O and FFN)", "",
              "| part | parameters | fraction |", "|---|---:|---:|"]
    lines += [f"| {k} | {p[k]:,} | {100 * f[k]:.2f}% |" for k in p]
    lines += [f"| total | {block['total']:,} | 100% |", "",
              f"Encoder–decoder decoder layer (self + cross attention): attention {100 * decoder['attention_fraction']:.1f}%, "
              f"feed-forward {100 * decoder['ffn_fraction']:.1f}% of {decoder['total']:,}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    common.start_study(("matplotlib",))
    args = parse_args(argv)
    use_agg_backend()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    heads = sorted(set(args.heads))
    rows = [attention_counts(args.d_model, h, bias) for h in heads for bias in (False, True)]
    for r in rows:
        if r["total"] != r["formula"]:
            raise RuntimeError(f"h={r['heads']}, bias={r['bias']}: counted {r['total']}, formula {r['formula']}")
    block = block_counts(args.d_model, args.block_heads, args.d_ff)
    decoder = decoder_layer_counts(args.d_model, args.block_heads, args.d_ff)
    results = {
        "config": {"d_model": args.d_model, "heads": heads, "block_heads": args.block_heads, "d_ff": args.d_ff},
        "metadata": run_metadata(),
        "attention": rows,
        "same_count_for_every_h": {str(b): len({r["total"] for r in rows if r["bias"] == b}) == 1 for b in (False, True)},
        "block": block,
        "decoder_layer": decoder,
    }
    text = table(rows, block, decoder, args.d_model, args.d_ff, args.block_heads)
    write_json(out / "results.json", results)
    write_atomic(out / "table.md", text)
    fig = plotting.param_count_plot(
        heads, {NAMES[n]: [r[NAMES[n]] for r in rows if not r["bias"]] for n in PROJECTIONS},
        [r["total"] for r in rows if r["bias"]], block["parts"],
        title=f"d_model = {args.d_model}: attention parameters do not depend on h; the block has d_ff = {args.d_ff}",
    )
    save_figure(fig, out / "params.png")
    print(text)
    print(f"wrote {out}/results.json, table.md, params.png")
    return results


if __name__ == "__main__":
    common.cli(main, "experiments.param_count")
