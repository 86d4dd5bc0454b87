"""`jax_mha.parallel.ulysses.ulysses_attention` (also `jax_mha.parallel.ulysses_attention`) on 4
forced CPU devices against `attention(..., implementation="xla")` on one device: values
and gradients (q, k, v, and the ALiBi slopes a `score_mod` closes over) for every part
of the description, with the batch or the heads split beside the sequence, a dense
mask and bias, the weights; `ulysses_attention_fn` in `MultiHeadAttention`; the
refusals that need several devices; the collectives of its program and the measuring
script `experiments/sequence_parallel_bytes.py` at its smoke sizes.

The 4-device checks run in one subprocess (XLA fixes the device count at start-up):
this file is its script too, printing one JSON line. Each case is one jitted program
for Ulysses (output and VJP together) and one for the reference. The refusals that
one device can show, and the studies' `--sequence-parallel` flag, run in-process.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from conftest import f32_tolerance, script_env

B, H, N, D, DV = 2, 8, 20, 5, 3  # N a multiple of P = 4; every axis its own size
# The float32 sums of one attention call, for the tolerances: the logits over D, the
# softmax sum and weights @ v over the N keys; its backward adds sums over DV, the
# keys and the query rows.
FORWARD_TERMS = D + 2 * N
BACKWARD_TERMS = FORWARD_TERMS + DV + 2 * N
# Options by name, with the key/value heads K (8: MHA, 4: GQA). "docs" (packed
# documents as segment ids), "alibi" (a score_mod over closed-over slopes, whose
# gradient is checked) and "doc_mask" (a mask_mod over document ids passed into the
# jitted function, i.e. traced, that also reads the global head) are built in `_options`.
CASES = {
    "full": (8, dict()),
    "causal_alibi": (4, dict(is_causal=True, alibi=True)),
    "window_soft_cap": (8, dict(local_window_size=(3, 2), logits_soft_cap=1.5, alibi=True)),
    "packed_causal": (4, dict(is_causal=True, docs=True)),
    "lengths": (4, dict(q_lengths=[17, 9], kv_lengths=[13, 0])),  # sequence 1: every row empty
    "document_mask": (8, dict(is_causal=True, doc_mask=True, alibi=True)),
    # The library's kernel (interpreted here) after the all-to-all, the mods on global indices.
    "kernel": (4, dict(is_causal=True, doc_mask=True, alibi=True, implementation="pallas_gpu")),
}
# 2 x 2 meshes: the batch, then the heads, split beside the sequence (mods read global indices).
SPLITS = {"batch_axis_name": "data", "head_axis_name": "model"}
ROOT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _options(options: dict, slopes, docs) -> dict:
    """The keywords of one case; `slopes (H,)` and `docs (B, N)` are traced."""
    import jax.numpy as jnp

    out = {name: value for name, value in options.items() if name not in ("docs", "alibi", "doc_mask")}
    for name in ("q_lengths", "kv_lengths"):
        if name in out:
            out[name] = jnp.asarray(out[name])
    if options.get("docs"):
        out["q_segment_ids"] = docs
    if options.get("alibi"):
        out["score_mod"] = lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j).astype(s.dtype)
    if options.get("doc_mask"):  # heads 1, 4, 7 ignore the documents: the global head matters
        out["mask_mod"] = lambda b, h, i, j: (docs[b, i] == docs[b, j]) | (h % 3 == 1)
    return out


def _inputs(rng, kv_heads: int):
    import jax.numpy as jnp

    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    q, k, v, w = f(B, H, N, D), f(B, kv_heads, N, D), f(B, kv_heads, N, DV), f(B, H, N, DV)
    slopes = jnp.asarray(2.0 ** -np.linspace(0.5, 4, H), jnp.float32)
    docs = jnp.asarray(np.sort(rng.integers(0, 4, (B, N)), axis=1), jnp.int32)
    return q, k, v, w, slopes, docs


def _compare(fn, inputs, spec, options) -> dict:
    """Ulysses vs one-device attention: max abs errors of the output and of the
    gradients of `(out * w).sum()` to q, k, v and the slopes (the last relative to its
    largest entry), and the compiled program's text."""
    import jax
    from jax.sharding import NamedSharding

    from jax_mha import attention

    q, k, v, w, slopes, docs = inputs

    def both(fn):
        def run(q, k, v, w, slopes, docs):
            out, pull = jax.vjp(lambda q, k, v, slopes: fn(q, k, v, **_options(options, slopes, docs)), q, k, v, slopes)
            return out, pull(w)

        return jax.jit(run)

    # Put from the host: resharding a device array compiles a slicing program per shape and mesh.
    sharded = [jax.device_put(np.asarray(x), NamedSharding(spec[0], spec[1])) for x in (q, k, v, w)]
    compiled = both(fn).lower(*sharded, slopes, docs).compile()
    (out, grads) = compiled(*sharded, slopes, docs)
    want, want_grads = both(lambda *a, **o: attention(*a, **{**o, "implementation": "xla"}))(q, k, v, w, slopes, docs)
    sharding = str(out.sharding.spec)
    out, want, grads, want_grads = _host(out, want, grads, want_grads)
    errors = [float(np.abs(a - e).max()) for a, e in zip(grads, want_grads)]
    errors[3] /= max(1.0, float(np.abs(want_grads[3]).max()))
    return {"out": float(np.abs(out - want).max()), "grads": errors, "out_max": float(np.abs(want).max()),
            "grads_max": [float(np.abs(g).max()) for g in want_grads[:3]],
            "slopes_grad_max": float(np.abs(want_grads[3]).max()), "sharding": sharding,
            "finite": bool(np.isfinite(out).all() and all(np.isfinite(g).all() for g in grads)),
            "hlo": compiled.as_text()}


