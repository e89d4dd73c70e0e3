"""A pathways-nb cluster as Kubernetes objects: one JobSet, a Service for the proxy, the token Secret.

The JobSet (API ``jobset.x-k8s.io/v1alpha2``) has three replicated jobs, as
Pathways on Cloud's do: ``rm`` (the resource manager), ``proxy``, and ``worker``
with one Job per island (``replicas``) of one pod per host (an Indexed Job of
``parallelism = completions = hosts``). A worker learns its island from the
``jobset.sigs.k8s.io/job-index`` annotation (through the downward API) and its
host from ``JOB_COMPLETION_INDEX``; it is reached at its pod's DNS name, which
JobSet's headless service gives every pod:
``<jobset>-<replicated job>-<job index>-<pod index>.<subdomain>``.

A server that dies is restarted in its pod (``restartPolicy: OnFailure``) and a
lost pod is recreated by its Job under the same name, so a worker comes back
where the resource manager and the proxy expect it: Kubernetes is the
supervisor. Internal calls carry the cluster token, mounted from the Secret
``<name>-token``; the proxy's port (IFRT protocol and observe API) is reached
through ``kubectl port-forward svc/<name>-proxy 29000:29000``.
"""

from __future__ import annotations

import argparse
import base64
import os
import pathlib
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from pathways_nb._version import __version__
from pathways_nb.core.security import generate_token
from pathways_nb.deploy.accelerators import Accelerator, check_shape
from pathways_nb.deploy.image import DOCKERFILE, DOCKERIGNORE
from pathways_nb.rm import policy
from pathways_nb.rm.policy import SessionPolicy

JOBSET_API_VERSION = "jobset.x-k8s.io/v1alpha2"
# The pod annotation JobSet sets to the index of the pod's Job within its replicated job.
JOB_INDEX_ANNOTATION = "jobset.sigs.k8s.io/job-index"
# Placing each island's Job on its own node pool (a TPU slice is a node pool on GKE).
EXCLUSIVE_TOPOLOGY_ANNOTATION = "alpha.jobset.sigs.k8s.io/exclusive-topology"
NODE_POOL_LABEL = "cloud.google.com/gke-nodepool"

PROXY_PORT = 29000
RESOURCE_MANAGER_PORT = 29001
WORKER_PORT = 29005
# Host 0 of a multi-host island serves the island's JAX distributed runtime here.
COORDINATOR_PORT = 29006
TOKEN_DIRECTORY = "/var/run/pathways"
TOKEN_KEY = "token"
TOKEN_FILE = f"{TOKEN_DIRECTORY}/{TOKEN_KEY}"
# Colocated Python: the worker pod's sidecar (pathways-nb colocated-host) serves on a unix socket
# in a volume both containers mount, and both share the pod's /dev/shm, where the executors'
# directories (and the array shards they pass through) live.
COLOCATED_DIRECTORY = "/var/run/pathways-colocated"
COLOCATED_SOCKET = f"{COLOCATED_DIRECTORY}/host.sock"

# Files written into the output directory.
MANIFEST_FILE = "pathways-nb.yaml"
SECRET_FILE = "secret.yaml"
GITIGNORE = f"# The cluster token: keep it out of version control.\n{SECRET_FILE}\n"

# Retries a Job allows before it fails (container restarts count too): a server is replaced
# however often it dies (the kubelet waits up to 5 minutes between restarts of a crashing one).
BACKOFF_LIMIT = 10_000
# After a Job has failed anyway, JobSet recreates the whole cluster this many times.
MAX_JOBSET_RESTARTS = 3

# Object names that become host names (RFC 1035 labels), and namespaces (RFC 1123 labels).
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


