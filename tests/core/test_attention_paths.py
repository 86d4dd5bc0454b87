"""One suite, every attention path: values, every JAX transformation, dtypes, edge cases.

Paths: "xla" (at these sizes the whole scores; `test_xla_beyond_the_whole_scores_
budget_runs_the_engine` covers its other route), "blockwise" (the engine with
small 4 x 8 blocks, so that padding, several blocks and block skipping all happen),
"weights" (return_weights=True: the reference path) and "cudnn" (GPU only; skipped
here with the reason). Every case is checked against references written apart from
the library: conftest's `jax_reference` (plain jax.numpy, float64; `np_attention` is
it on NumPy arrays) with the `np_allowed` pattern, whose autodiff is the truth for the
transformations. Axes have distinct prime sizes so a swapped axis cannot pass.
"""

from __future__ import annotations

import functools
import itertools
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import PATHS, f32_tolerance, jax_reference, normal, np_allowed, np_attention, run, x64

from jax_mha import attention, attention_entropy, causal_mask
from jax_mha._masking import Visibility, Window

# The float32 sums of the largest attention here, for the tolerances: the logits over
# D=5, the softmax sum and weights @ v over up to 13 keys; backward adds sums over D,
# the keys, and the rows (up to 13) of the up to 6 query heads that share a key head.
FORWARD_TERMS = 5 + 2 * 13
BACKWARD_TERMS = FORWARD_TERMS + 5 + 13 + 6 * 13


def assert_grads_close(got, want, terms=BACKWARD_TERMS):
    """Each gradient within `f32_tolerance` of its own size."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=f32_tolerance(terms=terms, magnitude=w))


def inputs(rng, batch=(2,), h=6, kv_heads=3, n=7, s=11, d=5, dtype=np.float32):
    return (normal(rng, batch + (h, n, d), dtype), normal(rng, batch + (kv_heads, s, d), dtype),
            normal(rng, batch + (kv_heads, s, d), dtype))


# Each case: keyword arguments of `attention` (arrays made by `make`), over the axes
# batch (2,), H=6, K=3, N=7, S=11. Together they cover causal x window x lengths x
# mask x bias x GQA/MQA/MHA pairwise.
CASES = {
    "plain_gqa": dict(),
    "causal": dict(is_causal=True),
    "window_left_only": dict(is_causal=True, local_window_size=(3, None)),
    "window_both_bias": dict(local_window_size=(2, 1), bias="bias"),
    "window_int_lengths": dict(local_window_size=2, q_lengths="q_len", kv_lengths="kv_len"),
    "lengths_mask_mqa": dict(kv_lengths="kv_len", mask="mask", kv_heads=1),
    "causal_lengths_bias_mask": dict(is_causal=True, q_lengths="q_len", kv_lengths="kv_len", bias="bias", mask="mask"),
    "everything_mha": dict(is_causal=True, local_window_size=(4, 0), q_lengths="q_len", kv_lengths="kv_len",
                           bias="bias", mask="mask", kv_heads=6),
    "more_queries_than_keys": dict(is_causal=True, n=13, s=5),
    "window_right_only": dict(local_window_size=(None, 2), bias="bias"),
    # Whole 4 x 8 blocks masked (blockwise skips them): by the mask, by short kv
    # lengths (sequence 0 sees 3 keys) and by q_lengths (sequence 1 has 4 rows).
    "masked_blocks": dict(mask="block_mask", kv_lengths="kv_short", q_lengths="q_len"),
    # Segment ids (packed sequences): sorted ids in self-attention (kv defaults to q),
    # unsorted ids on both sides (some queries then have no key of their segment:
    # empty rows), and with every other part of the description.
    "segments_packed_causal": dict(is_causal=True, q_segment_ids="seg_q_sorted", n=13, s=13),
    "segments_packed_window_gqa": dict(local_window_size=(3, 2), q_segment_ids="seg_q_sorted", n=13, s=13),
    "segments_unsorted_lengths": dict(q_segment_ids="seg_q_rand", kv_segment_ids="seg_kv_rand",
                                      q_lengths="q_len", kv_lengths="kv_len"),
    "segments_everything_mqa": dict(is_causal=True, local_window_size=(5, None), q_segment_ids="seg_q_sorted",
                                    kv_segment_ids="seg_kv_sorted", bias="bias", mask="mask", kv_heads=1),
}


def _block_mask(rng, n, s):
    """`(2, 1, N, S)`: sequence 0 may not see keys 0…7 (a whole key block), sequence
    1's rows 4… see nothing (a whole query block); elsewhere 1 in 4 pairs masked."""
    mask = rng.random((2, 1, n, s)) > 0.25
    mask[0, :, :, :8] = False
    mask[1, :, 4:, :] = False
    return mask


