"""Priorities: a low-priority call lets the calls of the usual priority go first, for at
most its limiter's low_priority_patience, on every store, sync and async, and through
the transports and @throttled.

The calls run on a fake clock: a low-priority call's sleep is where a normal call
arrives (the sleep hook below), so which one takes which slot is exact.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from throttle_client import (
    ConfigurationError,
    Limiter,
    MemoryBackend,
    ThrottledClient,
    ThrottledTransport,
    ThrottleTimeout,
    throttled,
)
from throttle_client.testing import FakeClock

GAP = 1.0  # one call a second: a slot is a second
RATES = ["60/minute"]  # (a slot a second, as the gap says)


def arriving_during_sleeps(
    make_limiter: Any,
    clock: FakeClock,
    arrive: Callable[[], Any],
    times: int = 1,
    at_the_end: bool = False,
) -> Any:
    """A sleep for the low-priority limiter: at each of its first ``times`` sleeps, a
    call of the usual priority arrives (``arrive``, a coroutine function for an
    AsyncLimiter), as the sleep begins, or ``at_the_end`` of it (to take the slot the
    sleeper wakes for)."""
    arrivals = [times]
    if make_limiter.mode == "sync":

        def sleep(seconds: float) -> None:
            if at_the_end:
                clock.sleep(seconds)
            if arrivals[0] > 0:
                arrivals[0] -= 1
                arrive()
            if not at_the_end:
                clock.sleep(seconds)

        return sleep

    async def asleep(seconds: float) -> None:
        if at_the_end:
            await clock.asleep(seconds)
        if arrivals[0] > 0:
            arrivals[0] -= 1
            await arrive()
        if not at_the_end:
            await clock.asleep(seconds)

    return asleep


def normal_arrivals(make_limiter: Any, crawl: Any, slots: list[float]) -> Callable[[], Any]:
    """What arrives: a normal acquire on ``crawl``, its slot noted."""
    if make_limiter.mode == "sync":
        return lambda: slots.append(crawl.acquire("token").slot)

    async def arrive() -> None:
        slots.append((await crawl.limiter.acquire("token")).slot)

    return arrive


def crawl_limiter(make_limiter: Any, clock: FakeClock, **options: Any) -> Any:
    """The limiter of the usual-priority calls: they book, and go at once (their sleeps
    do not move the clock), so only the low-priority call's sleeps move it."""
    if make_limiter.mode == "sync":

        def still(seconds: float) -> None:
            pass

        return make_limiter(rates=RATES, min_interval=GAP, clock=clock, sleep=still, **options)

    async def astill(seconds: float) -> None:
        await asyncio.sleep(0)

    return make_limiter(rates=RATES, min_interval=GAP, clock=clock, sleep=astill, **options)


@pytest.mark.parametrize("priority", ["low", "normal"])
def test_a_normal_call_that_comes_while_a_low_one_waits_goes_first(
    make_limiter: Any, priority: str
) -> None:
    clock = FakeClock()
    t0 = clock.now
    crawl = crawl_limiter(make_limiter, clock)
    crawl.acquire("token")
    crawl.acquire("token")  # the key's next slot is two seconds away: beyond a slot's reach
    normal: list[float] = []
    arrive = normal_arrivals(make_limiter, crawl, normal)
    background = make_limiter(
        rates=RATES,
        min_interval=GAP,
        clock=clock,
        sleep=arriving_during_sleeps(make_limiter, clock, arrive),
        backend=crawl.backend,
    )
    low = background.acquire("token", priority=priority)
    if priority == "low":  # it let the normal call take the next slot, and took the one after
        assert [slot - t0 for slot in normal] == [2 * GAP]
        assert low.slot - t0 == 3 * GAP and low.waited == pytest.approx(3 * GAP)
    else:  # booked when it asked: the normal call that came next queued behind it
        assert low.slot - t0 == 2 * GAP
        assert [slot - t0 for slot in normal] == [3 * GAP]
    usage = crawl.usage("token").rates[0]
    assert usage.used + usage.booked == 4  # every call booked once, none lost


