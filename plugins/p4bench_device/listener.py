"""A peer's listening socket and the anonymous part of admitting a connection.

Connections are accepted raw (`Listener`), so that the two things a flood and an
honest client differ in can be seen before any TLS work: a connection is *silent*
until its first byte (the TLS ClientHello) arrives (`wait_readable`), and a handshake
is *done* the moment the TLS layer calls its protocol's ``connection_made``
(`tls_accept`'s `on_done`), before the task awaiting it resumes. `admission.Gate`
uses both to evict only silent or stalled connections, never a completed handshake
(see `admission.HandshakeBudget`).

Linux and other selector event loops only (`loop.add_reader`), as everywhere the device
runtime runs (Raspberry Pi OS, Linux and macOS hosts).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger("p4bench.device")

__all__ = ["Listener", "wait_readable", "has_unread", "tls_accept"]

BACKLOG = 128  # also the most connections taken per readiness event, as asyncio's own servers do
ACCEPT_RETRY_S = (
    1.0  # out of file descriptors: stop accepting this long (asyncio's servers wait 1 s too)
)


class Listener:
    """Listening TCP sockets on the running loop (one per address `host` resolves to, as
    asyncio's servers bind); calls `handle(sock, address)` in a new task for each accepted
    connection (non-blocking, nothing read from it yet)."""

    def __init__(
        self,
        host: str,
        port: int,
        handle: Callable[[socket.socket, Any], Coroutine[Any, Any, None]],
    ) -> None:
        self._handle = handle
        self._loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Task[None]] = (
            set()
        )  # strong references: the loop keeps only weak ones
        self._closed = False
        self.sockets: list[socket.socket] = []
        try:
            infos = socket.getaddrinfo(
                host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
            for family, address in dict.fromkeys((info[0], info[4][:2]) for info in infos):
                if self.sockets and port == 0:
                    port = self.port  # one port for every address, as asyncio does
                sock = socket.create_server(
                    (address[0], port), family=family, backlog=BACKLOG
                )  # SO_REUSEADDR on POSIX
                sock.setblocking(False)
                self.sockets.append(sock)
                self._loop.add_reader(sock.fileno(), self._accept_ready, sock)
        except BaseException:
            self.close()
            raise

    @property
    def port(self) -> int:
        return int(self.sockets[0].getsockname()[1])

    def _accept_ready(self, listening: socket.socket) -> None:
        for _ in range(BACKLOG):
            try:
                conn, address = listening.accept()
            except (BlockingIOError, InterruptedError):
                return
            except (
                OSError
            ) as exc:  # EMFILE, ENFILE, ENOBUFS: let descriptors free up, then accept again
                log.warning("accept failed (%r); pausing for %.0f s", exc, ACCEPT_RETRY_S)
                self._loop.remove_reader(listening.fileno())
                self._loop.call_later(ACCEPT_RETRY_S, self._resume, listening)
                return
            conn.setblocking(False)
            task = self._loop.create_task(self._handle(conn, address))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _resume(self, listening: socket.socket) -> None:
        if not self._closed:
            self._loop.add_reader(listening.fileno(), self._accept_ready, listening)

    def close(self) -> None:
        """Stop listening (connections already accepted go on)."""
        if not self._closed:
            self._closed = True
            for sock in self.sockets:
                self._loop.remove_reader(sock.fileno())
                sock.close()


async def wait_readable(sock: socket.socket) -> None:
    """Wait until `sock` has bytes to read (or its end), reading nothing."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()

    def readable() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await ready
    finally:
        loop.remove_reader(fd)


def has_unread(sock: socket.socket) -> bool:
    """Whether bytes have arrived on `sock` that nobody has read yet (a peek: nothing is consumed)."""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK))
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:  # closed, reset
        return False


class _Protocol(asyncio.StreamReaderProtocol):
    """Stream protocol that says when the TLS handshake is done (its ``connection_made``)."""

    def __init__(self, reader: asyncio.StreamReader, on_done: Callable[[], None]) -> None:
        super().__init__(reader)
        self._on_done = on_done

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._on_done()
        super().connection_made(transport)


async def tls_accept(
    sock: socket.socket,
    context: ssl.SSLContext,
    timeout_s: float,
    on_done: Callable[[], None],
    limit: int = 2**16,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """The server side of a TLS handshake on the accepted `sock` (which the returned
    transport then owns; cancelled or failed, the transport is closed). `on_done` is
    called as soon as the handshake completes, synchronously on the loop."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=limit, loop=loop)
    protocol = _Protocol(reader, on_done)
    transport, _ = await loop.connect_accepted_socket(
        lambda: protocol, sock, ssl=context, ssl_handshake_timeout=timeout_s
    )
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)
