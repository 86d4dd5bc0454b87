"""The Pallas kernel paths (`pallas_tpu` = splash, `pallas_gpu` = the library's kernel) in Pallas
interpret mode against the float64 reference, on tiny prime-sized shapes that still
cover several blocks, padding, chunking and offsets. Each kernel's `run` is checked as
the dispatcher uses it (rows with no visible key zeroed afterwards); `refusal` is
checked part by part; `attention(implementation=...)` end to end (NaN isolation,
caching across traces). Lowering for the real devices: tests/paths/test_lowering.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import f32_tolerance, jax_reference, np_allowed, np_attention, x64

from jax_mha import _masking, attention
from jax_mha.paths import pallas_gpu, pallas_tpu

KERNELS = {"pallas_tpu": pallas_tpu, "pallas_gpu": pallas_gpu}
SCALE = 0.3


def _vis(batch, h, n, s, *, is_causal=False, window=None, q_ids=None, kv_ids=None, q_lengths=None, kv_lengths=None,
         **extra):
    """The description `attention` would build for these parts."""
    rank = len(batch)
    q_seg, kv_seg = _masking.segments_at_rank(None if q_ids is None else jnp.asarray(q_ids),
                                              None if kv_ids is None else jnp.asarray(kv_ids), rank)
    return _masking.Visibility(
        n, s, is_causal, _masking.canonical_window(window), q_segment_ids=q_seg, kv_segment_ids=kv_seg,
        q_lengths=_masking.lengths_at_rank(q_lengths, rank), kv_lengths=_masking.lengths_at_rank(kv_lengths, rank),
        batch_shape=tuple(batch), num_heads=h, **extra)


def _inputs(rng, batch, h, kh, n, s, d=16, dv=None):
    q = rng.standard_normal((*batch, h, n, d)).astype(np.float32)
    k = rng.standard_normal((*batch, kh, s, d)).astype(np.float32)
    v = rng.standard_normal((*batch, kh, s, dv or d)).astype(np.float32)
    return q, k, v


def _dispatched(mod, q, k, v, vis):
    """`run` as the dispatcher uses it: refusal None first, rows with no key zeroed after."""
    call = _masking.Call(q, k, v)
    assert mod.refusal(vis, call) is None
    if mod is pallas_gpu:  # a path's run (the library's kernel)
        run = lambda q, k, v: mod.run(q, k, v, jnp.zeros(k.shape[:-1], bool), vis, call, scale=SCALE)[0].astype(q.dtype)
    else:  # splash's kernel function
        run = lambda q, k, v: mod.run(q, k, v, vis, scale=SCALE, interpret=True)
    out = jax.jit(run)(q, k, v)  # one program: eagerly, each operation around the kernel compiles apart
    assert out.shape == q.shape[:-1] + v.shape[-1:] and out.dtype == q.dtype
    empty, _ = _masking.dense_rows(vis, jnp.zeros(k.shape[:-1], bool), q.shape[-3])
    return jnp.where(empty[..., None], 0.0, out.astype(jnp.float32))


def _forward_terms(d, s):
    """The float32 sums of one attention, for the tolerances: the logits over D, the
    softmax sum and weights @ v over the S keys."""
    return d + 2 * s


def _backward_terms(d, n, s, group):
    """The forward's sums and the backward's: over D, the keys, and the rows of the
    `group` query heads that share a key head."""
    return _forward_terms(d, s) + d + s + n * group


def _np_offset_allowed(n, s, offset, is_causal, window):
    """`(N, S)` pattern with query i at key position i + offset, in NumPy."""
    pos, key = np.arange(n)[:, None] + offset, np.arange(s)[None, :]
    ok = np.ones((n, s), bool)
    if is_causal:
        ok &= key <= pos
    if window is not None:
        ok &= (key >= pos - window[0]) & (key <= pos + window[1])
    return ok


def _segments(rng, batch, n, s, kind):
    if kind == "packed":  # self-attention, three documents
        ids = np.broadcast_to(np.repeat(np.arange(3), [n // 4, n // 2, n - n // 4 - n // 2]), (*batch, n))
        return ids, ids
    return rng.integers(0, 3, (*batch, n)), rng.integers(0, 3, (*batch, s))


# (kernel, batch, H, K, N, S, parts, why): each kernel only for what it expresses.
CASES = [
    ("pallas_tpu", (1,), 4, 2, 37, 131, dict(is_causal=True), "GQA, S > N bottom-right, two key blocks"),
    ("pallas_tpu", (1,), 3, 1, 131, 131, dict(is_causal=True, window=(20, None)), "MQA, left window, two blocks"),
    ("pallas_tpu", (2,), 2, 1, 67, 41, dict(segments="distinct", q_lengths=(50, 67), kv_lengths=(41, 19), dv=8),
     "distinct q/kv ids, both lengths, Dv != D"),
    ("pallas_tpu", (1,), 2, 2, 29, 61, dict(is_causal=True, window=(7, 3), q_offset=-3), "static offset, empty rows"),
    ("pallas_gpu", (1,), 2, 1, 37, 17, {}, "N > S, padded keys: query chunks folded into the batch"),
    ("pallas_gpu", (1,), 2, 2, 64, 32, {}, "N > S, no key padding (was: half the rows wrong)"),
    ("pallas_gpu", (1,), 2, 2, 17, 37, dict(is_causal=True), "causal S > N: dummy queries in front"),
    ("pallas_gpu", (2,), 4, 2, 41, 41, dict(is_causal=True, segments="packed", q_lengths=(41, 30)),
     "GQA, packed documents, q_lengths"),
    ("pallas_gpu", (1,), 2, 1, 13, 37, dict(is_causal=True, q_offset=10), "static offset inside the keys"),
]


@pytest.mark.parametrize("name,batch,h,kh,n,s,parts,why", CASES, ids=[f"{c[0]}-{c[4]}x{c[5]}" for c in CASES])
def test_forward_matches_float64(rng, name, batch, h, kh, n, s, parts, why):
    parts = dict(parts)
    q, k, v = _inputs(rng, batch, h, kh, n, s, dv=parts.pop("dv", None))
    kind = parts.pop("segments", None)
    if kind:
        parts["q_ids"], parts["kv_ids"] = _segments(rng, batch, n, s, kind)
    for key in ("q_lengths", "kv_lengths"):
        if key in parts:
            parts[key] = np.asarray(parts[key])
    offset = parts.pop("q_offset", None)
    allowed = np_allowed((*batch, h, n, s), is_causal=parts.get("is_causal", False), window=parts.get("window"),
                         q_lengths=parts.get("q_lengths"), kv_lengths=parts.get("kv_lengths"),
                         q_segment_ids=parts.get("q_ids"), kv_segment_ids=parts.get("kv_ids"))
    if offset is not None:
        allowed = np.broadcast_to(_np_offset_allowed(n, s, offset, parts.get("is_causal"), parts.get("window")),
                                  allowed.shape)
    out = _dispatched(KERNELS[name], q, k, v, _vis(batch, h, n, s, q_offset=offset, **parts))
    want, _ = np_attention(q, k, v, mask=allowed, scale=SCALE)
    np.testing.assert_allclose(np.asarray(out), want, atol=f32_tolerance(terms=_forward_terms(q.shape[-1], s),
                                                                         magnitude=want), err_msg=why)
    assert allowed.any()


GRAD_CASES = [
    ("pallas_tpu", (2,), 4, 2, 37, 131, dict(is_causal=True, segments="distinct", kv_lengths=(131, 100))),
    ("pallas_gpu", (1,), 2, 1, 37, 17, {}),  # query chunks: the keys' gradient sums over them
    ("pallas_gpu", (2,), 4, 2, 41, 41, dict(is_causal=True, segments="packed")),
]


@pytest.mark.parametrize("name,batch,h,kh,n,s,parts", GRAD_CASES, ids=[f"{c[0]}-{c[4]}x{c[5]}" for c in GRAD_CASES])
def test_gradients_match_float64_under_x64(rng, name, batch, h, kh, n, s, parts):
    """Under jax_enable_x64 (float32 inputs): both kernels used to raise `lax.div
    requires arguments to have the same dtypes, got int32, int64` there."""
    parts = dict(parts)
    q, k, v = _inputs(rng, batch, h, kh, n, s)
    if parts.pop("segments", None):
        parts["q_ids"], parts["kv_ids"] = _segments(rng, batch, n, s, "packed" if n == s else "distinct")
    if "kv_lengths" in parts:
        parts["kv_lengths"] = np.asarray(parts["kv_lengths"])
    allowed = np_allowed((*batch, h, n, s), is_causal=parts.get("is_causal", False),
                         kv_lengths=parts.get("kv_lengths"), q_segment_ids=parts.get("q_ids"),
                         kv_segment_ids=parts.get("kv_ids"))
    ct = rng.standard_normal(q.shape)
    with x64():
        vis = _vis(batch, h, n, s, **parts)
        got = jax.jit(jax.grad(lambda *a: jnp.sum(_dispatched(KERNELS[name], *a, vis) * ct), argnums=(0, 1, 2)))(
            q, k, v)
        want = jax.jit(jax.grad(lambda *a: jnp.sum(jax_reference(*a, jnp.asarray(allowed), scale=SCALE) * ct),
                                argnums=(0, 1, 2)))(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)))
    for g, w in zip(got, want):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(g), np.asarray(w),
                                   atol=f32_tolerance(terms=_backward_terms(16, n, s, h // kh), magnitude=w))


def test_tpu_sinks_match_float64(rng):
    """Attention sinks (splash's own argument), some beyond the soft-cap (a sink is not
    capped): output and the gradients to q, k, v and the sinks against the float64
    reference with one more key of logit sinks[h] and value zero; GQA, distinct q/kv
    segment ids, both lengths, rows that see no key (the dispatcher zeroes them)."""
    batch, h, kh, n, s = (2,), 4, 2, 37, 131
    q, k, v = _inputs(rng, batch, h, kh, n, s)
    q_ids, kv_ids = _segments(rng, batch, n, s, "distinct")
    parts = dict(is_causal=True, q_ids=q_ids, kv_ids=kv_ids, q_lengths=np.array([30, 37]),
                 kv_lengths=np.array([131, 100]), logits_soft_cap=1.0)
    allowed = jnp.asarray(np_allowed((*batch, h, n, s), is_causal=True, q_lengths=parts["q_lengths"],
                                     kv_lengths=parts["kv_lengths"], q_segment_ids=q_ids, kv_segment_ids=kv_ids))
    sinks = np.array([1.5, -2.0, 0.3, 3.0], np.float32)
    ct = rng.standard_normal(q.shape)

    def out_and_grads(f):
        def run(*args):
            out, pull = jax.vjp(f, *args)
            return out, pull(jnp.asarray(ct, out.dtype))

        return jax.jit(run)

    with x64():
        ours = lambda q, k, v, sinks: _dispatched(pallas_tpu, q, k, v, _vis(batch, h, n, s, sinks=sinks, **parts))
        ref = lambda q, k, v, sinks: jax_reference(q, k, v, allowed, scale=SCALE, cap=1.0, sinks=sinks)
        out, grads = out_and_grads(ours)(q, k, v, sinks)
        wide = [jnp.asarray(x, jnp.float64) for x in (q, k, v, sinks)]
        want, want_grads = out_and_grads(ref)(*wide)
        capped_sinks = jax_reference(*wide[:3], allowed, scale=SCALE, cap=1.0, sinks=jnp.tanh(wide[3]))
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=f32_tolerance(terms=_forward_terms(16, s),
                                                                                     magnitude=want))
    assert np.abs(np.asarray(capped_sinks - want)).max() > 1e-2  # capping the sinks would have been seen
    assert not np.asarray(allowed).any(-1).all()  # some rows see no key
    for g, w in zip(grads, want_grads):
        assert g.dtype == jnp.float32
        # the sinks' gradient sums over the batch's rows too
        np.testing.assert_allclose(np.asarray(g), np.asarray(w),
                                   atol=f32_tolerance(terms=_backward_terms(16, n, s, h // kh) + 2 * n, magnitude=w))
    assert np.abs(np.asarray(want_grads[3])).min() > 1e-3  # every head's sink gradient compared


def test_tpu_sinks_gradient_is_float32_for_bfloat16_inputs(rng):
    """Splash returns the sinks' gradient in q's dtype: through `attention` a float32
    `sinks` still gets a float32 gradient, close to the 'xla' path's."""
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _inputs(rng, (1,), 2, 1, 19, 19))
    sinks = jnp.asarray([0.5, -1.0], jnp.float32)
    grad = lambda impl: jax.jit(jax.grad(lambda s: attention(q, k, v, is_causal=True, sinks=s, implementation=impl)
                                         .astype(jnp.float32).sum()))(sinks)
    got, want = grad("pallas_tpu"), grad("xla")
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2)
    assert np.abs(np.asarray(want)).min() > 0.1


