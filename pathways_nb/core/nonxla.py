"""Programs that are not XLA: plugin programs and custom-call programs, one mechanism for all of them.

Pathways serves more than StableHLO through the same Compile/Execute requests
(docs/design.md, "Programs that are not XLA"):

- **plugin programs** (``xla::ifrt::PluginProgram``): the text ``"__serialized_plugin_program " + JSON``,
  whose one top-level key says what it is (``profileRequest``, ``bulk_persistence_write_request``, ...);
- **custom-call programs** (``xla::ifrt::CustomCallProgram``): a ``CustomCallProgramProto`` whose
  ``type`` says what it is (``jax_colocated_python_v0.0.1``).

Each (kind, key) has two halves, one for each side:

- the proxy half (``ProxyHalf.plan(body, session) -> ProgramPlan``): checks the request against the
  session (paths, sizes, devices it holds) and says where it runs and what it returns. Its output
  specs are the same on every execution (the stock client caches the first Execute's). It does no
  device work;
- the host half (``HostHalf.run(request, runtime, args, device_ids, results, context) -> values``):
  what one host (a worker, or the single-process proxy) does with its local arrays. It blocks on a
  pool thread, never on a stream's loop, and raises ``RequestError`` subclasses with clear messages.

This module holds what both sides share: the request parsing, the plan and its executions, and the
registry's type (``ProgramHalves``). Each side builds its own registry from an explicit list of its
halves (its ``program_kinds`` module); this module names none of them.
Anything a client sends that no half serves is refused with INVALID_ARGUMENT, and for plugin
programs the text says "Bad PluginProgram" (what pathwaysutils looks for) and lists the keys served.
"""

from __future__ import annotations

import abc
import dataclasses
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from pathways_nb.core import tuning
from pathways_nb.core.storage import StorageRoot
from pathways_nb.protocol import schema
from pathways_nb.protocol.errors import InvalidRequest, RequestError, Unimplemented
from pathways_nb.protocol.shardings import IfrtSharding

PLUGIN = "plugin"
CUSTOM_CALL = "custom_call"

# IFRT program type names (``request.program.type_name`` of a compile) -> our kinds.
PROGRAM_TYPES = {"xla::ifrt::PluginProgram": PLUGIN, "xla::ifrt::CustomCallProgram": CUSTOM_CALL}
PLUGIN_PREFIX = b"__serialized_plugin_program "


@dataclass(frozen=True)
class ParsedProgram:
    """A compile request's program, read: its kind, its key, and the body that kind's halves read."""

    kind: str
    key: str
    body: Any  # plugin: the JSON value under the key; custom call: the CustomCallProgramProto
    text: bytes  # the program as the client sent it


@dataclass(frozen=True)
class OutputSpec:
    """One result of a program: IFRT dtype kind, global shape, sharding (in the session's device ids)."""

    kind: int
    shape: tuple[int, ...]
    sharding: IfrtSharding


@dataclass(frozen=True)
class ResultSpec:
    """One result a host makes: dtype kind, shape, and sharding in that host's own device ids."""

    kind: int
    shape: tuple[int, ...]
    sharding: IfrtSharding


@dataclass(frozen=True)
class Execution:
    """One execution of a planned program, as the proxy starts it.

    ``request``: what each host's half gets. ``on_proxy``: blocking work of the proxy's own, run off
    its event loop before the hosts' (e.g. tracing the proxy itself). ``undo``: a request that
    undoes the execution where it succeeded, sent to every host if it failed on one (errors ignored).
    ``finished(error)``: called once every host (and ``on_proxy``) is done, ``error`` None on success.
    """

    request: bytes
    on_proxy: Callable[[], None] | None = None
    undo: bytes | None = None
    finished: Callable[[RequestError | None], None] | None = None


@dataclass(eq=False)
class ProgramPlan:
    """What the proxy half decided at compile time; the same for every execution.

    ``device_ids``: the executable's addressable devices (what the client sees; never empty).
    ``host_device_ids``: devices whose hosts run the host half (default: ``device_ids``); each
    host gets its own of them, in its local ids. ``num_args``: arguments each execution takes
    (each with as many shards as ``device_ids``).
    """

    kind: str
    key: str
    name: str
    device_ids: tuple[int, ...]
    outputs: tuple[OutputSpec, ...]
    request: bytes
    num_args: int = 0
    host_device_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.device_ids:
            raise InvalidRequest(f"{self.name} names no device to run on")
        if not self.host_device_ids:
            self.host_device_ids = self.device_ids

    def execution(self) -> Execution:
        """The next execution (called once per Execute, in the session's order, on the proxy's loop)."""
        return Execution(self.request)


