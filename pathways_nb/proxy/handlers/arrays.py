"""Array requests: host transfers, (dis)assembly, copies between devices, deletion."""

from __future__ import annotations

import math
import time

import numpy as np
from google.protobuf.message import DecodeError

from pathways_nb.core import string_arrays, tuning
from pathways_nb.core.dataflow import ArrayRecord, Pending, fulfil, when_all
from pathways_nb.core.events import event
from pathways_nb.protocol import dtypes, schema, shardings
from pathways_nb.protocol.errors import InvalidRequest, RequestError, Unimplemented, as_request_error, error_for
from pathways_nb.protocol.op_sharding import Tiling
from pathways_nb.protocol.shardings import IfrtSharding
from pathways_nb.proxy.dispatch import DEFERRED, handles

ALWAYS_COPY, REUSE_INPUT, DONATE_INPUT = 1, 2, 3


# -- host <-> device ------------------------------------------------------------------------


def _host_array(data: memoryview, dtype: np.dtype, shape: tuple[int, ...], byte_strides) -> np.ndarray:
    """Host bytes as an array of ``shape``, honouring the client's byte strides."""
    if byte_strides is None:
        expected = math.prod(shape) * dtype.itemsize
        if data.nbytes != expected:
            raise InvalidRequest(
                f"the host buffer has {data.nbytes} bytes, but a {dtype}{list(shape)} array needs {expected}"
            )
        return np.frombuffer(data, dtype).reshape(shape)
    strides = tuple(byte_strides)
    if len(strides) != len(shape):
        raise InvalidRequest(f"{len(strides)} byte strides given for a {len(shape)}-dimensional array")
    dense = math.prod(shape) * dtype.itemsize
    if data.nbytes < dense:
        # Strides that overlap elements (0, say) would turn a few uploaded bytes into a huge array.
        raise InvalidRequest(
            f"the host buffer has {data.nbytes} bytes, fewer than the {dense} of a {dtype}{list(shape)} array; "
            "byte strides may pad the elements, not overlap them"
        )
    try:
        view = np.ndarray(shape, dtype, buffer=data, strides=strides)
    except (TypeError, ValueError) as e:
        raise InvalidRequest(f"byte strides {list(strides)} do not fit the host buffer: {e}") from e
    # (np.ascontiguousarray would turn a 0-d array into a 1-d one.)
    return view if view.flags.c_contiguous else view.copy(order="C")


def _strided_extent(shape: tuple[int, ...], itemsize: int, byte_strides) -> int:
    """Bytes a host buffer of ``shape`` laid out with the client's byte strides (dense if none) takes."""
    if byte_strides is None:
        return math.prod(shape) * itemsize
    strides = tuple(byte_strides)
    if len(strides) != len(shape) or any(s < 0 for s in strides):
        raise InvalidRequest(f"byte strides {list(strides)} do not fit a {len(shape)}-dimensional array")
    return itemsize + sum((d - 1) * s for d, s in zip(shape, strides, strict=True)) if math.prod(shape) else 0


def _strided_bytes(host: np.ndarray, byte_strides) -> memoryview:
    """``host``'s elements laid out with the client's byte strides (dense if none)."""
    if byte_strides is None:
        return memoryview(np.ascontiguousarray(host).reshape(-1).view(np.uint8))
    out = np.zeros(_strided_extent(host.shape, host.itemsize, byte_strides), np.uint8)
    strides = tuple(byte_strides)
    if host.size:
        np.ndarray(host.shape, host.dtype, buffer=out, strides=strides)[...] = host
    return memoryview(out)


def _record_transfer(session, kind: str, name: str, sharding: IfrtSharding, started: float, nbytes: int) -> None:
    """Host transfers worth seeing on a timeline (1 MiB and up)."""
    if nbytes >= 1 << 20:
        session.events(event(kind, name, sharding.device_ids, started, time.time(), nbytes))


def _strides(request):
    return request.byte_strides.strides if request.HasField("byte_strides") else None