def make(rng, case, dtype=np.float32):
    """`(q, k, v, kwargs, allowed)` for a case; `allowed` is the NumPy pattern."""
    case = dict(case)
    n, s, kv_heads = case.pop("n", 7), case.pop("s", 11), case.pop("kv_heads", 3)
    q, k, v = inputs(rng, h=6, kv_heads=kv_heads, n=n, s=s, dtype=dtype)
    arrays = {
        "bias": normal(rng, (1, 6, n, s), dtype),
        "mask": jnp.asarray(rng.random((2, 1, n, s)) > 0.25),
        "q_len": jnp.array([n, max(n - 3, 0)]),
        "kv_len": jnp.array([s - 4, s]),
        "kv_short": jnp.array([min(3, s), s]),
        "block_mask": jnp.asarray(_block_mask(rng, n, s)),
        "seg_q_sorted": jnp.asarray(np.sort(rng.integers(0, 3, (2, n)), axis=-1)),
        "seg_kv_sorted": jnp.asarray(np.sort(rng.integers(0, 3, (2, s)), axis=-1)),
        "seg_q_rand": jnp.asarray(rng.integers(0, 3, (2, n))),
        "seg_kv_rand": jnp.asarray(rng.integers(0, 3, (2, s))),
    }
    kw = {name: arrays[val] if isinstance(val, str) else val for name, val in case.items()}
    allowed = np_allowed(
        (2, 6, n, s), is_causal=kw.get("is_causal", False), window=kw.get("local_window_size"),
        q_lengths=kw.get("q_lengths"), kv_lengths=kw.get("kv_lengths"), mask=kw.get("mask"),
        q_segment_ids=kw.get("q_segment_ids"), kv_segment_ids=kw.get("kv_segment_ids"),
    )
    return q, k, v, kw, allowed


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("path", PATHS)
def test_values_match_float64_reference(rng, path, name):
    q, k, v, kw, allowed = make(rng, CASES[name])
    expected, _ = np_attention(q, k, v, mask=allowed, bias=kw.get("bias"))
    out = run(path, q, k, v, **kw)
    chex.assert_shape(out, expected.shape)
    np.testing.assert_allclose(np.asarray(out), expected, atol=f32_tolerance(terms=FORWARD_TERMS, magnitude=expected))


@pytest.mark.parametrize("name", ["causal_lengths_bias_mask", "masked_blocks"])
def test_xla_beyond_the_whole_scores_budget_runs_the_engine(rng, monkeypatch, name):
    """Over `WHOLE_SCORES_MAX_BYTES` "xla" runs the blockwise engine (its default
    blocks): the reference's values, and the gradients of the whole-scores route."""
    from jax_mha.paths import dense

    q, k, v, kw, allowed = make(rng, CASES[name])
    expected, _ = np_attention(q, k, v, mask=allowed, bias=kw.get("bias"))

    def run_and_grads():  # fresh functions: JAX caches traces by function
        f = lambda q, k, v: attention(q, k, v, implementation="xla", **kw)
        loss = lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))
        both = jax.jit(lambda q, k, v: (f(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)))
        return str(jax.make_jaxpr(f)(q, k, v)), *both(q, k, v)

    whole_jaxpr, _, whole_grads = run_and_grads()
    monkeypatch.setattr(dense, "WHOLE_SCORES_MAX_BYTES", 0)
    engine_jaxpr, out, grads = run_and_grads()
    assert "flash_attention" not in whole_jaxpr and "flash_attention" in engine_jaxpr
    np.testing.assert_allclose(np.asarray(out), expected, atol=f32_tolerance(terms=FORWARD_TERMS, magnitude=expected))
    assert_grads_close(grads, whole_grads)


@pytest.mark.parametrize("path", PATHS)
def test_weights_path_returns_reference_weights(rng, path):
    q, k, v, kw, allowed = make(rng, CASES["causal_lengths_bias_mask"])
    if path != "weights":
        pytest.skip("only the weights path returns weights")
    _, expected = np_attention(q, k, v, mask=allowed, bias=kw["bias"])
    _, weights = attention(q, k, v, return_weights=True, **kw)
    np.testing.assert_allclose(np.asarray(weights), expected, atol=f32_tolerance(terms=5 + 11, magnitude=1.0))


JAX_NN_FEATURES = {
    "window": dict(local_window_size=(3, 1)),
    "causal_window": dict(is_causal=True, local_window_size=(2, 0)),
    "lengths": dict(q_lengths=np.array([9, 4]), kv_lengths=np.array([5, 9])),
    "causal_lengths_empty_rows": dict(is_causal=True, q_lengths=np.array([9, 9]), kv_lengths=np.array([0, 3])),
}


