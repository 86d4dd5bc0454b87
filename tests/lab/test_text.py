"""The character corpus: the leak-free three-way split, vocabulary, random and held-out batches, files, bpc."""

import math
from pydoc_data.topics import topics

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import f32_tolerance

from jax_mha.lab.text import (
    TextTaskConfig,
    bits_per_character,
    corpus_from_file,
    corpus_from_text,
    leak_free_groups,
    load_corpus,
    make_text_batch,
    reference_corpus,
    split_documents,
    split_topics,
    validation_batches,
    verbatim_overlap,
    window_hashes,
)


@pytest.fixture(scope="module")
def corpus():
    return reference_corpus(TextTaskConfig())


def test_reference_split_is_by_topic_deterministic_and_three_way(corpus):
    again = reference_corpus(TextTaskConfig())
    for name in ("train", "dev", "test"):
        np.testing.assert_array_equal(corpus.split(name), again.split(name))
    dev, test = list(corpus.dev_topics), list(corpus.test_topics)
    rest = sorted(set(topics) - set(dev) - set(test))
    assert dev and test and not set(dev) & set(test) and len(dev) + len(test) + len(rest) == len(topics)
    # Rebuilt independently from pydoc_data: each split is exactly its topics' text.
    assert corpus.decode(corpus.dev) == "\n".join(topics[n] for n in sorted(dev))
    assert corpus.decode(corpus.test) == "\n".join(topics[n] for n in sorted(test))
    assert corpus.decode(corpus.train) == "\n".join(topics[n] for n in rest)
    total = sum(len(t) for t in topics.values())
    for names in (dev, test):
        assert 0.09 < sum(len(topics[n]) for n in names) / total <= 0.1
    assert corpus.validation is corpus.dev and corpus.validation_topics == corpus.dev_topics  # the older names
    assert corpus.vocabulary == "".join(sorted(set("".join(topics.values()))))
    assert corpus.source.startswith("pydoc_data.topics (Python 3.")
    with pytest.raises(ValueError, match="split must be one of .* got 'valid'"):
        corpus.split("valid")


def brute_force_overlap(reference: str, other: str, width: int = 64) -> float:
    """Share of `other`'s characters inside a `width`-character run found in `reference`:
    a Python set of every window as a string, independent of the library's hashing."""
    windows = {reference[i : i + width] for i in range(len(reference) - width + 1)}
    covered = np.zeros(len(other), bool)
    for i in range(len(other) - width + 1):
        if other[i : i + width] in windows:
            covered[i : i + width] = True
    return float(covered.mean()) if other else 0.0


def test_held_out_text_is_not_inside_training_text(corpus):
    train = corpus.decode(corpus.train)
    for name in ("dev", "test"):
        held = corpus.decode(corpus.split(name))
        assert brute_force_overlap(train, held) < 0.02, name
        assert verbatim_overlap(corpus.train, corpus.split(name)) < 0.02, name
    # The former split by topic alone leaked: about half of its held-out characters lie
    # inside a 64-character run of training text (nested topics), and the checker sees it.
    old_train, old_held = split_topics(topics, 0.1)
    join = lambda names: "\n".join(topics[n] for n in names)
    assert verbatim_overlap(join(old_train), join(old_held)) > 0.4


def test_verbatim_overlap_equals_the_brute_force_count():
    rng = np.random.default_rng(3)
    for _ in range(5):
        reference = "".join(rng.choice(list("abc"), 400))
        other = "".join(rng.choice(list("abc"), 150)) + reference[37:61] + "".join(rng.choice(list("ab"), 90))
        for width in (1, 5, 9, 23):
            assert verbatim_overlap(reference, other, width) == pytest.approx(brute_force_overlap(reference, other, width))
    ids = np.array([4, 1, 5, 9, 2, 6], np.int32)
    assert verbatim_overlap(ids, ids[1:4], 3) == 1.0 and verbatim_overlap(ids, ids[::-1], 2) == 0.0
    assert verbatim_overlap("abc", "ab", 3) == 0.0  # shorter than a window
    np.testing.assert_array_equal(window_hashes("xyxy", 2)[[0, 2]], window_hashes("xyxy", 2)[[2, 0]])
    assert window_hashes("xyxy", 2)[0] != window_hashes("xyxy", 2)[1]
    with pytest.raises(ValueError, match="width must be an int >= 1, got 0"):
        window_hashes("abc", 0)
    with pytest.raises(ValueError, match="shape \\(2, 2\\)"):
        verbatim_overlap(np.zeros((2, 2), np.int32), "ab", 1)


