"""The Pathways kernel and the %pathways magics, in real Jupyter kernels."""

from __future__ import annotations

import json
import os
import re

import pytest

import pathways_nb
from pathways_nb.client import timeline
from pathways_nb.notebook import progress
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.testing import KernelSession, wait_until


@pytest.fixture(scope="module")
def kernel(kernel_installed):
    session = KernelSession("pathways")
    yield session
    session.close()


def test_the_kernelspec_names_the_pathways_kernel(kernel_installed):
    spec = json.loads((kernel_installed / "share/jupyter/kernels/pathways/kernel.json").read_text())
    assert spec["display_name"] == "Python 3 (Pathways)"
    assert spec["argv"][1:3] == ["-m", "pathways_nb.notebook.kernel"]
    assert os.path.exists(spec["argv"][0])
    assert (kernel_installed / "share/jupyter/kernels/pathways/logo-64x64.png").exists()


def test_first_output_says_how_to_connect(kernel):
    out = kernel.run("1 + 1")
    assert "not connected. Run %pathways connect ADDRESS" in out["stdout"]
    assert out["data"][-1]["text/plain"] == "2"
    assert "not connected" not in kernel.run("2 + 2")["stdout"]


def test_magics_need_a_connection(kernel):
    out = kernel.run("%pathways islands")
    assert "not connected: run %pathways connect ADDRESS" in out["stderr"] + out["stdout"]
    assert len((out["stderr"] + out["stdout"]).strip().splitlines()) == 1


def test_help_and_misuse(kernel):
    assert "%pathways connect ADDRESS" in kernel.run("%pathways help")["stdout"]
    out = kernel.run("%pathways bogus")
    assert "invalid choice: 'bogus'" in out["stderr"] + out["stdout"]


def test_a_comment_after_a_magic_is_not_an_argument(kernel):
    assert "%pathways connect ADDRESS" in kernel.run("%pathways help   # lists the subcommands")["stdout"]
    out = kernel.run("%pathways connect grpc://127.0.0.1:1 --timeout 2  # or: %pathways connect local")
    assert "could not connect to a Pathways proxy at grpc://127.0.0.1:1 within 2 s" in out["stderr"] + out["stdout"]


def test_connect_to_nothing_fails_in_one_line(kernel):
    out = kernel.run("%pathways connect grpc://127.0.0.1:1 --timeout 2")
    text = (out["stderr"] + out["stdout"]).strip()
    assert "could not connect to a Pathways proxy at grpc://127.0.0.1:1" in text
    assert "pathways-nb up" in text


def test_connect_run_and_look(kernel, cluster):
    out = kernel.run(f"%pathways connect {cluster.address} --tenant notebook-test --token {cluster.token}")
    assert not out["errors"], out
    assert cluster.address in out["data"][-1]["text/html"]
    assert "notebook-test" in out["data"][-1]["text/html"]
    # The whole cluster in one row: its shape, its server's version, where it is.
    (row,) = re.findall(r"<th[^>]*>cluster</th><td>([^<]*)</td>", out["data"][-1]["text/html"])
    assert (
        row == f"2 island(s) x 1 host(s) x 4 cpu device(s), pathways-nb {pathways_nb.__version__}, at {cluster.address}"
    )

    out = kernel.run(
        "import jax, jax.numpy as jnp, numpy as np\n"
        "step = jax.jit(lambda w, x: w - 0.1 * jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w))\n"
        "ws = [jax.device_put(np.ones((32, 8), np.float32), d) for d in (jax.devices()[0], jax.devices()[5])]\n"
        "x0, x5 = (jax.device_put(np.ones((16, 32), np.float32), d) for d in (jax.devices()[0], jax.devices()[5]))\n"
        "for _ in range(8):\n"
        "    ws = [step(ws[0], x0), step(ws[1], x5)]\n"
        "print(len(jax.devices()), float(ws[0].sum()), float(ws[1].sum()))"
    )
    assert not out["errors"], out
    count, first, second = out["stdout"].split()
    assert count == "8" and first == second

    out = kernel.run("%pathways devices")
    table = out["data"][-1]["text/plain"]
    assert "cpu:7" in table and "notebook-test" in table

    out = kernel.run("%pathways islands")
    (model,) = out["widgets"]
    html = kernel.widget_state(model)["value"]
    assert len(re.findall(r'class="pw-device[^"]*" data-device="\d+"', html)) == 8
    assert html.count('class="pw-island') >= 2 and "notebook-test" in html

    out = kernel.run("%pathways allocations")
    (model,) = out["widgets"]
    assert "notebook-test" in kernel.widget_state(model)["value"]

    # Right after the first run, the compiles do not set the timeline's scale: they are in a narrow band before
    # the steps, marked, whatever their length.
    out = kernel.run("%pathways timeline")
    (model,) = out["widgets"]
    svg = kernel.widget_state(model)["value"]
    (band,) = re.findall(r'class="pw-break pw-first-step" x="([\d.]+)" y="\d+" width="([\d.]+)"', svg)
    band_start, band_end = float(band[0]), float(band[0]) + float(band[1])
    assert float(band[1]) <= timeline.FIRST_STEP_WIDTH_PX and "first step + compile: " in svg
    compiles = re.findall(
        r'class="pw-bar pw-compile" data-device="\d+" x="([\d.]+)" y="\d+" width="([\d.]+)"'
        r"[^>]*><title>compile: jit__lambda",
        svg,
    )
    assert len(compiles) == 2 and all(
        band_start <= float(x) and float(x) + float(w) <= band_end + 0.5 for x, w in compiles
    )
    steps = [float(x) for x in re.findall(r'class="pw-step" x1="([\d.]+)"', svg)]
    assert len(steps) == 8 and steps[0] <= band_end <= min(steps[1:]) + 0.1, (band, steps)

    out = kernel.run("%pathways timeline --last 5")
    (model,) = out["widgets"]
    svg = kernel.widget_state(model)["value"]
    bars = re.findall(r'class="pw-bar pw-execute" data-device="(\d+)"', svg)
    assert {"0", "5"} <= set(bars)
    assert "pw-step" in svg


