"""A store a few milliseconds away: the transports keep sending, at the full rate.

Every reply of a real redis-server is held by a TCP proxy (tests/delay_proxy.py) for 20
or 60 ms, as a store in another zone or a busy one would answer. A call that slept
until its slot must not spend a round trip after it (the look for a pause goes before
the slot), nor book again for ever when its answers are slow (the lead it asks for
follows the round trip; a call books again at most a few times).

The upstream here counts arrivals, exactly, in the rate's own window. The rate is held
by arrival within the margin when the round trip is below it (20 ms against 25 ms);
above it (60 ms) the limiter warns that it cannot be, and the judge allows arrivals
that far (the round trip less the margin) from their slots, as the warning says.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from throttle_client import (
    AsyncLimiter,
    AsyncRedisBackend,
    AsyncThrottledClient,
    Limiter,
    RedisBackend,
    ThrottledClient,
)
from throttle_client.testing import RedisServer

from .delay_proxy import DelayProxy

# The second tier (pytest -m slow): see pyproject.toml.
pytestmark = pytest.mark.slow

RATE, PERIOD = 4, 1.0  # "4/second"
RUN = 3.0  # seconds of sending per case
TASKS = 12  # the async case: each waits its turn behind the others (3 s of backlog)
MARGIN = 0.025  # the default


@pytest.fixture(params=[0.02, 0.06], ids=["20ms", "60ms"])
def slow_store(request: pytest.FixtureRequest, own_redis: RedisServer) -> Iterator[DelayProxy]:
    with DelayProxy(own_redis.port, delay=request.param) as proxy:
        yield proxy


def judge(arrivals: list[float], delay: float) -> tuple[int, float]:
    """The most arrivals in any window of the rate (shortened by how far past the margin
    the store's round trip lets a call go), and the share of the quota they used between
    the first arrival and the last."""
    window = PERIOD - max(0.0, delay - MARGIN)
    times = sorted(arrivals)
    fullest = max(sum(1 for u in times if t - window < u <= t) for t in times)
    span = times[-1] - times[0]
    possible = RATE * (int(span / PERIOD) + 1)
    return fullest, len(times) / possible


def test_the_sync_transport_keeps_sending_through_a_slow_store(
    slow_store: DelayProxy, caplog: pytest.LogCaptureFixture
) -> None:
    arrivals: list[float] = []
    limiter = Limiter(RedisBackend(slow_store.url), rates=[f"{RATE}/second"])
    upstream = httpx.MockTransport(
        lambda r: (arrivals.append(time.monotonic()), httpx.Response(200))[1]
    )
    client = ThrottledClient(limiter, transport=upstream, acquire_timeout=10)
    deadline = time.monotonic() + RUN

    def worker() -> None:
        while time.monotonic() < deadline:
            client.get("http://api.test/", headers={"Authorization": "Bearer T"})

    with caplog.at_level(logging.WARNING, logger="throttle_client"):
        threads = [threading.Thread(target=worker) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    limiter.backend.close()
    fullest, used = judge(arrivals, slow_store.delay)
    assert fullest <= RATE, f"{fullest} arrivals in one window of {RATE}"
    assert used >= 0.8, f"{used:.0%} of the quota used: {len(arrivals)} arrivals"
    too_slow = [r for r in caplog.records if "too slow for margin" in r.getMessage()]
    if slow_store.delay > MARGIN:  # said once, naming the round trip and the margin
        assert len(too_slow) == 1
        message = too_slow[0].getMessage()
        assert "margin=25.0 ms" in message and "round trip takes 6" in message
    else:
        assert not too_slow


def test_the_async_transport_keeps_sending_through_a_slow_store(
    slow_store: DelayProxy, caplog: pytest.LogCaptureFixture
) -> None:
    arrivals: list[float] = []

    async def answer(request: httpx.Request) -> httpx.Response:
        arrivals.append(time.monotonic())
        return httpx.Response(200)

    async def crawl() -> None:
        backend = AsyncRedisBackend(slow_store.url)
        limiter = AsyncLimiter(backend, rates=[f"{RATE}/second"])
        deadline = time.monotonic() + RUN
        async with AsyncThrottledClient(
            limiter, transport=httpx.MockTransport(answer), acquire_timeout=20
        ) as client:

            async def task() -> None:
                while time.monotonic() < deadline:
                    await client.get("http://api.test/", headers={"Authorization": "Bearer T"})

            await asyncio.wait_for(asyncio.gather(*(task() for _ in range(TASKS))), 30)
        await backend.aclose()

    with caplog.at_level(logging.WARNING, logger="throttle_client"):
        asyncio.run(crawl())
    fullest, used = judge(arrivals, slow_store.delay)
    assert fullest <= RATE, f"{fullest} arrivals in one window of {RATE}"
    assert used >= 0.8, f"{used:.0%} of the quota used: {len(arrivals)} arrivals"
    too_slow = [r for r in caplog.records if "too slow for margin" in r.getMessage()]
    if slow_store.delay > MARGIN:  # said once, naming the round trip and the margin
        assert len(too_slow) == 1
        assert "margin=25.0 ms" in too_slow[0].getMessage()
    else:
        assert not too_slow
