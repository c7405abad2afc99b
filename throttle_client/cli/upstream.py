"""A local upstream API that enforces a per-token quota strictly, by its own clock.

The demo and the end-to-end tests point crawlers at it: it counts each request
by its arrival time against sliding windows and a minimum gap, and answers 429
to any request that would break them (a refused request is not counted, as a
real provider would not count it). Its statistics say how close the crawlers
came: requests, rejections, and the most requests seen in any window.

``tolerance`` (seconds) forgives arrivals that are early by at most that much:
a limiter hands out slots, but a request reaches the upstream a little after its
slot, by a delay that varies from request to request.
"""

from __future__ import annotations

import itertools
import json
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from throttle_client import Rate


def _rate(rate: Rate | str) -> Rate:
    return rate if isinstance(rate, Rate) else Rate.parse(rate)


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that closes a kept-alive connection as it ends is no error of a
        # request: only the others are printed.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@dataclass
class _TokenLog:
    rates: tuple[Rate, ...]
    arrivals: list[float] = field(default_factory=list)  # admitted requests, arrival order
    refused_at: list[float] = field(default_factory=list)  # arrival times of 429s
    rejected: int = 0
    paused_until: float = 0.0
    storm_sent: bool = False


def token_of(headers: Any, path: str) -> str:
    """The access token of a request: bearer/token Authorization, else ?access_token=."""
    auth = headers.get("Authorization", "")
    scheme, _, credentials = auth.partition(" ")
    if scheme.lower() in ("bearer", "token") and credentials.strip():
        return str(credentials.strip())
    values = parse_qs(urlsplit(path).query).get("access_token")
    return values[0] if values else "-"


