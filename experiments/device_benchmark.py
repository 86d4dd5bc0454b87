"""Accelerator benchmark: every jax_mha attention path this platform compiles, jax.nn's
dot_product_attention ("cudnn" and "xla") and PyTorch's SDPA (when torch with CUDA is
installed), forward and forward+backward, causal and causal with 8 packed documents;
and, with `--preset flex`, composed attention against PyTorch's FlexAttention.

    python -m experiments.device_benchmark --preset quick   # B=8, H=16, N 1k/4k/16k, D 64/128, bf16
    python -m experiments.device_benchmark --preset float16 # the quick sizes, causal, float16 (pallas_mgpu)
    python -m experiments.device_benchmark --preset full    # more sizes and float32 (no budget)
    python -m experiments.device_benchmark --preset flex    # composed cases: B=8, H=16, N 4k/16k, D 64/128, bf16
    python -m experiments.device_benchmark --preset flex --seq 16384 --head-dim 64   # a part of that grid
    python -m experiments.device_benchmark --smoke          # one tiny size: with --preset flex
                                                            # (every flex case), the only things run on CPU

`--preset quick` took 138 s on an H200, compilation included (docs/results/gpu_kernels.md),
and stops early with what it has when `--budget` seconds (default 420) run out. Pallas paths are never timed in interpret
mode (on CPU they are not run). A call a path refuses (its `refusal`, as `"auto"` reads it) is recorded with the reason, untimed;
one that fails (out of memory, a kernel error) with its error.

FLOPs count the visible pairs only: causal N(N+1)/2 per head, 8 packed causal documents
of d = N/8 tokens 8·d(d+1)/2, times 4·D forward (two matmuls) and 3.5x that for
forward+backward (FlashAttention-2's count). TFLOP/s is given as a % of the device's
dense bfloat16 spec peak where the device kind is known (`PEAK_TFLOPS`). Results:
JSON (atomic) and a figure, both naming the device.

`--preset flex` (the cases: `experiments.common_flex`): plain causal, ALiBi by
`score_mod` over traced slopes, soft cap 30, 8 packed documents by `mask_mod` over
traced ids, a (1024, 1024) window, prefix-LM by `mask_mod`, traced sinks, and a T5
relative-position table by `score_mod`, each forward and forward+backward (gradients
of q, k, v) by jax_mha's `"pallas_gpu"` (a refusal recorded, untimed) and
`"blockwise"`, PyTorch's `flex_attention` under `torch.compile` with the same mods and
a `create_block_mask` built once per case outside the timed call (skipped, with the
reason, without torch with CUDA), and jax.nn's cuDNN plain causal call once per size
as the reference of every case. Each measurement: one compiling call (a case's JAX
steps compile at once, in threads, while PyTorch compiles in the main thread), then 3
calls round-robin over the case's implementations (noise hits all alike): median, min
and max. TFLOP/s over each case's visible pairs, counted exactly (`common_flex.
visible_pairs`). No case starts after `--budget` seconds (default 270). On an H200
with torch 2.11 each (case, N = 4096, D) took about 15 s, compilation included:
`--budget 235` ran the N = 4096 cases and stopped, 283 s in all; N = 16384 needs a
larger budget. Results page: docs/results/composed_attention.md, rendered by
`experiments.report` from docs/results/data/device_benchmark_flex_h200*.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import itertools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common_flex
from experiments.common import median_seconds, run_metadata, save_figure, use_agg_backend, write_json
from jax_mha import _dispatch, functional
from jax_mha._validate import describe

DOCS = 8  # packed documents per row in the "packed" mask
# Dense bfloat16 tensor-core peak from the vendors' spec sheets, TFLOP/s, by device kind
# (`jax.devices()[0].device_kind`); the first pattern the kind contains wins.
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0),
               ("TPU v5 lite", 197.0), ("TPU v5e", 197.0))
# jax.nn's "xla" builds the float32 (B, H, N, S) scores; beyond this many bytes it is not run.
XLA_SCORES_MAX_BYTES = 16 * 2**30


@dataclasses.dataclass(frozen=True)
class Grid:
    """One preset: every combination of its sizes is one case."""

    batch: tuple = (8,)  # B: a training batch, so that short sequences still give the device work
    heads: tuple = (16,)  # H = K (no GQA: every compared kernel takes it the same way)
    seq: tuple = (1024, 4096, 16384)  # N = S
    head_dim: tuple = (64, 128)  # the two head sizes of current models
    dtype: tuple = ("bfloat16",)  # what training runs in; cuDNN takes no float32
    masks: tuple = ("causal", "packed")
    budget: float | None = 420.0  # seconds before the run stops with what it has: 8 minutes with margin
    repeats: int = 3  # timed calls per measurement, after one compiling call


PRESETS = {
    "smoke": Grid(batch=(1,), heads=(2,), seq=(128,), head_dim=(64,), dtype=("float32",), budget=None, repeats=2),
    "quick": Grid(),
    # The Hopper kernel ("pallas_mgpu") takes float16 only: the same sizes, causal, in float16.
    "float16": Grid(dtype=("float16",), masks=("causal",), budget=150.0),
    "full": Grid(batch=(1, 8), heads=(8, 32), seq=(1024, 4096, 16384, 32768), dtype=("bfloat16", "float32"),
                 budget=None, repeats=5),
}
# The composed cases (experiments.common_flex): each case against FlexAttention, its own grid.
FLEX_PRESETS = {
    "flex": common_flex.FlexGrid(),
    # `--preset flex --smoke`: every case at one tiny size (prime B and H, a window that
    # cuts, 7 tokens per document), float32 so that a CPU runs it; seconds.
    "flex_smoke": common_flex.FlexGrid(batch=2, heads=3, seq=(56,), head_dim=(16,), dtype="float32", window=6,
                                       budget=None),
}


def paths_for(platform: str, dtype: str = "float32") -> list[str]:
    """The jax_mha paths compiled natively on `platform` (interpret mode excluded; the
    Hopper kernel `"pallas_mgpu"` takes float16 only, so in bfloat16 it is recorded as
    refused, with its reason).
    `"xla"` only for float32: in half precision it runs the blockwise engine with the
    same blocks as `"blockwise"`."""
    paths = (["xla"] if dtype == "float32" else []) + ["blockwise"]
    return paths + {"gpu": ["cudnn", "pallas_gpu", "pallas_mgpu"], "tpu": ["pallas_tpu"]}.get(platform, [])


def visible_pairs(n: int, mask: str) -> int:
    """(query, key) pairs one head computes: causal N(N+1)/2; `DOCS` packed causal
    documents of d = N / DOCS tokens, DOCS · d(d+1)/2 (N a multiple of DOCS)."""
    if mask == "causal":
        return n * (n + 1) // 2
    d = n // DOCS
    return DOCS * d * (d + 1) // 2


def attention_flops(b: int, h: int, n: int, d: int, mask: str, backward: bool) -> float:
    """4·D per visible pair forward (q·k and p·v); forward+backward 3.5x forward."""
    fwd = 4.0 * b * h * visible_pairs(n, mask) * d
    return fwd * (3.5 if backward else 1.0)


def peak_tflops(device_kind: str) -> float | None:
    """The dense bfloat16 spec peak of this device kind, or None when unknown."""
    return next((peak for pattern, peak in PEAK_TFLOPS if pattern in device_kind), None)


def segment_ids(b: int, n: int) -> np.ndarray:
    """int32 `(B, N)`: `DOCS` documents of N / DOCS tokens each, packed in every row."""
    return common_flex.document_ids(b, n, DOCS)


def implementations(platform: str, dtype: str) -> list[str]:
    """Every implementation timed here, `"library:name"`."""
    names = [f"jax_mha:{p}" for p in paths_for(platform, dtype)] + ["jax.nn:xla"]
    if platform == "gpu":
        names.insert(len(names) - 1, "jax.nn:cudnn")
        if importlib.util.find_spec("torch") is not None:
            names.append("torch:sdpa")
    return names


def case_arrays(b: int, h: int, n: int, d: int, dtype: str) -> dict:
    """q, k, v `(B, H, N, D)` for jax_mha, the same transposed to jax.nn's
    `(B, N, H, D)`, and the packed documents' ids `(B, N)`."""
    keys = jax.random.split(jax.random.key(0), 3)
    bhnd = tuple(jax.random.normal(key, (b, h, n, d), dtype) for key in keys)
    bnhd = tuple(jnp.swapaxes(x, 1, 2) for x in bhnd)
    return dict(bhnd=bhnd, bnhd=bnhd, ids=jnp.asarray(segment_ids(b, n)))


