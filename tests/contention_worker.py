"""One process of the contention test: hammer one key, report the slots the store handed out.

Each process starts in a fresh interpreter (multiprocessing "spawn"), so no Redis
connection ever crosses a fork; everything it is given is picklable (a ``Plan``
holding a ``StoreSpec``), and it builds its own backend and limiter from that.

A sync process runs one loop; an async process runs several loops as tasks of
one event loop. Every loop asks for the key until the common deadline and records
``Decision.slot`` for each admitted call: the slots are the store's own schedule,
so the test judges them without caring when a process actually woke up.
"""

from __future__ import annotations

import asyncio
import random
import time
import traceback
from dataclasses import dataclass
from typing import Any

from throttle_client import (
    AsyncLimiter,
    AsyncRedisBackend,
    Decision,
    Limiter,
    Rate,
    RedisBackend,
    SQLiteBackend,
    ThrottleTimeout,
)

# What a loop does, by role:
#   "wait"  acquire() with a long timeout: together they keep reservations queued ahead at
#           all times, so demand exceeds the quota however late a process wakes;
#   "brief" acquire() with a short timeout: often refused with ThrottleTimeout;
#   "try"   try_acquire(): admitted only when the key is free right now.
TIMEOUTS = {"wait": 1.5, "brief": 0.25}
ROLES = ("wait", "brief", "try")


@dataclass(frozen=True)
class StoreSpec:
    """Where the shared log lives: a URL, and whether a Redis URL names a Cluster."""

    url: str
    cluster: bool = False


def make_backend(spec: StoreSpec, *, asynchronous: bool) -> Any:
    """The one place that turns a spec into a backend; a new store is one branch here."""
    if spec.url.startswith(("redis://", "rediss://", "unix://")):
        if asynchronous:
            return AsyncRedisBackend(spec.url, cluster=spec.cluster)
        return RedisBackend(spec.url, cluster=spec.cluster)
    if spec.url.startswith("sqlite:///"):
        # One file for both worlds: AsyncLimiter adapts it through ``to_async``.
        return SQLiteBackend(spec.url.removeprefix("sqlite:///"))
    raise ValueError(f"no backend for store spec {spec.url!r}")


@dataclass(frozen=True)
class Plan:
    """What one process does; ``roles`` has one entry for a sync process, several for async."""

    index: int
    store: StoreSpec
    key: str
    rates: tuple[tuple[int, float], ...]  # (limit, period in seconds)
    min_interval: float
    margin: float
    duration: float  # seconds of demand after the common start
    asynchronous: bool
    roles: tuple[str, ...]
    costs: tuple[int, ...]  # each call's cost is drawn from these
    seed: int


@dataclass(frozen=True)
class Admitted:
    slot: float  # Decision.slot: epoch seconds in the store's clock
    cost: int
    role: str
    late: int = 0  # Decision.late_wakeups: slots it booked, woke too late for, left unused


@dataclass
class Report:
    index: int
    admitted: list[Admitted]
    refused: dict[str, int]
    error: str | None = None
    late_units: int = 0  # units of slots booked, woken too late for, whose rebook timed out


def backoff(role: str, retry_after: float, end: float) -> float:
    """How long a refused loop waits before asking again: until its slot would be within
    its timeout (for "try": due), so demand never lapses; never past the deadline."""
    pause = retry_after - TIMEOUTS.get(role, 0.0)
    return max(0.001, min(pause, end - time.monotonic()))


def _limiter_args(plan: Plan) -> dict[str, Any]:
    return {
        "rates": [Rate(limit, period) for limit, period in plan.rates],
        "min_interval": plan.min_interval,
        "margin": plan.margin,
        "namespace": "contention",
    }


def _sync_loop(limiter: Limiter, plan: Plan, role: str, end: float, report: Report) -> None:
    rng = random.Random(plan.seed)
    while time.monotonic() < end:
        cost = rng.choice(plan.costs)
        try:
            if role == "try":
                decision: Decision = limiter.try_acquire(plan.key, cost)
            else:
                decision = limiter.acquire(plan.key, cost, timeout=TIMEOUTS[role])
        except ThrottleTimeout as exc:
            retry_after = exc.retry_after
            report.late_units += exc.late_wakeups * cost
        else:
            if decision.allowed:
                report.admitted.append(Admitted(decision.slot, cost, role, decision.late_wakeups))
                continue
            retry_after = decision.retry_after
        report.refused[role] = report.refused.get(role, 0) + 1
        time.sleep(backoff(role, retry_after, end))


async def _async_loop(
    limiter: AsyncLimiter, plan: Plan, role: str, seed: int, end: float, report: Report
) -> None:
    rng = random.Random(seed)
    while time.monotonic() < end:
        cost = rng.choice(plan.costs)
        try:
            if role == "try":
                decision: Decision = await limiter.try_acquire(plan.key, cost)
            else:
                decision = await limiter.acquire(plan.key, cost, timeout=TIMEOUTS[role])
        except ThrottleTimeout as exc:
            retry_after = exc.retry_after
            report.late_units += exc.late_wakeups * cost
        else:
            if decision.allowed:
                report.admitted.append(Admitted(decision.slot, cost, role, decision.late_wakeups))
                continue
            retry_after = decision.retry_after
        report.refused[role] = report.refused.get(role, 0) + 1
        await asyncio.sleep(backoff(role, retry_after, end))


def _run_sync(plan: Plan, barrier: Any, report: Report) -> None:
    (role,) = plan.roles
    backend = make_backend(plan.store, asynchronous=False)
    try:
        limiter = Limiter(backend, **_limiter_args(plan))
        limiter.usage(plan.key)  # connect and load the script before the start, writing nothing
        barrier.wait(timeout=60)
        _sync_loop(limiter, plan, role, time.monotonic() + plan.duration, report)
    finally:
        backend.close()


async def _run_async(plan: Plan, barrier: Any, report: Report) -> None:
    backend = make_backend(plan.store, asynchronous=True)
    try:
        limiter = AsyncLimiter(backend, **_limiter_args(plan))
        await limiter.usage(plan.key)
        # Blocking the event loop here is harmless: no task runs before the start.
        barrier.wait(timeout=60)
        end = time.monotonic() + plan.duration
        await asyncio.gather(
            *(
                _async_loop(limiter, plan, role, plan.seed * 100 + n, end, report)
                for n, role in enumerate(plan.roles)
            )
        )
    finally:
        close = getattr(backend, "aclose", None)
        if close is not None:
            await close()
        else:
            backend.close()


def run(plan: Plan, barrier: Any, results: Any) -> None:
    """Process entry point: wait at ``barrier`` with the others, then put a Report on
    ``results`` (with the traceback in ``error`` if anything went wrong)."""
    report = Report(plan.index, [], {})
    try:
        if plan.asynchronous:
            asyncio.run(_run_async(plan, barrier, report))
        else:
            _run_sync(plan, barrier, report)
    except BaseException:
        report.error = traceback.format_exc()
        barrier.abort()  # do not leave the others waiting for a process that is gone
    results.put(report)
