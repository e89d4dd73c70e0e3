"""Bytes between two processes of one host through files in a private shared-memory directory.

gRPC copies every byte several times (serialize, HTTP/2 frames, parse). When
both ends see the same tmpfs and the same network namespace, the sender
writes the bytes to a file in a directory only this user can enter, sends its
name, and the receiver maps the file and removes it: one copy in all.

Two processes use this only when it is proven, not guessed: the receiver
checks that the path lies in its own private root (same user, mode 0700) and
that the file is a regular file of the declared size. Hosts that are really
separate (other machines, or other network namespaces as in
tests/test_netns.py) have different ``host_key()`` values and keep to gRPC.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import mmap
import os
import shutil
import stat
import tempfile
import threading
import weakref
from pathlib import Path

import numpy as np

_LOGGER = logging.getLogger(__name__)

# Where private directories are made; default /dev/shm (tmpfs: memory, never a disk).
ROOT_ENV = "PATHWAYS_SHM_ROOT"
# PATHWAYS_SHARED_MEMORY=0: this process never passes bytes through shared memory (gRPC only).
ENABLE_ENV = "PATHWAYS_SHARED_MEMORY"
_DEFAULT_PARENT = "/dev/shm"

# Files kept behind the mappings ``take(..., keep=outbox)`` made, by mapping (weakly): such a file
# can be handed on whole to another process of this host without a copy (``Outbox.hand_over``),
# and is removed when its mapping goes otherwise.
_kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_kept_lock = threading.Lock()


class NotShared(OSError):
    """The file cannot be taken through shared memory (wrong place, owner, type or size)."""


def private_root() -> Path | None:
    """This user's directory for transfers (``/dev/shm/pathways-nb-<uid>``, mode 0700), or None if unusable."""
    parent = Path(os.environ.get(ROOT_ENV) or _DEFAULT_PARENT)
    root = parent / f"pathways-nb-{os.getuid()}"
    try:
        root.mkdir(mode=0o700, exist_ok=True)
        info = root.lstat()
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) != 0o700:
        return None  # someone else's, or opened up: never trust it
    return root


def host_key() -> str:
    """Equal for two processes exactly when they share a kernel, a network namespace, a user and the root.

    Empty when this process has no usable private root, or ``PATHWAYS_SHARED_MEMORY=0`` turns it off.
    """
    if os.environ.get(ENABLE_ENV, "").strip() == "0":
        return ""
    root = private_root()
    if root is None:
        return ""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        network_namespace = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return ""
    info = root.stat()
    return f"{boot_id}:{network_namespace}:{info.st_dev}:{info.st_ino}:{os.getuid()}"


class SharedDirectory:
    """A directory of this process inside the private root; removed when closed or at exit."""

    def __init__(self, purpose: str):
        root = private_root()
        if root is None:
            raise NotShared("no private shared-memory directory on this host")
        reap_stale(root)
        self.path = Path(tempfile.mkdtemp(prefix=f"{purpose}-{os.getpid()}-", dir=root))
        atexit.register(self.close)

    def write(self, name: str, data) -> Path:
        """Writes ``data`` (any buffer, or a list of them one after the other) to ``name`` in this directory; the
        reader removes it."""
        path = self.path / name
        with open(path, "wb", opener=lambda p, flags: os.open(p, flags | os.O_EXCL, 0o600)) as file:
            for part in data if isinstance(data, list) else [data]:
                file.write(memoryview(part).cast("B"))
        return path

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class Outbox:
    """Files this process hands to processes of its host, in a ``SharedDirectory`` made on first use.

    Writing never raises: where shared memory fails here (no root, tmpfs full), ``write`` says so in
    a debug log and returns None, and the caller sends the bytes another way.
    """

    def __init__(self, purpose: str):
        self.purpose = purpose
        self.host_key = host_key()
        if self.host_key:
            reap_stale()  # at start: what a killed predecessor left (its directory is made only on first use)
        self._directory: SharedDirectory | None = None
        self._lock = threading.Lock()
        self._names = itertools.count()

    def shares_host(self, other_key: str) -> bool:
        """Whether a process that reported ``other_key`` can take this process's files."""
        return bool(self.host_key) and other_key == self.host_key

    def _new_path(self, prefix: str) -> Path:
        with self._lock:
            if self._directory is None:
                self._directory = SharedDirectory(self.purpose)
            directory = self._directory
        return directory.path / f"{prefix}{next(self._names)}"

    def write(self, prefix: str, data) -> Path | None:
        """``data`` (any buffer, or a list of them) in a new file whose name starts with ``prefix``; None if that
        failed."""
        path = None
        try:
            path = self._new_path(prefix)
            return self._directory.write(path.name, data)
        except OSError as error:
            _LOGGER.debug("shared memory failed here (%s); sending the bytes over gRPC", error)
            if path is not None:
                path.unlink(missing_ok=True)
            return None

    def adopt(self, path: str | os.PathLike) -> Path | None:
        """Moves another process's file into this outbox (one tmpfs: a rename, no copy); None if that failed."""
        try:
            target = self._new_path("kept-")
            os.rename(path, target)
            return target
        except OSError as error:
            _LOGGER.debug("cannot keep %s (%s); it is removed once mapped", path, error)
            return None

    def hand_over(self, prefix: str, data) -> Path | None:
        """The file behind ``data``, renamed to start with ``prefix``, if ``data`` is the whole of a mapping
        ``take(..., keep=self)`` made; else None. The receiver takes the file (or the caller discards it).
        """
        mapping = _mapping_behind(data)
        if mapping is None or not _covers(data, mapping):
            return None
        with _kept_lock:
            kept = _kept.pop(mapping, None)
        if kept is None:
            return None
        path, finalizer = kept
        finalizer.detach()
        try:
            target = self._new_path(prefix)
            os.rename(path, target)
            return target
        except OSError as error:
            _LOGGER.debug("cannot hand %s over (%s); writing a copy", path, error)
            Path(path).unlink(missing_ok=True)
            return None

    def remove(self, prefix: str) -> None:
        """Removes the files not yet taken whose names start with ``prefix`` (their reader is gone)."""
        directory = self._directory
        if directory is None:
            return
        try:
            for path in directory.path.iterdir():
                if path.name.startswith(prefix):
                    path.unlink(missing_ok=True)
        except OSError as error:
            _LOGGER.warning("could not remove the files %s* of %s: %s", prefix, directory.path, error)


