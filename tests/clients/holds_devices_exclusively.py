"""Connects to argv[1] as tenant ``alice`` with exclusive use of the devices, and keeps an array.

Prints ``holding``; after a line on stdin disconnects (the array outlives the session) and prints
``released``; ends after another line.
"""

import sys

import jax
import numpy as np

import pathways_nb

pathways_nb.connect(sys.argv[1], tenant="alice", exclusive=True)
kept = jax.device_put(np.ones(4, np.float32), jax.devices()[0])  # an array that outlives the session
print("holding", flush=True)
sys.stdin.readline()
pathways_nb.disconnect()
print("released", flush=True)
sys.stdin.readline()
