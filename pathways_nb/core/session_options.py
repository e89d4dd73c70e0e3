"""What a client asks of the cluster when it connects: who it is, how many devices, shared or exclusive,
how urgent.

They travel in the IFRT client's ``ClientConnectionOptions.initialization_data``
(a map of str to bytes/int/bool), which the proxy receives with the session.
"""

from __future__ import annotations

import getpass
import os
import socket
from dataclasses import dataclass, field
from typing import Any

TENANT, EXCLUSIVE, DEVICES, ISLANDS, TIMEOUT, SECRET, WEIGHT, ONE_SLICE = (
    "pathways_tenant",
    "pathways_exclusive",
    "pathways_devices",
    "pathways_islands",
    "pathways_allocation_timeout_s",
    "pathways_session_secret",
    "pathways_weight",
    "pathways_one_slice",
)
PRIORITY = "pathways_priority"
# For plain ``JAX_PLATFORMS=proxy`` programs, which never call ``pathways_nb.connect``.
TENANT_ENV, WEIGHT_ENV, ONE_SLICE_ENV, PRIORITY_ENV = (
    "PATHWAYS_TENANT",
    "PATHWAYS_WEIGHT",
    "PATHWAYS_ONE_SLICE",
    "PATHWAYS_PRIORITY",
)
# A priority travels as a protobuf int32 (AllocateRequest.priority).
_PRIORITIES = range(-(2**31), 2**31)
_PRIORITY_RULE = f"an integer from {_PRIORITIES.start} to {_PRIORITIES.stop - 1} (higher goes first, default 0)"
# Shared-memory uploads (jax_plugin): the client's upload directory, the secret in its ``owner``
# file (proves the proxy sees the client's files), and ``shared_memory_key()`` of the client.
SHARED_DIRECTORY, SHARED_SECRET, SHARED_HOST = (
    "pathways_shared_directory",
    "pathways_shared_secret",
    "pathways_shared_host",
)

# The client's Python, jax and cloudpickle versions: colocated Python unpickles the client's functions,
# which only works between equal versions (the executor refuses others, naming both).
CLIENT_PYTHON, CLIENT_JAX, CLIENT_CLOUDPICKLE = (
    "pathways_client_python",
    "pathways_client_jax",
    "pathways_client_cloudpickle",
)
_CLIENT_VERSIONS = {CLIENT_PYTHON: "python", CLIENT_JAX: "jax", CLIENT_CLOUDPICKLE: "cloudpickle"}


def client_versions() -> dict[str, bytes]:
    """This process's versions, as initialization data (cloudpickle's only where it is installed)."""
    import importlib.metadata
    import sys

    import jax

    versions = {CLIENT_PYTHON: ".".join(str(n) for n in sys.version_info[:3]), CLIENT_JAX: jax.__version__}
    try:
        versions[CLIENT_CLOUDPICKLE] = importlib.metadata.version("cloudpickle")
    except importlib.metadata.PackageNotFoundError:
        pass
    return {key: value.encode() for key, value in versions.items()}


def read_client_versions(attributes: dict[str, Any]) -> dict[str, str]:
    """The versions a session's client sent: ``{"python": ..., "jax": ..., "cloudpickle": ...}``."""
    found = {}
    for key, name in _CLIENT_VERSIONS.items():
        value = attributes.get(key)
        if isinstance(value, bytes):
            found[name] = value.decode(errors="replace")[:64]
    return found


def shared_memory_key() -> str:
    """sha256 of ``shared_memory.host_key()`` (empty if none): equal for a client and a proxy of one host.

    A digest, so that what the proxy tells callers names no boot id, namespace or user.
    """
    import hashlib

    from pathways_nb.core import shared_memory

    key = shared_memory.host_key()
    return hashlib.sha256(key.encode()).hexdigest() if key else ""


