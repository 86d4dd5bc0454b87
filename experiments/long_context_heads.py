"""Per-head attention statistics of a character language model reading 16,384 characters.

An attention map of 16,384 characters would be a 16,384 x 16,384 array per head (1 GiB
in float32); `jax_mha.attention_statistics` reads the same model's heads
blockwise instead: for every query the entropy of its weights, for every key the
weight it receives, summed over queries. The study trains a small character model of
the harness (`jax_mha.lab.models.Decoder`, sinusoidal positions, so the 16,384
positions of the read need no table beyond its training windows) on short windows of
the Python Language Reference, reads the first 16,384 characters of the held-out test
split in one causal pass, and draws each head's entropy along the sequence and the
attention each key receives, beside uniform attention over the visible keys (entropy
`ln(i + 1)` at query i; key j receives `Σ_{i >= j} 1/(i + 1)`), and the model's loss
along the text. Past its training windows the model has never seen a position, and
the figure shows what its heads do there (docs/statistics.md discusses it).

    python -m experiments.long_context_heads          # a few minutes on a 2-core CPU
    python -m experiments.long_context_heads --smoke  # seconds: a tiny model, 512 characters

Writes docs/long_context_heads.png and docs/results/data/long_context_heads.json (the
plotted numbers, the model and training, timings and the machine); with `--out DIR`
both go to DIR.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from experiments.common_tables import table
from jax_mha import attention, attention_statistics
from jax_mha.lab.models import Decoder, ModelConfig
from jax_mha.lab.text import TextTaskConfig, bits_per_character
from jax_mha.lab.train import TrainConfig, train_seeds

MODULE = "experiments.long_context_heads"
FIGURE, DATA = Path("docs/long_context_heads.png"), Path("docs/results/data/long_context_heads.json")


@dataclasses.dataclass(frozen=True)
class Preset:
    """What the study trains and reads."""

    length: int = 16_384  # characters read in one pass
    train_seq_len: int = 128  # the training windows: the model has never seen a position past this
    d_model: int = 64  # small: the whole run fits a few minutes of a 2-core CPU
    num_heads: int = 4
    num_layers: int = 2  # room for a previous-token head feeding an induction head
    # None: no training, the seeded initialisation is read (the smoke run)
    train: TrainConfig | None = TrainConfig(batch_size=32, num_steps=400, learning_rate=6e-3, warmup_steps=50,
                                            steps_per_call=50, eval_every=200, eval_size=32, early_stop=False)
    bins: int = 48  # log-spaced position bins of the figure
    seed: int = 0


def smoke() -> Preset:
    """Seconds: 512 characters read by an untrained one-layer d_model=8 model (the
    trainer is tested elsewhere; here compiling it would be most of the run)."""
    return Preset(length=512, train_seq_len=16, d_model=8, num_heads=2, num_layers=1, bins=12, train=None)


def parse(argv):
    p = common.parser(MODULE, "Train a small character LM and read 16,384 held-out characters with it: per-head "
                              "attention entropy along the sequence and attention received per key, blockwise "
                              "(no 16k x 16k array).")
    p.add_argument("--smoke", action="store_true", help="a tiny model and 512 characters, in seconds (for tests)")
    p.add_argument("--out", type=Path, help="folder for the figure and the JSON (default: docs/ and docs/results/data/)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def train(preset: Preset, progress: bool):
    """`(params, config, task, training record)`: the model trained on `train_seq_len`
    windows, or only initialised (seed `preset.seed`) when `preset.train` is None."""
    task = TextTaskConfig(seq_len=preset.train_seq_len)
    config = ModelConfig(vocab_size=task.vocab_size, max_len=preset.train_seq_len, d_model=preset.d_model,
                         d_ff=4 * preset.d_model, num_heads=preset.num_heads, num_layers=preset.num_layers,
                         positional="sinusoidal")
    if preset.train is None:
        params = jax.jit(Decoder(config).init)(jax.random.PRNGKey(preset.seed), jnp.zeros((1, 1), jnp.int32))
        return params["params"], config, task, {"steps": 0, "wall_seconds": 0.0, "final_dev_bpc": None}
    bar = common.TrainingBar(preset.train.num_steps, "training", not progress)
    try:
        result = train_seeds(config, task, preset.train, [preset.seed], callback=bar)
    finally:
        bar.close()
    params = jax.tree.map(lambda x: x[0], result.state.params)
    record = {"steps": result.steps_run, "wall_seconds": result.wall_seconds,
              "final_dev_bpc": float(np.asarray(result.evals["bpc"])[0, -1])}
    return params, config, task, record


@functools.partial(jax.jit, static_argnames="config")
def read(params, config: ModelConfig, tokens):
    """`(bpc per position (T,), statistics of every layer)`: one causal pass over
    `tokens (1, T)`; each layer's attention runs blockwise and is measured by
    `attention_statistics` on the same q, k, v (dicts of `(1, H, T)` arrays)."""
    captured = []

    def attention_fn(q, k, v, *, return_weights=False, implementation=None, **kw):
        del implementation
        visibility = {name: x for name, x in kw.items() if name not in ("dropout_rate", "dropout_rng", "deterministic")}
        captured.append(attention_statistics(q, k, v, implementation="blockwise", **visibility))
        return attention(q, k, v, return_weights=return_weights, implementation="blockwise", **kw)

    logits = Decoder(config, attention_fn=attention_fn).apply({"params": params}, tokens[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    nats = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[0, :, 0]
    return bits_per_character(nats), captured


def log_bins(length: int, count: int) -> np.ndarray:
    """Bin edges `0 = e_0 < e_1 < … = length`, log-spaced past the first position."""
    return np.unique(np.concatenate([[0], np.round(np.geomspace(1, length, count)).astype(int), [length]]))


def binned(x: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Means of `x (…, T)` over the position bins `[e_k, e_{k+1})`: `(…, bins)`."""
    return np.stack([x[..., lo:hi].mean(-1) for lo, hi in zip(edges[:-1], edges[1:])], axis=-1)


