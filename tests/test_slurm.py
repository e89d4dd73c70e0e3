"""pathways-nb on a real Slurm: ``deploy slurm`` + ``sbatch``, ``salloc`` + ``up --slurm``, ``scancel``, dead steps.

One Slurm serves the whole run (Debian's 22.05: a private munged, slurmctld, and slurmd
n1..n3 at 127.0.0.1..3, ``pathways_nb.testing.slurm``), and the tests share as few jobs as
they can: a batch job of 2 islands of 1 host serves two tests, then holds n1 and n2 while a
``SlurmCluster`` of 1 island of 2 hosts, submitted from a kernel, waits in the queue behind it
until the test cancels it; ``salloc -N 3`` runs last. No test mocks Slurm.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pathways_nb.cli import main
from pathways_nb.client.observe import Observer
from pathways_nb.deploy import slurm as deploy_slurm
from pathways_nb.launch import connection_files
from pathways_nb.testing import KernelSession, finish, finished_ok, python_script, wait_until
from pathways_nb.testing.slurm import LocalSlurm, unavailable
from pathways_nb.testing.tls import certificates

# A job's cluster starts in 10-30 s on a busy 2-core machine (each server imports jax).
START_TIMEOUT_S = 240
# How soon after scancel every process of a job must be gone.
GONE_WITHIN_S = 10


@pytest.fixture(scope="session")
def slurm():
    reason = unavailable()
    if reason:
        if os.environ.get("REQUIRE_ALL"):
            pytest.fail(f"{reason} (an error: REQUIRE_ALL is set)")
        pytest.skip(reason)
    cluster = LocalSlurm(nodes=3).start()
    try:
        yield cluster
    finally:
        killed = cluster.stop()
    assert not killed, f"processes outlived their Slurm jobs and the daemons: {killed}"


@dataclass
class BatchJob:
    job_id: str
    directory: pathlib.Path
    address: str
    token: str | None


def _submit(slurm: LocalSlurm, directory: pathlib.Path, *flags: str) -> BatchJob:
    """``pathways-nb deploy slurm FLAGS`` then ``sbatch``; returns once the job's cluster serves."""
    assert main(["deploy", "slurm", *flags, "--output", str(directory)]) == 0
    job_id = slurm.run("sbatch", "--parsable", str(directory / deploy_slurm.SCRIPT_FILE)).stdout.strip()
    address_file = directory / connection_files.ADDRESS_FILE

    def progress() -> dict:
        state = slurm.job_state(job_id)
        if state not in ("PENDING", "CONFIGURING", "RUNNING"):
            output = directory / f"slurm-{job_id}.out"
            raise AssertionError(f"job {job_id} is {state}: {output.read_text() if output.exists() else ''}")
        return {"job": state, "address file": address_file.exists()}

    wait_until(progress, START_TIMEOUT_S, f"job {job_id}'s cluster serving", holds=lambda seen: seen["address file"])
    return BatchJob(job_id, directory, *connection_files.read(address_file))


def _cancel(slurm: LocalSlurm, job_id: str) -> float:
    """``scancel``; the seconds until no process of the job is left (at most ``GONE_WITHIN_S``)."""
    started = time.monotonic()
    slurm.run("scancel", job_id)
    _wait_gone(slurm, job_id)
    return time.monotonic() - started


def _wait_gone(slurm: LocalSlurm, job_id: str) -> None:
    """Waits until no process of job ``job_id`` is left, ``GONE_WITHIN_S`` at most."""
    wait_until(
        lambda: slurm.processes(job_id),
        GONE_WITHIN_S,
        f"every process of job {job_id} ended",
        holds=lambda left: not left,
    )


def _steps(slurm: LocalSlurm, job_id: str) -> dict[str, tuple[str, str]]:
    """The job's steps by name: (step id, node)."""
    lines = slurm.run("squeue", "-h", "-s", "-j", job_id, "-o", "%i %j %N").stdout.splitlines()
    return {name: (step, node) for step, name, node in (line.split() for line in lines)}


def _client_env(slurm: LocalSlurm) -> dict[str, str]:
    return {"SLURM_CONF": slurm.conf}


# -- the script, without a Slurm -------------------------------------------------------------


