"""Tests for `jax_mha.lab.analysis`: head importance against a Python loop over examples,
gates against zeroed output-kernel rows, the structure of iterative pruning.

Sizes are distinct primes where they can be (3 heads, 2 layers, d_model 15 -> D = 5,
T = 12, 7 sequences, 7 symbols), so a swapped layer/head axis cannot pass.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import f32_tolerance

from jax_mha.lab import analysis
from jax_mha.lab.data import CopyTaskConfig, make_batch
from jax_mha.lab.models import CopyTransformer, ModelConfig
from jax_mha.lab.train import scored_loss

TASK = CopyTaskConfig(length=5, num_symbols=7)  # T = 12, vocab 11
LAYERS, HEADS, D_MODEL = 2, 3, 15
BATCH = 7
# The float32 sums of the model's logits, for the tolerances: per layer two layer
# norms (mean and variance over d_model), the q/k/v projections, the logits over a
# head's 5, the softmax sum and weights @ v over T = 12, the output projection, the
# feed-forward layer (d_ff 22); the final norm and the logits. The loss adds the
# softmax over the 11 tokens and the mean over the batch's tokens.
LOGITS_TERMS = LAYERS * (2 * 2 * D_MODEL + D_MODEL + 5 + 2 * 12 + D_MODEL + D_MODEL + 22) + 2 * D_MODEL + D_MODEL
LOSS_TERMS = LOGITS_TERMS + 11 + BATCH * 12


@pytest.fixture(scope="module")
def setup():
    """A tiny copy model with random (untrained) weights and a batch of 7 sequences.

    The positional table and embeddings are scaled up so attention is far from
    uniform and every head's gradient is clearly non-zero."""
    model = CopyTransformer(_config())
    params = jax.jit(model.init)(jax.random.PRNGKey(3), jnp.zeros((1, TASK.seq_len), jnp.int32))["params"]
    params = dict(params, positions=params["positions"] * 50.0)
    batch = jax.jit(make_batch, static_argnums=(1, 2))(jax.random.key(5), TASK, BATCH)
    return model, params, batch


@jax.jit
def _apply(params, inputs, gates):
    return CopyTransformer(_config()).apply({"params": params}, inputs, head_mask=gates)


def _config():
    return ModelConfig(vocab_size=TASK.vocab_size, max_len=TASK.seq_len + 1, d_model=D_MODEL, num_heads=HEADS,
                       num_layers=LAYERS, d_ff=22)


def apply(params, inputs, gates=None):
    """The model's logits, jitted (eager apply compiles op by op: slow)."""
    return _apply(params, inputs, jnp.ones((LAYERS, HEADS)) if gates is None else jnp.asarray(gates, jnp.float32))


def loop_gate_gradient(model, params, batch, gates):
    """Per-example gate gradients, one `jax.grad` call per example: `(B, L, H)`."""

    @jax.jit
    def grad_one(g, one):
        loss = lambda g: scored_loss(model.apply({"params": params}, one["inputs"], head_mask=g), one)[0]
        return jax.grad(loss)(g)

    grads = []
    for n in range(batch["inputs"].shape[0]):
        one = {k: v[n : n + 1] for k, v in batch.items()}
        grads.append(np.asarray(grad_one(gates, one), np.float64))
    return np.stack(grads)


def zero_out_rows(params, layer, head):
    """Params with head `head`'s rows h*D:(h+1)*D of layer `layer`'s out kernel zeroed."""
    d = D_MODEL // HEADS
    kernel = np.array(params[f"block_{layer}"]["attention"]["out"]["kernel"])  # (H*D, d_model)
    kernel[head * d : (head + 1) * d] = 0.0
    block = dict(params[f"block_{layer}"])
    block["attention"] = dict(block["attention"], out=dict(block["attention"]["out"], kernel=kernel))
    return dict(params, **{f"block_{layer}": block})


# ----------------------------------------------------------------- importance


