"""Connects to argv[1] as tenant ``alice`` with exclusive use of the devices (those of the islands argv[2]
names, e.g. ``1`` or ``0,1``; default all), and keeps an array.

Prints ``holding``; after a line on stdin disconnects (the array outlives the session) and prints
``released``; ends after another line.
"""

import sys

import jax
import numpy as np

import pathways_nb

islands = [int(i) for i in sys.argv[2].split(",")] if len(sys.argv) > 2 else []
pathways_nb.connect(sys.argv[1], tenant="alice", exclusive=True, islands=islands)
kept = jax.device_put(np.ones(4, np.float32), jax.devices()[0])  # an array that outlives the session
print("holding", flush=True)
sys.stdin.readline()
pathways_nb.disconnect()
print("released", flush=True)
sys.stdin.readline()
