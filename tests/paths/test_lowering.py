"""Both Pallas kernels lowered for their real devices on this CPU: `jax.export` with
`platforms=["cuda"]` runs Pallas' Triton lowering and `platforms=["tpu"]` its Mosaic
lowering, with the kernel compiled (interpret=False), no device needed. Each cell
exports the forward and the gradient of `run` and finds the kernel's custom call in
the module text, or `refusal` returned a message for that cell.

Triton's lowering takes only power-of-two tiles (N = S in 33..48 or 65..112 used to
fail); Mosaic's takes only tiles its layouts allow. A representative set of cells runs
by default; `--full-matrix` runs the whole grid (N = S in {1, 34, 100, 128, 1000, 4096},
D in {64, 128, 256}, bfloat16 and float32, causal / segments / window / none, GQA, and
N != S). Splash's backward is its fused kernel (no dq kernel) while S spans at most
`pallas_tpu.FUSED_BWD_MAX_KV_BLOCKS` key blocks, its two kernels beyond.

The last section lowers `implementation="auto"` itself: the kernel of the platform
exported for, the pure-JAX path on this CPU, and splash inside a `shard_map` under a
mesh of four host devices (in a subprocess)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import f32_tolerance, script_env

from jax_mha import _masking
from jax_mha.paths import pallas_gpu, pallas_tpu

KERNELS = {"pallas_tpu": pallas_tpu, "pallas_gpu": pallas_gpu}
# (export platform, call platform, custom-call target, forward / backward kernel names)
TARGETS = {
    "pallas_gpu": ("cuda", "gpu", "__gpu$xla.gpu.triton", 'name = "forward_kernel"', 'name = "dkv_kernel"'),
    "pallas_tpu": ("tpu", "tpu", "tpu_custom_call", "splash_mha_fwd", "splash_mha_dkv"),
}
B, H, K = 2, 4, 2  # GQA everywhere


def _vis(n, s, parts):
    ids = lambda length: jnp.asarray(np.minimum(np.arange(length) * 3 // max(length, 1), 2)[None].repeat(B, 0))
    q_ids = kv_ids = None
    if "segments" in parts:
        q_ids, kv_ids = ids(n), ids(s)
    q_seg, kv_seg = _masking.segments_at_rank(q_ids, kv_ids, 1)
    sinks = jnp.linspace(-1.0, 2.0, H, dtype=jnp.float32) if "sinks" in parts else None
    return _masking.Visibility(n, s, "causal" in parts, _masking.Window(5, 2) if "window" in parts else None,
                               q_segment_ids=q_seg, kv_segment_ids=kv_seg, sinks=sinks, batch_shape=(B,), num_heads=H)


def export_cell(name, n, s, d, dtype, parts, grad):
    """The exported module text of `run` (or its gradient) for one cell, or
    `("refused", message)`."""
    platform, call_platform, target = TARGETS[name][:3]
    mod = KERNELS[name]
    q = jax.ShapeDtypeStruct((B, H, n, d), dtype)
    k = jax.ShapeDtypeStruct((B, K, s, d), dtype)
    vis = _vis(n, s, parts)
    call = _masking.Call(q, k, k, platform=call_platform)
    why = mod.refusal(vis, call)
    if why is not None:
        return ("refused", why)
    if name == "pallas_gpu":  # the path's own run (the library's kernel), compiled for the GPU
        bad = jnp.zeros((B, K, s), bool)
        f = lambda q, k, v: mod.run(q, k, v, bad, vis, call, scale=d ** -0.5)[0]
    else:  # splash's kernel function
        f = lambda q, k, v: mod.run(q, k, v, vis, scale=d ** -0.5, interpret=False)
    if grad:
        forward = f
        f = jax.grad(lambda q, k, v: forward(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    # The Triton call has no stable serialization: export would refuse it unless told.
    checks = [jax.export.DisabledSafetyCheck.custom_call(target)] if name == "pallas_gpu" else []
    return jax.export.export(jax.jit(f), platforms=[platform], disabled_checks=checks)(q, k, k).mlir_module()


DEFAULT_CELLS = [
    ("pallas_gpu", 34, 34, 64, "bfloat16", ("causal",)),
    ("pallas_gpu", 100, 100, 128, "float32", ("causal", "segments")),
    ("pallas_gpu", 1, 1, 128, "bfloat16", ()),
    ("pallas_gpu", 128, 128, 64, "float32", ("window",)),
    ("pallas_gpu", 100, 37, 64, "bfloat16", ("segments", "sinks")),  # N > S
    ("pallas_gpu", 37, 100, 128, "float32", ("causal",)),  # S > N
    ("pallas_gpu", 1000, 1000, 256, "bfloat16", ("causal",)),  # the widest head the GPU path takes
    ("pallas_tpu", 34, 34, 64, "bfloat16", ("window",)),
    ("pallas_tpu", 100, 100, 128, "float32", ("causal", "segments")),
    ("pallas_tpu", 1, 1, 64, "float32", ("causal",)),
    ("pallas_tpu", 128, 128, 128, "bfloat16", ()),
    ("pallas_tpu", 37, 100, 64, "bfloat16", ("causal", "window")),
    ("pallas_tpu", 100, 37, 128, "float32", ("segments",)),
    ("pallas_tpu", 100, 100, 128, "bfloat16", ("causal", "segments", "sinks")),  # splash's sinks argument
    ("pallas_tpu", 1000, 1000, 256, "bfloat16", ("causal", "segments")),
    ("pallas_tpu", 4096, 4096, 128, "bfloat16", ("causal",)),  # 8 key blocks: the two-kernel backward
]
PATTERNS = [("causal",), ("causal", "segments"), ("window",), ()]
SIZES, HEAD_DIMS, DTYPES = (1, 34, 100, 128, 1000, 4096), (64, 128, 256), ("bfloat16", "float32")
UNEQUAL = ((100, 37), (37, 100), (1, 1000), (1000, 34))  # (N, S)
FULL_CELLS = [(name, n, n, d, dt, parts) for name, n, d, dt, parts in itertools.product(
    sorted(KERNELS), SIZES, HEAD_DIMS, DTYPES, PATTERNS)] + [
    (name, n, s, d, dt, parts) for name, (n, s), d, dt, parts in itertools.product(
        sorted(KERNELS), UNEQUAL, HEAD_DIMS, DTYPES, PATTERNS)]


def pytest_generate_tests(metafunc):
    if "cell" in metafunc.fixturenames:
        cells = FULL_CELLS if metafunc.config.getoption("--full-matrix") else DEFAULT_CELLS
        metafunc.parametrize("cell", cells, ids=[f"{c[0]}-{c[1]}x{c[2]}-d{c[3]}-{c[4]}-{'+'.join(c[5]) or 'full'}"
                                                 for c in cells])


def expected_refusal(name, n, s, parts) -> str | None:
    """What `refusal` must say for a cell of this grid, or None (it must lower): the
    library's kernel and splash take every cell."""
    return None


