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

    python -m experiments.attention_maps                    # the full preset's h=8 seed-0 model
    python -m experiments.attention_maps --untrained        # a freshly initialised model: no structure yet
    python -m experiments.attention_maps --checkpoint results/head_ablation/full/checkpoints/h4_seed0.msgpack

The model is chosen as in experiments.head_pruning (the first line of output names it
and says why); without a checkpoint of the preset's model one is trained.

Writes to --out (default results/attention_maps/<preset>/): layer{l}.png per layer,
offset_profile.png, results.json.

With `--task lm` (seed 000, exercise 2: attention on real sentences) it draws the
character language models of `head_ablation --task lm`: one held-out sentence from the
validation split, its characters on both axes, one figure per layer for each of the
1-, 4- and 16-head models (`--heads` picks one), each head titled with its measured
type (`jax_mha.lab.head_types`). Writes h{H}_layer{l}.png and results.json to
results/attention_maps/lm-<preset>/.

    python -m experiments.attention_maps --task lm --preset quick
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common, plotting
from experiments.common import Interrupted, save_figure, write_json
from jax_mha.lab import analysis, head_types
from jax_mha.lab.data import task_to_dict
from jax_mha.lab.models import Decoder

MODULE = "experiments.attention_maps"


def parse(argv):
    """`(args, ModelSpec)`; every bad value ends in `error:` and exit 2."""
    p = common.parser(MODULE, "Draw per-head attention heatmaps of a copy-task model for one sequence and find the "
                              "retrieval head (most weight on key = query - L); with --task lm, per-head maps of "
                              "a held-out sentence for the 1-, 4- and 16-head language models.",
                      common.PRESETS, common.LM_PRESETS)
    common.add_model_args(p)
    p.add_argument("--untrained", action="store_true",
                   help="draw a freshly initialised model of the preset (seed --seed) instead of a trained one")
    p.add_argument("--example", type=common.nonnegative_int, default=0,
                   help="which held-out sequence to draw (index into the statistics batch; default 0)")
    p.add_argument("--stats-size", type=common.positive_int, default=256,
                   help="held-out sequences the per-head offset statistics average over (default 256)")
    p.add_argument("--out", type=Path, help="output folder (default results/attention_maps/<preset>)")
    args = p.parse_args(argv)
    if args.example >= args.stats_size:
        p.error(f"--example {args.example} must be below --stats-size {args.stats_size}")
    spec = common.build_or_exit(p, lambda: common.model_spec(args))
    if args.out is None:
        args.out = common.default_out("attention_maps", args.preset, args.task)
    return args, spec


def untrained(spec: common.ModelSpec) -> common.StudyModel:
    task = spec.ablation.task
    params = jax.jit(Decoder(spec.model).init)(jax.random.PRNGKey(spec.seed), jnp.zeros((1, task.seq_len), jnp.int32))
    print(f"model: untrained, the --preset {spec.preset} model with {spec.heads} heads initialised from seed "
          f"{spec.seed} ({common.describe_model(spec.model, task)})", flush=True)
    return common.StudyModel(params["params"], spec.model, task, {"kind": "untrained", "path": "", "seed": spec.seed,
                                                                  "why": "--untrained"})


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


def statistics(m: common.StudyModel, args) -> dict:
    """Attention weights of the statistics batch and each head's offset profile."""
    batch = jax.jit(lambda key: m.task.batch(key, args.stats_size))(jax.random.key(common.ANALYSIS_EVAL_SEED))
    weights = np.asarray(analysis.attention_weights(m.params, Decoder(m.config), batch["inputs"]))  # (layers, B, H, T, T)
    profile = np.asarray(analysis.offset_profile(jnp.asarray(weights), batch["scored"]))  # (layers, H, T)
    at_l = profile[..., m.task.length]
    layer, head = np.unravel_index(int(np.argmax(at_l)), at_l.shape)
    retrieval = {"layer": int(layer), "head": int(head), "weight_at_offset_L": float(at_l[layer, head]),
                 "dominant_offset": int(profile[layer, head].argmax())}
    return {"tokens": np.asarray(batch["inputs"][args.example]), "weights": weights, "profile": profile,
            "retrieval": retrieval}


