"""`jax_mha._statistics.attention_statistics` against a float64 NumPy reference written
here (its weights checked against conftest's `np_attention`) and against the dense
weights of `jax_mha.attention(..., return_weights=True)`; both implementations, blocks
that pad (N = 13, S = 17 in 4 x 3 blocks), jit, vmap, non-finite inputs, the memory
bound, errors, and the long-context study's smoke run."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import f32_tolerance, np_allowed, np_attention, x64

from jax_mha import attention, attention_entropy, attention_statistics

B, H, K, N, S, D = 2, 6, 3, 13, 17, 5  # GQA: query heads 0, 1 read key head 0, ...
BLOCKS = dict(query_block_size=4, key_block_size=3)  # neither divides N or S: padded rows and keys
NAMES = ("entropy", "max_weight", "received", "lse")
# The float32 sums of the statistics, for the tolerances: the logits over D, the
# softmax sum and the entropy's over the S keys, "received" over the N rows.
STAT_TERMS = D + 2 * S + N


def stat_tolerance(want):
    """`f32_tolerance` for one statistic, at its own size."""
    return f32_tolerance(terms=STAT_TERMS, magnitude=want)


def np_statistics(q, k, allowed, bias=None, *, cap=None, sinks=None, q_lengths=None):
    """Float64 statistics row by row: `(dict, weights (B, H, N, S))`.

    Logits `q·k / sqrt(D) + bias`, then `cap · tanh(· / cap)`; a key is visible where
    `allowed` and its logit is not -inf; the softmax denominator also holds
    `exp(sinks[h])` when given. Rows past `q_lengths` are padding: zeros, lse -inf."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    b_, h_, n_, d_ = q.shape
    s_, group = k.shape[-2], h_ // k.shape[-3]
    allowed = np.broadcast_to(allowed, (b_, h_, n_, s_))
    bias = np.broadcast_to(np.zeros(()) if bias is None else np.asarray(bias, np.float64), allowed.shape)
    weights, lse = np.zeros(allowed.shape), np.full(allowed.shape[:-1], -np.inf)
    for b, head, i in np.ndindex(b_, h_, n_):
        if q_lengths is not None and i >= q_lengths[b]:
            continue
        logits = k[b, head // group] @ q[b, head, i] / np.sqrt(d_) + bias[b, head, i]
        if cap is not None:
            logits = cap * np.tanh(logits / cap)
        ok = allowed[b, head, i] & (logits != -np.inf)
        parts = np.concatenate([logits[ok], [] if sinks is None else [float(sinks[head])]])
        if parts.size:
            top = parts.max()
            lse[b, head, i] = top + np.log(np.exp(parts - top).sum())
            weights[b, head, i, ok] = np.exp(logits[ok] - lse[b, head, i])
    logs = np.log(np.where(weights > 0, weights, 1.0))
    stats = {"entropy": -(weights * logs).sum(-1), "max_weight": weights.max(-1), "received": weights.sum(-2),
             "lse": lse}
    return stats, weights


def from_weights(w):
    """What the statistics mean, from `attention`'s weights."""
    return {"entropy": attention_entropy(w), "max_weight": w.max(-1), "received": w.sum(-2)}


@pytest.fixture(scope="module")
def qkv():
    rng = np.random.default_rng(0)
    return tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32)
                 for shape in ((B, H, N, D), (B, K, S, D), (B, K, S, D)))


def _ids(length, seed):
    return np.sort(np.random.default_rng(seed).integers(0, 3, (B, length)), axis=-1)


_SLOPES = np.linspace(0.1, 0.6, H)
_DIST = np.abs(np.arange(N)[:, None] + (S - N) - np.arange(S)[None, :])  # |query position - key position|
_EMPTY_ROW = np.ones((B, H, N, S), bool)
_EMPTY_ROW[0, 1, 5] = False  # one row of one head sees nothing

