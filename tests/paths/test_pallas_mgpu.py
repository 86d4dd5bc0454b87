"""The Hopper path (`implementation="pallas_mgpu"`, `jax_mha.paths.pallas_mgpu`) and the decode
kernel behind `"pallas_gpu"` (`jax_mha.paths.pallas_gpu_decode`).

Mosaic GPU cannot interpret the Hopper kernel, so on this CPU it is checked three ways:
its refusals by name; its forward and gradient lowered for CUDA with `jax.export`
(Mosaic GPU's lowering runs in Python; the kernel reads a CUDA runtime version while
tracing, faked here); and the translation around it (padding, the padding-key column,
offsets, GQA, the engine backward of causal calls) against the float64 reference, with
the kernel replaced by a plain-JAX stand-in of its math (`attention_mgpu.attention_reference`:
`(b, T, H, D)`, no scale, top-left causal). The decode kernel runs in Pallas interpret
mode against the reference and is lowered for CUDA. Tests marked `device` compile both
for a real GPU (Hopper for `pallas_mgpu`) and skip elsewhere.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import jax_reference, np_allowed, np_attention, x64
from jax.experimental.pallas.ops.gpu import attention_mgpu

from jax_mha import _attend, _dispatch, _masking, attention
from jax_mha._validate import describe
from jax_mha.functional import attention_from_description
from jax_mha.paths import pallas_gpu, pallas_gpu_decode, pallas_mgpu

MOSAIC, TRITON = "mosaic_gpu_v2", "__gpu$xla.gpu.triton"


def _cuda(version):
    return types.SimpleNamespace(cuda_runtime_get_version=lambda: version)


@pytest.fixture
def cuda_12_6(monkeypatch):
    """A CUDA runtime version for the kernel to read while tracing (none on this CPU)."""
    monkeypatch.setattr(attention_mgpu, "cuda_versions", _cuda(12060))


def _call(b, h, kh, n, s, d, dtype="float16", dv=None, platform="gpu", **call):
    q = jax.ShapeDtypeStruct((b, h, n, d), jnp.dtype(dtype))
    k = jax.ShapeDtypeStruct((b, kh, s, d), jnp.dtype(dtype))
    v = jax.ShapeDtypeStruct((b, kh, s, d if dv is None else dv), jnp.dtype(dtype))
    return _masking.Call(q, k, v, platform=platform, **call)


def _vis(b, h, n, s, **parts):
    return _masking.Visibility(n, s, batch_shape=(b,), num_heads=h, **parts)


ids = _masking.segments_at_rank(np.zeros((2, 11), np.int32), np.zeros((2, 11), np.int32), 1)
# (label, Visibility parts, Call shape/flags, the words the refusal must contain)
REFUSED = [
    ("cpu", {}, dict(platform="cpu"), "needs a GPU, this call runs on 'cpu'"),
    ("bfloat16", {}, dict(dtype="bfloat16"), "takes float16 only"),
    ("float32", {}, dict(dtype="float32"), "takes float16 only"),
    ("float64", {}, dict(dtype="float64"), "float64"),
    ("dv", {}, dict(dv=32), "equal q/k and v head dims"),
    ("d320", {}, dict(d=320), "head_dim up to 256"),
    ("d256-padded-keys", {}, dict(d=256, s=100), "plus the column that masks padding keys"),
    ("window", dict(window=_masking.Window(3, 0)), {}, "cannot express a local window"),
    ("kv_lengths", dict(kv_lengths=jnp.ones((2, 1, 1, 1), jnp.int32)), {}, "cannot express kv_lengths"),
    ("segments", dict(q_segment_ids=ids[0], kv_segment_ids=ids[1]), {}, "cannot express segment ids"),
    ("bias", dict(bias=jnp.zeros((1, 1, 1, 1))), {}, "an additive bias"),
    ("mask", dict(mask=jnp.ones((1, 1, 1, 1), bool)), {}, "a dense mask"),
    ("score_mod", dict(score_mod=lambda s, b, h, i, j: s), {}, "score_mod"),
    ("mask_mod", dict(mask_mod=lambda b, h, i, j: j <= i), {}, "mask_mod"),
    ("soft_cap", dict(logits_soft_cap=30.0), {}, "logits_soft_cap=30.0"),
    ("sinks", dict(sinks=jnp.zeros((4,))), {}, "sinks"),
    ("dropout", {}, dict(dropout=True), "dropout"),
    ("weights", {}, dict(return_weights=True), "return_weights=True"),
    ("residual", {}, dict(return_residual=True), "return_residual=True"),
    ("past-the-keys", dict(is_causal=True, q_offset=5), {}, "past the last key (N + offset = 16 > S = 11)"),
]


@pytest.mark.parametrize("label, parts, call, words", REFUSED, ids=[r[0] for r in REFUSED])
def test_mgpu_refuses_by_name(cuda_12_6, label, parts, call, words):
    shape = dict(b=2, h=4, kh=2, n=11, s=11, d=64) | {x: call.pop(x) for x in ("d", "s") if x in call}
    why = pallas_mgpu.refusal(_vis(2, 4, shape["n"], shape["s"], **parts), _call(**shape, **call))
    assert why is not None and why.startswith("implementation='pallas_mgpu'") and words in why, why


def test_mgpu_refuses_the_machine(monkeypatch):
    vis, call = _vis(2, 4, 11, 11, is_causal=True), _call(2, 4, 2, 11, 11, 64)
    monkeypatch.setattr(attention_mgpu, "cuda_versions", None)
    assert "needs jax's CUDA plugin" in pallas_mgpu.refusal(vis, call)
    monkeypatch.setattr(attention_mgpu, "cuda_versions", _cuda(12080))
    assert "ptxas miscompilation" in pallas_mgpu.refusal(vis, call)  # the kernel's own causal refusal
    assert pallas_mgpu.refusal(_vis(2, 4, 11, 11), call) is None
    monkeypatch.setattr(attention_mgpu, "cuda_versions", _cuda(12091))
    assert pallas_mgpu.refusal(vis, call) is None
    for gpu, words in ((("cuda", (8, 0)), "compute capability 9.0 (Hopper's wgmma), got 8.0"),
                       (("cuda", (10, 0)), "got 10.0"), (("cuda", ()), "got unreadable"), (("rocm", (9, 0)), "ROCm")):
        monkeypatch.setattr(pallas_mgpu, "this_gpu", lambda gpu=gpu: gpu)
        assert words in pallas_mgpu.refusal(vis, call)
    monkeypatch.setattr(pallas_mgpu, "this_gpu", lambda: ("cuda", (9, 0)))
    assert pallas_mgpu.refusal(vis, call) is None


def test_mgpu_is_named_only():
    assert "pallas_mgpu" in _dispatch.PATHS and all("pallas_mgpu" not in _dispatch.auto_chain(p) for p in ("gpu", "tpu"))
    q = jnp.zeros((1, 2, 5, 64), jnp.float16)
    with pytest.raises(ValueError, match="pallas_mgpu' needs a GPU, this call runs on 'cpu'"):
        attention(q, q, q, implementation="pallas_mgpu")


def _export(f, *args, target):
    return jax.export.export(jax.jit(f), platforms=["cuda"],
                             disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(target)])(*args).mlir_module()


def _loss(run):
    return jax.value_and_grad(lambda q, k, v: run(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))


# (B, H, K, N, S, D, causal): GQA; padded queries, padded keys (the extra column), D padding.
LOWERED = [(2, 4, 2, 100, 37, 96, False), (1, 4, 1, 37, 251, 128, True)]


@pytest.mark.parametrize("b, h, kh, n, s, d, causal", LOWERED)
def test_mgpu_lowers_for_cuda(cuda_12_6, b, h, kh, n, s, d, causal):
    """Forward and gradient lowered on this CPU: the kernel's custom call once forward,
    plus its dq and dk/dv kernels without causality; causal gradients come from the
    blockwise engine (no second kernel)."""
    vis, call = _vis(b, h, n, s, is_causal=causal), _call(b, h, kh, n, s, d)
    assert pallas_mgpu.refusal(vis, call) is None
    run = lambda q, k, v: pallas_mgpu.run(q, k, v, vis, scale=d ** -0.5, interpret=False)
    forward = _export(run, call.q, call.k, call.v, target=MOSAIC)
    both = _export(_loss(run), call.q, call.k, call.v, target=MOSAIC)
    assert forward.count(f"custom_call @{MOSAIC}") == 1
    assert both.count(f"custom_call @{MOSAIC}") == (1 if causal else 3)


def test_bfloat16_fails_mosaic_lowering(cuda_12_6):
    """Why bfloat16 is refused: the kernel's float16 tiles meet bfloat16 operands."""
    x = jax.ShapeDtypeStruct((1, 128, 1, 64), jnp.bfloat16)
    config = attention_mgpu.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2)
    with pytest.raises(ValueError, match="Mixed input dtypes"):
        _export(lambda q, k, v: attention_mgpu.attention(q, k, v, config), x, x, x, target=MOSAIC)


