"""Calendar rates: a limit per fixed window of the calendar in a time zone,
counted by every store in the same atomic step as the sliding rates, the gap and the
caps. The Hypothesis comparison with the model is in test_model.py (its machine draws
calendar rates, starting near DST changes, month ends and a leap day); here: the
spelling, worked examples on every store (sync and async), stacked and capped calls,
and the stale-windows round trip."""

from __future__ import annotations

from datetime import date, datetime
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from tests.store_calls import store_calls
from throttle_client import (
    BackendError,
    ConfigurationError,
    Limiter,
    MemoryBackend,
    Rate,
    RedisBackend,
    ThrottleTimeout,
)
from throttle_client._backends.base import Acquire, Quota, Windows
from throttle_client.testing import FakeClock

LA = "America/Los_Angeles"
HOUR = 3600.0


def local(zone: str, *wall: int) -> float:
    return datetime(*wall, tzinfo=ZoneInfo(zone)).timestamp()  # type: ignore[misc]


def wall(zone: str, seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, ZoneInfo(zone)).replace(tzinfo=None)


# -- spelling ---------------------------------------------------------------------------


def test_a_calendar_rate_is_spelled_in_rate_and_in_strings() -> None:
    day = Rate(10000, "day", tz=LA)
    assert day == Rate.parse("10000/day in America/Los_Angeles")
    assert day.calendar is not None and (day.calendar.unit, day.calendar.tz) == ("day", LA)
    month = Rate(3000, "month", anchor=date(2026, 1, 30))
    assert month == Rate.parse("3000/month from 2026-01-30") == Rate(3000, "month", anchor=30)
    assert month.calendar is not None and month.calendar.anchor_day == 30
    assert Rate.parse("5/month") == Rate(5, "month", tz="UTC")  # a month is never sliding
    assert Rate.parse("10/hours in Europe/Berlin").calendar is not None
    assert Rate.parse("10/day").calendar is None  # no zone: the sliding 24 hours, as before
    assert eval(repr(month)) == month and str(day) == "10000/day in America/Los_Angeles"
    assert Rate.parse(str(month)) == month  # "3000/month in UTC from day 30"
    assert Rate.parse("3000/month from 30") == month
    assert Rate(1, "day", tz=ZoneInfo(LA)) == Rate(1, "day", tz=LA)
    either = Rate.parse("3/month from 2026-01-30 in America/Chicago")
    assert either == Rate.parse("3/month in America/Chicago from day 30")
    # Only the anchor's day of the month counts: a plan's months before the date too.
    assert Rate(1, "month", anchor=date(2020, 7, 30)) == month.__class__(1, "month", anchor=30)


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda: Rate(10, "day"), "tz='UTC'"),
        (lambda: Rate(10, "fortnight", tz="UTC"), "'fortnight'"),
        (lambda: Rate(10, "day", tz="Mars/Olympus"), "'Mars/Olympus'"),
        (lambda: Rate(10, "day", anchor=date(2026, 1, 30)), "anchor= applies to monthly"),
        (lambda: Rate(10, "month", anchor=32), "32"),
        (lambda: Rate(10, "month", anchor="30 January"), "'30 January'"),
        (lambda: Rate(10, 3600, tz="UTC"), "3600"),
        (lambda: Rate.parse("10/2 days in UTC"), "'10/2 days in UTC'"),
        (lambda: Rate.parse("10/day in Nowhere"), "'Nowhere'"),
        (lambda: Rate.parse("10/month from day 32"), "32"),
        (lambda: Rate.parse("5/week"), "'5/week in UTC'"),
        (lambda: Rate(10, "day", tz=""), "not ''"),
        (lambda: Rate(10, "day", tz="localtime"), "'localtime'"),
        (lambda: Rate(10, "month", anchor=datetime(2026, 1, 30)), "not a datetime"),
        (lambda: Limiter(MemoryBackend(), rates="10/minute in UTC", margin=20), "margin=20"),
    ],
)
def test_a_bad_calendar_rate_is_refused_naming_the_value(make: Any, named: str) -> None:
    with pytest.raises(ConfigurationError, match=named.replace("(", r"\(").replace(")", r"\)")):
        make()


# -- worked examples on every store --------------------------------------------------------


