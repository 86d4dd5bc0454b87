"""Training across several processes (`jax.distributed`): when to start it, and
which process writes.

Under `jax.distributed.initialize` every process runs the same program; `jax.devices()`
lists the devices of all of them, so a mesh from `jax_mha.parallel.make_mesh` spans
every process. `train_seeds` builds its batches inside the jitted program from keys
every process holds, so nothing else is needed for the data; files are written by
process 0 only (`is_writer`).
"""

from __future__ import annotations

import os
from typing import Mapping

import jax

# Environments in which `jax.distributed.initialize()` finds the processes itself
# (jax/_src/clusters: SlurmCluster, OmpiCluster), each named by variables it requires.
CLUSTER_ENVS = {
    "SLURM": ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"),
    "Open MPI": ("OMPI_MCA_orte_hnp_uri",),
}
# Our own variables, read where no flag is given; jax itself reads only the first.
ENV_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def parse_address(text: str) -> str:
    """`HOST:PORT` checked (a port in 1..65535); ValueError naming the text otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"coordinator address {text!r} is not HOST:PORT with a port in 1..65535")
    return text


def settings(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
             env: Mapping[str, str] | None = None) -> dict | None:
    """The arguments for `jax.distributed.initialize`, or None for a plain single-process run.

    Flags win; where none is given, JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
    JAX_PROCESS_ID are read; where those are absent too but a SLURM or Open MPI job is
    detected, `{}` (jax finds the processes itself).

    Raises:
      ValueError: naming the bad value: a malformed address, a count < 1, an id
        outside [0, num_processes), or an address without the count and id.
    """
    env = os.environ if env is None else env

    def number(value, name: str) -> int | None:
        if value is None or isinstance(value, int):
            return value
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{name}={value!r} is not an integer") from None

    coordinator = coordinator if coordinator is not None else env.get("JAX_COORDINATOR_ADDRESS") or None
    num_processes = number(num_processes if num_processes is not None else env.get("JAX_NUM_PROCESSES"),
                           "num_processes")
    process_id = number(process_id if process_id is not None else env.get("JAX_PROCESS_ID"), "process_id")
    given = (coordinator, num_processes, process_id)
    if all(v is None for v in given):
        cluster = any(all(v in env for v in names) for names in CLUSTER_ENVS.values())
        return {} if cluster else None
    if coordinator is not None:
        parse_address(coordinator)
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    if process_id is not None and process_id < 0:
        raise ValueError(f"process_id must be >= 0, got {process_id}")
    if None not in (num_processes, process_id) and process_id >= num_processes:
        raise ValueError(f"process_id={process_id} must be < num_processes={num_processes}")
    cluster = any(all(v in env for v in names) for names in CLUSTER_ENVS.values())
    if None in given and not cluster:
        missing = [n for n, v in zip(("coordinator", "num_processes", "process_id"), given) if v is None]
        raise ValueError(f"several processes need a coordinator address, num_processes and process_id; "
                         f"missing {', '.join(missing)} (no SLURM or Open MPI job to read them from)")
    return {"coordinator_address": coordinator, "num_processes": num_processes, "process_id": process_id}


def initialize_from(coordinator: str | None = None, num_processes: int | None = None,
                    process_id: int | None = None, env: Mapping[str, str] | None = None) -> bool:
    """Calls `jax.distributed.initialize` when `settings(...)` asks for it (before any
    JAX computation); returns whether it did. A plain run (no flag, no variable, no
    cluster) is left alone. Calling it again after it started changes nothing.

    Raises:
      ValueError: as `settings`.
    """
    kwargs = settings(coordinator, num_processes, process_id, env)
    if kwargs is None:
        return False
    if not jax.distributed.is_initialized():
        jax.distributed.initialize(**kwargs)
    return True


def is_writer() -> bool:
    """Whether this process writes logs, results and figures: process 0 only."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Waits until every process reaches `barrier(name)` (nothing to wait for alone):
    after process 0 changes files the others are about to read."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
