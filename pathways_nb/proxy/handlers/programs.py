"""Program requests: compile, metadata, execute and the executable's lifetime."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pathways_nb.core import nonxla
from pathways_nb.core.dataflow import ArrayRecord, Pending, when_all
from pathways_nb.core.events import event
from pathways_nb.core.runtime_api import ArgumentFacts, ProgramInfo, check_arguments
from pathways_nb.protocol import attributes, dtypes
from pathways_nb.protocol.errors import Code, DataLoss, InvalidRequest, Unimplemented, as_request_error
from pathways_nb.proxy import executions, nonxla_programs
from pathways_nb.proxy.context import CompileCache
from pathways_nb.proxy.dispatch import DEFERRED, handles
from pathways_nb.proxy.nonxla_programs import NonXlaProgram

XLA_PROGRAM = "xla::ifrt::XlaProgram"
XLA_COMPILE_OPTIONS = "xla::ifrt::XlaCompileOptions"


@dataclass
class LoadedProgram:
    """A session's handle on a compiled XLA program (programs themselves are shared via the cache).

    Its execute strategy (``executions.Executable``): the devices must be the compiled ones; donated
    arguments free their bytes, and are donated only once non-XLA programs that read them are done;
    the program runs once its arguments exist and its group of islands serves.
    """

    program: ProgramInfo
    deleted: bool = False
    output_kinds: tuple[int, ...] = field(default=())

    @property
    def name(self) -> str:
        return self.program.name

    def check(self, request, inputs: Sequence[ArrayRecord]) -> None:
        if request.device_ids and tuple(request.device_ids) != self.program.device_ids:
            raise InvalidRequest(
                f"the program was compiled for devices {list(self.program.device_ids)}; "
                f"it cannot run on {list(request.device_ids)}"
            )

    def new_outputs(self) -> list[ArrayRecord]:
        program = self.program
        return [
            ArrayRecord(kind, aval.shape, sharding)
            for kind, aval, sharding in zip(
                self.output_kinds, program.signature.results, program.output_shardings, strict=True
            )
        ]

    def credit(self, request, inputs: Sequence[ArrayRecord]) -> int:
        return sum(
            record.nbytes for record in self._donated(request, inputs) if record.error is None and not record.is_deleted
        )

    def _donated(self, request, inputs: Sequence[ArrayRecord]) -> list[ArrayRecord]:
        keep = frozenset(request.execute_options.non_donatable_input_indices)
        return [inputs[i] for i in self.program.donated_args if i not in keep and i < len(inputs)]

    def start(self, session, request, inputs, outputs, status: Pending | None, failed_input) -> None:
        program = self.program
        for device_id in program.device_ids:  # what a later non-XLA program on these devices runs after
            session.latest_work[device_id] = outputs
        if failed_input is not None:
            # An argument holds an error (e.g. it was lost with its host): so do the results, read later.
            executions.fail_outputs(outputs, status, failed_input)
            return
        keep = frozenset(request.execute_options.non_donatable_input_indices)
        donated = self._donated(request, inputs)

        def run() -> None:
            check_arguments(program, [_facts(record) for record in inputs])
            try:
                values = session.runtime.execute(program, [record.value for record in inputs], keep)
            except DataLoss as lost:
                # The island is down. As with a device failure, the results hold the error and raise it
                # when they are read, not here (pathwaysutils' elastic mode relies on that).
                for record in outputs:
                    record.fail(lost)
                return
            for record, value in zip(outputs, values, strict=True):
                record.set(value)
            for record in donated:
                record.deleted = True
                record.free()

        # A donated argument that a non-XLA program still reads (an Orbax save) is donated after it; a program
        # over a group of islands that is forming (again) runs once it serves.
        reads = [record.reads_done() for record in donated]
        gate = session.runtime.ready(program.device_ids)
        gates = [ArrayRecord.gate(gate)] if gate is not None else []
        session.after([*inputs, *reads, *gates], run, outputs=outputs, on_error=status.fail if status else None)
        if status is not None:
            _finish_when_computed(session, outputs, status)


def _assignment_devices(options) -> tuple[int, ...]:
    """Device ids of a compile request, replica-major, from its ``DeviceAssignmentProto``."""
    build = options.executable_build_options
    if not build.HasField("device_assignment"):
        raise InvalidRequest("the compile options carry no device assignment; the client must name the devices")
    assignment = build.device_assignment
    replicas, partitions = assignment.replica_count, assignment.computation_count
    if replicas < 1 or partitions < 1:
        raise InvalidRequest(f"a device assignment of {replicas} replicas x {partitions} partitions runs nowhere")
    if len(assignment.computation_devices) != partitions or any(
        len(c.replica_device_ids) != replicas for c in assignment.computation_devices
    ):
        raise InvalidRequest("the device assignment does not match its replica and partition counts")
    device_ids = tuple(
        assignment.computation_devices[p].replica_device_ids[r] for r in range(replicas) for p in range(partitions)
    )
    if len(set(device_ids)) != len(device_ids):
        raise InvalidRequest(f"the device assignment names a device twice: {list(device_ids)}")
    return device_ids


# What the stock client sets in ``CompileOptionsProto`` and ``ExecutableBuildOptionsProto``, plus
# tuning knobs of XLA's own. Anything else (auto-sharding, multi-process, backend-only or portable
# compiles, tupled arguments, profiles) is refused: several of those abort XLA on a CHECK.
_COMPILE_OPTIONS = frozenset(
    {"executable_build_options", "profile_version", "allow_in_place_mlir_modification", "env_option_overrides"}
)
_BUILD_OPTIONS = frozenset(
    {
        "device_ordinal",
        "debug_options",
        "num_replicas",
        "num_partitions",
        "use_spmd_partitioning",
        "device_assignment",
        "allow_spmd_sharding_propagation_to_output",
        "allow_spmd_sharding_propagation_to_parameters",
        "use_shardy_partitioner",
        "process_count",
        "process_index",
        "memory_fitting_level",
        "exec_time_optimization_effort",
        "memory_fitting_effort",
        "optimization_level",
        "deduplicate_hlo",
        "alias_passthrough_params",
    }
)


def _names_a_server_file(option: str) -> bool:
    """Whether an XLA option reads or writes files (dumps, caches, profiles) where it runs."""
    return any(word in option for word in ("dump", "path", "file", "dir")) or option.endswith(("_to", "_from"))


def _drop_server_file_options(options) -> None:
    """Removes the options that would make XLA read or write files on the server for a client.

    A client's ``XLA_FLAGS`` (``--xla_dump_to``, autotune caches, ...) travel in its compile options;
    honoured here they would let one tenant write anywhere the server may. They are dropped, not
    refused, so that a client that dumps its own compiles locally still compiles here.
    """
    debug = options.executable_build_options.debug_options
    for descriptor, _value in debug.ListFields():
        if _names_a_server_file(descriptor.name):
            debug.ClearField(descriptor.name)
    for name in [name for name in options.env_option_overrides if _names_a_server_file(name)]:
        del options.env_option_overrides[name]


def _drop_crash_options(debug) -> None:
    """Removes XLA's debugging options that end the process on purpose (``xla_unsupported_crash_on_*``).

    They make a compile abort the server that runs it (a pass that misreports a change is a fatal
    error under them) instead of failing one request; like the file options, they are dropped.
    """
    for descriptor, _value in debug.ListFields():
        if "crash" in descriptor.name:
            debug.ClearField(descriptor.name)


def _check_options(options) -> None:
    """Refuses compile options this server does not serve, before XLA sees them."""
    _drop_server_file_options(options)
    build = options.executable_build_options
    _drop_crash_options(build.debug_options)
    if build.debug_options.xla_disable_hlo_passes and build.debug_options.xla_enable_hlo_passes_only:
        raise InvalidRequest(  # XLA checks this with an abort
            "the compile options set both xla_disable_hlo_passes and xla_enable_hlo_passes_only; set one of them"
        )
    for message, allowed in ((options, _COMPILE_OPTIONS), (build, _BUILD_OPTIONS)):
        for descriptor, _value in message.ListFields():
            if descriptor.name not in allowed:
                raise InvalidRequest(
                    f"compile option {descriptor.name} is not supported by this server; "
                    "compile without it (jax.jit sets only the usual options)"
                )
    assignment = build.device_assignment
    if (build.num_replicas, build.num_partitions) != (assignment.replica_count, assignment.computation_count):
        raise InvalidRequest(
            f"the compile options ask for {build.num_replicas} replicas x {build.num_partitions} partitions, "
            f"but the device assignment is {assignment.replica_count} x {assignment.computation_count}"
        )
    if build.device_ordinal != -1 or build.process_index != 0 or build.process_count not in (0, 1):
        raise InvalidRequest(
            "compile options for one device ordinal or for several processes are not supported; "
            "the device assignment alone says where the program runs"
        )


@handles("compile_request")
def compile_program(session, request, op_id):
    """Compiles off the stream thread (or takes the shared cache) and replies when done."""
    messages = session.messages
    if request.program.type_name in nonxla.PROGRAM_TYPES:
        return nonxla_programs.compile_program(session, request, op_id)
    if request.program.type_name != XLA_PROGRAM:
        raise Unimplemented(
            f"programs of type {request.program.type_name!r} are not supported; send an XlaProgram, or one of "
            f"{sorted(nonxla.PROGRAM_TYPES)}"
        )
    if request.compile_options.type_name != XLA_COMPILE_OPTIONS:
        raise Unimplemented(f"compile options of type {request.compile_options.type_name!r} are not supported")
    if request.host_callbacks:
        raise Unimplemented(
            "host callbacks (jax.debug.print, pure_callback, io_callback) cannot run through the "
            "IFRT proxy; remove them from the jitted function"
        )
    try:
        options = messages.ifrt.XlaCompileOptionsProto.FromString(request.compile_options.data).compile_options
    except Exception as e:
        raise InvalidRequest(f"malformed compile options: {e}") from e
    device_ids = _assignment_devices(options)
    _check_options(options)
    held = {*session.device_ids, *session.runtime.colocated_device_ids}
    unknown = [d for d in device_ids if d not in held]
    if unknown:
        raise InvalidRequest(f"the program is assigned to devices {unknown}, which this session does not hold")
    program_bytes = request.program.data
    options_bytes = options.SerializeToString()
    cache = session.context.compile_cache
    key = CompileCache.key(program_bytes, options_bytes, device_ids)

    def compile_now() -> ProgramInfo:
        program = cache.get(key)
        if program is None:
            started = time.time()
            try:
                with session.context.activities.track_from_pool(session.loop, "compile", "compiling", session.tenant):
                    program = session.runtime.compile(program_bytes, options_bytes, device_ids)
            except Exception:
                session.events(event("compile", "compile", device_ids, started, time.time(), failed=True))
                raise
            session.events(event("compile", program.name, device_ids, started, time.time()))
            cache.put(key, program)
        return program

    def compiled(program: ProgramInfo | None, error) -> None:
        if error is not None:
            session.reply_error(op_id, error)
            return
        handle = session.server_handle()
        session.programs[handle] = LoadedProgram(
            program, output_kinds=tuple(aval.kind for aval in program.signature.results)
        )
        ready = Pending()
        ready.resolve(None)
        response = messages.proxy.CompileResponse(
            loaded_executable_handle=handle,
            name=program.name,
            num_devices=len(program.device_ids),
            device_ids=program.device_ids,
            addressable_device_ids=program.device_ids,
            ready_future_handle=session.add_future(ready),
        )
        if program.fingerprint is not None:
            response.fingerprint_value = program.fingerprint
        session.reply(op_id, "compile_response", response)

    def compile_when_ready(_value, error) -> None:
        if error is not None:
            compiled(None, as_request_error(error))
        else:
            session.in_background(compile_now, compiled, pool=session.context.compile_pool)

    gate = session.runtime.ready(device_ids)  # a group of islands that forms: awaited without a pool thread
    if gate is None:
        compile_when_ready(None, None)
    else:
        session.when_done(gate, compile_when_ready)
    return DEFERRED


@handles("loaded_executable_metadata_request")
def metadata(session, request, op_id):
    """Shardings, layouts, memory kinds and donations of a compiled program."""
    loaded = session.program(request.loaded_executable_handle)
    if isinstance(loaded, NonXlaProgram):
        return nonxla_programs.metadata(session, loaded)
    program = loaded.program
    proxy, xla = session.messages.proxy, session.messages.xla
    response = proxy.LoadedExecutableMetadataResponse()
    if program.parameter_op_shardings is not None:
        for op in program.parameter_op_shardings:
            response.parameter_shardings.shardings.add().ParseFromString(op)
    if program.output_op_shardings is not None:
        for op in program.output_op_shardings:
            response.output_shardings.shardings.add().ParseFromString(op)
    _fill_layouts(response, "parameter", program.parameter_layouts, program.signature.args)
    _fill_layouts(response, "output", program.output_layouts, program.signature.results)
    response.output_memory_kinds.memory_kind_lists.add(memory_kinds=program.output_memory_kinds)
    response.donated_input_indices.donated_input_indices.extend(sorted(program.donated_args))
    response.donated_input_indices.SetInParent()
    response.compiled_memory_stats.CopyFrom(xla.CompiledMemoryStatsProto(**program.memory_stats))
    response.size_of_generated_code_in_bytes = program.memory_stats.get("generated_code_size_in_bytes", 0)
    return response


def _fill_layouts(response, which: str, minor_to_majors, avals) -> None:
    """``which`` ("parameter" or "output") layouts; for token values an error, as a local jaxlib answers.

    jax then uses default layouts, and the client makes its results without one.
    """
    if any(aval.is_token for aval in avals):
        error = getattr(response, f"{which}_layouts_error")
        error.code = Code.UNIMPLEMENTED
        error.message = f"XLA lays out no program with token {which}s"
        return
    layouts = getattr(response, f"{which}_layouts_list")
    layouts.SetInParent()
    for minor_to_major in minor_to_majors:
        layouts.layouts.add(minor_to_major=minor_to_major)


@handles(
    "loaded_executable_execute_request",
    outputs=lambda r: r.result_array_handle,
)
def execute(session, request, op_id):
    """Starts a program once its inputs exist; replies at once with (or without) output specs."""
    return executions.execute(session, session.program(request.loaded_executable_handle), request)


def _facts(record: ArrayRecord) -> ArgumentFacts:
    dtype = None if record.kind == dtypes.TOKEN_KIND else dtypes.to_numpy(record.kind)
    return ArgumentFacts(dtype, record.shape, frozenset(record.sharding.device_ids), record.is_deleted)


def _finish_when_computed(session, outputs: list[ArrayRecord], status: Pending) -> None:
    """Resolves ``status`` once every output is computed (or with the first failure)."""

    def wait():
        for record in outputs:
            record.value.block_until_ready()

    def known(error) -> None:
        if error is not None:
            status.fail(error)
        else:
            session.in_background(wait, lambda _r, e: status.fail(e) if e else status.resolve(None))

    when_all([record.pending for record in outputs], known)


@handles("loaded_executable_fetch_execute_result_request")
def fetch_execute_result(session, request, op_id):
    """Replies when the execution whose status handle is given has finished."""
    pending = session.take_future(request.result_status_handle)

    def done(_value, error):
        if error is not None:
            session.reply_error(op_id, error)
        else:
            session.reply(
                op_id,
                "loaded_executable_fetch_execute_result_response",
                session.messages.proxy.LoadedExecutableFetchExecuteResultResponse(),
            )

    session.when_done(pending, done)
    return DEFERRED


@handles("loaded_executable_cost_analysis_request")
def cost_analysis(session, request, op_id):
    """XLA's cost estimate; failures go in the body, which the client requires.

    Asked off the event loop (a cluster's worker answers it), so other requests keep flowing.
    """
    loaded = session.program(request.loaded_executable_handle)
    response = session.messages.proxy.LoadedExecutableCostAnalysisResponse()
    if isinstance(loaded, NonXlaProgram):
        response.status.code = Code.UNIMPLEMENTED
        response.status.message = f"a {loaded.parsed.kind} program has no cost analysis"
        return response
    program = loaded.program

    def answer(costs, error) -> None:
        if error is None:
            attributes.fill(response.attributes, costs)
            response.attributes.SetInParent()
        else:
            response.status.code = Code.UNIMPLEMENTED
            response.status.message = f"cost analysis is unavailable for this program: {error.message}"
        session.reply(op_id, "loaded_executable_cost_analysis_response", response)

    session.in_background(lambda: session.runtime.cost_analysis(program), answer)
    return DEFERRED


@handles("loaded_executable_human_readable_program_text_request")
def program_text(session, request, op_id):
    """The optimized HLO of the program (``compiled.as_text()``), written off the event loop."""
    loaded = session.program(request.loaded_executable_handle)
    if isinstance(loaded, NonXlaProgram):
        return session.messages.proxy.LoadedExecutableHumanReadableProgramTextResponse(
            human_readable_program_text=loaded.parsed.text.decode(errors="replace")
        )
    program = loaded.program

    def answer(text, error) -> None:
        if error is not None:
            session.reply_error(op_id, error)
            return
        response = session.messages.proxy.LoadedExecutableHumanReadableProgramTextResponse(
            human_readable_program_text=text
        )
        session.reply(op_id, "loaded_executable_human_readable_program_text_response", response)

    session.in_background(lambda: session.runtime.program_text(program), answer)
    return DEFERRED


@handles("loaded_executable_delete_request")
def delete_program(session, request, op_id):
    session.program(request.loaded_executable_handle).deleted = True
    done = Pending()
    done.resolve(None)
    return session.messages.proxy.LoadedExecutableDeleteResponse(future_handle=session.add_future(done))


@handles("loaded_executable_is_deleted_request")
def is_program_deleted(session, request, op_id):
    deleted = session.program(request.loaded_executable_handle).deleted
    return session.messages.proxy.LoadedExecutableIsDeletedResponse(is_deleted=deleted)


@handles("loaded_executable_destruct_request")
def destruct_program(session, request, op_id):
    """Drops the session's handle; running executions and their results stay valid."""
    session.program(request.loaded_executable_handle)
    del session.programs[request.loaded_executable_handle]
    return session.messages.proxy.LoadedExecutableDestructResponse()
