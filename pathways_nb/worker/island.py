"""The hosts of one island as one JAX distributed runtime.

An island of several hosts runs each program as one SPMD program: every
host's worker compiles it for all the island's devices and runs its own part,
and the collectives between hosts go through the platform's own transport
(gloo for CPU devices here; NCCL or ICI where those exist). The workers form
that runtime when they start, before their devices exist: host 0 serves the
coordination service at ``coordinator_address`` and every host joins it. If a
host dies the runtime cannot continue, so the launcher restarts every host of
the island and they form a new one (see ``LocalCluster``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

_LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True)
class IslandMembership:
    """Where this host stands in its island."""

    hosts: int
    host_index: int
    coordinator_address: str  # host:port of host 0's coordination service
    bind_host: str = "127.0.0.1"  # where host 0 listens for it
    # This host's address for the collectives between hosts (gloo's, on CPU); None: gloo's default, what
    # this machine's hostname resolves to (127.0.0.1 on many machines, where no other host can reach it).
    collectives_host: str | None = None
    timeout_s: int = 120
    heartbeat_timeout_s: int = 10

    def check(self) -> None:
        if self.hosts < 1 or not 0 <= self.host_index < self.hosts:
            raise ValueError(f"host index {self.host_index} does not fit an island of {self.hosts} host(s)")
        if self.hosts > 1 and ":" not in self.coordinator_address:
            raise ValueError(
                f"an island of {self.hosts} hosts needs --coordinator_address HOST:PORT (host 0's), "
                f"got {self.coordinator_address!r}"
            )

    def join(self, platform: str) -> None:
        """Joins the island's distributed runtime (call before the first use of JAX's devices)."""
        import jax

        self.check()
        if self.hosts == 1:
            return
        if platform in ("", "cpu"):
            # CPU devices of several processes reach each other through gloo.
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        port = self.coordinator_address.rsplit(":", 1)[1]
        _LOGGER.info(
            "joining island as host %d of %d through %s", self.host_index, self.hosts, self.coordinator_address
        )
        jax.distributed.initialize(
            coordinator_address=self.coordinator_address,
            num_processes=self.hosts,
            process_id=self.host_index,
            initialization_timeout=self.timeout_s,
            heartbeat_timeout_seconds=self.heartbeat_timeout_s,
            coordinator_bind_address=f"{self.bind_host}:{port}" if self.host_index == 0 else None,
        )
        if platform in ("", "cpu") and self.collectives_host:
            _gloo_on(self.collectives_host)


def _gloo_on(host: str) -> None:
    """Makes the CPU backend's gloo collectives listen on (and advertise) ``host``.

    JAX offers no setting for it, so this registers the CPU backend again with gloo made for ``host``
    (before the backend exists: ``join`` runs before the first use of the devices).
    """
    from functools import partial

    from jax._src import distributed, xla_bridge
    from jax._src.lib import _jax

    try:
        collectives = _jax.make_gloo_tcp_collectives(distributed_client=distributed.global_state.client, hostname=host)
    except RuntimeError as error:  # gloo: "Unable to find address for HOST; bind(2) ... failed"
        raise ValueError(
            f"the collectives between hosts cannot listen on {host} (--advertise_address, else --host): {error}; "
            "pass an address or name of this machine that the island's other hosts reach"
        ) from None
    xla_bridge.register_backend_factory(
        "cpu", partial(xla_bridge.make_cpu_client, collectives=collectives), priority=0, fail_quietly=False
    )