@pytest.mark.parametrize("feature", sorted(JAX_NN_FEATURES))
@pytest.mark.parametrize("path", PATHS)
def test_matches_jax_nn_dot_product_attention(rng, path, feature):
    """Where jax.nn has the feature (N == S, so both alignments agree): same values,
    with empty_rows="uniform", what jax.nn returns for rows with no key."""
    kw = JAX_NN_FEATURES[feature]
    q, k, v = inputs(rng, h=4, kv_heads=2, n=9, s=9, d=8)
    to_nn = lambda x: jnp.swapaxes(x, 1, 2)  # (B, L, heads, D)
    expected = jax.nn.dot_product_attention(
        to_nn(q), to_nn(k), to_nn(v), is_causal=kw.get("is_causal", False),
        local_window_size=kw.get("local_window_size"), query_seq_lengths=kw.get("q_lengths"),
        key_value_seq_lengths=kw.get("kv_lengths"),
    )
    out = run(path, q, k, v, empty_rows="uniform", **kw)
    np.testing.assert_allclose(np.asarray(out), np.asarray(to_nn(expected)),
                               atol=f32_tolerance(terms=8 + 2 * 9, magnitude=expected))


# --------------------------------------------------------------------------------------
# Every transformation, against autodiff of the float64 jax_reference.
# --------------------------------------------------------------------------------------


def transformation_case(rng):
    """float64 inputs with causal x window x lengths x bias x GQA, and f, f_ref:
    scalar functions of (q, k, v, bias) through `run` and through jax_reference."""
    b, h, kv_heads, n, s, d = 2, 4, 2, 3, 5, 2
    q, k, v = (jnp.asarray(rng.normal(size=shape)) for shape in
               ((b, h, n, d), (b, kv_heads, s, d), (b, kv_heads, s, d)))
    bias = jnp.asarray(rng.normal(size=(1, h, n, s)))
    kw = dict(is_causal=True, local_window_size=(3, None), kv_lengths=jnp.array([5, 4]))
    allowed = jnp.asarray(np_allowed((b, h, n, s), is_causal=True, window=(3, None), kv_lengths=[5, 4]))
    return (q, k, v, bias), kw, allowed


TRANSFORMS = ("jit", "vmap", "grad", "vjp", "jvp", "jacfwd", "hessian")


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("path", PATHS)
def test_transformations_match_float64_autodiff(rng, path, transform):
    if path == "cudnn" and transform in ("jvp", "jacfwd", "hessian"):
        pytest.skip("cuDNN's kernel (jax.nn's custom VJP) is reverse-mode only")
    with x64():
        args, kw, allowed = transformation_case(rng)
        out_fn = lambda q, k, v, bias: run(path, q, k, v, bias=bias, **kw)
        ref_fn = lambda q, k, v, bias: jax_reference(q, k, v, allowed, bias)
        scalar = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
        qs = jnp.stack([args[0], 2 * args[0], -args[0]])
        ct = jnp.asarray(rng.normal(size=args[0].shape))
        tangents = tuple(jnp.asarray(rng.normal(size=x.shape)) for x in args)
        transformed = {  # each a function of the arguments
            "jit": lambda f: f,
            "vmap": lambda f: lambda q, *rest: jax.vmap(f, in_axes=(0, None, None, None))(qs, *rest),  # over a new axis of q
            "grad": lambda f: jax.grad(scalar(f), argnums=(0, 1, 2, 3)),
            "vjp": lambda f: lambda *a: jax.vjp(f, *a)[1](ct),
            "jvp": lambda f: lambda *a: jax.jvp(f, a, tangents),
            "jacfwd": lambda f: jax.jacfwd(f, argnums=1),
            "hessian": lambda f: jax.hessian(scalar(f)),  # forward-over-reverse
        }[transform]
        got = (jax.jit(out_fn) if transform == "jit" else transformed(out_fn))(*args)
        # The reference as one jitted program (its eager ops would each compile).
        want = jax.jit(transformed(ref_fn))(*args)
        chex.assert_trees_all_close(got, want, atol=1e-10, rtol=1e-9)


def test_reverse_over_reverse_also_works(rng):
    """Not only forward-over-reverse: jacrev(jacrev) through the engine too."""
    with x64():
        (q, k, v, bias), kw, allowed = transformation_case(rng)
        f = lambda q: jnp.sum(jnp.sin(attention(q, k, v, bias=bias, **kw)))
        f_ref = lambda q: jnp.sum(jnp.sin(jax_reference(q, k, v, allowed, bias)))
        chex.assert_trees_all_close(jax.jit(jax.jacrev(jax.jacrev(f)))(q), jax.jit(jax.hessian(f_ref))(q), atol=1e-10)


@pytest.mark.parametrize("path", ("xla", "blockwise"))
def test_jit_compiles_once_per_shape(rng, path):
    chex.clear_trace_counter()
    q, k, v = inputs(rng)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def f(q, k, v):
        return run(path, q, k, v, is_causal=True)

    for scale in (1.0, 2.0, 3.0):
        f(q * scale, k, v).block_until_ready()


