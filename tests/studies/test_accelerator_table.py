"""docs/accelerators.md holds exactly the table `experiments/accelerator_table.py`
generates from the paths' refusal functions, so the page cannot drift from the code."""

import pytest

from experiments import accelerator_table


def test_page_holds_the_generated_table():
    text = accelerator_table.PAGE.read_text(encoding="utf-8")
    generated = accelerator_table.table()
    assert accelerator_table.replace_in_page(text, generated) == text, (
        "docs/accelerators.md is stale: run `python -m experiments.accelerator_table --write`")


def test_table_reads_the_refusals():
    """Spot checks against the dispatcher's rules: the chain per platform, the
    pure-JAX fallbacks, and cuDNN's dense-mask budget named in a note."""
    lines = accelerator_table.table().splitlines()
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in lines if line.startswith("| ")}
    assert rows["causal"][:3] == ["`cudnn`", "`pallas_tpu`", "`blockwise`"]
    assert rows["float32, causal"][0] == "`pallas_gpu`"  # cuDNN takes half precision only
    assert rows["return_weights"][:3] == ["`xla`"] * 3
    assert rows["causal + segment ids (packed)"][0] == "`pallas_gpu`"
    assert rows["causal + segment ids, B=1 H=4 N=S=512"][0] == "`cudnn`"  # under the dense-mask budget
    assert any("segment ids" in line and "2**24" in line for line in lines if line[:1].isdigit())


def test_replace_needs_the_markers():
    with pytest.raises(ValueError, match="accelerator_table: begin"):
        accelerator_table.replace_in_page("# no markers\n", "| table |\n")
