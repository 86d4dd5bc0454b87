"""`jax_mha.parallel.ring.ring_attention` (also `jax_mha.parallel.ring_attention`) on 4 and 8
forced CPU devices against `attention(..., implementation="xla")` on one device: values
and gradients (q, k, v, the floating arrays a `score_mod` closes over, the attention
sinks) for every part of the description it takes, the log-sum-exp of
`return_residual=True` and the gradients through it, the collectives in its program,
and its refusals.

Both device counts run in one subprocess with 8 devices (XLA fixes the device count
at start-up), the 4-device meshes on its first 4 (one start-up of jax for both); this
file is that subprocess's script too, and prints one JSON line of results. Each case is
one jitted program for the ring (output and VJP together) and one for the reference,
so the subprocess compiles two programs per case; the errors are measured on the host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import f32_tolerance, script_env

# (B, H, K, N, D): H != K (GQA), N a multiple of P² for the striped causal layout.
SHAPES = {4: (2, 6, 2, 48, 8), 8: (1, 3, 1, 64, 4)}
# Options by name; "docs" (packed documents as segment ids), "alibi" (a score_mod over
# closed-over slopes, whose gradient is checked), "doc_mask" (a mask_mod over a
# document-id array passed into the jitted function, i.e. traced), "sinks" (one logit
# per head, differentiated) and "lse" (return_residual=True, a cotangent on the lse
# too) are built in `_options`.
CASES = {
    "full": dict(),
    "causal": dict(is_causal=True),  # striped layout
    "causal_window": dict(is_causal=True, local_window_size=(5, 0)),  # ring cut to 2 steps at P=4
    "window_both_sides": dict(local_window_size=(7, 3), sinks=True, kv_lengths=[30, 0]),  # rows that see only a sink
    "kv_lengths": dict(kv_lengths=[30, 0], lse=True),  # sequence 1: every row empty, lse -inf
    "causal_kv_lengths": dict(is_causal=True, kv_lengths=[30, 11], scale=0.3),
    "packed_causal": dict(is_causal=True, docs=1, sinks=True, lse=True, q_lengths=[37, 13]),  # ids striped with rows
    "packed_lengths_window": dict(docs=1, q_lengths=[37, 13], kv_lengths=[41, 29], local_window_size=(9, 2),
                                  logits_soft_cap=1.5),
    "alibi": dict(is_causal=True, alibi=True),  # global q_idx - kv_idx in the striped layout
    "document_mask": dict(is_causal=True, doc_mask=True, logits_soft_cap=2.0),
}
# Every case runs on 4 devices; on 8 (a longer ring, cut differently by the window) these.
ON_EIGHT = ("causal", "causal_window", "window_both_sides", "packed_causal", "alibi", "document_mask")
# On 4 devices the batch, then the key/value heads, split beside the sequence (2 x 2);
# on 8 all three (2 x 2 x 2), through `ring_attention_fn`. The mods read the global
# batch and head indices.
SPLITS = {4: {"batch_axis_name": ("data",), "head_axis_name": ("model",)}, 8: {"batch_and_heads": ("data", "model")}}
SPLIT_SHAPE = (2, 6, 2, 16, 4)

ROOT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _documents(rng, b: int, n: int) -> np.ndarray:
    """int32 `(b, n)`: sorted document ids, each row packed differently (1 to 4 cuts)."""
    rows = []
    for _ in range(b):
        cuts = np.sort(rng.choice(np.arange(1, n), size=rng.integers(1, 5), replace=False))
        rows.append(np.searchsorted(cuts, np.arange(n), side="right") + rng.integers(0, 3))
    return np.stack(rows).astype(np.int32)


def _options(options: dict, b: int, floats: tuple, ints: tuple) -> dict:
    """The keywords of one case: `floats = (slopes (H,), sinks (H,))` differentiable, `ints =
    (document ids (B, N),)`, both passed into the jitted function."""
    import jax.numpy as jnp

    out = {name: value for name, value in options.items() if name not in ("docs", "alibi", "doc_mask", "sinks", "lse")}
    for name in ("q_lengths", "kv_lengths"):
        if name in out:
            out[name] = jnp.asarray(out[name][:b])
    if options.get("docs"):  # 2: neighbouring documents merged (coarser than the mask_mod's)
        out["q_segment_ids"] = ints[0] // options["docs"]
    if options.get("alibi"):
        slopes = floats[0]
        out["score_mod"] = lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j).astype(s.dtype)
    if options.get("doc_mask"):
        docs = ints[0]  # odd heads ignore the documents: the mask reads the global head too
        out["mask_mod"] = lambda b, h, i, j: (docs[b, i] == docs[b, j]) | (h % 2 == 1)
    if options.get("sinks"):
        out["sinks"] = floats[1]
    if options.get("lse"):
        out["return_residual"] = True
    return out


def _compare(ring_fn, inputs, sharded, options) -> dict:
    """Ring vs one-device attention: max abs errors of the output (and of the finite
    lse entries, whose -inf entries must coincide) and of the gradients of
    `(out * w).sum()` (`+ (lse * w_lse).sum()` over finite entries with "lse") to q,
    k, v, the slopes and the sinks (these two relative to their largest entry), and
    the compiled ring program's text."""
    import jax
    import jax.numpy as jnp

    from jax_mha import attention

    q, k, v, w, slopes, docs, sinks, w_lse = inputs
    b = q.shape[0]

    def both(fn):
        def run(q, k, v, w, slopes, docs, sinks, w_lse):
            f = lambda q, k, v, slopes, sinks: fn(q, k, v, **_options(options, b, (slopes, sinks), (docs,)))
            out, pull = jax.vjp(f, q, k, v, slopes, sinks)
            if not options.get("lse"):
                return out, None, pull(w)
            return out[0], out[1], pull((w, jnp.where(jnp.isfinite(out[1]), w_lse, 0.0)))

        return jax.jit(run)

    args = (*sharded[:4], slopes, docs, sinks, sharded[4])  # sharded: q, k, v, w, w_lse
    compiled = both(ring_fn).lower(*args).compile()
    (out, lse, grads), (want, want_lse, want_grads) = compiled(*args), both(
        lambda *a, **o: attention(*a, implementation="xla", **o))(q, k, v, w, slopes, docs, sinks, w_lse)
    sharding = str(out.sharding.spec)
    # On the host (NumPy): eagerly, each difference and maximum would compile a program per shape.
    out, want = np.asarray(out), np.asarray(want)
    grads, want_grads = [np.asarray(g) for g in grads], [np.asarray(g) for g in want_grads]
    errors = [float(np.abs(a - e).max()) for a, e in zip(grads, want_grads)]
    for i in (3, 4):
        errors[i] /= max(1.0, float(np.abs(want_grads[i]).max()))
    result = {
        "out": float(np.abs(out - want).max()),
        "grads": errors,
        "slopes_grad_max": float(np.abs(want_grads[3]).max()),
        "sinks_grad_max": float(np.abs(want_grads[4]).max()),
        "out_changed": float(np.abs(want).max()),
        "grads_max": [float(np.abs(g).max()) for g in want_grads[:3]],
        "finite": bool(np.isfinite(out).all() and all(np.isfinite(g).all() for g in grads)),
        "sharding": sharding,
        "hlo": compiled.as_text(),
    }
    if lse is not None:
        got_lse, want_lse = np.asarray(lse), np.asarray(want_lse)
        finite = np.isfinite(want_lse)
        result.update(lse=float(np.abs(np.where(finite, got_lse, 0.0) - np.where(finite, want_lse, 0.0)).max()),
                      lse_max=float(np.abs(np.where(finite, want_lse, 0.0)).max()),
                      lse_pattern=bool(np.array_equal(np.where(finite, 0.0, got_lse), np.where(finite, 0.0, want_lse))),
                      lse_minus_inf=int((want_lse == -np.inf).sum()), lse_dtype=str(lse.dtype),
                      lse_sharding=str(lse.sharding.spec))
    return result


