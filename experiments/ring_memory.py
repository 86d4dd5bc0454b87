"""Ring attention's memory per device against the blockwise path on one device.

Question: does splitting the sequence over P devices divide what each device holds by
P? Setup: causal self-attention, B=1, H=8, D=64, float32, forward+backward (one fixed
random output gradient), ring attention over P forced host devices (default 4) against
`attention(implementation="blockwise")` on one device. Memory is XLA's own account of
each compiled program (`memory_analysis()`: temporaries, arguments and outputs, per
device); time is the median of `--repeats` calls, taken only where `--time-up-to`
allows (on one CPU the P "devices" share the same cores, so the time is no speed-up).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m experiments.ring_memory

(the command sets the flag itself when it is missing). Writes
`results/ring_memory/ring_memory.json` and prints a table.
"""

from __future__ import annotations

import os
import sys

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    devices = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--devices=")), "4")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from experiments import common  # noqa: E402
from jax_mha import attention  # noqa: E402
from jax_mha.parallel import ring_attention  # noqa: E402

MIB = 2**20


def _lengths(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"lengths must be comma-separated ints, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"lengths must be positive, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.ring_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=_lengths, default=[16384, 65536], help="sequence lengths N (default 16384,65536)")
    p.add_argument("--devices", type=int, default=4, help="forced host devices on the ring (default 4)")
    p.add_argument("--time-up-to", type=int, default=16384, help="time only N up to this (default 16384; 0: none)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per row (default 3)")
    p.add_argument("--out", type=Path, default=Path("results/ring_memory"), help="output folder")
    return p


def _program(loss, *args):
    """The compiled forward+backward and XLA's per-device memory account in MiB."""
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    m = compiled.memory_analysis()
    memory = {"temp_mib": m.temp_size_in_bytes / MIB, "argument_mib": m.argument_size_in_bytes / MIB,
              "output_mib": m.output_size_in_bytes / MIB}
    return compiled, memory


def _time(compiled, args, repeats: int) -> float:
    jax.block_until_ready(compiled(*args))  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.devices < 1 or len(jax.devices()) < args.devices:
        build_parser().error(f"--devices={args.devices}: {len(jax.devices())} devices available")
    mesh = jax.make_mesh((args.devices,), ("sequence",))
    seq = NamedSharding(mesh, PartitionSpec(None, None, "sequence", None))
    rows = []
    for n in args.lengths:
        shape = (1, 8, n, 64)
        keys = jax.random.split(jax.random.key(n), 4)
        q, k, v, g = (jax.random.normal(key, shape) for key in keys)
        ring = lambda q, k, v: (ring_attention(q, k, v, mesh=mesh, is_causal=True) * g).sum()  # noqa: B023
        blockwise = lambda q, k, v: (attention(q, k, v, is_causal=True, implementation="blockwise") * g).sum()  # noqa: B023
        on_ring = [jax.device_put(x, seq) for x in (q, k, v)]
        for name, loss, inputs in (("ring", ring, on_ring), ("blockwise, one device", blockwise, (q, k, v))):
            compiled, memory = _program(loss, *inputs)
            timed = args.time_up_to and n <= args.time_up_to
            ms = _time(compiled, inputs, args.repeats) if timed else None
            rows.append({"n": n, "path": name, "devices": args.devices if name == "ring" else 1, **memory, "ms": ms})
            print(f"N={n:>6}  {name:<22} temp {memory['temp_mib']:9.1f} MiB/device  "
                  f"args {memory['argument_mib']:7.1f} MiB  " + (f"{ms:9.0f} ms" if ms else "   not timed"), flush=True)
    result = {"rows": rows, "config": {"B": 1, "H": 8, "D": 64, "causal": True, "dtype": "float32",
                                       "devices": args.devices, "repeats": args.repeats},
              "metadata": common.run_metadata()}
    common.write_json(args.out / "ring_memory.json", result)
    print(f"wrote {args.out / 'ring_memory.json'}")


if __name__ == "__main__":
    main()
