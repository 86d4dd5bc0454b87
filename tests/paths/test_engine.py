"""The blockwise engine (`jax_mha.paths.engine`) itself: query offsets (decoding), mods that
close over traced or reassigned values, the hand-written backward and its block
skipping, and the linear map that carries its transpose (`jax_mha.paths.linear_map`).

The reference is conftest's, written apart from the library: `jax_reference` (plain
jax.numpy, float64; `np_attention` is it on NumPy arrays) with a NumPy pattern and bias.
Axes have distinct prime sizes; blocks are small so that padding, several blocks and
skipping all happen.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import f32_tolerance, jax_reference, np_attention, x64

from jax_mha import attention
from jax_mha._masking import Visibility, Window, segments_at_rank
from jax_mha.paths import engine
from jax_mha.paths.blockwise import run_blockwise
from jax_mha.paths.linear_map import linear_call

B, H, K, S, D = 2, 6, 3, 23, 5


def sums(keys: int, extra: int = 0) -> int:
    """The float32 sums of attention over `keys` keys, forward and back, for the
    tolerances: the logits and dq over D, the softmax sum, weights @ v, dq, dk and dv
    over at most `keys` keys or rows; `extra` (a loss's sum, a parameter's sum over the
    rows and keys) on top."""
    return 2 * D + 4 * keys + extra


def assert_close(got, want, terms: int):
    """Each leaf of `got` within `f32_tolerance` of `want`'s, at that leaf's size."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=f32_tolerance(terms=terms, magnitude=w))


def normal(rng, shape, dtype=np.float32):
    return jnp.asarray(rng.normal(size=shape).astype(dtype))


# ---------------------------------------------------------------------------------
# Query offsets: decoding-style calls equal the rows of the full pass.
# ---------------------------------------------------------------------------------

# Each case: the description's keywords, and the same as a NumPy (pattern, bias) of
# the full pass over absolute positions (query i, key j).
DECODE = {
    "causal": (dict(is_causal=True), lambda i, j: (j <= i, 0.0 * i * j)),
    "causal_window": (dict(is_causal=True, window=Window(4, 0)), lambda i, j: ((j <= i) & (j >= i - 4), 0.0 * i * j)),
    "score_mod": (dict(is_causal=True, score_mod=lambda s, b, h, i, j: s + 1.5 * (i % 3 == j % 3).astype(s.dtype)),
                  lambda i, j: (j <= i, 1.5 * (i % 3 == j % 3))),
    "mask_mod": (dict(is_causal=True, mask_mod=lambda b, h, i, j: j >= i - 1),
                 lambda i, j: ((j <= i) & (j >= i - 1), 0.0 * i * j)),
}


def full_pass_rows(q, k, v, case, rows):
    """float64 reference rows `rows` of the full N = S pass."""
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    allowed, bias = DECODE[case][1](i, j)
    out, _ = np_attention(q, k, v, mask=np.broadcast_to(allowed, (S, S)), bias=np.broadcast_to(bias, (S, S)))
    return out[..., rows, :]


def decode(q_new, k, v, case, offset, q_block):
    """The engine with the new queries at key position `offset` (the mods see
    q_idx = offset + row), every key of the cache present."""
    n = q_new.shape[-2]
    vis = Visibility(n, S, q_offset=offset, q_start=offset, batch_shape=(B,), num_heads=H, **DECODE[case][0])
    return run_blockwise(q_new, k, v, vis, scale=1 / np.sqrt(D), query_block_size=q_block, key_block_size=4)[0]


@pytest.mark.parametrize("case", sorted(DECODE))
def test_decoding_rows_equal_the_full_pass_eager_and_traced(rng, case):
    """N = 1 and N = 3 new queries: eager with the offset a Python int, and jitted
    with it traced (one compilation for every offset)."""
    q, k, v = normal(rng, (B, H, S, D)), normal(rng, (B, K, S, D)), normal(rng, (B, K, S, D))
    for n in (1, 3):
        traced = jax.jit(lambda q_new, t: decode(q_new, k, v, case, t, 2))
        for t in (0, 7, S - n):
            want = full_pass_rows(q, k, v, case, slice(t, t + n))
            q_new = q[..., t:t + n, :]
            assert_close(traced(q_new, jnp.int32(t)), want, D + 2 * S)
            if t == 7:
                assert_close(decode(q_new, k, v, case, t, 2), want, D + 2 * S)