def _shape(proto) -> tuple[int, ...]:
    shape = tuple(proto.dims)
    if any(d < 0 for d in shape):
        raise InvalidRequest(f"negative dimension in shape {list(shape)}")
    return shape


def _sources(session, handles) -> list[ArrayRecord]:
    """The input arrays of a request that makes new ones; an input that failed fails it with its own error."""
    records = session.records(handles)
    for record in records:
        if record.error is not None:
            raise record.error
    return records


@handles(
    "make_array_from_host_buffer_request", outputs=lambda r: [r.array_handle] if r.HasField("array_handle") else []
)
def make_array_from_host_buffer(session, request, op_id):
    """A device array from an uploaded host buffer; the upload may still be on its way."""
    # Taken first, so that the buffer is dropped (not kept until the session ends) if the request fails.
    upload = session.host_buffers.take(request.host_buffer_handle)
    kind = request.dtype.kind
    dtype = dtypes.to_numpy(kind)
    shape = _shape(request.shape)
    sharding = shardings.from_proto(request.sharding)
    session.runtime.check_sharding(sharding)  # refuse unknown devices now
    strides = _strides(request)
    record = ArrayRecord(kind, shape, sharding)
    handle = request.array_handle if request.HasField("array_handle") else session.server_handle()
    session.add_new_arrays([handle], [record], f"array {handle} ({dtype}{list(shape)})")
    started = time.time()

    def put(data, off_loop: bool):
        put_on = session.runtime.put_blocking if off_loop else session.runtime.put
        return put_on(_host_array(data, dtype, shape, strides), sharding)

    def arrived(data, error):
        if error is not None:
            record.fail(error)
            return
        _put_when_arrived(session, record, lambda off_loop: put(data, off_loop), data.nbytes)
        _record_transfer(session, "upload", f"{dtype}{list(shape)}", sharding, started, data.nbytes)

    session.when_done(upload, arrived)
    return session.messages.proxy.MakeArrayFromHostBufferResponse(array_handle=handle)


@handles("make_arrays_from_host_buffer_shards_request", outputs=lambda r: r.array_handles)
def make_arrays_from_host_buffer_shards(session, request, op_id):
    """Sharded arrays from one host buffer per group of shards (``device_put`` with a sharding)."""
    # Every upload is taken first, so that none outlives a failed request.
    uploads = [[session.host_buffers.take(b.host_buffer_handle) for b in spec.host_buffers] for spec in request.specs]
    if request.array_handles and len(request.array_handles) != len(request.specs):
        raise InvalidRequest(f"{len(request.array_handles)} handles for {len(request.specs)} arrays")
    handles_out = []
    for index, spec in enumerate(request.specs):
        handle = request.array_handles[index] if request.array_handles else session.server_handle()
        handles_out.append(handle)
        _make_from_shards(session, handle, spec, uploads[index])
    return session.messages.proxy.MakeArraysFromHostBufferShardsResponse(array_handles=handles_out)


