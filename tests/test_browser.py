"""What a person sees: JupyterLab in Chromium runs a notebook on the Pathways kernel.

The notebook connects, runs a jitted loop on two islands, and shows the
island map and the live timeline; the test checks the rendered widgets (one
element per device, timeline bars for each device) and saves screenshots to
test-artifacts/. Another profiles a loop; another has its session preempted
and shows the island map with it suspended.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import urllib.request

import nbformat
import pytest

from pathways_nb.testing import wait_until

ARTIFACTS = pathlib.Path(__file__).resolve().parent.parent / "test-artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(kernel_installed, tmp_path_factory):
    root = tmp_path_factory.mktemp("lab")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    log = open(root / "jupyterlab.log", "w")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            f"--port={port}",
            "--ServerApp.ip=127.0.0.1",
            "--IdentityProvider.token=",
            "--ServerApp.password=",
            f"--ServerApp.root_dir={root}",
            "--ServerApp.allow_root=True",
            "--LabApp.expose_app_in_browser=True",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def answering() -> bool:
        try:
            urllib.request.urlopen(f"{url}/api/status", timeout=2)
            return True
        except OSError:
            if process.poll() is not None:
                raise RuntimeError(f"JupyterLab ended while starting (its log: {root / 'jupyterlab.log'})") from None
            return False

    wait_until(answering, 120, "JupyterLab answering", interval_s=0.5)
    yield url, root
    process.terminate()
    process.wait(30)
    log.close()
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(root / "jupyterlab.log", ARTIFACTS / "jupyterlab.log")


@contextlib.contextmanager
def _browser_page():
    """A page of Debian's Chromium (driven by Playwright); on a failure, a screenshot of it in test-artifacts/."""
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"],
        )
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        try:
            yield page
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "failure.png"), full_page=True)
            raise
        finally:
            browser.close()


def _kernel_notebook(*cells: str) -> nbformat.NotebookNode:
    """A notebook on the Pathways kernel of ``cells``."""
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "pathways", "display_name": "Python 3 (Pathways)", "language": "python"}
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    return notebook


def _pathways_notebook(address: str, token: str, tenant: str, *cells: str) -> nbformat.NotebookNode:
    """A notebook on the Pathways kernel that connects to ``address`` as ``tenant``, then runs ``cells``."""
    return _kernel_notebook(f"%pathways connect {address} --tenant {tenant} --token {token}", *cells)


def _notebook(address: str, token: str) -> nbformat.NotebookNode:
    return _pathways_notebook(
        address,
        token,
        "browser-test",
        (
            "import jax, jax.numpy as jnp, numpy as np\n"
            "step = jax.jit(lambda x: jnp.tanh(x @ x.T) / 4)\n"
            "xs = [jax.device_put(np.full((64, 64), 0.1, np.float32), d) for d in jax.devices()]\n"
            "for _ in range(5):\n"
            "    xs = [step(x) for x in xs]\n"
            "print('loop done', float(xs[0][0, 0]))"
        ),
        "%pathways islands",
        "%pathways timeline --live",
        "for _ in range(10):\n    xs = [step(x) for x in xs]\njax.block_until_ready(xs); print('more done')",
    )


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium: install it (as root: apt-get install chromium)")
def test_notebook_in_jupyterlab_shows_the_widgets(lab, cluster):
    url, root = lab
    specs = json.loads(urllib.request.urlopen(f"{url}/api/kernelspecs", timeout=30).read())
    assert "pathways" in specs["kernelspecs"], specs
    nbformat.write(_notebook(cluster.address, cluster.token), root / "pathways.ipynb")
    with _browser_page() as page:
        _run_and_check(page, url)


def _open_and_run_all(page, url: str, name: str = "pathways.ipynb") -> None:
    """Opens the notebook ``name`` and starts running every cell, once its kernel is up."""
    page.goto(f"{url}/lab/tree/{name}")
    page.wait_for_selector(".jp-Notebook:visible", timeout=60_000)  # (tabs restored from earlier tests are hidden)
    # Run only once this notebook is the current tab (JupyterLab restores the tabs of the last test
    # first; run-all went to the previous notebook once) and its own kernel is up: running earlier
    # makes JupyterLab ask for a kernel.
    page.wait_for_function(
        """(name) => {
            const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
            const kernel = panel && panel.context && panel.context.path === name && panel.sessionContext
                && panel.sessionContext.session && panel.sessionContext.session.kernel;
            return kernel && kernel.name === 'pathways' && kernel.connectionStatus === 'connected'
                && kernel.status === 'idle';
        }""",
        arg=name,
        timeout=120_000,
    )
    # Start the run without awaiting it (the command's promise lasts until every cell has run).
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")


