"""An older JAX client (in its own virtual environment) runs programs on today's server."""

from __future__ import annotations

import os
import subprocess
import textwrap

import numpy as np
import pytest

OLD_CLIENT_PYTHON = os.environ.get("PATHWAYS_OLD_CLIENT_PYTHON")

SCRIPT = textwrap.dedent("""
    import sys
    import jax, numpy as np
    from jax.extend.backend import ifrt_proxy, register_backend_factory
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    register_backend_factory("proxy", lambda: ifrt_proxy.get_client(sys.argv[1], ifrt_proxy.ClientConnectionOptions()))
    jax.config.update("jax_platforms", "proxy")
    devices = jax.devices()
    sharding = NamedSharding(Mesh(np.array(devices), ("x",)), P("x"))
    x = jax.device_put(np.arange(16, dtype=np.float32).reshape(4, 4), sharding)
    y = jax.jit(lambda a: (a @ a.T).sum())(x)
    print(jax.__version__, len(devices), float(y))
""")


@pytest.mark.skipif(
    not OLD_CLIENT_PYTHON, reason="set PATHWAYS_OLD_CLIENT_PYTHON to a Python with an older jax (make test does)"
)
def test_older_jax_client(proxy_server, tmp_path):
    env = dict(os.environ, IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS="true")
    env.pop("JAX_PLATFORMS", None)
    result = subprocess.run(
        # Run outside the checkout, whose pathways_nb.egg-info would lend the old client our plugin.
        [OLD_CLIENT_PYTHON, "-c", SCRIPT, proxy_server.address],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    version, devices, total = result.stdout.split()
    assert version != "0.10.2"
    x = np.arange(16, dtype=np.float32).reshape(4, 4)
    assert (int(devices), float(total)) == (4, float((x @ x.T).sum()))
