"""Saving and restoring models and training runs, each as one checksummed file.

Format: flax.serialization msgpack. A file is `{"format", "sha256", "body"}`, where
`body` is the msgpack bytes of the payload and `sha256` their hash, so a flipped or
missing byte anywhere is caught on load (a `ValueError` naming the file), never
loaded silently. Two payloads:

* a **model checkpoint** (`save_checkpoint`): one model's parameters, the
  `ModelConfig` they belong to and free-form metadata (the task, head count, seed);
* a **training state** (`save_train_state`): any pytree (a `train.TrainState`
  stacked over seeds: parameters, optimizer state, step) plus metadata (the curves
  so far), so an interrupted run continues where it was saved.

Chosen over orbax-checkpoint because these models are a few MB, written by one
process and read on one host: a single self-describing file, an atomic rename, and a
checksum over every byte, with no directory tree, async machinery or extra
dependency to leave half-written state behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization

from jax_mha.lab.models import Decoder, ModelConfig

FORMAT = "jax_mha-checkpoint-v2"
STALE_TMP_SECONDS = 60.0  # a temporary file this old belongs to a writer that was killed


@contextlib.contextmanager
def _sigint_deferred():
    """Holds Ctrl-C back while a file is being written; re-raises it afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received and callable(previous):
            previous(signal.SIGINT, None)
        elif received and previous == signal.SIG_DFL:
            raise KeyboardInterrupt


def _remove_stale_tmp(path: Path) -> None:
    """Temporary files of `path` left by a writer that was killed (SIGKILL, power)."""
    now = time.time()
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        with contextlib.suppress(OSError):
            if now - tmp.stat().st_mtime > STALE_TMP_SECONDS:
                tmp.unlink()


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Writes via a temporary file and `os.replace`: readers, and runs interrupted
    mid-write, see the old file or the new one, never half of one. Ctrl-C during the
    write is held until it is done, and no temporary file is left behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(path)
    with _sigint_deferred():
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


def _pack(payload: dict) -> bytes:
    body = serialization.msgpack_serialize(payload)
    return serialization.msgpack_serialize(
        {"format": FORMAT, "sha256": hashlib.sha256(body).hexdigest(), "body": body})


def _unpack(path: Path, kind: str) -> dict:
    """The verified payload of a file written by `_pack`.

    Raises:
      ValueError: naming the file, if it is missing, damaged or of another kind.
    """
    try:
        outer = serialization.msgpack_restore(path.read_bytes())
    except FileNotFoundError:
        raise ValueError(f"checkpoint {path} does not exist") from None
    except Exception as e:  # msgpack raises several types for truncated/corrupt data
        raise ValueError(f"checkpoint {path} is damaged or not a msgpack file ({type(e).__name__}: {e})") from None
    if not isinstance(outer, dict) or outer.get("format") != FORMAT or not isinstance(outer.get("body"), bytes):
        found = outer.get("format") if isinstance(outer, dict) else None
        raise ValueError(f"{path} is not a {FORMAT} file (format {found!r}); an older one must be rewritten")
    if hashlib.sha256(outer["body"]).hexdigest() != outer.get("sha256"):
        raise ValueError(f"checkpoint {path} is damaged: its checksum does not match its contents")
    payload = serialization.msgpack_restore(outer["body"])
    if not isinstance(payload, dict) or payload.get("kind") != kind:
        raise ValueError(f"{path} holds a {payload.get('kind')!r}, not a {kind!r}")
    return payload


def _flat_shapes(tree) -> dict[str, tuple]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(k): tuple(np.shape(v)) for k, v in flat}


def _check_shapes(path: Path, expected, stored, what: str) -> None:
    """Raises ValueError naming the file and every leaf that is missing, extra or of
    another shape."""
    want, got = _flat_shapes(expected), _flat_shapes(stored)
    if want != got:
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        wrong = {k: (got[k], want[k]) for k in want.keys() & got.keys() if got[k] != want[k]}
        raise ValueError(f"checkpoint {path} does not match {what}: missing {missing}, unexpected {extra}, "
                         f"(saved, expected) shapes {wrong}")


def save_checkpoint(path: str | os.PathLike, params: Any, model_config: ModelConfig, metadata: dict | None = None) -> None:
    """Writes `params` (one model, no seed axis) with its config, atomically."""
    write_atomic(path, _pack({
        "kind": "model",
        "model_config": dataclasses.asdict(model_config),
        "metadata": metadata or {},
        "params": jax.tree.map(np.asarray, params),
    }))


def load_checkpoint(path: str | os.PathLike, model_config: ModelConfig | None = None) -> tuple[Any, ModelConfig, dict]:
    """Reads a checkpoint written by `save_checkpoint`.

    Args:
      path: the file.
      model_config: if given, the checkpoint's config must equal it.

    Returns:
      `(params, model_config, metadata)`; params as jnp arrays, ready for
      `Decoder(model_config).apply({"params": params}, tokens)`.

    Raises:
      ValueError: naming the file, if it is missing, damaged (checksum), not a model
        checkpoint, if its config differs from `model_config` (naming the fields), or
        if its parameters do not match the shapes its config implies.
    """
    path = Path(path)
    payload = _unpack(path, "model")
    try:
        stored = ModelConfig(**payload["model_config"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint {path} has an unusable model_config: {e}") from None
    if model_config is not None and stored != model_config:
        want, got = dataclasses.asdict(model_config), dataclasses.asdict(stored)
        diff = {k: (got[k], want[k]) for k in want if got.get(k) != want[k]}
        raise ValueError(f"checkpoint {path} was saved for another model; (saved, requested) differ in {diff}")
    expected = jax.eval_shape(
        Decoder(stored).init, jax.random.PRNGKey(0), jnp.zeros((1, stored.max_len), jnp.int32)
    )["params"]
    _check_shapes(path, expected, payload["params"], "its config")
    params = serialization.from_state_dict(expected, payload["params"])
    return jax.tree.map(jnp.asarray, params), stored, payload["metadata"]


def save_train_state(path: str | os.PathLike, state: Any, metadata: dict | None = None) -> None:
    """Writes a training state (any pytree of arrays, e.g. a seed-stacked
    `TrainState`) and msgpack-able metadata, atomically."""
    state_dict = serialization.to_state_dict(jax.tree.map(np.asarray, state))
    write_atomic(path, _pack({"kind": "train_state", "state": state_dict, "metadata": metadata or {}}))


def train_state_metadata(path: str | os.PathLike) -> dict:
    """The metadata saved with a training state (e.g. the step it was saved at),
    without restoring the state.

    Raises:
      ValueError: naming the file, if it is missing, damaged or not a training state.
    """
    return _unpack(Path(path), "train_state")["metadata"]


def load_train_state(path: str | os.PathLike, target: Any) -> tuple[Any, dict]:
    """Reads a state written by `save_train_state` into the structure of `target`.

    Args:
      path: the file.
      target: a pytree of the expected structure (arrays or `jax.ShapeDtypeStruct`s).

    Returns:
      `(state, metadata)`, the state's leaves as jnp arrays.

    Raises:
      ValueError: naming the file, if it is missing or damaged, or if its leaves do
        not match `target`'s paths and shapes.
    """
    path = Path(path)
    payload = _unpack(path, "train_state")
    expected = serialization.to_state_dict(target)
    _check_shapes(path, expected, payload["state"], "the run being resumed")
    state = serialization.from_state_dict(target, payload["state"])
    return jax.tree.map(jnp.asarray, state), payload["metadata"]
