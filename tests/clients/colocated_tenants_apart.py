"""One of two tenants' executors (argv[4] names its role, ``a`` or ``b``), which meet in the directory
argv[5]: each leaves a secret in its own directory and says there where that is, then tries to read
the other's.

Says whether its executor started without the other's globals, what its read of the other's secret
gave (0: no other yet, 1: read, 2: refused), and the executor's uid; then holds its session (and
executor) until a line on stdin.
"""

import sys

import jax
import numpy as np
from colocated_client import connect, say
from jax.experimental import colocated_python as cp

cpus = connect()
role, meeting = sys.argv[4], sys.argv[5]


@cp.colocated_python
def visit(x):
    import builtins
    import os
    import pathlib

    print(f"tenant {role} was here", file=sys.stderr)  # printed by its own client only
    seen = getattr(builtins, "secret", None)
    builtins.secret = role
    pathlib.Path("secret.txt").write_text(role)
    pathlib.Path(meeting, role).write_text(os.getcwd())
    outcome = "none"
    for other in pathlib.Path(meeting).iterdir():
        if other.name != role:
            try:
                pathlib.Path(other.read_text(), "secret.txt").read_text()
                outcome = "read"
            except OSError as error:
                outcome = type(error).__name__
    codes = {"none": 0, "read": 1, "PermissionError": 2}
    return jax.device_put(np.array([seen is None, codes.get(outcome, 3), os.getuid()], np.float64), x.sharding)


x = jax.device_put(np.zeros(1, np.float32), cpus[0])
with jax.enable_x64(True):
    fresh, outcome, uid = np.asarray(visit(x)).tolist()
say(fresh=fresh, outcome=outcome, uid=uid)
sys.stdin.readline()  # the session (and its executor) lives until the test says