def _stand_in(q, k, v, *, config):
    """The kernel's math in plain JAX: `(b, T, H, D)`, no scale, top-left causal."""
    return attention_mgpu.attention_reference(q, k, v, causal=config.causal).astype(q.dtype)


def _inputs(batch, h, kh, n, s, d, dtype, dv=None, seed=0):
    rng = np.random.default_rng(seed)
    shapes = (batch + (h, n, d), batch + (kh, s, d), batch + (kh, s, d if dv is None else dv))
    return [jnp.asarray(rng.standard_normal(shape), dtype) for shape in shapes]


def _reference(q, k, v, allowed, cot):
    """Float64 output and `(dq, dk, dv)` of `sum(out * cot)`."""
    with x64():
        args = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)]
        loss = lambda q, k, v: jnp.sum(jax_reference(q, k, v, allowed) * cot)
        both = lambda *a: (jax_reference(*a, allowed), jax.grad(loss, argnums=(0, 1, 2))(*a))
        return jax.jit(both)(*args)  # one compile: op-by-op float64 dispatch is slower here


def _close(got, want, tol):
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float64), np.asarray(w)
        assert np.max(np.abs(g - w)) <= tol * max(np.max(np.abs(w)), 1e-30), np.max(np.abs(g - w))


# (B…, H, K, N, S, D, causal, q_offset)
TRANSLATED = [
    ((2, 3), 4, 2, 37, 23, 40, False, None),  # padded keys masked by a spare column of the D padding
    ((1,), 2, 1, 7, 70, 64, False, None),  # padded keys: the masking column widens D to 128
    ((1,), 2, 2, 29, 11, 64, True, None),  # causal N > S: 18 rows see no key
    ((1,), 4, 2, 13, 37, 64, True, 10),  # causal, a static offset inside the keys: 10 dummy queries in front
]


