"""The library's own flash kernel (`jax_mha.paths.flex`) behind `implementation="pallas_gpu"`
and `"pallas_tpu"`, in Pallas interpret mode on this CPU: every feature it takes,
values and gradients (q, k, v and every floating value a mod closes over) against the
float64 reference of conftest (`jax_reference`), GQA, N and S crossing block edges.
The lowering for CUDA of the same calls is in tests/paths/test_lowering.py."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import f32_tolerance, jax_reference, np_allowed, x64

from jax_mha import attention

B, H, K, N, S, D = 2, 4, 2, 97, 131, 8
OFFSET = S - N  # query i sits at key position i + OFFSET (bottom-right alignment)
KERNELS = ("pallas_gpu", "pallas_tpu")
TERMS = 2 * D + 3 * S + (H // K) * N  # forward and backward sums (see test_composition)


def _features():
    """name -> `(kw(values), reference(values) -> dict of jax_reference's arguments,
    values: the floating arrays the call closes over, by name)`."""
    rng = np.random.default_rng(0)
    rows, cols = np.arange(N)[:, None] + OFFSET, np.arange(S)[None, :]
    docs = np.sort(rng.integers(0, 4, (B, S)), axis=-1).astype(np.int32)
    same_doc = docs[:, None, :, None][..., OFFSET:, :] == docs[:, None, None, :]  # (B, 1, N, S)
    buckets = np.clip(cols - rows + 16, 0, 31)

    def alibi(v):
        return (dict(is_causal=True, score_mod=lambda s, b, h, i, j: s + v["slopes"][h] * (j - i - OFFSET)),
                dict(allowed=np_allowed((B, H, N, S), is_causal=True),
                     bias=v["slopes"][None, :, None, None] * jnp.asarray(cols - rows, v["slopes"].dtype)[None, None]))

    def table(v):
        return (dict(score_mod=lambda s, b, h, i, j: s + v["table"][h, jnp.clip(j - i - OFFSET + 16, 0, 31)]),
                dict(bias=v["table"][:, buckets][None]))

    ids = jnp.asarray(docs)
    return {
        "alibi": (alibi, {"slopes": rng.uniform(0.1, 1.0, H)}),
        "soft_cap": (lambda v: (dict(logits_soft_cap=2.0, is_causal=True),
                                dict(cap=2.0, allowed=np_allowed((B, H, N, S), is_causal=True))), {}),
        "documents": (lambda v: (dict(mask_mod=lambda b, h, i, j: ids[b, i + OFFSET] == ids[b, j]),
                                 dict(allowed=same_doc)), {}),
        "window": (lambda v: (dict(local_window_size=(9, 5)), dict(allowed=np_allowed((B, H, N, S), window=(9, 5)))),
                   {}),
        "prefix_lm": (lambda v: (dict(mask_mod=lambda b, h, i, j: (j < 40) | (j <= i + OFFSET)),
                                 dict(allowed=(cols < 40) | (cols <= rows))), {}),
        "sinks": (lambda v: (dict(sinks=v["sinks"], is_causal=True),
                             dict(sinks=v["sinks"], allowed=np_allowed((B, H, N, S), is_causal=True))),
                  {"sinks": rng.standard_normal(H)}),
        "bias": (lambda v: (dict(bias=v["bias"]), dict(bias=v["bias"])), {"bias": rng.standard_normal((B, H, N, S))}),
        "table": (table, {"table": rng.standard_normal((H, 32))}),
        "lengths_window": (lambda v: (dict(kv_lengths=np.array([70, S]), local_window_size=(20, 20)),
                                      dict(allowed=np_allowed((B, H, N, S), kv_lengths=np.array([70, S]),
                                                              window=(20, 20)))), {}),
        "segments": (lambda v: (dict(q_segment_ids=docs[:, OFFSET:], kv_segment_ids=docs), dict(allowed=same_doc)),
                     {}),
    }


FEATURES = _features()


def _inputs(dtype=np.float32):
    rng = np.random.default_rng(1)
    return tuple(rng.standard_normal(shape).astype(dtype) for shape in ((B, H, N, D), (B, K, S, D), (B, K, S, D)))


def _loss(out, lse, w):
    return jnp.sum(out * w) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w[..., 0])


def compare_feature(kernel, feature, reference_device=None):
    """`(ours, reference)`: the output, log-sum-exp and gradients of q, k, v and the
    captured floating values (a dict) of one feature, on `kernel` (jitted, float32) and
    on conftest's `jax_reference` (float64, on `reference_device` when given)."""
    make, values = FEATURES[feature]
    q, k, v = _inputs()
    w = np.random.default_rng(2).standard_normal((B, H, N, D)).astype(np.float32)

    def ours(q, k, v, vals):
        kw, _ = make(vals)
        out, lse = attention(q, k, v, implementation=kernel, return_residual=True, **kw)
        return _loss(out, lse, w), (out, lse)

    def reference(q, k, v, vals):
        _, ref = make(vals)
        out, lse = jax_reference(q, k, v, return_lse=True, **{n: jnp.asarray(x) for n, x in ref.items()})
        return _loss(out, lse, w), (out, lse)

    f32 = {n: jnp.asarray(x, jnp.float32) for n, x in values.items()}
    (_, got), grads = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, f32)
    with x64(), jax.default_device(reference_device or jax.devices()[0]):
        f64 = {n: jnp.asarray(x, jnp.float64) for n, x in values.items()}
        (_, want), want_grads = jax.jit(jax.value_and_grad(reference, argnums=(0, 1, 2, 3), has_aux=True))(
            *(jnp.asarray(x, jnp.float64) for x in (q, k, v)), f64)
    return (got, grads), (want, want_grads)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_kernel_equals_the_float64_reference(kernel, feature):
    """Output, log-sum-exp and the gradients of q, k, v and the captured floating values."""
    got, want = compare_feature(kernel, feature)
    assert set(got[1][3]) == set(FEATURES[feature][1])  # every captured floating value took a gradient
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, atol=f32_tolerance(terms=TERMS, magnitude=b[np.isfinite(b)]))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_precision_gradients_stay_within_the_reference_error_at_sharp_logits(dtype):
    """q and k scaled by 60 (logits in the thousands): the kernel's gradients are no
    further from float64 than the same math in plain JAX at the same input dtype."""
    q, k, v = (jnp.asarray(x) for x in _inputs())
    q, k = q * 60, k * 60
    w = jnp.asarray(np.random.default_rng(3).standard_normal((B, H, N, D)), jnp.float32)
    half = lambda x: x.astype(dtype)

    def ours(q, k, v):
        return jnp.sum(attention(q, k, v, implementation="pallas_gpu", is_causal=True).astype(jnp.float32) * w)

    def plain(q, k, v):
        allowed = np_allowed((B, H, N, S), is_causal=True)
        return jnp.sum(jax_reference(q, k, v, allowed=allowed).astype(jnp.float32) * w)

    # Each gradient as one program (eagerly, every operation around the kernel compiles).
    got = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(*map(half, (q, k, v)))
    base = jax.jit(jax.grad(plain, argnums=(0, 1, 2)))(*map(half, (q, k, v)))
    with x64():
        exact = jax.jit(jax.grad(plain, argnums=(0, 1, 2)))(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)))
    for name, a, b, e in zip("qkv", got, base, exact):
        e = np.asarray(e)
        err = np.max(np.abs(np.asarray(a, np.float64) - e))
        base_err = np.max(np.abs(np.asarray(b, np.float64) - e))
        eps = float(jnp.finfo(dtype).eps)
        assert err <= 2 * base_err + 4 * eps * np.max(np.abs(e)), (name, err, base_err)


