"""Connects to argv[1] as tenant ``napper`` with exclusive use of island argv[2], keeps arrays, prints ``idle``
and waits for a line on stdin; then uses them again (which resumes its session if it was suspended meanwhile)
and prints ``intact`` if every value is as it was."""

import sys

import jax
import numpy as np

import pathways_nb

address, island = sys.argv[1], int(sys.argv[2])
pathways_nb.connect(address, tenant="napper", exclusive=True, islands=[island])
host = np.random.default_rng(2).standard_normal((512, 512), dtype=np.float32)
kept = jax.device_put(host, jax.devices()[1])
doubled = jax.jit(lambda a: a + a)
assert np.array_equal(np.asarray(doubled(kept)), host + host)
print("idle", flush=True)
sys.stdin.readline()
ok = np.array_equal(np.asarray(doubled(kept)), host + host) and np.array_equal(np.asarray(kept), host)
print("intact" if ok else "changed", flush=True)
pathways_nb.disconnect()