def test_a_low_call_queues_once_its_patience_is_spent(make_limiter: Any) -> None:
    clock = FakeClock()
    t0 = clock.now
    crawl = crawl_limiter(make_limiter, clock)
    crawl.acquire("token")
    crawl.acquire("token")
    normal: list[float] = []
    arrive = normal_arrivals(make_limiter, crawl, normal)
    background = make_limiter(
        rates=RATES,
        min_interval=GAP,
        clock=clock,
        sleep=arriving_during_sleeps(make_limiter, clock, arrive, times=100, at_the_end=True),
        backend=crawl.backend,
        low_priority_patience=3.0,
    )
    low = background.acquire("token", priority="low")
    # A normal call takes every slot it wakes for: without patience it would wait for
    # ever. It yielded three seconds, then booked behind the normal calls booked by then.
    # (Normal calls still arrive while it sleeps to its slot: they queue behind it.)
    assert [slot - t0 for slot in normal if slot < low.slot] == [2 * GAP, 3 * GAP, 4 * GAP]
    assert low.slot - t0 == 5 * GAP and low.waited == pytest.approx(5 * GAP)


def test_a_low_calls_timeout_bounds_its_whole_wait(make_limiter: Any) -> None:
    clock = FakeClock()
    crawl = crawl_limiter(make_limiter, clock)
    crawl.acquire("token")
    crawl.acquire("token")
    low = make_limiter(rates=RATES, min_interval=GAP, clock=clock, backend=crawl.backend)
    with pytest.raises(ThrottleTimeout) as raised:
        low.acquire("token", timeout=0.5, priority="low")
    assert 0.5 <= raised.value.retry_after <= 2 * GAP
    usage = crawl.usage("token").rates[0]
    assert usage.used + usage.booked == 2  # its asks booked nothing
    # With the wait to reach the slot, it is admitted at it.
    assert low.acquire("token", timeout=3.0, priority="low").slot == clock.now


def test_a_low_call_whose_slot_lies_past_its_timeout_is_refused_at_once(
    make_limiter: Any,
) -> None:
    clock = FakeClock()
    crawl = crawl_limiter(make_limiter, clock)
    for _ in range(6):
        crawl.acquire("token")  # the next slot is 6 s away
    low = make_limiter(rates=RATES, min_interval=GAP, clock=clock, backend=crawl.backend)
    began = clock.now
    with pytest.raises(ThrottleTimeout) as raised:
        low.acquire("token", timeout=3.0, priority="low")
    # As a normal call: at once (slots never come sooner), saying when its slot is.
    assert clock.now == began and raised.value.retry_after == pytest.approx(6 * GAP)


def test_a_low_call_ends_though_its_sleeps_do_not_move_the_clock(make_limiter: Any) -> None:
    """What it slept counts toward its patience and its timeout, not only the clock (an
    injected sleep, a test's, may not move it)."""
    clock = FakeClock()
    crawl = crawl_limiter(make_limiter, clock)
    crawl.acquire("token")
    crawl.acquire("token")
    with pytest.raises(ThrottleTimeout):
        crawl.acquire("token", timeout=1.5, priority="low")
    decision = crawl.acquire("token", timeout=60, priority="low")  # patience, then queued
    assert decision.allowed and decision.slot - clock.now == pytest.approx(2 * GAP)


