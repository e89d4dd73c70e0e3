"""Requests about the session itself: devices, layouts, futures."""

from __future__ import annotations

import math

from pathways_nb._version import __version__
from pathways_nb.protocol import attributes, dtypes
from pathways_nb.protocol.errors import InvalidRequest
from pathways_nb.proxy.dispatch import DEFERRED, handles
from pathways_nb.proxy.versions import DEVICE_PLATFORM_NAME

# What the client's ``runtime_type`` says (the client adds "proxy/"): Pathways on Cloud's word, since
# Orbax keys on it (``multihost.is_proxy_pathways_backend``: "proxy/pathways" picks the persistence
# handler, ``ocp.pathways.register_type_handlers`` and Orbax v1 the Pathways handlers). This server is
# told apart by ``client_attributes["pathways_nb_version"]`` and by its observe API.
RUNTIME_TYPE = "pathways"


@handles("init_request")
def init(session, request, op_id):
    """Gets the session's devices (awaited on the loop: a cluster may make it wait) and describes them."""

    def described(runtime, error):
        if error is not None:
            session.reply_error(op_id, error)
        else:
            session.reply(op_id, "init_response", _describe(session, runtime))

    session.open_devices(described)
    return DEFERRED


def _describe(session, runtime):
    """The client's view of the session's devices: ``jax.devices()`` and their memories."""
    response = session.messages.proxy.InitResponse(
        session_id=session.session_id,
        platform_name=runtime.platform,
        platform_version=runtime.platform_version,
        process_index=0,
        runtime_type=RUNTIME_TYPE,
    )
    # Colocated CPU devices (colocated Python) are addressable but not primary: jax.devices() stays as it was.
    for device in runtime.describe_devices(runtime.device_ids + runtime.colocated_device_ids):
        memory_ids = [device.id * len(MEMORY_KINDS) + MEMORY_KINDS.index(kind) for kind in device.memory_kinds]
        proto = response.all_devices.add(
            id=device.id,
            local_device_id=device.id,
            local_hardware_id=device.local_hardware_id,
            device_kind=device.kind,
            default_memory_id=memory_ids[0],
            memory_ids=memory_ids,
            # The stock client's repr() shows to_string and str() shows debug_string.
            debug_string=device.debug_string,
            to_string=device.to_string,
        )
        if session.version.protocol_version >= DEVICE_PLATFORM_NAME:
            proto.platform_name = device.platform
        attributes.fill(proto.attributes, device.attributes)
        for memory_id, kind in zip(memory_ids, device.memory_kinds, strict=True):
            response.memories.add(
                id=memory_id,
                memory_space_kind=kind,
                kind_id=MEMORY_KINDS.index(kind),
                device_ids=[device.id],
                debug_string=f"{kind.upper()}_{memory_id}",
                to_string=f"{kind}:{device.id}",
            )
    response.primary_device_ids.extend(runtime.device_ids)
    response.addressable_device_ids.extend(runtime.device_ids + runtime.colocated_device_ids)
    attributes.fill(response.client_attributes, {"pathways_nb_version": __version__})
    return response


# Memory kinds a device may have; a memory's id is device id x 3 + the kind's index here.
MEMORY_KINDS = ("device", "pinned_host", "unpinned_host")


@handles("check_future_request")
def check_future(session, request, op_id):
    """Replies once the future is done; each future handle is checked once."""
    pending = session.take_future(request.future_handle)

    def done(_value, error):
        if error is not None:
            session.reply_error(op_id, error)
        else:
            session.reply(op_id, "check_future_response", session.messages.proxy.CheckFutureResponse())

    session.when_done(pending, done)
    return DEFERRED


@handles("get_default_layout_request")
def get_default_layout(session, request, op_id):
    """The layout an array of this dtype and shape gets on a device (PjRtLayout's serialized form)."""
    dtype = dtypes.to_numpy(request.dtype.kind)
    if any(d < 0 for d in request.dims):
        raise InvalidRequest(f"negative dimension in {list(request.dims)}")
    # (Zero dims do not save XLA, which multiplies the others first.)
    if math.prod(max(d, 1) for d in request.dims) * dtype.itemsize >= 1 << 63:
        raise InvalidRequest(f"an array of {dtype}{list(request.dims)} has more bytes than a 64-bit size can count")
    runtime, dims = session.runtime, tuple(request.dims)

    def layout() -> bytes:
        return runtime.default_layout(dtype, dims, request.device_id, request.memory_kind)

    if not runtime.layout_waits(dtype, dims, request.device_id, request.memory_kind):
        return session.messages.proxy.GetDefaultLayoutResponse(serialized_pjrt_layout=layout())

    def done(serialized: bytes, error) -> None:
        if error is not None:
            session.reply_error(op_id, error)
        else:
            response = session.messages.proxy.GetDefaultLayoutResponse(serialized_pjrt_layout=serialized)
            session.reply(op_id, "get_default_layout_response", response)

    session.in_background(layout, done)  # a worker is asked: never on the event loop
    return DEFERRED


@handles("get_default_device_assignment_request")
def get_default_device_assignment(session, request, op_id):
    """The first ``replicas x partitions`` devices of the session, replica-major."""
    replicas, partitions = request.num_replicas, request.num_partitions
    if replicas * partitions > len(session.device_ids) or replicas < 1 or partitions < 1:
        raise InvalidRequest(
            f"a device assignment of {replicas} replicas x {partitions} partitions needs "
            f"{replicas * partitions} devices; this session has {len(session.device_ids)}"
        )
    assignment = session.messages.xla.DeviceAssignmentProto(replica_count=replicas, computation_count=partitions)
    for partition in range(partitions):
        assignment.computation_devices.add(
            replica_device_ids=[session.device_ids[r * partitions + partition] for r in range(replicas)]
        )
    return session.messages.proxy.GetDefaultDeviceAssignmentResponse(device_assignment=assignment)
