"""The Pallas translators (`_pallas_tpu`: splash attention, `_pallas_gpu`: the Triton
FlashAttention kernel) in Pallas interpret mode, against the float64 reference with the
same pattern written as a dense NumPy mask, built here independently.

Interpret mode is slow (seconds a call on a CPU), so the shapes are the smallest that
tile: blocks of 128 (the modules' constants, patched) and N, S of 256 (2 x 2 blocks)
or 200 (padded to 256).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_mha import _pallas_gpu, _pallas_tpu, attention

KERNELS = {"pallas_tpu": _pallas_tpu.pallas_tpu_attention, "pallas_gpu": _pallas_gpu.pallas_gpu_attention}
OFF = dict(is_causal=False, local_window_size=None, q_segment_ids=None, kv_segment_ids=None, q_lengths=None,
           kv_lengths=None, mask=None, bias=None, return_weights=False, dropout_rate=0.0, deterministic=True)


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(_pallas_tpu, "BLOCK", 128)
    monkeypatch.setattr(_pallas_gpu, "BLOCK", 128)


def dense_allowed(b, n, s, *, is_causal=False, window=None, q_ids=None, kv_ids=None, q_lengths=None,
                  kv_lengths=None):
    """bool (B, 1, N, S), written from the definitions (bottom-right alignment)."""
    allowed = np.ones((b, 1, n, s), bool)
    for batch in range(b):
        for i in range(n):
            for j in range(s):
                at = i + s - n  # the key position of query i
                ok = True
                if is_causal:
                    ok &= j <= at
                if window is not None:
                    left, right = window
                    ok &= left is None or j >= at - left
                    ok &= right is None or j <= at + right
                if q_ids is not None:
                    ok &= q_ids[batch, i] == kv_ids[batch, j]
                if q_lengths is not None:
                    ok &= i < q_lengths[batch]
                if kv_lengths is not None:
                    ok &= j < kv_lengths[batch]
                allowed[batch, 0, i, j] = ok
    return allowed


# name: (kernels that claim it, (B, H, K, N, S, D), options)
PACKED = np.repeat(np.arange(4), 64)[None].repeat(2, 0)  # 4 documents of 64 in each row
CASES = {
    "causal_gqa": (KERNELS, (2, 3, 1, 256, 256, 16), dict(is_causal=True)),
    "causal_keys_after_queries": (["pallas_tpu"], (1, 2, 2, 128, 200, 16), dict(is_causal=True)),
    "window_both_sides": (["pallas_tpu"], (1, 2, 1, 200, 256, 16), dict(local_window_size=(20, 5))),
    "causal_window": (["pallas_tpu"], (1, 2, 2, 256, 256, 16), dict(is_causal=True, local_window_size=(40, None))),
    "packed_segments": (KERNELS, (2, 2, 2, 256, 256, 16), dict(is_causal=True, q_segment_ids=PACKED)),
    "unsorted_segments": (KERNELS, (1, 2, 1, 200, 200, 16), dict(q_segment_ids="random")),
    "lengths": (["pallas_tpu"], (2, 2, 1, 128, 256, 16), dict(q_lengths=[128, 90], kv_lengths=[256, 0])),
}


@pytest.mark.parametrize("path, case", [(p, c) for c, (ks, _, _) in CASES.items() for p in KERNELS if p in ks])
def test_kernel_matches_reference(path, case, np_attention):
    _, (b, h, kh, n, s, d), options = CASES[case]
    rng = np.random.default_rng(len(case))
    q = jnp.asarray(rng.standard_normal((b, h, n, d)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((b, kh, s, d)), jnp.float32) for _ in range(2))
    options = dict(options)
    if isinstance(options.get("q_segment_ids"), str):
        options["q_segment_ids"] = rng.integers(0, 3, (b, n))
    ids = options.get("q_segment_ids")
    if ids is not None:
        options["q_segment_ids"] = options["kv_segment_ids"] = jnp.asarray(ids, jnp.int32)
    for name in ("q_lengths", "kv_lengths"):
        if name in options:
            options[name] = jnp.asarray(options[name])
    allowed = dense_allowed(b, n, s, is_causal=options.get("is_causal", False),
                            window=options.get("local_window_size"), q_ids=ids, kv_ids=ids,
                            q_lengths=options.get("q_lengths"), kv_lengths=options.get("kv_lengths"))
    scale = 0.3
    kernel = lambda q, k, v: KERNELS[path](q, k, v, **{**OFF, **options, "scale": scale})  # noqa: E731
    w = jnp.asarray(rng.standard_normal((b, h, n, d)), jnp.float32)  # a random output gradient
    out, grads = jax.value_and_grad(lambda *a: (kernel(*a) * w).sum(), argnums=(0, 1, 2))(q, k, v)
    out = kernel(q, k, v)
    want, _ = np_attention(q, k, v, mask=allowed, scale=scale)
    np.testing.assert_allclose(out, want, atol=2e-5)
    reference = lambda q, k, v: attention(q, k, v, mask=jnp.asarray(allowed), scale=scale)  # noqa: E731
    want_grads = jax.grad(lambda *a: (reference(*a) * w).sum(), argnums=(0, 1, 2))(q, k, v)
    for got, expected in zip(grads, want_grads):
        assert bool(jnp.isfinite(got).all())
        np.testing.assert_allclose(got, expected, atol=5e-5)
    empty = ~allowed.any(-1)  # (B, 1, N): rows with no key are zeros
    assert np.all(np.asarray(out)[np.broadcast_to(empty, (b, h, n))] == 0)


@pytest.mark.parametrize("path", list(KERNELS))
def test_jit_vmap_and_leading_axes(path):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 1, 2, 128, 16)), jnp.float32)  # (vmapped, B, H, N, D)
    k = v = jnp.asarray(rng.standard_normal((2, 1, 2, 128, 16)), jnp.float32)
    run = jax.jit(jax.vmap(lambda q, k, v: KERNELS[path](q, k, v, **{**OFF, "is_causal": True, "scale": 0.25})))
    want = attention(q, k, v, is_causal=True, scale=0.25)
    np.testing.assert_allclose(run(q, k, v), want, atol=2e-5)


@pytest.mark.parametrize("path", list(KERNELS))
def test_forward_mode_is_a_clear_type_error(path):
    q = jnp.ones((1, 2, 128, 16))
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(lambda q: KERNELS[path](q, q, q, **{**OFF, "scale": 0.25}), (q,), (q,))


@pytest.mark.parametrize("path", list(KERNELS))
@pytest.mark.parametrize(
    "part, value, match",
    [
        ("bias", jnp.zeros((4, 4)), "cannot add a bias"),
        ("mask", jnp.ones((4, 4), bool), "cannot read a dense mask"),
        ("return_weights", True, "return_weights=True needs 'xla'"),
        ("dropout_rate", 0.1, "has no dropout"),
    ],
)
def test_refusals_name_the_part(path, part, value, match):
    x = jnp.ones((1, 2, 4, 8))
    options = {**OFF, "scale": 1.0, part: value}
    if part == "dropout_rate":
        options["deterministic"] = False
    with pytest.raises(ValueError, match=match):
        KERNELS[path](x, x, x, **options)


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(local_window_size=(3, 0)), "cannot express local_window_size"),
        (dict(kv_lengths=jnp.array([3])), r"cannot express kv_lengths \(express padding as q_segment_ids\)"),
        (dict(q_segment_ids=jnp.zeros((1, 4), jnp.int32), kv_segment_ids=jnp.zeros((1, 4), jnp.int32)),
         "kv_segment_ids must be q_segment_ids"),
        (dict(is_causal=True), r"only for N == S, got N=4, S=6"),
    ],
)
def test_gpu_refusals(options, match):
    q, k = jnp.ones((1, 2, 4, 8)), jnp.ones((1, 2, 6 if "is_causal" in options else 4, 8))
    with pytest.raises(ValueError, match=match):
        _pallas_gpu.pallas_gpu_attention(q, k, k, **{**OFF, "scale": 1.0, **options})


def test_tpu_soft_cap_refuses_non_positive():
    x = jnp.ones((1, 2, 4, 8))
    with pytest.raises(ValueError, match=r"logits_soft_cap must be > 0, got 0"):
        _pallas_tpu.pallas_tpu_attention(x, x, x, **{**OFF, "scale": 1.0}, logits_soft_cap=0)
