"""How long a waiter behind a full cap waits once the holder ends its lease."""

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