# --------------------------------------------------------------------------------------
# Dtypes.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ("float16", "bfloat16", "float32", "float64"))
@pytest.mark.parametrize("path", PATHS)
def test_dtype_in_is_dtype_out(rng, path, dtype):
    with x64(dtype == "float64"):
        q, k, v = (x.astype(dtype) for x in inputs(rng, n=5, s=13))
        out = run(path, q, k, v, is_causal=True)
        assert out.dtype == jnp.dtype(dtype)
        expected, _ = np_attention(q, k, v, mask=np_allowed((2, 6, 5, 13), is_causal=True))
        tol = {"float16": 5e-3, "bfloat16": 3e-2, "float64": 1e-12}.get(dtype)
        if tol is None:  # float32: its sums' rounding
            np.testing.assert_allclose(np.asarray(out, np.float64), expected,
                                       atol=f32_tolerance(terms=FORWARD_TERMS, magnitude=expected))
        else:
            np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=tol, rtol=tol)


@functools.cache
def _bfloat16_case():
    """The bfloat16 inputs, the output cotangent, the float64 reference's output and dq
    on those exact inputs, and jax.nn's mean |errors|: the same for every path, so
    computed once (each a single jitted program)."""
    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 4, 67, 32)) * 2) for _ in range(3))
    ct = jnp.asarray(rng.normal(size=q.shape))
    low = tuple(x.astype(jnp.bfloat16) for x in (q, k, v))
    with x64():
        exact = tuple(jnp.asarray(np.asarray(x.astype(jnp.float32), np.float64)) for x in low)
        want, dq64 = jax.jit(lambda q, k, v, ct: _out_and_dq(jax_reference, (q, k, v), ct))(
            *exact, jnp.asarray(np.asarray(ct), jnp.float64))
    want, dq64 = np.asarray(want), np.asarray(dq64)
    nn = lambda q, k, v: jnp.swapaxes(jax.nn.dot_product_attention(*(jnp.swapaxes(x, 1, 2) for x in (q, k, v))), 1, 2)
    nn_errors = _bfloat16_errors(jax.jit(lambda q, k, v, ct: _out_and_dq(nn, (q, k, v), ct))(*low, ct.astype(jnp.bfloat16)),
                                 want, dq64)
    return low, ct.astype(jnp.bfloat16), want, dq64, nn_errors


def _out_and_dq(f, args, ct):
    out, pull = jax.vjp(f, *args)
    return out, pull(ct)[0]


def _bfloat16_errors(out_and_dq, want, dq64):
    out, dq = out_and_dq
    return (np.mean(np.abs(np.asarray(out, np.float64) - want)), np.mean(np.abs(np.asarray(dq, np.float64) - dq64)))


@pytest.mark.parametrize("path", ("xla", "blockwise", "weights"))
def test_bfloat16_at_least_as_accurate_as_jax_nn(path):
    """Mean |error| of the output and of dq against float64, ours vs jax.nn's, over the
    same bfloat16 inputs (logits scaled after the matmul, in float32)."""
    low, ct, want, dq64, (nn_out, nn_dq) = _bfloat16_case()
    ours_out, ours_dq = _bfloat16_errors(_out_and_dq(lambda q, k, v: run(path, q, k, v), low, ct), want, dq64)
    assert ours_out <= nn_out * 1.05, (ours_out, nn_out)
    assert ours_dq <= nn_dq * 1.05, (ours_dq, nn_dq)


@pytest.mark.parametrize("path", ("weights", "xla", "blockwise"))
def test_float16_gradients_do_not_overflow(path):
    """Values near 1e3 and an output cotangent near 1e2: dO·vᵀ reaches ~1e7 (beyond
    float16's 65504) while the true gradients stay small; they come out finite and right."""
    rng = np.random.default_rng(3)
    q, k = (jnp.asarray(rng.normal(size=(1, 2, 5, 8)) * 0.1) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(1, 2, 5, 8)) * 1e3)
    ct = jnp.asarray(rng.normal(size=(1, 2, 5, 8)) * 1e2)
    f = lambda q, k, v: run(path, q, k, v, is_causal=True)
    low = tuple(x.astype(jnp.float16) for x in (q, k, v))
    grads = jax.vjp(f, *low)[1](ct.astype(jnp.float16))
    with x64():
        exact = tuple(jnp.asarray(np.asarray(x, np.float64)) for x in low)
        allowed = jnp.asarray(np.tril(np.ones((5, 5), bool)))
        want = jax.vjp(lambda *a: jax_reference(*a, allowed), *exact)[1](jnp.asarray(np.asarray(ct, np.float64)))
    assert max(float(np.max(np.abs(np.asarray(w)))) for w in want) < 6e4  # the exact gradient fits
    for g, w in zip(grads, want):
        assert g.dtype == jnp.float16
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w), rtol=2e-2, atol=2e-2 * float(np.max(np.abs(w))))


@pytest.mark.parametrize("dtype", ("int32", "complex64", "bool"))
def test_integer_complex_and_bool_inputs_raise_type_error(dtype):
    x = jnp.ones((2, 3, 5, 4), dtype)
    with pytest.raises(TypeError, match=str(jnp.dtype(dtype))):
        attention(x, x, x)


def test_mixed_dtypes_raise_type_error(rng):
    q, k, v = inputs(rng)
    with pytest.raises(TypeError, match="bfloat16"):
        attention(q, k.astype(jnp.bfloat16), v)


