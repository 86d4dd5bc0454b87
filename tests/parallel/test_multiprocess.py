"""Training across two processes (`jax.distributed`, CPU collectives) gives the
parameters of one process on the same four devices; argument checks of
`jax_mha.lab.distributed`.

Each process needs its own XLA flags before jax starts, so this file runs itself as a
script (`python tests/parallel/test_multiprocess.py PORT NUM_PROCESSES PROCESS_ID OUT`): two
processes with 2 forced host devices each, joined at a free local port, and one
process with 4, training a tiny character LM. The two processes train twice on a
data=2 x model=2 mesh: with each batch split across them, then with the heads split
across them (where no process can read a parameter or a per-head metric alone).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import f32_tolerance, script_env

SKIP_EXIT = 77  # the worker's "this platform cannot" status
TIMEOUT = 300  # seconds per subprocess; a hung collective fails the test instead of the suite (128 s on a loaded 2-core Zen 3)

ROOT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The float32 sums of the worker's training, for the tolerances. The model (1 layer,
# d_model 12, 2 heads of 6, d_ff 14, T 8): two layer norms (mean and variance), the
# q/k/v projections, the logits over 6, the softmax sum and weights @ v over T, the
# output projection, the feed-forward layer; the final norm, the logits. The loss adds
# the softmax over the 103 characters and the mean over the batch's 6 x 8 tokens; a
# step runs it backward and sums the gradients over the tokens; 4 steps.
FORWARD_TERMS = 2 * 2 * 12 + 12 + 6 + 2 * 8 + 12 + 12 + 14 + 2 * 12 + 12
LOSS_TERMS = FORWARD_TERMS + 103 + 6 * 8
TRAINING_TERMS = 4 * (2 * LOSS_TERMS + 6 * 8) + LOSS_TERMS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(num_processes: int, process_id: int, port: int, out: str, devices: int) -> subprocess.Popen:
    # Optimisation level 0: compiling is most of each process's time; both runs share it.
    flags = f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"
    env = script_env(XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(var, None)
    args = [sys.executable, os.path.abspath(__file__), str(port), str(num_processes), str(process_id), out]
    # Output to a file, not a pipe: nobody reads a pipe while waiting, and a full one would block.
    with open(f"{out}.{process_id}.log", "w") as log:
        return subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def _finish(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    """Waits for every process; if one fails, the others (blocked in a collective
    with it) are killed at once rather than at the timeout.

    Raises:
      subprocess.TimeoutExpired: after TIMEOUT seconds, every process killed.
    """
    deadline = time.monotonic() + TIMEOUT
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        hung = [p for p in procs if p.poll() is None]
        for p in hung:
            p.kill()
    results = [(p.wait(), Path(f"{p.args[-1]}.{p.args[-2]}.log").read_text()) for p in procs]
    if hung and time.monotonic() > deadline:
        raise subprocess.TimeoutExpired([p.args for p in hung], TIMEOUT)
    return results


def _params(path) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in json.loads(open(path).read()).items()}


def test_two_processes_train_as_one(tmp_path):
    port = _free_port()
    two = [_start(2, i, port, str(tmp_path / "two"), devices=2) for i in range(2)]
    one = [_start(1, 0, 0, str(tmp_path / "one"), devices=4)]
    try:
        results = _finish(two)
    except subprocess.TimeoutExpired:
        _finish(one)
        pytest.fail(f"two processes did not finish in {TIMEOUT} s")
    (one_rc, one_out), = _finish(one)
    for rc, out in results:
        if rc == SKIP_EXIT:
            pytest.skip(out.strip().splitlines()[-1])
        assert rc == 0, out[-4000:]
    assert one_rc == 0, one_out[-4000:]
    reports = [json.loads(out.splitlines()[-1]) for _, out in results]
    one = json.loads(one_out.splitlines()[-1])["one"]
    one_params = _params(tmp_path / "one.one.json")
    assert [r["process"] for r in reports] == [0, 1] and len(one_params) > 4
    # Training moved the parameters: equal results are not two untouched initialisations.
    assert one["moved"] > 1e-3
    for layout, axis in (("batch_across", "data"), ("heads_across", "model")):
        assert all(r[layout]["crosses"] == [axis] for r in reports), layout
        # Process 0 wrote the parameters and the state file; the metrics agree everywhere.
        assert (tmp_path / f"two.{layout}.state").exists()
        assert reports[0][layout]["eval_loss"] == reports[1][layout]["eval_loss"]
        np.testing.assert_allclose(reports[0][layout]["eval_loss"], one["eval_loss"],
                                   atol=f32_tolerance(terms=TRAINING_TERMS, magnitude=one["eval_loss"]))
        two_params = _params(tmp_path / f"two.{layout}.json")
        assert two_params.keys() == one_params.keys()
        for name in one_params:
            np.testing.assert_allclose(two_params[name], one_params[name], err_msg=f"{layout} {name}",
                                       atol=f32_tolerance(terms=TRAINING_TERMS, magnitude=one_params[name]))

@pytest.mark.parametrize("kwargs, env, match", [
    ({"coordinator": "localhost"}, {}, "not HOST:PORT"),
    ({"coordinator": "h:99999", "num_processes": 2, "process_id": 0}, {}, "not HOST:PORT"),
    ({"coordinator": "h:1234", "num_processes": 0, "process_id": 0}, {}, "num_processes must be >= 1, got 0"),
    ({"coordinator": "h:1234", "num_processes": 2, "process_id": -1}, {}, "process_id must be >= 0, got -1"),
    ({"coordinator": "h:1234", "num_processes": 2, "process_id": 2}, {}, "process_id=2 must be < num_processes=2"),
    ({}, {"JAX_COORDINATOR_ADDRESS": "h:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "x"}, "'x' is not an"),
    ({"coordinator": "h:1234"}, {}, "missing num_processes, process_id"),
])
def test_bad_settings_are_named(kwargs, env, match):
    from jax_mha.lab.distributed import settings

    with pytest.raises(ValueError, match=match):
        settings(**kwargs, env=env)


def test_settings_from_flags_env_and_clusters():
    from jax_mha.lab.distributed import settings

    assert settings(env={}) is None  # a plain run is left alone
    want = {"coordinator_address": "10.0.0.1:1234", "num_processes": 3, "process_id": 2}
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "3", "JAX_PROCESS_ID": "2"}
    assert settings(env=env) == want
    assert settings("10.0.0.1:1234", 3, 2, env={}) == want
    assert settings(process_id=1, env=env) == {**want, "process_id": 1}  # a flag wins over its variable
    slurm = {v: "1" for v in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")}
    assert settings(env=slurm) == {}  # jax reads the job itself
    assert settings(process_id=0, env=slurm) == {"coordinator_address": None, "num_processes": None, "process_id": 0}


@pytest.mark.parametrize("argv, env, message", [
    (["--coordinator", "localhost"], {}, "argument --coordinator: coordinator address 'localhost' is not HOST:PORT"),
    (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"], {}, "process_id=2 must be < num_processes=2"),
    (["--process-id", "-1"], {}, "argument --process-id: -1 is not an integer >= 0"),
    (["--num-processes", "0"], {}, "argument --num-processes: 0 is not an integer >= 1"),
    ([], {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "3"},
     "process_id=3 must be < num_processes=2"),
])
def test_study_flags_refuse_bad_values(argv, env, message, monkeypatch, capsys):
    from experiments import head_ablation

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        head_ablation.parse(["--preset", "tiny", *argv])
    assert exit_.value.code == 2
    assert f"error: {message}" in capsys.readouterr().err


# ---------------------------------------------------------------------------------
# The subprocess.
# ---------------------------------------------------------------------------------


def _worker(port: int, num_processes: int, process_id: int, out: str) -> None:
    import jax

    if num_processes > 1:
        try:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")  # the default; named as the test needs it
            from jax_mha.lab.distributed import initialize_from

            initialize_from(f"127.0.0.1:{port}", num_processes, process_id, env={})
        except (AttributeError, NotImplementedError, RuntimeError) as e:
            if "gloo" in str(e).lower() or "collective" in str(e).lower() or isinstance(e, AttributeError):
                print(f"no CPU collectives on this platform: {e}", flush=True)
                sys.exit(SKIP_EXIT)
            raise
    from jax_mha import parallel
    from jax_mha.lab.distributed import is_writer
    from jax_mha.lab.models import Decoder, ModelConfig
    from jax_mha.lab.text import TextTaskConfig
    from jax_mha.lab.train import TrainConfig, init_state, make_optimizer, train_seeds

    task = TextTaskConfig(seq_len=8)  # the character LM: no greedy decoding to compile for its metrics
    model_cfg = ModelConfig(vocab_size=task.vocab_size, max_len=task.seq_len, d_model=12, d_ff=14, num_heads=2,
                            num_layers=1)
    cfg = TrainConfig(batch_size=6, num_steps=4, learning_rate=1e-2, warmup_steps=1, steps_per_call=2, eval_every=4,
                      eval_size=6)
    flat = lambda tree: {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    if num_processes == 1:  # the reference: how far training moved it (the test reads this one's "moved")
        # The same seed's initial parameters (train_seeds: init key = split(PRNGKey(seed))[0]), by
        # train_seeds' own program (the same function jitted: one compile, then a cache hit there;
        # eagerly, each initializer's operations would compile one by one).
        init = jax.jit(lambda key: init_state(key, Decoder(model_cfg), make_optimizer(cfg)))
        initial = flat(init(jax.random.split(jax.random.PRNGKey(3))[0]).params)
    a, b = [d for d in jax.devices() if d.process_index == 0], [d for d in jax.devices() if d.process_index != 0]
    # Devices in row-major (data, model) order: [a0, a1, b0, b1] splits each batch
    # across the processes, [a0, b0, a1, b1] the heads (then no process holds a whole
    # query kernel or per-head metric).
    layouts = {"one": a} if num_processes == 1 else {"batch_across": [a[0], a[1], b[0], b[1]],
                                                       "heads_across": [a[0], b[0], a[1], b[1]]}
    report = {"process": jax.process_index()}
    for name, devices in layouts.items():
        mesh = parallel.make_mesh(data=2, model=2, devices=devices)
        grid = mesh.devices.reshape(2, 2)
        crosses = [axis for axis, line in (("data", grid[:, 0]), ("model", grid[0, :]))
                   if len({d.process_index for d in line}) > 1]
        # The two processes save the state as they train (each its own shards); the reference need not.
        state_dir = None if num_processes == 1 else f"{out}.{name}.state"
        result = train_seeds(model_cfg, task, cfg, [3], mesh=mesh, state_dir=state_dir)
        params = flat(jax.tree.map(lambda x: np.asarray(x)[0], result.state.params))  # on the host: no program per leaf
        if is_writer():
            with open(f"{out}.{name}.json", "w") as f:
                json.dump({k: v.tolist() for k, v in params.items()}, f)
        report[name] = {"crosses": crosses, "eval_loss": result.evals["loss"].tolist()}
        if num_processes == 1:
            report[name]["moved"] = max(float(np.abs(params[k] - initial[k]).max()) for k in params)
    print(json.dumps(report), flush=True)

if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
