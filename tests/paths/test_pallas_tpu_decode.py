"""The paged-attention decode kernel behind `"pallas_tpu"` (`jax_mha.paths.pallas_tpu_decode`).

On this CPU the kernel runs in TPU interpret mode (`pltpu.force_tpu_interpret_mode`,
which simulates its DMAs and semaphores) against the float64 reference, with a traced
cache index, GQA and kv_lengths; its forward and gradient are lowered for TPU with
`jax.export`; its refusals are checked by name and its routing (N == 2, segment ids:
splash) by which kernel runs. The kernel rounds k and v to bfloat16 whatever their
dtype, so float32 outputs are compared tightly with a reference fed bfloat16-rounded
keys and values, and loosely with the exact one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import jax_reference, x64

from jax_mha import _attend, _dispatch, _masking
from jax_mha._validate import describe
from jax_mha.functional import attention_from_description
from jax_mha.paths import pallas_tpu, pallas_tpu_decode


def _inputs(batch, h, kh, s, d, dtype, dv=None, seed=0):
    rng = np.random.default_rng(seed)
    shapes = (batch + (h, 1, d), batch + (kh, s, d), batch + (kh, s, d if dv is None else dv))
    return [jnp.asarray(rng.standard_normal(shape), dtype) for shape in shapes]


def _reference(q, k, v, allowed, cot=None, cap=None):
    """Float64 output and, with `cot`, `(dq, dk, dv)` of `sum(out * cot)`."""
    with x64():
        args = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)]
        out = lambda *a: jax_reference(*a, allowed, cap=cap)
        if cot is None:
            return jax.jit(out)(*args), None
        return jax.jit(lambda *a: (out(*a), jax.grad(lambda *b: jnp.sum(out(*b) * cot), argnums=(0, 1, 2))(*a)))(*args)


def _bf16(x):
    return np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)


def _close(got, want, tol):
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float64), np.asarray(w)
        assert np.max(np.abs(g - w)) <= tol * max(np.max(np.abs(w)), 1e-30), np.max(np.abs(g - w))


def _no_splash(monkeypatch):
    monkeypatch.setattr(pallas_tpu, "run", lambda *a, **kw: pytest.fail("splash attention ran"))


def test_decode_kernel_interpreted_float32(monkeypatch):
    """A jitted decoding step at traced cache index 20 of a cache of 37 (padded to 3
    pages of 16), GQA 6/3, kv_lengths (37, 15) (the second sequence's cut lies below
    the index): output tight against float64 on bfloat16-rounded k/v, loose against
    exact float64, and the engine's gradients against float64."""
    _no_splash(monkeypatch)
    b, h, kh, s, d = 2, 6, 3, 37, 24
    q, k, v = _inputs((b,), h, kh, s, d, jnp.float32)
    lengths = jnp.asarray([37, 15], jnp.int32)

    def step(q, k, v, index):
        vis = describe(q, k, v, is_causal=True, kv_lengths=lengths, q_offset=index, q_start=index)
        return attention_from_description(q, k, v, vis, implementation="pallas_tpu")

    key = np.arange(s)
    allowed = np.broadcast_to((key <= 20) & (key < np.asarray([37, 15])[:, None]), (h, 1, b, s)).transpose(2, 0, 1, 3)
    cot = np.random.default_rng(2).standard_normal((b, h, 1, d))
    out, pull = jax.vjp(jax.jit(lambda q, k, v: step(q, k, v, jnp.int32(20))), q, k, v)
    rounded, _ = _reference(q, _bf16(k), _bf16(v), allowed)
    want, want_grads = _reference(q, k, v, allowed, cot)
    _close([out], [rounded], 1e-5)
    _close([out], [want], 2e-2)
    _close(pull(jnp.asarray(cot, out.dtype)), want_grads, 1e-4)


def test_decode_kernel_interpreted_bfloat16_soft_cap(monkeypatch):
    """bfloat16, MQA (4/1), no causality, a window's right side only (the step at
    traced index 9 sees keys 0 … 11) and the kernel's soft-cap: against float64."""
    _no_splash(monkeypatch)
    b, h, kh, s, d = 1, 4, 1, 32, 16
    q, k, v = _inputs((b,), h, kh, s, d, jnp.bfloat16, seed=4)

    def step(q, k, v, index):
        vis = describe(q, k, v, local_window_size=(None, 2), logits_soft_cap=0.5, q_offset=index, q_start=index)
        return attention_from_description(q, k, v, vis, implementation="pallas_tpu")

    allowed = np.broadcast_to(np.arange(s) <= 11, (b, h, 1, s))
    want, _ = _reference(q, k, v, allowed, cap=0.5)
    _close([jax.jit(step)(q, k, v, jnp.int32(9))], [want], 2e-2)


