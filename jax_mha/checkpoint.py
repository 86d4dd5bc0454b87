"""Saving and restoring trained copy-task models.

Format: one msgpack file (flax.serialization) holding the parameters, the
`ModelConfig` they belong to and free-form metadata. Chosen over orbax-checkpoint
because these models are a few MB, written once and read on one host: a single
self-describing file, no directory tree, no async machinery and no extra dependency.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization

from jax_mha.models import CopyTransformer, ModelConfig

FORMAT = "jax_mha-checkpoint-v1"


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Writes via a temporary file and `os.replace`: readers, and runs interrupted
    mid-write, see the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        # mkstemp creates 0600; give the file the permissions a plain open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_checkpoint(path: str | os.PathLike, params: Any, model_config: ModelConfig, metadata: dict | None = None) -> None:
    """Writes `params` (one model, no seed axis) with its config, atomically."""
    payload = {
        "format": FORMAT,
        "model_config": dataclasses.asdict(model_config),
        "metadata": metadata or {},
        "params": jax.tree.map(np.asarray, params),
    }
    write_atomic(path, serialization.msgpack_serialize(payload))


def _flat_shapes(tree) -> dict[str, tuple]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(k): tuple(np.shape(v)) for k, v in flat}


def load_checkpoint(path: str | os.PathLike, model_config: ModelConfig | None = None) -> tuple[Any, ModelConfig, dict]:
    """Reads a checkpoint written by `save_checkpoint`.

    Args:
      path: the file.
      model_config: if given, the checkpoint's config must equal it.

    Returns:
      `(params, model_config, metadata)`; params as jnp arrays.

    Raises:
      ValueError: naming the file, if it is missing, unreadable or not a jax_mha
        checkpoint, if its config differs from `model_config` (naming the fields), or
        if its parameters do not match the shapes its config implies.
    """
    path = Path(path)
    try:
        payload = serialization.msgpack_restore(path.read_bytes())
    except FileNotFoundError:
        raise ValueError(f"checkpoint {path} does not exist") from None
    except Exception as e:  # msgpack raises several types for truncated/corrupt data
        raise ValueError(f"checkpoint {path} is corrupt or not a msgpack file: {e}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} checkpoint")
    try:
        stored = ModelConfig(**payload["model_config"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint {path} has an unusable model_config: {e}") from None
    if model_config is not None and stored != model_config:
        want, got = dataclasses.asdict(model_config), dataclasses.asdict(stored)
        diff = {k: (got[k], want[k]) for k in want if got.get(k) != want[k]}
        raise ValueError(f"checkpoint {path} was saved for another model; (saved, requested) differ in {diff}")

    expected = jax.eval_shape(
        CopyTransformer(stored).init, jax.random.PRNGKey(0), jnp.zeros((1, stored.max_len), jnp.int32)
    )["params"]
    want_shapes, got_shapes = _flat_shapes(expected), _flat_shapes(payload["params"])
    if want_shapes != got_shapes:
        missing = sorted(set(want_shapes) - set(got_shapes))
        extra = sorted(set(got_shapes) - set(want_shapes))
        wrong = {k: (got_shapes[k], want_shapes[k]) for k in want_shapes.keys() & got_shapes.keys() if got_shapes[k] != want_shapes[k]}
        raise ValueError(
            f"checkpoint {path} does not match its config: missing {missing}, unexpected {extra}, "
            f"(saved, expected) shapes {wrong}"
        )
    params = serialization.from_state_dict(expected, payload["params"])
    return jax.tree.map(jnp.asarray, params), stored, payload["metadata"]
