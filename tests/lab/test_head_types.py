"""Head-type scores against hand-built weights and a float64 NumPy loop reference."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import f32_tolerance

from jax_mha.lab.head_types import (
    DIFFUSE_THRESHOLD,
    HEAD_TYPES,
    INDUCTION_THRESHOLD,
    HeadScores,
    classify_heads,
    count_head_types,
    first_token_score,
    head_scores,
    head_type_table,
    induction_score,
    induction_targets,
    mean_entropy,
    normalized_entropy,
    previous_token_score,
    repeated_random_tokens,
)

L, B, T = 2, 3, 11  # prime-sized: a swapped axis cannot pass
SCORE_TERMS = B * T + T  # a score's float32 sums: over the batch's queries (and the entropy's over the keys)


def assert_scores_close(got, want, terms=SCORE_TERMS):
    """Each score array within `f32_tolerance` at its own size."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=f32_tolerance(terms=terms, magnitude=w))


def _one_hot_rows(keys_of_query: np.ndarray) -> np.ndarray:
    """`(T,)` key index per query -> `(T, T)` weights with all mass on that key."""
    w = np.zeros((len(keys_of_query), len(keys_of_query)))
    w[np.arange(len(keys_of_query)), keys_of_query] = 1.0
    return w


def _uniform_causal(t: int) -> np.ndarray:
    return np.tril(np.ones((t, t))) / np.arange(1, t + 1)[:, None]


