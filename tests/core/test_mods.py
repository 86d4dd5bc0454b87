"""Score and mask functions (`score_mod`, `mask_mod`) and `logits_soft_cap`, on every path.

Each mod is checked against a float64 reference written apart from the library
(`conftest.jax_reference`: plain jax.numpy, the same pattern as a dense bias or mask, the soft-cap as a
hand-written tanh) in value and in the gradients of q, k, v and of the mod's own
parameters (ALiBi slopes, a T5 relative-bias table). Axes have distinct prime sizes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import PATHS, f32_tolerance, jax_reference, run, x64

from jax_mha import attention
from jax_mha._masking import Visibility, Window
from jax_mha.paths.engine import visited_blocks

B, H, K, N, S, D = 2, 6, 3, 7, 11, 5
OFFSET = S - N  # query i sits at key position i + S - N
MAX_DIST = 4  # the T5 table's buckets: relative distances clipped to [-4, 4]
# The float32 sums, for the tolerances: the logits over D, the softmax sum and
# weights @ v over the S keys; backward adds sums over D, the keys, the rows of the
# H/K query heads sharing a key head, and (a mod's parameter) the batch, rows and keys.
FORWARD_TERMS = D + 2 * S
BACKWARD_TERMS = FORWARD_TERMS + D + S + N * (H // K) + B * N * S


def rel(n=N, s=S):
    """`(N, S)` relative distance key - query position."""
    return np.arange(s)[None, :] - (np.arange(n)[:, None] + s - n)


# Each case: (the mod keywords from a parameter, the same as dense bias/allowed/cap).
def alibi(slopes):
    return dict(score_mod=lambda sc, b, h, i, j: sc + slopes[h] * (j - i - OFFSET).astype(sc.dtype))


def alibi_dense(slopes):
    return dict(bias=(slopes[:, None, None] * jnp.asarray(rel(), slopes.dtype)[None])[None])


def t5(table):
    def score_mod(sc, b, h, i, j):
        return sc + table[h, jnp.clip(j - i - OFFSET, -MAX_DIST, MAX_DIST) + MAX_DIST]
    return dict(score_mod=score_mod)


def t5_dense(table):
    return dict(bias=table[:, np.clip(rel(), -MAX_DIST, MAX_DIST) + MAX_DIST][None])


CASES = {
    "alibi": (alibi, alibi_dense, lambda rng: rng.normal(size=H)),
    "t5_table": (t5, t5_dense, lambda rng: rng.normal(size=(H, 2 * MAX_DIST + 1))),
    "soft_cap": (lambda c: dict(logits_soft_cap=1.3), lambda c: dict(cap=1.3), lambda rng: np.zeros(())),
    "alibi_soft_cap_causal": (lambda s: alibi(s) | dict(logits_soft_cap=0.9, is_causal=True),
                              lambda s: alibi_dense(s) | dict(cap=0.9, allowed=jnp.asarray(rel() <= 0)),
                              lambda rng: rng.normal(size=H)),
    "prefix_lm": (lambda p: dict(mask_mod=lambda b, h, i, j: (j <= i + OFFSET) | (j < 3)),
                  lambda p: dict(allowed=jnp.asarray((rel() <= 0) | (np.arange(S) < 3)[None])),
                  lambda rng: np.zeros(())),
    "window_mask_mod_with_bias": (lambda p: dict(mask_mod=lambda b, h, i, j: jnp.abs(j - i - OFFSET) <= 2, bias=p),
                                  lambda p: dict(allowed=jnp.asarray(np.abs(rel()) <= 2), bias=p),
                                  lambda rng: rng.normal(size=(1, H, N, S))),
}


def case_inputs(rng, name, dtype=np.float32):
    q = rng.normal(size=(B, H, N, D)).astype(dtype)
    k, v = (rng.normal(size=(B, K, S, D)).astype(dtype) for _ in range(2))
    param = CASES[name][2](rng).astype(dtype)
    return tuple(jnp.asarray(x) for x in (q, k, v, param))


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("path", PATHS)
def test_mod_matches_dense_formulation_value_and_gradients(rng, path, name):
    """Forward and grad (q, k, v and the mod's parameter) under jit, against autodiff
    of the float64 dense formulation."""
    mod, same_dense, _ = CASES[name]
    with x64():
        q, k, v, p = case_inputs(rng, name, np.float64)
        loss = lambda out: jnp.sum(jnp.sin(out))
        want = jax.value_and_grad(lambda q, k, v, p: loss(jax_reference(q, k, v, **same_dense(p))), argnums=(0, 1, 2, 3))(
            q, k, v, p)
        # The loss's partial sums are at most the sum of its terms' sizes.
        terms_size = float(jnp.sum(jnp.abs(jnp.sin(jax_reference(q, k, v, **same_dense(p))))))
    q, k, v, p = (x.astype(jnp.float32) for x in (q, k, v, p))
    got = jax.jit(jax.value_and_grad(lambda q, k, v, p: loss(run(path, q, k, v, **mod(p))), argnums=(0, 1, 2, 3)))(
        q, k, v, p)
    np.testing.assert_allclose(got[0], want[0], atol=f32_tolerance(terms=FORWARD_TERMS + B * H * N * D,
                                                                   magnitude=terms_size))
    for g, w in zip(got[1], want[1]):  # each gradient against its own size
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=f32_tolerance(terms=BACKWARD_TERMS, magnitude=w))


@pytest.mark.parametrize("path", ["xla", "blockwise"])
def test_document_mask_mod_equals_segment_ids_with_two_batch_dims(rng, path):
    """`batch` is the flattened index over all leading dims (row-major)."""
    n = 13
    q = jnp.asarray(rng.normal(size=(2, 3, 2, n, D)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, 3, 1, n, D)), jnp.float32) for _ in range(2))
    ids = jnp.asarray(np.sort(rng.integers(0, 4, (2, 3, n)), axis=-1))
    flat = ids.reshape(6, n)
    mod = lambda b, h, i, j: flat[b, i] == flat[b, j]
    got = jax.jit(lambda q, k, v: run(path, q, k, v, mask_mod=mod))(q, k, v)
    want = run(path, q, k, v, q_segment_ids=ids)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=f32_tolerance(terms=D + 2 * n, magnitude=want))


def test_sliding_window_mask_mod_equals_local_window_size_and_visits_as_few_blocks(rng):
    n = s = 64
    q = jnp.asarray(rng.normal(size=(1, 2, n, D)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(1, 1, s, D)), jnp.float32) for _ in range(2))
    window = lambda b, h, i, j: (j <= i) & (j >= i - 9)
    f = lambda **kw: jax.jit(jax.grad(lambda q: jnp.sum(jnp.sin(attention(q, k, v, implementation="blockwise",
                                                                           **kw)))))(q)
    want = f(is_causal=True, local_window_size=(9, 0))  # dq: attention's sums over 64 keys, forward and back
    np.testing.assert_allclose(f(mask_mod=window), want, atol=f32_tolerance(terms=2 * D + 3 * s, magnitude=want))
    got = visited_blocks(q, k, v, Visibility(n, s, mask_mod=window, batch_shape=(1,), num_heads=2),
                         q_block=8, k_block=8)
    builtin = visited_blocks(q, k, v, Visibility(n, s, True, Window(9, 0)), q_block=8, k_block=8)
    assert got == builtin < 8 * 8 * 2 // 2  # fewer than the causal half of the (8 x 8 blocks) x 2 heads


def test_document_mask_mod_skips_at_least_the_blocks_segment_ids_skip(rng):
    n = 64
    q = jnp.asarray(rng.normal(size=(1, 1, n, D)), jnp.float32)
    ids = np.repeat(np.arange(4), 16)[None]  # four documents of 16
    doc = lambda b, h, i, j: jnp.asarray(ids)[b, i] == jnp.asarray(ids)[b, j]
    vis = Visibility(n, n, mask_mod=doc, batch_shape=(1,), num_heads=1)
    got = visited_blocks(q, q, q, vis, q_block=8, k_block=8)
    from jax_mha._masking import segments_at_rank
    q_ids, kv_ids = segments_at_rank(jnp.asarray(ids), jnp.asarray(ids), 1)
    builtin = visited_blocks(q, q, q, Visibility(n, n, q_segment_ids=q_ids, kv_segment_ids=kv_ids),
                             q_block=8, k_block=8)
    assert got == builtin == 4 * 2 * 2  # each 2-block document sees its own 2 x 2 blocks


@pytest.mark.parametrize("empty_rows", ["zero", "uniform"])
@pytest.mark.parametrize("path", ["xla", "blockwise", "weights"])
def test_mask_mod_emptying_rows_follows_empty_rows(rng, path, empty_rows):
    q, k, v, _ = case_inputs(rng, "alibi")
    mod = lambda b, h, i, j: (i % 3 != 0) & (j >= i)  # rows 0, 3, 6 see nothing
    allowed = (np.arange(N)[:, None] % 3 != 0) & (np.arange(S)[None] >= np.arange(N)[:, None])
    f = lambda q, k, v: run(path, q, k, v, mask_mod=mod, empty_rows=empty_rows)
    got, grads = jax.jit(lambda q, k, v: (f(q, k, v), jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2))(
        q, k, v)))(q, k, v)
    want = jax_reference(q, k, v, allowed=jnp.asarray(allowed))
    if empty_rows == "uniform":
        mean = jnp.repeat(jnp.mean(v, axis=-2, keepdims=True), H // K, axis=-3)
        want = jnp.where(jnp.asarray(allowed.any(-1))[:, None], want, mean)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want),
                               atol=f32_tolerance(terms=FORWARD_TERMS, magnitude=want))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)


@pytest.mark.parametrize("path", ["xla", "blockwise"])
def test_vmap_and_jvp_through_a_score_mod(rng, path):
    """vmap over an extra axis with a batched parameter, and forward mode (jvp) in q
    and the slopes, against the float64 dense formulation."""
    q, k, v, slopes = case_inputs(rng, "alibi")
    many = jnp.stack([slopes, 2 * slopes])
    got = jax.jit(jax.vmap(lambda s: run(path, q, k, v, **alibi(s))))(many)
    want = jnp.stack([jax_reference(q, k, v, **alibi_dense(s)) for s in many])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want),
                               atol=f32_tolerance(terms=FORWARD_TERMS, magnitude=want))
    dq, ds = jnp.ones_like(q), jnp.ones_like(slopes)
    _, t_got = jax.jit(lambda *a: jax.jvp(lambda q, s: run(path, q, k, v, **alibi(s)), (q, slopes), (dq, ds)))()
    _, t_want = jax.jvp(lambda q, s: jax_reference(q, k, v, **alibi_dense(s)), (q, slopes), (dq, ds))
    np.testing.assert_allclose(np.asarray(t_got), np.asarray(t_want),
                               atol=f32_tolerance(terms=2 * FORWARD_TERMS, magnitude=t_want))


BAD = [
    (dict(score_mod=lambda s, b, h, i, j: jnp.sum(s, axis=-1)), ValueError, "score_mod must return one score per"),
    (dict(score_mod=lambda s, b, h, i, j: i >= j), TypeError, "score_mod returned booleans.*mask_mod"),
    (dict(mask_mod=lambda b, i, j: j <= i), TypeError, r"mask_mod must take 4 arguments \(batch, head, q_idx"),
    (dict(score_mod=lambda s, i, j: s), TypeError, r"score_mod must take 5 arguments \(score, batch"),
    (dict(score_mod=lambda s, b, h, i, j: s.astype(jnp.float16)), TypeError, "score_mod must return the score's dtype"),
    (dict(mask_mod=lambda b, h, i, j: (j - i).astype(jnp.float32)), TypeError, "mask_mod must return booleans"),
    (dict(mask_mod=lambda b, h, i, j: jnp.ones((4,), bool)), ValueError, "mask_mod's result does not broadcast"),
    (dict(score_mod="alibi"), TypeError, "score_mod must be a callable"),
    (dict(mask_mod=3), TypeError, "mask_mod must be a callable"),
    (dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap"),
    (dict(logits_soft_cap=-2.0), ValueError, "logits_soft_cap"),
    (dict(logits_soft_cap=float("inf")), ValueError, "logits_soft_cap"),
    (dict(logits_soft_cap="30"), TypeError, "logits_soft_cap"),
    (dict(logits_soft_cap=True), TypeError, "logits_soft_cap"),
]


@pytest.mark.parametrize("kw,error,match", BAD)
def test_bad_mods_raise_one_line_errors_naming_them(rng, kw, error, match):
    q, k, v, _ = case_inputs(rng, "alibi")
    with pytest.raises(error, match=match) as info:
        attention(q, k, v, **kw)
    assert "\n" not in str(info.value)


def test_tpu_kernel_takes_mods_and_refuses_a_computed_index_table_by_name(rng):
    """Compiled for a TPU, "pallas_tpu" runs the library's kernel for mods; a table read
    at an index computed from the indices is a gather, which a TPU kernel cannot do."""
    from jax_mha import _dispatch, _masking

    q, k, v, _ = case_inputs(rng, "alibi")
    tpu = _masking.Call(q, k, v, platform="tpu")
    table = jnp.ones((q.shape[-3], 8), jnp.float32)
    for kw in (dict(score_mod=lambda s, b, h, i, j: s), dict(mask_mod=lambda b, h, i, j: j <= i)):
        assert _dispatch.refusal("pallas_tpu", Visibility(q.shape[-2], k.shape[-2], **kw), tpu) is None, kw
    gather = Visibility(q.shape[-2], k.shape[-2], score_mod=lambda s, b, h, i, j: s + table[h, jnp.clip(j - i, 0, 7)])
    why = _dispatch.refusal("pallas_tpu", gather, tpu)
    assert why is not None and "a table indexed by a computed index" in why and "score_mod" in why, why


def test_auto_takes_the_tpu_kernel_for_mods(monkeypatch, rng):
    """On a TPU "auto" reads the kernel's refusal: a mask function and a soft cap go to
    the kernel, a computed-index table to the pure-JAX path."""
    from jax_mha import _dispatch
    from jax_mha.functional import resolve_implementation

    q, k, v, _ = case_inputs(rng, "alibi")
    monkeypatch.setattr(_dispatch, "platform", lambda: "tpu")
    assert resolve_implementation(q, k, v, Visibility(N, S, mask_mod=lambda b, h, i, j: j <= i)) == "pallas_tpu"
    assert resolve_implementation(q, k, v, Visibility(N, S, logits_soft_cap=3.0)) == "pallas_tpu"
    table = jnp.ones((8,), jnp.float32)
    gather = Visibility(N, S, score_mod=lambda s, b, h, i, j: s + table[jnp.clip(j - i, 0, 7)])
    assert resolve_implementation(q, k, v, gather) == "xla"


def test_pallas_tpu_translates_soft_cap(rng):
    """splash's own soft-cap, in interpret mode, against the hand-written tanh."""
    q = jnp.asarray(rng.normal(size=(1, 2, 16, 8)) * 3, jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(1, 1, 16, 8)) * 3, jnp.float32) for _ in range(2))
    got = attention(q, k, v, is_causal=True, logits_soft_cap=2.0, implementation="pallas_tpu")
    want = jax_reference(q, k, v, allowed=jnp.asarray(rel(16, 16) <= 0), cap=2.0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=f32_tolerance(terms=8 + 2 * 16, magnitude=want))
    assert not np.allclose(np.asarray(got), np.asarray(jax_reference(q, k, v, allowed=jnp.asarray(rel(16, 16) <= 0))),
                           atol=1e-3)


