"""Speed of jax_mha's attention against flax, jax.nn and (optionally) PyTorch.

Times forward and forward+backward (float32, jitted) of self-attention layers at
the shapes of `FULL.shapes`, the copy-task training step against an equivalent
PyTorch eager step, and a large matmul as the machine's practical roofline, so that
every GFLOP/s figure can be read as a fraction of peak.

Run::

    python -m experiments.benchmark            # full: ~10 min on 2 CPU cores
    python -m experiments.benchmark --quick    # fewer repeats, ~3 min
    pip install -e .[torch]                    # adds the PyTorch rows

Honesty. Every row also reads as a percentage of *its own library's* matmul roofline
(jax and flax rows against jax's float32 matmul, torch rows against torch's), measured
at the start and again at the end of the run; the table and JSON name the CPU, the
core count and every library version, and record the load average before and after.
When the two rooflines differ by more than 10 % or the load average exceeds the core
count, other work shared the CPU: the run prints a loud warning and the JSON says
`"contended": true` (a contended run can flip which library looks faster).

Method. Every layer is compiled and warmed up first; then the layers of one shape are
timed *round-robin* (one sample of each in turn, `repeats` times), each sample
averaging enough calls to last `min_sample_s`, and the median sample is reported.
Interleaving means background load hits every layer alike, so the ratios within a run
stay meaningful on a shared machine even when absolute times drift. Every backward
starts from the same fixed random output gradient (`cotangent`). The run calls
`jax_mha.lab.host_memory.reuse_freed_memory` first (as every experiment does), for the
PyTorch rows too: they share the process.

FLOPs counted (multiply-add = 2, `experiments.common.attention_flops`): projections
`8·B·N·d²` (q, k, v, out) plus attention `4·B·N²·d` (QKᵀ and PV); forward+backward
counts 3× the forward (backward ≈ 2×).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jax_mha
from experiments import common
from experiments.common import Interrupted, save_figure, use_agg_backend, write_json
from jax_mha import functional

MODULE = "experiments.benchmark"
CONTENDED_DRIFT = 0.10  # roofline change between start and end that marks a shared CPU

Shape = tuple[int, int, int, int]  # (B, N, d_model, H)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What to time and how often."""

    shapes: tuple[Shape, ...] = (
        (8, 128, 256, 8),  # short sequences: projection-bound
        (4, 512, 512, 8),  # the middle ground
        (1, 2048, 512, 8),  # long: attention-bound, where blockwise matters
        (4, 512, 512, 1),  # one wide head ...
        (4, 512, 512, 16),  # ... to many narrow ones at the same d_model
    )
    repeats: int = 7  # samples per layer; the median is reported
    warmup: int = 2  # calls after compilation, before timing
    min_sample_s: float = 0.2  # each sample averages calls lasting at least this long
    train_repeats: int = 7  # samples of the training step
    train_calls: int = 5  # training steps per sample
    roofline_size: int = 2048  # the (n, n) @ (n, n) float32 matmul
    window_lengths: tuple[int, ...] = (4096, 16384)  # N of the sliding-window rows (B=1, H=8, D=64)
    windows: tuple[int, ...] = (128, 256, 512)  # left window sizes, right 0 (causal sliding window)
    window_repeats: int = 3  # samples of each window and decode row (each call lasts seconds)
    decode_lengths: tuple[int, ...] = (16, 64, 256)  # total lengths L of the decode rows

    def __post_init__(self):
        counts = {k: getattr(self, k) for k in ("repeats", "warmup", "train_repeats", "train_calls", "roofline_size",
                                                 "window_repeats")}
        if min(counts.values()) < 1 or not self.min_sample_s >= 0:
            raise ValueError(f"{counts} must all be >= 1 and min_sample_s={self.min_sample_s} >= 0")
        sizes = {"window_lengths": self.window_lengths, "windows": self.windows, "decode_lengths": self.decode_lengths}
        for name, values in sizes.items():
            if any(v < (2 if name == "decode_lengths" else 1) for v in values):
                raise ValueError(f"{name}={values} must be positive (decode lengths >= 2)")
        for shape in self.shapes:
            if len(shape) != 4 or min(shape) < 1 or shape[2] % shape[3]:
                raise ValueError(f"shape {shape} must be (B, N, d_model, H) >= 1 with d_model divisible by H")


QUICK = dataclasses.replace(BenchConfig(), repeats=3, warmup=1, min_sample_s=0.05, train_repeats=3, train_calls=3,
                            window_lengths=(4096,), window_repeats=1)
FULL = BenchConfig()

# The copy-task training step compared with PyTorch (the head-ablation defaults).
TRAIN_D_MODEL, TRAIN_HEADS, TRAIN_LAYERS, TRAIN_BATCH, TRAIN_LENGTH = 256, 8, 2, 64, 16


# ---------------------------------------------------------------------------------
# Timing.
# ---------------------------------------------------------------------------------


def _calls_per_sample(fn: Callable[[], Any], min_sample_s: float) -> int:
    t0 = time.perf_counter()
    fn()
    return max(1, math.ceil(min_sample_s / max(time.perf_counter() - t0, 1e-6)))


def time_interleaved(fns: dict[str, Callable[[], Any]], cfg: BenchConfig) -> dict[str, float]:
    """Median seconds per call of each blocking zero-argument callable, sampled round-robin."""
    for fn in fns.values():
        for _ in range(cfg.warmup):
            fn()
    calls = {name: _calls_per_sample(fn, cfg.min_sample_s) for name, fn in fns.items()}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(cfg.repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls[name]):
                fn()
            samples[name].append((time.perf_counter() - t0) / calls[name])
    return {name: statistics.median(s) for name, s in samples.items()}


def _blocking(fn: Callable, *args) -> Callable[[], Any]:
    return lambda: jax.block_until_ready(fn(*args))


# ---------------------------------------------------------------------------------
# The JAX layers: (init, apply) pairs over the same input.
# ---------------------------------------------------------------------------------


