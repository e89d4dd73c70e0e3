"""Many sessions on one proxy: 1 to 200 wire-level sessions against a 2-island cluster.

    python benchmarks/sessions.py [--sessions 1,10,50,200] [--seconds 60] [--clients 1]

Starts ``LocalCluster(islands=2, devices_per_host=2)`` and, per row, runs
``pathways_nb.testing.many_sessions``: that many sessions (``AsyncWireSession``, the IFRT proxy
protocol spoken directly over a connection each; not that many JAX processes), coroutines of one event
loop in each of ``--clients`` client processes (so that they take turns fairly), each session
compiling ``x * 2 + 1`` on one device and, after an idle window, looping for ``--seconds``:
upload 4 KiB and make it an array, execute, read the result back (checked), forget both arrays
(seven requests and calls per round). The proxy's CPU time and RSS are read from its process, apart
from the clients'. Per row: sessions served, rounds per second, a round's time (p50, p99),
fairness (the slowest session's rounds over the median's), the proxy's CPU per round (it must not
grow with the number of sessions), and what an idle and a busy session cost the proxy (CPU and
memory, over the proxy with no session open). Rows run one after another on the same cluster, after
a one-session warm-up (so programs are compiled and caches warm before the first row).
"""

from __future__ import annotations

import argparse
import time

import tables

from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.testing import many_sessions

COLUMNS = [
    ("sessions", "sessions", "{}"),
    ("served", "served", "{}"),
    ("rounds_s", "rounds/s", "{:.0f}"),
    ("p50_ms", "round p50 (ms)", "{:.1f}"),
    ("p99_ms", "round p99 (ms)", "{:.1f}"),
    ("fairness", "fairness (slowest/median)", "{:.2f}"),
    ("cpu_busy", "proxy CPU busy (cores)", "{:.2f}"),
    ("cpu_per_round_us", "proxy CPU per round (µs)", "{:.0f}"),
    ("idle_cpu_us", "proxy CPU per idle session (µs/s)", "{:.0f}"),
    ("idle_kib", "proxy memory per idle session (KiB)", "{:.0f}"),
    ("busy_kib", "proxy memory per busy session (KiB)", "{:.0f}"),
    ("clients_cpu", "clients CPU (cores)", "{:.2f}"),
]


def row(result: many_sessions.SessionsRun) -> dict:
    n = result.sessions
    return {
        "sessions": n,
        "served": result.served,
        "rounds_s": sum(result.iterations) / result.seconds,
        "p50_ms": result.round_trip_ms(0.5),
        "p99_ms": result.round_trip_ms(0.99),
        "fairness": result.fairness,
        "cpu_busy": result.proxy_cpu_busy,
        "cpu_per_round_us": result.cpu_per_iteration_us,
        "idle_cpu_us": (result.proxy_cpu_idle - result.proxy_cpu_quiet) / n * 1e6,
        "idle_kib": (result.proxy_rss_idle - result.proxy_rss_before) / n / 1024,
        "busy_kib": (result.proxy_rss_busy - result.proxy_rss_before) / n / 1024,
        "clients_cpu": result.clients_cpu_busy,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", default="1,10,50,200", help="comma-separated session counts, one row each")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long every session loops, per row")
    parser.add_argument("--idle", type=float, default=10.0, help="seconds the proxy is measured idle, per row")
    parser.add_argument(
        "--clients", type=int, default=1, help="client processes the sessions are spread over (coroutines in each)"
    )
    args = parser.parse_args()
    with LocalCluster(islands=2, devices_per_host=2) as cluster:
        pid = cluster.proxy.process.pid
        warm = many_sessions.run(cluster.address, pid, 1, 2.0, clients=1, idle_window_s=0.5)
        if warm.errors:
            raise SystemExit(f"the warm-up failed: {warm.errors[0]}")
        rows = []
        for sessions in [int(n) for n in args.sessions.split(",")]:
            started = time.monotonic()
            result = many_sessions.run(cluster.address, pid, sessions, args.seconds, args.clients, args.idle)
            rows.append(row(result))
            print(rows[-1], f"({time.monotonic() - started:.0f} s)", flush=True)
            for error in result.errors[:5]:
                print("  error:", error, flush=True)
        print(tables.markdown(rows, COLUMNS))


if __name__ == "__main__":
    main()
