"""Ring or Ulysses: bytes each device sends, and its memory, per attention layer.

Question: for the same sequence split over P devices, how much does each device send
per layer, and hold, with ring attention (`jax_mha.parallel.ring`: key/value blocks passed
around a ring) and with Ulysses (`jax_mha.parallel.ulysses`: all-to-all from the sequence
split to a head split and back)? Setup: self-attention, B=1, H=8, D=64, float32,
causal, forward+backward (the value of `(out * g).sum()` and its gradient to q, k, v), P forced host
devices (default 4); both run blockwise inside (the ring its own tiles, Ulysses
`implementation="blockwise"` on each device's heads). Nothing is run: the numbers are
read from the compiled programs.

How the bytes are counted: every collective instruction of the compiled (per-device,
SPMD-partitioned) HLO text, times the trip count of the while loops around it (XLA's
`known_trip_count`; a collective inside a conditional branch counts as if the branch
always runs). The operand bytes of one instruction come from its result shape (equal
to the operand for all-to-all, collective-permute and all-reduce; P times it for
all-gather). "Sent" is what leaves a device under the usual algorithms: an
all-to-all keeps 1/P of its operand and sends the rest, a collective-permute sends
its whole operand, an all-gather sends its operand to P - 1 devices, an all-reduce
2(P-1)/P of it (ring all-reduce). Memory is XLA's account of the compiled program
(`memory_analysis()`, per device): temporaries, arguments, outputs, and their sum
less the aliased bytes as the peak.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m experiments.sequence_parallel_bytes
    python -m experiments.sequence_parallel_bytes --smoke          # small sizes, seconds

(the command sets the flag itself when it is missing). Prints a table and writes
`results/sequence_parallel_bytes/sequence_parallel_bytes.json` (or `--out`).
"""

from __future__ import annotations

import os
import sys

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    devices = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--devices=")), "4")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}")

import argparse  # noqa: E402
import re  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from experiments import common  # noqa: E402
from jax_mha.parallel import ring_attention, ulysses_attention  # noqa: E402

MIB = 2**20
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
               "f64": 8, "s64": 8, "u64": 8}