def _random_causal(rng, shape) -> np.ndarray:
    logits = np.where(np.tril(np.ones(shape[-2:], bool)), rng.normal(size=shape) * 2, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    return w / w.sum(-1, keepdims=True)


def _np_scores(w, keep):
    """Loop reference: mean over kept queries t >= 1 of w[t, t-1], w[t, 0] and the entropy."""
    num_l, num_b, num_h, t, _ = w.shape
    out = np.zeros((3, num_l, num_h))
    for l in range(num_l):
        for h in range(num_h):
            rows = [(b, q) for b in range(num_b) for q in range(1, t) if keep[b, q]]
            out[0, l, h] = np.mean([w[l, b, h, q, q - 1] for b, q in rows])
            out[1, l, h] = np.mean([w[l, b, h, q, 0] for b, q in rows])
            ent = [-sum(x * np.log(x) for x in w[l, b, h, q] if x > 0) for b, q in rows]
            out[2, l, h] = np.mean(ent)
    return out


def test_hand_built_heads_score_their_known_values():
    heads = [
        _one_hot_rows(np.maximum(np.arange(T) - 1, 0)),  # perfect previous-token head
        _uniform_causal(T),
        _one_hot_rows(np.zeros(T, int)),  # perfect sink
    ]
    w = jnp.asarray(np.broadcast_to(np.stack(heads)[None, None], (L, B, 3, T, T)), jnp.float32)
    chance = np.mean(1.0 / np.arange(2, T + 1))  # uniform: 1/(t+1) on any one key, t = 1 … T-1
    expected_prev = np.array([1.0, chance, 1 / (T - 1)])  # the sink hits key t-1 only at t = 1
    expected_first = np.array([1 / (T - 1), chance, 1.0])
    expected_entropy = np.array([0.0, np.mean(np.log(np.arange(2, T + 1))), 0.0])
    tile = lambda x: np.broadcast_to(x, (L, 3))
    assert_scores_close(previous_token_score(w), tile(expected_prev))
    assert_scores_close(first_token_score(w), tile(expected_first))
    assert_scores_close(mean_entropy(w), tile(expected_entropy))
    assert_scores_close(normalized_entropy(w), tile(np.array([0.0, 1.0, 0.0])))


def test_random_heads_against_numpy_loops_with_query_mask(rng):
    w = _random_causal(rng, (L, B, 5, T, T))
    mask = rng.random((B, T)) < 0.6
    mask[0, 3] = True  # at least one kept query
    expected = _np_scores(w, mask)
    w32, m = jnp.asarray(w, jnp.float32), jnp.asarray(mask)
    got = [previous_token_score(w32, m), first_token_score(w32, m), mean_entropy(w32, m)]
    assert_scores_close(got, list(expected))
    no_mask = _np_scores(w, np.ones((B, T), bool))
    assert_scores_close(previous_token_score(w32), no_mask[0])


def test_repeated_random_tokens_structure():
    prefix = np.array([1, 0, 2])
    tokens = np.asarray(repeated_random_tokens(jax.random.key(0), 7, 5, 13, low=3, prefix=prefix))
    assert tokens.shape == (7, 3 + 10) and tokens.dtype == np.int32
    np.testing.assert_array_equal(tokens[:, :3], np.broadcast_to(prefix, (7, 3)))
    first, second = tokens[:, 3:8], tokens[:, 8:]
    np.testing.assert_array_equal(first, second)
    assert all(len(set(row)) == 5 for row in first.tolist())  # distinct within a copy
    assert first.min() >= 3 and first.max() < 13
    assert len(np.unique(first[:, 0])) > 1  # rows differ
    jitted = jax.jit(repeated_random_tokens, static_argnums=(1, 2, 3))(jax.random.key(0), 7, 5, 13)
    chex.assert_trees_all_equal(jitted, repeated_random_tokens(jax.random.key(0), 7, 5, 13))


@pytest.mark.parametrize("prefix_len", [0, 2])
def test_perfect_induction_pattern_scores_one(prefix_len):
    r = 7
    prefix = np.arange(prefix_len)  # ids below `low`: never in the copies
    tokens = repeated_random_tokens(jax.random.key(1), B, r, 17, low=2, prefix=prefix)
    t = prefix_len + 2 * r
    # By hand: the second-copy query at P + R + i reads key P + i + 1; other queries read themselves.
    keys = np.arange(t)
    second = keys >= prefix_len + r
    keys = np.where(second, keys - r + 1, keys)
    target, has = induction_targets(tokens)
    np.testing.assert_array_equal(has, np.broadcast_to(second, (B, t)))
    np.testing.assert_array_equal(np.asarray(target)[:, second], np.broadcast_to(keys[second], (B, r)))
    induction = _one_hot_rows(keys)
    previous = _one_hot_rows(np.maximum(np.arange(t) - 1, 0))
    w = jnp.asarray(np.stack([induction, previous, _uniform_causal(t)])[None, None], jnp.float32)
    w = jnp.broadcast_to(w, (L, B, 3, t, t))
    score = np.asarray(induction_score(w, tokens))
    uniform = np.mean(1.0 / (np.arange(prefix_len + r, t) + 1))
    assert_scores_close(score, np.broadcast_to([1.0, 0.0, uniform], (L, 3)), terms=B * t)


def test_induction_on_text_uses_most_recent_occurrence_three_back():
    tokens = jnp.asarray([[5, 6, 5, 7, 5, 8, 8, 6]])  # queries 4 (5 at 2 and 0) and 7 (6 at 1)
    target, has = induction_targets(tokens)
    np.testing.assert_array_equal(has[0], [0, 0, 0, 0, 1, 0, 0, 1])  # 5 at 2 is 2 back; 8 at 5 is 1 back
    assert int(target[0, 4]) == 1 and int(target[0, 7]) == 2


def test_head_scores_jit_matches_eager_and_classify(rng):
    text = jnp.asarray(_random_causal(rng, (L, B, 5, T, T)), jnp.float32)
    tokens = repeated_random_tokens(jax.random.key(2), 2, 4, 9)
    ind = jnp.asarray(_random_causal(rng, (L, 2, 5, 8, 8)), jnp.float32)
    eager = head_scores(text, ind, tokens)
    assert_scores_close(jax.jit(head_scores)(text, ind, tokens), eager)
    chex.assert_shape(list(eager), (L, 5))
    labels = classify_heads(eager)
    assert labels.shape == (L, 5) and set(labels.ravel()) <= set(HEAD_TYPES)
    table = head_type_table(eager, labels)
    assert len(table) == L * 5 and table[6]["layer"] == 1 and table[6]["head"] == 1
    assert table[6]["induction"] == pytest.approx(float(eager.induction[1, 1]))
    assert sum(count_head_types(labels).values()) == L * 5


def _scores(induction, previous, first, norm_entropy):
    to = lambda x: jnp.asarray([x], jnp.float32)  # (1 layer, H)
    return HeadScores(to(previous), to(induction), to(first), to(np.zeros(len(induction))), to(norm_entropy))


def test_classifier_thresholds_and_ties():
    t = INDUCTION_THRESHOLD
    scores = _scores(
        induction=[t, t - 1e-4, 0.1, 0.6, 0.3, 0.0, 0.0],
        previous=[0.0, 0.0, 0.7, 0.6, 0.3, 0.0, 0.0],
        first=[0.0, 0.0, 0.2, 0.0, 0.3, 0.0, 0.0],
        norm_entropy=[0.0, 0.0, 0.0, 0.0, DIFFUSE_THRESHOLD, DIFFUSE_THRESHOLD - 1e-4, 1.0],
    )
    labels = classify_heads(scores)
    expected = ["induction", "other", "previous_token", "induction", "diffuse", "other", "diffuse"]
    np.testing.assert_array_equal(labels[0], expected)
    assert count_head_types(labels) == {
        "induction": 2, "previous_token": 1, "first_token": 0, "diffuse": 2, "other": 2
    }
    # A lower induction threshold: the highest *passing* pattern wins.
    relaxed = classify_heads(_scores([0.35], [0.45], [0.0], [0.0]), induction=0.3)
    assert relaxed[0, 0] == "induction"
    rows = head_type_table(scores)
    assert [r["type"] for r in rows] == expected and rows[0]["induction"] == pytest.approx(t)


def test_classifier_errors():
    scores = _scores([0.2, np.nan], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0])
    with pytest.raises(ValueError, match="induction score of layer 0 head 1 is NaN"):
        classify_heads(scores)
    ok = _scores([0.2], [0.0], [0.0], [0.0])
    with pytest.raises(ValueError, match="threshold induction=1.5"):
        classify_heads(ok, induction=1.5)
    with pytest.raises(ValueError, match="unknown thresholds \\['sink'\\]"):
        classify_heads(ok, sink=0.5)
    with pytest.raises(ValueError, match="unknown head types \\['retrieval'\\]"):
        count_head_types(np.array([["induction", "retrieval"]]))


