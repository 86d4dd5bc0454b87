"""Peak memory of attention forward + backward vs sequence length: "xla" vs "blockwise".

The "xla" path on its whole-scores route (the one it takes while the scores are small,
held here at every N by `return_weights=True`) materialises the `(B, H, N, N)` logits
and weights (and their gradients), so its memory grows as N^2; the blockwise path
(online softmax with a recomputing custom VJP, `jax_mha.paths.blockwise`) should grow as N.
Each (N, implementation) runs `jit(grad(sum(attention(q, k, v))))` w.r.t. q, k, v
once, in a fresh Python process, so its peak resident set size (ru_maxrss, from
`os.wait4`) is its own.

    python -m experiments.blockwise_memory            # N = 1024 ... 8192: ~1 min, ~11 GiB free memory
    python -m experiments.blockwise_memory --full     # adds N = 16384 and 32768: ~5 min, ~16 GiB free
    python -m experiments.blockwise_memory --lengths 512 1024 --out /tmp/bm/results.json   # smoke run

The first line of output states the memory the run needs (estimated from the sizes)
and what the machine has free. A child whose RSS passes --max-rss-gib (or that leaves
the machine with under --min-free-gib of available memory) is killed and recorded as
"OOM", and that implementation is skipped at every larger N. Results and the log-log
plot of peak RSS vs N (peak_rss.png, beside --out) are written after every row; a
rerun with the same settings skips the rows already measured (--force measures them
again). A measuring child dies with its parent (Ctrl-C, or the parent killed).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from experiments import common

IMPLEMENTATIONS = ("xla", "blockwise")
RESULT_PREFIX = "BLOCKWISE_MEMORY_RESULT "  # marks the child's one line of JSON on stdout
GIB = 1024**3
POLL_S = 0.05  # RSS sampling interval of the parent while a child runs


QUICK_LENGTHS = (1024, 2048, 4096, 8192)
FULL_LENGTHS = QUICK_LENGTHS + (16384, 32768)
BASE_GIB = 0.55  # Python, JAX and small inputs, measured as the blockwise child's floor


def build_parser() -> argparse.ArgumentParser:
    p = common.parser("experiments.blockwise_memory",
                      "Peak RSS and wall time of jitted forward+backward attention (grad of sum(out) w.r.t. q, k, v) "
                      "for the 'xla' and 'blockwise' implementations, one fresh process per (N, implementation). The default "
                           "(N = 1024 ... 8192) takes ~1 min and ~11 GiB of free memory on a 2-core CPU.")
    p.add_argument("--lengths", type=common.positive_int, nargs="+",
                   help=f"sequence lengths N (= S, self-attention) (default {' '.join(map(str, QUICK_LENGTHS))}; "
                        f"--full: {' '.join(map(str, FULL_LENGTHS))})")
    p.add_argument("--full", action="store_true", help="also N = 16384 and 32768 (~5 min; ~16 GiB free memory: the xla child at N=16384 "
                        "asks for more and is killed at --max-rss-gib)")
    p.add_argument("--implementations", nargs="+", choices=IMPLEMENTATIONS, default=list(IMPLEMENTATIONS),
                   help="implementations to compare (default: %(default)s)")
    p.add_argument("--batch", type=common.positive_int, default=1, help="batch size B (default: %(default)s)")
    p.add_argument("--heads", type=common.positive_int, default=8, help="heads H (default: %(default)s)")
    p.add_argument("--head-dim", type=common.positive_int, default=64, help="head dim D (default: %(default)s)")
    p.add_argument("--causal", action="store_true", help="use is_causal=True (default: full bidirectional attention)")
    p.add_argument("--query-block-size", type=common.positive_int,
                   help="blockwise query block size (default: the library's, jax_mha.paths.blockwise.default_blocks)")
    p.add_argument("--key-block-size", type=common.positive_int,
                   help="blockwise key block size (default: the library's, jax_mha.paths.blockwise.default_blocks)")
    p.add_argument("--max-rss-gib", type=common.positive_float, default=16.0,
                   help="kill a child whose resident memory passes this many GiB and record it as OOM; larger N "
                        "of that implementation are then skipped (default: %(default)s)")
    p.add_argument("--min-free-gib", type=common.nonnegative_float, default=1.0,
                   help="also kill (as OOM) a child when the machine's MemAvailable drops below this many GiB: "
                        "the machine is shared (default: %(default)s)")
    p.add_argument("--timeout-s", type=common.positive_float, default=1800.0,
                   help="wall-clock limit per child in seconds; recorded as 'timeout' (default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path("results/blockwise_memory/results.json"),
                   help="JSON results file; the plot peak_rss.png goes beside it (default: %(default)s)")
    p.add_argument("--force", action="store_true", help="measure every row again instead of resuming")
    p.add_argument("--plot-only", action="store_true", help="measure nothing: redraw the plot from the existing --out JSON")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # internal: one measurement
    p.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)  # internal: the child dies with it
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.lengths is None:
        args.lengths = list(FULL_LENGTHS if args.full else QUICK_LENGTHS)
    args.lengths = sorted(set(args.lengths))
    return args


def estimate_gib(impl: str, n: int, args: argparse.Namespace) -> float:
    """Peak RSS a child is expected to need: the whole-scores route holds about five
    (B, H, N, N) float32 arrays at once (logits, weights and their gradients;
    measured 10.9 GiB at N=8192 where this says 10.6); blockwise about six
    (B, H, N, D) arrays (inputs, output, their gradients)."""
    if impl == "xla":
        return BASE_GIB + 5 * args.batch * args.heads * n * n * 4 / GIB
    return BASE_GIB + 6 * args.batch * args.heads * n * args.head_dim * 4 / GIB


def memory_line(args: argparse.Namespace) -> str:
    """The first line of output: what the run needs and what the machine has."""
    need = max((estimate_gib(i, n, args), i, n) for i in args.implementations for n in args.lengths)
    capped = min(need[0], args.max_rss_gib)
    return (f"needs about {capped:.1f} GiB of free memory (the largest child: {need[1]} at N={need[2]}, "
            f"~{need[0]:.1f} GiB{', capped by --max-rss-gib' if need[0] > args.max_rss_gib else ''}); "
            f"this machine has {_available_gib():.1f} GiB available")


# --------------------------------------------------------------------------------------
# Child: one measurement.
# --------------------------------------------------------------------------------------


def _self_rss_gib() -> float:
    """Peak RSS of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def run_child(args: argparse.Namespace) -> None:
    """Compiles and runs forward+backward once; prints one RESULT line of JSON."""
    if args.parent_pid is not None:
        _die_with_parent(args.parent_pid)
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
        # "xla" builds the whole scores only while they are small (WHOLE_SCORES_MAX_BYTES)
        # and runs the blockwise engine beyond; asking for the weights keeps it on the
        # whole-scores route at every N, the N^2 baseline this study measures.
        out = attention(q, k, v, is_causal=args.causal, implementation=impl, return_weights=impl == "xla", **blocks)
        return jnp.sum(out[0] if impl == "xla" else out)

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