def test_a_day_in_los_angeles_resets_at_its_midnight_across_the_23_hour_day(
    make_limiter: Any,
) -> None:
    clock = FakeClock(local(LA, 2026, 3, 7, 23, 59, 0))
    limiter = make_limiter(rates=[Rate(2, "day", tz=LA), "10/second"], clock=clock)
    slots = [wall(LA, limiter.acquire("k").slot) for _ in range(5)]
    assert slots == [
        datetime(2026, 3, 7, 23, 59),
        datetime(2026, 3, 7, 23, 59),
        datetime(2026, 3, 8, 0, 0),  # the next window, booked at once: one sleep
        datetime(2026, 3, 8, 0, 0),
        datetime(2026, 3, 9, 0, 0),  # 23 hours later: the clocks went forward
    ]
    # The clock slept to each slot: it is 9 March, 00:00, with one of the day's 2 left.
    assert limiter.try_acquire("k").allowed
    refused = limiter.try_acquire("k")
    assert not refused.allowed and refused.retry_after == pytest.approx(24 * HOUR)
    usage = limiter.usage("k")
    day = usage.rates[0]
    assert (day.used, day.booked, day.remaining) == (2, 0, 0)
    assert day.resets_at == local(LA, 2026, 3, 10, 0, 0)  # the end of the window holding now
    assert usage.rates[1].resets_at is None  # a sliding rate has no calendar window


def test_a_month_anchored_on_the_30th_clamps_to_february(make_limiter: Any) -> None:
    clock = FakeClock(local("UTC", 2026, 1, 30, 12, 0))
    limiter = make_limiter(rates=[Rate(1, "month", anchor=date(2026, 1, 30))], clock=clock)
    starts = [wall("UTC", limiter.acquire("k").slot) for _ in range(4)]
    assert starts == [
        datetime(2026, 1, 30, 12, 0),
        datetime(2026, 2, 28),  # 30 January -> 28 February -> 30 March -> 30 April
        datetime(2026, 3, 30),
        datetime(2026, 4, 30),
    ]


def test_the_margin_counts_a_call_just_before_midnight_in_the_next_day_too(
    make_limiter: Any,
) -> None:
    """A call whose slot is 10 ms before midnight may reach the upstream after it: with a
    margin of 25 ms it counts against both days."""
    clock = FakeClock(local("UTC", 2026, 5, 2) - 0.01)
    limiter = make_limiter(rates=[Rate(1, "day", tz="UTC")], clock=clock, margin=0.025)
    limiter.acquire("k")
    nxt = limiter.acquire("k")  # midnight's window is full of the late one: a day later
    assert wall("UTC", nxt.slot) == datetime(2026, 5, 3)


def test_calendar_sliding_gap_and_hour_rates_hold_together(make_limiter: Any) -> None:
    start = local(LA, 2026, 11, 1, 0, 59, 58)  # 01:00-02:00 comes twice
    clock = FakeClock(start)
    limiter = make_limiter(
        rates=[Rate(3, "hour", tz=LA), Rate(4, 2.0)], min_interval=0.5, clock=clock
    )
    slots = [limiter.acquire("k").slot - start for _ in range(8)]
    # 3 per hour, half a second apart: 00:59:58 to :59 (the midnight hour), then 01:00:00
    # to :01 (the first 01:00 hour), then the repeated 01:00 hour, an hour later.
    assert slots[:6] == [0.0, 0.5, 1.0, 2.0, 2.5, 3.0]
    assert slots[6:] == pytest.approx([2.0 + HOUR, 2.5 + HOUR])
    assert wall(LA, start + 2.0 + HOUR) == datetime(2026, 11, 1, 1, 0)  # the second one


# -- stacked and capped --------------------------------------------------------------------


def test_a_stacked_call_books_where_both_the_daily_and_the_sliding_rate_allow(
    make_limiter: Any,
) -> None:
    start = local("UTC", 2026, 6, 30, 23, 59, 59)
    clock = FakeClock(start)

    def tag(key: str) -> str:
        return "acct"  # every token of the account, with it, in one Cluster slot

    token = make_limiter(rates=[Rate(2, "day", tz="UTC")], clock=clock, namespace="token", tag=tag)
    account = make_limiter(
        rates=["3/hour"], clock=clock, namespace="account", backend=token._backend(), tag=tag
    )
    inner = getattr(account, "limiter", account)  # the AsyncLimiter behind a SyncView
    a, b = (token.acquire("a", also=[(inner, "acct")]) for _ in range(2))
    assert a.slot == b.slot == clock()
    third = token.acquire("a", also=[(inner, "acct")])  # the token's day is full
    assert wall("UTC", third.slot) == datetime(2026, 7, 1)
    fourth = token.acquire("b", also=[(inner, "acct")])  # the account's hour is full
    assert fourth.slot == pytest.approx(start + HOUR)


