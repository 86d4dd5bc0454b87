"""The accelerator benchmark's smoke size runs on CPU and writes a well-formed result."""

import json

import jax
import pytest

from experiments import device_benchmark


def test_smoke_runs_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    result = device_benchmark.main(["--smoke", "--repeats", "1", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["device"] and saved["platform"] == result["platform"]
    paths = {r["path"] for r in saved["rows"]}
    assert paths == set(device_benchmark.paths_for(saved["platform"]))
    for row in saved["rows"]:
        for name in ("forward", "forward_backward"):
            assert "error" not in row[name], row
            assert row[name]["ms"] > 0 and 0 < row[name]["roofline_pct"]
    assert "roofline" in capsys.readouterr().out


def test_paths_per_platform_never_time_interpret_mode():
    assert device_benchmark.paths_for("cpu") == ["xla", "blockwise"]
    assert "pallas_gpu" in device_benchmark.paths_for("gpu") and "pallas_tpu" not in device_benchmark.paths_for("gpu")
    assert "pallas_tpu" in device_benchmark.paths_for("tpu")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="on an accelerator the full grid would run")
def test_full_grid_refused_on_cpu():
    with pytest.raises(SystemExit):
        device_benchmark.main([])
