"""Peak memory of attention forward + backward vs sequence length: "xla" vs "blockwise".

The "xla" path materialises the `(B, H, N, N)` logits and weights (and their
gradients), so its memory grows as N^2; the blockwise path (online softmax with a
recomputing custom VJP, `jax_mha.blockwise`) should grow as N. Each (N, implementation)
runs `jit(grad(sum(attention(q, k, v))))` w.r.t. q, k, v once, in a fresh Python
process, so its peak resident set size (ru_maxrss, from `os.wait4`) is its own.

    python -m experiments.blockwise_memory                       # N = 2048 ... 32768; minutes on 2 CPU cores
    python -m experiments.blockwise_memory --lengths 512 1024 --out /tmp/bm/results.json   # smoke run

A child whose RSS passes --max-rss-gib (or that leaves the machine with under
--min-free-gib of available memory) is killed and recorded as "OOM", and that
implementation is skipped at every larger N. Results (written after every row, via a
temporary file and os.replace): --out (JSON) and a log-log plot of peak RSS vs N beside
it (peak_rss.png).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

IMPLEMENTATIONS = ("xla", "blockwise")
RESULT_PREFIX = "BLOCKWISE_MEMORY_RESULT "  # marks the child's one line of JSON on stdout
GIB = 1024**3
POLL_S = 0.05  # RSS sampling interval of the parent while a child runs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(
            "Peak RSS and wall time of jitted forward+backward attention (grad of "
            "sum(out) w.r.t. q, k, v) for the 'xla' and 'blockwise' implementations, "
            "one fresh process per (N, implementation)."
        )
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768],
                        help="sequence lengths N (= S, self-attention) to measure, ascending "
                             "(default: %(default)s)")
    parser.add_argument("--implementations", nargs="+", choices=IMPLEMENTATIONS,
                        default=list(IMPLEMENTATIONS),
                        help="implementations to compare (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=1, help="batch size B (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=8, help="heads H (default: %(default)s)")
    parser.add_argument("--head-dim", type=int, default=64, help="head dim D (default: %(default)s)")
    parser.add_argument("--causal", action="store_true",
                        help="use is_causal=True (default: full bidirectional attention)")
    parser.add_argument("--query-block-size", type=int, default=512,
                        help="blockwise query block size (default: %(default)s)")
    parser.add_argument("--key-block-size", type=int, default=1024,
                        help="blockwise key block size (default: %(default)s)")
    parser.add_argument("--max-rss-gib", type=float, default=16.0,
                        help="kill a child whose resident memory passes this many GiB and "
                             "record it as OOM; larger N of that implementation are then "
                             "skipped (default: %(default)s)")
    parser.add_argument("--min-free-gib", type=float, default=1.0,
                        help="also kill (as OOM) a child when the machine's MemAvailable "
                             "drops below this many GiB: the machine is shared "
                             "(default: %(default)s)")
    parser.add_argument("--timeout-s", type=float, default=1800.0,
                        help="wall-clock limit per child in seconds; recorded as 'timeout' "
                             "(default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("results/blockwise_memory/results.json"),
                        help="JSON results file; the plot peak_rss.png goes beside it "
                             "(default: %(default)s)")
    parser.add_argument("--plot-only", action="store_true",
                        help="measure nothing: redraw the plot from the existing --out JSON")
    parser.add_argument("--child", action="store_true",
                        help="internal: measure one --lengths value for one --implementations "
                             "value in this process and print the result as JSON")
    args = parser.parse_args(argv)
    if min(args.lengths) < 1 or min(args.batch, args.heads, args.head_dim) < 1:
        parser.error("--lengths, --batch, --heads and --head-dim must be positive")
    if args.max_rss_gib <= 0:
        parser.error(f"--max-rss-gib must be positive, got {args.max_rss_gib}")
    args.lengths = sorted(set(args.lengths))
    return args


# --------------------------------------------------------------------------------------
# Child: one measurement.
# --------------------------------------------------------------------------------------


def _self_rss_gib() -> float:
    """Peak RSS of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def run_child(args: argparse.Namespace) -> None:
    """Compiles and runs forward+backward once; prints one RESULT line of JSON."""
    import jax
    import jax.numpy as jnp

    from jax_mha.functional import attention

    (n,), (impl,) = args.lengths, args.implementations
    shape = (args.batch, args.heads, n, args.head_dim)  # (B, H, N, D)
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, shape, jnp.float32) for key in (kq, kk, kv))
    blocks = {}
    if impl == "blockwise":
        blocks = dict(query_block_size=args.query_block_size, key_block_size=args.key_block_size)

    def loss(q, k, v):
        out = attention(q, k, v, is_causal=args.causal, implementation=impl, **blocks)
        return jnp.sum(out)

    grad_fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    jax.block_until_ready((q, k, v))
    baseline = _self_rss_gib()  # Python + JAX + inputs, before any attention buffer exists

    start = time.perf_counter()
    compiled = grad_fn.lower(q, k, v).compile()
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    grads = jax.block_until_ready(compiled(q, k, v))
    run_s = time.perf_counter() - start
    finite = all(bool(jnp.isfinite(g).all()) for g in grads)
    result = {
        "baseline_rss_gib": baseline,
        "child_peak_rss_gib": _self_rss_gib(),
        "compile_s": compile_s,
        "run_s": run_s,
        "grads_finite": finite,
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# --------------------------------------------------------------------------------------
# Parent: one fresh process per (N, implementation), RSS watched from outside.
# --------------------------------------------------------------------------------------


def _rss_gib(pid: int) -> float:
    """Current resident set size of `pid` (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    return 0.0


def _available_gib() -> float:
    """The machine's MemAvailable (inf where /proc/meminfo is missing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    return float("inf")


def measure(args: argparse.Namespace, n: int, impl: str) -> dict:
    """Runs one child and watches it; returns a result row."""
    cmd = [
        sys.executable, "-m", "experiments.blockwise_memory", "--child",
        "--lengths", str(n), "--implementations", impl,
        "--batch", str(args.batch), "--heads", str(args.heads), "--head-dim", str(args.head_dim),
        "--query-block-size", str(args.query_block_size),
        "--key-block-size", str(args.key_block_size),
    ] + (["--causal"] if args.causal else [])
    row = {"n": n, "implementation": impl}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        killed_for = None
        polled_peak = 0.0
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid == proc.pid:
                break
            rss = _rss_gib(proc.pid)
            polled_peak = max(polled_peak, rss)
            if killed_for is None:
                if rss > args.max_rss_gib:
                    killed_for = f"RSS {rss:.2f} GiB > --max-rss-gib {args.max_rss_gib}"
                elif _available_gib() < args.min_free_gib:
                    killed_for = f"machine MemAvailable < --min-free-gib {args.min_free_gib}"
                elif time.perf_counter() - start > args.timeout_s:
                    killed_for = f"timeout after {args.timeout_s:.0f} s"
                if killed_for is not None:
                    os.kill(proc.pid, signal.SIGKILL)  # our own child, by pid
            time.sleep(POLL_S)
        wall_s = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()

    # ru_maxrss of this child alone (KiB on Linux), valid even when it was killed.
    row["peak_rss_gib"] = max(usage.ru_maxrss * 1024 / GIB, polled_peak)
    row["wall_s"] = wall_s
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if killed_for is not None:
        row["status"] = "timeout" if killed_for.startswith("timeout") else "OOM"
        row["reason"] = killed_for
    elif proc.returncode == -signal.SIGKILL:
        row["status"], row["reason"] = "OOM", "killed by SIGKILL (kernel OOM killer?)"
    elif proc.returncode != 0 or not lines:
        oom = "RESOURCE_EXHAUSTED" in stderr or "MemoryError" in stderr
        row["status"] = "OOM" if oom else "error"
        row["reason"] = (stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1][-500:]
    else:
        row.update(json.loads(lines[-1][len(RESULT_PREFIX):]))
        row["status"] = "ok" if row["grads_finite"] else "error"
        if not row["grads_finite"]:
            row["reason"] = "non-finite gradients"
    return row


def print_row(row: dict) -> None:
    if row["status"] == "skipped":
        print(f"{row['n']:>7} {row['implementation']:>10} {'skipped':>8}", flush=True)
        return
    timing = (f"{row['compile_s']:>9.1f} {row['run_s']:>8.1f}" if row["status"] == "ok"
              else f"{'-':>9} {'-':>8}")
    note = f"  ({row['reason']})" if "reason" in row else ""
    print(f"{row['n']:>7} {row['implementation']:>10} {row['status']:>8} "
          f"{row['peak_rss_gib']:>10.2f} {timing} {row['wall_s']:>8.1f}{note}", flush=True)


def plot(rows: list[dict], args: argparse.Namespace, path: Path) -> None:
    """Log-log peak RSS vs N, one line per implementation; OOM marked at the cap."""
    from experiments.common import save_figure, use_agg_backend

    use_agg_backend()
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for impl, color in zip(args.implementations, ("tab:red", "tab:blue")):
        ok = [r for r in rows if r["implementation"] == impl and r["status"] == "ok"]
        ax.plot([r["n"] for r in ok], [r["peak_rss_gib"] for r in ok], "o-", color=color,
                label=impl)
        oom = [r for r in rows if r["implementation"] == impl and r["status"] in ("OOM", "timeout")]
        if oom:
            # Drawn at the cap: an allocation refused up front leaves a small measured peak.
            ax.plot([r["n"] for r in oom], [args.max_rss_gib] * len(oom), "x", color=color,
                    markersize=10, mew=2, label=f"{impl}: {oom[0]['status']}")
    ax.axhline(args.max_rss_gib, color="gray", ls="--", lw=1, label=f"cap {args.max_rss_gib:g} GiB")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length N (= S)")
    ax.set_ylabel("peak RSS of the process (GiB)")
    causal = ", causal" if args.causal else ""
    ax.set_title(f"Attention forward+backward memory (B={args.batch}, H={args.heads}, "
                 f"D={args.head_dim}{causal})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        if len(args.lengths) != 1 or len(args.implementations) != 1:
            raise SystemExit("--child needs exactly one length and one implementation")
        run_child(args)
        return

    from experiments.common import run_metadata, write_json

    if args.plot_only:
        saved = json.loads(args.out.read_text())
        args = argparse.Namespace(**{**vars(args), **saved["config"], "out": args.out})
        plot(saved["rows"], args, args.out.parent / "peak_rss.png")
        print(f"wrote {args.out.parent / 'peak_rss.png'}")
        return

    config = {key: (str(val) if isinstance(val, Path) else val)
              for key, val in vars(args).items() if key not in ("child", "plot_only")}
    rows: list[dict] = []
    failed: set[str] = set()
    print(f"{'N':>7} {'impl':>10} {'status':>8} {'peak GiB':>10} {'compile s':>9} "
          f"{'run s':>8} {'wall s':>8}", flush=True)
    for n in args.lengths:
        for impl in args.implementations:
            if impl in failed:
                row = {"n": n, "implementation": impl, "status": "skipped",
                       "reason": f"{impl} already failed at a smaller N"}
            else:
                row = measure(args, n, impl)
                if row["status"] != "ok":
                    failed.add(impl)
            rows.append(row)
            print_row(row)
            write_json(args.out, {"config": config, "metadata": run_metadata(), "rows": rows})
    plot(rows, args, args.out.parent / "peak_rss.png")
    print(f"wrote {args.out} and {args.out.parent / 'peak_rss.png'}")


if __name__ == "__main__":
    main()