def jax_function(name: str, case: dict, arrays: dict):
    """`(f(q, k, v, ids) -> out, layout)` for one JAX implementation, or
    `(None, reason)` when it refuses this case or is not run at this size."""
    library, impl = name.split(":")
    b, h, n, dtype = case["batch"], case["heads"], case["seq"], case["dtype"]
    packed = case["mask"] == "packed"
    if library == "jax_mha":
        q, k, v = arrays["bhnd"]
        ids = np.asarray(arrays["ids"]) if packed else None
        try:  # the path's own refusal, as "auto" reads it
            functional.resolve_implementation(q, k, v, describe(q, k, v, is_causal=True, q_segment_ids=ids),
                                              implementation=impl)
        except ValueError as e:
            return None, f"refused: {e}"
        return (lambda q, k, v, ids: functional.attention(
            q, k, v, is_causal=True, q_segment_ids=ids if packed else None, implementation=impl)), "bhnd"
    if impl == "cudnn" and dtype not in ("bfloat16", "float16"):
        return None, f"skipped: jax.nn's cuDNN call takes float16/bfloat16 only, not {dtype}"
    if impl == "xla" and 4 * b * h * n * n > XLA_SCORES_MAX_BYTES:
        return None, f"skipped: jax.nn's xla path would build {4 * b * h * n * n / 2**30:.0f} GiB of float32 scores"

    def f(q, k, v, ids):  # (B, N, H, D); the packed documents as a dense (B, 1, N, N) mask
        mask = (ids[:, None, :, None] == ids[:, None, None, :]) if packed else None
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=impl)

    return f, "bnhd"


