"""The composed-attention cases of `python -m experiments.device_benchmark --preset flex`:
each case written once, for JAX, NumPy and PyTorch alike, and the pairs each one sees.

A case is a `Composed` description: causality, a window, a soft cap, a `score_mod`, a
`mask_mod` and sinks, built by `compose` from traced parameters (`case_params`) with one
array namespace (`JAX_OPS`, `NUMPY_OPS`, `torch_ops()`). jax_mha takes it as keyword
arguments (`jax_kwargs`); PyTorch's FlexAttention as one score function and one mask
function (`full_score`, `full_mask`: the window, causality and the soft cap rewritten as
mods), its sinks merged through the log-sum-exp (`torch_attention`); the tests evaluate
the same two functions in NumPy. The cases:

- `causal`: plain causal attention, the reference;
- `alibi`: ALiBi (Press et al. 2022), `score_mod` adding `slopes[h] · (kv_idx - q_idx)`
  over traced per-head slopes, causal;
- `softcap`: `logits_soft_cap` 30 (`30 · tanh(s / 30)`, the form of Gemma 2's cap), causal;
- `documents`: `docs` packed documents per row by a `mask_mod` over traced document
  ids `(B, N)`, causal within each document;
- `window`: `local_window_size=(window, window)`, not causal;
- `prefix_lm`: a `mask_mod` letting the first N/4 tokens see each other, causal after
  (Raffel et al. 2020, the prefix LM);
- `sinks`: traced `(H,)` sink logits, causal;
- `relative`: `score_mod` adding `table[h, bucket(kv_idx - q_idx)]`, a traced `(H, 32)`
  table over T5's unidirectional buckets (exact below 16, log-spaced to 128), causal.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import statistics
import time
import types
from concurrent import futures as concurrent_futures
from typing import Callable

import jax.numpy as jnp
import numpy as np

CASES = ("causal", "alibi", "softcap", "documents", "window", "prefix_lm", "sinks", "relative")
DESCRIPTIONS = {
    "causal": "plain causal (the reference)",
    "alibi": "ALiBi: score_mod over traced per-head slopes, causal",
    "softcap": "logits soft cap, causal",
    "documents": "packed documents: mask_mod over traced document ids, causal within documents",
    "window": "a window (left, right) around the diagonal, not causal",
    "prefix_lm": "prefix-LM: mask_mod, the first N/4 tokens bidirectional, causal after",
    "sinks": "traced (H,) sink logits, causal",
    "relative": "score_mod adding table[h, bucket(kv - q)], a traced (H, 32) table of T5 buckets, causal",
}
NUM_BUCKETS = 32  # T5's relative-position buckets (Raffel et al. 2020, Sec. 2.1)
MAX_DISTANCE = 128  # T5's: distances from here on share the last bucket


@dataclasses.dataclass(frozen=True)
class FlexGrid:
    """One flex preset: every (N, D) of it runs every case."""

    batch: int = 8  # B: the quick preset's, a training batch
    heads: int = 16  # H = K: no GQA, as in the quick preset
    seq: tuple = (4096, 16384)  # N = S; mods cost most where the scores are long
    head_dim: tuple = (64, 128)  # the two head sizes of current models
    dtype: str = "bfloat16"  # what training runs in, and what cuDNN and FlexAttention compile
    cases: tuple = CASES
    window: int = 1024  # keys each side in the window case: (1024, 1024), a local-attention layer's reach
    soft_cap: float = 30.0  # the cap of the soft-cap case
    docs: int = 8  # documents per row in the documents case, as the quick preset's packed mask
    budget: float | None = 270.0  # no case starts later. On an H200 the N = 4096 half took 283 s, N = 16384 at
    # D = 128 153 s and at D = 64 about 380 s over two calls (docs/results/composed_attention.md): the whole
    # grid needs over 13 minutes, so a device call with less runs it in parts (--seq, --head-dim, --cases)
    repeats: int = 5  # timed calls per measurement, round-robin over the case's implementations: five, so
    # that every ratio a page quotes comes with the spread of five interleaved calls


@dataclasses.dataclass(frozen=True)
class Composed:
    """One case as jax_mha's arguments name it (arrays of one namespace)."""

    is_causal: bool = True
    window: tuple | None = None  # (left, right)
    soft_cap: float | None = None
    score_mod: Callable | None = None
    mask_mod: Callable | None = None  # what causality and the window leave to a function
    sinks: object = None  # (H,)