def test_bad_inputs_name_the_value():
    w = jnp.asarray(np.broadcast_to(_uniform_causal(T), (L, B, 5, T, T)), jnp.float32)
    tokens = repeated_random_tokens(jax.random.key(0), B, 3, 5)  # T' = 6
    with pytest.raises(ValueError, match="got \\(3, 5, 11, 11\\)"):
        previous_token_score(w[0])
    with pytest.raises(ValueError, match="got \\(2, 3, 5, 11, 7\\)"):
        first_token_score(w[..., :7])
    with pytest.raises(ValueError, match="dtype int32"):
        mean_entropy(w.astype(jnp.int32))
    with pytest.raises(ValueError, match="T=1"):
        previous_token_score(w[..., :1, :1])
    with pytest.raises(ValueError, match="query_mask must have shape \\(B, T\\)=\\(3, 11\\), got \\(11,\\)"):
        previous_token_score(w, jnp.ones(T, bool))
    with pytest.raises(ValueError, match="query_mask must be bool, got dtype int32"):
        previous_token_score(w, jnp.ones((B, T), jnp.int32))
    with pytest.raises(ValueError, match="no query to average the first-token score"):
        first_token_score(w, jnp.zeros((B, T), bool).at[:, 0].set(True))
    with pytest.raises(ValueError, match="tokens must have shape \\(B, T\\)=\\(3, 11\\), got \\(3, 6\\)"):
        induction_score(w, tokens)
    with pytest.raises(ValueError, match="no query to average the induction score"):
        induction_score(w, jnp.broadcast_to(jnp.arange(T), (B, T)))  # nothing recurs
    with pytest.raises(ValueError, match="same num_layers and H"):
        head_scores(w, w[:, :, :4], tokens)
    with pytest.raises(ValueError, match="repeat_length=2 must be in \\[3, vocab_size - low = 9\\]"):
        repeated_random_tokens(jax.random.key(0), 2, 2, 10, low=1)
    with pytest.raises(ValueError, match="repeat_length=10"):
        repeated_random_tokens(jax.random.key(0), 2, 10, 10, low=1)
    with pytest.raises(ValueError, match="low=10"):
        repeated_random_tokens(jax.random.key(0), 2, 3, 10, low=10)
    with pytest.raises(ValueError, match="prefix ids \\[1, 12\\]"):
        repeated_random_tokens(jax.random.key(0), 2, 3, 10, prefix=np.array([1, 12]))
    with pytest.raises(ValueError, match="batch_size=0"):
        repeated_random_tokens(jax.random.key(0), 0, 3, 10)


# ----------------------------------------------------------------- prefix matching, copying, ICL


def _causal_uniform(layers, batch, heads, t):
    w = np.tril(np.ones((t, t))) / np.arange(1, t + 1)[:, None]
    return jnp.asarray(np.broadcast_to(w, (layers, batch, heads, t, t)), jnp.float32)


