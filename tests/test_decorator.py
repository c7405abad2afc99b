"""@throttled on plain functions, coroutine functions and methods."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from throttle_client import (
    AsyncLimiter,
    ConfigurationError,
    Limiter,
    MemoryBackend,
    ThrottleTimeout,
    throttled,
)
from throttle_client.testing import FakeClock


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def limiter(clock):
    return Limiter(MemoryBackend(), rates="2/second", margin=0, clock=clock, sleep=clock.sleep)


@pytest.fixture
def async_limiter(clock):
    return AsyncLimiter(
        MemoryBackend(), rates="2/second", margin=0, clock=clock, sleep=clock.asleep
    )


def test_waits_for_the_slot_of_the_named_argument(limiter, clock):
    calls = []

    @throttled(limiter, key="token")
    def fetch(token: str, url: str) -> str:
        calls.append((clock(), token))
        return url.upper()

    assert fetch("a", "x") == "X"
    assert fetch("a", url="y") == "Y"
    assert fetch(token="a", url="z") == "Z"  # third call for "a": the window is full
    assert fetch("b", "w") == "W"  # another key has its own log
    start = calls[0][0]
    assert [(t - start, k) for t, k in calls] == [(0, "a"), (0, "a"), (1.0, "a"), (1.0, "b")]
    assert limiter.usage("a").rates[0].used == 1  # only the call at 1.0 is in the window


def test_key_defaults_are_honoured(limiter):
    @throttled(limiter, key="token")
    def fetch(url: str, token: str = "default-token") -> str:
        return url

    fetch("x")
    assert limiter.usage("default-token").rates[0].used == 1


def test_key_and_cost_may_be_computed(limiter):
    @throttled(limiter, key=lambda user, pages: user["token"], cost=lambda user, pages: pages)
    def crawl(user: dict, pages: int) -> int:
        return pages

    assert crawl({"token": "t"}, 2) == 2
    assert limiter.usage("t").rates[0].used == 2


def test_cost_may_name_an_argument(limiter):
    @throttled(limiter, key="token", cost="units")
    def bulk(token: str, units: int = 2) -> None:
        pass

    bulk("t")
    assert limiter.usage("t").rates[0].used == 2


def test_a_key_passed_through_kwargs(limiter):
    @throttled(limiter, key="token")
    def fetch(url: str, **options: str) -> str:
        return url

    fetch("x", token="via-kwargs")
    assert limiter.usage("via-kwargs").rates[0].used == 1
    with pytest.raises(TypeError, match="no argument 'token'"):
        fetch("x")


def test_keeps_name_docstring_and_signature(limiter):
    def fetch(token: str, url: str, *, retries: int = 0) -> bytes:
        """Fetch a thing."""
        return b""

    wrapped = throttled(limiter, key="token")(fetch)
    assert wrapped.__name__ == "fetch"
    assert wrapped.__doc__ == "Fetch a thing."
    assert inspect.signature(wrapped) == inspect.signature(fetch)
    assert wrapped.__wrapped__ is fetch


def test_works_on_methods(limiter):
    class Api:
        def __init__(self, token: str) -> None:
            self.token = token

        @throttled(limiter, key=lambda self, path: self.token)
        def get(self, path: str) -> str:
            return f"{self.token}:{path}"

        @throttled(limiter, key="account")
        def get_as(self, account: str) -> str:
            return account

    assert Api("t1").get("/me") == "t1:/me"
    assert Api("t1").get_as("acct") == "acct"
    assert limiter.usage("t1").rates[0].used == 1
    assert limiter.usage("acct").rates[0].used == 1


def test_timeout_raises_and_does_not_call(limiter):
    calls = []

    @throttled(limiter, key="token", timeout=0.5)
    def fetch(token: str) -> None:
        calls.append(token)

    fetch("t")
    fetch("t")
    with pytest.raises(ThrottleTimeout) as caught:
        fetch("t")
    assert caught.value.retry_after == pytest.approx(1.0)
    assert calls == ["t", "t"]


async def test_coroutine_functions_with_an_async_limiter(async_limiter, clock):
    calls = []

    @throttled(async_limiter, key="token")
    async def fetch(token: str, url: str) -> str:
        """Fetch asynchronously."""
        calls.append(clock())
        return url

    assert inspect.iscoroutinefunction(fetch)
    assert fetch.__doc__ == "Fetch asynchronously."
    results = [await fetch("t", str(i)) for i in range(3)]
    assert results == ["0", "1", "2"]
    assert [t - calls[0] for t in calls] == [0, 0, 1.0]
    assert (await async_limiter.usage("t")).rates[0].used == 1


def test_a_limiter_of_the_wrong_world_is_refused(limiter, async_limiter):
    with pytest.raises(TypeError, match="coroutine function: throttle it with an AsyncLimiter"):

        @throttled(limiter, key="token")
        async def afetch(token: str) -> None: ...

    with pytest.raises(TypeError, match="plain function: throttle it with a Limiter"):

        @throttled(async_limiter, key="token")
        def fetch(token: str) -> None: ...


class AsyncFetcher:
    """Fetches with an async __call__."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def __call__(self, token: str, url: str) -> str:
        self.calls.append(token)
        return url


