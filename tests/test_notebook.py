"""The research notebook runs top to bottom (its cells assert their own results); its last
cell starts a tiny server (LocalServer) and measures prefill work from its answers."""

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "cache_engineering.ipynb"


def test_cache_engineering_notebook_executes():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3").execute()
    outputs = "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    assert "F saw: A0 C1 E2 F3" in outputs
    assert "max |logit diff|" in outputs
    assert "the prefill work; summed TTFT" in outputs  # the server measured the work