@pytest.mark.parametrize("case", ["score_mod", "mask_mod"])
def test_decoding_under_x64_with_an_int64_offset(rng, case):
    with x64():
        q, k, v = (normal(rng, shape, np.float64) for shape in ((B, H, S, D), (B, K, S, D), (B, K, S, D)))
        t = 9
        got = jax.jit(lambda q_new, t: decode(q_new, k, v, case, t, 2))(q[..., t:t + 3, :], jnp.asarray(t, jnp.int64))
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(got), full_pass_rows(q, k, v, case, slice(t, t + 3)), atol=1e-12)


def test_gradients_with_a_traced_offset_and_a_window(rng):
    """Seven queries at a traced offset into 23 keys, a (4, 2) window, 2 x 4 blocks:
    the backward's key-block pass finds its query blocks for any offset."""
    q, k, v = normal(rng, (B, H, 7, D)), normal(rng, (B, K, S, D)), normal(rng, (B, K, S, D))
    cot = normal(rng, (B, H, 7, D))

    def engine(q, k, v, t):
        vis = Visibility(7, S, window=Window(4, 2), q_offset=t, batch_shape=(B,), num_heads=H)
        return run_blockwise(q, k, v, vis, scale=1 / np.sqrt(D), query_block_size=2, key_block_size=4)[0]

    grads = jax.jit(jax.grad(lambda q, k, v, t: jnp.sum(engine(q, k, v, t) * cot), argnums=(0, 1, 2)))
    want = jax.jit(jax.grad(lambda q, k, v, allowed: jnp.sum(jax_reference(q, k, v, allowed) * cot),
                            argnums=(0, 1, 2)))
    for t in (0, 5, 16):
        pos = np.arange(7)[:, None] + t
        allowed = jnp.asarray((np.arange(S)[None] <= pos + 2) & (np.arange(S)[None] >= pos - 4))
        assert_close(grads(q, k, v, jnp.int32(t)), want(q, k, v, allowed), sums(S))


# ---------------------------------------------------------------------------------
# Mods closing over traced values, and over reassigned globals.
# ---------------------------------------------------------------------------------


def doc_inputs(rng, n=29):
    q, k, v = normal(rng, (B, 2, n, D)), normal(rng, (B, 1, n, D)), normal(rng, (B, 1, n, D))
    ids = jnp.asarray(np.sort(rng.integers(0, 4, (B, n)), axis=-1), jnp.int32)
    return q, k, v, ids


def doc_reference(q, k, v, ids, slopes=None):
    pos = np.arange(q.shape[-2])
    allowed = (ids[:, None, :, None] == ids[:, None, None, :]) & (pos[None, :] <= pos[:, None])[None, None]
    rel = jnp.asarray(pos[None, :] - pos[:, None], q.dtype)
    bias = None if slopes is None else (slopes[:, None, None] * rel[None])[None]
    return jax_reference(q, k, v, allowed, bias)


@pytest.mark.parametrize("path", ["blockwise", "xla"])
def test_mods_closing_over_traced_ints_bools_and_floats_under_jit_and_grad(rng, path):
    """Document ids (int), a switch (bool) and ALiBi slopes (float) passed into a
    jitted function; gradients reach q and the slopes. "xla" at N = 2,053 runs the
    engine (its whole scores would pass the limit)."""
    n = 29 if path == "blockwise" else 2053
    q, k, v, ids = doc_inputs(rng, n)
    q, k, v = q[:1, :1], k[:1], v[:1]
    ids, slopes = ids[:1], jnp.asarray([0.3])

    def loss(q, ids, on, slopes):
        mods = dict(mask_mod=lambda b, h, i, j: (ids[b, i] == ids[b, j]) & on,
                    score_mod=lambda s, b, h, i, j: s + slopes[h] * (j - i).astype(s.dtype))
        blocks = dict(query_block_size=8, key_block_size=4) if path == "blockwise" else {}
        return jnp.sum(jnp.sin(attention(q, k, v, is_causal=True, implementation=path, **blocks, **mods)))

    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 3)))(q, ids, jnp.asarray(True), slopes)
    want = jax.jit(jax.value_and_grad(lambda q, s: jnp.sum(jnp.sin(doc_reference(q, k, v, ids, s))), argnums=(0, 1)))(
        q, slopes)
    assert_close(got[0], want[0], sums(n, n * D))  # the loss: its sum over the output too
    assert_close(got[1][0], want[1][0], sums(n))  # dq
    assert_close(got[1][1], want[1][1], sums(n, n * n))  # d slopes: a sum over every (row, key)