def time_jax(f, args, backward: bool, repeats: int) -> tuple[float, float]:
    """`(median seconds, first call seconds)` of `f` (or its gradient) under jit."""
    if backward:
        loss = lambda q, k, v, ids: jnp.sum(f(q, k, v, ids).astype(jnp.float32))
        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    else:
        step = jax.jit(f)
    return median_seconds(lambda: jax.block_until_ready(step(*args)), warmup=1, repeats=repeats)


def time_torch(case: dict, backward: bool, repeats: int) -> tuple[float, float]:
    """The same as `time_jax` for PyTorch's scaled_dot_product_attention on CUDA; the
    packed documents as a dense (N, N) boolean mask (SDPA has no segment ids)."""
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        raise RuntimeError("torch has no CUDA device here")
    b, h, n, d = case["batch"], case["heads"], case["seq"], case["head_dim"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=getattr(torch, case["dtype"]), generator=gen,
                           requires_grad=backward) for _ in range(3))
    kw = dict(is_causal=True)
    if case["mask"] == "packed":
        ids, pos = torch.as_tensor(segment_ids(1, n)[0], device="cuda"), torch.arange(n, device="cuda")
        kw = dict(attn_mask=(ids[:, None] == ids[None, :]) & (pos[None, :] <= pos[:, None]))

    def step():
        with torch.set_grad_enabled(backward):
            out = F.scaled_dot_product_attention(q, k, v, **kw)
            if backward:
                out.float().sum().backward()
        torch.cuda.synchronize()

    return median_seconds(step, warmup=1, repeats=repeats)


def measure(name: str, case: dict, arrays: dict, backward: bool, repeats: int, peak: float | None) -> dict:
    """One pass of one implementation: `{ms, first_call_s, tflops, peak_pct}`, or
    `{refused | skipped | error: reason}`."""
    try:
        if name == "torch:sdpa":
            sec, first = time_torch(case, backward, repeats)
        else:
            f, layout = jax_function(name, case, arrays)
            if f is None:
                kind, reason = layout.split(": ", 1)
                return {kind: reason}
            sec, first = time_jax(f, (*arrays[layout], arrays["ids"]), backward, repeats)
    except Exception as e:  # out of memory, a kernel that fails to compile: recorded, the run goes on
        return dict(error=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}")
    flops = attention_flops(case["batch"], case["heads"], case["seq"], case["head_dim"], case["mask"], backward)
    tflops = flops / sec / 1e12
    half = case["dtype"] in ("bfloat16", "float16")
    return dict(ms=sec * 1e3, first_call_s=first, tflops=tflops,
                peak_pct=100 * tflops / peak if peak is not None and half else None)


