"""The backend contract: base classes per world, the old structural contract still
accepted (deprecated), clear errors for what is not a backend, and the flow drivers
that run every operation in both worlds."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis

from throttle_client import (
    AsyncBackend,
    AsyncLimiter,
    AsyncRedisBackend,
    Backend,
    Limiter,
    MemoryBackend,
)
from throttle_client._flow import arun, run


class OldSyncStore:
    """A store of the old contract: any object with a plain execute()."""

    def __init__(self) -> None:
        self.inner = MemoryBackend()

    def execute(self, op: Any) -> Any:
        return self.inner.execute(op)


class OldAsyncStore:
    def __init__(self) -> None:
        self.inner = MemoryBackend()

    async def execute(self, op: Any) -> Any:
        return self.inner.execute(op)


def test_a_store_of_the_old_contract_still_works_with_a_deprecation_warning() -> None:
    with pytest.warns(DeprecationWarning, match=r"OldSyncStore .* throttle_client\.Backend"):
        limiter = Limiter(OldSyncStore(), rates=["1/second"])
    assert limiter.try_acquire("k") and not limiter.try_acquire("k")


async def test_an_async_store_of_the_old_contract_still_works() -> None:
    with pytest.warns(DeprecationWarning, match=r"OldAsyncStore .* throttle_client\.AsyncBackend"):
        limiter = AsyncLimiter(OldAsyncStore(), rates=["1/second"])
    assert await limiter.try_acquire("k")
    assert not await limiter.try_acquire("k")


def test_an_old_async_store_given_to_a_limiter_is_refused() -> None:
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="use AsyncLimiter"):
        Limiter(OldAsyncStore(), rates=["1/second"])


def test_the_world_of_a_store_is_checked_when_its_class_is_made() -> None:
    with pytest.raises(TypeError, match=r"Wrong\.execute is a coroutine function"):

        class Wrong(Backend):
            async def execute(self, op: Any) -> Any:  # type: ignore[override]
                return None

    with pytest.raises(TypeError, match=r"WrongToo\.aexecute must be a coroutine function"):

        class WrongToo(AsyncBackend):
            def aexecute(self, op: Any) -> Any:  # type: ignore[override]
                return None


@pytest.mark.parametrize(
    ("thing", "hint"),
    [
        ("redis://localhost", r"a URL: give RedisBackend\(url\)"),
        (redis.Redis(port=1), r"wrap it, RedisBackend\(client\)"),
        (object(), r"a Backend subclass"),
    ],
)
def test_what_is_not_a_backend_gets_a_short_error_that_says_what_to_give(
    thing: Any, hint: str
) -> None:
    with pytest.raises(TypeError, match=hint) as info:
        Limiter(thing, rates=["1/second"])
    assert len(str(info.value)) < 150  # no repr of a whole connection pool


def test_an_asyncio_redis_client_is_named_as_such() -> None:
    client = redis.asyncio.Redis(port=1)
    with pytest.raises(TypeError, match=r"AsyncRedisBackend\(client\)"):
        AsyncLimiter(client, rates=["1/second"])


def test_a_store_of_both_worlds_serves_both_limiters() -> None:
    class Both(Backend, AsyncBackend):
        def __init__(self) -> None:
            self.inner = MemoryBackend()

        def execute(self, op: Any) -> Any:
            return self.inner.execute(op)

        async def aexecute(self, op: Any) -> Any:
            return self.inner.execute(op)

    store = Both()
    assert Limiter(store, rates=["1/second"]).try_acquire("k")
    assert AsyncLimiter(store, rates=["1/second"]).backend is store


async def test_async_redis_backend_execute_is_a_deprecated_name_for_aexecute(
    redis_url: str,
) -> None:
    async with AsyncRedisBackend(redis_url) as backend:
        limiter = AsyncLimiter(backend, rates=["5/second"])
        op = limiter._plan.inspect("k", limiter._local())
        with pytest.warns(DeprecationWarning, match="use aexecute"):
            snapshot = await backend.execute(op)
        assert snapshot.used == (0,)


# -- the drivers ---------------------------------------------------------------------------


def flow_with_cleanup(log: list[str]) -> Any:
    try:
        try:
            yield "fails"
        except ValueError as exc:  # a flow may handle what a step raised, and go on
            log.append(f"caught {exc}")
        answer = yield "works"
        log.append(f"got {answer}")
        yield "interrupted"
        log.append("never")
    finally:
        log.append("closed")


def test_the_sync_driver_throws_step_errors_in_and_closes_the_flow_on_an_interrupt() -> None:
    log: list[str] = []

    def perform(step: str) -> str:
        if step == "fails":
            raise ValueError("boom")
        if step == "interrupted":
            raise KeyboardInterrupt
        return "ok"

    with pytest.raises(KeyboardInterrupt):
        run(flow_with_cleanup(log), perform)
    assert log == ["caught boom", "got ok", "closed"]  # closed at once, not at collection


async def test_the_async_driver_closes_the_flow_when_its_task_is_cancelled() -> None:
    log: list[str] = []
    started = asyncio.Event()

    async def perform(step: str) -> str:
        if step == "fails":
            raise ValueError("boom")
        if step == "interrupted":
            started.set()
            await asyncio.sleep(60)
        return "ok"

    task = asyncio.ensure_future(arun(flow_with_cleanup(log), perform))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert log == ["caught boom", "got ok", "closed"]


def test_a_flow_returns_its_value_through_the_driver() -> None:
    def flow() -> Any:
        first = yield 1
        second = yield 2
        return first + second

    assert run(flow(), lambda step: step * 10) == 30


@pytest.mark.parametrize("store", ["memory", "sqlite"])
def test_a_reset_sweeps_on_the_injected_clock_not_the_hosts(
    store: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store sweeps expired keys inside any write, a reset's too: at the limiter's
    time. On the host's time (years past a FakeClock's) it forgot keys still in use."""
    from throttle_client import SQLiteBackend
    from throttle_client._backends import sqlite
    from throttle_client.testing import FakeClock

    if store == "sqlite":  # (memory looks for expired keys in every operation)
        monkeypatch.setattr(sqlite, "_SWEEP_EVERY", 1)
    backend = MemoryBackend() if store == "memory" else SQLiteBackend(tmp_path / "l.db")
    with backend:
        limiter = Limiter(backend, rates=["1/hour"], margin=0, clock=FakeClock())
        assert limiter.try_acquire("k")
        limiter.reset("other")
        assert not limiter.try_acquire("k")  # still within its hour