def test_trace_file_is_chrome_trace_json_with_a_track_per_device(kernel, tmp_path):
    path = tmp_path / "trace.json"
    out = kernel.run(f"%pathways trace {path}")
    assert "device tracks" in out["stdout"], out
    trace = json.loads(path.read_text())
    tracks = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert tracks == {i: f"cpu:{i}" for i in range(8)}
    bars = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in bars if e["cat"] == "execute"} >= {0, 5}
    assert all(e["dur"] >= 0 and e["ts"] > 0 for e in bars)


def test_live_timeline_follows_a_running_loop(kernel):
    out = kernel.run("%pathways timeline --live --last 3")
    (model,) = out["widgets"]
    before = kernel.widget_state(model)["value"]
    kernel.run("for _ in range(20):\n    ws = [step(ws[0], x0), step(ws[1], x5)]\njax.block_until_ready(ws)")

    def shown() -> str:
        kernel.run("pass")  # (the widget's updates are read while a cell runs)
        return kernel.widget_state(model)["value"]

    wait_until(
        shown, 60, "the live timeline showing the loop's steps", holds=lambda svg: svg != before and "pw-bar" in svg
    )


def test_already_connected_then_disconnect_and_reconnect(kernel, cluster):
    out = kernel.run(f"%pathways connect {cluster.address}")
    assert "already connected" in out["stderr"] + out["stdout"]
    assert "disconnected from" in kernel.run("%pathways disconnect")["stdout"]
    out = kernel.run("import jax; print(jax.devices()[0].client.runtime_type)")
    assert "proxy" not in out["stdout"]
    out = kernel.run(f"%pathways connect {cluster.address} --token {cluster.token}")
    assert not out["errors"]
    assert kernel.run("print(len(jax.devices()))")["stdout"].strip() == "8"
    kernel.run("%pathways disconnect")


def test_connect_local_starts_and_stops_a_cluster(kernel):
    out = kernel.run("%pathways connect local --islands 1 --devices_per_host 2")
    assert not out["errors"], out
    html = out["data"][-1]["text/html"]
    assert "<td>1 island(s) x 1 host(s) x 2 cpu device(s), pathways-nb " in html
    assert "started by this notebook (%pathways disconnect stops it)</td>" in html
    pids = kernel.run(
        "import pathways_nb\nprint(*[c.process.pid for c in pathways_nb.current().local_cluster.processes()])"
    )["stdout"].split()
    assert len(pids) == 3
    kernel.run("%pathways disconnect")
    import psutil

    assert not any(psutil.pid_exists(int(pid)) and psutil.Process(int(pid)).status() != "zombie" for pid in pids)


def test_kernel_connects_at_start_with_pathways_address(kernel_installed, proxy_server):
    session = KernelSession("pathways", env={"PATHWAYS_ADDRESS": proxy_server.address})
    try:
        out = session.run("import jax; print(len(jax.devices()), jax.devices()[0].client.runtime_type)")
        assert f"connected to {proxy_server.address} (4 devices)" in out["stdout"]
        assert "4 proxy/pathways" in out["stdout"]
    finally:
        session.close()


def test_load_ext_in_a_plain_ipython_kernel(proxy_server):
    session = KernelSession("python3")
    try:
        out = session.run(f"%load_ext pathways_nb\n%pathways connect {proxy_server.address}")
        assert not out["errors"], out
        assert proxy_server.address in out["data"][-1]["text/html"]
        out = session.run("%pathways devices")
        assert "cpu:3" in out["data"][-1]["text/plain"]
    finally:
        session.close()


