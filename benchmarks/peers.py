"""Local JAX, ``pathways-nb proxy``, a 1-device cluster, Ray and Dask on the same workloads, interleaved in one run.

    python benchmarks/peers.py [--quick] [--peers local,proxy,cluster,ray,dask] [--plot docs/images/performance.png]

Each peer runs in its own long-lived child process (one process's JAX talks to
one proxy target at a time), started once and then asked "measure X" over
stdin/stdout, so that rounds alternate between peers without paying start-up:
for each round, for each figure, for each peer (in an order rotated every
round), one measurement. Machine noise then hits every peer alike; the tables
give the median and the range over the rounds, as absolute values and as
ratios to local JAX in the same round. Ray and Dask come with the optional
``bench`` extra (``pip install -e ".[bench]"``); a peer that is not installed
is skipped, with a line saying so. docs/performance.md explains the workloads.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import workloads

HERE = os.path.dirname(os.path.abspath(__file__))
INSTALL_HINT = 'pip install -e ".[bench]" in the checkout'
RAY_START_ATTEMPTS = 3


@dataclass(frozen=True)
class Figure:
    key: str
    title: str
    unit: str
    higher_is_better: bool = True
    # The local figure its ratios divide by: local device -> host is zero-copy, so that row compares
    # with local host -> device, the cost of the same bytes copied into fresh memory on this machine.
    baseline: str = ""


FIGURES = [
    Figure("chain", "chained tiny programs", "programs/s"),
    Figure("h2d", "64 MiB host -> device", "GB/s"),
    Figure("d2h", "64 MiB device -> host", "GB/s", baseline="h2d"),
    Figure("step", "~10 ms compute step", "ms/step", higher_is_better=False),
]


@dataclass(frozen=True)
class Peer:
    name: str
    label: str
    modules: tuple[str, ...] = ()  # what it needs beyond pathways-nb's own dependencies
    # Started before the others: Ray gives its raylet a fixed 30 s to register, which it misses when it
    # starts beside the others on a busy 2-core machine (alone it takes ~10 s).
    starts_alone: bool = False


PEERS = {
    peer.name: peer
    for peer in [
        Peer("local", "local JAX"),
        Peer("proxy", "pathways-nb proxy"),
        Peer("cluster", "cluster (1 device)"),
        Peer("ray", "Ray (actor)", ("ray",), starts_alone=True),
        Peer("dask", "Dask (futures)", ("dask", "distributed")),
    ]
}


@dataclass(frozen=True)
class Settings:
    rounds: int
    chain_s: float
    transfers: int  # 64 MiB copies per transfer measurement
    steps: int  # chained compute steps per measurement


FULL = Settings(rounds=4, chain_s=1.0, transfers=4, steps=60)
QUICK = Settings(rounds=2, chain_s=0.3, transfers=1, steps=10)

# -- the programs every peer runs (module level, so that Ray and Dask workers import them by name) ------------

_tiny = jax.jit(lambda x: x + 1)
_matmul = jax.jit(lambda x, w: jnp.tanh(x @ w))  # the same step as workloads.compute_step_ms


def tiny_step(x: jax.Array) -> jax.Array:
    return _tiny(x)


def matmul_step(x: jax.Array, w: jax.Array) -> jax.Array:
    return _matmul(x, w)


def host_array(size_mib: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random(size_mib * workloads.MIB // 4, dtype=np.float32)


def device_array(size_mib: int, seed: int) -> jax.Array:
    return jax.device_put(host_array(size_mib, seed)).block_until_ready()


def matrix(size: int) -> jax.Array:
    return jax.device_put(np.random.default_rng(2).random((size, size), dtype=np.float32) / size)


def received_nbytes(host: np.ndarray) -> int:
    """What Ray's actor and Dask's task do with the array they receive: make it a JAX array on their device."""
    return jax.device_put(host).block_until_ready().nbytes


def to_host(x: jax.Array) -> np.ndarray:
    return np.asarray(x)


def ready_value(x: jax.Array) -> float:
    return float(x.block_until_ready().ravel()[0])


class Holder:
    """A Ray actor's state: one JAX array on the actor's CPU device, changed by each method call."""

    def start_tiny(self) -> None:
        self.x = tiny_step(jax.device_put(np.float32(0)))

    def tiny(self) -> None:
        self.x = tiny_step(self.x)

    def value(self) -> float:
        return ready_value(self.x)

    def receive(self, host: np.ndarray) -> int:
        return received_nbytes(host)

    def make(self, size_mib: int, seed: int) -> None:
        self.x = device_array(size_mib, seed)

    def fetch(self) -> np.ndarray:
        return to_host(self.x)

    def start_matmul(self, size: int) -> float:
        self.w = matrix(size)
        self.x = matmul_step(self.w, self.w)
        return self.value()

    def matmul(self) -> None:
        self.x = matmul_step(self.x, self.w)


def chained_rate(
    submit: Callable[[], object],
    wait: Callable[[object], object],
    finish: Callable[[], float],
    seconds: float,
    batch: int,
) -> tuple[int, float, float]:
    """Submits chained calls in batches for ``seconds``, then ``finish()``: (calls, calls per second, its value).

    Before each new batch it waits for the batch before last, so that the queue stays full but bounded (a
    peer that accepts calls faster than it runs them would otherwise run long past ``seconds``).
    """
    count, pending, started = 0, None, time.perf_counter()
    while time.perf_counter() - started < seconds:
        for _ in range(batch):
            last = submit()
        count += batch
        if pending is not None:
            wait(pending)
        pending = last
    value = finish()
    rate = count / (time.perf_counter() - started)
    return count, rate, value


# -- the backends, each inside its child process ---------------------------------------------------------------


class Jax:
    """Local JAX, or JAX through pathways-nb: the shared workloads on one device."""

    def __init__(self, device):
        self.device = device

    def calibrate(self, target_ms: float) -> float:
        """The matmul size of a ``target_ms`` step; best of 3 tries, so that a moment of load does not stop it short."""

        def step_ms(size: int) -> float:
            return min(workloads.compute_step_ms(self.device, size, 5) for _ in range(3))

        return workloads.calibrate(step_ms, 256, target_ms)

    def chain(self, seconds: float) -> float:
        return workloads.tiny_programs_per_second(self.device, seconds)

    def h2d(self, size_mib: int, repeats: int) -> float:
        return workloads.host_to_device_gbps(self.device, size_mib, repeats)

    def d2h(self, size_mib: int, repeats: int) -> float:
        return workloads.device_to_host_gbps(self.device, size_mib, repeats)

    def step(self, size: int, steps: int) -> float:
        return workloads.compute_step_ms(self.device, size, steps)


class Ray:
    """One Ray actor holding the JAX arrays; its method calls run in order on its state."""

    def __init__(self):
        import ray

        self.ray = ray
        self.actor = ray.remote(Holder).remote()

    def chain(self, seconds: float) -> float:
        ray, actor = self.ray, self.actor
        ray.get(actor.start_tiny.remote())
        count, rate, value = chained_rate(
            actor.tiny.remote, ray.get, lambda: ray.get(actor.value.remote()), seconds, batch=200
        )
        assert value == count + 1, (value, count)
        return rate

    def h2d(self, size_mib: int, repeats: int) -> float:
        ray, host = self.ray, host_array(size_mib, 0)
        ray.get(self.actor.receive.remote(ray.put(host)))
        started = time.perf_counter()
        for _ in range(repeats):
            ray.get(self.actor.receive.remote(ray.put(host)))
        return size_mib * workloads.MIB * repeats / (time.perf_counter() - started) / 1e9

    def d2h(self, size_mib: int, repeats: int) -> float:
        ray, elapsed = self.ray, 0.0
        for repeat in range(repeats + 1):
            ray.get(self.actor.make.remote(size_mib, repeat))  # fresh, like workloads.device_to_host_gbps
            started = time.perf_counter()
            back = ray.get(self.actor.fetch.remote())
            if repeat:  # the first read warms up
                elapsed += time.perf_counter() - started
        assert back.nbytes == size_mib * workloads.MIB
        return size_mib * workloads.MIB * repeats / elapsed / 1e9

    def step(self, size: int, steps: int) -> float:
        ray, actor = self.ray, self.actor
        ray.get(actor.start_matmul.remote(size))
        started = time.perf_counter()
        for _ in range(steps):
            actor.matmul.remote()
        ray.get(actor.value.remote())
        return (time.perf_counter() - started) / steps * 1e3


class Dask:
    """A ``distributed.Client`` on a local cluster of one single-threaded worker process; futures chain calls."""

    def __init__(self, client):
        import distributed

        self.client, self.wait = client, distributed.wait

    def chain(self, seconds: float) -> float:
        client = self.client
        x = client.submit(tiny_step, np.float32(0), pure=False)
        self.wait(x)

        def submit():
            nonlocal x
            x = client.submit(tiny_step, x, pure=False)
            return x

        count, rate, value = chained_rate(
            submit, self.wait, lambda: client.submit(ready_value, x).result(), seconds, batch=50
        )
        assert value == count + 1, (value, count)
        return rate

    def h2d(self, size_mib: int, repeats: int) -> float:
        client, host = self.client, host_array(size_mib, 0)

        def put() -> None:
            received = client.scatter(host, hash=False)
            assert client.submit(received_nbytes, received, pure=False).result() == host.nbytes

        put()
        started = time.perf_counter()
        for _ in range(repeats):
            put()
        return size_mib * workloads.MIB * repeats / (time.perf_counter() - started) / 1e9

    def d2h(self, size_mib: int, repeats: int) -> float:
        client, elapsed = self.client, 0.0
        for repeat in range(repeats + 1):
            on_worker = client.submit(device_array, size_mib, repeat, pure=False)
            self.wait(on_worker)
            started = time.perf_counter()
            back = client.submit(to_host, on_worker, pure=False).result()
            if repeat:
                elapsed += time.perf_counter() - started
        assert back.nbytes == size_mib * workloads.MIB
        return size_mib * workloads.MIB * repeats / elapsed / 1e9

    def step(self, size: int, steps: int) -> float:
        client = self.client
        w = client.submit(matrix, size, pure=False)
        x = client.submit(matmul_step, w, w, pure=False)
        client.submit(ready_value, x).result()
        started = time.perf_counter()
        for _ in range(steps):
            x = client.submit(matmul_step, x, w, pure=False)
        client.submit(ready_value, x).result()
        return (time.perf_counter() - started) / steps * 1e3


@contextlib.contextmanager
def backend(name: str) -> Iterator[object]:
    """Starts what peer ``name`` needs in this process (servers, clusters) and stops it afterwards."""
    import pathways_nb

    if name == "local":
        yield Jax(jax.devices("cpu")[0])
    elif name == "proxy":
        from pathways_nb.launch.processes import ChildServer

        server = ChildServer("proxy", ["proxy", "--server_port", "0", "--devices", "1"])
        server.start()
        try:
            pathways_nb.connect(server.address, progress=False)
            yield Jax(jax.devices("proxy")[0])
            pathways_nb.disconnect()
        finally:
            server.close()
    elif name == "cluster":
        from pathways_nb.launch.local_cluster import LocalCluster

        with LocalCluster(islands=1, devices_per_host=1) as cluster:
            pathways_nb.connect(cluster.address, progress=False)
            yield Jax(jax.devices("proxy")[0])
            pathways_nb.disconnect()
    elif name == "ray":
        import ray

        for attempt in range(RAY_START_ATTEMPTS):
            try:
                ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
                break
            except Exception as error:  # Ray raises a bare Exception for this one
                # Ray gives its raylet a fixed 30 s to register, which a busy 2-core machine can miss.
                ray.shutdown()
                if "timed out during startup" not in str(error) or attempt + 1 == RAY_START_ATTEMPTS:
                    raise
        try:
            yield Ray()
        finally:
            ray.shutdown()
    elif name == "dask":
        import distributed

        with (
            distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as dc,
            distributed.Client(dc) as client,
        ):
            yield Dask(client)
    else:
        raise ValueError(f"unknown peer {name!r}; choose from {', '.join(PEERS)}")


def serve(name: str) -> None:
    """The child's loop: one JSON request a line on stdin (``{"op": "h2d", ...}``), one JSON reply a line."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what libraries print goes to the log, not into the replies
    started = time.perf_counter()
    try:
        with backend(name) as peer:
            replies.write(json.dumps({"ready": time.perf_counter() - started}) + "\n")
            for line in sys.stdin:
                request = json.loads(line)
                try:
                    reply = {"value": getattr(peer, request.pop("op"))(**request)}
                except Exception:  # noqa: BLE001 - the parent reports it and goes on without this peer
                    reply = {"error": traceback.format_exc()}
                replies.write(json.dumps(reply) + "\n")
    except Exception:  # noqa: BLE001 - a peer that cannot start is reported, the others still run
        replies.write(json.dumps({"error": traceback.format_exc()}) + "\n")