def test_a_schedule_built_once_serves_every_layer(monkeypatch):
    """`jax_mha.block_schedule` built once (from shape structs) and given to two layers:
    the same values as each layer building its own, and no layer builds one."""
    import jax_mha
    from jax_mha.paths import schedules

    q, k, _ = (jnp.asarray(x) for x in _inputs())
    docs = jnp.asarray(np.sort(np.random.default_rng(4).integers(0, 4, (B, S)), axis=-1))
    mask_mod = lambda b, h, i, j: docs[b, i + OFFSET] == docs[b, j]
    schedule = jax_mha.block_schedule(jax.ShapeDtypeStruct(q.shape, q.dtype), k, is_causal=True, mask_mod=mask_mod)

    def layers(q, k, schedule):
        x = q
        for _ in range(2):
            x = attention(x, k, k, is_causal=True, mask_mod=mask_mod, implementation="pallas_gpu",
                          block_schedule=schedule)
        return x

    built = []
    original = schedules.build_schedule
    monkeypatch.setattr(schedules, "build_schedule", lambda *a, **kw: built.append(1) or original(*a, **kw))
    shared = jax.jit(layers)(q, k, schedule)
    assert not built  # every layer read the one given
    own = jax.jit(lambda q, k: layers(q, k, None))(q, k)
    assert built
    chex.assert_trees_all_close(shared, own, atol=1e-6)


