"""Through the proxy vs plain local JAX, side by side in one run.

    python benchmarks/proxy_vs_local.py [--quick]

Starts ``pathways-nb proxy`` with one CPU device on this machine, connects this
process to it, and measures each workload on the server's device and on this
process's own CPU device. Prints one table with the ratios. Targets on a
2-core machine: >= 5,000 tiny chained programs/s, >= 1 GB/s each way for 64 MiB,
a ~10 ms compute step within 5% of local.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import pathways_nb
from pathways_nb.processes import ChildServer

MIB = 1 << 20


def tiny_programs_per_second(device, seconds: float) -> float:
    """Chained ``x + 1`` calls dispatched back to back, then one wait."""
    step = jax.jit(lambda x: x + 1)
    x = step(jax.device_put(np.float32(0), device)).block_until_ready()
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        for _ in range(500):
            x = step(x)
        count += 500
    x.block_until_ready()
    elapsed = time.perf_counter() - started
    assert float(x) == count + 1
    return count / elapsed


def host_to_device_gbps(device, size_mib: int, repeats: int) -> float:
    host = np.random.default_rng(0).random(size_mib * MIB // 4, dtype=np.float32)
    jax.device_put(host, device).block_until_ready()
    started = time.perf_counter()
    for _ in range(repeats):
        jax.device_put(host, device).block_until_ready()
    return size_mib * MIB * repeats / (time.perf_counter() - started) / 1e9


def device_to_host_gbps(device, size_mib: int, repeats: int) -> float:
    host = np.random.default_rng(1).random(size_mib * MIB // 4, dtype=np.float32)
    elapsed = 0.0
    for _ in range(repeats + 1):
        on_device = jax.device_put(host, device).block_until_ready()  # fresh: no cached host copy
        started = time.perf_counter()
        back = np.asarray(on_device)
        elapsed += time.perf_counter() - started if _ else 0.0
    assert back.shape == host.shape
    return size_mib * MIB * repeats / elapsed / 1e9


def compute_step_ms(device, size: int, steps: int) -> float:
    """Mean time of a chained matmul step (the size is chosen to take ~10 ms locally)."""
    w = jax.device_put(np.random.default_rng(2).random((size, size), dtype=np.float32) / size, device)
    step = jax.jit(lambda x, w: jnp.tanh(x @ w))
    x = step(w, w).block_until_ready()
    started = time.perf_counter()
    for _ in range(steps):
        x = step(x, w)
    x.block_until_ready()
    return (time.perf_counter() - started) / steps * 1e3


def calibrate_step_size(device, target_ms: float = 10.0) -> int:
    size = 256
    while size < 4096 and compute_step_ms(device, size, 5) < target_ms * 0.7:
        size = int(size * 1.25)
    return size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs (for a smoke test)")
    args = parser.parse_args()
    seconds, repeats, steps = (1.0, 3, 30) if args.quick else (4.0, 8, 200)

    server = ChildServer("proxy", ["proxy", "--server_port", "0", "--devices", "1"])
    server.start()
    try:
        pathways_nb.connect(server.address)
        remote, local = jax.devices("proxy")[0], jax.devices("cpu")[0]
        size = calibrate_step_size(local)
        rows = []
        for name, unit, higher_is_better, measure in [
            ("tiny chained programs", "programs/s", True, lambda d: tiny_programs_per_second(d, seconds)),
            ("64 MiB host -> device", "GB/s", True, lambda d: host_to_device_gbps(d, 64, repeats)),
            ("64 MiB device -> host", "GB/s", True, lambda d: device_to_host_gbps(d, 64, repeats)),
            (f"compute step ({size}x{size} matmul)", "ms/step", False, lambda d: compute_step_ms(d, size, steps)),
        ]:
            local_value, remote_value = measure(local), measure(remote)
            ratio = remote_value / local_value if higher_is_better else local_value / remote_value
            rows.append((name, unit, local_value, remote_value, ratio))
        pathways_nb.disconnect()
    finally:
        server.close()

    print(f"{'workload':<34} {'unit':<11} {'local JAX':>11} {'via proxy':>11} {'proxy/local':>12}")
    for name, unit, local_value, remote_value, ratio in rows:
        print(f"{name:<34} {unit:<11} {local_value:>11.3g} {remote_value:>11.3g} {ratio:>12.3f}")
    print("(proxy/local: throughput ratio; for ms/step, local time / proxy time)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