def test_per_example_importance_equals_python_loop(setup):
    model, params, batch = setup
    ones = jnp.ones((LAYERS, HEADS))
    grads = loop_gate_gradient(model, params, batch, ones)  # (B, L, H)
    expected = np.abs(grads).mean(0)
    got = np.asarray(analysis.head_importance(params, model, batch, normalize=False))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(np.asarray(analysis.per_example_gate_gradients(params, model, batch, ones)),
                               grads, rtol=1e-4, atol=1e-7)
    normalized = expected / np.sqrt((expected**2).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(analysis.head_importance(params, model, batch)), normalized, rtol=1e-4)
    chex.assert_shape(got, (LAYERS, HEADS))
    assert np.all(expected > 0)


def test_importance_is_not_the_gradient_of_the_batch_loss(setup):
    """mean |g_n| >= |mean g_n| (every example has the same number of scored tokens,
    so the batch loss is the mean of the per-example losses), strictly somewhere."""
    model, params, batch = setup
    ones = jnp.ones((LAYERS, HEADS))
    batch_grad = jax.jit(jax.grad(lambda g: scored_loss(apply(params, batch["inputs"], g), batch)[0]))(ones)
    per_example = np.asarray(analysis.head_importance(params, model, batch, normalize=False))
    assert np.all(per_example >= np.abs(np.asarray(batch_grad)) - 1e-6)
    assert np.any(per_example > np.abs(np.asarray(batch_grad)) * 1.05)


def test_importance_at_pruned_gates(setup):
    """Gradients are taken at the given gates; removed heads score 0 and are left out
    of their layer's normalisation."""
    model, params, batch = setup
    gates = np.ones((LAYERS, HEADS), np.float32)
    gates[1, 2] = 0.0
    expected = np.abs(loop_gate_gradient(model, params, batch, jnp.asarray(gates))).mean(0) * gates
    got = np.asarray(analysis.head_importance(params, model, batch, gates=gates, normalize=False))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-7)
    normalized = np.asarray(analysis.head_importance(params, model, batch, gates=gates))
    assert normalized[1, 2] == 0.0
    np.testing.assert_allclose(np.linalg.norm(normalized, axis=-1), [1.0, 1.0], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(analysis.head_importance(params, model, batch, gates=None)),
                               np.asarray(analysis.head_importance(params, model, batch, gates=np.ones((LAYERS, HEADS)))))


def test_normalize_per_layer_keeps_zero_rows():
    scores = jnp.asarray([[3.0, 4.0, 0.0], [0.0, 0.0, 0.0]])
    np.testing.assert_allclose(np.asarray(analysis.normalize_per_layer(scores)), [[0.6, 0.8, 0.0], [0.0, 0.0, 0.0]])


# ----------------------------------------------------------------- gates and ablation


@pytest.mark.parametrize("layer,head", [(0, 1), (1, 2)])
def test_gate_off_equals_zeroed_out_kernel_rows(setup, layer, head):
    model, params, batch = setup
    gates = jnp.ones((LAYERS, HEADS)).at[layer, head].set(0.0)
    gated = apply(params, batch["inputs"], gates)
    zeroed = apply(zero_out_rows(params, layer, head), batch["inputs"])
    np.testing.assert_allclose(np.asarray(gated), np.asarray(zeroed), atol=f32_tolerance(terms=LOGITS_TERMS,
                                                                                         magnitude=zeroed))
    full = apply(params, batch["inputs"])
    assert not np.allclose(np.asarray(gated), np.asarray(full), atol=1e-3)  # the head did something


def test_ablate_each_head_matches_zeroed_kernels(setup):
    model, params, batch = setup
    _, base_acc = scored_loss(apply(params, batch["inputs"]), batch)
    expected = np.zeros((LAYERS, HEADS))
    for l in range(LAYERS):
        for h in range(HEADS):
            _, acc = scored_loss(apply(zero_out_rows(params, l, h), batch["inputs"]), batch)
            expected[l, h] = float(base_acc) - float(acc)
    np.testing.assert_allclose(np.asarray(analysis.ablate_each_head(params, model, batch)), expected, atol=1e-6)
    np.testing.assert_allclose(np.asarray(analysis.ablate_each_head(params, model, batch, chunk_size=2)), expected, atol=1e-6)