def _make_from_shards(session, handle: int, spec, uploads: list[Pending]) -> None:
    kind = spec.array_spec.dtype.kind
    dtype = dtypes.to_numpy(kind)
    shape = _shape(spec.array_spec.shape)
    sharding = shardings.from_proto(spec.array_spec.sharding)
    session.runtime.check_sharding(sharding)
    shard_shape = sharding.shard_shape(shape)
    record = ArrayRecord(kind, shape, sharding)
    session.add_new_arrays([handle], [record], f"array {handle} ({dtype}{list(shape)})")
    if len(spec.host_buffers) != len(spec.addressable_shard_indices):
        raise InvalidRequest("every host buffer needs its list of shard indices")
    owners: dict[int, int] = {}
    for buffer_index, indices in enumerate(spec.addressable_shard_indices):
        for shard_index in indices.indices:
            if not 0 <= shard_index < len(sharding.device_ids):
                raise InvalidRequest(
                    f"shard index {shard_index} is outside the sharding's {len(sharding.device_ids)} devices"
                )
            owners[shard_index] = buffer_index
    if len(owners) != len(sharding.device_ids):
        raise InvalidRequest(f"host buffers cover {len(owners)} of {len(sharding.device_ids)} shards")
    buffer_specs = [(dtypes.to_numpy(b.dtype.kind), _shape(b.shape), _strides(b)) for b in spec.host_buffers]
    for buffer_dtype, buffer_shape, _ in buffer_specs:
        if buffer_shape != shard_shape or buffer_dtype != dtype:
            raise InvalidRequest(
                f"a host buffer of {buffer_dtype}{list(buffer_shape)} for shards of {dtype}{list(shard_shape)}"
            )

    def put(off_loop: bool):
        hosts = [_host_array(u.value, *s) for u, s in zip(uploads, buffer_specs, strict=True)]
        shards = [hosts[owners[i]] for i in range(len(sharding.device_ids))]
        put_on = session.runtime.put_shards_blocking if off_loop else session.runtime.put_shards
        return put_on(shape, sharding, shards)

    def all_arrived(error):
        if error is not None:
            record.fail(error)
            return
        _put_when_arrived(session, record, put, sum(u.value.nbytes for u in uploads))

    when_all(uploads, lambda error: session.on_loop(lambda: all_arrived(error)))


def _put_when_arrived(session, record: ArrayRecord, put, nbytes: int) -> None:
    """Sets ``record`` to ``put(off_loop)``'s device value: on the wait pool for a large upload (the runtime's
    blocking put), else at once on the loop."""

    def done(value, error) -> None:
        if error is not None:
            record.fail(error)
        else:
            record.set(value)

    if nbytes >= tuning.OFF_LOOP_BYTES.value:
        session.in_background(lambda: put(True), done)
        return
    try:
        value, error = put(False), None
    except RequestError as failure:
        value, error = None, failure
    done(value, error)


@handles("copy_to_host_buffer_request")
def copy_to_host_buffer(session, request, op_id):
    """Stages an array's bytes as a host buffer the client then fetches with ``HostBufferLookup``.

    Replies at once: the lookup waits for the bytes (``HostBuffers.stage``), so the read runs
    while the reply and the lookup travel. Failures known now are this reply's; later ones the lookup's.
    """
    record = session.record(request.array_handle)
    if record.ready:
        if record.error is not None:
            raise record.error
        record.live()  # a deleted array fails now
    strides = _strides(request)
    strings = record.kind == dtypes.STRING_KIND
    if strings and strides is not None:
        raise InvalidRequest("a string array has no byte strides; read it without them")
    # The staged copy counts against the session's host buffers before it is made (a string
    # array's size is known only once read; plugin programs return a few short strings).
    nbytes = 0 if strings else _strided_extent(record.shape, dtypes.to_numpy(record.kind).itemsize, strides)
    reserved = session.host_buffers.reserve(nbytes, f"reading array {request.array_handle}")
    staged = session.host_buffers.stage(request.host_buffer_handle, reserved)
    started = time.time()

    def read() -> None:
        reading = record.read_later(lambda value: session.runtime.to_host_later(value, session.context.wait_pool))
        reading.on_done(arrived)

    def arrived(host, error) -> None:
        if error is not None:
            staged.fail(error)
        elif strings:
            # As the client reads string arrays: one StringArrayContents message, a string per element.
            fulfil(staged, lambda: memoryview(string_arrays.encode(host.reshape(-1))))
        else:
            fulfil(staged, lambda: _strided_bytes(host, strides))
            _record_transfer(session, "download", f"array {request.array_handle}", record.sharding, started, nbytes)

    try:
        session.after([record], read, on_error=staged.fail)
    except Exception as error:  # noqa: BLE001 - the lookup reports it
        staged.fail(as_request_error(error))
    return session.messages.proxy.CopyToHostBufferResponse()