def _die_with_parent(parent_pid: int) -> None:
    """In the child: be SIGKILLed when the parent dies (Linux), so a measuring
    process never outlives the run, whatever ends the parent. Set here rather than
    in a preexec_fn, which is unsafe once the parent runs XLA threads; a parent that
    died before this call is caught by the getppid check."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the parent's kill on Ctrl-C still covers the common case
    if os.getppid() != parent_pid:
        os._exit(1)


def _child_cmd(args: argparse.Namespace, n: int, impl: str) -> list[str]:
    return [
        sys.executable, "-m", "experiments.blockwise_memory", "--child",
        "--lengths", str(n), "--implementations", impl,
        "--batch", str(args.batch), "--heads", str(args.heads), "--head-dim", str(args.head_dim),
        "--parent-pid", str(os.getpid()),
    ] + (["--causal"] if args.causal else []) + [
        arg for flag, size in (("--query-block-size", args.query_block_size), ("--key-block-size", args.key_block_size))
        if size is not None for arg in (flag, str(size))
    ]


def _watch(proc: subprocess.Popen, args: argparse.Namespace) -> tuple[int, Any, str | None, float]:
    """Polls a child until it exits, killing it past a limit:
    `(exit status, rusage, why it was killed or None, polled peak GiB)`."""
    start, killed_for, polled_peak = time.perf_counter(), None, 0.0
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid == proc.pid:
            return status, usage, killed_for, polled_peak
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


def error_reason(stderr: str, returncode: int) -> str:
    """The line of a child's stderr that says what went wrong: the last exception
    line (`SomeError: ...`), not JAX's closing note about filtered frames."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", line)]
    return (errors or lines or [f"exit code {returncode}"])[-1][-500:]


