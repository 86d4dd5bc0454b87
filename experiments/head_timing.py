"""Does the number of heads change the cost of attention? (seed 000, exercise 3)

Times `jax_mha.MultiHeadAttention` for several head counts at fixed d_model, forward
and forward+backward, jitted, beside `flax.linen.MultiHeadDotProductAttention` in the
same run and on the same inputs. Each timing is the median of `--repeats` calls after
`--warmup` untimed ones (the first compiles).

FLOPs (multiply–add = 2), self-attention, no mask, B sequences of N tokens:
  projections  Q, K, V, O: 4 · 2·B·N·d²  = 8·B·N·d²
  attention    QKᵀ and AV: 2 · 2·B·N²·d  = 4·B·N²·d   (independent of h: h heads × d/h each)
  backward ≈ 2 × forward, so forward+backward ≈ 3 × forward.
Softmax, scaling and reshapes are not counted; achieved GFLOP/s = FLOPs / median time.

    python -m experiments.head_timing                    # quick: seq 128 and 512, ~1–2 min on 2 CPU cores
    python -m experiments.head_timing --full             # seq 128, 512, 1024, 7 repeats
    python -m experiments.head_timing --seq 256 --heads 1 4 --batch 4 --repeats 5

Writes to --out (default results/head_timing/): results.json, table.md, timing.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp

from experiments import common, plotting
from experiments.common import Interrupted, save_figure, use_agg_backend, write_atomic, write_json
from jax_mha.nn.linen import MultiHeadAttention

MODULE = "experiments.head_timing"


@dataclasses.dataclass(frozen=True)
class TimingConfig:
    """What to time."""

    heads: tuple[int, ...] = (1, 8, 16)  # seed 000's exercise 3
    seqs: tuple[int, ...] = (128, 512)  # quick: N = 1024 costs ~8x N = 512 in the attention part
    batch: int = 8
    d_model: int = 512  # the base Transformer's width
    repeats: int = 5  # median of 5: robust to a couple of slow calls (the machine is shared)
    warmup: int = 2  # the first call compiles, the second settles caches; later ones are steady
    impls: tuple[str, ...] = ("jax_mha", "flax")

    def __post_init__(self):
        sizes = {"batch": self.batch, "d_model": self.d_model, "repeats": self.repeats, "warmup": self.warmup}
        if min(sizes.values()) < 1 or not self.heads or not self.seqs or min(self.heads + self.seqs) < 1:
            raise ValueError(f"{sizes}, heads={self.heads} and seqs={self.seqs} must all be >= 1 (and not empty)")
        bad = [h for h in self.heads if self.d_model % h]
        if bad:
            raise ValueError(f"d_model={self.d_model} is not divisible by num_heads={bad[0]}")
        if not set(self.impls) <= {"jax_mha", "flax"}:
            raise ValueError(f"impls must be among jax_mha, flax, got {self.impls}")


def quick() -> TimingConfig:
    return TimingConfig()


def full() -> TimingConfig:
    """All three sequence lengths, more repeats (~5 min on 2 CPU cores)."""
    return TimingConfig(seqs=(128, 512, 1024), repeats=7, warmup=2)


def make_module(impl: str, heads: int, d_model: int) -> nn.Module:
    """The two implementations with the same parameters (biases on all four projections)."""
    if impl == "jax_mha":
        return MultiHeadAttention(num_heads=heads, qkv_bias=True, out_bias=True)
    if impl == "flax":
        return nn.MultiHeadDotProductAttention(num_heads=heads, qkv_features=d_model, out_features=d_model,
                                               use_bias=True, deterministic=True)
    raise ValueError(f"unknown implementation {impl!r}")


def median_ms(fn, args, warmup: int, repeats: int) -> tuple[float, float]:
    """(median milliseconds over `repeats`, milliseconds of the first call = compile + run)."""
    median, first = common.median_seconds(lambda: jax.block_until_ready(fn(*args)), warmup, repeats)
    return 1e3 * median, 1e3 * first


def time_one(impl: str, heads: int, seq: int, cfg: TimingConfig) -> dict:
    """One row: forward and forward+backward of one implementation at one size."""
    module = make_module(impl, heads, cfg.d_model)
    x = jax.random.normal(jax.random.PRNGKey(seq), (cfg.batch, seq, cfg.d_model), jnp.float32)
    params = jax.jit(module.init)(jax.random.PRNGKey(1), x[:1, :8])["params"]  # one program, not one per operation
    forward = jax.jit(lambda p, x: module.apply({"params": p}, x))
    # Gradients w.r.t. parameters and input, as in training a stack of layers.
    loss = lambda p, x: jnp.mean(jnp.square(module.apply({"params": p}, x)))
    forward_backward = jax.jit(jax.grad(loss, argnums=(0, 1)))
    fwd_ms, fwd_first = median_ms(forward, (params, x), cfg.warmup, cfg.repeats)
    bwd_ms, bwd_first = median_ms(forward_backward, (params, x), cfg.warmup, cfg.repeats)
    f = common.attention_flops(cfg.batch, seq, cfg.d_model)
    return {
        "impl": impl, "heads": heads, "head_dim": cfg.d_model // heads, "seq": seq, "batch": cfg.batch,
        "d_model": cfg.d_model, "fwd_ms": fwd_ms, "fwd_bwd_ms": bwd_ms,
        "fwd_first_call_ms": fwd_first, "fwd_bwd_first_call_ms": bwd_first,
        "gflops_fwd": f["forward"] / 1e9, "gflops_fwd_bwd": f["forward_backward"] / 1e9,
        "attention_flop_fraction": f["attention"] / f["forward"],
        "fwd_gflops_per_s": f["forward"] / 1e9 / (fwd_ms / 1e3),
        "fwd_bwd_gflops_per_s": f["forward_backward"] / 1e9 / (bwd_ms / 1e3),
    }


def table(rows: list[dict], cfg: TimingConfig) -> str:
    """Markdown table of the rows, plus each head count's time relative to h=1."""
    base = {(r["impl"], r["seq"]): r for r in rows if r["heads"] == min(cfg.heads)}
    lines = [f"Self-attention, batch {cfg.batch}, d_model {cfg.d_model}, float32, jitted; median of "
             f"{cfg.repeats} after {cfg.warmup} warm-up call(s).", "",
             f"| impl | h | d_k | N | GFLOP fwd | fwd ms | fwd GFLOP/s | fwd+bwd ms | fwd+bwd GFLOP/s | fwd+bwd vs h={min(cfg.heads)} |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        rel = r["fwd_bwd_ms"] / base[(r["impl"], r["seq"])]["fwd_bwd_ms"]
        lines.append(f"| {r['impl']} | {r['heads']} | {r['head_dim']} | {r['seq']} | {r['gflops_fwd']:.2f} | "
                     f"{r['fwd_ms']:.1f} | {r['fwd_gflops_per_s']:.1f} | {r['fwd_bwd_ms']:.1f} | "
                     f"{r['fwd_bwd_gflops_per_s']:.1f} | {rel:.2f}x |")
    return "\n".join(lines) + "\n"


def parse(argv) -> tuple[argparse.Namespace, TimingConfig]:
    """`(args, config)`; every bad value ends in `error:` and exit 2."""
    p = common.parser(MODULE, "Time multi-head self-attention (forward, forward+backward) for several head counts at "
                              "fixed d_model, jax_mha against flax.linen.MultiHeadDotProductAttention, with FLOPs and "
                              "achieved GFLOP/s.")
    p.add_argument("--full", action="store_true",
                   help="the full preset: sequence lengths 128, 512, 1024 and 7 repeats (default: quick, 128 and 512, 5 repeats)")
    p.add_argument("--heads", type=common.positive_int, nargs="+", help="head counts (each must divide --d-model; default 1 8 16)")
    p.add_argument("--seq", type=common.positive_int, nargs="+", help="sequence lengths N (overrides the preset)")
    p.add_argument("--batch", type=common.positive_int, help="batch size B (default 8)")
    p.add_argument("--d-model", type=common.positive_int, help="model width d (default 512)")
    p.add_argument("--repeats", type=common.positive_int, help="timed calls per measurement; the median is reported")
    p.add_argument("--warmup", type=common.positive_int, help="untimed calls first (the first one compiles)")
    p.add_argument("--impls", nargs="+", choices=("jax_mha", "flax"), help="implementations to time (default both)")
    p.add_argument("--out", type=Path, default=Path("results/head_timing"), help="output folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    cfg = full() if args.full else quick()
    overrides = {"heads": args.heads and tuple(args.heads), "seqs": args.seq and tuple(args.seq), "batch": args.batch,
                 "d_model": args.d_model, "repeats": args.repeats, "warmup": args.warmup,
                 "impls": args.impls and tuple(args.impls)}
    cfg = common.build_or_exit(p, lambda: dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None}))
    return args, cfg