def _dpa_core(num_heads: int):
    """Self-attention built on `jax.nn.dot_product_attention` in its native (B, N, H, D)
    layout: projections as (d, H, D) kernels, so no transposes at all."""

    def init(key, x):
        d = x.shape[-1]
        head_dim = d // num_heads
        ks = jax.random.split(key, 4)
        w = lambda k, shape: jax.random.normal(k, shape, jnp.float32) / math.sqrt(shape[0])
        return {
            "q": w(ks[0], (d, num_heads, head_dim)), "k": w(ks[1], (d, num_heads, head_dim)),
            "v": w(ks[2], (d, num_heads, head_dim)), "o": w(ks[3], (num_heads * head_dim, d)),
            "bq": jnp.zeros((num_heads, head_dim)), "bk": jnp.zeros((num_heads, head_dim)),
            "bv": jnp.zeros((num_heads, head_dim)), "bo": jnp.zeros((d,)),
        }

    def apply(p, x):
        q = jnp.einsum("bnd,dhk->bnhk", x, p["q"]) + p["bq"]  # (B, N, H, D)
        k = jnp.einsum("bnd,dhk->bnhk", x, p["k"]) + p["bk"]
        v = jnp.einsum("bnd,dhk->bnhk", x, p["v"]) + p["bv"]
        o = jax.nn.dot_product_attention(q, k, v)  # (B, N, H, D)
        return o.reshape(*o.shape[:2], -1) @ p["o"] + p["bo"]  # (B, N, d)

    return init, apply


def jax_layers(num_heads: int) -> dict[str, tuple[Callable, Callable]]:
    """name -> (init(key, x) -> params, apply(params, x) -> y), all with q/k/v/out biases."""
    layers = {}
    for impl in ("xla", "blockwise"):
        m = jax_mha.MultiHeadAttention(num_heads=num_heads, qkv_bias=True, implementation=impl)
        layers[f"jax_mha ({impl})"] = (m.init, m.apply)
    flax_mha = nn.MultiHeadDotProductAttention(num_heads=num_heads, deterministic=True)
    layers["flax MultiHeadDotProductAttention"] = (flax_mha.init, flax_mha.apply)
    layers["jax.nn.dot_product_attention"] = _dpa_core(num_heads)
    return layers


def cotangent(shape) -> np.ndarray:
    """The fixed random output gradient every backward starts from, in both libraries:
    a `.sum()` loss's all-ones gradient would let XLA fold the output projection's
    gradient matmuls into reductions, which PyTorch does not do."""
    return np.random.default_rng(5).standard_normal(shape).astype(np.float32)


def jax_timers(name: str, init: Callable, apply: Callable, x: jax.Array) -> dict[str, Callable[[], Any]]:
    params = init(jax.random.PRNGKey(0), x)
    fwd = jax.jit(apply)
    g = jnp.asarray(cotangent(x.shape))
    fwd_bwd = jax.jit(jax.grad(lambda p, x: jnp.vdot(apply(p, x), g), argnums=(0, 1)))
    return {(name, "fwd"): _blocking(fwd, params, x), (name, "fwd+bwd"): _blocking(fwd_bwd, params, x)}


# ---------------------------------------------------------------------------------
# PyTorch (optional).
# ---------------------------------------------------------------------------------


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def torch_timers(b: int, n: int, d: int, h: int) -> dict[tuple[str, str], Callable[[], Any]]:
    """`F.scaled_dot_product_attention` behind four Linear layers, and `nn.MultiheadAttention`."""
    import torch
    import torch.nn.functional as F

    class SDPAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))

        def forward(self, x):
            split = lambda t: t.view(b, n, h, d // h).transpose(1, 2)  # (B, H, N, D)
            o = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)))
            return self.o(o.transpose(1, 2).reshape(b, n, d))

    class TorchMHA(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = torch.nn.MultiheadAttention(d, h, batch_first=True)

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False)[0]

    torch.manual_seed(0)
    x = torch.randn(b, n, d)
    timers = {}
    for name, module in (("torch SDPA", SDPAttention()), ("torch nn.MultiheadAttention", TorchMHA())):
        module.eval()

        def fwd(module=module):
            with torch.inference_mode():
                return module(x)

        xg = x.clone().requires_grad_(True)
        g = torch.from_numpy(cotangent((b, n, d)))

        def fwd_bwd(module=module, xg=xg):
            module.zero_grad(set_to_none=True)
            xg.grad = None
            module(xg).backward(g)

        timers[(name, "fwd")] = fwd
        timers[(name, "fwd+bwd")] = fwd_bwd
    return timers


def _torch_decoder(vocab: int, max_len: int, d_ff: int):
    """An eager PyTorch twin of the copy-task `Decoder`: the same pre-norm blocks
    (learned positions, q/k/v without bias, exact GELU, final LayerNorm)."""
    import torch
    import torch.nn.functional as F

    d, h = TRAIN_D_MODEL, TRAIN_HEADS

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
            self.q, self.k, self.v = (torch.nn.Linear(d, d, bias=False) for _ in range(3))
            self.o = torch.nn.Linear(d, d)
            self.ffn = torch.nn.Sequential(torch.nn.Linear(d, d_ff), torch.nn.GELU(), torch.nn.Linear(d_ff, d))

        def forward(self, x):
            b, n, _ = x.shape
            y = self.norm1(x)
            split = lambda t: t.view(b, n, h, d // h).transpose(1, 2)
            a = F.scaled_dot_product_attention(split(self.q(y)), split(self.k(y)), split(self.v(y)), is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(b, n, d))
            return x + self.ffn(self.norm2(x))

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, d)
            self.positions = torch.nn.Parameter(0.02 * torch.randn(max_len, d))
            self.blocks = torch.nn.ModuleList(Block() for _ in range(TRAIN_LAYERS))
            self.final_norm = torch.nn.LayerNorm(d)
            self.logits = torch.nn.Linear(d, vocab)

        def forward(self, tokens):
            x = self.embed(tokens) + self.positions[: tokens.shape[1]]
            for block in self.blocks:
                x = block(x)
            return self.logits(self.final_norm(x))

    return Decoder()


