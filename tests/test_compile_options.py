"""A client's XLA flags cannot make the server read or write files (dumps, caches) for it."""

from __future__ import annotations

from pathlib import Path

from pathways_nb.testing import python_script

CLIENT = Path(__file__).with_name("clients") / "compile_sin_sum.py"


def test_dump_flags_of_a_client_are_not_honoured_on_the_server(proxy_server, tmp_path):
    dump = tmp_path / "dump"
    client = python_script(CLIENT, proxy_server.address, env={"XLA_FLAGS": f"--xla_dump_to={dump}"})
    out, err = client.communicate(timeout=180)
    assert client.returncode == 0, err[-3000:]
    assert abs(float(out.split()[-1]) - 2 * 8 * 0.8414709848) < 1e-4
    assert not dump.exists() or not any(dump.iterdir()), sorted(p.name for p in dump.iterdir())[:5]
