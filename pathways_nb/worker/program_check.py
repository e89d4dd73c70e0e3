"""Reading a client's StableHLO program where a crash costs only the reading: in a child process.

XLA's MLIR bytecode reader is not hardened against near-valid corruptions: a flipped bit or a
truncated artifact can abort the process that reads it ("double free or corruption", SIGSEGV)
instead of raising. Worse, one that the reader refuses with an ordinary error may first have
written past a buffer, and the process aborts later, in some other allocation, depending on what
its heap held. So before a server (a worker, or the single-process proxy) reads a program itself,
a child process reads it first, the way the server will: with XLA's conversion to an HLO
computation (parse, verify, legalize), and, if that fails, with the reader of the signature read
(``worker.signature``). A program the child reads is safe to read here. One the child's reader
refuses is refused in the child's words, and the server never reads it; one that kills the child
is refused with a clear error, and a new child reads the next program. Each distinct program is
checked once (by content).

The child speaks a tiny framed protocol on its standard input and output:
``python -m pathways_nb.worker.program_check``.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import select
import struct
import subprocess
import sys
import tempfile
import threading
import time

from pathways_nb.core import tuning
from pathways_nb.core.exit_status import exit_description
from pathways_nb.protocol.errors import Internal, InvalidRequest

_LOGGER = logging.getLogger(__name__)

_LENGTH = struct.Struct("<Q")
# The child's answers: read and converted; read, but XLA's conversion failed (its compile reports
# that); refused, with the words that follow.
_OK, _NOT_CONVERTED, _REFUSED = b"+", b"~", b"-"


class ProgramChecker:
    """A child process that reads programs first; one per server process, started on first use."""

    def __init__(self, timeout_s: float | None = None):
        self.timeout_s = tuning.PROGRAM_CHECK_TIMEOUT_S.value if timeout_s is None else timeout_s
        self._lock = threading.Lock()
        self._child: subprocess.Popen | None = None
        self._stderr = None  # the child's standard error (a temporary file), read when it ends badly
        # Whether the running child has failed to read a program: one that did may be damaged by it.
        self._tainted = False
        # Programs read before, by digest: None if safe, else the words they were refused with.
        self._checked: collections.OrderedDict[bytes, str | None] = collections.OrderedDict()
        # Programs refused because reading them killed a reader (or took too long), for tests and logs.
        self.crashes = 0

    def check(self, program: bytes) -> None:
        """Returns if reading ``program`` cannot crash this process; raises ``InvalidRequest`` otherwise.

        A program the reader refuses with an ordinary error is refused here, in the words the
        caller's own read would use (the version advice of ``compat.stablehlo`` among them).
        """
        digest = hashlib.sha256(program).digest()
        with self._lock:
            if digest in self._checked:
                self._checked.move_to_end(digest)
                refusal = self._checked[digest]
            else:
                refusal = self._checked[digest] = self._read_in_child(program)
                if len(self._checked) > tuning.PROGRAM_CHECK_REMEMBERED.value:
                    self._checked.popitem(last=False)
        if refusal is not None:
            raise InvalidRequest(refusal)

    def _read_in_child(self, program: bytes) -> str | None:
        """None if ``program`` is safe to read; the reader's words if it refused the program."""
        while True:
            tainted = self._tainted
            child = self._running_child()
            try:
                child.stdin.write(_LENGTH.pack(len(program)) + program)
                child.stdin.flush()
                reply = _read_frame(child.stdout, time.monotonic() + self.timeout_s)
            except (OSError, EOFError, TimeoutError) as error:
                if tainted and not isinstance(error, TimeoutError):
                    # This child had failed to read an earlier program, which may have damaged it: a
                    # new one decides whether this program is the one that kills its reader.
                    self._give_up(child)
                    continue
                raise self._refusal_after(child, error) from None
            if reply[:1] == _OK:
                return None
            if reply[:1] not in (_NOT_CONVERTED, _REFUSED):
                self._give_up(child)
                self.crashes += 1
                raise InvalidRequest("the program's reader answered nonsense; the program is refused")
            self._tainted = True
            return reply[1:].decode(errors="replace") if reply[:1] == _REFUSED else None

    def _refusal_after(self, child: subprocess.Popen, error: Exception) -> Internal | InvalidRequest:
        """Why the program is refused after ``child`` ended or hung reading it."""
        self._give_up(child)
        if child.returncode >= 0 and not isinstance(error, TimeoutError):
            # Python's own exit (an import failed, a pipe broke), not a crash inside the reader: the
            # checker is broken, not the program. Said so, with its words, instead of refusing programs.
            said = self._said(child)
            _LOGGER.error("the program checker %s: %s", exit_description(child.returncode), said)
            return Internal(
                f"this server's program checker {exit_description(child.returncode)} before it read the "
                f"program ({said[-300:] or 'it said nothing'}); the next request starts a new one"
            )
        self.crashes += 1
        how = (
            f"it took longer than {self.timeout_s:g} s"
            if isinstance(error, TimeoutError)
            else f"the process reading it {exit_description(child.returncode)}"
        )
        return InvalidRequest(
            f"the program could not be read safely: {how}. Its bytes are not a valid StableHLO "
            "artifact (corrupted or truncated on the way?); lower the function again with jax and send that"
        )

    def _running_child(self) -> subprocess.Popen:
        child = self._child
        if child is None or child.poll() is not None:
            self._stderr = tempfile.TemporaryFile()
            self._tainted = False
            child = self._child = subprocess.Popen(
                # -P: the server's working directory is not on the child's path (a folder there named
                # like a package it imports would replace that package).
                [sys.executable, "-P", "-m", __name__],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
            )
        return child

    def _give_up(self, child: subprocess.Popen) -> None:
        child.kill()
        child.wait()
        self._child = None

    def _said(self, child: subprocess.Popen) -> str:
        """The last lines the (ended) child wrote to its standard error."""
        self._stderr.seek(0)
        lines = self._stderr.read().decode(errors="replace").strip().splitlines()
        return " | ".join(lines[-5:])