def test_a_suspended_session_shows_in_every_view(kernel, cluster, tmp_path):
    """A session suspended by its client: the session's "not running" row, the allocation table's row and the island
    map's hatched devices while it is; resumed by its next step, a marked span on its timeline and in its trace,
    which count its steps as before. (A CPU session moves in milliseconds, too fast for a bar to be seen reliably:
    test_progress_bars_say_whose_session_moves_and_why checks the bars' words.)"""
    out = kernel.run(f"%pathways connect {cluster.address} --tenant pausing --only_islands 1 --token {cluster.token}")
    assert not out["errors"], out
    out = kernel.run(
        "import jax, numpy as np, pathways_nb\n"
        "session = pathways_nb.current()\n"
        "step = jax.jit(lambda x: x * 0.5 + 1)\n"
        "x = jax.device_put(np.ones(32 << 20, np.float32), jax.devices()[0])\n"
        "for _ in range(3):\n"
        "    x = step(x)\n"
        "x.block_until_ready()"
    )
    assert not out["errors"], out
    out = kernel.run("session.suspend()")
    assert not out["errors"], out

    (row,) = re.findall(
        r"<th[^>]*>not running</th><td[^>]*>(.*?)</td>", kernel.run("%pathways status")["data"][-1]["text/html"]
    )
    assert re.search(r"<div>pausing #\d+ suspended \(by its client\)</div>", row), row  # (a line a session)
    (model,) = kernel.run("%pathways allocations")["widgets"]
    table = kernel.widget_state(model)["value"]
    assert re.search(r"<td>pausing</td>\s*<td>suspended</td>\s*<td>suspended</td>\s*<td>by its client</td>", table)
    (model,) = kernel.run("%pathways islands")["widgets"]
    island_map = kernel.widget_state(model)["value"]
    tile = r'class="pw-device[^"]* pw-suspended[^"]*" data-device="(\d+)"[^>]*title="[^"]*; ([^";]*)"'
    hatched = [device for device, said in re.findall(tile, island_map) if said == "pausing suspended, resumes here"]
    assert hatched == ["4", "5", "6", "7"], island_map
    assert "pausing (suspended)" in island_map

    out = kernel.run("for _ in range(3):\n    x = step(x)\nprint(float(x[0]), session.status)")
    assert out["stdout"].split() == ["1.984375", "running"], out  # (x = 2 - 0.5**6 after 6 steps: none lost)
    (model,) = kernel.run("%pathways timeline")["widgets"]
    svg = kernel.widget_state(model)["value"]
    spans = re.findall(
        r'class="pw-suspension" data-device="(\d+)"[^>]*><title>suspended for [^:]+: ([^<]*)</title>', svg
    )
    assert spans == [(str(d), "by its client; resumed: a request arrived") for d in range(4, 8)], spans
    assert "6 step(s) of jit__lambda" in svg  # (the suspend and the resume are no steps)
    path = tmp_path / "trace.json"
    kernel.run(f"%pathways trace {path}")
    spans = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "suspension"]
    assert sorted(e["tid"] for e in spans) == [4, 5, 6, 7]
    assert all(e["name"] == "suspension: by its client" and e["dur"] > 0 for e in spans)
    out = kernel.run("print(*[t.get_text() for t in session.timeline().plot().axes[0].get_legend().get_texts()])")
    assert {"suspend", "resume", "suspended"} <= set(out["stdout"].split()), out
    kernel.run("%pathways disconnect")


def test_progress_bars_say_whose_session_moves_and_why():
    """The bars' words for the proxy's suspend, resume and wait activities (named as the proxy names them), and
    which bars a tenant sees: its own, and the suspensions it caused (of those holding devices it waits for)."""
    why = "preempted by tenant boss (priority 10, exclusive)"
    suspend = pb.Activity(kind="suspend", name=f"suspending ({why})", tenant="alice", bytes_total=268435456)
    resume = pb.Activity(kind="resume", name="resuming", tenant="alice", bytes_total=268435456)
    wait = pb.Activity(kind="wait", name="resuming: waiting for its devices", tenant="alice")
    assert progress.describe(suspend) == f"suspending alice's session ({why}), 268MB"
    assert progress.describe(resume) == "resuming alice's session, 268MB"
    assert progress.describe(wait) == "wait: resuming: waiting for its devices"
    compiling = pb.Activity(kind="compile", name="jit_step", tenant="carol")
    boss = pb.QueuedRequest(tenant="boss", waiting=pb.Waiting(holders=["alice (shared)", "carol (shared)"]))
    state = pb.ClusterState(activities=[suspend, resume, wait, compiling], queue=[boss])
    assert progress.shown(state, "boss") == [suspend]
    assert progress.shown(state, "alice") == [suspend, resume, wait]
    assert progress.shown(state, "carol") == [compiling]
