"""``pathways-nb deploy k8s``: its objects validate against Kubernetes' and JobSet's schemas, and its pods run here.

The schemas are checked offline (kubernetes-validate ships Kubernetes' JSON
schemas; tests/data holds one of the JobSet CRD, written from its API). The
process tests read the generated manifests as the kubelet would: each pod's
command, arguments and environment, with what Kubernetes substitutes (the
downward API, ``$(VAR)``, ``JOB_COMPLETION_INDEX``, the mounted token Secret)
done here, pod DNS names mapped to 127.0.0.1 and each pod's fixed ports to free
ones; then they start as real processes and a real JAX client uses the cluster.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import jsonschema
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pathways_nb.cli import build_parser, main
from pathways_nb.deploy import kubernetes
from pathways_nb.launch.processes import ChildServer
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.rpc import cluster_pb2_grpc
from pathways_nb.testing import python_script, wait_until

REPOSITORY = pathlib.Path(__file__).resolve().parent.parent
DOCS_MANIFESTS = REPOSITORY / "docs" / "kubernetes"
JOBSET_SCHEMA = json.loads((pathlib.Path(__file__).parent / "data" / "jobset_v1alpha2_schema.json").read_text())
# The oldest Kubernetes these manifests are meant for (gRPC probes are GA from 1.27) and the newest known.
KUBERNETES_VERSIONS = ("1.29", kubernetes_validate.utils.latest_version())
DOCUMENTED = ["--islands", "2", "--hosts_per_island", "1", "--devices_per_host", "4"]

# (accelerator, islands, hosts per island, devices per host)
SHAPES = [("cpu", 2, 1, 4), ("cpu", 2, 2, 2), ("tpu-v5e:2x2", 2, 2, 4), ("nvidia-h100:8", 2, 1, 8)]


def deploy(directory: pathlib.Path, *flags: str) -> pathlib.Path:
    assert main(["deploy", "k8s", *flags, "--output", str(directory)]) == 0
    return directory


def deploy_shape(directory: pathlib.Path, accelerator: str, islands: int, hosts: int, devices: int) -> pathlib.Path:
    return deploy(
        directory,
        *["--accelerator", accelerator, "--islands", str(islands)],
        *["--hosts_per_island", str(hosts), "--devices_per_host", str(devices)],
    )


def load_objects(directory: pathlib.Path) -> list[dict]:
    documents = [*yaml.safe_load_all((directory / kubernetes.MANIFEST_FILE).read_text())]
    documents.append(yaml.safe_load((directory / kubernetes.SECRET_FILE).read_text()))
    return documents


def by_kind(objects: list[dict], kind: str) -> dict:
    (found,) = [o for o in objects if o["kind"] == kind]
    return found


# -- what Kubernetes would do with the pods --------------------------------------------------

_EXPANSION = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_FIELD_PATH = re.compile(r"^metadata\.(annotations|labels)\['([^']+)'\]$")


def expand(text: str, variables: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined variables are replaced, ``$$`` is ``$``, the rest stays."""

    def replace(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return variables.get(match.group(1), match.group(0))

    return _EXPANSION.sub(replace, text)


@dataclass
class Pod:
    """One pod of the JobSet as its node would run it, with this machine's addresses."""

    replicated_job: str
    job_index: int
    pod_index: int
    dns_name: str  # <jobset>-<replicated job>-<job index>-<pod index>.<subdomain>
    container: dict
    metadata: dict
    ports: dict[int, int]  # containerPort -> a free port here
    env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    server: ChildServer | None = None

    def field_value(self, path: str) -> str:
        """A downward-API ``fieldRef`` as the kubelet resolves it."""
        match = _FIELD_PATH.match(path)
        if match:
            return self.metadata[match.group(1)][match.group(2)]
        simple = {"metadata.namespace": "default", "status.podIP": "127.0.0.1"}
        if path not in simple:
            pytest.fail(f"the manifest reads {path!r} through the downward API, which this test does not simulate")
        return simple[path]


def _free_port(held: contextlib.ExitStack) -> int:
    """A port free here, kept bound in ``held`` until every pod has one: no two pods get the same."""
    probe = held.enter_context(socket.socket())
    probe.bind(("127.0.0.1", 0))
    return probe.getsockname()[1]


def plan_pods(objects: list[dict], secrets_directory: pathlib.Path) -> list[Pod]:
    """Every pod of the JobSet with its final arguments and environment (nothing started)."""
    jobset = by_kind(objects, "JobSet")
    secrets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Secret"}
    name = jobset["metadata"]["name"]
    subdomain = jobset["spec"]["network"].get("subdomain", name)
    pods = []
    with contextlib.ExitStack() as held:
        for replicated in jobset["spec"]["replicatedJobs"]:
            job = replicated["template"]["spec"]
            assert job["completionMode"] == "Indexed"
            for job_index in range(replicated.get("replicas", 1)):
                for pod_index in range(job.get("completions", 1)):
                    (container,) = job["template"]["spec"]["containers"]
                    hostname = f"{name}-{replicated['name']}-{job_index}-{pod_index}"
                    markers = {
                        "jobset.sigs.k8s.io/jobset-name": name,
                        "jobset.sigs.k8s.io/replicatedjob-name": replicated["name"],
                        "jobset.sigs.k8s.io/job-index": str(job_index),
                        "batch.kubernetes.io/job-completion-index": str(pod_index),
                    }
                    labels = {**job["template"]["metadata"].get("labels", {}), **markers}
                    pod = Pod(
                        replicated["name"],
                        job_index,
                        pod_index,
                        f"{hostname}.{subdomain}",
                        container,
                        {"labels": labels, "annotations": dict(markers)},
                        {p["containerPort"]: _free_port(held) for p in container.get("ports", [])},
                    )
                    pods.append(pod)
    addresses = {f"{p.dns_name}:{port}": f"127.0.0.1:{local}" for p in pods for port, local in p.ports.items()}
    addresses.update({p.dns_name: "127.0.0.1" for p in pods})
    for pod in pods:
        spec = next(
            r["template"]["spec"]["template"]["spec"]
            for r in jobset["spec"]["replicatedJobs"]
            if r["name"] == pod.replicated_job
        )
        mounts = _mount_secrets(spec, pod.container, secrets, secrets_directory)
        # The Job controller gives every container of an Indexed Job its index.
        pod.env = {"JOB_COMPLETION_INDEX": str(pod.pod_index)}
        for variable in pod.container.get("env", []):
            if "value" in variable:
                pod.env[variable["name"]] = expand(variable["value"], pod.env)
            else:
                pod.env[variable["name"]] = pod.field_value(variable["valueFrom"]["fieldRef"]["fieldPath"])
        assert pod.container["command"] == ["pathways-nb"], "the image's entry point is the pathways-nb command"
        pod.args = [_localize(expand(a, pod.env), pod, addresses, mounts) for a in pod.container["args"]]
    return pods


def _mount_secrets(spec: dict, container: dict, secrets: dict, directory: pathlib.Path) -> dict[str, str]:
    """Writes each mounted Secret's keys into files here; returns mount path -> local directory."""
    mounts = {}
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        secret_name = volumes[mount["name"]]["secret"]["secretName"]
        local = directory / secret_name
        local.mkdir(parents=True, exist_ok=True)
        for key, value in secrets[secret_name]["stringData"].items():
            (local / key).write_text(value)
            (local / key).chmod(volumes[mount["name"]]["secret"].get("defaultMode", 0o644))
        mounts[mount["mountPath"]] = str(local)
    return mounts


def _localize(argument: str, pod: Pod, addresses: dict[str, str], mounts: dict[str, str]) -> str:
    """One argument with this machine's ports, addresses and files for the pod's."""
    if not argument.startswith("--"):
        return argument
    flag, _, value = argument.partition("=")
    if flag == "--server_port":
        return f"{flag}={pod.ports[int(value)]}"
    for name in sorted(addresses, key=len, reverse=True):  # host:port before the bare host name
        value = value.replace(name, addresses[name])
    for mount_path, local in mounts.items():
        if value.startswith(mount_path + "/"):
            value = local + value[len(mount_path) :]
    return f"{flag}={value}"


def _health_check(pod: Pod) -> None:
    """The readiness probe: the standard gRPC health check on the probe's port."""
    port = pod.ports[pod.container["readinessProbe"]["grpc"]["port"]]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING, f"{pod.dns_name} is not ready"


@contextlib.contextmanager
def running(objects: list[dict], directory: pathlib.Path) -> Iterator[list[Pod]]:
    """Starts every pod in the JobSet's order (a replicated job after those it depends on are ready)."""
    pods = plan_pods(objects, directory)
    replicated = {r["name"]: r for r in by_kind(objects, "JobSet")["spec"]["replicatedJobs"]}
    dependencies = {name: {d["name"] for d in r.get("dependsOn", [])} for name, r in replicated.items()}
    first = {name for name, needs in dependencies.items() if not needs}
    assert all(needs <= first for needs in dependencies.values()), "this test starts two waves: update it"
    try:
        for group in (first, set(replicated) - first):
            for pod in pods:
                if pod.replicated_job in group:
                    pod.server = ChildServer(pod.dns_name, pod.args, env=_environment(pod))
                    pod.server.launch()
            for pod in pods:
                if pod.replicated_job in group:
                    pod.server.wait_started(120)
                    _health_check(pod)
        yield pods
    finally:
        started = [p.server.process for p in pods if p.server is not None and p.server.process is not None]
        for pod in reversed(pods):
            if pod.server is not None:
                pod.server.close()
        assert all(process.poll() is not None for process in started), "a pod's process is still running"


def _environment(pod: Pod) -> dict[str, str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "PATHWAYS_"))}
    return {**environment, **pod.env}