def discard(path: str | os.PathLike) -> None:
    """Removes a file of the private root that will not be taken (its message failed or nobody waits for it)."""
    if contains(path):
        Path(path).unlink(missing_ok=True)


def reap_stale(root: Path | None = None) -> list[Path]:
    """Removes the directories of processes that are gone (a SIGKILLed one never ran its atexit); returns them.

    A directory's owner is the pid in its name (``purpose-<pid>-xxxx``).
    """
    root = root or private_root()
    if root is None:
        return []
    reaped = []
    for directory in root.iterdir():
        parts = directory.name.rsplit("-", 2)
        if len(parts) != 3 or not parts[1].isdigit() or _alive(int(parts[1])):
            continue
        shutil.rmtree(directory, ignore_errors=True)
        reaped.append(directory)
    return reaped


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process (it cannot own a directory here, but never guess)
    return True


def contains(path: str | os.PathLike) -> bool:
    """Whether ``path`` is inside this user's private root (what a peer names is checked with this)."""
    root = private_root()
    if root is None:
        return False
    try:
        resolved = Path(path).resolve(strict=False)
    except (OSError, RuntimeError):
        return False
    return resolved.is_relative_to(root.resolve()) and resolved != root.resolve()


def take(path: str | os.PathLike, size: int, keep: Outbox | None = None) -> memoryview:
    """The ``size`` bytes of the file at ``path``, mapped (copy-on-write, so writable); the file is removed.

    With ``keep``, the file moves into that outbox instead and stays while the mapping lives, so
    that ``keep.hand_over`` can pass the same bytes on to another process of this host without a
    copy (a proxy forwarding a client's upload to its worker). Raises ``NotShared`` (and removes
    nothing) if the path is outside the private root, is not a regular file of this user, or has
    another size.
    """
    if not contains(path):
        raise NotShared(f"{path} is not in this user's private shared-memory directory")
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise NotShared(f"cannot open {path}: {e.strerror}") from None
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise NotShared(f"{path} is not a regular file of this user")
        if info.st_size != size:
            raise NotShared(f"{path} holds {info.st_size} bytes, not the {size} declared")
        kept = keep.adopt(path) if keep is not None and size > 0 else None
        if kept is None:
            os.unlink(path)
        if size == 0:
            return memoryview(bytearray())
        mapping = mmap.mmap(descriptor, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        if kept is not None:
            with _kept_lock:
                _kept[mapping] = (kept, weakref.finalize(mapping, discard, kept))
        return memoryview(mapping)
    finally:
        os.close(descriptor)


def _mapping_behind(data) -> mmap.mmap | None:
    """The mapping whose memory ``data`` (a memoryview or numpy array of views of views) is, if any."""
    obj = data
    for _ in range(32):
        if isinstance(obj, mmap.mmap):
            return obj
        obj = obj.obj if isinstance(obj, memoryview) else getattr(obj, "base", None)
        if obj is None:
            return None
    return None


def _covers(data, mapping: mmap.mmap) -> bool:
    """Whether ``data`` is exactly the bytes of ``mapping``: same start, same length."""
    view, whole = np.frombuffer(data, np.uint8), np.frombuffer(mapping, np.uint8)
    return view.nbytes == whole.nbytes and view.ctypes.data == whole.ctypes.data
