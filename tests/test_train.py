"""Training loop: one step learns, a tiny model solves the copy task (and needs attention
to), vmap over seeds equals separate runs, non-finite losses stop at once."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_mha.data import CopyTaskConfig, chance_accuracy, make_batch
from jax_mha.models import CopyTransformer, ModelConfig
from jax_mha.train import (
    TrainConfig,
    evaluate,
    greedy_decode,
    init_state,
    jit_train_step,
    make_optimizer,
    train_seeds,
)

TASK = CopyTaskConfig(length=6)
MODEL = ModelConfig(vocab_size=TASK.vocab_size, max_len=TASK.seq_len, d_model=32, num_heads=4, num_layers=2, d_ff=64)
TRAIN = TrainConfig(batch_size=32, num_steps=400, learning_rate=3e-3, warmup_steps=20,
                    steps_per_call=50, eval_every=100, eval_size=128)


@pytest.fixture(scope="module")
def trained():
    """One tiny model trained on the copy task (shared by the tests below)."""
    result = train_seeds(MODEL, TASK, TRAIN, [0])
    return result, jax.tree.map(lambda x: x[0], result.state.params)


def test_one_step_lowers_loss_on_fixed_batch():
    model = CopyTransformer(MODEL)
    optimizer = make_optimizer(dataclasses.replace(TRAIN, warmup_steps=0))
    state = init_state(jax.random.PRNGKey(0), model, optimizer)
    batch = make_batch(jax.random.PRNGKey(1), TASK, 16)
    step = jit_train_step(model, optimizer)
    before = float(step(jax.tree.map(jnp.copy, state), batch, jax.random.PRNGKey(2))[1]["loss"])
    state, metrics = step(state, batch, jax.random.PRNGKey(2))
    after = float(step(state, batch, jax.random.PRNGKey(3))[1]["loss"])
    assert float(metrics["loss"]) == pytest.approx(before)
    assert after < before - 0.05, (before, after)
    chex.assert_tree_all_finite(metrics)


def test_train_step_donates_state_and_does_not_retrace():
    model = CopyTransformer(MODEL)
    optimizer = make_optimizer(TRAIN)
    batch = make_batch(jax.random.PRNGKey(1), TASK, 8)
    state = init_state(jax.random.PRNGKey(0), model, optimizer)
    from jax_mha.train import make_train_step

    step = jax.jit(chex.assert_max_traces(make_train_step(model, optimizer), n=1), donate_argnums=(0,))
    old = state
    state, _ = step(state, batch, jax.random.PRNGKey(0))
    state, _ = step(state, batch, jax.random.PRNGKey(1))  # a retrace would raise here
    assert jax.tree.leaves(old.params)[0].is_deleted()
    assert int(state.step) == 2


def test_tiny_model_learns_the_copy(trained):
    result, _ = trained
    final_token = result.evals["token_accuracy"][0, -1]
    assert final_token >= 0.95, result.evals["token_accuracy"]
    assert result.evals["exact_accuracy"][0, -1] >= 0.8
    assert result.steps_to_target[0] is not None


def test_attention_is_needed(trained):
    """With every head gated off the model sees no earlier token: chance accuracy."""
    _, params = trained
    model = CopyTransformer(MODEL)
    batch = make_batch(jax.random.PRNGKey(77), TASK, 256)
    on = evaluate(params, model, batch)
    off = evaluate(params, model, batch, head_mask=jnp.zeros((MODEL.num_layers, MODEL.num_heads)))
    assert float(on["token_accuracy"]) >= 0.95
    assert float(off["token_accuracy"]) <= chance_accuracy(TASK) + 0.05, float(off["token_accuracy"])
    assert float(off["exact_accuracy"]) < 0.01


def test_greedy_decode_matches_teacher_forcing_when_perfect(trained):
    _, params = trained
    model = CopyTransformer(MODEL)
    batch = make_batch(jax.random.PRNGKey(8), TASK, 64)
    decoded = greedy_decode(params, model, batch)
    teacher = jnp.argmax(model.apply({"params": params}, batch["inputs"]), -1)
    scored = np.asarray(batch["scored"])
    # Wherever teacher forcing is right on a whole sequence, greedy decoding is identical.
    all_right = np.all(np.where(scored, teacher == batch["targets"], True), -1)
    assert all_right.mean() > 0.5
    np.testing.assert_array_equal(np.asarray(decoded)[all_right][scored[all_right]],
                                  np.asarray(teacher)[all_right][scored[all_right]])


def test_evaluate_attention_statistics(trained):
    _, params = trained
    metrics = evaluate(params, CopyTransformer(MODEL), make_batch(jax.random.PRNGKey(9), TASK, 32))
    for name in ("entropy", "entropy_normalized", "confidence"):
        chex.assert_shape(metrics[name], (MODEL.num_layers, MODEL.num_heads))
    assert np.all((metrics["entropy_normalized"] >= 0) & (metrics["entropy_normalized"] <= 1 + 1e-5))
    assert np.all((metrics["confidence"] > 0) & (metrics["confidence"] <= 1 + 1e-6))
    # A solved copy needs some head that is sharply focused.
    assert float(metrics["confidence"].max()) > 0.5


def test_vmap_over_seeds_equals_separate_runs():
    cfg = dataclasses.replace(TRAIN, num_steps=100, eval_every=50, early_stop=False)
    both = train_seeds(MODEL, TASK, cfg, [3, 5])
    for i, seed in enumerate([3, 5]):
        alone = train_seeds(MODEL, TASK, cfg, [seed])
        np.testing.assert_allclose(both.curve["loss"][i], alone.curve["loss"][0], rtol=1e-4)
        chex.assert_trees_all_close(
            jax.tree.map(lambda x: x[i], both.state.params), jax.tree.map(lambda x: x[0], alone.state.params),
            rtol=1e-3, atol=1e-5,
        )
    # Different seeds really differ.
    assert not np.allclose(both.curve["loss"][0], both.curve["loss"][1])
    looped = train_seeds(MODEL, TASK, cfg, [3, 5], use_vmap=False)
    np.testing.assert_allclose(both.curve["loss"], looped.curve["loss"], rtol=1e-4)


def test_non_finite_loss_raises_with_step():
    cfg = dataclasses.replace(TRAIN, num_steps=50, learning_rate=float("nan"), warmup_steps=0)
    with pytest.raises(RuntimeError, match="non-finite loss nan at step 1 \\(seed 0\\)"):
        train_seeds(MODEL, TASK, cfg, [0])


def test_config_errors():
    with pytest.raises(ValueError, match="eval_every=70 must be a multiple of steps_per_call=50"):
        TrainConfig(eval_every=70, steps_per_call=50)
    with pytest.raises(ValueError, match="num_steps=120 must be a multiple of steps_per_call=50"):
        train_seeds(MODEL, TASK, dataclasses.replace(TRAIN, num_steps=120), [0])
    with pytest.raises(ValueError, match="d_model=30 is not divisible by num_heads=4"):
        ModelConfig(d_model=30, num_heads=4)
