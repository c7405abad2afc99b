"""An upstream that judges concurrency caps by what it sees: requests in flight.

``InflightUpstream`` is a ThreadingHTTPServer on 127.0.0.1 (a free port) that counts the
requests in flight per token (``Authorization: Bearer <t>``) and per account (header
``X-Account``). A request that arrives while its token already has ``token_cap``
requests in flight, or its account ``account_cap``, is answered 429 at once and not
counted; any other is held for ``handling`` seconds, then answered 200.

A request leaves the count *before* its answer is written: a client cannot have read
the answer (and so ended its lease) while the upstream still counts the request, so a
429 always means the clients really had more than the cap in flight.

Every change of a count is journaled with its time (monotonic), so a test can integrate
over a run: how long a token was at its cap, its mean occupancy.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler

from tests.local_server import LocalServer
from throttle_client.cli.upstream import token_of


@dataclass(frozen=True)
class Occupancy:
    """One key's counts over ``span`` seconds (its first arrival to its last)."""

    span: float
    at_cap: float  # seconds with ``cap`` requests in flight
    mean: float  # mean number in flight

    def utilisation(self) -> float:
        return self.at_cap / self.span if self.span > 0 else 0.0


class InflightUpstream(LocalServer):
    """``with InflightUpstream(token_cap=4) as upstream:`` ... ``upstream.url``."""

    def __init__(
        self, token_cap: int, account_cap: int | None = None, handling: float = 0.02
    ) -> None:
        self.token_cap = token_cap
        self.account_cap = account_cap
        self.handling = handling
        self._lock = threading.Lock()
        self._now: dict[str, int] = defaultdict(int)  # "token:<t>" / "account:<a>" -> count
        self._peak: dict[str, int] = defaultdict(int)
        self._journal: dict[str, list[tuple[float, int]]] = defaultdict(list)
        self._arrivals: dict[str, list[float]] = defaultdict(list)
        self.served = 0
        self.refused = 0
        super().__init__()

    def _caps(self, token: str, account: str | None) -> list[tuple[str, int]]:
        caps = [(f"token:{token}", self.token_cap)]
        if account is not None and self.account_cap is not None:
            caps.append((f"account:{account}", self.account_cap))
        return caps

    def enter(self, token: str, account: str | None) -> bool:
        """Counts a request in (True), or refuses it (False): a cap is full."""
        caps = self._caps(token, account)
        with self._lock:
            now = time.monotonic()
            if any(self._now[key] >= cap for key, cap in caps):
                self.refused += 1
                return False
            for key, _ in caps:
                self._now[key] += 1
                self._peak[key] = max(self._peak[key], self._now[key])
                self._journal[key].append((now, self._now[key]))
                self._arrivals[key].append(now)
            return True

    def leave(self, token: str, account: str | None) -> None:
        with self._lock:
            now = time.monotonic()
            for key, _ in self._caps(token, account):
                self._now[key] -= 1
                self._journal[key].append((now, self._now[key]))
            self.served += 1

    def peak(self, key: str) -> int:
        """The most requests ever in flight for ``token:<t>`` or ``account:<a>``."""
        with self._lock:
            return self._peak[key]

    def most_in_any_window(self, key: str, period: float) -> int:
        """The most arrivals of ``key`` within any ``period`` seconds."""
        with self._lock:
            arrivals = sorted(self._arrivals[key])
        most, first = 0, 0
        for last, t in enumerate(arrivals):
            while t - arrivals[first] >= period:
                first += 1
            most = max(most, last - first + 1)
        return most

    def occupancy(self, key: str, cap: int) -> Occupancy:
        """Time at ``cap`` and mean count for ``key``, from when it first reaches the cap
        to its last arrival:
        the run is a continuous backlog (more callers than slots until the last request
        is sent), so some call waits throughout that span."""
        with self._lock:
            journal = list(self._journal[key])
            arrivals = list(self._arrivals[key])
        # From the moment the cap is first full (the fleet has started) to the last arrival.
        start = next((t for t, count in journal if count >= cap), arrivals[0])
        end = arrivals[-1]
        at_cap = area = 0.0
        for (t0, count), (t1, _) in itertools.pairwise(journal):
            lo, hi = max(t0, start), min(t1, end)
            if hi > lo:
                area += count * (hi - lo)
                if count >= cap:
                    at_cap += hi - lo
        span = end - start
        return Occupancy(span=span, at_cap=at_cap, mean=area / span if span > 0 else 0.0)

    def answer(self, request: BaseHTTPRequestHandler) -> tuple[int, dict[str, str], bytes]:
        token = token_of(request.headers, request.path)
        account = request.headers.get("X-Account")
        if not self.enter(token, account):
            return 429, {}, b"too many in flight\n"
        try:
            time.sleep(self.handling)
        finally:
            self.leave(token, account)  # before the answer: see the module
        return 200, {}, b"ok\n"
