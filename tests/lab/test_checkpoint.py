"""Tests for `jax_mha.lab.checkpoint`: exact round trips of exported models, a
`ValueError` naming the file for every way one can be unusable (including a single
flipped byte), atomic writes that survive Ctrl-C and leave no temporary files; and
the orbax training states: keep-N, exact restores, a save on 4 devices (one process,
or two) restored into a 2-device mesh, and a SIGKILL during an asynchronous save (the
previous step restores)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import script_env
from flax import serialization

from jax_mha.lab import checkpoint
from jax_mha.lab.checkpoint import FORMAT, load_checkpoint, save_checkpoint, write_atomic
from jax_mha.lab.data import CopyTaskConfig
from jax_mha.lab.models import CopyTransformer, ModelConfig

TASK = CopyTaskConfig(length=5, num_symbols=7)
CONFIG = ModelConfig(vocab_size=TASK.vocab_size, max_len=TASK.seq_len, d_model=15, num_heads=3, num_layers=2, d_ff=22)


@pytest.fixture(scope="module")
def params():
    model = CopyTransformer(CONFIG)
    return jax.jit(model.init)(jax.random.PRNGKey(7), jnp.zeros((1, TASK.seq_len), jnp.int32))["params"]


@pytest.fixture
def saved(tmp_path, params):
    path = tmp_path / "model.msgpack"
    save_checkpoint(path, params, CONFIG, {"task": dataclasses.asdict(TASK), "heads": 3, "seed": 0})
    return path


def test_round_trip_gives_identical_outputs(saved, params):
    restored, config, metadata = load_checkpoint(saved, CONFIG)
    assert config == CONFIG
    assert metadata == {"task": dataclasses.asdict(TASK), "heads": 3, "seed": 0}
    assert CopyTaskConfig(**metadata["task"]) == TASK
    assert jax.tree.structure(restored) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(params)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (3, TASK.seq_len), 0, TASK.vocab_size)
    apply = jax.jit(lambda p, t: CopyTransformer(config).apply({"params": p}, t))
    np.testing.assert_array_equal(np.asarray(apply(restored, tokens)), np.asarray(apply(params, tokens)))


def test_save_leaves_no_temporary_files(saved):
    assert sorted(p.name for p in saved.parent.iterdir()) == [saved.name]


def raises_naming(path, *patterns):
    """`pytest.raises(ValueError)` whose message names `path` and matches `patterns`."""
    return pytest.raises(ValueError, match=re.escape(str(path)) + "".join(f"(?s:.*){p}" for p in patterns))


def test_missing_file(tmp_path):
    path = tmp_path / "absent.msgpack"
    with raises_naming(path, "does not exist"):
        load_checkpoint(path)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_file(saved, damage):
    data = saved.read_bytes()
    saved.write_bytes({"garbage": b"\xc1\xff not msgpack \x00" * 7, "truncated": data[: len(data) // 3], "empty": b""}[damage])
    with raises_naming(saved):
        load_checkpoint(saved)


def test_one_flipped_byte_fails_the_checksum(saved):
    data = bytearray(saved.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the parameters: still valid msgpack, wrong values
    saved.write_bytes(bytes(data))
    with raises_naming(saved, "damaged: its checksum does not match"):
        load_checkpoint(saved)


@pytest.mark.parametrize("payload", [{"format": "something-else", "params": {}},
                                     {"format": "jax_mha-checkpoint-v1", "params": {}}])
def test_other_msgpack_is_rejected(tmp_path, payload):
    path = tmp_path / "other.msgpack"
    path.write_bytes(serialization.msgpack_serialize(payload))
    with raises_naming(path, f"not a {FORMAT} file"):
        load_checkpoint(path)


# ----------------------------------------------------------------- training states (orbax)


def _on_one_device(tree):
    """The restore target of `tree`: its shapes and dtypes on the first device."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype, sharding=device), tree)