def test_prefix_matching_is_high_on_an_induction_pattern_and_chance_on_uniform():
    from jax_mha.lab.head_types import prefix_matching_chance, prefix_matching_score

    p, r, layers, batch, heads = 2, 5, 2, 3, 7
    t = p + 2 * r + 1  # one trailing token after the copies
    uniform = _causal_uniform(layers, batch, heads, t)
    induction = np.array(uniform)
    for q in range(p + r, p + 2 * r):  # head 4 of layer 1 reads the key after the first occurrence
        induction[1, :, 4, q] = 0.0
        induction[1, :, 4, q, q - r + 1] = 1.0
    scores = np.asarray(prefix_matching_score(jnp.asarray(induction), r, p))
    chance = prefix_matching_chance(r, p)
    assert scores[1, 4] == pytest.approx(1.0)
    # Every other head is uniform: exactly the chance level, mean of 1/(q+1) over the second copy.
    assert chance == pytest.approx(np.mean([1 / (q + 1) for q in range(p + r, p + 2 * r)]))
    np.testing.assert_allclose(np.delete(scores.ravel(), 1 * heads + 4), chance, rtol=1e-6)
    # A previous-token head is not an induction head.
    prev = np.zeros((1, batch, 1, t, t), np.float32)
    prev[0, :, 0, 0, 0] = 1.0
    for q in range(1, t):
        prev[0, :, 0, q, q - 1] = 1.0
    assert float(prefix_matching_score(jnp.asarray(prev), r, p)[0, 0]) == 0.0
    with pytest.raises(ValueError, match="cannot hold"):
        prefix_matching_score(uniform, 6, p)


def test_copying_effect_by_hand():
    from jax_mha.lab.head_types import copying_effect

    r, v = 4, 11
    tokens = jnp.asarray([[3, 1, 4, 5, 3, 1, 4, 5], [2, 7, 1, 8, 2, 7, 1, 8]])
    logits = np.zeros((2, 8, v), np.float32)  # uniform everywhere: ln V nats ...
    for t in range(r, 2 * r - 1):  # ... except a confident, right second copy
        logits[:, t, :] = -30.0
        logits[np.arange(2), t, np.asarray(tokens[:, t + 1])] = 30.0
    out = copying_effect(jnp.asarray(logits), tokens, r)
    assert float(out["first_copy_loss"]) == pytest.approx(np.log(v), rel=1e-5)
    assert float(out["second_copy_loss"]) == pytest.approx(0.0, abs=1e-5)
    assert float(out["copying"]) == pytest.approx(np.log(v), rel=1e-5)
    same = copying_effect(jnp.zeros((2, 8, v)), tokens, r)  # a model that ignores context: no effect
    assert float(same["copying"]) == pytest.approx(0.0, abs=1e-6)


def test_icl_score_sign():
    from jax_mha.lab.head_types import icl_score

    t = 40
    falling = jnp.broadcast_to(3.0 - jnp.arange(t) / t, (5, t))  # the context helps
    # Late = positions 24…39 (mean 3 - 31.5/40), early = 8…15 (mean 3 - 11.5/40): -20/40.
    assert float(icl_score(falling)) == pytest.approx(-0.5, abs=1e-5)
    assert float(icl_score(jnp.ones((5, t)))) == 0.0
    with pytest.raises(ValueError, match="cannot hold"):
        icl_score(jnp.ones((2, 20)))


def test_frequent_and_real_span_probes():
    from jax_mha.lab.head_types import frequent_symbols, repeated_spans, repeated_symbols

    train = np.array([5, 5, 5, 2, 2, 9, 9, 9, 9, 1])
    np.testing.assert_array_equal(frequent_symbols(train, 11, 3), [9, 5, 2])
    rows = np.asarray(repeated_symbols(jax.random.PRNGKey(0), 7, 3, [9, 5, 2], prefix=[0]))
    assert rows.shape == (7, 7) and np.all(rows[:, 0] == 0)
    np.testing.assert_array_equal(rows[:, 1:4], rows[:, 4:])
    assert all(sorted(r[1:4]) == [2, 5, 9] for r in rows)  # distinct, drawn from the frequent ones only
    spans = repeated_spans(np.arange(100), 4, 6)
    np.testing.assert_array_equal(spans[:, :6], spans[:, 6:])
    np.testing.assert_array_equal(spans[-1, :6], np.arange(94, 100))
    with pytest.raises(ValueError, match="fewer than count"):
        frequent_symbols(train, 11, 5)
