"""Both Pallas kernels lowered for their real devices on this CPU: `jax.export` with
`platforms=["cuda"]` runs Pallas' Triton lowering and `platforms=["tpu"]` its Mosaic
lowering, with the kernel compiled (interpret=False), no device needed. Each cell
exports the forward and the gradient of `run` and finds the kernel's custom call in
the module text, or `refusal` returned a message for that cell.

Triton's lowering takes only power-of-two tiles (N = S in 33..48 or 65..112 used to
fail); Mosaic's takes only tiles its layouts allow. A representative set of cells runs
by default; `--full-matrix` runs the whole grid (N = S in {1, 34, 100, 128}, D in {64,
128}, bfloat16 and float32, causal / segments / window, GQA, and N != S)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_mha import _masking, _pallas_gpu, _pallas_tpu

KERNELS = {"pallas_tpu": _pallas_tpu, "pallas_gpu": _pallas_gpu}
# (export platform, call platform, custom-call target, forward / backward kernel names)
TARGETS = {
    "pallas_gpu": ("cuda", "gpu", "__gpu$xla.gpu.triton", 'name = "mha_forward"', 'name = "mha_backward"'),
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
    why = mod.refusal(vis, _masking.Call(q, k, k, platform=call_platform))
    if why is not None:
        return ("refused", why)
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
    ("pallas_gpu", 128, 128, 64, "float32", ("window",)),  # refused: no window in the Triton kernel
    ("pallas_gpu", 100, 37, 64, "bfloat16", ()),  # N > S: query chunks
    ("pallas_gpu", 37, 100, 128, "float32", ("causal",)),  # S > N: dummy queries in front
    ("pallas_tpu", 34, 34, 64, "bfloat16", ("window",)),
    ("pallas_tpu", 100, 100, 128, "float32", ("causal", "segments")),
    ("pallas_tpu", 1, 1, 64, "float32", ("causal",)),
    ("pallas_tpu", 128, 128, 128, "bfloat16", ()),
    ("pallas_tpu", 37, 100, 64, "bfloat16", ("causal", "window")),
    ("pallas_tpu", 100, 37, 128, "float32", ("segments",)),
    ("pallas_tpu", 100, 100, 128, "bfloat16", ("causal", "segments", "sinks")),  # splash's sinks argument
]
PATTERNS = [("causal",), ("causal", "segments"), ("window",), ()]
FULL_CELLS = [(name, n, n, d, dt, parts) for name, n, d, dt, parts in itertools.product(
    sorted(KERNELS), (1, 34, 100, 128), (64, 128), ("bfloat16", "float32"), PATTERNS)] + [
    (name, n, s, d, dt, parts) for name, (n, s), d, dt, parts in itertools.product(
        sorted(KERNELS), ((100, 37), (37, 100)), (64, 128), ("bfloat16", "float32"), PATTERNS)]


def pytest_generate_tests(metafunc):
    if "cell" in metafunc.fixturenames:
        cells = FULL_CELLS if metafunc.config.getoption("--full-matrix") else DEFAULT_CELLS
        metafunc.parametrize("cell", cells, ids=[f"{c[0]}-{c[1]}x{c[2]}-d{c[3]}-{c[4]}-{'+'.join(c[5]) or 'full'}"
                                                 for c in cells])


def expected_refusal(name, n, s, parts) -> str | None:
    """What `refusal` must say for a cell of this grid, or None (it must lower)."""
    if name == "pallas_gpu" and "window" in parts:
        return "cannot express a local window"
    if name == "pallas_gpu" and "sinks" in parts:
        return "cannot express sinks"
    if name == "pallas_gpu" and "segments" in parts and n != s:
        return "reads one segment-id array for queries and keys"
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
        assert text.count(f"custom_call @{target}") == (3 if grad else 1)  # backward: delta/dq, dkv


def test_old_block_rule_fails_triton_lowering():
    """The rule the tests above guard: a 48-row tile (round_up(34, 16)) is refused by
    Pallas' Triton lowering, so the tests do reach that check."""
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention

    x = jax.ShapeDtypeStruct((1, 48, 2, 64), jnp.bfloat16)
    sizes = gpu_attention.BlockSizes(48, 48, 48, 48, 48, 48)
    f = lambda q, k, v: gpu_attention.mha(q, k, v, None, causal=True, block_sizes=sizes)
    checks = [jax.export.DisabledSafetyCheck.custom_call(TARGETS["pallas_gpu"][2])]
    with pytest.raises(ValueError, match="power of 2"):
        jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=checks)(x, x, x)