def uniform_reference(length: int) -> tuple[np.ndarray, np.ndarray]:
    """Causal uniform attention: `(entropy at each query ln(i + 1), received by each key Σ_{i>=j} 1/(i+1))`."""
    i = np.arange(length)
    received = np.cumsum((1.0 / (i + 1))[::-1])[::-1]
    return np.log(i + 1.0), received


def measure(preset: Preset, params, config, task) -> dict:
    """The read and its binned numbers."""
    tokens = np.asarray(task.corpus.test[: preset.length + 1], np.int32)[None]
    read_config = dataclasses.replace(config, max_len=preset.length)
    start = time.perf_counter()
    bpc, stats = jax.block_until_ready(read(params, read_config, jnp.asarray(tokens)))
    seconds = time.perf_counter() - start
    entropy = np.stack([np.asarray(s["entropy"])[0] for s in stats])  # (layers, H, T)
    received = np.stack([np.asarray(s["received"])[0] for s in stats])  # (layers, H, T)
    top = np.stack([np.asarray(s["max_weight"])[0] for s in stats])
    edges = log_bins(preset.length, preset.bins)
    uniform_entropy, uniform_received = uniform_reference(preset.length)
    spans = summary_spans(preset)
    return {
        "summary_spans": spans, "summary": summary(entropy, top, received, uniform_entropy, uniform_received, spans),
        "bin_edges": edges, "bin_centers": np.sqrt(np.maximum(edges[:-1], 0.5) * edges[1:]),
        "entropy": binned(entropy, edges), "uniform_entropy": binned(uniform_entropy, edges),
        "received": binned(received, edges), "uniform_received": binned(uniform_received, edges),
        "max_weight": binned(top, edges), "received_total": received.sum(-1), "received_first_key": received[..., 0],
        "bpc": binned(np.asarray(bpc), edges), "bpc_mean": float(np.mean(bpc)),
        "bpc_within_training_window": float(np.mean(np.asarray(bpc)[: preset.train_seq_len])),
        "read_seconds": seconds, "text": task.corpus.decode(tokens[0, :200]),
    }


