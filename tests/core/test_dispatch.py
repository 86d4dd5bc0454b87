"""`jax_mha._dispatch`: the "auto" chain per platform read from each path's one
refusal, explicit choices raising that refusal, and the steps every path shares (NaN
isolation, empty rows, padding rows) around a kernel that knows nothing of them."""

from __future__ import annotations

import dataclasses
import itertools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import f32_tolerance, np_allowed, np_attention

from jax_mha import _dispatch, _masking, attention
from jax_mha._path import EVERY_PART
from jax_mha.paths import cudnn, kernel_common
from jax_mha.paths.dense import reference_weights

B, H, K, N, S, D = 2, 6, 3, 7, 11, 5
# The float32 sums of one attention call, for the tolerances against the float64
# references: the logits over D, the softmax sum and weights @ v over the S keys;
# backward adds sums over D, the keys and the rows of the H/K heads sharing a key head.
FORWARD_TERMS = D + 2 * S
BACKWARD_TERMS = FORWARD_TERMS + D + S + N * (H // K)


def structs(dtype=jnp.float32, n=N, s=S, d=D):
    q = jax.ShapeDtypeStruct((B, H, n, d), dtype)
    k = jax.ShapeDtypeStruct((B, K, s, d), dtype)
    return q, k, k


def fake_kernel(refuses=None):
    """A stand-in kernel module: refuses with `refuses` (or takes everything) and runs
    plain softmax attention over the description's pattern, with no NaN handling and
    arbitrary output on empty rows (what a fused kernel gives)."""
    seen = {}

    def run(q, k, v, vis, *, scale, interpret):
        seen.update(vis=vis, interpret=interpret)
        # A named kernel runs staged (one jitted branch per platform): read the inputs when it runs.
        jax.debug.callback(lambda ok: seen.update(finite=bool(ok)), jnp.all(jnp.isfinite(q)) & jnp.all(jnp.isfinite(v)))
        allowed = _masking.dense_allowed(vis, q.ndim)
        weights, _ = reference_weights(q, k, allowed, scale=scale)  # (weights, empty)
        weights = jnp.where(jnp.any(allowed, -1, keepdims=True), weights, 1.0 / k.shape[-2])  # garbage on empty rows
        return jnp.einsum("bhns,bhsd->bhnd", weights, jnp.repeat(v, q.shape[1] // v.shape[1], axis=1))

    return types.SimpleNamespace(refusal=lambda vis, call: refuses, run=run, seen=seen)


def install(monkeypatch, fakes, absent=None):
    """Swaps the registered Pallas paths for the fake kernels `fakes` (by name; the rest
    get `absent`): each takes every part, refuses with its `refusal` and runs its `run`
    as the path's kernel, on the path's own platforms."""
    for name, path in _dispatch.REGISTRY.items():
        if not path.platforms or name == "cudnn":
            continue
        fake = fakes.get(name, absent)
        if fake is None:
            continue
        swapped = dataclasses.replace(path, run=kernel_common.kernel_run(fake.run), takes=EVERY_PART,
                                      limits=lambda vis, call, fake=fake: fake.refusal(vis, call), decode=None)
        monkeypatch.setitem(_dispatch.REGISTRY, name, swapped)


@pytest.mark.parametrize("platform, dtype, kernels, kw, expected", [
    ("cpu", jnp.float32, {}, {}, "xla"),
    ("cpu", jnp.bfloat16, {}, {}, "blockwise"),  # half precision: the engine, never the whole float32 scores
    ("tpu", jnp.float32, {"pallas_tpu": None}, {}, "pallas_tpu"),
    ("tpu", jnp.float32, {"pallas_tpu": "no"}, {}, "xla"),
    ("tpu", jnp.float32, {"pallas_tpu": None}, {"return_weights": True}, "xla"),  # the kernel's own refusal decides
    ("gpu", jnp.bfloat16, {"pallas_gpu": None}, {}, "cudnn"),
    ("gpu", jnp.float32, {"pallas_gpu": None}, {}, "pallas_gpu"),  # cuDNN refuses float32
    ("gpu", jnp.float32, {"pallas_gpu": "no"}, {}, "xla"),
    ("gpu", jnp.bfloat16, {"pallas_gpu": "no"}, {"dropout": True}, "xla"),  # cuDNN refuses dropout
])
def test_auto_walks_the_platform_chain(monkeypatch, platform, dtype, kernels, kw, expected):
    fakes = {path: fake_kernel(why) for path, why in kernels.items()}
    if "return_weights" in kw:
        fakes["pallas_tpu"].refusal = lambda vis, call: "weights" if call.return_weights else None
    absent = fake_kernel("not this test's kernel")
    install(monkeypatch, fakes, absent)
    q, k, v = structs(dtype, d=64)
    call = _masking.Call(q, k, v, platform=platform, **kw)
    assert _dispatch.choose(_masking.Visibility(N, S), call, "auto") == expected
    assert _dispatch.choose(_masking.Visibility(N, S), call, None) == expected


def test_explicit_choice_raises_the_paths_refusal(rng):
    q = jnp.asarray(rng.standard_normal((B, H, N, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, K, S, D)), jnp.float32)
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match=r"implementation='cudnn' needs a GPU, this call runs on 'cpu'"):
            attention(q, k, k, implementation="cudnn")
    with pytest.raises(ValueError, match=r"return_weights=True needs implementation='xla'"):
        attention(q, k, k, implementation="blockwise", return_weights=True)
    with pytest.raises(ValueError, match=r"implementation must be one of .* got 'flash'"):
        attention(q, k, k, implementation="flash")


@pytest.mark.parametrize("part, vis_kw, call_kw", [
    ("score_mod", {"score_mod": lambda s, b, h, i, j: s}, {}),
    ("logits_soft_cap", {"logits_soft_cap": 3.0}, {}),
    ("float16 or bfloat16", {}, {"dtype": jnp.float32}),
    ("head_dim <= 128", {}, {"d": 136}),
    ("return_weights", {}, {"return_weights": True}),
    ("dropout", {}, {"dropout": True}),
    ("query offset", {"q_offset": 3}, {}),
])
def test_cudnn_refusal_names_the_part(part, vis_kw, call_kw):
    from jax_mha.paths import cudnn

    options = dict(call_kw)
    dtype, d = options.pop("dtype", jnp.bfloat16), options.pop("d", 64)
    call = _masking.Call(*structs(dtype, d=d), platform="gpu", **options)
    good = _masking.Call(*structs(jnp.bfloat16, d=64), platform="gpu")
    assert cudnn.refusal(_masking.Visibility(N, S), good) is None
    assert cudnn.refusal(_masking.Visibility(N, S, mask_mod=lambda b, h, i, j: j <= i), good) is None  # a dense mask
    assert part in cudnn.refusal(_masking.Visibility(N, S, **vis_kw), call)


def test_kernel_paths_share_the_nan_isolation_and_empty_rows(rng, monkeypatch):
    """A kernel that leaves NaN handling, empty rows and padding rows to the
    dispatcher: a NaN in a key past `kv_lengths` or in another document reaches no
    row, rows with no key are zeros (or the mean of v), rows past `q_lengths` zeros."""
    fake = fake_kernel()
    install(monkeypatch, {}, fake)
    q = rng.standard_normal((B, H, N, D))
    k, v = rng.standard_normal((B, K, S, D)), rng.standard_normal((B, K, S, D))
    q_ids = np.array([[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 2, 2, 2]])
    kv_ids = np.array([[0] * 5 + [1] * 6, [0, 0, 1, 1, 1, 1, 1, 1, 3, 3, 3]])
    kv_lengths, q_lengths = np.array([S, 9]), np.array([N, 5])
    v[0, :, 2] = np.nan  # document 0 of sequence 0: seen by its rows only
    k[1, :, 10] = np.inf  # past sequence 1's kv_lengths: seen by no row
    kw = dict(q_segment_ids=q_ids, kv_segment_ids=kv_ids, kv_lengths=kv_lengths, q_lengths=q_lengths)
    allowed = np_allowed((B, H, N, S), **kw)
    for empty_rows in ("zero", "uniform"):
        out = np.asarray(attention(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), implementation="pallas_tpu",
                                   empty_rows=empty_rows, **kw))
        assert fake.seen["interpret"] and fake.seen["finite"]
        clean_v = np.where(np.isfinite(v), v, 0.0)
        want, _ = np_attention(q, np.where(np.isfinite(k), k, 0.0), clean_v, mask=allowed)
        nan_rows = np.zeros((B, H, N), bool)
        nan_rows[0, :, :3] = True  # document 0 rows of sequence 0 see the NaN value
        empty = ~allowed.any(-1) & (np.arange(N) < q_lengths[:, None, None])  # sequence 1, document 2
        if empty_rows == "uniform":
            nan_rows[1] |= empty[1]  # a uniform row averages every value of its sequence, the inf key's too
        assert np.array_equal(np.isnan(out).any(-1), nan_rows)
        if empty_rows == "uniform":
            want = np.where(empty[..., None], np.repeat(clean_v.mean(-2, keepdims=True), H // K, 1), want)
        np.testing.assert_allclose(np.where(nan_rows[..., None], 0, out), np.where(nan_rows[..., None], 0, want),
                                   atol=f32_tolerance(terms=FORWARD_TERMS, magnitude=want))


# --- "auto" chooses by the platform the computation is lowered for -------------------


def garbage_kernel():
    """A kernel module that takes every call and returns 7s (any of its output shows),
    recording the `interpret` flag of each call."""
    seen = []

    def run(q, k, v, vis, *, scale, interpret):
        seen.append(interpret)
        return jnp.full(q.shape[:-1] + v.shape[-1:], 7.0, q.dtype)

    return types.SimpleNamespace(refusal=lambda vis, call: None, run=run, seen=seen)


def test_auto_chooses_for_every_lowering_platform(monkeypatch):
    """The string is the call platform's choice; `per_platform` walks each lowering
    platform's chain with its own refusals. cuDNN stays out of the CUDA branch unless
    the default backend is a CUDA GPU (jax.nn reads the GPU while it traces)."""
    fakes = {"pallas_tpu": fake_kernel(None), "pallas_gpu": fake_kernel("no")}
    fakes["pallas_tpu"].refusal = lambda vis, call: None if call.platform == "tpu" else "tpu only"
    install(monkeypatch, fakes)
    vis, call = _masking.Visibility(N, S), _masking.Call(*structs(jnp.bfloat16, d=64), platform="gpu")
    choice = _dispatch.choose(vis, call, "auto")
    assert choice == "cudnn" and isinstance(choice, str)  # what a GPU host runs and reports
    assert choice.per_platform == {"cpu": "blockwise", "cuda": "blockwise", "rocm": "blockwise", "tpu": "pallas_tpu",
                                   None: "blockwise"}
    # A CUDA host (jax.default_backend() says "gpu" there, as on ROCm; seen on an H200).
    monkeypatch.setattr(cudnn, "this_gpu", lambda: ("cuda", (9, 0)))
    assert _dispatch.choose(vis, call, "auto").per_platform["cuda"] == "cudnn"
    assert _dispatch.choose(vis, call, "auto").per_platform["rocm"] == "blockwise"  # cuDNN is NVIDIA's
    monkeypatch.setattr(cudnn, "this_gpu", lambda: ("rocm", (9, 4)))
    assert _dispatch.choose(vis, call, "auto").per_platform["cuda"] == "blockwise"
    assert type(_dispatch.choose(vis, call, "blockwise")) is str  # an explicit choice is taken as it is


def test_auto_runs_this_platforms_branch_and_stages_the_kernels(monkeypatch, rng):
    """On this CPU a jitted "auto" call runs the pure-JAX branch (the kernel's 7s never
    show) while the kernels are traced into their platforms' branches compiled, never
    interpreted; an eager call runs its own branch only and traces no kernel."""
    fake = garbage_kernel()
    install(monkeypatch, {}, fake)
    _dispatch._kernel_branch.clear_cache()  # its cache does not know the module was swapped
    q = rng.standard_normal((B, H, N, D))
    k, v = rng.standard_normal((B, K, S, D)), rng.standard_normal((B, K, S, D))
    want, _ = np_attention(q, k, v, mask=np_allowed((B, H, N, S), is_causal=True))
    f = lambda q, k, v: attention(q, k, v, is_causal=True, implementation="auto")
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    np.testing.assert_allclose(f(*args), want, atol=f32_tolerance(terms=FORWARD_TERMS, magnitude=want))
    assert fake.seen == []
    np.testing.assert_allclose(jax.jit(f)(*args), want, atol=f32_tolerance(terms=FORWARD_TERMS, magnitude=want))
    assert len(fake.seen) == 2 and not any(fake.seen)  # the TPU branch and the CUDA branch, both compiled
    _dispatch._kernel_branch.clear_cache()


def test_auto_under_transformations_on_cpu(rng):
    """jit, grad, vmap and jvp of "auto" through `platform_dependent` with the real
    kernels staged (splash for TPUs; Triton refuses D=5 on a GPU): the CPU branch, equal
    to the float64 reference, forward mode included (only this platform's branch is
    compiled). A call every kernel refuses stages no branch at all."""
    from conftest import jax_reference, x64

    q = rng.standard_normal((3, B, H, N, D))
    k, v = rng.standard_normal((3, B, K, S, D)), rng.standard_normal((3, B, K, S, D))
    allowed = np_allowed((B, H, N, S), is_causal=True)
    f = lambda q, k, v: attention(q, k, v, is_causal=True, implementation="auto")
    args = [jnp.asarray(x[0], jnp.float32) for x in (q, k, v)]
    assert "platform_index" in str(jax.make_jaxpr(f)(*args))
    masked = lambda q, k, v: attention(q, k, v, mask=jnp.asarray(allowed), implementation="auto")
    assert "platform_index" not in str(jax.make_jaxpr(masked)(*args))  # both kernels refuse a dense mask
    loss = lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))
    tangents = [jnp.asarray(x[1], jnp.float32) for x in (q, k, v)]
    got = {"out": jax.jit(f)(*args), "grad": jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args),
           "vmap": jax.jit(jax.vmap(f))(*(jnp.asarray(x, jnp.float32) for x in (q, k, v))),
           "jvp": jax.jit(lambda *a: jax.jvp(f, a, tuple(tangents))[1])(*args)}
    with x64():
        ref = lambda q, k, v: jax_reference(q, k, v, jnp.asarray(allowed))
        a64 = [jnp.asarray(x[0]) for x in (q, k, v)]
        want = {"out": ref(*a64),
                "grad": jax.grad(lambda *a: jnp.sum(jnp.sin(ref(*a))), argnums=(0, 1, 2))(*a64),
                "vmap": jax.vmap(ref)(*(jnp.asarray(x) for x in (q, k, v))),
                "jvp": jax.jvp(ref, tuple(a64), tuple(jnp.asarray(x[1]) for x in (q, k, v)))[1]}
        want = jax.tree.map(np.asarray, want)
    terms = {"out": FORWARD_TERMS, "grad": BACKWARD_TERMS, "vmap": FORWARD_TERMS, "jvp": 2 * FORWARD_TERMS}
    for name, value in got.items():  # each array against its own size
        for g, w in zip(jax.tree.leaves(value), jax.tree.leaves(want[name])):
            np.testing.assert_allclose(g, w, atol=f32_tolerance(terms=terms[name], magnitude=w), err_msg=name)


