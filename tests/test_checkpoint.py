"""Tests for `jax_mha.lab.checkpoint`: exact round trips (models and training states), a
`ValueError` naming the file for every way a checkpoint can be unusable (including a
single flipped byte), and atomic writes that survive Ctrl-C and leave no temporary
files."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import threading
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import serialization

from jax_mha.lab import checkpoint
from jax_mha.lab.checkpoint import (
    FORMAT,
    load_checkpoint,
    load_train_state,
    save_checkpoint,
    save_train_state,
    write_atomic,
)
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


def test_train_state_round_trip_and_kind_check(tmp_path, saved, params):
    path = tmp_path / "state.msgpack"
    state = {"step": np.int32(7), "params": params, "mu": [np.arange(3.0), np.ones((2, 5))]}
    history = {"curve": {"loss": [np.float32(1.5), np.float32(0.5)]}, "stop_reason": None, "step": 7}
    save_train_state(path, state, history)
    restored, meta = load_train_state(path, jax.tree.map(np.zeros_like, state))
    chex.assert_trees_all_equal(restored, state)
    assert meta["step"] == 7 and meta["stop_reason"] is None and len(meta["curve"]["loss"]) == 2
    with raises_naming(path, "does not match the run being resumed", "missing"):
        load_train_state(path, {"step": np.int32(0)} | {"other": np.zeros(2)})
    with raises_naming(path, "holds a 'train_state', not a 'model'"):
        load_checkpoint(path)
    with raises_naming(saved, "holds a 'model', not a 'train_state'"):
        load_train_state(saved, state)


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
