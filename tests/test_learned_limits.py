"""Limits learned from the upstream's headers: reading every header shape,
holding a key to a stricter view on every store (sync and async), reporting a looser one,
the newest report winning, and never failing a response when the store cannot keep it.
The Hypothesis comparison with the model (test_model.py) draws learned limits too; the
fleet of processes against a real upstream is in test_learned_fleet.py."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import httpx
import pytest
import redis

from tests.store_calls import store_calls
from throttle_client import (
    Limiter,
    LocalFallback,
    MemoryBackend,
    RedisBackend,
    ThrottledClient,
)
from throttle_client._acquiring import send_flow
from throttle_client._backends.base import Inspect, Learn, Quota
from throttle_client._backends.redis import redis_keys
from throttle_client._feedback import read_quota_view
from throttle_client.testing import FakeClock, RedisServer

NOW = 1_800_000_000.0


# -- reading the headers ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"X-RateLimit-Remaining": "7", "X-RateLimit-Reset": "30"}, (7, 30.0, None)),
        (  # GitHub: epoch seconds, and the limit
            {
                "X-RateLimit-Remaining": "7",
                "X-RateLimit-Reset": str(NOW + 12),
                "X-RateLimit-Limit": "60",
            },
            (7, 12.0, 60),
        ),
        (
            {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": str((NOW + 2) * 1000)},
            (0, 2.0, None),
        ),
        ({"RateLimit-Remaining": "3", "RateLimit-Reset": "5", "RateLimit-Limit": "9"}, (3, 5.0, 9)),
        ({"RateLimit": "limit=10, remaining=4, reset=6"}, (4, 6.0, 10)),
        (  # draft 08: the policy with the fewest left; its window when t= is missing
            {
                "RateLimit": '"minute";r=5;t=12, "day";r=2',
                "RateLimit-Policy": '"minute";q=10;w=60, "day";q=100;w=86400',
            },
            (2, 86400.0, 100),
        ),
    ],
)
def test_every_shape_of_quota_header_is_read(headers: dict[str, str], expected: Any) -> None:
    view = read_quota_view(headers, now=NOW)
    assert view is not None and (view.remaining, view.resets_in, view.limit) == expected


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"X-RateLimit-Remaining": "7"},  # no reset: nothing said of when
        {"X-RateLimit-Remaining": "-1", "X-RateLimit-Reset": "30"},
        {"X-RateLimit-Remaining": "seven", "X-RateLimit-Reset": "30"},
        {"X-RateLimit-Remaining": "7", "X-RateLimit-Reset": str(NOW - 5)},  # already past
        {"X-RateLimit-Remaining": "7", "X-RateLimit-Reset": "1e9999"},
    ],
)
def test_headers_that_say_nothing_usable_are_ignored(headers: dict[str, str]) -> None:
    assert read_quota_view(headers, now=NOW) is None


# -- holding a key to what the upstream said --------------------------------------------------


def a_store(kind: str, request: pytest.FixtureRequest) -> Any:
    """A store of ``kind``: memory, a SQLite file of the test's own, or the session's Redis."""
    from throttle_client import SQLiteBackend

    if kind == "memory":
        return MemoryBackend()
    if kind == "sqlite":
        return SQLiteBackend(request.getfixturevalue("tmp_path") / "limits.db")
    return RedisBackend(request.getfixturevalue("redis_url"))


class HalfLimitAPI:
    """An upstream that really allows ``limit`` per fixed second (by arrival on ``clock``),
    and says so in X-RateLimit headers; each request takes ``delay`` seconds to arrive."""

    def __init__(self, clock: FakeClock, limit: int, delay: float = 0.01) -> None:
        self.clock, self.limit, self.delay = clock, limit, delay
        self.counts: dict[int, int] = {}
        self.statuses: list[int] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.clock.advance(self.delay)
        window = math.floor(self.clock())
        used = self.counts[window] = self.counts.get(window, 0) + 1
        headers = {
            "X-RateLimit-Limit": str(self.limit),
            "X-RateLimit-Remaining": str(max(0, self.limit - used)),
            "X-RateLimit-Reset": str(window + 1),
        }
        status = 200 if used <= self.limit else 429
        self.statuses.append(status)
        return httpx.Response(status, headers=headers)


def test_a_plan_half_the_configured_one_is_held_to_on_every_store(make_limiter: Any) -> None:
    clock = FakeClock(NOW)
    limiter = make_limiter(rates=["10/second"], clock=clock)
    api = HalfLimitAPI(clock, limit=5)
    inner = getattr(limiter, "limiter", limiter)  # the AsyncLimiter behind a SyncView
    if make_limiter.mode == "sync":
        with ThrottledClient(inner, transport=httpx.MockTransport(api)) as client:
            for _ in range(40):
                client.get("https://api.example.com/x", headers={"Authorization": "Bearer t"})
    else:
        from throttle_client import AsyncThrottledClient

        async def send() -> None:
            async with AsyncThrottledClient(inner, transport=httpx.MockTransport(api)) as client:
                for _ in range(40):
                    await client.get(
                        "https://api.example.com/x", headers={"Authorization": "Bearer t"}
                    )

        limiter.loop.run_until_complete(send())
    assert 429 not in api.statuses
    full = [count for second, count in sorted(api.counts.items())][:-1]
    assert full and all(count == 5 for count in full)  # all of what it allows, each second
    usage = limiter.usage("t")
    assert usage.learned is not None and usage.learned.limit <= 5
    assert usage.upstream is not None and usage.upstream.stricter


def test_a_looser_view_changes_nothing_and_is_told_once(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock(NOW)
    limiter = Limiter(MemoryBackend(), rates=["10/minute"], clock=clock, sleep=clock.sleep)
    ops = store_calls(limiter)
    looser = {
        "X-RateLimit-Remaining": "4000",
        "X-RateLimit-Reset": "3600",
        "X-RateLimit-Limit": "5000",
    }
    with caplog.at_level(logging.INFO, logger="throttle_client"):
        for _ in range(3):
            limiter.learn("t", limiter.acquire("t"), looser)
    told = [r for r in caplog.records if "allows more than" in r.getMessage()]
    assert len(told) == 1 and "the configured limits stay" in told[0].getMessage()
    assert not [op for op in ops if isinstance(op, Learn)]  # the store is not written
    usage = limiter.usage("t")
    assert usage.learned is None
    assert usage.upstream is not None and not usage.upstream.stricter
    assert (usage.upstream.remaining, usage.upstream.limit) == (4000, 5000)
    assert usage.upstream.resets_at == pytest.approx(NOW + 300)  # max_pause at most
    limiter.reset("t")
    assert limiter.usage("t").upstream is None


def test_the_calls_after_the_answered_one_count_against_what_it_said_remained() -> None:
    """Three calls booked; the first one's answer says 2 remain: the two in flight after
    it take them, so the next call waits for the reset."""
    clock = FakeClock(NOW)
    limiter = Limiter(MemoryBackend(), rates=["100/minute"], clock=clock, sleep=clock.sleep)
    first, *_ = [limiter.acquire("t") for _ in range(3)]
    limiter.learn("t", first, {"X-RateLimit-Remaining": "2", "X-RateLimit-Reset": "30"})
    learned = limiter.usage("t").learned
    assert learned is not None and (learned.limit, learned.used) == (3, 3)
    refused = limiter.try_acquire("t")
    assert not refused.allowed and refused.retry_after == pytest.approx(30)


def test_a_longer_window_than_the_rates_is_stricter_when_it_allows_fewer() -> None:
    """10/second configured, the upstream allows 100 an hour: fewer than the 35,000 the
    rates would let through before its reset, so it is held to, though 99 > 9 left this
    second."""
    clock = FakeClock(NOW)
    limiter = Limiter(MemoryBackend(), rates=["10/second"], clock=clock, sleep=clock.sleep)
    headers = {"X-RateLimit-Remaining": "99", "X-RateLimit-Reset": "3540"}
    limiter.learn("t", limiter.acquire("t"), headers, max_pause=3600)
    learned = limiter.usage("t").learned
    assert learned is not None and learned.limit == 100
    assert learned.resets_at == pytest.approx(NOW + 3540)


def test_a_learned_limit_holds_for_max_pause_at_most(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock(NOW)
    limiter = Limiter(MemoryBackend(), rates=["10/second"], clock=clock, sleep=clock.sleep)
    spent = {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "86400"}
    limiter.learn("t", limiter.acquire("t"), spent)  # max_pause: 300 s by default
    refused = limiter.try_acquire("t")
    assert not refused.allowed and refused.retry_after == pytest.approx(300)
    api_calls: list[float] = []

    def api(request: httpx.Request) -> httpx.Response:
        api_calls.append(clock())
        return httpx.Response(200, headers=spent)

    from throttle_client import RetryPolicy

    other = Limiter(MemoryBackend(), rates=["10/second"], clock=clock, sleep=clock.sleep)
    retry = RetryPolicy(max_pause=60)
    with ThrottledClient(other, transport=httpx.MockTransport(api), retry=retry) as client:
        for _ in range(2):
            client.get("https://api.example.com/x", headers={"Authorization": "Bearer t"})
    assert api_calls[1] - api_calls[0] == pytest.approx(60)  # the transport's max_pause


def test_learn_refuses_what_is_not_an_admitted_call_and_reports_bad_headers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from throttle_client import ConfigurationError

    clock = FakeClock(NOW)
    limiter = Limiter(MemoryBackend(), rates=["1/minute"], clock=clock, sleep=clock.sleep)
    admitted = limiter.acquire("t")
    with pytest.raises(ConfigurationError, match="not None"):
        limiter.learn("t", None, {})  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="allowed=False"):
        limiter.learn("t", limiter.try_acquire("t"), {})
    with caplog.at_level(logging.WARNING, logger="throttle_client"):
        bad = {"X-RateLimit-Remaining": "abc", "X-RateLimit-Reset": "30"}
        assert limiter.learn("t", admitted, bad) is None
    assert any("'abc'" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_an_answer_later_than_the_longest_window_is_not_learned_from(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """The entries it would count from may be trimmed already: counting too few would
    let too many through, so the store ignores it (the rates still hold)."""
    backend = a_store(kind, request)
    clock = FakeClock(NOW)
    limiter = Limiter(backend, rates=["10/second"], clock=clock, sleep=clock.sleep, margin=0)
    slow = limiter.acquire("t")
    for _ in range(5):
        limiter.acquire("t")
    clock.advance(1.5)  # its answer comes back 1.5 s after its slot: past the 1 s window
    limiter.acquire("t")  # (trims what the window no longer holds)
    limiter.learn("t", slow, {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "30"})
    assert limiter.usage("t").learned is None
    timely = limiter.acquire("t")
    limiter.learn("t", timely, {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "30"})
    learned = limiter.usage("t").learned
    # (It counts the call before it too: the same slot, which may have arrived after it.)
    assert learned is not None and (learned.limit, learned.used) == (1, 2)
    backend.close()


@pytest.mark.parametrize("kind", ["memory", "sqlite", "redis"])
def test_through_the_transports_a_slow_answer_is_learned_from_all_the_same(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """The transports' admissions mark where a learned limit would count from (the
    running total before the slot, less the margin), so an answer 2 s late counts every
    call after it, though a 1 s window let the store trim them."""

    backend = a_store(kind, request)
    clock = FakeClock(NOW)
    limiter = Limiter(backend, rates=["10/second"], clock=clock, sleep=clock.sleep, margin=0)
    answers = iter([{"X-RateLimit-Remaining": "3", "X-RateLimit-Reset": "60"}])

    def slow(request: httpx.Request) -> httpx.Response:
        for _ in range(5):  # others send meanwhile
            limiter.acquire("t")
            clock.advance(0.4)
        return httpx.Response(200, headers=next(answers, {}))

    with ThrottledClient(limiter, transport=httpx.MockTransport(slow)) as client:
        client.get("https://api.example.com/x", headers={"Authorization": "Bearer t"})
    learned = limiter.usage("t").learned
    # The answered call and the 5 sent while it was on its way: 6 of the 3 + 1 it allows.
    assert learned is not None and (learned.limit, learned.used) == (4, 6)
    refused = limiter.try_acquire("t")
    assert not refused.allowed and refused.retry_after == pytest.approx(60)  # its reset
    backend.close()


def test_the_newest_report_wins_and_an_older_one_is_ignored() -> None:
    store = MemoryBackend()
    quota = Quota(((100, 60_000_000),), 0)
    now = 1_000_000_000_000

    def learn(since: int, limit: int) -> None:
        store.execute(Learn("k", quota, since, now + 10_000_000, limit, now_us=now))

    def learned() -> Any:
        return store.execute(Inspect("k", quota, now_us=now)).learned

    learn(now - 5, 4)
    learn(now - 9, 1)  # an older request's answer, arriving late: ignored
    assert learned() == (4, 0, now + 10_000_000)
    learn(now - 2, 2)
    assert learned() == (2, 0, now + 10_000_000)


class FixedWindowAPI:
    """An asyncio upstream that allows ``limit`` per fixed second of real time and answers
    after ``latency`` seconds, saying what remains; it notes each request's send time
    (from the client's clock, in a header) and status."""

    def __init__(self, limit: int, latency: float) -> None:
        self.limit, self.latency = limit, latency
        self.counts: dict[int, int] = {}
        self.answered: list[tuple[float, int]] = []  # (sent, status)
        self.first_answer = math.inf

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        now = time.time()
        window = math.floor(now)
        used = self.counts[window] = self.counts.get(window, 0) + 1
        status = 200 if used <= self.limit else 429
        await asyncio.sleep(self.latency)
        headers = {
            "X-RateLimit-Remaining": str(max(0, self.limit - used)),
            "X-RateLimit-Reset": f"{window + 1:.3f}",
        }
        if status == 429:
            headers["Retry-After"] = "1"
        self.answered.append((float(request.headers["X-Sent"]), status))
        self.first_answer = min(self.first_answer, time.time())
        return httpx.Response(status, headers=headers)

    def late_refusals(self) -> int:
        """429s to requests sent after the first answer came back."""
        return sum(
            1 for sent, status in self.answered if status == 429 and sent > self.first_answer
        )


async def crowd(api: FixedWindowAPI, learn: bool, tasks: int = 12, seconds: float = 2.5) -> None:
    from throttle_client import AsyncLimiter, AsyncThrottledClient, RetryPolicy

    limiter = AsyncLimiter(MemoryBackend(), rates=["60/second"])
    async with AsyncThrottledClient(
        limiter,
        transport=httpx.MockTransport(api),
        learn=learn,
        retry=RetryPolicy(max_attempts=1),
    ) as client:
        end = time.time() + seconds

        async def worker() -> None:
            while time.time() < end:
                headers = {"Authorization": "Bearer t", "X-Sent": repr(time.time())}
                await client.get("https://api.example.com/x", headers=headers)

        await asyncio.gather(*(worker() for _ in range(tasks)))


def test_concurrent_calls_hold_to_a_smaller_plan_from_the_first_answer_on() -> None:
    """12 tasks at once, configured for 60/s, against an API that allows 20 per second: after
    the first answer not one more 429, and each whole second gets what the API allows
    less at most the 12 in flight when its answers say so. Without learning the same crowd is
    refused over and over: the test tells the two apart."""
    learning = FixedWindowAPI(limit=20, latency=0.02)
    asyncio.run(crowd(learning, learn=True))
    assert learning.late_refusals() == 0
    whole = sorted(learning.counts.items())[1:-1]  # the first and last seconds are partial
    # Less what was in flight when an answer said how much was left (12 tasks: measured
    # 12-16 of 20 a second), never more than it allows.
    assert whole and all(20 - 12 <= count <= 20 for _, count in whole), whole
    blind = FixedWindowAPI(limit=20, latency=0.02)
    asyncio.run(crowd(blind, learn=False))
    assert blind.late_refusals() > 0


def test_transports_can_be_told_not_to_learn() -> None:
    clock = FakeClock(NOW)
    limiter = Limiter(MemoryBackend(), rates=["10/second"], clock=clock, sleep=clock.sleep)
    api = HalfLimitAPI(clock, limit=5)
    with ThrottledClient(limiter, transport=httpx.MockTransport(api), learn=False) as client:
        for _ in range(12):
            client.get("https://api.example.com/x", headers={"Authorization": "Bearer t"})
    assert limiter.usage("t").learned is None and limiter.usage("t").upstream is None


def test_a_store_that_cannot_keep_it_does_not_fail_the_response(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = RedisServer()
    server.start()
    limiter = Limiter(RedisBackend(server.url), rates=["10/second"], retry_for=0.1)
    decision = limiter.acquire("t")
    server.close()
    with caplog.at_level(logging.WARNING, logger="throttle_client"):
        view = limiter.learn(
            "t", decision, {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "5"}
        )
    assert view is not None and view.remaining == 0
    assert any("could not keep what the upstream said" in r.getMessage() for r in caplog.records)


def test_under_local_fallback_a_learned_limit_is_shared_out(own_redis: RedisServer) -> None:
    clock = FakeClock(NOW)
    limiter = Limiter(
        RedisBackend(own_redis.url),
        rates=["100/minute"],
        clock=clock,
        sleep=clock.sleep,
        retry_for=0,
        on_unavailable=LocalFallback(expected_workers=2),
    )
    own_redis.close()
    first = limiter.acquire("t")  # from the process's own share, the store being gone
    limiter.learn("t", first, {"X-RateLimit-Remaining": "4", "X-RateLimit-Reset": "30"})
    admitted = 0
    while limiter.try_acquire("t").allowed:
        admitted += 1
    assert admitted == (4 + 1) // 2 - 1  # half of "5 from the first call on", the first taken


def test_a_meta_written_by_an_older_version_reads_as_no_learned_limit(redis_url: str) -> None:
    clock = FakeClock(NOW)
    limiter = Limiter(RedisBackend(redis_url), rates=["10/minute"], clock=clock, sleep=clock.sleep)
    limiter.acquire("t")
    _, meta = redis_keys(limiter.store_key("t"))
    client = redis.Redis.from_url(redis_url)
    # Seven fields, as before learned limits: (tag, last, total, base, pause, first, exp).
    client.eval(
        "local t = {cmsgpack.unpack(redis.call('GET', KEYS[1]))}"
        " redis.call('SET', KEYS[1], cmsgpack.pack(t[1], t[2], t[3], t[4], t[5], t[6], t[7]))",
        1,
        meta,
    )
    usage = limiter.usage("t")
    assert usage.learned is None and usage.rates[0].used == 1
    assert limiter.acquire("t").remaining == (8,)
    client.close()


def test_a_lost_log_on_redis_does_not_cut_a_learned_limit_short(redis_url: str) -> None:
    """The script rebuilds a lost log and renews the key's TTLs: never shorter than a
    learned limit in force (it lives in the meta)."""
    limiter = Limiter(RedisBackend(redis_url), rates=["10/second"], margin=0)
    decision = limiter.acquire("t")
    limiter.learn("t", decision, {"X-RateLimit-Remaining": "1", "X-RateLimit-Reset": "120"})
    log, meta = redis_keys(limiter.store_key("t"))
    client = redis.Redis.from_url(redis_url)
    client.delete(log)  # as an eviction would
    limiter.try_acquire("t")  # repairs the log, and renews the TTLs
    assert client.pttl(meta) > 100_000
    learned = limiter.usage("t").learned
    assert learned is not None and learned.used == 2 and learned.limit == 2
    assert not limiter.try_acquire("t").allowed
    client.close()


def test_sqlite_forgets_a_learned_limit_with_a_lost_meta(tmp_path: Any) -> None:
    """The running total a learned limit counts from belongs to the meta it came with: a
    meta rebuilt from nothing starts again from 0, so the limit goes with the old one."""
    import sqlite3

    from throttle_client import SQLiteBackend

    clock = FakeClock(NOW)
    backend = SQLiteBackend(tmp_path / "lost.db")
    limiter = Limiter(backend, rates=["100/second"], clock=clock, sleep=clock.sleep, margin=0)
    for _ in range(50):
        limiter.acquire("t")
    limiter.learn(
        "t", limiter.acquire("t"), {"X-RateLimit-Remaining": "4", "X-RateLimit-Reset": "300"}
    )
    db = sqlite3.connect(tmp_path / "lost.db")
    db.execute("DELETE FROM tc_meta")
    db.commit()
    db.close()
    clock.advance(10)  # the entries no longer matter: the key starts afresh
    assert limiter.usage("t").learned is None
    admitted = sum(limiter.try_acquire("t").allowed for _ in range(20))
    assert admitted == 20  # the rates alone (100/s): no stale limit counting from 51
    backend.close()


def test_a_retried_call_carries_no_mark() -> None:
    """A retry finds its call booked: the entries before it may have been trimmed since,
    so it marks nothing, and a learned limit from its answer reads the log instead."""
    from throttle_client._backends.base import Acquire

    store = MemoryBackend()
    quota = Quota(((10, 1_000_000),), 0)
    now = 1_000_000_000_000
    first = store.execute(Acquire("k", quota, 1, 0, "call", now_us=now, mark_us=0))
    again = store.execute(Acquire("k", quota, 1, 0, "call", now_us=now, mark_us=0, retry=True))
    assert (first.mark, again.mark) == (0, -1) and again.slot_us == first.slot_us


@pytest.mark.parametrize("kind", ["memory", "sqlite", "redis"])
def test_a_key_forgotten_while_a_call_was_in_flight_counts_everything(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """The key is reset and refilled past the answered call's mark before its answer comes
    back: the mark belongs to the key's former life, so the learned limit counts all."""

    backend = a_store(kind, request)
    clock = FakeClock(NOW)
    limiter = Limiter(backend, rates=["100/second"], clock=clock, sleep=clock.sleep, margin=0)
    refill = iter(range(1))

    def api(request: httpx.Request) -> httpx.Response:
        for _ in refill:  # while this call is on its way: the key is reset and refilled
            clock.advance(0.01)
            limiter.reset("t")
            for _ in range(10):
                limiter.acquire("t")
        return httpx.Response(
            200, headers={"X-RateLimit-Remaining": "5", "X-RateLimit-Reset": "60"}
        )

    for _ in range(8):
        limiter.acquire("t")
    clock.advance(0.5)  # so that the call's mark is 8: the units before its slot
    with ThrottledClient(limiter, transport=httpx.MockTransport(api)) as client:
        client.get("https://api.example.com/x", headers={"Authorization": "Bearer t"})
    learned = limiter.usage("t").learned
    # 5 left + its own 1: the 10 booked since count (not 10 - 8, from the old mark).
    assert learned is not None and (learned.limit, learned.used) == (6, 10)
    assert not limiter.try_acquire("t").allowed
    backend.close()


def test_an_admission_by_local_fallback_carries_no_mark(own_redis: RedisServer) -> None:
    """A mark is a running total of the store's log: one taken in the fallback's own log
    would mislead a limit learned later in the store, so the fallback is not asked."""
    from throttle_client._flow import run

    limiter = Limiter(
        RedisBackend(own_redis.url),
        rates=["100/minute"],
        retry_for=0,
        on_unavailable=LocalFallback(expected_workers=2),
    )
    own_redis.close()
    decision = run(send_flow(limiter, "t", 1, None, limiter._local()), limiter._perform)
    assert decision.allowed and decision._mark == -1