def cases(grid: Grid):
    """Every case of `grid`, smallest N first (what a budget cut leaves out is the largest)."""
    for n, b, h, d, dtype, mask in itertools.product(grid.seq, grid.batch, grid.heads, grid.head_dim, grid.dtype,
                                                      grid.masks):
        yield dict(mask=mask, batch=b, heads=h, seq=n, head_dim=d, dtype=dtype)


def auto_choice(case: dict, arrays: dict) -> str:
    """The path `implementation="auto"` takes for this case."""
    q, k, v = arrays["bhnd"]
    ids = np.asarray(arrays["ids"]) if case["mask"] == "packed" else None
    return functional.resolve_implementation(q, k, v, describe(q, k, v, is_causal=True, q_segment_ids=ids))


def run(grid: Grid, budget: float | None) -> dict:
    """Times every implementation on every case of `grid` until `budget` seconds
    (None: no limit) have passed; a pass not reached is recorded as skipped."""
    platform, kind = _dispatch.platform(), str(jax.devices()[0].device_kind)
    peak, start, rows, auto, stopped = peak_tflops(kind), time.monotonic(), [], [], False
    for case in cases(grid):
        if stopped:
            break
        arrays = case_arrays(case["batch"], case["heads"], case["seq"], case["head_dim"], case["dtype"])
        auto.append({**case, "chosen": auto_choice(case, arrays)})
        for name in implementations(platform, case["dtype"]):
            row = {"impl": name, **case}
            for pass_name, backward in (("forward", False), ("forward_backward", True)):
                stopped = stopped or (budget is not None and time.monotonic() - start > budget)
                row[pass_name] = (dict(skipped=f"the budget of {budget:g} s ran out") if stopped
                                  else measure(name, case, arrays, backward, grid.repeats, peak))
            rows.append(row)
            print(format_row(row), flush=True)
        del arrays
    return dict(kind="device_benchmark", device=kind, platform=platform, peak_bf16_tflops=peak, rows=rows, auto=auto, docs_per_row=DOCS,
                causal=True, budget_s=budget, stopped_early=stopped, seconds=time.monotonic() - start,
                grid=dataclasses.asdict(grid), metadata=run_metadata(), time=time.time())


def format_row(row: dict) -> str:
    head = (f"{row['impl']:<18} {row['mask']:<6} B={row['batch']} H={row['heads']:<3} N={row['seq']:<6} "
            f"D={row['head_dim']:<4} {row['dtype']:<9}")
    cells = []
    for name in ("forward", "forward_backward"):
        r = row[name]
        if "ms" in r:
            pct = "" if r["peak_pct"] is None else f" {r['peak_pct']:5.1f}% of peak"
            cells.append(f"{name}: {r['ms']:9.3f} ms {r['tflops']:8.3g} TFLOP/s{pct}")
        else:
            kind = next(iter(r))
            cells.append(f"{name}: {kind}: {r[kind][:70]}")
    return head + " | " + " | ".join(cells)


