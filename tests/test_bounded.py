"""Bounded rates: a key's memory bounded whatever the limit, never over it.

The model comparison (tests/test_model.py) holds every store to the naive model with
bounded rates among the random ones; here are the promises one by one, on every store.
"""

from __future__ import annotations

import bisect
import sqlite3
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis

from throttle_client import ConfigurationError, Limiter, Rate, RedisBackend, SQLiteBackend
from throttle_client._backends.redis import redis_keys
from throttle_client.testing import FakeClock

# -- the option ------------------------------------------------------------------------------


def test_a_rate_is_bounded_by_keyword_or_in_its_string() -> None:
    day = Rate(70000, timedelta(days=1), buckets=48)
    assert day == Rate.parse("70000/day in 48 buckets") == Rate.parse(str(day))
    assert (day.bounded, day.buckets, day.bucket_us) == (True, 48, 1_800_000_000)
    assert Rate(10, 1, bounded=True).buckets == 60  # the default
    month = Rate.parse("1000000/month, bounded")
    assert month.bounded and month.buckets == 0 and month == Rate.parse(str(month))
    assert repr(month) == "Rate(1000000, 'month', tz='UTC', bounded=True)"
    assert not Rate.parse("5000/hour").bounded and Rate(5, 1) != Rate(5, 1, bounded=True)
    assert Rate.parse("10/month,bounded") == Rate(10, "month", tz="UTC", bounded=True)


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: Rate(10, 60, buckets=1), "from 2 to 1000, not 1"),
        (lambda: Rate(10, 60, buckets=1001), "not 1001"),
        (lambda: Rate(10, 60, buckets=2.5), "not 2.5"),
        (lambda: Rate(10, 60, buckets=True), "not True"),
        (lambda: Rate(10, 60, bounded="yes"), "bounded must be True or False, not 'yes'"),
        (lambda: Rate(10, "day", tz="UTC", buckets=24), "buckets=24 belongs to sliding rates"),
        (lambda: Rate.parse("10/day in 1 buckets"), "'10/day in 1 buckets'"),
        (lambda: Rate.parse("10/day in 123456 buckets"), "from 2 to 1000"),
        (lambda: Rate(10, 60, bounded=False, buckets=6), "buckets=6 makes a rate bounded"),
        (lambda: Rate(10, 5e-06, buckets=48), "5 µs cannot be counted in 48 buckets"),
        (lambda: Rate.parse("10/day in 48buckets"), "as '... in 48 buckets'"),
        (lambda: Rate.parse("10/month in 4 buckets"), "in a string: '..., bounded'"),
        (lambda: Rate.parse("10/day in 4 buckets, bounded"), "each optionally bounded"),
    ],
)
def test_a_bad_bucket_count_is_refused_by_name(make: Any, words: str) -> None:
    with pytest.raises(ConfigurationError, match=words.replace("(", r"\(")):
        make()


# -- the promises, on every store --------------------------------------------------------


def _slots(limiter: Any, calls: int) -> list[float]:
    slots = []
    for _ in range(calls):
        slots.append(limiter.acquire("token").slot)
    return slots


def test_a_bounded_rate_never_admits_more_and_holds_back_at_most_a_bucket(
    make_limiter: Any,
) -> None:
    """Forty calls, each as soon as the limiter lets it (it sleeps on the fake clock):
    no window of 60 s holds more than 10 slots, and the 11th call after any call comes
    at most one bucket (10 s) after that call's slot has left the window."""
    limiter = make_limiter(rates=[Rate(10, 60, buckets=6)])
    slots = _slots(limiter, 40)
    for i, slot in enumerate(slots):
        assert i - bisect.bisect_right(slots, slot - 60) + 1 <= 10, slots
    gaps = [later - slot for slot, later in zip(slots, slots[10:], strict=False)]
    assert min(gaps) >= 60 and max(gaps) <= 70 + 1e-6, gaps
    assert max(gaps) > 60  # (the buckets do hold calls back: else this test shows nothing)