def test_tpu_logits_soft_cap_matches_float64(rng):
    # c * tanh(logits / c) on the scaled logits, before masking; a cap of 1 on logits of
    # size ~1..3 moves the output far beyond the tolerance.
    q, k, v = _inputs(rng, (1,), 2, 2, 41, 41)
    out = _dispatched(pallas_tpu, q, k, v, _vis((1,), 2, 41, 41, is_causal=True, logits_soft_cap=1.0))
    logits = np.einsum("bhnd,bhsd->bhns", q.astype(np.float64), k.astype(np.float64)) * SCALE
    causal = np_allowed((1, 2, 41, 41), is_causal=True)
    for capped in (np.tanh(logits), logits):
        w = np.exp(np.where(causal, capped, -np.inf) - capped.max(-1, keepdims=True))
        want = (w / w.sum(-1, keepdims=True)) @ v.astype(np.float64)
        if capped is logits:
            assert np.abs(np.asarray(out) - want).max() > 1e-2  # the cap mattered
        else:
            np.testing.assert_allclose(np.asarray(out), want, atol=f32_tolerance(terms=_forward_terms(16, 41),
                                                                                 magnitude=want))


def _traced(fn):
    """Calls `fn` with a traced int32 scalar (inside a jit trace); its result."""
    box = []
    jax.jit(lambda o: box.append(fn(o)) or o)(jnp.int32(0))
    return box[0]


