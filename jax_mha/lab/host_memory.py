"""Host memory on CPU: keep each call's temporaries out of fresh pages.

XLA:CPU allocates a compiled call's temporaries as one block, freed when the call
returns. glibc serves any block above its mmap threshold (at most 32 MiB) with a
fresh `mmap` and gives it back with `munmap`, so every call page-faults the whole
block in again, 4 KiB at a time; on the copy-task training step that costs page
faults and time (measured in docs/performance.md, "Design choices and what they
measured"). PyTorch allocates many smaller tensors, which glibc reuses.

`reuse_freed_memory()` tells glibc to keep freed memory for reuse instead: one
malloc arena (a worker thread's own arena cannot grow past 64 MiB, so a big block
would be mapped anyway), no `mmap` for big blocks, and no trimming of the heap. The
process's resident memory then stays at its peak. It changes the whole process, so
the library never calls it on its own; every experiment does (`experiments.common`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import warnings

# mallopt parameters, from glibc's malloc.h.
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int


def _backend_started() -> bool:
    """Whether JAX has created its backends (and so its worker threads), when the
    running JAX can tell; if it cannot, assume not."""
    try:
        from jax._src import xla_bridge
    except ImportError:
        return False
    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started()) if started is not None else False


def reuse_freed_memory() -> bool:
    """Makes glibc keep and reuse freed memory (see the module docstring).

    Call it before the first JAX computation: threads that already allocated keep
    their own arenas, so afterwards it would not take effect. Returns whether it
    took effect: False (with a warning) once JAX has started, and False, silently,
    where the C library is not glibc (macOS, musl) and there is nothing to change.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if _backend_started():
        warnings.warn("reuse_freed_memory() must run before the first JAX computation; JAX has started, "
                      "so nothing was changed", RuntimeWarning, stacklevel=2)
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, _NEVER_TRIM))
    return all(libc.mallopt(param, value) == 1 for param, value in settings)
