"""`reuse_freed_memory`: glibc keeps a call's big temporaries instead of mapping them
fresh (and page-faulting them in) on every call. Each case runs in a fresh process,
since the setting must come before JAX starts."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting exists only in glibc")

# The copy-task model's forward+backward (166 MB of temporaries, above glibc's
# largest mmap threshold); prints the median minor page faults of 5 calls after
# warm-up. The median, since on a busy machine XLA's threads may free and allocate in
# another order and grow the heap once (a call of ~28,000 faults was seen).
FAULTS = textwrap.dedent("""
    import resource, sys
    from jax_mha.lab.host_memory import reuse_freed_memory
    applied = reuse_freed_memory() if sys.argv[1] == "reuse" else None
    import jax, jax.numpy as jnp
    from jax_mha.lab.models import Decoder, ModelConfig
    model = Decoder(ModelConfig(vocab_size=14, d_model=256, num_heads=8, num_layers=2))
    tokens = jnp.zeros((64, 34), jnp.int32)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), tokens)  # one program (eagerly, ~7 CPU s of op compiles)
    grad = jax.jit(jax.grad(lambda p: jnp.sum(model.apply(p, tokens) ** 2)))
    for _ in range(2):
        jax.block_until_ready(grad(params))
    faults = []
    for _ in range(5):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        jax.block_until_ready(grad(params))
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(applied, sorted(faults)[2])
""")


def _faults(mode: str) -> tuple[str, float]:
    out = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, timeout=300, check=True)
    applied, faults = out.stdout.split()
    return applied, float(faults)


def test_reuse_stops_the_page_faults_of_every_call():
    _, default_faults = _faults("default")
    applied, reused_faults = _faults("reuse")
    assert applied == "True"
    assert default_faults > 20_000, default_faults  # ~40,000 4 KiB pages mapped anew each call
    assert reused_faults < default_faults / 20, (reused_faults, default_faults)


def test_after_jax_started_it_warns_and_changes_nothing():
    code = textwrap.dedent("""
        import warnings, jax, jax.numpy as jnp
        from jax_mha.lab.host_memory import reuse_freed_memory
        jax.block_until_ready(jnp.ones(2) + 1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            print(reuse_freed_memory(), [str(w.message) for w in caught])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.startswith("False"), out.stdout
    assert "before the first JAX computation" in out.stdout