STRUCT = jax.ShapeDtypeStruct
BOTH_REFUSE = [
    ("dense mask", dict(mask=jnp.ones((1, 1, 7, 11), bool)), {}),
    ("return_weights", {}, dict(return_weights=True)),
    ("dropout", {}, dict(dropout=True)),
    ("float32, too coarse for float64", {}, dict(dtype=jnp.float64)),
    ("one dtype", {}, dict(k_dtype=jnp.bfloat16)),
    ("H=6, K=4", {}, dict(kh=4)),
]
# Parts only the library's kernel takes: compiled for a TPU, "pallas_tpu" runs splash.
SPLASH_REFUSES = [
    ("bias", dict(bias=jnp.zeros((1, 1, 7, 11))), {}),
    ("score_mod", dict(score_mod=lambda s, b, h, i, j: s), {}),
    ("mask_mod", dict(mask_mod=lambda b, h, i, j: j <= i), {}),
    ("return_residual=True", {}, dict(return_residual=True)),
    ("traced query offset", "traced", {}),
]


def _refusal(name, vis_kw, call_kw, *, n=7, s=11, d=64, platform=None):
    call_kw = dict(call_kw)
    dtype, d = call_kw.pop("dtype", jnp.float32), call_kw.pop("d", d)
    kh, dv = call_kw.pop("kh", 2), call_kw.pop("dv", d)
    q, k = STRUCT((2, 6, n, d), dtype), STRUCT((2, kh, s, d), call_kw.pop("k_dtype", dtype))
    call = _masking.Call(q, k, STRUCT((2, kh, s, dv), dtype), platform=platform or name[len("pallas_"):], **call_kw)
    if vis_kw == "traced":
        return _traced(lambda o: KERNELS[name].refusal(_vis((2,), 6, n, s, is_causal=True, q_offset=o), call))
    return KERNELS[name].refusal(_vis((2,), 6, n, s, **vis_kw), call)