@pytest.mark.parametrize("kind", ["memory", "sqlite", "redis", "cluster"])
def test_a_capped_limiter_with_a_calendar_rate(kind: str, request: pytest.FixtureRequest) -> None:
    from throttle_client import SQLiteBackend

    if kind == "memory":
        backend: Any = MemoryBackend()
    elif kind == "sqlite":
        backend = SQLiteBackend(request.getfixturevalue("tmp_path") / "c.db")
    else:
        url = request.getfixturevalue("redis_url" if kind == "redis" else "cluster_url")
        backend = RedisBackend(url, cluster=kind == "cluster")
    clock = FakeClock(local("UTC", 2026, 2, 28, 23, 59))
    limiter = Limiter(
        backend,
        rates=[Rate(2, "day", tz="UTC")],
        max_concurrent=1,
        clock=clock,
        sleep=clock.sleep,
    )
    try:
        with limiter.lease("k") as first:
            assert first.slot == clock()
            with pytest.raises(ThrottleTimeout), limiter.lease("k", timeout=0):  # cap full
                pass
        with limiter.lease("k") as second:
            assert second.slot == clock()
        with limiter.lease("k") as third:  # the day is full: 1 March (2026 is no leap year)
            assert wall("UTC", third.slot) == datetime(2026, 3, 1)
            assert limiter.usage("k").in_flight == 1
        assert limiter.usage("k").in_flight == 0
    finally:
        backend.close()


# -- the windows the limiter gives, and stale answers ------------------------------------------


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_a_slot_beyond_the_windows_given_is_asked_again_once(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """A monthly rate full for the month pushes the slot 3 weeks on: the minute rate's
    windows given around now do not reach it, the store says so (writing nothing), and
    the limiter asks once more with windows there."""
    backend: Any = (
        MemoryBackend() if kind == "memory" else RedisBackend(request.getfixturevalue("redis_url"))
    )
    clock = FakeClock(local("UTC", 2026, 3, 7, 12, 0))
    limiter = Limiter(
        backend,
        rates=[Rate(2, "minute", tz="UTC"), Rate(3, "month", tz="UTC")],
        clock=clock,
        sleep=clock.sleep,
    )
    calls = store_calls(limiter)
    for _ in range(3):
        limiter.acquire("k")
    assert len(calls) == 3  # the second minute's window was given: no second ask
    fourth = limiter.acquire("k")
    assert wall("UTC", fourth.slot) == datetime(2026, 4, 1)
    assert len(calls) == 5  # once stale, once with windows around 1 April
    first_windows = calls[3].quota.limits[0][1]
    assert isinstance(first_windows, Windows)
    assert first_windows.spans[-1][1] < fourth.slot * 1e6  # the first ask did not reach it
    usage = limiter.usage("k")  # on 1 April, where the clock slept to
    assert [r.used for r in usage.rates] == [1, 1]
    assert usage.rates[1].resets_at == local("UTC", 2026, 5, 1)
    backend.close()


def test_a_store_clock_outside_the_windows_given_is_asked_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The limiter's guess of the store's time is two hours ahead, across midnight: the
    store answers stale with its now, and the windows around that are used."""
    clock = FakeClock(local("UTC", 2026, 3, 7, 23, 30))
    limiter = Limiter(
        MemoryBackend(), rates=[Rate(1, "day", tz="UTC")], clock=clock, sleep=clock.sleep
    )
    monkeypatch.setattr(limiter._pacing, "store_time_us", lambda now: round((now + 2 * HOUR) * 1e6))
    calls = store_calls(limiter)
    first = limiter.acquire("k")
    assert first.slot == clock()
    assert len(calls) == 2  # the first ask was stale (windows of a later day)
    assert wall("UTC", limiter.acquire("k").slot) == datetime(2026, 3, 8)
    assert len(calls) == 4  # the guess stays wrong here (a real one follows the store's)
    assert limiter.usage("k").rates[0].used == 1


def test_a_store_that_keeps_answering_stale_is_an_error() -> None:
    class Jumping(MemoryBackend):
        def execute(self, op: Any) -> Any:
            verdict = super().execute(op)
            return type(verdict)(False, 0, 0, 0, (), stale=True)

    limiter = Limiter(Jumping(), rates="1/day in UTC")
    with pytest.raises(BackendError, match="moved on 8 times"):
        limiter.acquire("k")


def test_the_lua_script_refuses_malformed_windows(redis_url: str) -> None:
    backend = RedisBackend(redis_url)
    overlapping = Windows(0, ((0, 10), (5, 20)), 0)
    with pytest.raises(BackendError, match="bad calendar rate #1"):
        backend.execute(Acquire("k", Quota(((1, overlapping),), 0), 1, 0, "c", now_us=1))
    backend.close()
