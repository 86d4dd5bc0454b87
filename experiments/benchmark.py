"""Speed of jax_mha's attention against flax, jax.nn and (optionally) PyTorch.

Times forward and forward+backward (float32, jitted) of self-attention layers at
the shapes of `FULL.shapes`, the copy-task training step against an equivalent
PyTorch eager step, and a large matmul as the machine's practical roofline, so that
every GFLOP/s figure can be read as a fraction of peak.

Run::

    python -m experiments.benchmark            # full: ~10 min on 2 CPU cores
    python -m experiments.benchmark --quick    # fewer repeats, ~3 min
    pip install -e .[torch]                    # adds the PyTorch rows

Method. Every layer is compiled and warmed up first; then the layers of one shape are
timed *round-robin* (one sample of each in turn, `repeats` times), each sample
averaging enough calls to last `min_sample_s`, and the median sample is reported.
Interleaving means background load hits every layer alike, so the ratios within a run
stay meaningful on a shared machine even when absolute times drift.

FLOPs counted (multiply-add = 2): projections `8·B·N·d²` (q, k, v, out) plus attention
`4·B·N²·d` (QKᵀ and PV); forward+backward counts 3× the forward (backward ≈ 2×).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jax_mha
from experiments.common import run_metadata, save_figure, use_agg_backend, write_json
from jax_mha import functional

Shape = tuple[int, int, int, int]  # (B, N, d_model, H)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What to time and how often."""

    shapes: tuple[Shape, ...] = (
        (8, 128, 256, 8),  # short sequences: projection-bound
        (4, 512, 512, 8),  # the middle ground
        (1, 2048, 512, 8),  # long: attention-bound, where blockwise matters
        (4, 512, 512, 1),  # one wide head ...
        (4, 512, 512, 16),  # ... to many narrow ones at the same d_model
    )
    repeats: int = 7  # samples per layer; the median is reported
    warmup: int = 2  # calls after compilation, before timing
    min_sample_s: float = 0.2  # each sample averages calls lasting at least this long
    train_repeats: int = 7  # samples of the training step
    train_calls: int = 5  # training steps per sample
    roofline_size: int = 2048  # the (n, n) @ (n, n) float32 matmul


QUICK = dataclasses.replace(BenchConfig(), repeats=3, warmup=1, min_sample_s=0.05, train_repeats=3, train_calls=3)
FULL = BenchConfig()

# The copy-task training step compared with PyTorch (the head-ablation defaults).
TRAIN_D_MODEL, TRAIN_HEADS, TRAIN_LAYERS, TRAIN_BATCH, TRAIN_LENGTH = 256, 8, 2, 64, 16


def attention_flops(b: int, n: int, d: int) -> float:
    """Forward FLOPs of one self-attention layer: projections + scores + weighted sum."""
    return 8.0 * b * n * d * d + 4.0 * b * n * n * d


# ---------------------------------------------------------------------------------
# Timing.
# ---------------------------------------------------------------------------------


def _calls_per_sample(fn: Callable[[], Any], min_sample_s: float) -> int:
    t0 = time.perf_counter()
    fn()
    return max(1, math.ceil(min_sample_s / max(time.perf_counter() - t0, 1e-6)))


def time_interleaved(fns: dict[str, Callable[[], Any]], cfg: BenchConfig) -> dict[str, float]:
    """Median seconds per call of each blocking zero-argument callable, sampled round-robin."""
    for fn in fns.values():
        for _ in range(cfg.warmup):
            fn()
    calls = {name: _calls_per_sample(fn, cfg.min_sample_s) for name, fn in fns.items()}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(cfg.repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls[name]):
                fn()
            samples[name].append((time.perf_counter() - t0) / calls[name])
    return {name: statistics.median(s) for name, s in samples.items()}


def _blocking(fn: Callable, *args) -> Callable[[], Any]:
    return lambda: jax.block_until_ready(fn(*args))


# ---------------------------------------------------------------------------------
# The JAX layers: (init, apply) pairs over the same input.
# ---------------------------------------------------------------------------------


