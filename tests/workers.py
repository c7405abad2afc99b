"""Code that runs in worker processes (spawned, so it must be importable)."""

from __future__ import annotations

import time
from typing import Any

from throttle_client import BackendUnavailable, Limiter, RedisBackend


def failover_worker(url: str, start: float, duration: float, events: Any) -> None:
    """Acquire through an outage; report when calls succeeded and when the policy said no."""
    outcomes: dict[str, Any] = {"ok": [], "unavailable": []}
    limiter = Limiter(RedisBackend(url), rates=["1000/second"], retry_for=0.2)
    time.sleep(max(0.0, start - time.time()))
    try:
        while time.time() < start + duration:
            try:
                limiter.acquire("token", timeout=1.0)
                outcomes["ok"].append(time.time())
            except BackendUnavailable:
                outcomes["unavailable"].append(time.time())
            time.sleep(0.02)
    except Exception as exc:  # reported to the test, which fails on it
        outcomes["error"] = repr(exc)
    events.put(outcomes)