class StrictUpstream:
    """An HTTP server on 127.0.0.1 that answers 200 within the quota and 429 beyond it.

    >>> with StrictUpstream(rates=["10/second"], min_interval=0.05) as upstream:
    ...     httpx.get(upstream.url + "/items", headers={"Authorization": "Bearer t"})

    ``storm_retry_after``: answer the first request of each token with
    ``429 Retry-After: <n>`` and refuse the token for those n seconds.
    ``send_headers``: add ``X-RateLimit-Limit/Remaining/Reset`` from the first rate.
    ``path_rates``: paths under a prefix count in a quota of their own, per token (as
    GitHub's search API has its own beside the core one).
    ``accounts`` (token -> account) and ``account_rates``: a token's requests count in its
    account's quota too, shared by the account's tokens (no gap there); a request over
    either is refused.
    """

    def __init__(
        self,
        *,
        rates: Sequence[Rate | str],
        min_interval: float = 0.0,
        tolerance: float = 0.0,
        storm_retry_after: int | None = None,
        send_headers: bool = False,
        path_rates: Mapping[str, Sequence[Rate | str]] | None = None,
        accounts: Mapping[str, str] | None = None,
        account_rates: Sequence[Rate | str] = (),
        port: int = 0,
    ) -> None:
        self.rates = tuple(_rate(rate) for rate in rates)
        self.min_interval = min_interval
        self.tolerance = tolerance
        self.storm_retry_after = storm_retry_after
        self.send_headers = send_headers
        self.path_rates = {
            prefix: tuple(_rate(rate) for rate in rates)
            for prefix, rates in (path_rates or {}).items()
        }
        self.accounts = dict(accounts or {})
        self.account_rates = tuple(_rate(rate) for rate in account_rates)
        self._tokens: dict[str, _TokenLog] = {}
        self._accounts: dict[str, _TokenLog] = {}
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", port), self._handler())
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    # -- the quota --------------------------------------------------------------------

    def _quota(self, token: str, path: str) -> tuple[str, tuple[Rate, ...]]:
        """The log a request counts in, and its rates: a ``path_rates`` prefix has its own."""
        route = urlsplit(path).path
        for prefix, rates in self.path_rates.items():
            if route == prefix or route.startswith(prefix.rstrip("/") + "/"):
                return f"{token} {prefix}", rates
        return token, self.rates

    def _judge(self, token: str, path: str, now: float) -> tuple[int, dict[str, str]]:
        """Status and headers for a request of ``token`` to ``path`` arriving at ``now``."""
        name, rates = self._quota(token, path)
        with self._lock:
            log = self._tokens.setdefault(name, _TokenLog(rates))
            if self.storm_retry_after is not None and not log.storm_sent:
                log.storm_sent = True
                log.paused_until = now + self.storm_retry_after
                log.refused_at.append(now)
                return 429, {"Retry-After": str(self.storm_retry_after)}
            account = self._account_log(token)
            if self._breaks_quota(log, now, self.min_interval) or (
                account is not None and self._breaks_quota(account, now, 0.0)
            ):
                log.rejected += 1
                log.refused_at.append(now)
                return 429, {"Retry-After": "1"}
            log.arrivals.append(now)
            if account is not None:
                account.arrivals.append(now)
            headers: dict[str, str] = {}
            if self.send_headers:
                rate = log.rates[0]
                in_window = [t for t in log.arrivals if t > now - rate.period]
                headers = {
                    "X-RateLimit-Limit": str(rate.limit),
                    "X-RateLimit-Remaining": str(max(0, rate.limit - len(in_window))),
                    "X-RateLimit-Reset": str(int(in_window[0] + rate.period + time.time() - now)),
                }
            return 200, headers

    def _account_log(self, token: str) -> _TokenLog | None:
        """The log of the account ``token`` belongs to, if it has one with rates."""
        account = self.accounts.get(token)
        if account is None or not self.account_rates:
            return None
        return self._accounts.setdefault(account, _TokenLog(self.account_rates))

    def _breaks_quota(self, log: _TokenLog, now: float, gap: float) -> bool:
        if now < log.paused_until - self.tolerance:
            return True
        if log.arrivals and now - log.arrivals[-1] < gap - self.tolerance:
            return True
        for rate in log.rates:
            edge = now - rate.period + self.tolerance
            in_window = sum(1 for t in reversed(log.arrivals) if t > edge)
            if in_window + 1 > rate.limit:
                return True
        return False

    # -- what the crawlers achieved -------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Totals, and per rate the most requests any window held (exactly, by arrival)."""
        with self._lock:
            logs = {name: (log.rates, list(log.arrivals)) for name, log in self._tokens.items()}
            rejected = sum(log.rejected for log in self._tokens.values())
        arrivals = {name: times for name, (_, times) in logs.items()}
        peaks = {str(rate): 0 for rate in self.rates}
        for rates, times in logs.values():
            for rate in rates:
                window: deque[float] = deque()
                for t in times:
                    window.append(t)
                    while window[0] <= t - rate.period:
                        window.popleft()
                    peaks[str(rate)] = max(peaks.get(str(rate), 0), len(window))
        gaps = [b - a for times in arrivals.values() for a, b in itertools.pairwise(times)]
        return {
            "admitted": sum(len(times) for times in arrivals.values()),
            "rejected": rejected,
            "per_token": {token: len(times) for token, times in arrivals.items()},
            "peak_in_window": peaks,
            "min_gap": min(gaps) if gaps else None,
        }

    def account_arrivals(self, account: str) -> list[float]:
        """Admitted requests of the tokens of ``account``, by arrival time."""
        with self._lock:
            log = self._accounts.get(account)
            return list(log.arrivals) if log else []

    def arrivals(self, token: str) -> list[float]:
        """Admitted requests of ``token`` (``"<token> <prefix>"`` for a path quota), by
        arrival time (``time.monotonic()``)."""
        with self._lock:
            log = self._tokens.get(token)
            return list(log.arrivals) if log else []

    def refusals(self, token: str) -> list[float]:
        """Arrival times of the requests of ``token`` answered 429."""
        with self._lock:
            log = self._tokens.get(token)
            return list(log.refused_at) if log else []

    # -- serving ----------------------------------------------------------------------

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # Headers and body go out in two writes; with Nagle on, the body waits for
            # the client's delayed ACK (~40 ms) and every answer arrives that late.
            disable_nagle_algorithm = True

            def _answer(self) -> None:
                now = time.monotonic()
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                token = token_of(self.headers, self.path)
                status, headers = upstream._judge(token, self.path, now)
                body = json.dumps({"ok": status == 200, "path": self.path}).encode()
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _answer

            def log_message(self, format: str, *args: Any) -> None:
                pass  # requests carry tokens: never log them

        return Handler

    def start(self) -> StrictUpstream:
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> StrictUpstream:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