# (name, attention_statistics keywords, the NumPy reference's (allowed, bias, cap) keywords)
CASES = [
    ("causal_gqa_bias", dict(is_causal=True, bias=np.linspace(-1, 1, H * N * S).reshape(1, H, N, S)),
     dict(allowed=np_allowed((B, H, N, S), is_causal=True), bias=np.linspace(-1, 1, H * N * S).reshape(1, H, N, S))),
    ("window_lengths_empty_rows", dict(local_window_size=(3, 1), q_lengths=np.array([9, 13]),
                                       kv_lengths=np.array([5, 17])),
     dict(allowed=np_allowed((B, H, N, S), window=(3, 1), q_lengths=[9, 13], kv_lengths=[5, 17]), q_lengths=[9, 13])),
    ("packed_segments", dict(is_causal=True, q_segment_ids=_ids(N, 1), kv_segment_ids=_ids(S, 2)),
     dict(allowed=np_allowed((B, H, N, S), is_causal=True, q_segment_ids=_ids(N, 1), kv_segment_ids=_ids(S, 2)))),
    ("mask_and_minus_inf_bias", dict(mask=_EMPTY_ROW, bias=np.where(np.eye(N, S, 4) > 0, -np.inf, 0.0)),
     dict(allowed=_EMPTY_ROW, bias=np.where(np.eye(N, S, 4) > 0, -np.inf, 0.0))),
    ("score_mod_mask_mod_soft_cap",
     dict(score_mod=lambda s, b, h, i, j: s - jnp.asarray(_SLOPES, s.dtype)[h] * jnp.abs(i + (S - N) - j).astype(
         s.dtype), mask_mod=lambda b, h, i, j: (i + j + h) % 4 != 0, logits_soft_cap=2.0),
     dict(allowed=(np.arange(N)[:, None] + np.arange(S)[None] + np.arange(H)[:, None, None]) % 4 != 0,
          bias=-_SLOPES[:, None, None] * _DIST, cap=2.0)),
]


@pytest.mark.parametrize("implementation", ["xla", "blockwise"])
@pytest.mark.parametrize("name, kw, ref_kw", CASES, ids=[c[0] for c in CASES])
def test_matches_float64_reference_and_dense_weights(qkv, name, kw, ref_kw, implementation):
    q, k, v = qkv
    kw = {key: jnp.asarray(x) if isinstance(x, np.ndarray) else x for key, x in kw.items()}
    blocks = BLOCKS if implementation == "blockwise" else {}
    got = jax.jit(lambda q, k, v: attention_statistics(q, k, v, implementation=implementation, **blocks, **kw))(
        q, k, v)
    want, _ = np_statistics(q, k, **ref_kw)
    for stat in NAMES:
        assert got[stat].shape == want[stat].shape and got[stat].dtype == jnp.float32
        np.testing.assert_allclose(got[stat], want[stat], atol=stat_tolerance(want[stat]), err_msg=f"{name}: {stat}")
    if implementation == "xla":  # the same numbers from attention's own weights
        _, w = jax.jit(lambda q, k, v: attention(q, k, v, return_weights=True, **kw))(q, k, v)
        for stat, value in from_weights(w).items():
            np.testing.assert_allclose(got[stat], value, atol=stat_tolerance(value), err_msg=f"{name}: {stat}")
    if name == "window_lengths_empty_rows":  # the case has empty rows, and they are zeros with lse -inf
        empty = ~ref_kw["allowed"].any(-1)
        assert empty[0, :, 4:].all() and not empty[0, :, :4].any()
        assert np.all(np.asarray(got["lse"])[empty] == -np.inf) and np.all(np.asarray(got["max_weight"])[empty] == 0)


def test_reference_weights_are_np_attention(qkv):
    q, k, v = qkv
    allowed = np_allowed((B, H, N, S), is_causal=True, kv_lengths=[5, 17])
    _, weights = np_statistics(q, k, allowed)
    np.testing.assert_allclose(weights, np_attention(q, k, v, mask=allowed)[1], atol=1e-12)


@pytest.mark.parametrize("implementation", ["xla", "blockwise"])
def test_sinks_join_the_denominator(qkv, implementation):
    q, k, v = qkv
    sinks = jnp.asarray(np.linspace(-1.0, 2.0, H), jnp.float32)
    blocks = BLOCKS if implementation == "blockwise" else {}
    kw = dict(is_causal=True, mask=jnp.asarray(_EMPTY_ROW), q_lengths=jnp.array([11, 13]))
    got = attention_statistics(q, k, v, sinks=sinks, implementation=implementation, **blocks, **kw)
    allowed = np_allowed((B, H, N, S), is_causal=True, mask=_EMPTY_ROW, q_lengths=[11, 13])
    want, weights = np_statistics(q, k, allowed, sinks=np.asarray(sinks), q_lengths=[11, 13])
    for stat in NAMES:
        np.testing.assert_allclose(got[stat], want[stat], atol=stat_tolerance(want[stat]), err_msg=stat)
    lse = np.asarray(got["lse"])
    # The sink takes what the real keys leave; on the row without keys it takes everything.
    np.testing.assert_allclose(np.exp(np.asarray(sinks)[:, None] - lse[1]), 1.0 - weights[1].sum(-1),
                               atol=f32_tolerance(terms=D + S, magnitude=1.0))
    assert lse[0, 1, 5] == pytest.approx(float(sinks[1])) and got["entropy"][0, 1, 5] == 0.0
    assert np.all(lse[0, :, 11:] == -np.inf) and np.all(np.asarray(got["entropy"])[0, :, 11:] == 0)  # padding rows