@pytest.mark.parametrize("batch, h, kh, n, s, d, causal, offset", TRANSLATED)
def test_mgpu_translation_against_the_reference(monkeypatch, batch, h, kh, n, s, d, causal, offset):
    """`run` with the kernel replaced by its stand-in: output and gradients (the
    stand-in's autodiff without causality, the engine's with it) against float64."""
    monkeypatch.setattr(pallas_mgpu, "_attention", _stand_in)
    q, k, v = _inputs(batch, h, kh, n, s, d, jnp.float16)
    cot = np.random.default_rng(1).standard_normal(batch + (h, n, d))
    vis = _masking.Visibility(n, s, causal, q_offset=offset, batch_shape=batch, num_heads=h)
    allowed = np_allowed(batch + (h, n, s), is_causal=causal)
    if offset is not None:  # np_allowed places queries at S - N
        allowed = np.arange(s)[None, :] <= np.arange(n)[:, None] + offset
    run = lambda q, k, v: pallas_mgpu.run(q, k, v, vis, scale=d ** -0.5, interpret=False)
    out, pull = jax.vjp(jax.jit(run), q, k, v)
    want, want_grads = _reference(q, k, v, allowed, cot)
    _close([out], [want], 4e-3)
    _close(pull(jnp.asarray(cot, out.dtype)), want_grads, 1e-2)


