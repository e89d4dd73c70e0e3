"""Programs that are not XLA: the stock client's PluginProgram through both backends, and bad ones refused.

The stock client compiles and runs them through pathwaysutils' own ``PluginExecutable`` (the real
package), as Pathways on Cloud is driven; malformed programs go through the raw wire.
"""

from __future__ import annotations

import itertools
import json
import os
import uuid

import jax
import numpy as np
import pytest
from jax import numpy as jnp
from pathwaysutils.plugin_executable import PluginExecutable
from test_wire import _put, _read, _status

from pathways_nb.core import nonxla, string_arrays
from pathways_nb.protocol import dtypes
from pathways_nb.testing import WireSession


def _profile_request(location: str, session_name: str, hosts: int = 1) -> dict:
    return {
        "traceLocation": location,
        "maxNumHosts": hosts,
        "includeResourceManagers": False,
        "xprofTraceOptions": {"traceDirectory": location, "traceSessionName": session_name},
    }


def _call(executable: PluginExecutable) -> list:
    """One execution, as pathwaysutils makes it: one (1,) string result on the default device, status awaited."""
    default = jax.devices("proxy")[0]
    out_avals = [jax.core.ShapedArray((1,), jnp.object_)]
    arrays, status = executable.call(out_avals=out_avals, out_shardings=[jax.sharding.SingleDeviceSharding(default)])
    status.result(timeout=120)
    return arrays


def test_a_plugin_program_compiles_and_runs_through_the_stock_client(backend, connected):
    run = uuid.uuid4().hex[:8]
    with jax.default_device(jax.devices("proxy")[0]):
        executable = PluginExecutable(json.dumps({"profileRequest": _profile_request(f"gs://bucket/{run}", "s")}))
        (started,) = _call(executable)
        (stopped,) = _call(executable)  # the same executable: its second execution stops the trace
    assert started.shape == (1,) and "tracing island0-host0" in np.asarray(started)[0]
    written = np.asarray(stopped)[0]
    expected = os.path.join(backend.storage_root, "bucket", run, "plugins", "profile", "s", "island0-host0.xplane.pb")
    assert os.path.realpath(written) == os.path.realpath(expected)
    assert os.path.getsize(expected) > 0
    # The session serves ordinary programs after it.
    x = jax.device_put(np.arange(4.0, dtype=np.float32), jax.devices("proxy")[0])
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda v: v * 2)(x)), np.arange(4.0) * 2)


@pytest.fixture
def wire(proxy_server):
    with WireSession(proxy_server.address) as session:
        yield session


def _compile_plugin(session, data: bytes, type_name: str = "xla::ifrt::PluginProgram"):
    request = session.messages.proxy.CompileRequest()
    request.program.type_name = type_name
    request.program.data = data
    request.compile_options.type_name = "xla::ifrt::PluginCompileOptions"
    return session.call("compile_request", request)


_HANDLES = itertools.count(900)


def _serves(session) -> None:
    """The session still round-trips an array (the server survived what came before)."""
    value = np.arange(6, dtype=np.float32).reshape(2, 3)
    handle = next(_HANDLES)
    _put(session, handle, value)
    assert _read(session, handle, handle + (1 << 30)) == value.tobytes()


