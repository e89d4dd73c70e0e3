"""The fault table: what a client sees, and for how long, when a process of a local cluster dies.

    python benchmarks/faults.py

Starts a supervised 2-island LocalCluster and a client process that runs a
small program on each island every 20 ms, keeping one array on each island
from the start. Then it injects faults one at a time (a worker killed with
SIGKILL, a worker crashing with SIGSEGV, the resource manager killed, the
proxy killed) and reports, per fault: how long until the client saw a clear
error (and its first words), how long until work on the island succeeded
again, and whether any array outside the dead process was lost.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.testing import python_process

CLIENT = """
    import json, sys, time, jax, numpy as np, pathways_nb
    address, token = sys.argv[1], sys.argv[2]

    def connect():
        pathways_nb.connect(address, token=token, progress=False, timeout_s=30)
        islands = {}
        for d in jax.devices("proxy"):
            islands.setdefault(d.slice_index, d)
        kept = {i: jax.device_put(np.full(4, i, np.float32), d) for i, d in islands.items()}
        return islands, kept

    islands, kept = connect()
    step = jax.jit(lambda x: x + 1)
    while True:
        for island, device in islands.items():
            event = {"t": time.time(), "island": island}
            try:
                value = float(np.asarray(step(jax.device_put(np.float32(island), device))))
                event["ok"] = value == island + 1
            except Exception as error:
                event["error"] = str(error).split(";")[0][:160]
            try:
                event["kept"] = float(np.asarray(kept[island]).sum()) == 4 * island
            except Exception:                                        # lost with its island's worker
                event["kept"] = False
            print(json.dumps(event), flush=True)
            if "Connection to IFRT proxy server was terminated" in event.get("error", ""):
                try:
                    pathways_nb.disconnect()
                except Exception:
                    pass
                while True:
                    try:
                        islands, kept = connect()
                        break
                    except Exception:
                        time.sleep(0.2)
        time.sleep(0.02)
"""


class Events:
    """The client's event stream, read on a thread."""

    def __init__(self, process):
        self.items: list[dict] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._read, args=(process,), daemon=True).start()

    def _read(self, process) -> None:
        for line in process.stdout:
            if line.startswith("{"):
                with self._lock:
                    self.items.append(json.loads(line))

    def since(self, t: float) -> list[dict]:
        with self._lock:
            return [e for e in self.items if e["t"] >= t]


def _measure(events: Events, fault_at: float, island: int | None, settle_s: float = 20.0) -> dict:
    """Seconds to the first error and to the first success after it (on ``island``, or any)."""
    deadline = time.time() + settle_s
    first_error = recovered = None
    while time.time() < deadline:
        for event in events.since(fault_at):
            if island is not None and event["island"] != island:
                continue
            if first_error is None and "error" in event:
                first_error = event
            elif first_error is not None and event.get("ok"):
                recovered = event
                break
        if recovered is not None:
            break
        time.sleep(0.1)
    others_lost = any(
        e["island"] != island and (not e["kept"] or "error" in e) for e in events.since(fault_at) if island is not None
    )
    return {
        "error_after_s": None if first_error is None else first_error["t"] - fault_at,
        "error": None if first_error is None else first_error["error"],
        "recovered_after_s": None if recovered is None else recovered["t"] - fault_at,
        "other_islands_lost_work": others_lost,
    }


def main() -> int:
    rows = []
    with LocalCluster(islands=2, devices_per_host=1) as cluster:
        client = python_process(CLIENT, cluster.address, cluster.token)
        events = Events(client)
        while not events.since(0):
            time.sleep(0.1)
        time.sleep(1)
        faults = [
            ("worker of island 1: SIGKILL", lambda: cluster.workers[(1, 0)].process.pid, signal.SIGKILL, 1),
            ("worker of island 1: SIGSEGV", lambda: cluster.workers[(1, 0)].process.pid, signal.SIGSEGV, 1),
            ("resource manager: SIGKILL", lambda: cluster.resource_manager.process.pid, signal.SIGKILL, None),
            ("proxy: SIGKILL", lambda: cluster.proxy.process.pid, signal.SIGKILL, None),
        ]
        for name, pid, sig, island in faults:
            old_pid = pid()
            fault_at = time.time()
            os.kill(old_pid, sig)
            healthy_after = _healthy_again(cluster, old_pid, fault_at)
            row = {"fault": name, **_measure(events, fault_at, island), "healthy_after_s": healthy_after}
            if island is None and row["error_after_s"] is None:
                row["note"] = "no error: running sessions do not need it"
            rows.append(row)
            time.sleep(2)
        client.kill()
        if os.environ.get("FAULTS_DUMP"):
            with open(os.environ["FAULTS_DUMP"], "w") as dump:
                json.dump(events.since(0), dump)
    print(
        "| fault | clear error after | the client's error | process replaced, cluster healthy after "
        "| work again after | other islands / arrays lost |"
    )
    print("|---|---|---|---|---|---|")
    for row in rows:
        error_s = "none" if row["error_after_s"] is None else f"{row['error_after_s']:.2f} s"
        back = "n/a" if row["recovered_after_s"] is None else f"{row['recovered_after_s']:.2f} s"
        message = row["error"] or row.get("note", "")
        lost = "yes" if row["other_islands_lost_work"] else "none"
        print(f"| {row['fault']} | {error_s} | {message} | {row['healthy_after_s']:.2f} s | {back} | {lost} |")
    return 0


def _healthy_again(cluster: LocalCluster, old_pid: int, fault_at: float, timeout_s: float = 30.0) -> float:
    """Seconds from the fault until the dead process is replaced and every worker is registered and healthy."""
    while time.time() - fault_at < timeout_s:
        pids = {child.process.pid for child in cluster.processes()}
        workers = _state_or_none(cluster)
        if old_pid not in pids and workers and all(w.healthy for w in workers):
            return time.time() - fault_at
        time.sleep(0.05)
    return float("nan")


def _state_or_none(cluster: LocalCluster) -> list:
    try:
        return list(cluster.state().workers)
    except Exception:  # noqa: BLE001 - the resource manager is restarting
        return []


if __name__ == "__main__":
    raise SystemExit(main())