def _host(*trees):
    """The arrays as NumPy arrays, for the comparisons: eagerly on the device, each
    difference and maximum would compile a program per shape."""
    import jax

    return [jax.tree.map(np.asarray, tree) for tree in trees]


def _cases(rng) -> dict:
    import jax
    from jax.sharding import PartitionSpec

    from jax_mha.parallel import ulysses_attention

    results = {}
    mesh = jax.make_mesh((4,), ("sequence",))  # Explicit axes: inputs resharded inside
    for name, (kv_heads, options) in CASES.items():
        fn = lambda *a, **o: ulysses_attention(*a, mesh=mesh, **o)
        results[name] = _compare(fn, _inputs(rng, kv_heads), (mesh, PartitionSpec(None, None, "sequence")), options)
        hlo = results[name].pop("hlo")
        if name == "full":
            results["hlo"] = {"all_to_all": len(re.findall(r"all-to-all\(", hlo)),
                              "collective_permute": hlo.count("collective-permute"), "all_gather": hlo.count("all-gather")}
    for arg, axis in SPLITS.items():
        mesh = jax.make_mesh((2, 2), (axis, "sequence"))
        spec = PartitionSpec(axis if axis == "data" else None, axis if axis == "model" else None, "sequence")
        fn = lambda *a, **o: ulysses_attention(*a, mesh=mesh, **{arg: axis}, **o)  # noqa: B023
        results[arg] = _compare(fn, _inputs(rng, 4), (mesh, spec), dict(is_causal=True, docs=True, alibi=True,
                                                                           doc_mask=True, kv_lengths=[19, 11]))
        results[arg].pop("hlo")
    return results