def test_train_state_keeps_the_newest_n_and_restores_exactly(tmp_path, params):
    """Four asynchronous saves with max_to_keep=2: only the last two step folders
    remain, and the newest restores bit for bit, with its history as JSON."""
    manager = checkpoint.train_state_manager(tmp_path / "run", max_to_keep=2)
    rng = np.random.default_rng(0)
    states = [{"step": np.int32(step), "params": jax.tree.map(lambda x: rng.standard_normal(x.shape, np.float32), params),
               "mu": [rng.standard_normal(3), rng.standard_normal((2, 5), np.float32)]} for step in range(1, 5)]
    for step, state in enumerate(states, 1):
        history = {"curve": {"loss": [np.float32(1.5), np.ones(3, np.float32) / step]}, "stop_reason": None, "step": step}
        checkpoint.save_train_state(manager, step, state, history)
    checkpoint.close_train_state(manager)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["3", "4"]
    assert checkpoint.saved_train_step(tmp_path / "run") == 4
    manager = checkpoint.train_state_manager(tmp_path / "run", max_to_keep=2)
    assert checkpoint.train_history(manager) == {"curve": {"loss": [1.5, [0.25] * 3]}, "stop_reason": None, "step": 4}
    restored = checkpoint.restore_train_state(manager, _on_one_device(states[-1]))
    chex.assert_trees_all_equal(restored, jax.tree.map(jnp.asarray, states[-1]))
    with raises_naming(tmp_path / "run" / "4", "does not match the run being resumed", r"missing \['other'\]",
                       r"unexpected \['mu/0', 'mu/1'\]"):
        checkpoint.restore_train_state(manager, _on_one_device({**states[-1], "mu": None, "other": np.zeros(2)}))
    with raises_naming(tmp_path / "run" / "4", r"'mu/1': \(\(2, 5\), \(5, 2\)\)"):
        checkpoint.restore_train_state(manager, _on_one_device({**states[-1], "mu": [np.zeros(3), np.zeros((5, 2))]}))
    checkpoint.close_train_state(manager)


def test_damaged_train_state_names_the_step(tmp_path):
    state = {"w": np.arange(7.0), "b": np.arange(5, dtype=np.int32)}
    manager = checkpoint.train_state_manager(tmp_path / "run")
    checkpoint.save_train_state(manager, 3, state, {"step": 3})
    checkpoint.close_train_state(manager)
    for data in (tmp_path / "run" / "3" / "state").rglob("d/*"):  # the array chunks
        data.write_bytes(data.read_bytes()[:10])
    manager = checkpoint.train_state_manager(tmp_path / "run")
    with raises_naming(tmp_path / "run" / "3", "is damaged"):
        checkpoint.restore_train_state(manager, _on_one_device(state))
    checkpoint.close_train_state(manager)


def test_train_state_manager_rejects(tmp_path):
    with pytest.raises(ValueError, match="max_to_keep must be an int >= 1, got 0"):
        checkpoint.train_state_manager(tmp_path / "run", max_to_keep=0)
    old = tmp_path / "h4_state.msgpack"
    old.write_bytes(b"")
    with raises_naming(old, "is a file, not a training state folder"):
        checkpoint.train_state_manager(old)
    assert checkpoint.saved_train_step(tmp_path / "absent") is None


# Run as a script (`python tests/lab/test_checkpoint.py MODE DIR`) in a subprocess with its
# own XLA_FLAGS: forced host devices must be set before jax starts, and a SIGKILL must
# not hit the test process.
SEEDS, MESH_MODEL = 2, ModelConfig(vocab_size=11, max_len=7, d_model=12, num_heads=2, num_layers=1, d_ff=10)


def _script_state():
    """A real seed-stacked TrainState (model, AdamW moments, step) and its optimizer."""
    from jax_mha.lab import train
    model, optimizer = CopyTransformer(MESH_MODEL), train.make_optimizer(train.TrainConfig())
    # Its shapes (no compile), filled with distinct values: a swapped leaf must show.
    leaves, tree = jax.tree.flatten(train.abstract_state(model, optimizer, SEEDS))
    rng = np.random.default_rng(5)
    # Cast on the host, then put: a cast on the device compiles a program per leaf.
    leaves = [jax.device_put(np.asarray(rng.integers(0, 1000, x.shape) if jnp.issubdtype(x.dtype, jnp.integer)
                                        else rng.standard_normal(x.shape), x.dtype)) for x in leaves]
    return jax.tree.unflatten(tree, leaves), model, optimizer