def test_a_low_call_on_a_pool_lets_a_normal_one_take_the_free_key(make_limiter: Any) -> None:
    clock = FakeClock()
    t0 = clock.now
    pooled = {"tag": lambda key: "pool"}  # (a Cluster's pool shares a hash slot)
    crawl = crawl_limiter(make_limiter, clock, **pooled)
    for key in ("a", "a", "b", "b"):
        crawl.acquire(key)  # each key's next slot is two seconds away
    taken: list[str] = []
    if make_limiter.mode == "sync":

        def arrive() -> None:
            taken.append(crawl.acquire_any(["a", "b"]).key)

    else:

        async def arrive() -> None:
            taken.append((await crawl.limiter.acquire_any(["a", "b"])).key)

    background = make_limiter(
        rates=RATES,
        min_interval=GAP,
        clock=clock,
        sleep=arriving_during_sleeps(make_limiter, clock, arrive),
        backend=crawl.backend,
        **pooled,
    )
    low = background.acquire_any(["a", "b"], priority="low")
    # The normal call took the key free first; the low one, the other key's slot.
    assert len(taken) == 1 and {*taken, low.key} == {"a", "b"} and low.slot - t0 == 2 * GAP


# -- bad input ----------------------------------------------------------------------------


def test_a_priority_other_than_normal_or_low_is_refused_by_name() -> None:
    limiter = Limiter(MemoryBackend(), rates=RATES)
    with pytest.raises(ValueError, match="'urgent'"):
        limiter.acquire("token", priority="urgent")
    with pytest.raises(ValueError, match="'high'"):
        limiter.acquire_any(["a", "b"], priority="high")
    with pytest.raises(ValueError, match="'LOW'"):
        limiter.lease("token", priority="LOW")
    with pytest.raises(ValueError, match="'urgent'"):
        throttled(limiter, key="token", priority="urgent")
    with pytest.raises(ConfigurationError, match="priority must be 'normal' or 'low', not 2"):
        ThrottledTransport(limiter, priority=2)  # type: ignore[arg-type]
    assert limiter.usage("token").rates[0].used == 0  # nothing booked by any of them


@pytest.mark.parametrize("patience", [-1, float("nan"), "soon"])
def test_a_bad_patience_is_refused_by_name(patience: Any) -> None:
    with pytest.raises((ConfigurationError, TypeError), match="low_priority_patience"):
        Limiter(MemoryBackend(), rates=RATES, low_priority_patience=patience)


def test_a_capped_call_has_no_priority() -> None:
    capped = Limiter(MemoryBackend(), rates=RATES, max_concurrent=2)
    plain = Limiter(capped.backend, rates=RATES, namespace="plain")
    with pytest.raises(ConfigurationError, match="capped"):
        throttled(capped, key="token", priority="low")  # at decoration, not the first call
    with pytest.raises(ConfigurationError, match="capped"):
        throttled(plain, key="token", also=[(capped, "account")], priority="low")
    with pytest.raises(ConfigurationError, match="capped"):
        ThrottledTransport(plain, also=[(capped, lambda r: "account")], priority="low")
    ok = httpx.MockTransport(lambda r: httpx.Response(200))
    stacked = ThrottledClient(plain, also=[(capped, lambda r: "account")], transport=ok)
    with pytest.raises(ConfigurationError, match="capped"):
        stacked.get("https://api.example.com/", extensions={"priority": "low"})
    with pytest.raises(ConfigurationError, match="capped"), capped.lease("token", priority="low"):
        pass
    with pytest.raises(ConfigurationError, match="capped"):
        ThrottledTransport(capped, priority="low")
    plain = ThrottledClient(capped, transport=httpx.MockTransport(lambda r: httpx.Response(200)))
    with pytest.raises(ConfigurationError, match="capped"):
        plain.get("https://api.example.com/", extensions={"priority": "low"})
    assert capped.usage("token").rates[0].used == 0


# -- the transports and @throttled ------------------------------------------------------------


def two_booked(store: MemoryBackend, clock: FakeClock) -> None:
    """The key's next slot two seconds away: beyond a low-priority call's reach."""
    ahead = Limiter(
        store, rates=RATES, min_interval=GAP, margin=0, clock=clock, sleep=lambda seconds: None
    )
    for _ in range(2):
        ahead.acquire("token")  # (its sleep does not move the clock)


