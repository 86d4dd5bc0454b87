"""The mod benchmark's smoke size runs in-process and writes a well-formed result."""

import json

import pytest

from experiments import mod_benchmark


def test_smoke_runs_and_writes_json(tmp_path, capsys):
    out = tmp_path / "mods.json"
    result = mod_benchmark.main(["--smoke", "--repeats", "1", "--out", str(out)])
    saved = json.loads(out.read_text())
    kinds = {r["kind"] for r in saved["rows"]}
    assert kinds == {"alibi_score_mod", "alibi_dense_bias", "window_mask_mod", "window_builtin"}
    for row in saved["rows"]:
        assert "error" not in row and row["seconds"] > 0 and row["temp_mib"] >= 0, row
    assert set(result["ratios"]) == {"alibi_score_mod/alibi_dense_bias N=256", "window_mask_mod/window_builtin N=256"}
    assert "wrote" in capsys.readouterr().out


def test_dense_rows_past_the_limit_report_memory_only(tmp_path):
    result = mod_benchmark.main(["--smoke", "--repeats", "1", "--dense-max-n", "0", "--out", str(tmp_path / "m.json")])
    dense = [r for r in result["rows"] if r["kind"] == "alibi_dense_bias"]
    assert dense and all("seconds" not in r and "memory_analysis" in r["note"] for r in dense)


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--dense-max-n", "-1"], ["--repeats", "x"], ["--bogus"]])
def test_bad_flags_are_argparse_errors(argv):
    with pytest.raises(SystemExit):
        mod_benchmark.main(["--smoke", *argv])