def plot(result: dict):
    """TFLOP/s against N: one panel per pass and mask, one line per implementation
    and head_dim (the largest batch, heads and the first dtype of the grid)."""
    import matplotlib.pyplot as plt

    grid = result["grid"]
    b, h, dtype = max(grid["batch"]), max(grid["heads"]), grid["dtype"][0]
    fig, axes = plt.subplots(2, len(grid["masks"]), figsize=(6 * len(grid["masks"]), 8), squeeze=False,
                             layout="constrained")
    names = sorted({r["impl"] for r in result["rows"]})
    colors = dict(zip(names, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 3))
    for (i, pass_name), (j, mask) in itertools.product(enumerate(("forward", "forward_backward")),
                                                       enumerate(grid["masks"])):
        ax = axes[i, j]
        for name, d in itertools.product(names, grid["head_dim"]):
            pts = sorted((r["seq"], r[pass_name]["tflops"]) for r in result["rows"]
                         if (r["impl"], r["head_dim"], r["mask"], r["batch"], r["heads"], r["dtype"]) ==
                         (name, d, mask, b, h, dtype) and "tflops" in r[pass_name])
            if pts:
                ax.plot(*zip(*pts), marker="o", color=colors[name], linestyle="-" if d == max(grid["head_dim"]) else "--",
                        label=f"{name}, D={d}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length N (= S)")
        ax.set_ylabel("TFLOP/s (visible pairs only)")
        ax.set_title(f"{pass_name.replace('_', ' + ')}, {mask}{' (8 documents)' if mask == 'packed' else ''}")
        ax.grid(alpha=0.3)
    if axes[0, -1].get_legend_handles_labels()[0]:
        axes[0, -1].legend(fontsize=7, loc="best")
    peak = result["peak_bf16_tflops"]
    fig.suptitle(f"Attention on {result['device']} ({result['platform']}): B={b}, H={h}, {dtype}"
                 + (f"; spec peak {peak:g} TFLOP/s" if peak else "")
                 + (" — stopped early (budget)" if result["stopped_early"] else ""))
    return fig


# ----------------------------------------------------------------- the flex preset


def flex_implementations(case: str) -> list[str]:
    """The implementations of one flex case: jax_mha's Triton kernel and engine, jax.nn's
    cuDNN plain causal call (in the causal case only: one reference per size, the same
    for every case) and PyTorch's FlexAttention."""
    return ["jax_mha:pallas_gpu", "jax_mha:blockwise"] + (["jax.nn:cudnn"] if case == "causal" else []) + ["torch:flex"]


def flex_arrays(grid: common_flex.FlexGrid, n: int, d: int) -> dict:
    """q, k, v `(B, H, N, D)`, the same as jax.nn's `(B, N, H, D)`, and the cases'
    parameters, NumPy (`np`) and on the device (`params`)."""
    keys = jax.random.split(jax.random.key(0), 3)
    bhnd = tuple(jax.random.normal(key, (grid.batch, grid.heads, n, d), grid.dtype) for key in keys)
    np_params = common_flex.case_params(grid, n)
    return dict(bhnd=bhnd, bnhd=tuple(jnp.swapaxes(x, 1, 2) for x in bhnd), np=np_params,
                params={key: jnp.asarray(x) for key, x in np_params.items()})


def flex_row(case: str, name: str, grid: common_flex.FlexGrid, n: int, d: int, **cells) -> dict:
    """One implementation on one case at one size; its passes' cells added as they come."""
    return dict(case=case, impl=name, batch=grid.batch, heads=grid.heads, seq=n, head_dim=d, dtype=grid.dtype,
                visible_pairs=common_flex.visible_pairs(case, n, grid), **cells)


def flex_untimed(name: str, c: common_flex.Composed, arrays: dict, dtype: str, platform: str) -> dict | None:
    """`{skipped | refused: reason}` for an implementation that does not run this case
    here (a jax_mha path's own refusal, as `"auto"` reads it), or None."""
    library, impl = name.split(":")
    if library == "torch":
        why = common_flex.torch_missing()
        return None if why is None else dict(skipped=why)
    if library == "jax.nn":
        if platform != "gpu":
            return dict(skipped=f"jax.nn's cuDNN call runs on a CUDA GPU, not on {platform}")
        return None if dtype in ("bfloat16", "float16") else dict(
            skipped=f"jax.nn's cuDNN call takes float16/bfloat16 only, not {dtype}")
    if impl not in paths_for(platform, dtype):
        return dict(skipped=f"{impl} is timed compiled on its own device only (never in interpret mode), "
                            f"not on {platform}")
    q, k, v = arrays["bhnd"]
    try:
        functional.resolve_implementation(q, k, v, describe(q, k, v, **common_flex.jax_kwargs(c)),
                                          implementation=impl)
    except ValueError as e:
        return dict(refused=str(e))
    return None