def test_decode_through_the_cache(monkeypatch):
    """Three steps of `_attend.attend` with a cache of 17 on `"pallas_tpu"`, one jitted
    step (the index traced), each row against the reference over the prefix."""
    _no_splash(monkeypatch)
    rng = np.random.default_rng(3)
    b, h, kh, length, d = 1, 4, 2, 17, 16
    cache = _attend.Cache(jnp.zeros((b, kh, length, d)), jnp.zeros((b, kh, length, d)), jnp.int32(0))
    qs, ks, vs = (jnp.asarray(rng.standard_normal((3, b, x, 1, d)), jnp.float32) for x in (h, kh, kh))
    step = jax.jit(lambda q, k, v, cache: _attend.attend(q, k, v, cache=cache, implementation="pallas_tpu")[::2])
    for t in range(3):
        out, cache = step(qs[t], ks[t], vs[t], cache)
        prefix = [np.concatenate(x[:t + 1], -2) for x in (ks, vs)]
        want, _ = _reference(qs[t], *(_bf16(x) for x in prefix), None)
        _close([out], [want], 1e-5)


def _lowered(f, *args):
    return jax.export.export(jax.jit(f), platforms=["tpu"])(*args).mlir_module()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_kernel_lowers_for_tpu(dtype):
    """Forward and gradient of a decoding step lowered for TPU with a traced offset and
    kv_lengths: one Mosaic call, the paged kernel (the gradient is the engine's)."""
    b, h, kh, s, d = 2, 8, 2, 100, 128
    q, k, v = (jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)) for shape in ((b, h, 1, d), (b, kh, s, d), (b, kh, s, d)))
    index = jax.ShapeDtypeStruct((), jnp.int32)

    def loss(q, k, v, index):
        vis = _masking.Visibility(1, s, True, q_offset=index, batch_shape=(b,), num_heads=h,
                                  kv_lengths=jnp.full((b, 1, 1, 1), 90, jnp.int32))
        assert pallas_tpu_decode.decode_refusal(vis, _masking.Call(q, k, v, platform="tpu")) is None
        return pallas_tpu_decode.run(q, k, v, vis, scale=d ** -0.5, interpret=False).astype(jnp.float32).sum()

    for f in (loss, jax.value_and_grad(loss, argnums=(0, 1, 2))):
        text = _lowered(f, q, k, v, index)
        assert text.count("tpu_custom_call") == 1 and "paged_flash_attention_kernel" in text


def test_auto_lowers_decoding_to_the_paged_kernel():
    """`"auto"` lowered for TPU takes the paged kernel for a decoding step (splash
    refuses its traced offset), and no kernel for the same step on a CPU."""
    q, k = jnp.zeros((1, 4, 1, 128), jnp.bfloat16), jnp.zeros((1, 2, 64, 128), jnp.bfloat16)

    def step(q, k, v, index):
        vis = describe(q, k, v, is_causal=True, q_offset=index, q_start=index)
        return attention_from_description(q, k, v, vis, implementation="auto")

    index = jax.ShapeDtypeStruct((), jnp.int32)
    assert "paged_flash_attention_kernel" in _lowered(step, q, k, k, index)
    assert "tpu_custom_call" not in jax.jit(step).lower(q, k, k, jnp.int32(3)).as_text()


def _call(h=4, kh=2, n=1, s=37, d=64, dtype="float32", dv=None, platform="tpu", **flags):
    q = jax.ShapeDtypeStruct((2, h, n, d), jnp.dtype(dtype))
    k = jax.ShapeDtypeStruct((2, kh, s, d), jnp.dtype(dtype))
    v = jax.ShapeDtypeStruct((2, kh, s, d if dv is None else dv), jnp.dtype(dtype))
    return _masking.Call(q, k, v, platform=platform, **flags)


def _vis(n=1, s=37, **parts):
    return _masking.Visibility(n, s, batch_shape=(2,), num_heads=4, **parts)