# -- the parent: children, rounds, tables, plot ----------------------------------------------------------------


class PeerFailed(Exception):
    """A child's error (its traceback, or its log's tail); ``summary`` is its last line."""

    @property
    def summary(self) -> str:
        lines = str(self).strip().splitlines()
        return lines[-1] if lines else "no details"


class Child:
    """A peer's child process, asked for one measurement at a time."""

    def __init__(self, peer: Peer, log_dir: str):
        self.peer = peer
        self.log_dir = log_dir
        self.log_path = os.path.join(log_dir, f"{peer.name}.log")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([HERE, *filter(None, [env.get("PYTHONPATH")])])
        if peer.name in ("local", "ray", "dask"):
            env["JAX_PLATFORMS"] = "cpu"
        with open(self.log_path, "a") as log:  # a restarted peer's log follows its first
            self.process = subprocess.Popen(
                [sys.executable, "-c", "import sys, peers; peers.serve(sys.argv[1])", peer.name],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=env,
            )

    def _reply(self, timeout_s: float) -> dict:
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            state = "exited" if ready else f"gave no reply within {timeout_s:g} s"
            raise PeerFailed(f"{self.peer.label} {state}; its log:\n{self.log_tail()}")
        reply = json.loads(line)
        if "error" in reply:
            raise PeerFailed(f"{self.peer.label} failed:\n{reply['error']}")
        return reply

    def ready(self, timeout_s: float = 240.0) -> float:
        """Waits until the child has started its peer; returns how long that took (s)."""
        return self._reply(timeout_s)["ready"]

    def ask(self, op: str, timeout_s: float = 240.0, **arguments) -> float:
        self.process.stdin.write(json.dumps({"op": op, **arguments}) + "\n")
        self.process.stdin.flush()
        return self._reply(timeout_s)["value"]

    def log_tail(self, lines: int = 30) -> str:
        with open(self.log_path, errors="replace") as log:
            return "\n".join(log.read().splitlines()[-lines:])

    def close(self) -> str:
        """Stops the child; returns its log directory (for a restart)."""
        with contextlib.suppress(OSError):
            self.process.stdin.close()  # the child's loop ends, and it stops its servers
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        return self.log_dir