def _run_and_check(page, url: str) -> None:
    """Opens the notebook, runs every cell, and checks the rendered widgets."""
    _open_and_run_all(page, url)
    page.wait_for_selector("text=more done", timeout=150_000)
    devices = page.locator(".pw-island-map .pw-device")
    devices.first.wait_for(timeout=60_000)
    assert devices.count() == 8
    page.locator(".pw-island-map").screenshot(path=str(ARTIFACTS / "island-map.png"))
    bars = page.locator("svg.pw-timeline rect.pw-bar")
    page.wait_for_function(
        "() => new Set([...document.querySelectorAll('svg.pw-timeline rect.pw-execute')]"
        ".map(r => r.dataset.device)).size === 8",
        timeout=60_000,
    )
    assert bars.count() > 8
    # The live view draws a new SVG twice a second (a loaded machine's screenshot outlasted one and
    # found it detached): shoot the widget's own element, which stays.
    live = page.locator(".widget-html-content", has=page.locator("svg.pw-timeline"))
    live.screenshot(path=str(ARTIFACTS / "timeline.png"))
    page.screenshot(path=str(ARTIFACTS / "notebook.png"), full_page=True)


def _profiling_notebook(address: str, token: str) -> nbformat.NotebookNode:
    return _pathways_notebook(
        address,
        token,
        "profile-test",
        (
            "import tempfile, jax, jax.numpy as jnp, numpy as np\n"
            "step = jax.jit(lambda w, x: w - 0.01 * jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w))\n"
            "firsts = [jax.devices()[0], jax.devices()[4]]\n"
            "ws = [jax.device_put(np.full((256, 256), 0.01, np.float32), d) for d in firsts]\n"
            "xs = [jax.device_put(np.ones((128, 256), np.float32), d) for d in firsts]\n"
            "def train(n):\n"
            "    global ws\n"
            "    for _ in range(n):\n"
            "        ws = [step(w, x) for w, x in zip(ws, xs)]\n"
            "    jax.block_until_ready(ws)\n"
            "train(2); logdir = tempfile.mkdtemp()"
        ),
        "%%pathways profile {logdir}\ntrain(3)",
        "print('profiled', len(_.trace.devices))",
    )


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make test installs it)")
def test_device_timeline_of_a_profile_in_jupyterlab(lab, cluster):
    """``%%pathways profile`` draws each device's ops in JupyterLab: a row per device of both islands."""
    url, root = lab
    nbformat.write(_profiling_notebook(cluster.address, cluster.token), root / "profiling.ipynb")
    with _browser_page() as page:
        _open_and_run_all(page, url, "profiling.ipynb")
        page.wait_for_selector("text=profiled 2", timeout=240_000)
        timeline = page.locator("svg.pw-timeline").first
        devices = page.evaluate(
            "() => [...new Set([...document.querySelectorAll('svg.pw-timeline rect.pw-op')]"
            ".map(r => r.dataset.device))].sort()"
        )
        assert devices == ["0", "4"], devices
        timeline.screenshot(path=str(ARTIFACTS / "device-timeline.png"))
        page.screenshot(path=str(ARTIFACTS / "profile-notebook.png"), full_page=True)


# A tenant of priority 10 that takes island 1 to itself until its stdin closes.
BOSS = """
import sys, pathways_nb
pathways_nb.connect(sys.argv[1], tenant="boss", islands=[1], exclusive=True, priority=10, progress=False)
print("connected", flush=True)
sys.stdin.read()
"""


def _preempted_notebook() -> nbformat.NotebookNode:
    """alice shares a cluster of its own (two islands of two devices); boss preempts her for island 1."""
    return _kernel_notebook(
        "%pathways connect local --islands 2 --devices_per_host 2 --tenant alice",
        (
            "import os, subprocess, sys, pathways_nb\n"
            "session = pathways_nb.current()\n"
            "environment = {k: v for k, v in os.environ.items() if not k.startswith('JAX_')}\n"
            f"boss = subprocess.Popen([sys.executable, '-c', {BOSS!r}, session.address], stdin=subprocess.PIPE,\n"
            "                        stdout=subprocess.PIPE, text=True, env=environment)\n"
            "print('boss', boss.stdout.readline().strip() + ';', 'alice', session.status)"
        ),
        "%pathways islands",
        "boss.stdin.close(); boss.wait(60)\n%pathways disconnect",
    )


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make test installs it)")
def test_island_map_of_a_preempted_session_in_jupyterlab(lab):
    """The devices a suspended session resumes on are hatched in its tenant's colour: island 0's (free now) all
    over, island 1's (boss holds them) along their foot; the legend and a line below the map say whose, and why."""
    url, root = lab
    nbformat.write(_preempted_notebook(), root / "preempted.ipynb")
    with _browser_page() as page:
        _open_and_run_all(page, url, "preempted.ipynb")
        page.wait_for_selector("text=boss connected; alice suspended", timeout=180_000)
        island_map = page.locator(".pw-island-map")
        island_map.wait_for(timeout=60_000)
        hatched = page.locator(".pw-island-map .pw-device.pw-suspended")
        assert [hatched.nth(i).get_attribute("title").split(" · ")[-1] for i in range(hatched.count())] == [
            *["free; alice suspended, resumes here"] * 2,
            *["held by boss (exclusive); alice suspended, resumes here"] * 2,
        ]
        assert "alice (suspended)" in island_map.locator(".pw-legend").inner_text()
        why = island_map.locator(".pw-not-running").inner_text()
        assert re.fullmatch(r"alice #\d+ suspended \(preempted by tenant boss \(priority 10, exclusive\)\)", why)
        island_map.screenshot(path=str(ARTIFACTS / "island-map-suspended.png"))
        page.wait_for_selector("text=disconnected from", timeout=120_000)