def _inputs(rng, shape):
    import jax.numpy as jnp

    b, h, kh, n, d = shape
    q, w = (jnp.asarray(rng.standard_normal((b, h, n, d)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((b, kh, n, d)), jnp.float32) for _ in range(2))
    slopes = jnp.asarray(2.0 ** -np.linspace(0.5, 4, h), jnp.float32)
    docs = jnp.asarray(_documents(rng, b, n))
    sinks = jnp.asarray(2.0 * rng.standard_normal(h), jnp.float32)  # some heads' rows mostly sink
    return q, k, v, w, slopes, docs, sinks, jnp.asarray(rng.standard_normal((b, h, n)), jnp.float32)


def _run_cases(num_devices: int) -> dict:
    """The cases on the process's first `num_devices` devices."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from jax_mha.parallel import ring_attention, ring_attention_fn

    devices = jax.devices()[:num_devices]
    rng = np.random.default_rng(num_devices)
    mesh = jax.make_mesh((num_devices,), ("sequence",), devices=devices)
    inputs = _inputs(rng, SHAPES[num_devices])
    seq = NamedSharding(mesh, PartitionSpec(None, None, "sequence", None))
    # Put from the host: resharding a device array compiles a slicing program per shape and mesh.
    sharded = [jax.device_put(np.asarray(x), seq) for x in inputs[:4]] + [
        jax.device_put(np.asarray(inputs[-1]), NamedSharding(mesh, PartitionSpec(None, None, "sequence")))]
    results = {}
    for name, options in CASES.items():
        if num_devices == 8 and name not in ON_EIGHT:
            continue
        ring = lambda *a, **o: ring_attention(*a, mesh=mesh, query_chunk_size=4, **o)
        results[name] = _compare(ring, inputs, sharded, options)
        hlo = results[name].pop("hlo")
        if name == "causal":
            results["hlo"] = {"collective_permute": hlo.count("collective-permute"), "all_gather": hlo.count("all-gather")}
    inputs = _inputs(rng, SPLIT_SHAPE)
    for name, axes in SPLITS[num_devices].items():
        shape = (2,) * (len(axes) + 1)
        mesh = jax.make_mesh(shape, (*axes, "sequence"), devices=devices)
        spec = PartitionSpec("data" if "data" in axes else None, "model" if "model" in axes else None, "sequence")
        sharded = [jax.device_put(np.asarray(x), NamedSharding(mesh, spec)) for x in (*inputs[:4], inputs[-1])]
        split = {"batch_axis_name": "data" if "data" in axes else None,
                 "head_axis_name": "model" if "model" in axes else None}
        ring = lambda *a, **o: ring_attention(*a, mesh=mesh, query_chunk_size=4, **split, **o)  # noqa: B023
        if len(axes) == 2:  # the modules' attention_fn: it splits over "data" and "model" by itself
            ring = ring_attention_fn(mesh, query_chunk_size=4)
        results[name] = _compare(ring, inputs, sharded, dict(is_causal=True, docs=2, alibi=True, doc_mask=True,
                                                             sinks=True, lse=True))
        results[name].pop("hlo")
    return results


def _length_refusals() -> list[str]:
    """The messages for a length that does not fit a ring of 4 (non-causal, causal)."""
    import jax
    import jax.numpy as jnp

    from jax_mha.parallel import ring_attention

    mesh = jax.make_mesh((4,), ("sequence",), devices=jax.devices()[:4])
    messages = []
    for causal in (False, True):
        x = jnp.ones((1, 2, 8 if causal else 10, 4))
        try:
            ring_attention(x, x, x, mesh=mesh, is_causal=causal)
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    return messages


@pytest.fixture(scope="module")
def subprocess_results():
    """The subprocess's results: {"4": …, "8": …, "length_refusals": […]}."""
    flags = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    env = script_env(XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module", params=[4, 8])
def ring_results(request, subprocess_results):
    return request.param, subprocess_results[str(request.param)]


def _assert_equal_to_attention(got, where, options, shape):
    """Tolerances from the float32 sums of `shape`'s attention: the logits over D, the
    softmax sum and weights @ v over the N keys; backward sums over D, the keys, and
    (for dk, dv) the rows of the H/K query heads that share a key head."""
    b, h, kh, n, d = shape
    forward = d + 2 * n
    backward = forward + d + n + n * (h // kh)
    assert got["finite"], where
    assert got["out"] < f32_tolerance(terms=forward, magnitude=got["out_changed"]), (where, got)
    for error, size in zip(got["grads"][:3], got["grads_max"]):  # dq, dk, dv
        assert error < f32_tolerance(terms=backward, magnitude=size), (where, got)
    # d slopes (a sum over the batch and every row and key) and d sinks (over the batch
    # and the rows), relative to their largest entries.
    assert got["grads"][3] < f32_tolerance(terms=backward + b * n * n, magnitude=1.0), (where, got)
    assert got["grads"][4] < f32_tolerance(terms=backward + b * n, magnitude=1.0), (where, got)
    assert (got["sinks_grad_max"] > 0.1) == bool(options.get("sinks")), (where, got)  # compared, and not zero
    if options.get("lse"):
        assert got["lse"] < f32_tolerance(terms=d + n, magnitude=got["lse_max"]), (where, got)
        assert got["lse_pattern"] and got["lse_dtype"] == "float32", (where, got)
        assert "sequence" in got["lse_sharding"], (where, got)  # split along N like out


@pytest.mark.parametrize("case", list(CASES))
def test_ring_attention_equals_attention(ring_results, case):
    num_devices, results = ring_results
    if case not in results:
        pytest.skip(f"not run on the {num_devices}-device mesh")
    got = results[case]
    _assert_equal_to_attention(got, (num_devices, case), CASES[case], SHAPES[num_devices])
    assert got["out_changed"] > 0.1  # the reference output is not all zeros: the comparison means something
    assert "sequence" in got["sharding"]  # the output stays split along N
    if CASES[case].get("alibi"):
        assert got["slopes_grad_max"] > 1.0  # the slopes' gradient is compared, and is not zero
    if CASES[case].get("lse") and ("q_lengths" in CASES[case] or not CASES[case].get("sinks")):
        assert got["lse_minus_inf"] > 0  # rows past q_lengths, or with no key and no sink: -inf compared


@pytest.mark.parametrize("split", ["batch_axis_name", "head_axis_name", "batch_and_heads"])
def test_batch_or_heads_split_beside_the_sequence(ring_results, split):
    """GQA, packed documents, ALiBi, a document mask that also reads the head, sinks
    and the lse, with the batch and/or the key/value heads split over mesh axes beside
    the sequence: the mods must see the global batch and head indices, each device its
    heads' sinks."""
    num_devices, results = ring_results
    if split not in results:
        pytest.skip(f"not run on the {num_devices}-device mesh")
    got = results[split]
    _assert_equal_to_attention(got, (num_devices, split), dict(sinks=True, lse=True), SPLIT_SHAPE)
    assert got["slopes_grad_max"] > 1.0
    for axis in ("data", "model"):
        assert (axis in got["sharding"]) == (axis in SPLITS[num_devices][split]), got


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
    with pytest.raises(TypeError, match=r"ring_attention\(\) got an unexpected keyword argument 'dropout_rate'"):
        ring_attention(x, x, x, mesh=mesh, dropout_rate=0.1)  # the description's keywords only
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
    with pytest.raises(ValueError, match=r"local_window_size left side must be >= 0, got -1"):
        ring_attention(x, x, x, mesh=mesh, local_window_size=(-1, 0))
    with pytest.raises(ValueError, match=r"query_chunk_size must be a positive int, got 0"):
        ring_attention(x, x, x, mesh=mesh, query_chunk_size=0)
    # The rest of the description goes through attention's own checks and messages.
    with pytest.raises(ValueError, match=r"q_segment_ids of shape \(1, 5\) does not broadcast"):
        ring_attention(x, x, x, mesh=mesh, q_segment_ids=jnp.zeros((1, 5), jnp.int32))
    with pytest.raises(TypeError, match=r"q_lengths must be integers"):
        ring_attention(x, x, x, mesh=mesh, q_lengths=jnp.ones((1,)))
    with pytest.raises(TypeError, match=r"mask_mod must return booleans"):
        ring_attention(x, x, x, mesh=mesh, mask_mod=lambda b, h, i, j: i - j)
    with pytest.raises(ValueError, match=r"logits_soft_cap must be a positive finite number"):
        ring_attention(x, x, x, mesh=mesh, logits_soft_cap=-1.0)
    with pytest.raises(ValueError, match=r"sinks must have shape \(H,\) = \(2,\), one logit per query head, got \(3,\)"):
        ring_attention(x, x, x, mesh=mesh, sinks=jnp.zeros(3))
    with pytest.raises(TypeError, match=r"sinks must be floating"):
        ring_attention(x, x, x, mesh=mesh, sinks=jnp.zeros(2, jnp.int32))


def test_refusal_names_every_part_it_cannot_take():
    import jax.numpy as jnp

    from jax_mha._masking import Call, Visibility
    from jax_mha.parallel.ring import refusal

    x = jnp.ones((1, 2, 6, 4))
    assert refusal(Visibility(6, 6, is_causal=True, q_lengths=jnp.ones((1, 1, 1, 1), jnp.int32)), Call(x, x, x)) is None
    message = refusal(Visibility(6, 6, mask=jnp.ones((6, 6), bool), bias=jnp.zeros((6, 6))),
                      Call(x, x, x, return_weights=True, dropout=True, empty_rows="uniform"))
    assert "cannot take mask, bias, return_weights=True, attention dropout, empty_rows='uniform'" in message
    assert "\n" not in message


def test_length_not_a_multiple_of_the_ring_is_refused(subprocess_results):
    lines = subprocess_results["length_refusals"]
    assert "N=10 is not a multiple of the ring size 4" in (lines[0] or "")
    assert "N=8 is not a multiple of the ring size squared (striped causal layout) 16" in (lines[1] or "")


if __name__ == "__main__":
    print("RESULT " + json.dumps({"4": _run_cases(4), "8": _run_cases(8), "length_refusals": _length_refusals()}))
