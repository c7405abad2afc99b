"""Any number of tasks or threads on one limiter: pool exhaustion is never
an outage, under every failure policy, for URL-built and user-built clients.

Every call books a slot at one fixed moment (an injected clock that never moves, and a
sleep that returns at once), so the store hands out a schedule: the test judges those
slots. A call that slipped past the store (a policy answering instead) shows up as an
exception or as a slot crowding the first window.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
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
    ThrottleTimeout,
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


# -- order while connections open, and an outage met by calls queued later -------------


def lined_up(batcher: Any, calls: int) -> bool:
    """Whether ``calls + 1`` calls are in: the first in flight, the others queued (the
    server is paused: nothing comes back)."""
    return batcher.busy >= 1 and len(batcher.queue) >= calls


async def test_a_burst_keeps_its_order_while_connections_open(own_redis: RedisServer) -> None:
    """One connection open (a call was made), then calls one after another, held by a
    paused server: the first goes over the open connection, the others need connections
    opened (a few round trips each). Once the server goes on, the slots come in the
    order the calls were made: no call waits on a connection being opened while calls
    made after it go first over one already open."""
    backend = AsyncRedisBackend(own_redis.url)
    limiter = AsyncLimiter(backend, rates=["1000/second"], min_interval=0.01, margin=0)
    await limiter.try_acquire("another key")
    batcher = backend._batcher
    own_redis.pause()
    try:
        tasks = []
        for i in range(40):
            tasks.append(asyncio.create_task(limiter.acquire("token", timeout=5)))
            for _ in range(5000):  # this call is in flight or queued before the next one
                if lined_up(batcher, i):
                    break
                await asyncio.sleep(0.001)
            assert batcher.busy >= 1 and len(batcher.queue) == i, (i, batcher.busy)
        await asyncio.sleep(0.1)
    finally:
        own_redis.resume()
    slots = [decision.slot for decision in await asyncio.gather(*tasks)]
    assert slots == sorted(slots), [sorted(slots).index(slot) for slot in slots]
    await backend.aclose()


def test_a_thread_burst_keeps_its_order_while_connections_open(own_redis: RedisServer) -> None:
    backend = RedisBackend(own_redis.url)
    limiter = Limiter(backend, rates=["1000/second"], min_interval=0.01, margin=0)
    limiter.try_acquire("another key")
    batcher = backend._batcher
    slots: dict[int, float] = {}
    threads = [
        threading.Thread(target=lambda i=i: slots.update({i: limiter.acquire("token").slot}))
        for i in range(40)
    ]
    own_redis.pause()
    try:
        for i, thread in enumerate(threads):
            thread.start()
            # This call holds the open connection (the first), or is queued, before the
            # next one starts (the server answers nothing meanwhile).
            deadline = time.monotonic() + 5
            while not lined_up(batcher, i) and time.monotonic() < deadline:
                time.sleep(0.001)
            assert batcher.busy >= 1 and len(batcher.queue) == i, (i, batcher.busy)
        time.sleep(0.1)
    finally:
        own_redis.resume()
    for thread in threads:
        thread.join()
    in_order = [slots[i] for i in range(40)]
    assert in_order == sorted(in_order), [sorted(in_order).index(slot) for slot in in_order]
    backend.close()


async def test_calls_queued_during_a_hang_wait_one_socket_timeout(own_redis: RedisServer) -> None:
    """The server stops; 4 calls go, 100 more come 50 ms later and queue behind them.
    When the 4 time out, the 100 fail with them: they waited on the store as long, so
    they do not retry into a second socket timeout (retry_for=1, the default)."""
    backend = AsyncRedisBackend(own_redis.url)
    limiter = AsyncLimiter(backend, rates=["100000/second"])
    await limiter.try_acquire("token")
    ended: list[float] = []

    async def call() -> BaseException | None:
        try:
            await limiter.try_acquire("token")
        except BackendUnavailable as exc:
            return exc
        finally:
            ended.append(time.monotonic() - started)
        return None

    own_redis.pause()
    try:
        started = time.monotonic()
        first = [asyncio.create_task(call()) for _ in range(4)]
        await asyncio.sleep(0.05)
        results = await asyncio.gather(*first, *(call() for _ in range(100)))
    finally:
        own_redis.resume()
    assert all(isinstance(r, BackendUnavailable) for r in results), results
    assert max(ended) < SOCKET_TIMEOUT + 0.6, sorted(ended)[-5:]  # not two timeouts (2 s)
    await backend.aclose()


def test_threads_queued_during_a_hang_wait_one_socket_timeout(own_redis: RedisServer) -> None:
    backend = RedisBackend(own_redis.url)
    limiter = Limiter(backend, rates=["100000/second"])
    limiter.try_acquire("token")
    results: list[BaseException | None] = []
    ended: list[float] = []

    def call() -> None:
        results.append(refusal(limiter))
        ended.append(time.monotonic() - started)

    own_redis.pause()
    try:
        started = time.monotonic()
        threads = [threading.Thread(target=call) for _ in range(104)]
        for thread in threads[:4]:
            thread.start()
        time.sleep(0.05)
        for thread in threads[4:]:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        own_redis.resume()
    assert len(results) == 104 and all(isinstance(r, BackendUnavailable) for r in results)
    assert max(ended) < SOCKET_TIMEOUT + 0.6, sorted(ended)[-5:]
    backend.close()


async def test_time_spent_queued_counts_against_the_timeout(own_redis: RedisServer) -> None:
    """Calls that queue 0.3 s (a paused server) then ask for slots 50 ms apart, each with
    timeout=0.5: the queue's 0.3 s is part of their 0.5 s, so none comes back later than
    its timeout after it was called (not 0.3 s later), and the rest time out."""
    backend = AsyncRedisBackend(own_redis.url)
    limiter = AsyncLimiter(backend, rates=["1000/second"], min_interval=0.05, margin=0)
    await limiter.try_acquire("another key")
    took: list[float] = []

    async def call() -> bool:
        called = time.monotonic()
        try:
            await limiter.acquire("token", timeout=0.5)
        except ThrottleTimeout:
            return False
        took.append(time.monotonic() - called)
        return True

    own_redis.pause()
    try:
        tasks = [asyncio.create_task(call()) for _ in range(20)]
        await asyncio.sleep(0.3)
    finally:
        own_redis.resume()
    admitted = await asyncio.gather(*tasks)
    assert 1 <= sum(admitted) < 10, admitted  # (without the queue's time: ~10 of them)
    assert max(took) < 0.5 + 0.1, sorted(took)
    await backend.aclose()


@pytest.mark.parametrize("built", ["url", "user"])
def test_an_async_backend_serves_one_event_loop_after_another(redis_url: str, built: str) -> None:
    """redis.asyncio's connections belong to the loop that opened them: the backend opens
    its own anew in each new loop (a second asyncio.run), rather than fail in it."""
    client = redis.asyncio.Redis.from_url(redis_url)
    backend = AsyncRedisBackend(redis_url if built == "url" else client)
    limiter = AsyncLimiter(backend, rates=["1000/second"])

    async def burst() -> list[bool]:
        decisions = await asyncio.gather(*(limiter.acquire("k") for _ in range(20)))
        await backend.aclose()
        return [d.allowed for d in decisions]

    for _ in range(3):
        assert asyncio.run(burst()) == [True] * 20


# Its connections left open when the loop ended (the caller's leak: asyncio warns when
# they are collected, so in a process of its own, not in the suite's).
UNCLOSED = """
import asyncio, sys
from throttle_client import AsyncLimiter, AsyncRedisBackend
limiter = AsyncLimiter(AsyncRedisBackend(sys.argv[1]), rates=["1000/second"])
async def burst():
    return all(d.allowed for d in await asyncio.gather(*(limiter.acquire("k") for _ in range(20))))
print([asyncio.run(burst()) for _ in range(3)])
"""


def test_an_async_backend_left_open_serves_the_next_loop_too(redis_url: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", UNCLOSED, redis_url], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[True, True, True]", result.stderr


def test_an_async_backend_in_use_by_a_running_loop_says_so(redis_url: str) -> None:
    backend = AsyncRedisBackend(redis_url)
    limiter = AsyncLimiter(backend, rates=["1000/second"])
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(limiter.acquire("k"), loop).result(5)
        with pytest.raises(RuntimeError, match="serves an event loop that still runs"):
            asyncio.run(limiter.acquire("k"))
        asyncio.run_coroutine_threadsafe(backend.aclose(), loop).result(5)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
