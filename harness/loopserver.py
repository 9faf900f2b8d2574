"""What the harness's TCP proxies share: a server on 127.0.0.1 run by an event loop of its own in a thread, so that
clients of any loop (and synchronous ones) can use it, and closing a connection with an RST."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from typing import TypeVar

S = TypeVar("S", bound="LoopServer")


class LoopServer:
    """``with Subclass(...) as server:``, then connect to ``server.url``; each accepted connection is handed to
    ``_handle`` on the server's loop. Leaving the block stops the loop: ``_closing`` runs, then every task still
    running is cancelled and awaited."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.port = 0
        self._handlers: set[asyncio.Task[None] | None] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self: S) -> S:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError(f"{self.name} did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        """Serve one accepted connection."""
        raise NotImplementedError

    def _closing(self) -> None:
        """On the server's loop, as it stops, before its tasks are cancelled."""

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._accepted, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            self._closing()
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.close()

    async def _accepted(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._handlers.add(task)  # held: a handler its client abandoned is cancelled at the end, not collected
        try:
            await self._handle(client_r, client_w)
        finally:
            self._handlers.discard(task)


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST (SO_LINGER 0), not a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()
