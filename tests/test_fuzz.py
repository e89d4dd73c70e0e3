"""Protocol fuzzing: thousands of random and mutated IFRT requests, then a stock client must still work.

Requests are generated from the wire schema read from jaxlib (every kind of
``IfrtRequest``, random field values, handles that exist and that don't, huge
and negative dims, empty and huge device lists, random shardings, dtypes and
type names), or are byte-level mutations of the requests a real jax client
sent (captured through a relay), their StableHLO programs corrupted too (bit
flips, truncations, splices). Host-buffer calls with random sizes are mixed
in. Every reply must be a well-formed response; an INTERNAL reply is a server
bug (an error nobody turned into a clear status). Afterwards every server
process is alive (none was replaced), a stock jax client computes correctly,
and each server's memory is back near where it started.

``PATHWAYS_FUZZ_SEED``, ``PATHWAYS_FUZZ_SECONDS`` and ``PATHWAYS_FUZZ_REQUESTS`` (the least
per target) change the run.
"""

from __future__ import annotations

import base64
import collections
import json
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import psutil
import pytest

from pathways_nb import testing
from pathways_nb.core import nonxla
from pathways_nb.core import persistence_requests as persistence
from pathways_nb.core.security import TOKEN_ENV, ClusterCredentials
from pathways_nb.launch import local_cluster
from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.protocol import data_messages, op_sharding, schema, shardings
from pathways_nb.testing import WireSession

SEED = int(os.environ.get("PATHWAYS_FUZZ_SEED", "20261201"))
SECONDS = float(os.environ.get("PATHWAYS_FUZZ_SECONDS", "15"))
# Requests each target gets at least, however loaded the machine (within CAP_S more seconds).
REQUESTS = int(os.environ.get("PATHWAYS_FUZZ_REQUESTS", "3000"))
CAP_S = 300.0
MIB = 1 << 20
# Growth of a server's resident memory that the fuzzing may leave behind: caches of the
# programs and shardings it made (the compile cache keeps up to 256 programs) and allocator
# slack. Measured: +15 to +39 MiB per process after 15 s runs, levelling off near +50 MiB after
# a minute; a leak of the uploads or arrays the fuzzer makes is hundreds of MiB (one was 3.3 GiB).
RSS_SLACK = 64 * MIB
INTERNAL = grpc.StatusCode.INTERNAL.value[0]
SERVICE_STORE = testing.SERVICE + "HostBufferStore"
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]

SHARDING_TYPES = (shardings.SINGLE_DEVICE, shardings.HLO, shardings.CONCRETE_EVEN, shardings.OPAQUE)
PLUGIN_PROGRAM = "xla::ifrt::PluginProgram"
CUSTOM_CALL_PROGRAM = "xla::ifrt::CustomCallProgram"
CUSTOM_CALL_OPTIONS = "xla::ifrt::CustomCallCompileOptions"
COLOCATED_PYTHON = "jax_colocated_python_v0.0.1"
TYPE_NAMES = (
    *SHARDING_TYPES,
    "xla::ifrt::XlaProgram",
    "xla::ifrt::XlaCompileOptions",
    PLUGIN_PROGRAM,
    CUSTOM_CALL_PROGRAM,
    "xla::ifrt::PluginCompileOptions",
    CUSTOM_CALL_OPTIONS,
    "xla::ifrt::Unknown",
    "",
)
# Places and names persistence requests name: inside the storage root, and attempts to leave it.
PLACES = (
    "gs://fuzz-bucket/ckpt",
    "gs://fuzz-bucket/../../etc",
    "/etc",
    "/",
    "relative",
    "gs://",
    "",
    "gs://x\u00e9/\u4e2d",
)
NAMES = ("w", "params.w", "a/b", "../escape", ".", "", "x" * 300)
# Places a profile may name: inside the storage root, outside it, malformed.
TRACE_LOCATIONS = ("gs://fuzz-bucket/run", "gs://fuzz-bucket/../up", "/etc", "relative", "gs://", "s3://b/p", "")
MEMORY_KINDS = ("device", "pinned_host", "unpinned_host", "hbm", "")
DIMS = (0, 1, 2, 3, 4, 8, 1000, 1 << 31, 1 << 40, (1 << 63) - 1, -1, -(1 << 40))
EDGE_INTS = (0, 1, 2, 3, 7, 255, 1 << 31, (1 << 31) - 1, 1 << 48, (1 << 63) - 1, -1, -(1 << 63))


# -- a relay that records what a real client sends -----------------------------------------------