def torch_copy_train_step(cfg_train, vocab: int, max_len: int, d_ff: int):
    """An eager PyTorch twin of `train.jit_train_step` on the copy task: masked
    cross-entropy, global-norm clipping, AdamW with warmup-cosine.
    Returns `step(tokens, targets, scored) -> loss`."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = _torch_decoder(vocab, max_len, d_ff)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg_train.learning_rate, weight_decay=cfg_train.weight_decay, eps=1e-8)
    warm, total = cfg_train.warmup_steps, max(cfg_train.num_steps, cfg_train.warmup_steps + 1)

    def lr_lambda(t):  # optax.warmup_cosine_decay_schedule
        if t < warm:
            return t / warm
        frac = min((t - warm) / (total - warm), 1.0)
        return cfg_train.end_lr_ratio + (1 - cfg_train.end_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)

    def step(tokens, targets, scored):
        opt.zero_grad(set_to_none=True)
        logits = model(tokens)
        weight = scored.float()
        nll = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), reduction="none")
        loss = (nll * weight.reshape(-1)).sum() / weight.sum().clamp(min=1.0)
        loss.backward()
        with torch.profiler.record_function(OPTIMIZER_PART):  # names the part in `profile_torch_step`
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg_train.grad_clip_norm)
            opt.step()
            sched.step()
        with torch.no_grad():  # the JAX step also reports accuracy
            _ = ((logits.argmax(-1) == targets).float() * weight).sum() / weight.sum()
        return loss

    return step


@dataclasses.dataclass
class TrainSteps:
    """The copy-task training step in both libraries, on one fixed batch."""

    jax_step: Callable  # (state, batch, rng) -> (state, metrics); the state is donated
    state: Any
    batch: dict
    rng: jax.Array
    torch_step: Callable[[], Any] | None  # one eager step on the same batch
    vocab: int  # the task's vocabulary size
    d_ff: int  # the feed-forward's hidden width

    def run_jax(self, calls: int) -> None:
        for _ in range(calls):
            self.state, metrics = self.jax_step(self.state, self.batch, self.rng)
        jax.block_until_ready(metrics["loss"])


def train_steps(with_torch: bool) -> TrainSteps:
    from jax_mha.lab.data import CopyTaskConfig
    from jax_mha.lab.models import Decoder, ModelConfig
    from jax_mha.lab.train import TrainConfig, init_state, jit_train_step, make_optimizer

    task = CopyTaskConfig(length=TRAIN_LENGTH)
    model_cfg = ModelConfig(d_model=TRAIN_D_MODEL, num_heads=TRAIN_HEADS, num_layers=TRAIN_LAYERS)
    train_cfg = TrainConfig(batch_size=TRAIN_BATCH)
    model = Decoder(model_cfg)
    optimizer = make_optimizer(train_cfg)
    batch = task.batch(jax.random.PRNGKey(1), TRAIN_BATCH)
    torch_step = None
    if with_torch:
        import torch

        step = torch_copy_train_step(train_cfg, task.vocab_size, model_cfg.max_len, model_cfg.d_ff)
        tokens, targets, scored = (torch.from_numpy(np.array(batch[k])) for k in ("inputs", "targets", "scored"))
        torch_step = functools.partial(step, tokens.long(), targets.long(), scored)
    state = jax.jit(lambda key: init_state(key, model, optimizer))(jax.random.PRNGKey(0))  # one program, not per op
    return TrainSteps(jit_train_step(model, optimizer), state,
                      batch, jax.random.PRNGKey(2), torch_step, task.vocab_size, model_cfg.d_ff)


def time_train_steps(cfg: BenchConfig, with_torch: bool) -> dict[str, float]:
    """Median seconds per training step: jax_mha's jitted optax step vs PyTorch eager."""
    steps = train_steps(with_torch)
    fns = {"jax_mha train step (jit, optax)": lambda: steps.run_jax(cfg.train_calls)}
    if with_torch:
        fns["torch train step (eager, AdamW)"] = lambda: [steps.torch_step() for _ in range(cfg.train_calls)]
    run_cfg = dataclasses.replace(cfg, repeats=cfg.train_repeats, min_sample_s=0.0)
    return {name: t / cfg.train_calls for name, t in time_interleaved(fns, run_cfg).items()}


# ---------------------------------------------------------------------------------
# Where a training step's time goes, in both libraries.
# ---------------------------------------------------------------------------------

OPTIMIZER_PART = "optimizer (clip + AdamW)"
PROFILE_PARTS = ("embedding", "LayerNorm", "attention projections", "attention core", "feed-forward",
                 "logits + loss", OPTIMIZER_PART, "other")  # other: residual adds, copies, bias sums


def _jax_part(op_name: str) -> str:
    """The part of the step an XLA op belongs to, from the module path in its name."""
    import re

    if "Decoder" not in op_name:
        return "logits + loss" if re.search(r"jvp\(|transpose\(", op_name) else OPTIMIZER_PART
    for pattern, part in ((r"/ffn/", "feed-forward"), (r"/attention/(query|key|value|out)/", "attention projections"),
                          (r"/attention/", "attention core"), (r"norm", "LayerNorm"), (r"embed|positions", "embedding"),
                          (r"/logits/", "logits + loss")):
        if re.search(pattern, op_name):
            return part
    return "other"