def _dense_and_weights(rng) -> dict:
    """A dense mask `(B, 1, N, N)` and a per-head bias `(H, N, N)`, with the weights."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from jax_mha import attention
    from jax_mha.parallel import ulysses_attention

    mesh = jax.make_mesh((4,), ("sequence",))
    q, k, v = _inputs(rng, 4)[:3]
    mask = jnp.asarray(rng.random((B, 1, N, N)) < 0.7)
    bias = jnp.asarray(rng.standard_normal((H, N, N)), jnp.float32)
    options = dict(mask=mask, bias=bias, return_weights=True)
    loss = lambda fn: jax.jit(jax.value_and_grad(lambda q, k, v: (fn(q, k, v)[0] ** 2).sum(), argnums=(0, 1, 2)))
    split = [jax.device_put(np.asarray(x), NamedSharding(mesh, PartitionSpec(None, None, "sequence"))) for x in (q, k, v)]
    got = jax.jit(lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh, **options))(*split)
    # The references jitted too (with the unmasked output): eagerly, each operation compiles on its own.
    want, unmasked = jax.jit(lambda q, k, v: (attention(q, k, v, implementation="xla", **options),
                                              attention(q, k, v)))(q, k, v)
    (value, grads) = loss(lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh, **options))(*split)
    (want_value, want_grads) = loss(lambda q, k, v: attention(q, k, v, implementation="xla", **options))(q, k, v)
    got, want, unmasked, value, grads, want_value, want_grads = _host(got, want, unmasked, value, grads, want_value,
                                                                      want_grads)
    return {"out": float(np.abs(got[0] - want[0]).max()), "weights": float(np.abs(got[1] - want[1]).max()),
            "weights_shape": list(got[1].shape), "loss": abs(float(value - want_value)) / float(want_value),
            "grads": max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(grads, want_grads)),
            "out_max": float(np.abs(want[0]).max()),
            "masked_changes_out": float(np.abs(want[0] - unmasked).max())}


def _new_keywords(rng) -> dict:
    """`sinks` and `return_residual`, where `attention` has them (being added): each
    device's slice of the sinks, the lse brought back to the sequence split."""
    import jax
    import jax.numpy as jnp

    from jax_mha import attention
    from jax_mha.parallel import ulysses_attention

    mesh = jax.make_mesh((4,), ("sequence",))
    q, k, v = _inputs(rng, 4)[:3]
    accepted = inspect.signature(attention).parameters
    out = {}
    if "sinks" in accepted:
        sinks = jnp.asarray(rng.standard_normal(H), jnp.float32)
        grad = lambda fn: jax.jit(jax.grad(lambda q, s: (fn(q, s) ** 2).sum(), argnums=(0, 1)))
        got = grad(lambda q, s: ulysses_attention(q, k, v, mesh=mesh, sinks=s, is_causal=True))(q, sinks)
        want = grad(lambda q, s: attention(q, k, v, sinks=s, is_causal=True, implementation="xla"))(q, sinks)
        got, want = _host(got, want)
        out["sinks"] = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(got, want))  # relative
    if "return_residual" in accepted:
        got = jax.jit(lambda q: ulysses_attention(q, k, v, mesh=mesh, return_residual=True, kv_lengths=jnp.array(
            [7, 0])))(q)
        want = jax.jit(lambda q: attention(q, k, v, return_residual=True, kv_lengths=jnp.array([7, 0]),
                                           implementation="xla"))(q)
        got, want = _host(got, want)
        finite = np.isfinite(want[1])
        with np.errstate(invalid="ignore"):  # -inf - -inf where the row is empty, masked out by `finite`
            lse_error = np.where(finite, got[1] - want[1], 0.0)
        out["residual"] = {"out": float(np.abs(got[0] - want[0]).max()), "out_max": float(np.abs(want[0]).max()),
                           "lse": float(np.abs(lse_error).max()),
                           "lse_max": float(np.abs(np.where(finite, want[1], 0.0)).max()),
                           "empty_equal": bool(np.all(np.where(finite, True, got[1] == want[1]))),
                           "shape": list(got[1].shape)}
    return out


