"""The margin: the quota held as the upstream counts it, by arrival, not only by slot.

A request leaves a little after its slot. ``margin`` widens every window and a
non-zero gap in the slot arithmetic, and a call that wakes (or hears back) later
than slot + margin books a new slot instead of going. Here on every backend, sync
and async, with a fake clock whose sleeps and answers can run late on purpose.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from datetime import timedelta
from typing import Any

import httpx
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from throttle_client import (
    Backend,
    ConfigurationError,
    Limiter,
    MemoryBackend,
    RedisBackend,
    ThrottledClient,
)
from throttle_client._acquiring import MAX_REBOOKS
from throttle_client._pacing import WARM_UP, Pacing
from throttle_client._store_clock import StoreClock
from throttle_client.testing import FakeClock, RedisServer

US = 1_000_000


def us(seconds: float) -> int:
    return round(seconds * US)


def late_sleeper(clock: FakeClock, overshoots: list[float], asynchronous: bool) -> Any:
    """A sleep that wakes ``overshoots.pop(0)`` seconds late (then on time)."""

    def sleep(seconds: float) -> None:
        clock.sleep(seconds + (overshoots.pop(0) if overshoots else 0.0))

    async def asleep(seconds: float) -> None:
        sleep(seconds)

    return asleep if asynchronous else sleep


def test_margin_widens_every_window_and_the_gap(make_limiter: Any) -> None:
    clock = FakeClock()
    limiter = make_limiter(rates=["2/second"], min_interval=0.1, margin=0.05, clock=clock)
    start = us(clock.now)
    assert us(limiter.acquire("k").slot) == start
    assert us(limiter.try_acquire("k").retry_after) == 150_000  # gap 0.1 + margin
    assert us(limiter.acquire("k").slot) == start + 150_000
    assert us(limiter.acquire("k").slot) == start + 1_050_000  # window 1 s + margin
    assert limiter.margin == 0.05


def test_without_a_gap_the_margin_spaces_nothing(make_limiter: Any) -> None:
    clock = FakeClock()
    limiter = make_limiter(rates=["3/second"], margin=timedelta(milliseconds=50), clock=clock)
    assert all(limiter.try_acquire("k").allowed for _ in range(3))  # all three now
    assert us(limiter.try_acquire("k").retry_after) == 1_050_000


def test_a_late_wakeup_books_a_new_slot_and_leaves_the_late_one_booked(
    make_limiter: Any, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    overshoots = [0.1]  # the first sleep wakes 100 ms late, past the 25 ms margin
    sleep = late_sleeper(clock, overshoots, make_limiter.mode == "async")
    limiter = make_limiter(rates=["1/second"], margin=0.025, clock=clock, sleep=sleep)
    start = us(clock.now)
    assert limiter.acquire("k").late_wakeups == 0
    with caplog.at_level(logging.DEBUG, logger="throttle_client"):
        decision = limiter.acquire("k")
    # Booked 1.025, woke at 1.125: too late to go, so it booked 2.05 and went then.
    assert decision.late_wakeups == 1
    assert us(decision.slot) == start + 2_050_000 == us(clock.now)
    assert us(decision.waited) == 1_025_000 + 925_000  # the sleeps it asked for
    assert limiter.usage("k").rates[0].used == 1  # the late slot counts, unused, in (1.05, 2.05]
    late = [r for r in caplog.records if "past its slot" in r.getMessage()]
    assert len(late) == 1 and late[0].levelno == logging.DEBUG
    assert "100.0 ms" in late[0].getMessage()


def test_a_wakeup_within_the_margin_goes(make_limiter: Any) -> None:
    clock = FakeClock()
    sleep = late_sleeper(clock, [0.02], make_limiter.mode == "async")
    limiter = make_limiter(rates=["1/second"], margin=0.025, clock=clock, sleep=sleep)
    limiter.acquire("k")
    decision = limiter.acquire("k")
    assert decision.late_wakeups == 0 and us(clock.now) - us(decision.slot) == 20_000


def test_a_margin_of_zero_never_rebooks(make_limiter: Any) -> None:
    clock = FakeClock()
    sleep = late_sleeper(clock, [5.0], make_limiter.mode == "async")
    limiter = make_limiter(rates=["1/second"], margin=0, clock=clock, sleep=sleep)
    limiter.acquire("k")
    assert limiter.acquire("k").late_wakeups == 0  # only the slots are exact then


def slow_store(clock: FakeClock, delays: list[float], late: float) -> Any:
    """A memory store whose answers come back ``delays.pop(0)`` (then ``late``) seconds
    after it decided."""
    inner = MemoryBackend()

    class SlowAnswers(Backend):
        def execute(self, op: Any) -> Any:
            answer = inner.execute(op)
            clock.advance(delays.pop(0) if delays else late)
            return answer

    return SlowAnswers()


def test_a_late_answer_to_try_acquire_is_a_refusal() -> None:
    """The store booked the slot now, but its answer came back 50 ms later: the call
    would leave 50 ms after its slot. try_acquire says no (the late slot stays booked)."""
    clock = FakeClock()
    limiter = Limiter(slow_store(clock, [0.0], 0.05), rates=["5/second"], margin=0.025, clock=clock)
    limiter.try_acquire("other")  # a quick answer: the store's clock is known exactly
    decision = limiter.try_acquire("k")
    assert not decision.allowed and decision.late_wakeups == 1
    assert limiter.usage("k").rates[0].used == 1  # one late slot, never more


def test_slow_answers_book_a_slot_far_enough_ahead_once() -> None:
    """Every answer comes back 50 ms late: a slot due now cannot be met, so the call
    books again with a lead of twice that round trip, sleeps to it, and goes. Slow
    answers cost one unused slot per call, not a cascade of them."""
    clock = FakeClock()
    limiter = Limiter(
        slow_store(clock, [0.0], 0.05),
        rates=["20/second"],
        margin=0.025,
        clock=clock,
        sleep=clock.sleep,
    )
    limiter.try_acquire("other")
    start = us(clock.now)
    decision = limiter.acquire("k")
    assert decision.allowed and decision.late_wakeups == 1
    assert us(decision.slot) == start + 50_000 + 100_000  # asked at 50 ms, 100 ms ahead
    assert us(clock.now) == us(decision.slot)  # went on time
    assert limiter.usage("k").rates[0].used == 2  # the late slot and this one


def test_an_answer_slower_than_the_margin_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    """When every round trip is longer than the margin, no call can be proven on time.
    Over the first answers that counts as late (a cold start passes); a store that stays
    that far is said so once, and calls go by the most hopeful estimate instead of
    booking again forever."""
    clock = FakeClock()
    store = slow_store(clock, [], 0.05)  # every answer takes 50 ms to come back
    limiter = Limiter(store, rates=["100/second"], margin=0.025, clock=clock, sleep=clock.sleep)
    with caplog.at_level(logging.WARNING, logger="throttle_client"):
        first = limiter.acquire("k")  # a cold start: books again, one round trip ahead
        decisions = [limiter.try_acquire("k") for _ in range(WARM_UP + 3)]
    assert first.allowed and first.late_wakeups == 1
    assert all(d.allowed and not d.late_wakeups for d in decisions)  # try_acquire never
    warned = [r for r in caplog.records if "too slow for margin" in r.getMessage()]
    assert len(warned) == 1 and "50.0 ms" in warned[0].getMessage()


def test_the_look_for_a_pause_goes_before_the_slot() -> None:
    """A transport's call that slept looks at its key for a pause before it goes. Every
    answer here takes 20 ms, most of the 25 ms margin: a look made after waking would
    make every call late, and book again, for ever. It is sent a round trip and a half
    before the slot instead, and the call goes on time."""
    clock = FakeClock()
    store = slow_store(clock, [], 0.02)
    limiter = Limiter(store, rates=["2/second"], margin=0.025, clock=clock, sleep=clock.sleep)
    seen: list[Any] = []
    limiter.listen(seen.append)
    sent: list[float] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        sent.append(clock.now)
        return httpx.Response(200)

    client = ThrottledClient(limiter, transport=httpx.MockTransport(upstream), acquire_timeout=5)
    for _ in range(5):
        client.get("https://api.test/", headers={"Authorization": "Bearer T"})
    assert not [e for e in seen if e.kind == "late_wakeup"]
    assert sent[-1] - sent[0] < 2.2  # five calls of 2/second: two windows and a bit


def test_a_call_late_again_and_again_goes_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """A process whose every sleep wakes 100 ms late (an overloaded event loop) cannot
    keep any call within a 25 ms margin. Each late wake-up books a new slot, but not for
    ever: after MAX_REBOOKS the call goes, and a warning says what to change, once."""
    clock = FakeClock()
    sleep = late_sleeper(clock, [0.1] * 100, asynchronous=False)
    limiter = Limiter(MemoryBackend(), rates=["1/second"], margin=0.025, clock=clock, sleep=sleep)
    limiter.acquire("k")  # (at once: no sleep)
    with caplog.at_level(logging.WARNING, logger="throttle_client"):
        decisions = [limiter.acquire("k") for _ in range(2)]
    assert all(d.allowed and d.late_wakeups == MAX_REBOOKS + 1 for d in decisions)
    warned = [r for r in caplog.records if "too slow for margin" in r.getMessage()]
    assert len(warned) == 1 and "100.0 ms late" in warned[0].getMessage()


@pytest.mark.parametrize("bad", [-0.001, float("nan"), float("inf"), "25ms", None])
def test_a_bad_margin_is_refused_by_name(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="margin"):
        Limiter(MemoryBackend(), rates=["1/second"], margin=bad)


# -- the guarantee, on random late wake-ups and slow answers --------------------------------

RATES = [(3, US), (5, 3 * US)]
GAP = 100_000
MARGIN = 25_000


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.integers(0, 400_000),  # idle time before the call (µs)
            st.integers(0, 3 * MARGIN),  # how late its sleep wakes
            st.integers(0, 2 * MARGIN),  # how late the store's answer comes back
            st.booleans(),  # try_acquire instead of acquire
        ),
        min_size=1,
        max_size=40,
    )
)
def test_calls_leave_within_the_margin_and_arrivals_keep_the_exact_quota(
    steps: list[tuple[int, int, int, bool]],
) -> None:
    """Whatever the lateness of sleeps and answers, every admitted call returns no
    earlier than its slot and at most ``margin`` after it; so the times the calls
    leave (what an upstream counts) keep the exact quota, not only the slots."""
    clock = FakeClock()
    inner = MemoryBackend()
    answer_delays: list[float] = []
    wake_delays: list[float] = []

    class SlowAnswers(Backend):
        def execute(self, op: Any) -> Any:
            answer = inner.execute(op)
            clock.advance(answer_delays.pop(0) if answer_delays else 0.0)
            return answer

    def sleep(seconds: float) -> None:
        clock.advance(seconds + (wake_delays.pop(0) if wake_delays else 0.0))

    limiter = Limiter(
        SlowAnswers(),
        rates=[f"{limit}/{period / US} seconds" for limit, period in RATES],
        min_interval=GAP / US,
        margin=MARGIN / US,
        clock=clock,
        sleep=sleep,
    )
    limiter.try_acquire("warm-up")  # a quick answer: the store's clock is known exactly
    left: list[int] = []
    for idle, wake_late, answer_late, trying in steps:
        clock.advance(idle / US)
        wake_delays[:] = [wake_late / US]
        answer_delays[:] = [answer_late / US]
        decision = limiter.try_acquire("k") if trying else limiter.acquire("k")
        if decision.allowed:
            gone = us(clock.now)
            # (1 µs: times are float seconds since the epoch, exact to a quarter of a µs.)
            assert us(decision.slot) - 1 <= gone <= us(decision.slot) + MARGIN
            left.append(gone)
    for t in left:
        for limit, period in RATES:
            assert sum(1 for u in left if t - period < u <= t) <= limit
    assert all(b - a >= GAP for a, b in itertools.pairwise(left))


def test_an_answer_from_another_clock_replaces_what_was_known() -> None:
    """A failover or another Cluster node answers with a clock 50 ms ahead: the bracket
    kept from the old clock would wake calls 50 ms early on the new one. It is dropped."""
    known = StoreClock(drift=0.0)
    known.observe(10.0, 10.0, 1000.0)  # offset exactly 990
    known.observe(11.0, 11.001, 1001.05)  # offset in [990.049, 990.05]: outside, ahead
    assert known.low(11.0) == pytest.approx(990.049) and known.high(11.0) == pytest.approx(990.05)
    assert known.wake_at(1002.0) >= 1002.0 - 990.049 - 1e-9  # never before on the new clock


def test_a_sleep_that_ends_early_is_slept_out() -> None:
    """A timer that fires 2 ms early (uvloop rounds to milliseconds) must not let a call
    go before its slot: the rest is slept too."""
    margin = 0.025
    overran: list[float] = []

    def early_timer(seconds: float) -> None:
        asked = seconds - 0.002 if seconds > 0.01 else seconds
        started = time.monotonic()
        time.sleep(asked)
        overran.append(time.monotonic() - started - asked)

    backend = MemoryBackend()  # the host's clock, as the store's
    limiter = Limiter(backend, rates=["1/0.05 seconds"], margin=margin, sleep=early_timer)
    limiter.acquire("k")
    decision = limiter.acquire("k")
    assert time.time() >= decision.slot  # whatever the machine's load
    # Slept out, the call went within its margin: it booked no second slot. Unless this
    # machine woke a sleep half the margin late (a loaded run): then booking again is
    # what the margin asks for, and only the line above can be held.
    if max(overran) < margin / 2:
        assert decision.late_wakeups == 0, overran


def test_a_call_booked_at_the_end_of_a_pause_keeps_its_slot() -> None:
    """A transport's look for a pause, made before the slot, finds the pause the call was
    booked after still in force: that is no reason to book again."""
    clock = FakeClock()
    store = slow_store(clock, [], 0.002)  # the look goes 3 ms before the slot
    limiter = Limiter(store, rates=["4/second"], clock=clock, sleep=clock.sleep)
    seen: list[Any] = []
    limiter.listen(seen.append)
    limiter.pause("T", 1.0)
    sent: list[float] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        sent.append(clock.now)
        return httpx.Response(200)

    client = ThrottledClient(limiter, transport=httpx.MockTransport(upstream))
    started = clock.now
    for _ in range(4):
        client.get("https://api.test/", headers={"Authorization": "Bearer T"})
    # All four booked at the pause's end, and sent then (each answer took 2 ms).
    assert all(1.0 <= t - started <= 1.0 + 4 * 0.002 + 1e-6 for t in sent), sent
    assert not [e for e in seen if e.kind == "late_wakeup"]


def test_a_lead_never_outlasts_the_wait_allowed() -> None:
    """Slow answers make a limiter ask for slots a round trip ahead; a caller that waits
    less than that still gets an idle key's slot within its timeout."""
    clock = FakeClock()
    store = slow_store(clock, [], 0.01)  # every answer takes 10 ms, 4 of them the margin
    limiter = Limiter(store, rates=["100/second"], margin=0.025, clock=clock, sleep=clock.sleep)
    for key in ("a", "b", "c"):
        limiter.acquire(key)  # (the round trip is learned)
    decisions = [limiter.acquire(f"idle-{n}", timeout=0.015) for n in range(5)]
    assert all(d.allowed for d in decisions)


