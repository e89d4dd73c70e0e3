"""Where servers write what clients ask them to keep: profiles, checkpoints.

Every server of a cluster (workers, the proxy) writes under one directory, its ``--storage_root``.
A client names places as Pathways on Cloud does, ``gs://bucket/path``, which a local cluster maps to
``<storage_root>/bucket/path``; a local path is accepted only if it lies inside the root. Either way
the place is checked twice: lexically where the request arrives (``check_location``: no ``..``, a
plausible bucket, a bounded length), and against the file system where the write happens
(``StorageRoot.resolve``: the resolved path, symlinks followed, stays inside the resolved root), so
a tenant never writes elsewhere on a server.

Where a server can reach the real buckets (GCS FUSE mounts them as ``/gcs/<bucket>`` on Vertex AI
and on GKE with the Cloud Storage FUSE CSI driver), ``--storage_root /gcs`` makes the same
requests write to Cloud Storage itself.
"""

from __future__ import annotations

import getpass
import os
import re
import tempfile
from pathlib import Path, PurePosixPath

from pathways_nb.protocol.errors import InvalidRequest, PermissionDenied

GCS_SCHEME = "gs://"
# A Cloud Storage bucket name (3-222 characters; dots allowed, as in domain-named buckets).
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")
_MAX_LOCATION_CHARS = 4096


def user_directory() -> Path:
    """This user's pathways-nb directory in the temp dir (the default storage root, running clusters' records)."""
    return Path(tempfile.gettempdir()) / f"pathways-nb-{getpass.getuser()}"


def default_root() -> Path:
    """Where a server started on its own (no ``--storage_root``) writes: a directory of this user's in the temp dir."""
    return user_directory() / "storage"


def check_location(location: str) -> str:
    """``location`` if it is a well-formed ``gs://bucket/path`` or absolute local path, else a clear error.

    Lexical only (no file system access), so the proxy can refuse a bad request before any worker sees it.
    """
    if not isinstance(location, str) or not location:
        raise InvalidRequest("the storage location is empty; name a gs://bucket/path under the cluster's storage root")
    if len(location) > _MAX_LOCATION_CHARS or "\0" in location:
        raise InvalidRequest(
            f"the storage location is {len(location)} characters or holds a NUL byte; "
            f"name a gs://bucket/path of at most {_MAX_LOCATION_CHARS} characters"
        )
    if location.startswith(GCS_SCHEME):
        bucket, _, rest = location[len(GCS_SCHEME) :].partition("/")
        if not _BUCKET.fullmatch(bucket):
            raise InvalidRequest(
                f"{location!r} does not start with a valid bucket name; write gs://BUCKET/path, "
                "BUCKET of 3-222 lowercase letters, digits, '.', '-' or '_'"
            )
        _check_parts(location, rest)
        return location
    if "://" in location:
        raise InvalidRequest(f"{location!r}: only gs:// locations and local paths under the storage root are served")
    if not location.startswith("/"):
        raise InvalidRequest(
            f"{location!r} is a relative path; name a gs://bucket/path, or an absolute path inside the "
            "cluster's storage root"
        )
    _check_parts(location, location)
    return location


def _check_parts(location: str, path: str) -> None:
    if any(part in ("..", ".") for part in PurePosixPath(path).parts) or "/./" in path or path.endswith("/."):
        raise InvalidRequest(f"{location!r} contains '.' or '..'; name the place itself, without relative parts")


class StorageRoot:
    """One server's storage root: resolves client locations to paths inside it, and refuses the others."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).expanduser().absolute()

    def __repr__(self) -> str:
        return f"StorageRoot({str(self.root)!r})"

    def resolve(self, location: str) -> Path:
        """The path of ``location`` under the root (created directories included); refused if it would leave it.

        ``gs://bucket/p`` is ``<root>/bucket/p``; a local path must already name a place inside the
        root. Symlinks are followed before the check, so a link inside the root that points out of
        it is refused too.
        """
        check_location(location)
        if location.startswith(GCS_SCHEME):
            candidate = self.root / location[len(GCS_SCHEME) :]
        else:
            candidate = Path(location)
        self.root.mkdir(parents=True, exist_ok=True)
        real_root = self.root.resolve()
        resolved = candidate.resolve()
        if not _inside(resolved, real_root) and not _inside(candidate.absolute(), self.root):
            raise PermissionDenied(
                f"{location!r} is outside this server's storage root {self.root}; name a gs://bucket/path "
                "(it maps to <storage_root>/bucket/path) or a path inside the root"
            )
        if not _inside(resolved, real_root):
            raise PermissionDenied(
                f"{location!r} leads out of this server's storage root {self.root} through a symbolic link; "
                "it is refused"
            )
        return resolved

    def directory(self, location: str) -> Path:
        """``resolve(location)``, created as a directory (and checked again once it exists)."""
        path = self.resolve(location)
        path.mkdir(parents=True, exist_ok=True)
        return self.resolve(location)

    def write(self, directory: Path, name: str, data: bytes) -> Path:
        """Writes ``data`` to ``directory/name`` at once (a temporary file renamed), never through a symlink."""
        if "/" in name or name in ("", ".", ".."):
            raise InvalidRequest(f"{name!r} is not a plain file name")
        if not _inside(directory.resolve(), self.root.resolve()):
            raise PermissionDenied(f"{directory} is outside this server's storage root {self.root}")
        target = directory / name
        handle, temporary = tempfile.mkstemp(prefix=f".{name}.", dir=directory)
        try:
            with os.fdopen(handle, "wb") as f:
                f.write(data)
            os.replace(temporary, target)  # replaces a symlink named ``name`` itself, never its target
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        return target


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents
