"""Training loop: one step learns, a tiny model solves the copy task (and needs attention
to), vmap over seeds equals separate runs, an interrupted run resumes exactly,
non-finite losses stop at once, and every bad configuration is a ValueError."""

import dataclasses
import json
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_mha.lab import checkpoint
from jax_mha.lab.data import CopyTaskConfig, Decoding, chance_accuracy, greedy_decode, make_batch, task_to_dict
from jax_mha.lab.models import CopyTransformer, ModelConfig, decode_step, empty_cache, model_to_dict
from jax_mha.lab.train import (
    TrainConfig,
    evaluate,
    init_state,
    jit_train_step,
    make_optimizer,
    train_seeds,
)

TASK = CopyTaskConfig(length=6)
MODEL = ModelConfig(vocab_size=TASK.vocab_size, max_len=TASK.seq_len, d_model=32, num_heads=4, num_layers=2, d_ff=64)
TRAIN = TrainConfig(batch_size=32, num_steps=400, learning_rate=3e-3, warmup_steps=20,
                    steps_per_call=50, eval_every=50, eval_size=128)  # 2 layers solve it by step 100-150 (seeds 0-2)


_make_batch = jax.jit(make_batch, static_argnums=(1, 2))  # one program per batch size, not op by op


@pytest.fixture(scope="module")
def trained():
    """One tiny model trained on the copy task (shared by the tests below)."""
    result = train_seeds(MODEL, TASK, TRAIN, [0])
    return result, jax.tree.map(lambda x: x[0], result.state.params)


SMALL = dataclasses.replace(MODEL, num_layers=1, d_model=16)  # compiles faster: the tests below are about the loop
# Small batches: these runs compare two ways of running the same loop, not what it learns.
SHORT = dataclasses.replace(TRAIN, num_steps=100, eval_every=50, early_stop=False, batch_size=8, eval_size=16)


@pytest.fixture(scope="module")
def one_step():
    """The small model's initial state, a fixed batch and its optimizer (no warmup): the
    two single-step tests below compile the same program once."""
    model = CopyTransformer(SMALL)
    optimizer = make_optimizer(dataclasses.replace(TRAIN, warmup_steps=0))
    init = jax.jit(lambda key: init_state(key, model, optimizer))
    return model, optimizer, init, _make_batch(jax.random.PRNGKey(1), TASK, 16)


def test_one_step_lowers_loss_on_fixed_batch(one_step):
    model, optimizer, init, batch = one_step
    state = init(jax.random.PRNGKey(0))
    step = jit_train_step(model, optimizer)
    before = float(step(jax.tree.map(jnp.copy, state), batch, jax.random.PRNGKey(2))[1]["loss"])
    state, metrics = step(state, batch, jax.random.PRNGKey(2))
    after = float(step(state, batch, jax.random.PRNGKey(3))[1]["loss"])
    assert float(metrics["loss"]) == pytest.approx(before)
    assert after < before - 0.05, (before, after)
    chex.assert_tree_all_finite(metrics)


def test_train_step_donates_state_and_does_not_retrace(one_step):
    model, optimizer, init, batch = one_step
    state = init(jax.random.PRNGKey(0))
    from jax_mha.lab.train import make_train_step

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
    batch = _make_batch(jax.random.PRNGKey(77), TASK, 256)
    evaluate_jit = jax.jit(evaluate, static_argnums=(1, 2))  # one compilation for both gate settings
    on = evaluate_jit(params, model, TASK, batch, jnp.ones((MODEL.num_layers, MODEL.num_heads)))
    off = evaluate_jit(params, model, TASK, batch, jnp.zeros((MODEL.num_layers, MODEL.num_heads)))
    assert float(on["token_accuracy"]) >= 0.95
    assert float(off["token_accuracy"]) <= chance_accuracy(TASK) + 0.05, float(off["token_accuracy"])
    assert float(off["exact_accuracy"]) < 0.01


# Jitted once for the module with the parameters as arguments: the trained and the
# untrained parameters run the same compiled programs.
_MODEL = CopyTransformer(MODEL)
_logits = lambda params, tokens, head_mask=None: _MODEL.apply({"params": params}, tokens, head_mask=head_mask)
_teacher = jax.jit(_logits)
_greedy = jax.jit(lambda params, batch, head_mask=None: greedy_decode(
    lambda tokens: _logits(params, tokens, head_mask), batch))
