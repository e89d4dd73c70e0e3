"""User Python beside the devices: ``jax.experimental.colocated_python``, stock client, a 2-island cluster.

Each client runs in a child process (its JAX must talk to this cluster only) from a script that
prints JSON lines; the test reads them. Where this machine lets executors run as users of their
own (root, and a Python other users can read), the cluster's executors do.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import tempfile
import time

import numpy as np
import psutil
import pytest

from pathways_nb.core import shared_memory
from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.testing import other_users_python, python_process

CLIENT_TIMEOUT_S = 300
DEADLINE_S = 60

PRELUDE = """
import json, os, sys, time, jax, numpy as np, pathways_nb
from jax.experimental import colocated_python as cp

def say(**values):
    print(json.dumps(values), flush=True)

pathways_nb.connect(sys.argv[1], token=sys.argv[2], tenant=sys.argv[3])
cpus = cp.colocated_cpu_devices(jax.devices())
"""


@pytest.fixture
def open_directory():
    """A directory every user may write in (executors run as users of their own), removed afterwards.

    Not under pytest's ``tmp_path``, whose parents only this user may enter.
    """
    directory = tempfile.mkdtemp(prefix="pathways-nb-test-")
    os.chmod(directory, 0o777)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def start_client(cluster: LocalCluster, body: str, tenant: str = "tenant-a", *args: str):
    return python_process(PRELUDE + body, cluster.address, cluster.token, tenant, *args)


def run_client(cluster: LocalCluster, body: str, tenant: str = "tenant-a", *args: str) -> list[dict]:
    """Runs ``body`` as a client of ``cluster``; the JSON lines it printed."""
    process = start_client(cluster, body, tenant, *args)
    out, err = process.communicate(timeout=CLIENT_TIMEOUT_S)
    assert process.returncode == 0, f"client failed:\n{err[-4000:]}"
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def executors(cluster: LocalCluster) -> list[psutil.Process]:
    """The executors the cluster's colocated hosts run now."""
    found = []
    for host in cluster.colocated_hosts.values():
        for child in psutil.Process(host.process.pid).children():
            try:
                if "pathways_nb.executor" in " ".join(child.cmdline()):
                    found.append(child)
            except psutil.NoSuchProcess:
                pass
    return found


def test_each_device_has_a_colocated_cpu_device_and_jax_devices_is_unchanged(colocated_cluster):
    (result,) = run_client(
        colocated_cluster,
        """
devices = jax.devices()
x = jax.device_put(np.arange(6.0), devices[3])
on_cpu = jax.device_put(x, cpus[3])
back = jax.device_put(on_cpu * 2, devices[3])
say(devices=[d.id for d in devices], local_count=jax.local_device_count(),
    kinds=sorted({d.device_kind for d in devices}), cpus=[d.id for d in cpus],
    cpu_kinds=sorted({d.device_kind for d in cpus}),
    pairs=[[d.colocation_id, c.colocation_id] for d, c in zip(devices, cpus)],
    islands=[c.slice_index for c in cpus], on_cpu=[d.id for d in on_cpu.devices()],
    back=np.asarray(back).tolist())
""",
    )
    assert result["devices"] == [0, 1, 2, 3] and result["local_count"] == 4
    assert result["kinds"] == ["cpu accelerator"]
    assert result["cpus"] == [4, 5, 6, 7] and result["cpu_kinds"] == ["cpu"]
    assert all(a == b for a, b in result["pairs"])
    assert result["islands"] == [0, 0, 1, 1]
    assert result["on_cpu"] == [7]
    assert result["back"] == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]


def test_an_unspecialized_function_compiles_three_programs_then_runs_one(colocated_cluster):
    lines = run_client(
        colocated_cluster,
        """
from jax.extend.ifrt_programs import ifrt_programs
compiled = []
make = ifrt_programs.make_colocated_python_program
def counting(name, *args, **kwargs):
    compiled.append(name)
    return make(name, *args, **kwargs)
ifrt_programs.make_colocated_python_program = counting

@cp.colocated_python
def stats(x):
    import builtins
    builtins.runs = getattr(builtins, "runs", 0) + 1
    return {"double": x * 2, "sum": x.sum(keepdims=True),
            "runs": jax.device_put(np.int32(builtins.runs), x.sharding)}

x = jax.device_put(np.arange(4.0, dtype=np.float32), cpus[1])
first = jax.tree.map(np.asarray, stats(x))
say(call=1, compiled=list(compiled), double=first["double"].tolist(), sum=first["sum"].tolist(),
    runs=int(first["runs"]))
second = jax.tree.map(np.asarray, stats(x + 1))
say(call=2, compiled=list(compiled), double=second["double"].tolist(), runs=int(second["runs"]))
""",
    )
    first, second = lines
    assert first["compiled"] == ["stats_output_specs_and_push_result", "stats", "stats_pop_result"]
    assert first["double"] == [0.0, 2.0, 4.0, 6.0] and first["sum"] == [6.0] and first["runs"] == 1
    assert second["compiled"] == first["compiled"]  # the second call runs the function alone
    assert second["double"] == [2.0, 4.0, 6.0, 8.0] and second["runs"] == 2