def test_jit_and_vmap_with_traced_mods(qkv):
    q, k, v = qkv

    def stats(q, k, v, slopes, kv_len):
        mod = lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j).astype(s.dtype)  # closes over a traced array
        return attention_statistics(q, k, v, score_mod=mod, kv_lengths=kv_len, is_causal=True,
                                    implementation="blockwise", **BLOCKS)

    slopes, lengths = jnp.asarray(_SLOPES, jnp.float32), jnp.array([17, 6])
    got = jax.jit(jax.vmap(stats, in_axes=(0, 0, 0, None, 0)))(q, k, v, slopes, lengths)
    dist = np.abs(np.arange(N)[:, None] - np.arange(S)[None, :])
    for b in range(B):
        allowed = np_allowed((1, H, N, S), is_causal=True, kv_lengths=[int(lengths[b])])
        want, _ = np_statistics(q[b:b + 1], k[b:b + 1], allowed, bias=-_SLOPES[:, None, None] * dist)
        for stat in NAMES:
            np.testing.assert_allclose(got[stat][b], want[stat][0], atol=stat_tolerance(want[stat][0]), err_msg=stat)


@pytest.mark.parametrize("implementation", ["xla", "blockwise"])
def test_non_finite_inputs_poison_only_the_rows_that_see_them(implementation):
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((1, 2, 7, 4), (1, 1, 7, 4), (1, 1, 7, 4)))
    ids = jnp.array([[0, 0, 0, 1, 1, 1, 1]])
    kw = dict(is_causal=True, q_segment_ids=ids, q_lengths=jnp.array([6]), implementation=implementation,
              **(dict(query_block_size=2, key_block_size=3) if implementation == "blockwise" else {}))
    clean = attention_statistics(q, k, v, **kw)
    k_bad, q_bad = k.copy(), q.copy()
    k_bad[0, 0, 4, 1] = np.nan  # key 4 (segment 1): rows 4, 5 see it; row 6 is padding
    q_bad[0, 1, 1, 0] = np.inf  # row 1 of head 1 (segment 0) sees keys 0, 1
    q_bad[0, 0, 6, 0] = np.nan  # a padding row
    got = attention_statistics(q_bad, k_bad, v, **kw)
    bad = np.zeros((2, 7), bool)
    bad[:, 4:6] = bad[1, 1] = True  # MQA: both query heads read the bad key
    for stat in ("entropy", "max_weight", "lse"):
        value = np.asarray(got[stat])[0]
        assert np.all(np.isnan(value[bad])), stat
        np.testing.assert_array_equal(value[~bad], np.asarray(clean[stat])[0][~bad], err_msg=stat)
    bad_keys = np.zeros((2, 7), bool)
    bad_keys[:, 3:6] = bad_keys[1, :2] = True  # the keys the poisoned rows may attend
    received = np.asarray(got["received"])[0]
    assert np.all(np.isnan(received[bad_keys]))
    np.testing.assert_array_equal(received[~bad_keys], np.asarray(clean["received"])[0][~bad_keys])
    v_bad = v.copy()
    v_bad[0, 0, 2, 3] = np.nan  # a value of segment 0: row 2 of both heads sees it
    assert np.isnan(np.asarray(attention_statistics(q, k, v_bad, **kw)["entropy"])[0, :, 2]).all()


def test_memory_stays_linear_at_long_context():
    """At N = 8192 the weights alone would take 256 MiB; the blockwise path ("auto"
    takes it at this size) keeps its temporaries under an eighth of that."""
    n = 8192
    x = jax.ShapeDtypeStruct((1, 1, n, 64), jnp.float32)
    compiled = jax.jit(lambda q, k, v: attention_statistics(q, k, v, is_causal=True)).lower(x, x, x).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < n * n * 4 / 8, f"temp {temp / 2**20:.1f} MiB"