async def test_an_object_with_an_async_call(async_limiter, clock):
    fetcher = AsyncFetcher()
    fetch = throttled(async_limiter, key="token")(fetcher)
    assert inspect.iscoroutinefunction(fetch) and fetch.__doc__ == AsyncFetcher.__doc__
    assert [await fetch("t", str(i)) for i in range(3)] == ["0", "1", "2"]
    assert fetcher.calls == ["t"] * 3 and clock.slept == [1.0]  # the third waited its turn


def test_an_object_with_an_async_call_is_named_in_messages(limiter, async_limiter):
    with pytest.raises(TypeError, match=r"AsyncFetcher\.__call__ is a coroutine function"):
        throttled(limiter, key="token")(AsyncFetcher())
    with pytest.raises(ConfigurationError, match="names no argument of AsyncFetcher"):
        throttled(async_limiter, key="tokn")(AsyncFetcher())


def test_generator_functions_are_refused_as_what_they_are(limiter, async_limiter):
    async def pages(token: str):
        yield token

    def lines(token: str):
        yield token

    for any_limiter in (limiter, async_limiter):
        with pytest.raises(TypeError, match="pages is an async generator function, whose body"):
            throttled(any_limiter, key="token")(pages)
        with pytest.raises(TypeError, match="lines is a generator function, whose body"):
            throttled(any_limiter, key="token")(lines)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"key": "tokn"}, ConfigurationError, "key='tokn' names no argument of"),
        ({"key": "token", "cost": "units"}, ConfigurationError, "cost='units'"),
        ({"key": "token", "cost": 0}, ConfigurationError, "not 0"),
        ({"key": 42}, TypeError, "not 42"),
        ({"key": "token", "cost": 1.5}, TypeError, "not 1.5"),
    ],
)
def test_bad_options_fail_at_decoration_naming_the_value(limiter, options, error, message):
    with pytest.raises(error, match=message):

        @throttled(limiter, **options)
        def fetch(token: str) -> None: ...


# -- feedback= : the upstream's answer in what a call returned or raised ------------------


class _Answer:
    """What a fetch function returns: the upstream's status and headers."""

    def __init__(self, status: int, headers: dict[str, str] | None = None) -> None:
        self.status_code, self.headers = status, headers or {}


class _Refused(Exception):
    def __init__(self, answer: _Answer) -> None:
        super().__init__(f"HTTP {answer.status_code}")
        self.response = answer


def _read(outcome: object) -> tuple[int, dict[str, str]] | None:
    answer = outcome.response if isinstance(outcome, _Refused) else outcome
    return (answer.status_code, answer.headers) if isinstance(answer, _Answer) else None


