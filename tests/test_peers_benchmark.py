"""benchmarks/peers.py: a local-only quick run prints its tables and plot, and a missing peer is named, not fatal.

The run is real (a child process running the JAX workloads); nothing is timed here.
"""

from __future__ import annotations

import os
import subprocess
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def test_a_quick_local_run_prints_the_tables_and_writes_the_plot_and_names_a_missing_peer(tmp_path):
    plot = tmp_path / "performance.png"
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "clients", "peers_without_ray.py")
    env = {**os.environ, "PYTHONPATH": BENCHMARKS}
    run = subprocess.run(
        [sys.executable, script, "--quick", "--peers", "local,ray", "--plot", str(plot)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        cwd=BENCHMARKS,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert 'Ray (actor): skipped: ray not installed (pip install -e ".[bench]" in the checkout)' in run.stdout
    assert "| figure | local JAX |" in run.stdout
    for row in ["| chained tiny programs (programs/s) |", "| 64 MiB host -> device |", "| ~10 ms compute step |"]:
        assert row in run.stdout, run.stdout
    assert "| 64 MiB device -> host | zero-copy |" in run.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_tables_give_median_range_and_ratios_to_local_in_the_same_round():
    sys.path.insert(0, BENCHMARKS)
    try:
        import peers
    finally:
        sys.path.remove(BENCHMARKS)
    results = {
        "local": {"chain": [1000.0, 3000.0], "h2d": [2.0, 1.0], "d2h": [50.0, 60.0], "step": [10.0, 20.0]},
        "dask": {"chain": [100.0, 600.0], "h2d": [1.0, 1.0], "d2h": [1.0, 2.0], "step": [20.0, 25.0]},
    }
    ratios = peers.ratios(results)["dask"]
    assert ratios["chain"] == [0.1, 0.2]
    assert ratios["d2h"] == [0.5, 2.0]  # over local host -> device: locally the read is zero-copy
    assert ratios["step"] == [0.5, 0.8]  # local time / peer time
    text = peers.tables(results)
    assert "| chained tiny programs (programs/s) | 2k (1k-3k) | 350 (100-600) |" in text
    assert "| ~10 ms compute step | 1 (1-1) | 0.65 (0.5-0.8) |" in text
    assert "| 64 MiB device -> host | zero-copy | 1.25 (0.5-2) |" in text