def summary_spans(preset: Preset) -> list[list[int]]:
    """Query positions `[lo, hi)` the summary table averages over: inside the training
    window, the window's length right after it, and the last eighth of the text."""
    w, n = preset.train_seq_len, preset.length
    return [[0, w], [w, 2 * w], [n - n // 8, n]]


def summary(entropy, top, received, uniform_entropy, uniform_received, spans) -> dict:
    """Per layer and head: mean entropy and max_weight over each span of queries, and the
    weight the first character receives; the same for uniform attention."""
    mean = lambda x, lo, hi: x[..., lo:hi].mean(-1)
    return {"entropy": [mean(entropy, lo, hi) for lo, hi in spans],
            "uniform_entropy": [float(mean(uniform_entropy, lo, hi)) for lo, hi in spans],
            "max_weight": [mean(top, lo, hi) for lo, hi in spans],
            "uniform_max_weight": [float(mean(1.0 / np.arange(1.0, len(uniform_entropy) + 1), lo, hi)) for lo, hi in spans],
            "received_first": received[..., 0], "uniform_received_first": float(uniform_received[0])}


def summary_table(data: dict) -> dict:
    """The results page's table (`experiments.report`'s literal kind): one row per head."""
    spans, sm = data["summary_spans"], data["summary"]
    name = lambda lo, hi: f"{lo:,}–{hi - 1:,}"
    header = (["layer", "head"] + [f"entropy, queries {name(*s)} (nats)" for s in spans]
              + [f"max weight, {name(*spans[0])} / {name(*spans[-1])}", "weight received by the first character"])
    rows = []
    layers, heads = np.shape(sm["received_first"])
    for layer in range(layers):
        for h in range(heads):
            rows.append([str(layer), str(h)] + [f"{e[layer][h]:.2f}" for e in sm["entropy"]]
                        + [f"{sm['max_weight'][0][layer][h]:.2g} / {sm['max_weight'][-1][layer][h]:.2g}",
                           f"{sm['received_first'][layer][h]:.1f}"])
    rows.append(["uniform", "–"] + [f"{e:.2f}" for e in sm["uniform_entropy"]]
                + [f"{sm['uniform_max_weight'][0]:.2g} / {sm['uniform_max_weight'][-1]:.2g}",
                   f"{sm['uniform_received_first']:.1f}"])
    return {"header": header, "align": ["r"] * len(header), "rows": rows}


def figure(data: dict, preset: Preset, title: str):
    """Entropy (top) and received attention (middle) per head, one column per layer;
    the model's bits per character along the text (bottom)."""
    import matplotlib.pyplot as plt

    layers, heads = data["entropy"].shape[:2]
    fig, axes = plt.subplots(3, layers, figsize=(6.0 * layers, 9.0), squeeze=False, sharex=True,
                             gridspec_kw={"height_ratios": [3, 3, 1.4]})
    colors = plt.cm.tab10(np.arange(heads) % 10)
    x = data["bin_centers"]
    for layer in range(layers):
        top, middle, bottom = axes[:, layer]
        for h in range(heads):
            top.plot(x, data["entropy"][layer, h], color=colors[h], label=f"head {h}")
            middle.plot(x, data["received"][layer, h], color=colors[h], label=f"head {h}")
        top.plot(x, data["uniform_entropy"], "k--", lw=1, label="uniform over visible keys")
        middle.plot(x, data["uniform_received"], "k--", lw=1, label="uniform over visible keys")
        bottom.plot(x, data["bpc"], color="black", lw=1, label="bits per character (next-character loss)")
        for ax in (top, middle, bottom):
            ax.axvline(preset.train_seq_len, color="grey", ls=":", lw=1, label=f"training window ({preset.train_seq_len})")
            ax.set_xscale("log")
            ax.grid(alpha=0.3)
        top.set(title=f"layer {layer}", ylabel="entropy of the query's weights (nats)")
        middle.set(yscale="log", ylabel="attention received by the key\n(weight summed over queries)")
        bottom.set(xlabel="position in the text (characters, log scale)", ylabel="model bpc")
    axes[0, -1].legend(fontsize=8, loc="upper left")
    axes[2, -1].legend(fontsize=8, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def title(preset: Preset, config: ModelConfig, training: dict, machine: str) -> str:
    trained = (f"untrained (initialised from seed {preset.seed})" if not training["steps"] else
               f"trained {training['steps']} steps on {preset.train_seq_len}-character windows (dev "
               f"{training['final_dev_bpc']:.2f} bpc)")
    return (f"Per-head attention statistics over {preset.length:,} held-out characters of the Python Language "
            f"Reference, one causal pass\nCharacter LM, d_model={config.d_model}, {config.num_heads} heads, "
            f"{config.num_layers} layer(s), sinusoidal positions, {trained}; position bins log-spaced"
            f"\nattention_statistics, blockwise, on {machine}")


def main(argv=None) -> dict:
    common.start_study()
    args = parse(argv)
    common.use_agg_backend()
    preset = smoke() if args.smoke else Preset()
    figure_path, data_path = (FIGURE, DATA) if args.out is None else (args.out / FIGURE.name, args.out / DATA.name)
    start = time.perf_counter()
    params, config, task, training = train(preset, not args.no_progress)
    data = measure(preset, params, config, task)
    machine = common.cpu_model()
    record = {"kind": "literal", "traced": True,
              "note": ("the table is computed by experiments.long_context_heads from the statistics of one read; "
                       "the arrays below are the figure's"),
              "tables": {"heads": summary_table(data)},
              "config": {"length": preset.length, "train_seq_len": preset.train_seq_len, "seed": preset.seed,
                         "model": dataclasses.asdict(config), "train": preset.train and dataclasses.asdict(preset.train),
                         "text": f"{task.corpus.source}, test split, first {preset.length + 1} characters",
                         "smoke": args.smoke},
              "metadata": common.run_metadata(), "machine": machine, "training": training, **data,
              "total_seconds": time.perf_counter() - start}
    figure_path.parent.mkdir(parents=True, exist_ok=True)
    common.save_figure(figure(data, preset, title(preset, config, training, machine)), figure_path)
    common.write_json(data_path, record)
    print(f"trained {training['steps']} steps in {training['wall_seconds']:.0f} s; read {preset.length} characters in "
          f"{data['read_seconds']:.1f} s ({data['bpc_mean']:.3f} bpc)")
    heads = record["tables"]["heads"]
    print(table(heads["header"], heads["align"], heads["rows"]))
    print(f"wrote {figure_path} and {data_path}")
    return record


if __name__ == "__main__":
    common.cli(main, MODULE)