def _script(mode: str, directory: str) -> None:
    import asyncio

    import orbax.checkpoint as ocp

    from jax_mha import parallel
    from jax_mha.lab import train
    if mode.startswith("save_process"):  # one of two processes, each with 2 of the 4 devices
        jax.distributed.initialize(os.environ["COORDINATOR"], 2, int(mode[-1]))
    state, model, optimizer = _script_state()
    if mode == "kill":  # save step 1, then die while step 2 is written
        manager = checkpoint.train_state_manager(directory)
        checkpoint.save_train_state(manager, 1, state, {"step": 1})
        manager.wait_until_finished()

        async def hang(self):  # the step's files are written; the commit (a rename) never comes
            print("COMMITTING", flush=True)
            await asyncio.sleep(3600)

        ocp._src.path.atomicity.AtomicRenameTemporaryPath.finalize = hang
        checkpoint.save_train_state(manager, 2, jax.tree.map(lambda x: x + 1, state), {"step": 2})
        time.sleep(3600)
    mesh = parallel.make_mesh(*{"restore": (1, 2)}.get(mode, (2, 2)))  # (data, model): 4 devices, then 2
    target = train._restore_target(train.abstract_state(model, optimizer, SEEDS), mesh)
    manager = checkpoint.train_state_manager(directory)
    if mode.startswith("save"):
        # Each process builds only the shards it holds, as a multi-process run has them.
        state = jax.tree.map(lambda x, t: jax.make_array_from_callback(x.shape, t.sharding, lambda i: x[i]),
                             state, target)
        checkpoint.save_train_state(manager, 7, state, {"step": 7, "devices": len(jax.devices())})
        checkpoint.close_train_state(manager)
        return
    restored = checkpoint.restore_train_state(manager, target)
    kernel = restored.params["block_0"]["attention"]["query"]["kernel"]
    print("RESULT " + json.dumps({
        "devices": len(jax.devices()), "history": checkpoint.train_history(manager),
        "equal": all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                     zip(jax.tree.leaves(restored), jax.tree.leaves(state))),
        "shardings_as_target": all(a.sharding == t.sharding for a, t in
                                   zip(jax.tree.leaves(restored), jax.tree.leaves(target))),
        "query_kernel_shards": sorted({tuple(s.data.shape) for s in kernel.addressable_shards}),
        "query_kernel_spec": list(kernel.sharding.spec)}))
    checkpoint.close_train_state(manager)


def _run_script(mode: str, directory, devices: int, **env) -> subprocess.Popen:
    # Optimisation level 0, as conftest sets for the suite (the script compiles only small programs).
    flags = f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"
    env = script_env(XLA_FLAGS=flags, JAX_PLATFORMS="cpu", **env)
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), mode, str(directory)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("processes", [1, 2])
def test_state_saved_on_4_devices_restores_into_a_2_device_mesh(tmp_path, processes):
    """Saved sharded over data=2 x model=2 (by one process with 4 devices, or by two
    with 2 each, each writing its own shards), restored into model=2 on two devices:
    every leaf equal, each in the shardings of the new mesh (heads split in two)."""
    if processes == 1:
        savers = [_run_script("save", tmp_path / "run", 4)]
    else:
        with socket.socket() as s:  # a free port for the coordinator
            s.bind(("127.0.0.1", 0))
            coordinator = f"127.0.0.1:{s.getsockname()[1]}"
        savers = [_run_script(f"save_process{i}", tmp_path / "run", 2, COORDINATOR=coordinator) for i in range(2)]
    for saving in savers:
        try:
            assert saving.wait(timeout=240) == 0, saving.stderr.read()[-4000:]
        finally:
            saving.kill()
    written_by = sorted(p.name for p in (tmp_path / "run" / "7" / "state").glob("ocdbt.process_*"))
    assert written_by == [f"ocdbt.process_{i}" for i in range(processes)]  # each process wrote its own shards
    restoring = _run_script("restore", tmp_path / "run", 2)
    stdout, stderr = restoring.communicate(timeout=240)
    assert restoring.returncode == 0, stderr[-4000:]
    result = json.loads([line for line in stdout.splitlines() if line.startswith("RESULT ")][-1][len("RESULT "):])
    assert result["devices"] == 2 and result["history"] == {"step": 7, "devices": 4}
    assert result["equal"] and result["shardings_as_target"]
    d, half = MESH_MODEL.d_model, MESH_MODEL.d_model // 2
    assert result["query_kernel_shards"] == [[SEEDS, d, half]] and result["query_kernel_spec"] == [None, None, "model"]


