"""`jax_mha.paths.cudnn` on a CPU: which parts of a call reach jax.nn's cuDNN call natively
and which as a dense mask (`plan`), what `refusal` names so that `"auto"` moves on, and
the translation itself run end to end against the float64 reference, with
`jax.nn.dot_product_attention` replaced by a stand-in that applies the checks jax's
cuDNN path makes (the window rule of `jax/_src/nn/functions.py`, the even-length rule
for a bias of `jax/_src/cudnn/fused_attention_stablehlo.py`) and then computes with
jax.nn's own "xla" implementation. The kernel itself runs only on a GPU
(tests/paths/test_device.py)."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import f32_tolerance, jax_reference, np_allowed, np_attention, x64

from jax_mha import _dispatch, _masking
from jax_mha._validate import describe
from jax_mha.paths import cudnn

BIG = (8, 16, 4096, 4096)  # (B, H, N, S): a training shape whose dense mask is far past 2**24 elements
SMALL = (2, 4, 64, 64)


def call_for(shape, dtype=jnp.bfloat16, d=64, kv_heads=None, s=None):
    b, h, n, s0 = shape
    s = s0 if s is None else s
    q = jax.ShapeDtypeStruct((b, h, n, d), dtype)
    k = jax.ShapeDtypeStruct((b, kv_heads or h, s, d), dtype)
    return _masking.Call(q, k, k, platform="gpu")


def vis_for(shape, s=None, **parts):
    b, h, n, s0 = shape
    s = s0 if s is None else s
    if parts.pop("segments", False):
        parts.update(q_segment_ids=jnp.zeros((1, 1, n, 1), jnp.int32), kv_segment_ids=jnp.zeros((1, 1, 1, s), jnp.int32))
    for name in ("q_lengths", "kv_lengths"):
        if parts.get(name) is not None:
            parts[name] = jnp.full((b, 1, 1, 1), parts[name], jnp.int32)
    return _masking.Visibility(n, s, batch_shape=(b,), num_heads=h, **parts)


# (the part the refusal must name, the description's parts, the key length S when != N)
DENSE_PARTS = [
    ("segment ids", dict(segments=True, is_causal=True), None),
    ("mask_mod", dict(mask_mod=lambda b, h, i, j: j <= i), None),
    ("a boolean mask", dict(mask=jnp.ones((1, 1, 1, 1), bool)), None),
    ("a bias", dict(bias=jnp.zeros((1, 1, 1, 1), jnp.bfloat16)), None),
    ("is_causal with N != S", dict(is_causal=True), 8192),
    ("local_window_size=(3, 2) (cuDNN's sliding window is left-only", dict(window=_masking.Window(3, 2)), None),
    ("local_window_size=(3, None) (cuDNN's sliding window is left-only", dict(window=_masking.Window(3, None)), None),
    ("is_causal and local_window_size=(128, None) with q_lengths/kv_lengths",
     dict(is_causal=True, window=_masking.Window(128, None), kv_lengths=100), None),
]


@pytest.mark.parametrize("part, parts, s", DENSE_PARTS, ids=[p[0].split(" (")[0] for p in DENSE_PARTS])
def test_dense_parts_are_refused_past_the_budget_by_name(part, parts, s):
    """What cuDNN takes only as a dense (B, H, N, S) mask: refused by name at a
    training shape (the mask, its bias and the bias' gradient would not fit), taken at
    a small one."""
    why = cudnn.refusal(vis_for(BIG, s, **parts), call_for(BIG, s=s))
    assert why is not None and part in why and "2**24" in why, why
    small_s = None if s is None else 2 * SMALL[3] + 1  # odd S: padded, not refused
    assert cudnn.refusal(vis_for(SMALL, small_s, **parts), call_for(SMALL, s=small_s)) is None


@pytest.mark.parametrize("parts, native", [
    (dict(is_causal=True), (True, None)),
    (dict(is_causal=True, window=_masking.Window(128, None)), (True, (128, 0))),
    (dict(is_causal=True, window=_masking.Window(128, 7)), (True, (128, 0))),  # the right side is behind the diagonal
    (dict(window=_masking.Window(128, 0)), (True, (128, 0))),  # a left window is the causal mask cut on the left
    (dict(window=_masking.Window(None, 0)), (True, None)),
    (dict(is_causal=True, q_lengths=100, kv_lengths=90), (True, None)),  # PADDING_CAUSAL
    (dict(kv_lengths=90), (False, None)),
    (dict(window=_masking.Window(None, None)), (False, None)),
])
def test_native_parts_are_taken_at_any_size(parts, native):
    vis = vis_for(BIG, **parts)
    assert cudnn.refusal(vis, call_for(BIG, kv_heads=4)) is None  # GQA too
    how = cudnn.plan(vis)
    assert (how.is_causal, how.local_window_size) == native and how.pattern_native and not how.dense


@pytest.mark.parametrize("gpu, d, part", [
    (("rocm", ()), 64, "this one is ROCm"),
    (("cuda", (7, 5)), 64, "compute capability >= 8.0"),
    (("cuda", (8, 0)), 256, "head_dim <= 128"),
    (("cuda", (9, 0)), 264, "head_dim <= 256"),
    (("cuda", (9, 0)), 100, "a multiple of 8"),
    (None, 136, "head_dim <= 128"),  # a GPU call described elsewhere: the limit every GPU has
])
def test_device_limits(monkeypatch, gpu, d, part):
    monkeypatch.setattr(cudnn, "this_gpu", lambda: gpu)
    why = cudnn.refusal(vis_for(SMALL), call_for(SMALL, d=d))
    assert why is not None and part in why, why
    if gpu is not None and gpu[0] == "cuda" and gpu[1] >= (9, 0):
        assert cudnn.refusal(vis_for(SMALL), call_for(SMALL, d=256)) is None  # Hopper: up to 256


def test_jax_nn_has_no_segment_offsets():
    """Why segment ids go through the dense mask: the public call takes no offsets.
    A jax that adds them makes this fail, and the path should then use them."""
    params = inspect.signature(jax.nn.dot_product_attention).parameters
    assert not {"q_offsets", "kv_offsets", "q_segment_ids", "segment_ids"} & set(params)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CUDA plugin is present: the kernel itself is tested")
def test_cuda_export_needs_the_gpu_plugin():
    """Why no lowering test exports the cuDNN path (as tests/paths/test_lowering.py does the
    Pallas kernels): jax's cuDNN call asks the CUDA plugin for cuDNN's version at trace
    time. A jax that exports it without the plugin makes this fail."""
    x = jax.ShapeDtypeStruct((2, 64, 4, 64), jnp.bfloat16)
    f = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
    with pytest.raises(RuntimeError, match="cuDNN is not detected"):
        jax.export.export(f, platforms=["cuda"])(x, x, x)


def fake_cudnn(real):
    """jax.nn.dot_product_attention as its cuDNN branch checks the arguments, then
    computed by its "xla" branch (top-left causal and window, as cuDNN's)."""
    seen = {}

    def attend(q, k, v, bias=None, mask=None, *, scale, is_causal, query_seq_lengths, key_value_seq_lengths,
               local_window_size, implementation):
        assert implementation == "cudnn"
        padding = query_seq_lengths is not None or key_value_seq_lengths is not None
        if local_window_size is not None and not (local_window_size[1] == 0 or (is_causal and not padding)):
            raise ValueError(f"cuDNN doesn't support right window: {local_window_size[1]}")
        # jax's training check reads its placeholder for a missing bias as a bias: odd
        # lengths raise with or without one (seen on an H200, jax 0.11.2).
        if q.shape[1] % 2 or k.shape[1] % 2:
            raise NotImplementedError(f"Unsupported sequence length Q {q.shape[1]}, KV {k.shape[1]}.")
        seen.update(causal=is_causal, window=local_window_size, shapes=(q.shape[1], k.shape[1]))
        return real(q, k, v, bias, mask, scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
                    key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
                    implementation="xla")

    return attend, seen


B, H, K, D = 2, 4, 2, 8


def _mod(b, h, i, j):
    return (j % 3 != 1) | (i == j)


# (N, S, attention's parts, what jax.nn gets: (is_causal, window, padded (N, S)))
TRANSLATIONS = [
    (7, 7, dict(is_causal=True), (True, None, (8, 8))),
    (8, 8, dict(is_causal=True), (True, None, (8, 8))),
    (7, 7, dict(is_causal=True, local_window_size=(3, None)), (True, (3, 0), (8, 8))),
    (7, 7, dict(local_window_size=(2, 0)), (True, (2, 0), (8, 8))),
    (7, 7, dict(local_window_size=(2, 0), q_lengths=np.array([7, 5])), (False, None, (8, 8))),
    (7, 7, dict(local_window_size=(2, 3)), (False, None, (8, 8))),
    (7, 7, dict(is_causal=True, local_window_size=(3, 1), kv_lengths=np.array([7, 4])), (False, None, (8, 8))),
    (7, 7, dict(is_causal=True, q_segment_ids=np.array([[0, 0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 1]]),
                q_lengths=np.array([6, 7])), (True, None, (8, 8))),
    (5, 11, dict(is_causal=True), (False, None, (6, 12))),
    (7, 5, {}, (False, None, (8, 6))),
    (6, 9, dict(q_lengths=np.array([6, 4])), (False, None, (6, 10))),
    (6, 9, dict(bias=True), (False, None, (6, 10))),
    (8, 8, dict(is_causal=True, mask_mod=_mod), (True, None, (8, 8))),
]


def _allowed(n, s, parts):
    kw = {name: parts[name] for name in ("q_lengths", "kv_lengths", "q_segment_ids") if name in parts}
    allowed = np_allowed((B, H, n, s), is_causal=parts.get("is_causal", False), window=parts.get("local_window_size"),
                         **kw)
    if "mask_mod" in parts:
        i, j = np.arange(n)[:, None], np.arange(s)[None, :]
        allowed = allowed & np.asarray(_mod(0, 0, i, j))
    return allowed


@pytest.mark.parametrize("n, s, parts, sent", TRANSLATIONS, ids=[f"{t[0]}x{t[1]}-{'+'.join(t[2])}" for t in TRANSLATIONS])
def test_translation_matches_the_reference(monkeypatch, rng, n, s, parts, sent):
    """Output and gradients of the cuDNN path (the stand-in computing) against the
    float64 reference: alignment, windows, lengths, segments, the dense mask and the
    padding to even lengths are the translation's, not jax's."""
    fake, seen = fake_cudnn(jax.nn.dot_product_attention)
    monkeypatch.setattr(jax.nn, "dot_product_attention", fake)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((B, H, n, D), (B, K, s, D), (B, K, s, D)))
    cot = rng.standard_normal((B, H, n, D))
    parts = dict(parts)
    bias = rng.standard_normal((1, H, n, s)).astype(np.float32) if parts.pop("bias", False) else None
    vis = describe(q, k, v, None, None if bias is None else jnp.asarray(bias), **parts)
    call = _masking.Call(*(jax.ShapeDtypeStruct(x.shape, jnp.bfloat16) for x in (q, k, v)), platform="gpu")
    assert cudnn.refusal(vis, call) is None
    def loss(q, k, v):
        out = _dispatch.run("cudnn", q, k, v, vis, call, scale=0.3)
        return jnp.sum(out * cot), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    assert (seen["causal"], seen["window"], seen["shapes"]) == sent
    allowed = _allowed(n, s, parts)
    want, _ = np_attention(q, k, v, mask=allowed, bias=bias, scale=0.3)
    # The float32 sums: the logits over D, the softmax sum and weights @ v over S; the
    # backward's over D, the keys, and the rows of the H/K heads sharing a key head.
    np.testing.assert_allclose(out, want, atol=f32_tolerance(terms=D + 2 * s, magnitude=want))
    with x64():
        ref = lambda q, k, v: jnp.sum(jax_reference(q, k, v, allowed, None if bias is None else jnp.asarray(bias, jnp.float64),
                                                    scale=0.3) * cot)
        want_grads = jax.jit(jax.grad(ref, argnums=(0, 1, 2)))(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)))
    for got, expected in zip(grads, want_grads):
        np.testing.assert_allclose(got, expected, atol=f32_tolerance(terms=2 * D + 3 * s + n * (H // K),
                                                                     magnitude=expected))
