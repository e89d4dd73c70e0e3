"""An unspecialized colocated function, called twice: the first call compiles three programs (output
specs, the function, the result's pop), the second runs the function alone.

Says, after each call, the programs compiled so far and the call's results.
"""

import jax
import numpy as np
from colocated_client import connect, say
from jax.experimental import colocated_python as cp
from jax.extend.ifrt_programs import ifrt_programs

cpus = connect()
compiled = []
make = ifrt_programs.make_colocated_python_program


def counting(name, *args, **kwargs):
    compiled.append(name)
    return make(name, *args, **kwargs)


ifrt_programs.make_colocated_python_program = counting


@cp.colocated_python
def stats(x):
    import builtins

    builtins.runs = getattr(builtins, "runs", 0) + 1
    return {"double": x * 2, "sum": x.sum(keepdims=True), "runs": jax.device_put(np.int32(builtins.runs), x.sharding)}


x = jax.device_put(np.arange(4.0, dtype=np.float32), cpus[1])
first = jax.tree.map(np.asarray, stats(x))
say(
    call=1,
    compiled=list(compiled),
    double=first["double"].tolist(),
    sum=first["sum"].tolist(),
    runs=int(first["runs"]),
)
second = jax.tree.map(np.asarray, stats(x + 1))
say(call=2, compiled=list(compiled), double=second["double"].tolist(), runs=int(second["runs"]))