def _dpa_core(num_heads: int):
    """Self-attention built on `jax.nn.dot_product_attention` in its native (B, N, H, D)
    layout: projections as (d, H, D) kernels, so no transposes at all."""

    def init(key, x):
        d = x.shape[-1]
        head_dim = d // num_heads
        ks = jax.random.split(key, 4)
        w = lambda k, shape: jax.random.normal(k, shape, jnp.float32) / math.sqrt(shape[0])
        return {
            "q": w(ks[0], (d, num_heads, head_dim)), "k": w(ks[1], (d, num_heads, head_dim)),
            "v": w(ks[2], (d, num_heads, head_dim)), "o": w(ks[3], (num_heads * head_dim, d)),
            "bq": jnp.zeros((num_heads, head_dim)), "bk": jnp.zeros((num_heads, head_dim)),
            "bv": jnp.zeros((num_heads, head_dim)), "bo": jnp.zeros((d,)),
        }

    def apply(p, x):
        q = jnp.einsum("bnd,dhk->bnhk", x, p["q"]) + p["bq"]  # (B, N, H, D)
        k = jnp.einsum("bnd,dhk->bnhk", x, p["k"]) + p["bk"]
        v = jnp.einsum("bnd,dhk->bnhk", x, p["v"]) + p["bv"]
        o = jax.nn.dot_product_attention(q, k, v)  # (B, N, H, D)
        return o.reshape(*o.shape[:2], -1) @ p["o"] + p["bo"]  # (B, N, d)

    return init, apply


def jax_layers(num_heads: int) -> dict[str, tuple[Callable, Callable]]:
    """name -> (init(key, x) -> params, apply(params, x) -> y), all with q/k/v/out biases."""
    layers = {}
    for impl in ("xla", "blockwise"):
        m = jax_mha.MultiHeadAttention(num_heads=num_heads, qkv_bias=True, implementation=impl)
        layers[f"jax_mha ({impl})"] = (m.init, m.apply)
    flax_mha = nn.MultiHeadDotProductAttention(num_heads=num_heads, deterministic=True)
    layers["flax MultiHeadDotProductAttention"] = (flax_mha.init, flax_mha.apply)
    layers["jax.nn.dot_product_attention"] = _dpa_core(num_heads)
    return layers


def jax_timers(name: str, init: Callable, apply: Callable, x: jax.Array) -> dict[str, Callable[[], Any]]:
    params = init(jax.random.PRNGKey(0), x)
    fwd = jax.jit(apply)
    fwd_bwd = jax.jit(jax.grad(lambda p, x: apply(p, x).sum(), argnums=(0, 1)))
    return {(name, "fwd"): _blocking(fwd, params, x), (name, "fwd+bwd"): _blocking(fwd_bwd, params, x)}


# ---------------------------------------------------------------------------------
# PyTorch (optional).
# ---------------------------------------------------------------------------------


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def torch_timers(b: int, n: int, d: int, h: int) -> dict[tuple[str, str], Callable[[], Any]]:
    """`F.scaled_dot_product_attention` behind four Linear layers, and `nn.MultiheadAttention`."""
    import torch
    import torch.nn.functional as F

    class SDPAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))

        def forward(self, x):
            split = lambda t: t.view(b, n, h, d // h).transpose(1, 2)  # (B, H, N, D)
            o = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)))
            return self.o(o.transpose(1, 2).reshape(b, n, d))

    class TorchMHA(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = torch.nn.MultiheadAttention(d, h, batch_first=True)

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False)[0]

    torch.manual_seed(0)
    x = torch.randn(b, n, d)
    timers = {}
    for name, module in (("torch SDPA", SDPAttention()), ("torch nn.MultiheadAttention", TorchMHA())):
        module.eval()

        def fwd(module=module):
            with torch.inference_mode():
                return module(x)

        xg = x.clone().requires_grad_(True)

        def fwd_bwd(module=module, xg=xg):
            module.zero_grad(set_to_none=True)
            xg.grad = None
            module(xg).sum().backward()

        timers[(name, "fwd")] = fwd
        timers[(name, "fwd+bwd")] = fwd_bwd
    return timers


