"""Saving and restoring exported models and training runs: two formats, each for
what it does best.

* An **exported model** (`save_checkpoint`/`load_checkpoint`): one model's
  parameters, the `ModelConfig` they belong to and free-form metadata (the task,
  head count, seed), in one small file a person can copy, mail or commit. Format:
  flax.serialization msgpack; a file is `{"format", "sha256", "body"}`, where `body`
  is the msgpack bytes of the payload and `sha256` their hash, so a flipped or
  missing byte anywhere is caught on load (a `ValueError` naming the file), never
  loaded silently. Written by one process, atomically (`write_atomic`).
* A **training state** (`train_state_manager`, `save_train_state`,
  `restore_train_state`): a `train.TrainState` stacked over seeds (parameters,
  optimizer state, step) plus the run's history as JSON (curves, evaluations, the
  fingerprint of the run), through `orbax.checkpoint.CheckpointManager`: one folder
  per saved step, the last `max_to_keep` kept, written in the background while
  training goes on, each process writing the shards it holds, and restored
  straight into the shardings of the mesh that resumes it (which may differ from
  the one that saved). Orbax writes a step into a temporary folder and renames it
  when complete, so a run killed mid-save resumes from the step before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
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
import orbax.checkpoint as ocp
from flax import serialization

from jax_mha.lab.models import Decoder, ModelConfig

FORMAT = "jax_mha-checkpoint-v2"
STALE_TMP_SECONDS = 60.0  # a temporary file this old belongs to a writer that was killed
MAX_TO_KEEP = 2  # training states kept: the newest, and the one before in case the newest is suspect


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
    """Leaf shapes by path, spelled the same for a saved tree's metadata (dicts and
    lists) and for the pytree it was saved from (dataclasses, named tuples)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(k, simple=True, separator="/"): tuple(getattr(v, "shape", np.shape(v)))
            for k, v in flat}


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


# ----------------------------------------------------------------- training states (orbax)


def train_state_manager(directory: str | os.PathLike, *, max_to_keep: int = MAX_TO_KEEP) -> ocp.CheckpointManager:
    """The orbax manager of a run's training states in `directory` (created on the
    first save): asynchronous saves, the newest `max_to_keep` steps kept, the
    temporary folders of saves that were killed removed. Every process of a
    multi-process run makes one and calls the same saves and restores (orbax
    coordinates them; each process writes its own shards). `close` it, with
    `close_train_state`, before the process ends.

    Raises:
      ValueError: if `max_to_keep` is not an int >= 1, or `directory` is a file.
    """
    if not isinstance(max_to_keep, int) or isinstance(max_to_keep, bool) or max_to_keep < 1:
        raise ValueError(f"max_to_keep must be an int >= 1, got {max_to_keep!r}")
    if Path(directory).is_file():
        raise ValueError(f"{directory} is a file, not a training state folder (an older msgpack state? delete it)")
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.LatestN(n=max_to_keep),  # what max_to_keep= did, not deprecated
        enable_async_checkpointing=True, cleanup_tmp_directories=True, create=False)
    # Registered up front, so that a fresh manager can read a step's metadata before any save or restore.
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for item, args in (("state", ocp.args.StandardSave), ("state", ocp.args.StandardRestore),
                       ("history", ocp.args.JsonSave), ("history", ocp.args.JsonRestore)):
        registry.add(item, args)
    return ocp.CheckpointManager(Path(directory).absolute(), options=options, handler_registry=registry)


def _jsonable(tree: Any) -> Any:
    """`tree` with every array and NumPy scalar as (nested) Python lists and numbers;
    a deep copy, so the caller may keep appending to its lists while it is saved."""
    if isinstance(tree, dict):
        return {str(k): _jsonable(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_jsonable(v) for v in tree]
    if isinstance(tree, (np.ndarray, np.generic, jax.Array)):
        return np.asarray(tree).tolist()
    return tree


def save_train_state(manager: ocp.CheckpointManager, step: int, state: Any, history: dict) -> None:
    """Starts saving `state` (a pytree of arrays, sharded or not) and `history`
    (JSON-able once arrays are lists) as `step`, and returns once the arrays are
    copied off the devices: the writing goes on in the background, so `state` may be
    donated to the next step at once. Ctrl-C during the call is held until the save
    is under way (the previous step stays whole whatever happens next)."""
    args = ocp.args.Composite(state=ocp.args.StandardSave(state), history=ocp.args.JsonSave(_jsonable(history)))
    with _sigint_deferred():
        manager.save(step, args=args, force=True)


def close_train_state(manager: ocp.CheckpointManager) -> None:
    """Waits for the saves under way to be complete on disk, then releases the
    manager; Ctrl-C while waiting is held until the save is done."""
    with _sigint_deferred():
        manager.wait_until_finished()
        manager.close()


def saved_train_step(directory: str | os.PathLike) -> int | None:
    """The newest completely saved step in `directory`, or None (no folder, or no
    save finished yet); saves still being written or killed mid-way do not count."""
    steps = ocp.path.step.checkpoint_steps(Path(directory).absolute())  # finalized ones only
    return max(steps, default=None)


def train_history(manager: ocp.CheckpointManager) -> dict | None:
    """The history saved with the newest step (JSON: arrays as lists), without
    reading the state; None if nothing is saved.

    Raises:
      ValueError: naming the folder, if its newest step has no readable history.
    """
    step = manager.latest_step()
    if step is None:
        return None
    try:
        history = manager.restore(step, args=ocp.args.Composite(history=ocp.args.JsonRestore())).history
    except (KeyError, ValueError, OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{manager.directory} step {step} has no readable history "
                         f"({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(history, dict):
        raise ValueError(f"{manager.directory} step {step} has no readable history (found {type(history).__name__})")
    return history


def restore_train_state(manager: ocp.CheckpointManager, target: Any) -> Any:
    """The newest saved state, restored into `target`'s structure and shardings.

    Args:
      manager: from `train_state_manager`.
      target: the expected state as `jax.ShapeDtypeStruct`s whose `sharding` says
        where each restored leaf goes (e.g. `train.abstract_state` with
        `parallel.tree_shardings` of the resuming mesh); each process reads only
        the shards it holds.

    Raises:
      ValueError: naming the folder, if nothing is saved there, if the saved
        leaves do not match `target`'s paths and shapes (naming them), or if a
        file of the step is missing or damaged.
    """
    step = manager.latest_step()
    if step is None:
        raise ValueError(f"{manager.directory} holds no saved training state")
    path = Path(manager.directory) / str(step)
    try:
        stored = manager.item_metadata(step)["state"]
    except Exception as e:  # tensorstore reports a missing or damaged file as several exception types
        raise _damaged(path, e) from None
    _check_shapes(path, target, stored, "the run being resumed")
    try:
        return manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))).state
    except Exception as e:
        raise _damaged(path, e) from None


def _damaged(path: Path, error: Exception) -> ValueError:
    return ValueError(f"training state {path} is damaged ({type(error).__name__}: {str(error)[:200]}); "
                      "delete that step's folder to resume from the one before")
