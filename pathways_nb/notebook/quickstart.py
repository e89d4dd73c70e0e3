"""The quickstart: runs notebooks/quickstart.ipynb in the Pathways kernel and prints what it shows.

``python -m pathways_nb.notebook.quickstart`` (``make quickstart``) needs no cloud
account: the notebook starts a cluster of two islands of 4 CPU devices on this
machine (``%pathways connect local``), trains on one island, pipelines across
both, and shows the island map and the step timeline. The executed notebook
is saved next to a temporary copy, for opening in JupyterLab.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

NOTEBOOK = pathlib.Path(__file__).resolve().parents[2] / "notebooks" / "quickstart.ipynb"


def _print_outputs(cell) -> None:
    for output in cell.get("outputs", []):
        if output["output_type"] == "stream":
            print(output["text"], end="")
        elif output["output_type"] in ("execute_result", "display_data"):
            data = output["data"]
            if "application/vnd.jupyter.widget-view+json" in data:
                print("[widget]")
            else:
                print(data.get("text/plain", ""))
        elif output["output_type"] == "error":
            print(f"{output['ename']}: {output['evalue']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the pathways-nb quickstart notebook.")
    parser.add_argument("--notebook", default=str(NOTEBOOK), help="the notebook to run")
    parser.add_argument("--output", default=None, help="where to save the executed notebook")
    args = parser.parse_args(argv)

    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    from pathways_nb.notebook.kernelspec import install

    with tempfile.TemporaryDirectory(prefix="pathways-kernel-") as prefix:
        install(prefix=prefix)
        import os

        os.environ["JUPYTER_PATH"] = os.pathsep.join(
            filter(None, [os.path.join(prefix, "share", "jupyter"), os.environ.get("JUPYTER_PATH")])
        )
        notebook = nbformat.read(args.notebook, as_version=4)
        client = NotebookClient(notebook, timeout=600, kernel_name="pathways")
        failed = None
        try:
            client.execute()
        except CellExecutionError as error:
            failed = error
    for cell in notebook.cells:
        if cell.cell_type == "code":
            print(f">>> {cell.source.splitlines()[0]}")
            _print_outputs(cell)
    output = args.output or os.path.join(tempfile.gettempdir(), "pathways-quickstart.executed.ipynb")
    nbformat.write(notebook, output)
    print(f"\nthe executed notebook: {output}")
    if failed is not None:
        print(f"the quickstart failed: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
