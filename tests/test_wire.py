"""Bad input at the protocol level gets a clear error, and the server keeps serving everyone else."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from pathways_nb.protocol import dtypes
from pathways_nb.testing import WireSession, lowered_program

F32 = dtypes.from_numpy(np.dtype(np.float32))


@pytest.fixture
def wire(proxy_server):
    with WireSession(proxy_server.address) as session:
        yield session


def _status(response):
    return response.response_metadata.status.code, response.response_metadata.status.message


def _array_request(session, handle: int, shape=(2, 3), device: int = 0, kind: int = F32):
    return session.array_request(handle, shape, kind, device)


def _put(session, handle: int, value: np.ndarray, device: int = 0) -> None:
    session.make_array(handle, value, device)


def _read(session, array_handle: int, host_handle: int) -> bytes:
    return session.read_array(array_handle, host_handle)


def _compile(session, device_ids):
    """Compiles ``x * 2`` over float32[2, 3] for ``device_ids`` through the wire; returns the handle."""
    response = session.compile(lowered_program(lambda x: x * 2, np.zeros((2, 3), np.float32), device_ids))
    assert _status(response)[0] == 0, _status(response)
    return response.compile_response.loaded_executable_handle


def test_a_well_formed_session_round_trips(wire):
    value = np.arange(6, dtype=np.float32).reshape(2, 3)
    _put(wire, 10, value)
    assert np.frombuffer(_read(wire, 10, 11), np.float32).tolist() == value.ravel().tolist()


def test_unknown_array_handle_is_not_found_and_the_session_goes_on(wire):
    response = wire.call(
        "copy_to_host_buffer_request",
        wire.messages.proxy.CopyToHostBufferRequest(array_handle=4242, host_buffer_handle=5),
    )
    code, message = _status(response)
    assert code == grpc.StatusCode.NOT_FOUND.value[0]
    assert "4242" in message
    test_a_well_formed_session_round_trips(wire)


def test_unknown_executable_handle(wire):
    request = wire.messages.proxy.LoadedExecutableExecuteRequest(loaded_executable_handle=777, args_handles=[1])
    code, message = _status(wire.call("loaded_executable_execute_request", request))
    assert code == grpc.StatusCode.NOT_FOUND.value[0]
    assert "777" in message


def test_unknown_future_handle(wire):
    request = wire.messages.proxy.CheckFutureRequest(future_handle=99)
    code, message = _status(wire.call("check_future_request", request))
    assert code == grpc.StatusCode.NOT_FOUND.value[0]
    assert "99" in message


def test_request_with_no_operation_and_unimplemented_kinds(wire):
    code, message = _status(wire.call("init_request", wire.messages.proxy.InitRequest()))
    assert code == 0
    empty = wire.messages.proxy.IfrtRequest()
    empty.request_metadata.op_id = 1000
    wire.send_raw(empty.SerializeToString())
    response = wire.receive()
    assert response.response_metadata.op_id == 1000
    assert response.response_metadata.status.code == grpc.StatusCode.UNIMPLEMENTED.value[0]
    poll = wire.messages.proxy.LoadedHostCallbackPollRequest(loaded_host_callback_handle=1)
    code, message = _status(wire.call("loaded_host_callback_poll_request", poll))
    assert code == grpc.StatusCode.UNIMPLEMENTED.value[0]
    assert "loaded_host_callback_poll_request" in message


def test_wrong_size_and_dtype_fail_on_use_with_the_reason(wire):
    wire.store_host_buffer(20, b"\x00" * 10)  # float32[2, 3] needs 24 bytes
    wire.call("make_array_from_host_buffer_request", _array_request(wire, 20))
    response = wire.call("check_value_ready_request", wire.messages.proxy.CheckValueReadyRequest(value_handles=[20]))
    code, message = _status(response)
    assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "10 bytes" in message and "24" in message
    response = wire.call("make_array_from_host_buffer_request", _array_request(wire, 21, kind=99))
    code, message = _status(response)
    assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "string" in message


def _copy_to_host(session, array_handle: int, host_handle: int):
    request = session.messages.proxy.CopyToHostBufferRequest(array_handle=array_handle, host_buffer_handle=host_handle)
    return session.call("copy_to_host_buffer_request", request)


def test_a_read_is_answered_before_its_bytes_exist_and_the_lookup_waits_for_them(wire):
    """The stock client looks the bytes up only after this answer: it need not wait for the read."""
    wire.call("make_array_from_host_buffer_request", _array_request(wire, 80))  # its upload comes later
    assert _status(_copy_to_host(wire, 80, 81)) == (0, "")
    value = np.arange(6, dtype=np.float32).reshape(2, 3)
    wire.store_host_buffer(80, value.tobytes())
    assert np.frombuffer(wire.lookup_host_buffer(81), np.float32).tolist() == value.ravel().tolist()
    wire.delete_host_buffer(81)
    with pytest.raises(grpc.RpcError) as error:
        wire.lookup_host_buffer(81)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_read_that_fails_after_its_answer_fails_the_lookup_with_the_reason(wire):
    wire.call("make_array_from_host_buffer_request", _array_request(wire, 82))
    assert _status(_copy_to_host(wire, 82, 83)) == (0, "")
    wire.store_host_buffer(82, b"\x00" * 10)  # float32[2, 3] needs 24 bytes
    with pytest.raises(grpc.RpcError) as error:
        wire.lookup_host_buffer(83)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "10 bytes" in error.value.details() and "24" in error.value.details()
    wire.delete_host_buffer(83)  # the stock client deletes after every lookup: no second error
    test_a_well_formed_session_round_trips(wire)


def test_a_read_into_a_host_buffer_handle_in_use_is_refused(wire):
    _put(wire, 84, np.ones((2, 3), np.float32))
    assert _status(_copy_to_host(wire, 84, 85)) == (0, "")
    code, message = _status(_copy_to_host(wire, 84, 85))
    assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "85" in message and "already in use" in message
    assert np.frombuffer(wire.lookup_host_buffer(85), np.float32).tolist() == [1.0] * 6


def test_upload_that_never_comes_times_out_with_a_clear_error(wire):
    started = time.monotonic()
    wire.call("make_array_from_host_buffer_request", _array_request(wire, 30))
    response = wire.call("check_value_ready_request", wire.messages.proxy.CheckValueReadyRequest(value_handles=[30]))
    code, message = _status(response)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert "host buffer 30" in message and "did not arrive" in message
    assert 4 < time.monotonic() - started < 30
    test_a_well_formed_session_round_trips(wire)


def test_upload_shorter_than_declared_is_refused(wire):
    with pytest.raises(grpc.RpcError) as error:
        wire.store_host_buffer(40, b"\x01" * 8, declared_size=100)
    assert error.value.code() == grpc.StatusCode.DATA_LOSS
    test_a_well_formed_session_round_trips(wire)


def test_execute_with_arguments_on_other_devices_is_refused(wire):
    program = _compile(wire, [0])
    _put(wire, 50, np.ones((2, 3), np.float32), device=1)
    request = wire.messages.proxy.LoadedExecutableExecuteRequest(loaded_executable_handle=program, args_handles=[50])
    code, message = _status(wire.call("loaded_executable_execute_request", request))
    assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "devices [1]" in message and "[0]" in message
    _put(wire, 51, np.ones((2, 3), np.float32), device=0)
    request = wire.messages.proxy.LoadedExecutableExecuteRequest(
        loaded_executable_handle=program, args_handles=[51], result_array_handle=[52]
    )
    assert _status(wire.call("loaded_executable_execute_request", request))[0] == 0
    assert np.frombuffer(_read(wire, 52, 53), np.float32).tolist() == [2.0] * 6


def test_a_failed_execute_poisons_its_result_handles(wire):
    program = _compile(wire, [0])
    request = wire.messages.proxy.LoadedExecutableExecuteRequest(
        loaded_executable_handle=program, args_handles=[999], result_array_handle=[60]
    )
    assert _status(wire.call("loaded_executable_execute_request", request))[0] == grpc.StatusCode.NOT_FOUND.value[0]
    response = wire.call("check_value_ready_request", wire.messages.proxy.CheckValueReadyRequest(value_handles=[60]))
    code, message = _status(response)
    assert code == grpc.StatusCode.NOT_FOUND.value[0]
    assert "999" in message


def test_reused_handle_is_refused(wire):
    _put(wire, 70, np.zeros((2, 3), np.float32))
    wire.store_host_buffer(71, np.zeros((2, 3), np.float32).tobytes())
    request = _array_request(wire, 71)
    request.array_handle = 70
    code, message = _status(wire.call("make_array_from_host_buffer_request", request))
    assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "70" in message and "already in use" in message


def test_malformed_bytes_end_only_that_stream(proxy_server, wire):
    with WireSession(proxy_server.address) as bad:
        bad.send_raw(b"\xff\xff\xff\xff not a protobuf")
        with pytest.raises(grpc.RpcError) as error:
            bad.receive()
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed IfrtRequest" in error.value.details()
    test_a_well_formed_session_round_trips(wire)


def test_version_outside_the_supported_range_is_refused(proxy_server):
    from pathways_nb.protocol import schema

    messages = schema.load()
    channel = grpc.insecure_channel(proxy_server.address.removeprefix("grpc://"))
    get_version = channel.unary_unary(
        "/xla.ifrt.proxy.GrpcIfrtService/GetVersion",
        request_serializer=messages.proxy.GrpcGetVersionRequest.SerializeToString,
        response_deserializer=messages.proxy.GrpcGetVersionResponse.FromString,
    )
    request = messages.proxy.GrpcGetVersionRequest()
    request.min_version.protocol_version, request.max_version.protocol_version = 3, 9
    with pytest.raises(grpc.RpcError) as error:
        get_version(request)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "3-9" in error.value.details() and "jax" in error.value.details()
    request.min_version.protocol_version, request.max_version.protocol_version = 10, 40
    assert get_version(request).version.protocol_version == 25
    channel.close()
