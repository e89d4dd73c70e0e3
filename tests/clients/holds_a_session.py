"""Connects to argv[1] as tenant argv[2], keeps an array, and prints its connection's secret (so that the test
controls its sessions as the connection's own Session would); after a line on stdin checks the array (which
resumes a suspended session) and prints ``intact``, ``changed``, or ``lost: ERROR`` if reading it failed."""

import sys

import jax
import numpy as np

import pathways_nb

session = pathways_nb.connect(sys.argv[1], tenant=sys.argv[2], islands=[0])
host = np.arange(1000, dtype=np.float32)
kept = jax.device_put(host, jax.devices()[0])
print(session.secret, flush=True)
sys.stdin.readline()
try:
    print("intact" if np.array_equal(np.asarray(kept + 0), host) else "changed", flush=True)
except Exception as error:  # noqa: BLE001 - what the test checks
    print(f"lost: {error}".replace("\n", " "), flush=True)
pathways_nb.disconnect()
