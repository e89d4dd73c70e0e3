"""The cluster token, per-connection secrets, TLS and loopback binds, against real servers."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pathways_nb import cli
from pathways_nb.core import security
from pathways_nb.core.security import ClusterCredentials
from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.launch.processes import ChildServer
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.rpc import cluster_pb2_grpc
from pathways_nb.testing import python_script
from pathways_nb.testing.tls import certificates

CLIENT = Path(__file__).with_name("clients") / "holds_a_session_with_the_token.py"


@pytest.fixture(scope="module")
def secured():
    with LocalCluster(islands=1, devices_per_host=2) as cluster:
        yield cluster


def _endpoints(cluster: LocalCluster) -> dict[str, str]:
    return {
        "resource manager": cluster.resource_manager_address,
        "worker": cluster.workers[(0, 0)].hostport,
        "observe": cluster.address.removeprefix("grpc://"),
    }


def _call(endpoint: str, channel: grpc.Channel):
    """One cheap call to each internal service."""
    if endpoint == "resource manager":
        return cluster_pb2_grpc.ResourceManagerStub(channel).GetClusterState(pb.ClusterStateRequest(), timeout=10)
    if endpoint == "observe":
        return cluster_pb2_grpc.ObserveStub(channel).GetEvents(pb.WatchEventsRequest(after=2**63), timeout=10)
    # A worker session stream: a fetch of an unknown array gets a reply (an error naming it) once admitted.
    stub = cluster_pb2_grpc.WorkerStub(channel)
    replies = stub.Session(
        iter([pb.CommandBatch(session="security-probe", commands=[pb.Command(fetch=pb.Fetch(id=4242, request=1))])]),
        timeout=10,
    )
    try:
        return next(replies)
    finally:
        replies.cancel()


@pytest.mark.parametrize("endpoint", ["resource manager", "worker", "observe"])
def test_internal_calls_need_the_cluster_token(secured, endpoint):
    address = _endpoints(secured)[endpoint]
    for token in [None, "not-the-token", secured.token[:-1]]:
        with ClusterCredentials(token=token).channel(address) as channel:
            with pytest.raises(grpc.RpcError) as error:
                _call(endpoint, channel)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED, (token, error.value)
        assert error.value.details() == security.NEEDS_TOKEN
    with ClusterCredentials(token=secured.token).channel(address) as channel:
        served = _call(endpoint, channel)
    if endpoint == "resource manager":
        assert len(served.workers) == 1 and served.workers[0].healthy
    if endpoint == "worker":
        assert "4242" in served.replies[0].error.message  # the worker's own answer: no such array


def test_health_checks_need_no_token(secured):
    for endpoint, address in _endpoints(secured).items():
        with grpc.insecure_channel(address) as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING, endpoint


def test_the_host_probe_needs_no_token_and_says_only_whether_the_caller_shares_the_host(secured):
    """Plain JAX_PLATFORMS=proxy processes hold no token; they ask before their client exists."""
    from pathways_nb.core import shared_memory
    from pathways_nb.core.session_options import shared_memory_key

    with grpc.insecure_channel(_endpoints(secured)["observe"]) as channel:
        host = cluster_pb2_grpc.ObserveStub(channel).GetHost(pb.GetHostRequest(), timeout=10)
    assert host.shared_memory_key == shared_memory_key()
    assert shared_memory.host_key() not in str(host)  # a hash, not the host's identity


def test_children_get_the_token_in_their_environment_and_never_print_it(secured):
    for child in secured.processes():
        assert secured.token not in " ".join(child.process.args), child.name
        assert secured.token not in child.log(), child.name
        assert child.env[security.TOKEN_ENV] == secured.token


@pytest.fixture(scope="module")
def clients(secured):
    """Two stock JAX clients connected to ``secured``, tenants alice and bob, with what they reported."""
    processes = {tenant: python_script(CLIENT, secured.address, secured.token, tenant) for tenant in ("alice", "bob")}
    reports = {}
    try:
        for tenant, process in processes.items():
            line = process.stdout.readline()
            assert line, f"client {tenant} failed:\n{process.communicate(timeout=60)[1][-4000:]}"
            reports[tenant] = json.loads(line)
        yield reports
    finally:
        for process in processes.values():
            process.stdin.close()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def test_a_stock_client_with_the_token_runs_a_jit_and_sees_the_cluster(clients):
    import numpy as np

    expected = (np.sin(np.arange(4, dtype=np.float32)) * 2).tolist()
    for report in clients.values():
        np.testing.assert_allclose(report["result"], expected, rtol=1e-6)
        assert report["workers"] == 1
    assert clients["alice"]["secret"] != clients["bob"]["secret"]


def _tenants(stub) -> list[str]:
    return sorted(s.tenant for s in stub.GetClusterState(pb.ClusterStateRequest(), timeout=10).sessions)


def test_a_tenant_ends_only_its_own_sessions(secured, clients):
    with secured.credentials.channel(secured.address.removeprefix("grpc://")) as channel:
        stub = cluster_pb2_grpc.ObserveStub(channel)
        assert _tenants(stub) == ["alice", "bob"]
        for secret in [clients["bob"]["secret"], security.generate_token()]:
            assert stub.EndSessions(pb.EndSessionsRequest(tenant="alice", secret=secret), timeout=10).ended == 0
        with pytest.raises(grpc.RpcError) as error:
            stub.EndSessions(pb.EndSessionsRequest(tenant="alice"), timeout=10)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "secret" in error.value.details()
        assert _tenants(stub) == ["alice", "bob"]
        ended = stub.EndSessions(pb.EndSessionsRequest(tenant="alice", secret=clients["alice"]["secret"]), timeout=10)
        assert ended.ended == 1
        assert _tenants(stub) == ["bob"]


def test_the_token_file_wins_over_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "token"
    security.write_token_file(str(path), "from-the-file")
    assert os.stat(path).st_mode & 0o777 == 0o600
    monkeypatch.setenv(security.TOKEN_ENV, "from-the-environment")
    args = cli.build_parser().parse_args(["resource-manager", "--token_file", str(path)])
    assert ClusterCredentials.from_args(args).token == "from-the-file"
    args = cli.build_parser().parse_args(["resource-manager"])
    assert ClusterCredentials.from_args(args).token == "from-the-environment"
    path.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        ClusterCredentials.from_args(
            cli.build_parser().parse_args(["worker", "--resource_manager_address", "x:1", "--token_file", str(path)])
        )


def test_servers_without_a_token_listen_only_on_loopback(monkeypatch, capsys):
    monkeypatch.delenv(security.TOKEN_ENV, raising=False)
    for command in (["resource-manager"], ["proxy"], ["worker", "--resource_manager_address", "127.0.0.1:1"]):
        with pytest.raises(SystemExit) as stopped:
            cli.main([*command, "--host", "0.0.0.0", "--server_port", "0"])
        assert stopped.value.code == 2
        message = capsys.readouterr().err
        assert "with no cluster token" in message and "--token_file" in message, (command, message)


def test_every_server_listens_on_loopback_by_default():
    parser = cli.build_parser()
    for command in (["resource-manager"], ["proxy"], ["worker", "--resource_manager_address", "x:1"]):
        assert parser.parse_args(command).host == "127.0.0.1"


# -- TLS -------------------------------------------------------------------------------------


def test_tls_resource_manager_and_worker(tmp_path):
    pem = certificates(tmp_path)
    token = security.generate_token()
    env = {**os.environ, security.TOKEN_ENV: token}
    tls = ["--tls_cert", pem["cert"], "--tls_key", pem["key"]]
    rm = ChildServer("tls-resource-manager", ["resource-manager", "--server_port", "0", *tls], env=env)
    worker = None
    try:
        rm.start()
        trusting = ["--resource_manager_address", rm.hostport, "--tls_ca", pem["ca"]]
        worker = ChildServer("tls-worker", ["worker", "--server_port", "0", "--devices", "1", *tls, *trusting], env=env)
        worker.start()
        with ClusterCredentials(token=token).channel(rm.hostport) as plaintext:
            with pytest.raises(grpc.RpcError) as error:
                _call("resource manager", plaintext)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        with open(pem["ca"], "rb") as f:
            ca = f.read()
        with ClusterCredentials(tls_ca=ca).channel(rm.hostport) as no_token:
            with pytest.raises(grpc.RpcError) as error:
                _call("resource manager", no_token)
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with ClusterCredentials(token=token, tls_ca=ca).channel(rm.hostport) as channel:
            state = _call("resource manager", channel)
        # The worker reached the resource manager over TLS (it trusts the CA), and serves TLS itself.
        assert [w.healthy for w in state.workers] == [True]
        with ClusterCredentials(token=token, tls_ca=ca).channel(worker.hostport) as channel:
            assert "4242" in _call("worker", channel).replies[0].error.message
    finally:
        for child in (worker, rm):
            if child is not None:
                child.close()


def test_made_tokens_pass_on_a_command_line_and_others_pass_with_an_equals_sign():
    """One URL-safe token in 64 began with '-', which ``%pathways connect ... --token`` read as an option
    (a browser test failed so); a user's own such token goes as ``--token=T``."""
    from pathways_nb.notebook import magics

    parser = magics._parser()
    for _ in range(2000):
        token = security.generate_token()
        assert len(token) == 64 and int(token, 16) >= 0, token
        assert parser.parse_args(["connect", "local", "--token", token]).token == token
    assert parser.parse_args(["connect", "local", "--token=-own-token"]).token == "-own-token"
    with pytest.raises(magics.UsageError, match="a value that begins with '-' goes as --option=VALUE"):
        parser.parse_args(["connect", "local", "--token", "-own-token"])