@pytest.mark.parametrize("how", ["transport", "extension"])
def test_a_low_request_lets_a_normal_one_go_first(how: str) -> None:
    clock = FakeClock()
    t0 = clock.now
    store = MemoryBackend()
    arrived: list[tuple[str, float]] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        arrived.append((request.url.path, clock.now - t0))
        return httpx.Response(200)

    def client(limiter: Limiter, **options: Any) -> ThrottledClient:
        mock = httpx.MockTransport(upstream)
        return ThrottledClient(limiter, key=lambda r: "token", transport=mock, **options)

    def limiter(sleep: Callable[[float], None]) -> Limiter:
        return Limiter(store, rates=RATES, min_interval=GAP, margin=0, clock=clock, sleep=sleep)

    interactive = client(limiter(clock.sleep))
    two_booked(store, clock)
    first_sleep = [True]

    def sleep(seconds: float) -> None:
        if first_sleep.pop() if first_sleep else False:
            interactive.get("https://api.example.com/interactive")
        clock.sleep(seconds)

    if how == "transport":
        background = client(limiter(sleep), priority="low")
        background.get("https://api.example.com/crawl")
    else:
        background = client(limiter(sleep))
        background.get("https://api.example.com/crawl", extensions={"priority": "low"})
    # The interactive request took the next slot; the crawl's went after it (when the
    # crawl asked again: its sleep ended after the interactive request's).
    assert [path for path, _ in arrived] == ["/interactive", "/crawl"]
    assert arrived[0][1] == 2 * GAP and arrived[1][1] >= 3 * GAP


def test_a_low_priority_decorated_function_yields() -> None:
    clock = FakeClock()
    t0 = clock.now
    store = MemoryBackend()
    crawl = Limiter(store, rates=RATES, min_interval=GAP, margin=0, clock=clock, sleep=clock.sleep)
    two_booked(store, clock)
    normal: list[float] = []

    def sleep(seconds: float) -> None:
        if not normal:
            normal.append(crawl.acquire("token").slot - t0)
        clock.sleep(seconds)

    background = Limiter(store, rates=RATES, min_interval=GAP, margin=0, clock=clock, sleep=sleep)

    @throttled(background, key="token", priority="low")
    def fetch(token: str) -> float:
        return clock.now - t0

    assert fetch("token") >= 3 * GAP and normal == [2 * GAP]


async def test_an_async_low_request_lets_a_normal_one_go_first() -> None:
    from throttle_client import AsyncLimiter, AsyncThrottledClient

    clock = FakeClock()
    t0 = clock.now
    store = MemoryBackend()
    arrived: list[tuple[str, float]] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        arrived.append((request.url.path, clock.now - t0))
        return httpx.Response(200)

    def client(sleep: Any, **options: Any) -> AsyncThrottledClient:
        limiter = AsyncLimiter(
            store, rates=RATES, min_interval=GAP, margin=0, clock=clock, sleep=sleep
        )
        mock = httpx.MockTransport(upstream)
        return AsyncThrottledClient(limiter, key=lambda r: "token", transport=mock, **options)

    interactive = client(clock.asleep)

    async def still(seconds: float) -> None:
        await asyncio.sleep(0)

    ahead = AsyncLimiter(store, rates=RATES, min_interval=GAP, margin=0, clock=clock, sleep=still)
    for _ in range(2):  # the key's next slot two seconds away
        await ahead.acquire("token")
    first_sleep = [True]

    async def sleep(seconds: float) -> None:
        if first_sleep.pop() if first_sleep else False:
            await interactive.get("https://api.example.com/interactive")
        await clock.asleep(seconds)

    background = client(sleep, priority="low")
    await background.get("https://api.example.com/crawl")
    # The interactive request took the next slot; the crawl's went after it (when the
    # crawl asked again: its sleep ended after the interactive request's).
    assert [path for path, _ in arrived] == ["/interactive", "/crawl"]
    assert arrived[0][1] == 2 * GAP and arrived[1][1] >= 3 * GAP
    await asyncio.gather(interactive.aclose(), background.aclose())
