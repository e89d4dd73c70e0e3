"""What a session knows about one array handle.

The client chooses most array handles and pipelines its requests, so a handle
is often used before its data exists (the upload is still running, or the
program that makes it waits for its own inputs). An ``ArrayRecord`` is known
from the request that names it (dtype, shape, sharding) and holds the device
array once there is one, or the error that stopped it, which every later use
reports with its original message.
"""

from __future__ import annotations

from pathways_nb.protocol.errors import RequestError
from pathways_nb.protocol.shardings import IfrtSharding
from pathways_nb.proxy.pending import Pending


class ArrayRecord:
    """An array of a session: metadata now, device value or error when known."""

    __slots__ = ("_pending", "deleted", "error", "kind", "shape", "sharding", "value")

    def __init__(self, kind: int, shape: tuple[int, ...], sharding: IfrtSharding, value=None):
        self.kind = kind
        self.shape = shape
        self.sharding = sharding
        self.value = value
        self.error: RequestError | None = None
        self.deleted = False
        self._pending: Pending | None = None if value is not None else Pending()

    @classmethod
    def failed(cls, kind: int, shape: tuple[int, ...], sharding: IfrtSharding, error: RequestError) -> ArrayRecord:
        record = cls(kind, shape, sharding)
        record.fail(error)
        return record

    @property
    def ready(self) -> bool:
        """True once the value or the error is known."""
        return self._pending is None or self._pending.done

    @property
    def pending(self) -> Pending:
        """Done when the value or the error is known."""
        if self._pending is None:
            self._pending = Pending()
            self._pending.resolve(self.value)
        return self._pending

    def set(self, value) -> None:
        self.value = value
        if self._pending is not None:
            self._pending.resolve(value)

    def fail(self, error: RequestError) -> None:
        self.error = error
        if self._pending is None:
            self._pending = Pending()
        self._pending.fail(error)

    def delete(self) -> None:
        """Frees the device memory now, or as soon as the value exists."""
        self.deleted = True
        if self.ready:
            if self.value is not None:
                self.value.delete()
        else:
            self.pending.on_done(lambda value, _error: value is not None and value.delete())

    @property
    def is_deleted(self) -> bool:
        return self.deleted or (self.value is not None and self.value.is_deleted())
