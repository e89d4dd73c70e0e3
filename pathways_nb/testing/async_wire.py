"""``WireSession``'s requests over grpc.aio: many sessions as coroutines of one event loop.

Sessions that are threads of one process share its GIL, and which thread gets
it next is the OS's choice: a CI run gave two sessions of one process 18
and 144 rounds, which need not be the proxy's doing. Coroutines of
one loop take turns in the order their replies came, so what differs between
them is the servers' doing. Each session has a connection of its own, as a
client process has.
"""

from __future__ import annotations

import contextlib

import grpc

from pathways_nb.testing.wire_requests import WireRequests, expect_reply, read_status_checked

# Channels of one process share connections unless told not to; a session here stands for a process.
_OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)


class AsyncWireSession(WireRequests):
    """One IFRT proxy session over grpc.aio; ``await AsyncWireSession.open(address)``, then one call at a time."""

    def __init__(self, address: str, protocol_version: int = 25, serdes_version: int = 0):
        super().__init__(protocol_version, serdes_version)
        self.channel = grpc.aio.insecure_channel(address.removeprefix("grpc://"), options=_OWN_CONNECTION)
        self._stream = self.stub(self.channel, "IfrtSession")(metadata=self.session_metadata())
        self._store = self.stub(self.channel, "HostBufferStore")
        self._lookup = self.stub(self.channel, "HostBufferLookup")
        self._delete = self.stub(self.channel, "HostBufferDelete")
        self.init_response = None

    @classmethod
    async def open(cls, address: str) -> AsyncWireSession:
        """A session whose init request the proxy has answered."""
        session = cls(address)
        try:
            reply = await session.call("init_request", session.messages.proxy.InitRequest())
        except BaseException:
            await session.close()
            raise
        session.init_response = reply.init_response
        session.session_id = session.init_response.session_id
        return session

    async def call(self, kind: str, body):
        """Sends one request and returns its reply (no other reply may be outstanding)."""
        op_id, data = self.request(kind, body)
        await self._stream.write(data)
        response = await self._stream.read()
        if response is grpc.aio.EOF:
            raise ConnectionError(f"the proxy ended session {self.session_id}'s stream: {await self._stream.code()}")
        return expect_reply(response, op_id)

    async def make_array(self, handle: int, value, device: int) -> None:
        """Uploads ``value`` (a numpy array) and makes it array ``handle`` on ``device``."""
        data = value.tobytes()
        await self._store(iter(self.store_chunks(data)), metadata=self.store_metadata(handle, len(data)))
        await self.call("make_array_from_host_buffer_request", self.value_request(handle, value, device))

    async def read_array(self, array_handle: int, host_handle: int) -> bytes:
        """The bytes of an array, through host buffer ``host_handle`` (deleted afterwards)."""
        response = await self.call("copy_to_host_buffer_request", self.copy_request(array_handle, host_handle))
        read_status_checked(response, array_handle)
        data = b"".join([chunk.data async for chunk in self._lookup(self.lookup_request(host_handle))])
        await self._delete(self.delete_request(host_handle))
        return data

    async def compile(self, program: tuple[bytes, bytes]):
        """The CompileResponse for ``program`` (from ``lowered_program``)."""
        return await self.call("compile_request", self.compile_request(program))

    async def execute(self, executable: int, args: list[int], results: list[int]):
        return await self.call("loaded_executable_execute_request", self.execute_request(executable, args, results))

    async def destruct(self, handles: list[int]) -> None:
        """Forgets arrays, as the client does when it drops them."""
        await self.call("destruct_array_request", self.destruct_request(handles))

    async def close(self) -> None:
        """Ends the session's stream (the proxy ends the session) and closes its connection."""
        with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):  # the stream had ended already
            await self._stream.done_writing()
        await self.channel.close()