def test_a_schedule_of_other_lengths_or_not_a_schedule_is_refused():
    import jax_mha

    q, k, v = (jnp.asarray(x) for x in _inputs())
    schedule = jax_mha.block_schedule(q[..., :50, :], k, is_causal=True)
    with pytest.raises(ValueError, match="built for N=50, S=131; this call has N=97, S=131"):
        attention(q, k, v, is_causal=True, block_schedule=schedule)
    with pytest.raises(TypeError, match="block_schedule must be the result of jax_mha.block_schedule, got dict"):
        attention(q, k, v, block_schedule={})


@pytest.mark.parametrize("kernel", KERNELS)
def test_decoding_chunks_at_a_traced_cache_index_run_on_the_kernel(kernel):
    """A prefill then chunks of two rows through the cache under jit (the query offset
    is the traced cache index): the kernel takes the steps, with a mod, a window and
    sinks, and equals the same steps on `"xla"`."""
    from jax_mha import _attend

    q, k, v = (jnp.asarray(x[:1, :, :13]) for x in _inputs())
    slopes = jnp.asarray(np.linspace(0.1, 0.9, H), jnp.float32)
    kw = dict(score_mod=lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j), local_window_size=(6, 0),
              sinks=slopes)

    def steps(implementation):
        cache = _attend.Cache(jnp.zeros_like(k), jnp.zeros_like(v), jnp.zeros((), jnp.int32), None)
        step = jax.jit(lambda q, k, v, cache: _attend.attend(q, k, v, cache=cache, implementation=implementation,
                                                            **kw)[::2])
        outs = []
        for lo, hi in [(0, 5), (5, 7), (7, 9), (9, 11), (11, 13)]:
            out, cache = step(q[..., lo:hi, :], k[..., lo:hi, :], v[..., lo:hi, :], cache)
            outs.append(out)
        return jnp.concatenate(outs, axis=-2)

    chex.assert_trees_all_close(steps(kernel), steps("xla"), atol=f32_tolerance(terms=TERMS, magnitude=1.0))