@dataclass(frozen=True)
class SessionHost:
    """One host of a session's devices: its island, its index there, the session's devices on it."""

    island: int
    host_index: int
    device_ids: tuple[int, ...]
    # The session's colocated CPU devices on this host (a cluster with colocated Python).
    colocated_device_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class SessionView:
    """What a proxy half may know of the session that compiles a program."""

    session_id: int
    tenant: str
    device_ids: tuple[int, ...]
    hosts: tuple[SessionHost, ...]
    # Whether the proxy itself is the only host (the single-process server): no separate proxy part.
    proxy_is_host: bool
    # The session's ``runtime_api.DeviceSession``, for kinds that use the proxy's own services.
    runtime: Any = None
    # The CPU devices beside ``device_ids`` for colocated Python (empty: the cluster runs none).
    colocated_device_ids: tuple[int, ...] = ()
    # What the client said of its versions ({"python": ..., "jax": ..., "cloudpickle": ...}, those sent).
    client_versions: dict[str, str] = field(default_factory=dict)

    @property
    def default_device_id(self) -> int:
        """Where results go when a request names no devices (the client's default device is the first)."""
        return self.device_ids[0]

    def check_devices(self, device_ids: Sequence[int], what: str) -> tuple[int, ...]:
        """``device_ids`` if the session holds each (and none twice), else a clear error."""
        ids = tuple(int(d) for d in device_ids)
        unknown = [d for d in ids if d not in self.device_ids]
        if unknown:
            raise InvalidRequest(
                f"{what} names devices {unknown}, which this session does not hold ({list(self.device_ids)})"
            )
        if len(set(ids)) != len(ids):
            raise InvalidRequest(f"{what} names a device twice: {list(ids)}")
        return ids


@dataclass(frozen=True)
class HostContext:
    """Where a host half runs: the process's storage root and its place in the cluster."""

    storage: StorageRoot
    island: int = 0
    host_index: int = 0
    # How files this host writes are named (``island0-host0``; ``proxy``, ``resource-manager``).
    name: str = "island0-host0"
    tenant: str = ""
    # The worker's key of the session the program runs for ("" where there is none).
    session: str = ""
    # This host's colocated Python (the worker's ``ColocatedPython``; None: the cluster runs none).
    colocated: Any = None
    # Where what the program's user code writes goes (the worker's ``LineSink``; None: nowhere), and
    # the client's output context of the call, which tags it (``pathways_nb.v1.OutputLine.context``).
    output: Any = None
    output_context: str = ""
    # This host's colocated CPU devices, local id -> the id the session knows each by (empty: the cluster's).
    session_device_ids: dict[int, int] = dataclasses.field(default_factory=dict)

    def for_tenant(
        self,
        tenant: str,
        session: str = "",
        output: Any = None,
        output_context: str = "",
        session_device_ids: dict[int, int] | None = None,
    ) -> HostContext:
        return dataclasses.replace(
            self,
            tenant=tenant,
            session=session,
            output=output,
            output_context=output_context,
            session_device_ids=session_device_ids or {},
        )


class ProxyHalf(abc.ABC):
    """The proxy half of one kind of non-XLA program; subclasses set ``kind`` and ``key`` and implement ``plan``."""

    kind: ClassVar[str] = PLUGIN
    key: ClassVar[str] = ""

    @abc.abstractmethod
    def plan(self, body: Any, session: SessionView) -> ProgramPlan:
        """Checks the request and says where it runs and what it returns (on the proxy's compile pool)."""


class HostHalf(abc.ABC):
    """The host half of one kind of non-XLA program; subclasses set ``kind`` and ``key`` and implement ``run``."""

    kind: ClassVar[str] = PLUGIN
    key: ClassVar[str] = ""

    @abc.abstractmethod
    def run(
        self,
        request: bytes,
        runtime: Any,
        args: Sequence[Sequence[Any]],
        device_ids: tuple[int, ...],
        results: Sequence[ResultSpec],
        context: HostContext,
    ) -> list:
        """One value per entry of ``results`` (this host's parts), from ``args``.

        ``runtime``: the host's ``LocalRuntime``; ``args``: per argument, this host's
        local pieces of it (jax arrays on its devices);
        ``device_ids``: this host's devices among the plan's ``host_device_ids`` (local ids).
        """