def torch_copy_train_step(cfg_train, seq_len: int, vocab: int, max_len: int, d_ff: int):
    """An eager PyTorch twin of `train.jit_train_step` on the copy task: the same
    pre-norm decoder (learned positions, q/k/v without bias, exact GELU, final
    LayerNorm), masked cross-entropy, global-norm clipping, AdamW with warmup-cosine.
    Returns `step(tokens, targets, scored) -> loss`."""
    import torch
    import torch.nn.functional as F

    d, h = TRAIN_D_MODEL, TRAIN_HEADS

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
            self.q, self.k, self.v = (torch.nn.Linear(d, d, bias=False) for _ in range(3))
            self.o = torch.nn.Linear(d, d)
            self.ffn = torch.nn.Sequential(torch.nn.Linear(d, d_ff), torch.nn.GELU(), torch.nn.Linear(d_ff, d))

        def forward(self, x):
            b, n, _ = x.shape
            y = self.norm1(x)
            split = lambda t: t.view(b, n, h, d // h).transpose(1, 2)
            a = F.scaled_dot_product_attention(split(self.q(y)), split(self.k(y)), split(self.v(y)), is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(b, n, d))
            return x + self.ffn(self.norm2(x))

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, d)
            self.positions = torch.nn.Parameter(0.02 * torch.randn(max_len, d))
            self.blocks = torch.nn.ModuleList(Block() for _ in range(TRAIN_LAYERS))
            self.final_norm = torch.nn.LayerNorm(d)
            self.logits = torch.nn.Linear(d, vocab)

        def forward(self, tokens):
            x = self.embed(tokens) + self.positions[: tokens.shape[1]]
            for block in self.blocks:
                x = block(x)
            return self.logits(self.final_norm(x))

    torch.manual_seed(0)
    model = Decoder()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg_train.learning_rate, weight_decay=cfg_train.weight_decay, eps=1e-8)
    warm, total = cfg_train.warmup_steps, max(cfg_train.num_steps, cfg_train.warmup_steps + 1)

    def lr_lambda(t):  # optax.warmup_cosine_decay_schedule
        if t < warm:
            return t / warm
        frac = min((t - warm) / (total - warm), 1.0)
        return cfg_train.end_lr_ratio + (1 - cfg_train.end_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)

    def step(tokens, targets, scored):
        opt.zero_grad(set_to_none=True)
        logits = model(tokens)
        weight = scored.float()
        nll = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), reduction="none")
        loss = (nll * weight.reshape(-1)).sum() / weight.sum().clamp(min=1.0)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg_train.grad_clip_norm)
        opt.step()
        sched.step()
        with torch.no_grad():  # the JAX step also reports accuracy
            _ = ((logits.argmax(-1) == targets).float() * weight).sum() / weight.sum()
        return loss

    return step


def time_train_steps(cfg: BenchConfig, with_torch: bool) -> dict[str, float]:
    """Median seconds per training step: jax_mha's jitted optax step vs PyTorch eager."""
    from jax_mha.data import CopyTaskConfig, make_batch
    from jax_mha.models import CopyTransformer, ModelConfig
    from jax_mha.train import TrainConfig, init_state, jit_train_step, make_optimizer

    task = CopyTaskConfig(length=TRAIN_LENGTH)
    model_cfg = ModelConfig(d_model=TRAIN_D_MODEL, num_heads=TRAIN_HEADS, num_layers=TRAIN_LAYERS)
    train_cfg = TrainConfig(batch_size=TRAIN_BATCH)
    model = CopyTransformer(model_cfg)
    optimizer = make_optimizer(train_cfg)
    step = jit_train_step(model, optimizer)
    batch = make_batch(jax.random.PRNGKey(1), task, TRAIN_BATCH)
    holder = {"state": init_state(jax.random.PRNGKey(0), model, optimizer)}
    rng = jax.random.PRNGKey(2)

    def jax_calls():
        for _ in range(cfg.train_calls):
            holder["state"], metrics = step(holder["state"], batch, rng)  # the state is donated
        jax.block_until_ready(metrics["loss"])

    fns = {"jax_mha train step (jit, optax)": jax_calls}
    if with_torch:
        import torch

        torch_step = torch_copy_train_step(train_cfg, task.seq_len, task.vocab_size, model_cfg.max_len, model_cfg.d_ff)
        tokens, targets, scored = (torch.from_numpy(np.array(batch[k])) for k in ("inputs", "targets", "scored"))
        tokens, targets = tokens.long(), targets.long()

        def torch_calls():
            for _ in range(cfg.train_calls):
                torch_step(tokens, targets, scored)

        fns["torch train step (eager, AdamW)"] = torch_calls
    run_cfg = dataclasses.replace(cfg, repeats=cfg.train_repeats, min_sample_s=0.0)
    return {name: t / cfg.train_calls for name, t in time_interleaved(fns, run_cfg).items()}