@pytest.mark.parametrize("name", sorted(KERNELS))
@pytest.mark.parametrize("part,vis_kw,call_kw", BOTH_REFUSE, ids=[p for p, _, _ in BOTH_REFUSE])
def test_refusal_names_the_part(name, part, vis_kw, call_kw):
    why = _refusal(name, vis_kw, call_kw)
    assert why is not None and part in why and f"implementation={name!r}" in why and "\n" not in why
    assert "'xla'" in why  # and the path to use instead
    assert _refusal(name, {}, {}) is None


@pytest.mark.parametrize("part,vis_kw,call_kw", SPLASH_REFUSES, ids=[p for p, _, _ in SPLASH_REFUSES])
def test_tpu_takes_what_splash_cannot_take_compiled_and_interpreted(part, vis_kw, call_kw):
    """The library's kernel (its Mosaic form) takes them on a TPU (test_flex_tpu)."""
    assert _refusal("pallas_tpu", vis_kw, call_kw) is None
    assert _refusal("pallas_tpu", vis_kw, call_kw, platform="cpu") is None
    assert _refusal("pallas_gpu", vis_kw, call_kw) is None


@pytest.mark.parametrize("part,vis_kw,call_kw", [
    ("head dims up to 256 on a GPU", {}, dict(d=264)),
    ("runs on a GPU", {}, dict(platform="tpu")),
])
def test_gpu_refuses_by_name(part, vis_kw, call_kw):
    call_kw = dict(call_kw)
    why = _refusal("pallas_gpu", vis_kw, call_kw, platform=call_kw.pop("platform", None))
    assert why is not None and part in why, why