@dataclass(frozen=True)
class Deployment:
    """The shape of a cluster on Kubernetes and where it runs; ``ValueError`` if it cannot be built."""

    islands: int
    hosts_per_island: int
    devices_per_host: int
    accelerator: Accelerator
    image: str
    name: str = "pathways-nb"
    namespace: str | None = None
    # Tenants' jax.experimental.colocated_python beside the devices (docs/colocated_python.md).
    colocated_python: bool = False
    # The resource manager's policy on sessions: priorities, idle ones (docs/cluster.md).
    policy: SessionPolicy = field(default_factory=SessionPolicy)

    def __post_init__(self) -> None:
        check_shape(self.islands, self.hosts_per_island, self.devices_per_host, self.accelerator, self.colocated_python)
        if not _DNS_LABEL.match(self.name):
            raise ValueError(
                f"--name {self.name!r} cannot name Kubernetes objects: use lower-case letters, digits and '-', "
                "starting with a letter, e.g. pathways-nb"
            )
        longest = self.pod_hostname("worker", self.islands - 1, self.hosts_per_island - 1)
        if len(longest) > 63:
            raise ValueError(
                f"--name {self.name!r} is too long: pod host names such as {longest} must fit in 63 characters"
            )
        if self.namespace is not None and not _NAMESPACE.match(self.namespace):
            raise ValueError(
                f"--namespace {self.namespace!r} is not a Kubernetes namespace name: use at most 63 lower-case "
                "letters, digits and '-', e.g. ml-team"
            )
        if not self.image or any(c.isspace() for c in self.image):
            raise ValueError(f"--image {self.image!r} is not an image reference, e.g. registry/pathways-nb:0.1.0")

    # -- names -----------------------------------------------------------------------------

    @property
    def subdomain(self) -> str:
        """The headless service JobSet creates for the pods' DNS names."""
        return self.name

    @property
    def token_secret_name(self) -> str:
        return f"{self.name}-token"

    @property
    def proxy_service_name(self) -> str:
        return f"{self.name}-proxy"

    def pod_hostname(self, replicated_job: str, job_index: int | str, pod_index: int | str) -> str:
        return f"{self.name}-{replicated_job}-{job_index}-{pod_index}"

    def pod_address(self, replicated_job: str, job_index: int | str, pod_index: int | str) -> str:
        """A pod's DNS name within the namespace (JobSet's ``enableDNSHostnames``)."""
        return f"{self.pod_hostname(replicated_job, job_index, pod_index)}.{self.subdomain}"

    @property
    def resource_manager_address(self) -> str:
        return f"{self.pod_address('rm', 0, 0)}:{RESOURCE_MANAGER_PORT}"

    @property
    def instance_type(self) -> str:
        """The resource manager's ``--instance_type``: the platform as the workers' jaxlib reports it."""
        return f"{self.accelerator.device_platform}:{self.hosts_per_island}x{self.devices_per_host}"

    def command_line(self) -> str:
        """The ``pathways-nb deploy k8s`` flags that make this deployment (for the manifest's header)."""
        flags = [
            f"--islands {self.islands}",
            f"--hosts_per_island {self.hosts_per_island}",
            f"--devices_per_host {self.devices_per_host}",
            f"--accelerator {self.accelerator.name}",
            f"--image {self.image}",
            f"--name {self.name}",
        ]
        if self.namespace is not None:
            flags.append(f"--namespace {self.namespace}")
        if self.colocated_python:
            flags.append("--colocated_python")
        flags += map(shlex.quote, self.policy.flags())
        return "pathways-nb deploy k8s " + " ".join(flags)


# -- the objects -----------------------------------------------------------------------------


def jobset(deployment: Deployment) -> dict[str, Any]:
    """The JobSet: the resource manager first, then (once it serves) the proxy and the workers."""
    d = deployment
    server_flags = ["--host=0.0.0.0", f"--token_file={TOKEN_FILE}"]
    resource_manager = _replicated_job(
        d,
        "rm",
        args=[
            "resource-manager",
            f"--server_port={RESOURCE_MANAGER_PORT}",
            *server_flags,
            f"--instance_count={d.islands}",
            f"--instance_type={d.instance_type}",
            *d.policy.flags(),
        ],
        port=RESOURCE_MANAGER_PORT,
        requests={"cpu": "500m", "memory": "1Gi"},
    )
    proxy = _replicated_job(
        d,
        "proxy",
        args=[
            "proxy",
            f"--server_port={PROXY_PORT}",
            *server_flags,
            f"--resource_manager_address={d.resource_manager_address}",
            f"--session_device_bytes={_session_device_bytes(d)}",
        ],
        port=PROXY_PORT,
        requests={"cpu": "1", "memory": "4Gi"},
        after="rm",
    )
    accelerator = d.accelerator
    worker = _replicated_job(
        d,
        "worker",
        args=[
            "worker",
            f"--server_port={WORKER_PORT}",
            *server_flags,
            f"--advertise_address={d.pod_address('worker', '$(ISLAND)', '$(JOB_COMPLETION_INDEX)')}",
            f"--resource_manager_address={d.resource_manager_address}",
            "--island=$(ISLAND)",
            "--host_index=$(JOB_COMPLETION_INDEX)",
            f"--platform={accelerator.platform}",
            f"--devices={d.devices_per_host}",
            *_island_flags(d),
            *(["--colocated_python", f"--colocated_python_host=unix:{COLOCATED_SOCKET}"] if d.colocated_python else []),
        ],
        port=WORKER_PORT,
        requests=_worker_requests(d),
        limits=accelerator.worker_resources(),
        env=[
            {
                "name": "ISLAND",
                "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{JOB_INDEX_ANNOTATION}']"}},
            }
        ],
        node_selector=accelerator.worker_node_selector(d.hosts_per_island),
        replicas=d.islands,
        pods=d.hosts_per_island,
        after="rm",
        job_annotations=(
            {EXCLUSIVE_TOPOLOGY_ANNOTATION: NODE_POOL_LABEL} if accelerator.topology_label is not None else {}
        ),
        colocated_host=d.colocated_python,
    )
    return {
        "apiVersion": JOBSET_API_VERSION,
        "kind": "JobSet",
        "metadata": _metadata(d, d.name),
        "spec": {
            "network": {"enableDNSHostnames": True, "subdomain": d.subdomain},
            "failurePolicy": {"maxRestarts": MAX_JOBSET_RESTARTS, "restartStrategy": "Recreate"},
            "replicatedJobs": [resource_manager, proxy, worker],
        },
    }


