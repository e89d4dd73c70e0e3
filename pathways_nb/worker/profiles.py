"""``profileRequest``'s host half: a host starts or stops its own trace (``core.profile_requests``).

The proxy half (``proxy/profiles.py``) says which hosts trace and alternates start and stop; a
host writes ``<traceDirectory>/plugins/profile/<traceSessionName>/<island>-<host>.xplane.pb`` under
its storage root. With ``xprofTraceOptions`` each execution returns one ``(1,)`` string array on the
default device (what pathwaysutils asks for, and discards); without, none.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pathways_nb.core import nonxla
from pathways_nb.core.profile_requests import KEY, run_trace
from pathways_nb.core.string_arrays import StringArray


class ProfileHost(nonxla.HostHalf):
    """Runs one start, stop or abort of the trace on this host."""

    kind = nonxla.PLUGIN
    key = KEY

    def run(
        self,
        request: bytes,
        runtime: Any,
        args: Sequence[Sequence[Any]],
        device_ids: tuple[int, ...],
        results: Sequence[nonxla.ResultSpec],
        context: nonxla.HostContext,
    ) -> list:
        # A host that only holds the result (its devices are not traced) takes part without tracing.
        text = run_trace(json.loads(request), context) if device_ids else ""
        return [StringArray(spec.shape, [text.encode()] * int(spec.shape[0] if spec.shape else 1)) for spec in results]
