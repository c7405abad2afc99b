"""The memory backend under threads and asyncio tasks, and its forgetting of idle keys.

Judged by the slots it hands out: no window ever holds more than its limit,
consecutive slots keep the minimum interval, and the schedule is exactly the one
the reference model gives for the same calls one after another.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import threading
from collections.abc import Sequence

import pytest

from throttle_client import AsyncLimiter, Limiter, MemoryBackend
from throttle_client._backends import memory
from throttle_client._backends.sliding_log import LIFE_RESET
from throttle_client.testing import FakeClock

from .model import Model

US = 1_000_000
RATES = ["10/second", "30/5 seconds"]
MODEL_RATES = [(10, US), (30, 5 * US)]
GAP = 10_000


def us(seconds: float) -> int:
    return round(seconds * US)


def assert_within_limits(slots: Sequence[int], gap: int = GAP) -> None:
    slots = sorted(slots)
    for t in slots:
        for limit, period in MODEL_RATES:
            assert sum(1 for u in slots if t - period < u <= t) <= limit
    assert all(b - a >= gap for a, b in itertools.pairwise(slots))


def sequential_schedule(now: int, calls: int) -> list[int]:
    model = Model(MODEL_RATES, GAP)
    return [model.acquire("k", now).slot for _ in range(calls)]


def test_threads_on_one_key_get_exactly_the_sequential_schedule() -> None:
    clock = FakeClock()  # never moves: every thread asks at the same moment
    limiter = Limiter(
        MemoryBackend(),
        rates=RATES,
        min_interval=GAP / US,
        margin=0,
        clock=clock,
        sleep=lambda s: None,
    )
    slots: list[int] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def worker() -> None:
        start.wait()
        for _ in range(25):
            slot = us(limiter.acquire("k").slot)
            with lock:
                slots.append(slot)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(slots) == sequential_schedule(us(clock.now), 200)
    assert_within_limits(slots)


def test_threads_with_a_moving_clock_never_over_admit() -> None:
    ticks = itertools.count()
    tick_lock = threading.Lock()

    def clock() -> float:
        with tick_lock:  # each look at the clock is 1 ms later
            return 1_700_000_000 + next(ticks) / 1000

    limiter = Limiter(MemoryBackend(), rates=RATES, min_interval=GAP / US, margin=0, clock=clock)
    admitted: list[int] = []
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(300):
            decision = limiter.try_acquire("k")
            if decision:
                with lock:
                    admitted.append(us(decision.slot))

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Calls come every few ms, so every second the clock spans starts with a full window
    # of 10 (30 at most in 5 s): exactly what the quota allows, no more and no less.
    span = next(ticks) / 1000
    assert span < 5
    assert len(admitted) == min(10 * math.ceil(span), 30)
    assert_within_limits(admitted)


async def test_asyncio_tasks_on_one_key() -> None:
    clock = FakeClock()
    start = us(clock.now)
    limiter = AsyncLimiter(
        MemoryBackend(),
        rates=RATES,
        min_interval=GAP / US,
        margin=0,
        clock=clock,
        sleep=clock.asleep,
    )

    async def task() -> int:
        return us((await limiter.acquire("k")).slot)

    slots = await asyncio.gather(*(task() for _ in range(60)))
    # Tasks interleave at every sleep, and the fake clock moves with them; still the
    # store hands out slots first come, first served, within every limit.
    assert_within_limits(slots)
    assert sorted(slots) == sequential_schedule(start, 60)


# -- forgetting ----------------------------------------------------------------------------


def test_idle_keys_are_forgotten() -> None:
    clock = FakeClock()
    backend = MemoryBackend()
    limiter = Limiter(backend, rates=["5/second", "10/minute"], margin=0, clock=clock)
    for n in range(100):
        limiter.acquire(f"token-{n}")
    assert len(backend._logs) == 100
    clock.advance(30)
    for _ in range(1100):  # the store sweeps as it works
        limiter.try_acquire("busy")
    assert len(backend._logs) == 101  # within the minute nothing may be forgotten
    clock.advance(61)
    for _ in range(1100):
        limiter.usage("busy")
    assert len(backend._logs) <= 1


def held(backend: MemoryBackend) -> int:
    """What the store holds per key, all kinds together: logs, leases, cards, pushback
    and usage histories."""
    kinds = (backend._logs, backend._leases, backend._cards, backend._pushback)
    return sum(map(len, kinds)) + len(backend._history)


def test_a_churn_of_keys_holds_only_the_keys_in_use() -> None:
    """Rounds of fresh keys (one per client, per job), each used a few times and never
    again, through a limiter of the defaults: the store holds the round's keys, the same
    every round, not every key it ever saw (a usage history kept by default held each
    for two years)."""
    clock = FakeClock()
    backend = MemoryBackend()
    limiter = Limiter(backend, rates="5/second", clock=clock, sleep=clock.sleep)
    sizes = []
    for round_ in range(6):
        for n in range(400):
            for _ in range(3):
                assert limiter.try_acquire(f"job-{round_}-{n}").allowed
        sizes.append(held(backend))
        clock.advance(3)  # past every key's horizon and the second kept after it, and its card's
    assert sizes == [800] * 6  # each key of the round: its log and its card


def test_idle_keys_go_a_few_per_operation_and_a_paused_one_stays() -> None:
    """Once their horizon has passed, idle keys go as the store works, a few per
    operation (no operation pays for all of them); a key still paused stays."""
    clock = FakeClock()
    backend = MemoryBackend()
    limiter = Limiter(backend, rates="5/second", clock=clock, sleep=clock.sleep)
    for n in range(600):
        limiter.try_acquire(f"client-{n}")
    limiter.pause("paused", 3600)
    before = held(backend)
    assert before == 2 * 601  # logs and cards
    clock.advance(10)
    limiter.try_acquire("busy")
    assert held(backend) >= before - 5 * memory._FORGET_STEP  # a few, not all at once
    for _ in range(600 // memory._FORGET_STEP):
        limiter.try_acquire("busy")
    kept = {limiter.store_key("paused"), limiter.store_key("busy")}
    assert set(backend._logs) == set(backend._cards) == kept
    assert held(backend) == 4
    assert limiter.usage("paused").paused_until is not None
    assert len(backend._expiring_logs) == len(backend._expiring_cards) == 2  # scheduled


def test_a_reset_or_an_expired_key_is_dropped() -> None:
    clock = FakeClock()
    backend = MemoryBackend()
    limiter = Limiter(backend, rates=["1/second"], margin=0, clock=clock)
    limiter.acquire("a")
    limiter.acquire("b")
    limiter.reset("a")
    # Of "a" only the word that it began again at a reset is left, until its time was
    # up: a worker that knew it does not take the reset for a store that lost it.
    reset = backend._logs[limiter.store_key("a")]
    assert reset.times == [] and reset.total == 0 and reset.life == LIFE_RESET
    limiter.usage("never seen")
    assert len(backend._logs) == 2  # looking creates nothing
    clock.advance(2)  # past the horizon and the second the store keeps after it
    assert limiter.try_acquire("b")  # an expired log is replaced, never mistaken for busy
    for _ in range(4):
        limiter.try_acquire("b")  # (idle keys go a few per operation)
    assert list(backend._logs) == [limiter.store_key("b")]


def test_a_clock_given_to_the_backend_still_works_but_is_deprecated() -> None:
    clock = FakeClock()
    with pytest.warns(DeprecationWarning, match=r"MemoryBackend\(clock=\.\.\.\) is deprecated"):
        backend = MemoryBackend(clock=clock)
    limiter = Limiter(backend, rates=["1/second"], margin=0)
    assert limiter.try_acquire("k")
    assert us(limiter.try_acquire("k").retry_after) == US
    clock.advance(1)
    assert limiter.try_acquire("k")


def test_a_backend_is_truthy_and_a_context_manager_even_when_empty() -> None:
    with MemoryBackend() as backend:
        assert bool(backend)  # an empty store is still a store
        assert Limiter(backend, rates=["1/second"]).try_acquire("k")
