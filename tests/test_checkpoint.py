"""Tests for `jax_mha.checkpoint`: an exact round trip, and a `ValueError` naming the
file for every way a checkpoint can be unusable."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import serialization

from jax_mha.checkpoint import FORMAT, load_checkpoint, save_checkpoint
from jax_mha.data import CopyTaskConfig
from jax_mha.models import CopyTransformer, ModelConfig

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


def test_other_msgpack_is_rejected(tmp_path):
    path = tmp_path / "other.msgpack"
    path.write_bytes(serialization.msgpack_serialize({"format": "something-else", "params": {}}))
    with raises_naming(path, f"not a {FORMAT} checkpoint"):
        load_checkpoint(path)


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
    payload = {"format": FORMAT, "model_config": {"d_model": 15, "num_heads": 4}, "metadata": {},
               "params": jax.tree.map(np.asarray, params)}
    path.write_bytes(serialization.msgpack_serialize(payload))
    with raises_naming(path, "model_config"):
        load_checkpoint(path)