def draw(m: common.StudyModel, stats: dict, args) -> None:
    """layer{l}.png (one heatmap per head) and offset_profile.png."""
    length, profile, r = m.task.length, stats["profile"], stats["retrieval"]
    at_l = profile[..., length]
    kind = {"untrained": "untrained", "trained": "freshly trained", "checkpoint": "trained"}[m.source["kind"]]
    for l in range(m.config.num_layers):
        titles = [f"head {h}: w(q−L) = {at_l[l, h]:.2f}" + (" ◀ retrieval" if (l, h) == (r["layer"], r["head"]) else "")
                  for h in range(m.config.num_heads)]
        save_figure(plotting.attention_grid(
            stats["weights"][l, args.example], stats["tokens"], titles=titles, stripe_offset=length, ncols=4,
            suptitle=(f"Layer {l} attention, {kind} {m.config.num_heads}-head copy model, held-out sequence "
                      f"#{args.example} (L={length})\nw(q−L): mean weight on key = query − L over the scored "
                      f"queries of {args.stats_size} sequences; dotted line: that diagonal")), args.out / f"layer{l}.png")
    save_figure(offset_figure(profile, length, f"Where each head looks: mean weight by offset at scored queries "
                                               f"({kind} model, {args.stats_size} sequences)"), args.out / "offset_profile.png")


def report(m: common.StudyModel, stats: dict, args) -> None:
    profile, length, r = stats["profile"], m.task.length, stats["retrieval"]
    print(f"\nmodel: {m.source['kind']} {m.source.get('path', '')} ({common.describe_model(m.config, m.task)})")
    print("mean weight on key = query - L at scored queries (rows: layers, columns: heads)")
    for l in range(m.config.num_layers):
        print(f"  layer {l}: " + " ".join(f"{v:.2f}" for v in profile[l, :, length]))
    print("dominant offset per head")
    for l in range(m.config.num_layers):
        print(f"  layer {l}: " + " ".join(f"{v:>4d}" for v in profile[l].argmax(-1)))
    print(f"retrieval head: layer {r['layer']} head {r['head']}, weight {r['weight_at_offset_L']:.3f} on key = query - "
          f"{length} (and {profile[r['layer'], r['head'], length + 1]:.3f} on query - {length + 1})")
    print(f"wrote {args.out}/layer*.png, offset_profile.png, results.json")


# ----------------------------------------------------------------- the language model (--task lm)

LM_HEADS = (1, 4, 16)  # the three models: one head, a few, many narrow ones


def lm_specs(args, spec: common.ModelSpec) -> list[common.ModelSpec]:
    """The models to draw: `--heads` (or `--checkpoint`), else those of 1, 4, 16 heads the preset trains."""
    if args.heads is not None or args.checkpoint is not None:
        return [spec]
    heads = [h for h in LM_HEADS if h in spec.ablation.heads] or [spec.ablation.analysis_heads]
    return [dataclasses.replace(spec, heads=h) for h in heads]


def lm_titles(m: common.StudyModel, tokens: np.ndarray) -> tuple[np.ndarray, list[list[str]], list[dict]]:
    """Attention weights `(layers, H, T, T)` on the sentence, and per-head titles naming
    each head's type and scores (measured on validation windows, not just this sentence)."""
    model = Decoder(m.config)
    weights = np.asarray(analysis.attention_weights(m.params, model, jnp.asarray(tokens)[None]))[:, 0]
    text = m.task.eval_batch(None, 32)["inputs"]
    scores = analysis.model_head_scores(m.params, model, text, key=jax.random.key(common.ANALYSIS_EVAL_SEED))
    labels = head_types.classify_heads(scores)
    titles = [[f"head {h}: {labels[l, h].replace('_', '-')}\nprev {float(scores.previous_token[l, h]):.2f}, "
               f"ind {float(scores.induction[l, h]):.2f}, first {float(scores.first_token[l, h]):.2f}"
               for h in range(m.config.num_heads)] for l in range(m.config.num_layers)]
    return weights, titles, head_types.head_type_table(scores, labels)