def _module(rng) -> dict:
    """`ulysses_attention_fn` in `MultiHeadAttention` (GQA, packed, causal) against the
    plain module: the loss and the parameter gradients, each relative to its size."""
    import jax
    import jax.numpy as jnp

    from jax_mha import MultiHeadAttention, parallel

    mesh = parallel.make_mesh(sequence=4)  # Auto axes, the trainer's mesh
    x = jnp.asarray(rng.standard_normal((B, N, 24)), jnp.float32)
    plain = MultiHeadAttention(num_heads=8, num_kv_heads=4)
    ulysses = MultiHeadAttention(num_heads=8, num_kv_heads=4, attention_fn=parallel.ulysses_attention_fn(mesh))
    params = plain.init(jax.random.key(0), x)
    options = dict(is_causal=True, segment_ids=jnp.asarray(np.repeat([[0, 1], [2, 2]], [7, 13], axis=1)),
                   kv_lengths=jnp.array([20, 15]))
    run = lambda model: jax.jit(jax.value_and_grad(lambda p: (model.apply(p, x, **options) ** 2).sum()))(params)
    (value, grads), (want, want_grads) = _host(run(ulysses), run(plain))
    return {"value": abs(float(value - want)) / float(want),
            "grads": max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(jax.tree.leaves(grads),
                                                                                       jax.tree.leaves(want_grads)))}


def _refusals() -> dict:
    """The messages of what only several devices can refuse."""
    import jax
    import jax.numpy as jnp

    from jax_mha.parallel import ulysses_attention

    mesh = jax.make_mesh((4,), ("sequence",))
    two = jax.make_mesh((2, 2), ("model", "sequence"))
    x = lambda h, n: jnp.ones((1, h, n, 4))
    calls = {"heads": lambda: ulysses_attention(x(6, 8), x(6, 8), x(6, 8), mesh=mesh),
             "kv_heads": lambda: ulysses_attention(x(8, 8), x(2, 8), x(2, 8), mesh=mesh),
             "length": lambda: ulysses_attention(x(8, 10), x(8, 10), x(8, 10), mesh=mesh),
             "heads_times_model": lambda: ulysses_attention(x(6, 8), x(6, 8), x(6, 8), mesh=two,
                                                            head_axis_name="model"),
             "batch": lambda: ulysses_attention(x(4, 8), x(4, 8), x(4, 8), mesh=two, axis_name="model",
                                                batch_axis_name="sequence")}
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


def _study_flag() -> dict:
    """`--sequence-parallel ulysses` on a `sequence=4` mesh: parsed, refused by name
    where a head count does not divide; `train.sequence_parallel` gives the model
    `ulysses_attention_fn` for that choice (the module test shows that runs as the
    plain model) and ring attention by default."""
    import contextlib
    import io

    from experiments import head_ablation
    from jax_mha.lab import train
    from jax_mha.lab.models import Decoder, ModelConfig

    base = ["--task", "lm", "--preset", "tiny", "--mesh", "data=1,sequence=4", "--sequence-parallel", "ulysses"]
    args, _, mesh = head_ablation.parse([*base, "--heads", "4"])
    err, code = io.StringIO(), None
    try:
        with contextlib.redirect_stderr(err):
            head_ablation.parse([*base, "--heads", "2", "4"])
    except SystemExit as e:
        code = e.code
    model = Decoder(ModelConfig(vocab_size=5, max_len=16, d_model=8, num_heads=4, num_layers=1, d_ff=8))
    name = lambda kind: train.sequence_parallel(model, mesh, kind).attention_fn.func.__name__
    return {"parsed": args.sequence_parallel, "mesh": dict(mesh.shape), "error": err.getvalue()[-400:], "code": code,
            "ring": name("ring"), "inside": name(args.sequence_parallel), "after": name("ring")}