# --------------------------------------------------------------------------------------
# Edge cases, identical on every path.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, s", [(0, 5), (5, 0), (0, 0)])
@pytest.mark.parametrize("path", PATHS)
def test_empty_sequences_give_zeros(rng, path, n, s):
    q, k, v = inputs(rng, n=n, s=s)
    for empty_rows in ("zero", "uniform"):
        out = run(path, q, k, v, is_causal=True, empty_rows=empty_rows)
        chex.assert_shape(out, (2, 6, n, 5))
        np.testing.assert_array_equal(out, 0.0)
    grads = jax.grad(lambda q, k, v: jnp.sum(run(path, q, k, v)), argnums=(0, 1, 2))(q, k, v)
    chex.assert_trees_all_equal_shapes(grads, (q, k, v))


def _nan_rows(out):
    """bool (B, H, N): rows with any NaN."""
    return np.isnan(np.asarray(out)).any(-1)


@pytest.mark.parametrize("where", ("q", "k", "v", "v_inf"))
@pytest.mark.parametrize("path", PATHS)
def test_non_finite_inputs_reach_only_the_rows_that_see_them(rng, path, where):
    """Causal attention, N = S = 7, a bad value at position 3: only the rows that may
    attend to it (for q: row 3 itself) are non-finite; the others equal a clean run."""
    q, k, v = inputs(rng, n=7, s=7)
    clean = run(path, q, k, v, is_causal=True)
    bad = jnp.inf if where == "v_inf" else jnp.nan
    name = where[0]
    arrays = {"q": q, "k": k, "v": v}
    arrays[name] = arrays[name].at[:, :, 3, :].set(bad)
    out = run(path, arrays["q"], arrays["k"], arrays["v"], is_causal=True)
    touched = np.zeros((2, 6, 7), bool)
    if name == "q":
        touched[:, :, 3] = True
    else:
        touched[:, :, 3:] = True  # rows i >= 3 see key 3 under the causal mask
    np.testing.assert_array_equal(~np.isfinite(np.asarray(out)).all(-1), touched)
    np.testing.assert_allclose(np.asarray(out)[~touched], np.asarray(clean)[~touched], atol=2e-6)


@pytest.mark.parametrize("path", PATHS)
def test_nan_in_masked_key_and_value_stays_out_of_values_and_gradients(rng, path):
    q, k, v = inputs(rng, n=5, s=9)
    lengths = jnp.array([6, 9])
    k_bad = k.at[0, :, 7].set(jnp.nan)  # past sequence 0's length: masked for all its queries
    v_bad = v.at[0, :, 8].set(jnp.nan)
    f = lambda q, k, v: jnp.sum(jnp.sin(run(path, q, k, v, kv_lengths=lengths)))
    value, grads = jax.value_and_grad(f, argnums=(0, 1, 2))(q, k_bad, v_bad)
    value_clean, grads_clean = jax.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(value, value_clean, rtol=1e-6)
    chex.assert_tree_all_finite(grads[0])
    chex.assert_trees_all_close(grads[0], grads_clean[0], atol=2e-6)


@pytest.mark.parametrize("path", PATHS)
def test_minus_inf_bias_row_is_an_empty_row(rng, path):
    """How PyTorch users write masks: an all -inf bias row is a fully masked row (zeros;
    no NaN in the output or in any gradient)."""
    q, k, v = inputs(rng, n=5, s=9)
    bias = jnp.zeros((1, 6, 5, 9)).at[:, 2, 1].set(-jnp.inf).at[:, :, :, 4].set(-jnp.inf)
    f = lambda q, k, v, bias: run(path, q, k, v, bias=bias)
    out = f(q, k, v, bias)
    np.testing.assert_array_equal(np.asarray(out)[:, 2, 1], 0.0)
    expected, _ = np_attention(q, k, v, mask=np.isfinite(np.asarray(bias)), bias=jnp.where(jnp.isfinite(bias), bias, 0))
    np.testing.assert_allclose(np.asarray(out), expected, atol=f32_tolerance(terms=FORWARD_TERMS, magnitude=expected))
    grads = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2, 3))(q, k, v, bias)
    chex.assert_tree_all_finite(grads)


@pytest.mark.parametrize("path", PATHS)
def test_empty_rows_policy_and_query_padding(rng, path):
    """kv_lengths=0 empties sequence 0: "zero" gives zeros, "uniform" the mean value;
    rows past q_lengths are zero under both. Gradients are finite."""
    q, k, v = inputs(rng, n=5, s=9)
    kw = dict(kv_lengths=jnp.array([0, 9]), q_lengths=jnp.array([5, 3]))
    zero = run(path, q, k, v, **kw)
    uniform = run(path, q, k, v, empty_rows="uniform", **kw)
    np.testing.assert_array_equal(np.asarray(zero)[0], 0.0)
    mean_v = np.repeat(np.asarray(v).mean(-2, keepdims=True), 2, axis=-3)[0]  # (H, 1, D)
    np.testing.assert_allclose(np.asarray(uniform)[0], np.broadcast_to(mean_v, (6, 5, 5)),
                               atol=f32_tolerance(terms=9, magnitude=v))  # a float32 mean of 9 values
    for out in (zero, uniform):
        np.testing.assert_array_equal(np.asarray(out)[1, :, 3:], 0.0)
        np.testing.assert_allclose(np.asarray(out)[1, :, :3], np.asarray(zero)[1, :, :3], atol=1e-6)
    for policy in ("zero", "uniform"):
        grads = jax.grad(lambda v: jnp.sum(run(path, q, k, v, empty_rows=policy, **kw)))(v)
        chex.assert_tree_all_finite(grads)


