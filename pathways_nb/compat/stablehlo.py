"""StableHLO versions: a program a newer client wrote than this server's jaxlib reads gets a clear error.

A portable artifact starts with ``ML\\xefR``, one byte, then ``StableHLO_vX.Y.Z``:
the version its writer targeted. jaxlib's reader ignores that number and
fails only on what it cannot parse, with a message that names neither side's
jax; the number says whether the client is the newer side.
"""

from __future__ import annotations

import re

from pathways_nb.errors import SUPPORTED_JAXLIB

_HEADER = re.compile(rb"ML\xefR.StableHLO_v(\d+)\.(\d+)\.(\d+)", re.DOTALL)


def artifact_version(program: bytes) -> tuple[int, int, int] | None:
    """The StableHLO version a portable artifact was written for, if its header says."""
    match = _HEADER.match(program[:64])
    return None if match is None else tuple(int(part) for part in match.groups())


def server_version() -> tuple[int, ...]:
    """The newest StableHLO this server's jaxlib reads."""
    from jaxlib.mlir.dialects import stablehlo

    return tuple(int(part) for part in stablehlo.get_current_version().split("."))


def unreadable(program: bytes, error: Exception) -> str:
    """Why this server's jaxlib could not read ``program``, and what to upgrade when the client is newer."""
    import jaxlib.version

    written = artifact_version(program)
    readable = server_version()
    if written is not None and written > readable:
        server = jaxlib.version.__version__
        return (
            f"the program is StableHLO {'.'.join(map(str, written))}, newer than this server's jaxlib {server} "
            f"reads (StableHLO up to {'.'.join(map(str, readable))}): the client's jax is newer than the server's. "
            f"Upgrade the server's jaxlib (pathways-nb's servers run on jaxlib {SUPPORTED_JAXLIB}) or use a "
            f"client jax <= {server} ({error})"
        )
    return f"the program is not a StableHLO portable artifact: {error}"
