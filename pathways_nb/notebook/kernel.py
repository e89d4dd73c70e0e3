"""The "Python 3 (Pathways)" kernel: an IPython kernel with the ``%pathways`` magics loaded.

With ``PATHWAYS_ADDRESS`` set it connects at start; otherwise (or if that
fails) its first output says how to connect.
"""

from __future__ import annotations

import os

# jaxlib's C++ client logs its connection warnings straight to stderr, which a notebook shows in the
# cell; keep warnings out unless the user asked for them. (Must precede jax's import.)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from ipykernel.ipkernel import IPythonKernel
from ipykernel.kernelapp import IPKernelApp

from pathways_nb._version import __version__
from pathways_nb.client.connection import ADDRESS_ENV, connect
from pathways_nb.errors import PathwaysError

HINT = (
    "Pathways kernel: not connected. Run %pathways connect ADDRESS, or %pathways connect local to start a cluster here."
)


class PathwaysKernel(IPythonKernel):
    implementation = "pathways-nb"
    implementation_version = __version__
    banner = f"Python 3 (Pathways) - pathways-nb {__version__}"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.shell.extension_manager.load_extension("pathways_nb")
        message = HINT
        address = os.environ.get(ADDRESS_ENV)
        if address:
            try:
                session = connect(address)
                message = f"Pathways kernel: connected to {session.address} ({len(session.devices)} devices)."
            except PathwaysError as error:
                message = f"Pathways kernel: could not connect to ${ADDRESS_ENV}={address}: {error}"
        self._first_cell_message = message
        self.shell.events.register("pre_run_cell", self._say_once)

    def _say_once(self, info=None) -> None:
        """Prints the connection status before the first cell, unless that cell is about connecting."""
        self.shell.events.unregister("pre_run_cell", self._say_once)
        if self._first_cell_message == HINT and "%pathways" in getattr(info, "raw_cell", ""):
            return
        print(self._first_cell_message)


def main() -> None:
    IPKernelApp.launch_instance(kernel_class=PathwaysKernel)


if __name__ == "__main__":
    main()
