"""Every feature with every other, on every path: path x pair of features x
transformation, each cell against the float64 reference of tests/conftest.py
(`jax_reference`, `np_allowed`), or the path refusing the cell by name.

The matrix is generated: 15 features, their 105 pairs, 6 paths (the whole scores, the
weights, the blockwise engine, both Pallas kernels in interpret mode, and decoding:
a prefill chunk then single steps through the cache) and the ring, 4 transformations
(jit, vmap, grad, jvp). `pytest --full-matrix tests/core/test_composition.py` runs every
cell; the default run (CI) takes a fixed-seed draw of them (`_draw`), so every run
checks the same cells: every path under every transformation, each path with 8 of its
features (every feature on at least 3 paths).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import f32_tolerance, jax_reference, np_allowed, script_env, x64

from jax_mha import _attend, attention

B, H, N, S, D = 2, 6, 7, 11, 5
KV_GQA = 3
FEATURES = ("causal", "window", "q_lengths", "kv_lengths", "segments", "mask", "bias", "score_mod", "mask_mod",
            "soft_cap", "gqa", "uniform_rows", "dropout", "sinks", "residual")
PATHS = ("xla", "weights", "blockwise", "pallas_tpu", "pallas_gpu", "decode")
TRANSFORMS = ("jit", "vmap", "grad", "jvp")
# Ring cells per subprocess: about 4 s each on a 2-core CPU, so one process stays well
# inside its timeout (the full matrix's 420 cells in one took longer than 1,500 s).
RING_CHUNK = 60
RING_DEVICES, RING_N = 4, 16  # N a multiple of P² (the striped causal layout)
RATE = 0.3
SLOPES = np.array([0.5, -0.25, 0.125, 1.0, -0.5, 0.75])
# The float32 sums of a cell, for the tolerances: the logits over D, the softmax sum
# and weights @ v over at most 16 keys; backward (or a jvp's tangent) adds sums over
# D, the keys, and the rows of the H query heads that may share a key head.
CELL_TERMS = 2 * D + 3 * RING_N + H * RING_N


ALL_CELLS = [(path, pair, t) for path in PATHS for pair in itertools.combinations(FEATURES, 2) for t in TRANSFORMS]
ALL_RING = [("ring", pair, t) for pair in itertools.combinations(FEATURES, 2) for t in TRANSFORMS]


def _name(cell):
    path, (a, b), t = cell
    return f"{path}-{a}+{b}-{t}"


def pytest_generate_tests(metafunc):
    full = metafunc.config.getoption("--full-matrix")
    if "cell" in metafunc.fixturenames:
        cells = ALL_CELLS if full else DRAWN_CELLS
        metafunc.parametrize("cell", cells, ids=[_name(c) for c in cells])
    if "ring_cell" in metafunc.fixturenames:
        cells = ALL_RING if full else DRAWN_RING
        metafunc.parametrize("ring_cell", cells, ids=[_name(c) for c in cells])


def problem(features, n):
    """`(attention keywords, reference parts)` for a set of features; n = N = S when
    decoding (self-attention), else N queries against S keys."""
    rng = np.random.default_rng(FEATURES.index(sorted(features)[0]) * 31 + n)
    s = S if n == N else n  # N queries against S keys; decoding and the ring are self-attention
    kw, ref = {}, dict(cap=None, bias=None, rate=0.0)
    allowed = dict(shape=(B, H, n, s))
    if "causal" in features:
        kw["is_causal"] = allowed["is_causal"] = True
    if "window" in features:
        kw["local_window_size"] = allowed["window"] = (3, 2)
    if "q_lengths" in features:
        kw["q_lengths"] = allowed["q_lengths"] = np.array([n, n - 3])
    if "kv_lengths" in features:
        kw["kv_lengths"] = allowed["kv_lengths"] = np.array([s - 4, s])
    if "segments" in features:
        q_ids = np.sort(rng.integers(0, 3, (B, n)), axis=-1)
        kv_ids = q_ids if n == s else np.sort(rng.integers(0, 3, (B, s)), axis=-1)
        kw.update(q_segment_ids=q_ids, kv_segment_ids=kv_ids)
        allowed.update(q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    if "mask" in features:
        kw["mask"] = allowed["mask"] = rng.random((B, 1, n, s)) < 0.7
    bias = np.zeros((B, H, n, s))
    if "bias" in features:
        kw["bias"] = rng.standard_normal((B, H, n, s)).astype(np.float32)
        bias = bias + kw["bias"]
    rows, cols = np.arange(n)[:, None], np.arange(s)[None, :]
    if "score_mod" in features:  # ALiBi-like, from the mods' indices
        slopes = jnp.asarray(SLOPES, jnp.float32)
        kw["score_mod"] = lambda sc, b, h, i, j: sc + slopes[h] * 0.1 * (j - i).astype(sc.dtype)
        bias = bias + SLOPES[:, None, None] * 0.1 * (cols - rows)
    mask_mod_ok = np.ones((1, H, n, s), bool)
    if "mask_mod" in features:
        kw["mask_mod"] = lambda b, h, i, j: (i + j + h) % 4 != 0
        mask_mod_ok = (rows + cols + np.arange(H)[:, None, None]) % 4 != 0
    if "soft_cap" in features:
        kw["logits_soft_cap"] = ref["cap"] = 2.0
    if "uniform_rows" in features:
        kw["empty_rows"] = "uniform"
    if "sinks" in features:
        kw["sinks"] = ref["sinks"] = np.array([0.3, -1.0, 2.0, 0.0, -0.5, 1.0], np.float32)
    if "residual" in features:
        kw["return_residual"] = ref["return_lse"] = True
    if "dropout" in features:
        kw.update(dropout_rate=RATE, deterministic=False, dropout_rng=jax.random.key(7))
        ref.update(rate=RATE, keep=np.asarray(jax.random.bernoulli(jax.random.key(7), 1 - RATE, (B, H, n, s))))
    ref["allowed"] = np_allowed(**allowed) & mask_mod_ok
    ref["bias"] = bias if ("bias" in features or "score_mod" in features) else None
    if "uniform_rows" in features:
        valid = np.arange(n) < np.broadcast_to(np.asarray(kw.get("q_lengths", n)), (B,))[:, None, None]
        ref["uniform_rows"] = ~ref["allowed"].any(-1) & valid
    return kw, ref


def inputs(features, n):
    rng = np.random.default_rng(len(features) + n)
    kv = KV_GQA if "gqa" in features else H
    s = S if n == N else n  # N queries against S keys; decoding and the ring are self-attention
    return tuple(rng.standard_normal(shape).astype(np.float32)
                 for shape in ((B, H, n, D), (B, kv, s, D), (B, kv, s, D)))


def decode(q, k, v, kw, prefill=8):
    """Prefill `prefill` tokens, then one token per call, through the cache (the
    layer's own code, `_attend.attend`); the outputs of every call concatenated."""
    n = q.shape[-2]
    ids = kw.pop("q_segment_ids", None)
    kw.pop("kv_segment_ids", None)
    kw.pop("is_causal", None)  # decoding is causal
    mask, bias = kw.pop("mask", None), kw.pop("bias", None)
    cache = _attend.Cache(jnp.zeros(k.shape, k.dtype), jnp.zeros(v.shape, v.dtype), jnp.zeros((), jnp.int32),
                          None if ids is None else jnp.zeros((B, n), jnp.int32))
    outs = []
    for lo, hi in [(0, prefill)] + [(t, t + 1) for t in range(prefill, n)]:
        rows = lambda x: None if x is None else x[..., lo:hi, :]  # noqa: B023
        out, _, cache = _attend.attend(q[..., lo:hi, :], k[..., lo:hi, :], v[..., lo:hi, :], cache=cache,
                                       mask=rows(mask), bias=rows(bias),
                                       segment_ids=None if ids is None else ids[:, lo:hi], **kw)
        outs.append(out)
    return jnp.concatenate(outs, axis=-2)


def attention_fn(path, kw):
    kw = {name: jnp.asarray(x) if isinstance(x, np.ndarray) else x for name, x in kw.items()}
    if path == "ring":
        from jax_mha import parallel
        from jax_mha.parallel.ring import ring_attention_fn

        # The library's mesh (Auto axes): eager grad on an Explicit mesh needs jax.set_mesh, in plain JAX too.
        ring = ring_attention_fn(parallel.make_mesh(sequence=RING_DEVICES), query_chunk_size=2)
        return lambda q, k, v: ring(q, k, v, **kw)
    if path == "decode":
        return lambda q, k, v: decode(q, k, v, dict(kw))
    if path == "weights":
        pick = (lambda r: (r[0], r[2])) if kw.get("return_residual") else (lambda r: r[0])
        return lambda q, k, v: pick(attention(q, k, v, implementation="xla", return_weights=True, **kw))
    blocks = dict(query_block_size=4, key_block_size=8) if path == "blockwise" else {}
    return lambda q, k, v: attention(q, k, v, implementation=path, **blocks, **kw)


def loss(result, w):
    """A scalar of the output (and of the finite log-sum-exps, when returned)."""
    out, lse = result if isinstance(result, tuple) else (result, None)
    total = jnp.sum(out * w.astype(out.dtype))
    if lse is not None:
        total = total + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w[..., 0].astype(lse.dtype))
    return total


