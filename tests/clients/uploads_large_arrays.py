"""The same 256 MiB upload argv[2] times in a row, to device argv[3] of the proxy at argv[1] (island 0's).

Prints ``ready`` once connected (and a small upload made); after a line on stdin uploads, then prints
JSON: each upload's start and end (``time.time()``).
"""

import json
import sys
import time

import jax
import numpy as np

import pathways_nb

pathways_nb.connect(sys.argv[1], tenant="uploader", islands=[0])
device = jax.devices()[int(sys.argv[3])]
big = np.ones(64 << 20, np.float32)  # 256 MiB
jax.device_put(big[:8], device).block_until_ready()
print("ready", flush=True)
sys.stdin.readline()
times = []
for _ in range(int(sys.argv[2])):
    started = time.time()
    jax.device_put(big, device).block_until_ready().delete()
    times.append((started, time.time()))
print(json.dumps(times), flush=True)
