"""Installing the "Python 3 (Pathways)" kernel (``pathways-nb kernel install``)."""

from __future__ import annotations

import argparse
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


def add_parser(commands, common: argparse.ArgumentParser) -> None:
    """The ``kernel`` commands (``install``), among ``commands``; ``common``: every command's flags."""
    kernel = commands.add_parser("kernel", parents=[common], help="the Jupyter kernel")
    kernel_commands = kernel.add_subparsers(dest="kernel_command", required=True)
    install_command = kernel_commands.add_parser(
        "install", parents=[common], help='install the "Python 3 (Pathways)" kernel'
    )
    where = install_command.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="for this user only")
    where.add_argument("--sys_prefix", action="store_true", help="in this Python environment")
    where.add_argument("--prefix", default=None, help="under this prefix")
    install_command.add_argument("--name", default="pathways", help="the kernel's name")
    install_command.set_defaults(run=run_install)


def run_install(args: argparse.Namespace) -> int:
    """``kernel install``: installs the kernelspec where the flags say, and says where."""
    prefix = sys.prefix if args.sys_prefix else args.prefix
    where = install(user=args.user, prefix=prefix, name=args.name)
    print(f'installed the "Python 3 (Pathways)" kernel in {where}')
    return 0