def missing(peer: Peer) -> str | None:
    """Why ``peer`` cannot run here (a module it needs is not installed), or None."""
    for module in peer.modules:
        if importlib.util.find_spec(module) is None:
            return f"skipped: {module} not installed ({INSTALL_HINT})"
    return None


Results = dict[str, dict[str, list[float]]]  # peer -> figure -> one value a round


RESTARTS = 1  # a peer that fails is started afresh this many times before it leaves the run


def measure(children: dict[str, Child], settings: Settings, notes: list[str]) -> Results:
    """Runs the rounds; a peer that fails is restarted and asked again, then leaves the run (with a note)."""
    size = int(children["local"].ask("calibrate", target_ms=10.0))
    print(f"compute step: tanh(x @ w), {size}x{size} float32 (~10 ms on local JAX)", flush=True)
    requests = {
        "chain": {"seconds": settings.chain_s},
        "h2d": {"size_mib": 64, "repeats": settings.transfers},
        "d2h": {"size_mib": 64, "repeats": settings.transfers},
        "step": {"size": size, "steps": settings.steps},
    }
    results: Results = {name: {f.key: [] for f in FIGURES} for name in children}
    names = list(children)
    for round_ in range(settings.rounds):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        spent = dict.fromkeys(order, 0.0)  # seconds each peer took this round, set-up included
        for figure in FIGURES:
            for name in order:
                asked = time.perf_counter()
                for attempt in range(RESTARTS + 1):
                    if name not in children:
                        break
                    try:
                        results[name][figure.key].append(children[name].ask(figure.key, **requests[figure.key]))
                        break
                    except PeerFailed as error:
                        if name == "local":
                            raise
                        print(error, file=sys.stderr, flush=True)
                        notes.append(f"{PEERS[name].label}: round {round_ + 1}, {figure.key}: {error.summary}")
                        log_dir = children.pop(name).close()
                        if attempt == RESTARTS:
                            notes.append(f"{PEERS[name].label}: left the run")
                            results.pop(name)
                        else:
                            _ready(children, name, Child(PEERS[name], log_dir), notes)
                spent[name] += time.perf_counter() - asked
        took = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in spent.items())
        print(f"round {round_ + 1}/{settings.rounds} done ({took})", flush=True)
    return results