def test_float64_and_bfloat16(qkv):
    """Under strict dtype promotion, as the library's other paths are tested."""
    q, k, v = qkv
    with x64(), jax.numpy_dtype_promotion("strict"):
        q64, k64, v64 = (jnp.asarray(np.asarray(x), jnp.float64) for x in (q, k, v))
        got = attention_statistics(q64, k64, v64, is_causal=True, implementation="blockwise", **BLOCKS)
        want, _ = np_statistics(q64, k64, np_allowed((B, H, N, S), is_causal=True))
        for stat in NAMES:
            assert got[stat].dtype == jnp.float64
            np.testing.assert_allclose(got[stat], want[stat], rtol=1e-12, atol=1e-12, err_msg=stat)
    with jax.numpy_dtype_promotion("strict"):
        half = attention_statistics(*(x.astype(jnp.bfloat16) for x in (q, k, v)), is_causal=True)
    want, _ = np_statistics(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), np_allowed((B, H, N, S), is_causal=True))
    assert half["entropy"].dtype == jnp.float32
    np.testing.assert_allclose(half["entropy"], want["entropy"], rtol=2e-2, atol=2e-2)


def test_no_gradient_flows_and_none_raises(qkv):
    """The blockwise path's key loops have traced bounds (reverse mode would refuse them):
    the stopped inputs keep them out of the derivative."""
    q, k, v = qkv
    loss = lambda q: sum(jnp.sum(x) for x in attention_statistics(
        q, k, v, is_causal=True, implementation="blockwise", **BLOCKS).values())
    assert not np.any(np.asarray(jax.grad(loss)(q)))


def test_empty_sizes():
    sinks = jnp.array([0.5, -1.0])
    got = attention_statistics(jnp.ones((2, 2, 3, 4)), jnp.ones((2, 1, 0, 4)), jnp.ones((2, 1, 0, 4)), sinks=sinks,
                               q_lengths=jnp.array([3, 1]))
    assert got["received"].shape == (2, 2, 0) and not np.any(np.asarray(got["entropy"]))
    np.testing.assert_array_equal(got["lse"][0], np.broadcast_to(np.asarray(sinks)[:, None], (2, 3)))
    np.testing.assert_array_equal(got["lse"][1, :, 1:], -np.inf)  # padding rows
    got = attention_statistics(jnp.ones((1, 2, 0, 4)), jnp.ones((1, 2, 5, 4)), jnp.ones((1, 2, 5, 4)))
    assert got["entropy"].shape == (1, 2, 0) and not np.any(np.asarray(got["received"]))


@pytest.mark.parametrize("kw, error, match", [
    (dict(implementation="cudnn"), ValueError, "implementation must be one of"),
    (dict(sinks=jnp.zeros(5)), ValueError, r"sinks must have shape \(H,\) = \(6,\)"),
    (dict(sinks=jnp.zeros(6, jnp.int32)), TypeError, "sinks must be floating"),
    (dict(query_block_size=0), ValueError, "query_block_size must be >= 1, got 0"),
    (dict(key_block_size=2.5), TypeError, "key_block_size must be an int"),
    (dict(mask=jnp.ones((N, S), jnp.int32)), TypeError, "mask must be boolean"),
    (dict(local_window_size=(-1, 2)), ValueError, "left side must be >= 0"),
    (dict(dropout_rate=0.1), TypeError, "unexpected keyword argument 'dropout_rate'"),
    (dict(sinks=jnp.array([0.0, 1.0, np.nan, 0.0, 0.0, 0.0])), ValueError, "sinks must be finite, got nan for head 2"),
])
def test_bad_inputs_raise_one_line_errors(qkv, kw, error, match):
    q, k, v = qkv
    with pytest.raises(error, match=match):
        attention_statistics(q, k, v, **kw)


def test_long_context_study_smoke(tmp_path):
    from experiments import long_context_heads

    record = long_context_heads.main(["--smoke", "--out", str(tmp_path), "--no-progress"])
    data = json.loads((tmp_path / "long_context_heads.json").read_text())
    assert (tmp_path / "long_context_heads.png").stat().st_size > 0
    layers, heads = record["config"]["model"]["num_layers"], record["config"]["model"]["num_heads"]
    assert np.asarray(data["entropy"]).shape == (layers, heads, len(data["bin_centers"]))
    # Entropy is at most that of uniform attention over the keys a query sees.
    assert np.all(np.asarray(data["entropy"]) <= np.asarray(data["uniform_entropy"])[None, None] + 1e-4)
    # Every query's weights sum to one, so the keys receive N in all.
    np.testing.assert_allclose(np.asarray(data["received_total"]), data["config"]["length"], rtol=1e-4)
    from experiments.common_tables import render

    assert len(render(data, "heads").splitlines()) == 2 + layers * heads + 1  # what the results page shows