@pytest.mark.parametrize("path", PATHS)
def test_uniform_empty_row_averages_non_finite_values_into_nan(rng, path):
    """A "uniform" empty row is the mean of every value of its head, so a NaN value
    makes it NaN (as jax.nn's uniform rows); the "zero" row and the other heads stay."""
    q, k, v = inputs(rng, n=5, s=9)
    v = v.at[0, 1, 6, 2].set(jnp.nan)  # key/value head 1 of sequence 0 (query heads 2, 3)
    kw = dict(kv_lengths=jnp.array([4, 9]))  # the NaN key is masked: no row sees it
    kw_empty = dict(kv_lengths=jnp.array([0, 9]))  # every row of sequence 0 empty
    np.testing.assert_array_equal(np.isnan(np.asarray(run(path, q, k, v, empty_rows="uniform", **kw))), False)
    uniform = np.asarray(run(path, q, k, v, empty_rows="uniform", **kw_empty))
    assert np.isnan(uniform[0, 2:4]).all() and not np.isnan(uniform[0, [0, 1, 4, 5]]).any()
    assert not np.isnan(uniform[1]).any()
    np.testing.assert_array_equal(np.asarray(run(path, q, k, v, **kw_empty))[0], 0.0)


def test_attention_entropy_propagates_nan():
    w = jnp.array([[0.5, 0.5, 0.0], [jnp.nan, 0.5, 0.5], [1.0, 0.0, 0.0]])
    h = np.asarray(attention_entropy(w))
    np.testing.assert_allclose(h[0], np.log(2.0), rtol=1e-6)
    assert np.isnan(h[1]) and h[2] == 0.0


# --------------------------------------------------------------------------------------
# Bad inputs: one clear error each, the same on every path.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ("xla", "blockwise", "weights"))
def test_bad_descriptions_raise(rng, path):
    q, k, v = inputs(rng)
    with pytest.raises(TypeError, match="bias must be floating.*bool"):
        run(path, q, k, v, bias=jnp.ones((7, 11), bool))
    with pytest.raises(TypeError, match="mask must be boolean.*float32"):
        run(path, q, k, v, mask=jnp.ones((7, 11)))
    with pytest.raises(TypeError, match="kv_lengths must be integers.*float32"):
        run(path, q, k, v, kv_lengths=jnp.array([3.0, 4.0]))
    with pytest.raises(TypeError, match="q_lengths must be integers"):
        run(path, q, k, v, q_lengths=jnp.array([3.5, 4.0]))
    with pytest.raises(ValueError, match=r"kv_lengths of shape \(3,\) does not broadcast"):
        run(path, q, k, v, kv_lengths=jnp.array([1, 2, 3]))
    with pytest.raises(ValueError, match="left side must be >= 0, got -1"):
        run(path, q, k, v, local_window_size=(-1, 2))
    with pytest.raises(TypeError, match="local_window_size"):
        run(path, q, k, v, local_window_size=(1, 2, 3))
    with pytest.raises(TypeError, match="right side must be an int or None, got 2.5"):
        run(path, q, k, v, local_window_size=(1, 2.5))
    with pytest.raises(ValueError, match="empty_rows must be one of .*'nan'"):
        run(path, q, k, v, empty_rows="nan")
    with pytest.raises(ValueError, match="scale must be finite, got nan"):
        run(path, q, k, v, scale=float("nan"))


def test_causal_mask_rejects_non_integers():
    with pytest.raises(TypeError, match="3.5"):
        causal_mask(3.5)
    with pytest.raises(TypeError, match="True"):
        causal_mask(3, True)
    with pytest.raises(ValueError, match="n=-2"):
        causal_mask(-2)


def test_blockwise_rejects_bad_block_sizes(rng):
    q, k, v = inputs(rng)
    with pytest.raises(ValueError, match="query_block_size=0"):
        attention(q, k, v, implementation="blockwise", query_block_size=0)
    with pytest.raises(TypeError, match="key_block_size must be an int, got 2.5"):
        attention(q, k, v, implementation="blockwise", key_block_size=2.5)


