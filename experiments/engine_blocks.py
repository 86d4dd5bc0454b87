"""The blockwise engine's blocks on this device: forward+backward time of
`attention(implementation="blockwise", query_block_size=..., key_block_size=...)`,
B=4, H=16, N=S=8192, D=64, bfloat16, causal and unmasked, for each (queries, keys)
pair per block; the pairs `blockwise.default_blocks` picks on this platform are recorded.
The engine is the path of whatever no kernel takes, so its blocks are chosen per
platform from this sweep (`blockwise.DEVICE_BLOCKS`).

    python -m experiments.engine_blocks            # a GPU or TPU; about a minute on an H200
    python -m experiments.engine_blocks --smoke    # one tiny size, seconds, on CPU too

Each pair: one compiling call, then `--repeats` timed calls (median, min, max). No pair
starts after `--budget` seconds. Writes `results/engine_blocks.json` (atomic), naming the
device, after every pair, so a stopped run keeps what it measured.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from experiments import common_flex
from experiments.common import run_metadata, write_json
from jax_mha import _dispatch, attention
from jax_mha.paths import blockwise

PAIRS = ((256, 256), (512, 512), (1024, 512), (1024, 1024), (2048, 256), (2048, 512), (2048, 1024), (4096, 1024))
SIZES = dict(batch=4, heads=16, seq=8192, head_dim=64, dtype="bfloat16")
SMOKE = dict(batch=1, heads=2, seq=256, head_dim=16, dtype="float32")


def gradients(is_causal: bool, q_block: int, k_block: int):
    """The jitted `(dq, dk, dv)` of `sum(attention(...))` (float32 sum) on the engine."""
    loss = lambda q, k, v: jnp.sum(attention(q, k, v, is_causal=is_causal, implementation="blockwise",
                                             query_block_size=q_block, key_block_size=k_block).astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def measure(is_causal: bool, q_block: int, k_block: int, args: tuple, repeats: int) -> dict:
    """One pair: `first_call_s` and the median/min/max ms of `repeats` timed calls
    (`common_flex.round_robin` of one step), or the `error` that stopped it."""
    step = gradients(is_causal, q_block, k_block)
    cell = common_flex.round_robin({"step": lambda: jax.block_until_ready(step(*args))}, repeats)["step"]
    cell.pop("times_ms", None)
    return dict(causal=is_causal, q_block=q_block, k_block=k_block, **cell)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m experiments.engine_blocks", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("results/engine_blocks.json"), help="JSON path")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per pair, after one compiling call")
    p.add_argument("--budget", type=float, default=150.0, help="no pair starts after this many seconds")
    p.add_argument("--smoke", action="store_true", help="one tiny size in float32 (runs on CPU)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.budget < 0:
        p.error(f"--budget must be >= 0 seconds, got {args.budget:g}")
    platform = _dispatch.platform()
    if platform == "cpu" and not args.smoke:
        p.error("the sweep is for a GPU or TPU; on CPU only --smoke runs")
    sizes = SMOKE if args.smoke else SIZES
    pairs = ((64, 64), (128, 128)) if args.smoke else PAIRS
    shape = (sizes["batch"], sizes["heads"], sizes["seq"], sizes["head_dim"])
    q, k, v = (jax.random.normal(key, shape, sizes["dtype"]) for key in jax.random.split(jax.random.key(0), 3))
    result = dict(kind="engine_blocks", device=str(jax.devices()[0].device_kind), platform=platform, **sizes,
                  defaults={"causal": blockwise.default_blocks(True, None, platform=platform),
                            "unmasked": blockwise.default_blocks(False, None, platform=platform)},
                  budget_s=args.budget, rows=[], metadata=run_metadata())
    start = time.monotonic()
    for is_causal in (True, False):
        for q_block, k_block in pairs:
            if time.monotonic() - start > args.budget:
                result["stopped_early"] = True
                break
            row = measure(is_causal, q_block, k_block, (q, k, v), args.repeats)
            result["rows"].append(row)
            write_json(args.out, result)
            print(f"causal={is_causal!s:<5} q_block={q_block:<5} k_block={k_block:<5} " + (
                f"{row['ms']:9.3f} ms [{row['ms_min']:.3f}-{row['ms_max']:.3f}]" if "ms" in row else row["error"]),
                flush=True)
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