def test_specialize_runs_one_program_with_the_given_output_specs(colocated_cluster):
    (result,) = run_client(
        colocated_cluster,
        """
def scaled(x, factor):
    return x * factor

call = cp.colocated_python(scaled).specialize(out_specs_fn=lambda x, factor: x)
x = jax.device_put(np.ones((2, 3), np.float32), cpus[2])
f = jax.device_put(np.float32(3), cpus[2])
outs = [call(x, f) for _ in range(3)]         # asynchronous: results are futures
say(values=[np.asarray(o).tolist() for o in outs], devices=[d.id for d in outs[0].devices()])
""",
    )
    assert result["values"] == [[[3.0] * 3] * 2] * 3
    assert result["devices"] == [6]


def test_a_colocated_class_keeps_its_state_across_calls(colocated_cluster):
    (result,) = run_client(
        colocated_cluster,
        """
@cp.colocated_python_class
class Accumulator:
    def __init__(self, start):
        self.total = start

    def add(self, x):
        self.total = self.total + float(np.asarray(x).sum())
        return jax.device_put(np.float32(self.total), x.sharding)

acc = Accumulator(10.0)
x = jax.device_put(np.ones(4, np.float32), cpus[0])
totals = [float(np.asarray(acc.add(x))) for _ in range(3)]
other = Accumulator(0.0)
say(totals=totals, other=float(np.asarray(other.add(x))))
""",
    )
    assert result["totals"] == [14.0, 18.0, 22.0]
    assert result["other"] == 4.0


def test_asynchronous_calls_run_in_the_order_the_session_made_them(colocated_cluster):
    (result,) = run_client(
        colocated_cluster,
        """
@cp.colocated_python_class
class Log:
    def __init__(self):
        self.items = []

    def append(self, x):
        self.items.append(float(np.asarray(x)[0]))
        return x

    def contents(self, x):
        return jax.device_put(np.array(self.items, np.float32), x.sharding)

log = Log()
x = jax.device_put(np.zeros(1, np.float32), cpus[2])
np.asarray(log.append(x))                             # the first call finds the output specs
pending = [log.append(x + i) for i in range(1, 13)]   # asynchronous, arguments ready at any time
say(items=np.asarray(log.contents(x)).tolist())
""",
    )
    assert result["items"] == [float(i) for i in range(13)]


def test_an_exception_raised_remotely_arrives_with_its_message_and_traceback(colocated_cluster):
    result, after = run_client(
        colocated_cluster,
        """
@cp.colocated_python
def fails(x):
    raise ValueError("the input pipeline ran dry")

x = jax.device_put(np.ones(2, np.float32), cpus[0])
try:
    np.asarray(fails(x))
    say(raised=None)
except Exception as error:
    say(raised=type(error).__name__, message=str(error))
ok = cp.colocated_python(lambda x: x + 1)
say(after=np.asarray(ok(x)).tolist())
""",
    )
    assert result["raised"] == "JaxRuntimeError"
    assert "ValueError: the input pipeline ran dry" in result["message"]
    assert "Remote traceback" in result["message"] and "in fails" in result["message"]
    assert after["after"] == [2.0, 2.0]  # the executor keeps serving


def test_an_executor_killed_mid_call_fails_that_call_only_and_the_next_call_works(colocated_cluster):
    process = start_client(
        colocated_cluster,
        """
@cp.colocated_python
def pid_or_wait(x):
    import os, pathlib, time
    if float(np.asarray(x)[0]) > 0:
        pathlib.Path("running").write_text("")
        time.sleep(300)
    return jax.device_put(np.float32(os.getpid()), x.sharding)

zero = jax.device_put(np.zeros(1, np.float32), cpus[3])
say(pid=int(np.asarray(pid_or_wait(zero))))
try:
    np.asarray(pid_or_wait(zero + 1))
    say(raised=None)
except Exception as error:
    say(raised=type(error).__name__, message=str(error))
say(after=int(np.asarray(pid_or_wait(zero))))
""",
    )
    first = json.loads(process.stdout.readline())
    marker = f"/proc/{first['pid']}/cwd/running"
    deadline = time.monotonic() + DEADLINE_S
    while not os.path.exists(marker):
        assert time.monotonic() < deadline, "the executor never started the long call"
        time.sleep(0.05)
    os.kill(first["pid"], signal.SIGKILL)
    out, err = process.communicate(timeout=CLIENT_TIMEOUT_S)
    assert process.returncode == 0, err[-4000:]
    failed, after = (json.loads(line) for line in out.splitlines())
    assert failed["raised"] == "JaxRuntimeError"
    assert "killed by signal SIGKILL" in failed["message"] and "pid_or_wait" in failed["message"]
    assert after["after"] != first["pid"]  # a new executor
    assert all(w.alive() for w in colocated_cluster.workers.values())


