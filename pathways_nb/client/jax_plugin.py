"""JAX's ``proxy`` backend: the IFRT proxy client that ships inside jaxlib.

Installed as an entry point of the ``jax_plugins`` group, so that
``JAX_PLATFORMS=proxy JAX_BACKEND_TARGET=grpc://host:port python ...`` works
with no import. ``initialize()`` registers the backend only when ``proxy`` is
among the requested platforms: an unconditional registration would make JAX
try (and log about) the proxy in every plain local program.

When the first proxy client of a process has its server on this host, large
uploads go through shared memory (the client's large-transfer mode, which it
reads from two variables once per process): see ``_shared_uploads``.
"""

from __future__ import annotations

import os
import sys

from pathways_nb.client import batch_flusher
from pathways_nb.core import tuning

PLATFORM = "proxy"
# Same variable as Google's pathwaysutils, so settings carry over.
TIMEOUT_ENV = "PATHWAYS_PROXY_CONNECTION_TIMEOUT_SECS"
INSECURE_ENV = "IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS"
# The stock client's large-transfer mode: buffers of THRESHOLD bytes and up are written to
# DIRECTORY/lt_<handle> and the server reads them from there (HostBufferReadFromDisk).
THRESHOLD_ENV = "IFRT_PROXY_GRPC_LARGE_TRANSFER_OPTIMIZATION_THRESHOLD_BYTES"
DIRECTORY_ENV = "IFRT_PROXY_GRPC_LARGE_TRANSFER_OPTIMIZATION_DIRECTORY"
_SHARED_PURPOSE = "ifrt"

# Set by pathways_nb.connect: what this process asks of the cluster (None: the defaults).
session_options = None
# This process's shared-memory uploads, once its first client turned them on.
_uploads = None
_first_client = True


def _requested_platforms() -> list[str]:
    import jax

    return [p.strip() for p in (jax.config.jax_platforms or "").split(",") if p.strip()]


def initialize() -> None:
    """Called by JAX's plugin discovery; registers the backend if the user asked for it."""
    if PLATFORM in _requested_platforms():
        register()


def register() -> None:
    """Registers (or re-registers) the ``proxy`` backend factory."""
    from jax.extend.backend import register_backend_factory

    # fail_quietly only applies when JAX_PLATFORMS is unset; an explicit request fails loudly.
    register_backend_factory(PLATFORM, make_client, priority=-1, fail_quietly=True)


def unregister() -> None:
    """Removes the factory, so JAX with no platform set never tries the proxy (JAX has no public call)."""
    from jax._src import xla_bridge

    xla_bridge._backend_factories.pop(PLATFORM, None)


def connection_timeout_s() -> float:
    value = os.environ.get(TIMEOUT_ENV)
    if not value:
        return tuning.CONNECT_TIMEOUT_S.value
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds, got {value!r}") from None


def make_client():
    """Connects jaxlib's IFRT proxy client to ``jax_backend_target``."""
    import jax
    from jax.extend.backend import ifrt_proxy

    target = jax.config.read("jax_backend_target")
    if not target:
        raise RuntimeError(
            "JAX_PLATFORMS includes 'proxy' but no server address is set: set "
            "JAX_BACKEND_TARGET=grpc://host:port, or call pathways_nb.connect('grpc://host:port')"
        )
    _refuse_a_server_of_this_process(target)
    # The client defaults to ALTS, which works only inside Google Cloud; our clusters (and
    # Pathways on Cloud behind a port-forward) are reached over plain gRPC.
    os.environ.setdefault(INSECURE_ENV, "true")
    options = ifrt_proxy.ClientConnectionOptions()
    options.connection_timeout_in_seconds = max(1, round(connection_timeout_s()))
    from pathways_nb.core.session_options import SessionOptions, client_versions

    requested = session_options if session_options is not None else SessionOptions.from_environment()
    initialization_data = requested.to_initialization_data() if requested is not None else {}
    initialization_data.update(_shared_uploads(target, min(tuning.PROBE_TIMEOUT_S.value, connection_timeout_s())))
    initialization_data.update(client_versions())
    options.initialization_data = initialization_data
    # No on_disconnect callback: the client calls it from its destructor, which at interpreter
    # exit runs after Python can no longer be entered, and the process aborts.
    with batch_flusher.demoting_new_flusher():
        return ifrt_proxy.get_client(target, options)


