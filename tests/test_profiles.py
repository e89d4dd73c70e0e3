"""Device profiles: pathwaysutils' route as on Pathways on Cloud, and ``pathways_nb.profile`` / ``%%pathways profile``.

pathwaysutils 0.1.13 runs unchanged in a process of its own (it patches ``jax.profiler``): only its
client-side export is pointed at a local directory, since jaxlib's own gs:// file system cannot
write offline (pathwaysutils keeps the originals as ``profiling._original_start_trace``).
"""

from __future__ import annotations

import gzip
import json
import re
import uuid
from pathlib import Path

import jax
import numpy as np
import pytest
from jax import numpy as jnp
from jax.profiler import ProfileData
from pathwaysutils.plugin_executable import PluginExecutable

from pathways_nb.testing import KernelSession, python_script, wait_until

PATHWAYSUTILS = Path(__file__).with_name("clients") / "pathwaysutils_profiles.py"


def _xla_ops(path: Path) -> dict[int, set[str]]:
    """The XLA ops of a worker's trace file, by the device ordinal that ran them (parsed by jaxlib)."""
    ops: dict[int, set[str]] = {}
    for plane in ProfileData.from_file(str(path)).planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if "hlo_op" in stats:
                    ops.setdefault(int(stats["device_ordinal"]), set()).add(str(stats["hlo_op"]))
    return ops


def test_pathwaysutils_profiles_every_worker_into_one_session_directory(cluster):
    client = python_script(
        PATHWAYSUTILS,
        cluster.storage_root,
        env={"JAX_PLATFORMS": "proxy", "JAX_BACKEND_TARGET": cluster.address},
    )
    out, err = client.communicate(timeout=300)
    assert client.returncode == 0, err[-4000:]
    report = json.loads(out.splitlines()[-1])
    assert "already being taken" in report["double_start"]
    assert "a trace is already running on island0-host0" in report["second_start"], report
    for session in ("first", "second"):
        directory = Path(cluster.storage_root) / "bucket" / "run" / "plugins" / "profile" / session
        names = sorted(p.name for p in directory.glob("*.xplane.pb"))
        assert {"island0-host0.xplane.pb", "island1-host0.xplane.pb", "proxy.xplane.pb"} <= set(names), names
        assert "resource-manager.xplane.pb" in names, names
        for island in (0, 1):
            ops = _xla_ops(directory / f"island{island}-host0.xplane.pb")
            # The first device of the island (local ordinal 0) ran the step's dot and tanh.
            assert any("tanh" in op for op in ops[0]) and len(ops[0]) >= 2, ops


def _execute(executable: PluginExecutable) -> str:
    default = jax.devices("proxy")[0]
    out_avals = [jax.core.ShapedArray((1,), jnp.object_)]
    arrays, status = executable.call(out_avals=out_avals, out_shardings=[jax.sharding.SingleDeviceSharding(default)])
    status.result(timeout=120)
    return str(np.asarray(arrays[0])[0])


def _request(location: str, **more) -> str:
    request = {"traceLocation": location, "maxNumHosts": 1, "xprofTraceOptions": {"traceSessionName": "s"}, **more}
    return json.dumps({"profileRequest": request})


def test_a_place_outside_the_storage_root_is_refused(backend, connected, tmp_path):
    executable = PluginExecutable(_request(str(tmp_path / "elsewhere")))
    with pytest.raises(Exception, match=r"PERMISSION_DENIED.*outside this server's storage root"):
        _execute(executable)
    assert not (tmp_path / "elsewhere").exists()
    # Nothing was left running: a trace into the root starts and stops.
    executable = PluginExecutable(_request(f"gs://bucket/{uuid.uuid4().hex}"))
    assert _execute(executable).startswith("tracing")
    assert _execute(executable).endswith(".xplane.pb")


def test_max_duration_stops_the_trace_by_itself(backend, connected):
    run = uuid.uuid4().hex
    executable = PluginExecutable(_request(f"gs://bucket/{run}", maxDurationSecs=0.5))
    _execute(executable)
    written = Path(backend.storage_root) / "bucket" / run / "plugins" / "profile" / "s" / "island0-host0.xplane.pb"
    wait_until(written.exists, 60, f"{written} written after maxDurationSecs", interval_s=0.1)
    assert _execute(executable) == str(written.resolve())  # the stop reports what was written
    assert _execute(executable).startswith("tracing")  # and the next execution starts again
    _execute(executable)


@pytest.fixture(scope="module")
def kernel(kernel_installed, cluster):
    session = KernelSession("pathways")
    out = session.run(f"%pathways connect {cluster.address} --token {cluster.token}")
    assert not out["errors"], out
    out = session.run(
        "import jax, jax.numpy as jnp, numpy as np, pathways_nb\n"
        "step = jax.jit(lambda w, x: w - 0.01 * jnp.tanh(x @ w))\n"
        "firsts = [jax.devices()[0], jax.devices()[4]]\n"
        "ws = [jax.device_put(np.ones((64, 64), np.float32), d) for d in firsts]\n"
        "xs = [jax.device_put(np.ones((64, 64), np.float32), d) for d in firsts]\n"
        "def train(n=3):\n"
        "    global ws\n"
        "    for _ in range(n):\n"
        "        ws = [step(w, x) for w, x in zip(ws, xs)]\n"
        "    jax.block_until_ready(ws)\n"
        "train()"
    )
    assert not out["errors"], out
    yield session
    session.close()


def _device_rows(svg: str) -> set[str]:
    return set(re.findall(r'class="pw-bar pw-op" data-device="(\d+)"', svg))


def test_profile_in_a_kernel_shows_both_islands_devices(kernel, tmp_path):
    out = kernel.run(
        f"with pathways_nb.profile({str(tmp_path)!r}) as run:\n"
        "    train()\n"
        "print(sorted(p.name for p in run.files))\n"
        "print(run.trace.slowest_ops(3).to_json(orient='records'))\n"
        "run"
    )
    assert not out["errors"], out
    names, slowest = out["stdout"].strip().splitlines()[-2:]
    assert "island0-host0.xplane.pb" in names and "island1-host0.xplane.pb" in names and "client-" in names
    assert json.loads(slowest)[0]["program"].startswith("jit_")
    html = out["data"][-1]["text/html"]
    assert {"0", "4"} <= _device_rows(html), "ops on both islands' devices"
    assert "xprof --logdir" in html
    (session_dir,) = (tmp_path / "plugins" / "profile").iterdir()
    trace = json.loads(gzip.open(session_dir / "perfetto_trace.json.gz").read())
    assert {e["tid"] for e in trace["traceEvents"] if e.get("ph") == "X"} >= {0, 4}

    # The live timeline draws the profiled step's device spans beside the proxy's events.
    out = kernel.run("%pathways timeline")
    (model,) = out["widgets"]
    svg = kernel.widget_state(model)["value"]
    assert {"0", "4"} <= _device_rows(svg) and "pw-execute" in svg


def test_profile_cell_magic(kernel, tmp_path):
    out = kernel.run(f"%%pathways profile {tmp_path} --no_servers\ntrain(2)")
    assert not out["errors"], out
    assert "trace files in" in out["stdout"] and "xprof --logdir" in out["stdout"]
    assert {"0", "4"} <= _device_rows(out["data"][-1]["text/html"])
    (session_dir,) = (tmp_path / "plugins" / "profile").iterdir()
    assert not (session_dir / "proxy.xplane.pb").exists()
    out = kernel.run("%pathways profile /tmp/x")
    assert "is a cell magic" in out["stderr"] + out["stdout"]
