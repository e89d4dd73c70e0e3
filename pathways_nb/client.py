"""Pointing this process's JAX at a Pathways cluster, and back at local devices.

``connect()`` works in a process that has already used local JAX: it sets
JAX's platform and backend target, resets JAX's backends and caches, and
connects at once, so a wrong address fails here (within ``timeout_s``) with a
message that names it, rather than at the first ``jax.devices()``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from pathways_nb import jax_plugin
from pathways_nb.errors import ConnectionFailed, PathwaysError

_LOGGER = logging.getLogger(__name__)

ADDRESS_ENV = "PATHWAYS_ADDRESS"


def normalize_address(address: str) -> str:
    """``host:port`` or ``grpc://host:port`` as ``grpc://host:port``."""
    address = address.strip()
    if not address:
        raise ValueError("the address is empty; pass grpc://host:port")
    if "://" in address and not address.startswith("grpc://"):
        scheme = address.split("://", 1)[0]
        raise ValueError(f"unsupported scheme {scheme!r} in {address!r}; use grpc://host:port")
    if not address.startswith("grpc://"):
        address = "grpc://" + address
    if ":" not in address.removeprefix("grpc://"):
        raise ValueError(f"{address!r} has no port; use grpc://host:port")
    return address


@dataclass
class Connection:
    """What this process is connected to: the address and the devices it was given."""

    address: str
    devices: list = field(repr=False)
    platform: str = ""
    runtime: str = ""

    def __repr__(self) -> str:
        return f"<pathways_nb.Connection {self.address} devices={len(self.devices)} platform={self.platform}>"


@dataclass
class _Previous:
    platforms: str | None
    backend_target: str


_state: dict[str, object] = {}


def connect(address: str | None = None, *, timeout_s: float = 60.0) -> Connection:
    """Makes ``jax.devices()`` the devices of the cluster at ``address``.

    ``address`` defaults to the ``PATHWAYS_ADDRESS`` environment variable.
    Raises ``ConnectionFailed`` (JAX left on its previous devices) if nothing
    answers within ``timeout_s`` seconds.
    """
    import jax
    from jax.extend import backend

    address = normalize_address(address or os.environ.get(ADDRESS_ENV, ""))
    current = _state.get("connection")
    if current is not None:
        raise PathwaysError(f"already connected to {current.address}; call pathways_nb.disconnect() first")
    previous = _Previous(jax.config.jax_platforms, jax.config.read("jax_backend_target"))
    os.environ[jax_plugin.INSECURE_ENV] = "true"
    os.environ[jax_plugin.TIMEOUT_ENV] = str(timeout_s)
    backend.clear_backends()
    jax.config.update("jax_platforms", f"{jax_plugin.PLATFORM},cpu")
    jax.config.update("jax_backend_target", address)
    jax_plugin.register()
    try:
        devices = jax.devices(jax_plugin.PLATFORM)
    except Exception as e:  # noqa: BLE001 - JAX wraps connection errors in RuntimeError
        _restore(previous)
        raise ConnectionFailed(address, timeout_s, str(e)) from None
    jax.clear_caches()
    proxy = backend.get_backend(jax_plugin.PLATFORM)
    connection = Connection(address, devices, proxy.platform, proxy.runtime_type)
    _state["connection"] = connection
    _state["previous"] = previous
    return connection


def disconnect() -> None:
    """Returns JAX to this machine's devices; arrays on the cluster become unusable."""
    if _state.pop("connection", None) is None:
        return
    _restore(_state.pop("previous"))


def current() -> Connection | None:
    """The active connection, or None."""
    return _state.get("connection")


def _restore(previous: _Previous) -> None:
    import gc

    import jax
    from jax.extend import backend

    # Drop compiled programs while the connection is up, so they are released cleanly.
    jax.clear_caches()
    gc.collect()
    backend.clear_backends()
    jax_plugin.unregister()
    jax.config.update("jax_platforms", previous.platforms)
    jax.config.update("jax_backend_target", previous.backend_target)
