"""The published anchors (`experiments.anchor_*`) and what they added to the harness:
attention-only decoders (`ModelConfig(d_ff=0)`), in-context Markov chains
(`MarkovTaskConfig` and its strategies), single-token MQAR keys
(`RecallTaskConfig(key_tokens=1)`) and the repeat task's induction probe. Each anchor
runs once at its tiny size; the pieces are checked against NumPy float64 references and
brute-force counts."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import f32_tolerance

from experiments import anchor_induction, anchor_markov, anchor_mqar, common_anchors, report
from jax_mha.lab import head_types, stats
from jax_mha.lab.data import (
    FIRST_SYMBOL,
    MarkovTaskConfig,
    RecallTaskConfig,
    RepeatTaskConfig,
    in_context_strategies,
    sample_markov_chains,
    stationary_distribution,
    task_from_dict,
    task_to_dict,
)
from jax_mha.lab.models import Decoder, ModelConfig, generate
from jax_mha.lab.train import scored_loss

# ----------------------------------------------------------------- attention-only decoder


def _layer_norm(x, p, eps=1e-6):
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * np.asarray(p["scale"], np.float64) + np.asarray(p["bias"], np.float64)


def _attention_only_reference(params, tokens, num_heads: int, head_dim: int) -> np.ndarray:
    """Float64 NumPy forward of a pre-norm attention-only decoder: `(B, T) -> (B, T, V)`."""
    f64 = lambda a: np.asarray(a, np.float64)
    t = tokens.shape[1]
    x = f64(params["embed"]["embedding"])[tokens] + f64(params["positions"])[:t]
    causal = np.tril(np.ones((t, t), bool))
    layer = 0
    while f"block_{layer}" in params:
        blk = params[f"block_{layer}"]
        y = _layer_norm(x, blk["norm1"])
        split = lambda w: (y @ f64(w)).reshape(*y.shape[:2], num_heads, head_dim).transpose(0, 2, 1, 3)  # (B, H, T, D)
        q, k, v = (split(blk["attention"][n]["kernel"]) for n in ("query", "key", "value"))
        s = np.where(causal, q @ k.transpose(0, 1, 3, 2) / math.sqrt(head_dim), -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        o = (w @ v).transpose(0, 2, 1, 3).reshape(*y.shape[:2], num_heads * head_dim)
        x = x + o @ f64(blk["attention"]["out"]["kernel"]) + f64(blk["attention"]["out"]["bias"])
        layer += 1
    x = _layer_norm(x, params["final_norm"])
    return x @ f64(params["logits"]["kernel"]) + f64(params["logits"]["bias"])


def test_attention_only_decoder_matches_a_float64_reference():
    # Every size different (V 7, T 11, d 5, H 3, D 2: attention width 6 != d) so a swapped axis cannot pass.
    cfg = ModelConfig(vocab_size=7, max_len=13, d_model=5, num_heads=3, head_dim=2, num_layers=2, d_ff=0)
    model = Decoder(cfg)
    tokens = jax.random.randint(jax.random.key(1), (2, 11), 0, 7)
    params = model.init(jax.random.key(0), tokens)["params"]
    for name in ("block_0", "block_1"):
        assert sorted(params[name]) == ["attention", "norm1"]  # no ffn, no norm2
    params = jax.tree.map(lambda p: p + 0.3 * jax.random.normal(jax.random.key(2), p.shape), params)  # off init
    logits, weights = model.apply({"params": params}, tokens, return_weights=True)
    want = _attention_only_reference(params, np.asarray(tokens), 3, 2)
    # Per layer: the norm (mean and variance over d), the projections over d, the logits
    # over D, the softmax sum and weights @ v over T, the output projection over H*D;
    # the final norm, the logits.
    terms = 2 * (2 * 2 * 5 + 5 + 2 + 2 * 11 + 6) + 2 * 5 + 5
    np.testing.assert_allclose(logits, want, atol=f32_tolerance(terms=terms, magnitude=want))
    assert weights.shape == (2, 2, 3, 11, 11)


def test_attention_only_decoder_decodes_through_its_cache_and_refuses_a_negative_width():
    cfg = ModelConfig(vocab_size=7, max_len=13, d_model=6, num_heads=2, num_layers=2, d_ff=0)
    model = Decoder(cfg)
    prompt = jax.random.randint(jax.random.key(3), (3, 4), 0, 7)
    params = model.init(jax.random.key(0), prompt)["params"]
    out = generate(params, model, prompt, 7)  # through the KV cache, token by token
    full = model.apply({"params": params}, out)  # the whole sequence at once
    np.testing.assert_array_equal(out[:, 4:], jnp.argmax(full[:, 3:-1], -1))  # each token the full pass's argmax
    with pytest.raises(ValueError, match="d_ff must be >= 0, got -1"):
        ModelConfig(d_ff=-1)


# ----------------------------------------------------------------- in-context Markov chains


def _brute_force_strategies(tokens: np.ndarray, k: int) -> dict[str, np.ndarray]:
    """Position by position, by counting in Python: the definitions of the docstring."""
    b, t = tokens.shape
    uni, bi = np.zeros((b, t, k)), np.zeros((b, t, k))
    for r in range(b):
        for i in range(t):
            seen = tokens[r, : i + 1].tolist()
            uni[r, i] = [(seen.count(j) + 1) / (i + 1 + k) for j in range(k)]
            after = [seen[s + 1] for s in range(i) if seen[s] == seen[i]]
            bi[r, i] = [(after.count(j) + 1) / (len(after) + k) for j in range(k)]
    return {"uniform": np.full((b, t, k), 1 / k), "unigram": uni, "bigram": bi}


def test_in_context_strategies_equal_brute_force_counts():
    tokens = np.random.default_rng(0).integers(0, 5, (3, 17))
    got = in_context_strategies(jnp.asarray(tokens), 5)
    for name, want in _brute_force_strategies(tokens, 5).items():
        np.testing.assert_allclose(got[name], want, atol=1e-6, err_msg=name)


def test_markov_eval_metrics_are_the_strategies_losses_and_divergences():
    task = MarkovTaskConfig(seq_len=13, num_states=5)
    batch = task.batch(jax.random.key(4), 7)
    bigram = in_context_strategies(batch["inputs"], 5)["bigram"]
    logits = jnp.log(bigram) + 3.0  # softmax-invariant shift: the model *is* the bigram strategy
    out = task.eval_metrics(None, logits, batch)
    # The float32 sums: a softmax over the 5 states, the means over the 7 x 13 tokens, of
    # log-probabilities of the logits' size.
    tol = f32_tolerance(terms=5 + 7 * 13, magnitude=logits)
    assert abs(float(out["kl_bigram"])) < tol and float(out["kl_unigram"]) > 1e-3
    np.testing.assert_allclose(out["bigram_loss"], scored_loss(logits, batch)[0], atol=tol)
    np.testing.assert_allclose(out["uniform_loss"], math.log(5), atol=f32_tolerance(terms=5 + 7 * 13,
                                                                                    magnitude=math.log(5)))


def test_markov_chains_follow_their_transition_matrices():
    task = MarkovTaskConfig(seq_len=3001, num_states=3)
    transitions, tokens = (np.asarray(x) for x in sample_markov_chains(jax.random.key(5), task, 2))
    pi = np.asarray(stationary_distribution(jnp.asarray(transitions)))
    np.testing.assert_allclose(np.einsum("bi,bij->bj", pi, transitions), pi, atol=1e-5)
    for r in range(2):
        counts = np.zeros((3, 3))
        np.add.at(counts, (tokens[r, :-1], tokens[r, 1:]), 1)
        seen = counts.sum(1) > 300  # rows visited often enough to estimate
        np.testing.assert_allclose((counts / counts.sum(1, keepdims=True))[seen], transitions[r][seen], atol=0.08)
    for bad, match in (({"num_states": 1}, "num_states"), ({"concentration": float("nan")}, "concentration"),
                       ({"concentration": 0}, "concentration")):
        with pytest.raises(ValueError, match=match):
            MarkovTaskConfig(**bad)
    assert task_from_dict(task_to_dict(task)) == task


# ----------------------------------------------------------------- single-token MQAR keys, the induction probe


def test_single_token_keys_score_the_value_of_the_queried_key():
    task = RecallTaskConfig(num_pairs=5, num_queries=7, num_key_symbols=11, num_values=3, key_tokens=1)
    batch = jax.tree.map(np.asarray, task.batch(jax.random.key(6), 13))
    assert task.seq_len == 2 * (5 + 7) + 1 == batch["inputs"].shape[1]
    for row, target, scored in zip(batch["inputs"], batch["targets"], batch["scored"]):
        pairs = dict(zip(row[1:11:2].tolist(), row[2:11:2].tolist()))
        assert len(pairs) == 5  # distinct keys
        assert [pairs[row[i]] for i in np.flatnonzero(scored)] == target[scored].tolist()
    with pytest.raises(ValueError, match="key_tokens must be 1 or 2, got 3"):
        RecallTaskConfig(key_tokens=3)
    assert "key_tokens" not in task_to_dict(RecallTaskConfig())  # saved runs' fingerprints unchanged
    assert task_from_dict(task_to_dict(task)) == task


def test_repeat_probe_and_its_prefix_matching_at_evaluation():
    task = RepeatTaskConfig(seq_len=12, min_repeat=2, max_repeat=6, num_symbols=8, track_induction=True)
    probe, r = task.induction_probe(), task.probe_repeat
    assert probe.shape == (32, 2 * r) and (probe[:, :r] == probe[:, r:]).all()
    assert all(len(set(row[:r])) == r for row in probe) and probe.min() >= FIRST_SYMBOL
    model = Decoder(ModelConfig(vocab_size=task.vocab_size, max_len=12, d_model=6, num_heads=2, num_layers=2, d_ff=0))
    params = model.init(jax.random.key(0), jnp.asarray(probe))["params"]
    logits_fn = lambda t: model.apply({"params": params}, t)
    out = task.eval_metrics(logits_fn, None, None)
    _, weights = model.apply({"params": params}, jnp.asarray(probe), return_weights=True)  # the model's own weights
    want = head_types.prefix_matching_score(weights, r)
    # The weights' sums (two attention-only layers of d 6, T 12), then the score's mean over the probes' rows.
    terms = 2 * (2 * 2 * 6 + 6 + 3 + 2 * 12 + 6) + 32 * 2 * r
    np.testing.assert_allclose(out["prefix_matching"], want, atol=f32_tolerance(terms=terms, magnitude=want))
    assert RepeatTaskConfig().eval_metrics(logits_fn, None, None) == {}


# ----------------------------------------------------------------- the anchors at their tiny size


def _run(module, tmp_path, *extra):
    out = tmp_path / module.NAME
    module.main(["--preset", "tiny", "--out", str(out), "--no-progress", *extra])
    results = json.loads((out / "results.json").read_text())
    data = json.loads((out / "artifact.json").read_text())
    assert (out / f"anchor_{module.NAME}.png").stat().st_size > 0 and (out / "summary.md").exists()
    for block in common_anchors.RENDERERS[data["kind"]]:
        assert report.render(data, block).strip()  # the page's blocks render from the artifact
    return out, results, data


def test_induction_anchor_tiny(tmp_path):
    _, results, data = _run(anchor_induction, tmp_path, "--layers", "2")
    arm = data["arms"]["2"]
    assert arm["seeds"] == [0, 1] and len(arm["max_prefix_matching"]) == 2
    r = results["probe_repeat"]
    assert data["chance"] == pytest.approx(head_types.prefix_matching_chance(r))
    run = results["arms"]["2"]["runs"][0]
    pm = np.asarray(run["prefix_matching"])  # (evaluations, layers, heads)
    assert pm.shape[1:] == (2, 2) and (0 <= pm).all() and (pm <= 1).all()
    assert run["max_prefix_matching"] == pytest.approx(pm[-1].max())


def test_mqar_anchor_tiny_resumes_without_retraining(tmp_path, monkeypatch):
    out, results, data = _run(anchor_mqar, tmp_path, "--widths", "8")
    assert set(data["widths"]) == {"8"} and data["reference"]["chance"] == pytest.approx(1 / 4)
    accs = data["widths"]["8"]["final_accuracy"]
    assert accs == [run["recall_accuracy"][-1] for run in results["arms"]["8"]["runs"]]

    def no_training(*args, **kwargs):
        raise AssertionError("a finished width was trained again")

    monkeypatch.setattr(common_anchors, "train_seeds", no_training)
    again = anchor_mqar.main(["--preset", "tiny", "--out", str(out), "--no-progress", "--widths", "8"])
    assert again["arms"]["8"]["runs"][0]["final_accuracy"] == accs[0]


def test_markov_anchor_tiny_lines_are_the_trainers_held_out_rows(tmp_path):
    _, results, data = _run(anchor_markov, tmp_path, "--layers", "2")
    arm = results["arms"]["2"]
    for name in ("uniform", "unigram", "bigram"):  # computed apart, from the trainer's eval key: the same rows
        assert arm["strategy_losses"][name] == pytest.approx(data["reference"][name], abs=1e-5)
    assert data["reference"]["oracle"] < data["reference"]["bigram"] < data["reference"]["uniform"]
    for stages in data["arms"]["2"]["stages"]:
        assert [s for s, _ in stages][0] in anchor_markov.STRATEGIES
        assert [step for _, step in stages] == sorted(step for _, step in stages)


def test_common_anchors_count_and_order():
    stages = [[["uniform", 20], ["unigram", 60], ["bigram", 400]], [["uniform", 20], ["bigram", 80], ["unigram", 90]],
              [["unigram", 20], ["bigram", 80]]]
    assert common_anchors.markov_staged({"stages": stages}) == [True, False, False]  # ends at unigram; no uniform
    assert common_anchors.steps_cell([300, None, 100, 200]) == "200 (100–300; 3/4)"
    low, high = stats.wilson_interval(3, 5)
    assert common_anchors.share([True, True, False, True, False]) == f"3/5 [{low:.2f}, {high:.2f}]"