@pytest.mark.parametrize(
    "data, words",
    [
        (b'{"profileRequest": {}}', "must start with '__serialized_plugin_program '"),
        (nonxla.PLUGIN_PREFIX + b"{not json", "does not parse"),
        (nonxla.PLUGIN_PREFIX + b'["profileRequest"]', "exactly one key"),
        (nonxla.PLUGIN_PREFIX + b'{"a": 1, "b": 2}', "exactly one key"),
        (nonxla.PLUGIN_PREFIX + b'{"no_such_request": {}}', "no handler for 'no_such_request'"),
        (nonxla.PLUGIN_PREFIX + b"\xff\xfe", "does not parse"),
        (nonxla.PLUGIN_PREFIX + b'{"profileRequest": ' + b"[" * 100000 + b"]" * 100000 + b"}", "does not parse"),
        (nonxla.PLUGIN_PREFIX + json.dumps({"profileRequest": {"x": "y" * (10 << 20)}}).encode(), "MiB allowed"),
        (nonxla.PLUGIN_PREFIX + b'{"profileRequest": []}', "must be a JSON object"),
        (nonxla.PLUGIN_PREFIX + b'{"profileRequest": {}}', "needs a traceLocation"),
        (nonxla.PLUGIN_PREFIX + b'{"profileRequest": {"traceLocation": "gs://bucket/../x"}}', "'..'"),
        (nonxla.PLUGIN_PREFIX + b'{"profileRequest": {"traceLocation": "gs://bucket/p", "maxNumHosts": "1"}}', "int"),
        (
            nonxla.PLUGIN_PREFIX
            + b'{"profileRequest": {"traceLocation": "gs://bucket/p", "devices": {"deviceIds": [99]}}}',
            "does not hold",
        ),
    ],
)
def test_a_bad_plugin_program_is_refused_with_the_reason_and_the_server_goes_on(wire, data, words):
    code, message = _status(_compile_plugin(wire, data))
    assert code == 3, message  # INVALID_ARGUMENT
    assert "Bad PluginProgram" in message and words in message, message
    assert "profileRequest" in message, message  # the key, or the keys this server knows
    _serves(wire)


def test_a_bad_custom_call_program_is_refused(wire):
    code, message = _status(_compile_plugin(wire, b"\xff\x00garbage", "xla::ifrt::CustomCallProgram"))
    assert code == 3 and "Bad CustomCallProgram" in message, message
    program = wire.messages.ifrt.CustomCallProgramProto(type="no_such_type")
    code, message = _status(_compile_plugin(wire, program.SerializeToString(), "xla::ifrt::CustomCallProgram"))
    assert code == 3 and "no_such_type" in message, message
    _serves(wire)


def test_a_string_result_reads_back_as_the_client_reads_it(wire, proxy_server):
    run = uuid.uuid4().hex[:8]
    text = json.dumps({"profileRequest": _profile_request(f"gs://bucket/{run}", "w")})
    compiled = _compile_plugin(wire, nonxla.PLUGIN_PREFIX + text.encode())
    assert _status(compiled) == (0, ""), _status(compiled)
    handle = compiled.compile_response.loaded_executable_handle
    metadata = wire.call(
        "loaded_executable_metadata_request",
        wire.messages.proxy.LoadedExecutableMetadataRequest(loaded_executable_handle=handle),
    ).loaded_executable_metadata_response
    assert metadata.output_layouts_error.code == 12 and not metadata.donated_input_indices.donated_input_indices

    texts = []
    for execution in range(2):
        request = wire.messages.proxy.LoadedExecutableExecuteRequest(loaded_executable_handle=handle)
        request.execute_options.fill_status = True
        response = wire.call("loaded_executable_execute_request", request).loaded_executable_execute_response
        (output,) = response.outputs
        assert output.dtype.kind == dtypes.STRING_KIND and list(output.shape.dims) == [1]
        assert response.status_handle
        host_handle = (1 << 40) + execution
        contents = _read(wire, output.array_handle, host_handle)
        texts.append(np.asarray(string_arrays.decode(contents, (1,)))[0].decode())
    assert texts[0].startswith("tracing island0-host0")
    assert texts[1].endswith("island0-host0.xplane.pb") and os.path.exists(texts[1])

    # A non-XLA program takes no arguments it did not plan for.
    request = wire.messages.proxy.LoadedExecutableExecuteRequest(loaded_executable_handle=handle, args_handles=[7])
    code, message = _status(wire.call("loaded_executable_execute_request", request))
    assert code == 5 and "unknown array handle" in message, message
