"""Tests for `jax_mha.parallel` (shardings) and the trainer's sharded jit.

The multi-device checks need several devices, which a CPU host only provides when
`XLA_FLAGS=--xla_force_host_platform_device_count=4` is set *before* jax starts; the
rest of the suite has already imported jax in this process, so this file runs itself
as a script in a subprocess with that flag (`python tests/parallel/test_parallel.py`), which
prints one JSON line of measurements, and the tests assert on it. Sizes are small and
mostly distinct (d_model 20 = 4 heads x 5, d_ff 14, batch 6, T 8) so a swapped axis
shows up as a wrong shard shape.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import f32_tolerance, script_env
from jax.sharding import AbstractMesh, PartitionSpec

NUM_DEVICES = 4
D_MODEL, HEADS, D_FF, BATCH, LENGTH = 20, 4, 14, 6, 3  # T = 2 * LENGTH + 2 = 8
# The float32 sums of the model, for the tolerances: three layer norms (mean and
# variance over d_model), the q/k/v projections, attention (logits over D, the softmax
# sum and weights @ v over T), the output projection, the MLP, the logits; the loss
# adds the softmax over the 14 tokens and the mean over the batch's B*T; the gradient
# runs the model backward and sums over the tokens.
T = 2 * LENGTH + 2
FORWARD_TERMS = 3 * 2 * D_MODEL + D_MODEL + D_MODEL // HEADS + 2 * T + D_MODEL + D_MODEL + D_FF + D_MODEL
LOSS_TERMS = FORWARD_TERMS + 14 + BATCH * T
GRAD_TERMS = 2 * LOSS_TERMS + BATCH * T


# ---------------------------------------------------------------------------------
# In-process tests: no devices needed.
# ---------------------------------------------------------------------------------

ROOT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_parse_mesh_spec():
    from jax_mha.parallel import parse_mesh_spec

    assert parse_mesh_spec("data=2,model=2") == {"data": 2, "model": 2}
    assert parse_mesh_spec(" model=4 ") == {"model": 4}
    assert parse_mesh_spec("data=1,sequence=4") == {"data": 1, "sequence": 4}
    assert parse_mesh_spec("") == {} and parse_mesh_spec(None) == {}
    for bad, match in (("heads=2", "data=N"), ("data=0", "positive"), ("data=x", "positive"),
                       ("data=2,data=2", "twice"), ("model", "data=N")):
        with pytest.raises(ValueError, match=match):
            parse_mesh_spec(bad)


def test_make_mesh_single_device_and_errors():
    from jax_mha.parallel import make_mesh

    one = jax.devices()[:1]
    mesh = make_mesh(devices=one)
    assert dict(mesh.shape) == {"data": 1, "sequence": 1, "model": 1}
    with pytest.raises(ValueError, match=r"data=1 x sequence=1 x model=2 needs 2 devices, only 1"):
        make_mesh(data=1, model=2, devices=one)
    with pytest.raises(ValueError, match=r"1 devices cannot be split into sequence=1 x model=3"):
        make_mesh(model=3, devices=one)
    with pytest.raises(ValueError, match=r"1 devices cannot be split into sequence=2 x model=1"):
        make_mesh(sequence=2, devices=one)



def _copy_model_state():
    """Abstract (shape-only) TrainState of a small copy-task model."""
    from jax_mha.lab.models import CopyTransformer, ModelConfig
    from jax_mha.lab.train import TrainConfig, init_state, make_optimizer

    model = CopyTransformer(ModelConfig(d_model=D_MODEL, num_heads=HEADS, d_ff=D_FF, num_layers=1, max_len=16))
    opt = make_optimizer(TrainConfig(num_steps=10, steps_per_call=10, eval_every=10))
    return jax.eval_shape(lambda: init_state(jax.random.PRNGKey(0), model, opt))


def test_partition_specs_follow_heads_and_mirror_optimizer_state():
    from jax_mha.parallel import partition_specs

    state = _copy_model_state()
    specs = partition_specs(state)
    attn = specs.params["block_0"]["attention"]
    assert attn["query"]["kernel"] == PartitionSpec(None, "model")  # output (heads) columns
    assert attn["key"]["kernel"] == attn["value"]["kernel"] == PartitionSpec(None, "model")
    assert attn["out"]["kernel"] == PartitionSpec("model", None)  # input (heads) rows
    assert attn["out"]["bias"] == PartitionSpec(None)
    ffn = specs.params["block_0"]["ffn"]
    assert ffn["hidden"]["kernel"] == PartitionSpec(None, "model")
    assert ffn["output"]["kernel"] == PartitionSpec("model", None)
    assert specs.params["embed"]["embedding"] == PartitionSpec(None, None)
    assert specs.step == PartitionSpec()
    # Adam's moments mirror the parameters; its count is a replicated scalar.
    adam = specs.opt_state[1][0]
    assert adam.mu["block_0"]["attention"]["query"]["kernel"] == PartitionSpec(None, "model")
    assert adam.nu["block_0"]["attention"]["out"]["kernel"] == PartitionSpec("model", None)
    assert adam.count == PartitionSpec()


def test_partition_specs_user_rules_stacked_axes_and_boxes():
    import flax.linen as nn

    from jax_mha import MultiHeadAttention
    from jax_mha.parallel import logical_axes, partition_specs

    x = jax.ShapeDtypeStruct((2, 7, D_MODEL), jnp.float32)
    params = jax.eval_shape(MultiHeadAttention(num_heads=HEADS, qkv_bias=True).init, jax.random.PRNGKey(0), x)["params"]
    assert logical_axes(params)["query"]["kernel"] == PartitionSpec("embed", "heads")
    assert logical_axes(params)["value"]["bias"] == PartitionSpec("kv_heads")
    # Users remap logical names: heads over both axes, or head parallelism off.
    both = partition_specs(params, rules=(("heads", ("data", "model")),))
    assert both["query"]["kernel"] == PartitionSpec(None, ("data", "model"))
    assert both["key"]["kernel"] == PartitionSpec(None, None)  # kv_heads has no rule: replicated
    off = partition_specs(params, rules=(("heads", None), ("kv_heads", None)))
    assert all(s == PartitionSpec(None, None) for s in (off["query"]["kernel"], off["out"]["kernel"]))
    # A stacked leading axis (seeds) stays unsharded.
    stacked = jax.tree.map(lambda p: jax.ShapeDtypeStruct((3,) + p.shape, p.dtype), params)
    assert partition_specs(stacked)["out"]["kernel"] == PartitionSpec(None, "model", None)
    # flax boxes keep their own logical names.
    boxed = {"w": nn.LogicallyPartitioned(jnp.zeros((3, 5)), ("heads", "embed"))}
    assert partition_specs(boxed)["w"] == PartitionSpec("model", None)


def test_divisibility_checks_name_both_numbers():
    from jax_mha.parallel import check_batch_divisible, check_heads_divisible

    mesh = AbstractMesh((1, 4), ("data", "model"))
    with pytest.raises(ValueError, match=r"num_heads=6 is not divisible by mesh axis 'model' of size 4"):
        check_heads_divisible(6, mesh)
    with pytest.raises(ValueError, match=r"num_kv_heads=2 is not divisible by mesh axis 'model' of size 4"):
        check_heads_divisible(8, mesh, num_kv_heads=2)
    check_heads_divisible(8, mesh, rules=(("heads", "model"), ("kv_heads", None)), num_kv_heads=2)
    with pytest.raises(ValueError, match=r"batch size 6 is not divisible by mesh axis 'data' of size 4"):
        check_batch_divisible(6, AbstractMesh((4, 1), ("data", "model")))


# ---------------------------------------------------------------------------------
# Multi-device tests: one subprocess with 4 CPU devices, shared by the tests below.
# ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def multi_device():
    # Optimisation level 0, as conftest sets for the suite: compiling is most of the subprocess's time.
    flags = f"--xla_force_host_platform_device_count={NUM_DEVICES} --xla_backend_optimization_level=0"
    env = script_env(XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_mesh_uses_all_devices(multi_device):
    assert multi_device["num_devices"] == NUM_DEVICES
    assert multi_device["mesh_shape"] == {"data": 2, "sequence": 1, "model": 2}


def test_parameters_are_sharded_by_heads(multi_device):
    shards = multi_device["shard_shapes"]
    hd = D_MODEL // 2  # 2 heads (of 4) per model-axis device
    assert shards["query_kernel"] == [[D_MODEL, hd]] * NUM_DEVICES
    assert shards["value_kernel"] == [[D_MODEL, hd]] * NUM_DEVICES
    assert shards["out_kernel"] == [[hd, D_MODEL]] * NUM_DEVICES
    assert shards["adam_mu_query_kernel"] == [[D_MODEL, hd]] * NUM_DEVICES
    assert shards["embedding"] == [[14, D_MODEL]] * NUM_DEVICES  # replicated
    assert shards["batch_inputs"] == [[BATCH // 2, 2 * LENGTH + 2]] * NUM_DEVICES  # split over data
    assert multi_device["state_spec_after_step"] == [None, "model"]


def test_sharded_forward_and_gradient_match_single_device(multi_device):
    got = multi_device
    assert got["logits_max_abs_diff"] < f32_tolerance(terms=FORWARD_TERMS, magnitude=got["logits_max"])
    assert got["grads_max_rel_diff"] < f32_tolerance(terms=GRAD_TERMS, magnitude=1.0)  # each leaf to its largest
    assert got["loss_diff"] < f32_tolerance(terms=LOSS_TERMS, magnitude=got["loss"])


def test_sharded_train_steps_match_single_device(multi_device):
    """The parameters after 3 Adam steps differ by each step's roundings of the
    gradients, through the updates, and of the parameters themselves (at their size)."""
    got = multi_device
    assert got["step_params_moved"] > 1e-4  # the steps moved the parameters: the comparison means something
    terms = 3 * GRAD_TERMS + LOSS_TERMS
    assert got["step_params_max_abs_diff"] < f32_tolerance(terms=terms, magnitude=got["step_params_max"])
    assert got["step_loss_diffs"] and all(diff < f32_tolerance(terms=terms, magnitude=loss) for diff, loss in zip(
        got["step_loss_diffs"], got["step_losses"])), got
    assert got["chunk_loss_max_diff"] < f32_tolerance(terms=LOSS_TERMS, magnitude=got["chunk_losses"])  # seed-stacked


def test_heads_stay_local(multi_device):
    # Megatron layout: weights are never gathered; heads are combined by all-reduces.
    assert multi_device["collectives"]["all-gather"] == 0
    assert multi_device["collectives"]["all-reduce"] > 0


def test_indivisible_sizes_raise(multi_device):
    assert "num_heads=6 is not divisible by mesh axis 'model' of size 4" in multi_device["heads_error"]
    assert "batch size 6 is not divisible by mesh axis 'data' of size 4" in multi_device["batch_error"]


# ---------------------------------------------------------------------------------
# The subprocess.
# ---------------------------------------------------------------------------------


def _worker() -> dict:
    import re

    from jax_mha import parallel
    from jax_mha.lab.data import CopyTaskConfig, make_batch
    from jax_mha.lab.models import CopyTransformer, ModelConfig
    from jax_mha.lab.train import TrainConfig, init_state, jit_train_chunk, jit_train_step, make_optimizer, scored_loss

    out: dict = {"num_devices": jax.device_count()}
    mesh = parallel.make_mesh(**parallel.parse_mesh_spec("data=2,model=2"))
    out["mesh_shape"] = dict(mesh.shape)
    model = CopyTransformer(ModelConfig(d_model=D_MODEL, num_heads=HEADS, d_ff=D_FF, num_layers=1, max_len=16))
    # warmup_steps=1: the first step already moves the parameters.
    opt = make_optimizer(TrainConfig(num_steps=10, steps_per_call=10, eval_every=10, warmup_steps=1))
    task = CopyTaskConfig(length=LENGTH)
    init = jax.jit(lambda key: init_state(key, model, opt))  # one compile, not one per initializer
    state = init(jax.random.PRNGKey(0))
    batch = make_batch(jax.random.PRNGKey(1), task, BATCH)
    sharded = parallel.shard(state, mesh)
    sbatch = parallel.shard_batch(batch, mesh)
    shapes = lambda x: [list(s.data.shape) for s in x.addressable_shards]
    attn = sharded.params["block_0"]["attention"]
    out["shard_shapes"] = {
        "query_kernel": shapes(attn["query"]["kernel"]),
        "value_kernel": shapes(attn["value"]["kernel"]),
        "out_kernel": shapes(attn["out"]["kernel"]),
        "adam_mu_query_kernel": shapes(sharded.opt_state[1][0].mu["block_0"]["attention"]["query"]["kernel"]),
        "embedding": shapes(sharded.params["embed"]["embedding"]),
        "batch_inputs": shapes(sbatch["inputs"]),
    }

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["inputs"])
        return scored_loss(logits, batch)[0], logits

    # Forward (logits) and gradient, single device vs. params and batch on the mesh.
    grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    # The results compared on the host (NumPy): eagerly, each leaf's subtract, abs and max would
    # compile a program of its own.
    host = lambda tree: jax.tree.map(np.asarray, tree)
    ((loss1, logits1), g1), ((loss4, logits4), g4) = host(grad(state.params, batch)), host(grad(sharded.params, sbatch))
    out["logits_max_abs_diff"] = float(np.abs(logits1 - logits4).max())
    out["loss_diff"] = float(abs(loss1 - loss4))
    out["logits_max"], out["loss"] = float(np.abs(logits1).max()), float(loss1)
    out["grads_max_rel_diff"] = max(
        float(np.abs(a - b).max() / (np.abs(a).max() + 1e-12)) for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g4))
    )

    ref_step = jit_train_step(model, opt)
    step = jit_train_step(model, opt, mesh=mesh)  # the trainer's one jit, with parallel's shardings
    hlo = step.lower(sharded, batch, jax.random.PRNGKey(0)).compile().as_text()
    out["collectives"] = {op: len(re.findall(rf"\b{op}(-start)?\(", hlo)) for op in ("all-gather", "all-reduce")}
    # A copy through the host (no program per leaf): the steps donate their input state.
    ref, diffs, losses = jax.tree.map(lambda x: jax.device_put(np.asarray(x)), state), [], []
    for t in range(3):
        rng = jax.random.PRNGKey(10 + t)
        ref, m1 = ref_step(ref, batch, rng)
        sharded, m4 = step(sharded, batch, rng)
        diffs.append(float(abs(m1["loss"] - m4["loss"])))
        losses.append(float(m1["loss"]))
    out["step_loss_diffs"], out["step_losses"] = diffs, losses
    ref_params, state_params, sharded_params = host(ref.params), host(state.params), host(sharded.params)
    out["step_params_moved"] = max(
        float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(ref_params), jax.tree.leaves(state_params)))
    out["step_params_max"] = max(float(np.abs(a).max()) for a in jax.tree.leaves(ref_params))
    out["step_params_max_abs_diff"] = max(
        float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(ref_params), jax.tree.leaves(sharded_params))
    )
    out["state_spec_after_step"] = list(sharded.params["block_0"]["attention"]["key"]["kernel"].sharding.spec)

    # A seed-stacked sharded chunk of 1 step against the reference step fed the batch
    # and dropout key that train.make_train_chunk uses.
    seeds = [init(jax.random.PRNGKey(3)), init(jax.random.PRNGKey(4))]
    keys = jax.random.split(jax.random.PRNGKey(5), 2)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *seeds)
    chunk = jit_train_chunk(model, opt, task, BATCH, 1, num_seeds=2, mesh=mesh)
    _, chunk_metrics = chunk(parallel.shard(stacked, mesh), keys)
    chunk_loss = np.asarray(chunk_metrics["loss"])
    chunk_diffs, chunk_losses = [], []
    for i, seed_state in enumerate(seeds):
        data_key, dropout_key = jax.random.split(keys[i])
        seed_batch = make_batch(jax.random.fold_in(data_key, 0), task, BATCH)
        _, m1 = ref_step(seed_state, seed_batch, jax.random.fold_in(dropout_key, 0))
        chunk_diffs.append(float(abs(np.asarray(m1["loss"]) - chunk_loss[i, 0])))
        chunk_losses.append(float(m1["loss"]))
    out["chunk_loss_max_diff"], out["chunk_losses"] = max(chunk_diffs), chunk_losses

    try:
        jit_train_step(CopyTransformer(ModelConfig(d_model=30, num_heads=6, d_ff=D_FF, num_layers=1, max_len=16)), opt,
                       mesh=parallel.make_mesh(model=4))
    except ValueError as e:
        out["heads_error"] = str(e)
    try:
        jit_train_step(model, opt, mesh=parallel.make_mesh(data=4))(parallel.shard(state, parallel.make_mesh(data=4)),
                                                                   batch, jax.random.PRNGKey(0))
    except ValueError as e:
        out["batch_error"] = str(e)
    return out


if __name__ == "__main__":
    jax.config.update("jax_numpy_rank_promotion", "raise")  # as conftest.py does for the suite
    print("RESULT " + json.dumps(_worker()))