def write(rows: list[dict], cfg: TimingConfig, load_before, out: Path) -> dict:
    """results.json, table.md and timing.png; returns the results."""
    rows = sorted(rows, key=lambda r: (r["seq"], r["impl"], r["heads"]))
    text = table(rows, cfg)
    load = {"before": load_before, "after": os.getloadavg(), "cpu_count": os.cpu_count()}
    text += (f"\nLoad average (1/5/15 min) before {load['before'][0]:.1f}/{load['before'][1]:.1f}/{load['before'][2]:.1f}, "
             f"after {load['after'][0]:.1f}/{load['after'][1]:.1f}/{load['after'][2]:.1f} on {load['cpu_count']} CPUs "
             f"({common.cpu_model()}).\n")
    results = {"config": dataclasses.asdict(cfg), "metadata": common.run_metadata(), "load_average": load, "rows": rows}
    write_json(out / "results.json", results)
    write_atomic(out / "table.md", text)
    fig = plotting.timing_plot(rows, title=(f"Multi-head self-attention on {jax.default_backend().upper()}: batch {cfg.batch}, "
                                            f"d_model {cfg.d_model}, float32 (median of {cfg.repeats})"))
    save_figure(fig, out / "timing.png")
    print(text)
    print(f"wrote {out}/results.json, table.md, timing.png")
    return results


def main(argv=None) -> dict:
    common.start_study()
    args, cfg = parse(argv)
    use_agg_backend()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    from tqdm.auto import tqdm

    jobs = [(impl, h, n) for n in cfg.seqs for h in cfg.heads for impl in cfg.impls]
    load_before = os.getloadavg()  # other processes slow every row alike; the load says how much
    rows = []
    try:
        for impl, h, n in tqdm(jobs, desc="timing", unit="config", disable=args.no_progress):
            rows.append(time_one(impl, h, n, cfg))
    except KeyboardInterrupt:
        raise Interrupted(f"{len(rows)} of {len(jobs)} timings were done and are not kept (timings are compared "
                          "within one run)", resumes=False) from None
    return write(rows, cfg, load_before, out)


if __name__ == "__main__":
    common.cli(main, MODULE)
