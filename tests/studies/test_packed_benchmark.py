"""The packed-documents benchmark's smoke size runs in-process and writes a well-formed result."""

import json

import pytest

from experiments import packed_benchmark


def test_smoke_runs_and_writes_json(tmp_path, capsys):
    out = tmp_path / "packed.json"
    result = packed_benchmark.main(["--smoke", "--rounds", "1", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert {(r["kind"], r["mode"]) for r in saved["rows"]} == {
        (kind, mode) for kind in ("one_doc", "packed") for mode in packed_benchmark.MODES}
    for row in saved["rows"]:
        assert row["seconds"] > 0 and row["cpu_seconds"] >= 0 and len(row["samples"]) == 1, row
        assert row["docs"] == (1 if row["kind"] == "one_doc" else packed_benchmark.SMOKE["docs"])
    assert len(result["ratios"]) == 2 * (3 + 2) and all(r > 0 for r in result["ratios"].values())
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--seqs", "250"], ["--rounds", "x"], ["--bogus"]])
def test_bad_flags_are_argparse_errors(argv):
    with pytest.raises(SystemExit):
        packed_benchmark.main(["--smoke", *argv])