def _decode_case(dtype, causal=True, window=(9, None), kv_lengths=(37, 15), dv=40):
    """A decoding step at traced cache index 20 of a cache of 37 (GQA 6/3, D=24):
    `(f(q, k, v, index), q, k, v, allowed at index 20)`."""
    b, h, kh, s, d = 2, 6, 3, 37, 24
    q, k, v = _inputs((b,), h, kh, 1, s, d, dtype, dv=dv)
    lengths = None if kv_lengths is None else jnp.asarray(kv_lengths, jnp.int32)

    def f(q, k, v, index):
        vis = describe(q, k, v, is_causal=causal, local_window_size=window, kv_lengths=lengths, q_offset=index,
                       q_start=index)
        return attention_from_description(q, k, v, vis, implementation="pallas_gpu")

    key = np.arange(s)
    ok = np.ones(s, bool) if not causal else key <= 20
    if window is not None:
        ok &= key >= 20 - window[0]
    allowed = np.broadcast_to(ok, (b, h, 1, s)).copy()
    if kv_lengths is not None:
        allowed &= key < np.asarray(kv_lengths)[:, None, None, None]
    return f, q, k, v, allowed


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_decode_kernel_interpreted(monkeypatch, dtype, tol):
    """`"pallas_gpu"` on a decoding step runs the decode kernel (the FlashAttention
    path is never called), with a traced cache index, a window, kv_lengths, GQA and
    Dv != D: output (and, float32, gradients: the engine's) against float64."""
    monkeypatch.setattr(pallas_gpu, "run", lambda *a, **kw: pytest.fail("the FlashAttention kernel ran"))
    f, q, k, v, allowed = _decode_case(jnp.dtype(dtype))
    cot = np.random.default_rng(2).standard_normal((2, 6, 1, 40))
    step = jax.jit(lambda q, k, v: f(q, k, v, jnp.int32(20)))
    want, want_grads = _reference(q, k, v, allowed, cot)
    if dtype == "bfloat16":
        _close([step(q, k, v)], [want], tol)
        return
    out, pull = jax.vjp(step, q, k, v)
    _close([out], [want], tol)
    _close(pull(jnp.asarray(cot, out.dtype)), want_grads, 4 * tol)


def test_decode_through_the_cache():
    """Three steps of `_attend.attend` with a cache on `"pallas_gpu"`, one jitted step
    (the index traced), each row against the causal reference over the prefix."""
    rng = np.random.default_rng(3)
    b, h, kh, length, d = 1, 4, 2, 17, 16
    cache = _attend.Cache(jnp.zeros((b, kh, length, d)), jnp.zeros((b, kh, length, d)), jnp.int32(0))
    qs, ks, vs = (jnp.asarray(rng.standard_normal((3, b, x, 1, d)), jnp.float32) for x in (h, kh, kh))
    step = jax.jit(lambda q, k, v, cache: _attend.attend(q, k, v, cache=cache, implementation="pallas_gpu")[::2])
    for t in range(3):
        out, cache = step(qs[t], ks[t], vs[t], cache)
        want, _ = np_attention(qs[t], np.concatenate(ks[:t + 1], -2), np.concatenate(vs[:t + 1], -2))
        _close([out], [want], 1e-5)


