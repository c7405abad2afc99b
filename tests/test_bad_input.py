"""Bad input: refused at once with an error that names the value, and nothing is written.

Every limiter here sits on the real Redis server of the session, flushed per test,
so "nothing written" is checked where it matters: DBSIZE stays 0. A key is never
echoed in a message, since it is usually an access token.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis

from throttle_client import (
    AsyncLimiter,
    AsyncRedisBackend,
    BackendError,
    BackendUnavailable,
    ConfigurationError,
    CostTooHigh,
    Limiter,
    Rate,
    RedisBackend,
)
from throttle_client._ops import Acquire, Policy
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
        policy=Policy(limits=((3, 1_000_000),), min_interval_us=0),
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
        policy=Policy(limits=((0, 1_000_000),), min_interval_us=0),
        cost=1,
        max_wait_us=-1,
        call_id="id-1",
        now_us=1_700_000_000_000_000,
    )
    with pytest.raises(BackendError, match="bad rate") as error:
        backend.execute(op)
    assert not isinstance(error.value, BackendUnavailable)
    backend.close()
