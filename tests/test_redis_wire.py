"""The script's call on the wire: packed as redis-py would pack it, sent on the client's
own connections, answered and failing as through redis-py, and used only on clients of
the backend's own."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis
import redis.asyncio
from redis import exceptions as rx

from throttle_client import AsyncLimiter, AsyncRedisBackend, BackendError, Limiter, RedisBackend
from throttle_client._backends import redis_wire


@pytest.mark.parametrize(
    "args",
    [
        (b"sha", 2, b"tc:{k}:log", "tc:{k}:meta", b"acquire", b"\x93\x00\xcf", b"-", b"1"),
        ("fn", 0),
        ("héllo", b"", b"\r\n", -1, 2**62),
    ],
)
def test_a_command_is_packed_as_redis_py_packs_it(args: tuple[Any, ...]) -> None:
    theirs = b"".join(redis.Connection().pack_command("FCALL", *args))
    assert redis_wire.pack("fcall", args) == theirs


def refuse_redis_py(client: Any) -> list[str]:
    """Make ``client``'s command layer fail loudly; the commands it was asked for."""
    asked: list[str] = []

    def refused(*args: Any, **options: Any) -> Any:
        asked.append(str(args[0]))
        raise AssertionError(f"{args[0]} went through redis-py's command layer")

    client.execute_command = refused
    return asked


def test_a_backend_of_its_own_client_sends_its_decisions_on_the_wire(redis_url: str) -> None:
    backend = RedisBackend(redis_url)
    limiter = Limiter(backend, rates=["3/minute"])
    assert limiter.try_acquire("k").allowed  # (the first call also loads the library)
    refuse_redis_py(backend._runner)
    assert [limiter.try_acquire("k").allowed for _ in range(3)] == [True, True, False]
    backend.close()


class CountingPool(redis.ConnectionPool):
    """A pool of the user's own kind: the backend cannot copy it, and uses the client
    as it is."""


def test_a_client_the_backend_uses_as_it_is_goes_through_redis_py(redis_url: str) -> None:
    client = redis.Redis(connection_pool=CountingPool.from_url(redis_url))
    backend = RedisBackend(client)
    limiter = Limiter(backend, rates=["3/minute"])
    assert limiter.try_acquire("k").allowed
    asked = refuse_redis_py(client)
    with pytest.raises(AssertionError, match="redis-py's command layer"):
        limiter.try_acquire("k")
    assert asked and asked[0].upper() in {"FCALL", "EVALSHA"}
    client.close()


def test_an_error_reply_on_the_wire_is_redis_py_s_error(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    with pytest.raises(rx.NoScriptError):
        redis_wire.call(client, "evalsha", ("0" * 40, 0))
    failing = client.script_load("return redis.error_reply('no room here')")
    with pytest.raises(rx.ResponseError, match="no room here"):
        redis_wire.call(client, "evalsha", (failing, 0))
    assert redis_wire.call(client, "evalsha", (client.script_load("return 7"), 0)) == 7
    assert client.ping()  # (the connection an error reply came on is still in use)
    client.close()


def test_an_async_backend_sends_its_decisions_on_the_wire(redis_url: str) -> None:
    async def main() -> None:
        backend = AsyncRedisBackend(redis_url)
        limiter = AsyncLimiter(backend, rates=["3/minute"])
        assert (await limiter.try_acquire("k")).allowed
        refuse_redis_py(backend._runner)
        answers = await asyncio.gather(*(limiter.try_acquire("k") for _ in range(3)))
        assert sorted(a.allowed for a in answers) == [False, True, True]
        await backend.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("reply", [b"ec19ee1d825109c4", b"", b"1 2"])
def test_an_answer_of_the_wrong_shape_is_a_backend_error(
    redis_url: str, reply: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reply that is not a decision's (another command's, read out of step) fails the
    call as the store's error, naming what came, never as a ValueError from parsing."""
    backend = RedisBackend(redis_url)
    limiter = Limiter(backend, rates=["3/minute"])
    assert limiter.try_acquire("k").allowed
    runner: Any = backend._runner
    connection = runner.connection_pool.connection_class
    monkeypatch.setattr(connection, "read_response", lambda *a, **k: reply)
    with pytest.raises(BackendError, match="Redis answered"):
        limiter.try_acquire("k")
    monkeypatch.undo()
    assert limiter.try_acquire("k").allowed
    backend.close()
