"""What an executor has: no cluster token, none of the workers' files (their shared-memory directory is
argv[4]); and it ends with its session.

Says the executor's pid, whether it has the token, how many environment variables, and whether it
could list the workers' directory; disconnects and says what a call then raised; then waits for a
line on stdin.
"""

import sys

import jax
import numpy as np
from colocated_client import connect, say
from jax.experimental import colocated_python as cp

import pathways_nb

cpus = connect()
workers_directory = sys.argv[4]  # the workers' shared memory: other tenants' arrays pass there


@cp.colocated_python
def probe(x):
    import os

    try:
        os.listdir(workers_directory)
        workers_files = 1
    except PermissionError:
        workers_files = 0
    return jax.device_put(
        np.array([os.getpid(), "PATHWAYS_CLUSTER_TOKEN" in os.environ, len(os.environ), workers_files], np.float32),
        x.sharding,
    )


x = jax.device_put(np.zeros(1, np.float32), cpus[1])
pid, has_token, variables, workers_files = np.asarray(probe(x)).tolist()
say(pid=int(pid), has_token=bool(has_token), variables=int(variables), workers_files=bool(workers_files))
pathways_nb.disconnect()
try:
    np.asarray(probe(x))
    say(after_disconnect=None)
except Exception as error:  # noqa: BLE001 - that it fails is what the test checks
    say(after_disconnect=type(error).__name__)
sys.stdin.readline()
