"""The Pallas kernel paths (`pallas_tpu` = splash, `pallas_gpu` = Triton mha) in Pallas
interpret mode against the float64 reference, on the smallest shapes that still tile
(at least 2x2 blocks of 128, or a non-multiple of the block to exercise padding)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_mha import attention
from jax_mha._pallas_gpu import pallas_gpu_attention
from jax_mha._pallas_tpu import pallas_tpu_attention
from tests.conftest import jax_reference, np_allowed, np_attention, x64

KERNELS = {"pallas_tpu": pallas_tpu_attention, "pallas_gpu": pallas_gpu_attention}
BASE = dict(scale=None, is_causal=False, local_window_size=None, q_segment_ids=None, kv_segment_ids=None,
            q_lengths=None, kv_lengths=None, mask=None, bias=None, return_weights=False, dropout_rate=0.0,
            deterministic=True, interpret=True)


def _inputs(rng, batch, h, kh, n, s, d=64):
    q = rng.standard_normal((*batch, h, n, d)).astype(np.float32)
    k = rng.standard_normal((*batch, kh, s, d)).astype(np.float32)
    v = rng.standard_normal((*batch, kh, s, d)).astype(np.float32)
    return q, k, v


def _call(name, q, k, v, **kw):
    args = {**BASE, **kw}
    if args["scale"] is None:
        args["scale"] = 1.0 / np.sqrt(q.shape[-1])
    return KERNELS[name](q, k, v, **args)


def _np_segments(qs, ks):
    """`(B…, 1, N, S)` same-segment pattern, broadcast over heads."""
    return (np.asarray(qs)[..., :, None] == np.asarray(ks)[..., None, :])[..., None, :, :]


# (kernel, batch, H, K, N, S, parts): each kernel only for the parts it claims.
CASES = [
    ("pallas_tpu", (1,), 4, 2, 128, 256, dict(is_causal=True)),                   # GQA, S > N bottom-right
    ("pallas_tpu", (1,), 2, 2, 256, 256, dict(local_window_size=(16, 8))),         # window both sides
    ("pallas_tpu", (1,), 3, 1, 256, 256, dict(is_causal=True, local_window_size=(20, None))),  # MQA, left
    ("pallas_tpu", (1,), 2, 2, 256, 256, dict(local_window_size=(None, 5))),       # window right only
    ("pallas_tpu", (2,), 2, 1, 200, 136, dict(segments="unsorted", q_lengths=(150, 200), kv_lengths=(136, 70))),
    ("pallas_tpu", (1,), 2, 2, 256, 256, dict(is_causal=True, segments="packed")),
    ("pallas_gpu", (1,), 2, 2, 128, 256, dict(is_causal=True)),
    ("pallas_gpu", (1,), 6, 2, 200, 200, dict(is_causal=True, segments="packed")),  # GQA + padding
    ("pallas_gpu", (2,), 2, 2, 256, 256, dict(segments="unsorted")),
]


def _segments(rng, kind, batch, n, s):
    if kind == "packed":
        cut = np.sort(rng.choice(np.arange(1, n), 3, replace=False))
        ids = np.searchsorted(cut, np.arange(n), side="right")
        qs = np.broadcast_to(ids, (*batch, n)).astype(np.int32)
        return qs, qs
    qs = rng.integers(0, 3, (*batch, n)).astype(np.int32)
    return qs, (qs if n == s else rng.integers(0, 3, (*batch, s)).astype(np.int32))


@pytest.mark.parametrize("name,batch,h,kh,n,s,parts", CASES,
                         ids=[f"{c[0]}-{c[3]}of{c[2]}-{c[4]}x{c[5]}-{'-'.join(c[6])}" for c in CASES])
def test_forward_matches_float64(rng, name, batch, h, kh, n, s, parts):
    q, k, v = _inputs(rng, batch, h, kh, n, s)
    parts = dict(parts)
    allowed = np_allowed((*batch, h, n, s), is_causal=parts.get("is_causal", False),
                         window=parts.get("local_window_size"), q_lengths=parts.get("q_lengths"),
                         kv_lengths=parts.get("kv_lengths"))
    kind = parts.pop("segments", None)
    if kind:
        qs, ks = _segments(rng, kind, batch, n, s)
        seg = jnp.asarray(qs)
        # The GPU kernel reads one array for both sides: hand it the same object.
        parts.update(q_segment_ids=seg, kv_segment_ids=seg if ks is qs else jnp.asarray(ks))
        allowed = allowed & _np_segments(qs, ks)
    for key in ("q_lengths", "kv_lengths"):
        if parts.get(key) is not None:
            parts[key] = jnp.asarray(parts[key])
    out = _call(name, q, k, v, **parts)
    ref, _ = np_attention(q, k, v, mask=allowed, scale=1.0 / np.sqrt(q.shape[-1]))
    assert out.shape == q.shape and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=1e-5)
    # The case must have had something to check: some rows empty or partial.
    assert allowed.any()


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_empty_rows_zero_value_and_gradient(rng, name):
    # Causal with N > S (bottom-right): the first N - S queries see no key.
    q, k, v = _inputs(rng, (1,), 2, 2, 256, 128)

    def loss(q, k, v):
        return jnp.sum(_call(name, q, k, v, is_causal=True) ** 2)

    out = _call(name, q, k, v, is_causal=True)
    assert not np.asarray(out[..., :128, :]).any()
    assert np.asarray(out[..., 128:, :]).any()
    gq, gk, gv = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert all(np.isfinite(np.asarray(g)).all() for g in (gq, gk, gv))
    assert not np.asarray(gq[..., :128, :]).any()


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_gradients_match_float64_autodiff(rng, name):
    batch, h, kh, n = (1,), 2, 1, 256
    q, k, v = _inputs(rng, batch, h, kh, n, n)
    qs, _ = _segments(rng, "packed", batch, n, n)
    seg = jnp.asarray(qs)
    ct = rng.standard_normal(q.shape)
    allowed = np_allowed((*batch, h, n, n), is_causal=True) & _np_segments(qs, qs)

    def loss(q, k, v):
        return jnp.sum(_call(name, q, k, v, is_causal=True, q_segment_ids=seg, kv_segment_ids=seg) * ct)

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    with x64():
        def ref_loss(q, k, v):
            return jnp.sum(jax_reference(q, k, v, jnp.asarray(allowed)) * ct)

        want = jax.grad(ref_loss, argnums=(0, 1, 2))(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)))
        want = [np.asarray(w) for w in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), w, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_jit_vmap_and_leading_batch_rank(rng, name):
    # vmap over one axis of a rank-2 batch: the kernel sees (B=2) inside each mapped call.
    q, k, v = _inputs(rng, (2, 1), 2, 2, 128, 128)
    f = jax.jit(jax.vmap(lambda q, k, v: _call(name, q, k, v, is_causal=True)))
    out = f(q, k, v)
    ref, _ = np_attention(q, k, v, mask=np_allowed(q.shape[:-1] + (128,), is_causal=True),
                          scale=1.0 / np.sqrt(64))
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_forward_mode_is_refused_clearly(rng, name):
    # Both kernels are custom_vjp: JAX refuses jvp/jacfwd with a one-line TypeError at
    # trace time (the docstrings quote it), never a trace from inside the kernel.
    q, k, v = _inputs(rng, (1,), 1, 1, 128, 128)
    with pytest.raises(TypeError, match="forward-mode autodiff .* custom_vjp"):
        jax.jvp(lambda q: _call(name, q, k, v), (q,), (q,))
    with pytest.raises(TypeError, match="forward-mode autodiff .* custom_vjp"):
        jax.jacfwd(lambda q: _call(name, q, k, v).sum())(q)


REFUSALS = [
    (dict(bias=np.zeros((128, 128), np.float32)), "bias"),
    (dict(mask=np.ones((128, 128), bool)), "dense mask"),
    (dict(return_weights=True), "return_weights"),
    (dict(dropout_rate=0.1, deterministic=False), "dropout"),
]


@pytest.mark.parametrize("name", sorted(KERNELS))
@pytest.mark.parametrize("parts,word", REFUSALS, ids=[w for _, w in REFUSALS])
def test_refuses_what_it_cannot_express(rng, name, parts, word):
    q, k, v = _inputs(rng, (1,), 1, 1, 128, 128)
    with pytest.raises(ValueError, match=f"{name} cannot .*{word}"):
        _call(name, q, k, v, **parts)


@pytest.mark.parametrize("parts,word", [
    (dict(local_window_size=(4, 4)), "local window"),
    (dict(kv_lengths=jnp.asarray([64])), "lengths"),
    (dict(logits_soft_cap=30.0), "logits_soft_cap"),
    (dict(q_segment_ids=jnp.zeros((1, 128), jnp.int32), kv_segment_ids=jnp.ones((1, 128), jnp.int32)), "one segment-id array"),
])
def test_gpu_refuses_tpu_only_parts(rng, parts, word):
    q, k, v = _inputs(rng, (1,), 1, 1, 128, 128)
    with pytest.raises(ValueError, match=word):
        _call("pallas_gpu", q, k, v, **parts)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_bad_shapes_and_types_are_named(rng, name):
    q, k, v = _inputs(rng, (1,), 3, 2, 128, 128)
    with pytest.raises(ValueError, match="H=3, K=2"):
        _call(name, q, k, v)
    q, k, v = _inputs(rng, (1,), 2, 2, 128, 128)
    with pytest.raises(TypeError, match="interpret"):
        _call(name, q, k, v, interpret="yes")
    with pytest.raises(TypeError, match="float32"):
        seg = jnp.zeros((1, 128), jnp.float32)
        _call(name, q, k, v, q_segment_ids=seg, kv_segment_ids=seg)


def test_tpu_logits_soft_cap_matches_float64(rng):
    # c * tanh(logits / c) on the scaled logits, before masking (API.md, third round).
    # A cap of 1 on logits of size ~1..3 changes the output far beyond the tolerance.
    q, k, v = _inputs(rng, (1,), 2, 2, 256, 256)
    cap, scale = 1.0, 1.0 / np.sqrt(64)
    out = _call("pallas_tpu", q, k, v, is_causal=True, logits_soft_cap=cap)
    logits = np.einsum("bhnd,bhsd->bhns", q.astype(np.float64), k.astype(np.float64)) * scale
    logits = np.where(np.tril(np.ones((256, 256), bool)), cap * np.tanh(logits / cap), -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    want = (w / w.sum(-1, keepdims=True)) @ v.astype(np.float64)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=1e-5)
    uncapped = _call("pallas_tpu", q, k, v, is_causal=True)
    assert np.abs(np.asarray(uncapped) - want).max() > 1e-2
    with pytest.raises(ValueError, match="logits_soft_cap"):
        _call("pallas_tpu", q, k, v, logits_soft_cap=-1.0)


@pytest.mark.parametrize("path", ["pallas_tpu", "pallas_gpu"])
def test_attention_dispatches_to_the_kernel_across_traces(path):
    """`attention(implementation=path)` under two jits of the same shapes: the cached
    splash kernel must not carry the first trace's tracers into the second."""
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.standard_normal((2, 4, 128, 16)), jnp.float32)
    k = v = jnp.asarray(rng.standard_normal((2, 2, 128, 16)), jnp.float32)
    ids = jnp.asarray(np.repeat(np.arange(2), 64)[None].repeat(2, 0))
    for options in (dict(is_causal=True), dict(is_causal=True, q_segment_ids=ids)):
        got = jax.jit(lambda q, k, v: attention(q, k, v, implementation=path, **options))(q, k, v)  # noqa: B023
        np.testing.assert_allclose(got, attention(q, k, v, **options), atol=2e-5)
