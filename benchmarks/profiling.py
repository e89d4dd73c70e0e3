"""Device profiles: what a trace costs a running step, and how long a long trace takes to write and read.

    python benchmarks/profiling.py [--rounds 4] [--steps 40] [--long_seconds 60]

1. Overhead: a ~10 ms training step on a 2-island cluster (one step per island, both islands
   busy), timed over ``--steps`` steps with no trace and with every worker, the proxy and the
   resource manager tracing (``pathways_nb.profile``), in alternating rounds in one run; the
   ratio of the medians is the trace's cost.
2. A long trace: the same step for ``--long_seconds`` under a trace, then the time for the
   workers to stop and write it, for the notebook to fetch it, and to parse it into device spans,
   with the files' sizes.
On a shared 2-core machine every process competes for the same cores: read the ratio, and the
range over rounds, not the absolute times.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import pathways_nb
from pathways_nb.client import profiles
from pathways_nb.launch.local_cluster import LocalCluster


def _step_for_10ms(devices) -> tuple:
    """A jitted MLP training step and per-island data, sized to take about 10 ms on this machine."""

    def loss(params, x):
        w1, w2 = params
        return jnp.mean((jnp.tanh(x @ w1) @ w2) ** 2)

    step = jax.jit(lambda p, x: [w - 0.01 * g for w, g in zip(p, jax.grad(loss)(p, x), strict=True)])
    rng = np.random.default_rng(0)
    for width in (64, 128, 192, 256, 384, 512, 768, 1024):
        params = [rng.standard_normal(s).astype(np.float32) / 16 for s in ((width, width), (width, 16))]
        x = rng.standard_normal((256, width)).astype(np.float32)
        replicas = [([jax.device_put(p, d) for p in params], jax.device_put(x, d)) for d in devices]
        _run(step, replicas, 3)
        started = time.perf_counter()
        _run(step, replicas, 10)
        per_step = (time.perf_counter() - started) / 10
        if per_step >= 0.01:
            break
    return step, replicas, width, per_step


def _run(step, replicas, steps: int) -> list:
    for _ in range(steps):
        replicas[:] = [(step(p, x), x) for p, x in replicas]
    jax.block_until_ready([p for p, _ in replicas])
    return replicas


def _timed(step, replicas, steps: int) -> float:
    started = time.perf_counter()
    _run(step, replicas, steps)
    return (time.perf_counter() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="measurements per row")
    parser.add_argument("--steps", type=int, default=40, help="training steps per measurement")
    parser.add_argument("--long_seconds", type=float, default=60.0, help="how long the long trace runs")
    args = parser.parse_args()
    with LocalCluster(islands=2, devices_per_host=2) as cluster:
        session = pathways_nb.connect(cluster.address, token=cluster.token, progress=False)
        firsts = [next(d for d in jax.devices() if d.slice_index == i) for i in (0, 1)]
        step, replicas, width, per_step = _step_for_10ms(firsts)
        print(f"step: MLP of width {width}, {per_step * 1e3:.1f} ms per step on both islands")

        with tempfile.TemporaryDirectory() as logdir, pathways_nb.profile(logdir, progress=False):
            _timed(step, replicas, args.steps)  # a first round of each, not counted (first traces, caches)
        _timed(step, replicas, args.steps)
        plain, traced = [], []
        for _ in range(args.rounds):
            plain.append(_timed(step, replicas, args.steps))
            with tempfile.TemporaryDirectory() as logdir, pathways_nb.profile(logdir, progress=False):
                traced.append(_timed(step, replicas, args.steps))
        ratio = statistics.median(traced) / statistics.median(plain)
        print("\n| step | ms per step (median, range over rounds) |")
        print("|---|---|")
        print(f"| no trace | {statistics.median(plain) * 1e3:.2f} ({min(plain) * 1e3:.2f}-{max(plain) * 1e3:.2f}) |")
        print(f"| every worker, proxy and RM tracing | {statistics.median(traced) * 1e3:.2f} "
              f"({min(traced) * 1e3:.2f}-{max(traced) * 1e3:.2f}) |")  # fmt: skip
        print(f"| ratio | {ratio:.3f} |")

        with tempfile.TemporaryDirectory() as logdir:
            steps = 0
            stopped_at = {}
            original = profiles._run

            def timed_stop(executable) -> None:
                started = time.perf_counter()
                original(executable)
                stopped_at.setdefault("calls", []).append(time.perf_counter() - started)

            profiles._run = timed_stop
            try:
                with pathways_nb.profile(logdir, progress=False) as run:
                    started = time.perf_counter()
                    while time.perf_counter() - started < args.long_seconds:
                        _run(step, replicas, 10)
                        steps += 10
                    finished = time.perf_counter()
                total = time.perf_counter() - finished
            finally:
                profiles._run = original
            write_s = stopped_at["calls"][-1]
            parse_started = time.perf_counter()
            placement, labels = profiles._placement(session)
            trace = profiles.read_session(run.logdir, run.session, placement, labels)
            parse_s = time.perf_counter() - parse_started
            sizes = {p.name: p.stat().st_size for p in run.files}
            print(f"\n{args.long_seconds:.0f} s trace, {steps} steps on 2 islands: {len(trace.events)} device spans")
            print("\n| phase | seconds |")
            print("|---|---|")
            print(f"| stop: every process stops and writes its trace | {write_s:.2f} |")
            print(f"| fetch + parse + Perfetto export (all of profile()'s exit) | {total - write_s:.2f} |")
            print(f"| parse alone (jaxlib's ProfileData, all files) | {parse_s:.2f} |")
            print("\n| file | MiB |")
            print("|---|---|")
            for name, size in sorted(sizes.items()):
                print(f"| {name} | {size / 2**20:.2f} |")
        pathways_nb.disconnect()


if __name__ == "__main__":
    main()