def test_ablate_each_head_from_pruned_gates(setup):
    """Starting from a pruned model, heads already off lose nothing."""
    model, params, batch = setup
    gates = np.ones((LAYERS, HEADS), np.float32)
    gates[0, 0] = 0.0
    drops = np.asarray(analysis.ablate_each_head(params, model, batch, gates=gates))
    assert drops[0, 0] == 0.0
    acc = analysis.make_accuracy_fn(params, model, batch)
    off = gates.copy()
    off[1, 1] = 0.0
    np.testing.assert_allclose(drops[1, 1], acc(gates) - acc(off), atol=1e-6)


def test_gate_metrics_matches_separate_calls(setup):
    model, params, batch = setup
    rng = np.random.default_rng(0)
    stack = (rng.random((5, LAYERS, HEADS)) > 0.4).astype(np.float32)
    acc, loss = analysis.gate_metrics(params, model, batch, stack)
    chex.assert_shape((acc, loss), (5,))
    for g, a, lo in zip(stack, np.asarray(acc), np.asarray(loss)):
        l_ref, a_ref = scored_loss(apply(params, batch["inputs"], g), batch)
        np.testing.assert_allclose(a, float(a_ref), rtol=1e-5, atol=1e-6)  # a count's ratio: equal, or off by 1 / tokens
        np.testing.assert_allclose(lo, float(l_ref), atol=f32_tolerance(terms=LOSS_TERMS, magnitude=l_ref))


