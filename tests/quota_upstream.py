"""An upstream that enforces a fixed-window quota per token and says so in its headers.

``QuotaUpstream`` is a ThreadingHTTPServer on 127.0.0.1 (a free port). Each token
(``Authorization: Bearer <t>``) may make ``limit`` requests per window of ``window``
seconds, the windows aligned to multiples of ``window`` on ``time.time()``; a request
counts by its *arrival* (when the server reads it), never by when it was sent. Every
answer carries what a provider such as GitHub sends:

* ``X-RateLimit-Limit``: ``limit``;
* ``X-RateLimit-Remaining``: what the window has left after this request;
* ``X-RateLimit-Reset``: the window's end, in epoch seconds with decimals.

A request beyond the limit is answered 429 with the same headers (remaining 0) and
``Retry-After`` (whole seconds up to the window's end, rounded up, as RFC 9110 writes
it), and is not counted. Every arrival is journaled with its time, its status and the
``X-Client`` header the caller sent (``-`` without one), so a test can tell a fleet's
requests from an outside client's and count them per window.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler

from tests.local_server import LocalServer
from throttle_client.cli.upstream import token_of


@dataclass(frozen=True)
class Arrival:
    """One request as the upstream saw it."""

    at: float  # time.time() when it was counted (or refused)
    client: str  # its X-Client header
    status: int  # 200 or 429
    remaining: int  # what the answer said was left in the window


class QuotaUpstream(LocalServer):
    """``with QuotaUpstream(limit=60, window=1.0) as upstream:`` ... ``upstream.url``."""

    def __init__(self, *, limit: int, window: float) -> None:
        self.limit = limit
        self.window = window
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, int], int] = defaultdict(int)  # (token, window) -> n
        self._journal: dict[str, list[Arrival]] = defaultdict(list)
        super().__init__()

    # -- the quota ------------------------------------------------------------------------

    def window_of(self, t: float) -> int:
        """The index of the window that holds epoch time ``t``."""
        return math.floor(t / self.window)

    def judge(self, token: str, client: str) -> tuple[int, dict[str, str]]:
        """Count a request of ``token`` arriving now: its status and quota headers."""
        with self._lock:
            now = time.time()
            index = self.window_of(now)
            end = (index + 1) * self.window
            used = self._counts[token, index]
            status = 200 if used < self.limit else 429
            if status == 200:
                used = self._counts[token, index] = used + 1
            remaining = self.limit - used
            self._journal[token].append(Arrival(now, client, status, remaining))
        headers = {
            "X-RateLimit-Limit": str(self.limit),
            "X-RateLimit-Remaining": str(remaining),
            "X-RateLimit-Reset": f"{end:.6f}",
        }
        if status == 429:
            headers["Retry-After"] = str(max(1, math.ceil(end - now)))
        return status, headers

    # -- what the clients achieved -------------------------------------------------------

    def arrivals(self, token: str) -> list[Arrival]:
        """Every request of ``token``, admitted or refused, in arrival order."""
        with self._lock:
            return list(self._journal[token])

    def admitted_per_window(self, token: str) -> Counter[int]:
        """Admitted requests of ``token`` per window index, every client together."""
        return Counter(self.window_of(a.at) for a in self.arrivals(token) if a.status == 200)

    # -- serving ----------------------------------------------------------------------------

    def answer(self, request: BaseHTTPRequestHandler) -> tuple[int, dict[str, str], bytes]:
        token = token_of(request.headers, request.path)
        status, headers = self.judge(token, request.headers.get("X-Client", "-"))
        return status, headers, b"ok\n" if status == 200 else b"quota exceeded\n"