def profile_jax_step(steps: TrainSteps, calls: int) -> dict[str, float]:
    """ms per step in each part of the jitted step: every XLA op's time from a
    `jax.profiler` trace, assigned by the module path in its HLO metadata. Ops on the
    two cores can overlap, so the parts can sum to more than the step."""
    import glob
    import gzip
    import json
    import re
    import tempfile

    hlo = steps.jax_step.lower(steps.state, steps.batch, steps.rng).compile().as_text()
    part = {m.group(1): _jax_part(m.group(2)) for m in re.finditer(r'%([\w.\-]+) = [^\n]*?op_name="([^"]*)"', hlo)}
    steps.run_jax(2)
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        steps.run_jax(calls)
        jax.profiler.stop_trace()
        (trace,) = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
        events = json.load(gzip.open(trace))["traceEvents"]
    ms = dict.fromkeys(PROFILE_PARTS, 0.0)
    for e in events:
        if e.get("ph") == "X" and e["name"] in part:
            ms[part[e["name"]]] += e["dur"] / 1e3 / calls
    return ms


def _torch_part(op: str, shapes: list, vocab: int, d_ff: int) -> str:
    """The part of the step a PyTorch op outside the optimizer belongs to, from its
    name and, for matmuls, its input shapes (a list of shapes): the feed-forward's
    have the hidden width, the logits' the vocabulary size."""
    op = op.lower()
    if "embedding" in op:
        return "embedding"
    if "layer_norm" in op:
        return "LayerNorm"
    if "attention" in op or "flash" in op:
        return "attention core"
    if "gelu" in op:
        return "feed-forward"
    if "softmax" in op or "nll" in op or "cross_entropy" in op:
        return "logits + loss"
    if op in ("aten::mm", "aten::addmm", "aten::bmm"):
        dims = {d for shape in shapes for d in shape}
        if d_ff in dims:
            return "feed-forward"
        return "logits + loss" if vocab in dims else "attention projections"
    return "other"


