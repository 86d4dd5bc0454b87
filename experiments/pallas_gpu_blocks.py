"""The GPU kernel's blocks on this GPU: forward+backward time of
`attention(implementation="pallas_gpu")` (the library's kernel, `jax_mha.paths.flex`),
causal, B=8, H=16, N=S=4096, bfloat16, at D = 64 and 128, for each pair of
(queries, keys) per block (`jax_mha.paths.pallas_gpu.blocks`; the backward's dk/dv
programs use the same blocks). Each pair's gradients are checked against the float32
blockwise engine's.

    python -m experiments.pallas_gpu_blocks             # a GPU only; about a minute on an H200
    python -m experiments.pallas_gpu_blocks --launch    # (num_warps, num_stages) at the library's blocks

Writes `results/pallas_gpu_blocks.json` (atomic), naming the device; the pair the
library uses is `flex.blocks`' (64 x 64: docs/results/composed_attention.md says
why, from this sweep and the composed cases on an H200).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import median_seconds, run_metadata, write_json
from jax_mha import _dispatch, attention
from jax_mha.paths import flex, pallas_gpu

PAIRS = ((64, 64), (128, 64), (64, 128), (128, 128), (32, 64), (64, 32))
LAUNCHES = ((4, 2), (4, 3), (4, 1), (8, 2), (8, 3))  # (num_warps, num_stages), at the library's blocks
B, H, N = 8, 16, 4096


def gradients(implementation: str):
    """The jitted `(dq, dk, dv)` of `sum(attention(...))` (float32 sum)."""
    loss = lambda q, k, v: jnp.sum(attention(q, k, v, is_causal=True, implementation=implementation)
                                   .astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def measure(d: int, q_block: int, k_block: int, want, q, k, v, repeats: int, launch=None) -> dict:
    """One pair at head size `d` (and `launch`, `(num_warps, num_stages)`, when given):
    median ms, first call s, largest gradient error relative to the largest reference
    gradient."""
    saved, saved_launch = pallas_gpu.blocks, (flex.NUM_WARPS, flex.NUM_STAGES)
    pallas_gpu.blocks = lambda n, s: (q_block, k_block)
    flex.NUM_WARPS, flex.NUM_STAGES = launch or saved_launch
    extra = {} if launch is None else dict(num_warps=launch[0], num_stages=launch[1])
    try:
        step = gradients("pallas_gpu")  # a new jit: traced with this pair
        sec, first = median_seconds(lambda: jax.block_until_ready(step(q, k, v)), warmup=1, repeats=repeats)
        got = step(q, k, v)
    except Exception as e:  # a pair Triton cannot compile (shared memory) is recorded, the sweep goes on
        return dict(head_dim=d, q_block=q_block, k_block=k_block, **extra, error=f"{type(e).__name__}: {str(e)[:200]}")
    finally:
        pallas_gpu.blocks = saved
        flex.NUM_WARPS, flex.NUM_STAGES = saved_launch
    err = max(float(np.max(np.abs(np.asarray(g, np.float32) - w)) / max(float(np.max(np.abs(w))), 1e-30))
              for g, w in zip(got, want))
    return dict(head_dim=d, q_block=q_block, k_block=k_block, **extra, ms=sec * 1e3, first_call_s=first,
                relative_error=err)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m experiments.pallas_gpu_blocks", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("results/pallas_gpu_blocks.json"), help="JSON path")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per pair, after one compiling call")
    p.add_argument("--launch", action="store_true",
                   help="sweep (num_warps, num_stages) at the library's blocks instead of the block pairs")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if _dispatch.platform() != "gpu":
        p.error(f"the Triton kernel compiles for a GPU; this backend is {jax.default_backend()}")
    rows = []
    for d in (64, 128):
        keys = jax.random.split(jax.random.key(0), 3)
        q, k, v = (jax.random.normal(key, (B, H, N, d), jnp.bfloat16) for key in keys)
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        want = [np.asarray(g) for g in gradients("blockwise")(*f32)]
        runs = ([(*pallas_gpu.blocks(N, N), launch) for launch in LAUNCHES] if args.launch
                else [(*pair, None) for pair in PAIRS])
        for q_block, k_block, launch in runs:
            rows.append(measure(d, q_block, k_block, want, q, k, v, args.repeats, launch))
            row = rows[-1]
            write_json(args.out, dict(kind="pallas_gpu_blocks", partial=True, rows=rows))
            print(f"D={d:<4} q_block={q_block:<4} k_block={k_block:<3} launch={launch} " + (
                f"{row['ms']:8.3f} ms  error {row['relative_error']:.1e}" if "ms" in row else row["error"]), flush=True)
    result = dict(kind="pallas_gpu_blocks", device=str(jax.devices()[0].device_kind), batch=B, heads=H, seq=N, dtype="bfloat16", causal=True,
                  library_pairs={d: pallas_gpu.blocks(N, N) for d in (64, 128)},
                  library_launch=(flex.NUM_WARPS, flex.NUM_STAGES), swept="launch" if args.launch else "blocks", rows=rows,
                  metadata=run_metadata())
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
