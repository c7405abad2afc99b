"""Helpers for tests of concurrency caps: a hand-off timed, calls in flight counted."""

from __future__ import annotations

import threading
import time

from throttle_client import Limiter


def handoff_seconds(limiter: Limiter, key: str = "token", hold: float = 0.2) -> float:
    """A holder takes ``key`` (``max_concurrent=1``) and releases it ``hold`` seconds
    later, in another thread; returns how long the waiter waited. Woken by its grant, it
    waits about ``hold``; left to look again on its own, a third of the lease TTL."""
    holder = limiter.lease(key)
    holder.__enter__()
    threading.Timer(hold, holder.release).start()
    started = time.monotonic()
    with limiter.lease(key, timeout=5):
        return time.monotonic() - started


class InFlight:
    """Counts the calls inside ``with counter:`` blocks, across threads, and the most
    at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.inside = self.peak = self.done = 0

    def __enter__(self) -> None:
        with self._lock:
            self.inside += 1
            self.peak = max(self.peak, self.inside)

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            self.inside -= 1
            self.done += 1
