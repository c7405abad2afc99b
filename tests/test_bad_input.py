"""Bad input: refused at once with an error that names the value, and nothing is written.

The valid ranges (throttle_client/_ranges.py) are held by one table of cases run on
every store, sync and async; "nothing written" is checked in the store itself (its
keys, rows or DBSIZE). Further checks run on the real Redis server of the session,
flushed per test. A key is never echoed in a message, since it is usually an access
token.
"""

from __future__ import annotations

import asyncio
import math
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
import redis
import redis.cluster

from throttle_client import (
    AsyncLimiter,
    AsyncRedisBackend,
    BackendError,
    BackendUnavailable,
    ConfigurationError,
    CostTooHigh,
    Limiter,
    MemoryBackend,
    Rate,
    RedisBackend,
    SQLiteBackend,
    ThrottleTimeout,
)
from throttle_client._backends.base import Acquire, Quota
from throttle_client._ranges import MAX_SECONDS
from throttle_client.testing import FakeClock

TOKEN = "EAAB-secret-access-token-0123456789"


@pytest.fixture
def store(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    assert client.dbsize() == 0, "bad input wrote to the store"
    client.close()


def named(error: pytest.ExceptionInfo[BaseException], value: object) -> bool:
    return repr(value) in str(error.value) or str(value) in str(error.value)


def limiter_on(url: str, **options: Any) -> Limiter:
    options.setdefault("rates", ["3/second"])
    return Limiter(RedisBackend(url), clock=FakeClock(), **options)


# -- one table, every store ------------------------------------------------------------------

TEN_YEARS = timedelta(seconds=MAX_SECONDS)
SURROGATE_TOKEN = "EAAB-secret\ud800-token"


@dataclass(frozen=True)
class Case:
    """``run(make_limiter, limiter)`` must raise ``error`` whose message holds ``names``."""

    name: str
    run: Callable[[Any, Any], object]
    names: str
    error: type[Exception] = ConfigurationError

    def __str__(self) -> str:
        return self.name


def built(**options: Any) -> Callable[[Any, Any], object]:
    return lambda make, _: make(**options)


def called(method: str, *args: Any, **kwargs: Any) -> Callable[[Any, Any], object]:
    return lambda _, limiter: getattr(limiter, method)(*args, **kwargs)


CASES = [
    # When the limiter (or its Rate) is built:
    Case("17 rates", built(rates=["100/second"] * 17), "17"),
    Case("limit 2**40 + 1", lambda *_: Rate(2**40 + 1, 1), str(2**40 + 1)),
    Case("limit 2**60", lambda *_: Rate(2**60, 1), str(2**60)),
    Case("limit 2**70", lambda *_: Rate(2**70, 1), str(2**70)),
    Case("limit 2**70 as text", built(rates=[f"{2**70}/second"]), f"{2**70}/second"),
    Case("period 1e12", lambda *_: Rate(10, 1e12), "1000000000000.0"),
    Case("period of 10 years + 1 s", lambda *_: Rate(10, MAX_SECONDS + 1), "315576001.0"),
    Case("period of 4000 days as text", built(rates=["1/4000 days"]), "1/4000 days"),
    Case("period below 1 microsecond", lambda *_: Rate(10, 1e-7), "1e-07"),
    Case("min_interval 1e12", built(rates=["1/second"], min_interval=1e12), "1000000000000.0"),
    Case(
        "min_interval of 10 years + 1 µs",
        built(rates=["1/second"], min_interval=TEN_YEARS + timedelta(microseconds=1)),
        "days=3652",
    ),
    Case("Arabic-Indic digits", built(rates=["\u0661\u0660/second"]), "\u0661\u0660/second"),
    Case("full-width digits", built(rates=["\uff11\uff10/second"]), "\uff11\uff10/second"),
    Case(
        "namespace with a lone surrogate",
        built(rates=["1/second"], namespace="ns\udc80"),
        "position 2",
    ),
    Case("namespace with NUL", built(rates=["1/second"], namespace="a\x00b"), "NUL"),
    Case(
        "key_secret with a lone surrogate",
        built(rates=["1/second"], key_secret="s\ud800x"),
        "key_secret",
    ),
    # With the call that carries the value, before anything reaches the store:
    Case("pause 1e10", called("pause", TOKEN, 1e10), "10000000000.0"),
    Case("pause 1e300", called("pause", TOKEN, 1e300), "1e+300"),
    Case("pause of 10 years + 1 s", called("pause", TOKEN, MAX_SECONDS + 1), "315576001.0"),
    Case("pause inf", called("pause", TOKEN, math.inf), "inf"),
    Case("pause -1", called("pause", TOKEN, -1), "-1"),
    Case("timeout nan", called("acquire", TOKEN, timeout=math.nan), "nan"),
    Case("timeout -1", called("acquire", TOKEN, timeout=-1), "-1"),
    Case("cost 2**70", called("acquire", TOKEN, 2**70), str(2**70), CostTooHigh),
    *(
        Case(
            f"{method} of a key with a lone surrogate",
            called(method, SURROGATE_TOKEN),
            "position 11",
        )
        for method in ("try_acquire", "acquire", "usage", "reset")
    ),
    Case(
        "pause of a key with a lone surrogate", called("pause", SURROGATE_TOKEN, 1), "position 11"
    ),
]


def stored(limiter: Any, request: pytest.FixtureRequest) -> int:
    """What the store behind ``limiter`` holds: keys, rows, or DBSIZE."""
    backend = limiter.backend
    backend = getattr(backend, "backend", backend)  # the store an AsyncLimiter wraps
    if isinstance(backend, MemoryBackend):
        return len(backend._logs)
    if isinstance(backend, SQLiteBackend):
        with sqlite3.connect(backend.path) as db:
            tables = ("tc_entries", "tc_meta")
            return sum(db.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in tables)
    if isinstance(backend, (RedisBackend, AsyncRedisBackend)) and isinstance(
        backend.client, (redis.Redis, redis.asyncio.Redis)
    ):
        client = redis.Redis.from_url(request.getfixturevalue("redis_url"))
        size = client.dbsize()
    else:
        client = redis.cluster.RedisCluster.from_url(request.getfixturevalue("cluster_url"))
        size = client.dbsize(target_nodes=redis.cluster.RedisCluster.PRIMARIES)
    client.close()
    return int(size)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_bad_values_fail_alike_on_every_store(
    make_limiter: Any, case: Case, request: pytest.FixtureRequest
) -> None:
    """One answer, on memory, SQLite, Redis and Cluster, sync and async: a
    ConfigurationError naming the value, and nothing written."""
    limiter = make_limiter(rates=["3/second"])
    with pytest.raises(case.error) as error:
        case.run(make_limiter, limiter)
    assert isinstance(error.value, ConfigurationError) and isinstance(error.value, ValueError)
    assert case.names in str(error.value)
    assert "EAAB" not in str(error.value)  # never the key, nor any part of it
    assert "s\ud800x" not in str(error.value)  # nor the secret
    assert stored(limiter, request) == 0


class StillClock(FakeClock):
    """Records sleeps without moving: every call arrives at the same moment."""

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


def test_the_furthest_slot_is_ten_years_ahead_on_every_store(make_limiter: Any) -> None:
    """None, or a timeout of 10 years or more, waits for any slot there is; no store
    books one further ahead, so the same call gets the same ThrottleTimeout on each."""
    clock = StillClock()
    limiter = make_limiter(rates=[Rate(1, MAX_SECONDS)], clock=clock)
    assert limiter.acquire(TOKEN).waited == 0
    assert limiter.acquire(TOKEN, timeout=1e10).waited == MAX_SECONDS
    for timeout in (None, 1e10, math.inf, TEN_YEARS * 3):
        with pytest.raises(ThrottleTimeout) as refused:
            limiter.acquire(TOKEN, timeout=timeout)
        assert refused.value.retry_after == 2 * MAX_SECONDS
    usage = limiter.usage(TOKEN).rates[0]
    assert (usage.used, usage.booked) == (1, 1)  # the refusals booked nothing


def test_the_largest_values_work_alike_on_every_store(make_limiter: Any) -> None:
    """Every bound at once, to the microsecond: nothing a store computes from them is
    rounded (the Redis script counts in doubles, SQLite in 64-bit integers)."""
    big = 2**40
    limiter = make_limiter(
        rates=[Rate(big, MAX_SECONDS), Rate(big, 1), *["1099511627776/3652.5 days"] * 14],
        min_interval=TEN_YEARS,
        clock=StillClock(),
    )
    assert limiter.try_acquire(TOKEN, big).remaining == (0,) * 16
    refused = limiter.try_acquire(TOKEN)
    assert refused.retry_after == MAX_SECONDS and refused.remaining == (0,) * 16
    assert limiter.pause(TOKEN, TEN_YEARS) - refused.slot == 0  # as far as the gap
    usage = limiter.usage(TOKEN)
    assert [(r.used, r.booked, r.remaining) for r in usage.rates[:2]] == [(big, 0, 0)] * 2
    assert [r.resets_in for r in usage.rates[:2]] == [MAX_SECONDS, 1.0]
    assert usage.next_slot_in == usage.paused_for == MAX_SECONDS
    booked = limiter.acquire(TOKEN, big - 1)
    assert booked.waited == MAX_SECONDS and booked.remaining[:2] == (1, 1)
    with pytest.raises(ThrottleTimeout) as refused_again:
        limiter.acquire(TOKEN, big)
    assert refused_again.value.retry_after == 2 * MAX_SECONDS
    assert limiter.usage(TOKEN).rates[1].booked == big - 1


def test_a_timeout_beyond_ten_years_is_no_limit(make_limiter: Any) -> None:
    clock = FakeClock()
    limiter = make_limiter(rates=["1/second"], clock=clock)
    limiter.acquire(TOKEN)
    assert limiter.acquire(TOKEN, timeout=1e10).waited == 1.0
    assert limiter.acquire(TOKEN, timeout=math.inf).waited == 1.0
    assert clock.slept == [1.0, 1.0]


# -- rates -------------------------------------------------------------------------------

BAD_LIMITS = [0, -1, 1.5, math.nan, math.inf, True, "3", None]
BAD_PERIODS = [0, -1, -0.5, math.nan, math.inf, -math.inf, timedelta(0), timedelta(-1), "1", 1e-9]


@pytest.mark.parametrize("limit", BAD_LIMITS, ids=repr)
def test_bad_limit(limit: Any) -> None:
    with pytest.raises(ConfigurationError) as error:
        Rate(limit, 1)
    assert isinstance(error.value, ValueError) and named(error, limit)


@pytest.mark.parametrize("period", BAD_PERIODS, ids=repr)
def test_bad_period(period: Any) -> None:
    with pytest.raises(ConfigurationError) as error:
        Rate(1, period)
    assert named(error, period)


BAD_RATE_STRINGS = [
    "",
    "ten/second",
    "10",
    "10/",
    "/second",
    "10/fortnight",
    "10/0 seconds",
    "0/second",
    "-5/second",
    "10/-1 second",
    "1.5/second",
    "10 seconds",
]


@pytest.mark.parametrize("text", BAD_RATE_STRINGS)
def test_unparsable_rate_strings(text: str, redis_url: str, store: redis.Redis) -> None:
    with pytest.raises(ConfigurationError) as error:
        Rate.parse(text)
    assert repr(text) in str(error.value)
    with pytest.raises(ValueError, match="rate"):
        limiter_on(redis_url, rates=["1/second", text])


@pytest.mark.parametrize("rates", [[], [3], [None], [(3, 1)]], ids=repr)
def test_rates_must_be_rates(rates: Any, redis_url: str) -> None:
    with pytest.raises(ConfigurationError):
        limiter_on(redis_url, rates=rates)


@pytest.mark.parametrize(
    "gap", [-1, -0.001, math.nan, math.inf, -math.inf, timedelta(seconds=-1), "0.1"], ids=repr
)
def test_bad_min_interval(gap: Any, redis_url: str, store: redis.Redis) -> None:
    with pytest.raises(ConfigurationError) as error:
        limiter_on(redis_url, min_interval=gap)
    assert named(error, gap)


@pytest.mark.parametrize("namespace", ["a{b}", "{", "}", "x}y", "", None], ids=repr)
def test_bad_namespace(namespace: Any, redis_url: str, store: redis.Redis) -> None:
    with pytest.raises(ConfigurationError) as error:
        limiter_on(redis_url, namespace=namespace)
    assert named(error, namespace)


# -- per call: costs, keys, timeouts, pauses ------------------------------------------------

BAD_COSTS = [0, -1, 1.5, math.nan, math.inf, True, False, "3", None]


@pytest.fixture(params=["sync", "async"])
def call(request: pytest.FixtureRequest, redis_url: str) -> Iterator[Any]:
    """``call("try_acquire", *args)`` on a sync or an async limiter over Redis."""
    if request.param == "sync":
        limiter: Any = limiter_on(redis_url)
        yield lambda name, *args, **kw: getattr(limiter, name)(*args, **kw)
        limiter.backend.close()
        return
    backend = AsyncRedisBackend(redis_url)
    alimiter = AsyncLimiter(backend, rates=["3/second"], clock=FakeClock())
    loop = asyncio.new_event_loop()
    yield lambda name, *args, **kw: loop.run_until_complete(getattr(alimiter, name)(*args, **kw))
    loop.run_until_complete(backend.aclose())
    loop.close()


@pytest.mark.parametrize("method", ["try_acquire", "acquire"])
@pytest.mark.parametrize("cost", BAD_COSTS, ids=repr)
def test_bad_cost(call: Any, method: str, cost: Any, store: redis.Redis) -> None:
    with pytest.raises(ConfigurationError) as error:
        call(method, TOKEN, cost)
    assert named(error, cost) and TOKEN not in str(error.value)


@pytest.mark.parametrize("method", ["try_acquire", "acquire"])
def test_cost_above_the_limit(call: Any, method: str, store: redis.Redis) -> None:
    with pytest.raises(CostTooHigh) as error:
        call(method, TOKEN, 4)
    assert "4" in str(error.value) and TOKEN not in str(error.value)


@pytest.mark.parametrize("key", [b"EAAB-secret-bytes-token", 12345678, None, ("EAAB-tuple",)])
@pytest.mark.parametrize("method", ["try_acquire", "acquire", "usage", "reset"])
def test_a_key_must_be_a_str_and_is_never_echoed(
    call: Any, method: str, key: Any, store: redis.Redis
) -> None:
    with pytest.raises(TypeError) as error:
        call(method, key)
    assert type(key).__name__ in str(error.value)
    for secret in ("EAAB", "12345678"):
        assert secret not in str(error.value)


def test_an_empty_key_is_refused(call: Any, store: redis.Redis) -> None:
    with pytest.raises(ConfigurationError):
        call("try_acquire", "")


@pytest.mark.parametrize("timeout", [-1, math.nan, "5", timedelta(seconds=-2)], ids=repr)
def test_bad_timeout(call: Any, timeout: Any, store: redis.Redis) -> None:
    with pytest.raises(ConfigurationError) as error:
        call("acquire", TOKEN, 1, timeout)
    assert named(error, timeout) and TOKEN not in str(error.value)


@pytest.mark.parametrize("seconds", [-1, math.nan, math.inf, "5", None], ids=repr)
def test_bad_pause(call: Any, seconds: Any, store: redis.Redis) -> None:
    with pytest.raises(ConfigurationError) as error:
        call("pause", TOKEN, seconds)
    assert named(error, seconds) and TOKEN not in str(error.value)


# -- the script checks again what Python checked -----------------------------------------------


@pytest.mark.parametrize("cost", [0, -1, 4], ids=repr)
def test_the_script_refuses_a_bad_cost_too(redis_url: str, store: redis.Redis, cost: int) -> None:
    """A caller that skips the Limiter (or a bug in it) still cannot book a bad cost."""
    backend = RedisBackend(redis_url)
    op = Acquire(
        key="default:{abc}",
        quota=Quota(limits=((3, 1_000_000),), min_interval_us=0),
        cost=cost,
        max_wait_us=-1,
        call_id="id-1",
        now_us=1_700_000_000_000_000,
    )
    with pytest.raises(BackendError, match="cost") as error:
        backend.execute(op)
    assert not isinstance(error.value, BackendUnavailable)
    backend.close()


def test_the_script_refuses_a_bad_rate(redis_url: str, store: redis.Redis) -> None:
    backend = RedisBackend(redis_url)
    op = Acquire(
        key="default:{abc}",
        quota=Quota(limits=((0, 1_000_000),), min_interval_us=0),
        cost=1,
        max_wait_us=-1,
        call_id="id-1",
        now_us=1_700_000_000_000_000,
    )
    with pytest.raises(BackendError, match="bad rate") as error:
        backend.execute(op)
    assert not isinstance(error.value, BackendUnavailable)
    backend.close()
