"""``profileRequest``: the plugin program pathwaysutils sends to profile Pathways' own processes.

pathwaysutils 0.1.13 (``profiling.py``) compiles ONE executable from ``{"profileRequest": R}`` and
executes it twice, without arguments: the first execution starts a trace, the second stops it. R:

    {"traceLocation": "gs://b/d", "maxNumHosts": 1, "includeResourceManagers": true,
     "xprofTraceOptions": {"traceDirectory": "gs://b/d", "traceSessionName": "2026_12_01_10_00_00",
                           "hostTraceLevel": 2, "pwTraceOptions": {"enablePythonTracer": true,
                                                                   "advancedConfiguration": {...}}},
     "maxDurationSecs": 60.0, "devices": {"deviceIds": [0, 1]}, "blockUntilStart": true}

This is the proxy half (``ProfilePlanner.plan``): it picks the hosts (those holding
``devices.deviceIds``, else the session's first ``maxNumHosts`` hosts) and checks the place
lexically; each execution of the plan alternates start and stop (``ProfilePlan.execution``), and
with ``includeResourceManagers`` the proxy and the resource manager trace themselves too
(``trace_proxy``). The host half (``worker/profiles.py``) starts or stops a host's trace
(``core.profile_requests.run_trace``). With ``xprofTraceOptions`` each execution returns one
``(1,)`` string array on the default device (what pathwaysutils asks for, and discards); without, none.
"""

from __future__ import annotations

import functools
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from pathways_nb.core import nonxla
from pathways_nb.core.host_profiler import TraceOptions, check_session_name, storage_writer
from pathways_nb.core.profile_requests import KEY, run_trace, trace_options
from pathways_nb.core.storage import check_location
from pathways_nb.protocol import dtypes
from pathways_nb.protocol.errors import InvalidRequest, RequestError
from pathways_nb.protocol.shardings import IfrtSharding
from pathways_nb.rpc import cluster_pb2 as pb

_LOGGER = logging.getLogger(__name__)

# The proxy's own trace and the resource manager's (``trace_proxy``): called with a host's request on
# the proxy, off its event loop; None on the single-process proxy, whose process is the host.
ProxyPart = Callable[[dict], None]


