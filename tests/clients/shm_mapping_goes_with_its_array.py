"""Uploads 4 MiB through shared memory to the proxy at argv[1] (pid argv[2]), then deletes the array.

Prints JSON: how many of the upload's files the proxy had mapped while the array lived, and after its
deletion (once it is 0, 10 s at most).
"""

import json
import sys

import jax
import numpy as np

import pathways_nb
from pathways_nb.testing import wait_until

pathways_nb.connect(sys.argv[1])
maps = f"/proc/{sys.argv[2]}/maps"


def mapped():
    with open(maps) as lines:
        return sum("/lt_" in line or "/kept-" in line for line in lines)  # the upload's file, kept or not


x = jax.device_put(np.ones(4 * 2**20, np.uint8), jax.devices("proxy")[0]).block_until_ready()
while_alive = mapped()
x.delete()
jax.device_put(np.zeros(3), jax.devices("proxy")[0]).block_until_ready()  # a round trip after the delete
wait_until(mapped, 10, "the upload's file unmapped", holds=lambda count: count == 0)
print(json.dumps({"alive": while_alive, "after": mapped()}))
