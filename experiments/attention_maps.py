"""Per-head attention maps of the copy-task model (seed 000 §8, seed 004 §12.8).

One figure per layer: a grid with one heatmap per head for one held-out sequence,
input tokens on both axes (query rows, key columns). Beside the pictures, numbers
over many sequences: for every head, the mean weight at each query−key offset over
the scored queries (the second copy), its dominant offset, and which head is the
retrieval head — the one that puts the most weight on the copy diagonal.

Where the copy stripe sits: the sequence is `<s> x1 … xL | x1 … xL </s>`. The query
at input position t predicts token t+1; in the second copy that is x_{t-L}, which
sits at input position t−L. So a head that fetches the token to copy attends
key = query − L in these (input × input) maps — the same thing as "target looks
L+1 tokens back" in token positions.

    python -m experiments.attention_maps                    # trained checkpoint (or trains one, ~2 min)
    python -m experiments.attention_maps --untrained        # a freshly initialised model: no structure yet
    python -m experiments.attention_maps --checkpoint results/head_ablation/checkpoints/h4_seed0.msgpack

Writes to --out (default results/attention_maps/): layer{l}.png per layer,
offset_profile.png, results.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from experiments import plotting
from experiments.common import run_metadata, save_figure, use_agg_backend, write_json
from experiments.head_pruning import add_model_source_args, build_config, load_or_train
from jax_mha import analysis
from jax_mha.data import make_batch
from jax_mha.models import CopyTransformer


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m experiments.attention_maps",
        description="Draw per-head attention heatmaps of the copy-task model for one sequence and find the "
                    "retrieval head (most weight on key = query - L).",
    )
    add_model_source_args(p)
    p.add_argument("--untrained", action="store_true",
                   help="draw a freshly initialised model (seed --seed) instead of a trained one")
    p.add_argument("--example", type=int, default=0, help="which held-out sequence to draw (index into the stats batch)")
    p.add_argument("--stats-size", type=int, default=256,
                   help="held-out sequences the per-head offset statistics average over")
    p.add_argument("--out", type=Path, default=Path("results/attention_maps"), help="output folder")
    return p.parse_args(argv)


def offset_figure(profile: np.ndarray, length: int, title: str):
    """Mean weight per query−key offset for every head, one panel per layer."""
    import matplotlib.pyplot as plt

    n_layers, n_heads, t_len = profile.shape
    fig, axes = plt.subplots(1, n_layers, figsize=(6.2 * n_layers, 3.8), squeeze=False, sharey=True)
    colors = plt.cm.tab20(np.linspace(0, 1, max(n_heads, 2)))
    for layer, ax in enumerate(axes[0]):
        for h in range(n_heads):
            ax.plot(np.arange(t_len), profile[layer, h], "-", marker=".", ms=3, color=colors[h], label=f"head {h}")
        ax.axvline(length, color="black", ls=":", lw=1, label=f"offset L = {length}")
        ax.set(title=f"layer {layer}", xlabel="query − key offset (0 = the query itself)",
               ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("mean attention weight\n(scored queries)")
    axes[0, -1].legend(fontsize=7, ncol=2, loc="upper right")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg = build_config(args)
    use_agg_backend()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    if args.untrained:
        model_cfg, task = cfg.model, cfg.task
        model = CopyTransformer(model_cfg)
        params = model.init(jax.random.PRNGKey(cfg.seed), jnp.zeros((1, task.seq_len), jnp.int32))["params"]
        source = {"kind": "untrained", "seed": cfg.seed}
    else:
        params, model_cfg, task, source = load_or_train(
            cfg, checkpoint=args.checkpoint, retrain=args.retrain, out=out, progress=not args.no_progress)
        model = CopyTransformer(model_cfg)
    if not 0 <= args.example < args.stats_size:
        raise SystemExit(f"error: --example {args.example} must be in [0, --stats-size={args.stats_size})")

    batch = jax.jit(make_batch, static_argnums=(1, 2))(jax.random.key(cfg.eval_seed), task, args.stats_size)
    weights = np.asarray(analysis.attention_weights(params, model, batch["inputs"]))  # (layers, B, H, T, T)
    profile = np.asarray(analysis.offset_profile(jnp.asarray(weights), batch["scored"]))  # (layers, H, T)
    length = task.length
    at_l, at_l1 = profile[..., length], profile[..., length + 1]
    layer, head = np.unravel_index(int(np.argmax(at_l)), at_l.shape)
    retrieval = {"layer": int(layer), "head": int(head), "weight_at_offset_L": float(at_l[layer, head]),
                 "dominant_offset": int(profile[layer, head].argmax())}

    tokens = np.asarray(batch["inputs"][args.example])
    kind = {"untrained": "untrained", "trained": "freshly trained", "checkpoint": "trained"}[source["kind"]]
    for l in range(model_cfg.num_layers):
        titles = [f"head {h}: w(q−L) = {at_l[l, h]:.2f}" + (" ◀ retrieval" if (l, h) == (layer, head) else "")
                  for h in range(model_cfg.num_heads)]
        fig = plotting.attention_grid(
            weights[l, args.example], tokens, titles=titles, stripe_offset=length, ncols=4,
            suptitle=(f"Layer {l} attention, {kind} {model_cfg.num_heads}-head copy model, held-out sequence "
                      f"#{args.example} (L={length})\nw(q−L): mean weight on key = query − L over the scored "
                      f"queries of {args.stats_size} sequences; dotted line: that diagonal"),
        )
        save_figure(fig, out / f"layer{l}.png")
    save_figure(offset_figure(profile, length, f"Where each head looks: mean weight by offset at scored queries "
                                                f"({kind} model, {args.stats_size} sequences)"), out / "offset_profile.png")

    results = {
        "config": {"task": dataclasses.asdict(task), "model": dataclasses.asdict(model_cfg),
                   "example": args.example, "stats_size": args.stats_size, "eval_seed": cfg.eval_seed},
        "metadata": run_metadata(),
        "source": source,
        "example_tokens": tokens,
        "weight_at_offset_L": at_l,
        "weight_at_offset_L_plus_1": at_l1,
        "dominant_offset": profile.argmax(-1),
        "weight_at_dominant_offset": profile.max(-1),
        "offset_profile": profile,
        "retrieval_head": retrieval,
    }
    write_json(out / "results.json", results)

    print(f"\nmodel: {source['kind']} {source.get('path', '')} ({model_cfg.num_layers} layers x {model_cfg.num_heads} heads, L={length})")
    print("mean weight on key = query - L at scored queries (rows: layers, columns: heads)")
    for l in range(model_cfg.num_layers):
        print(f"  layer {l}: " + " ".join(f"{v:.2f}" for v in at_l[l]))
    print("dominant offset per head")
    for l in range(model_cfg.num_layers):
        print(f"  layer {l}: " + " ".join(f"{v:>4d}" for v in profile[l].argmax(-1)))
    print(f"retrieval head: layer {layer} head {head}, weight {at_l[layer, head]:.3f} on key = query - {length} "
          f"(and {at_l1[layer, head]:.3f} on query - {length + 1})")
    print(f"wrote {out}/layer*.png, offset_profile.png, results.json")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
