"""The examples in docs/ run, in order, page by page, against a real server.

Each page's ```python blocks run in one fresh Python process (so a page reads
top to bottom like a session); its ```ipython blocks run, in order, in a
fresh Pathways kernel. ```python skip and ```ipython skip blocks are
illustrations only (code for a cluster or a hosted runtime the tests do not
have); shell, YAML and text blocks are not Python. Any other block fails
test_every_block_is_run_or_marked, so no example escapes by its label. The
documented address grpc://127.0.0.1:29000 is replaced by the test server's, and its documented
storage root /tmp/pathways-storage by the server's.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"^```python\s*\n(.*?)^```", re.MULTILINE | re.DOTALL)
IPYTHON_BLOCK = re.compile(r"^```ipython\s*\n(.*?)^```", re.MULTILINE | re.DOTALL)
DOCUMENTED_ADDRESS = "grpc://127.0.0.1:29000"
DOCUMENTED_STORAGE_ROOT = "/tmp/pathways-storage"
FENCE = re.compile(r"^```(.*)$", re.MULTILINE)
NOT_RUN = {"python skip", "ipython skip", "bash", "text", "yaml", "dockerfile"}


def test_every_block_is_run_or_marked():
    """Each fenced block is run (python, ipython) or marked as not Python or not runnable here."""
    for page in sorted(DOCS.glob("*.md")):
        headers = FENCE.findall(page.read_text())[::2]  # opening fences; the closing ones are bare
        unknown = sorted({h.strip() for h in headers} - NOT_RUN - {"python", "ipython"})
        assert not unknown, (
            f"{page.name}: code blocks labelled {unknown}: use one of python, ipython, {sorted(NOT_RUN)}"
        )


def _pages_with_examples() -> list[pathlib.Path]:
    return sorted(page for page in DOCS.glob("*.md") if BLOCK.search(page.read_text()))


@pytest.mark.parametrize("page", _pages_with_examples(), ids=lambda p: p.name)
def test_examples_run(page, proxy_server, tmp_path):
    code = "\n".join(BLOCK.findall(page.read_text())).replace(DOCUMENTED_ADDRESS, proxy_server.address)
    code = code.replace(DOCUMENTED_STORAGE_ROOT, proxy_server.storage_root)
    script = tmp_path / f"{page.stem}.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{page.name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"


def _pages_with_ipython() -> list[pathlib.Path]:
    return sorted(page for page in DOCS.glob("*.md") if IPYTHON_BLOCK.search(page.read_text()))


@pytest.mark.parametrize("page", _pages_with_ipython(), ids=lambda p: p.name)
def test_ipython_examples_run(page, kernel_installed):
    from pathways_nb.testing import KernelSession

    kernel = KernelSession("pathways")
    try:
        for block in IPYTHON_BLOCK.findall(page.read_text()):
            out = kernel.run(block)
            problems = out["errors"] + [line for line in out["stderr"].splitlines() if "Error" in line]
            assert not problems, f"{page.name}: {block!r} failed: {problems}"
    finally:
        kernel.close()