# Holds the server for about ``ARGV[1]`` ms: another client's slow script, a busy moment.
BUSY = """
local t0 = redis.call('TIME')
repeat
  local t = redis.call('TIME')
until (t[1] - t0[1]) * 1000000 + (t[2] - t0[2]) >= tonumber(ARGV[1]) * 1000
return 1
"""


def test_a_moment_the_store_was_busy_leads_no_call_after_it(own_redis: RedisServer) -> None:
    """A call that waited behind another client's slow script (~150 ms) had a long round
    trip, but its answer came back as soon as the store decided: the calls after it,
    the store idle again, are not booked a lead ahead (twice that round trip, ~0.3 s) as
    if the store were far away, nor sleep to it. (Judged by the total they slept, which
    a busy machine's scheduling alone keeps to a few ms.)"""
    limiter = Limiter(RedisBackend(own_redis.url), rates=["1000/second"])
    for _ in range(4):  # (the first opens the connection and loads the script)
        limiter.acquire("k")
    busy = redis.Redis.from_url(own_redis.url)
    holding = threading.Thread(target=busy.eval, args=(BUSY, 0, 200))
    holding.start()
    time.sleep(0.05)  # (the slow script has begun)
    started = time.monotonic()
    behind = limiter.acquire("k")
    assert time.monotonic() - started > 0.05  # it did wait behind the slow script
    holding.join()
    after = [behind.waited] + [limiter.acquire("k").waited for _ in range(5)]
    assert sum(after) < 0.05, after
    busy.close()
    limiter.backend.close()


def test_a_store_clock_that_steps_ahead_keeps_the_lead_of_a_distant_store() -> None:
    """A store 40 ms away (on the way back) whose clock steps 35 ms ahead, less than a
    round trip (or a failover to a node that far ahead): the step is within what the
    clock's bracket allows, so it is not taken for a new clock, and the bracket would
    take the step off the answer's way back. The lead a call asks for still follows the
    round trips measured: 40 ms, past the margin's quarter, so calls keep booking ahead."""
    pacing = Pacing(injected=False)
    offset, out, back = 1000.0, 0.0001, 0.040
    t = 10.0

    def answer(step: float, timed: bool = True) -> None:
        nonlocal t
        decided = t + out
        pacing.observe(True, t, decided + back, round((decided + offset + step) * US), timed)
        t = decided + back + 0.2

    answer(0.0, timed=False)  # (a cold answer)
    for _ in range(10):
        answer(0.0)
    assert 0.040 <= pacing.rtt < 0.041
    for _ in range(300):  # a minute of answers after the step
        answer(0.035)
        assert pacing.rtt >= 0.040