_cached_greedy = jax.jit(lambda params, batch, head_mask: greedy_decode(Decoding(
    lambda tokens: _logits(params, tokens, head_mask), decode_step(params, MODEL, head_mask),
    empty_cache(MODEL, batch["inputs"].shape[0], TASK.seq_len)), batch))


def test_greedy_decode_matches_teacher_forcing_when_perfect(trained):
    _, params = trained
    batch = _make_batch(jax.random.PRNGKey(8), TASK, 64)
    decoded = _greedy(params, batch)
    teacher = jnp.argmax(_teacher(params, batch["inputs"]), -1)
    scored = np.asarray(batch["scored"])
    # Wherever teacher forcing is right on a whole sequence, greedy decoding is identical.
    all_right = np.all(np.where(scored, teacher == batch["targets"], True), -1)
    assert all_right.mean() > 0.5
    np.testing.assert_array_equal(np.asarray(decoded)[all_right][scored[all_right]],
                                  np.asarray(teacher)[all_right][scored[all_right]])


@pytest.mark.parametrize("params_from", ["trained", "untrained"])
def test_cached_greedy_decode_equals_rerunning_the_prefix(trained, params_from):
    """The KV-cache decoder the evaluation uses gives the reference's tokens, on a
    model that copies and on an untrained one (whose argmaxes are arbitrary)."""
    batch = _make_batch(jax.random.PRNGKey(10), TASK, 17)
    params = trained[1] if params_from == "trained" else jax.jit(_MODEL.init)(jax.random.PRNGKey(3), batch["inputs"])["params"]
    head_mask = jnp.ones((MODEL.num_layers, MODEL.num_heads)).at[1, 2].set(0.0)
    reference = _greedy(params, batch, head_mask)
    np.testing.assert_array_equal(np.asarray(_cached_greedy(params, batch, head_mask)), np.asarray(reference))
    assert (np.asarray(reference)[np.asarray(batch["scored"])] > 0).any()


def test_evaluate_attention_statistics(trained):
    """`evaluate`'s per-head statistics, as the run's last held-out evaluation gave them."""
    result, _ = trained
    metrics = {name: value[0, -1] for name, value in result.evals.items() if name != "step"}
    for name in ("entropy", "entropy_normalized", "confidence"):
        chex.assert_shape(metrics[name], (MODEL.num_layers, MODEL.num_heads))
    assert np.all((metrics["entropy_normalized"] >= 0) & (metrics["entropy_normalized"] <= 1 + 1e-5))
    assert np.all((metrics["confidence"] > 0) & (metrics["confidence"] <= 1 + 1e-6))
    # A solved copy needs some head that is sharply focused.
    assert float(metrics["confidence"].max()) > 0.5


@pytest.fixture(scope="module")
def two_seeds():
    """Seeds 3 and 5 trained together for 100 steps, evaluated at 50 and 100."""
    return train_seeds(SMALL, TASK, SHORT, [3, 5])


def test_vmap_over_seeds_equals_separate_runs(two_seeds):
    looped = train_seeds(SMALL, TASK, SHORT, [3, 5], use_vmap=False)  # one program per seed, one after another
    np.testing.assert_allclose(two_seeds.curve["loss"], looped.curve["loss"], rtol=1e-4)
    chex.assert_trees_all_close(two_seeds.state.params, looped.state.params, rtol=1e-3, atol=1e-5)
    assert not np.allclose(two_seeds.curve["loss"][0], two_seeds.curve["loss"][1])  # seeds really differ
    assert two_seeds.stop_reason == "step limit" and two_seeds.steps_run == 100


def test_interrupted_run_resumes_exactly(two_seeds, tmp_path):
    """Stopped after its first save (step 50), the run continues from the orbax
    folder to the same curves, evaluations and parameters as the uninterrupted run;
    the stop waited for the save, and a run of other seeds is refused."""
    state_dir = tmp_path / "state"

    def stop_after_first_save(report):
        if "eval" in report:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_seeds(SMALL, TASK, SHORT, [3, 5], state_dir=state_dir, callback=stop_after_first_save)
    assert checkpoint.saved_train_step(state_dir) == 50  # complete on disk once train_seeds has raised
    resumed = train_seeds(SMALL, TASK, SHORT, [3, 5], state_dir=state_dir)
    assert resumed.resumed_from == 50 and resumed.steps_run == 100
    np.testing.assert_allclose(resumed.curve["loss"], two_seeds.curve["loss"], rtol=1e-5)
    assert resumed.curve["loss"].dtype == two_seeds.curve["loss"].dtype == np.float32
    np.testing.assert_array_equal(resumed.evals["step"], [50, 100])
    np.testing.assert_allclose(resumed.evals["token_accuracy"], two_seeds.evals["token_accuracy"], atol=1e-6)
    chex.assert_trees_all_close(resumed.state.params, two_seeds.state.params, rtol=1e-4, atol=1e-6)
    assert sorted(p.name for p in state_dir.iterdir()) == ["100", "50"]  # no temporary folders left
    with pytest.raises(ValueError, match=r"state was saved by another run \(it differs in \['seeds'\]\)"):
        train_seeds(SMALL, TASK, SHORT, [3, 6], state_dir=state_dir)