def test_a_bounded_calendar_rate_decides_as_the_exact_one(make_limiter: Any) -> None:
    """Counted per window (and per margin before its end), a bounded calendar rate gives
    the very answers of the exact one, at the edges of the windows and of the margin."""
    clock = FakeClock(1_700_000_000 - 1_700_000_000 % 60 + 30)  # 30 s into a minute
    exact = make_limiter(
        rates=[Rate(3, "minute", tz="UTC")], margin=0.5, clock=clock, namespace="exact"
    )
    bounded = make_limiter(
        rates=[Rate(3, "minute", tz="UTC", bounded=True)],
        margin=0.5,
        clock=clock,
        backend=exact.backend,
        namespace="bounded",
    )
    answers: dict[str, list[Any]] = {"exact": [], "bounded": []}
    # Into the minute, then the margin before its end (which counts in the next one too),
    # its edges, the next minute's start, and a jump over a whole minute.
    for step in [0, 10, 19.4, 0.05, 0.05, 0.2, 0.29, 0.01, 0.3, 20, 39, 0.6, 61, 0.1, 0.2]:
        clock.advance(step)
        for name, limiter in (("exact", exact), ("bounded", bounded)):
            decision = limiter.try_acquire("token")
            usage = limiter.usage("token")
            answers[name].append(
                (
                    decision.allowed,
                    round(decision.retry_after, 6),
                    decision.remaining,
                    usage.rates[0].used,
                    round(usage.rates[0].resets_in, 6),
                )
            )
    assert answers["bounded"] == answers["exact"]
    assert sum(allowed for allowed, *_ in answers["exact"]) >= 6  # several windows were used


def test_a_bounded_limiter_counts_the_calls_of_an_exact_one_on_the_same_key(
    make_limiter: Any,
) -> None:
    """Against the rule (every worker sharing a key uses the same rates), as while a
    fleet switches: the units of calls booked by a limiter that keeps no coarse log
    count for the bounded one, at the newest slot (never too few)."""
    clock = FakeClock()
    exact = make_limiter(rates=[Rate(100, 60)], clock=clock)
    bounded = make_limiter(rates=[Rate(5, 60, buckets=6)], clock=clock, backend=exact.backend)
    assert bounded.try_acquire("token").allowed
    for _ in range(4):
        clock.advance(1)
        assert exact.try_acquire("token").allowed
    refused = bounded.try_acquire("token")
    assert not refused.allowed and refused.remaining == (0,)
    clock.advance(refused.retry_after)
    assert bounded.try_acquire("token").allowed


def _fullest(slots: list[float], period: float) -> int:
    """The most slots in any sliding window of ``period`` (they come in order)."""
    return max(i - bisect.bisect_right(slots, slot - period) + 1 for i, slot in enumerate(slots))


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("100/hour in 4 buckets", "100/hour"),
        ("100/day in UTC, bounded", "100/day in UTC"),
        ("100/hour", "100/hour in 4 buckets"),
    ],
)
def test_a_rate_switched_between_bounded_and_exact_never_over_uses(
    make_limiter: Any, before: str, after: str
) -> None:
    """Every worker switches at once, on a key in use. A bounded limiter trims the key's
    own log to 5 s; the exact one that follows counts those trimmed calls as at the
    trim's slot (LogView.trimmed), the latest they can be, not as long gone."""
    clock = FakeClock(1_700_000_000 - 1_700_000_000 % 86400 + 3600)
    slots = []
    first = make_limiter(rates=[before], clock=clock)
    for _ in range(100):
        slots.append(first.acquire("token").slot)
        clock.advance(6)
    clock.advance(60)
    then = make_limiter(rates=[after], clock=clock, backend=first.backend)
    for _ in range(100):
        decision = then.try_acquire("token")
        if decision.allowed:
            slots.append(decision.slot)
        clock.advance(1)
    window = 86400 if "day" in before else 3600
    assert _fullest(slots, window) <= 100
    clock.advance(window)  # and no stall past a window after the switch
    assert then.try_acquire("token").allowed


def test_exact_and_bounded_workers_on_one_key_never_over_use(make_limiter: Any) -> None:
    """Against the rule (every worker sharing a key uses the same rates), but safe all
    the same: the exact worker finds the bounded one's trimming and counts the trimmed
    calls at its slot; the bounded one catches up with the exact one's calls."""
    clock = FakeClock()
    exact = make_limiter(rates=["100/hour"], clock=clock)
    bounded = make_limiter(rates=["100/hour in 4 buckets"], clock=clock, backend=exact.backend)
    slots = []
    for i in range(400):
        decision = (exact if i % 2 else bounded).try_acquire("token")
        if decision.allowed:
            slots.append(decision.slot)
        clock.advance(30)
    assert _fullest(slots, 3600) <= 100
    assert len(slots) >= 100