def test_gpu_takes_what_the_wrapped_triton_kernel_refused():
    """Windows, kv_lengths, the soft cap, Dv != D, small head dims, distinct or traced
    segment ids for queries and keys, a causal offset past the last key."""
    ids = jnp.zeros((2, 11), jnp.int32)
    for vis_kw, call_kw in [(dict(window=(3, 2)), {}), (dict(kv_lengths=np.array([5, 11])), {}),
                            (dict(logits_soft_cap=5.0), {}), ({}, dict(dv=32)), ({}, dict(d=8)),
                            (dict(q_ids=np.zeros((2, 7), int), kv_ids=np.array([[0, 0, 0, 1] + [0] * 7] * 2)), {}),
                            (dict(is_causal=True, q_offset=5), {})]:
        assert _refusal("pallas_gpu", vis_kw, call_kw) is None, vis_kw
    call = _masking.Call(STRUCT((2, 6, 7, 64), jnp.float32), STRUCT((2, 2, 11, 64), jnp.float32),
                         STRUCT((2, 2, 11, 64), jnp.float32), platform="gpu")
    apart = lambda o: _vis((2,), 6, 7, 11, q_ids=ids[:, :7] + o, kv_ids=ids + 2 * o)
    assert _traced(lambda o: pallas_gpu.refusal(apart(o), call)) is None


def test_gpu_traced_ids_through_attention(rng):
    """Traced ids given once or twice (queries' and keys' apart) run on the kernel."""
    q, k, v = _inputs(rng, (1,), 2, 2, 19, 23)
    q_ids, kv_ids = np.repeat([[0, 1]], 1, 0).repeat([9, 10], 1), np.repeat([[0, 1]], 1, 0).repeat([12, 11], 1)
    f = jax.jit(lambda q, k, v, a, b: attention(q, k, v, q_segment_ids=a, kv_segment_ids=b, implementation="pallas_gpu"))
    want, _ = np_attention(q, k, v, mask=np_allowed((1, 2, 19, 23), q_segment_ids=q_ids, kv_segment_ids=kv_ids))
    np.testing.assert_allclose(np.asarray(f(q, k, v, q_ids, kv_ids)), want,
                               atol=f32_tolerance(terms=_forward_terms(16, 23), magnitude=want))


def test_tpu_refuses_float16_and_accepts_the_rest():
    assert "float16" in _refusal("pallas_tpu", {}, dict(dtype=jnp.float16))
    rich = dict(is_causal=True, window=(3, None), q_ids=np.zeros((2, 7), int), kv_ids=np.ones((2, 11), int),
                kv_lengths=np.array([4, 11]), q_offset=2, logits_soft_cap=5.0, sinks=jnp.zeros(6))
    assert _refusal("pallas_tpu", rich, dict(dv=32, empty_rows="uniform")) is None
    assert _refusal("pallas_gpu", {}, dict(empty_rows="uniform")) is None


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_forward_mode_is_refused_clearly(rng, name):
    # Both kernels are custom_vjp: JAX refuses jvp with a one-line TypeError at trace
    # time (the docstrings quote it), never a trace from inside the kernel.
    q, k, v = _inputs(rng, (1,), 1, 1, 16, 16)
    vis = _vis((1,), 1, 16, 16)
    del vis
    with pytest.raises(TypeError, match="forward-mode autodiff .* custom_vjp"):
        jax.jvp(lambda q: attention(q, k, v, implementation=name), (q,), (q,))


