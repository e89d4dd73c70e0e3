"""The committed cluster RPC modules are what cluster.proto generates."""

from __future__ import annotations

import pathlib

from pathways_nb.rpc import generate


def test_generated_modules_are_up_to_date(tmp_path):
    generate.generate(tmp_path)
    for name in ("cluster_pb2.py", "cluster_pb2_grpc.py"):
        committed = (generate.HERE / name).read_text()
        assert (tmp_path / name).read_text() == committed, f"{name} is stale: run python -m pathways_nb.rpc.generate"
    assert pathlib.Path(generate.HERE / "cluster.proto").exists()
