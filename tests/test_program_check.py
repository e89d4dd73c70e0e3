"""A corrupted StableHLO program costs only the child process that reads it first, never a server.

XLA's bytecode reader aborts (SIGSEGV, SIGABRT) on some near-valid corruptions. The test finds
such a program the way the fuzzer would (seeded bit flips of a real artifact, until one kills a
bare reader), then sends it to both kinds of server: each refuses it with a clear error, stays
up (no worker is replaced either), and compiles the intact program right after. A program the
reader refuses with an ordinary error is refused in the reader's words without the server
reading it: such a read may still have damaged the heap of the process that did it.
"""

from __future__ import annotations

import random

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.lib import _jax
from jaxlib.mlir.dialects import stablehlo

from pathways_nb.protocol.errors import Internal, InvalidRequest
from pathways_nb.testing import WireSession
from pathways_nb.worker.program_check import ProgramChecker

# Mutants to try before concluding that this jaxlib's reader no longer crashes (about 1 in 150 does).
SEARCH = 1500


def _artifact() -> bytes:
    lowered = jax.jit(lambda a: jnp.tanh(a @ a).sum(axis=0)).lower(np.ones((8, 8), np.float32))
    return _jax.mlir.serialize_portable_artifact(lowered.as_text(), stablehlo.get_current_version())


def _flipped(rng: random.Random, program: bytes) -> bytes:
    out = bytearray(program)
    for _ in range(rng.randint(1, 3)):
        out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    return bytes(out)


@pytest.fixture(scope="module")
def crashing() -> tuple[bytes, bytes]:
    """(an intact artifact, a mutant of it that kills the process reading it), checked by a bare checker."""
    program = _artifact()
    checker = ProgramChecker()
    checker.check(program)
    rng = random.Random(20261202)
    for _ in range(SEARCH):
        mutant = _flipped(rng, program)
        try:
            checker.check(mutant)
        except InvalidRequest as refusal:
            if not checker.crashes:
                continue  # refused in the reader's words
            assert checker.crashes == 1
            assert "could not be read safely" in refusal.message and "killed by signal" in refusal.message
            checker.check(program)  # a new reader serves the next program
            return program, mutant
    pytest.fail(f"none of {SEARCH} mutants crashed the reader: jaxlib's reader may be hardened now; drop the search")


def _compile(wire: WireSession, program: bytes, device_id: int):
    """A compile request for ``program`` on one device, as the stock client sends it."""
    messages = wire.messages
    options = messages.ifrt.XlaCompileOptionsProto()
    build = options.compile_options.executable_build_options
    build.num_replicas = build.num_partitions = 1
    build.device_ordinal = -1
    assignment = build.device_assignment
    assignment.replica_count = assignment.computation_count = 1
    assignment.computation_devices.add().replica_device_ids.append(device_id)
    request = messages.proxy.CompileRequest()
    request.program.type_name = "xla::ifrt::XlaProgram"
    request.program.data = program
    request.compile_options.type_name = "xla::ifrt::XlaCompileOptions"
    request.compile_options.data = options.SerializeToString()
    return wire.call("compile_request", request).response_metadata.status


def test_a_program_that_crashes_the_reader_is_refused_and_the_server_lives(backend, crashing, request):
    program, mutant = crashing
    exits = len(request.getfixturevalue("cluster").exits) if backend.name == "cluster" else 0
    with WireSession(backend.address) as wire:
        device = wire.init_response.addressable_device_ids[0]
        status = _compile(wire, mutant, device)
        assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], status
        assert "could not be read safely" in status.message and "lower the function again" in status.message
        assert _compile(wire, program, device).code == 0
    if backend.name == "cluster":
        assert len(request.getfixturevalue("cluster").exits) == exits  # no worker died and was replaced
    else:
        assert request.getfixturevalue("proxy_server").alive()


def test_a_program_the_reader_refuses_is_refused_in_its_words_and_never_read_by_the_server(proxy_server):
    program = _artifact()
    truncated = program[: len(program) // 2]
    checker = ProgramChecker()
    with pytest.raises(InvalidRequest, match="not a StableHLO portable artifact") as refusal:
        checker.check(truncated)
    assert checker.crashes == 0
    with pytest.raises(InvalidRequest) as again:  # remembered: no reader is asked twice
        checker.check(truncated)
    assert again.value.message == refusal.value.message
    checker.check(program)  # the reader that refused it reads the next program

    # The server: MLIR writes what it could not read to the standard error of the process that read it.
    written = len(proxy_server.log())
    with WireSession(proxy_server.address) as wire:
        status = _compile(wire, truncated, wire.init_response.addressable_device_ids[0])
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], status
    assert "not a StableHLO portable artifact" in status.message
    assert "failed to deserialize" not in proxy_server.log()[written:]


def _broken_jaxlib(directory) -> None:
    """A ``jaxlib`` package in ``directory`` that fails to import, as a stray folder or a bad install would."""
    (directory / "jaxlib").mkdir()
    (directory / "jaxlib" / "__init__.py").write_text("raise ImportError('a jaxlib broken on purpose')\n")


def test_a_broken_checker_is_reported_as_the_servers_fault_not_the_programs(tmp_path, monkeypatch):
    _broken_jaxlib(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the child imports the broken jaxlib first
    checker = ProgramChecker()
    with pytest.raises(Internal) as error:
        checker.check(_artifact())
    assert "program checker exited with status 1" in error.value.message
    assert "a jaxlib broken on purpose" in error.value.message  # its own words, not "corrupted program"
    monkeypatch.delenv("PYTHONPATH")
    checker.check(_artifact())  # the next request starts a new one


def test_a_folder_in_the_servers_working_directory_does_not_replace_a_package_of_the_checker(tmp_path, monkeypatch):
    _broken_jaxlib(tmp_path)
    monkeypatch.chdir(tmp_path)
    checker = ProgramChecker()
    checker.check(_artifact())
    assert checker.crashes == 0
