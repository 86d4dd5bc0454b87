"""`jax_mha.parallel.ring_attention` on 4 and 8 forced CPU devices against `attention`
on one device: values and gradients for every part it claims, the collectives in its
program, and its refusals.

Each device count runs in one subprocess (XLA fixes the device count at start-up);
this file is that subprocess's script too, and prints one JSON line of results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

# (B, H, K, N, D): H != K (GQA), N a multiple of P² for the striped causal layout.
SHAPES = {4: (2, 6, 2, 48, 8), 8: (1, 3, 1, 64, 4)}
CASES = {
    "full": dict(),
    "causal": dict(is_causal=True),  # striped layout
    "causal_window": dict(is_causal=True, local_window_size=(5, 0)),  # ring cut to 2 steps at P=4
    "window_both_sides": dict(local_window_size=(7, 3)),
    "kv_lengths": dict(kv_lengths=[30, 0]),  # sequence 1: every row empty
    "causal_kv_lengths": dict(is_causal=True, kv_lengths=[30, 11], scale=0.3),
}

ROOT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_cases(num_devices: int) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from jax_mha import attention
    from jax_mha.parallel import ring_attention

    mesh = jax.make_mesh((num_devices,), ("sequence",))
    b, h, kh, n, d = SHAPES[num_devices]
    rng = np.random.default_rng(num_devices)
    q, w = (jnp.asarray(rng.standard_normal((b, h, n, d)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((b, kh, n, d)), jnp.float32) for _ in range(2))
    seq = NamedSharding(mesh, PartitionSpec(None, None, "sequence", None))
    sharded = [jax.device_put(x, seq) for x in (q, k, v)]
    results = {}
    for name, options in CASES.items():
        options = dict(options)
        if "kv_lengths" in options:
            options["kv_lengths"] = jnp.asarray(options["kv_lengths"][:b])
        ring = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, query_chunk_size=4, **options)  # noqa: B023
        ref = lambda q, k, v: attention(q, k, v, implementation="xla", **options)  # noqa: B023
        loss = lambda f: (lambda q, k, v: (f(q, k, v) * w).sum())  # a random output gradient
        out = jax.jit(ring)(*sharded)
        grads = jax.jit(jax.grad(loss(ring), argnums=(0, 1, 2)))(*sharded)
        want_grads = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
        results[name] = {
            "out": float(jnp.abs(out - ref(q, k, v)).max()),
            "grads": [float(jnp.abs(a - e).max()) for a, e in zip(grads, want_grads)],
            "finite": bool(jnp.isfinite(out).all() and all(jnp.isfinite(g).all() for g in grads)),
            "sharding": str(out.sharding.spec),
        }
    if num_devices == 4:  # the batch, then the key/value heads, split beside the sequence
        for axis, option in (("data", "batch_axis_name"), ("model", "head_axis_name")):
            mesh2 = jax.make_mesh((2, 2), (axis, "sequence"))
            spec = (axis, None) if axis == "data" else (None, axis)
            split = NamedSharding(mesh2, PartitionSpec(*spec, "sequence", None))
            ring = lambda q, k, v: ring_attention(q, k, v, mesh=mesh2, is_causal=True, **{option: axis})  # noqa: B023
            ref = lambda q, k, v: attention(q, k, v, is_causal=True)
            out = jax.jit(ring)(*(jax.device_put(x, split) for x in (q, k, v)))
            grads = jax.jit(jax.grad(lambda q, k, v: (ring(q, k, v) * w).sum(), argnums=(0, 1, 2)))(
                *(jax.device_put(x, split) for x in (q, k, v)))
            want_grads = jax.grad(lambda q, k, v: (ref(q, k, v) * w).sum(), argnums=(0, 1, 2))(q, k, v)
            results[option] = {
                "out": float(jnp.abs(out - ref(q, k, v)).max()),
                "grads": [float(jnp.abs(a - e).max()) for a, e in zip(grads, want_grads)],
                "sharding": str(out.sharding.spec),
            }
    hlo = jax.jit(jax.grad(lambda q, k, v: ring_attention(q, k, v, mesh=mesh, is_causal=True).sum(),
                           argnums=(1, 2))).lower(*sharded).compile().as_text()
    results["hlo"] = {"collective_permute": hlo.count("collective-permute"), "all_gather": hlo.count("all-gather")}
    return results


@pytest.fixture(scope="module", params=[4, 8])
def ring_results(request):
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={request.param}", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT_DIR, env.get("PYTHONPATH")]))  # a checkout not installed
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(request.param)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1]
    return request.param, json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("case", list(CASES))
def test_ring_attention_equals_attention(ring_results, case):
    num_devices, results = ring_results
    got = results[case]
    assert got["finite"], (num_devices, case)
    assert got["out"] < 2e-5, (num_devices, case, got)
    assert max(got["grads"]) < 2e-5, (num_devices, case, got)
    assert "sequence" in got["sharding"]  # the output stays split along N


@pytest.mark.parametrize("option", ["batch_axis_name", "head_axis_name"])
def test_batch_or_heads_split_beside_the_sequence(ring_results, option):
    num_devices, results = ring_results
    if num_devices != 4:
        pytest.skip("measured on the 4-device mesh (2 x 2)")
    got = results[option]
    assert got["out"] < 2e-5 and max(got["grads"]) < 2e-5, got
    assert ("data" if option == "batch_axis_name" else "model") in got["sharding"], got


def test_keys_and_values_travel_by_collective_permute(ring_results):
    _, results = ring_results
    assert results["hlo"]["collective_permute"] > 0
    assert results["hlo"]["all_gather"] == 0  # no device ever gathers the whole K or V


def test_refusals_name_the_numbers():
    import jax
    import jax.numpy as jnp

    from jax_mha.parallel import ring_attention

    mesh = jax.make_mesh((1,), ("sequence",))
    x = jnp.ones((1, 2, 6, 4))
    with pytest.raises(ValueError, match=r"axis_name='seq' is not an axis"):
        ring_attention(x, x, x, mesh=mesh, axis_name="seq")
    with pytest.raises(ValueError, match=r"batch_axis_name='data' is not an axis"):
        ring_attention(x, x, x, mesh=mesh, batch_axis_name="data")
    with pytest.raises(ValueError, match=r"must be different mesh axes"):
        ring_attention(x, x, x, mesh=mesh, head_axis_name="sequence")
    with pytest.raises(ValueError, match=r"k and v must be \(B, K, N, D\)"):
        ring_attention(x, x[:, :, :5], x[:, :, :5], mesh=mesh)
    with pytest.raises(ValueError, match=r"num_heads=2 of q is not divisible by num_kv_heads=3"):
        ring_attention(x, jnp.ones((1, 3, 6, 4)), jnp.ones((1, 3, 6, 4)), mesh=mesh)
    with pytest.raises(TypeError, match=r"ring_attention q must be a real floating array"):
        ring_attention(x.astype(jnp.int32), x, x, mesh=mesh)
    with pytest.raises(ValueError, match=r"local_window_size sides must be ints >= 0"):
        ring_attention(x, x, x, mesh=mesh, local_window_size=(-1, 0))


def test_length_not_a_multiple_of_the_ring_is_refused():
    script = (
        "import jax, jax.numpy as jnp\n"
        "from jax_mha.parallel import ring_attention\n"
        "mesh = jax.make_mesh((4,), ('sequence',))\n"
        "x = jnp.ones((1, 2, 10, 4))\n"
        "for causal in (False, True):\n"
        "    try:\n"
        "        ring_attention(jnp.ones((1, 2, 8 if causal else 10, 4)), *[jnp.ones((1, 2, 8 if causal else 10, 4))] * 2,"
        " mesh=mesh, is_causal=causal)\n"
        "    except ValueError as e:\n"
        "        print(e)\n"
    )
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT_DIR, env.get("PYTHONPATH")]))  # a checkout not installed
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert "N=10 is not a multiple of the ring size 4" in lines[0]
    assert "N=8 is not a multiple of the ring size squared (striped causal layout) 16" in lines[1]


if __name__ == "__main__":
    print("RESULT " + json.dumps(_run_cases(int(sys.argv[1]))))