Half = TypeVar("Half", ProxyHalf, HostHalf)


class ProgramHalves(Generic[Half]):
    """The halves one side serves, by (kind, key): built once from that side's explicit list, then only read."""

    def __init__(self, halves: Iterable[Half]):
        self._halves: dict[tuple[str, str], Half] = {}
        for half in halves:
            where = (half.kind, half.key)
            if where in self._halves:
                raise RuntimeError(f"two program halves for {where}")
            self._halves[where] = half

    def keys(self, kind: str) -> list[str]:
        """The keys served for ``kind``, sorted."""
        return sorted(key for k, key in self._halves if k == kind)

    def lookup(self, kind: str, key: str) -> Half:
        """The half for (kind, key); INVALID_ARGUMENT naming the keys served otherwise."""
        found = self._halves.get((kind, key))
        if found is None:
            raise self.refusal(kind, f"no handler for {key!r}")
        return found

    def refusal(self, kind: str, what: str) -> InvalidRequest:
        """A program of ``kind`` refused: ``what`` is wrong; the message lists the keys served."""
        if kind == PLUGIN:
            return InvalidRequest(
                f"Bad PluginProgram: {what}. This server serves plugin programs whose JSON has one top-level key "
                f"of {self.keys(PLUGIN)}"
            )
        return InvalidRequest(
            f"Bad CustomCallProgram: {what}. This server serves custom-call programs of the types "
            f"{self.keys(CUSTOM_CALL)}"
        )


def parse(type_name: str, data: bytes, served: ProgramHalves) -> ParsedProgram:
    """Reads a compile request's program of a non-XLA type, of a (kind, key) ``served`` knows; a clear
    INVALID_ARGUMENT for anything malformed."""
    kind = PROGRAM_TYPES.get(type_name)
    if kind is None:
        raise Unimplemented(f"programs of type {type_name!r} are not supported")
    limit = tuning.MAX_PROGRAM_BYTES.value
    if len(data) > limit:
        allowed = f"more than the {limit / (1 << 20):g} MiB allowed ({tuning.MAX_PROGRAM_BYTES.env_var})"
        raise served.refusal(kind, f"the program is {len(data)} bytes, {allowed}")
    if kind == PLUGIN:
        return _parse_plugin(data, served)
    return _parse_custom_call(data, served)


def _parse_plugin(data: bytes, served: ProgramHalves) -> ParsedProgram:
    if not data.startswith(PLUGIN_PREFIX):
        raise served.refusal(PLUGIN, f"the program text must start with {PLUGIN_PREFIX.decode()!r}, followed by JSON")
    try:
        value = json.loads(data[len(PLUGIN_PREFIX) :].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise served.refusal(PLUGIN, f"the program's JSON does not parse ({e})") from None
    if not isinstance(value, dict) or len(value) != 1:
        shown = sorted(value) if isinstance(value, dict) else type(value).__name__
        raise served.refusal(PLUGIN, f"the program's JSON must be an object with exactly one key, not {shown}")
    ((key, body),) = value.items()
    served.lookup(PLUGIN, key)
    return ParsedProgram(PLUGIN, key, body, data)


def _parse_custom_call(data: bytes, served: ProgramHalves) -> ParsedProgram:
    try:
        program = schema.load().ifrt.CustomCallProgramProto.FromString(data)
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise served.refusal(CUSTOM_CALL, f"the program does not parse as a CustomCallProgramProto ({e})") from None
    served.lookup(CUSTOM_CALL, program.type)
    return ParsedProgram(CUSTOM_CALL, program.type, program, data)


def plan(parsed: ParsedProgram, session: SessionView, served: ProgramHalves[ProxyHalf]) -> ProgramPlan:
    """The proxy half of ``parsed``'s kind; a plugin program's refusal says "Bad PluginProgram" (pathwaysutils' cue)."""
    try:
        return served.lookup(parsed.kind, parsed.key).plan(parsed.body, session)
    except InvalidRequest as error:
        if parsed.kind == PLUGIN and not error.message.startswith("Bad PluginProgram"):
            raise InvalidRequest(f"Bad PluginProgram: {parsed.key}: {error.message}") from None
        raise


def json_body(body: Any, what: str) -> dict:
    """A plugin request's body as a JSON object, or a clear error."""
    if not isinstance(body, dict):
        raise InvalidRequest(f"Bad PluginProgram: {what} must be a JSON object, not {type(body).__name__}")
    return body
