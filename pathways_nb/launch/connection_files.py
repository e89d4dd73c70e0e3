"""The files through which a running cluster says how to reach it: ``DIR/address`` and ``DIR/token``.

``pathways-nb up --output DIR`` (and the Slurm batch script of ``pathways-nb deploy
slurm``, which runs it) writes them once the cluster serves and removes them when it
stops: ``address`` holds one line, ``grpc://HOST:PORT``, and ``token`` the cluster
token, readable by this user only (0600). ``pathways_nb.connect(".../address")``,
``%pathways connect slurm://JOBID`` and ``SlurmCluster`` read them.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from pathways_nb.core.security import read_token_file, write_token_file

ADDRESS_FILE = "address"
TOKEN_FILE = "token"


def write(directory: str | os.PathLike[str], address: str, token: str) -> None:
    """Writes the token (0600, first) and then the address: a reader that finds the address finds the token."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    write_token_file(str(directory / TOKEN_FILE), token)
    partial = directory / f".{ADDRESS_FILE}.partial"
    partial.write_text(address + "\n")
    partial.replace(directory / ADDRESS_FILE)  # (in one step: never half an address)


def remove(directory: str | os.PathLike[str]) -> None:
    """Removes both files (the cluster stopped: the address no longer serves, the token opens nothing)."""
    for name in (ADDRESS_FILE, TOKEN_FILE):
        with contextlib.suppress(FileNotFoundError):
            (Path(directory) / name).unlink()


def read(address_file: str | os.PathLike[str]) -> tuple[str, str | None]:
    """The address in ``address_file`` and the token beside it (None if there is none, or it is not
    readable: computing works without it, only the cluster views need it)."""
    path = Path(address_file)
    try:
        address = path.read_text().strip()
    except OSError as error:
        raise ValueError(f"cannot read the cluster's address from {path}: {error.strerror}") from None
    if not address:
        raise ValueError(f"{path} is empty: the cluster that wrote it has not started serving yet")
    try:
        token = read_token_file(str(path.parent / TOKEN_FILE))
    except ValueError:
        token = None
    return address, token