@pytest.mark.parametrize(
    "flags",
    [
        ["--islands", "2", "--hosts_per_island", "1", "--devices_per_host", "4"],
        ["--islands", "1", "--hosts_per_island", "2", "--devices_per_host", "8", "--gpus_per_node", "8"],
        ["--islands", "2", "--hosts_per_island", "2", "--devices_per_host", "2", "--colocated_python"],
    ],
    ids=["cpu", "gpus", "colocated"],
)
def test_the_script_is_valid_bash_that_asks_slurm_for_one_node_per_host(flags, tmp_path):
    limits = ["--partition", "batch", "--time", "1:00:00"]
    assert main(["deploy", "slurm", *flags, *limits, "--output", str(tmp_path)]) == 0
    script = tmp_path / deploy_slurm.SCRIPT_FILE
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    shape = dict(zip(flags[::2], flags[1::2], strict=False))
    nodes = int(shape["--islands"]) * int(shape["--hosts_per_island"])
    directives = re.findall(r"^#SBATCH (\S+)$", text, re.MULTILINE)
    assert f"--nodes={nodes}" in directives and "--partition=batch" in directives and "--time=1:00:00" in directives
    assert f"--output={tmp_path}/slurm-%j.out" in directives
    gpus = "--gpus_per_node" in flags
    assert ("--gres=gpu:8" in directives) == gpus
    (command,) = [line for line in text.splitlines() if line.startswith("exec ")]
    arguments = command.split()[1:]
    assert arguments[:5] == [sys.executable, "-m", "pathways_nb.cli", "up", "--slurm"]
    assert f"--platform={'cuda' if gpus else 'cpu'}" in arguments and f"--output={tmp_path}" in arguments
    assert ("--colocated_python" in arguments) == ("--colocated_python" in flags)
    # What runs in the job is a command pathways-nb accepts.
    from pathways_nb.cli import build_parser

    parsed = build_parser().parse_args(arguments[3:])
    assert (parsed.islands, parsed.hosts_per_island, parsed.slurm) == (
        int(shape["--islands"]),
        int(shape["--hosts_per_island"]),
        True,
    )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        # The shapes deploy k8s refuses (tests/test_kubernetes.py), in the same words.
        ({"--islands": "0"}, "each must be at least 1"),
        ({"--devices_per_host": "0"}, "each must be at least 1"),
        ({"--gpus_per_node": "8"}, "does not match --gpus_per_node 8, whose hosts have 8 chips"),
        ({"--gpus_per_node": "4", "--devices_per_host": "4", "--colocated_python": None}, "needs CPU workers"),
        # What an #SBATCH line cannot hold.
        ({"--partition": "gpu batch"}, "cannot go on an #SBATCH line"),
        ({"--gpus_per_node": "-1"}, "use 0 (CPU workers) or more"),
        ({"--tls_cert": "cert.pem", "--tls_key": "key.pem"}, "--tls_ca go together for a whole cluster"),
    ],
)
def test_impossible_shapes_are_refused_saying_what_to_do(changes, message, tmp_path, capsys):
    flags = {"--islands": "2", "--hosts_per_island": "1", "--devices_per_host": "2", **changes}
    arguments = [word for flag, value in flags.items() for word in (flag, value) if word is not None]
    with pytest.raises(SystemExit) as exit_info:
        main(["deploy", "slurm", *arguments, "--output", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# -- a batch job of 2 islands ----------------------------------------------------------------

CLIENTS = pathlib.Path(__file__).with_name("clients")
# One program on every island, compared bitwise with this machine's JAX (both sides run the same XLA).
SAME_ON_EVERY_ISLAND = CLIENTS / "same_on_every_island.py"


@pytest.fixture(scope="module")
def islands_job(slurm, tmp_path_factory):
    """2 islands of 1 host of 2 CPU devices, a batch job on n1 and n2 (the queued-cluster test ends it)."""
    shape = ["--islands", "2", "--hosts_per_island", "1", "--devices_per_host", "2"]
    job = _submit(slurm, tmp_path_factory.mktemp("islands"), *shape)
    yield job
    if slurm.job_state(job.job_id) in ("PENDING", "RUNNING"):
        _cancel(slurm, job.job_id)


def test_a_batch_job_serves_both_islands_from_its_nodes(slurm, islands_job):
    steps = _steps(slurm, islands_job.job_id)
    # The resource manager and the proxy on the first node, a worker on each node: steps of the one job.
    assert {name: node for name, (_step, node) in steps.items()} == {
        "batch": "n1",
        "resource-manager": "n1",
        "proxy": "n1",
        "worker-0-0": "n1",
        "worker-1-0": "n2",
    }
    assert islands_job.address.startswith("grpc://127.0.0.1:")  # n1's NodeAddr
    assert (islands_job.directory / connection_files.TOKEN_FILE).stat().st_mode & 0o777 == 0o600
    # A stock client (pathways_nb.connect of the address file), results bitwise equal to local JAX's.
    address_file = str(islands_job.directory / connection_files.ADDRESS_FILE)
    report = json.loads(finished_ok(python_script(SAME_ON_EVERY_ISLAND, address_file)).splitlines()[-1])
    assert report == {"hosts": ["127.0.0.1", "127.0.0.2"], "same": {"0": True, "1": True}}


def _worker(observer: Observer, worker_id: str):
    return next((w for w in observer.state().workers if w.worker_id == worker_id), None)


def test_a_worker_step_killed_costs_its_island_until_the_step_is_started_again(slurm, islands_job):
    client = python_script(
        CLIENTS / "work_through_a_killed_worker_step.py",
        islands_job.address,
        env={"PATHWAYS_CLUSTER_TOKEN": islands_job.token},
    )
    observer = Observer(islands_job.address, islands_job.token)
    try:
        assert json.loads(client.stdout.readline() or "{}") == {"before": 6.0}, client.stderr.read()[-3000:]
        old_pid = _worker(observer, "island1-host0").pid
        step, node = _steps(slurm, islands_job.job_id)["worker-1-0"]
        assert node == "n2"
        slurm.run("scancel", "--signal=KILL", step, check=False)  # (22.05 says "error ... No error" and does it)
        wait_until(
            lambda: _worker(observer, "island1-host0"),
            60,
            "the resource manager saying island 1 is down, and why",
            holds=lambda w: w and not w.healthy and "Slurm node n2" in w.down_reason,
        )
        client.stdin.write("\n")
        client.stdin.flush()
        report = json.loads(client.stdout.readline() or "{}")
        for work in ("kept", "new"):  # an array it held, and new work on its island
            assert "DATA_LOSS" in report[work].get("error", "") and "island 1 host 0" in report[work]["error"], report
        assert "killed by signal SIGKILL on Slurm node n2" in report["new"]["error"], report
        assert report["island0"] == {"value": [2.0] * 3}  # the other island kept serving
        # A new step on n2, whose worker registers: the island is back.
        wait_until(
            lambda: _worker(observer, "island1-host0"),
            120,
            "island 1's worker healthy again, a new process",
            holds=lambda w: w and w.healthy and w.pid != old_pid,
        )
        assert _steps(slurm, islands_job.job_id)["worker-1-0"][1] == "n2"
        client.stdin.write("\n")
        client.stdin.flush()
        out, err = finish(client, 120)
        assert json.loads(out.splitlines()[-1]) == {"fresh": {"value": [42.0] * 3}}, err[-3000:]
    finally:
        observer.close()
        client.kill()
        client.communicate()


# -- a SlurmCluster from a kernel, queued behind that job --------------------------------------

SUBMIT = """
import pathways_nb
cluster = pathways_nb.SlurmCluster(islands=1, hosts_per_island=2, devices_per_host=2, directory={directory!r},
                                   timeout_s={timeout})
print(cluster)
"""

ACROSS_TWO_NODES = """
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
session = cluster.connect(progress=False)
x = jax.device_put(np.arange(8, dtype=np.float32), NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x")))
print(sorted({d.host_index for d in jax.devices()}), len({d.host.rsplit(":", 1)[0] for d in jax.devices()}),
      float(jax.jit(lambda v: (v * v).sum())(x)))
"""


def _widget_texts(kernel: KernelSession) -> list[str]:
    """What the widgets of the cell that runs now show (their states are updated by another thread).

    tqdm's notebook bar writes its description with figure spaces (U+2007): read as spaces.
    """
    try:
        return [str(state.get("value", "")).replace("\u2007", " ") for state in list(kernel.widgets.values())]
    except RuntimeError:  # the dictionary changed while read: look again
        return []


@pytest.fixture(scope="module")
def kernel(kernel_installed, slurm):
    session = KernelSession("pathways", env=_client_env(slurm))
    yield session
    session.close()


def test_a_slurm_cluster_waits_in_the_queue_then_runs_one_program_across_two_nodes(
    slurm, islands_job, kernel, tmp_path
):
    """Also: scancel of the job ahead ends all its processes, and a client reading from it is told why."""
    reader = python_script(CLIENTS / "reads_a_program_that_never_ends.py", islands_job.address)
    assert reader.stdout.readline() == "reading\n", reader.stderr.read()[-3000:]
    submitted: dict = {}
    code = SUBMIT.format(directory=str(tmp_path / "queued"), timeout=START_TIMEOUT_S)
    cell = threading.Thread(target=lambda: submitted.update(kernel.run(code, timeout_s=START_TIMEOUT_S + 60)))
    cell.start()
    queued = []
    try:
        # The new job waits for nodes (n1 and n2 are the batch job's), and the notebook shows it.
        queued = wait_until(lambda: [j for j in slurm.jobs() if j != islands_job.job_id], 60, "the submission")
        pending = f"Slurm job {queued[0]}: PENDING (Resources)"
        wait_until(
            lambda: _widget_texts(kernel),
            60,
            f"the notebook's progress bar showing {pending!r}",
            holds=lambda texts: any(pending in text for text in texts),
        )
        seconds = _cancel(slurm, islands_job.job_id)
        print(f"every process of job {islands_job.job_id} ended {seconds:.1f} s after scancel")
        out, err = finish(reader, 60)
        assert "UNAVAILABLE" in out and "the Slurm job ended" in out, (out, err[-3000:])
    except BaseException:
        for job_id in queued:  # the cell's SlurmCluster then fails at once
            slurm.run("scancel", job_id, check=False)
        raise
    finally:
        reader.kill()
        cell.join(START_TIMEOUT_S + 90)
    assert not submitted["errors"], submitted
    assert f"(Slurm job {queued[0]}): 1 island(s) x 2 host(s)" in submitted["stdout"], submitted

    out = kernel.run(ACROSS_TWO_NODES)
    assert not out["errors"], out
    assert out["stdout"].strip().splitlines()[-1] == "[0, 1] 2 140.0"

    out = kernel.run("cluster.close()\nprint(cluster)")
    assert not out["errors"], out
    assert "<SlurmCluster closed" in out["stdout"]
    assert slurm.job_state(queued[0]) == "CANCELLED"
    _wait_gone(slurm, queued[0])


# -- salloc, then pathways-nb up --slurm --------------------------------------------------------


def _serves_only_tls(address: str, ca: bytes) -> bool:
    """Whether ``address`` answers a health check over TLS (trusting ``ca``) and refuses one in plaintext."""

    def healthy(channel: grpc.Channel) -> bool:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    with (
        grpc.insecure_channel(address) as plaintext,
        grpc.secure_channel(address, grpc.ssl_channel_credentials(ca)) as secured,
    ):
        return healthy(secured) and not healthy(plaintext)


def test_up_inside_salloc_lays_the_cluster_over_the_allocation_and_scancel_ends_it(slurm, kernel, tmp_path):
    """With TLS between its nodes: the certificate names the three nodes' addresses."""
    pem = certificates(tmp_path, addresses=slurm.node_addresses.values())
    tls = ["--tls_cert", pem["cert"], "--tls_key", pem["key"], "--tls_ca", pem["ca"]]
    up = [sys.executable, "-m", "pathways_nb.cli", "up", "--devices_per_host", "2", "--port", "0", *tls]
    salloc = subprocess.Popen(
        ["salloc", "-N", "3", *up],
        cwd=tmp_path,
        env=slurm.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = []
        for line in salloc.stdout:  # the launcher says how to connect once it serves
            lines.append(line)
            if "stops it" in line:
                break
        text = "".join(lines)
        assert "on Slurm job" in text and "nodes n1 n2 n3" in text, text  # found from SLURM_JOB_ID: no --slurm
        (job_id,) = slurm.jobs()
        assert f"%pathways connect slurm://{job_id}" in text
        directory = tmp_path / f"pathways-nb-{job_id}"
        # A notebook attaches by the job's id (its comment names the directory of the address and the token).
        out = kernel.run("%pathways connect slurm://999999")
        assert "Slurm job 999999" in out["stderr"] + out["stdout"], out
        assert not kernel.run(f"%pathways connect slurm://{job_id}")["errors"]
        out = kernel.run(f"%run {SAME_ON_EVERY_ISLAND}\n%pathways disconnect")
        report = json.loads(out["stdout"].splitlines()[0])
        assert report == {"hosts": ["127.0.0.1", "127.0.0.2", "127.0.0.3"], "same": {"0": True, "1": True, "2": True}}
        # The workers serve only TLS (the proxy's own port stays plaintext: the stock client speaks only that).
        address, token = connection_files.read(directory / connection_files.ADDRESS_FILE)
        observer = Observer(address, token)
        try:
            workers = observer.state().workers
        finally:
            observer.close()
        ca = pathlib.Path(pem["ca"]).read_bytes()
        assert len(workers) == 3 and all(_serves_only_tls(w.address, ca) for w in workers), workers
        _cancel(slurm, job_id)
        assert salloc.wait(GONE_WITHIN_S) == 0
        # Its address and token went with it, then the directory it made (unless the cluster kept its logs or
        # storage: then the launcher's last lines say why).
        left = sorted(str(path.relative_to(directory)) for path in directory.rglob("*")) if directory.exists() else []
        assert not directory.exists(), (left, _written_so_far(salloc.stdout)[-4000:])
    finally:
        salloc.kill()
        salloc.communicate()


def _written_so_far(stream) -> str:
    """What a process's output pipe holds now, without waiting for its end (a child may still hold it open)."""
    os.set_blocking(stream.fileno(), False)
    try:
        return stream.read() or ""
    except (OSError, TypeError):
        return ""
