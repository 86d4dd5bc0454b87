"""The tables of the accelerator results (docs/results/gpu_kernels.md,
docs/results/composed_attention.md), rendered from committed data by
`experiments.report`. Kinds:

- `device_tests`: `pytest -m device` on one device (`experiments.report` reads the
  outcome per test); block `table`.
- `device_benchmark`: `experiments.device_benchmark` (one preset on one device); blocks
  `table` (milliseconds per path and case), `tflops` (forward+backward TFLOP/s) and
  `versus_jax_nn` (each jax_mha kernel's time over jax.nn's cuDNN call, causal cases).
- `device_benchmark_flex`: `experiments.device_benchmark --preset flex` (composed
  attention: mods, windows, sinks, against FlexAttention); blocks `table` (median
  milliseconds and the min–max of the repeats per case and implementation),
  `tflops` (forward+backward TFLOP/s), `versus_cudnn` (time over jax.nn's cuDNN plain
  causal call at the same size), `refusals` (why an implementation did not run) and
  `targets` (the engine over the kernel, the kernel over FlexAttention, each against
  its target).
- `pallas_gpu_blocks`: `experiments.pallas_gpu_blocks` (block pairs, or `--launch`:
  warps and stages); block `table`.
- `engine_blocks`: `experiments.engine_blocks`; block `table`.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import Callable

PASSES = ("forward", "forward_backward")


def _cases(data: dict, mask: str) -> list[tuple[int, int]]:
    """(N, D) of every case of `mask`, in the order measured."""
    seen = []
    for row in data["rows"]:
        key = (row["seq"], row["head_dim"])
        if row["mask"] == mask and key not in seen:
            seen.append(key)
    return seen


def _row(data: dict, impl: str, mask: str, n: int, d: int) -> dict | None:
    return next((r for r in data["rows"] if (r["impl"], r["mask"], r["seq"], r["head_dim"]) == (impl, mask, n, d)),
                None)


def _impls(data: dict) -> tuple[list[str], list[str]]:
    """(implementations with a timing somewhere, those refused or skipped everywhere)."""
    names = list(dict.fromkeys(r["impl"] for r in data["rows"]))
    timed = [n for n in names if any("ms" in r[p] for r in data["rows"] if r["impl"] == n for p in PASSES)]
    return timed, [n for n in names if n not in timed]


def _why_not(data: dict, impl: str) -> str:
    """The first reason an implementation gave for not running."""
    for row in data["rows"]:
        if row["impl"] == impl:
            kind = next(iter(row["forward"]))
            return f"{kind}: {row['forward'][kind]}"
    return ""


def _cell(row: dict | None, fmt: Callable[[dict], str]) -> str:
    if row is None:
        return "–"
    parts = []
    for name in PASSES:
        r = row[name]
        parts.append(fmt(r) if "ms" in r else next(iter(r)))
    return " / ".join(parts)


def _auto(data: dict, mask: str, n: int, d: int) -> str:
    return next((a["chosen"] for a in data["auto"] if (a["mask"], a["seq"], a["head_dim"]) == (mask, n, d)), "–")


def _grid_line(data: dict) -> str:
    grid = data["grid"]
    return (f"{data['device']}, B={max(grid['batch'])}, H={max(grid['heads'])}, {grid['dtype'][0]}, median of "
            f"{grid['repeats']} timed calls after a compiling one; "
            + ("every case measured" if not data["stopped_early"] else "stopped early by its budget"))


def benchmark_table(data: dict) -> str:
    """Milliseconds, forward / forward+backward, per mask, (N, D) and path."""
    timed, untimed = _impls(data)
    lines = [f"{_grid_line(data)}. Cells: forward / forward+backward, ms.", ""]
    for mask in dict.fromkeys(r["mask"] for r in data["rows"]):
        label = "causal" if mask == "causal" else f"causal, {data['docs_per_row']} packed documents"
        lines += [f"**{label}**", "", "| N | D | `auto` takes | " + " | ".join(f"`{n}`" for n in timed) + " |",
                  "|---:|---:|---|" + "---|" * len(timed)]
        for n, d in _cases(data, mask):
            cells = [_cell(_row(data, impl, mask, n, d), lambda r: f"{r['ms']:.2f}") for impl in timed]
            lines.append(f"| {n} | {d} | `{_auto(data, mask, n, d)}` | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [f"Not run: `{impl}` ({_why_not(data, impl)})." for impl in untimed]
    return "\n".join(lines).rstrip()


def benchmark_tflops(data: dict) -> str:
    """Forward+backward TFLOP/s (visible pairs only) and % of the spec peak, causal."""
    timed, _ = _impls(data)
    peak = data.get("peak_bf16_tflops")
    lines = ["Forward+backward, causal: TFLOP/s counting visible pairs only"
             + (f" (% of the {peak:g} TFLOP/s dense bfloat16 spec peak)." if peak else "."), "",
             "| N | D | " + " | ".join(f"`{n}`" for n in timed) + " |", "|---:|---:|" + "---|" * len(timed)]
    for n, d in _cases(data, "causal"):
        cells = []
        for impl in timed:
            row = _row(data, impl, "causal", n, d)
            r = None if row is None else row["forward_backward"]
            cells.append("–" if r is None else next(iter(r)) if "tflops" not in r else
                         f"{r['tflops']:.0f}" + (f" ({r['peak_pct']:.0f} %)" if r.get("peak_pct") is not None else ""))
        lines.append(f"| {n} | {d} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def benchmark_versus_jax_nn(data: dict) -> str:
    """Each jax_mha path's time over `jax.nn.dot_product_attention(implementation=
    "cudnn")` on the same case (packed documents: jax.nn given the dense mask); 1.00 is
    as fast as jax.nn's own call."""
    ours = [n for n in _impls(data)[0] if n.startswith("jax_mha:")]
    lines = [f"Time over jax.nn's cuDNN call ({data['device']}): forward / forward+backward.", "",
             "| mask | N | D | " + " | ".join(f"`{n}`" for n in ours) + " |", "|---|---:|---:|" + "---|" * len(ours)]
    for mask in dict.fromkeys(r["mask"] for r in data["rows"]):
        for n, d in _cases(data, mask):
            base = _row(data, "jax.nn:cudnn", mask, n, d)
            cells = [_ratio_cell(_row(data, impl, mask, n, d), base) for impl in ours]
            lines.append(f"| {mask} | {n} | {d} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratio_cell(row, base) -> str:
    """`"forward / forward+backward"` time of `row` over `base` ("–" where either lacks one)."""
    pair = [row[p]["ms"] / base[p]["ms"] if row and base and "ms" in row[p] and "ms" in base[p] else None
            for p in PASSES]
    return " / ".join("–" if x is None else f"{x:.2f}" for x in pair)


def _flex_sizes(data: dict) -> list[tuple[int, int]]:
    """(N, D) of a flex run, in the order measured."""
    return list(dict.fromkeys((r["seq"], r["head_dim"]) for r in data["rows"]))


def _flex_row(data: dict, impl: str, case: str, n: int, d: int) -> dict | None:
    return next((r for r in data["rows"] if (r["impl"], r["case"], r["seq"], r["head_dim"]) == (impl, case, n, d)),
                None)


def _flex_columns(data: dict) -> list[str]:
    """The implementations timed somewhere, jax.nn's cuDNN reference last."""
    timed = _impls(data)[0]
    return [n for n in timed if n != "jax.nn:cudnn"] + [n for n in timed if n == "jax.nn:cudnn"]


def _flex_head(data: dict) -> str:
    grid = data["grid"]
    torch = f"torch {data['torch']}" if data.get("torch") else "no torch"
    return (f"{data['device']}, B={grid['batch']}, H={grid['heads']}, {grid['dtype']}, {torch}; median of "
            f"{grid['repeats']} timed calls after a compiling one, round-robin over a case's implementations; "
            + ("every case measured" if not data["stopped_early"] else "stopped early by its budget"))


def _flex_untimed(cell: dict) -> str:
    return next(iter(cell))


def flex_table(data: dict) -> str:
    """Median ms [min–max], forward / forward+backward, per size, case and implementation."""
    columns = _flex_columns(data)
    lines = [f"{_flex_head(data)}. Cells: forward / forward+backward, median ms [min–max]; jax.nn's cuDNN call "
             "runs plain causal attention, the reference of every case.", ""]
    spread = lambda r: f"{r['ms']:.2f} [{r['ms_min']:.2f}–{r['ms_max']:.2f}]"
    for n, d in _flex_sizes(data):
        lines += [f"**N = {n}, D = {d}**", "", "| case | " + " | ".join(f"`{c}`" for c in columns) + " |",
                  "|---|" + "---|" * len(columns)]
        for case in data["cases"]:
            cells = [_cell(_flex_row(data, impl, case, n, d), spread) for impl in columns]
            lines.append(f"| {case} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines).rstrip()


def flex_tflops(data: dict) -> str:
    """Forward+backward TFLOP/s over the visible pairs of each case (% of the spec peak)."""
    columns, peak = _flex_columns(data), data.get("peak_bf16_tflops")
    lines = ["Forward+backward TFLOP/s, counting each case's visible pairs only"
             + (f" (% of the {peak:g} TFLOP/s dense bfloat16 spec peak)." if peak else "."), "",
             "| case | N | D | visible pairs per head | " + " | ".join(f"`{c}`" for c in columns) + " |",
             "|---|---:|---:|---:|" + "---|" * len(columns)]
    for n, d in _flex_sizes(data):
        for case in data["cases"]:
            pairs, cells = None, []
            for impl in columns:
                row = _flex_row(data, impl, case, n, d)
                pairs = row["visible_pairs"] if row is not None else pairs
                r = None if row is None else row["forward_backward"]
                rate = None if r is None or "tflops" not in r else f"{r['tflops']:.0f}" if r["tflops"] >= 10 else (
                    f"{r['tflops']:.2g}")
                cells.append("–" if r is None else _flex_untimed(r) if rate is None else
                             rate + (f" ({r['peak_pct']:.0f} %)" if r.get("peak_pct") is not None else ""))
            lines.append(f"| {case} | {n} | {d} | {pairs:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def flex_versus_cudnn(data: dict) -> str:
    """Each implementation's median time over jax.nn's cuDNN plain causal call at the same
    (N, D): what the composition costs next to the plain kernel (the window and the
    documents see fewer pairs, so below 1.00 is possible)."""
    columns = [c for c in _flex_columns(data) if c != "jax.nn:cudnn"]
    lines = [f"Time over jax.nn's cuDNN plain causal call ({data['device']}): forward / forward+backward.", "",
             "| case | N | D | " + " | ".join(f"`{c}`" for c in columns) + " |", "|---|---:|---:|" + "---|" * len(columns)]
    for n, d in _flex_sizes(data):
        base = _flex_row(data, "jax.nn:cudnn", "causal", n, d)
        for case in data["cases"]:
            cells = [_ratio_cell(_flex_row(data, impl, case, n, d), base) for impl in columns]
            lines.append(f"| {case} | {n} | {d} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def flex_refusals(data: dict) -> str:
    """Why an implementation did not run a case: each distinct reason once, with its cases."""
    reasons: dict[tuple[str, str], list[str]] = {}
    for row in data["rows"]:
        for p in PASSES:
            cell = row[p]
            if "ms" not in cell:
                kind = _flex_untimed(cell)
                cases = reasons.setdefault((row["impl"], f"{kind}: {cell[kind]}"), [])
                if row["case"] not in cases:
                    cases.append(row["case"])
    if not reasons:
        return "Every implementation ran every case."
    return "\n".join(f"- `{impl}`, {', '.join(cases)}: {why}" for (impl, why), cases in reasons.items())


ENGINE_TARGET, TORCH_TARGET = 4.0, 1.25  # issue targets: the kernel ≥ 4x the engine, ≤ 1.25x FlexAttention


def flex_targets(data: dict) -> str:
    """Per composed case and size, forward+backward: the blockwise engine's time over the
    kernel's (target ≥ `ENGINE_TARGET`) and the kernel's over FlexAttention's (target
    ≤ `TORCH_TARGET`), each marked met or not; the counts below the table."""
    lines = [f"Forward+backward, {data['device']}: the engine's median time over the kernel's (target ≥ "
             f"{ENGINE_TARGET:g}) and the kernel's over FlexAttention's (target ≤ {TORCH_TARGET:g}).", "",
             "| case | N | D | `jax_mha:pallas_gpu` ms | engine / kernel | kernel / FlexAttention |",
             "|---|---:|---:|---:|---:|---:|"]
    met = {"engine": [0, 0], "torch": [0, 0]}

    def ratio(num, den, target, key, at_least):
        if num is None or den is None:
            return "–"
        value = num / den
        ok = value >= target if at_least else value <= target
        met[key][0] += ok
        met[key][1] += 1
        return f"{value:.2f} " + ("met" if ok else "**not met**")

    ms = lambda row: None if row is None or "ms" not in row["forward_backward"] else row["forward_backward"]["ms"]
    for n, d in _flex_sizes(data):
        for case in data["cases"]:
            kernel = ms(_flex_row(data, "jax_mha:pallas_gpu", case, n, d))
            if case == "causal" or kernel is None:
                continue
            engine, torch = ms(_flex_row(data, "jax_mha:blockwise", case, n, d)), ms(
                _flex_row(data, "torch:flex", case, n, d))
            lines.append(f"| {case} | {n} | {d} | {kernel:.2f} | {ratio(engine, kernel, ENGINE_TARGET, 'engine', True)}"
                         f" | {ratio(kernel, torch, TORCH_TARGET, 'torch', False)} |")
    lines += ["", f"Engine target met in {met['engine'][0]} of {met['engine'][1]} composed measurements; "
              f"FlexAttention target in {met['torch'][0]} of {met['torch'][1]} (a case FlexAttention did not run "
              "has no ratio)."]
    return "\n".join(lines)


def engine_blocks_table(data: dict) -> str:
    """Forward+backward ms per (query, key) block pair of the blockwise engine, causal and
    unmasked; the fastest of each marked, and the pair `default_blocks` picks named."""
    lines = [f"{data['device']}: the blockwise engine forward+backward, B={data['batch']}, H={data['heads']}, "
             f"N=S={data['seq']}, D={data['head_dim']}, {data['dtype']}; median of the timed calls [min–max]. "
             f"Defaults when the sweep ran: causal {tuple(data['defaults']['causal'])}, unmasked "
             f"{tuple(data['defaults']['unmasked'])}" + (" (stopped by its budget)." if data.get("stopped_early")
                                                         else "."),
             "", "| mask | q_block | k_block | ms |", "|---|---:|---:|---:|"]
    for causal in (True, False):
        rows = [r for r in data["rows"] if r["causal"] == causal]
        best = min((r for r in rows if "ms" in r), key=lambda r: r["ms"], default=None)
        for r in rows:
            cell = r.get("error") or (f"{r['ms']:.1f} [{r['ms_min']:.1f}–{r['ms_max']:.1f}]")
            cell = f"**{cell}**" if r is best else cell
            lines.append(f"| {'causal' if causal else 'unmasked'} | {r['q_block']} | {r['k_block']} | {cell} |")
    return "\n".join(lines)


def device_tests_table(data: dict) -> str:
    """One line per test that ran (not skipped on this device), its outcome and time."""
    ran = [t for t in data["tests"] if t["outcome"] != "skipped"]
    passed = sum(t["outcome"] == "passed" for t in ran)
    lines = [f"`pytest -m device` on {data['device']} ({data['versions']}): {passed} of {len(ran)} passed; "
             f"{len(data['tests']) - len(ran)} skipped (other platforms' kernels).", "",
             "| test | outcome | s |", "|---|---|---:|"]
    lines += [f"| `{t['name']}` | {t['outcome']} | {t['seconds']:.1f} |" for t in ran]
    return "\n".join(lines)


def blocks_table(data: dict) -> str:
    """Forward+backward ms per pair of blocks (the library kernel's `q_block, k_block`,
    or the former wrapped kernel's backward `outer, inner`); the fastest per D marked."""
    a, b = ("q_block", "k_block") if "q_block" in data["rows"][0] else ("outer", "inner")
    launch = "num_warps" in data["rows"][0]
    extra = " num_warps | num_stages |" if launch else ""
    lines = [f"{data['device']}: causal forward+backward, B={data['batch']}, H={data['heads']}, "
             f"N=S={data['seq']}, {data['dtype']}; gradient error relative to the largest gradient of the "
             "float32 blockwise engine.", "", f"| D | {a} | {b} |{extra} ms | error |",
             "|---:|---:|---:|" + ("---:|---:|" if launch else "") + "---:|---:|"]
    key = lambda r: f"| {r['head_dim']} | {r[a]} | {r[b]} |" + (f" {r['num_warps']} | {r['num_stages']} |" if launch
                                                                  else "")
    for d in dict.fromkeys(r["head_dim"] for r in data["rows"]):
        rows = [r for r in data["rows"] if r["head_dim"] == d]
        best = min((r for r in rows if "ms" in r), key=lambda r: r["ms"], default=None)
        for r in rows:
            if "ms" not in r:
                lines.append(f"{key(r)} {r['error']} | – |")
                continue
            ms = f"**{r['ms']:.2f}**" if r is best else f"{r['ms']:.2f}"
            lines.append(f"{key(r)} {ms} | {r['relative_error']:.1e} |")
    return "\n".join(lines)


def device_tests_from_junit(xml_text: str, device: str, versions: str) -> dict:
    """A `device_tests` data file from pytest's `--junitxml` report: each test's name,
    outcome (passed, failed, error, skipped) and seconds."""
    tests = []
    for case in ET.fromstring(xml_text).iter("testcase"):
        outcome = next((o for o in ("failure", "error", "skipped") if case.find(o) is not None), "passed")
        tests.append(dict(name=f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}",
                          outcome={"failure": "failed"}.get(outcome, outcome), seconds=float(case.get("time", 0))))
    return dict(kind="device_tests", device=device, versions=versions, tests=tests)


RENDERERS: dict[str, dict[str, Callable[[dict], str]]] = {
    "device_tests": {"table": device_tests_table},
    "device_benchmark": {"table": benchmark_table, "tflops": benchmark_tflops,
                         "versus_jax_nn": benchmark_versus_jax_nn},
    "device_benchmark_flex": {"table": flex_table, "tflops": flex_tflops, "versus_cudnn": flex_versus_cudnn,
                              "refusals": flex_refusals, "targets": flex_targets},
    "pallas_gpu_blocks": {"table": blocks_table},
    "engine_blocks": {"table": engine_blocks_table},
}


def render(data: dict, block: str) -> str:
    """The Markdown of one block of one device data file.

    Raises:
      ValueError: for a block the kind does not have.
    """
    kind = data["kind"]
    if block not in RENDERERS[kind]:
        raise ValueError(f"a {kind} file has no block {block!r}; it has {sorted(RENDERERS[kind])}")
    return RENDERERS[kind][block](data)