def profile_torch_step(steps: TrainSteps, calls: int) -> dict[str, float]:
    """ms per step in each part of PyTorch's eager step: the self time of every op
    (`torch.profiler`); ops under the step's optimizer scope are the optimizer, the
    rest are assigned by op name and, for matmuls, input shapes."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        steps.torch_step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(calls):
            steps.torch_step()
    ms = dict.fromkeys(PROFILE_PARTS, 0.0)
    for event in prof.events():
        scope, in_optimizer = event.cpu_parent, event.name == OPTIMIZER_PART
        while scope is not None and not in_optimizer:
            in_optimizer, scope = scope.name == OPTIMIZER_PART, scope.cpu_parent
        part = OPTIMIZER_PART if in_optimizer else _torch_part(event.name, event.input_shapes or [], steps.vocab, steps.d_ff)
        ms[part] += event.self_cpu_time_total / 1e3 / calls
    return ms


def profile_train_steps(with_torch: bool, calls: int = 5) -> dict[str, dict[str, float]]:
    """`{library: {part: ms per step}}` for the copy-task training step."""
    steps = train_steps(with_torch)
    out = {"jax_mha (jit, optax)": profile_jax_step(steps, calls)}
    if with_torch:
        out["torch (eager, AdamW)"] = profile_torch_step(steps, calls)
    return out


def roofline(cfg: BenchConfig, with_torch: bool) -> dict[str, float]:
    """GFLOP/s of a large float32 matmul in each library: the practical peak of this machine."""
    size = cfg.roofline_size
    a = jax.random.normal(jax.random.PRNGKey(0), (size, size), jnp.float32)
    fns = {"jax": _blocking(jax.jit(jnp.matmul), a, a)}
    if with_torch:
        import torch

        at = torch.from_numpy(np.array(a))  # a writable copy
        fns["torch"] = lambda: torch.mm(at, at)
    times = time_interleaved(fns, dataclasses.replace(cfg, repeats=max(3, cfg.repeats // 2)))
    return {name: 2.0 * size**3 / t / 1e9 for name, t in times.items()}


# ---------------------------------------------------------------------------------
# Sliding windows: blockwise skips the key blocks a window rules out.
# ---------------------------------------------------------------------------------

WINDOW_HEADS, WINDOW_HEAD_DIM = 8, 64  # B = 1: one long sequence, d_model = 512
JAX_NN_MAX_N = 4096  # jax.nn builds the (H, N, N) logits: 8.6 GB forward alone at N=16,384


def _window_grad(n: int, window, layer: str):
    """Jitted forward+backward `(q, k, v) -> grads` of causal attention with `window`
    (`(left, 0)` or None for full causal), and its inputs."""
    shape = (1, WINDOW_HEADS, n, WINDOW_HEAD_DIM)  # (B, H, N, D)
    q, k, v = (jax.random.normal(key, shape, jnp.float32) for key in jax.random.split(jax.random.PRNGKey(3), 3))
    if layer == "jax.nn.dot_product_attention":
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # its (B, N, H, D) layout
        attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=window)
    else:
        attend = lambda q, k, v: jax_mha.attention(q, k, v, is_causal=True, local_window_size=window,
                                                   implementation="blockwise")
    grad = jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).sum(), argnums=(0, 1, 2)))
    return grad, (q, k, v)


def _temp_mib(fn, args) -> float:
    """XLA's temporary buffers of the compiled call, MiB (the working memory beyond
    inputs and outputs); NaN where the backend does not say."""
    stats = fn.lower(*args).compile().memory_analysis()
    return float("nan") if stats is None else stats.temp_size_in_bytes / 2**20


def time_windows(cfg: BenchConfig) -> list[dict]:
    """Causal sliding windows against full causal attention, forward+backward, per N."""
    rows = []
    for n in cfg.window_lengths:
        cases = [("jax_mha (blockwise)", None)] + [("jax_mha (blockwise)", (w, 0)) for w in cfg.windows]
        if n <= JAX_NN_MAX_N:
            cases += [("jax.nn.dot_product_attention", (w, 0)) for w in cfg.windows]
        compiled = {case: _window_grad(n, case[1], case[0]) for case in cases}
        fns = {case: _blocking(fn, *args) for case, (fn, args) in compiled.items()}
        times = time_interleaved(fns, dataclasses.replace(cfg, repeats=cfg.window_repeats, warmup=1))
        full = times[("jax_mha (blockwise)", None)]
        for (layer, window), t in times.items():
            rows.append({"N": n, "layer": layer, "window": None if window is None else list(window),
                         "ms": 1e3 * t, "speedup_vs_full_causal": full / t,
                         "temp_mib": _temp_mib(*compiled[(layer, window)])})
    return rows


# ---------------------------------------------------------------------------------
# The projections' kernel-gradient trick (jax_mha/nn/projection.py): does it still pay?
# ---------------------------------------------------------------------------------

PROJECTION_SHAPE = (4, 512, 512)  # (B, N, d_model): the q, k, v, out projections of (4, 512, 512, 8)


def time_projection(cfg: BenchConfig) -> dict[str, float]:
    """Forward+backward ms of four `nn.Dense(d_model)` layers on one input, with
    `projection_dot_general` (the library's) and with plain `lax.dot_general`."""
    from jax_mha.nn.projection import projection_dot_general

    x = jax.random.normal(jax.random.PRNGKey(4), PROJECTION_SHAPE, jnp.float32)
    fns = {}
    for name, dot in (("projection_dot_general", projection_dot_general), ("lax.dot_general", jax.lax.dot_general)):
        layers = [nn.Dense(PROJECTION_SHAPE[-1], dot_general=dot) for _ in range(4)]
        params = [layer.init(jax.random.PRNGKey(i), x) for i, layer in enumerate(layers)]
        loss = lambda ps, x, layers=layers: sum(layer.apply(p, x).sum() for layer, p in zip(layers, ps))
        fns[name] = _blocking(jax.jit(jax.grad(loss, argnums=(0, 1))), params, x)
    return {name: 1e3 * t for name, t in time_interleaved(fns, cfg).items()}


# ---------------------------------------------------------------------------------
# Decoding: the KV cache against re-running the whole prefix.
# ---------------------------------------------------------------------------------

DECODE_D_MODEL, DECODE_HEADS, DECODE_LAYERS, DECODE_BATCH = 256, 8, 2, 8


@functools.partial(jax.jit, static_argnums=(1, 3))
def _decode_without_cache(params, model, prompt, num_tokens: int) -> jax.Array:
    """Greedy decoding with no cache: every new token re-runs the model on a
    fixed-length buffer (one compilation; causal, so later slots are unseen)."""
    b, p = prompt.shape
    buffer = jnp.zeros((b, p + num_tokens), jnp.int32).at[:, :p].set(prompt)

    def body(t, buffer):
        logits = model.apply({"params": params}, buffer)  # (B, T, V)
        return buffer.at[:, t].set(jnp.argmax(logits[:, t - 1], -1).astype(jnp.int32))

    return jax.lax.fori_loop(p, p + num_tokens, body, buffer)


def time_decode(cfg: BenchConfig) -> list[dict]:
    """Greedy tokens/s of a decoder with `generate` (KV cache) and with the whole
    prefix re-run for every token, per total length L (a 1-token prompt, L - 1 new
    tokens). Both give the same tokens (tests/lab/test_models.py)."""
    from jax_mha.lab.models import Decoder, ModelConfig, generate

    rows = []
    for length in cfg.decode_lengths:
        model = Decoder(ModelConfig(vocab_size=64, max_len=length, d_model=DECODE_D_MODEL, num_heads=DECODE_HEADS,
                                    num_layers=DECODE_LAYERS))
        prompt = jnp.zeros((DECODE_BATCH, 1), jnp.int32)
        params = jax.jit(model.init)(jax.random.PRNGKey(0), prompt)["params"]  # one program, not one per operation
        fns = {"with cache (generate)": lambda: jax.block_until_ready(generate(params, model, prompt, length - 1)),
               "no cache (re-run prefix)": lambda: jax.block_until_ready(
                   _decode_without_cache(params, model, prompt, length - 1))}
        times = time_interleaved(fns, dataclasses.replace(cfg, repeats=cfg.window_repeats, warmup=1))
        for name, t in times.items():
            rows.append({"L": length, "layer": name, "ms": 1e3 * t,
                         "tokens_per_s": DECODE_BATCH * (length - 1) / t,
                         "speedup_vs_no_cache": times["no cache (re-run prefix)"] / t})
    return rows


# ---------------------------------------------------------------------------------
# The run.
# ---------------------------------------------------------------------------------

FLAX = "flax MultiHeadDotProductAttention"


def library(layer: str) -> str:
    """Whose matmul roofline a row is measured against."""
    return "torch" if layer.startswith("torch") else "jax"


def auto_path(b: int, n: int, d: int, h: int) -> str:
    """The path `implementation="auto"` takes for self-attention of this shape, as the
    core itself decides it (`functional.resolve_implementation`)."""
    qkv = jax.ShapeDtypeStruct((b, h, n, d // h), jnp.float32)
    return functional.resolve_implementation(qkv, qkv, qkv, implementation="auto")


def time_shape(shape, cfg: BenchConfig, with_torch: bool, peak: dict[str, float]) -> list[dict]:
    """Every layer at one (B, N, d_model, H), interleaved; one row per layer and mode."""
    b, n, d, h = shape
    x = jax.random.normal(jax.random.PRNGKey(1), (b, n, d), jnp.float32)
    fns = {}
    for name, (init, apply) in jax_layers(h).items():
        fns.update(jax_timers(name, init, apply, x))
    if with_torch:
        fns.update(torch_timers(b, n, d, h))
    times = time_interleaved(fns, cfg)
    flops = common.attention_flops(b, n, d)
    rows = []
    for (name, mode), t in times.items():
        gflops = flops["forward_backward" if mode == "fwd+bwd" else "forward"] / t / 1e9
        rows.append({"B": b, "N": n, "d_model": d, "H": h, "layer": name, "mode": mode, "ms": 1e3 * t,
                     "gflops": gflops, "roofline_library": library(name),
                     "frac_roofline": gflops / peak[library(name)], "vs_flax": t / times[(FLAX, mode)]})
    return rows


def contention(start: dict, end: dict) -> dict[str, Any]:
    """Whether other work shared the CPU: roofline drift or load above the core count."""
    drift = {lib: abs(end["roofline_gflops"][lib] - g) / g for lib, g in start["roofline_gflops"].items()}
    cores = os.cpu_count() or 1
    load = max(start["load_average"][0], end["load_average"][0])
    reasons = [f"{lib} matmul roofline moved {100 * v:.0f}% between start and end" for lib, v in drift.items()
               if v > CONTENDED_DRIFT]
    if load > cores:
        reasons.append(f"1-minute load average {load:.1f} exceeds the {cores} cores")
    return {"contended": bool(reasons), "reasons": reasons, "roofline_drift": drift, "max_load_average": load}


def snapshot(cfg: BenchConfig, with_torch: bool) -> dict[str, Any]:
    return {"roofline_gflops": roofline(cfg, with_torch), "load_average": list(os.getloadavg())}


def run(cfg: BenchConfig, with_torch: bool, sections: tuple[str, ...] = ("train", "windows", "decode"),
        progress: bool = True, partial: Callable[[dict], None] = lambda result: None) -> dict[str, Any]:
    """Roofline, every shape, the training step, the windows, decoding, the roofline
    again. `partial` gets the result so far after every step (to write it)."""
    from tqdm.auto import tqdm

    print("measuring the matmul roofline (start)", flush=True)
    start = snapshot(cfg, with_torch)
    result = {"start": start, "roofline_gflops": start["roofline_gflops"], "roofline_size": cfg.roofline_size,
              "rows": [], "train_step_ms": {}, "auto_path": {}, "window_rows": [], "decode_rows": [],
              "complete": False}
    for shape in tqdm(cfg.shapes, desc="timing shapes", unit="shape", disable=not progress):
        result["rows"] += time_shape(shape, cfg, with_torch, start["roofline_gflops"])
        result["auto_path"][str(shape)] = auto_path(*shape)
        partial(result)
    if "train" in sections:
        print("timing the copy-task training step", flush=True)
        result["train_step_ms"] = {k: 1e3 * v for k, v in time_train_steps(cfg, with_torch).items()}
        print("profiling one training step in each library", flush=True)
        result["train_profile_ms"] = profile_train_steps(with_torch, cfg.train_calls)
        partial(result)
    if "windows" in sections:
        print(f"timing sliding windows at N = {', '.join(map(str, cfg.window_lengths))} (seconds per call)", flush=True)
        result["window_rows"] = time_windows(cfg)
        partial(result)
    if "train" in sections:
        result["projection_ms"] = time_projection(cfg)
    if "decode" in sections:
        print(f"timing greedy decoding at L = {', '.join(map(str, cfg.decode_lengths))}", flush=True)
        result["decode_rows"] = time_decode(cfg)
        partial(result)
    print("measuring the matmul roofline (end)", flush=True)
    result["end"] = snapshot(cfg, with_torch)
    result.update(contention(start, result["end"]), complete=True)
    return result


ROOFLINE_TARGET = 0.70  # target: attention fwd+bwd at N >= 512, share of jax's own matmul roofline
TORCH_SDPA_TARGET = 1.2  # target: at most this many times torch SDPA's fwd+bwd time, N >= 512
WINDOW_TARGET = (16384, 256, 10.0)  # target: at N=16,384 a (256, 0) window >= 10x faster than full causal
DECODE_TARGET = (256, 5.0)  # target: the cache >= 5x the tokens/s of re-running the prefix at L=256


def _layer_targets(rows: list[dict], auto: dict) -> dict[str, Any]:
    """Per-shape ratios of the attention layers: vs flax, vs torch SDPA, % roofline."""
    get = lambda shape, layer, mode: next((r for r in rows if (r["B"], r["N"], r["d_model"], r["H"]) == shape
                                           and r["layer"] == layer and r["mode"] == mode), None)
    shapes = sorted({(r["B"], r["N"], r["d_model"], r["H"]) for r in rows}, key=lambda s: (s[1], s[3]))
    out: dict[str, Any] = {"xla_vs_flax": {}, "auto_frac_roofline_fwd_bwd": {}, "auto_vs_torch_sdpa_fwd_bwd": {}}
    for s in shapes:
        out["xla_vs_flax"][str(s)] = {m: get(s, "jax_mha (xla)", m)["vs_flax"] for m in ("fwd", "fwd+bwd")}
        if s[1] < 512:
            continue
        ours = get(s, f"jax_mha ({auto[str(s)]})", "fwd+bwd")
        out["auto_frac_roofline_fwd_bwd"][str(s)] = ours["frac_roofline"]
        torch = get(s, "torch SDPA", "fwd+bwd")
        if torch is not None:
            out["auto_vs_torch_sdpa_fwd_bwd"][str(s)] = ours["ms"] / torch["ms"]
    return out


def check_targets(result: dict[str, Any]) -> dict[str, Any]:
    """The issues' targets, evaluated on this run: the ratios and one verdict each
    (True met, False missed; absent when this run did not measure it)."""
    out = _layer_targets(result["rows"], result["auto_path"])
    verdicts = {"never slower than flax (xla path, every shape and mode)":
                all(v <= 1.0 for r in out["xla_vs_flax"].values() for v in r.values())}
    if out["auto_frac_roofline_fwd_bwd"]:
        verdicts[f"fwd+bwd >= {ROOFLINE_TARGET:.0%} of jax's matmul roofline at N >= 512"] = all(
            v >= ROOFLINE_TARGET for v in out["auto_frac_roofline_fwd_bwd"].values())
    if out["auto_vs_torch_sdpa_fwd_bwd"]:
        verdicts[f"fwd+bwd <= {TORCH_SDPA_TARGET}x torch SDPA at N >= 512"] = all(
            v <= TORCH_SDPA_TARGET for v in out["auto_vs_torch_sdpa_fwd_bwd"].values())
    train = result["train_step_ms"]
    if "torch train step (eager, AdamW)" in train:
        out["train_speed_vs_torch"] = train["torch train step (eager, AdamW)"] / train["jax_mha train step (jit, optax)"]
        verdicts["train step at least as fast as torch eager"] = out["train_speed_vs_torch"] >= 1.0
    n, w, x = WINDOW_TARGET
    hit = [r for r in result["window_rows"] if r["N"] == n and r["window"] == [w, 0] and r["layer"].startswith("jax_mha")]
    if hit:
        out["window_speedup"] = hit[0]["speedup_vs_full_causal"]
        verdicts[f"({w}, 0) window >= {x:g}x faster than full causal blockwise at N={n}"] = out["window_speedup"] >= x
    length, x = DECODE_TARGET
    hit = [r for r in result["decode_rows"] if r["L"] == length and r["layer"].startswith("with cache")]
    if hit:
        out["decode_speedup"] = hit[0]["speedup_vs_no_cache"]
        verdicts[f"KV cache >= {x:g}x the tokens/s of no cache at L={length}"] = out["decode_speedup"] >= x
    out["verdicts"] = verdicts
    return out


def verdict_lines(result: dict[str, Any]) -> str:
    """One line per target: MET or MISSED, on the machine named above the table."""
    lines = [f"targets on {machine_line(result['metadata'])}:"]
    for name, ok in result["targets"]["verdicts"].items():
        lines.append(f"  {'MET   ' if ok else 'MISSED'} {name}")
    return "\n".join(lines)


def machine_line(meta: dict) -> str:
    """CPU, cores and versions: what a timing table is only true for."""
    versions = ", ".join(f"{k} {meta[k]}" for k in ("jax", "flax", "torch") if k in meta)
    threads = f", torch threads {meta['torch_threads']}" if "torch_threads" in meta else ""
    return f"{meta['cpu']}, {meta['cpu_count']} cores; {versions}{threads}"


def format_table(result: dict[str, Any]) -> str:
    """Markdown table: one line per (shape, layer), forward and forward+backward,
    each with its GFLOP/s as % of its own library's matmul roofline."""
    peak, end = result["roofline_gflops"], result.get("end", {}).get("roofline_gflops", {})
    roof = ", ".join(f"{k} {v:.1f}" + (f" → {end[k]:.1f}" if k in end else "") for k, v in peak.items())
    lines = [
        f"machine: {machine_line(result['metadata'])}",
        f"matmul roofline (float32, {result['roofline_size']}² @ {result['roofline_size']}², start → end): {roof} GFLOP/s",
        f"load average (1 min) start → end: {result['start']['load_average'][0]:.2f} → "
        f"{result.get('end', result['start'])['load_average'][0]:.2f}",
        "",
        "| (B, N, d, H) | layer | fwd ms | fwd GFLOP/s (% roofline) | fwd vs flax | fwd+bwd ms | fwd+bwd GFLOP/s (% roofline) | fwd+bwd vs flax |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    by_key: dict[tuple, dict[str, dict]] = {}
    for r in result["rows"]:
        by_key.setdefault(((r["B"], r["N"], r["d_model"], r["H"]), r["layer"]), {})[r["mode"]] = r
    for (shape, layer), modes in by_key.items():
        f, fb = modes["fwd"], modes["fwd+bwd"]
        lines.append(
            f"| {shape} | {layer} | {f['ms']:.2f} | {f['gflops']:.1f} ({100 * f['frac_roofline']:.0f}% {f['roofline_library']}) "
            f"| {f['vs_flax']:.2f} | {fb['ms']:.2f} | {fb['gflops']:.1f} ({100 * fb['frac_roofline']:.0f}% "
            f"{fb['roofline_library']}) | {fb['vs_flax']:.2f} |")
    if result["train_step_ms"]:
        lines += ["", "| training step (copy task, d=256, 8 heads, 2 layers, batch 64 × 34 tokens) | ms/step |", "| --- | ---: |"]
        lines += [f"| {k} | {v:.1f} |" for k, v in result["train_step_ms"].items()]
    lines += _profile_table(result.get("train_profile_ms", {}))
    if result.get("projection_ms"):
        ms = result["projection_ms"]
        lines += ["", f"projections (4 Dense layers, fwd+bwd, {PROJECTION_SHAPE}): projection_dot_general "
                      f"{ms['projection_dot_general']:.1f} ms vs lax.dot_general {ms['lax.dot_general']:.1f} ms "
                      f"({ms['lax.dot_general'] / ms['projection_dot_general']:.2f}x)"]
    lines += _window_table(result["window_rows"]) + _decode_table(result["decode_rows"])
    if result.get("contended"):
        lines.insert(3, "CONTENDED RUN: other work shared the CPU (see the warning below)")
    return "\n".join(lines)


def _profile_table(profile: dict[str, dict[str, float]]) -> list[str]:
    """Where one training step's time goes, ms per part, one column per library."""
    if not profile:
        return []
    libs = list(profile)
    lines = ["", "| part of the training step, ms | " + " | ".join(libs) + " |", "| --- |" + " ---: |" * len(libs)]
    for part in PROFILE_PARTS:
        lines.append(f"| {part} | " + " | ".join(f"{profile[lib][part]:.1f}" for lib in libs) + " |")
    lines.append("| sum of the parts | " + " | ".join(f"{sum(profile[lib].values()):.1f}" for lib in libs) + " |")
    return lines


def _window_table(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = ["", f"| causal attention, fwd+bwd (B=1, H={WINDOW_HEADS}, D={WINDOW_HEAD_DIM}) | N | window | ms "
                 "| speed-up vs full causal blockwise | XLA temp MiB |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        window = "full" if r["window"] is None else f"({r['window'][0]}, {r['window'][1]})"
        lines.append(f"| {r['layer']} | {r['N']} | {window} | {r['ms']:.0f} | {r['speedup_vs_full_causal']:.1f}x "
                     f"| {r['temp_mib']:.0f} |")
    return lines


def _decode_table(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = ["", f"| greedy decoding (d={DECODE_D_MODEL}, {DECODE_HEADS} heads, {DECODE_LAYERS} layers, batch "
                 f"{DECODE_BATCH}) | L | ms per sequence batch | tokens/s | speed-up |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['L']} | {r['ms']:.0f} | {r['tokens_per_s']:.0f} "
                     f"| {r['speedup_vs_no_cache']:.1f}x |")
    return lines


def warning(result: dict) -> str:
    return ("!" * 78 + "\nWARNING: CONTENDED RUN, other work shared the CPU: " + "; ".join(result["reasons"])
            + ".\nThese timings can rank the libraries wrongly; measure again on a quiet machine.\n" + "!" * 78)


def plot(result: dict[str, Any], path: Path) -> None:
    """GFLOP/s per layer and shape, forward and forward+backward, against the roofline."""
    use_agg_backend()
    import matplotlib.pyplot as plt

    rows = result["rows"]
    shapes = list(dict.fromkeys((r["B"], r["N"], r["d_model"], r["H"]) for r in rows))
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    width = 0.8 / len(layers)
    for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
        for i, layer in enumerate(layers):
            vals = [next((r["gflops"] for r in rows if r["layer"] == layer and r["mode"] == mode
                          and (r["B"], r["N"], r["d_model"], r["H"]) == s), 0.0) for s in shapes]
            ax.bar(np.arange(len(shapes)) + (i - (len(layers) - 1) / 2) * width, vals, width, label=layer)
        for lib, style in zip(result["roofline_gflops"], ("--", ":")):
            ax.axhline(result["roofline_gflops"][lib], color="k", ls=style, lw=1, label=f"{lib} matmul roofline")
        ax.set_xticks(np.arange(len(shapes)), [f"B{b} N{n}\nd{d} H{h}" for b, n, d, h in shapes], fontsize=8)
        ax.set_title(f"{mode} (float32)")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("GFLOP/s")
    fig.suptitle(machine_line(result["metadata"]) + (" (CONTENDED RUN)" if result.get("contended") else ""), fontsize=9)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=4, bbox_to_anchor=(0.5, -0.12), frameon=False)
    save_figure(fig, path)


def _shapes(text: str) -> tuple[tuple[int, int, int, int], ...]:
    """`--shapes`: 'B,N,d_model,H;...' with positive ints and d_model divisible by H."""
    shapes = []
    for part in filter(None, text.replace(" ", "").split(";")):
        try:
            shape = tuple(int(v) for v in part.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not four integers B,N,d_model,H") from None
        if len(shape) != 4 or min(shape) < 1:
            raise argparse.ArgumentTypeError(f"{part!r} must be four integers >= 1: B,N,d_model,H")
        if shape[2] % shape[3]:
            raise argparse.ArgumentTypeError(f"{part!r}: d_model={shape[2]} is not divisible by H={shape[3]}")
        shapes.append(shape)
    if not shapes:
        raise argparse.ArgumentTypeError(f"{text!r} names no shape")
    return tuple(shapes)


def parse(argv):
    p = common.parser(MODULE, "Times jax_mha attention (xla, blockwise) against flax, jax.nn.dot_product_attention "
                              "and, when torch is installed, PyTorch; forward and forward+backward, plus the copy-task "
                              "training step, each as a percentage of its library's matmul roofline.")
    p.add_argument("--quick", action="store_true", help="fewer repeats and shorter samples (a smoke run)")
    p.add_argument("--out", type=Path, default=Path("results/benchmark"), help="directory for benchmark.json and benchmark.png")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch rows even if torch is installed")
    p.add_argument("--no-train", action="store_true", help="skip the training-step comparison")
    p.add_argument("--no-windows", action="store_true", help="skip the sliding-window rows (N = 4,096 and 16,384)")
    p.add_argument("--no-decode", action="store_true", help="skip the decode-with-cache rows")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--shapes", type=_shapes,
                   help="semicolon-separated B,N,d_model,H tuples to time instead of the defaults, e.g. '8,128,256,8;1,2048,512,8'")
    return p.parse_args(argv)


def metadata(with_torch: bool) -> dict[str, Any]:
    meta = common.run_metadata()
    if with_torch:
        import torch

        meta.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
    meta["glibc_tunables"] = os.environ.get("GLIBC_TUNABLES")  # malloc settings change large-array costs
    return meta


def main(argv: list[str] | None = None) -> dict[str, Any]:
    common.start_study()
    args = parse(argv)
    cfg = QUICK if args.quick else FULL
    if args.shapes:
        cfg = dataclasses.replace(cfg, shapes=args.shapes)
    with_torch = torch_available() and not args.no_torch
    out, start = Path(args.out), time.perf_counter()
    meta = metadata(with_torch)
    print(f"machine: {machine_line(meta)}; load average {meta['load_average'][0]:.2f}", flush=True)
    extra = {"metadata": meta, "config": dataclasses.asdict(cfg), "preset": "quick" if args.quick else "full"}
    partial = lambda result: write_json(out / "benchmark.json", {**result, **extra})
    try:
        sections = tuple(name for name, skip in (("train", args.no_train), ("windows", args.no_windows),
                                                 ("decode", args.no_decode)) if not skip)
        result = run(cfg, with_torch, sections, progress=not args.no_progress, partial=partial)
    except KeyboardInterrupt:
        raise Interrupted(f"the shapes timed so far are in {out / 'benchmark.json'} (marked incomplete); a benchmark "
                          "is one run, so it measures everything again", resumes=False) from None
    result.update(extra, targets=check_targets(result), wall_seconds=time.perf_counter() - start)
    write_json(out / "benchmark.json", result)
    plot(result, out / "benchmark.png")
    print(format_table(result))
    print("\n" + verdict_lines(result))
    if result["contended"]:
        print("\n" + warning(result), flush=True)
    print(f"\nwrote {out / 'benchmark.json'} and {out / 'benchmark.png'} in {result['wall_seconds']:.0f} s")
    return result


if __name__ == "__main__":
    common.cli(main, MODULE)