def default_tenant() -> str:
    """``user@host:pid``: one tenant per client process."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "user"
    return f"{user}@{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class SessionOptions:
    tenant: str = field(default_factory=default_tenant)
    exclusive: bool = False
    num_devices: int = 0  # 0: every device (of the chosen islands)
    islands: tuple[int, ...] = ()  # empty: any
    timeout_s: float = 60.0  # how long to wait for devices
    # Random per connection: proves to the proxy's EndSessions that a session is the caller's own.
    secret: str = field(default="", repr=False)
    # The tenant's share of busy devices relative to other tenants (proportional share).
    weight: float = 1.0
    # All islands one slice (every device's slice_index 0), not a slice each as Pathways shows TPU slices.
    one_slice: bool = False
    # Higher first: an exclusive request of a higher priority has the sessions that hold its devices
    # suspended; the cluster caps it per tenant (--priority_ceiling).
    priority: int = 0

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"weight must be a positive number, got {self.weight!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) or self.priority not in _PRIORITIES:
            raise ValueError(f"priority must be {_PRIORITY_RULE}, got {self.priority!r}")

    def to_initialization_data(self) -> dict[str, bytes | bool | int]:
        return {
            TENANT: self.tenant.encode(),
            EXCLUSIVE: self.exclusive,
            DEVICES: self.num_devices,
            ISLANDS: ",".join(str(i) for i in self.islands).encode(),
            TIMEOUT: max(1, round(self.timeout_s)),
            SECRET: self.secret.encode(),
            WEIGHT: repr(float(self.weight)).encode(),
            ONE_SLICE: self.one_slice,
            PRIORITY: str(self.priority).encode(),
        }

    @classmethod
    def from_environment(cls) -> SessionOptions | None:
        """What a plain ``JAX_PLATFORMS=proxy`` process asks for (``PATHWAYS_TENANT``, ``PATHWAYS_WEIGHT``,
        ``PATHWAYS_ONE_SLICE``, ``PATHWAYS_PRIORITY``); None if it asks for nothing."""
        tenant, weight, priority = os.environ.get(TENANT_ENV), os.environ.get(WEIGHT_ENV), os.environ.get(PRIORITY_ENV)
        one_slice = os.environ.get(ONE_SLICE_ENV, "").strip().lower()
        if not tenant and not weight and not one_slice and not priority:
            return None
        if one_slice not in ("", "0", "1", "false", "true"):
            raise ValueError(f"{ONE_SLICE_ENV} must be 1 or 0 (true or false), got {one_slice!r}")
        priority_value = _priority(priority or "0", PRIORITY_ENV)
        try:
            weight_value = float(weight or 1.0)
            return cls(
                tenant=tenant or default_tenant(),
                weight=weight_value,
                one_slice=one_slice in ("1", "true"),
                priority=priority_value,
            )
        except ValueError as e:
            raise ValueError(f"{WEIGHT_ENV} must be a positive number, got {weight!r}") from e

    @classmethod
    def from_attributes(
        cls, attributes: dict[str, Any], default_timeout_s: float, default_tenant: str
    ) -> SessionOptions:
        """Reads what the client sent; ``ValueError`` if it is malformed."""

        def text(key: str, default: str) -> str:
            value = attributes.get(key, default)
            return value.decode() if isinstance(value, bytes) else str(value)

        return cls(
            tenant=text(TENANT, default_tenant) or default_tenant,
            exclusive=bool(attributes.get(EXCLUSIVE, False)),
            num_devices=int(attributes.get(DEVICES, 0)),
            islands=tuple(int(i) for i in text(ISLANDS, "").split(",") if i.strip()),
            timeout_s=float(attributes.get(TIMEOUT, default_timeout_s)),
            secret=text(SECRET, ""),
            weight=float(text(WEIGHT, "1.0")),
            one_slice=bool(attributes.get(ONE_SLICE, False)),
            priority=_priority(text(PRIORITY, "0"), PRIORITY),
        )


def _priority(text: str, name: str) -> int:
    """``text`` as a priority; ``ValueError`` naming ``name`` (the variable or attribute) if it is none."""
    try:
        value = int(text.strip())
    except ValueError:
        value = None
    if value is None or value not in _PRIORITIES:
        raise ValueError(f"{name} must be {_PRIORITY_RULE}, got {text!r}")
    return value