def test_kill_during_an_async_save_restores_the_previous_step(tmp_path):
    """SIGKILL while step 2 is being committed: step 1 is the newest step, restores
    whole, and the next manager removes the half-saved folder."""
    proc = _run_script("kill", tmp_path / "run", 1)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 180)  # a hung child fails the test, never hangs it
        line = proc.stdout.readline().strip() if ready else "(nothing within 180 s)"
        if line != "COMMITTING":
            proc.kill()
            pytest.fail(f"the saving process printed {line!r}: {proc.stderr.read()[-4000:]}")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    names = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert names[0] == "1" and len(names) == 2 and names[1].startswith("2.orbax-checkpoint-tmp"), names
    assert checkpoint.saved_train_step(tmp_path / "run") == 1
    state = _script_state()[0]
    manager = checkpoint.train_state_manager(tmp_path / "run")
    assert checkpoint.train_history(manager) == {"step": 1}
    chex.assert_trees_all_equal(checkpoint.restore_train_state(manager, _on_one_device(state)), state)
    checkpoint.close_train_state(manager)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["1"]


def test_ctrl_c_during_a_write_is_held_until_the_file_is_complete(tmp_path, monkeypatch):
    """SIGINT arriving mid-write: the file is still written whole, then
    KeyboardInterrupt is raised; no temporary file is left."""
    path = tmp_path / "results.json"
    real_replace = os.replace

    def interrupted_replace(src, dst):
        # To the main thread itself: a process-wide kill may land on one of JAX's
        # threads, which on a busy machine can run the handler after the write is over.
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        time.sleep(0.01)
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", interrupted_replace)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own Ctrl-C
    try:
        with pytest.raises(KeyboardInterrupt):
            write_atomic(path, "complete\n")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert path.read_text() == "complete\n"
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_stale_temporary_files_are_removed(tmp_path):
    path = tmp_path / "model.msgpack"
    stale = tmp_path / ".model.msgpack.abc123.tmp"  # left by a writer that was SIGKILLed
    stale.write_bytes(b"")
    old = time.time() - 2 * checkpoint.STALE_TMP_SECONDS
    os.utime(stale, (old, old))
    write_atomic(path, b"new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.msgpack"]


def test_mismatched_config_names_the_fields(saved):
    other = dataclasses.replace(CONFIG, num_heads=5)
    with raises_naming(saved, "num_heads"):
        load_checkpoint(saved, other)


def test_parameters_that_do_not_fit_their_config(tmp_path, params):
    """Parameters of a 3-head d_model=15 model stored under a d_model=21 config."""
    path = tmp_path / "lying.msgpack"
    save_checkpoint(path, params, dataclasses.replace(CONFIG, d_model=21))
    with raises_naming(path, "does not match its config"):
        load_checkpoint(path)


def test_unusable_config(tmp_path, params):
    path = tmp_path / "badconfig.msgpack"
    payload = {"kind": "model", "model_config": {"d_model": 15, "num_heads": 4}, "metadata": {},
               "params": jax.tree.map(np.asarray, params)}
    path.write_bytes(checkpoint._pack(payload))
    with raises_naming(path, "model_config"):
        load_checkpoint(path)


if __name__ == "__main__":
    _script(*sys.argv[1:])
