"""The accelerators a deployment can ask Kubernetes for, and what each means for a worker pod.

Names say the chip and what one host holds: ``tpu-v5e:2x2`` is a TPU v5e host
with a 2x2 block of chips (GKE machine type ct5lp-hightpu-4t), ``nvidia-h100:8``
a machine with eight H100 GPUs, ``cpu`` any node (the workers' devices are XLA
CPU devices). A TPU island of several hosts is one multi-host slice, so its
node selector names the slice's topology (2 hosts of 2x2 chips form a 2x4 slice).
"""

from __future__ import annotations

from dataclasses import dataclass, field

TPU_RESOURCE = "google.com/tpu"
GPU_RESOURCE = "nvidia.com/gpu"


@dataclass(frozen=True)
class Accelerator:
    """One kind of host: the chips it has and how a pod gets them."""

    name: str
    # The worker's --platform flag (what JAX is told to use).
    platform: str
    # What jaxlib calls the platform of those devices, which the resource manager's
    # --instance_type must name: jaxlib reports CUDA devices as "gpu".
    device_platform: str
    # Devices per host; None: any number (CPU devices are made up by XLA).
    chips_per_host: int | None = None
    # The extended resource a worker pod asks for (one per chip), and the node labels it selects.
    resource: str | None = None
    node_selector: dict[str, str] = field(default_factory=dict)
    # The slice topology label value by hosts per island (TPUs only; empty: any host count).
    topologies: dict[int, str] = field(default_factory=dict)
    topology_label: str | None = None
    # What the image installs besides pathways-nb for these chips (its EXTRA_REQUIREMENTS build argument).
    extra_requirements: str = ""
    # The flag that asked for these hosts, for messages (default: --accelerator NAME).
    flag: str = ""

    @property
    def asked_by(self) -> str:
        return self.flag or f"--accelerator {self.name}"

    def check(self, hosts_per_island: int, devices_per_host: int) -> None:
        """Raises ``ValueError`` saying how islands of this shape cannot be made of these hosts."""
        if self.chips_per_host is not None and devices_per_host != self.chips_per_host:
            raise ValueError(
                f"--devices_per_host {devices_per_host} does not match {self.asked_by}, whose hosts "
                f"have {self.chips_per_host} chips: use --devices_per_host {self.chips_per_host}"
            )
        if self.topologies and hosts_per_island not in self.topologies:
            shapes = ", ".join(f"{hosts} ({topology})" for hosts, topology in self.topologies.items())
            raise ValueError(
                f"--hosts_per_island {hosts_per_island}: {self.name} slices come with {shapes} hosts; "
                "choose one of those host counts"
            )

    def worker_node_selector(self, hosts_per_island: int) -> dict[str, str]:
        """The node labels a worker of an island of ``hosts_per_island`` hosts must land on."""
        selector = dict(self.node_selector)
        if self.topology_label is not None:
            selector[self.topology_label] = self.topologies[hosts_per_island]
        return selector

    def worker_resources(self) -> dict[str, str]:
        """The extended resources (chips) a worker pod takes: as limits, which Kubernetes requires of them."""
        return {self.resource: str(self.chips_per_host)} if self.resource else {}


ACCELERATORS: dict[str, Accelerator] = {
    accelerator.name: accelerator
    for accelerator in (
        Accelerator(name="cpu", platform="cpu", device_platform="cpu"),
        Accelerator(
            name="tpu-v5e:2x2",
            platform="tpu",
            device_platform="tpu",
            chips_per_host=4,
            resource=TPU_RESOURCE,
            node_selector={"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice"},
            # v5e slices of 4-chip hosts: chips = 4 x hosts, laid out as a 2D torus.
            topologies={1: "2x2", 2: "2x4", 4: "4x4", 8: "4x8", 16: "8x8", 32: "8x16", 64: "16x16"},
            topology_label="cloud.google.com/gke-tpu-topology",
            extra_requirements="jax[tpu]",
        ),
        Accelerator(
            name="nvidia-h100:8",
            platform="cuda",
            device_platform="gpu",
            chips_per_host=8,
            resource=GPU_RESOURCE,
            node_selector={"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
            extra_requirements="jax[cuda12]",
        ),
    )
}


def gpus(count: int) -> Accelerator:
    """Hosts of ``count`` CUDA GPUs each, as a Slurm job asks for them (``--gres=gpu:COUNT``)."""
    flag = f"--gpus_per_node {count}"
    return Accelerator(name=f"gpu:{count}", platform="cuda", device_platform="gpu", chips_per_host=count, flag=flag)


def check_shape(
    islands: int, hosts_per_island: int, devices_per_host: int, accelerator: Accelerator, colocated_python: bool
) -> None:
    """Raises ``ValueError`` saying why a cluster of this shape cannot be made (every ``deploy`` target's check)."""
    if colocated_python and accelerator.platform != "cpu":
        raise ValueError(
            f"--colocated_python needs CPU workers, not {accelerator.asked_by}: colocated CPU devices are "
            "more devices of a worker's CPU client, which only CPU workers have yet"
        )
    if min(islands, hosts_per_island, devices_per_host) < 1:
        raise ValueError(
            f"--islands {islands} --hosts_per_island {hosts_per_island} --devices_per_host "
            f"{devices_per_host}: each must be at least 1"
        )
    accelerator.check(hosts_per_island, devices_per_host)


def accelerator(name: str) -> Accelerator:
    """The accelerator called ``name``; ``ValueError`` listing the known ones otherwise."""
    try:
        return ACCELERATORS[name.strip().lower()]
    except KeyError:
        raise ValueError(
            f"--accelerator {name!r} is not one this command knows: use one of {', '.join(ACCELERATORS)}"
        ) from None