def test_feedback_pauses_the_key_for_every_worker_and_learns_the_quota(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    limiter = Limiter(
        MemoryBackend(), rates=["10/second"], clock=clock, sleep=clock.sleep, margin=0
    )
    answers = iter(
        [
            _Answer(429, {"Retry-After": "3"}),  # the key paused 3 s
            _Refused(_Answer(503, {"Retry-After": "2"})),  # raised: 2 s more
            _Answer(
                200,
                {
                    "X-RateLimit-Limit": "1",
                    "X-RateLimit-Remaining": "0",
                    "X-RateLimit-Reset": str(int(clock() + 60)),
                },
            ),
            _Answer(200),
        ]
    )
    called: list[float] = []
    start = clock()

    @throttled(limiter, key="token", feedback=_read)
    def fetch(token: str) -> _Answer:
        called.append(round(clock() - start, 3))
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert fetch("t").status_code == 429  # the caller still gets what the call returned
    assert limiter.usage("t").paused_for == pytest.approx(3.0)
    with pytest.raises(_Refused):
        fetch("t")
    fetch("t")
    assert limiter.usage("t").learned is not None  # held to the upstream's 1 call
    fetch("t")
    assert called[:3] == [0.0, 3.0, 5.0] and called[3] >= 60.0
    assert "pausing its key for 3.00s" in caplog.text and "t" not in caplog.text.split()


def test_a_feedback_that_fails_reads_nothing_and_the_call_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    limiter = Limiter(MemoryBackend(), rates=["10/second"], clock=clock, sleep=clock.sleep)

    @throttled(limiter, key="token", feedback=lambda result: 1 / 0)
    def fetch(token: str) -> _Answer:
        return _Answer(429, {"Retry-After": "30"})

    assert fetch("t").status_code == 429
    assert limiter.usage("t").paused_for == 0.0
    assert "feedback= failed for" in caplog.text
    with pytest.raises(TypeError, match="feedback must be a plain function"):
        throttled(limiter, key="token", feedback="status")  # type: ignore[arg-type]


def test_feedback_on_a_coroutine_function() -> None:
    clock = FakeClock()
    limiter = AsyncLimiter(MemoryBackend(), rates=["10/second"], clock=clock, sleep=clock.asleep)
    answers = iter([_Refused(_Answer(429, {"Retry-After": "4"})), _Answer(200)])
    called: list[float] = []
    start = clock()

    @throttled(limiter, key="token", feedback=_read)
    async def fetch(token: str) -> _Answer:
        called.append(round(clock() - start, 3))
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def main() -> None:
        with pytest.raises(_Refused):
            await fetch("t")
        assert (await fetch("t")).status_code == 200

    asyncio.run(main())
    assert called[0] == 0.0 and called[1] >= 4.0


def test_feedback_reads_any_mapping_of_headers() -> None:
    """A client's own headers need not be a dict of str: urllib's Message, int or
    bytes values are read as a transport reads a response's."""
    from email.message import Message

    clock = FakeClock()
    limiter = Limiter(MemoryBackend(), rates=["10/second"], clock=clock, sleep=clock.sleep)
    message = Message()
    message["Retry-After"] = "3"
    answers = iter([(429, message), (429, {"Retry-After": 5}), (429, {b"Retry-After": b"7"})])

    @throttled(limiter, key="token", feedback=lambda result: result)
    def fetch(token: str) -> object:
        return next(answers)

    for pause in (3.0, 5.0, 7.0):
        fetch("t")
        assert limiter.usage("t").paused_for == pytest.approx(pause)


def test_feedback_that_is_no_mapping_is_logged_and_the_result_returned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    limiter = Limiter(MemoryBackend(), rates=["10/second"])

    @throttled(limiter, key="token", feedback=lambda result: (429, ["Retry-After: 3"]))
    def fetch(token: str) -> str:
        return "the page"

    assert fetch("t") == "the page"
    assert limiter.usage("t").paused_for == 0.0
    assert "feedback= failed for" in caplog.text


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_store_out_of_reach_after_the_call_does_not_replace_its_outcome(
    asynchronous: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The call has run: its result (or its exception) goes to its caller even when
    the pause it asks for cannot reach the store."""
    from typing import Any

    from throttle_client import BackendUnavailable
    from throttle_client._backends.ops import Pause

    class LostAfterAdmitting(MemoryBackend):
        def execute(self, op: Any) -> Any:
            if isinstance(op, Pause):
                raise BackendUnavailable("the store went away")
            return super().execute(op)

    answer = _Answer(429, {"Retry-After": "3"})
    if asynchronous:
        limiter: Any = AsyncLimiter(LostAfterAdmitting(), rates=["10/second"], retry_for=0)

        @throttled(limiter, key="token", feedback=_read)
        async def afetch(token: str) -> _Answer:
            return answer

        assert asyncio.run(afetch("t")) is answer
    else:
        limiter = Limiter(LostAfterAdmitting(), rates=["10/second"], retry_for=0)

        @throttled(limiter, key="token", feedback=_read)
        def fetch(token: str) -> _Answer:
            return answer

        assert fetch("t") is answer
    assert "could not be shared" in caplog.text


def test_feedback_headers_may_be_pairs_or_none_and_an_async_feedback_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    clock = FakeClock()
    limiter = Limiter(MemoryBackend(), rates=["10/second"], clock=clock, sleep=clock.sleep)
    answers = iter([(429, [("Retry-After", "4")]), (429, None)])

    @throttled(limiter, key="token", feedback=lambda result: result)
    def fetch(token: str) -> object:
        return next(answers)

    fetch("t")
    assert limiter.usage("t").paused_for == pytest.approx(4.0)
    fetch("t")  # a 429 that says nothing: the transports' first backoff
    assert limiter.usage("t").paused_for == pytest.approx(1.0)

    async def reads(outcome: object) -> None: ...

    with pytest.raises(TypeError, match="plain function"):
        throttled(limiter, key="token", feedback=reads)  # type: ignore[arg-type]

    # A feedback written for responses, given the exception of a lost connection: the
    # caller gets that exception; the log has no error for it.
    @throttled(limiter, key="token", feedback=lambda r: (r.status_code, r.headers))
    def lost(token: str) -> object:
        raise ConnectionError("the connection was lost")

    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="throttle_client"), pytest.raises(ConnectionError):
        lost("t")
    assert [r.levelname for r in caplog.records if "feedback= failed" in r.message] == ["DEBUG"]