def _worker_memory_gib(d: Deployment) -> int | None:
    """The memory a CPU worker asks for (its devices' arrays live there); None for accelerators."""
    return 2 * d.devices_per_host if d.accelerator.resource is None else None


def _worker_requests(d: Deployment) -> dict[str, str]:
    memory = _worker_memory_gib(d)
    if memory is None:  # the arrays live in the chips' memory
        return {"cpu": "8", "memory": "32Gi"}
    return {"cpu": str(d.devices_per_host), "memory": f"{memory}Gi"}


def _island_flags(d: Deployment) -> list[str]:
    """The flags that make the pods of a multi-host island one distributed runtime, led by its pod 0."""
    if d.hosts_per_island == 1:
        return []
    coordinator = d.pod_address("worker", "$(ISLAND)", 0)
    return [f"--hosts_per_island={d.hosts_per_island}", f"--coordinator_address={coordinator}:{COORDINATOR_PORT}"]


def _session_device_bytes(d: Deployment) -> int:
    """The proxy's per-session device memory quota: half the CPU workers' memory; 0 (none) for accelerators.

    The proxy's default is half of its own machine's memory, which says nothing of the workers' here;
    accelerators' runtimes enforce their own limit.
    """
    memory = _worker_memory_gib(d)
    return 0 if memory is None else d.islands * d.hosts_per_island * memory * 2**30 // 2


def proxy_service(deployment: Deployment) -> dict[str, Any]:
    """The proxy's port (the IFRT protocol and the observe API share it) under a stable name."""
    d = deployment
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(d, d.proxy_service_name, component="proxy"),
        "spec": {
            "selector": {"jobset.sigs.k8s.io/jobset-name": d.name, "jobset.sigs.k8s.io/replicatedjob-name": "proxy"},
            "ports": [
                {"name": "grpc", "port": PROXY_PORT, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "grpc"}
            ],
        },
    }


def token_secret(deployment: Deployment, token: str) -> dict[str, Any]:
    """The Secret every server reads the cluster token from."""
    d = deployment
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(d, d.token_secret_name),
        "type": "Opaque",
        "stringData": {TOKEN_KEY: token},
    }


def _metadata(d: Deployment, name: str, component: str | None = None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name}
    if d.namespace is not None:
        metadata["namespace"] = d.namespace
    metadata["labels"] = _labels(d, component)
    return metadata


def _labels(d: Deployment, component: str | None = None) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "pathways-nb", "app.kubernetes.io/instance": d.name}
    if component is not None:
        labels["app.kubernetes.io/component"] = component
    return labels