def roofline(cfg: BenchConfig, with_torch: bool) -> dict[str, float]:
    """GFLOP/s of a large float32 matmul: the practical peak of this machine."""
    size = cfg.roofline_size
    a = jax.random.normal(jax.random.PRNGKey(0), (size, size), jnp.float32)
    fns = {"jax": _blocking(jax.jit(jnp.matmul), a, a)}
    if with_torch:
        import torch

        at = torch.from_numpy(np.array(a))  # a writable copy
        fns["torch"] = lambda: torch.mm(at, at)
    times = time_interleaved(fns, dataclasses.replace(cfg, repeats=max(3, cfg.repeats // 2)))
    return {name: 2.0 * size**3 / t / 1e9 for name, t in times.items()}


# ---------------------------------------------------------------------------------
# The run.
# ---------------------------------------------------------------------------------

FLAX = "flax MultiHeadDotProductAttention"


def run(
    cfg: BenchConfig, with_torch: bool, with_train: bool = True, progress: Callable[[str], None] = print
) -> dict[str, Any]:
    peak = roofline(cfg, with_torch)
    progress(f"matmul roofline: " + ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in peak.items()))
    rows = []
    for b, n, d, h in cfg.shapes:
        x = jax.random.normal(jax.random.PRNGKey(1), (b, n, d), jnp.float32)
        fns = {}
        for name, (init, apply) in jax_layers(h).items():
            fns.update(jax_timers(name, init, apply, x))
        if with_torch:
            fns.update(torch_timers(b, n, d, h))
        times = time_interleaved(fns, cfg)
        flops = attention_flops(b, n, d)
        for (name, mode), t in times.items():
            f = flops * (3.0 if mode == "fwd+bwd" else 1.0)
            rows.append({
                "B": b, "N": n, "d_model": d, "H": h, "layer": name, "mode": mode, "ms": 1e3 * t,
                "gflops": f / t / 1e9, "frac_peak": f / t / 1e9 / peak["jax"],
                "vs_flax": t / times[(FLAX, mode)],
            })
        progress(f"done (B, N, d, H) = {(b, n, d, h)}")
    train = time_train_steps(cfg, with_torch) if with_train else {}
    return {
        "roofline_gflops": peak, "roofline_size": cfg.roofline_size, "rows": rows,
        "train_step_ms": {k: 1e3 * v for k, v in train.items()},
        "auto_blockwise_min_scores": functional.AUTO_BLOCKWISE_MIN_SCORES,
        "xla_chunk_score_bytes": functional.XLA_CHUNK_SCORE_BYTES,
    }


def auto_choice(n: int) -> str:
    """The path implementation="auto" takes on CPU for self-attention of length n."""
    return "blockwise" if n * n >= functional.AUTO_BLOCKWISE_MIN_SCORES else "xla"


def check_targets(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, evaluated on this run's ratios."""
    rows = result["rows"]
    get = lambda shape, layer, mode: next(
        r["ms"] for r in rows if (r["B"], r["N"], r["d_model"], r["H"]) == shape and r["layer"] == layer and r["mode"] == mode
    )
    shapes = sorted({(r["B"], r["N"], r["d_model"], r["H"]) for r in rows}, key=lambda s: (s[1], s[3]))
    out: dict[str, Any] = {}
    xla_vs_flax = {str(s): {m: get(s, "jax_mha (xla)", m) / get(s, FLAX, m) for m in ("fwd", "fwd+bwd")} for s in shapes}
    out["xla_vs_flax"] = xla_vs_flax
    out["xla_no_slower_than_flax"] = all(v <= 1.0 for r in xla_vs_flax.values() for v in r.values())
    block_vs_xla = {}
    for s in shapes:
        for m in ("fwd", "fwd+bwd"):
            block_vs_xla[f"{s} {m}"] = get(s, "jax_mha (blockwise)", m) / get(s, "jax_mha (xla)", m)
    out["blockwise_vs_xla"] = block_vs_xla
    # Where blockwise is faster there is nothing to bound.
    out["blockwise_within_1.5x_of_xla"] = all(v <= 1.5 for v in block_vs_xla.values() if v > 1.0)
    train = result["train_step_ms"]
    if "torch train step (eager, AdamW)" in train and "jax_mha train step (jit, optax)" in train:
        speed = train["torch train step (eager, AdamW)"] / train["jax_mha train step (jit, optax)"]
        out["train_speed_vs_torch"] = speed
        out["train_at_least_torch"] = speed >= 1.0
    long = [s for s in shapes if s[1] >= 2048]
    if long and any(r["layer"] == "torch SDPA" for r in rows):
        s = long[0]
        best = get(s, f"jax_mha ({auto_choice(s[1])})", "fwd+bwd")
        out["long_auto_path"] = auto_choice(s[1])
        out["long_auto_vs_torch_sdpa_fwd_bwd"] = best / get(s, "torch SDPA", "fwd+bwd")
        out["long_within_1.5x_of_torch"] = out["long_auto_vs_torch_sdpa_fwd_bwd"] <= 1.5
    return out


def format_table(result: dict[str, Any]) -> str:
    """Markdown table: one line per (shape, layer), forward and forward+backward."""
    peak = result["roofline_gflops"]
    lines = [
        f"matmul roofline (float32, {result['roofline_size']}² @ {result['roofline_size']}²): "
        + ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in peak.items()),
        "",
        "| (B, N, d, H) | layer | fwd ms | fwd GFLOP/s | fwd vs flax | fwd+bwd ms | fwd+bwd GFLOP/s | fwd+bwd vs flax |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    by_key: dict[tuple, dict[str, dict]] = {}
    for r in result["rows"]:
        by_key.setdefault(((r["B"], r["N"], r["d_model"], r["H"]), r["layer"]), {})[r["mode"]] = r
    for (shape, layer), modes in by_key.items():
        f, fb = modes["fwd"], modes["fwd+bwd"]
        lines.append(
            f"| {shape} | {layer} | {f['ms']:.2f} | {f['gflops']:.1f} ({100 * f['frac_peak']:.0f}%) | {f['vs_flax']:.2f} "
            f"| {fb['ms']:.2f} | {fb['gflops']:.1f} ({100 * fb['frac_peak']:.0f}%) | {fb['vs_flax']:.2f} |"
        )
    if result["train_step_ms"]:
        lines += ["", "| training step (copy task, d=256, 8 heads, 2 layers, batch 64 × 33 tokens) | ms/step |", "| --- | ---: |"]
        lines += [f"| {k} | {v:.1f} |" for k, v in result["train_step_ms"].items()]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """GFLOP/s per layer and shape, forward and forward+backward, against the roofline."""
    use_agg_backend()
    import matplotlib.pyplot as plt

    rows = result["rows"]
    shapes = list(dict.fromkeys((r["B"], r["N"], r["d_model"], r["H"]) for r in rows))
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    width = 0.8 / len(layers)
    for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
        for i, layer in enumerate(layers):
            vals = [next((r["gflops"] for r in rows if r["layer"] == layer and r["mode"] == mode
                          and (r["B"], r["N"], r["d_model"], r["H"]) == s), 0.0) for s in shapes]
            ax.bar(np.arange(len(shapes)) + (i - (len(layers) - 1) / 2) * width, vals, width, label=layer)
        ax.axhline(result["roofline_gflops"]["jax"], color="k", ls="--", lw=1, label="jax matmul roofline")
        ax.set_xticks(np.arange(len(shapes)), [f"B{b} N{n}\nd{d} H{h}" for b, n, d, h in shapes], fontsize=8)
        ax.set_title(f"{mode} (float32)")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("GFLOP/s")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=4, bbox_to_anchor=(0.5, -0.12), frameon=False)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.benchmark",
        description="Times jax_mha attention (xla, blockwise) against flax, jax.nn.dot_product_attention "
        "and, when torch is installed, PyTorch; forward and forward+backward, plus the copy-task training step.",
    )
    parser.add_argument("--quick", action="store_true", help="fewer repeats and shorter samples (a smoke run)")
    parser.add_argument("--out", default="results/benchmark", help="directory for benchmark.json and benchmark.png")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch rows even if torch is installed")
    parser.add_argument("--no-train", action="store_true", help="skip the training-step comparison")
    parser.add_argument(
        "--shapes", default=None,
        help="semicolon-separated B,N,d_model,H tuples to time instead of the defaults, e.g. '8,128,256,8;1,2048,512,8'",
    )
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    if args.shapes:
        shapes = tuple(tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";") if s)
        if any(len(s) != 4 or s[2] % s[3] for s in shapes):
            parser.error(f"--shapes needs B,N,d_model,H with d_model divisible by H, got {args.shapes!r}")
        cfg = dataclasses.replace(cfg, shapes=shapes)
    with_torch = torch_available() and not args.no_torch

    start = time.perf_counter()
    result = run(cfg, with_torch, with_train=not args.no_train)
    result["targets"] = check_targets(result)
    meta = run_metadata()
    if with_torch:
        import torch

        meta.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
    meta["glibc_tunables"] = os.environ.get("GLIBC_TUNABLES")  # malloc settings change large-array costs
    result.update(metadata=meta, config=dataclasses.asdict(cfg), preset="quick" if args.quick else "full",
                  wall_seconds=time.perf_counter() - start)
    out = Path(args.out)
    write_json(out / "benchmark.json", result)
    plot(result, out / "benchmark.png")
    print(format_table(result))
    print("\ntargets:", {k: v for k, v in result["targets"].items() if not isinstance(v, dict)})
    print(f"\nwrote {out / 'benchmark.json'} and {out / 'benchmark.png'} in {result['wall_seconds']:.0f} s")
    return result


if __name__ == "__main__":
    main()
