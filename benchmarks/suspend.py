"""Suspending and resuming sessions: how long, how fast, and what it costs others.

    python benchmarks/suspend.py [--sizes 64,1024,4096] [--seconds 40] [--every 10]

Three tables, each measured side by side in one run:

1. Suspend and resume times of a session holding SIZE MiB of arrays on island 0 (two devices, one
   array sharded over both), its arrays kept in the workers' memory (a CPU device's buffers stay in
   place: the times are the control path's) and, on a second cluster whose workers have no memory
   budget for suspended arrays (``--suspend_memory_budget 0``), in files under the storage root:
   seconds and GB/s each way, and whether every value came back (a checksum). Then the same with
   island 0 taken while the session is suspended: it resumes on island 1 (virtual devices), its
   arrays sent from island 0's worker to island 1's.
2. How long a session of priority 10 waits for island 0 while a priority-0 session holds it with
   1 GiB of arrays (it is preempted: suspended first), against the same connect on a free island.
3. The steps per second of a tenant training on island 1 alone, and while another session on
   island 0 (1 GiB) is suspended and resumed every ``--every`` seconds: the ratio says what the
   suspensions cost a tenant that has nothing to do with them.
"""

from __future__ import annotations

import argparse
import json
import time

import tables

from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.testing import finished_ok, python_process

MIB = 1 << 20

# Holds MiB (argv[2]) of arrays exclusively at priority argv[3] on island argv[4] ("any": any island); prints one
# JSON line per command read from stdin: "suspend", "resume" (timed), "check" (the checksum still equal), "end".
HOLDER = """
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec
import pathways_nb

islands = [] if sys.argv[4] == "any" else [int(sys.argv[4])]
session = pathways_nb.connect(
    sys.argv[1], tenant="holder", exclusive=True, num_devices=2, islands=islands, priority=int(sys.argv[3])
)
devices = jax.devices()
mesh = jax.make_mesh((len(devices),), ("x",), devices=devices)
rows = int(sys.argv[2]) * (1 << 20) // (4 * 1024)
make = jax.jit(lambda: jax.random.normal(jax.random.key(0), (rows, 1024)),
               out_shardings=NamedSharding(mesh, PartitionSpec("x")))
held = make()
checksum = jax.jit(lambda a: jnp.sum(a * 1.0009765625))
expected = float(checksum(held))
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    command = line.strip()
    started = time.perf_counter()
    if command == "suspend":
        session.suspend()
    elif command == "resume":
        session.resume(progress=False)
    elif command == "check":
        print(json.dumps({"equal": float(checksum(held)) == expected}), flush=True)
        continue
    else:
        break
    print(json.dumps({command: time.perf_counter() - started}), flush=True)
"""

# Connects to argv[1] exclusively to island argv[2] at priority argv[3]; prints how long the connect took, and
# holds the island until a line on stdin.
TAKER = """
import json, sys, time
import jax
import pathways_nb
started = time.perf_counter()
pathways_nb.connect(sys.argv[1], tenant="taker", exclusive=True, islands=[int(sys.argv[2])],
                    priority=int(sys.argv[3]), timeout_s=300)
print(json.dumps({"waited": time.perf_counter() - started}), flush=True)
sys.stdin.readline()
pathways_nb.disconnect()
"""

# Trains a small MLP on island 1 for argv[2] seconds per line on stdin; prints its steps per second each time.
TRAINER = """
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
import pathways_nb

pathways_nb.connect(sys.argv[1], tenant="trainer", islands=[1])
device = jax.devices()[0]
rng = np.random.default_rng(0)
w = [jax.device_put(rng.standard_normal((256, 256), dtype=np.float32) * 0.05, device) for _ in range(3)]
x = jax.device_put(rng.standard_normal((128, 256), dtype=np.float32), device)

@jax.jit
def step(w, x):
    def loss(w):
        h = x
        for layer in w:
            h = jnp.tanh(h @ layer)
        return jnp.mean(h ** 2)
    grads = jax.grad(loss)(w)
    return [a - 0.01 * g for a, g in zip(w, grads, strict=True)]

for _ in range(20):
    w = step(w, x)
jax.block_until_ready(w)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    if line.strip() == "end":
        break
    steps, started = 0, time.perf_counter()
    while time.perf_counter() - started < float(sys.argv[2]):
        for _ in range(10):
            w = step(w, x)
        jax.block_until_ready(w)
        steps += 10
    print(json.dumps({"steps_s": steps / (time.perf_counter() - started)}), flush=True)
"""


class Client:
    """A client process that answers one JSON line per line it is sent."""

    def __init__(self, code: str, *args: str, token: str):
        self.process = python_process(code, *args, env={"PATHWAYS_CLUSTER_TOKEN": token})

    def read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"a client ended:\n{self.process.communicate()[1][-3000:]}")
        return json.loads(line)

    def ask(self, command: str) -> dict:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.read()

    def end(self) -> None:
        self.process.stdin.write("end\n")
        self.process.stdin.flush()
        finished_ok(self.process, 120)


