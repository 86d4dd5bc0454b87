"""Score and mask functions against their dense and built-in equivalents, forward+backward.

    python -m experiments.mod_benchmark            # N = 4,096 and 16,384, B=1, H=8, D=64
    python -m experiments.mod_benchmark --smoke    # one tiny size, seconds

Rows (causal, float32, grad w.r.t. q, k, v and the ALiBi slopes):
* ALiBi as a `score_mod` (blockwise: nothing (N, S) is built) vs the same ALiBi as a
  dense `(1, H, N, S)` bias built from the slopes inside the step (blockwise too, so
  only the bias differs). The dense step runs only up to `--dense-max-n`; beyond, its
  XLA temp memory is read from `jax.jit(...).lower(...).compile().memory_analysis()`
  without running it (the row says so).
* A sliding window (256 keys back) as a `mask_mod` vs `local_window_size=(256, 0)`.
Prints a table and writes JSON to results/mod_benchmark/ (atomic write).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import median_seconds, run_metadata, write_json
from jax_mha import attention

FULL = dict(seqs=(4096, 16384), heads=8, head_dim=64, window=256)
SMOKE = dict(seqs=(256,), heads=2, head_dim=16, window=32)


def _alibi_slopes(h: int) -> jax.Array:
    return 2.0 ** (-8.0 * jnp.arange(1, h + 1, dtype=jnp.float32) / h)  # Press et al. 2022


def make_step(kind: str, n: int, h: int, window: int):
    """`step(q, k, v, slopes) -> (loss, grads)`, jitted, for one row kind."""
    def loss(q, k, v, slopes):
        if kind == "alibi_score_mod":
            mod = lambda s, b, hh, i, j: s + slopes[hh] * (j - i).astype(s.dtype)
            out = attention(q, k, v, is_causal=True, score_mod=mod, implementation="blockwise")
        elif kind == "alibi_dense_bias":
            rel = (jnp.arange(n)[None, :] - jnp.arange(n)[:, None]).astype(jnp.float32)
            bias = (slopes[:, None, None] * rel[None])[None]  # (1, H, N, S)
            out = attention(q, k, v, bias=bias, is_causal=True, implementation="blockwise")
        elif kind == "window_mask_mod":
            mod = lambda b, hh, i, j: (j <= i) & (j >= i - window)
            out = attention(q, k, v, mask_mod=mod, implementation="blockwise")
        elif kind == "window_builtin":
            out = attention(q, k, v, is_causal=True, local_window_size=(window, 0), implementation="blockwise")
        else:
            raise ValueError(kind)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))


def measure(kind: str, n: int, h: int, d: int, window: int, repeats: int, run_it: bool) -> dict:
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, h, n, d)), jnp.float32) for _ in range(3))
    slopes = _alibi_slopes(h)
    step = make_step(kind, n, h, window)
    row = dict(kind=kind, n=n, heads=h, head_dim=d)
    try:
        compiled = step.lower(q, k, v, slopes).compile()
        memory = compiled.memory_analysis()
        row["temp_mib"] = None if memory is None else memory.temp_size_in_bytes / 2**20
    except Exception as err:  # noqa: BLE001 - an out-of-memory compile is a result here
        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        return row
    if not run_it:
        row["note"] = "not run (dense bias too large for this machine): memory from memory_analysis only"
        return row
    try:
        sec, first = median_seconds(lambda: jax.block_until_ready(compiled(q, k, v, slopes)), warmup=1,
                                    repeats=repeats)
        row.update(seconds=sec, first_seconds=first)
    except Exception as err:  # noqa: BLE001
        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    return row


def run(config: dict, repeats: int, dense_max_n: int) -> dict:
    rows = []
    h, d, w = config["heads"], config["head_dim"], config["window"]
    for n in config["seqs"]:
        for kind in ("alibi_score_mod", "alibi_dense_bias"):
            rows.append(measure(kind, n, h, d, w, repeats, run_it=kind != "alibi_dense_bias" or n <= dense_max_n))
            print(_line(rows[-1]), flush=True)
    n = max(config["seqs"])
    for kind in ("window_mask_mod", "window_builtin"):
        rows.append(measure(kind, n, h, d, w, repeats, run_it=True))
        print(_line(rows[-1]), flush=True)
    return dict(config=config, rows=rows, ratios=_ratios(rows))


def _line(row: dict) -> str:
    sec = f"{row['seconds']:.3f} s" if "seconds" in row else "-"
    mem = f"{row['temp_mib']:.1f} MiB" if row.get("temp_mib") is not None else "-"
    extra = row.get("error") or row.get("note") or ""
    return f"{row['kind']:<18} N={row['n']:>6}  {sec:>10}  temp {mem:>12}  {extra}"


def _ratios(rows: list[dict]) -> dict:
    """time ratios of each mod to its equivalent, where both ran."""
    by = {(r["kind"], r["n"]): r for r in rows}
    out = {}
    for (kind, n), r in by.items():
        other = {"alibi_score_mod": "alibi_dense_bias", "window_mask_mod": "window_builtin"}.get(kind)
        o = by.get((other, n))
        if o and "seconds" in r and "seconds" in o:
            out[f"{kind}/{other} N={n}"] = r["seconds"] / o["seconds"]
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m experiments.mod_benchmark", description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="one tiny size (seconds)")
    p.add_argument("--repeats", type=int, default=2, help="timed calls per row (median), >= 1")
    p.add_argument("--dense-max-n", type=int, default=4096, help="run the dense-bias rows only up to this N")
    p.add_argument("--out", default=None, help="JSON path (default results/mod_benchmark/[smoke|full].json)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.dense_max_n < 0:
        p.error(f"--dense-max-n must be >= 0, got {args.dense_max_n}")
    config = SMOKE if args.smoke else FULL
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()})")
    result = run(config, args.repeats, args.dense_max_n)
    result.update(smoke=args.smoke, meta=run_metadata())
    for name, ratio in result["ratios"].items():
        print(f"{name}: {ratio:.2f}x")
    out = args.out or f"results/mod_benchmark/{'smoke' if args.smoke else 'full'}.json"
    write_json(out, result)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