@handles("check_value_ready_request")
def check_value_ready(session, request, op_id):
    """Replies once every array has been computed, or with the first failure."""
    records = session.records(request.value_handles)

    def wait():
        for record in records:
            if record.value is not None and not record.is_deleted:
                record.value.block_until_ready()

    def done(_result, error):
        if error is not None:
            session.reply_error(op_id, error)
        else:
            session.reply(op_id, "check_value_ready_response", session.messages.proxy.CheckValueReadyResponse())

    session.after(records, lambda: session.in_background(wait, done), on_error=lambda e: session.reply_error(op_id, e))
    return DEFERRED


@handles("make_error_arrays_request", outputs=lambda r: r.array_handles)
def make_error_arrays(session, request, op_id):
    """Arrays that hold an error the client made; using them raises it."""
    if not 1 <= request.error.code <= 16:
        raise InvalidRequest(f"an error array needs an error status (code 1-16), not code {request.error.code}")
    error = error_for(request.error.code, request.error.message or "error array")
    if request.array_handles and len(request.array_handles) != len(request.array_specs):
        raise InvalidRequest(f"{len(request.array_handles)} handles for {len(request.array_specs)} error arrays")
    handles_out = []
    for index, spec in enumerate(request.array_specs):
        handle = request.array_handles[index] if request.array_handles else session.server_handle()
        sharding = shardings.from_proto(spec.sharding)
        session.add_array(handle, ArrayRecord.failed(spec.dtype.kind, _shape(spec.shape), sharding, error))
        handles_out.append(handle)
    return session.messages.proxy.MakeErrorArraysResponse(array_handles=handles_out)


# -- assembling and moving ------------------------------------------------------------------


def _derive(
    session,
    handle: int,
    inputs: list[ArrayRecord],
    record: ArrayRecord,
    make,
    semantics: int,
    new_memory: bool = True,
    blocks=lambda: False,
    make_blocking=None,
) -> int:
    """Adds ``record`` under ``handle`` and fills it with ``make()`` once ``inputs`` are ready.

    ``new_memory``: the result takes memory of its own (not a view of an input's), so it counts against the quota.
    ``blocks()``: whether making it waits for devices (then ``make_blocking`` runs off the event loop, on the
    wait pool, instead of ``make``).
    """
    handle = handle or session.server_handle()
    if new_memory:
        donated = sum(source.nbytes for source in inputs) if semantics == DONATE_INPUT else 0
        session.add_new_arrays([handle], [record], f"array {handle} ({list(record.shape)})", credit=donated)
    else:
        session.add_array(handle, record)

    def finish(value, error) -> None:
        if error is not None:
            record.fail(error)
            return
        record.set(value)
        if semantics == DONATE_INPUT:  # only once made: a donated input is read until then
            for source in inputs:
                source.delete()

    def work():
        if blocks():
            session.in_background(make_blocking, finish)
        else:
            finish(make(), None)

    session.after(inputs, work, outputs=[record])
    return handle


@handles("assemble_array_from_single_device_arrays_request", outputs=lambda r: [r.result_handle])
def assemble(session, request, op_id):
    inputs = _sources(session, request.single_device_array_handles)
    if not inputs:
        raise InvalidRequest("assembling an array needs at least one single-device array")
    shape = _shape(request.shape)
    sharding = shardings.from_proto(request.sharding)
    kind = request.dtype.kind if request.HasField("dtype") else inputs[0].kind
    record = ArrayRecord(kind, shape, sharding)
    handle = _derive(
        session,
        request.result_handle,
        inputs,
        record,
        lambda: session.runtime.assemble(shape, sharding, [r.live() for r in inputs]),
        request.copy_semantics,
    )
    return session.messages.proxy.AssembleArrayFromSingleDeviceArraysResponse(array_handle=handle)


