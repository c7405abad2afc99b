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

Use is judged as the limiter promises it: the slots it books fill at least 80 % of the
rate between the first arrival and the last, a slot booked by a call that then woke
too late to meet it (a late wake-up: it books again, and the late slot stays unused,
under-use rather than over-use) counting as booked; and most slots (at least half) do
carry a request. At 20 ms the store's round trip leaves 5 ms of the 25 ms margin to
wake in: a machine whose other core is busy overshoots some sleeps by more.
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


def judge(arrivals: list[float], delay: float, late: int = 0) -> tuple[int, float, float]:
    """The most arrivals in any window of the rate (shortened by how far past the margin
    the store's round trip lets a call go), the share of the quota they used between the
    first arrival and the last, and the share booked (with ``late`` wake-ups' slots)."""
    window = PERIOD - max(0.0, delay - MARGIN)
    times = sorted(arrivals)
    fullest = max(sum(1 for u in times if t - window < u <= t) for t in times)
    span = times[-1] - times[0]
    possible = RATE * (int(span / PERIOD) + 1)
    return fullest, len(times) / possible, (len(times) + late) / possible


def check_use(used: float, booked: float, arrivals: list[float], late: list[float]) -> None:
    said = (
        f"{used:.0%} of the quota used, {booked:.0%} booked: {len(arrivals)} arrivals, late {late}"
    )
    assert booked >= 0.8, said
    assert used >= 0.5, said


def check_too_slow(caplog: pytest.LogCaptureFixture, delay: float) -> str:
    """The "too slow" warning: said once, naming the margin, when the round trip is past
    it; below it, at most once (a busy machine that made calls late again and again).
    Answers the warning's text, "" for none."""
    said = [r.getMessage() for r in caplog.records if "too slow for margin" in r.getMessage()]
    if delay > MARGIN:
        assert len(said) == 1 and "margin=25.0 ms" in said[0], said
    else:
        assert len(said) <= 1, said
    return said[0] if said else ""


def test_the_sync_transport_keeps_sending_through_a_slow_store(
    slow_store: DelayProxy, caplog: pytest.LogCaptureFixture
) -> None:
    arrivals: list[float] = []
    limiter = Limiter(RedisBackend(slow_store.url), rates=[f"{RATE}/second"])
    late: list[float] = []
    limiter.listen(lambda e: late.append(e.late_by) if e.kind == "late_wakeup" else None)
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
    fullest, used, booked = judge(arrivals, slow_store.delay, len(late))
    assert fullest <= RATE, f"{fullest} arrivals in one window of {RATE}"
    check_use(used, booked, arrivals, late)
    said = check_too_slow(caplog, slow_store.delay)
    if slow_store.delay > MARGIN:  # (names the round trip, 60-odd ms, too)
        assert "round trip takes 6" in said


def test_the_async_transport_keeps_sending_through_a_slow_store(
    slow_store: DelayProxy, caplog: pytest.LogCaptureFixture
) -> None:
    arrivals: list[float] = []

    async def answer(request: httpx.Request) -> httpx.Response:
        arrivals.append(time.monotonic())
        return httpx.Response(200)

    late: list[float] = []

    async def crawl() -> None:
        backend = AsyncRedisBackend(slow_store.url)
        limiter = AsyncLimiter(backend, rates=[f"{RATE}/second"])
        limiter.listen(lambda e: late.append(e.late_by) if e.kind == "late_wakeup" else None)
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
    fullest, used, booked = judge(arrivals, slow_store.delay, len(late))
    assert fullest <= RATE, f"{fullest} arrivals in one window of {RATE}"
    check_use(used, booked, arrivals, late)
    check_too_slow(caplog, slow_store.delay)