def _worker() -> dict:
    from experiments import sequence_parallel_bytes

    rng = np.random.default_rng(4)
    out = {"cases": _cases(rng), "dense": _dense_and_weights(rng), "new": _new_keywords(rng), "module": _module(rng),
           "refusals": _refusals(), "study": _study_flag()}
    with tempfile.TemporaryDirectory() as folder:
        result = sequence_parallel_bytes.main(["--smoke", "--out", folder])
        out["bytes"] = {"rows": result["rows"], "written": os.listdir(folder)}
    return out


@pytest.fixture(scope="module")
def four_devices():
    flags = "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0"
    env = script_env(XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ROOT_DIR)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def _assert_equal_to_attention(got, where):
    assert got["finite"], where
    assert got["out"] < f32_tolerance(terms=FORWARD_TERMS, magnitude=got["out_max"]), (where, got)
    for error, size in zip(got["grads"][:3], got["grads_max"]):  # dq, dk, dv
        assert error < f32_tolerance(terms=BACKWARD_TERMS, magnitude=size), (where, got)
    # d slopes, relative to its largest entry: each a sum over the batch and every (row, key).
    assert got["grads"][3] < f32_tolerance(terms=BACKWARD_TERMS + B * N * N, magnitude=1.0), (where, got)


@pytest.mark.parametrize("case", [*CASES, *SPLITS])
def test_ulysses_equals_attention(four_devices, case):
    got = four_devices["cases"][case]
    _assert_equal_to_attention(got, case)
    assert got["out_max"] > 0.1  # the reference output is not all zeros: the comparison means something
    assert "sequence" in got["sharding"]  # the output stays split along N
    options = CASES[case][1] if case in CASES else {"alibi": True}
    if options.get("alibi"):
        assert got["slopes_grad_max"] > 0.1  # the slopes' gradient is compared, and is not zero
    if case in SPLITS:
        assert SPLITS[case] in got["sharding"]  # the batch or the heads stay split too


def test_the_heads_travel_by_all_to_all(four_devices):
    hlo = four_devices["cases"]["hlo"]
    assert hlo["all_to_all"] >= 4  # q, k, v to the heads, the output back
    assert hlo["collective_permute"] == 0 and hlo["all_gather"] == 0


def test_dense_mask_bias_and_weights(four_devices):
    got = four_devices["dense"]
    assert got["masked_changes_out"] > 0.1
    assert got["out"] < f32_tolerance(terms=FORWARD_TERMS, magnitude=got["out_max"]), got
    assert got["weights"] < f32_tolerance(terms=D + N, magnitude=1.0), got
    assert got["loss"] < f32_tolerance(terms=FORWARD_TERMS + B * H * N * DV, magnitude=1.0), got  # relative
    assert got["grads"] < f32_tolerance(terms=BACKWARD_TERMS, magnitude=1.0), got  # relative, each gradient
    assert got["weights_shape"] == [B, H, N, N]


def test_sinks_and_the_residual_where_attention_has_them(four_devices):
    new = four_devices["new"]
    if not new:
        pytest.skip("jax_mha.attention takes neither sinks nor return_residual yet")
    if "sinks" in new:  # relative, each gradient (q's, and the sinks' summed over the batch and rows)
        assert new["sinks"] < f32_tolerance(terms=BACKWARD_TERMS + B * N, magnitude=1.0), new
    if "residual" in new:
        got = new["residual"]
        assert got["out"] < f32_tolerance(terms=FORWARD_TERMS, magnitude=got["out_max"]), got
        assert got["lse"] < f32_tolerance(terms=D + N, magnitude=got["lse_max"]), got
        assert got["empty_equal"] and got["shape"] == [B, H, N], got


def test_ulysses_attention_fn_in_the_module_equals_the_plain_module(four_devices):
    """Both relative: the loss, and each parameter's gradient to its largest entry.
    The float32 sums: the projections over d_model=24 (in and out, forward and
    backward), attention's own, the loss over B*N*24 and the gradients over B*N tokens."""
    terms = 4 * 24 + BACKWARD_TERMS + B * N * 24 + B * N
    assert four_devices["module"]["value"] < f32_tolerance(terms=terms, magnitude=1.0), four_devices["module"]
    assert four_devices["module"]["grads"] < f32_tolerance(terms=terms, magnitude=1.0), four_devices["module"]