COLLECTIVES = ("all-to-all", "collective-permute", "all-gather", "all-reduce", "reduce-scatter")
SMOKE = dict(seq_len=256, heads=8, head_dim=16)
_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) ")
_CALLS = re.compile(r"(body|condition|calls|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_OP = re.compile(r"=\s*(.+?)\s+(" + "|".join(COLLECTIVES) + r")(-done)?\(")
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """`({computation name: its instruction lines}, the entry's name)`."""
    comps, entry, name = {}, None, None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header and line.rstrip().endswith("{"):
            name = header.group(2)
            comps[name] = []
            entry = name if header.group(1) else entry
        elif name is not None and line.startswith("  "):
            comps[name].append(line)
    return comps, entry


def _multipliers(comps: dict[str, list[str]], entry: str) -> dict[str, int]:
    """How many times each computation runs per call of the entry: the product of the
    trip counts of the while loops on the way down (a branch: as if always taken)."""
    callers = defaultdict(list)  # callee -> [(caller, factor)]
    for caller, lines in comps.items():
        for line in lines:
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
            for kind, callee in _CALLS.findall(line):
                callers[callee].append((caller, int(trips.group(1)) if kind == "body" and trips else 1))
            for group in _BRANCHES.findall(line):
                for callee in re.findall(r"%([\w.\-]+)", group):
                    callers[callee].append((caller, 1))
    memo = {entry: 1}

    def times(name: str) -> int:
        if name not in memo:
            memo[name] = 0  # a cycle cannot happen in HLO; guards the recursion anyway
            memo[name] = sum(times(caller) * factor for caller, factor in callers.get(name, ()))
        return memo[name]

    return {name: times(name) for name in comps}


def _group_size(line: str, devices: int) -> int:
    groups = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if groups:
        return len(groups.group(1).split(","))
    iota = re.search(r"replica_groups=\[\d+,(\d+)\]", line)
    return int(iota.group(1)) if iota else devices


def _bytes(type_text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(type_text):
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        total += count * DTYPE_BYTES.get(dtype, 4)
    return total


def collective_bytes(hlo: str, devices: int) -> dict:
    """Per collective kind: instructions in the text, executions per call, operand
    bytes and bytes sent per device (see the module docstring for the counting)."""
    comps, entry = _computations(hlo)
    runs = _multipliers(comps, entry)
    out = {kind: {"instructions": 0, "executions": 0, "operand_bytes": 0, "sent_bytes": 0.0} for kind in COLLECTIVES}
    for name, lines in comps.items():
        for line in lines:
            op = _OP.search(line)
            if op is None or (op.group(2) + "-start(") in line:
                continue
            kind, p, result = op.group(2), _group_size(line, devices), _bytes(op.group(1))
            operand = {"all-gather": result // p, "reduce-scatter": result * p}.get(kind, result)
            sent = {"all-to-all": operand * (p - 1) / p, "collective-permute": operand,
                    "all-gather": operand * (p - 1), "all-reduce": 2 * operand * (p - 1) / p,
                    "reduce-scatter": result * (p - 1)}[kind]
            row = out[kind]
            row["instructions"] += 1
            row["executions"] += runs[name]
            row["operand_bytes"] += runs[name] * operand
            row["sent_bytes"] += runs[name] * sent
    return out


def measure(path: str, mesh, n: int, heads: int, head_dim: int) -> dict:
    """Compiles one forward+backward of `path` ("ring" or "ulysses") and returns its
    collectives and memory per device."""
    devices = mesh.shape["sequence"]
    seq = NamedSharding(mesh, PartitionSpec(None, None, "sequence", None))
    x = jax.ShapeDtypeStruct((1, heads, n, head_dim), jnp.float32, sharding=seq)
    if path == "ring":
        attend = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, is_causal=True)
    else:
        attend = lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh, is_causal=True, implementation="blockwise")
    loss = lambda q, k, v, g: (attend(q, k, v) * g).sum()
    # value_and_grad, not grad: the loss keeps the forward output live, as a training step does.
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(x, x, x, x).compile()
    m = compiled.memory_analysis()
    memory = {"temp_bytes": m.temp_size_in_bytes, "argument_bytes": m.argument_size_in_bytes,
              "output_bytes": m.output_size_in_bytes, "alias_bytes": m.alias_size_in_bytes}
    memory["peak_bytes"] = memory["temp_bytes"] + memory["argument_bytes"] + memory["output_bytes"] - memory[
        "alias_bytes"]
    collectives = collective_bytes(compiled.as_text(), devices)
    sent = sum(row["sent_bytes"] for row in collectives.values())
    operand = sum(row["operand_bytes"] for row in collectives.values())
    return {"path": path, "devices": devices, "n": n, "heads": heads, "head_dim": head_dim, "memory": memory,
            "collectives": collectives, "sent_bytes": sent, "operand_bytes": operand}


def table(rows: list[dict]) -> str:
    """The printed table: MiB per device."""
    lines = ["| path | collectives (executions per call) | operand MiB | sent MiB / device | peak MiB / device "
             "| temporaries MiB |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        kinds = ", ".join(f"{row['executions']} {kind}" for kind, row in r["collectives"].items() if row["executions"])
        lines.append(f"| {r['path']} | {kinds} | {r['operand_bytes'] / MIB:.1f} | {r['sent_bytes'] / MIB:.1f} | "
                     f"{r['memory']['peak_bytes'] / MIB:.1f} | {r['memory']['temp_bytes'] / MIB:.1f} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.sequence_parallel_bytes",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=common.positive_int, default=16384, help="sequence length N (default 16384)")
    p.add_argument("--heads", type=common.positive_int, default=8, help="heads H (default 8)")
    p.add_argument("--head-dim", type=common.positive_int, default=64, help="head size D (default 64)")
    p.add_argument("--devices", type=common.positive_int, default=4, help="forced host devices P (default 4)")
    p.add_argument("--smoke", action="store_true", help="small sizes (N=256, D=16): checks the script in seconds")
    p.add_argument("--out", type=Path, default=Path("results/sequence_parallel_bytes"), help="output folder")
    return p


def main(argv=None) -> dict:
    p = build_parser()
    args = p.parse_args(argv)
    if len(jax.devices()) < args.devices:
        p.error(f"--devices={args.devices}: {len(jax.devices())} devices available (set XLA_FLAGS="
                f"--xla_force_host_platform_device_count={args.devices} before Python starts)")
    sizes = SMOKE if args.smoke else dict(seq_len=args.seq_len, heads=args.heads, head_dim=args.head_dim)
    if sizes["seq_len"] % (args.devices * args.devices) or sizes["heads"] % args.devices:
        p.error(f"--seq-len={sizes['seq_len']} must be a multiple of P² = {args.devices ** 2} (the ring's causal "
                f"layout) and --heads={sizes['heads']} of P = {args.devices} (Ulysses)")
    mesh = jax.make_mesh((args.devices,), ("sequence",), devices=jax.devices()[:args.devices])
    rows = [measure(path, mesh, sizes["seq_len"], sizes["heads"], sizes["head_dim"]) for path in ("ring", "ulysses")]
    print(f"causal self-attention, forward+backward, B=1, H={sizes['heads']}, N={sizes['seq_len']}, "
          f"D={sizes['head_dim']}, float32, P={args.devices}")
    print(table(rows))
    result = {"rows": rows, "config": {"B": 1, **sizes, "causal": True, "dtype": "float32", "devices": args.devices,
                                       "smoke": args.smoke}, "metadata": common.run_metadata()}
    common.write_json(args.out / "sequence_parallel_bytes.json", result)
    print(f"wrote {args.out / 'sequence_parallel_bytes.json'}")
    return result


if __name__ == "__main__":
    main()