def lm_main(args, spec: common.ModelSpec) -> dict:
    """Per-layer maps of one validation sentence for each model; returns the record."""
    task = spec.ablation.task
    tokens = common.sentence_windows(task, task.seq_len, args.example + 1)[args.example]  # (T,)
    sentence = task.corpus.decode(tokens)
    labels = plotting.char_labels(sentence)
    machine = f"{common.cpu_model()}"
    record = {"config": {"task": task_to_dict(task), "preset": args.preset, "example": args.example},
              "metadata": common.run_metadata(), "sentence": sentence, "models": {}}
    for s in lm_specs(args, spec):
        m = common.find_model(s, args.out, args.checkpoint, args.retrain) or common.train_model(
            s, args.out, not args.no_progress)
        weights, titles, table = lm_titles(m, tokens)
        for l in range(m.config.num_layers):
            save_figure(plotting.attention_grid(
                weights[l], tokens, labels=labels, titles=titles[l], ncols=2 if m.config.num_heads <= 4 else 4,
                label_fontsize=7.0, unit="character; ␣ space, ↵ newline",
                suptitle=(f"Layer {l} of the {m.config.num_heads}-head character LM ({m.config.num_layers} "
                          f"layer{'s' if m.config.num_layers > 1 else ''}, d_model={m.config.d_model}): a held-out sentence (validation topics of the Python "
                          f"reference)\nrows: query character, columns: key character; head type measured on "
                          f"validation text (trained on {machine})")),
                args.out / f"h{m.config.num_heads}_layer{l}.png")
        record["models"][str(m.config.num_heads)] = {"source": m.source, "head_types": table}
        print(f"h={m.config.num_heads}: " + ", ".join(f"L{r['layer']}H{r['head']} {r['type']}" for r in table))
    write_json(args.out / "results.json", record)
    print(f"sentence: {sentence!r}\nwrote {args.out}/h*_layer*.png and results.json")
    return record


def main(argv=None) -> dict:
    common.start_study()
    args, spec = parse(argv)
    common.use_agg_backend()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.task == "lm":
        if args.untrained:
            raise SystemExit("error: --untrained is for the copy task")
        try:
            return lm_main(args, spec)
        except KeyboardInterrupt:
            raise Interrupted("the models are saved in their checkpoints; the maps were not finished",
                              resumes=False) from None
    if args.untrained:
        m = untrained(spec)
    else:
        m = common.find_model(spec, args.out, args.checkpoint, args.retrain) or common.train_model(
            spec, args.out, not args.no_progress)
    try:
        stats = statistics(m, args)
        draw(m, stats, args)
    except KeyboardInterrupt:
        raise Interrupted(f"the model is saved in {m.source['path'] or '(untrained: nothing to save)'}; the maps "
                          "were not finished", resumes=False) from None
    profile, length = stats["profile"], m.task.length
    results = {
        "config": {"task": task_to_dict(m.task), "model": dataclasses.asdict(m.config), "preset": args.preset,
                   "example": args.example, "stats_size": args.stats_size, "eval_seed": common.ANALYSIS_EVAL_SEED},
        "metadata": common.run_metadata(), "source": m.source, "example_tokens": stats["tokens"],
        "weight_at_offset_L": profile[..., length], "weight_at_offset_L_plus_1": profile[..., length + 1],
        "dominant_offset": profile.argmax(-1), "weight_at_dominant_offset": profile.max(-1),
        "offset_profile": profile, "retrieval_head": stats["retrieval"],
    }
    write_json(args.out / "results.json", results)
    report(m, stats, args)
    return results


if __name__ == "__main__":
    common.cli(main, MODULE)
