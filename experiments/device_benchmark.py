"""Accelerator benchmark: every attention path that exists on this platform, forward and
forward+backward, over a grid of (B, N, H, D, dtype) with packed sequences (8 documents
per row as segment ids), as % of this device's measured matmul roofline.

    python -m experiments.device_benchmark            # the full grid (GPU/TPU)
    python -m experiments.device_benchmark --smoke    # one tiny size (all that runs on CPU)

Paths: xla and blockwise everywhere; cudnn and pallas_gpu on GPU; pallas_tpu on TPU.
Pallas paths are never timed in interpret mode (on CPU they are skipped): interpret
mode is a correctness tool. Results go to JSON (atomic write) with the device named.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import median_seconds, run_metadata, write_json
from jax_mha import functional

FULL = dict(batch=(1, 8), seq=(1024, 4096, 16384, 32768), heads=(8, 32), head_dim=(64, 128),
            dtype=("float32", "bfloat16"))
SMOKE = dict(batch=(1,), seq=(256,), heads=(2,), head_dim=(64,), dtype=("float32",))
DOCS_PER_ROW = 8


def paths_for(platform: str) -> list[str]:
    """The paths that run natively on `platform` (interpret-mode kernels excluded)."""
    paths = ["xla", "blockwise"]
    if platform == "gpu":
        paths += ["cudnn", "pallas_gpu"]
    if platform == "tpu":
        paths += ["pallas_tpu"]
    return paths


def matmul_roofline(dtype: str, size: int = 8192, repeats: int = 5) -> float:
    """FLOP/s of one big square matmul on this device: the roofline the table divides by."""
    a = jnp.ones((size, size), dtype)
    f = jax.jit(lambda a: a @ a)
    sec, _ = median_seconds(lambda: f(a).block_until_ready(), warmup=2, repeats=repeats)
    return 2 * size**3 / sec


def _segment_ids(batch: int, n: int) -> jax.Array:
    ids = np.minimum(np.arange(n) * DOCS_PER_ROW // n, DOCS_PER_ROW - 1).astype(np.int32)
    return jnp.broadcast_to(jnp.asarray(ids), (batch, n))


def make_call(path: str, seg: jax.Array):
    """`f(q, k, v) -> out` for one path, causal with packed segment ids (a kernel
    path compiles on its own platform: `attention` interprets only elsewhere)."""
    return lambda q, k, v: functional.attention(q, k, v, is_causal=True, implementation=path, q_segment_ids=seg,
                                                kv_segment_ids=seg)


def attention_flops(b, h, n, d, backward: bool) -> float:
    """Causal: half of the 4·B·H·N²·D forward FLOPs; backward is 2.5x forward (FA2's count)."""
    fwd = 4 * b * h * n * n * d / 2
    return fwd * (3.5 if backward else 1.0)


def run(grid: dict, warmup: int, repeats: int) -> dict:
    platform = jax.default_backend()
    rows, roof = [], {}
    for b, n, h, d, dt in itertools.product(*(grid[k] for k in ("batch", "seq", "heads", "head_dim", "dtype"))):
        if dt not in roof:
            roof[dt] = matmul_roofline(dt, size=8192 if platform != "cpu" else 512)
        key = jax.random.split(jax.random.key(0), 3)
        q, k, v = (jax.random.normal(kk, (b, h, n, d), dt) for kk in key)
        seg = _segment_ids(b, n)
        for path in paths_for(platform):
            call = make_call(path, seg)
            fwd = jax.jit(call)
            fb = jax.jit(jax.grad(lambda q, k, v: call(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
            row = dict(path=path, batch=b, seq=n, heads=h, head_dim=d, dtype=dt)
            for name, f, back in (("forward", fwd, False), ("forward_backward", fb, True)):
                try:
                    sec, _ = median_seconds(lambda: jax.block_until_ready(f(q, k, v)), warmup, repeats)
                except Exception as e:  # a path that refuses the size/dtype (e.g. cudnn float32), or OOM
                    row[name] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
                    continue
                flops = attention_flops(b, h, n, d, back)
                row[name] = dict(ms=sec * 1e3, tflops=flops / sec / 1e12, roofline_pct=100 * flops / sec / roof[dt])
            rows.append(row)
            print(_format(row), flush=True)
    return dict(device=str(jax.devices()[0].device_kind), platform=platform,
                matmul_roofline_tflops={k: v / 1e12 for k, v in roof.items()}, rows=rows,
                docs_per_row=DOCS_PER_ROW, causal=True, metadata=run_metadata(), time=time.time())


def _format(row: dict) -> str:
    head = f"{row['path']:<11} B={row['batch']} N={row['seq']:<6} H={row['heads']:<3} D={row['head_dim']:<4} {row['dtype']:<9}"
    cells = []
    for name in ("forward", "forward_backward"):
        r = row[name]
        cells.append(f"{name}: " + (r["error"][:60] if "error" in r else f"{r['ms']:9.3f} ms {r['roofline_pct']:5.1f}%"))
    return head + " | " + " | ".join(cells)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m experiments.device_benchmark", description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="one tiny size (the only thing run on CPU)")
    p.add_argument("--out", default=None, help="JSON path (default results/device_benchmark[_smoke].json)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    platform = jax.default_backend()
    if platform == "cpu" and not args.smoke:
        p.error("on CPU only --smoke runs (the full grid is for GPUs and TPUs)")
    print(f"device: {jax.devices()[0].device_kind} ({platform}); paths: {', '.join(paths_for(platform))}")
    result = run(SMOKE if args.smoke else FULL, warmup=2, repeats=args.repeats)
    result["smoke"] = args.smoke
    print("matmul roofline: " + ", ".join(f"{k} {v:.2f} TFLOP/s" for k, v in result["matmul_roofline_tflops"].items()))
    out = args.out or f"results/device_benchmark{'_smoke' if args.smoke else ''}.json"
    write_json(out, result)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
