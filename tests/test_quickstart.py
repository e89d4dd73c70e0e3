"""The quickstart notebook runs end to end in the Pathways kernel (nbclient)."""

from __future__ import annotations

import nbformat
from nbclient import NotebookClient

from pathways_nb.notebook.quickstart import NOTEBOOK


def _text(cell) -> str:
    parts = []
    for output in cell.get("outputs", []):
        if output["output_type"] == "stream":
            parts.append(output["text"])
        elif "data" in output:
            parts.append(output["data"].get("text/plain", ""))
    return "".join(parts)


def test_quickstart_notebook(kernel_installed):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="pathways").execute()
    cells = [c for c in notebook.cells if c.cell_type == "code"]
    assert not any(o["output_type"] == "error" for c in cells for o in c.get("outputs", []))
    outputs = [_text(c) for c in cells]
    assert "not connected" not in outputs[0] and "pathways_nb.Session" in outputs[0]
    assert "(7, 1)" in outputs[1]
    assert "loss after 30 steps" in outputs[3]
    assert "(256, 10)" in "".join(outputs)
    assert "8 device tracks" in "".join(outputs)
    assert "disconnected from" in outputs[-1]