@handles("disassemble_into_single_device_arrays_request", outputs=lambda r: r.result_handles)
def disassemble(session, request, op_id):
    (source,) = _sources(session, [request.array_handle])
    sharding = source.sharding
    if request.result_handles and len(request.result_handles) != len(sharding.device_ids):
        raise InvalidRequest(
            f"{len(request.result_handles)} result handles for an array with {len(sharding.device_ids)} shards"
        )
    shard_shape = sharding.shard_shape(source.shape)
    parts = [
        ArrayRecord(source.kind, shard_shape, IfrtSharding((device_id,), sharding.memory_kind))
        for device_id in sharding.device_ids
    ]
    result_handles = list(request.result_handles) or [session.server_handle() for _ in parts]
    for handle, part in zip(result_handles, parts, strict=True):
        session.add_array(handle, part)

    def split():
        for part, value in zip(parts, session.runtime.disassemble(source.live(), sharding), strict=True):
            part.set(value)

    session.after([source], split, outputs=parts)
    return session.messages.proxy.DisassembleIntoSingleDeviceArraysResponse(array_handles=result_handles)


@handles("fully_replicated_shard_request", outputs=lambda r: [r.result_handle])
def fully_replicated_shard(session, request, op_id):
    (source,) = _sources(session, [request.array_handle])
    first = source.sharding.device_ids[0]
    record = ArrayRecord(source.kind, source.shape, IfrtSharding((first,), source.sharding.memory_kind))

    def first_shard():
        if source.sharding.op_sharding is not None:
            raise InvalidRequest("the array is not fully replicated; disassemble it to read one shard")
        return session.runtime.disassemble(source.live(), source.sharding)[0]

    handle = _derive(
        session, request.result_handle, [source], record, first_shard, request.copy_semantics, new_memory=False
    )
    return session.messages.proxy.FullyReplicatedShardResponse(array_handle=handle)


def _move_all(session, sources: list[ArrayRecord], targets: list[IfrtSharding], result_handles, semantics) -> list:
    """Each source's value laid out by its target sharding, under the client's result handles."""
    if result_handles and len(result_handles) != len(sources):
        raise InvalidRequest(f"{len(result_handles)} result handles for {len(sources)} arrays")
    handles_out = []
    for index, (source, target) in enumerate(zip(sources, targets, strict=True)):
        session.runtime.check_sharding(target)
        record = ArrayRecord(source.kind, source.shape, target)
        handle = result_handles[index] if result_handles else 0
        handles_out.append(
            _derive(
                session,
                handle,
                [source],
                record,
                lambda s=source, t=target: session.runtime.copy(s.live(), t),
                semantics,
                blocks=lambda s=source, t=target: session.runtime.copy_blocks(s.live(), t),
                make_blocking=lambda s=source, t=target: session.runtime.copy_blocking(s.live(), t),
            )
        )
    return handles_out


@handles("copy_arrays_request", outputs=lambda r: r.result_handles)
def copy_arrays(session, request, op_id):
    """The same arrays on other devices or memories (``jax.device_put`` to new devices)."""
    sources = _sources(session, request.array_handles)
    memory_kind = request.memory_kind or None if request.HasField("memory_kind") else None
    targets = [
        source.sharding.with_devices(
            tuple(request.device_ids) or source.sharding.device_ids, memory_kind or source.sharding.memory_kind
        )
        for source in sources
    ]
    handles_out = _move_all(session, sources, targets, request.result_handles, request.copy_semantics)
    return session.messages.proxy.CopyArraysResponse(array_handles=handles_out)


@handles("reshard_arrays_request", outputs=lambda r: r.result_handles)
def reshard_arrays(session, request, op_id):
    """The same arrays with new shardings (possibly new devices)."""
    sources = _sources(session, request.array_handles)
    if len(request.array_specs) != len(sources):
        raise InvalidRequest(f"{len(request.array_specs)} array specs for {len(sources)} arrays")
    targets = [shardings.from_proto(spec.sharding) for spec in request.array_specs]
    handles_out = _move_all(session, sources, targets, request.result_handles, request.copy_semantics)
    return session.messages.proxy.ReshardArraysResponse(array_handles=handles_out)