def test_rows_by_intervals_match_the_pattern_row_by_row():
    """`dense_rows` where only causality and a window restrict (prefix counts over each
    row's key interval, no N x S work) against the NumPy pattern: no empty row, and a
    row is touched exactly when a key it may see is bad; GQA (6 query heads, 3 kv
    heads), every small (N, S), aligned bottom-right."""
    rng = np.random.default_rng(0)
    windows = [None, (0, 0), (1, None), (None, 1), (2, 0), (0, 2), (3, 1)]
    checked = 0
    for n, s, is_causal, window in itertools.product(range(1, 7), range(1, 7), (False, True), windows):
        vis = _masking.Visibility(n, s, is_causal, None if window is None else _masking.Window(*window))
        if not vis.every_row_sees_a_key:
            continue
        bad = rng.random((2, 3, s)) < 0.3
        empty, touched = _masking.dense_rows(vis, jnp.asarray(bad), 6)
        allowed = np_allowed((2, 6, n, s), is_causal=is_causal, window=window)
        np.testing.assert_array_equal(empty, np.zeros((2, 6, n), bool))
        np.testing.assert_array_equal(touched, (allowed & np.repeat(bad, 2, axis=1)[:, :, None, :]).any(-1),
                                      err_msg=str((n, s, is_causal, window)))
        checked += 1
    assert checked > 100