def _refuse_a_server_of_this_process(target: str) -> None:
    """Raises if ``target`` is a proxy this process serves itself (the connection would hang for good)."""
    served = sys.modules.get("pathways_nb.proxy.server")
    port = target.rpartition(":")[2]
    if served is None or not port.isdigit() or not served.serves_here(int(port)) or not _is_local(target):
        return
    raise RuntimeError(
        f"the IFRT proxy at {target} runs in this Python process, and jaxlib's client holds the GIL "
        "while it waits for the server's replies, so the two would wait for each other forever. Serve it "
        "from another process: `pathways-nb proxy`, `pathways-nb up`, or pathways_nb.launch.local_cluster.LocalCluster "
        "(whose servers are child processes)"
    )


class _SharedUploads:
    """This process's upload directory (private, 0700), and what proves it to the server."""

    def __init__(self, key: str):
        import secrets

        from pathways_nb.core import shared_memory

        self.key = key
        self.directory = shared_memory.SharedDirectory(_SHARED_PURPOSE)
        self.secret = secrets.token_hex(16)
        self.directory.write("owner", self.secret.encode())

    def attributes(self) -> dict[str, bytes]:
        from pathways_nb.core import session_options as names

        return {
            names.SHARED_DIRECTORY: os.fsencode(self.directory.path),
            names.SHARED_SECRET: self.secret.encode(),
            names.SHARED_HOST: self.key.encode(),
        }


def _shared_uploads(target: str, timeout_s: float) -> dict[str, bytes]:
    """The initialization data naming this process's upload directory, where ``target`` can read it.

    The client reads its large-transfer variables once, at the first client of
    the process, so that client decides for the process's life: shared memory
    is on if its server says (``Observe.GetHost``) it runs on this host, and
    ``PATHWAYS_SHARED_MEMORY=0`` or variables the user set keep it off. Once on,
    a client for a server elsewhere is refused here, since that server could not
    read the uploads; once off, every client uses gRPC.
    """
    global _uploads, _first_client
    from pathways_nb.core import session_options as names
    from pathways_nb.core import shared_memory

    first, _first_client = _first_client, False
    if _uploads is not None:
        if _is_local(target) and _server_key(target, timeout_s) == _uploads.key:
            return _uploads.attributes()
        raise RuntimeError(
            f"the server at {target} is not on this host, and this process sends uploads of "
            f"{tuning.CLIENT_SHARED_MEMORY_BYTES.value} bytes and more through shared memory, which that server "
            "cannot read "
            "(the IFRT client fixes this at a process's first connection). Connect from a new process (restart "
            f"the kernel), or set {shared_memory.ENABLE_ENV}=0 before the first connection"
        )
    if not first:
        return {}
    inherited = shared_memory.contains(os.environ.get(DIRECTORY_ENV, "/"))
    if inherited:  # a pathways-nb parent's directory: never this process's (handles would collide)
        del os.environ[DIRECTORY_ENV]
        os.environ.pop(THRESHOLD_ENV, None)
    if THRESHOLD_ENV in os.environ or DIRECTORY_ENV in os.environ:
        return {}  # the user's own large-transfer settings
    key = names.shared_memory_key()
    if not key or not _is_local(target) or _server_key(target, timeout_s) != key:
        return {}
    try:
        _uploads = _SharedUploads(key)
    except OSError:
        return {}
    os.environ[DIRECTORY_ENV] = str(_uploads.directory.path)
    os.environ[THRESHOLD_ENV] = str(tuning.CLIENT_SHARED_MEMORY_BYTES.value)
    return _uploads.attributes()


def _is_local(target: str) -> bool:
    """Whether ``target``'s host is an address of this network namespace (a host key includes it)."""
    import socket

    host = target.removeprefix("grpc://").rpartition(":")[0].strip("[]")
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except OSError:
        return False
    for address in addresses:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((address, 0))  # succeeds only for an address of this namespace
            return True
        except OSError:
            continue
    return False


def _server_key(target: str, timeout_s: float) -> str:
    """The server's ``shared_memory_key()``; empty if it does not say (not ours, or not reachable)."""
    import grpc

    from pathways_nb.core.security import ClusterCredentials
    from pathways_nb.rpc import cluster_pb2, cluster_pb2_grpc

    # The probe needs no token (security.OPEN_METHOD_PREFIXES): plain JAX_PLATFORMS=proxy processes hold none.
    channel = ClusterCredentials().channel(target.removeprefix("grpc://"))
    try:
        stub = cluster_pb2_grpc.ObserveStub(channel)
        return stub.GetHost(cluster_pb2.GetHostRequest(), timeout=timeout_s, wait_for_ready=True).shared_memory_key
    except grpc.RpcError:
        return ""
    finally:
        channel.close()
