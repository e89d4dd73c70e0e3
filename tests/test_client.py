"""connect/disconnect in a live process: after local JAX, back and forth, with clear failures."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from pathways_nb.client import batch_flusher
from pathways_nb.client.connection import normalize_address
from pathways_nb.core import tuning
from pathways_nb.testing import finish, python_script

CLIENTS = Path(__file__).with_name("clients")


def _run(script: str, *args: str) -> tuple[int, str, str]:
    """Runs the client ``script``: its exit status, output and errors."""
    process = python_script(CLIENTS / script, *args)
    out, err = finish(process, 300)
    return process.returncode, out, err


def test_connect_after_local_use_disconnect_and_reconnect(proxy_server):
    status, out, err = _run("connect_disconnect_reconnect.py", proxy_server.address)
    assert status == 0, err[-3000:]
    lines = [line.split() for line in out.splitlines()]
    assert lines[0][:2] == ["local", "2.0"] and lines[0][2] != "proxy/pathways"
    assert lines[1] == ["remote", "4.0", "proxy/pathways", "4"]
    assert lines[2][:2] == ["local", "6.0"] and lines[2][2] != "proxy/pathways"
    assert lines[3] == ["remote", "8.0", "proxy/pathways"]


def test_connecting_to_nothing_fails_within_the_timeout():
    status, out, err = _run("connect_fails.py", "127.0.0.1:1", "2")
    assert status == 0, err[-3000:]
    seconds, message = out.split(" ", 1)
    assert float(seconds) < 30  # not the default 60 s (about 2 s; 14 s seen with jax imported inside, at load 20)
    assert "grpc://127.0.0.1:1" in message and "within 2 s" in message


def test_a_refused_address_fails_at_once_even_with_a_long_timeout():
    status, out, err = _run("connect_fails.py", "127.0.0.1:1", "60")
    assert status == 0, err[-3000:]
    seconds, message = out.split(" ", 1)
    assert float(seconds) < 30  # not the 60 s time-out (at once: < 1 s on a quiet machine)
    assert "grpc://127.0.0.1:1" in message and "nothing is listening there" in message


def test_a_server_that_accepts_but_never_answers_gets_the_timeout():
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts connections, never speaks gRPC
        port = silent.getsockname()[1]
        status, out, err = _run("connect_fails.py", f"127.0.0.1:{port}", "3")
    assert status == 0, err[-3000:]
    seconds, message = out.split(" ", 1)
    assert 2.5 <= float(seconds) < 30 and "within 3 s" in message


def test_connecting_to_a_proxy_served_by_this_very_process_is_refused_not_hung():
    """jaxlib's client holds the GIL while it waits for a compile: a server in its own process could never answer."""
    status, out, err = _run("connect_to_own_process.py")
    assert status == 0, err[-3000:]
    first, last = out.strip().splitlines()
    seconds, message = first.split(" ", 1)
    assert float(seconds) < 10
    assert "runs in this Python process" in message and "pathways-nb up" in message
    assert last == "2.0 cpu"


@pytest.mark.parametrize(
    ("given", "expected"),
    [("localhost:29000", "grpc://localhost:29000"), (" grpc://10.0.0.1:1 ", "grpc://10.0.0.1:1")],
)
def test_addresses_are_normalized(given, expected):
    assert normalize_address(given) == expected


@pytest.mark.parametrize("bad", ["", "http://host:1", "grpc://host"])
def test_bad_addresses_are_refused_with_the_reason(bad):
    with pytest.raises(ValueError, match=r"address|scheme|port"):
        normalize_address(bad)


def _has_cap_sys_nice() -> bool:
    """Whether this process may set another thread's timer slack (bit 23 of its effective capabilities)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 23 & 1)
    return False


def test_the_stock_client_s_batch_flusher_runs_only_on_idle_cores_and_seldom(proxy_server):
    """jaxlib's IFRT proxy client wakes a thread every 50 µs to send batched deletions (13% of a core);
    ``connect`` puts that thread, and only it, under SCHED_IDLE, and where the process may (with
    CAP_SYS_NICE) gives it 2 ms of timer slack, so it wakes ~500 times a second
    (``pathways_nb.client.batch_flusher``)."""
    status, out, err = _run("client_threads_at_rest.py", proxy_server.address)
    assert status == 0, err[-3000:]
    threads = [line.split()[1:] for line in out.splitlines() if line.startswith("thread")]
    assert len(threads) == 1 and threads[0][1] == "idle", out  # no other thread wakes often
    rate, slack = int(threads[0][0]), threads[0][2]
    if _has_cap_sys_nice():
        assert slack == str(batch_flusher.TIMER_SLACK_NS) and rate < 1000, out
    else:  # without CAP_SYS_NICE it keeps its 50 µs sleeps
        assert rate > 2000, out
    assert "result 8.0" in out, out


def test_the_batch_flusher_switch_leaves_the_stock_client_s_thread_as_it_made_it(proxy_server):
    """``PATHWAYS_BATCH_FLUSHER=stock`` (``tuning.BATCH_FLUSHER``): the flusher keeps its policy and its 50 µs
    sleeps (thousands of wake-ups a second), as the stock client started it."""
    process = python_script(
        CLIENTS / "client_threads_at_rest.py", proxy_server.address, env={tuning.BATCH_FLUSHER.env_var: "stock"}
    )
    out, err = finish(process, 300)
    assert process.returncode == 0, err[-3000:]
    threads = [line.split()[1:] for line in out.splitlines() if line.startswith("thread")]
    assert len(threads) == 1 and threads[0][1] == "normal", out
    assert int(threads[0][0]) > 2000 and threads[0][2] != str(batch_flusher.TIMER_SLACK_NS), out
    assert "result 8.0" in out, out