def test_errors_do_not_depend_on_asserts():
    """Under `python -O` (asserts stripped) every check still raises."""
    script = textwrap.dedent("""
        import jax.numpy as jnp
        from jax_mha import attention, causal_mask, split_heads
        x = jnp.ones((2, 3, 5, 4))
        checks = [
            lambda: attention(x, x, x, mask=jnp.ones((5, 5))),
            lambda: attention(x, x, x, bias=jnp.ones((5, 5), bool)),
            lambda: attention(x.astype(int), x, x),
            lambda: attention(x, x, x, kv_lengths=jnp.ones(2)),
            lambda: attention(x, x[:, :2], x),
            lambda: causal_mask(3.5),
            lambda: split_heads(jnp.ones((2, 5, 6)), 4),
        ]
        for check in checks:
            try:
                check()
            except (TypeError, ValueError):
                continue
            raise SystemExit("no error")
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-O", "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


# --------------------------------------------------------------------------------------
# Cost: skipped blocks and linear memory.
# --------------------------------------------------------------------------------------


def test_windows_and_causality_shrink_the_key_loop():
    """Blocks outside the visible band are not iterated: at N = S = 16,384 with 128 x 512
    blocks, a (256, 0) window visits at most 2 of the 32 key blocks per query block."""
    from jax_mha.paths import engine

    n = 16384
    x = jax.ShapeDtypeStruct((1, 1, n, 8), jnp.float32)

    def band(**kw):
        plans = []  # the plan is static: read it while tracing, nothing runs
        jax.eval_shape(lambda q: plans.append(engine._prepare(q, q, q, Visibility(n, n, **kw), scale=1.0, q_block=128,
                                                              k_block=512, bad_kv=None)[0]), x)
        return plans[0].band

    assert band() == 32
    assert band(is_causal=True) == 32  # the band is the longest row; later cond-skips halve the work
    assert band(is_causal=True, window=Window(256, 0)) == 2
    assert band(window=Window(128, 128)) == 2


def test_static_empty_row_check_matches_the_pattern():
    """`every_row_sees_a_key` (which lets the whole-scores path skip its empty-row
    bookkeeping) against the NumPy pattern, row by row, over every small (N, S),
    causality and window, aligned bottom-right so that N > S empties causal rows."""
    windows = [None, (0, 0), (1, None), (None, 1), (2, 0), (0, 2), (3, 1), (None, None)]
    for n, s, is_causal, window in itertools.product(range(1, 7), range(1, 7), (False, True), windows):
        vis = Visibility(n, s, is_causal, None if window is None else Window(*window))
        expected = bool(np_allowed((1, n, s), is_causal=is_causal, window=window).any(-1).all())
        assert vis.every_row_sees_a_key == expected, (n, s, is_causal, window)
    assert not Visibility(4, 4, mask=jnp.ones((4, 4), bool)).every_row_sees_a_key  # a mask is not static
    assert not Visibility(4, 4, kv_lengths=jnp.array(4)).every_row_sees_a_key


@pytest.mark.parametrize("name", ["everything_mha", "masked_blocks", "causal_lengths_bias_mask"])
def test_all_heads_together_match_reference_values_and_gradients(rng, monkeypatch, name):
    """The engine's other layout (every head in one batched step: GPUs, several
    devices) against the float64 reference, on both tuned paths."""
    from jax_mha.paths import engine

    monkeypatch.setattr(engine, "one_cpu_device", lambda: False)
    q, k, v, kw, allowed = make(rng, CASES[name])
    expected, _ = np_attention(q, k, v, mask=allowed, bias=kw.get("bias"))
    loss = lambda q, k, v, f: jnp.sum(jnp.sin(f(q, k, v)))
    ref_grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, lambda q, k, v: attention(q, k, v, return_weights=True,
                                                                                      **kw)[0])
    for blocks in ({}, dict(implementation="blockwise", query_block_size=4, key_block_size=8)):
        f = lambda q, k, v: attention(q, k, v, **blocks, **kw)
        np.testing.assert_allclose(np.asarray(f(q, k, v)), expected,
                                   atol=f32_tolerance(terms=FORWARD_TERMS, magnitude=expected))
        assert_grads_close(jax.grad(loss, argnums=(0, 1, 2))(q, k, v, f), ref_grads)


def test_default_blocks_fit_the_pattern():
    from jax_mha.paths.blockwise import default_blocks

    assert default_blocks(False, None) == (2048, 256)  # nothing to skip: tall query blocks
    assert default_blocks(True, None) == (512, 512)
    assert default_blocks(True, Window(256, 0)) == (128, 128)
    assert default_blocks(True, Window(256, None)) == (128, 128)  # causal: nothing right of the query
    assert default_blocks(False, Window(100, 100)) == (128, 128)
    assert default_blocks(True, Window(257, 0)) == (512, 512)
    assert default_blocks(True, Window(0, 0)) == (128, 128)
    assert default_blocks(False, Window(3, None)) == (512, 512)  # unbounded on the right
    assert default_blocks(True, Window(2000, 0)) == (512, 512)
    # per platform: a GPU's causal blocks from its sweep; a narrow window keeps its span
    assert default_blocks(True, None, platform="gpu") == (1024, 1024)
    assert default_blocks(False, None, platform="gpu") == (2048, 256)
    assert default_blocks(True, Window(100, 0), platform="gpu") == (128, 128)


def test_blockwise_memory_is_linear_in_sequence_length():
    """Compiled forward+backward temporary memory grows ~linearly, far below N x S."""
    temp = {}
    for n in (1024, 4096):
        x = jax.ShapeDtypeStruct((1, 2, n, 16), jnp.float32)
        fn = lambda q, k, v: attention(q, k, v, is_causal=True, implementation="blockwise",
                                       query_block_size=128, key_block_size=128).sum()
        analysis = jax.jit(jax.grad(fn, argnums=(0, 1, 2))).lower(x, x, x).compile().memory_analysis()
        if analysis is None:
            pytest.skip("this backend reports no memory analysis")
        temp[n] = analysis.temp_size_in_bytes
    scores_bytes = 2 * 4096 * 4096 * 4  # one float32 (H, N, S) array at N = S = 4096
    assert temp[4096] < scores_bytes / 16, temp
    assert temp[4096] / temp[1024] < 6, temp  # ~x4 when linear; quadratic would be x16


# ---------------------------------------------------------------------------------
# Segment ids (packed sequences): gradients, block skipping, errors.
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["segments_packed_causal", "segments_unsorted_lengths", "segments_everything_mqa"])
@pytest.mark.parametrize("path", PATHS)
def test_segment_ids_gradients_match_float64_autodiff(rng, path, name):
    q, k, v, kw, allowed = make(rng, CASES[name])
    cot = normal(rng, q.shape[:-1] + v.shape[-1:])
    bias = kw.get("bias")
    loss = lambda q, k, v: jnp.sum(run(path, q, k, v, **kw) * cot)
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    with x64():
        as64 = lambda x: jnp.asarray(np.asarray(x, np.float64))
        ref = lambda q, k, v: jnp.sum(jax_reference(q, k, v, allowed, None if bias is None else as64(bias)) * as64(cot))
        expected = jax.grad(ref, argnums=(0, 1, 2))(as64(q), as64(k), as64(v))
        expected = [np.asarray(g) for g in expected]
    for got, want in zip(grads, expected):
        assert np.all(np.isfinite(np.asarray(got)))
        np.testing.assert_allclose(np.asarray(got), want, atol=f32_tolerance(terms=BACKWARD_TERMS, magnitude=want))


def test_segment_ids_skip_key_blocks():
    """Causal N = 256 in 32 x 32 blocks: one document visits the 8 x 9 / 2 = 36
    blocks of the causal triangle; 4 packed documents of 64 only the 3 causal blocks
    inside each document (12); unsorted ids stay exact but skip nothing here."""
    from jax_mha._masking import Visibility, segments_at_rank
    from jax_mha.paths.engine import visited_blocks

    n = 256
    q = jnp.zeros((1, 1, n, 8))

    def count(ids):
        ids = None if ids is None else jnp.asarray(ids)
        q_ids, kv_ids = segments_at_rank(ids, ids, 1)
        vis = Visibility(n, n, is_causal=True, q_segment_ids=q_ids, kv_segment_ids=kv_ids)
        return visited_blocks(q, q, q, vis, q_block=32, k_block=32)

    one = count(None)
    four = count(np.repeat(np.arange(4), 64)[None])
    unsorted = count(np.random.default_rng(0).integers(0, 4, (1, n)))
    assert one == 8 * 9 // 2  # causal: the lower triangle of 8 x 8 blocks
    assert four == 4 * 3  # per document: its 2 x 2 blocks' causal triangle
    assert unsorted == one  # random ids: every block's range meets every other's


def test_segment_ids_bad_inputs_raise(rng):
    q, k, v = inputs(rng, n=7, s=11)
    ids_q, ids_kv = jnp.zeros((2, 7), jnp.int32), jnp.zeros((2, 11), jnp.int32)
    with pytest.raises(TypeError, match="q_segment_ids must be integers"):
        attention(q, k, v, q_segment_ids=ids_q.astype(jnp.float32), kv_segment_ids=ids_kv)
    with pytest.raises(TypeError, match="kv_segment_ids must be integers"):
        attention(q, k, v, q_segment_ids=ids_q, kv_segment_ids=ids_kv.astype(bool))
    with pytest.raises(ValueError, match="N=7 queries and S=11 keys"):
        attention(q, k, v, q_segment_ids=ids_q)
    with pytest.raises(ValueError, match="kv_segment_ids needs q_segment_ids"):
        attention(q, k, v, kv_segment_ids=ids_kv)
    with pytest.raises(ValueError, match=r"kv_segment_ids of shape \(2, 7\) does not broadcast to \(B…, S\)"):
        attention(q, k, v, q_segment_ids=ids_q, kv_segment_ids=ids_q)
    with pytest.raises(ValueError, match=r"q_segment_ids of shape \(3, 7\)"):
        attention(q, k, v, q_segment_ids=jnp.zeros((3, 7), jnp.int32), kv_segment_ids=ids_kv)