def test_single_head_off_gates():
    gates = jnp.asarray([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    stack = np.asarray(analysis.single_head_off_gates(gates))
    assert stack.shape == (6, 2, 3)
    for i in range(6):
        expected = np.asarray(gates).copy()
        expected[divmod(i, 3)] = 0.0
        np.testing.assert_array_equal(stack[i], expected)


def test_bad_shapes_raise(setup):
    model, params, batch = setup
    with pytest.raises(ValueError, match=r"\(num_layers, num_heads\) = \(2, 3\), got \(3, 2\)"):
        analysis.head_importance(params, model, batch, gates=np.ones((3, 2)))
    with pytest.raises(ValueError, match=r"gate_stack must have shape"):
        analysis.gate_metrics(params, model, batch, np.ones((LAYERS, HEADS)))
    with pytest.raises(ValueError, match="order must be one of"):
        analysis.prune_heads_iteratively(params, model, batch, order="random")
    with pytest.raises(ValueError, match="heads_per_step must be >= 1, got 0"):
        analysis.prune_heads_iteratively(params, model, batch, heads_per_step=0)
    for bad in (5.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match=r"max_drop must be in \[0, 1\]"):
            analysis.prune_heads_iteratively(params, model, batch, max_drop=bad)
    with pytest.raises(ValueError, match="criterion must be one of"):
        analysis.prune_heads_iteratively(params, model, batch, criterion="bpc")


def test_nan_scores_stop_pruning_with_an_error(setup):
    """A model whose losses are NaN cannot be ranked: a clear error, not a loop forever."""
    model, params, batch = setup
    broken = dict(params, logits=jax.tree.map(lambda x: x * jnp.nan, params["logits"]))
    for order in analysis.ORDERS:
        with pytest.raises(FloatingPointError, match=r"not finite for \(layer, head\) \[\(0, 0\)"):
            analysis.prune_heads_iteratively(broken, model, batch, order=order)


def test_loss_criterion_bounds_the_relative_loss_rise(setup):
    model, params, batch = setup
    result = analysis.prune_heads_iteratively(params, model, batch, criterion="loss", max_drop=0.05, run_to_end=True)
    base = result.steps[0].loss
    for step in result.steps:
        assert step.within_rule == (step.loss <= base * 1.05)
    k = result.heads_prunable
    assert all(s.within_rule for s in result.steps[: k + 1]) and result.criterion == "loss"
    if k < result.total_heads:
        assert not result.steps[k + 1].within_rule


# ----------------------------------------------------------------- pruning


def check_structure(result, total, heads_per_step):
    """Monotone in heads removed; gates nested; records consistent with themselves."""
    steps = result.steps
    assert steps[0].num_pruned == 0 and steps[0].removed == [] and np.all(steps[0].gates == 1)
    for prev, step in zip(steps, steps[1:]):
        assert step.num_pruned == min(prev.num_pruned + heads_per_step, total)
        assert np.all(step.gates <= prev.gates)  # once off, off for good
        assert total - step.gates.sum() == step.num_pruned
        for l, h in step.removed:
            assert prev.gates[l, h] == 1 and step.gates[l, h] == 0
        assert step.within_rule == (step.accuracy >= result.base_accuracy - result.max_drop)


@pytest.mark.parametrize("order", analysis.ORDERS)
def test_pruning_is_monotone_and_respects_the_stop_rule(setup, order):
    model, params, batch = setup
    total = LAYERS * HEADS
    accuracy = analysis.make_accuracy_fn(params, model, batch)
    result = analysis.prune_heads_iteratively(params, model, batch, order=order, max_drop=0.0)
    check_structure(result, total, 1)
    for step in result.steps:
        np.testing.assert_allclose(step.accuracy, accuracy(step.gates), atol=1e-7)
    # It stops at the first step outside the rule (or when no head is left).
    assert all(s.within_rule for s in result.steps[:-1])
    assert result.stop_rule_fired == (not result.steps[-1].within_rule)
    assert result.stop_rule_fired or result.steps[-1].num_pruned == total
    assert result.heads_prunable == max(s.num_pruned for s in result.steps if s.within_rule)
    np.testing.assert_array_equal(result.surviving_gates().sum(), total - result.heads_prunable)

    # Run to the end: same prefix, same count, every head gone at last.
    full = analysis.prune_heads_iteratively(params, model, batch, order=order, max_drop=0.0, run_to_end=True)
    check_structure(full, total, 1)
    assert full.heads_prunable == result.heads_prunable
    assert full.steps[-1].num_pruned == total and len(full.steps) == total + 1
    for a, b in zip(result.steps, full.steps):
        np.testing.assert_array_equal(a.gates, b.gates)


def test_pruning_without_a_binding_rule_removes_everything(setup):
    model, params, batch = setup
    result = analysis.prune_heads_iteratively(params, model, batch, max_drop=1.0, heads_per_step=2)
    check_structure(result, LAYERS * HEADS, 2)
    assert [s.num_pruned for s in result.steps] == [0, 2, 4, 6]
    assert result.heads_prunable == LAYERS * HEADS and not result.stop_rule_fired
    assert np.all(result.fractions == np.asarray([0, 2, 4, 6]) / 6)


def test_first_step_removes_the_lowest_ranked_head(setup):
    model, params, batch = setup
    importance = np.asarray(analysis.head_importance(params, model, batch))
    result = analysis.prune_heads_iteratively(params, model, batch, order="importance", max_drop=1.0)
    assert result.steps[1].removed == [divmod(int(importance.argmin()), HEADS)]
    np.testing.assert_allclose(result.steps[1].scores, importance, rtol=1e-6)

    drops = np.asarray(analysis.ablate_each_head(params, model, batch))
    oracle = analysis.prune_heads_iteratively(params, model, batch, order="oracle", max_drop=1.0)
    (l, h), = oracle.steps[1].removed
    assert drops[l, h] == drops.min()


def test_pruning_compiles_once_per_shape(setup):
    """Each step reuses the compiled accuracy / importance / ablation functions."""
    model, params, batch = setup
    analysis.prune_heads_iteratively(params, model, batch, max_drop=1.0, order="importance")
    analysis.prune_heads_iteratively(params, model, batch, max_drop=1.0, order="oracle")
    sizes = (analysis._gate_metrics._cache_size(), analysis._importance._cache_size(), analysis._ablation._cache_size())
    other = jax.tree.map(lambda x: x * 1.01, params)  # new values, same shapes
    analysis.prune_heads_iteratively(other, model, batch, max_drop=1.0, order="importance")
    analysis.prune_heads_iteratively(other, model, batch, max_drop=1.0, order="oracle")
    assert (analysis._gate_metrics._cache_size(), analysis._importance._cache_size(),
            analysis._ablation._cache_size()) == sizes


def test_to_dict_is_plain(setup):
    import json

    model, params, batch = setup
    result = analysis.prune_heads_iteratively(params, model, batch, max_drop=0.0, order="oracle")
    record = json.loads(json.dumps(result.to_dict()))
    assert record["heads_prunable"] == result.heads_prunable
    assert len(record["steps"]) == len(result.steps) and len(record["fractions"]) == len(result.steps)


# ----------------------------------------------------------------- attention statistics


def test_offset_profile_matches_loop(setup):
    model, params, batch = setup
    weights = np.asarray(analysis.attention_weights(params, model, batch["inputs"]))  # (L, B, H, T, T)
    scored = np.asarray(batch["scored"])
    t_len = weights.shape[-1]
    expected = np.zeros((LAYERS, HEADS, t_len))
    for l in range(LAYERS):
        for h in range(HEADS):
            for o in range(t_len):
                vals = [weights[l, b, h, t, t - o] for b in range(BATCH) for t in range(o, t_len) if scored[b, t]]
                expected[l, h, o] = np.mean(vals) if vals else 0.0
    got = np.asarray(analysis.offset_profile(jnp.asarray(weights), batch["scored"]))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(analysis.diagonal_weight(jnp.asarray(weights[1]), 5, batch["scored"])),
                               expected[1, :, 5], rtol=1e-5)
    # Unmasked, on one layer: every query counts.
    one = np.asarray(analysis.offset_profile(jnp.asarray(weights[0])))
    np.testing.assert_allclose(one[:, 0], np.diagonal(weights[0], axis1=-2, axis2=-1).mean((0, 2)), rtol=1e-5)


def test_bpc_criterion_oracle_ranks_by_loss_rise(setup):
    """The LM's rule: the oracle removes the head whose removal raises the loss least,
    and every step inside the rule keeps the loss within 1 % of the unpruned model."""
    model, params, batch = setup
    _, loss_up = analysis._ablation(params, analysis.as_head_model(model), batch, jnp.ones((LAYERS, HEADS)), None)
    result = analysis.prune_heads_iteratively(params, model, batch, order="oracle", criterion="loss", max_drop=0.01,
                                              run_to_end=True)
    assert result.steps[1].removed == [divmod(int(np.argmin(np.asarray(loss_up))), HEADS)]
    base = result.steps[0].loss
    for step in result.steps[1:]:
        assert step.within_rule == (step.loss <= base * 1.01)
    first_out = next((s.num_pruned for s in result.steps if not s.within_rule), np.inf)
    assert result.heads_prunable == max(s.num_pruned for s in result.steps if s.within_rule and s.num_pruned < first_out)


def test_split_bpc_is_the_count_weighted_mean(setup):
    model, params, batch = setup
    stacked = jax.tree.map(lambda x: jnp.stack([x, x.at[:, :4].set(False) if x.dtype == bool else x]), batch)
    losses = [float(scored_loss(apply(params, b["inputs"]), b)[0]) for b in (batch, jax.tree.map(lambda x: x[1], stacked))]
    counts = np.asarray(stacked["scored"].sum((1, 2)), float)
    expected = (losses[0] * counts[0] + losses[1] * counts[1]) / counts.sum() / np.log(2)
    np.testing.assert_allclose(analysis.split_bpc(params, model, stacked), expected, rtol=1e-5)


# ----------------------------------------------------------------- oracle in loss, the causal induction check


def test_ablate_each_head_loss_matches_a_loop(setup):
    model, params, batch = setup
    rises = np.asarray(analysis.ablate_each_head_loss(params, model, batch))
    base = float(scored_loss(_apply(params, batch["inputs"], jnp.ones((LAYERS, HEADS))), batch)[0])
    for layer in range(LAYERS):
        for head in range(HEADS):
            gates = jnp.ones((LAYERS, HEADS)).at[layer, head].set(0.0)
            loss = float(scored_loss(_apply(params, batch["inputs"], gates), batch)[0])
            assert rises[layer, head] == pytest.approx(loss - base, abs=1e-5)


def test_induction_gating_check_gates_the_named_heads(setup):
    from jax_mha.lab import head_types

    model, params, batch = setup
    r = 5
    probe = jnp.concatenate([batch["inputs"][:, :r], batch["inputs"][:, :r]], axis=1)  # (7, 10)
    text = batch["inputs"]  # (7, 12)
    scores = np.array([[0.1, 0.9, 0.2], [0.3, 0.05, 0.8]])
    out = analysis.induction_gating_check(params, model, probe, r, text, scores, k=2, early=(1, 3), late_from_end=3)
    assert out["top"]["heads"] == [(0, 1), (1, 2)] and out["bottom"]["heads"] == [(1, 1), (0, 0)]
    for arm, heads in (("none", []), ("top", [(0, 1), (1, 2)])):
        gates = jnp.asarray(analysis.gates_without((LAYERS, HEADS), heads))
        copy = head_types.copying_effect(_apply(params, probe, gates), probe, r)
        nll = head_types.token_losses(_apply(params, text, gates), text)  # (7, 11)
        assert out[arm]["second_copy_loss"] == pytest.approx(float(copy["second_copy_loss"]), rel=1e-5)
        assert out[arm]["early_loss"] == pytest.approx(float(nll[:, 1:3].mean()), rel=1e-5)
        assert out[arm]["late_loss"] == pytest.approx(float(nll[:, -3:].mean()), rel=1e-5)
    assert out["top"]["second_copy_loss"] != out["none"]["second_copy_loss"]  # gating changed something


def test_same_layer_controls_match_the_arm_layer_by_layer():
    scores = np.zeros((3, 5))
    heads = [(1, 2), (1, 4), (2, 0)]
    draws = analysis.same_layer_controls(scores, heads, draws=40, seed=3)
    assert len(draws) == 40
    for d in draws:
        assert sorted(layer for layer, _ in d) == [1, 1, 2]  # as many from each layer as the arm
        assert not set(d) & set(heads) and len(set(d)) == 3
    assert len({tuple(d) for d in draws}) > 1  # random, not one fixed set
    with pytest.raises(ValueError, match="layer 1 has 1 other heads"):
        analysis.same_layer_controls(np.zeros((2, 3)), [(1, 0), (1, 1)], draws=1)


def test_induction_gating_check_controls_are_gated_losses(setup):
    model, params, batch = setup
    r = 5
    probe = jnp.concatenate([batch["inputs"][:, :r], batch["inputs"][:, :r]], axis=1)
    text = batch["inputs"]
    scores = np.array([[0.1, 0.9, 0.2], [0.3, 0.05, 0.8]])
    out = analysis.induction_gating_check(params, model, probe, r, text, scores, k=1, controls=4, seed=0,
                                          early=(1, 3), late_from_end=3)
    assert len(out["controls"]) == 4
    for c in out["controls"]:
        (layer, head), = c["heads"]
        assert layer == 0 and head != 1  # the top head (0, 1) lives in layer 0
        twin = analysis.induction_gating_check(params, model, probe, r, text, _only(layer, head),
                                               k=1, early=(1, 3), late_from_end=3)["top"]
        assert c["second_copy_loss"] == pytest.approx(twin["second_copy_loss"], rel=1e-6)


def _only(layer, head):
    s = np.zeros((LAYERS, HEADS))
    s[layer, head] = 1.0
    return s