def restart(pod: Pod) -> None:
    """What the kubelet does for ``restartPolicy: OnFailure``: the same command again, in the same pod."""
    assert pod.server is not None
    pod.server.close()
    pod.server = ChildServer(pod.dns_name, pod.args, env=_environment(pod))
    pod.server.start(120)
    _health_check(pod)


def token_of(objects: list[dict]) -> str:
    return by_kind(objects, "Secret")["stringData"][kubernetes.TOKEN_KEY]


def cluster_state(pods: list[Pod], token: str) -> pb.ClusterState:
    (rm,) = [p for p in pods if p.replicated_job == "rm"]
    with grpc.insecure_channel(f"127.0.0.1:{rm.ports[kubernetes.RESOURCE_MANAGER_PORT]}") as channel:
        return cluster_pb2_grpc.ResourceManagerStub(channel).GetClusterState(
            pb.ClusterStateRequest(), metadata=[("authorization", f"Bearer {token}")], timeout=10
        )


def wait_for_workers(pods: list[Pod], token: str, healthy: set[tuple[int, int]], timeout_s: float = 60) -> list:
    """The resource manager's workers once exactly ``healthy`` (island, host) pairs are healthy."""
    return wait_until(
        lambda: list(cluster_state(pods, token).workers),
        timeout_s,
        f"exactly the workers {sorted(healthy)} healthy",
        holds=lambda workers: {(w.island, w.host_index) for w in workers if w.healthy} == healthy,
        interval_s=0.1,
    )