def test_mods_closing_over_tracers_under_vmap(rng):
    """vmap over the document ids a mask_mod reads (a batched int tracer) and over
    the slopes a score_mod reads, with gradients inside the vmap."""
    q, k, v, ids = doc_inputs(rng)

    def one(ids, slopes):
        mods = dict(mask_mod=lambda b, h, i, j: ids[b, i] == ids[b, j],
                    score_mod=lambda s, b, h, i, j: s + slopes[h] * (j - i).astype(s.dtype))
        f = lambda q: jnp.sum(jnp.sin(attention(q, k, v, is_causal=True, implementation="blockwise",
                                                query_block_size=8, key_block_size=4, **mods)))
        return jax.value_and_grad(f)(q)

    many_ids = jnp.stack([ids, ids[::-1]])
    many_slopes = jnp.asarray([[0.3, -0.2], [0.1, 0.5]])
    got = jax.jit(jax.vmap(one))(many_ids, many_slopes)
    reference = jax.jit(jax.value_and_grad(lambda q, ids, s: jnp.sum(jnp.sin(doc_reference(q, k, v, ids, s)))))
    for m in range(2):
        want = reference(q, many_ids[m], many_slopes[m])
        assert_close((got[0][m], got[1][m]), want, sums(29, B * 2 * 29 * D))  # and the loss over the output


DOC = None  # read by `global_doc_mask` at each call
WIDTH = 3  # read by `global_window`


def global_doc_mask(b, h, i, j):
    doc = jnp.asarray(DOC)
    return doc[b, i] == doc[b, j]


def global_window(b, h, i, j):
    return (j <= i) & (j >= i - WIDTH)


def test_a_mask_reading_a_reassigned_global_follows_it_eager_and_jitted(rng):
    """Block ranges follow the values the mask reads at each call, never a cache of
    the function: eager calls, and a fresh jit per call, after reassigning DOC."""
    global DOC
    q, k, v, _ = doc_inputs(rng)
    run = lambda: attention(q, k, v, is_causal=True, mask_mod=global_doc_mask, implementation="blockwise",
                            query_block_size=8, key_block_size=4)
    for layout in (np.repeat([0, 1], [14, 15]), np.repeat([0, 1, 2, 3], [4, 9, 3, 13])):
        DOC = jnp.asarray(np.stack([layout, layout[::-1].max() - layout[::-1]]), jnp.int32)
        want = jax.jit(doc_reference)(q, k, v, DOC)
        assert_close(run(), want, D + 2 * 29)
        assert_close(jax.jit(lambda: run())(), want, D + 2 * 29)


def test_gradients_of_a_window_read_from_a_reassigned_global(rng):
    """A fresh jit per width: each traces the engine with the width then in WIDTH."""
    global WIDTH
    q, k, v, _ = doc_inputs(rng)
    reference = jax.jit(jax.grad(lambda q, k, v, ok: jnp.sum(jnp.sin(jax_reference(q, k, v, ok))), argnums=(0, 1, 2)))
    for width in (3, 11):
        WIDTH = width
        loss = lambda q, k, v: jnp.sum(jnp.sin(attention(q, k, v, mask_mod=global_window, implementation="blockwise",
                                                         query_block_size=8, key_block_size=4)))
        pos = np.arange(29)
        allowed = jnp.asarray((pos[None] <= pos[:, None]) & (pos[None] >= pos[:, None] - width))
        assert_close(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v), reference(q, k, v, allowed), sums(29))


