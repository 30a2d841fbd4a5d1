"""The research notebook runs top to bottom (its cells assert their own results); its last
cell starts a tiny server (LocalServer) and measures prefill work from its answers. It runs on
`tiny` as written, and on `tiny-gpt-oss` with its first cell's `MODEL` switched (slow: the
MoE model's step shapes compile for the server too)."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "cache_engineering.ipynb"
MODEL_LINE = 'MODEL = "tiny"\n'


@pytest.mark.parametrize("model", ["tiny", pytest.param("tiny-gpt-oss", marks=pytest.mark.slow)])
def test_cache_engineering_notebook_executes(model):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    assert first.source.count(MODEL_LINE) == 1  # the model choice the notebook documents
    first.source = first.source.replace(MODEL_LINE, f'MODEL = "{model}"\n')
    NotebookClient(nb, timeout=600, kernel_name="python3").execute()
    outputs = "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    assert "F saw: A0 C1 E2 F3" in outputs
    assert "max |logit diff|" in outputs
    assert "the prefill work; summed TTFT" in outputs  # the server measured the work