def transformed(transform, f, q, k, v):
    """The transformation of `f` at (q, k, v), as a pytree of arrays."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((B, H, q.shape[-2], D))
    if transform == "jit":
        return jax.jit(f)(q, k, v)
    if transform == "vmap":
        return jax.vmap(f)(*(jnp.stack([x, 0.5 * x]) for x in (q, k, v)))
    if transform == "grad":
        return jax.grad(lambda *a: loss(f(*a), w), argnums=(0, 1, 2))(q, k, v)
    tangents = tuple(jnp.asarray(rng.standard_normal(x.shape), x.dtype) for x in (q, k, v))
    return jax.jvp(f, (q, k, v), tangents)


NOT_APPLICABLE = {  # (path, feature): a combination that has no meaning there
    ("decode", "q_lengths"), ("decode", "kv_lengths"), ("decode", "uniform_rows"), ("decode", "dropout"),
    ("decode", "residual"),
}
RING_REFUSES = {"mask": "mask", "bias": "bias", "dropout": "dropout", "uniform_rows": "empty_rows"}
# The library's own kernels (`jax_mha.paths.flex`) take every feature but a dense mask and dropout.
KERNEL_REFUSES = {"mask": "mask", "dropout": "dropout"}
# What a path refuses, and the word its message must contain.
REFUSES = {
    "blockwise": {"dropout": "dropout"},
    "decode": {},
    "ring": RING_REFUSES,
    "pallas_tpu": KERNEL_REFUSES,
    "pallas_gpu": KERNEL_REFUSES,
}


def _draw(paths, seed, transforms=TRANSFORMS):
    """The default (CI) draw. Each path once under each of `transforms`, on features it
    takes, consecutive in one seeded order of the features, each path starting where the
    previous one stopped (so every feature is computed on some path); then, per feature
    the path refuses, one cell of it with the next feature (the refusal by name), under
    the transformations in turn. A cell's cost is its compilations, and a refused one
    stops before any."""
    rng, start, cells = random.Random(seed), 0, []
    order = rng.sample(FEATURES, len(FEATURES))
    for path in paths:
        takes = [f for f in order if (path, f) not in NOT_APPLICABLE and f not in REFUSES.get(path, {})]
        picked = [takes[(start + i) % len(takes)] for i in range(2 * len(transforms))]
        start += len(picked)
        pairs = list(zip(transforms, zip(picked[::2], picked[1::2])))
        refused = [f for f in order if f in REFUSES.get(path, {})]
        pairs += [(TRANSFORMS[i % len(TRANSFORMS)], (f, takes[(start + i) % len(takes)]))
                  for i, f in enumerate(refused)]
        cells += [(path, tuple(sorted(pair, key=FEATURES.index)), t) for t, pair in pairs]
    return cells


# The ring computes under jit and grad and refuses jvp (reverse mode only); its vmap is
# drawn with a refused feature: a computed ring cell under vmap costs as much as the
# rest of the ring's draw (the full matrix has them).
DRAWN_CELLS, DRAWN_RING = _draw(PATHS, seed=0), _draw(("ring",), seed=1, transforms=("jit", "grad", "jvp"))


def check_cell(path, pair, transform) -> str:
    """Runs one cell: "ok" (equal to the reference), "refused" (by name, as the path
    documents), "n/a"; anything else raises."""
    if any((path, f) in NOT_APPLICABLE for f in pair):
        return "n/a"
    n = {"decode": S, "ring": RING_N}.get(path, N)
    kw, ref = problem(set(pair) | ({"causal"} if path == "decode" else set()), n)
    q, k, v = (jnp.asarray(x) for x in inputs(pair, n))
    f = attention_fn(path, kw)
    refused = [REFUSES.get(path, {})[feature] for feature in pair if feature in REFUSES.get(path, {})]
    if refused:
        with pytest.raises(ValueError, match="|".join(refused)):
            transformed(transform, f, q, k, v)
        return "refused"
    if transform == "jvp" and path in ("pallas_tpu", "pallas_gpu", "ring"):
        with pytest.raises(TypeError, match="custom_vjp"):  # these differentiate in reverse mode only
            transformed(transform, f, q, k, v)
        return "refused"
    got = transformed(transform, f, q, k, v)
    with x64():
        g = lambda *a: jax_reference(*a, **{name: jnp.asarray(x) if isinstance(x, np.ndarray) else x
                                            for name, x in ref.items()})
        # The reference under one jit: one compilation, not one per operation (it is the oracle, not the path).
        want = jax.jit(lambda *a: transformed(transform, g, *a))(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):  # each array at its own size
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=f32_tolerance(terms=CELL_TERMS, magnitude=b))
    return "ok"


def test_cell(cell):
    if check_cell(*cell) == "n/a":
        pytest.skip(f"{cell[0]} has no {cell[1]}")


@pytest.fixture(scope="module")
def ring_results(request):
    """The ring cells, run in one subprocess with 4 forced host devices (XLA fixes the
    device count at start-up): `{cell name: "ok" | "refused" | the error}`."""
    cells = ALL_RING if request.config.getoption("--full-matrix") else DRAWN_RING
    flags = f"--xla_force_host_platform_device_count={RING_DEVICES} --xla_backend_optimization_level=0"
    env = script_env(XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    results = {}
    for start in range(0, len(cells), RING_CHUNK):  # the full matrix's 420 cells in several processes
        done = subprocess.run([sys.executable, __file__, json.dumps(cells[start:start + RING_CHUNK])], env=env,
                              capture_output=True, text=True, timeout=1500,
                              cwd=os.path.dirname(os.path.abspath(__file__)))
        assert done.returncode == 0, done.stderr[-3000:]
        results.update(json.loads(done.stdout.strip().splitlines()[-1]))
    return results


def test_the_default_draw_covers_what_it_promises():
    """The CI draw (`_draw`): every path under every transformation, no cell that is
    only "n/a", every feature in cells of at least 3 paths, every refusal once, and the
    ring under jit, grad and jvp with each feature it refuses."""
    assert {(p, t) for p, _, t in DRAWN_CELLS} == set(itertools.product(PATHS, TRANSFORMS))
    assert not [c for c in DRAWN_CELLS if any((c[0], f) in NOT_APPLICABLE for f in c[1])]
    for feature in FEATURES:
        assert len({p for p, pair, _ in DRAWN_CELLS if feature in pair}) >= 3, feature
    for path, refused in REFUSES.items():
        cells = DRAWN_RING if path == "ring" else DRAWN_CELLS
        assert set(refused) <= {f for p, pair, _ in cells if p == path for f in pair}, path
    assert {"jit", "grad", "jvp"} <= {t for _, _, t in DRAWN_RING}


def test_ring_cell(ring_cell, ring_results):
    status = ring_results[_name(ring_cell)]
    assert status in ("ok", "refused", "n/a"), status


def _ring_main(cells) -> dict:
    results = {}
    for path, pair, transform in cells:
        try:
            results[_name((path, pair, transform))] = check_cell(path, tuple(pair), transform)
        except Exception as e:  # reported to the parent test, which fails on it
            results[_name((path, pair, transform))] = f"{type(e).__name__}: {str(e)[:500]}"
    return results


if __name__ == "__main__":
    print(json.dumps(_ring_main(json.loads(sys.argv[1]))))