@pytest.mark.parametrize("shape, varying", [((5, 7), (1,)), ((3, 4, 5), (0, 2)), ((2, 40), (1,)), ((4, 100), (1,))])
def test_a_read_of_a_few_entries_adds_its_cotangent_entry_by_entry(shape, varying):
    """`kernel_mods._per_entry` (the sums a GPU adds atomically, one per entry) adds up
    to the same gradient as adding every element's cotangent at its index; a read of
    more than `PER_ENTRY_MAX` entries (`(4, 100)`) is left element by element."""
    from jax_mha.paths import kernel_mods

    rng = np.random.default_rng(sum(shape))
    tile = (11, 13)
    parts = tuple(jnp.asarray(rng.integers(0, dim, tile), jnp.int32) if a in varying
                  else jnp.full((1, 1), rng.integers(0, dim), jnp.int32) for a, dim in enumerate(shape))
    indices = tuple(jnp.broadcast_to(p, tile) for p in parts)
    ct = jnp.asarray(rng.standard_normal(tile), jnp.float32)
    read = kernel_mods.Read(0, indices, ct, parts)
    got_indices, got_ct = kernel_mods._per_entry(read, shape, ct)
    entries = int(np.prod([shape[a] for a in varying]))
    chex.assert_shape(got_ct, tile if entries > kernel_mods.PER_ENTRY_MAX else (1, 1 << (entries - 1).bit_length()))
    want = np.zeros(shape)
    np.add.at(want, tuple(np.asarray(i) for i in indices), np.asarray(ct, np.float64))
    got = np.zeros(shape)
    np.add.at(got, tuple(np.asarray(jnp.broadcast_to(i, got_ct.shape)) for i in got_indices), np.asarray(got_ct))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_head_index_stays_one_value_when_jnp_broadcasts_it():
    """`table[h, bucket(kv - q)]`: jnp broadcasts the `(1, 1)` head to the tile before
    gathering; the read must still record it as one value, so that its gradient is
    added per table entry (`_per_entry`), not per pair of the tile."""
    from jax_mha.paths import engine, kernel_mods

    table = jnp.asarray(np.random.default_rng(3).standard_normal((5, 32)), jnp.float32)
    mod = lambda s, b, h, q, kv: s + table[h, jnp.clip(kv - q, 0, 31)]
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    traced, consts = engine.trace_mod(mod, jax.ShapeDtypeStruct((8, 16), jnp.float32), i32(1, 1), i32(1, 1),
                                      i32(8, 1), i32(1, 16))
    args = (jnp.zeros((8, 16)), jnp.zeros((1, 1), jnp.int32), jnp.full((1, 1), 3, jnp.int32),
            jnp.arange(8)[:, None], jnp.arange(16)[None, :])
    out, (read,) = kernel_mods.evaluate(traced, consts, args)
    chex.assert_shape(read.parts[0], (1, 1))
    chex.assert_shape(read.parts[1], (8, 16))
    np.testing.assert_array_equal(out, mod(*args))
    indices, sums = kernel_mods._per_entry(read, table.shape, jnp.ones((8, 16)))
    chex.assert_shape(sums, (1, 32))
    np.testing.assert_array_equal(np.asarray(indices[0]), 3)


def test_broadcast_indices_evaluate_like_the_mod_wherever_they_are_used():
    """A broadcast head index used beyond an elementwise gather (in the index array of
    a gather of whole rows, or in arithmetic) evaluates as the plain mod does."""
    from jax_mha.paths import engine, kernel_mods

    table = jnp.asarray(np.random.default_rng(5).standard_normal((5, 32)), jnp.float32)
    rows = jnp.asarray(np.random.default_rng(7).standard_normal((5, 8, 16)), jnp.float32)
    mods = [lambda s, b, h, q, kv: s + rows[h, q][:, 0, :],  # a gather of whole rows: its index used whole
            lambda s, b, h, q, kv: s * (h + 1) + table[h, jnp.clip(kv - q, 0, 31)] * (b + 2)]
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    args = (jnp.asarray(np.random.default_rng(6).standard_normal((8, 16)), jnp.float32),
            jnp.full((1, 1), 1, jnp.int32), jnp.full((1, 1), 3, jnp.int32), jnp.arange(8)[:, None],
            jnp.arange(16)[None, :])
    for mod in mods:
        traced, consts = engine.trace_mod(mod, jax.ShapeDtypeStruct((8, 16), jnp.float32), i32(1, 1), i32(1, 1),
                                          i32(8, 1), i32(1, 16))
        out, _ = kernel_mods.evaluate(traced, consts, args)
        np.testing.assert_allclose(out, mod(*args), rtol=1e-6)