@functools.cache
def flex_jax_step(name: str, case: str, grid: common_flex.FlexGrid, n: int, backward: bool):
    """`step(q, k, v, params)` jitted: jax_mha's path `name` on the case built from the
    traced `params`, or jax.nn's cuDNN plain causal call (`(B, N, H, D)`); with
    `backward`, the gradients of q, k, v of the float32 sum of the output. Cached: the
    tests check the very steps a smoke run timed, without compiling them again."""
    library, impl = name.split(":")

    def f(q, k, v, params):
        if library == "jax.nn":
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
        c = common_flex.compose(case, params, n, grid, common_flex.JAX_OPS)
        return functional.attention(q, k, v, implementation=impl, **common_flex.jax_kwargs(c))

    if not backward:
        return jax.jit(f)
    return jax.jit(jax.grad(lambda *args: jnp.sum(f(*args).astype(jnp.float32)), argnums=(0, 1, 2)))


def flex_case(case: str, grid: common_flex.FlexGrid, n: int, d: int, arrays: dict, platform: str,
              peak: float | None) -> list[dict]:
    """One row per implementation of one case at one size, its two passes timed
    round-robin with every other implementation's (`common_flex.round_robin`)."""
    c = common_flex.compose(case, arrays["params"], n, grid, common_flex.JAX_OPS)
    rows, steps = {}, {}
    for name in flex_implementations(case):
        row = rows[name] = flex_row(case, name, grid, n, d)
        untimed = flex_untimed(name, c, arrays, grid.dtype, platform)
        if untimed is not None:
            row.update(forward=untimed, forward_backward=untimed)
        elif name == "torch:flex":
            try:
                passes, row["block_mask_s"] = common_flex.torch_steps(case, grid, n, d, arrays["np"])
                steps.update({(name, p): f for p, f in passes.items()})
            except Exception as e:  # no memory, a torch that cannot build the mask: recorded, the run goes on
                row.update(forward=common_flex.error_cell(e), forward_backward=common_flex.error_cell(e))
        else:
            args = (*arrays["bnhd" if name.startswith("jax.nn") else "bhnd"], arrays["params"])
            for p, backward in (("forward", False), ("forward_backward", True)):
                step = flex_jax_step(name, case, grid, n, backward)
                # args bound now: a closure would see the last implementation's layout
                steps[name, p] = lambda step=step, args=args: jax.block_until_ready(step(*args))
    jax_steps = frozenset(key for key in steps if not key[0].startswith("torch"))
    for (name, p), cell in common_flex.round_robin(steps, grid.repeats, concurrent=jax_steps).items():
        if "ms" in cell:
            tflops = common_flex.attention_flops(grid, case, n, d, p == "forward_backward") / cell["ms"] / 1e9
            half = grid.dtype in ("bfloat16", "float16")
            cell.update(tflops=tflops, peak_pct=100 * tflops / peak if peak is not None and half else None)
        rows[name][p] = cell
    return list(rows.values())


def run_flex(grid: common_flex.FlexGrid, budget: float | None, save=None) -> dict:
    """Every case of `grid` at every (N, D), smallest first, until `budget` seconds (None:
    no limit) have passed: a case not started by then is recorded as skipped. `save`,
    when given, takes the result so far after every case (a stopped run keeps them)."""
    platform, kind = _dispatch.platform(), str(jax.devices()[0].device_kind)
    peak, start, rows, auto, stopped = peak_tflops(kind), time.monotonic(), [], [], False

    def result() -> dict:
        return dict(kind="device_benchmark_flex", device=kind, platform=platform, peak_bf16_tflops=peak,
                    cases={case: common_flex.DESCRIPTIONS[case] for case in grid.cases},
                    torch=common_flex.torch_version(), rows=rows, auto=auto, budget_s=budget, stopped_early=stopped,
                    seconds=time.monotonic() - start, grid=dataclasses.asdict(grid), metadata=run_metadata(),
                    time=time.time())
    for n, d in itertools.product(grid.seq, grid.head_dim):
        arrays = flex_arrays(grid, n, d)
        for case in grid.cases:
            stopped = stopped or (budget is not None and time.monotonic() - start > budget)
            if stopped:
                late = dict(skipped=f"the budget of {budget:g} s ran out")
                rows += [flex_row(case, name, grid, n, d, forward=late, forward_backward=late)
                         for name in flex_implementations(case)]
                continue
            q, k, v = arrays["bhnd"]
            c = common_flex.compose(case, arrays["params"], n, grid, common_flex.JAX_OPS)
            vis = describe(q, k, v, **common_flex.jax_kwargs(c))
            auto.append(dict(case=case, seq=n, head_dim=d, chosen=functional.resolve_implementation(q, k, v, vis)))
            for row in flex_case(case, grid, n, d, arrays, platform, peak):
                rows.append(row)
                print(format_flex_row(row), flush=True)
            if save is not None:
                save(result())
        del arrays
    return result()