def test_hessian_in_the_slopes_through_score_mod_soft_cap_and_mask_mod(rng):
    """Forward-over-reverse through the engine's custom JVP (the mods included)
    equals the whole-scores route's, which is plain autodiff."""
    q = jnp.asarray(rng.normal(size=(1, 2, 3, 2)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 5, 2)), jnp.float32)
    v = k + 1

    def f(path):
        def loss(slopes):
            mods = dict(score_mod=lambda s, b, h, i, j: s + slopes[h] * (j - i).astype(s.dtype), logits_soft_cap=2.0,
                        mask_mod=lambda b, h, i, j: j != i)
            return jnp.sum(jnp.sin(run(path, q, k, v, **mods)))
        return loss

    slopes = jnp.asarray([0.3, -0.5])
    hess = lambda path: jax.jit(jax.hessian(f(path)))(slopes)
    want = hess("xla")  # attention's sums (D=2, 5 keys) forward, back, and forward again
    np.testing.assert_allclose(hess("blockwise"), want, atol=f32_tolerance(terms=3 * (2 + 2 * 5), magnitude=want))


def test_float64_inputs_on_the_engine_match_the_whole_scores(rng):
    """Under x64 the engine's indices stay int32 (the mods were converted for them)."""
    with x64():
        q, k, v, slopes = case_inputs(rng, "alibi", np.float64)
        mods = lambda s: alibi(s) | dict(mask_mod=lambda b, h, i, j: (j - i) % 3 != 0, logits_soft_cap=2.0)
        grads = {path: jax.jit(jax.grad(lambda s: jnp.sum(jnp.sin(run(path, q, k, v, **mods(s))))))(slopes)
                 for path in ("xla", "blockwise")}
        np.testing.assert_allclose(np.asarray(grads["blockwise"]), np.asarray(grads["xla"]), rtol=1e-10, atol=1e-12)