ids = _masking.segments_at_rank(np.zeros((2, 1), np.int32), np.zeros((2, 37), np.int32), 1)
# (label, Visibility parts, Call parts, the words the refusal must contain)
REFUSED = [
    ("n2", dict(n=2), {}, "takes one query row, got N=2"),
    ("gpu", {}, dict(platform="gpu"), "runs on a TPU"),
    ("float16", {}, dict(dtype="float16"), "got float16"),
    ("float64", {}, dict(dtype="float64"), "float64"),
    ("gqa", {}, dict(kh=3), "K dividing query heads H, got H=4, K=3"),
    ("dv", {}, dict(dv=32), "one head dim for q, k and v, got D=64, Dv=32"),
    ("segments", dict(q_segment_ids=ids[0], kv_segment_ids=ids[1]), {}, "segment ids"),
    ("window-left", dict(is_causal=True, window=_masking.Window(8, None)), {}, "left edge cuts keys"),
    ("bias", dict(bias=jnp.zeros((1, 1, 1, 1))), {}, "an additive bias"),
    ("mask", dict(mask=jnp.ones((1, 1, 1, 1), bool)), {}, "a dense mask"),
    ("score_mod", dict(score_mod=lambda s, b, h, i, j: s), {}, "score_mod"),
    ("mask_mod", dict(mask_mod=lambda b, h, i, j: j <= i), {}, "mask_mod"),
    ("sinks", dict(sinks=jnp.zeros((4,))), {}, "sinks"),
    ("dropout", {}, dict(dropout=True), "dropout"),
    ("weights", {}, dict(return_weights=True), "return_weights=True"),
    ("residual", {}, dict(return_residual=True), "return_residual=True"),
]


@pytest.mark.parametrize("label, parts, flags, words", REFUSED, ids=[r[0] for r in REFUSED])
def test_decode_refuses_by_name(label, parts, flags, words):
    call = _call(n=parts.get("n", 1), **flags)
    why = pallas_tpu_decode.decode_refusal(_vis(**parts), call)
    assert why is not None and why.startswith("implementation='pallas_tpu'") and words in why, why
    assert _dispatch.refusal("pallas_tpu", _vis(**parts), call) == pallas_tpu.refusal(_vis(**parts), call)


def test_decode_takes_what_it_can():
    """A window whose left edge cuts nothing, the soft-cap, kv_lengths, a traced offset
    and MQA are the kernel's; a static offset too (any N == 1 call)."""
    call = _call(kh=1)
    lengths = jnp.ones((2, 1, 1, 1), jnp.int32)
    for parts in (dict(is_causal=True, window=_masking.Window(40, None)), dict(logits_soft_cap=5.0),
                  dict(kv_lengths=lengths, window=_masking.Window(None, 3)), dict(is_causal=True, q_offset=7)):
        assert pallas_tpu_decode.decode_refusal(_vis(**parts), call) is None, parts
    traced = jax.jit(lambda o: jnp.int32(_dispatch.refusal("pallas_tpu", _vis(is_causal=True, q_offset=o), call)
                                         is None))(jnp.int32(3))
    assert traced == 1  # splash refuses a traced offset; the paged kernel takes it


@pytest.mark.parametrize("parts", [dict(n=2), dict(q_segment_ids=ids[0], kv_segment_ids=ids[1])], ids=["n2", "seg"])
def test_refused_steps_go_to_splash(parts):
    """A call the paged kernel refuses runs on splash (the registered path's `pick`);
    a step it takes on the paged kernel."""
    n = parts.get("n", 1)
    call = _call(n=n)
    path = _dispatch.REGISTRY["pallas_tpu"]
    assert path.pick(_vis(**parts), call) is path and path.run is pallas_tpu.PATH.run
    assert path.pick(_vis(), _call()) is path.decode is pallas_tpu_decode.DECODE


def test_pages_are_a_reshape():
    """The page layout: sizes, and no copy of a cache whose length is a multiple of 16."""
    assert pallas_tpu_decode.pages(37) == (16, 3, 3)
    assert pallas_tpu_decode.pages(192) == (64, 3, 3)
    assert pallas_tpu_decode.pages(4096) == (128, 32, 4)
    x = jnp.arange(2 * 3 * 48 * 5.0).reshape(2, 3, 48, 5)
    jaxpr = jax.make_jaxpr(lambda x: pallas_tpu_decode.paged(x, 16, 3))(x)
    assert [e.primitive.name for e in jaxpr.eqns] == ["reshape"]
    pages = pallas_tpu_decode.paged(x, 16, 3)  # page p of sequence (b, kv head) holds its keys 16p … 16p + 15
    assert pages.shape == (1, 18, 16, 5) and np.array_equal(pages[0, 1 * 3 + 2], x[0, 1, 32:48])