@handles("remap_arrays_request", outputs=lambda r: r.result_handles)
def remap_arrays(session, request, op_id):
    """New arrays whose shards are shards of the inputs, as the remap plan maps them."""
    sources = _sources(session, request.array_handles)
    plan = request.plan
    if len(plan.input_specs) != len(sources):
        raise InvalidRequest(f"the remap plan takes {len(plan.input_specs)} arrays, got {len(sources)}")
    # jax's reorder_shards names its results by a ConcreteEvenSharding, which says only the devices: their
    # layout is the one their shards bring.
    reordered = [_splitting_concrete_even(spec.sharding) for spec in plan.output_specs]
    targets = [
        even or shardings.from_proto(spec.sharding) for even, spec in zip(reordered, plan.output_specs, strict=True)
    ]
    moves = _remap_moves(plan, [len(s.sharding.device_ids) for s in sources], [len(t.device_ids) for t in targets])
    outputs = [
        ArrayRecord(
            spec.dtype.kind,
            _shape(spec.shape),
            target if even is None else _brought_layout(target, index, _shape(spec.shape), sources, moves),
        )
        for index, (spec, target, even) in enumerate(zip(plan.output_specs, targets, reordered, strict=True))
    ]
    result_handles = list(request.result_handles) or [session.server_handle() for _ in outputs]
    if len(result_handles) != len(outputs):
        raise InvalidRequest(f"{len(result_handles)} result handles for {len(outputs)} remapped arrays")
    donated = sum(source.nbytes for source in sources) if request.copy_semantics == DONATE_INPUT else 0
    session.add_new_arrays(result_handles, outputs, f"{len(outputs)} remapped array(s)", credit=donated)

    def remap():
        pieces = [session.runtime.disassemble(s.live(), s.sharding) for s in sources]
        placed: list[list] = [[None] * len(o.sharding.device_ids) for o in outputs]
        for in_array, i, out_array, j in moves:
            placed[out_array][j] = pieces[in_array][i]
        for record, shards in zip(outputs, placed, strict=True):
            record.set(session.runtime.assemble(record.shape, record.sharding, shards))
        if request.copy_semantics == DONATE_INPUT:
            for source in sources:
                source.delete()

    session.after(sources, remap, outputs=outputs)
    return session.messages.proxy.RemapArraysResponse(array_handles=result_handles)


def _splitting_concrete_even(proto) -> IfrtSharding | None:
    """The devices and memory kind of a ConcreteEvenSharding that splits its array; None for any other sharding."""
    if proto.serialized_sharding.type_name != shardings.CONCRETE_EVEN:
        return None
    try:
        body = schema.load().ifrt.ConcreteEvenShardingProto.FromString(proto.serialized_sharding.data)
    except DecodeError:
        return None  # shardings.from_proto says what is wrong with it
    if body.is_fully_replicated or len(body.devices.device_ids) < 2:
        return None
    return IfrtSharding(tuple(body.devices.device_ids), body.memory_kind if body.HasField("memory_kind") else None)


def _brought_layout(
    target: IfrtSharding, index: int, shape: tuple[int, ...], sources: list[ArrayRecord], moves
) -> IfrtSharding:
    """``target``'s devices holding the regions their shards held in the one source array they all come from."""
    into = {j: (in_array, i) for in_array, i, out_array, j in moves if out_array == index}
    from_arrays = {in_array for in_array, _ in into.values()}
    source = sources[from_arrays.pop()] if len(from_arrays) == 1 else None
    from_input = {i: j for j, (_, i) in into.items()}
    if source is None or source.shape != shape or len(from_input) != len(source.sharding.device_ids):
        raise Unimplemented(
            f"remapped array {index} is given by a ConcreteEvenSharding, and its shards are not a reordering of one "
            "array's shards, so this server cannot tell its layout; give it a NamedSharding"
        )
    tiling = source.sharding.tiling()
    if tiling.is_fully_replicated:
        return target
    reordered = Tiling(
        tiling.num_devices, tiling.partitions, tiling.replicas, tuple(from_input[i] for i in tiling.tile_devices)
    )
    return IfrtSharding(target.device_ids, target.memory_kind, reordered.to_proto().SerializeToString())