def _ready(children: dict[str, Child], name: str, child: Child, notes: list[str]) -> None:
    """Waits until peer ``name``'s child is ready, and adds it to ``children``; one that cannot start is left out."""
    try:
        print(f"{PEERS[name].label}: started in {child.ready():.1f} s", flush=True)
        children[name] = child
    except PeerFailed as error:
        child.close()
        if name == "local":
            raise
        print(error, file=sys.stderr, flush=True)
        notes.append(f"{PEERS[name].label}: did not start: {error.summary}")


def ratios(results: Results) -> dict[str, dict[str, list[float]]]:
    """Each peer's value over local JAX's in the same round (local time over peer time for ms/step)."""
    local = results["local"]
    out: dict[str, dict[str, list[float]]] = {}
    for name, figures in results.items():
        out[name] = {}
        for figure in FIGURES:
            base = local[figure.baseline or figure.key]
            values = figures[figure.key]
            out[name][figure.key] = [
                v / b if figure.higher_is_better else b / v for v, b in zip(values, base, strict=False)
            ]
    return out


def _number(value: float) -> str:
    return f"{value / 1000:.3g}k" if value >= 999.5 else f"{value:.3g}"  # 999.6 is 1k, not 1e+03


def _cell(values: list[float]) -> str:
    if not values:
        return "-"
    middle = _number(statistics.median(values))
    if len(values) == 1:
        return middle
    return f"{middle} ({_number(min(values))}-{_number(max(values))})"


