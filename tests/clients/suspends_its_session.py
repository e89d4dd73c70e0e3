"""Connects to argv[1] (island 0), keeps argv[2] MiB of arrays, half as much more that it drops later, and a
compiled program, suspends its session, prints ``suspended`` and waits for a line on stdin; then deletes and
drops arrays, prints ``let go`` and waits for another line; then uses the session again and prints one JSON
line of what it found.

Arrays deleted and dropped while the session is suspended resume nothing; a program dispatched then resumes
it and runs; every array comes back bitwise equal; the proxy compiles nothing again for it.
"""

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import pathways_nb

address, mib = sys.argv[1], int(sys.argv[2])
session = pathways_nb.connect(address, tenant="sleeper", islands=[0])
devices = jax.devices()
mesh = jax.make_mesh((len(devices),), ("x",), devices=devices)
rows = mib * (1 << 20) // (4 * 1024)
host = np.random.default_rng(0).standard_normal((rows, 1024), dtype=np.float32)
big = jax.device_put(host, NamedSharding(mesh, PartitionSpec("x")))
dropped_big = jax.device_put(host[: rows // 2], NamedSharding(mesh, PartitionSpec("x")))
small = jax.device_put(np.arange(7, dtype=np.int8), devices[1])
halves_host = np.asarray(jnp.linspace(0, 1, 64, dtype=jnp.bfloat16, device=jax.devices("cpu")[0]))
halves = jax.device_put(halves_host, devices[0])
deleted, dropped = jax.device_put(np.ones(5), devices[0]), jax.device_put(np.zeros(3), devices[1])
step = jax.jit(lambda a: a * 2 + 1)
expected = np.asarray(step(big))


def compiles() -> int:
    return sum(1 for e in session.observer.events(tenant="sleeper") if e.kind == "compile")


compiled_before = compiles()
started = time.monotonic()
session.suspend()
suspend_s = time.monotonic() - started
state_suspended = session.status
print("suspended", flush=True)
sys.stdin.readline()
deleted.delete()  # a delete_array request
del dropped, dropped_big  # destruct_array requests, sent by the client's flusher within milliseconds
time.sleep(0.5)
state_after_letting_go = session.status
print("let go", flush=True)
sys.stdin.readline()
started = time.monotonic()
result = step(big)  # resumes the session
equal_result = bool(np.array_equal(np.asarray(result), expected))
resume_s = time.monotonic() - started
print(
    json.dumps(
        {
            "state_suspended": state_suspended,
            "state_after_letting_go": state_after_letting_go,
            "state_after": session.status,
            "suspend_s": suspend_s,
            "resume_s": resume_s,
            "result_equal": equal_result,
            "big_equal": bool(np.array_equal(np.asarray(big), host)),
            "small_equal": bool(np.array_equal(np.asarray(small), np.arange(7, dtype=np.int8))),
            "halves_equal": bool(np.array_equal(np.asarray(halves), halves_host)),
            "compiles_after_resume": compiles() - compiled_before,
        }
    ),
    flush=True,
)
pathways_nb.disconnect()
