"""Client x server matrix: stock JAX clients 0.7.2 to 0.12 run ordinary programs on jaxlib 0.10.2 and 0.12 servers.

Each client is its own virtual environment (``make test`` builds them and passes
their pythons in ``PATHWAYS_*_PYTHON``) and runs tests/compat_client.py, which
needs no pathways-nb, from outside the checkout (whose egg-info would lend it our
jax plugin). The servers: this process's jaxlib 0.10.2 (the shared ``proxy_server``
and ``cluster`` fixtures) and jaxlib 0.12 on Python 3.12 (``pathways-nb proxy`` and
``pathways-nb up`` started from that venv), one per (server, mode) for all clients.
docs/compatibility.md shows the matrix.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import pytest

from pathways_nb.compat import stablehlo
from pathways_nb.protocol.errors import InvalidRequest
from pathways_nb.proxy import versions
from pathways_nb.testing import wait_until
from pathways_nb.worker import signature

CLIENT_PROGRAM = Path(__file__).with_name("compat_client.py")
PY312 = os.environ.get("PATHWAYS_PY312_PYTHON")
PY312_JAX = "0.12.0.1"  # the jax of that Python (make test's .venv-py312)
MAKE_HINT = "make test builds it (make compat-venvs)"
PY312_HINT = "install python3.12 (or pass PYTHON312=/path/to/python3.12), then make test builds it"
# Client jax version -> the Python that has it (None: not built here).
CLIENTS = {
    "0.7.2": os.environ.get("PATHWAYS_OLD_CLIENT_PYTHON"),
    "0.9.2": os.environ.get("PATHWAYS_JAX09_PYTHON"),
    jax.__version__: sys.executable,
    PY312_JAX: PY312,
}
SERVERS = {jax.__version__: sys.executable, PY312_JAX: PY312}
MODES = ("proxy", "cluster")
PROGRAMS = (
    "jit multiple_outputs scan grad sharded_put_1d sharded_put_2d sharded_jit_reduction donation bf16 "
    "device_to_device random read_back".split()
)


def _env() -> dict[str, str]:
    env = dict(os.environ, IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS="true")
    for name in ("JAX_PLATFORMS", "JAX_BACKEND_TARGET"):
        env.pop(name, None)
    return env


class _Py312Server:
    """``pathways-nb proxy`` or ``pathways-nb up`` run by the jaxlib 0.12 venv; its address read from its output."""

    def __init__(self, mode: str):
        self.directory = tempfile.TemporaryDirectory(prefix=f"pathways-compat-{mode}-")
        self.log_path = Path(self.directory.name) / "log"
        if mode == "proxy":
            port_file = Path(self.directory.name) / "port"
            arguments = ["proxy", "--server_port", "0", "--devices", "4", "--port_file", str(port_file)]
        else:
            port_file = None
            arguments = ["up", "--islands", "1", "--devices_per_host", "4", "--server_port", "0"]
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [PY312, "-m", "pathways_nb.cli", *arguments],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_env(),
                cwd=self.directory.name,
                start_new_session=True,
            )

        def address() -> str | None:
            if self.process.poll() is not None:
                raise RuntimeError(f"the jaxlib 0.12 {mode} ended while starting:\n{self.log()[-3000:]}")
            if port_file is not None:
                port = port_file.read_text().strip() if port_file.exists() else ""
                return f"grpc://127.0.0.1:{port}" if port else None
            found = re.search(r"cluster serving (grpc://\S+):", self.log())
            return found.group(1) if found else None

        try:
            self.address = wait_until(address, 120, f"the jaxlib 0.12 {mode} serving", interval_s=0.1)
        except TimeoutError:
            log = self.log()  # (close() removes it)
            self.close()
            raise RuntimeError(f"the jaxlib 0.12 {mode} did not start within 120 s:\n{log[-3000:]}") from None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # `up` stops its children on SIGTERM
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.directory.cleanup()


@pytest.fixture(scope="module")
def server_address(request):
    """``server_address(version, mode)``: one server per (version, mode), started at first use, for every client."""
    started: dict[tuple[str, str], _Py312Server] = {}

    def address(version: str, mode: str) -> str:
        if version == jax.__version__:
            return request.getfixturevalue("proxy_server" if mode == "proxy" else "cluster").address
        if (version, mode) not in started:
            started[version, mode] = _Py312Server(mode)
        return started[version, mode].address

    yield address
    for server in started.values():
        server.close()


def _needs(python: str | None, what: str, version: str) -> None:
    if not python:
        pytest.skip(f"no Python with {what}: {PY312_HINT if version == PY312_JAX else MAKE_HINT}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("server", SERVERS)
def test_client_runs_ordinary_programs(server, client, mode, server_address, tmp_path):
    _needs(SERVERS[server], f"jaxlib {server} for the server", server)
    _needs(CLIENTS[client], f"jax {client} for the client", client)
    result = subprocess.run(
        [CLIENTS[client], str(CLIENT_PROGRAM), server_address(server, mode)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    lines = result.stdout.splitlines()
    assert lines and lines[0].startswith(f"CLIENT jax {client} "), (result.stdout, result.stderr[-3000:])
    failures = [line for line in lines if line.startswith("FAIL ")]
    assert not failures, failures
    passed = [line.split()[1] for line in lines if line.startswith("PASS ")]
    assert passed == PROGRAMS and lines[-1] == "DONE", (result.stdout, result.stderr[-3000:])
    assert result.returncode == 0, result.stderr[-3000:]


def test_named_shardings_match_jax_0_12():
    """The named-sharding reader against jax 0.12's own NamedSharding, in the Python 3.12 venv."""
    _needs(PY312, "jax 0.12", PY312_JAX)
    tests = Path(__file__).parent
    result = subprocess.run(
        [PY312, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests / "test_named_op_sharding.py")],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tests.parent,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert re.search(r"\b11 passed\b", result.stdout), result.stdout[-3000:]