def _replicated_job(
    d: Deployment,
    name: str,
    args: list[str],
    port: int,
    requests: dict[str, str],
    limits: dict[str, str] | None = None,
    env: list[dict[str, Any]] | None = None,
    node_selector: dict[str, str] | None = None,
    replicas: int = 1,
    pods: int = 1,
    job_annotations: dict[str, str] | None = None,
    after: str | None = None,
    colocated_host: bool = False,
) -> dict[str, Any]:
    """One replicated job: ``replicas`` Indexed Jobs of ``pods`` pods, each running one server.

    ``colocated_host``: each pod also runs ``pathways-nb colocated-host`` beside the server, the
    supervisor of its colocated Python executors (the worker never runs a tenant's code).
    """
    container: dict[str, Any] = {
        "name": name,
        "image": d.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["pathways-nb"],
        "args": args,
    }
    if env:
        container["env"] = env
    container["ports"] = [{"name": "grpc", "containerPort": port, "protocol": "TCP"}]
    # Ready once it serves: the servers answer the standard gRPC health check without the token.
    container["readinessProbe"] = {"grpc": {"port": port}, "periodSeconds": 5}
    resources: dict[str, Any] = {"requests": {**requests, **(limits or {})}}
    if limits:
        resources["limits"] = dict(limits)
    container["resources"] = resources
    container["volumeMounts"] = [{"name": "token", "mountPath": TOKEN_DIRECTORY, "readOnly": True}]
    pod_spec: dict[str, Any] = {
        "restartPolicy": "OnFailure",
        # No *_SERVICE_HOST variables: nothing reads them, and they would share the PATHWAYS_ prefix.
        "enableServiceLinks": False,
    }
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    pod_spec["containers"] = [container]
    pod_spec["volumes"] = [{"name": "token", "secret": {"secretName": d.token_secret_name, "defaultMode": 0o400}}]
    if colocated_host:
        _add_colocated_host(d, pod_spec, requests)
    job_metadata: dict[str, Any] = {"labels": _labels(d, name)}
    if job_annotations:
        job_metadata["annotations"] = job_annotations
    replicated_job: dict[str, Any] = {"name": name, "replicas": replicas}
    if after is not None:
        # Created once ``after``'s pods are ready (its server answers health checks).
        replicated_job["dependsOn"] = [{"name": after, "status": "Ready"}]
    replicated_job["template"] = {
        "metadata": job_metadata,
        "spec": {
            "parallelism": pods,
            "completions": pods,
            "completionMode": "Indexed",
            "backoffLimit": BACKOFF_LIMIT,
            "template": {"metadata": {"labels": _labels(d, name)}, "spec": pod_spec},
        },
    }
    return replicated_job


def _add_colocated_host(d: Deployment, pod_spec: dict[str, Any], requests: dict[str, str]) -> None:
    """Puts ``pathways-nb colocated-host`` beside the pod's server (its first container): a sidecar that shares
    the socket's directory and ``/dev/shm`` with it."""
    shared = [
        {"name": "colocated", "mountPath": COLOCATED_DIRECTORY},
        {"name": "shm", "mountPath": "/dev/shm"},
    ]
    pod_spec["containers"][0]["volumeMounts"].extend(shared)
    pod_spec["containers"].append(
        {
            "name": "colocated-host",
            "image": d.image,
            "imagePullPolicy": "IfNotPresent",
            "command": ["pathways-nb"],
            "args": ["colocated-host", f"--socket={COLOCATED_SOCKET}", f"--token_file={TOKEN_FILE}"],
            "resources": {"requests": dict(requests)},
            "volumeMounts": [{"name": "token", "mountPath": TOKEN_DIRECTORY, "readOnly": True}, *shared],
        }
    )
    pod_spec["volumes"].append({"name": "colocated", "emptyDir": {}})
    pod_spec["volumes"].append({"name": "shm", "emptyDir": {"medium": "Memory"}})


# -- files -----------------------------------------------------------------------------------


def manifest_text(deployment: Deployment) -> str:
    """``pathways-nb.yaml``: how it was made and how to use it, then the JobSet and the Service."""
    import yaml  # (here, not at the top: every pathways-nb command builds this command's parser)

    d = deployment
    namespace = f" -n {d.namespace}" if d.namespace is not None else ""
    build_args = (
        f' --build-arg EXTRA_REQUIREMENTS="{d.accelerator.extra_requirements}"'
        if d.accelerator.extra_requirements
        else ""
    )
    header = (
        f"# A pathways-nb cluster on Kubernetes (JobSet {JOBSET_API_VERSION}): a resource manager, a proxy,\n"
        f"# and {d.islands} island(s) of {d.hosts_per_island} {d.accelerator.name} host(s) with "
        f"{d.devices_per_host} device(s) each.\n"
        f"# Made by: {d.command_line()}\n"
        "# See docs/kubernetes.md. In short, from the repository root:\n"
        f"#   docker build -f DIR/Dockerfile -t {d.image}{build_args} .   (DIR: this directory; then push it\n"
        "#   where the cluster can pull it)\n"
        f"#   kubectl apply{namespace} -f {SECRET_FILE} -f {MANIFEST_FILE}   (in this directory)\n"
        f"#   kubectl port-forward{namespace} svc/{d.proxy_service_name} {PROXY_PORT}:{PROXY_PORT}\n"
        f'#   pathways_nb.connect("grpc://localhost:{PROXY_PORT}")\n'
    )
    return header + yaml.safe_dump_all([jobset(d), proxy_service(d)], sort_keys=False, width=120)


