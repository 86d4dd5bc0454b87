"""The table of docs/accelerators.md, generated from the paths' own `refusal` functions
and `_dispatch.choose`: for representative calls, which path `implementation="auto"`
takes on each platform and what each kernel says about the call.

    python -m experiments.accelerator_table            # prints the table
    python -m experiments.accelerator_table --write    # replaces it in docs/accelerators.md

Nothing runs: each call is a description (`Visibility`) and shape structs (`Call`), at a
training shape (B=8, H=16, N=S=4096, D=128, bfloat16) unless its row says otherwise.
The `pallas_mgpu` column reads that kernel's own rules (`pallas_mgpu.kernel_refusal`):
its machine check refuses every call where no Hopper GPU and CUDA plugin are present,
which says nothing about the call. It is named only, never in a platform's `auto` chain.
tests/studies/test_accelerator_table.py checks that the page holds exactly this output.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jax_mha import _dispatch, _masking
from jax_mha.paths import pallas_mgpu

PAGE = Path(__file__).resolve().parents[1] / "docs" / "accelerators.md"
BEGIN, END = "<!-- accelerator_table: begin -->", "<!-- accelerator_table: end -->"
SHAPE = dict(b=8, h=16, k=16, n=4096, s=4096, d=128, dtype="bfloat16")
# (platform, the kernels asked there) in the order of the table's columns.
PLATFORMS = (("gpu", ("cudnn", "pallas_gpu", "pallas_mgpu")), ("tpu", ("pallas_tpu",)), ("cpu", ()))
# Paths whose column reads a refusal other than the dispatcher's (see the docstring).
RULES = {"pallas_mgpu": pallas_mgpu.kernel_refusal}
# (row label, Visibility parts, Call parts, shape changes)
CASES = [
    ("causal", dict(is_causal=True), {}, {}),
    ("float32, causal", dict(is_causal=True), {}, dict(dtype="float32")),
    ("float16, causal", dict(is_causal=True), {}, dict(dtype="float16")),
    ("float16, GQA (K = H/4), N=1000, S=4000, no mask", {}, {}, dict(dtype="float16", k=4, n=1000, s=4000)),
    ("window left-only (128, 0)", dict(window=(128, 0)), {}, {}),
    ("causal + window (128, None)", dict(is_causal=True, window=(128, None)), {}, {}),
    ("window both sides (128, 128)", dict(window=(128, 128)), {}, {}),
    ("causal + q/kv lengths", dict(is_causal=True, lengths=True), {}, {}),
    ("causal + window (128, 0) + q/kv lengths", dict(is_causal=True, window=(128, 0), lengths=True), {}, {}),
    ("causal + segment ids (packed)", dict(is_causal=True, segments=True), {}, {}),
    ("causal + segment ids, B=1 H=4 N=S=512", dict(is_causal=True, segments=True), {}, dict(b=1, h=4, k=4, n=512, s=512)),
    ("GQA (K = H/4), causal", dict(is_causal=True), {}, dict(k=4)),
    ("N != S (N=1024, S=4096), causal", dict(is_causal=True), {}, dict(n=1024)),
    ("N != S (N=1024, S=4096), no mask", {}, {}, dict(n=1024)),
    ("dense boolean mask", dict(mask=True), {}, {}),
    ("bias", dict(bias=True), {}, {}),
    ("score_mod", dict(score_mod=lambda s, b, h, i, j: s), {}, {}),
    ("mask_mod", dict(mask_mod=lambda b, h, i, j: j <= i), {}, {}),
    ("mask_mod, B=1 H=4 N=S=512", dict(mask_mod=lambda b, h, i, j: j <= i), {}, dict(b=1, h=4, k=4, n=512, s=512)),
    ("logits soft-cap 30", dict(logits_soft_cap=30.0), {}, {}),
    ("sinks", dict(sinks=True), {}, {}),
    ("return_residual (log-sum-exp)", dict(is_causal=True), dict(return_residual=True), {}),
    ("return_weights", dict(is_causal=True), dict(return_weights=True), {}),
    ("decode step: N=1 at offset 4000, causal + window (128, None) + q/kv lengths",
     dict(is_causal=True, window=(128, None), lengths=True, q_offset=4000), {}, dict(n=1)),
]


def describe_case(vis_parts: dict, call_parts: dict, changes: dict, platform: str):
    """`(Visibility, Call)` for one row on one platform; arrays are tiny stand-ins
    where only their presence matters, real where the kernels read them (segment ids)."""
    sh = {**SHAPE, **changes}
    b, h, k, n, s, d = (sh[x] for x in "bhknsd")
    parts = dict(vis_parts)
    if "window" in parts:
        parts["window"] = _masking.canonical_window(parts["window"])
    if parts.pop("lengths", False):
        parts.update(q_lengths=jnp.full((b, 1, 1, 1), n, jnp.int32), kv_lengths=jnp.full((b, 1, 1, 1), s, jnp.int32))
    if parts.pop("segments", False):
        ids = np.repeat(np.arange(8), -(-n // 8))[:n].astype(np.int32)
        q_ids, kv_ids = _masking.segments_at_rank(np.broadcast_to(ids, (b, n)), np.broadcast_to(ids, (b, s)), 1)
        parts.update(q_segment_ids=q_ids, kv_segment_ids=kv_ids, segments_shared=True)
    for name, value in (("mask", jnp.ones((1, 1, 1, 1), bool)), ("bias", jnp.zeros((1, 1, 1, 1), jnp.float32)),
                        ("sinks", jnp.zeros((h,), jnp.float32))):
        if parts.get(name) is True:
            parts[name] = value
    vis = _masking.Visibility(n, s, batch_shape=(b,), num_heads=h, **parts)
    dtype = jnp.dtype(sh["dtype"])
    q = jax.ShapeDtypeStruct((b, h, n, d), dtype)
    kv = jax.ShapeDtypeStruct((b, k, s, d), dtype)
    return vis, _masking.Call(q, kv, kv, platform=platform, **call_parts)


def short(why: str) -> str:
    """A refusal without its path name and its advice, for a footnote."""
    why = re.sub(r"^implementation='\w+' ", "", why)
    return re.split(r"; (use|'pallas_tpu')", why)[0].replace("|", "/")


def table() -> str:
    """The markdown table and its numbered notes (one per distinct refusal)."""
    notes: dict[str, int] = {}

    def cell(path: str, vis, call) -> str:
        why = RULES[path](vis, call) if path in RULES else _dispatch.refusal(path, vis, call)
        if why is None:
            return "runs"
        number = notes.setdefault(short(why), len(notes) + 1)
        return f"refused [{number}]"

    kernels = [(platform, path) for platform, paths in PLATFORMS for path in paths]
    head = ["case"] + [f"{p.upper()} `auto`" for p, _ in PLATFORMS] + [f"`{path}`" for _, path in kernels]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, vis_parts, call_parts, changes in CASES:
        row = [label]
        for platform, _ in PLATFORMS:
            vis, call = describe_case(vis_parts, call_parts, changes, platform)
            row.append(f"`{_dispatch.choose(vis, call, 'auto')}`")
        for platform, path in kernels:
            row.append(cell(path, *describe_case(vis_parts, call_parts, changes, platform)))
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines += [f"{number}. {why}" for why, number in notes.items()]
    return "\n".join(lines) + "\n"


def replace_in_page(text: str, generated: str) -> str:
    """`text` with the part between `BEGIN` and `END` replaced by `generated`.

    Raises:
      ValueError: when the page lacks either marker.
    """
    if BEGIN not in text or END not in text:
        raise ValueError(f"the page has no {BEGIN} ... {END} block to replace")
    before, rest = text.split(BEGIN, 1)
    return before + BEGIN + "\n" + generated + END + rest.split(END, 1)[1]


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(prog="python -m experiments.accelerator_table", description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help=f"replace the table in {PAGE.relative_to(PAGE.parents[1])}")
    args = p.parse_args(argv)
    generated = table()
    if args.write:
        PAGE.write_text(replace_in_page(PAGE.read_text(encoding="utf-8"), generated), encoding="utf-8")
        print(f"wrote the table into {PAGE}")
    else:
        print(generated, end="")
    return generated


if __name__ == "__main__":
    main(sys.argv[1:])
