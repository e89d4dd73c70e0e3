"""What a cluster is meant to look like: ``--instance_count`` islands of ``--instance_type``.

``cpu:2x4`` means islands of 2 hosts with 4 CPU devices each, as Pathways'
``--instance_type`` names a slice's shape. The platform is the one workers'
devices report, jaxlib's name: ``gpu`` for CUDA and ROCm (``cuda`` and ``rocm``
are read as ``gpu``). Device ids follow from it, so they stay the same when a
worker restarts: island i, host h, local device d has id ``(i * hosts + h) * devices + d``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_INSTANCE_TYPE = re.compile(r"^(?P<platform>[a-z][a-z0-9_]*):(?P<hosts>\d+)x(?P<devices>\d+)$")
# Workers are told JAX's platform names (``--platform cuda``); their devices report jaxlib's (``gpu``).
JAXLIB_PLATFORM = {"cuda": "gpu", "rocm": "gpu"}


@dataclass(frozen=True)
class Topology:
    islands: int
    platform: str
    hosts_per_island: int
    devices_per_host: int

    @classmethod
    def parse(cls, instance_count: int, instance_type: str) -> Topology:
        match = _INSTANCE_TYPE.match(instance_type.strip().lower())
        if not match:
            raise ValueError(
                f"--instance_type {instance_type!r} is not PLATFORM:HOSTSxDEVICES, e.g. cpu:1x4 "
                "(islands of 1 host with 4 devices)"
            )
        platform = JAXLIB_PLATFORM.get(match["platform"], match["platform"])
        topology = cls(instance_count, platform, int(match["hosts"]), int(match["devices"]))
        if min(topology.islands, topology.hosts_per_island, topology.devices_per_host) < 1:
            raise ValueError(f"--instance_count {instance_count} --instance_type {instance_type}: sizes must be >= 1")
        return topology

    @property
    def instance_type(self) -> str:
        return f"{self.platform}:{self.hosts_per_island}x{self.devices_per_host}"

    @property
    def devices(self) -> int:
        """How many devices the cluster has (colocated CPU devices not counted)."""
        return self.islands * self.hosts_per_island * self.devices_per_host

    def device_id(self, island: int, host_index: int, local_id: int) -> int:
        return (island * self.hosts_per_island + host_index) * self.devices_per_host + local_id

    def check_worker(self, island: int, host_index: int, platform: str, device_count: int) -> None:
        """Raises ``ValueError`` saying how a worker does not fit."""
        if not 0 <= island < self.islands:
            raise ValueError(f"island {island} does not exist: the cluster has islands 0-{self.islands - 1}")
        if not 0 <= host_index < self.hosts_per_island:
            raise ValueError(f"host {host_index} does not exist: islands have hosts 0-{self.hosts_per_island - 1}")
        if platform != self.platform:
            raise ValueError(f"the worker's devices are {platform}, the cluster's are {self.platform}")
        if device_count != self.devices_per_host:
            raise ValueError(
                f"the worker has {device_count} devices, hosts of this cluster have {self.devices_per_host} "
                f"(--instance_type {self.instance_type})"
            )