def holder(cluster: LocalCluster, mib: int, priority: int = 0, island: str = "0") -> Client:
    client = Client(HOLDER, cluster.address, str(mib), str(priority), island, token=cluster.token)
    client.read()
    return client


def taker(cluster: LocalCluster, island: int, priority: int) -> tuple[Client, float]:
    """A client holding ``island`` (until ``end``), and how long it waited for it."""
    client = Client(TAKER, cluster.address, str(island), str(priority), token=cluster.token)
    return client, client.read()["waited"]


def suspend_resume_rows(sizes: list[int], where: str, budget: int | None, move: bool = False) -> list[dict]:
    """``move``: island 0 is taken while the session is suspended, and it resumes on island 1."""
    rows = []
    with LocalCluster(islands=2 if move else 1, devices_per_host=2, suspend_memory_budget=budget) as cluster:
        for mib in sizes:
            client = holder(cluster, mib, island="any" if move else "0")
            suspend_s = client.ask("suspend")["suspend"]
            blocker = taker(cluster, 0, 0)[0] if move else None
            resume_s = client.ask("resume")["resume"]
            equal = client.ask("check")["equal"]
            client.end()
            if blocker is not None:
                blocker.end()
            gb = mib * MIB / 1e9
            rows.append(
                {
                    "size": f"{mib} MiB",
                    "where": where + (", resumed on the other island" if move else ""),
                    "suspend_s": suspend_s,
                    "suspend_gbs": gb / suspend_s,
                    "resume_s": resume_s,
                    "resume_gbs": gb / resume_s,
                    "equal": "yes" if equal else "NO",
                }
            )
            print(rows[-1], flush=True)
    return rows


def preemption_rows(cluster: LocalCluster) -> list[dict]:
    def taking(island: int) -> float:
        client, waited = taker(cluster, island, 10)
        client.end()
        return waited

    free = taking(1)
    held = holder(cluster, 1024)
    preempting = taking(0)
    resumed = held.ask("check")["equal"]
    held.end()
    return [
        {"what": "connect, priority 10, to a free island", "waited": free, "equal": ""},
        {
            "what": "connect, priority 10, preempting a 1 GiB session",
            "waited": preempting,
            "equal": "yes" if resumed else "NO",
        },
    ]


def interference_row(cluster: LocalCluster, seconds: float, every: float) -> dict:
    trainer = Client(TRAINER, cluster.address, str(seconds), token=cluster.token)
    trainer.read()
    alone = trainer.ask("go")["steps_s"]
    held = holder(cluster, 1024)
    trainer.process.stdin.write("go\n")
    trainer.process.stdin.flush()
    moves, started = 0, time.monotonic()
    while time.monotonic() - started < seconds:
        time.sleep(every / 2)
        held.ask("suspend")
        time.sleep(every / 2)
        held.ask("resume")
        moves += 1
    beside = trainer.read()["steps_s"]
    equal = held.ask("check")["equal"]
    held.end()
    trainer.end()
    return {
        "alone": alone,
        "beside": beside,
        "ratio": beside / alone,
        "moves": moves,
        "equal": "yes" if equal else "NO",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,1024,4096", help="MiB of arrays per row, comma-separated")
    parser.add_argument("--seconds", type=float, default=40.0, help="how long the trainer trains, per measurement")
    parser.add_argument("--every", type=float, default=10.0, help="seconds per suspend and resume of the other")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    moves = suspend_resume_rows(sizes, "host memory", None) + suspend_resume_rows(sizes, "files (budget 0)", 0)
    moves += suspend_resume_rows(sizes, "host memory", None, move=True)
    moves += suspend_resume_rows(sizes, "files (budget 0)", 0, move=True)
    with LocalCluster(islands=2, devices_per_host=2) as cluster:
        waits = preemption_rows(cluster)
        interference = interference_row(cluster, args.seconds, args.every)
    print(
        tables.markdown(
            moves,
            [
                ("size", "arrays", "{}"),
                ("where", "kept in", "{}"),
                ("suspend_s", "suspend (s)", "{:.2f}"),
                ("suspend_gbs", "suspend (GB/s)", "{:.2f}"),
                ("resume_s", "resume (s)", "{:.2f}"),
                ("resume_gbs", "resume (GB/s)", "{:.2f}"),
                ("equal", "values intact", "{}"),
            ],
        )
    )
    print()
    print(
        tables.markdown(
            waits, [("what", "", "{}"), ("waited", "waited (s)", "{:.2f}"), ("equal", "holder intact", "{}")]
        )
    )
    print()
    print(
        tables.markdown(
            [interference],
            [
                ("alone", "trainer alone (steps/s)", "{:.1f}"),
                ("beside", f"while another is suspended and resumed every {args.every:g} s", "{:.1f}"),
                ("ratio", "ratio", "{:.2f}"),
                ("moves", "suspend-resume cycles", "{}"),
                ("equal", "the other intact", "{}"),
            ],
        )
    )


if __name__ == "__main__":
    main()