@pytest.mark.parametrize("name, message", [
    ("heads", r"splits the heads: num_heads H=6 is not a multiple of 4 \(axis_name='sequence' has 4 devices\)"),
    ("kv_heads", r"num_kv_heads K=2 is not a multiple of 4 \(axis_name='sequence' has 4 devices\)"),
    ("length", r"query length N=10 is not a multiple of the 4 devices of axis_name='sequence'"),
    ("heads_times_model", r"num_heads H=6 is not a multiple of 4 \(axis_name='sequence' has 2 devices, times 2 "
                          r"of head_axis_name='model'\)"),
    ("batch", r"batch size B=1 is not a multiple of the 2 devices of batch_axis_name='sequence'"),
])
def test_refusals_that_need_several_devices(four_devices, name, message):
    assert re.search(message, four_devices["refusals"][name] or ""), four_devices["refusals"][name]


def test_measuring_script_counts_the_all_to_alls(four_devices):
    """At the smoke sizes (N=256, H=8, D=16, P=4): Ulysses sends 8 all-to-alls (4
    forward, 4 backward), each 3/4 of a device's `(1, 8, 64, 16)` float32 block; the
    ring passes blocks around by collective-permute and sends more."""
    rows = {r["path"]: r for r in four_devices["bytes"]["rows"]}
    assert four_devices["bytes"]["written"] == ["sequence_parallel_bytes.json"]
    ulysses, ring = rows["ulysses"], rows["ring"]
    assert ulysses["collectives"]["all-to-all"]["executions"] == 8
    assert ulysses["collectives"]["collective-permute"]["executions"] == 0
    block = 8 * 64 * 16 * 4
    np.testing.assert_allclose(ulysses["collectives"]["all-to-all"]["sent_bytes"], 8 * block * 3 / 4)
    assert ring["collectives"]["collective-permute"]["executions"] >= 2 * 3  # k and v, P - 1 hops forward
    assert ring["sent_bytes"] > 2 * ulysses["sent_bytes"]
    assert all(r["memory"]["peak_bytes"] > 3 * block for r in rows.values())  # q, k, v at least


def test_study_flag_runs_ulysses_in_the_trainer(four_devices):
    study = four_devices["study"]
    assert study["parsed"] == "ulysses" and study["mesh"]["sequence"] == 4
    assert study["code"] == 2
    assert "--sequence-parallel ulysses splits the heads over the 4 devices of 'sequence': 2 heads do not divide" in (
        study["error"])
    assert study["inside"] == "_ulysses_attention_fn"
    assert study["ring"] == study["after"] == "_ring_attention_fn"


# ---------------------------------------------------------------------------------
# In-process: what one device can refuse, and the studies' flag.
# ---------------------------------------------------------------------------------