def test_leak_free_groups_join_quoting_documents_transitively():
    rng = np.random.default_rng(0)
    text = lambda n: "".join(rng.choice(list("abcdefgh "), n))
    a, c, e = text(300), text(200), text(250)
    b = "intro " + a[50:130] + " outro"  # quotes 80 characters of a
    # d quotes b's first 64 characters, which hold "intro " (letters a's alphabet lacks):
    # d shares no window with a, and joins a's group only through b.
    docs = {"a": a, "b": b, "c": c, "d": "so " + b[:64] + " and more", "e": e}
    docs["f"] = "short " + e[:40]  # shares only 40 characters with e: below the width, kept apart
    groups = leak_free_groups(docs, width=64)
    assert groups == [["a", "b", "d"], ["c"], ["e"], ["f"]]
    train, dev, test = split_documents(docs, 0.3, 0.3, width=64)
    for group in groups:  # a group never straddles two splits
        assert sum(bool(set(group) & set(part)) for part in (train, dev, test)) == 1
    assert split_documents(docs, 0.3, 0.3, width=64) == (train, dev, test)
def test_split_topics_respects_the_fraction():
    docs = {f"doc{i}": "x" * (7 * i + 3) for i in range(13)}
    train, held = split_topics(docs, 0.3)
    assert split_topics(docs, 0.3) == (train, held)
    assert sorted(train + held) == sorted(docs) and not set(train) & set(held)
    assert 0 < sum(len(docs[n]) for n in held) <= 0.3 * sum(len(d) for d in docs.values())


def test_vocabulary_round_trip_and_errors(corpus):
    text = 'The "if" statement — “quoted”, 3.14 + x**2…\n'
    ids = corpus.encode(text)
    assert ids.dtype == np.int32 and ids.shape == (len(text),)
    assert corpus.decode(ids) == text
    with pytest.raises(ValueError, match="'€'"):
        corpus.encode("price: 5 €")
    with pytest.raises(ValueError, match="id 103 is outside"):
        corpus.decode(np.array([0, corpus.vocab_size]))


def test_random_batch_layout_and_windows(corpus):
    cfg = TextTaskConfig(seq_len=11)
    batch = make_text_batch(jax.random.key(3), corpus.train, cfg, 7)
    for name, dtype in (("inputs", jnp.int32), ("targets", jnp.int32), ("scored", jnp.bool_)):
        chex.assert_shape(batch[name], (7, 11))
        assert batch[name].dtype == dtype
    inputs, targets = np.asarray(batch["inputs"]), np.asarray(batch["targets"])
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
    assert np.asarray(batch["scored"]).all()
    assert inputs.min() >= 0 and targets.max() < corpus.vocab_size
    train_text = corpus.decode(corpus.train)
    for row_in, row_t in zip(inputs, targets):
        assert corpus.decode(np.concatenate([row_in, row_t[-1:]])) in train_text  # a real window


def test_random_batch_determinism_jit_and_edges():
    cfg = TextTaskConfig(seq_len=5)
    tokens = jnp.arange(8, dtype=jnp.int32)  # T + 3 characters: starts 0, 1, 2
    sample = jax.jit(make_text_batch, static_argnums=(2, 3))
    a = sample(jax.random.key(0), tokens, cfg, 97)
    chex.assert_trees_all_equal(a, make_text_batch(jax.random.key(0), tokens, cfg, 97))
    assert not np.array_equal(a["inputs"], sample(jax.random.key(1), tokens, cfg, 97)["inputs"])
    starts = np.asarray(a["inputs"][:, 0])
    assert set(starts.tolist()) == {0, 1, 2}  # the last window ends on the last character
    np.testing.assert_array_equal(a["targets"], starts[:, None] + 1 + np.arange(5))  # no clipping