def _remap_moves(plan, input_shards: list[int], output_shards: list[int]) -> list[tuple[int, int, int, int]]:
    """The plan's mappings as (input array, its shard, output array, its shard), checked against the arrays."""
    moves = []
    for mapping in plan.mappings:
        if not (0 <= mapping.in_array < len(input_shards) and 0 <= mapping.out_array < len(output_shards)):
            raise InvalidRequest(
                f"a remap mapping from array {mapping.in_array} to array {mapping.out_array}; the plan has "
                f"{len(input_shards)} input and {len(output_shards)} output arrays"
            )
        ends = (
            mapping.from_start,
            mapping.from_end,
            mapping.from_step,
            mapping.to_start,
            mapping.to_end,
            mapping.to_step,
        )
        if len({len(e) for e in ends}) != 1:
            raise InvalidRequest("a remap mapping's interval lists (start, end, step; from and to) differ in length")
        for from_start, from_end, from_step, to_start, to_end, to_step in zip(*ends, strict=True):
            if from_step <= 0 or to_step <= 0:
                raise InvalidRequest("a remap interval needs a positive step")
            taken = range(from_start, from_end, from_step)
            into = range(to_start, to_end, to_step)
            if len(taken) != len(into):
                raise InvalidRequest("a remap interval maps a different number of shards than it receives")
            for i, j in zip(taken, into, strict=True):
                if not (0 <= i < input_shards[mapping.in_array] and 0 <= j < output_shards[mapping.out_array]):
                    raise InvalidRequest(
                        f"a remap interval moves shard {i} of input {mapping.in_array} to shard {j} of output "
                        f"{mapping.out_array}, which have {input_shards[mapping.in_array]} and "
                        f"{output_shards[mapping.out_array]} shards"
                    )
                moves.append((mapping.in_array, i, mapping.out_array, j))
    assigned = {(out_array, j) for _, _, out_array, j in moves}
    if len(assigned) != sum(output_shards):
        raise InvalidRequest("the remap plan leaves shards of an output array unassigned")
    return moves


@handles("bitcast_arrays_request", outputs=lambda r: r.result_handles)
def bitcast_arrays(session, request, op_id):
    raise Unimplemented(
        "bitcast_arrays is not implemented by the pathways-nb proxy server; "
        "use jax.lax.bitcast_convert_type inside a jitted function instead"
    )


# -- lifetime --------------------------------------------------------------------------------


@handles("delete_array_request")
def delete_array(session, request, op_id):
    """Frees device memory now; the handles stay known (as deleted) until destructed."""
    errors = []
    for handle in request.array_handle:
        record = session.arrays.get(handle)
        if record is None:
            errors.append(handle)
        else:
            record.delete()
    done = Pending()
    if errors:
        done.fail(InvalidRequest(f"cannot delete unknown array handle(s) {', '.join(map(str, errors))}"))
    else:
        done.resolve(None)
    return session.messages.proxy.DeleteArrayResponse(deletion_future_handle=session.add_future(done))


@handles("destruct_array_request")
def destruct_array(session, request, op_id):
    """Forgets handles the client dropped; their memory goes once no program uses it."""
    missing = []
    for handle in request.array_handle:
        record = session.arrays.pop(handle, None)
        if record is None:
            missing.append(handle)
        else:
            record.free()
    if missing:
        raise InvalidRequest(f"unknown array handle(s) {', '.join(map(str, missing))}")
    return session.messages.proxy.DestructArrayResponse()


@handles("is_array_deleted_request")
def is_array_deleted(session, request, op_id):
    return session.messages.proxy.IsArrayDeletedResponse(deleted=session.record(request.array_handle).is_deleted)
