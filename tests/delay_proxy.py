"""A TCP proxy on a free loopback port that holds every reply from its target for a
fixed delay: a store that is a few milliseconds away (another zone, a busy server),
made of a real redis-server and real sockets. Requests pass at once; each chunk the
target sends back is delivered ``delay`` seconds after it arrived, in order.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import selectors
import socket
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Self


class DelayProxy:
    """``with DelayProxy(port, delay=0.02) as proxy:`` then connect to ``proxy.port``."""

    def __init__(self, target_port: int, *, delay: float, host: str = "127.0.0.1") -> None:
        self.target = (host, target_port)
        self.delay = delay
        self._listener = socket.create_server((host, 0))
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        # (due time, order, destination socket, bytes): replies waiting for their time.
        self._held: list[tuple[float, int, socket.socket, bytes]] = []
        self._order = itertools.count()
        self._pairs: dict[socket.socket, tuple[socket.socket, bool]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in list(self._pairs):
            sock.close()
        self._listener.close()
        self._selector.close()

    def _accept(self) -> None:
        client, _ = self._listener.accept()
        upstream = socket.create_connection(self.target)
        for sock in (client, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)
        # client -> upstream passes at once; upstream -> client is held.
        self._pairs[client] = (upstream, False)
        self._pairs[upstream] = (client, True)
        self._selector.register(client, selectors.EVENT_READ, None)
        self._selector.register(upstream, selectors.EVENT_READ, None)

    def _drop(self, sock: socket.socket) -> None:
        peer, _ = self._pairs.pop(sock, (None, False))
        for one in (sock, peer):
            if one is None:
                continue
            self._pairs.pop(one, None)
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(one)
            one.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            timeout = 0.05
            if self._held:
                timeout = max(0.0, min(timeout, self._held[0][0] - time.monotonic()))
            for key, _ in self._selector.select(timeout):
                sock = key.fileobj
                if sock is self._listener:
                    self._accept()
                    continue
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(65536)
                except OSError:
                    data = b""
                if sock not in self._pairs:
                    continue
                peer, held = self._pairs[sock]
                if not data:
                    self._drop(sock)
                elif held:
                    due = time.monotonic() + self.delay
                    heapq.heappush(self._held, (due, next(self._order), peer, data))
                else:
                    peer.sendall(data)
            now = time.monotonic()
            while self._held and self._held[0][0] <= now:
                _, _, peer, data = heapq.heappop(self._held)
                if peer in self._pairs:
                    peer.setblocking(True)
                    try:
                        peer.sendall(data)
                    except OSError:
                        self._drop(peer)
                        continue
                    peer.setblocking(False)