def test_validation_batches_score_every_character_once():
    n, cfg = 53, TextTaskConfig(seq_len=7)
    tokens = np.arange(n, dtype=np.int32)  # ids are positions: a target names what it scores
    batches = validation_batches(tokens, cfg, 3)
    num_windows = math.ceil((n - 1) / 7)  # 8 windows, the last end-aligned
    for name in ("inputs", "targets", "scored"):
        chex.assert_shape(batches[name], (math.ceil(num_windows / 3), 3, 7))
    np.testing.assert_array_equal(batches["inputs"][..., 1:], batches["targets"][..., :-1])
    np.testing.assert_array_equal(batches["targets"], batches["inputs"] + 1)  # windows of real text
    scored = np.sort(np.asarray(batches["targets"])[np.asarray(batches["scored"])])
    np.testing.assert_array_equal(scored, np.arange(1, n))
    np.testing.assert_array_equal(batches["scored"].sum((1, 2)), [21, 21, 10])
    exact = validation_batches(np.arange(15, dtype=np.int32), cfg, 2)  # 14 targets = 2 full windows
    assert exact["scored"].shape == (1, 2, 7) and bool(exact["scored"].all())
    one_over = validation_batches(np.arange(16, dtype=np.int32), cfg, 2)  # 15 targets: a third window
    np.testing.assert_array_equal(np.sort(one_over["targets"][one_over["scored"]]), np.arange(1, 16))


def test_bits_per_character():
    assert float(bits_per_character(math.log(2))) == pytest.approx(1.0)
    losses, counts = np.array([1.0, 2.0, 4.0]), np.array([10, 10, 5])
    expected = (10 * 1.0 + 10 * 2.0 + 5 * 4.0) / 25 / math.log(2)
    assert float(bits_per_character(losses, num_scored=counts)) == pytest.approx(expected, rel=1e-6)
    assert float(jax.jit(bits_per_character)(jnp.float32(math.log(4)))) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="loss_nats=\\[-1.0\\]"):
        bits_per_character([-1.0])
    with pytest.raises(ValueError, match="loss_nats=nan"):
        bits_per_character(float("nan"))
    with pytest.raises(ValueError, match="num_scored=\\[0.0, 0.0\\]"):
        bits_per_character([1.0, 1.0], num_scored=[0, 0])


def test_file_corpus(tmp_path):
    text = "".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\r\n" for i in range(31))
    path = tmp_path / "own.txt"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))  # with a BOM and CRLF line ends
    cfg = TextTaskConfig(seq_len=13, validation_fraction=0.2, test_fraction=0.15, text_file=str(path))
    corpus = load_corpus(cfg)
    clean = text.replace("\r\n", "\n")
    train, dev, test = (corpus.decode(corpus.split(name)) for name in ("train", "dev", "test"))
    assert train + dev + test == clean and len(dev) == round(0.2 * len(clean)) and len(test) == round(0.15 * len(clean))
    assert corpus.vocabulary == "".join(sorted(set(clean))) and str(path) in corpus.source
    batch = make_text_batch(jax.random.key(0), corpus.train, cfg, 5)
    assert int(batch["targets"].max()) < corpus.vocab_size
    same = corpus_from_text(clean, cfg)
    np.testing.assert_array_equal(same.validation, corpus.validation)


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "does not exist"),
        ("dir", "is a directory"),
        (b"", "is empty"),
        (b"abc\xff\xfe", "is not UTF-8: byte 3 is 0xff"),
        (b"0123456789" * 3, "too short: its splits have 24 training, 3 dev and 3 test characters"),
    ],
)
def test_file_errors_name_the_file(tmp_path, content, message):
    path = tmp_path / "text.txt"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=message) as err:
        corpus_from_file(path, TextTaskConfig(seq_len=5))
    assert "text.txt" in str(err.value)


def test_reference_too_short_for_a_huge_window():
    with pytest.raises(ValueError, match="seq_len \\+ 1 = 100001"):
        reference_corpus(TextTaskConfig(seq_len=100_000))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"seq_len": 0}, ValueError, "seq_len=0"),
        ({"seq_len": 2.5}, TypeError, "seq_len must be an int, got 2.5"),
        ({"validation_fraction": 0.0}, ValueError, "validation_fraction=0.0"),
        ({"validation_fraction": 1.0}, ValueError, "validation_fraction=1.0"),
        ({"test_fraction": -0.1}, ValueError, "test_fraction=-0.1"),
        ({"validation_fraction": 0.5, "test_fraction": 0.5}, ValueError, "test_fraction = 1.0 must be < 1"),
        ({"text_file": ""}, ValueError, "text_file=''"),
    ],
)
def test_config_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        TextTaskConfig(**kwargs)