def tables(results: Results) -> str:
    """Markdown tables, rows = figures, columns = peers: absolute values, then ratios to local JAX."""
    names = list(results)
    header = "| figure | " + " | ".join(PEERS[n].label for n in names) + " |"
    rule = "|---" * (len(names) + 1) + "|"
    lines = ["Median (range) over the rounds:", "", header, rule]
    for figure in FIGURES:
        cells = [_cell(results[n][figure.key]) for n in names]
        lines.append(f"| {figure.title} ({figure.unit}) | " + " | ".join(cells) + " |")
    lines += ["", "Ratio to local JAX in the same round (higher is better):", "", header, rule]
    by_ratio = ratios(results)
    for figure in FIGURES:
        cells = ["zero-copy" if n == "local" and figure.baseline else _cell(by_ratio[n][figure.key]) for n in names]
        lines.append(f"| {figure.title} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "(device -> host is divided by local JAX's host -> device rate: locally np.asarray is zero-copy;"
        " ms/step: local time / peer time)",
    ]
    return "\n".join(lines)


def _ratio_of(figure: Figure) -> str:
    if figure.baseline:
        return "over local host -> device:\nlocal JAX reads zero-copy"
    return f"{figure.unit} over local" if figure.higher_is_better else "local time over peer time"


def plot(results: Results, path: str, subtitle: str) -> None:
    """A grouped bar chart of the ratios to local JAX (log scale: they span four decades), with their ranges."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_ratio = ratios(results)
    names = [n for n in results if n != "local"]  # local JAX is the dashed line at 1
    width = 0.8 / max(len(names), 1)
    figure_, axes = plt.subplots(figsize=(11, 5.5))
    axes.axhline(1.0, color="gray", linewidth=1, linestyle="--", label="local JAX = 1")
    for index, name in enumerate(names):
        xs, heights, low, high = [], [], [], []
        for position, figure in enumerate(FIGURES):
            values = by_ratio[name][figure.key]
            if not values:
                continue
            middle = statistics.median(values)
            xs.append(position - 0.4 + width * (index + 0.5))
            heights.append(middle)
            low.append(middle - min(values))
            high.append(max(values) - middle)
        bars = axes.bar(xs, heights, width, yerr=[low, high], capsize=3, label=PEERS[name].label)
        axes.bar_label(bars, labels=[f"{h:.2g}" for h in heights], fontsize=7, padding=2)
    axes.set_yscale("log")
    axes.set_xticks(
        range(len(FIGURES)),
        [f"{f.title}\n({_ratio_of(f)})" for f in FIGURES],
    )
    axes.set_ylabel("ratio to local JAX (higher is better)")
    axes.set_title(f"The same workloads side by side, interleaved in one run\n{subtitle}", fontsize=10)
    axes.legend(fontsize=8, loc="upper left")  # above the chain's bars, the lowest
    figure_.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure_.savefig(path, dpi=110)
    plt.close(figure_)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter rounds (a smoke test, < 90 s)")
    parser.add_argument(
        "--peers", default=",".join(PEERS), help=f"comma-separated, of {', '.join(PEERS)} (local is always run)"
    )
    parser.add_argument("--plot", metavar="PNG", help="also write the ratio chart there")
    args = parser.parse_args(argv)
    wanted = [n.strip() for n in args.peers.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in PEERS]
    if unknown:
        parser.error(f"unknown peer(s) {', '.join(unknown)}; choose from {', '.join(PEERS)}")
    settings = QUICK if args.quick else FULL
    notes: list[str] = []
    runnable = ["local"]
    for name in wanted:
        reason = missing(PEERS[name])
        if reason:
            notes.append(f"{PEERS[name].label}: {reason}")
            print(notes[-1], flush=True)
        elif name not in runnable:
            runnable.append(name)

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pathways-peers-") as log_dir:
        children: dict[str, Child] = {}
        launched: list[Child] = []
        try:
            for alone in (True, False):
                batch = {n: Child(PEERS[n], log_dir) for n in runnable if PEERS[n].starts_alone == alone}
                launched += batch.values()  # a batch starts side by side
                for name, child in batch.items():
                    _ready(children, name, child, notes)
            children = {n: children[n] for n in runnable if n in children}  # the tables' column order
            results = measure(children, settings, notes)
        finally:
            for child in [*launched, *children.values()]:
                child.close()
    elapsed = time.perf_counter() - started
    subtitle = (
        f"{datetime.date.today()}, {os.cpu_count()} CPU cores, {settings.rounds} rounds"
        f"{' (--quick)' if args.quick else ''}, median and range"
    )
    print()
    print(f"{subtitle}; {elapsed:.0f} s in all")
    print(tables(results))
    for note in notes:
        print(note)
    if args.plot:
        plot(results, args.plot, subtitle)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