# -- memory: bounded whatever the limit ----------------------------------------------------


def _redis_bytes(url: str, limiter: Limiter, key: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        return sum(client.memory_usage(name) or 0 for name in redis_keys(limiter.store_key(key)))
    finally:
        client.close()


@pytest.mark.parametrize(
    ("rate", "seconds"),
    [
        (Rate(70000, timedelta(days=1), buckets=48), 1.5 * 86400),
        (Rate(1_000_000, "month", tz="UTC", bounded=True), 40 * 86400),
    ],
    ids=["70000-a-day-in-48-buckets", "1000000-a-month-bounded"],
)
def test_a_bounded_key_holds_under_2_kb_in_redis(
    redis_url: str, rate: Rate, seconds: float
) -> None:
    """3000 calls spread over more than one window (so trims run), at the limit: the
    key's log and meta stay under 2 KB all along."""
    clock = FakeClock()
    with RedisBackend(redis_url) as backend:
        limiter = Limiter(backend, rates=[rate], clock=clock, sleep=clock.sleep)
        largest = 0
        for i in range(3000):
            assert limiter.try_acquire("token").allowed
            clock.advance(seconds / 3000)
            if i % 100 == 99:
                largest = max(largest, _redis_bytes(redis_url, limiter, "token"))
        assert 0 < largest <= 2048, largest
        usage = limiter.usage("token").rates[0]
        assert 0 < usage.used <= 3000


# -- a coarse log lost --------------------------------------------------------------------


def test_a_lost_redis_meta_never_lets_a_bounded_rate_over_use(redis_url: str) -> None:
    """The coarse logs live in the meta: lost with it, they are begun again with every
    unit of the key at its newest slot, so the full window stays full."""
    clock = FakeClock()
    with RedisBackend(redis_url) as backend:
        limiter = Limiter(backend, rates=[Rate(5, 60, buckets=6)], clock=clock, sleep=clock.sleep)
        for _ in range(5):
            assert limiter.try_acquire("token").allowed
            clock.advance(1)
        client = redis.Redis.from_url(redis_url)
        client.delete(redis_keys(limiter.store_key("token"))[1])
        client.close()
        assert not limiter.try_acquire("token").allowed
        clock.advance(30)
        assert not limiter.try_acquire("token").allowed


def test_a_lost_sqlite_coarse_log_never_lets_a_bounded_rate_over_use(tmp_path: Path) -> None:
    clock = FakeClock()
    with SQLiteBackend(tmp_path / "limits.db") as backend:
        limiter = Limiter(backend, rates=[Rate(5, 60, buckets=6)], clock=clock, sleep=clock.sleep)
        for _ in range(5):
            assert limiter.try_acquire("token").allowed
            clock.advance(1)
        with sqlite3.connect(tmp_path / "limits.db") as db:
            assert db.execute("DELETE FROM tc_coarse").rowcount == 1
        assert not limiter.try_acquire("token").allowed
        clock.advance(30)
        assert not limiter.try_acquire("token").allowed
        with sqlite3.connect(tmp_path / "limits.db") as db:  # unreadable: the same
            db.execute("UPDATE tc_coarse SET logs = 'not json'")
        assert not limiter.try_acquire("token").allowed


def test_a_late_answer_counts_from_the_bounded_rates_logs(make_limiter: Any) -> None:
    """A key with only bounded rates keeps its calls 5 s: an answer that comes back
    later is counted from the coarse logs (never fewer calls than there were), not
    dropped."""
    clock = FakeClock()
    limiter = make_limiter(rates=[Rate(1000, 86400, buckets=48)], clock=clock)
    first = limiter.acquire("token")
    clock.advance(6)
    headers = {"X-RateLimit-Remaining": "5", "X-RateLimit-Reset": "600"}
    assert limiter.learn("token", first, headers) is not None
    assert limiter.usage("token").learned is not None
    assert sum(limiter.try_acquire("token").allowed for _ in range(20)) == 5