def write(deployment: Deployment, output: str | pathlib.Path) -> list[pathlib.Path]:
    """Writes the manifests, the token Secret, the Dockerfile and its ignore file into ``output``.

    An existing ``secret.yaml`` keeps its token, so re-running with new sizes and
    re-applying does not change the token under running servers.
    """
    import yaml

    directory = pathlib.Path(output)
    directory.mkdir(parents=True, exist_ok=True)
    secret_path = directory / SECRET_FILE
    token = _existing_token(secret_path) or generate_token()
    files = {
        MANIFEST_FILE: manifest_text(deployment),
        SECRET_FILE: yaml.safe_dump(token_secret(deployment, token), sort_keys=False),
        "Dockerfile": DOCKERFILE,
        # BuildKit reads <Dockerfile>.dockerignore beside a Dockerfile given with -f.
        "Dockerfile.dockerignore": DOCKERIGNORE,
        ".gitignore": GITIGNORE,
    }
    written = []
    for name, text in files.items():
        path = directory / name
        # The Secret holds the token: readable by this user only, from the first byte on.
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if name == SECRET_FILE else 0o644)
        with os.fdopen(descriptor, "w") as f:
            f.write(text)
        written.append(path)
    secret_path.chmod(0o600)
    return written


def _existing_token(path: pathlib.Path) -> str | None:
    """The token of a Secret written earlier to ``path``, if there is one."""
    import yaml

    try:
        secret = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(secret, dict) or secret.get("kind") != "Secret":
        return None
    token = (secret.get("stringData") or {}).get(TOKEN_KEY)
    if token is None and TOKEN_KEY in (secret.get("data") or {}):
        token = base64.b64decode(secret["data"][TOKEN_KEY]).decode()
    return token.strip() if isinstance(token, str) and token.strip() else None


def add_parser(targets, common: argparse.ArgumentParser) -> None:
    """``deploy k8s``, among ``targets`` (``deploy``'s commands); ``common``: every command's flags."""
    k8s = targets.add_parser(
        "k8s", parents=[common], help="Kubernetes: a JobSet, the proxy's Service, the token Secret, a Dockerfile"
    )
    k8s.add_argument("--islands", type=int, required=True, help="number of islands (one worker Job each)")
    k8s.add_argument("--hosts_per_island", type=int, required=True, help="hosts (worker pods) per island")
    k8s.add_argument("--devices_per_host", type=int, required=True, help="devices (chips) per host")
    k8s.add_argument("--accelerator", default="cpu", help="cpu, tpu-v5e:2x2 or nvidia-h100:8 (default cpu)")
    k8s.add_argument("--image", default=f"pathways-nb:{__version__}", help="the image built from this repository")
    k8s.add_argument("--namespace", default=None, help="Kubernetes namespace (default: kubectl's current one)")
    k8s.add_argument("--name", default="pathways-nb", help="the JobSet's name, which prefixes every object's")
    k8s.add_argument(
        "--colocated_python",
        action="store_true",
        help="run tenants' jax.experimental.colocated_python beside the devices: each worker pod gets a "
        "colocated-host sidecar (CPU workers; docs/colocated_python.md)",
    )
    policy.add_arguments(k8s)
    k8s.add_argument("--output", required=True, help="directory to write the files into")
    k8s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Writes the files ``deploy k8s`` names into ``--output``, and says what to do next."""
    from pathways_nb.deploy.accelerators import accelerator

    deployment = Deployment(
        islands=args.islands,
        hosts_per_island=args.hosts_per_island,
        devices_per_host=args.devices_per_host,
        accelerator=accelerator(args.accelerator),
        image=args.image,
        name=args.name,
        namespace=args.namespace,
        colocated_python=args.colocated_python,
        policy=SessionPolicy(args.suspend_idle_after, args.suspend_idle_always, args.priority_ceiling),
    )
    for path in write(deployment, args.output):
        print(f"wrote {path}")
    print(f"next: build and push {args.image}, kubectl apply -f {args.output}, then see docs/kubernetes.md")
    return 0