# -- the schemas -----------------------------------------------------------------------------


def validate_jobset(jobset: dict) -> None:
    """The JobSet against the CRD's schema, its Job templates against Kubernetes', and the webhook's rules."""
    jsonschema.Draft202012Validator(JOBSET_SCHEMA).validate(jobset)
    names = [r["name"] for r in jobset["spec"]["replicatedJobs"]]
    assert len(set(names)) == len(names), f"replicated job names repeat: {names}"
    for position, replicated in enumerate(jobset["spec"]["replicatedJobs"]):
        for dependency in replicated.get("dependsOn", []):
            assert dependency["name"] in names[:position], f"{replicated['name']} depends on a later job"
        job = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {
                "name": f"{jobset['metadata']['name']}-{replicated['name']}-0",
                **replicated["template"].get("metadata", {}),
            },
            "spec": replicated["template"]["spec"],
        }
        validate_kubernetes(job)


def validate_kubernetes(obj: dict) -> None:
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.fixture
def no_network(monkeypatch):
    """Schema checks must work offline: any attempt to reach the network fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"the network was used: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_objects_validate(shape, tmp_path, no_network):
    accelerator, islands, hosts, devices = shape
    objects = load_objects(deploy_shape(tmp_path, accelerator, islands, hosts, devices))
    assert sorted(o["kind"] for o in objects) == ["JobSet", "Secret", "Service"]
    for obj in objects:
        if obj["kind"] == "JobSet":
            validate_jobset(obj)
        else:
            validate_kubernetes(obj)

    jobset = by_kind(objects, "JobSet")
    replicated = {r["name"]: r for r in jobset["spec"]["replicatedJobs"]}
    assert list(replicated) == ["rm", "proxy", "worker"]
    worker_job = replicated["worker"]["template"]["spec"]
    assert (replicated["worker"]["replicas"], worker_job["parallelism"], worker_job["completions"]) == (
        islands,
        hosts,
        hosts,
    )
    pod_spec = worker_job["template"]["spec"]
    assert pod_spec["restartPolicy"] == "OnFailure"
    resources = pod_spec["containers"][0]["resources"]
    expected = {
        "cpu": ({}, {}),
        "tpu-v5e:2x2": (
            {"google.com/tpu": "4"},
            {
                "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
                "cloud.google.com/gke-tpu-topology": {1: "2x2", 2: "2x4"}[hosts],
            },
        ),
        "nvidia-h100:8": ({"nvidia.com/gpu": "8"}, {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}),
    }[accelerator]
    assert resources.get("limits", {}) == expected[0]
    assert pod_spec.get("nodeSelector", {}) == expected[1]
    assert {"cpu", "memory"} <= set(resources["requests"])

    # Every pod's arguments, as its node would expand them, are flags the command accepts.
    pods = plan_pods(objects, tmp_path / "secrets")
    commands = {}
    for pod in pods:
        args = build_parser().parse_args(pod.args)
        commands.setdefault(args.command, []).append(args)
        assert args.token_file and pathlib.Path(args.token_file).read_text() == token_of(objects)
    (rm,) = commands["resource-manager"]
    platform = {"cpu": "cpu", "tpu-v5e:2x2": "tpu", "nvidia-h100:8": "gpu"}[accelerator]
    assert (rm.instance_count, rm.instance_type) == (islands, f"{platform}:{hosts}x{devices}")
    (proxy,) = commands["proxy"]
    # A session may keep half of the CPU workers' memory (2 GiB per device) in arrays; accelerators police their own.
    assert proxy.session_device_bytes == (islands * hosts * devices * 2**30 if accelerator == "cpu" else 0)
    workers = commands["worker"]
    assert sorted((w.island, w.host_index) for w in workers) == [(i, h) for i in range(islands) for h in range(hosts)]
    assert {w.platform for w in workers} == {{"cpu": "cpu", "tpu-v5e:2x2": "tpu", "nvidia-h100:8": "cuda"}[accelerator]}
    assert {w.devices for w in workers} == {devices}
    # Before localizing, a worker advertises its own pod's DNS name.
    worker = next(p for p in reversed(pods) if p.replicated_job == "worker")
    advertised = next(a for a in worker.container["args"] if a.startswith("--advertise_address="))
    assert expand(advertised, worker.env) == f"--advertise_address={worker.dns_name}"


def _first_depends(jobset: dict) -> None:
    jobset["spec"]["replicatedJobs"][0]["dependsOn"] = [{"name": "proxy", "status": "Ready"}]


def _unknown_container_field(jobset: dict) -> None:
    jobset["spec"]["replicatedJobs"][2]["template"]["spec"]["template"]["spec"]["containers"][0]["port"] = 1


BREAKAGES = {
    "unknown field": lambda j: j["spec"].update(replicatedJob=[]),
    "negative replicas": lambda j: j["spec"]["replicatedJobs"][2].update(replicas=-1),
    "first job depends": _first_depends,
    "bad dependency status": lambda j: j["spec"]["replicatedJobs"][1]["dependsOn"][0].update(status="Running"),
    "InOrder with dependsOn": lambda j: j["spec"].update(startupPolicy={"startupPolicyOrder": "InOrder"}),
    "bad name": lambda j: j["metadata"].update(name="Pathways_NB"),
    "unknown container field": _unknown_container_field,
}


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_the_schemas_catch_a_broken_jobset(breakage, tmp_path, no_network):
    jobset = by_kind(load_objects(deploy(tmp_path, *DOCUMENTED)), "JobSet")
    BREAKAGES[breakage](jobset)
    with pytest.raises(jsonschema.ValidationError):
        validate_jobset(jobset)


def test_the_schemas_catch_a_broken_service(tmp_path, no_network):
    service = by_kind(load_objects(deploy(tmp_path, *DOCUMENTED)), "Service")
    service["spec"]["ports"][0]["port"] = "twenty-nine thousand"
    with pytest.raises(jsonschema.ValidationError):
        validate_kubernetes(service)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--accelerator", "tpu-v9"], "use one of cpu, tpu-v5e:2x2, nvidia-h100:8"),
        (
            ["--accelerator", "tpu-v5e:2x2", "--devices_per_host", "8"],
            "whose hosts have 4 chips: use --devices_per_host 4",
        ),
        (["--accelerator", "nvidia-h100:8"], "whose hosts have 8 chips: use --devices_per_host 8"),
        (["--accelerator", "tpu-v5e:2x2", "--hosts_per_island", "3"], "choose one of those host counts"),
        (["--name", "Pathways"], "cannot name Kubernetes objects"),
        (["--islands", "0"], "each must be at least 1"),
        (["--namespace", "ML_team"], "is not a Kubernetes namespace name"),
    ],
)
def test_bad_arguments_say_what_to_do(flags, message, tmp_path, capsys):
    pairs = DOCUMENTED + flags
    arguments = dict(zip(pairs[::2], pairs[1::2], strict=True))  # later flags win
    with pytest.raises(SystemExit) as exit_info:
        main(["deploy", "k8s", *[x for item in arguments.items() for x in item], "--output", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_colocated_python_gives_each_worker_pod_a_colocated_host_beside_it(tmp_path, no_network):
    objects = load_objects(deploy(tmp_path, *DOCUMENTED, "--colocated_python"))
    jobset = by_kind(objects, "JobSet")
    validate_jobset(jobset)
    replicated = {r["name"]: r for r in jobset["spec"]["replicatedJobs"]}
    pod = replicated["worker"]["template"]["spec"]["template"]["spec"]
    worker, host = pod["containers"]
    assert (worker["name"], host["name"]) == ("worker", "colocated-host")
    socket_flag = f"--colocated_python_host=unix:{kubernetes.COLOCATED_SOCKET}"
    assert "--colocated_python" in worker["args"] and socket_flag in worker["args"]
    assert host["args"][:2] == ["colocated-host", f"--socket={kubernetes.COLOCATED_SOCKET}"]
    assert f"--token_file={kubernetes.TOKEN_FILE}" in host["args"]  # its callers need the token
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["shm"]["emptyDir"] == {"medium": "Memory"}  # the executors' shards pass through memory
    for container in (worker, host):
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["colocated"] == kubernetes.COLOCATED_DIRECTORY and mounts["shm"] == "/dev/shm"
    for other in ("rm", "proxy"):  # only workers have executors
        assert len(replicated[other]["template"]["spec"]["template"]["spec"]["containers"]) == 1


def test_colocated_python_on_accelerators_says_it_needs_cpu_workers(tmp_path, capsys):
    flags = ["--accelerator", "nvidia-h100:8", "--islands", "1", "--hosts_per_island", "1", "--devices_per_host", "8"]
    with pytest.raises(SystemExit) as exit_info:
        main(["deploy", "k8s", *flags, "--colocated_python", "--output", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "--colocated_python needs CPU workers" in capsys.readouterr().err


def test_committed_manifests_are_fresh(tmp_path):
    """docs/kubernetes is exactly what the documented command writes (the token Secret is never committed)."""
    fresh = deploy(tmp_path, *DOCUMENTED)
    generated = {p.name for p in fresh.iterdir()} - {kubernetes.SECRET_FILE}
    committed = {p.name for p in DOCS_MANIFESTS.iterdir()} - {kubernetes.SECRET_FILE}
    assert committed == generated
    for name in generated:
        assert (DOCS_MANIFESTS / name).read_text() == (fresh / name).read_text(), (
            f"docs/kubernetes/{name} is stale: pathways-nb deploy k8s {' '.join(DOCUMENTED)} --output docs/kubernetes"
        )
    assert kubernetes.SECRET_FILE in (DOCS_MANIFESTS / ".gitignore").read_text().split()
    # One Dockerfile: the copy beside the manifests (none at the repository root to drift from it).
    assert not (REPOSITORY / "Dockerfile").exists()


def test_name_and_namespace_reach_every_object(tmp_path, no_network):
    objects = load_objects(deploy(tmp_path, *DOCUMENTED, "--name", "demo", "--namespace", "ml-team"))
    assert {(o["kind"], o["metadata"]["name"], o["metadata"]["namespace"]) for o in objects} == {
        ("JobSet", "demo", "ml-team"),
        ("Service", "demo-proxy", "ml-team"),
        ("Secret", "demo-token", "ml-team"),
    }
    validate_jobset(by_kind(objects, "JobSet"))
    assert by_kind(objects, "Service")["spec"]["selector"]["jobset.sigs.k8s.io/jobset-name"] == "demo"
    pods = plan_pods(objects, tmp_path / "secrets")
    proxy = next(p for p in pods if p.replicated_job == "proxy")
    assert "--resource_manager_address=demo-rm-0-0.demo:29001" in proxy.container["args"]
    assert {p.dns_name for p in pods if p.replicated_job == "worker"} == {
        "demo-worker-0-0.demo",
        "demo-worker-1-0.demo",
    }


def test_the_token_is_kept_when_deploying_again(tmp_path):
    first = token_of(load_objects(deploy(tmp_path / "a", *DOCUMENTED)))
    again = token_of(load_objects(deploy(tmp_path / "a", "--islands", "3", *DOCUMENTED[2:])))
    elsewhere = token_of(load_objects(deploy(tmp_path / "b", *DOCUMENTED)))
    assert first == again != elsewhere
    assert len(first) >= 40
    assert (tmp_path / "a" / kubernetes.SECRET_FILE).stat().st_mode & 0o777 == 0o600


# -- the processes ---------------------------------------------------------------------------

CLIENTS = pathlib.Path(__file__).with_name("clients")


def run_client(proxy: Pod, token: str, islands: str, program: str = "sums_on_islands.py") -> dict:
    address = f"grpc://127.0.0.1:{proxy.ports[kubernetes.PROXY_PORT]}"
    # As docs/kubernetes.md says: the token from the Secret, for the cluster's views.
    client = python_script(CLIENTS / program, address, islands, env={"PATHWAYS_CLUSTER_TOKEN": token})
    out, err = client.communicate(timeout=180)
    assert client.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_the_pods_run_here_and_serve_jax(tmp_path):
    """2 islands of 1 host of 4 CPU devices: the cluster comes up, a JAX client computes, a dead worker comes back."""
    objects = load_objects(deploy(tmp_path / "k8s", *DOCUMENTED))
    token = token_of(objects)
    with running(objects, tmp_path / "secrets") as pods:
        workers = wait_for_workers(pods, token, {(0, 0), (1, 0)})
        with pytest.raises(grpc.RpcError) as refused:  # the servers read the token from the mounted Secret
            cluster_state(pods, "not-the-token")
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        by_island = {p.job_index: p for p in pods if p.replicated_job == "worker"}
        assert sorted(w.address for w in workers) == sorted(
            f"127.0.0.1:{p.ports[kubernetes.WORKER_PORT]}" for p in by_island.values()
        )
        (proxy,) = [p for p in pods if p.replicated_job == "proxy"]
        assert run_client(proxy, token, "0,1") == {"devices": 8, "results": {"0": 140.0, "1": 140.0}}

        by_island[1].server.process.kill()  # the worker of island 1 dies
        wait_for_workers(pods, token, {(0, 0)})
        restart(by_island[1])
        wait_for_workers(pods, token, {(0, 0), (1, 0)})
        assert run_client(proxy, token, "1") == {"devices": 8, "results": {"1": 140.0}}


def test_an_island_of_two_hosts_registers_and_runs_one_program_across_them(tmp_path):
    """1 island of 2 hosts: the resource manager accepts both hosts, and a sharded jit runs on all 4 devices."""
    objects = load_objects(
        deploy(tmp_path / "k8s", "--islands", "1", "--hosts_per_island", "2", "--devices_per_host", "2")
    )
    with running(objects, tmp_path / "secrets") as pods:
        workers = wait_for_workers(pods, token_of(objects), {(0, 0), (0, 1)})
        assert sorted(list(w.device_ids) for w in workers) == [[0, 1], [2, 3]]
        (proxy,) = [p for p in pods if p.replicated_job == "proxy"]
        assert run_client(proxy, token_of(objects), "0", "sum_across_hosts.py") == {"hosts": [0, 1], "results": 140.0}
