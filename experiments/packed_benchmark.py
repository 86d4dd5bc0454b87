"""Packed documents on the blockwise path: forward, backward and forward+backward.

    python -m experiments.packed_benchmark            # N = 4,096 and 16,384, H=8, D=64, causal
    python -m experiments.packed_benchmark --smoke    # one tiny size, seconds

Rows (B=1, float32, causal, `implementation="blockwise"` with its default blocks):
* `one_doc`: one causal document of N tokens (no segment ids);
* `packed`: `--docs` documents of N / docs tokens packed in the same row
  (`q_segment_ids`), each causal within itself.
Modes: `forward` (the output alone), `backward` (the pullback of `jax.vjp` alone, its
residuals computed beforehand), `fwd_bwd` (`value_and_grad` w.r.t. q, k, v in one
jit). Every (row, mode) is timed once per round, the rounds interleaved, so that a
shared machine's load falls on all of them alike; the table gives medians over the
rounds of the wall time and of the process's CPU time (all of XLA's threads: on a
machine shared with other jobs, the steadier measure of the work done), and the
ratios come from those medians (one run).
Prints a table and writes JSON to results/packed_benchmark/ (atomic write).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import run_metadata, write_json
from jax_mha import attention

FULL = dict(seqs=(4096, 16384), heads=8, head_dim=64, docs=8)
SMOKE = dict(seqs=(256,), heads=2, head_dim=16, docs=4)
MODES = ("forward", "backward", "fwd_bwd")


def make_steps(n: int, docs: int | None):
    """`{mode: fn(q, k, v, g)}` for one row (each blocks until ready). `docs` None: one
    document without segment ids."""
    ids = None if docs is None else jnp.repeat(jnp.arange(docs, dtype=jnp.int32), n // docs)[None]  # (1, N)

    def f(q, k, v):
        return attention(q, k, v, is_causal=True, q_segment_ids=ids, implementation="blockwise")

    forward = jax.jit(f)
    with_pullback = jax.jit(lambda q, k, v: jax.vjp(f, q, k, v)[1])
    pull = jax.jit(lambda pullback, g: pullback(g))
    both = jax.jit(jax.value_and_grad(lambda q, k, v, g: jnp.sum(f(q, k, v) * g), argnums=(0, 1, 2)))
    cache = {}

    def backward(q, k, v, g):
        if "pullback" not in cache:  # residuals once, outside the timing
            cache["pullback"] = jax.block_until_ready(with_pullback(q, k, v))
        return pull(cache["pullback"], g)

    return {"forward": lambda q, k, v, g: forward(q, k, v), "backward": backward, "fwd_bwd": both}


def run(config: dict, rounds: int) -> dict:
    h, d, docs = config["heads"], config["head_dim"], config["docs"]
    rng = np.random.default_rng(0)
    rows = []
    for n in config["seqs"]:
        q, k, v, g = (jnp.asarray(rng.normal(size=(1, h, n, d)), jnp.float32) for _ in range(4))
        steps = {kind: make_steps(n, None if kind == "one_doc" else docs) for kind in ("one_doc", "packed")}
        times = {(kind, mode): [] for kind in steps for mode in MODES}
        cpu = {key: [] for key in times}
        for modes in steps.values():  # compile (and the backward's residuals) before timing
            for fn in modes.values():
                jax.block_until_ready(fn(q, k, v, g))
        for _ in range(rounds):
            for (kind, mode), seen in times.items():
                t0, c0 = time.perf_counter(), time.process_time()
                jax.block_until_ready(steps[kind][mode](q, k, v, g))
                seen.append(time.perf_counter() - t0)
                cpu[kind, mode].append(time.process_time() - c0)
        for (kind, mode), seen in times.items():
            rows.append(dict(n=n, kind=kind, mode=mode, heads=h, head_dim=d, docs=1 if kind == "one_doc" else docs,
                             seconds=statistics.median(seen), cpu_seconds=statistics.median(cpu[kind, mode]),
                             samples=seen, cpu_samples=cpu[kind, mode]))
            print(_line(rows[-1]), flush=True)
    return dict(config=config, rounds=rounds, rows=rows, ratios=_ratios(rows))


def _line(row: dict) -> str:
    return (f"N={row['n']:>6}  {row['kind']:<8} {row['mode']:<9} {row['seconds']:9.3f} s wall  "
            f"{row['cpu_seconds']:9.3f} s cpu")


def _ratios(rows: list[dict]) -> dict:
    """Per N and measure (wall, cpu): one document / packed for each mode, and
    backward / forward per row."""
    out = {}
    for measure, field in (("wall", "seconds"), ("cpu", "cpu_seconds")):
        t = {(r["n"], r["kind"], r["mode"]): r[field] for r in rows}
        for n in sorted({r["n"] for r in rows}):
            for mode in MODES:
                out[f"N={n} {measure} {mode} one_doc/packed"] = t[n, "one_doc", mode] / t[n, "packed", mode]
            for kind in ("one_doc", "packed"):
                out[f"N={n} {measure} {kind} backward/forward"] = t[n, kind, "backward"] / t[n, kind, "forward"]
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m experiments.packed_benchmark", description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="one tiny size (seconds)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timed rounds (median), >= 1")
    p.add_argument("--seqs", type=int, nargs="+", default=None, help="sequence lengths (default 4096 16384)")
    p.add_argument("--out", default=None, help="JSON path (default results/packed_benchmark/[smoke|full].json)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    config = dict(SMOKE if args.smoke else FULL)
    if args.seqs is not None:
        bad = [n for n in args.seqs if n < config["docs"] or n % config["docs"]]
        if bad:
            p.error(f"--seqs must be multiples of {config['docs']} (the documents), got {bad}")
        config["seqs"] = tuple(args.seqs)
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()})")
    result = run(config, args.rounds)
    result.update(smoke=args.smoke, meta=run_metadata())
    for name, ratio in result["ratios"].items():
        print(f"{name}: {ratio:.2f}x")
    out = args.out or f"results/packed_benchmark/{'smoke' if args.smoke else 'full'}.json"
    write_json(out, result)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
