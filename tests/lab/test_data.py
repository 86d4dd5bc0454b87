"""The delayed copy task: format, scored mask, determinism, reverse and padded variants."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_mha.lab.data import BOS, EOS, FIRST_SYMBOL, PAD, SEP, CopyTaskConfig, chance_accuracy, make_batch


def _tokens(batch):
    """Reassembles the full token sequences (B, 2L+3) from inputs/targets."""
    return np.concatenate([np.asarray(batch["inputs"])[:, :1], np.asarray(batch["targets"])], axis=1)


def test_format_and_scored_mask():
    cfg = CopyTaskConfig(length=7, num_symbols=5)
    batch = make_batch(jax.random.PRNGKey(3), cfg, 11)
    for name in ("inputs", "targets", "scored"):
        chex.assert_shape(batch[name], (11, cfg.seq_len))
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    tokens = _tokens(batch)
    L = cfg.length
    assert (tokens[:, 0] == BOS).all() and (tokens[:, L + 1] == SEP).all() and (tokens[:, 2 * L + 2] == EOS).all()
    first, second = tokens[:, 1 : L + 1], tokens[:, L + 2 : 2 * L + 2]
    np.testing.assert_array_equal(first, second)
    assert first.min() >= FIRST_SYMBOL and first.max() < FIRST_SYMBOL + cfg.num_symbols
    # Scored targets: exactly the second copy and EOS (target index = token index - 1).
    expected = np.zeros(cfg.seq_len, bool)
    expected[L + 1 : 2 * L + 2] = True
    np.testing.assert_array_equal(batch["scored"], np.broadcast_to(expected, (11, cfg.seq_len)))
    # Symbols are uniform-ish: every one of the 5 appears.
    assert len(np.unique(first)) == cfg.num_symbols


def test_deterministic_per_key_and_jittable():
    cfg = CopyTaskConfig(length=5)
    a = make_batch(jax.random.PRNGKey(0), cfg, 13)
    b = make_batch(jax.random.PRNGKey(0), cfg, 13)
    c = make_batch(jax.random.PRNGKey(1), cfg, 13)
    chex.assert_trees_all_equal(a, b)
    assert not np.array_equal(a["inputs"], c["inputs"])
    jitted = jax.jit(make_batch, static_argnums=(1, 2))(jax.random.PRNGKey(0), cfg, 13)
    chex.assert_trees_all_equal(a, jitted)


def test_reverse_variant():
    cfg = CopyTaskConfig(length=6, reverse=True)
    tokens = _tokens(make_batch(jax.random.PRNGKey(2), cfg, 7))
    L = cfg.length
    np.testing.assert_array_equal(tokens[:, 1 : L + 1][:, ::-1], tokens[:, L + 2 : 2 * L + 2])
    assert (tokens[:, 2 * L + 2] == EOS).all()


def test_variable_length_padding():
    cfg = CopyTaskConfig(length=9, min_length=2)
    batch = make_batch(jax.random.PRNGKey(5), cfg, 64)
    tokens = _tokens(batch)
    lengths = (tokens == SEP).argmax(1) - 1
    assert lengths.min() >= 2 and lengths.max() <= 9 and len(np.unique(lengths)) > 3
    for row, l, scored in zip(tokens, lengths, np.asarray(batch["scored"])):
        np.testing.assert_array_equal(row[1 : l + 1], row[l + 2 : 2 * l + 2])
        assert row[2 * l + 2] == EOS and (row[2 * l + 3 :] == PAD).all()
        assert scored.sum() == l + 1 and scored[l + 1 : 2 * l + 2].all()


def test_config_errors_and_chance():
    with pytest.raises(ValueError, match="min_length=5 must be in \\[1, length=3\\]"):
        CopyTaskConfig(length=3, min_length=5)
    with pytest.raises(ValueError, match="length=0"):
        CopyTaskConfig(length=0)
    # L=9 symbols at 1/10 each plus a free EOS, over 10 scored tokens.
    assert chance_accuracy(CopyTaskConfig(length=9)) == pytest.approx((0.9 + 1) / 10)


def test_task_interface_and_round_trip():
    from jax_mha.lab.data import TASKS, task_from_dict, task_to_dict

    cfg = CopyTaskConfig(length=5, min_length=2, num_symbols=7, reverse=True)
    chex.assert_trees_all_equal(cfg.batch(jax.random.PRNGKey(4), 3), make_batch(jax.random.PRNGKey(4), cfg, 3))
    data = task_to_dict(cfg)
    assert data == {"name": "copy", "length": 5, "min_length": 2, "num_symbols": 7, "reverse": True}
    assert task_from_dict(data) == cfg and TASKS["copy"] is CopyTaskConfig
    assert task_from_dict({"length": 5}) == CopyTaskConfig(length=5)  # files without a name are copy tasks
    with pytest.raises(ValueError, match="unknown task 'bogus'"):
        task_from_dict({"name": "bogus"})
    with pytest.raises(ValueError, match="cannot be built"):
        task_from_dict({"name": "copy", "width": 3})


def test_exact_accuracy_counts_whole_sequences():
    """A model that knows the answer decodes every sequence; one that is wrong at a
    single scored position of a sequence loses that whole sequence."""
    cfg = CopyTaskConfig(length=4, num_symbols=5)
    batch = make_batch(jax.random.PRNGKey(6), cfg, 7)
    vocab = cfg.vocab_size

    def oracle(tokens, wrong_row=None):
        # Knows every scored target; optionally wrong once in one row.
        answer = jnp.where(batch["scored"], batch["targets"], 0)
        if wrong_row is not None:
            answer = answer.at[wrong_row, -2].set(FIRST_SYMBOL + (answer[wrong_row, -2] - FIRST_SYMBOL + 1) % 5)
        return jax.nn.one_hot(answer, vocab) * 10.0

    perfect = cfg.eval_metrics(oracle, None, batch)["exact_accuracy"]
    assert float(perfect) == 1.0
    one_wrong = cfg.eval_metrics(lambda t: oracle(t, wrong_row=2), None, batch)["exact_accuracy"]
    assert float(one_wrong) == pytest.approx(6 / 7)


def test_bad_sizes():
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        make_batch(jax.random.PRNGKey(0), CopyTaskConfig(), 0)
    with pytest.raises(TypeError, match="length must be an int"):
        CopyTaskConfig(length=2.5)
    with pytest.raises(ValueError, match="num_symbols=1"):
        CopyTaskConfig(num_symbols=1)


# ----------------------------------------------------------------- multi-query associative recall


def _recall_reference(tokens: np.ndarray, num_pairs: int) -> dict[int, int]:
    """Independent reading of one row: {input position t: the value the key (tokens[t-1], tokens[t]) names}."""
    context = {(int(tokens[1 + 3 * i]), int(tokens[2 + 3 * i])): int(tokens[3 + 3 * i]) for i in range(num_pairs)}
    out = {}
    for t in range(3 * num_pairs + 3, len(tokens) - 1, 3):  # each query's b, after BOS, the pairs and SEP
        out[t] = context[(int(tokens[t - 1]), int(tokens[t]))]
    return out


def test_recall_targets_are_the_value_of_the_matching_key():
    from jax_mha.lab.data import RecallTaskConfig, make_recall_batch

    cfg = RecallTaskConfig(num_pairs=7, num_queries=5, num_key_symbols=3, num_values=11)
    batch = jax.tree.map(np.asarray, make_recall_batch(jax.random.PRNGKey(3), cfg, 13))
    assert batch["inputs"].shape == (13, cfg.seq_len) == (13, 3 * 12 + 1)
    for row in range(13):
        tokens = np.concatenate([batch["inputs"][row], batch["targets"][row, -1:]])
        keys = [(tokens[1 + 3 * i], tokens[2 + 3 * i]) for i in range(7)]
        assert len(set(keys)) == 7  # distinct keys, so the answer is unique
        assert all(cfg.first_value <= tokens[3 + 3 * i] < cfg.vocab_size for i in range(7))
        expected = _recall_reference(tokens, 7)
        assert sorted(np.flatnonzero(batch["scored"][row])) == sorted(expected)
        for t, value in expected.items():
            assert batch["targets"][row, t] == value
    # With 3 key symbols and 7 pairs, some row holds both (a, b) and (b, a): order matters.
    rows = [{(int(r[1 + 3 * i]), int(r[2 + 3 * i])) for i in range(7)} for r in batch["inputs"]]
    assert any((x, y) in keys and (y, x) in keys and x != y for keys in rows for (x, y) in keys)


def test_recall_task_checks_and_registration():
    from jax_mha.lab.data import TASKS, RecallTaskConfig, task_from_dict, task_to_dict

    cfg = RecallTaskConfig(num_pairs=4, num_queries=2)
    assert TASKS["mqar"] is RecallTaskConfig and task_from_dict(task_to_dict(cfg)) == cfg
    old = {k: v for k, v in task_to_dict(cfg).items() if k != "queries_with_replacement"}
    assert task_from_dict(old).queries_with_replacement is False  # files of the earlier generator
    with pytest.raises(ValueError, match="num_key_symbols"):
        RecallTaskConfig(num_pairs=10, num_key_symbols=3)
    with pytest.raises(ValueError, match="num_queries=3 distinct keys"):
        RecallTaskConfig(num_pairs=2, num_queries=3, queries_with_replacement=False)
    assert RecallTaskConfig(num_pairs=2, num_queries=3).seq_len == 16  # with repeats, Q may exceed N
    with pytest.raises(TypeError, match="queries_with_replacement must be a bool"):
        RecallTaskConfig(queries_with_replacement=1)
    batch = cfg.batch(jax.random.PRNGKey(0), 5)
    perfect = cfg.eval_metrics(None, jax.nn.one_hot(batch["targets"], cfg.vocab_size), batch)
    assert float(perfect["recall_accuracy"]) == 1.0 and float(perfect["query_exact"]) == 1.0
    wrong = cfg.eval_metrics(None, jax.nn.one_hot(jnp.zeros_like(batch["targets"]), cfg.vocab_size), batch)
    assert float(wrong["recall_accuracy"]) == 0.0 and float(wrong["query_exact"]) == 0.0


def test_recall_queries_repeat_keys_unless_asked_once():
    from jax_mha.lab.data import RecallTaskConfig, make_recall_batch

    for replace in (True, False):
        cfg = RecallTaskConfig(num_pairs=5, num_queries=5, num_key_symbols=3, num_values=7,
                               queries_with_replacement=replace)
        batch = jax.tree.map(np.asarray, make_recall_batch(jax.random.PRNGKey(11), cfg, 400))
        tokens = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)
        queries = tokens[:, 2 + 3 * 5 :].reshape(400, 5, 3)[..., :2]
        distinct = np.array([len({tuple(q) for q in row}) for row in queries])
        if replace:
            # 5 draws from 5 keys repeat one with probability 1 - 5!/5^5 = 0.96; every key
            # is asked about as often (uniform draws): each of the 5 pairs ~ 1/5 of queries.
            assert 0.9 < np.mean(distinct < 5) < 1.0
            pairs = tokens[:, 1 : 1 + 15].reshape(400, 5, 3)[..., :2]
            which = (pairs[:, None] == queries[:, :, None]).all(-1).argmax(-1)  # (rows, Q) pair index asked
            assert np.all(np.abs(np.bincount(which.ravel(), minlength=5) / which.size - 0.2) < 0.03)
        else:
            assert np.all(distinct == 5)  # the earlier variant: every key once
        for row in range(20):
            expected = _recall_reference(tokens[row], 5)
            for t, value in expected.items():
                assert batch["targets"][row, t] == value
