"""What a client asks of the cluster when it connects: who it is, how many devices, shared or exclusive.

They travel in the IFRT client's ``ClientConnectionOptions.initialization_data``
(a map of str to bytes/int/bool), which the proxy receives with the session.
"""

from __future__ import annotations

import getpass
import os
import socket
from dataclasses import dataclass, field
from typing import Any

TENANT, EXCLUSIVE, DEVICES, ISLANDS, TIMEOUT, SECRET = (
    "pathways_tenant",
    "pathways_exclusive",
    "pathways_devices",
    "pathways_islands",
    "pathways_allocation_timeout_s",
    "pathways_session_secret",
)


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

    def to_initialization_data(self) -> dict[str, bytes | bool | int]:
        return {
            TENANT: self.tenant.encode(),
            EXCLUSIVE: self.exclusive,
            DEVICES: self.num_devices,
            ISLANDS: ",".join(str(i) for i in self.islands).encode(),
            TIMEOUT: max(1, round(self.timeout_s)),
            SECRET: self.secret.encode(),
        }

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
        )