class _Relay(grpc.GenericRpcHandler):
    """Forwards the IFRT service to ``target`` as raw bytes and keeps what the client sent."""

    _STREAMING = {"IfrtSession": "stream_stream", "HostBufferStore": "stream_unary", "HostBufferLookup": "unary_stream"}

    def __init__(self, target: str):
        self.channel = grpc.insecure_channel(target)
        self.log: list[tuple[str, bytes, dict]] = []  # (method, request bytes, metadata)
        self._lock = threading.Lock()
        self.server = grpc.server(ThreadPoolExecutor(16))
        self.server.add_generic_rpc_handlers((self,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def _record(self, name: str, data: bytes, metadata: dict) -> bytes:
        with self._lock:
            self.log.append((name, data, metadata))
        return data

    def service(self, details):
        method = details.method
        name = method.rsplit("/", 1)[-1]
        kind = self._STREAMING.get(name, "unary_unary")
        upstream = getattr(self.channel, kind)(method)

        def forwarded(context):
            metadata = tuple((m.key, m.value) for m in context.invocation_metadata() if m.key.startswith("ifrt-"))
            return metadata, dict(metadata)

        def recorded(requests, metadata) -> Iterator[bytes]:
            chunks = []  # an upload is recorded once, whole, when it ends
            try:
                for raw in requests:
                    if name == "HostBufferStore":
                        chunks.append(bytes(data_messages.decode(raw)))
                        yield raw
                    else:
                        yield self._record(name, raw, metadata)
            except grpc.RpcError:
                return  # the client went away (it ends its session stream that way)
            if name == "HostBufferStore":
                self._record(name, b"".join(chunks), metadata)

        def relay(request, context):
            metadata, as_dict = forwarded(context)
            try:
                if kind.startswith("stream"):
                    request = recorded(request, as_dict)
                else:
                    self._record(name, request, as_dict)
                reply = upstream(request, metadata=metadata)
                if kind.endswith("stream"):
                    yield from reply
                else:
                    yield reply
            except grpc.RpcError as e:
                context.abort(e.code(), e.details())

        def unary(request, context):
            return next(relay(request, context))

        if kind == "stream_stream":
            return grpc.stream_stream_rpc_method_handler(relay)
        if kind == "unary_stream":
            return grpc.unary_stream_rpc_method_handler(relay)
        if kind == "stream_unary":
            return grpc.stream_unary_rpc_method_handler(unary)
        return grpc.unary_unary_rpc_method_handler(unary)

    def close(self) -> None:
        self.server.stop(None)
        self.channel.close()


CLIENTS = Path(__file__).with_name("clients")
CLIENT = CLIENTS / "fuzz_ordinary_programs.py"
COLOCATED_CLIENT = CLIENTS / "fuzz_colocated_programs.py"


def _run_client(
    address: str, stock: bool, script: Path = CLIENT, token: str | None = None, warm_profilers: bool = False
) -> str:
    """Runs the client ``script`` against ``address``: with JAX's variables only (stock) or via
    ``pathways_nb.connect`` (with the cluster's ``token``, which reading its profiles needs; and, with
    ``warm_profilers``, a trace of every server process afterwards)."""
    if stock:
        env = {"JAX_PLATFORMS": "proxy,cpu", "JAX_BACKEND_TARGET": address}
        env["IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS"] = "true"
        process = testing.python_script(script, env=env)
    else:
        env = {TOKEN_ENV: token} if token else None
        process = testing.python_script(script, address, *(["--warm_profilers"] if warm_profilers else []), env=env)
    out, err = process.communicate(timeout=180)
    assert process.returncode == 0 and "client ok" in out, f"client failed:\n{out}\n{err[-4000:]}"
    return out


@pytest.fixture(scope="module")
def captured(proxy_server) -> list[tuple[str, bytes, dict]]:
    """What a real jax client sends for device_put, jit (with donation), sharding and reads."""
    relay = _Relay(proxy_server.hostport)
    try:
        _run_client(f"grpc://127.0.0.1:{relay.port}", stock=True)
    finally:
        relay.close()
    return relay.log


# -- random requests from the schema ---------------------------------------------------------------


@dataclass
class Handles:
    """Handles the fuzzer has seen, so that requests often name things that exist."""

    arrays: list[int] = field(default_factory=lambda: [1])
    programs: list[int] = field(default_factory=lambda: [1 << 48])
    futures: list[int] = field(default_factory=lambda: [1 << 48])
    host_buffers: list[int] = field(default_factory=lambda: [1])
    devices: list[int] = field(default_factory=lambda: [0])
    # Texts of colocated Python programs a real client sent (cloudpickle): sent intact, never mutated
    # (a mutated pickle is a program of its own, run where colocated Python runs).
    program_texts: list[bytes] = field(default_factory=list)

    def learn(self, response) -> None:
        for name, values in _ints_named(response):
            target = self.for_field(name)
            if target is not None:
                target.extend(v for v in values if v not in target)
                del target[:-64]

    def for_field(self, name: str) -> list[int] | None:
        if "executable_handle" in name:
            return self.programs
        if "future_handle" in name or "status_handle" in name:
            return self.futures
        if "host_buffer_handle" in name:
            return self.host_buffers
        if "device_id" in name:
            return self.devices
        if "handle" in name:
            return self.arrays
        return None


def _ints_named(message) -> Iterator[tuple[str, list[int]]]:
    for descriptor, value in message.ListFields():
        if descriptor.message_type is not None:
            for item in value if descriptor.is_repeated else [value]:
                if hasattr(item, "ListFields"):
                    yield from _ints_named(item)
        elif descriptor.cpp_type in (descriptor.CPPTYPE_INT64, descriptor.CPPTYPE_UINT64, descriptor.CPPTYPE_INT32):
            yield descriptor.name, list(value) if descriptor.is_repeated else [value]


class RequestMaker:
    """Structurally random messages of the IFRT schema, biased towards what handlers must check."""

    def __init__(self, rng: random.Random, handles: Handles):
        self.rng = rng
        self.handles = handles
        self.messages = schema.load()
        self.kinds = [f.name for f in self.messages.proxy.IfrtRequest.DESCRIPTOR.oneofs_by_name["request"].fields]
        self.payloads = {
            shardings.SINGLE_DEVICE: self.messages.ifrt.SingleDeviceShardingProto,
            shardings.HLO: self.messages.ifrt.HloShardingProto,
            shardings.CONCRETE_EVEN: self.messages.ifrt.ConcreteEvenShardingProto,
            shardings.OPAQUE: self.messages.ifrt.OpaqueShardingProto,
            "xla::ifrt::XlaCompileOptions": self.messages.ifrt.XlaCompileOptionsProto,
            CUSTOM_CALL_PROGRAM: self.messages.ifrt.CustomCallProgramProto,
        }

    def request(self, kind: str | None = None):
        request = self.messages.proxy.IfrtRequest()
        kind = kind or self.rng.choice(self.kinds)
        body = getattr(request, kind)
        body.SetInParent()
        self.fill(body, 0)
        if kind == "make_error_arrays_request" and body.error.code == INTERNAL:
            body.error.code = 2  # an error array the fuzzer made must not read as a server bug
        return kind, request

    def fill(self, message, depth: int) -> None:
        rng = self.rng
        fields = message.DESCRIPTOR.fields
        if {"type_name", "data"} <= {f.name for f in fields}:
            self._serialized(message, depth)
            return
        for descriptor in fields:
            if rng.random() < (0.35 if depth < 4 else 0.08):
                continue
            if descriptor.message_type is not None and descriptor.message_type.GetOptions().map_entry:
                continue  # attribute maps and XLA flag overrides: nothing a handler reads
            if descriptor.name == "debug_options":
                continue  # XLA's own ~300 flags: XLA's surface, not the protocol's (mutants still reach them)
            target = getattr(message, descriptor.name)
            if descriptor.message_type is not None:
                if depth > 6:
                    continue
                if descriptor.is_repeated:
                    for _ in range(self.rng.choice((0, 1, 1, 2, 3))):
                        self.fill(target.add(), depth + 1)
                else:
                    target.SetInParent()
                    self.fill(target, depth + 1)
            elif descriptor.is_repeated:
                target.extend(
                    _clip(descriptor, v) if isinstance(v, int) and not isinstance(v, bool) else v
                    for v in self._many(descriptor)
                )
            else:
                setattr(message, descriptor.name, self.scalar(descriptor))

    def _many(self, descriptor) -> list:
        """Mostly a few values; now and then a huge list (device ids, dims, handles) of one or of counted values."""
        rng, name = self.rng, descriptor.name
        if rng.random() < 0.03 and ("device" in name or "dims" in name or "handle" in name):
            count = rng.choice((100, 5000))
            return [self.scalar(descriptor)] * count if rng.random() < 0.5 else list(range(count))
        return [self.scalar(descriptor) for _ in range(rng.choice((0, 1, 1, 1, 2, 2, 3, 4)))]

    def _serialized(self, message, depth: int) -> None:
        """A ``Serialized{type_name, data}``: a known type with a random body of that type, mostly."""
        rng = self.rng
        message.type_name = rng.choice(TYPE_NAMES) if rng.random() < 0.9 else self._text()
        payload = self.payloads.get(message.type_name)
        if message.type_name == PLUGIN_PROGRAM and rng.random() < 0.85:
            data = self.plugin_program() if rng.random() < 0.5 else self.persistence_program()
            message.data = _mutate(rng, data) if rng.random() < 0.15 else data
        elif payload is not None and rng.random() < 0.85:
            body = payload()
            self.fill(body, depth + 1)
            data = body.SerializeToString()
            message.data = _mutate(rng, data) if rng.random() < 0.15 else data
        else:
            message.data = rng.randbytes(rng.choice((0, 1, 8, 64)))

    def persistence_program(self) -> bytes:
        """A plugin program's text: mostly an Orbax persistence request, plausible but for a field or two."""
        rng = self.rng
        key = rng.choice((persistence.WRITE_KEY, persistence.READ_KEY, persistence.WRITE_KEY))
        entries = [self._persistence_entry(key == persistence.READ_KEY) for _ in range(rng.choice((0, 1, 1, 2, 3)))]
        body = {"read_requests" if key == persistence.READ_KEY else "write_requests": entries}
        if rng.random() < 0.1:
            body = rng.choice(([], "x", None, {"write_requests": "x"}, {}))
        return nonxla.PLUGIN_PREFIX + json.dumps({key: body}).encode()

    def _persistence_entry(self, reading: bool) -> dict:
        """One array of a persistence request: well-formed half the time, else with one defect."""
        rng = self.rng

        def b64(text: str) -> str:
            return base64.b64encode(text.encode()).decode()

        devices = rng.sample(self.handles.devices, rng.randint(1, len(self.handles.devices)))
        dims = [rng.choice((1, 2, 4, 8)) * len(devices) for _ in range(rng.randint(0, 3))]
        sharding = ""  # replicated
        if dims and rng.random() < 0.5:  # split along the first dimension, over the devices
            count = len(devices)
            tiling = op_sharding.Tiling(count, (count,) + (1,) * (len(dims) - 1), 1, tuple(range(count)))
            sharding = base64.b64encode(tiling.to_proto().SerializeToString()).decode()
        entry = {
            "b64_location": b64(PLACES[0]),
            "b64_name": b64("w"),
            "b64_hlo_sharding_string": sharding,
            "shape": {"xla_primitive_type_str": rng.choice(("F32", "BF16", "S32")), "dimensions": dims}
            if reading
            else dims,
            "devices": {"device_ids": devices},
            "timeout": rng.choice(({"seconds": 5, "nanos": 0}, "5s")),
        }
        defect = rng.randrange(16)
        if defect == 0:
            entry["b64_location"] = b64(rng.choice(PLACES[1:])) if rng.random() < 0.9 else "%%"
        elif defect == 1:
            entry["b64_name"] = b64(rng.choice(NAMES[1:]))
        elif defect == 2:
            entry["b64_hlo_sharding_string"] = rng.choice(("!", b64("x"), base64.b64encode(rng.randbytes(24)).decode()))
        elif defect == 3:
            dims[:] = [rng.choice(DIMS) for _ in range(rng.randint(1, 3))]
        elif defect == 4:
            entry["devices"]["device_ids"] = [rng.choice(EDGE_INTS) for _ in range(rng.randint(0, 3))]
        elif defect == 5:
            entry["timeout"] = rng.choice(("0.001s", "x", {"seconds": -1}, 10**30, None, {"seconds": 10**18}))
        elif defect == 6:
            del entry[rng.choice(sorted(entry))]
        elif defect == 7:
            entry[rng.choice(sorted(entry))] = rng.choice(([], {}, 3, "x", None, [[1]]))
        elif defect == 8 and reading:
            entry["shape"]["xla_primitive_type_str"] = rng.choice(("TOKEN", "", "f32", 11))
        return entry

    def scalar(self, descriptor):
        rng, name, kind = self.rng, descriptor.name, descriptor.cpp_type
        if kind == descriptor.CPPTYPE_BOOL:
            return rng.random() < 0.5
        if kind == descriptor.CPPTYPE_STRING:
            if name == "serialized_program_text" and self.handles.program_texts and rng.random() < 0.5:
                return rng.choice(self.handles.program_texts)
            if descriptor.type == descriptor.TYPE_BYTES:
                return rng.randbytes(rng.choice((0, 1, 16, 200)))
            if name == "type" and descriptor.containing_type.name == "CustomCallProgramProto":
                return COLOCATED_PYTHON if rng.random() < 0.85 else self._text()
            if name == "memory_kind":
                return rng.choice(MEMORY_KINDS)
            if name == "type_name":
                return rng.choice(TYPE_NAMES)
            return self._text()
        if kind in (descriptor.CPPTYPE_FLOAT, descriptor.CPPTYPE_DOUBLE):
            return rng.choice((0.0, 1.0, -1.0, 1e300, float("inf"), float("nan")))
        if kind == descriptor.CPPTYPE_ENUM:
            values = [v.number for v in descriptor.enum_type.values]
            return rng.choice(values) if rng.random() < 0.9 else rng.choice((-1, 1000))
        pool = self.handles.for_field(name)
        if name == "dims":
            value = rng.choice(DIMS) if rng.random() < 0.3 else rng.randint(0, 6)
        elif name == "kind" and descriptor.containing_type.name == "DTypeProto":
            value = rng.randint(0, 34)
        elif pool is not None and rng.random() < 0.75:
            value = rng.choice(pool)
        else:
            value = rng.choice(EDGE_INTS) if rng.random() < 0.5 else rng.randint(0, 10)
        return _clip(descriptor, value)

    def _text(self) -> str:
        return "".join(self.rng.choice("abc:_ \u00e9\u4e2d0") for _ in range(self.rng.randint(0, 12)))

    def plugin_program(self) -> bytes:
        """A plugin program's text: a profileRequest (well-formed or not), another key, or no JSON at all.

        The traces it may start end by themselves within a second (``maxDurationSecs``), so none
        outlives the run.
        """
        rng = self.rng
        choice = rng.random()
        if choice < 0.1:
            return rng.randbytes(rng.choice((0, 8, 64)))
        if choice < 0.2:
            return b"__serialized_plugin_program " + rng.randbytes(rng.choice((0, 1, 32)))
        request = {
            "traceLocation": rng.choice(TRACE_LOCATIONS),
            "maxNumHosts": rng.choice((0, 1, 2, -1, "1", 1 << 40)),
            "includeResourceManagers": rng.choice((True, False, "yes")),
            "maxDurationSecs": rng.choice((0.2, 1, -1, 1e300, "1")),
        }
        if rng.random() < 0.6:
            request["xprofTraceOptions"] = {
                "traceSessionName": rng.choice(("s", "", "../x", "a/b", self._text())),
                "hostTraceLevel": rng.choice((0, 1, 2, 3, 7, -1)),
                "pwTraceOptions": rng.choice(({}, {"enablePythonTracer": rng.random() < 0.5}, [], None)),
            }
        if rng.random() < 0.3:
            request["devices"] = {"deviceIds": [rng.choice([*self.handles.devices, 99, -1]) for _ in range(2)]}
        for key in [k for k in request if rng.random() < 0.1]:
            del request[key]
        request.setdefault("maxDurationSecs", 1)
        key = "profileRequest" if rng.random() < 0.85 else rng.choice(("bulk_persistence_write_request", self._text()))
        body = request if rng.random() < 0.9 else rng.choice(([], 1, None, "x"))
        return b"__serialized_plugin_program " + json.dumps({key: body}).encode()


def _clip(descriptor, value: int) -> int:
    bits = 32 if descriptor.cpp_type in (descriptor.CPPTYPE_INT32, descriptor.CPPTYPE_UINT32) else 64
    if descriptor.cpp_type in (descriptor.CPPTYPE_UINT32, descriptor.CPPTYPE_UINT64):
        return value % (1 << bits)
    return (value + (1 << (bits - 1))) % (1 << bits) - (1 << (bits - 1))


def _mutate(rng: random.Random, data: bytes) -> bytes:
    """One to four byte-level edits: flips, overwrites, deletions, duplications, insertions, huge varints."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        at = rng.randrange(len(out) + 1)
        if op == 0 and out:
            out[at % len(out)] ^= 1 << rng.randrange(8)
        elif op == 1 and out:
            out[at % len(out)] = rng.randrange(256)
        elif op == 2:
            del out[at : at + rng.randint(1, 8)]
        elif op == 3:
            out[at:at] = out[at : at + rng.randint(1, 16)]
        elif op == 4:
            out[at:at] = rng.randbytes(rng.randint(1, 8))
        else:
            out[at:at] = b"\xff" * 9 + b"\x01"
    return bytes(out)


def _mutate_program(rng: random.Random, program: bytes, other: bytes) -> bytes:
    """A StableHLO artifact corrupted as storage and networks corrupt: bit flips, a truncation, or a splice."""
    choice = rng.randrange(4)
    if choice == 0 and program:
        flipped = bytearray(program)
        for _ in range(rng.randint(1, 3)):
            flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        return bytes(flipped)
    if choice == 1:
        return program[: rng.randrange(len(program) + 1)]
    if choice == 2:  # the head of one module, the tail of another
        return program[: rng.randrange(len(program) + 1)] + other[rng.randrange(len(other) + 1) :]
    return program


# -- the fuzzing session ---------------------------------------------------------------------------


@dataclass
class Findings:
    sent: int = 0
    replies: int = 0
    host_calls: int = 0
    unparsable_mutants: int = 0
    bugs: list[str] = field(default_factory=list)
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=8))
    by_code: dict[int, int] = field(default_factory=dict)

    def bug(self, text: str) -> None:
        if len(self.bugs) < 200:
            self.bugs.append(text)


class FuzzSession:
    """One IFRT session fed random requests; a reader thread checks every reply."""

    WINDOW = 256  # requests in flight before the sender waits a little for replies

    def __init__(self, address: str, rng: random.Random, findings: Findings, corpus: list):
        self.wire = WireSession(address)
        self.rng = rng
        self.findings = findings
        self.corpus = corpus
        self.handles = Handles()
        self.handles.devices = list(self.wire.init_response.addressable_device_ids) or [0]
        self.handles.program_texts = _program_texts(self.wire.messages, corpus)
        self.maker = RequestMaker(rng, self.handles)
        self.sent: dict[int, str] = {}
        self.lock = threading.Lock()
        self.answered = threading.Condition(self.lock)
        self.op_ids = iter(range(1 << 20, 1 << 40))
        self.stream_error: grpc.RpcError | None = None
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        try:
            while True:
                self._check(self.wire.receive())
        except StopIteration:
            pass
        except grpc.RpcError as e:
            self.stream_error = e
        with self.answered:
            self.answered.notify_all()

    def _check(self, response) -> None:
        op_id = response.response_metadata.op_id
        with self.answered:
            kind = self.sent.pop(op_id, None)
            self.answered.notify_all()
        findings = self.findings
        findings.replies += 1
        status = response.response_metadata.status
        findings.by_code[status.code] = findings.by_code.get(status.code, 0) + 1
        if kind is None:
            findings.bug(f"a reply to op {op_id}, which was not sent (or answered twice)")
        elif status.code == INTERNAL:
            findings.bug(f"{kind}: INTERNAL: {status.message[:300]}")
        elif not 0 <= status.code <= 16:
            findings.bug(f"{kind}: status code {status.code} is not a gRPC code")
        elif status.code == 0:
            expected = kind.removesuffix("_request") + "_response"
            if response.WhichOneof("response") != expected:
                findings.bug(f"{kind}: an OK reply carries {response.WhichOneof('response')}, not {expected}")
            self.handles.learn(response)

    def send(self, kind: str, request, wait_s: float = 0.0) -> None:
        """Sends ``request``; with ``wait_s``, waits that long at most for its reply."""
        op_id = next(self.op_ids)
        request.request_metadata.op_id = op_id
        with self.answered:
            self.answered.wait_for(lambda: len(self.sent) < self.WINDOW or self.stream_error, timeout=0.5)
            self.sent[op_id] = kind
        self.wire.send_raw(request.SerializeToString())
        self.findings.sent += 1
        self.findings.recent.append(str(request).replace("\n", " ")[:1500])
        if wait_s:
            with self.answered:
                self.answered.wait_for(lambda: op_id not in self.sent or self.stream_error, timeout=wait_s)

    def replay(self) -> None:
        """The captured client's requests and uploads, unchanged: they make real arrays and programs."""
        for method, data, metadata in self.corpus:
            if method == "IfrtSession":
                request = self.wire.messages.proxy.IfrtRequest.FromString(data)
                kind = request.WhichOneof("request")
                if kind != "init_request":
                    # The client waited for its programs before using their handles.
                    self.send(kind, request, wait_s=30.0 if kind == "compile_request" else 0.0)
            elif method == "HostBufferStore":
                self._store(_store_handle(self.wire, metadata), data)

    def step(self) -> None:
        r = self.rng.random()
        if r < 0.04:
            self._plugin_program()
        elif r < 0.62:
            self.send(*self.maker.request())
        elif r < 0.96:
            self._mutant()
        else:
            self._host_buffer_call()

    def _mutant(self) -> None:
        requests = [data for method, data, _ in self.corpus if method == "IfrtSession"]
        original = self.rng.choice(requests)
        parse = self.wire.messages.proxy.IfrtRequest.FromString
        try:
            request = parse(_mutate(self.rng, original))
        except Exception:  # noqa: BLE001 - protobuf decode errors: the server would end the stream
            self.findings.unparsable_mutants += 1
            return
        kind = request.WhichOneof("request")
        if kind is None or kind == "init_request":
            return
        if kind == "compile_request" and parse(original).WhichOneof("request") == kind:
            # The request's fields are mutated above; its program, a real StableHLO artifact, is
            # mutated as a program: XLA's bytecode reader aborts on some near-valid corruptions,
            # which servers must read in a child process first (``worker.program_check``).
            programs = [parse(data).compile_request.program.data for data in requests if b"StableHLO" in data]
            request.compile_request.program.data = _mutate_program(
                self.rng, parse(original).compile_request.program.data, self.rng.choice(programs)
            )
        self.send(kind, request)

    def _plugin_program(self) -> None:
        """A plugin program compiled, then executed now and then (random executes reach it too)."""
        request = self.wire.messages.proxy.IfrtRequest()
        compile_request = request.compile_request
        compile_request.program.type_name = PLUGIN_PROGRAM
        compile_request.program.data = self.maker.plugin_program()
        compile_request.compile_options.type_name = "xla::ifrt::PluginCompileOptions"
        self.send("compile_request", request)  # planned at once: no need to wait as for XLA compiles
        for _ in range(self.rng.choice((0, 1, 2))):
            kind, execute = self.maker.request("loaded_executable_execute_request")
            self.send(kind, execute)

    def _host_buffer_call(self) -> None:
        rng = self.rng
        handle = rng.choice(self.handles.host_buffers) if rng.random() < 0.6 else rng.choice(EDGE_INTS)
        handle = _clip(self.wire.messages.proxy.GrpcHostBufferStoreMetadata.DESCRIPTOR.fields_by_name["handle"], handle)
        choice = rng.randrange(5)
        self.findings.host_calls += 1
        try:
            if choice == 4:
                self._read_from_disk(handle)
            elif choice == 3:
                self._odd_store()
            elif choice == 0:
                size = rng.choice((0, 1, 24, 4096, 3 * MIB))
                declared = size if rng.random() < 0.6 else rng.choice((0, size + 1, max(size - 1, 0), 1 << 33, 1 << 62))
                self._store(handle, rng.randbytes(size), declared)
            elif choice == 1:
                self.wire.lookup_host_buffer(handle)
            else:
                self.wire.delete_host_buffer(handle)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
                self.findings.bug(
                    f"host buffer call {('store', 'lookup', 'delete', 'odd store', 'read from disk')[choice]}: "
                    f"{e.code().name}: {e.details()}"
                )

    def _odd_store(self) -> None:
        """A ``HostBufferStore`` with odd metadata (missing, malformed, another session) or odd chunks."""
        rng, proxy = self.rng, self.wire.messages.proxy
        metadata = proxy.GrpcHostBufferStoreMetadata(
            session_id=rng.choice((self.wire.session_id, 0, 10**6, (1 << 64) - 1)),
            handle=rng.randrange(1 << 40),
            buffer_size=rng.choice((0, 8, 1 << 20, -5)),
        ).SerializeToString()
        headers = rng.choice(
            ((), ((testing.STORE_METADATA_KEY, metadata),), ((testing.STORE_METADATA_KEY, _mutate(rng, metadata)),))
        )
        chunks = [rng.choice((b"", b"\x0a\x08" + rng.randbytes(8), rng.randbytes(rng.randint(1, 20))))]
        store = self.wire.channel.stream_unary(SERVICE_STORE, request_serializer=None, response_deserializer=None)
        store(iter(chunks * rng.randint(0, 3)), metadata=headers)

    def _read_from_disk(self, handle: int) -> None:
        """A ``HostBufferReadFromDisk`` (this session named no shared directory): OK, NOT_FOUND for another."""
        rng, proxy = self.rng, self.wire.messages.proxy
        request = proxy.GrpcHostBufferReadFromDiskRequest()
        request.metadata.session_id = rng.choice((self.wire.session_id, self.wire.session_id, 10**6))
        request.metadata.handle, request.metadata.buffer_size = handle, rng.choice((0, 8, 1 << 20, -5, 1 << 62))
        read = self.wire.channel.unary_unary(
            testing.SERVICE + "HostBufferReadFromDisk",
            request_serializer=proxy.GrpcHostBufferReadFromDiskRequest.SerializeToString,
            response_deserializer=proxy.GrpcHostBufferReadFromDiskResponse.FromString,
        )
        try:
            read(request, timeout=30)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND or request.metadata.session_id == self.wire.session_id:
                self.findings.bug(f"HostBufferReadFromDisk: {e.code().name}: {e.details()}")
        self.handles.host_buffers.append(handle)

    def _store(self, handle: int, data: bytes, declared: int | None = None) -> None:
        try:
            self.wire.store_host_buffer(handle, data, declared)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
                self.findings.bug(f"HostBufferStore: {e.code().name}: {e.details()}")
        self.handles.host_buffers.append(handle)
        del self.handles.host_buffers[:-64]

    def close(self, drain_s: float = 2.0) -> None:
        """Waits briefly for outstanding replies (some wait for uploads that never come), then ends."""
        with self.answered:
            self.answered.wait_for(lambda: not self.sent or self.stream_error, timeout=drain_s)
        if self.stream_error is not None:
            self.findings.bug(
                f"the server ended the stream: {self.stream_error.code().name}: {self.stream_error.details()}"
            )
        self.wire.close()
        self.reader.join(5)


def _program_texts(messages, corpus: list) -> list[bytes]:
    """The texts of the custom-call programs (colocated Python) in the captured requests."""
    texts = []
    for method, data, _ in corpus:
        if method != "IfrtSession":
            continue
        request = messages.proxy.IfrtRequest.FromString(data)
        program = request.compile_request.program
        if request.WhichOneof("request") == "compile_request" and program.type_name == CUSTOM_CALL_PROGRAM:
            texts.append(messages.ifrt.CustomCallProgramProto.FromString(program.data).serialized_program_text)
    return texts


def _store_handle(wire: WireSession, metadata: dict) -> int:
    raw = metadata.get(testing.STORE_METADATA_KEY, b"")
    return wire.messages.proxy.GrpcHostBufferStoreMetadata.FromString(raw).handle


def _fuzz(address: str, corpus: list, seconds: float, seed: int, dead: Callable[[], list[str]]) -> Findings:
    """Fuzzes sessions one after another for ``seconds`` and at least ``REQUESTS`` requests (within
    ``seconds + CAP_S``: a loaded machine sends fewer a second, the run does the same work); stops early
    if a server process died."""
    rng = random.Random(seed)
    findings = Findings()
    started = time.monotonic()

    def more() -> bool:
        elapsed = time.monotonic() - started
        return (elapsed < seconds or findings.sent < REQUESTS) and elapsed < seconds + CAP_S

    while more() and not dead():
        try:
            session = FuzzSession(address, rng, findings, corpus)
        except grpc.RpcError:
            if dead():
                break
            raise
        try:
            session.replay()
            for _ in range(1500):
                if not more() or session.stream_error is not None:
                    break
                session.step()
        finally:
            session.close()
    return findings


def _rss(processes: list[psutil.Process]) -> list[int]:
    return [p.memory_info().rss for p in processes]


def _fuzz_and_check(
    name: str,
    processes: list,
    alive: Callable[[], list[str]],
    address: str,
    corpus,
    seconds: float,
    token: str | None = None,
    loop_stats: Callable[[], list] | None = None,
) -> None:
    """Fuzzes the server at ``address``; then no process died, no finding, memory back, and (``loop_stats``:
    its servers' watchdog counts) no loop ran one callback for more than 0.5 s meanwhile."""
    pids = [psutil.Process(p.process.pid) for p in processes]
    earlier = testing.open_sessions(address, token)  # (this process's own, if a test before connected it)
    # Warm: what a first client loads stays loaded, the profilers that the fuzzer's traces start too.
    _run_client(address, stock=False, token=token, warm_profilers=True)
    testing.wait_until_sessions_end(address, token, besides=earlier)
    before = _rss(pids)
    started, started_at = time.monotonic(), time.time()
    findings = _fuzz(address, corpus, seconds, SEED, alive)
    elapsed = time.monotonic() - started
    dead = alive()
    recent = "\n".join(findings.recent)
    assert not dead, f"{name}: server processes died while fuzzing: {dead}\nthe last requests sent:\n{recent}"
    _run_client(address, stock=False)
    testing.wait_until_sessions_end(address, token, besides=earlier)  # the fuzzer's and clients' arrays are gone
    after = _rss(pids)
    summary = (
        f"{name}: {findings.sent} requests + {findings.host_calls} host-buffer calls in {elapsed:.1f} s, "
        f"{findings.replies} replies by code {dict(sorted(findings.by_code.items()))}, "
        f"{findings.unparsable_mutants} unparsable mutants skipped; RSS MiB before/after "
        f"{[b >> 20 for b in before]} / {[a >> 20 for a in after]}"
    )
    print(summary)
    assert findings.sent >= REQUESTS, summary
    assert not findings.bugs, summary + "\nfirst findings:\n" + "\n".join(findings.bugs[:15])
    for process, b, a in zip(processes, before, after, strict=True):
        assert a - b < RSS_SLACK, f"{process.name} grew by {(a - b) >> 20} MiB: {summary}"
    stalled = testing.long_callback_stalls(loop_stats(), since=started_at) if loop_stats else {}
    assert not stalled, f"{name}: loops that ran a callback for more than 0.5 s while fuzzed: {stalled}"


def test_fuzz_single_process_proxy(proxy_server, captured):
    _fuzz_and_check(
        "proxy",
        [proxy_server],
        lambda: [] if proxy_server.alive() else [f"proxy: {proxy_server.log_tail()}"],
        proxy_server.address,
        captured,
        SECONDS,
        loop_stats=lambda: [local_cluster.loop_stats(proxy_server.hostport, ClusterCredentials())],
    )


def _deaths(cluster: LocalCluster) -> Callable[[], list[str]]:
    """What of ``cluster`` died from now on: a process down, or one the supervisor replaced (alive again)."""
    exits = len(cluster.exits)

    def dead() -> list[str]:
        replaced = [f"{e.name}: {e.description}" for e in cluster.exits[exits:]]
        return replaced + [f"{p.name}: {p.log_tail()}" for p in cluster.processes() if not p.alive()]

    return dead


def test_fuzz_cluster(cluster, captured):
    _fuzz_and_check(
        "cluster",
        cluster.processes(),
        _deaths(cluster),
        cluster.address,
        captured,
        SECONDS,
        cluster.token,
        loop_stats=cluster.loop_stats,
    )


def test_fuzz_colocated_python_cluster(captured):
    """Custom-call programs reach the executors: real ones (replayed), random ones, with random arguments."""
    with LocalCluster(
        islands=2, devices_per_host=2, colocated_python=True, colocated_python_executable=testing.other_users_python()
    ) as cluster:
        relay = _Relay(cluster.proxy.hostport)
        try:
            _run_client(f"grpc://127.0.0.1:{relay.port}", stock=True, script=COLOCATED_CLIENT)
        finally:
            relay.close()

        corpus = captured + relay.log
        _fuzz_and_check(
            "colocated",
            cluster.processes(),
            _deaths(cluster),
            cluster.address,
            corpus,
            SECONDS,
            cluster.token,
            loop_stats=cluster.loop_stats,
        )
        _run_client(cluster.address, stock=False, script=COLOCATED_CLIENT)


# -- what the fuzzer found, pinned ------------------------------------------------------------------


@pytest.fixture
def wire(proxy_server):
    with WireSession(proxy_server.address) as session:
        yield session


def _status(response) -> tuple[int, str]:
    return response.response_metadata.status.code, response.response_metadata.status.message


def test_requests_on_a_failed_handle_get_its_own_error(wire):
    """A handle whose request failed has no sharding: using it must raise that failure, not crash."""
    proxy = wire.messages.proxy
    bad = proxy.LoadedExecutableExecuteRequest(loaded_executable_handle=4242, result_array_handle=[7])
    assert _status(wire.call("loaded_executable_execute_request", bad))[0] == grpc.StatusCode.NOT_FOUND.value[0]
    for kind, body in (
        (
            "disassemble_into_single_device_arrays_request",
            proxy.DisassembleIntoSingleDeviceArraysRequest(array_handle=7),
        ),
        ("fully_replicated_shard_request", proxy.FullyReplicatedShardRequest(array_handle=7, result_handle=8)),
        ("copy_arrays_request", proxy.CopyArraysRequest(array_handles=[7], device_ids=[1], result_handles=[9])),
    ):
        code, message = _status(wire.call(kind, body))
        assert code == grpc.StatusCode.NOT_FOUND.value[0] and "4242" in message, (kind, code, message)


def test_a_remap_plan_that_does_not_fit_is_invalid(wire):
    proxy = wire.messages.proxy
    value = b"\x00" * 24
    wire.store_host_buffer(1, value)
    make = proxy.MakeArrayFromHostBufferRequest(host_buffer_handle=1, array_handle=1)
    make.dtype.kind = 11  # f32
    make.shape.dims.extend([2, 3])
    make.sharding.CopyFrom(shardings.IfrtSharding((0,)).to_proto())
    assert _status(wire.call("make_array_from_host_buffer_request", make)) == (0, "")
    remap = proxy.RemapArraysRequest(array_handles=[1], result_handles=[2])
    spec = remap.plan.input_specs.add()
    spec.CopyFrom(remap.plan.output_specs.add())
    for spec in (remap.plan.input_specs[0], remap.plan.output_specs[0]):
        spec.dtype.kind = 11
        spec.shape.dims.extend([2, 3])
        spec.sharding.CopyFrom(shardings.IfrtSharding((0,)).to_proto())
    mapping = remap.plan.mappings.add(in_array=0, out_array=0)
    mapping.from_start.extend([0, 1])  # two "from" intervals, one "to"
    mapping.from_end.extend([1, 2])
    mapping.from_step.extend([1, 1])
    mapping.to_start.append(0)
    mapping.to_end.append(1)
    mapping.to_step.append(1)
    code, message = _status(wire.call("remap_arrays_request", remap))
    assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "differ in length" in message


def test_a_layout_for_a_shape_too_large_to_count_is_invalid(wire):
    request = wire.messages.proxy.GetDefaultLayoutRequest(dims=[1 << 40, 1 << 40], device_id=0)
    request.dtype.kind = 11
    code, message = _status(wire.call("get_default_layout_request", request))
    assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "64-bit" in message


def _compile_with(wire, captured, change):
    """A captured client's compile request, its compile options changed by ``change``, sent: the reply."""
    proxy, ifrt = wire.messages.proxy, wire.messages.ifrt
    compile_request = next(
        request.compile_request
        for method, data, _ in captured
        if method == "IfrtSession"
        and (request := proxy.IfrtRequest.FromString(data)).WhichOneof("request") == "compile_request"
    )
    options = ifrt.XlaCompileOptionsProto.FromString(compile_request.compile_options.data)
    change(options.compile_options.executable_build_options)
    compile_request.compile_options.data = options.SerializeToString()
    return wire.call("compile_request", compile_request)


def test_compile_options_that_abort_xla_are_refused(wire, captured):
    """Auto-sharding made XLA abort ("auto-partitioner callback wasn't registered"); it is refused."""
    code, message = _status(
        _compile_with(wire, captured, lambda build: setattr(build, "use_auto_spmd_partitioning", True))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "use_auto_spmd_partitioning" in message

    def both_pass_filters(build):
        build.debug_options.xla_disable_hlo_passes.append("algsimp")
        build.debug_options.xla_enable_hlo_passes_only.append("dce")

    code, message = _status(_compile_with(wire, captured, both_pass_filters))
    assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "xla_enable_hlo_passes_only" in message


def test_xla_s_crash_on_purpose_options_are_dropped_and_the_program_compiles(wire, captured):
    """Under xla_unsupported_crash_on_hlo_pass_noop_change the CPU compiler's layout assignment aborted the
    worker (the fuzzer flipped a byte into it); the server drops such options and compiles."""

    def crash_on_noop_change(build):
        build.debug_options.xla_unsupported_crash_on_hlo_pass_noop_change = True

    reply = _compile_with(wire, captured, crash_on_noop_change)
    assert reply.WhichOneof("response") == "compile_response", reply


def test_a_program_whose_names_are_not_utf8_is_invalid_not_a_server_error(wire):
    """A byte flipped into a name of the program: XLA compiled it, and reading the compiled module back
    (for its donated parameters) failed as INTERNAL ("String field had bad UTF-8")."""

    def marker_fn_zz(x):
        return x * 2

    artifact, options = testing.lowered_program(marker_fn_zz, np.zeros(3, np.float32), [0])
    assert b"marker_fn_zz" in artifact
    code, message = _status(wire.compile((artifact.replace(b"marker_fn_zz", b"marker_fn\xff\xfe\xfd"), options)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "UTF-8" in message, message
    assert wire.compile((artifact, options)).WhichOneof("response") == "compile_response"


def test_init_sent_again_answers_the_same_devices_without_a_second_allocation(cluster):
    before = len(cluster.state().allocations)
    with WireSession(cluster.address) as session:
        again = session.call("init_request", session.messages.proxy.InitRequest()).init_response
        assert list(again.addressable_device_ids) == list(session.init_response.addressable_device_ids)
        assert len(cluster.state().allocations) == before + 1


def test_overlapping_byte_strides_cannot_turn_a_few_bytes_into_a_huge_array(proxy_server, wire):
    """Zero strides once made 4 uploaded bytes a 1 GiB array (the fuzzer saw the proxy grow by 3 GiB)."""
    before = psutil.Process(proxy_server.process.pid).memory_info().rss
    wire.store_host_buffer(1, b"\x00" * 4)
    make = wire.messages.proxy.MakeArrayFromHostBufferRequest(host_buffer_handle=1, array_handle=1)
    make.dtype.kind = 11  # f32
    make.shape.dims.append(1 << 28)
    make.byte_strides.strides.append(0)
    make.sharding.CopyFrom(shardings.IfrtSharding((0,)).to_proto())
    wire.call("make_array_from_host_buffer_request", make)
    ready = wire.call("check_value_ready_request", wire.messages.proxy.CheckValueReadyRequest(value_handles=[1]))
    code, message = _status(ready)
    assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "not overlap" in message, message
    assert psutil.Process(proxy_server.process.pid).memory_info().rss - before < 64 * MIB