NAN_CASES = {  # a NaN reachable only through keys the description hides from every other row
    "pallas_tpu": dict(q_segment_ids=np.array([[0] * 6 + [1] * 7] * 2), kv_segment_ids=np.array([[0] * 5 + [1] * 6] * 2),
                       kv_lengths=np.array([11, 8])),
    "pallas_gpu": dict(q_segment_ids=np.array([[0] * 5 + [1] * 6] * 2), kv_segment_ids=None, is_causal=True),
}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_attention_isolates_nan_keys(rng, name):
    """Through `jax_mha.attention`: a NaN in a key past kv_lengths (tpu) or in another
    document's key (both) reaches no row outside the NaN's own document."""
    kw = NAN_CASES[name]
    n = kw["q_segment_ids"].shape[1]
    s = n if kw["kv_segment_ids"] is None else kw["kv_segment_ids"].shape[1]
    q, k, v = _inputs(rng, (2,), 4, 2, n, s)
    k[0, :, 1] = np.nan  # document 0 of sequence 0
    if "kv_lengths" in kw:
        v[1, :, 9] = np.inf  # past sequence 1's kv_lengths
    kw = {key: value for key, value in kw.items() if value is not None}
    arrays = {key: jnp.asarray(value) for key, value in kw.items() if not isinstance(value, bool)}
    out = jax.jit(lambda q, k, v, a: attention(q, k, v, implementation=name, is_causal="is_causal" in kw, **a))(
        q, k, v, arrays)
    out = np.asarray(out)
    allowed = np_allowed((2, 4, n, s), is_causal=kw.get("is_causal", False), kv_lengths=kw.get("kv_lengths"),
                         q_segment_ids=kw["q_segment_ids"], kv_segment_ids=kw.get("kv_segment_ids"))
    nan_rows = allowed[..., 1] & np.array([True, False])[:, None, None]  # the rows that may see key 1 of sequence 0
    assert np.array_equal(np.isnan(out).any(-1), nan_rows)
    want, _ = np_attention(q, np.nan_to_num(k), np.nan_to_num(v, posinf=0.0), mask=allowed)
    np.testing.assert_allclose(np.where(nan_rows[..., None], 0, out), np.where(nan_rows[..., None], 0, want),
                               atol=f32_tolerance(terms=_forward_terms(16, s), magnitude=want))


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_attention_dispatches_to_the_kernel_across_traces(name):
    """`attention(implementation=name)` under two jits of the same shapes, the second
    vmapped over a leading batch axis: the cached splash kernel must not carry the
    first trace's tracers into the second."""
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.standard_normal((2, 4, 32, 16)), jnp.float32)
    k = v = jnp.asarray(rng.standard_normal((2, 2, 32, 16)), jnp.float32)
    ids = jnp.asarray(np.repeat(np.arange(2), 16)[None].repeat(2, 0))
    got = jax.jit(lambda q, k, v: attention(q, k, v, is_causal=True, implementation=name))(q, k, v)
    want, _ = np_attention(q, k, v, mask=np_allowed((2, 4, 32, 32), is_causal=True))
    np.testing.assert_allclose(got, want, atol=f32_tolerance(terms=_forward_terms(16, 32), magnitude=want))
    seg = jax.jit(jax.vmap(lambda q, k, v, i: attention(q, k, v, is_causal=True, q_segment_ids=i, implementation=name)))
    got = seg(q[:, None], k[:, None], v[:, None], ids[:, None])[:, 0]
    want, _ = np_attention(q, k, v, mask=np_allowed((2, 4, 32, 32), is_causal=True, q_segment_ids=ids))
    np.testing.assert_allclose(got, want, atol=f32_tolerance(terms=_forward_terms(16, 32), magnitude=want))