def test_batch_errors():
    cfg = TextTaskConfig(seq_len=7)
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="has 7 characters, fewer than seq_len \\+ 1 = 8"):
        make_text_batch(key, jnp.arange(7), cfg, 2)
    with pytest.raises(ValueError, match="shape \\(2, 9\\)"):
        make_text_batch(key, jnp.zeros((2, 9), jnp.int32), cfg, 2)
    with pytest.raises(ValueError, match="dtype float32"):
        validation_batches(np.zeros(20, np.float32), cfg, 2)
    with pytest.raises(ValueError, match="batch_size=0"):
        make_text_batch(key, jnp.arange(20), cfg, 0)
    with pytest.raises(TypeError, match="text must be a str, got bytes"):
        corpus_from_text(b"abc")


# ----------------------------------------------------------------- the "lm" task the trainer consumes

LM_TEXT = "The cat sat. A dog ran far away, and the cat sat still. " * 3  # 168 chars, vocab of 19


@pytest.fixture(scope="module")
def lm_task(tmp_path_factory):
    path = tmp_path_factory.mktemp("lm") / "text.txt"
    path.write_text(LM_TEXT, encoding="utf-8")
    return TextTaskConfig(seq_len=7, validation_fraction=0.25, text_file=str(path))


def test_lm_task_is_a_registered_task_and_round_trips(lm_task):
    from jax_mha.lab.data import TASKS, task_from_dict, task_to_dict

    assert TASKS["lm"] is TextTaskConfig and lm_task.stop_metric is None  # never stops early
    data = task_to_dict(lm_task)
    assert data == {"name": "lm", "seq_len": 7, "validation_fraction": 0.25, "text_file": lm_task.text_file,
                    "track_induction": False, "test_fraction": 0.1}
    assert task_from_dict(data) == lm_task and hash(task_from_dict(data)) == hash(lm_task)
    assert lm_task.corpus is lm_task.corpus  # loaded once, cached per config
    assert lm_task.vocab_size == len(set(LM_TEXT))


def test_lm_task_batches_are_windows_of_their_split(lm_task):
    corpus, t = lm_task.corpus, lm_task.seq_len
    train = corpus.decode(corpus.train)
    batch = jax.jit(lm_task.batch, static_argnums=1)(jax.random.key(3), 5)
    chex.assert_shape([batch["inputs"], batch["targets"]], (5, t))
    for row_in, row_out in zip(np.asarray(batch["inputs"]), np.asarray(batch["targets"])):
        assert corpus.decode(row_in) + corpus.decode(row_out)[-1:] in train
    val = lm_task.eval_batch(None, 3)  # evenly spaced: the first and the last window of the dev split
    dev = np.asarray(corpus.dev)
    np.testing.assert_array_equal(val["inputs"][0], dev[:t])
    np.testing.assert_array_equal(val["targets"][-1], dev[-t:])
    assert bool(val["scored"].all())
    test = lm_task.windows("test", 2)  # the reported split: its own first and last window
    np.testing.assert_array_equal(test["inputs"][0], corpus.test[:t])
    np.testing.assert_array_equal(test["targets"][-1], corpus.test[-t:])
    with pytest.raises(ValueError, match="split must be one of"):
        lm_task.windows("holdout", 2)


def test_lm_eval_metric_is_bits_per_character_by_hand(lm_task):
    """bpc from hand-made logits: -log2 softmax at the targets, averaged in float64."""
    batch = {"targets": jnp.array([[0, 2], [1, 1]]), "scored": jnp.array([[True, True], [True, False]])}
    logits = jnp.array([[[2.0, 0.0, 0.0], [0.0, 0.0, 1.0]], [[1.0, 3.0, 0.0], [9.0, 9.0, 9.0]]])
    p = lambda row, k: math.exp(row[k]) / sum(math.exp(v) for v in row)
    expected = -(math.log2(p([2, 0, 0], 0)) + math.log2(p([0, 0, 1], 2)) + math.log2(p([1, 3, 0], 1))) / 3
    got = lm_task.eval_metrics(None, logits, batch)["bpc"]
    # float32: a log-softmax over 3 (at the logits' size), a mean over the 3 scored tokens.
    np.testing.assert_allclose(float(got), expected, atol=f32_tolerance(terms=3 + 3, magnitude=logits))
    uniform = lm_task.eval_metrics(None, jnp.zeros((2, 2, 3)), batch)["bpc"]
    np.testing.assert_allclose(float(uniform), math.log2(3), atol=f32_tolerance(terms=3 + 3, magnitude=math.log2(3)))


