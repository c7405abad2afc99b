"""Any number of tasks or threads on one limiter (issue #8 §2): pool exhaustion is never
an outage, under every failure policy, for URL-built and user-built clients.

Every call books a slot at one fixed moment (an injected clock that never moves, and a
sleep that returns at once), so the store hands out a schedule: the test judges those
slots. A call that slipped past the store (a policy answering instead) shows up as an
exception or as a slot crowding the first window.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from typing import Any

import pytest
import redis
import redis.asyncio

from throttle_client import (
    AsyncLimiter,
    AsyncRedisBackend,
    BackendUnavailable,
    Limiter,
    LocalFallback,
    RedisBackend,
)
from throttle_client.testing import RedisServer

T0 = 1_700_000_000.0
LIMIT = 100  # per second
POLICIES = ["raise", "allow", LocalFallback(expected_workers=4)]
POLICY_IDS = ["raise", "allow", "fallback"]


def judge(slots: list[float], calls: int) -> None:
    """Every call admitted, LIMIT per one-second window from T0 on, no window over it."""
    assert len(slots) == calls
    per_second = Counter(round((slot - T0) * 1_000_000) // 1_000_000 for slot in slots)
    assert set(per_second.values()) == {LIMIT}, per_second  # full windows, none over
    assert sorted(per_second) == list(range(calls // LIMIT))


async def nosleep(seconds: float) -> None:
    await asyncio.sleep(0)


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
@pytest.mark.parametrize("built", ["url", "user"])
async def test_1000_tasks_on_one_async_limiter(redis_url: str, built: str, policy: Any) -> None:
    # A user's client with a small pool: 1000 tasks at once would exhaust it.
    client = redis.asyncio.Redis.from_url(redis_url, max_connections=20)
    backend = AsyncRedisBackend(redis_url if built == "url" else client)
    limiter = AsyncLimiter(
        backend, rates=[f"{LIMIT}/second"], clock=lambda: T0, sleep=nosleep, on_unavailable=policy
    )
    decisions = await asyncio.gather(*(limiter.acquire("token") for _ in range(1000)))
    judge([d.slot for d in decisions], 1000)
    await backend.aclose()
    await client.aclose()


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
@pytest.mark.parametrize("built", ["url", "user"])
def test_200_threads_on_one_limiter(redis_url: str, built: str, policy: Any) -> None:
    client = redis.Redis.from_url(redis_url, max_connections=20)
    backend = RedisBackend(redis_url if built == "url" else client)
    limiter = Limiter(
        backend,
        rates=[f"{LIMIT}/second"],
        clock=lambda: T0,
        sleep=lambda seconds: None,
        on_unavailable=policy,
    )
    start = threading.Barrier(200)
    slots: list[float] = []
    errors: list[BaseException] = []

    def work() -> None:
        start.wait()
        try:
            for _ in range(5):
                slots.append(limiter.acquire("token").slot)
        except BaseException as exc:  # every error counts against the test
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(200)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    judge(slots, 1000)
    backend.close()
    client.close()


# -- the queue when the store hangs, and cancelled waiters ------------------------------

SOCKET_TIMEOUT = 1.0  # the backend's
SLACK = 1.0  # a loaded 2-core machine


async def test_a_hung_store_fails_the_whole_async_queue_at_once(own_redis: RedisServer) -> None:
    """200 tasks, 4 connections: when the calls in flight time out, the operations
    queued behind them fail with them, instead of each round of the queue waiting out
    a timeout."""
    backend = AsyncRedisBackend(own_redis.url)
    limiter = AsyncLimiter(backend, rates=["100000/second"], retry_for=0)
    await limiter.try_acquire("token")
    own_redis.pause()
    try:
        started = time.monotonic()
        results = await asyncio.gather(
            *(limiter.try_acquire("token") for _ in range(200)), return_exceptions=True
        )
        elapsed = time.monotonic() - started
    finally:
        own_redis.resume()
    assert all(isinstance(r, BackendUnavailable) for r in results), results
    assert elapsed < SOCKET_TIMEOUT + SLACK, elapsed  # one timeout, not four rounds of it
    await backend.aclose()


def test_a_hung_store_fails_the_whole_thread_queue_at_once(own_redis: RedisServer) -> None:
    backend = RedisBackend(own_redis.url)
    limiter = Limiter(backend, rates=["100000/second"], retry_for=0)
    limiter.try_acquire("token")
    own_redis.pause()
    results: list[BaseException | None] = []
    threads = [
        threading.Thread(target=lambda: results.append(refusal(limiter))) for _ in range(200)
    ]
    try:
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - started
    finally:
        own_redis.resume()
    assert len(results) == 200 and all(isinstance(r, BackendUnavailable) for r in results)
    assert elapsed < SOCKET_TIMEOUT + SLACK, elapsed
    backend.close()


def refusal(limiter: Limiter) -> BaseException | None:
    try:
        limiter.try_acquire("token")
    except BackendUnavailable as exc:
        return exc
    return None


async def test_cancelled_tasks_never_keep_a_place(redis_url: str) -> None:
    backend = AsyncRedisBackend(redis_url)
    # margin=0: this is about places in the pool; with a margin, a loaded machine makes
    # some of 500 concurrent answers late, and a late try_acquire is (rightly) refused.
    limiter = AsyncLimiter(backend, rates=["100000/second"], margin=0)
    for _ in range(5):  # tasks cancelled while waiting, while handed a place, in flight
        tasks = [asyncio.create_task(limiter.try_acquire("token")) for _ in range(300)]
        for _ in range(3):
            await asyncio.sleep(0)
        for task in tasks[::2]:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert backend._batcher.busy == 0 and not backend._batcher.queue
    decisions = await asyncio.gather(*(limiter.try_acquire("token") for _ in range(500)))
    assert all(d.allowed for d in decisions)
    await backend.aclose()