def test_two_tenants_executors_see_neither_each_others_globals_nor_files_nor_output(colocated_cluster, open_directory):
    meeting = open_directory  # where each tenant's executor says where its files are
    body = """
role, meeting = sys.argv[4], sys.argv[5]

@cp.colocated_python
def visit(x):
    import builtins, os, pathlib
    print(f"tenant {role} was here", file=sys.stderr)  # printed by its own client only
    seen = getattr(builtins, "secret", None)
    builtins.secret = role
    pathlib.Path("secret.txt").write_text(role)
    pathlib.Path(meeting, role).write_text(os.getcwd())
    outcome = "none"
    for other in pathlib.Path(meeting).iterdir():
        if other.name != role:
            try:
                pathlib.Path(other.read_text(), "secret.txt").read_text()
                outcome = "read"
            except OSError as error:
                outcome = type(error).__name__
    codes = {"none": 0, "read": 1, "PermissionError": 2}
    return jax.device_put(np.array([seen is None, codes.get(outcome, 3), os.getuid()], np.float64), x.sharding)

x = jax.device_put(np.zeros(1, np.float32), cpus[0])
with jax.enable_x64(True):
    fresh, outcome, uid = np.asarray(visit(x)).tolist()
say(fresh=fresh, outcome=outcome, uid=uid)
sys.stdin.readline()  # the session (and its executor) lives until the test says
"""
    a = start_client(colocated_cluster, body, "tenant-a", "a", meeting)
    clients = [a]
    try:
        first = json.loads(a.stdout.readline())  # a's executor has written its file, and lives on
        clients.append(b := start_client(colocated_cluster, body, "tenant-b", "b", meeting))
        second = json.loads(b.stdout.readline())
    finally:
        errors = [process.communicate("\n", timeout=CLIENT_TIMEOUT_S)[1] for process in clients]
    assert first["fresh"] == second["fresh"] == 1.0  # neither saw the other's globals
    for role, other, error in (("a", "b", errors[0]), ("b", "a", errors[1])):
        assert f"[island 0 host 0] tenant {role} was here" in error and f"tenant {other} was here" not in error
    if other_users_python() is None:
        pytest.skip("executors share this host's user here: files are not kept apart (docs/colocated_python.md)")
    assert first["uid"] != second["uid"] and 0 not in (first["uid"], second["uid"])
    assert first["outcome"] == 0.0 and second["outcome"] == 2.0  # b found a's directory and was refused


def test_an_executor_has_no_cluster_token_nor_the_workers_files_and_ends_with_its_session(colocated_cluster):
    process = start_client(
        colocated_cluster,
        """
workers_directory = sys.argv[4]  # the workers' shared memory: other tenants' arrays pass there

@cp.colocated_python
def probe(x):
    import os
    try:
        os.listdir(workers_directory)
        workers_files = 1
    except PermissionError:
        workers_files = 0
    return jax.device_put(np.array(
        [os.getpid(), "PATHWAYS_CLUSTER_TOKEN" in os.environ, len(os.environ), workers_files], np.float32), x.sharding)

x = jax.device_put(np.zeros(1, np.float32), cpus[1])
pid, has_token, variables, workers_files = np.asarray(probe(x)).tolist()
say(pid=int(pid), has_token=bool(has_token), variables=int(variables), workers_files=bool(workers_files))
pathways_nb.disconnect()
try:
    np.asarray(probe(x))
    say(after_disconnect=None)
except Exception as error:
    say(after_disconnect=type(error).__name__)
sys.stdin.readline()
""",
        "tenant-a",
        str(shared_memory.private_root()),
    )
    probed = json.loads(process.stdout.readline())
    assert not probed["has_token"] and probed["variables"] < 12
    if other_users_python() is not None:
        assert not probed["workers_files"]
    assert json.loads(process.stdout.readline())["after_disconnect"] is not None  # refused once the session ended
    deadline = time.monotonic() + DEADLINE_S
    while psutil.pid_exists(probed["pid"]):
        assert time.monotonic() < deadline, "the session ended but its executor lives on"
        time.sleep(0.05)
    process.communicate("\n", timeout=CLIENT_TIMEOUT_S)