# ----------------------------------------------------------------- n-gram baselines


def test_ngram_on_iid_uniform_text_is_log2_k():
    from jax_mha.lab.text import ngram_bpc

    k = 5
    rng = np.random.default_rng(0)
    train, validation = rng.integers(0, k, 60_000), rng.integers(0, k, 8_000)
    for order in (1, 2, 3):
        # An i.i.d. uniform source has entropy log2 k at every order; the smoothed
        # estimate may sit a little above it (finite counts), never meaningfully below.
        assert ngram_bpc(train, validation, order, vocab_size=7) == pytest.approx(np.log2(k), abs=0.02)


def test_ngram_on_periodic_text_needs_enough_context():
    from jax_mha.lab.text import ngram_bpc

    # After "0" comes 1 or 3, after "1" comes 2 or 0: a bigram is unsure (1 bit) at 4 of
    # the 6 positions, a trigram's two-character context is never ambiguous.
    period = np.array([0, 1, 2, 0, 3, 1])
    train, validation = np.tile(period, 2_000), np.tile(period, 100)
    uni = ngram_bpc(train, validation, 1, vocab_size=4)
    bi = ngram_bpc(train, validation, 2, vocab_size=4)
    tri = ngram_bpc(train, validation, 3, vocab_size=4)
    frequencies = np.bincount(period, minlength=4) / period.size
    assert uni == pytest.approx(-(frequencies * np.log2(frequencies)).sum(), abs=0.01)
    assert bi == pytest.approx(4 / 6, abs=0.01)
    assert tri < 0.01


def test_ngram_unseen_context_falls_back_and_rejects_bad_input():
    from jax_mha.lab.text import ngram_bpc

    # Validation "3 3": context 3 never appears in training, so the bigram equals the unigram.
    train, validation = np.array([0, 1, 2, 0, 1, 2, 3]), np.array([3, 3])
    assert ngram_bpc(train, validation, 2, 4) == pytest.approx(ngram_bpc(train, validation, 1, 4))
    with pytest.raises(ValueError, match="order"):
        ngram_bpc(train, validation, 0, 4)
    with pytest.raises(ValueError, match=r"ids in \[0, 3\)"):
        ngram_bpc(train, validation, 1, 3)


def test_induction_tracking_at_every_evaluation():
    import dataclasses

    from jax_mha.lab.models import ModelConfig
    from jax_mha.lab.train import TrainConfig, train_seeds

    task = TextTaskConfig(seq_len=32, track_induction=True)
    model = ModelConfig(vocab_size=task.vocab_size, max_len=32, d_model=8, num_heads=2, num_layers=2, d_ff=16)
    train = TrainConfig(batch_size=4, num_steps=20, warmup_steps=2, steps_per_call=10, eval_every=10, eval_size=8,
                        early_stop=False)
    ev = train_seeds(model, task, train, [0, 1]).evals
    assert ev["prefix_matching_frequent"].shape == (2, 2, 2, 2)  # (seeds, evaluations, layers, heads)
    assert ev["prefix_matching_spans"].shape == (2, 2, 2, 2)
    for name in ("icl_score", "copying_frequent", "copying_spans", "second_copy_loss_spans"):
        assert ev[name].shape == (2, 2) and np.all(np.isfinite(ev[name]))
    # An untrained model attends almost uniformly: its prefix matching sits near chance.
    chance = float(ev["prefix_matching_chance"][0, 0])
    assert np.all(np.abs(ev["prefix_matching_spans"] - chance) < 0.5 * chance + 0.05)
    plain = dataclasses.replace(task, track_induction=False)
    assert "icl_score" not in plain.eval_metrics(None, jnp.zeros((1, 32, task.vocab_size)),
                                                 plain.eval_batch(None, 1))
