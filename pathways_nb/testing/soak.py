"""A soak of a cluster: many client processes, mixed work, churn and a killed client, then a memory check.

Each client is a real JAX process that connects (and, now and then,
disconnects and connects again), and loops over a fixed set of workloads:
uploads and reads of several dtypes and shapes, jitted programs on one
device and on a sharded mesh of an island, copies between islands. Every
result is compared with the same work on the client's own CPU devices: any
difference is a wrong result. One client is killed mid-work (SIGKILL), as a
crashed notebook would be: it works until killed and reports each finished
workload, and the kill comes right after such a report, while it is alive
and inside the next one; the others must finish. Afterwards the cluster's
processes must be back near the memory they used after a warm-up.

``benchmarks/soak.py`` runs the full soak (8 clients, 60 s); the test suite a
small one. The workload set is fixed and a warm-up client runs all of it
once, so during the soak nothing new is compiled and caches do not grow.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import textwrap
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import psutil

from pathways_nb.core.exit_status import exit_description
from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.testing import finish, python_script, wait_until_sessions_end

CLIENT = os.path.join(os.path.dirname(__file__), "soak_client.py")


@dataclass
class SoakReport:
    """What a soak saw: per-client results, the killed client, and server memory before and after."""

    clients: list[dict] = field(default_factory=list)
    killed_seed: int | None = None
    # How the client meant to be killed ended, when not by our SIGKILL mid-work: its status and stderr.
    killed_note: str = ""
    rss_before: dict[str, int] = field(default_factory=dict)
    rss_after: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def killed_ok(self) -> bool:
        """Whether the client meant to be killed was killed by us, alive and mid-work."""
        return self.killed_seed is not None and not self.killed_note

    @property
    def wrong(self) -> int:
        return sum(c["wrong"] for c in self.clients)

    @property
    def errors(self) -> list[str]:
        return [e for c in self.clients for e in c["errors"]]

    @property
    def iterations(self) -> int:
        return sum(c["iterations"] for c in self.clients)

    def memory_growth(self) -> dict[str, float]:
        """Each server process's RSS after the soak relative to after the warm-up (1.0: unchanged)."""
        return {name: self.rss_after[name] / before for name, before in self.rss_before.items()}

    def table(self) -> str:
        lines = [
            f"soak: {len(self.clients)} surviving clients + 1 killed, {self.seconds:.0f} s, "
            f"{self.iterations} checked operations, {self.wrong} wrong, {len(self.errors)} errors",
            *([self.killed_note] if self.killed_note else []),
            "| process | RSS after warm-up (MiB) | RSS after soak (MiB) | ratio |",
            "|---|---|---|---|",
        ]
        for name, ratio in sorted(self.memory_growth().items()):
            lines.append(
                f"| {name} | {self.rss_before[name] / 2**20:.0f} | {self.rss_after[name] / 2**20:.0f} | {ratio:.3f} |"
            )
        return "\n".join(lines)


def _rss(cluster: LocalCluster) -> dict[str, int]:
    return {child.name: psutil.Process(child.process.pid).memory_info().rss for child in cluster.processes()}


def _client(cluster: LocalCluster, seconds: float, seed: int) -> subprocess.Popen:
    return python_script(CLIENT, cluster.address, str(seconds), str(seed), cluster.token)


def _kill_mid_work(victim: subprocess.Popen, reports: int, timeout_s: float) -> str:
    """SIGKILLs the client just after its ``reports``-th finished workload; "" if that is how it ended.

    The client works until killed and reports each workload as it finishes it, so the kill lands
    while it is alive and inside the next one. Otherwise the answer says how it ended (status and
    stderr): a client that fails by itself is a bug to look at, not a kill that came late.
    """
    progress: queue.SimpleQueue = queue.SimpleQueue()
    stderr: list[str] = []
    readers = [
        threading.Thread(target=lambda: [progress.put(line) for line in victim.stdout], daemon=True),
        threading.Thread(target=lambda: stderr.extend(victim.stderr), daemon=True),
    ]
    for reader in readers:
        reader.start()
    deadline, done = time.monotonic() + timeout_s, 0
    while done < reports and victim.poll() is None:
        try:
            done += "progress" in json.loads(progress.get(timeout=min(1.0, max(0.0, deadline - time.monotonic()))))
        except queue.Empty:
            if time.monotonic() > deadline:
                break
    alive = victim.poll() is None
    victim.kill()
    victim.wait()
    for reader in readers:
        reader.join(timeout=10)
    if done >= reports and alive:
        return ""
    if alive:
        what = f"reported {done} of {reports} finished workloads within {timeout_s:g} s"
    else:
        what = f"had {exit_description(victim.returncode)} by itself after {done} finished workloads"
    return f"the client meant to be killed mid-work {what}; its stderr:\n{''.join(stderr)[-3000:]}"


def run(cluster: LocalCluster, clients: int = 8, seconds: float = 60.0, settle_s: float = 2.0) -> SoakReport:
    """Soaks ``cluster``: ``clients`` processes, all but one for ``seconds``; that one is killed mid-work."""
    report = SoakReport()
    warmup = _client(cluster, 0, 0)  # every workload once
    out, err = finish(warmup, timeout_s=300)
    if warmup.returncode != 0:
        raise RuntimeError(f"the warm-up client failed:\n{err[-3000:]}")
    wait_until_sessions_end(cluster.address, cluster.token, timeout_s=30)
    time.sleep(settle_s)
    report.rss_before = _rss(cluster)
    started = time.monotonic()
    processes = [_client(cluster, seconds, seed) for seed in range(1, clients)]
    victim = _client(cluster, -1, clients)  # works until killed
    report.killed_seed = clients
    report.killed_note = _kill_mid_work(victim, reports=5, timeout_s=seconds + 120)
    for process in processes:
        out, err = finish(process, timeout_s=seconds + 300)
        if process.returncode != 0:
            raise RuntimeError(f"a soak client failed (status {process.returncode}):\n{err[-3000:]}")
        report.clients.append(json.loads(out.strip().splitlines()[-1]))
    report.seconds = time.monotonic() - started
    wait_until_sessions_end(cluster.address, cluster.token, timeout_s=60)
    time.sleep(settle_s)
    report.rss_after = _rss(cluster)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pathways_nb.testing.soak [--clients N] [--seconds S]``: soak a fresh 2-island cluster."""
    import argparse

    parser = argparse.ArgumentParser(description=textwrap.dedent(__doc__).splitlines()[0])
    parser.add_argument("--clients", type=int, default=8, help="client processes (one of them is killed)")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long each client works")
    args = parser.parse_args(argv)
    with LocalCluster(islands=2, devices_per_host=2) as cluster:
        report = run(cluster, args.clients, args.seconds)
    print(report.table())
    return 0 if report.killed_ok and report.wrong == 0 and not report.errors else 1
