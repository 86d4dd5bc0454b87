"""Matplotlib figures shared by the experiments.

Each function takes plain NumPy data and returns a `Figure` (save it with
`experiments.common.save_figure`, which also closes it); none of them reads files or
knows about an experiment's results layout. Call `experiments.common.use_agg_backend()`
before the first figure.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from jax_mha.lab.data import BOS, EOS, FIRST_SYMBOL, PAD, SEP

_SPECIAL = {PAD: "_", BOS: "<s>", SEP: "|", EOS: "</s>"}


def token_labels(tokens: Sequence[int]) -> list[str]:
    """Readable labels for copy-task tokens: specials as `<s> | </s> _`, content
    symbols as letters `a, b, …` (symbol 0 = `a`)."""
    out = []
    for t in np.asarray(tokens).tolist():
        if t in _SPECIAL:
            out.append(_SPECIAL[t])
        else:
            i = t - FIRST_SYMBOL
            out.append(chr(ord("a") + i) if 0 <= i < 26 else str(i))
    return out


def char_labels(text: str) -> list[str]:
    """Readable axis labels for characters: space as `␣`, newline as `↵`, tab as `→`."""
    return [{" ": "␣", "\n": "↵", "\t": "→"}.get(ch, ch) for ch in text]


def attention_grid(
    weights: np.ndarray,
    tokens: Sequence[int],
    *,
    titles: Sequence[str],
    suptitle: str,
    ncols: int = 4,
    stripe_offset: int | None = None,
    cmap: str = "viridis",
    labels: Sequence[str] | None = None,
    label_fontsize: float | None = None,
    unit: str = "input token",
):
    """Per-head attention heatmaps for one sequence, a grid of subplots.

    Args:
      weights: `(n, T, T)`, one map per panel (query rows, key columns).
      tokens: `(T,)` input tokens, labelling both axes.
      titles: one title per panel.
      suptitle: the figure title.
      ncols: panels per row.
      stripe_offset: if set, a thin dashed guide on key = query − offset.
      cmap: colormap; one shared colorbar (0 to 1) for every panel.
      labels: `(T,)` axis labels instead of `token_labels(tokens)` (e.g. `char_labels`).
      label_fontsize: points for the axis labels (default: smaller as T grows); the
        panels grow with it so every label keeps its own row and column.
      unit: what the axes count, in "query (unit)" and "key (unit)".

    Returns:
      the figure.
    """
    import matplotlib.pyplot as plt

    n, t_len, _ = weights.shape
    ncols = max(1, min(ncols, n))
    nrows = -(-n // ncols)
    fontsize = max(3.5, min(8.0, 260.0 / t_len)) if label_fontsize is None else label_fontsize
    size = 2.0 + 0.085 * t_len * fontsize / max(3.5, min(8.0, 260.0 / t_len))  # inches per panel: one label per token
    fig, axes = plt.subplots(nrows, ncols, figsize=(size * ncols + 1.2, size * nrows + 0.9), squeeze=False)
    labels = token_labels(tokens) if labels is None else list(labels)
    image = None
    for i, ax in enumerate(axes.flat):
        if i >= n:
            ax.set_visible(False)
            continue
        image = ax.imshow(weights[i], cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest")
        if stripe_offset is not None and stripe_offset < t_len:
            q = np.arange(stripe_offset, t_len)
            ax.plot(q - stripe_offset, q, ls=(0, (1, 3)), color="white", lw=0.6, alpha=0.6)
            ax.set_xlim(-0.5, t_len - 0.5)
            ax.set_ylim(t_len - 0.5, -0.5)
        ax.set_title(titles[i], fontsize=9)
        ax.set_xticks(range(t_len), labels, rotation=90, fontsize=fontsize)
        ax.set_yticks(range(t_len), labels, fontsize=fontsize)
        ax.tick_params(length=1.5, pad=1)
        if i % ncols == 0:
            ax.set_ylabel(f"query ({unit})", fontsize=8)
        if i // ncols == nrows - 1 or i + ncols >= n:
            ax.set_xlabel(f"key ({unit})", fontsize=8)
    fig.suptitle(suptitle, fontsize=11)
    fig.tight_layout(rect=(0, 0, 0.93, 1))
    cax = fig.add_axes((0.945, 0.15, 0.012, 0.7))
    fig.colorbar(image, cax=cax, label="attention weight")
    return fig


def layer_head_heatmaps(
    panels: Sequence[tuple[np.ndarray, str, str]],
    *,
    suptitle: str,
    marks: np.ndarray | None = None,
    fmt: str = "{:.2f}",
    cmap: str = "magma",
):
    """Side-by-side `(num_layers, H)` heatmaps with values written in the cells.

    Args:
      panels: `(values (L, H), title, colorbar label)` per panel.
      suptitle: the figure title.
      marks: optional bool `(L, H)`; marked cells get a cyan frame in every panel.
      fmt: cell text format.
      cmap: colormap.

    Returns:
      the figure.
    """
    import matplotlib.pyplot as plt

    n_layers, n_heads = panels[0][0].shape
    fig, axes = plt.subplots(1, len(panels), figsize=(len(panels) * (1.2 + 0.75 * n_heads), 1.6 + 0.75 * n_layers), squeeze=False)
    for ax, (values, title, label) in zip(axes[0], panels):
        values = np.asarray(values, float)
        image = ax.imshow(values, cmap=cmap, aspect="auto")
        fig.colorbar(image, ax=ax, label=label, fraction=0.05, pad=0.03)
        lo, hi = np.nanmin(values), np.nanmax(values)
        for (l, h), v in np.ndenumerate(values):
            light = hi > lo and (v - lo) / (hi - lo) < 0.55
            ax.text(h, l, fmt.format(v), ha="center", va="center", fontsize=8, color="white" if light else "black")
        if marks is not None:
            for l, h in zip(*np.nonzero(marks)):
                ax.add_patch(plt.Rectangle((h - 0.5, l - 0.5), 1, 1, fill=False, ec="cyan", lw=2))
        ax.set(title=title, xlabel="head", ylabel="layer", xticks=range(n_heads), yticks=range(n_layers))
    fig.suptitle(suptitle, fontsize=11)
    fig.tight_layout()
    return fig


def _pruning_curves(ax, curves: dict, heads_prunable: dict, total_heads: int) -> None:
    """One line per pruning order (`label -> (fractions, metric)`), a star where its
    stop rule ended (`heads_prunable[label]` heads pruned)."""
    styles = ["o-", "s--", "^-.", "d:"]
    for i, (label, (fractions, values)) in enumerate(curves.items()):
        (line,) = ax.plot(fractions, values, styles[i % len(styles)], ms=4, label=label)
        k = heads_prunable.get(label)
        if k is not None:
            idx = int(np.argmin(np.abs(np.asarray(fractions) - k / total_heads)))
            ax.plot([fractions[idx]], [values[idx]], "*", ms=15, color=line.get_color(), mec="black",
                    label=f"{label}: {k}/{total_heads} heads prunable")


def pruning_curves(
    curves: Mapping[str, tuple[np.ndarray, np.ndarray]],
    *,
    base_accuracy: float,
    max_drop: float,
    chance: float | None,
    heads_prunable: Mapping[str, int],
    total_heads: int,
    title: str,
):
    """Accuracy against the fraction of heads pruned, one line per pruning order.

    Args:
      curves: `label -> (fractions (S,), accuracies (S,))`.
      base_accuracy: the unpruned model's accuracy.
      max_drop: the stop rule's tolerance; the band below `base_accuracy` is shaded.
      chance: a reference accuracy drawn as a dotted line (None: none).
      heads_prunable: `label -> heads removed before the stop rule fired`, marked.
      total_heads: all heads of the model (for the marker positions).
      title: the figure title.

    Returns:
      the figure.
    """
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    ax.axhspan(base_accuracy - max_drop, base_accuracy, color="tab:green", alpha=0.15,
               label=f"within {100 * max_drop:g} point(s) of unpruned")
    _pruning_curves(ax, curves, heads_prunable, total_heads)
    if chance is not None:
        ax.axhline(chance, color="grey", ls=":", label=f"no-attention chance ({chance:.3f})")
    ax.set(xlabel="fraction of heads pruned", ylabel="scored-token accuracy (teacher forced)",
           title=title, xlim=(-0.02, 1.02), ylim=(0, 1.03))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    return fig


def timing_plot(rows: Sequence[Mapping], *, title: str):
    """Time and throughput of attention implementations against sequence length.

    Args:
      rows: dicts with `impl`, `heads`, `seq`, `fwd_ms`, `fwd_bwd_ms`,
        `fwd_gflops_per_s`, `fwd_bwd_gflops_per_s`.
      title: the figure title.

    Returns:
      the figure: forward and forward+backward milliseconds (log-log) and achieved
      GFLOP/s; one colour per head count, one line style per implementation.
    """
    import matplotlib.pyplot as plt

    heads = sorted({r["heads"] for r in rows})
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    colors = {h: plt.cm.viridis(x) for h, x in zip(heads, np.linspace(0, 0.85, len(heads)))}
    styles = dict(zip(impls, ["o-", "s--", "^:"]))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    panels = (("fwd_ms", "forward time (ms)"), ("fwd_bwd_ms", "forward + backward time (ms)"),
              ("fwd_bwd_gflops_per_s", "achieved GFLOP/s, forward + backward"))
    for ax, (field, label) in zip(axes, panels):
        for impl in impls:
            for h in heads:
                sel = sorted((r for r in rows if r["impl"] == impl and r["heads"] == h), key=lambda r: r["seq"])
                if sel:
                    ax.plot([r["seq"] for r in sel], [r[field] for r in sel], styles[impl], color=colors[h],
                            label=f"{impl}, h={h}", ms=5)
        ax.set(xscale="log", xlabel="sequence length N", ylabel=label)
        if field != "fwd_bwd_gflops_per_s":
            from matplotlib.ticker import LogLocator, NullFormatter, StrMethodFormatter

            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(StrMethodFormatter("{x:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
        seqs = sorted({r["seq"] for r in rows})
        ax.set_xticks(seqs, [str(s) for s in seqs])
        ax.xaxis.set_minor_locator(plt.NullLocator())
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def param_count_plot(heads: Sequence[int], projections: Mapping[str, Sequence[int]], with_bias: Sequence[int],
                     block_parts: Mapping[str, int], *, title: str):
    """Left: attention parameters per head count, stacked by projection (flat in h).
    Right: one Transformer block's parameters by part, as a labelled horizontal bar.

    Args:
      heads: the head counts.
      projections: `name -> parameters without bias, one per head count` (W_Q, …).
      with_bias: total with biases, one per head count (written above the bars).
      block_parts: `part -> parameters` of one block.
      title: the figure title.

    Returns:
      the figure.
    """
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [1, 1.3]})
    x = np.arange(len(heads))
    bottom = np.zeros(len(heads))
    for i, (name, counts) in enumerate(projections.items()):
        ax0.bar(x, counts, 0.6, bottom=bottom, color=plt.cm.Pastel1(i), ec="grey", label=name)
        bottom += np.asarray(counts, float)
    for xi, total, biased in zip(x, bottom, with_bias):
        ax0.text(xi, total * 1.02, f"{int(total):,}\n({int(biased):,}\nwith biases)", ha="center", va="bottom", fontsize=7)
    ax0.set_xticks(x, [str(h) for h in heads])
    ax0.set(xlabel="number of heads h (d_k = d_model / h)", ylabel="parameters (no biases)",
            title="W_Q, W_K, W_V, W_O: the same for every h", ylim=(0, bottom.max() * 1.6))
    ax0.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax0.legend(fontsize=8, loc="upper center", ncol=4)
    ax0.grid(alpha=0.3, axis="y")
    total = sum(block_parts.values())
    left = 0
    for i, (name, count) in enumerate(block_parts.items()):
        ax1.barh([0], [count], left=left, color=plt.cm.tab10(i), label=f"{name}: {count:,} ({100 * count / total:.1f}%)")
        if count / total > 0.08:
            ax1.text(left + count / 2, 0, f"{name}\n{100 * count / total:.1f}%", ha="center", va="center", color="white")
        left += count
    ax1.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax1.set(yticks=[], xlabel="parameters", title=f"One Transformer block: {total:,} parameters", xlim=(0, total))
    ax1.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(block_parts))
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def learning_curves(curves: Mapping[int, Mapping[str, np.ndarray]]):
    """Training loss and held-out exact-sequence accuracy against step, one colour
    per head count (line: mean over seeds, band: min–max).

    Args:
      curves: `heads -> {"step" (C,), "loss" (seeds, C), "eval_step" (E,),
        "exact_accuracy" (seeds, E)}`.

    Returns:
      the figure.
    """
    import matplotlib.pyplot as plt

    keys = sorted(curves)
    colors = plt.cm.viridis(np.linspace(0, 0.9, max(len(keys), 1)))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for color, h in zip(colors, keys):
        for ax, steps, field in ((axes[0], "step", "loss"), (axes[1], "eval_step", "exact_accuracy")):
            values = np.asarray(curves[h][field], dtype=float)
            ax.plot(curves[h][steps], values.mean(0), color=color, label=f"h={h}")
            ax.fill_between(curves[h][steps], values.min(0), values.max(0), color=color, alpha=0.2)
    axes[0].set(yscale="log", xlabel="optimizer step", ylabel="training loss (scored positions)",
                title="Training loss (mean, band = min–max over seeds)")
    axes[1].set(xlabel="optimizer step", ylabel="held-out exact-sequence accuracy", ylim=(-0.02, 1.02),
                title="Greedy-decoded copy accuracy (held out)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(title="heads")
    return fig


def accuracy_vs_heads(stats: Mapping[int, Mapping[str, tuple[float, float]]], chance: float):
    """Final accuracy and steps to target against the head count (mean ± std).

    Args:
      stats: `heads -> {"final_token_accuracy", "final_exact_accuracy",
        "steps_to_target"} -> (mean, std)` over seeds.
      chance: the no-attention accuracy, drawn dotted.

    Returns:
      the figure.
    """
    import matplotlib.pyplot as plt

    heads = np.asarray(sorted(stats))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for field, label, marker in (("final_token_accuracy", "token accuracy (teacher forced)", "o"),
                                 ("final_exact_accuracy", "exact-sequence accuracy (greedy)", "s")):
        values = np.asarray([stats[h][field] for h in heads])
        axes[0].errorbar(heads, values[:, 0], yerr=values[:, 1], marker=marker, capsize=4, label=label)
    axes[0].axhline(chance, color="grey", ls=":", label=f"no-attention chance ({chance:.2f})")
    axes[0].set(xscale="log", xlabel="number of heads h (d_model fixed)", ylabel="final held-out accuracy",
                title="Final accuracy vs head count", ylim=(0, 1.05))
    axes[0].legend(loc="lower right")
    steps = np.asarray([stats[h]["steps_to_target"] for h in heads])
    axes[1].errorbar(heads, steps[:, 0], yerr=steps[:, 1], marker="o", capsize=4)
    axes[1].set(xscale="log", xlabel="number of heads h (d_model fixed)", ylabel="steps to 99% held-out token accuracy",
                title="Convergence speed (missing point = never reached)")
    for ax in axes:
        ax.set_xticks(heads, [str(h) for h in heads])
        ax.grid(alpha=0.3)
    return fig


def entropy_per_head(entropy: Mapping[int, np.ndarray]):
    """Normalised attention entropy of every head, ranked within its layer.

    Head indices are arbitrary (any permutation is the same model), so heads are
    ranked by entropy within each seed and layer before averaging over seeds.

    Args:
      entropy: `heads -> (seeds, layers, heads)` normalised entropies.

    Returns:
      the figure: one row per head count, bars mean ± std over seeds.
    """
    import matplotlib.pyplot as plt

    keys = sorted(entropy)
    layers = entropy[keys[0]].shape[1]
    fig, axes = plt.subplots(len(keys), 1, figsize=(10, 1.9 * len(keys) + 0.9), squeeze=False)
    for ax, h in zip(axes[:, 0], keys):
        ranked = np.sort(entropy[h], axis=-1)
        width = 0.8 / layers
        for layer in range(layers):
            x = np.arange(h) + (layer - (layers - 1) / 2) * width
            ax.bar(x, ranked[:, layer].mean(0), width, yerr=ranked[:, layer].std(0), capsize=2,
                   label=f"layer {layer}", color=plt.cm.tab10(layer))
        ax.set(ylim=(0, 1), ylabel=f"h={h}", xticks=np.arange(h))
        ax.grid(alpha=0.3, axis="y")
    axes[0, 0].legend(ncol=layers, loc="upper left", fontsize=8)
    axes[-1, 0].set_xlabel("head rank within its layer (0 = most focused)")
    fig.suptitle("Attention entropy per head at scored queries, normalised by ln(#visible keys)\n"
                 "(0 = attends to one key, 1 = uniform; mean ± std over seeds)")
    return fig


def bpc_curves(curves: Mapping[int, Mapping[str, np.ndarray]], *, title: str):
    """Validation bits per character against step, one colour per head count.

    Args:
      curves: `heads -> {"step" (E,), "bpc" (seeds, E)}`.
      title: the axes title (say the machine and the data).

    Returns:
      the figure: mean over seeds as a line, every seed as a thin line.
    """
    import matplotlib.pyplot as plt

    keys = sorted(curves)
    colors = plt.cm.viridis(np.linspace(0, 0.9, max(len(keys), 1)))
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for color, h in zip(colors, keys):
        steps, values = np.asarray(curves[h]["step"]), np.asarray(curves[h]["bpc"], dtype=float)
        for row in values:
            ax.plot(steps, row, color=color, lw=0.6, alpha=0.45)
        ax.plot(steps, values.mean(0), color=color, lw=1.8, marker=".", label=f"h={h} (d_head={curves[h].get('head_dim', '?')})")
    ax.set(xlabel="optimizer step", ylabel="validation bits per character", title=title)
    ax.grid(alpha=0.3)
    ax.legend(title="heads (thin: single seeds)", fontsize=8)
    return fig


def bpc_vs_heads(stats: Mapping[int, Sequence[float]], *, title: str, fixed: str = "d_model fixed",
                 split: str = "validation"):
    """Final held-out bpc against the head count: every seed as a dot, mean ± std.

    Args:
      stats: `heads -> per-seed final bpc`.
      title: the axes title.
      fixed: what stays the same across head counts, for the x label ("d_model fixed",
        or "head size 32 fixed" for a `--head-dim` sweep).
      split: the split the bpc was measured on, for the y label ("test", "dev").

    Returns:
      the figure.
    """
    import matplotlib.pyplot as plt

    heads = np.asarray(sorted(stats))
    values = [np.asarray(stats[h], float) for h in heads]
    fig, ax = plt.subplots(figsize=(6.5, 4.4))
    for h, v in zip(heads, values):
        ax.scatter(np.full(v.shape, h), v, color="grey", s=14, zorder=3, label="single seed" if h == heads[0] else None)
    from jax_mha.lab.stats import t_interval

    half = [t_interval(v).half_width if v.size > 1 else 0.0 for v in values]
    ax.errorbar(heads, [v.mean() for v in values], yerr=half, marker="o", capsize=5,
                color="C0", label="mean, 95 % t interval over seeds", zorder=2)
    ax.set(xscale="log", xlabel=f"number of heads h ({fixed})", ylabel=f"{split} bits per character (lower is better)",
           title=title)
    ax.set_xticks(heads, [str(h) for h in heads])
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def head_type_heatmap(scores: Mapping[str, np.ndarray], labels: np.ndarray, *, suptitle: str):
    """One row of `(num_layers, H)` heatmaps per score, each head's type written in it.

    Args:
      scores: score name -> `(num_layers, H)` values in [0, 1] (e.g. previous_token,
        induction, first_token, normalized_entropy).
      labels: str `(num_layers, H)` head types.
      suptitle: the figure title.

    Returns:
      the figure.
    """
    import matplotlib.pyplot as plt

    short = {"induction": "ind", "previous_token": "prev", "first_token": "first", "diffuse": "diff", "other": "oth"}
    n_layers, n_heads = labels.shape
    fig, axes = plt.subplots(len(scores), 1, figsize=(2.2 + 0.62 * n_heads, 0.9 + len(scores) * (0.55 + 0.5 * n_layers)),
                             squeeze=False)
    for ax, (name, values) in zip(axes[:, 0], scores.items()):
        values = np.asarray(values, float)
        image = ax.imshow(values, cmap="magma", vmin=0.0, vmax=1.0, aspect="auto")
        for l, h in np.ndindex(n_layers, n_heads):
            text = f"{values[l, h]:.2f}\n{short.get(str(labels[l, h]), labels[l, h])}"
            ax.text(h, l, text, ha="center", va="center", fontsize=6.5, color="white" if values[l, h] < 0.6 else "black")
        ax.set_yticks(range(n_layers), [f"layer {l}" for l in range(n_layers)])
        ax.set_xticks(range(n_heads), [str(h) for h in range(n_heads)])
        ax.set_title(name.replace("_", " ") + ("" if "entropy" in name else " score"), fontsize=9)
        fig.colorbar(image, ax=ax, fraction=0.03, pad=0.02)
    axes[-1, 0].set_xlabel("head (cell: score, then the head's type)")
    fig.suptitle(suptitle, fontsize=10)
    fig.tight_layout()
    return fig


def bpc_pruning_curves(
    curves: Mapping[str, tuple[np.ndarray, np.ndarray]], *, base_bpc: float, max_rise: float,
    heads_prunable: Mapping[str, int], total_heads: int, title: str, all_off_bpc: float | None = None,
    split: str = "validation",
):
    """Held-out bits per character against the fraction of heads pruned.

    Args:
      curves: `label -> (fractions (S,), bpc (S,))`.
      base_bpc: the unpruned model's bpc; the band up to `base_bpc * (1 + max_rise)` is shaded.
      max_rise: the stop rule's relative tolerance (0.01 = 1 %).
      heads_prunable: `label -> heads removed before the stop rule fired`, starred.
      total_heads: all heads of the model.
      title: the figure title.
      all_off_bpc: bpc with every head off, drawn dotted (None: none).
      split: the split the bpc was measured on, for the y label ("test", "dev").

    Returns:
      the figure.
    """
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    ax.axhspan(base_bpc, base_bpc * (1 + max_rise), color="tab:green", alpha=0.2,
               label=f"within {100 * max_rise:g} % of unpruned ({base_bpc:.3f})")
    _pruning_curves(ax, curves, heads_prunable, total_heads)
    if all_off_bpc is not None:
        ax.axhline(all_off_bpc, color="grey", ls=":", label=f"every head off ({all_off_bpc:.3f})")
    ax.set(xlabel="fraction of heads pruned", ylabel=f"{split} bits per character", title=title, xlim=(-0.02, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def induction_curves(curves: Mapping[int, Mapping[str, Any]], *, title: str):
    """Induction evidence against training characters, one line per head count (mean over seeds).

    Args:
      curves: `heads -> {"characters": (E,), "icl_score": per-seed (E,), "prefix_matching_spans":
        per-seed (E, layers, H), "prefix_matching_frequent": same, "copying_spans": per-seed (E,),
        "prefix_matching_chance": per-seed (E,)}`.
      title: the figure's title.

    Returns:
      the figure: ICL score, the best head's prefix matching (real spans and frequent
      characters, chance dotted), and the copying effect on real spans.
    """
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    chance = None
    for i, h in enumerate(sorted(curves)):
        c = curves[h]
        x = np.asarray(c["characters"], float)
        axes[0].plot(x, np.mean(c["icl_score"], axis=0), color=f"C{i}", marker=".", label=f"h={h}")
        best = lambda key: np.mean([np.asarray(s).reshape(len(x), -1).max(-1) for s in c[key]], axis=0)
        axes[1].plot(x, best("prefix_matching_spans"), color=f"C{i}", marker=".", label=f"h={h}, real spans")
        axes[1].plot(x, best("prefix_matching_frequent"), color=f"C{i}", ls="--", label=f"h={h}, frequent chars")
        axes[2].plot(x, np.mean(c["copying_spans"], axis=0), color=f"C{i}", marker=".", label=f"h={h}")
        chance = float(np.mean(c["prefix_matching_chance"]))
    if chance is not None:
        axes[1].axhline(chance, color="grey", ls=":", label=f"uniform attention ({chance:.3f})")
    axes[0].set(ylabel="ICL score: late − early loss (nats)", title="In-context learning (Olsson et al. 2022)")
    axes[1].set(ylabel="best head's prefix-matching score", title="Prefix matching on repeated sequences", ylim=(0, 1))
    axes[2].set(ylabel="first-copy − second-copy loss (nats)", title="Copying effect on repeated real spans")
    for ax in axes:
        ax.set(xlabel="training characters per seed")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return fig
