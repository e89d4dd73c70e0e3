"""JAX's ``proxy`` backend: the IFRT proxy client that ships inside jaxlib.

Installed as an entry point of the ``jax_plugins`` group, so that
``JAX_PLATFORMS=proxy JAX_BACKEND_TARGET=grpc://host:port python ...`` works
with no import. ``initialize()`` registers the backend only when ``proxy`` is
among the requested platforms: an unconditional registration would make JAX
try (and log about) the proxy in every plain local program.
"""

from __future__ import annotations

import os

PLATFORM = "proxy"
# Same variable as Google's pathwaysutils, so settings carry over.
TIMEOUT_ENV = "PATHWAYS_PROXY_CONNECTION_TIMEOUT_SECS"
INSECURE_ENV = "IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS"
DEFAULT_TIMEOUT_S = 60.0

# Set by pathways_nb.connect: what this process asks of the cluster (None: the defaults).
session_options = None


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
        return DEFAULT_TIMEOUT_S
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
    # The client defaults to ALTS, which works only inside Google Cloud; our clusters (and
    # Pathways on Cloud behind a port-forward) are reached over plain gRPC.
    os.environ.setdefault(INSECURE_ENV, "true")
    options = ifrt_proxy.ClientConnectionOptions()
    options.connection_timeout_in_seconds = max(1, round(connection_timeout_s()))
    from pathways_nb.session_options import SessionOptions

    requested = session_options if session_options is not None else SessionOptions.from_environment()
    if requested is not None:
        options.initialization_data = requested.to_initialization_data()
    # No on_disconnect callback: the client calls it from its destructor, which at interpreter
    # exit runs after Python can no longer be entered, and the process aborts.
    return ifrt_proxy.get_client(target, options)