def _namespace(xp, int32, float32) -> types.SimpleNamespace:
    return types.SimpleNamespace(where=xp.where, tanh=xp.tanh, log=xp.log, clip=xp.clip,
                                 int=lambda x: x.astype(int32), float=lambda x: x.astype(float32),
                                 like=lambda x, ref: x.astype(ref.dtype))


JAX_OPS = _namespace(jnp, jnp.int32, jnp.float32)
NUMPY_OPS = _namespace(np, np.int32, np.float32)


def torch_ops() -> types.SimpleNamespace:
    """The namespace of `compose` in PyTorch (imported here: torch is optional)."""
    import torch

    return types.SimpleNamespace(where=torch.where, tanh=torch.tanh, log=torch.log,
                                 clip=lambda x, lo, hi: torch.clamp(x, lo, hi),
                                 int=lambda x: x.to(torch.int32), float=lambda x: x.to(torch.float32),
                                 like=lambda x, ref: x.to(ref.dtype))


def document_ids(b: int, n: int, docs: int) -> np.ndarray:
    """int32 `(B, N)`: `docs` documents of ceil(N / docs) tokens (the last shorter), in every row."""
    return np.broadcast_to(np.repeat(np.arange(docs, dtype=np.int32), -(-n // docs))[:n], (b, n)).copy()


def case_params(grid: FlexGrid, n: int) -> dict[str, np.ndarray]:
    """The traced parameters of every case, NumPy: ALiBi `slopes (H,)` (Press et al.'s
    geometric 2^(-8h/H)), document `ids (B, N)`, `sinks (H,)` and the relative `table
    (H, 32)` (seeded normals)."""
    h = grid.heads
    rng = np.random.default_rng(0)
    return dict(slopes=(2.0 ** (-8.0 * np.arange(1, h + 1) / h)).astype(np.float32),
                ids=document_ids(grid.batch, n, grid.docs),
                sinks=rng.normal(size=h).astype(np.float32),
                table=(0.5 * rng.normal(size=(h, NUM_BUCKETS))).astype(np.float32))


def t5_bucket(rel, ops):
    """T5's unidirectional bucket of `rel = kv_idx - q_idx` (`_relative_position_bucket`,
    bidirectional=False): the distance `max(-rel, 0)` itself below 16, then
    16 + 16·log(n/16)/log(128/16) (floored), the last bucket from 128 on."""
    n = ops.clip(-rel, 0, None)
    exact = NUM_BUCKETS // 2
    far = exact + ops.int(ops.log(ops.float(ops.clip(n, exact, None)) / exact)
                          / math.log(MAX_DISTANCE / exact) * (NUM_BUCKETS - exact))
    return ops.where(n < exact, n, ops.clip(far, 0, NUM_BUCKETS - 1))


def compose(case: str, params: dict, n: int, grid: FlexGrid, ops) -> Composed:
    """The case over `params` (arrays of `ops`' namespace) for sequences of length `n`.

    Raises:
      ValueError: for a case not in `CASES`.
    """
    slopes, ids, table, prefix = params["slopes"], params["ids"], params["table"], n // 4
    if case in ("causal", "sinks"):
        return Composed(sinks=params["sinks"] if case == "sinks" else None)
    if case == "alibi":
        return Composed(score_mod=lambda s, b, h, q, kv: s + ops.like(slopes[h] * ops.float(kv - q), s))
    if case == "softcap":
        return Composed(soft_cap=grid.soft_cap)
    if case == "documents":
        return Composed(mask_mod=lambda b, h, q, kv: ids[b, q] == ids[b, kv])
    if case == "window":
        return Composed(is_causal=False, window=(grid.window, grid.window))
    if case == "prefix_lm":
        return Composed(is_causal=False, mask_mod=lambda b, h, q, kv: (kv <= q) | (kv < prefix))
    if case == "relative":
        return Composed(score_mod=lambda s, b, h, q, kv: s + ops.like(table[h, t5_bucket(kv - q, ops)], s))
    raise ValueError(f"unknown case {case!r}; the cases are {CASES}")


def jax_kwargs(c: Composed) -> dict:
    """The keyword arguments of `jax_mha.attention` for one case."""
    return dict(is_causal=c.is_causal, local_window_size=c.window, logits_soft_cap=c.soft_cap,
                score_mod=c.score_mod, mask_mod=c.mask_mod, sinks=c.sinks)


def full_score(c: Composed, ops) -> Callable | None:
    """FlexAttention's `score_mod`: the case's, then the soft cap (jax_mha's order)."""
    if c.score_mod is None and c.soft_cap is None:
        return None

    def score(s, b, h, q, kv):
        if c.score_mod is not None:
            s = c.score_mod(s, b, h, q, kv)
        return s if c.soft_cap is None else c.soft_cap * ops.tanh(s / c.soft_cap)

    return score


def full_mask(c: Composed) -> Callable | None:
    """FlexAttention's `mask_mod`: causality, the window and the case's `mask_mod`,
    together (None: every pair)."""
    if not c.is_causal and c.window is None and c.mask_mod is None:
        return None

    def mask(b, h, q, kv):
        parts = [kv <= q] if c.is_causal else []
        if c.window is not None:
            parts.append((q - kv <= c.window[0]) & (kv - q <= c.window[1]))
        if c.mask_mod is not None:
            parts.append(c.mask_mod(b, h, q, kv))
        out = parts[0]
        for part in parts[1:]:
            out = out & part
        return out

    return mask


def row_intervals(case: str, n: int, grid: FlexGrid) -> tuple[np.ndarray, np.ndarray]:
    """`(lo, hi)` int64 `(N,)`: query i sees exactly keys lo[i]..hi[i] (inclusive) in
    every case; written apart from the mods, from the cases' closed forms.

    Raises:
      ValueError: for a case not in `CASES`.
    """
    rows = np.arange(n, dtype=np.int64)
    if case == "documents":
        ids = document_ids(1, n, grid.docs)[0]
        return np.searchsorted(ids, ids).astype(np.int64), rows  # a document's first token
    if case == "window":
        return np.maximum(rows - grid.window, 0), np.minimum(rows + grid.window, n - 1)
    if case == "prefix_lm":
        return np.zeros(n, np.int64), np.maximum(rows, n // 4 - 1)
    if case in CASES:
        return np.zeros(n, np.int64), rows
    raise ValueError(f"unknown case {case!r}; the cases are {CASES}")


def visible_pairs(case: str, n: int, grid: FlexGrid) -> int:
    """(query, key) pairs one head computes in `case` (sinks are no pairs)."""
    lo, hi = row_intervals(case, n, grid)
    return int(np.sum(hi - lo + 1))


def attention_flops(grid: FlexGrid, case: str, n: int, d: int, backward: bool) -> float:
    """4·D per visible pair forward (q·k and p·v); forward+backward 3.5x forward
    (FlashAttention-2's count), as the other presets."""
    return 4.0 * grid.batch * grid.heads * visible_pairs(case, n, grid) * d * (3.5 if backward else 1.0)


# ----------------------------------------------------------------- timing


def error_cell(e: Exception) -> dict:
    """A measurement that failed (out of memory, a kernel that does not compile): its error, one line."""
    text = str(e).strip()
    return dict(error=f"{type(e).__name__}: {text.splitlines()[0][:200] if text else ''}")


def _first_call(step) -> dict:
    """The compiling call of one step: `{first_call_s}`, or its error."""
    try:
        t0 = time.perf_counter()
        step()
        return dict(first_call_s=time.perf_counter() - t0)
    except Exception as e:  # recorded; the other steps go on
        return error_cell(e)


def round_robin(steps: dict, repeats: int, concurrent: frozenset = frozenset()) -> dict:
    """`{key: cell}` for `steps` (`{key: f}`, each `f()` blocking until its result is
    ready): one compiling call each, then `repeats` rounds of one call each, in turn, so
    that whatever slows the device for a while slows every step alike. A cell holds
    `first_call_s`, `times_ms`, the median `ms`, `ms_min` and `ms_max`, or `error`.

    The compiling calls of the keys in `concurrent` run at once, in threads (JAX
    compiles in parallel, releasing the GIL), while the others (PyTorch's: its compiler
    is not thread-safe) run one after another in this thread: their `first_call_s`
    counts compiling under that contention. The timed rounds run in this thread alone."""
    with concurrent_futures.ThreadPoolExecutor(max_workers=max(len(concurrent), 1)) as pool:
        started = {key: pool.submit(_first_call, step) for key, step in steps.items() if key in concurrent}
        firsts = {key: _first_call(step) for key, step in steps.items() if key not in concurrent}
        firsts.update({key: future.result() for key, future in started.items()})
    cells = {key: firsts[key] for key in steps}
    times = {key: [] for key, cell in cells.items() if "error" not in cell}
    for _ in range(repeats):
        for key in list(times):
            try:
                t0 = time.perf_counter()
                steps[key]()
                times[key].append(time.perf_counter() - t0)
            except Exception as e:
                cells[key] = error_cell(e)
                del times[key]
    for key, seconds in times.items():
        ms = [1e3 * t for t in seconds]
        cells[key].update(times_ms=ms, ms=statistics.median(ms), ms_min=min(ms), ms_max=max(ms))
    return cells


# ----------------------------------------------------------------- PyTorch FlexAttention


def torch_missing(need_cuda: bool = True) -> str | None:
    """Why FlexAttention cannot be timed here, or None."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch

    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention"
    if need_cuda and not torch.cuda.is_available():
        return f"torch {torch.__version__} has no CUDA device here"
    return None


def torch_version() -> str | None:
    """The installed torch's version, or None."""
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    return str(torch.__version__)


@functools.cache
def compiled_flex():
    """`torch.compile(flex_attention)`, static shapes, `fullgraph=True`. Eager
    FlexAttention builds the whole scores and must never be timed in its place: past
    Dynamo's recompile limit, or after a failed compile (a graph break), a call would
    silently run eager; `fullgraph` makes a failure raise (recorded as the step's error),
    and the limit is raised, since every case and size compiles anew (new mods, new
    shapes)."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    config = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                 "accumulated_recompile_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), 1024))
    return torch.compile(flex_attention, dynamic=False, fullgraph=True)


def torch_block_mask(c: Composed, b: int, n: int, device: str):
    """FlexAttention's `BlockMask` of the case (None: every pair), per batch row (the
    documents' ids are), shared by the heads; compiled where torch's signature allows."""
    from torch.nn.attention.flex_attention import create_block_mask

    mask = full_mask(c)
    if mask is None:
        return None
    try:  # compiled: the (B, N, N) pattern is never built
        return create_block_mask(mask, b, None, n, n, device=device, _compile=device != "cpu")
    except TypeError:  # a torch without `_compile`
        return create_block_mask(mask, b, None, n, n, device=device)


def torch_attention(q, k, v, c: Composed, block_mask, flex):
    """`(B, H, N, D)`: case `c` (built with `torch_ops()`) by `flex` (FlexAttention,
    compiled or not); sinks merged through the rows' log-sum-exp, the sink's share of a
    row being `1 - sigmoid(lse - sink)`."""
    import torch

    score = full_score(c, torch_ops())
    if c.sinks is None:
        return flex(q, k, v, score_mod=score, block_mask=block_mask)
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:  # before torch 2.9: return_lse
        out, lse = flex(q, k, v, score_mod=score, block_mask=block_mask, return_lse=True)
    else:
        out, aux = flex(q, k, v, score_mod=score, block_mask=block_mask, return_aux=AuxRequest(lse=True))
        lse = aux.lse
    keep = torch.sigmoid(lse.float() - c.sinks.float()[None, :, None])  # (B, H, N)
    return (out.float() * keep[..., None]).to(q.dtype)


def torch_steps(case: str, grid: FlexGrid, n: int, d: int, params: dict, device: str = "cuda"):
    """`({"forward": f, "forward_backward": f}, seconds to build the block mask)` for
    `round_robin`: FlexAttention compiled, on seeded `(B, H, N, D)` inputs of
    `grid.dtype`, the block mask built once outside the timed call (as FlexAttention is
    used: once per batch, for every layer); forward+backward the gradients of q, k, v
    of the float32 sum of the output, as the JAX steps."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(grid.batch, grid.heads, n, d, device=device, dtype=getattr(torch, grid.dtype),
                           generator=gen) for _ in range(3))
    c = compose(case, {key: torch.as_tensor(x, device=device) for key, x in params.items()}, n, grid, torch_ops())
    t0 = time.perf_counter()
    block_mask = torch_block_mask(c, grid.batch, n, device)
    sync()
    mask_s, flex = time.perf_counter() - t0, compiled_flex()
    grad_in = tuple(x.detach().requires_grad_() for x in (q, k, v))

    def forward():
        with torch.no_grad():
            torch_attention(q, k, v, c, block_mask, flex)
        sync()

    def forward_backward():
        out = torch_attention(*grad_in, c, block_mask, flex)
        torch.autograd.grad(out.float().sum(), grad_in)
        sync()

    return dict(forward=forward, forward_backward=forward_backward), mask_s


# ----------------------------------------------------------------- figure


def plot(result: dict):
    """TFLOP/s (visible pairs) per case: one panel per pass and (N, D), one bar per
    implementation with its min–max spread, jax.nn's cuDNN plain causal as a line."""
    import matplotlib.pyplot as plt

    grid, rows = result["grid"], result["rows"]
    sizes = list(dict.fromkeys((r["seq"], r["head_dim"]) for r in rows))
    names = [n for n in dict.fromkeys(r["impl"] for r in rows if "tflops" in r["forward_backward"] or
                                      "tflops" in r["forward"]) if n != "jax.nn:cudnn"]
    colors = dict(zip(names, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    fig, axes = plt.subplots(2, max(len(sizes), 1), figsize=(5 * max(len(sizes), 1), 8), squeeze=False,
                             layout="constrained")
    width = 0.8 / max(len(names), 1)
    for i, pass_name in enumerate(("forward", "forward_backward")):
        for j, (n, d) in enumerate(sizes):
            ax = axes[i, j]
            for m, name in enumerate(names):
                _bars(ax, rows, name, pass_name, n, d, grid["cases"], (m - (len(names) - 1) / 2) * width, width,
                      colors[name])
            ref = next((r[pass_name] for r in rows if (r["impl"], r["seq"], r["head_dim"]) == ("jax.nn:cudnn", n, d)
                        and "tflops" in r[pass_name]), None)
            if ref is not None:
                ax.axhline(ref["tflops"], color="black", linestyle="--", linewidth=1, label="jax.nn:cudnn, plain causal")
            ax.set_xticks(range(len(grid["cases"])), grid["cases"], rotation=45, ha="right", fontsize=8)
            ax.set_ylabel("TFLOP/s (visible pairs only)")
            ax.set_title(f"{pass_name.replace('_', ' + ')}, N={n}, D={d}", fontsize=10)
            ax.grid(axis="y", alpha=0.3)
    if axes[0, -1].get_legend_handles_labels()[0]:
        axes[0, -1].legend(fontsize=7, loc="best")
    peak = result["peak_bf16_tflops"]
    fig.suptitle(f"Composed attention on {result['device']} ({result['platform']}): B={grid['batch']}, "
                 f"H={grid['heads']}, {grid['dtype']}" + (f"; spec peak {peak:g} TFLOP/s" if peak else "")
                 + (" — stopped early (budget)" if result["stopped_early"] else ""))
    return fig


def _bars(ax, rows: list, name: str, pass_name: str, n: int, d: int, cases: list, offset: float, width: float,
          color) -> None:
    """One implementation's bars over the cases of one panel (none where it did not run)."""
    xs, heights, spread = [], [], [[], []]
    for x, case in enumerate(cases):
        row = next((r for r in rows if (r["impl"], r["case"], r["seq"], r["head_dim"]) == (name, case, n, d)), None)
        cell = None if row is None else row[pass_name]
        if cell is None or "tflops" not in cell:
            continue
        xs.append(x + offset)
        heights.append(cell["tflops"])
        spread[0].append(cell["tflops"] - cell["tflops"] * cell["ms"] / cell["ms_max"])
        spread[1].append(cell["tflops"] * cell["ms"] / cell["ms_min"] - cell["tflops"])
    if xs:
        ax.bar(xs, heights, width, yerr=spread, color=color, label=name, capsize=2)
