"""Executes the notebook argv[1] with its own kernel (nbclient, 600 s a cell) and writes it to argv[2]."""

import sys

import nbformat
from nbclient import NotebookClient

notebook = nbformat.read(sys.argv[1], as_version=4)
NotebookClient(notebook, timeout=600, kernel_name=notebook.metadata.kernelspec.name).execute()
nbformat.write(notebook, sys.argv[2])
