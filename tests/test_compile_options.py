"""A client's XLA flags cannot make the server read or write files (dumps, caches) for it."""

from __future__ import annotations

from pathways_nb.testing import python_process

COMPILE = """
    import sys, jax, jax.numpy as jnp, numpy as np, pathways_nb
    pathways_nb.connect(sys.argv[1])
    print(float(jax.jit(lambda x: jnp.sin(x).sum() * 2)(jax.device_put(np.ones(8, np.float32)))))
"""


def test_dump_flags_of_a_client_are_not_honoured_on_the_server(proxy_server, tmp_path):
    dump = tmp_path / "dump"
    client = python_process(COMPILE, proxy_server.address, env={"XLA_FLAGS": f"--xla_dump_to={dump}"})
    out, err = client.communicate(timeout=180)
    assert client.returncode == 0, err[-3000:]
    assert abs(float(out.split()[-1]) - 2 * 8 * 0.8414709848) < 1e-4
    assert not dump.exists() or not any(dump.iterdir()), sorted(p.name for p in dump.iterdir())[:5]