def test_forward_and_gradient_lower_to_the_kernel(cell):
    name, n, s, d, dtype, parts = cell
    _, _, target, forward, backward = TARGETS[name]
    refused = expected_refusal(name, n, s, parts)
    for grad in (False, True):
        text = export_cell(name, n, s, d, jnp.dtype(dtype), parts, grad)
        if refused is not None:  # the dispatcher moves on: nothing to lower
            assert isinstance(text, tuple) and refused in text[1], text
            return
        assert not isinstance(text, tuple), text
        assert f"custom_call @{target}" in text and forward in text
        assert (backward in text) == grad
        assert text.count(f"custom_call @{target}") == (1 + backward_kernels(name, s) if grad else 1)
        if name == "pallas_tpu":
            assert ("splash_mha_dq" in text) == (grad and backward_kernels(name, s) == 2)


def backward_kernels(name, s) -> int:
    """The backward's kernel calls: Triton's delta/dq and dkv; splash's fused dq/dk/dv
    kernel while S spans at most `FUSED_BWD_MAX_KV_BLOCKS` of its key blocks, else its
    dq and dkv kernels."""
    if name == "pallas_gpu":
        return 2
    block = min(pallas_tpu.DEFAULT_BLOCK, -(-s // pallas_tpu.MIN_BLOCK) * pallas_tpu.MIN_BLOCK)
    return 1 if -(-s // block) <= pallas_tpu.FUSED_BWD_MAX_KV_BLOCKS else 2


# --- implementation="auto" lowered for each platform ----------------------------------
# (this section: "auto" chooses by the lowering platform; splash under a mesh)

CUDA_CHECKS = [jax.export.DisabledSafetyCheck.custom_call(TARGETS["pallas_gpu"][2])]


def export_auto(platforms, dtype=jnp.float32, grad=False, n=100, **kw):
    """The exported module text of a jitted `attention(..., implementation="auto")`
    (or its gradient) at q `(2, 4, n, 64)`, k/v `(2, 2, n, 64)`."""
    from jax_mha import attention

    q, k = jax.ShapeDtypeStruct((B, H, n, 64), dtype), jax.ShapeDtypeStruct((B, K, n, 64), dtype)
    f = lambda q, k, v: attention(q, k, v, implementation="auto", **kw)
    if grad:
        forward = f
        f = jax.grad(lambda q, k, v: forward(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    return jax.export.export(jax.jit(f), platforms=platforms, disabled_checks=CUDA_CHECKS)(q, k, k).mlir_module()


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "gradient"])
def test_auto_lowers_to_the_kernel_of_the_platform_exported_for(grad):
    """One jitted "auto" function, three exports from this CPU: Triton's kernel for
    CUDA, splash's for TPU, neither for CPU (the pure-JAX path)."""
    triton, mosaic = TARGETS["pallas_gpu"][2], TARGETS["pallas_tpu"][2]
    calls = 1 + (2 if grad else 0)
    cuda = export_auto(["cuda"], grad=grad, is_causal=True)
    assert cuda.count(f"custom_call @{triton}") == calls and mosaic not in cuda
    tpu = export_auto(["tpu"], grad=grad, is_causal=True)
    assert tpu.count(f"custom_call @{mosaic}") == (2 if grad else 1) and triton not in tpu  # fused backward
    cpu = export_auto(["cpu"], grad=grad, is_causal=True)
    assert triton not in cpu and mosaic not in cpu and "dot_general" in cpu


def test_auto_exports_the_pure_path_where_every_kernel_refuses_and_triton_for_cudnn():
    """A dense mask no kernel exported from this CPU takes leaves both branches the
    pure-JAX path (cuDNN would take it on a GPU host); a soft cap goes to the library's
    kernel for CUDA and to splash for TPU; a bfloat16 call a GPU host would give to
    cuDNN is exported for CUDA from this CPU with the Triton kernel (jax.nn's cuDNN
    call cannot be traced without a GPU)."""
    from jax_mha import _dispatch

    mask = np.tril(np.ones((100, 100), bool))
    assert TARGETS["pallas_gpu"][2] not in export_auto(["cuda"], mask=mask)
    assert TARGETS["pallas_tpu"][2] not in export_auto(["tpu"], mask=mask)
    assert TARGETS["pallas_gpu"][2] in export_auto(["cuda"], logits_soft_cap=5.0)
    assert TARGETS["pallas_tpu"][2] in export_auto(["tpu"], logits_soft_cap=5.0)
    q = jax.ShapeDtypeStruct((B, H, 128, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((B, K, 128, 64), jnp.bfloat16)
    choice = _dispatch.choose(_masking.Visibility(128, 128, True), _masking.Call(q, k, k, platform="gpu"), "auto")
    assert choice == "cudnn" and choice.per_platform["cuda"] == "pallas_gpu"
    text = export_auto(["cuda"], dtype=jnp.bfloat16, n=128, is_causal=True)
    assert TARGETS["pallas_gpu"][2] in text and "custom_call @__cudnn" not in text


def test_splash_block_tables_equal_splash_own(monkeypatch):
    """The masks whose blocks the description's key ranges decide build the same block
    tables (forward and dkv, fused or not) as splash's own masks, which evaluate every
    block; and only the partial blocks reach splash's mask evaluation."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    cases = [(1024, 1024, True, None, 0), (512, 1024, True, None, 512), (1024, 384, True, None, -640),
             (1024, 1024, False, (200, 0), 0), (640, 1024, True, (300, None), 384), (1024, 768, False, (64, 64), -300),
             (512, 512, False, None, 0)]
    for n, s, causal, window, offset in cases:
        for fused in (False, True):
            args = (n, s, 2, causal, window, offset, 128, 128, None, True, fused)
            ours = pallas_tpu._kernel.__wrapped__(*args)
            with monkeypatch.context() as patch:  # splash's own masks, every block evaluated
                patch.setattr(pallas_tpu, "_ranged_mask", lambda inner, pattern: inner)
                theirs = pallas_tpu._kernel.__wrapped__(*args)
            for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
                np.testing.assert_array_equal(a, b, err_msg=str(args))
    evaluated = []
    original = sm.CausalMask.__getitem__
    monkeypatch.setattr(sm.CausalMask, "__getitem__", lambda self, idx: evaluated.append(idx) or original(self, idx))
    pallas_tpu._kernel.__wrapped__(4096, 4096, 4, True, None, 0, 512, 512, None, True, False)
    assert 0 < len(evaluated) <= 4 * 8  # the 8 diagonal blocks, per table; splash alone asks all 64 of each


def spy_kernel_arrays(monkeypatch):
    """The names of the arrays each splash call gets (`ids` only with segment ids)."""
    seen = []
    original = pallas_tpu._call_kernel
    monkeypatch.setattr(pallas_tpu, "_call_kernel", lambda kernel, arrays: seen.append(sorted(arrays))
                        or original(kernel, arrays))
    return seen


@pytest.mark.parametrize("parts, n, s, with_ids", [
    (("causal",), 100, 100, False),  # padded keys lie above the diagonal: no ids
    (("causal",), 37, 100, False),
    (("causal", "window"), 100, 37, False),
    ((), 128, 128, False),  # nothing padded
    ((), 100, 100, True),  # padded keys visible: ids hide them
    (("window",), 100, 100, True),  # the window's right side reaches past S
    (("causal", "segments"), 128, 128, True),
])
def test_splash_gets_segment_ids_only_when_needed(monkeypatch, parts, n, s, with_ids):
    seen = spy_kernel_arrays(monkeypatch)
    vis = _vis(n, s, parts)
    q = jax.ShapeDtypeStruct((B, H, n, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((B, K, s, 64), jnp.bfloat16)
    jax.eval_shape(lambda q, k, v: pallas_tpu.run(q, k, v, vis, scale=0.125, interpret=False), q, k, k)
    assert seen == [sorted(["q", "k", "v"] + (["ids"] if with_ids else []))]


def _mesh_worker() -> dict:
    """Run in a subprocess with 4 host devices: splash under a (2, 2) mesh of axes
    "data" and "model", explicit and automatic, exported for TPU and interpreted here."""
    from conftest import jax_reference, np_allowed

    from jax_mha import attention

    out = {}
    rng = np.random.default_rng(3)
    n, d = 100, 64
    q = jnp.asarray(rng.standard_normal((B, H, n, d)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, K, n, d)), jnp.float32) for _ in range(2))
    ct = jnp.asarray(rng.standard_normal((B, H, n, d)), jnp.float32)

    def value_and_grad(impl, attend=attention, dtype=jnp.float32):
        """`(out, its vjp of ct)` of `attend`, jitted."""
        def both(q, k, v):
            out, pull = jax.vjp(lambda *a: attend(*a, is_causal=True, implementation=impl), q, k, v)
            return out, pull(ct.astype(dtype))
        return jax.jit(both)
    for kind in ("Explicit", "Auto"):
        mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(getattr(jax.sharding.AxisType, kind),) * 2)
        with jax.set_mesh(mesh):
            text = jax.export.export(value_and_grad("auto"), platforms=["tpu"])(q, k, v).mlir_module()
            out[f"{kind} export"] = {"kernels": text.count("custom_call @tpu_custom_call"),
                                     "manual": "manual_computation" in text}
            got = value_and_grad("pallas_tpu")(q, k, v)
            out[f"{kind} shard_map"] = "shard_map" in str(jax.make_jaxpr(value_and_grad("pallas_tpu"))(q, k, v))
            with pytest.raises(ValueError) as refused:
                attention(jnp.ones((2, 6, 8, 8)), jnp.ones((2, 3, 8, 8)), jnp.ones((2, 3, 8, 8)),
                          implementation="pallas_tpu")
            out[f"{kind} refusal"] = str(refused.value)
        with jax.enable_x64(True):
            allowed = jnp.asarray(np_allowed((B, H, n, n), is_causal=True))
            ref = lambda q, k, v, is_causal, implementation: jax_reference(q, k, v, allowed)
            want = value_and_grad(None, ref, jnp.float64)(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)))
            out[f"{kind} error"] = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
                                       for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    x = jax.device_put(jnp.ones((3, H, 8, 8)), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    with pytest.raises(ValueError) as refused:  # no context mesh: the inputs' sharding's
        attention(x, x, x, implementation="pallas_tpu")
    out["sharding refusal"] = str(refused.value)
    return out


def test_splash_runs_in_a_shard_map_under_a_mesh():
    """Under a mesh of 4 host devices with axes "data" and "model" (explicit or
    automatic shardings), "auto" exported for TPU holds splash inside a shard_map (a
    Mosaic kernel cannot be partitioned automatically), splash interpreted on that mesh
    equals the float64 reference, value and gradients, and kv heads the "model" axis
    does not divide are refused by name."""
    import json
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = script_env(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0")
    env["PYTHONPATH"] = os.pathsep.join([here, env["PYTHONPATH"]])
    code = "import json, test_lowering; print('RESULT ' + json.dumps(test_lowering._mesh_worker()))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=here)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads([line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1][len("RESULT "):])
    for kind in ("Explicit", "Auto"):
        assert got[f"{kind} export"] == {"kernels": 2, "manual": True}, got  # forward and fused backward
        assert got[f"{kind} shard_map"], got
        # Relative to each array's size; the float32 sums over D=64 and the 100 keys or rows, forward and back.
        assert got[f"{kind} error"] < f32_tolerance(terms=2 * 64 + 4 * 100 + 100 * (H // K), magnitude=1.0), got
        assert "heads over the mesh axis 'model' of size 2" in got[f"{kind} refusal"], got
        assert "kv heads K=3 (H=6)" in got[f"{kind} refusal"], got
    assert "batch over the mesh axis 'data' of size 2, which does not divide the flattened batch 3" in got[
        "sharding refusal"], got


# --- the library's own kernel: every feature it takes, lowered ------------------------

def _feature_kwargs(feature, n, s):
    """Keyword arguments of `attention` for one composed feature (traced values are
    arguments of the exported function: `values`)."""
    offset = s - n
    return {
        "alibi": lambda v: dict(is_causal=True, score_mod=lambda sc, b, h, i, j: sc + v["slopes"][h] * (j - i - offset)),
        "soft_cap": lambda v: dict(is_causal=True, logits_soft_cap=30.0),
        "documents": lambda v: dict(mask_mod=lambda b, h, i, j: v["docs"][b, i + offset] == v["docs"][b, j]),
        "window": lambda v: dict(local_window_size=(16, 16)),
        "prefix_lm": lambda v: dict(mask_mod=lambda b, h, i, j: (j < s // 4) | (j <= i + offset)),
        "sinks": lambda v: dict(is_causal=True, sinks=v["slopes"]),
        "bias": lambda v: dict(bias=v["bias"]),
        "table": lambda v: dict(score_mod=lambda sc, b, h, i, j: sc + v["table"][h, jnp.clip(j - i - offset + 16, 0, 31)]),
        "lengths_window": lambda v: dict(kv_lengths=v["lengths"], local_window_size=(16, 16)),
        "residual": lambda v: dict(is_causal=True, return_residual=True),
    }[feature]


FEATURES = ("alibi", "soft_cap", "documents", "window", "prefix_lm", "sinks", "bias", "table", "lengths_window",
            "residual")


def export_feature(feature, implementation, platform, n=96, s=96, grad=True):
    """The exported text of the gradient (of q, k, v and the floating values) of
    `attention(..., implementation=...)` with one composed feature."""
    from jax_mha import EXPORT_DISABLED_CHECKS, attention

    q = jax.ShapeDtypeStruct((B, H, n, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((B, K, s, 64), jnp.bfloat16)
    values = {"slopes": jax.ShapeDtypeStruct((H,), jnp.float32), "docs": jax.ShapeDtypeStruct((B, s), jnp.int32),
              "bias": jax.ShapeDtypeStruct((B, H, n, s), jnp.bfloat16),
              "table": jax.ShapeDtypeStruct((H, 32), jnp.float32), "lengths": jax.ShapeDtypeStruct((B,), jnp.int32)}
    make = _feature_kwargs(feature, n, s)

    def f(q, k, v, values):
        out = attention(q, k, v, implementation=implementation, **make(values))
        out = out[0] if isinstance(out, tuple) else out
        return out.astype(jnp.float32).sum()

    floating = lambda v: {x: y for x, y in v.items() if jnp.issubdtype(y.dtype, jnp.floating)}
    g = jax.grad(lambda q, k, v, fl, rest: f(q, k, v, {**fl, **rest}), argnums=(0, 1, 2, 3)) if grad else None
    ints = {x: y for x, y in values.items() if x not in floating(values)}
    fn = g if grad else (lambda q, k, v, fl, rest: f(q, k, v, {**fl, **rest}))
    return jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=EXPORT_DISABLED_CHECKS)(
        q, k, k, floating(values), ints).mlir_module()


@pytest.mark.parametrize("implementation", ["pallas_gpu", "auto"])
@pytest.mark.parametrize("feature", FEATURES)
def test_every_feature_exports_for_cuda_with_the_kernel(feature, implementation):
    """Forward and backward of each composed feature, named or chosen by "auto",
    exported for CUDA from this CPU: the library's three Triton kernels (forward, dq,
    dk/dv), compiled (never the interpret-mode emulation, which has no custom call),
    each taking the scores' exponentials by `ex2.approx` (libdevice's `__nv_exp2f`),
    not by the several instructions of its accurate `__nv_expf`."""
    text = export_feature(feature, implementation, "cuda")
    assert text.count("custom_call @__gpu$xla.gpu.triton") == 3
    for kernel in ("forward_kernel", "dq_kernel", "dkv_kernel"):
        assert f'name = "{kernel}"' in text
    assert text.count("__nv_exp2f") == 3 and "__nv_expf" not in text


@pytest.mark.parametrize("feature", ["alibi", "documents", "bias", "table"])
def test_tpu_export_of_what_splash_cannot_take_is_the_library_kernel_or_a_named_refusal(feature):
    """On a TPU `"pallas_tpu"` runs splash for what it takes and the library's kernel
    (its Mosaic form) for the rest: the gradient exported for TPU holds its three
    Mosaic kernels, never the interpret-mode emulation; a table read at a computed index
    (a gather) is refused by name, and the export then holds the pure-JAX path."""
    from jax_mha import _dispatch

    q = jax.ShapeDtypeStruct((B, H, 96, 64), jnp.bfloat16)
    table = jnp.zeros((H, 32))
    score_mod = {"alibi": lambda s, b, h, i, j: s + table[h, 0] * (j - i),
                 "table": lambda s, b, h, i, j: s + table[h, jnp.clip(j - i, 0, 31)]}.get(feature)
    vis = _masking.Visibility(96, 96, score_mod=score_mod,
                              mask_mod=(lambda b, h, i, j: i >= j) if feature == "documents" else None,
                              bias=jnp.zeros((1, 1, 96, 96)) if feature == "bias" else None)
    why = _dispatch.refusal("pallas_tpu", vis, _masking.Call(q, q, q, platform="tpu"))
    text = export_feature(feature, "pallas_tpu", "tpu")
    if feature == "table":
        assert why is not None and "cannot take a table indexed by a computed index" in why, why
        assert "tpu_custom_call" not in text and "dot_general" in text
    else:
        assert why is None, why
        assert text.count("custom_call @tpu_custom_call") == 3


def test_packed_documents_at_32k_hold_no_n_by_s_tensor():
    """N = S = 32768, 8 packed documents by a mask_mod over traced ids, forward and
    backward exported for CUDA: the schedule is built a query block at a time and the
    kernel holds tiles, so no 32768 x 32768 array appears anywhere in the module."""
    from jax_mha import EXPORT_DISABLED_CHECKS, attention

    n = 32768
    q = jax.ShapeDtypeStruct((1, 2, n, 64), jnp.bfloat16)
    docs = jax.ShapeDtypeStruct((1, n), jnp.int32)

    def loss(q, k, v, docs):
        out = attention(q, k, v, implementation="pallas_gpu", is_causal=True,
                        mask_mod=lambda b, h, i, j: docs[b, i] == docs[b, j])
        return out.astype(jnp.float32).sum()

    text = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=["cuda"],
                             disabled_checks=EXPORT_DISABLED_CHECKS)(q, q, q, docs).mlir_module()
    assert "custom_call @__gpu$xla.gpu.triton" in text
    assert f"{n}x{n}" not in text and f"{n},{n}" not in text