def _field(body: dict, name: str, kinds: tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is default:
        return value
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        wanted = " or ".join(k.__name__ for k in kinds)
        raise InvalidRequest(f"Bad PluginProgram: profileRequest.{name} must be a {wanted}, not {value!r}")
    return value


def _trace_options(request: dict) -> TraceOptions:
    xprof = _field(request, "xprofTraceOptions", (dict,), {})
    pathways = _field(xprof, "pwTraceOptions", (dict,), {})
    level = _field(xprof, "hostTraceLevel", (int,), 2)
    if not 0 <= level <= 3:
        raise InvalidRequest(f"Bad PluginProgram: hostTraceLevel must be 0-3, not {level}")
    advanced = {}
    for key, value in _field(pathways, "advancedConfiguration", (dict,), {}).items():
        if not isinstance(value, dict) or len(value) != 1:
            raise InvalidRequest(f"Bad PluginProgram: advancedConfiguration[{key!r}] must be one typed value")
        ((kind, item),) = value.items()
        if kind not in ("boolValue", "int64Value", "stringValue"):
            raise InvalidRequest(f"Bad PluginProgram: advancedConfiguration[{key!r}] has unknown type {kind!r}")
        advanced[str(key)] = int(item) if kind == "int64Value" else item
    duration = _field(request, "maxDurationSecs", (int, float), 0.0)
    if duration < 0 or duration > 24 * 3600:
        raise InvalidRequest(f"Bad PluginProgram: maxDurationSecs must be 0-86400, not {duration}")
    return TraceOptions(level, bool(_field(pathways, "enablePythonTracer", (bool,), False)), advanced, float(duration))


class ProfilePlan(nonxla.ProgramPlan):
    """One profile executable: its executions start and stop a trace, in turn."""

    def __init__(self, *, trace: dict, proxy_part: ProxyPart | None, **fields):
        super().__init__(**fields)
        self.trace = trace
        self.proxy_part = proxy_part
        self._running: dict | None = None  # the start request of the trace under way

    def execution(self) -> nonxla.Execution:
        starting = self._running is None
        if starting:
            request = {
                **self.trace,
                "action": "start",
                "trace": uuid.uuid4().hex,
                "session": self.trace["session"] or time.strftime("%Y_%m_%d_%H_%M_%S"),
            }
            self._running = request
        else:
            request = {**self._running, "action": "stop"}
            self._running = None

        def finished(error: RequestError | None) -> None:
            if error is not None and starting:
                self._running = None  # the next execution starts again

        on_proxy = None
        if self.proxy_part is not None and self.trace["include_proxy"]:
            on_proxy = functools.partial(self.proxy_part, request)
        # A start that failed on one host (another trace runs there) must not leave the others tracing.
        undo = json.dumps({**request, "action": "abort"}).encode() if starting else None
        return nonxla.Execution(json.dumps(request).encode(), on_proxy, undo, finished)


class ProfilePlanner(nonxla.ProxyHalf):
    """Checks a profile request and plans its traces (on the proxy's compile pool)."""

    kind = nonxla.PLUGIN
    key = KEY

    def plan(self, body: Any, session: nonxla.SessionView) -> ProfilePlan:
        request = nonxla.json_body(body, KEY)
        location = _field(request, "traceLocation", (str,), None)
        xprof = _field(request, "xprofTraceOptions", (dict,), None)
        directory = _field(xprof or {}, "traceDirectory", (str,), location)
        if directory is None:
            raise InvalidRequest("Bad PluginProgram: profileRequest needs a traceLocation (gs://bucket/path)")
        check_location(directory)
        session_name = _field(xprof or {}, "traceSessionName", (str,), "")
        if session_name:
            check_session_name(session_name)
        options = _trace_options(request)
        named = _field(_field(request, "devices", (dict,), {}), "deviceIds", (list,), [])
        if named:
            named = session.check_devices(named, "profileRequest.devices.deviceIds")
            hosts = [h for h in session.hosts if set(h.device_ids) & set(named)]
        else:
            count = _field(request, "maxNumHosts", (int,), 1)
            if count < 0:
                raise InvalidRequest(f"Bad PluginProgram: maxNumHosts must be >= 0, not {count}")
            hosts = list(session.hosts[: count or None])
        default = session.default_device_id
        device_ids = (default, *(d for d in named if d != default))
        outputs = ()
        if xprof is not None:  # pathwaysutils then asks for one (1,) string result on the default device
            outputs = (nonxla.OutputSpec(dtypes.STRING_KIND, (1,), IfrtSharding((default,))),)
        trace = {
            "location": directory,
            "session": session_name,
            "hostTraceLevel": options.host_tracer_level,
            "pythonTracer": options.python_tracer,
            "advanced": options.advanced,
            "maxDurationSecs": options.max_duration_s,
            "tenant": session.tenant,
            "include_proxy": bool(_field(request, "includeResourceManagers", (bool,), False)),
        }
        return ProfilePlan(
            trace=trace,
            proxy_part=None if session.proxy_is_host else functools.partial(trace_proxy, session.runtime),
            kind=self.kind,
            key=self.key,
            name="profile",
            device_ids=device_ids,
            outputs=outputs,
            request=b"",
            host_device_ids=tuple(d for host in hosts for d in host.device_ids),
        )


def trace_proxy(runtime: Any, request: dict) -> None:
    """On a cluster's proxy: traces the proxy itself and the resource manager, beside the hosts.

    The proxy's trace is ``proxy.xplane.pb``; the resource manager's comes back with its stop and is
    written beside it as ``resource-manager.xplane.pb``. The resource manager's part is best effort
    (one that cannot trace, an older one, is logged): it is not what a profile is taken for.
    """
    context = runtime.host.for_tenant(request["tenant"])
    run_trace(request, context)
    start = request["action"] == "start"
    if request["action"] == "abort":
        return
    options = trace_options(request)
    control = pb.ProfileControl(
        start=start,
        trace=request["trace"],
        owner=context.tenant,
        host_tracer_level=options.host_tracer_level,
        python_tracer=options.python_tracer,
        max_duration_s=options.max_duration_s,
    )
    try:
        xspace = runtime.profile_resource_manager(control)
    except RequestError as error:
        _LOGGER.warning("the resource manager's part of the trace is missing: %s", error.message)
        return
    if not start and xspace:
        _, write = storage_writer(context.storage, request["location"], request["session"], "resource-manager")
        write(xspace)
