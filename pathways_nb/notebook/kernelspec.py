"""Installing the "Python 3 (Pathways)" kernel (``pathways-nb kernel install``)."""

from __future__ import annotations

import json
import pathlib
import shutil
import sys
import tempfile

KERNEL_NAME = "pathways"
SOURCE = pathlib.Path(__file__).resolve().parent.parent.parent / "kernels" / KERNEL_NAME


def kernel_source() -> pathlib.Path:
    """The kernel's folder (kernel.json and logos): the checkout's, or the one pip installed."""
    installed = pathlib.Path(sys.prefix) / "share" / "jupyter" / "kernels" / KERNEL_NAME
    return SOURCE if SOURCE.exists() else installed


def install(user: bool = False, prefix: str | None = None, name: str = KERNEL_NAME) -> str:
    """Installs the kernelspec (for this Python) and returns where it went."""
    from jupyter_client.kernelspec import KernelSpecManager

    with tempfile.TemporaryDirectory() as staging:
        target = pathlib.Path(staging) / name
        shutil.copytree(kernel_source(), target)
        spec = json.loads((target / "kernel.json").read_text())
        spec["argv"][0] = sys.executable  # the Python that has pathways-nb
        (target / "kernel.json").write_text(json.dumps(spec, indent=1))
        return KernelSpecManager().install_kernel_spec(str(target), name, user=user, prefix=prefix)
