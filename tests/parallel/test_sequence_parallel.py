"""Sequence parallelism in the model: `parallel.ring_attention_fn` as the modules'
`attention_fn`, and the trainer on a mesh with a "sequence" axis.

The 4-device checks run in one subprocess (XLA fixes the device count at start-up):
this file is its script too, printing one JSON line. The rest runs in-process on a
one-device mesh (a ring of one), where the adapter's plumbing and refusals show.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import f32_tolerance, script_env

SEQ_LEN = 16  # T: a multiple of P² = 16, the striped causal layout on 4 devices
# One layer: the ring runs in it forward and backward, on tokens split over the
# sequence axis; a second layer would run the same program again (and double the
# compile time of the subprocess, most of its cost).
NUM_LAYERS = 1
# The float32 sums of the worker's model (d_model 12, 3 heads, d_ff 20, NUM_LAYERS, batch
# 3), for the tolerances: per layer two layer norms (mean and variance), the q/k/v
# projections, attention (logits over D=4, the softmax sum and weights @ v over T),
# the output projection and the MLP; the final norm and the logits; the loss adds the
# softmax over the 103 characters and the mean over B*T; a gradient runs it backward
# and sums over the tokens; a training step adds that to the parameters.
FORWARD_TERMS = NUM_LAYERS * (2 * 2 * 12 + 12 + 4 + 2 * SEQ_LEN + 12 + 12 + 20) + 2 * 12 + 12
LOSS_TERMS = FORWARD_TERMS + 103 + 3 * SEQ_LEN
STEP_TERMS = 2 * LOSS_TERMS + 3 * SEQ_LEN


def _worker() -> dict:
    from experiments import head_ablation
    from jax_mha import parallel
    from jax_mha.lab.models import Decoder, ModelConfig
    from jax_mha.lab.text import TextTaskConfig
    from jax_mha.lab.train import TrainConfig, init_state, jit_train_step, make_optimizer, train_seeds

    out: dict = {}
    task = TextTaskConfig(seq_len=SEQ_LEN)
    model_cfg = ModelConfig(vocab_size=task.vocab_size, max_len=SEQ_LEN, d_model=12, num_heads=3, num_layers=NUM_LAYERS,
                            d_ff=20)
    train = TrainConfig(batch_size=3, num_steps=6, steps_per_call=3, eval_every=6, eval_size=4, warmup_steps=1,
                        learning_rate=3e-3, early_stop=False)
    mesh = parallel.make_mesh(**parallel.parse_mesh_spec("data=1,sequence=4"))
    one = train_seeds(model_cfg, task, train, [0, 1])
    ring = train_seeds(model_cfg, task, train, [0, 1], mesh=mesh)
    # Compared on the host (NumPy): eagerly, each leaf's subtract, abs and max would compile a program.
    host = lambda tree: [np.asarray(x) for x in jax.tree.leaves(tree)]
    max_abs_diff = lambda a, b: max(float(np.abs(x - y).max()) for x, y in zip(host(a), host(b)))
    leaves = lambda r: host(r.state.params)
    out["params_max_abs_diff"] = max_abs_diff(one.state.params, ring.state.params)
    model, opt = Decoder(model_cfg), make_optimizer(train)
    init = jax.jit(lambda key: init_state(key, model, opt))
    state = init(jax.random.split(jax.random.PRNGKey(0))[0])  # seed 0's initial state, as train_seeds draws it
    out["params_moved"] = max(float(np.abs(a[0] - b).max()) for a, b in zip(leaves(one), host(state.params)))
    out["params_max"] = max(float(np.abs(a).max()) for a in leaves(one))
    out["loss_curves"] = [one.curve["loss"].tolist(), ring.curve["loss"].tolist()]
    out["eval_bpc"] = [one.evals["bpc"].tolist(), ring.evals["bpc"].tolist()]

    # The single step: its program passes the ring's blocks around and splits the tokens.
    batch = task.batch(jax.random.PRNGKey(1), 3)
    sharded, sbatch = parallel.shard(state, mesh), parallel.shard_batch(batch, mesh)
    out["batch_spec"] = [str(x) for x in sbatch["inputs"].sharding.spec]
    step = jit_train_step(model, opt, mesh=mesh).lower(sharded, sbatch, jax.random.PRNGKey(2)).compile()
    out["collective_permutes"] = len(re.findall(r"collective-permute(-start)?\(", step.as_text()))
    # Copies through the host (no program per leaf): the steps donate their input state.
    copy = lambda tree: jax.tree.map(lambda x: jax.device_put(np.asarray(x), x.sharding), tree)
    ref_state, _ = jit_train_step(model, opt)(copy(state), batch, jax.random.PRNGKey(2))
    new, metrics = step(sharded, sbatch, jax.random.PRNGKey(2))
    # A second step: the first one's learning rate is 0 (warm-up from 0), it moves nothing.
    ref_state, _ = jit_train_step(model, opt)(ref_state, batch, jax.random.PRNGKey(3))
    second, _ = step(copy(new), sbatch, jax.random.PRNGKey(3))
    out["step_params_max_abs_diff"] = max_abs_diff(ref_state.params, second.params)
    out["step_params_moved"] = max_abs_diff(ref_state.params, state.params)
    out["step_params_max"] = max(float(np.abs(a).max()) for a in host(ref_state.params))

    # The study accepts the mesh when T fits, and refuses (argparse error) when not.
    _, _, study_mesh = head_ablation.parse(["--task", "lm", "--preset", "tiny", "--mesh", "data=1,sequence=4"])
    out["study_mesh"] = dict(study_mesh.shape)
    try:
        jit_train_step(model, opt, mesh=mesh).lower(new, {k: v[:, :12] for k, v in batch.items()},
                                                    jax.random.PRNGKey(2))
    except ValueError as e:
        out["short_error"] = str(e)
    return out


@pytest.fixture(scope="module")
def four_devices():
    # Optimisation level 0, as conftest sets for the suite: compiling is most of the subprocess's time.
    flags = "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0"
    env = script_env(XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_lm_trained_with_sequence_axis_equals_one_device(four_devices):
    """6 steps: each one's roundings of the gradients and of the parameters (at their
    size) add up; the losses and the evaluation (relative) go through them too."""
    assert four_devices["params_moved"] > 1e-3  # training moved the parameters: the comparison means something
    terms = 6 * STEP_TERMS + LOSS_TERMS
    assert four_devices["params_max_abs_diff"] < f32_tolerance(terms=terms, magnitude=four_devices["params_max"])
    one, ring = four_devices["loss_curves"]
    np.testing.assert_allclose(ring, one, rtol=f32_tolerance(terms=terms, magnitude=1.0))
    np.testing.assert_allclose(*four_devices["eval_bpc"], rtol=f32_tolerance(terms=terms, magnitude=1.0))


def test_train_step_on_a_sequence_mesh_runs_the_ring(four_devices):
    assert four_devices["batch_spec"] == ["data", "sequence"]  # tokens split over the sequence axis
    assert four_devices["collective_permutes"] > 0  # K/V blocks passed around the ring
    assert four_devices["step_params_moved"] > 1e-4  # the two steps moved the parameters
    assert four_devices["step_params_max_abs_diff"] < f32_tolerance(terms=2 * STEP_TERMS,
                                                                    magnitude=four_devices["step_params_max"])
    assert four_devices["study_mesh"] == {"data": 1, "sequence": 4, "model": 1}
    assert "sequence length 12 is not a multiple of 4² = 16" in four_devices["short_error"]


# ---------------------------------------------------------------------------------
# In-process: a ring of one device.
# ---------------------------------------------------------------------------------


@pytest.fixture
def mesh():
    from jax_mha import parallel

    return parallel.make_mesh(devices=jax.devices()[:1])


def test_ring_attention_fn_in_the_module_equals_the_default(rng, mesh):
    from jax_mha import MultiHeadAttention, parallel

    x = jnp.asarray(rng.standard_normal((2, 7, 15)), jnp.float32)  # B=2, N=7, d_model=15 (H=5, D=3)
    ring = MultiHeadAttention(num_heads=5, attention_fn=parallel.ring_attention_fn(mesh))
    plain = MultiHeadAttention(num_heads=5)
    params = plain.init(jax.random.key(0), x)
    options = dict(is_causal=True, local_window_size=(3, 0), kv_lengths=jnp.array([7, 4]))
    # One jit each (eager shard_map runs op by op): the output and its parameter gradients.
    run = lambda model, **more: jax.jit(jax.value_and_grad(
        lambda p: (model.apply(p, x, **options, **more) ** 2).sum()))(params)
    (value, grads), (want, want_grads) = run(ring), run(plain)
    plain_value = want
    # The projections over d_model=15 (in and out, forward and back), attention's sums
    # (D=3, N=7) forward and back, the loss over B*N*15, the gradients over B*N tokens.
    terms = 4 * 15 + 2 * (3 + 2 * 7) + 2 * 7 * 15 + 2 * 7
    np.testing.assert_allclose(value, want, rtol=f32_tolerance(terms=terms, magnitude=1.0))
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(a, b, atol=f32_tolerance(terms=terms, magnitude=b))
    # The adapter passes the rest of the description on: segment ids (the module's
    # segment_ids), q_lengths, the mods and the soft-cap change the result as they do
    # for attention.
    more = dict(segment_ids=jnp.array([[0, 0, 0, 1, 1, 1, 1], [3, 3, 5, 5, 5, 5, 5]]), q_lengths=jnp.array([6, 7]),
                score_mod=lambda s, b, h, i, j: s - 0.3 * (h + 1).astype(s.dtype) * jnp.abs(i - j).astype(s.dtype),
                mask_mod=lambda b, h, i, j: (i - j != 1) | (b == 1), logits_soft_cap=2.5)
    (value, grads), (want, want_grads) = run(ring, **more), run(plain, **more)
    np.testing.assert_allclose(value, want, rtol=f32_tolerance(terms=terms, magnitude=1.0))
    assert abs(float(value) - float(plain_value)) > 1e-3  # the extra keywords took effect
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(a, b, atol=f32_tolerance(terms=terms, magnitude=b))


@pytest.mark.parametrize("options, named", [
    (dict(mask=jnp.ones((7, 7), bool)), "mask"),
    (dict(bias=jnp.zeros((7, 7))), "bias"),
    (dict(return_weights=True), "return_weights=True"),
])
def test_ring_attention_fn_refuses_what_the_ring_cannot_do_by_name(rng, mesh, options, named):
    from jax_mha import MultiHeadAttention, parallel

    x = jnp.asarray(rng.standard_normal((2, 7, 15)), jnp.float32)
    model = MultiHeadAttention(num_heads=5, attention_fn=parallel.ring_attention_fn(mesh))
    params = jax.eval_shape(MultiHeadAttention(num_heads=5).init, jax.random.key(0), x)
    with pytest.raises(ValueError, match=rf"ring attention .* cannot take {re.escape(named)}"):
        jax.eval_shape(lambda p: model.apply(p, x, **options), params)  # refused while tracing


def test_ring_attention_fn_refuses_attention_dropout_and_a_bad_axis(rng, mesh):
    from jax_mha import parallel

    q = jnp.asarray(rng.standard_normal((1, 2, 5, 3)), jnp.float32)
    fn = parallel.ring_attention_fn(mesh)
    calm = jax.jit(lambda q: fn(q, q, q, dropout_rate=0.5) - fn(q, q, q))(q)  # deterministic: no dropout
    np.testing.assert_array_equal(calm, jnp.zeros_like(q))
    with pytest.raises(ValueError, match=r"cannot take attention dropout"):
        fn(q, q, q, dropout_rate=0.5, deterministic=False, dropout_rng=jax.random.key(0))
    with pytest.raises(ValueError, match=r"cannot take empty_rows='uniform'"):
        fn(q, q, q, empty_rows="uniform")
    with pytest.raises(ValueError, match="axis_name='seq' is not an axis of the mesh"):
        parallel.ring_attention_fn(mesh, "seq")


def test_check_sequence_divisible_names_the_numbers(mesh):
    from jax_mha import parallel

    parallel.check_sequence_divisible(7, mesh)  # one device: anything fits
    parallel.check_sequence_divisible(32, 4)
    parallel.check_sequence_divisible(12, 4, is_causal=False)
    with pytest.raises(ValueError, match=re.escape("sequence length 12 is not a multiple of 4² = 16 (causal")):
        parallel.check_sequence_divisible(12, 4)
    with pytest.raises(ValueError, match=re.escape("sequence length 10 is not a multiple of 4: mesh axis")):
        parallel.check_sequence_divisible(10, 4, is_causal=False)


if __name__ == "__main__":
    jax.config.update("jax_numpy_rank_promotion", "raise")  # as conftest.py does for the suite
    print("RESULT " + json.dumps(_worker()))