def test_early_stop_says_why(trained):
    result, _ = trained
    assert result.stop_reason == "target reached" and result.steps_run < TRAIN.num_steps


def test_non_finite_loss_raises_with_step():
    cfg = dataclasses.replace(TRAIN, num_steps=50, learning_rate=1e30, warmup_steps=0)
    with pytest.raises(RuntimeError, match=r"non-finite loss (nan|inf) at step \d+ \(seed 0\)"):
        train_seeds(SMALL, TASK, cfg, [0])


@pytest.mark.parametrize("field, value, match", [
    ("batch_size", 0, "batch_size must be >= 1"),
    ("eval_every", 0, "eval_every must be >= 1"),
    ("steps_per_call", 0, "steps_per_call must be >= 1"),
    ("eval_size", -3, "eval_size must be >= 1"),
    ("learning_rate", -0.01, "learning_rate must be a finite number > 0"),
    ("learning_rate", math.nan, "learning_rate must be a finite number > 0"),
    ("warmup_steps", -1, "warmup_steps must be >= 0"),
    ("grad_clip_norm", 0.0, "grad_clip_norm must be a finite number > 0"),
    ("weight_decay", -1.0, "weight_decay must be a finite number >= 0"),
    ("end_lr_ratio", 1.5, r"end_lr_ratio must be in \[0, 1\]"),
    ("target_accuracy", 1.5, r"target_accuracy must be in \(0, 1\]"),
    ("target_accuracy", 0.0, r"target_accuracy must be in \(0, 1\]"),
    ("eval_every", 70, "eval_every=70 must be a multiple of steps_per_call=50"),
    ("num_steps", 75, "num_steps=75 must be a multiple of steps_per_call=50"),
])
def test_train_config_rejects(field, value, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**{field: value})


@pytest.mark.parametrize("field, value, match", [
    ("num_layers", -1, "num_layers must be >= 1"),
    ("d_model", 0, "d_model must be >= 1"),
    ("num_heads", 0, "num_heads must be >= 1"),
    ("dropout_rate", 1.5, r"dropout_rate must be in \[0, 1\)"),
    ("dropout_rate", math.nan, r"dropout_rate must be in \[0, 1\)"),
    ("d_model", 30, "d_model=30 is not divisible by num_heads=8"),
    ("positional", "rotary", "positional must be one of"),
    ("implementation", "fast", "implementation"),
])
def test_model_config_rejects(field, value, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{field: value})


def test_model_and_task_must_fit():
    with pytest.raises(ValueError, match="does not fit the copy task"):
        train_seeds(dataclasses.replace(SMALL, max_len=5), TASK, SHORT, [0])
    with pytest.raises(ValueError, match="distinct"):
        train_seeds(SMALL, TASK, SHORT, [1, 1])


def test_state_of_another_shape_is_refused(tmp_path):
    """A folder whose state does not have this run's leaves (its fingerprint forged to
    match) is refused naming the folder and the leaves, before anything is read."""
    fingerprint = {"model": model_to_dict(SMALL), "task": task_to_dict(TASK), "train": dataclasses.asdict(SHORT),
                   "seeds": [0]}
    manager = checkpoint.train_state_manager(tmp_path / "other")
    checkpoint.save_train_state(manager, 50, {"w": np.zeros(3)}, {"fingerprint": json.loads(json.dumps(fingerprint))})
    checkpoint.close_train_state(manager)
    with pytest.raises(ValueError, match=r"other/50 does not match the run being resumed: missing \[.*params"):
        train_seeds(SMALL, TASK, SHORT, [0], state_dir=tmp_path / "other")