def _read_frame(stream, deadline: float) -> bytes:
    """One length-prefixed frame from a pipe, by ``deadline`` (``TimeoutError``; ``EOFError`` if it closed)."""
    header = _read_exactly(stream, _LENGTH.size, deadline)
    return _read_exactly(stream, _LENGTH.unpack(header)[0], deadline)


def _read_exactly(stream, size: int, deadline: float) -> bytes:
    data = bytearray()
    descriptor = stream.fileno()
    while len(data) < size:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([descriptor], [], [], remaining)[0]:
            raise TimeoutError
        chunk = os.read(descriptor, size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return bytes(data)


def _serve() -> None:
    """The child: reads each program as the server will, answers ``+``, ``~`` or ``-`` and the refusal."""
    from jaxlib import _jax
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import stablehlo

    from pathways_nb.compat import stablehlo as stablehlo_versions

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        header = stdin.read(_LENGTH.size)
        if len(header) < _LENGTH.size:
            return  # the server closed the pipe (or ended)
        program = stdin.read(_LENGTH.unpack(header)[0])
        try:
            _jax.mlir.mlir_module_to_xla_computation(program, use_tuple_args=False, return_tuple=False)
            reply = _OK
        except Exception:  # noqa: BLE001 - unreadable, or read well and not converted: the reader says which
            try:
                # The reader of the server's signature read (``worker.signature``), in a bare context
                # (jax's own would cost this child an import of jax: 2.6 s instead of 0.3 s to start).
                stablehlo.deserialize_portable_artifact(ir.Context(), program)
                reply = _NOT_CONVERTED  # read well, but XLA's conversion failed: its compile says why
            except Exception as error:  # noqa: BLE001 - the reader refused it: so does the server, in these words
                reply = _REFUSED + stablehlo_versions.unreadable(program, error).encode(errors="replace")[:4000]
        stdout.write(_LENGTH.pack(len(reply)) + reply)
        stdout.flush()


if __name__ == "__main__":
    _serve()