def _classify(row: dict, code: int, killed_for: str | None, stdout: str, stderr: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if killed_for is not None:
        row.update(status="timeout" if killed_for.startswith("timeout") else "OOM", reason=killed_for)
    elif code == -signal.SIGKILL:
        row.update(status="OOM", reason="killed by SIGKILL (kernel OOM killer?)")
    elif code != 0 or not lines:
        oom = "RESOURCE_EXHAUSTED" in stderr or "MemoryError" in stderr
        row.update(status="OOM" if oom else "error", reason=error_reason(stderr, code))
    else:
        row.update(json.loads(lines[-1][len(RESULT_PREFIX):]))
        row["status"] = "ok" if row["grads_finite"] else "error"
        if not row["grads_finite"]:
            row["reason"] = "non-finite gradients"
    return row


def measure(args: argparse.Namespace, n: int, impl: str) -> dict:
    """Runs one child and watches it; returns a result row. The child is killed if
    this process is interrupted."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(_child_cmd(args, n, impl), stdout=out, stderr=err, env=common.child_env())
        try:
            status, usage, killed_for, polled_peak = _watch(proc, args)
        finally:
            if proc.returncode is None and _rss_gib(proc.pid) > 0:
                proc.kill()
                proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    # ru_maxrss of this child alone (KiB on Linux), valid even when it was killed.
    row = {"n": n, "implementation": impl, "peak_rss_gib": max(usage.ru_maxrss * 1024 / GIB, polled_peak),
           "wall_s": time.perf_counter() - start, "estimated_gib": estimate_gib(impl, n, args)}
    return _classify(row, os.waitstatus_to_exitcode(status), killed_for, stdout, stderr)


def print_row(row: dict, resumed: bool = False) -> None:
    if row["status"] == "skipped":
        print(f"{row['n']:>7} {row['implementation']:>10} {'skipped':>8}", flush=True)
        return
    timing = (f"{row['compile_s']:>9.1f} {row['run_s']:>8.1f}" if row["status"] == "ok"
              else f"{'-':>9} {'-':>8}")
    note = f"  ({row['reason']})" if "reason" in row else ""
    note += "  (from the earlier run)" if resumed else ""
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


def _config(args: argparse.Namespace) -> dict:
    """What makes two runs' rows comparable (the lengths are not part of it: a rerun
    with more lengths extends the same file)."""
    skip = ("child", "plot_only", "force", "lengths", "full", "out")
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in skip}


def _rows_problem(data) -> str | None:
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list) or not isinstance(data.get("config"), dict):
        return "it does not hold a 'config' object and a list of 'rows'"
    if not all(isinstance(r, dict) and {"n", "implementation", "status"} <= set(r) for r in data["rows"]):
        return "a row lacks n, implementation or status"
    return None


def previous_rows(args: argparse.Namespace) -> list[dict]:
    """Rows of an earlier run with the same settings, to resume; [] with --force."""
    if args.force or not args.out.exists():
        return []
    saved = common.read_results(args.out, _rows_problem)
    if saved["config"] != _config(args):
        raise SystemExit(f"error: {args.out} was measured with other settings; use another --out, or --force")
    return [r for r in saved["rows"] if r["status"] != "skipped"]


def measure_all(args: argparse.Namespace, rows: list[dict]) -> list[dict]:
    """Every (N, implementation) not in `rows`, smallest N first; results and the plot
    are rewritten after each."""
    done = {(r["n"], r["implementation"]): r for r in rows}
    failed = {r["implementation"] for r in rows if r["status"] != "ok"}
    rows = []
    for n in args.lengths:
        for impl in args.implementations:
            if (n, impl) in done:
                row = done[(n, impl)]
            elif impl in failed:
                row = {"n": n, "implementation": impl, "status": "skipped", "reason": f"{impl} already failed at a smaller N"}
            else:
                row = measure(args, n, impl)
                failed |= {impl} if row["status"] != "ok" else set()
            rows.append(row)
            print_row(row, resumed=(n, impl) in done)
            common.write_json(args.out, {"config": _config(args), "metadata": common.run_metadata(), "rows": rows})
            plot(rows, args, args.out.parent / "peak_rss.png")
    return rows


def main(argv: list[str] | None = None) -> int:
    common.start_study(("matplotlib",))
    args = parse_args(argv)
    if args.child:
        run_child(args)
        return 0
    if args.plot_only:
        saved = common.read_results(args.out, _rows_problem)
        args = argparse.Namespace(**{**vars(args), **saved["config"], "out": args.out})
        plot(saved["rows"], args, args.out.parent / "peak_rss.png")
        print(f"wrote {args.out.parent / 'peak_rss.png'}")
        return 0
    print(memory_line(args), flush=True)
    rows = previous_rows(args)
    print(f"{'N':>7} {'impl':>10} {'status':>8} {'peak GiB':>10} {'compile s':>9} {'run s':>8} {'wall s':>8}", flush=True)
    try:
        rows = measure_all(args, rows)
    except KeyboardInterrupt:
        raise common.Interrupted(f"the rows measured so far are in {args.out}") from None
    print(f"wrote {args.out} and {args.out.parent / 'peak_rss.png'}")
    errors = [r for r in rows if r["status"] == "error"]
    if errors:
        print(f"error: {len(errors)} measurement(s) failed, e.g. N={errors[0]['n']} {errors[0]['implementation']}: "
              f"{errors[0]['reason']}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    common.cli(lambda argv: sys.exit(main(argv)), "experiments.blockwise_memory")
