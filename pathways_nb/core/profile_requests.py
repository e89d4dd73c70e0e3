"""What each traced process of a profile (``profileRequest``) is told, and what it does with it.

The proxy half of ``profileRequest`` turns pathwaysutils' request into one JSON request per
execution, ``{"action": "start" | "stop" | "abort", "trace": ..., "location": ..., ...}``; each
traced process runs it with ``run_trace``: the hosts (the host half), and the proxy itself
with ``includeResourceManagers``. Both sides use this module.
"""

from __future__ import annotations

import logging

from pathways_nb.core.host_profiler import PROFILER, TraceOptions, storage_writer
from pathways_nb.core.nonxla import HostContext

_LOGGER = logging.getLogger(__name__)

KEY = "profileRequest"


def trace_options(request: dict) -> TraceOptions:
    """The trace options of a host's start request."""
    return TraceOptions(
        request["hostTraceLevel"], request["pythonTracer"], request["advanced"], request["maxDurationSecs"]
    )


def run_trace(request: dict, context: HostContext) -> str:
    """Starts or stops this process's trace as ``request`` says; what happened, in words."""
    if request["action"] == "abort":
        PROFILER.abort(request["trace"])
        return "aborted"
    if request["action"] == "start":
        directory, write = storage_writer(context.storage, request["location"], request["session"], context.name)
        PROFILER.start(
            request["trace"], request["tenant"] or context.tenant, trace_options(request), context.name, write
        )
        return f"tracing {context.name} into {directory}"
    written = PROFILER.stop(request["trace"], context.name)
    _LOGGER.info("wrote %s (%d bytes in %.2f s)", written.path, written.nbytes, written.seconds)
    return str(written.path)
