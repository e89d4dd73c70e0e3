"""A colocated class keeps its state across calls; another instance has its own.

Says the running totals of three calls on one instance, and one call's on another.
"""

import jax
import numpy as np
from colocated_client import connect, say
from jax.experimental import colocated_python as cp

cpus = connect()


@cp.colocated_python_class
class Accumulator:
    def __init__(self, start):
        self.total = start

    def add(self, x):
        self.total = self.total + float(np.asarray(x).sum())
        return jax.device_put(np.float32(self.total), x.sharding)


acc = Accumulator(10.0)
x = jax.device_put(np.ones(4, np.float32), cpus[0])
totals = [float(np.asarray(acc.add(x))) for _ in range(3)]
other = Accumulator(0.0)
say(totals=totals, other=float(np.asarray(other.add(x))))