def test_pallas_gpu_routes_decoding_steps():
    """The decode kernel takes N == 1 (a traced offset too); everything else, and its
    refusals, are the library kernel's, which takes a traced offset at any N."""
    call1, call2 = _call(2, 4, 2, 1, 37, 64, "float32"), _call(2, 4, 2, 2, 37, 64, "float32")
    traced = lambda n, call: jax.jit(lambda o: jnp.int32(
        _dispatch.refusal("pallas_gpu", _vis(2, 4, n, 37, is_causal=True, q_offset=o), call) is None))(jnp.int32(3))
    assert traced(1, call1) == 1 and traced(2, call2) == 1
    picked = []
    jax.jit(lambda o: picked.append(_dispatch.REGISTRY["pallas_gpu"].pick(
        _vis(2, 4, 1, 37, is_causal=True, q_offset=o), call1)) or o)(jnp.int32(3))
    assert picked[0] is _dispatch.REGISTRY["pallas_gpu"].decode  # a one-row step: the decode kernel
    seg = _masking.segments_at_rank(np.zeros((2, 1), np.int32), np.zeros((2, 37), np.int32), 1)
    vis = _vis(2, 4, 1, 37, q_segment_ids=seg[0], kv_segment_ids=seg[1])
    assert "segment ids" in pallas_gpu_decode.decode_refusal(vis, call1)
    assert _dispatch.refusal("pallas_gpu", vis, call1) == pallas_gpu.refusal(vis, call1)
    assert "N=2" in pallas_gpu_decode.decode_refusal(_vis(2, 4, 2, 37), call2)
    assert "up to 256" in pallas_gpu_decode.decode_refusal(_vis(2, 4, 1, 37), _call(2, 4, 2, 1, 37, 320, "float32"))
    assert pallas_gpu_decode.key_splits(37) == (16, 3) and pallas_gpu_decode.key_splits(4096) == (256, 16)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_kernel_lowers_for_cuda(dtype):
    """The decode step's forward and gradient lowered for CUDA with a traced offset:
    one Triton call (the gradient is the engine's)."""
    b, h, kh, s, d = 2, 8, 2, 100, 64
    call = _call(b, h, kh, 1, s, d, dtype)
    index = jax.ShapeDtypeStruct((), jnp.int32)

    def loss(q, k, v, index):
        vis = _vis(b, h, 1, s, is_causal=True, window=_masking.Window(40, None), q_offset=index,
                   kv_lengths=jnp.full((b, 1, 1, 1), 90, jnp.int32))
        assert pallas_gpu_decode.decode_refusal(vis, call) is None
        out = pallas_gpu_decode.run(q, k, v, vis, scale=0.125, interpret=False)
        return out.astype(jnp.float32).sum()

    text = _export(jax.value_and_grad(loss, argnums=(0, 1, 2)), call.q, call.k, call.v, index, target=TRITON)
    assert text.count(f"custom_call @{TRITON}") == 1 and 'name = "mha_forward"' in text


ON_HOPPER = jax.default_backend() == "gpu" and pallas_mgpu.this_gpu() == ("cuda", (9, 0))


@pytest.mark.device
@pytest.mark.parametrize("n, s, causal", [(251, 251, True), (131, 251, True), (251, 131, False), (256, 256, False)])
def test_mgpu_on_hopper(n, s, causal):
    """Compiled on a Hopper GPU: output and gradients of `attention(implementation=
    "pallas_mgpu")` against float64 (GQA, padding, N != S)."""
    if not ON_HOPPER:
        pytest.skip("pallas_mgpu compiles for a GPU of compute capability 9.0")
    q, k, v = _inputs((2,), 4, 2, n, s, 64, jnp.float16)
    cot = np.random.default_rng(1).standard_normal((2, 4, n, 64))
    run = lambda q, k, v: attention(q, k, v, is_causal=causal, implementation="pallas_mgpu")
    out, pull = jax.vjp(jax.jit(run), q, k, v)
    want, want_grads = _reference(q, k, v, np_allowed((2, 4, n, s), is_causal=causal), cot)
    _close([out], [want], 2e-2)
    _close(pull(jnp.asarray(cot, out.dtype)), want_grads, 2e-2)


@pytest.mark.device
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_kernel_on_gpu(dtype):
    if jax.default_backend() != "gpu":
        pytest.skip("the decode kernel compiles for a GPU")
    f, q, k, v, allowed = _decode_case(jnp.dtype(dtype))
    want, _ = _reference(q, k, v, allowed, np.zeros((2, 6, 1, 40)))
    _close([jax.jit(f)(q, k, v, jnp.int32(20))], [want], 2e-2)
