"""Shared test configuration and the one float64 reference (`jax_reference`), written apart
from the library.

`jax_numpy_rank_promotion="raise"` turns every implicit rank broadcast (e.g. adding a
`(N, S)` bias to `(B, H, N, S)` logits) into an error, so the library has to broadcast
explicitly and a silently swapped or missing axis cannot slip through.

XLA's CPU backend compiles at optimisation level 0 here: the suite compiles thousands
of small programs and runs few large ones, so compilation is most of its time (27 %
less wall time for tests/nn/test_modules.py and tests/lab/test_train.py, measured on the
2-core CI-sized CPU). Values are checked against references with tolerances, and
bit-for-bit comparisons are between two runs under the same flags. A test that starts
its own Python process sets its own XLA_FLAGS.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import os
import shutil
import tempfile
from pathlib import Path

if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):  # read when the backend starts
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
# On a GPU each pytest worker would otherwise take 75 % of its memory when it starts
# (`pytest -m device` runs two workers); the tests' arrays are small.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# One compilation cache for the run, shared by both workers and every process a test
# starts (they inherit the variables): the suite compiles thousands of small programs,
# many of them more than once (the same computation traced again by another test or
# parametrization), and compiling is most of its time. A fresh directory per run,
# removed at its end (`pytest_sessionfinish`), so no run reads another's entries.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax_mha-tests-xla-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


def np_attention(q, k, v, mask=None, bias=None, scale=None):
    """`jax_reference` in float64 on NumPy arrays, with the weights: the suite's one
    reference, for tests that compare arrays rather than transformations.

    Args:
      q: `(B…, H, N, D)`; k: `(B…, K, S, D)`; v: `(B…, K, S, Dv)`.
      mask: bool broadcastable to `(B…, H, N, S)`, True = may attend.
      bias: float broadcastable to `(B…, H, N, S)`.
      scale: logit scale, default `1/sqrt(D)`.

    Returns:
      `(out (B…, H, N, Dv), weights (B…, H, N, S))`, float64 NumPy; a row with no
      allowed key has zero weights and a zero output.
    """
    full = (*np.shape(q)[:-1], np.shape(k)[-2])  # (B…, H, N, S)
    f64 = lambda x: jnp.asarray(np.asarray(x, np.float64))
    mask = None if mask is None else np.broadcast_to(np.asarray(mask, bool), full)
    with x64():
        bias = None if bias is None else f64(np.broadcast_to(np.asarray(bias, np.float64), full))
        out, weights = jax_reference(f64(q), f64(k), f64(v), mask, bias, scale, return_weights=True)
        return np.asarray(out), np.asarray(weights)


def f32_tolerance(*, terms: int, magnitude, dtype=jnp.float32, safety: float = 8.0) -> float:
    """Absolute tolerance for two float computations of the same values whose sums
    run in different orders (two paths, sharded vs whole, module vs function, against
    a float64 reference, or on another CPU's vector width):
    `safety * eps(dtype) * sqrt(terms) * magnitude`.

    sqrt, not the worst case eps * terms (Higham, "Accuracy and Stability of Numerical
    Algorithms" §4.2): rounding errors of real data have nearly independent signs and
    add like a random walk (Higham & Mary 2019, probabilistic rounding error
    analysis), and eps * terms, with terms in the hundreds, would pass a 1e-4
    relative bug. `terms`: the summed terms of every reduction on the way, added (D
    for logits, S for the softmax sum and weights @ v, d_model for projections, the
    tokens for a parameter's gradient). `magnitude`: the size of the values and their
    partial sums, a number or the reference array (its largest finite |entry|).
    `safety` covers the constants (the largest of many entries sits a few sigmas
    out; exp turns a logit's absolute error into a relative one). A swapped axis, a
    missing head or a wrong scale is off by a fair fraction of `magnitude`.
    """
    values = np.abs(np.asarray(magnitude, np.float64))
    values = values[np.isfinite(values)]
    return safety * float(jnp.finfo(dtype).eps) * math.sqrt(terms) * float(values.max(initial=0.0))


@pytest.fixture(name="np_attention")
def np_attention_fixture():
    """The float64 NumPy reference `np_attention`."""
    return np_attention


@pytest.fixture
def rng():
    """A fresh NumPy generator per test (fixed seed: failures reproduce)."""
    return np.random.default_rng(0)


def np_allowed(shape, *, is_causal=False, window=None, q_lengths=None, kv_lengths=None, mask=None,
               q_segment_ids=None, kv_segment_ids=None):
    """The boolean `(B…, H, N, S)` pattern of who may attend, in NumPy, written apart
    from `jax_mha._masking`: query i sits at key position i + S - N; a window side of
    None is unbounded; lengths are per batch entry."""
    *batch, h, n, s = shape
    pos = np.arange(n)[:, None] + (s - n)
    key = np.arange(s)[None, :]
    ok = np.ones(shape, bool)
    if is_causal:
        ok &= key <= pos
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        if left is not None:
            ok &= key >= pos - left
        if right is not None:
            ok &= key <= pos + right
    if q_lengths is not None:
        ok &= np.arange(n)[:, None] < np.broadcast_to(np.asarray(q_lengths), tuple(batch))[..., None, None, None]
    if kv_lengths is not None:
        ok &= key < np.broadcast_to(np.asarray(kv_lengths), tuple(batch))[..., None, None, None]
    if q_segment_ids is not None:  # (B…, N) and (B…, S); kv defaults to q
        q_ids = np.asarray(q_segment_ids)
        kv_ids = q_ids if kv_segment_ids is None else np.asarray(kv_segment_ids)
        ok &= (q_ids[..., None, :, None] == kv_ids[..., None, None, :])
    if mask is not None:
        ok &= np.asarray(mask)
    return ok


# Jitted: one program per shapes and options. Called outside a `jit`, each jnp
# operation would compile on its own for every new shape.
@functools.partial(jax.jit, static_argnames=("return_lse", "return_weights"))
def jax_reference(q, k, v, allowed=None, bias=None, scale=None, cap=None, keep=None, rate=0.0, uniform_rows=None,
                  sinks=None, return_lse=False, return_weights=False):
    """Dense attention in plain `jax.numpy`, written apart from `jax_mha`, for comparing
    every JAX transformation against autodiff (run it in float64): scaled logits, + bias,
    `cap * tanh(logits / cap)` when `cap` is given (Gemma 2's order), mask, softmax. k/v
    are repeated per query head (GQA); masked logits are -inf; rows with nothing allowed
    give 0. `keep` (bool, the weights' shape) drops weights out at `rate` (kept ones
    scaled by 1/(1-rate)); `uniform_rows` (bool `(B…, H, N)`) gives those rows the mean
    of all values (the `empty_rows="uniform"` policy). `sinks` `(H,)`: one more key
    per head, never masked, of that logit and value zero. `return_lse`: also the log
    of each row's softmax denominator (-inf where it is empty); `return_weights`: also
    the weights `(B…, H, N, S)` (the sinks' own weights left out)."""
    h, kv_heads, d = q.shape[-3], k.shape[-3], q.shape[-1]
    k = jnp.repeat(k, h // kv_heads, axis=-3)
    v = jnp.repeat(v, h // kv_heads, axis=-3)
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    logits = q @ jnp.swapaxes(k, -1, -2) * scale
    if bias is not None:
        logits = logits + bias
    if cap is not None:
        logits = cap * jnp.tanh(logits / cap)
    allowed = jnp.ones(logits.shape, bool) if allowed is None else jnp.broadcast_to(allowed, logits.shape)
    if sinks is not None:  # the sink as a last key: always allowed, value zero
        sink = jnp.broadcast_to(sinks[:, None, None], logits.shape[:-1] + (1,)).astype(logits.dtype)
        logits = jnp.concatenate([logits, sink], axis=-1)
        allowed = jnp.concatenate([allowed, jnp.ones(sink.shape, bool)], axis=-1)
        v = jnp.concatenate([v, jnp.zeros(v.shape[:-2] + (1, v.shape[-1]), v.dtype)], axis=-2)
        if keep is not None:
            keep = jnp.concatenate([jnp.asarray(keep), jnp.ones(sink.shape, bool)], axis=-1)
    logits = jnp.where(allowed, logits, -jnp.inf)
    top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    e = jnp.where(allowed, jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    total = jnp.sum(e, axis=-1, keepdims=True)
    weights = e / jnp.where(total > 0, total, 1.0)
    if keep is not None:
        weights = jnp.where(keep, weights / (1.0 - rate), 0.0)
    out = weights @ v
    if return_weights:
        return out, weights[..., :-1] if sinks is not None else weights
    if uniform_rows is not None:
        mean_v = jnp.mean(v if sinks is None else v[..., :-1, :], axis=-2, keepdims=True)
        out = jnp.where(uniform_rows[..., None], mean_v, out)
    if not return_lse:
        return out
    shift = jnp.where(jnp.isfinite(top), top, 0.0)[..., 0]
    return out, jnp.where(total[..., 0] > 0, shift + jnp.log(jnp.where(total[..., 0] > 0, total[..., 0], 1.0)),
                          -jnp.inf)


# The attention paths the suites run; "weights" is "xla" asked for the weights too.
PATHS = ("xla", "blockwise", "weights", "cudnn")
KERNEL_PATHS = ("pallas_tpu", "pallas_gpu")


def normal(rng, shape, dtype=jnp.float32):
    """Fresh standard-normal inputs (never zeros), as a jax array (cast in NumPy and
    put on the device: `jnp.asarray` would compile a conversion per shape)."""
    return jax.device_put(np.asarray(rng.standard_normal(shape), dtype))


def randomize(params, seed=0):
    """Replaces every leaf by fresh N(0, 0.3²) values, so zero-initialised biases matter.

    NumPy draws: no XLA compilation per parameter shape (keeps the suite fast on CPU).
    """
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(lambda x: jax.device_put(np.asarray(0.3 * rng.standard_normal(x.shape), x.dtype)),
                                  params)


def run(path, q, k, v, **kw):
    """`jax_mha.attention` on one path, jitted once per path and static options (arrays
    traced); the output only. The blockwise path runs 4 x 8 blocks (several blocks,
    padding and skipping all happen). Works under outer transformations too."""
    from jax_mha import attention

    if path == "cudnn" and jax.default_backend() != "gpu":
        pytest.skip("the cudnn path needs a GPU; this backend is " + jax.default_backend())
    arrays = {name: x for name, x in kw.items() if isinstance(x, (jax.Array, np.ndarray))}
    static = {name: x for name, x in kw.items() if name not in arrays}
    if path == "weights":
        static.update(implementation="xla", return_weights=True)
    elif path == "blockwise":
        static = dict(query_block_size=4, key_block_size=8) | static
        static.update(implementation="blockwise")
    else:
        static.update(implementation=path)
    out = _jitted(tuple(sorted(static.items(), key=lambda item: item[0])), attention)(q, k, v, arrays)
    return out[0] if path == "weights" else out


@functools.cache
def _jitted(static, attention):
    return jax.jit(lambda q, k, v, arrays: attention(q, k, v, **arrays, **dict(static)))


def x64(enabled: bool = True):
    """Context manager turning 64-bit types on (`jax.enable_x64`, or the older
    `jax.experimental.enable_x64`)."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(enabled)
    from jax.experimental import disable_x64, enable_x64  # jax < 0.5

    return enable_x64() if enabled else disable_x64()


TESTS_DIR = Path(__file__).resolve().parent


def script_env(**overrides: str) -> dict[str, str]:
    """The environment of a test file run again as a script in a subprocess (to start
    XLA with more host devices): the checkout, whether installed or not, and this
    directory (`conftest`) importable; `overrides` set variables such as XLA_FLAGS."""
    env = dict(os.environ, **overrides)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR.parent), str(TESTS_DIR), env.get("PYTHONPATH")]))
    return env


def run_in(cwd: Path, main, argv) -> tuple[object, str]:
    """A study's `main(argv)` with `cwd` as the working directory; `(result, stdout)`."""
    out, old = io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out):
            result = main(argv)
    finally:
        os.chdir(old)
    return result, out.getvalue()


def pytest_addoption(parser):
    parser.addoption("--full-matrix", action="store_true", default=False,
                     help="run every cell of tests/core/test_composition.py (CI runs a fixed-seed draw of them)")


def pytest_sessionfinish(session):
    """Removes the run's compilation cache, in the process that made it."""
    if _OWN_CACHE and not hasattr(session.config, "workerinput"):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
