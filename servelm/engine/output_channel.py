"""The engine process's messages to the front end: length-prefixed pickles over a Unix stream socket.

Why not ZMQ, which carries the front end's messages the other way: a ZMQ send is handed to the
sender's I/O thread, which writes the socket, and the receiver's I/O thread reads it and wakes the
receiving thread: three thread wake-ups per engine step, on the cores the next forward pass runs
on (two on the development box, where every wake-up preempts a model thread). A plain socket write
from the engine wakes the front end's event loop alone. The engine sends one message per step;
the front end sends rarely (requests, aborts, calls), so its direction stays on ZMQ.

Invariants:
- A message is an 8-byte little-endian length, then that many bytes of pickle; the engine writes
  whole messages from its one loop thread, the front end reads them in order from one task.
- The front end listens before the engine process is sent its job; the engine connects once, first
  thing. A second connection is refused (closed).
- The engine's end blocks only when the front end has stopped reading and the socket's buffer
  (``SEND_BUFFER_BYTES``) is full; ZMQ queued without bound instead.
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct
from typing import Any

HEADER = struct.Struct("<Q")
"""Each message's length in bytes."""
SEND_BUFFER_BYTES = 4 << 20
"""The engine end's socket buffer, as asked (the OS caps it at ``net.core.wmem_max``): many steps'
outputs (a 32-stream step pickles to a few KB), so a front end busy for a moment never stalls a step."""


class OutputWriter:
    """The engine process's end: ``send_pyobj`` writes one message (blocking)."""

    def __init__(self, path: str) -> None:
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        self._socket.connect(path)

    def send_pyobj(self, message: Any) -> None:
        data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        self._socket.sendall(HEADER.pack(len(data)) + data)

    def close(self) -> None:
        self._socket.close()


class OutputReader:
    """The front end's end: listens on ``path`` (``start``), then ``recv_pyobj`` returns the engine's
    messages in order; it raises ``EOFError`` once the engine closed its end (it exited)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._server: asyncio.AbstractServer | None = None
        self._connected: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] | None = None

    async def start(self) -> None:
        self._connected = asyncio.get_running_loop().create_future()
        self._server = await asyncio.start_unix_server(self._accept, path=self.path)

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._connected is not None
        if self._connected.done():   # one engine per reader
            writer.close()
            return
        self._connected.set_result((reader, writer))

    async def recv_pyobj(self) -> Any:
        assert self._connected is not None, "start() first"
        reader, _ = await self._connected
        try:
            (length,) = HEADER.unpack(await reader.readexactly(HEADER.size))
            return pickle.loads(await reader.readexactly(length))
        except asyncio.IncompleteReadError:
            raise EOFError("the engine process closed its output socket") from None

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._connected is not None:
            if self._connected.done() and not self._connected.cancelled():
                self._connected.result()[1].close()
            else:
                self._connected.cancel()
