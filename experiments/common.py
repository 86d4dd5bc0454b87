"""What every experiment shares: atomic writes, run metadata, figure saving."""

from __future__ import annotations

import json
import os
import platform
from typing import Any

import numpy as np

from jax_mha.checkpoint import write_atomic


def to_jsonable(x: Any) -> Any:
    """NumPy/JAX scalars and arrays to plain Python, recursively; NaN/inf to None."""
    if isinstance(x, dict):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_jsonable(v) for v in x]
    if hasattr(x, "tolist") and not isinstance(x, (str, bytes)):
        return to_jsonable(np.asarray(x).tolist())
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x


def write_json(path: str | os.PathLike, data: Any) -> None:
    """Atomic, indented JSON."""
    write_atomic(path, json.dumps(to_jsonable(data), indent=2) + "\n")


def run_metadata() -> dict[str, Any]:
    """Versions and device, recorded beside every result."""
    import flax
    import jax
    import optax

    return {
        "jax": jax.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d.device_kind) for d in jax.devices()],
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
    }


def save_figure(fig, path: str | os.PathLike) -> None:
    """Saves a matplotlib figure as PNG atomically and closes it."""
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    write_atomic(path, buf.getvalue())


def use_agg_backend() -> None:
    """Experiments draw to files; never ask for a screen."""
    import matplotlib

    matplotlib.use("Agg")
