"""Every path agrees at the edges: one policy for non-finite sinks, `empty_rows` with
sinks consistent with the log-sum-exp (so `merge_attentions` of parts equals one call),
statistics within their bounds, refusals that name the real cause, and `"auto"` never
lowering the user's precision. Read across the registry (`jax_mha._dispatch.REGISTRY`):
every path that runs on this CPU and takes the part is checked, so a path registered
later is checked too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import jax_reference, np_allowed, x64

from jax_mha import _dispatch, _masking, attention, attention_statistics, merge_attentions, parallel

B, H, K, N, S, D = 2, 4, 2, 7, 11, 8
SINKS = np.array([0.5, np.nan, np.inf, -np.inf], np.float32)  # head 0 finite, heads 1-3 not


def cpu_paths(part: str | None = None) -> list[str]:
    """The registered paths that run on this CPU (interpreted kernels included) and take
    `part` (every one of them for None)."""
    return [name for name, path in _dispatch.REGISTRY.items()
            if (part is None or part in path.takes) and (not path.platforms or path.interprets)]


def inputs(rng, n=N, s=S):
    q = jnp.asarray(rng.standard_normal((B, H, n, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, K, s, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, K, s, D)), jnp.float32)
    return q, k, v


def ring(q, k, v, **kw):
    """Ring attention on a one-device ring (the sequence axis of size 1)."""
    mesh = parallel.make_mesh(sequence=1)
    return parallel.ring_attention(q, k, v, mesh=mesh, **kw)


def test_every_path_that_takes_sinks_is_checked():
    assert {"xla", "blockwise", "pallas_tpu"} <= set(cpu_paths("sinks"))


@pytest.mark.parametrize("path", cpu_paths("sinks") + ["ring"])
def test_traced_non_finite_sinks_make_their_heads_nan_on_every_path(rng, path):
    """NaN, +inf and -inf sinks, traced: every row of those heads NaN (output and lse),
    the other heads equal to the float64 reference."""
    q, k, v = inputs(rng)
    kw = dict(is_causal=True, return_residual=True)
    if path == "ring":
        q, k, v = inputs(rng, n=S)
        f = jax.jit(lambda q, k, v, sinks: ring(q, k, v, sinks=sinks, **kw))
    elif "return_residual" in _dispatch.REGISTRY[path].takes:
        f = jax.jit(lambda q, k, v, sinks: attention(q, k, v, sinks=sinks, implementation=path, **kw))
    else:  # the lse from the float64 reference's side only
        f = jax.jit(lambda q, k, v, sinks: (attention(q, k, v, sinks=sinks, implementation=path, is_causal=True),
                                            jnp.full((B, H, N), jnp.nan).at[:, :1].set(0.0)))
    out, lse = f(q, k, v, jnp.asarray(SINKS))
    assert bool(jnp.all(jnp.isnan(out[:, 1:]))) and bool(jnp.all(jnp.isnan(lse[:, 1:])))
    if not np.any(lse[:, :1]):
        lse = None
    with x64():
        allowed = np_allowed((B, H, q.shape[-2], k.shape[-2]), is_causal=True)
        want, want_lse = jax_reference(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)), allowed,
                                       sinks=jnp.full((H,), 0.5, jnp.float64), return_lse=True)
    np.testing.assert_allclose(out[:, :1], np.asarray(want)[:, :1], atol=2e-5, rtol=1e-4)
    if lse is not None:
        np.testing.assert_allclose(lse[:, :1], np.asarray(want_lse)[:, :1], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("path", cpu_paths() + ["ring"])
def test_a_non_finite_input_makes_nan_exactly_the_rows_that_see_it(rng, path, where):
    """One NaN entry of q (its row), of k or v (the key of position 5 under a causal
    pattern: rows 5… see it): those rows NaN in the output and the lse, every other row
    equal to the float64 reference without the bad entry, on every path and ring."""
    n = S
    q, k, v = inputs(rng, n=n)
    arrays = dict(q=q, k=k, v=v)
    arrays[where] = arrays[where].at[0, 1, 5, 3].set(jnp.nan)  # batch 0; query head 1 or kv head 1
    kw = dict(is_causal=True, return_residual=True)
    if path == "ring":
        out, lse = jax.jit(lambda a: ring(**a, **kw))(arrays)
    elif "return_residual" in _dispatch.REGISTRY[path].takes:
        out, lse = jax.jit(lambda a: attention(**a, implementation=path, **kw))(arrays)
    else:
        out, lse = jax.jit(lambda a: attention(**a, implementation=path, is_causal=True))(arrays), None
    rows = np.arange(n)
    bad = np.zeros((B, H, n), bool)
    if where == "q":
        bad[0, 1, 5] = True
    else:  # kv head 1 serves query heads 2 and 3; causal: rows 5… see key 5
        bad[0, 2:4, rows >= 5] = True
    np.testing.assert_array_equal(np.isnan(np.asarray(out)).any(-1), bad)
    if lse is not None:
        np.testing.assert_array_equal(np.isnan(np.asarray(lse)), bad)
    with x64():
        allowed = np_allowed((B, H, n, n), is_causal=True)
        want, want_lse = jax_reference(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)), allowed, return_lse=True)
    np.testing.assert_allclose(np.asarray(out)[~bad], np.asarray(want)[~bad], atol=2e-5, rtol=1e-4)
    if lse is not None:
        np.testing.assert_allclose(np.asarray(lse)[~bad], np.asarray(want_lse)[~bad], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("path", cpu_paths("sinks") + ["ring", "statistics"])
def test_concrete_non_finite_sinks_raise_naming_the_head(rng, path):
    q, k, v = inputs(rng, n=S) if path == "ring" else inputs(rng)
    sinks = jnp.asarray([0.0, 0.0, np.nan, 0.0], jnp.float32)
    call = {"ring": lambda: ring(q, k, v, sinks=sinks),
            "statistics": lambda: attention_statistics(q, k, v, sinks=sinks)}.get(
        path, lambda: attention(q, k, v, sinks=sinks, implementation=path))
    with pytest.raises(ValueError, match=r"sinks must be finite, got nan for head 2"):
        call()


@pytest.mark.parametrize("implementation", ["xla", "blockwise"])
def test_statistics_stay_in_their_bounds_and_bad_sinks_are_nan(rng, implementation):
    q, k, v = inputs(rng)
    q = q * 4.0  # sharp rows: near one-hot weights, where rounding steps past the bounds
    stats = jax.jit(lambda sinks: attention_statistics(q, k, v, sinks=sinks, is_causal=True,
                                                       implementation=implementation))
    got = stats(jnp.asarray([0.5, -3.0, 2.0, 0.0], jnp.float32))
    entropy, top = np.asarray(got["entropy"]), np.asarray(got["max_weight"])
    assert entropy.min() >= 0.0 and entropy.max() <= np.log(S) and top.min() >= 0.0 and top.max() <= 1.0
    bad = stats(jnp.asarray(SINKS))
    for name in ("entropy", "max_weight", "lse"):
        assert bool(jnp.all(jnp.isnan(bad[name][:, 1:]))) and not bool(jnp.any(jnp.isnan(bad[name][:, :1])))


@pytest.mark.parametrize("path", cpu_paths("sinks"))
@pytest.mark.parametrize("empty_rows", ["zero", "uniform"])
def test_rows_without_keys_attend_their_sink_under_either_policy(rng, path, empty_rows):
    """With sinks no row is empty: a row that sees no key outputs 0 and its lse is the
    sink, whatever `empty_rows` says, so merging parts equals one call over all keys."""
    q, k, v = inputs(rng)
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
    lengths = jnp.asarray([S, 0])  # sequence 1 sees no key
    kw = dict(sinks=sinks, empty_rows=empty_rows, implementation=path)
    if "return_residual" not in _dispatch.REGISTRY[path].takes:
        np.testing.assert_array_equal(attention(q, k, v, kv_lengths=lengths, **kw)[1], 0.0)
        return
    kw["return_residual"] = True
    out, lse = attention(q, k, v, kv_lengths=lengths, **kw)
    np.testing.assert_array_equal(out[1], 0.0)
    np.testing.assert_allclose(lse[1], jnp.broadcast_to(sinks[:, None], (H, N)), rtol=1e-6)
    # Split the keys in two: the first part carries the sinks, the second sees no key on sequence 1.
    first = attention(q, k[..., :5, :], v[..., :5, :], kv_lengths=jnp.asarray([5, 0]), **kw)
    second = attention(q, k[..., 5:, :], v[..., 5:, :], kv_lengths=jnp.asarray([S - 5, 0]),
                       **(kw | dict(sinks=None)))
    merged, merged_lse = merge_attentions([first, second])
    np.testing.assert_allclose(merged, out, atol=1e-5)
    np.testing.assert_allclose(merged_lse, lse, atol=1e-5)


def test_ring_refuses_a_dense_mask_or_bias_with_a_value_error(rng):
    q, k, v = inputs(rng, n=S)
    with pytest.raises(ValueError, match="ring attention .* cannot take mask"):
        ring(q, k, v, mask=jnp.ones((B, H, S, S), bool))
    with pytest.raises(ValueError, match="cannot take bias"):
        ring(q, k, v, bias=jnp.zeros((B, H, S, S)))


def _decode_step(dtype, **vis):
    q = jax.ShapeDtypeStruct((B, H, 1, 64), jnp.dtype(dtype))
    k = jax.ShapeDtypeStruct((B, K, 37, 64), jnp.dtype(dtype))
    call = _masking.Call(q, k, k, platform="tpu")
    return call, lambda offset: _masking.Visibility(1, 37, is_causal=True, q_offset=offset, batch_shape=(B,),
                                                    num_heads=H, **vis)


def test_a_refusal_names_the_real_cause_of_a_jitted_decoding_step():
    """The paged kernel refuses sinks and splash a traced offset, but the library's
    kernel takes both: a jitted step with sinks runs. With a dense mask, which no TPU
    kernel takes, the refusal names the mask, not the traced offset."""
    box = []
    for extra in (dict(sinks=jnp.zeros((H,))), dict(mask=jnp.ones((1, 37), bool))):
        call, vis = _decode_step("bfloat16", **extra)
        jax.jit(lambda o: box.append(_dispatch.refusal("pallas_tpu", vis(o), call)) or o)(jnp.int32(3))
    assert box[0] is None, box[0]
    assert "mask" in box[1] and "traced" not in box[1], box[1]


@pytest.mark.parametrize("dtype, kernel", [("float32", False), ("bfloat16", True)])
def test_auto_keeps_float32_decoding_on_a_float32_path(dtype, kernel):
    """The paged TPU kernel rounds k and v to bfloat16: `"auto"` takes it for bfloat16
    steps only; named explicitly it takes float32 too."""
    call, vis = _decode_step(dtype)
    box = []

    def choose(offset):
        box.append(_dispatch.choose(vis(offset), call, "auto"))
        box.append(_dispatch.refusal("pallas_tpu", vis(offset), call))
        return offset

    jax.jit(choose)(jnp.int32(3))
    assert (box[0] == "pallas_tpu") == kernel and box[0].per_platform["tpu"] == box[0]
    assert box[1] is None  # an explicit choice accepts the rounding