@pytest.mark.parametrize(
    ("offered", "chosen"),
    # What each stock client sends in GetVersion (protocol min, max, serialization min, max), measured.
    [((15, 16, 0, 0), (16, 0)), ((16, 25, 0, 3), (25, 3)), ((16, 25, 2, 6), (25, 3))],
    ids=["0.7.2", "0.10.2", "0.12.0.1"],
)
def test_every_client_s_version_range_gets_one_inside_it(offered, chosen):
    negotiated = versions.choose(*offered)
    assert (negotiated.protocol_version, negotiated.serdes_version) == chosen


def _artifact() -> bytes:
    """A StableHLO portable artifact of a small program, as this jaxlib writes one."""
    from jaxlib.mlir.dialects import stablehlo as mlir_stablehlo

    text = jax.jit(lambda a: a + 1).lower(jax.ShapeDtypeStruct((3,), "float32")).as_text()
    return mlir_stablehlo.serialize_portable_artifact_str(text, mlir_stablehlo.get_current_version())


def test_a_program_from_a_newer_stablehlo_is_refused_with_both_versions():
    program = _artifact()
    assert signature.read(program).args[0].shape == (3,)
    current = ".".join(map(str, stablehlo.server_version()))
    assert stablehlo.artifact_version(program) == stablehlo.server_version()
    # What this jaxlib cannot parse, from a writer that says it targeted a newer StableHLO.
    newer = program.replace(current.encode(), f"{int(current.split('.')[0]) + 1}.0.0".encode(), 1)
    broken = newer[: len(newer) // 2]
    with pytest.raises(
        InvalidRequest, match=f"newer than this server's jaxlib {jax.__version__} reads .*Upgrade the server"
    ):
        signature.read(broken)
    with pytest.raises(InvalidRequest, match="not a StableHLO portable artifact"):
        signature.read(program[: len(program) // 2])