def test_a_call_over_several_hosts_colocated_devices_is_refused_with_what_to_do(colocated_cluster):
    (result,) = run_client(
        colocated_cluster,
        """
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
both_islands = NamedSharding(Mesh(np.array(cpus), ("x",)), P("x"))
x = jax.device_put(np.arange(8, dtype=np.float32), both_islands)
try:
    np.asarray(cp.colocated_python(lambda x: x * 2)(x))
    say(raised=None)
except Exception as error:
    say(raised=type(error).__name__, message=str(error))
""",
    )
    assert result["raised"] == "JaxRuntimeError"
    assert "INVALID_ARGUMENT" in result["message"] and "several hosts" in result["message"]
    assert "call the function once per host" in result["message"]


def test_colocated_programs_are_refused_where_the_cluster_runs_no_colocated_python(cluster):
    code = """
import json, sys, jax, numpy as np, pathways_nb
from jax.experimental import colocated_python as cp
pathways_nb.connect(sys.argv[1], token=sys.argv[2])
x = jax.device_put(np.ones(2, np.float32), jax.devices()[0])
try:
    np.asarray(cp.colocated_python(lambda x: x)(x))
    print(json.dumps({"raised": None}))
except Exception as error:
    print(json.dumps({"raised": type(error).__name__, "message": str(error)}))
"""
    process = python_process(code, cluster.address, cluster.token)
    out, err = process.communicate(timeout=CLIENT_TIMEOUT_S)
    assert process.returncode == 0, err[-4000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["raised"] == "JaxRuntimeError"
    assert "colocated Python is off on this cluster" in result["message"]
    assert "--colocated_python" in result["message"]


ORBAX_CLIENT = """
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
os.umask(0)  # directories this client makes, the executors (other users) write into
path, save = sys.argv[4], sys.argv[5] == "save"
mesh = Mesh(np.array(jax.devices()[:2]), ("x",))  # island 0's devices
tree = {
    "w": jax.device_put(np.arange(16, dtype=np.float32).reshape(4, 4), NamedSharding(mesh, P("x"))),
    "b": jax.device_put(np.array([1.5, -2.0], np.float32), NamedSharding(mesh, P())),
}
ocp.pathways.register_type_handlers()       # its default dispatcher: colocated Python
checkpointer = ocp.PyTreeCheckpointer()
if save:
    checkpointer.save(path, tree)
restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding), tree)
restored = checkpointer.restore(path, restore_args=restore_args)
say(restored={k: np.asarray(v).tolist() for k, v in restored.items()},
    shardings_kept=all(restored[k].sharding == tree[k].sharding for k in tree))
"""

LOCAL_ORBAX = """
import json, sys, jax, numpy as np, orbax.checkpoint as ocp
on_cpu = ocp.ArrayRestoreArgs(sharding=jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0]))
restored = ocp.PyTreeCheckpointer().restore(sys.argv[1], restore_args={"w": on_cpu, "b": on_cpu})
print(json.dumps({k: np.asarray(v).tolist() for k, v in restored.items()}))
"""


def test_orbax_pathways_handlers_save_and_restore_through_colocated_python_as_local_orbax_does(
    colocated_cluster, open_directory
):
    path = os.path.join(open_directory, "checkpoint")  # the executors write there as users of their own
    expected = {"w": np.arange(16, dtype=np.float32).reshape(4, 4).tolist(), "b": [1.5, -2.0]}
    (saved,) = run_client(colocated_cluster, ORBAX_CLIENT, "tenant-a", path, "save")
    assert saved["restored"] == expected and saved["shardings_kept"]
    # The arrays' bytes were written beside the devices, by the executor, not by the client.
    owners = {p.stat().st_uid for p in pathlib.Path(path).rglob("*") if p.is_file() and "ocdbt.process" in str(p)}
    assert owners and (other_users_python() is None or 0 not in owners)
    # A later session (another executor, another user) restores it.
    (later,) = run_client(colocated_cluster, ORBAX_CLIENT, "tenant-a", path, "restore")
    assert later["restored"] == expected and later["shardings_kept"]
    # It is an ordinary Orbax checkpoint: local Orbax (no cluster) reads the same values.
    local = python_process(LOCAL_ORBAX, path, env={"JAX_PLATFORMS": "cpu"})
    out, err = local.communicate(timeout=CLIENT_TIMEOUT_S)
    assert local.returncode == 0, err[-4000:]
    assert json.loads(out.strip().splitlines()[-1]) == expected