# ---------------------------------------------------------------------------------
# The backward: gradients of every input, block skipping, orientation fallback.
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("per_head,bias_shape", [(True, (B, H, 13, S)), (False, (1, H, 1, S)), (True, (B, 1, 13, 1))])
def test_bias_and_lse_gradients_with_broadcast_bias(rng, monkeypatch, per_head, bias_shape):
    """The dq pass's bias cotangent, summed over the axes the bias broadcasts along,
    and `lse` differentiable too, both engine layouts."""
    monkeypatch.setattr(engine, "one_cpu_device", lambda: per_head)
    q, k, v = normal(rng, (B, H, 13, D)), normal(rng, (B, K, S, D)), normal(rng, (B, K, S, D))
    bias = normal(rng, bias_shape)
    allowed = np.arange(S)[None] <= np.arange(13)[:, None] + S - 13

    def blockwise(q, k, v, bias):
        vis = Visibility(13, S, True, Window(6, None), bias=bias, batch_shape=(B,), num_heads=H)
        out, lse, _ = run_blockwise(q, k, v, vis, scale=0.7, query_block_size=4, key_block_size=8)
        return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(lse))

    def reference(q, k, v, bias):
        kk, vv = (jnp.repeat(x, H // K, axis=1) for x in (k, v))
        logits = jnp.einsum("bhqd,bhkd->bhqk", q, kk) * 0.7 + bias
        ok = allowed & (np.arange(S)[None] >= np.arange(13)[:, None] + S - 13 - 6)
        logits = jnp.where(ok[None, None], logits, -jnp.inf)
        lse = jax.nn.logsumexp(logits, axis=-1)
        out = jnp.einsum("bhqk,bhkd->bhqd", jnp.exp(logits - lse[..., None]), vv)
        return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(lse))

    got = jax.jit(jax.grad(blockwise, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    want = jax.jit(jax.grad(reference, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    assert_close(got, want, sums(S, B * 13 * S))  # d bias over the axes it broadcasts along


def test_a_mod_that_cannot_be_transposed_still_differentiates(rng):
    """A score_mod written for `(…, N, 1)` query indices only: the dk/dv pass keeps
    its blocks unturned (multiplying transposed operands) and stays exact."""
    q, k, v = normal(rng, (1, 2, 13, D)), normal(rng, (1, 1, S, D)), normal(rng, (1, 1, S, D))
    mod = lambda s, b, h, i, j: s + 0.2 * jnp.squeeze(i, -1)[..., None].astype(s.dtype)
    plan, _ = engine._prepare(q, k, v, Visibility(13, S, score_mod=mod, num_heads=2), scale=1.0, q_block=4,
                              k_block=8, bad_kv=None)
    assert not plan.transposable
    rows = jnp.asarray(np.broadcast_to(np.arange(13)[:, None] * 0.2, (13, S)), jnp.float32)
    loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))
    blockwise = lambda q, k, v: attention(q, k, v, score_mod=mod, implementation="blockwise", query_block_size=4,
                                          key_block_size=8)
    got = jax.jit(jax.grad(loss(blockwise), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(loss(lambda q, k, v: jax_reference(q, k, v, bias=rows[None, None])), argnums=(0, 1, 2)))(
        q, k, v)
    assert_close(got, want, sums(S))


SKIPS = {
    "causal": dict(is_causal=True),
    "window": dict(window=Window(5, 3)),
    "packed_causal": dict(is_causal=True, ids=np.repeat([0, 1, 2, 3], [16, 16, 9, 23])),
    "packed_unsorted": dict(ids=np.repeat([1, 0, 1, 2], 16)),
    "mask_mod_window": dict(mask_mod=lambda b, h, i, j: (j <= i) & (j > i - 9)),
    "traced_offset_window": dict(is_causal=True, window=Window(7, 0), q_offset=jnp.int32(0)),
}


@pytest.mark.parametrize("name", sorted(SKIPS))
def test_backward_passes_visit_the_blocks_the_forward_visits(name):
    """The dk/dv pass (query blocks per key block) computes exactly the block pairs
    of the forward and dq pass (key blocks per query block), GQA included."""
    n = 64
    q, kv = jnp.zeros((1, 4, n, 8)), jnp.zeros((1, 2, n, 8))
    kw = dict(SKIPS[name])
    ids = kw.pop("ids", None)
    if ids is not None:
        kw["q_segment_ids"], kw["kv_segment_ids"] = segments_at_rank(jnp.asarray(ids)[None], jnp.asarray(ids)[None], 1)
    vis = Visibility(n, n, batch_shape=(1,), num_heads=4, **kw)
    by_queries, by_keys = (engine.visited_table(q, kv, kv, vis, q_block=8, k_block=8, by=by) for by in ("queries",
                                                                                                       "keys"))
    np.testing.assert_array_equal(by_keys, by_queries)
    assert 0 < by_queries.sum() < by_queries.size


def test_packed_documents_visit_only_their_own_blocks():
    """Causal N = 256 in 32 x 32 blocks, 4 documents of 64: 3 block pairs per
    document, in each pass."""
    n = 256
    q = jnp.zeros((1, 1, n, 8))
    ids = jnp.asarray(np.repeat(np.arange(4), 64))[None]
    q_ids, kv_ids = segments_at_rank(ids, ids, 1)
    vis = Visibility(n, n, is_causal=True, q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    for by in ("queries", "keys"):
        assert engine.visited_blocks(q, q, q, vis, q_block=32, k_block=32, by=by) == 4 * 3
    with pytest.raises(ValueError, match="by must be 'queries' or 'keys', got 'rows'"):
        engine.visited_blocks(q, q, q, vis, q_block=32, k_block=32, by="rows")


def test_per_example_gradients(rng):
    """vmap of grad (the transposed map batched) through a score_mod, against plain
    autodiff of the dense reference (forward over reverse: tests/core/test_mods.py,
    tests/core/test_attention_paths.py)."""
    q, k, v = normal(rng, (3, 1, 2, 7, D)), normal(rng, (1, 1, 11, D)), normal(rng, (1, 1, 11, D))
    slopes = jnp.asarray([0.2, -0.4])

    def f(q, slopes, engine=True):
        mod = lambda s, b, h, i, j: s + slopes[h] * (j - i).astype(s.dtype)
        if engine:
            out = attention(q, k, v, is_causal=True, score_mod=mod, implementation="blockwise", query_block_size=2,
                            key_block_size=4)
        else:
            rel = jnp.asarray(np.arange(11)[None] - np.arange(7)[:, None], jnp.float32)
            allowed = np.arange(11)[None] <= np.arange(7)[:, None] + 4
            out = jax_reference(q, k, v, allowed, (slopes[:, None, None] * rel[None])[None])
        return jnp.sum(jnp.sin(out))

    per_example = lambda engine: jax.vmap(jax.grad(lambda q, s: f(q, s, engine), argnums=(0, 1)), (0, None))(q, slopes)
    assert_close(jax.jit(lambda: per_example(True))(), jax.jit(lambda: per_example(False))(),
                 sums(11, 7 * 11))  # d slopes over every (row, key)


# ---------------------------------------------------------------------------------
# The linear map with a hand-written transpose.
# ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Scaled:
    """x -> tanh(w) @ x, linear in x; its transpose counts its calls."""

    transposed: bool = False
    calls: list = dataclasses.field(default_factory=list, compare=False, hash=False)

    def apply(self, res, lin):
        a = jnp.tanh(res[0])
        if self.transposed:
            self.calls.append(1)
            return [a.T @ lin[0]]
        return [a @ lin[0]]

    def transpose(self):
        return Scaled(not self.transposed, self.calls)

    def out_avals(self, res, lin):
        rows = res[0].shape[1] if self.transposed else res[0].shape[0]
        return [jax.ShapeDtypeStruct((rows,), lin[0].dtype)]


def test_linear_call_in_every_mode():
    calls = []

    @jax.custom_jvp
    def f(x, w):
        return jnp.sin(jnp.tanh(w) @ x)

    @f.defjvp
    def f_jvp(primals, tangents):
        (x, w), (dx, dw) = primals, tangents
        y = jnp.tanh(w) @ x
        return jnp.sin(y), jnp.cos(y) * (linear_call(Scaled(calls=calls), [w], [dx])[0] + (1 - jnp.tanh(w) ** 2) * dw @ x)

    plain = lambda x, w: jnp.sin(jnp.tanh(w) @ x)
    with x64():
        rng = np.random.default_rng(1)
        x, w = jnp.asarray(rng.normal(size=3)), jnp.asarray(rng.normal(size=(2, 3)))
        xs = jnp.stack([x, -2 * x])
        loss = lambda g: lambda x, w: jnp.sum(g(x, w) ** 2)
        modes = {
            "jacrev_jacrev": lambda g: jax.jacrev(jax.jacrev(loss(g), (0, 1)), (0, 1))(x, w),
            "vmap_grad": lambda g: jax.vmap(jax.grad(loss(g), (0, 1)), (0, None))(xs, w),
            "grad_vmap": lambda g: jax.grad(lambda xs, w: jnp.sum(jax.vmap(loss(g), (0, None))(xs, w)), (0, 1))(xs, w),
            "vmap_hessian": lambda g: jax.vmap(jax.hessian(loss(g), (0, 1)), (0, None))(xs, w),
        }
        got, want = (jax.jit(lambda g=g: {n: m(g) for n, m in modes.items()})() for g in (f, plain))
        chex.assert_trees_all_close(got, want, atol=1e-12, rtol=1e-10)
        assert calls  # the hand-written transpose ran