def test_refusals_name_the_bad_value():
    import jax
    import jax.numpy as jnp

    from jax_mha import parallel

    mesh = jax.make_mesh((1,), ("sequence",))
    x = jnp.ones((1, 2, 6, 4))
    call = lambda *a, **o: parallel.ulysses_attention(*a, mesh=mesh, **o)
    with pytest.raises(ValueError, match=r"axis_name='seq' is not an axis of the mesh"):
        call(x, x, x, axis_name="seq")
    with pytest.raises(ValueError, match=r"batch_axis_name='data' is not an axis"):
        call(x, x, x, batch_axis_name="data")
    with pytest.raises(ValueError, match=r"must be different mesh axes"):
        call(x, x, x, head_axis_name="sequence")
    with pytest.raises(ValueError, match=r"expects k of shape \(B, heads, length, D\), got \(2, 6, 4\)"):
        call(x, x[0], x)
    with pytest.raises(ValueError, match=r"layout='BNHD' is not supported"):
        call(x, x, x, layout="BNHD")
    with pytest.raises(ValueError, match=r"cannot take attention dropout \(dropout_rate=0.5"):
        call(x, x, x, dropout_rate=0.5, deterministic=False, dropout_rng=jax.random.key(0))
    with pytest.raises(TypeError, match=r"needs a jax.sharding.Mesh as mesh, got 'sequence'"):
        parallel.ulysses_attention(x, x, x, mesh="sequence")
    with pytest.raises(ValueError, match=r"axis_name='seq' is not an axis of the mesh"):
        parallel.ulysses_attention_fn(mesh, "seq")
    # attention's own checks run on the global shapes, with the caller's numbers.
    with pytest.raises(ValueError, match=r"q_segment_ids of shape \(1, 5\) does not broadcast"):
        call(x, x, x, q_segment_ids=jnp.zeros((1, 5), jnp.int32))
    with pytest.raises(TypeError, match=r"mask_mod must return booleans"):
        call(x, x, x, mask_mod=lambda b, h, i, j: i - j)
    with pytest.raises(ValueError, match=r"num_heads=2 of q is not divisible by num_kv_heads=3"):
        call(x, jnp.ones((1, 3, 6, 4)), jnp.ones((1, 3, 6, 4)))


def test_one_device_equals_attention(rng):
    """A mesh of one device: the all-to-alls are identities; values and gradients."""
    import jax
    import jax.numpy as jnp

    from jax_mha import attention, parallel

    mesh = jax.make_mesh((1,), ("sequence",))
    q = jnp.asarray(rng.standard_normal((2, 3, 7, 5)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((2, 1, 11, 5)), jnp.float32)  # cross-attention, MQA
    options = dict(kv_lengths=jnp.array([11, 4]), local_window_size=(5, 1))
    loss = lambda fn: jax.jit(jax.value_and_grad(lambda q, kv: (fn(q, kv, kv, **options) ** 2).sum(), (0, 1)))
    value, grads = loss(lambda *a, **o: parallel.ulysses_attention(*a, mesh=mesh, **o))(q, kv)
    want, want_grads = loss(lambda *a, **o: attention(*a, implementation="xla", **o))(q, kv)
    terms = 5 + 2 * 11 + 5 + 2 * 11 + 3 * 7  # attention's sums forward and back; dkv over rows and the 3 heads
    np.testing.assert_allclose(value, want, rtol=f32_tolerance(terms=terms + 2 * 3 * 7 * 5, magnitude=1.0))
    for a, b in zip(grads, want_grads):
        np.testing.assert_allclose(a, b, atol=f32_tolerance(terms=terms, magnitude=np.abs(b).max()))


def test_sequence_parallel_flag_parses(capsys):
    from experiments import head_ablation

    assert head_ablation.build_parser().parse_args([]).sequence_parallel == "ring"
    assert head_ablation.build_parser().parse_args(["--sequence-parallel", "ulysses"]).sequence_parallel == "ulysses"
    with pytest.raises(SystemExit) as exit_:
        head_ablation.build_parser().parse_args(["--sequence-parallel", "striped"])
    assert exit_.value.code == 2
    assert "argument --sequence-parallel: invalid choice: 'striped'" in capsys.readouterr().err


def test_sequence_parallel_refuses_an_unknown_kind():
    from jax_mha.lab import train
    from jax_mha.lab.models import Decoder, ModelConfig

    model = Decoder(ModelConfig(vocab_size=5, max_len=16, d_model=8, num_heads=4, num_layers=1, d_ff=8))
    with pytest.raises(ValueError, match=r"must be one of \('ring', 'ulysses'\), got 'striped'"):
        train.sequence_parallel(model, None, "striped")


if __name__ == "__main__":
    import jax

    jax.config.update("jax_numpy_rank_promotion", "raise")  # as conftest.py does for the suite
    print("RESULT " + json.dumps(_worker()))
