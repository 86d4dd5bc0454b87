"""The kernels compiled for real on their own accelerator (no interpret mode) against
the float64 reference: cudnn and pallas_gpu on a GPU, pallas_tpu on a TPU, and
`"auto"`, forward and gradients, for causal, windows, packed segment ids, GQA and
N != S; and the library's GPU kernel with every composed feature of tests/paths/test_flex.py
(mods over captured values, bias, soft cap, sinks, lengths, the log-sum-exp). Marked `device`: the default run deselects them
(pyproject.toml) and off their platform they skip; on a GPU or TPU run
`pytest -m device`.

Tolerance: the largest error relative to the largest reference magnitude, 2e-2 for
bfloat16 inputs (an 8-bit mantissa, probabilities rounded before the value product)
and 1e-2 for float32 (GPU matmuls at JAX's default precision, TF32 on recent NVIDIA
GPUs; 2e-2 on a TPU, whose default float32 matmul runs bfloat16 passes)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import jax_reference, np_allowed, x64

from jax_mha import _dispatch, attention
from jax_mha._validate import describe
from jax_mha.functional import resolve_implementation

pytestmark = pytest.mark.device
PLATFORM = _dispatch.platform()
B, H, K, D = 2, 4, 2, 64  # GQA throughout: two query heads per kv head
# float32 on a TPU: its default matmul precision is bfloat16 passes.
TOL = {"bfloat16": 2e-2, "float32": 2e-2 if PLATFORM == "tpu" else 1e-2}


def _documents(n):
    """Three packed documents of uneven lengths, the same in every batch row."""
    return np.repeat(np.arange(3), [n // 4, n // 2, n - n // 4 - n // 2])[None].repeat(B, 0)


# name: (N, S, attention's parts); lengths not multiples of any block: padding is exercised.
CASES = {
    "causal": (251, 251, dict(is_causal=True)),
    "segments": (251, 251, dict(is_causal=True, q_segment_ids=_documents(251))),
    "n_lt_s": (131, 251, dict(is_causal=True)),
    "n_gt_s": (251, 131, {}),
    "left_window": (251, 251, dict(is_causal=True, local_window_size=(40, None))),
    "both_window": (251, 251, dict(local_window_size=(40, 17))),
}
# (platform, path, dtypes, cases): each kernel for what it expresses on its device.
MATRIX = [
    ("gpu", "cudnn", ("bfloat16",), ("causal", "segments", "n_lt_s", "n_gt_s", "left_window", "both_window")),
    ("gpu", "pallas_gpu", ("bfloat16", "float32"), tuple(CASES)),
    ("tpu", "pallas_tpu", ("bfloat16", "float32"), tuple(CASES)),
]
CELLS = [(platform, path, dtype, case) for platform, path, dtypes, cases in MATRIX for dtype in dtypes for case in cases]
# "auto" per platform and dtype: the kernel it must pick for a causal call.
AUTO = [("gpu", "bfloat16", "cudnn"), ("gpu", "float32", "pallas_gpu"), ("tpu", "bfloat16", "pallas_tpu"),
        ("tpu", "float32", "pallas_tpu")]


def _inputs(n, s, dtype, seed=0):
    """q, k, v rounded to `dtype` (the reference reads the same values) and a float32
    output cotangent."""
    rng = np.random.default_rng(seed)
    shapes = ((B, H, n, D), (B, K, s, D), (B, K, s, D))
    q, k, v = (jnp.asarray(rng.standard_normal(shape), dtype) for shape in shapes)
    return q, k, v, jnp.asarray(rng.standard_normal((B, H, n, D)), jnp.float32)


def _reference(q, k, v, cot, n, s, parts):
    """Output and `(dq, dk, dv)` of `sum(out * cot)` in float64 on the host."""
    allowed = np_allowed((B, H, n, s), is_causal=parts.get("is_causal", False),
                         window=parts.get("local_window_size"), q_segment_ids=parts.get("q_segment_ids"))
    with x64(), jax.default_device(jax.devices("cpu")[0]):
        args = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)]
        loss = lambda q, k, v: (jnp.sum(jax_reference(q, k, v, allowed) * np.asarray(cot, np.float64)),
                                jax_reference(q, k, v, allowed))
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(*args)
        return np.asarray(out), [np.asarray(g) for g in grads]


def _check(implementation, dtype, case):
    """`attention(implementation=...)` jitted on the device, forward and gradients,
    against the float64 reference; returns the path the dispatcher chose."""
    n, s, parts = CASES[case]
    q, k, v, cot = _inputs(n, s, dtype)
    chosen = resolve_implementation(q, k, v, describe(q, k, v, **parts), implementation=implementation)

    def loss(q, k, v):
        out = attention(q, k, v, implementation=implementation, **parts)
        return jnp.sum(out.astype(jnp.float32) * cot), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    want, want_grads = _reference(q, k, v, cot, n, s, parts)
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), (want, *want_grads)):
        got = np.asarray(got, np.float64)
        assert np.all(np.isfinite(got)), f"{implementation} {case} {dtype}: non-finite {name}"
        err = np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30)
        assert err <= TOL[dtype.name], f"{chosen} {case} {dtype}: {name} relative error {err:.2e} > {TOL[dtype.name]}"
    return chosen


@pytest.mark.parametrize("platform, path, dtype, case", CELLS, ids=["-".join(c) for c in CELLS])
def test_kernel_on_its_device(platform, path, dtype, case):
    if PLATFORM != platform:
        pytest.skip(f"{path} compiles for a {platform.upper()}; this backend is {jax.default_backend()}")
    assert _check(path, jnp.dtype(dtype), case) == path


@pytest.mark.parametrize("platform, dtype, expected", AUTO, ids=["-".join(c) for c in AUTO])
def test_auto_picks_the_kernel_on_its_device(platform, dtype, expected):
    if PLATFORM != platform:
        pytest.skip(f"'auto' picks {expected} on a {platform.upper()}; this backend is {jax.default_backend()}")
    assert _check("auto", jnp.dtype(dtype), "causal") == expected


# The custom call each kernel lowers to (StableHLO text of the lowered program).
TARGETS = {"cudnn": "__cudnn$fmha", "pallas_gpu": "__gpu$xla.gpu.triton", "pallas_tpu": "tpu_custom_call"}


@pytest.mark.parametrize("platform, dtype, expected", AUTO, ids=["-".join(c) for c in AUTO])
def test_auto_lowers_to_the_kernel_it_picks(platform, dtype, expected):
    """The gradient of `"auto"`'s call, lowered for this device, holds the kernel that
    `resolve_implementation` names (not the pure-JAX fallback of another branch)."""
    if PLATFORM != platform:
        pytest.skip(f"'auto' picks {expected} on a {platform.upper()}; this backend is {jax.default_backend()}")
    n, s, parts = CASES["causal"]
    q, k, v, _ = _inputs(n, s, jnp.dtype(dtype))
    loss = lambda q, k, v: jnp.sum(attention(q, k, v, implementation="auto", **parts).astype(jnp.float32))
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).as_text()
    calls = sorted(set(re.findall(r"custom_call @([\w$.]+)", text)))
    assert any(c.startswith(TARGETS[expected]) for c in calls), f"'auto' lowered with custom calls {calls}"


FEATURES = ["alibi", "bias", "documents", "lengths_window", "prefix_lm", "segments", "sinks", "soft_cap", "table",
            "window"]
# A TPU kernel cannot gather: the relative-position table is refused there by name (test_flex_tpu).
COMPOSED = [("gpu", "pallas_gpu", f) for f in FEATURES] + [("tpu", "pallas_tpu", f) for f in FEATURES if f != "table"]


@pytest.mark.parametrize("platform, path, feature", COMPOSED, ids=["-".join(c) for c in COMPOSED])
def test_library_kernel_composes_on_its_device(platform, path, feature):
    """The library's kernel compiled for its device (Triton on a GPU, Mosaic on a TPU,
    splash where it takes the whole call), each composed feature of
    tests/paths/test_flex.py (values and gradients of q, k, v and the captured floating
    values, float32 inputs) against float64, relative to the largest reference value."""
    if PLATFORM != platform:
        pytest.skip(f"the {path} kernel compiles for a {platform.upper()}; this backend is {jax.default_backend()}")
    from test_flex import compare_feature

    got, want = compare_feature(path, feature, reference_device=jax.devices("cpu")[0])
    for got_x, ref_x in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        got_x, ref_x = np.asarray(got_x, np.float64), np.asarray(ref_x)
        finite = np.isfinite(ref_x)
        assert np.array_equal(np.isfinite(got_x), finite), feature
        err = np.max(np.abs(got_x[finite] - ref_x[finite])) / max(np.max(np.abs(ref_x[finite])), 1e-30)
        assert err <= TOL["float32"], f"{feature}: relative error {err:.2e} > {TOL['float32']}"
