"""Regenerates cluster_pb2.py and cluster_pb2_grpc.py from cluster.proto (needs grpcio-tools).

python -m pathways_nb.rpc.generate
"""

from __future__ import annotations

import pathlib
import re
import sys

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def generate(output: pathlib.Path = HERE) -> None:
    from grpc_tools import protoc

    status = protoc.main(
        [
            "protoc",
            f"-I{ROOT}",
            f"--python_out={output}",
            f"--grpc_python_out={output}",
            str(HERE / "cluster.proto"),
        ]
    )
    if status != 0:
        raise SystemExit(f"protoc failed with status {status}")
    generated = output / "pathways_nb" / "rpc"
    for name in ("cluster_pb2.py", "cluster_pb2_grpc.py"):
        text = (generated / name).read_text()
        # protoc writes absolute imports from the include root; keep them package-absolute.
        text = re.sub(r"^from pathways_nb\.rpc import", "from pathways_nb.rpc import", text, flags=re.M)
        (output / name).write_text(text)
    for leftover in sorted(generated.glob("*"), reverse=True):
        leftover.unlink()
    for directory in (generated, generated.parent):
        directory.rmdir()


if __name__ == "__main__":
    generate(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
