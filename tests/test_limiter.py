"""The conformance suite: the limiter's semantics, written once, run on every backend,
sync and async.

``make_limiter`` builds a limiter over each backend with a FakeClock (Redis follows
it through the script's test-only time argument), so every expectation below is an
exact number worked out from the spec, in whole microseconds.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from throttle_client import (
    AsyncLimiter,
    ConfigurationError,
    CostTooHigh,
    Limiter,
    MemoryBackend,
    Rate,
    ThrottleTimeout,
)
from throttle_client.testing import FakeClock

from .conftest import SyncView

US = 1_000_000


def us(seconds: float) -> int:
    return round(seconds * US)


class StillClock(FakeClock):
    """Records sleeps without moving: every call arrives at the same moment."""

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


def twin(limiter: Any, **options: Any) -> Any:
    """Another holder of the same store (another worker), with its own settings."""
    clock = limiter._config.clock
    options.setdefault("rates", limiter.rates)
    options.setdefault("clock", clock)
    if isinstance(limiter, SyncView):
        options.setdefault("sleep", clock.asleep)
        return SyncView(AsyncLimiter(limiter.backend, **options), limiter.loop)
    options.setdefault("sleep", clock.sleep)
    return Limiter(limiter.backend, **options)


def used(limiter: Any, key: str) -> tuple[int, ...]:
    return tuple(rate.used for rate in limiter.usage(key).rates)


# -- several rates, min_interval, weighted cost ------------------------------------------


def test_every_rate_holds_at_once(make_limiter: Any) -> None:
    clock = FakeClock()
    limiter = make_limiter(rates=["3/second", Rate(5, timedelta(seconds=10))], clock=clock)
    assert [limiter.try_acquire("k").remaining for _ in range(3)] == [(2, 4), (1, 3), (0, 2)]
    refused = limiter.try_acquire("k")
    assert not refused.allowed and us(refused.retry_after) == US  # 3/second is full
    assert refused.remaining == (0, 2)
    clock.advance(1)
    assert [limiter.try_acquire("k").remaining for _ in range(2)] == [(2, 1), (1, 0)]
    refused = limiter.try_acquire("k")
    # Now 5/10s is full until the first three calls (at 0) leave the window, at 10 s.
    assert us(refused.retry_after) == 9 * US
    clock.advance(9)
    assert limiter.try_acquire("k").allowed


def test_min_interval_spaces_calls(make_limiter: Any) -> None:
    clock = FakeClock()
    limiter = make_limiter(
        rates=["100/second"], min_interval=timedelta(milliseconds=250), clock=clock
    )
    assert limiter.try_acquire("k").allowed
    assert us(limiter.try_acquire("k").retry_after) == 250_000
    clock.advance(0.1)
    assert us(limiter.try_acquire("k").retry_after) == 150_000
    decision = limiter.acquire("k")
    assert us(decision.waited) == 150_000 and clock.slept == [decision.waited]
    assert us(limiter.try_acquire("k").retry_after) == 250_000  # from the slot just taken


def test_weighted_cost(make_limiter: Any) -> None:
    clock = FakeClock()
    limiter = make_limiter(rates=["10/second"], clock=clock)
    assert limiter.try_acquire("k", cost=4).remaining == (6,)
    clock.advance(0.5)
    assert limiter.try_acquire("k", cost=6).remaining == (0,)
    assert us(limiter.try_acquire("k").retry_after) == 500_000  # the cost-4 entry leaves at 1 s
    clock.advance(0.5)
    # At 1 s the 6 units from 0.5 s are still in (0, 1]: 4 more fit, 5 do not.
    refused = limiter.try_acquire("k", cost=5)
    assert us(refused.retry_after) == 500_000
    assert limiter.try_acquire("k", cost=4).remaining == (0,)


# -- FIFO: reserved slots ------------------------------------------------------------------


def test_acquire_hands_out_the_earliest_slots_in_order(make_limiter: Any) -> None:
    clock = StillClock()
    limiter = make_limiter(rates=["2/second", "5/10 seconds"], min_interval=0.1, clock=clock)
    start = us(clock.now)
    slots = [us(limiter.acquire("k").slot) - start for _ in range(6)]
    # Two per second with 0.1 s between, then 5/10s holds the sixth until 10 s.
    assert slots == [0, 100_000, 1_000_000, 1_100_000, 2_000_000, 10_000_000]
    assert [us(s) for s in clock.slept] == slots[1:]
    # A try now sees the next free slot after the reservations, and books nothing.
    assert us(limiter.try_acquire("k").retry_after) == 10_100_000
    assert us(limiter.acquire("k").slot) - start == 10_100_000


def test_weighted_reservations_stay_in_arrival_order(make_limiter: Any) -> None:
    clock = StillClock()
    limiter = make_limiter(rates=["5/second"], clock=clock)
    start = us(clock.now)
    slots = [us(limiter.acquire("k", cost=c).slot) - start for c in (3, 3, 1, 5)]
    # A cost-1 call after a cost-3 one waits its turn even though 1 unit was free sooner.
    assert slots == [0, 1_000_000, 1_000_000, 2_000_000]
    assert slots == sorted(slots)


# -- refusals leave no trace -------------------------------------------------------------


def test_try_acquire_never_records_a_refusal(make_limiter: Any) -> None:
    clock = FakeClock()
    limiter = make_limiter(rates=["2/second"], min_interval=0.01, clock=clock)
    assert limiter.try_acquire("k").allowed
    clock.advance(0.5)
    assert limiter.try_acquire("k").allowed
    before = limiter.usage("k")
    refusals = [limiter.try_acquire("k") for _ in range(20)]
    assert not any(refusals)
    assert {us(r.retry_after) for r in refusals} == {500_000}
    assert limiter.usage("k") == before
    clock.advance(0.5)
    assert limiter.try_acquire("k").allowed  # exactly when the first call leaves


def test_acquire_timeout_raises_and_books_nothing(make_limiter: Any) -> None:
    clock = FakeClock()
    limiter = make_limiter(rates=["1/second"], clock=clock)
    limiter.acquire("k")
    with pytest.raises(ThrottleTimeout) as refused:
        limiter.acquire("k", timeout=0.5)
    assert us(refused.value.retry_after) == US
    with pytest.raises(ThrottleTimeout):
        limiter.acquire("k", timeout=timedelta(0))
    assert used(limiter, "k") == (1,) and clock.slept == []
    decision = limiter.acquire("k", timeout=1.0)  # the slot is exactly the timeout away
    assert us(decision.waited) == US and decision.allowed


def test_timeout_equal_to_the_wait_is_enough(make_limiter: Any) -> None:
    """2.01 * 1e6 is 2009999.9999999998 in floats: the wait must not be truncated."""
    limiter = make_limiter(rates=[Rate(1, 2.01)], clock=StillClock())
    limiter.acquire("k")
    assert us(limiter.acquire("k", timeout=2.01).waited) == 2_010_000


def test_cost_above_a_limit_fails_at_once_without_touching_the_store(make_limiter: Any) -> None:
    limiter = make_limiter(rates=["10/second", "3/minute"])
    with pytest.raises(CostTooHigh) as error:
        limiter.acquire("k", cost=4)
    assert isinstance(error.value, ValueError) and isinstance(error.value, ConfigurationError)
    assert "4" in str(error.value)
    with pytest.raises(CostTooHigh):
        limiter.try_acquire("k", cost=11)
    assert used(limiter, "k") == (0, 0)
    assert limiter.try_acquire("k", cost=3).allowed


# -- pause ---------------------------------------------------------------------------------


def test_pause_blocks_every_holder_and_only_moves_forward(make_limiter: Any) -> None:
    clock = FakeClock()
    limiter = make_limiter(rates=["10/second"], clock=clock)
    other = twin(limiter)
    assert limiter.try_acquire("k").allowed
    until = limiter.pause("k", 5)
    assert us(until) == us(clock.now) + 5 * US
    assert us(other.pause("k", 1)) == us(until)  # a shorter pause does not shorten it
    refused = other.try_acquire("k")
    assert us(refused.retry_after) == 5 * US and us(refused.paused_until) == us(until)
    usage = other.usage("k")
    assert us(usage.paused_for) == 5 * US and us(usage.next_slot_in) == 5 * US
    clock.advance(2)
    assert us(limiter.pause("k", 4)) == us(clock.now) + 4 * US  # a longer one extends it
    decision = other.acquire("k")
    assert us(decision.waited) == 4 * US and us(decision.slot) == us(until) + US
    assert limiter.try_acquire("k").allowed and limiter.try_acquire("other key").allowed


def test_pause_and_min_interval_combine(make_limiter: Any) -> None:
    clock = FakeClock()
    limiter = make_limiter(rates=["10/second"], min_interval=3, clock=clock)
    limiter.acquire("k")
    limiter.pause("k", 1)
    assert us(limiter.try_acquire("k").retry_after) == 3 * US  # the gap outlasts the pause


# -- usage, reset, namespaces ----------------------------------------------------------------


def test_usage_reports_and_changes_nothing(make_limiter: Any) -> None:
    clock = FakeClock()
    limiter = make_limiter(rates=["3/second", "5/minute"], min_interval=0.2, clock=clock)
    fresh = limiter.usage("k")
    assert [(r.used, r.booked, r.remaining, r.resets_in) for r in fresh.rates] == [
        (0, 0, 3, 0),
        (0, 0, 5, 0),
    ]
    assert (fresh.next_slot_in, fresh.paused_for, fresh.paused_until) == (0, 0, None)
    limiter.acquire("k")
    clock.advance(0.3)
    limiter.acquire("k", cost=2)
    usage = limiter.usage("k")
    assert [r.rate for r in usage.rates] == [Rate(3, 1), Rate(5, 60)]
    assert [(r.used, r.booked, r.remaining) for r in usage.rates] == [(3, 0, 0), (3, 0, 2)]
    # 3/second takes a call once the first one leaves its window; 5/minute takes one now.
    assert [us(r.resets_in) for r in usage.rates] == [700_000, 0]
    assert us(usage.next_slot_in) == 700_000  # 3/second is full until the first call leaves
    assert usage.paused_for == 0
    assert all(limiter.usage("k") == usage for _ in range(3))
    clock.advance(0.7)
    assert limiter.try_acquire("k").allowed  # usage() reserved nothing


def test_usage_splits_used_from_booked(make_limiter: Any) -> None:
    """Slots up to now are used, slots ahead are booked; resets_in says when a call can go."""
    limiter = make_limiter(rates=["10/second", "100/minute"], clock=StillClock())
    for _ in range(30):
        limiter.acquire("k")  # slots: ten at 0 s, ten at 1 s, ten at 2 s
    per_second, per_minute = limiter.usage("k").rates
    assert (per_second.used, per_second.booked, per_second.remaining) == (10, 20, 0)
    assert (per_minute.used, per_minute.booked, per_minute.remaining) == (10, 20, 70)
    # 10/second takes one more once the ten at 2 s are the only ones in its window.
    assert (us(per_second.resets_in), us(per_minute.resets_in)) == (3 * US, 0)
    assert us(limiter.usage("k").next_slot_in) == 3 * US
    assert us(limiter.try_acquire("k").retry_after) == 3 * US


def test_usage_by_store_key_reads_the_key_whose_store_key_it_is(make_limiter: Any) -> None:
    """What ``throttle-client top`` does: it finds store keys, never the keys themselves,
    and reads each with a limiter that never saw the key."""
    limiter = make_limiter(rates=["3/second", "5/minute"], namespace="crawl", clock=StillClock())
    for _ in range(4):
        limiter.acquire("ghp_token")  # three used now, one booked a second ahead
    hashed = limiter.store_key("ghp_token")
    assert limiter.usage(store_key=hashed) == limiter.usage("ghp_token")
    reader = twin(limiter, namespace="crawl", margin=0)
    usage = reader.usage(store_key=hashed)
    assert [(r.used, r.booked, r.remaining) for r in usage.rates] == [(3, 1, 0), (3, 1, 1)]
    assert us(usage.next_slot_in) == US  # when the first three leave 3/second's window
    # Another key's store key reads that key: an empty log.
    other = reader.usage(store_key=reader.store_key("another token"))
    assert [(r.used, r.booked) for r in other.rates] == [(0, 0), (0, 0)]
    assert [(r.used, r.booked) for r in limiter.usage("ghp_token").rates] == [(3, 1), (3, 1)]


def test_usage_by_store_key_refuses_what_is_not_one_of_the_namespace(make_limiter: Any) -> None:
    limiter = make_limiter(rates=["3/second"], namespace="crawl")
    for wrong in [
        "ghp_token",  # the key itself, where its store key was meant
        limiter.store_key("ghp_token").replace("crawl:", "other:"),
        "crawl:no-braces",
    ]:
        with pytest.raises(ConfigurationError, match="is not a store key of namespace 'crawl'"):
            limiter.usage(store_key=wrong)
    with pytest.raises(TypeError, match="not both"):
        limiter.usage("ghp_token", store_key=limiter.store_key("ghp_token"))
    with pytest.raises(TypeError, match="a str, not NoneType"):
        limiter.usage()


def test_booked_slots_become_used_as_time_reaches_them(make_limiter: Any) -> None:
    clock = StillClock()
    limiter = make_limiter(rates=["2/second"], clock=clock)
    for _ in range(3):
        limiter.acquire("k")  # slots 0, 0 and 1 s; the sleeps do not move the clock
    usage = limiter.usage("k").rates[0]
    assert (usage.used, usage.booked, usage.remaining, us(usage.resets_in)) == (2, 1, 0, US)
    clock.advance(1)  # the two at 0 leave the window as the one at 1 s enters it
    usage = limiter.usage("k").rates[0]
    assert (usage.used, usage.booked, usage.remaining, us(usage.resets_in)) == (1, 0, 1, 0)


def test_reset_forgets_the_key(make_limiter: Any) -> None:
    clock = FakeClock()
    limiter = make_limiter(rates=["1/minute"], clock=clock)
    limiter.acquire("k")
    limiter.acquire("other")
    limiter.pause("k", 30)
    limiter.reset("k")
    usage = limiter.usage("k")
    assert usage.rates[0].used == 0 and usage.paused_until is None
    assert limiter.try_acquire("k").allowed
    assert not limiter.try_acquire("other").allowed  # other keys are untouched
    limiter.reset("never seen")  # forgetting an unknown key is fine


def test_keys_and_namespaces_are_isolated(make_limiter: Any) -> None:
    limiter = make_limiter(rates=["1/minute"], namespace="a")
    same = twin(limiter, namespace="a")
    other = twin(limiter, namespace="b")
    assert limiter.try_acquire("token").allowed
    assert not same.try_acquire("token").allowed
    assert other.try_acquire("token").allowed
    assert limiter.try_acquire("token2").allowed
    other.pause("token2", 60)
    assert limiter.usage("token2").paused_until is None


# -- the sliding window ----------------------------------------------------------------------


def test_window_slides_and_is_half_open(make_limiter: Any) -> None:
    clock = FakeClock()
    limiter = make_limiter(rates=["2/second"], clock=clock)
    limiter.try_acquire("k")
    clock.advance(0.5)
    limiter.try_acquire("k")
    clock.advance(0.499999)
    assert us(limiter.try_acquire("k").retry_after) == 1  # one microsecond short
    clock.advance(0.000001)
    # At exactly 1 s the call from 0 is out of (now - 1 s, now]; the one from 0.5 s is in.
    usage = limiter.usage("k").rates[0]
    assert (usage.used, usage.booked, usage.remaining, usage.resets_in) == (1, 0, 1, 0)
    assert limiter.try_acquire("k").remaining == (0,)
    # A fixed window would start afresh at 1 s and admit a second call; a sliding one
    # waits for the call at 0.5 s to leave.
    assert us(limiter.try_acquire("k").retry_after) == 500_000


def test_decision_fields(make_limiter: Any) -> None:
    clock = FakeClock()
    limiter = make_limiter(rates=["2/second"], clock=clock)
    admitted = limiter.try_acquire("k", cost=2)
    assert admitted and admitted.allowed and admitted.cost == 2
    assert (admitted.retry_after, admitted.waited, admitted.paused_until) == (0, 0, None)
    assert us(admitted.slot) == us(clock.now) and admitted.rates == (Rate(2, 1),)
    refused = limiter.try_acquire("k")
    assert not refused and us(refused.slot) == us(clock.now) + US


def test_a_store_forgets_a_key_by_its_store_key_and_answers_a_ping(make_limiter: Any) -> None:
    limiter = make_limiter(rates=["1/minute"])
    assert limiter.try_acquire("k") and limiter.try_acquire("other")
    assert not limiter.try_acquire("k")
    store, name = limiter.backend, limiter.store_key("k")
    if make_limiter.mode == "async":
        limiter.loop.run_until_complete(store.aping())
        limiter.loop.run_until_complete(store.aforget(name))
    else:
        store.ping()
        store.forget(name)
    # Forgotten, as a worker that never saw it finds. (The store's forget() runs on the
    # host's clock, this limiter on a test's: to it the reset's marker is long gone, and
    # a key it booked on begun afresh would be one the store lost.)
    newcomer = make_limiter(rates=["1/minute"], backend=store, clock=limiter._config.clock)
    assert newcomer.try_acquire("k")
    assert not limiter.try_acquire("other")  # only that key


def test_a_slot_waits_its_turn_then_runs_the_block() -> None:
    clock = FakeClock()
    limiter = Limiter(MemoryBackend(), rates=["2/second"], clock=clock, sleep=clock.sleep, margin=0)
    start, ran = clock(), []
    for _ in range(3):
        with limiter.slot("token") as decision:
            ran.append(round(clock() - start, 3))
    assert ran == [0.0, 0.0, 1.0] and decision.waited == 1.0


def test_an_async_slot_waits_its_turn_then_runs_the_block() -> None:
    clock = FakeClock()
    limiter = AsyncLimiter(
        MemoryBackend(), rates=["2/second"], clock=clock, sleep=clock.asleep, margin=0
    )
    start, ran = clock(), []

    async def main() -> None:
        for _ in range(3):
            async with limiter.slot("token", timeout=5):
                ran.append(round(clock() - start, 3))

    asyncio.run(main())
    assert ran == [0.0, 0.0, 1.0]
