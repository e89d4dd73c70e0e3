"""Binder's set-up, replayed: a fresh environment built the way Binder builds it runs the quickstart notebook.

Binder (repo2docker) makes an environment of binder/runtime.txt's Python,
installs binder/requirements.txt from the repository's root (this checkout:
pathways-nb is not on a package index), runs binder/postBuild, and serves
JupyterLab from that environment. This test does the same in a fresh virtual
environment, then executes notebooks/quickstart.ipynb with the kernel that
postBuild installed there. It is slow (one full pip install, from pip's cache
where it can), so it is marked ``slow``: ``make test`` runs it,
``-m "not slow"`` leaves it out.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import nbformat
import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
BINDER = REPO / "binder"

EXECUTE = pathlib.Path(__file__).with_name("clients") / "executes_a_notebook.py"


def _run(command: list[str], env: dict[str, str], timeout_s: float) -> str:
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_binder_environment_runs_the_quickstart(tmp_path):
    runtime = (BINDER / "runtime.txt").read_text().strip()
    assert runtime == f"python-{sys.version_info.major}.{sys.version_info.minor}", (
        f"binder/runtime.txt asks for {runtime}; this test builds with Python {sys.version.split()[0]}"
    )
    venv = tmp_path / "binder-env"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # Binder's environment: its bin first on PATH, nothing of this test run's JAX or Jupyter settings.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "JUPYTER_", "VIRTUAL_ENV", "PYTHON"))}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    _run([str(python), "-m", "pip", "install", "--quiet", "-r", "binder/requirements.txt"], env, 1500)
    _run(["bash", str(BINDER / "postBuild")], env, 120)

    specs = json.loads(_run([str(venv / "bin" / "jupyter"), "kernelspec", "list", "--json"], env, 60))["kernelspecs"]
    pathways = specs["pathways"]
    assert pathlib.Path(pathways["resource_dir"]).is_relative_to(venv), pathways["resource_dir"]
    assert pathways["spec"]["display_name"] == "Python 3 (Pathways)"
    assert pathlib.Path(pathways["spec"]["argv"][0]).parent == venv / "bin"
    server_config = venv / "etc/jupyter/jupyter_server_config.d/pathways-nb-binder.json"
    assert json.loads(server_config.read_text())["ServerApp"]["default_url"] == "/lab/tree/notebooks/quickstart.ipynb"
    assert (REPO / "notebooks/quickstart.ipynb").exists()

    executed = tmp_path / "quickstart.executed.ipynb"
    _run([str(python), str(EXECUTE), str(REPO / "notebooks/quickstart.ipynb"), str(executed)], env, 900)
    notebook = nbformat.read(executed, as_version=4)
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o["output_type"] == "error"]
    text = "".join(o.get("text", "") for o in outputs if o["output_type"] == "stream")
    assert "loss after 30 steps" in text and "disconnected from" in text
