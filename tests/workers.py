"""Code that runs in worker processes (spawned, so it must be importable), and how a
test starts a fleet of them together."""

from __future__ import annotations

import queue
import time
from typing import Any

from throttle_client import BackendUnavailable, Limiter, RedisBackend, ThrottleTimeout


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


def sentinel_worker(
    sentinels: list[tuple[str, int]], service: str, rate: str, start: float, duration: float,
    events: Any,
) -> None:  # fmt: skip
    """Acquire through a Sentinel-managed master client, as users build one; report the
    slots the store handed out, and when calls succeeded or the policy said no."""
    import redis.sentinel

    outcomes: dict[str, Any] = {"slots": [], "ok": [], "unavailable": []}
    sentinel = redis.sentinel.Sentinel(sentinels, socket_timeout=0.5)
    backend = RedisBackend(sentinel.master_for(service))
    limiter = Limiter(backend, rates=[rate], namespace="sentinel", retry_for=0.2)
    time.sleep(max(0.0, start - time.time()))
    try:
        while time.time() < start + duration:
            asked = time.time()  # "ok" is when a call was asked, not when its slot came
            try:
                decision = limiter.acquire("token", timeout=0.5)
                outcomes["slots"].append(decision.slot)
                outcomes["ok"].append(asked)
            except ThrottleTimeout as exc:
                time.sleep(min(exc.retry_after, 0.05))
            except BackendUnavailable:
                outcomes["unavailable"].append(time.time())
                time.sleep(0.02)
    except Exception as exc:  # reported to the test, which fails on it
        outcomes["error"] = repr(exc)
    backend.close()
    events.put(outcomes)


def start_together(workers: list[Any], start: Any, results: Any) -> list[Any]:
    """Start ``workers`` (processes that each wait at the ``start`` barrier, then put one
    report on ``results``), let them go together, and collect their reports; kill them
    all if any fails or stays silent."""
    for worker in workers:
        worker.start()
    try:
        start.wait(timeout=60)  # every worker imported and connected: go together
        reports = [results.get(timeout=60) for _ in workers]
    except (queue.Empty, Exception):
        for worker in workers:
            worker.kill()
        raise
    for worker in workers:
        worker.join(10)
        assert worker.exitcode == 0
    return reports