def format_flex_row(row: dict) -> str:
    head = f"{row['case']:<10} {row['impl']:<19} N={row['seq']:<6} D={row['head_dim']:<4}"
    cells = []
    for name in ("forward", "forward_backward"):
        r = row[name]
        if "ms" in r:
            pct = "" if r["peak_pct"] is None else f" {r['peak_pct']:5.1f}%"
            cells.append(f"{name}: {r['ms']:9.3f} ms [{r['ms_min']:.3f}-{r['ms_max']:.3f}] "
                         f"{r['tflops']:7.3g} TFLOP/s{pct}")
        else:
            kind = next(iter(r))
            cells.append(f"{name}: {kind}: {r[kind][:60]}")
    return head + " | " + " | ".join(cells)


def _positive(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m experiments.device_benchmark", description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted([*PRESETS, "flex"]), default=None, help="the grid (default: quick)")
    p.add_argument("--smoke", action="store_true",
                   help="one tiny size, seconds, the only thing run on CPU: --preset smoke, or with --preset flex "
                        "every flex case")
    p.add_argument("--budget", type=float, default=None, help="stop after this many seconds (default: the preset's)")
    p.add_argument("--out", default=None, help="JSON path (default results/device_benchmark_PRESET.json)")
    p.add_argument("--figure", default=None, help="PNG path (default: the JSON path with .png)")
    p.add_argument("--seq", type=_positive, nargs="+", help="with --preset flex: these N = S only (e.g. 16384)")
    p.add_argument("--head-dim", type=_positive, nargs="+", help="with --preset flex: these D only")
    p.add_argument("--cases", choices=common_flex.CASES, nargs="+",
                   help="with --preset flex: these cases only (causal holds the cuDNN reference of its size)")
    args = p.parse_args(argv)
    preset = ("flex_smoke" if args.preset == "flex" else "smoke") if args.smoke else args.preset or "quick"
    flex = preset in FLEX_PRESETS
    grid = FLEX_PRESETS[preset] if flex else PRESETS[preset]
    chosen = {field: tuple(value) for field, value in
              (("seq", args.seq), ("head_dim", args.head_dim), ("cases", args.cases)) if value is not None}
    if chosen and not flex:
        p.error(f"--{next(iter(chosen)).replace('_', '-')} narrows the flex preset only (give --preset flex)")
    grid = dataclasses.replace(grid, **chosen)
    budget = grid.budget if args.budget is None else args.budget
    if budget is not None and budget < 0:
        p.error(f"--budget must be >= 0 seconds, got {budget:g}")
    platform = _dispatch.platform()
    if platform == "cpu" and preset not in ("smoke", "flex_smoke"):
        p.error(f"on CPU only --smoke runs (--preset {preset} is for GPUs and TPUs)")
    names = (list(dict.fromkeys(n for case in grid.cases for n in flex_implementations(case))) if flex
             else implementations(platform, grid.dtype[0]))
    print(f"device: {jax.devices()[0].device_kind} ({platform}); implementations: {', '.join(names)}")
    out = Path(args.out or f"results/device_benchmark_{preset}.json")
    result = run_flex(grid, budget, save=lambda partial: write_json(out, {**partial, "preset": preset})) if flex \
        else run(grid, budget)
    result["preset"] = preset
    write_json(out, result)
    print(f"wrote {out}" + (" (stopped early: the budget ran out)" if result["stopped_early"] else ""))
    if importlib.util.find_spec("matplotlib") is not None:
        use_agg_backend()
        figure = Path(args.figure or out.with_suffix(".png"))
        save_figure((common_flex.plot if flex else plot)(result), figure)
        print(f"wrote {figure}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
