"""The script's call on the wire: packed as redis-py would pack it, sent on the client's
own connections, answered and failing as through redis-py, and used only on clients of
the backend's own."""

from __future__ import annotations

import asyncio
import os
import threading
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
        redis_wire.Wire(client).call("evalsha", ("0" * 40, 0))
    failing = client.script_load("return redis.error_reply('no room here')")
    with pytest.raises(rx.ResponseError, match="no room here"):
        redis_wire.Wire(client).call("evalsha", (failing, 0))
    assert redis_wire.Wire(client).call("evalsha", (client.script_load("return 7"), 0)) == 7
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


def named_url(redis_url: str, name: str) -> str:
    """``redis_url`` whose connections name themselves ``name`` (CLIENT SETNAME)."""
    return f"{redis_url}{'&' if '?' in redis_url else '?'}client_name={name}"


def connections(redis_url: str, name: str) -> int:
    """How many connections the server has of that name."""
    admin = redis.Redis.from_url(redis_url)
    try:
        return sum(1 for client in admin.client_list() if client.get("name") == name)
    finally:
        admin.close()


def test_one_connection_serves_call_after_call(redis_url: str) -> None:
    """The first call opens the Wire's connection (and loads the library on it); every
    call after it goes on that one; the pool opens none, and close() closes it."""
    backend = RedisBackend(named_url(redis_url, "wire-one"))
    limiter = Limiter(backend, rates=["1000/minute"])
    for _ in range(20):
        assert limiter.try_acquire("k").allowed
    assert connections(redis_url, "wire-one") == 1
    runner: Any = backend._runner
    assert [c for c in runner.connection_pool._connections if c is not None] == []
    backend.close()
    assert connections(redis_url, "wire-one") == 0


def test_an_async_backend_uses_one_connection_too(redis_url: str) -> None:
    async def main() -> None:
        backend = AsyncRedisBackend(named_url(redis_url, "wire-async"))
        limiter = AsyncLimiter(backend, rates=["1000/minute"])
        for _ in range(20):
            assert (await limiter.try_acquire("k")).allowed
        assert connections(redis_url, "wire-async") == 1
        await backend.aclose()
        assert connections(redis_url, "wire-async") == 0

    asyncio.run(main())


def test_a_connection_the_server_closed_between_calls_is_opened_again(redis_url: str) -> None:
    """The Wire's connection is probed before it is used, as the pool probes one it hands
    out: the server closing it (a restart, its idle timeout) fails no call."""
    client = redis.Redis.from_url(redis_url)
    wire = redis_wire.Wire(client)
    seven = client.script_load("return 7")
    other = redis.Redis.from_url(redis_url)
    for _ in range(3):
        assert wire.call("evalsha", (seven, 0)) == 7
        assert other.client_kill_filter(_type="normal", skipme=True) >= 1
    assert wire.call("evalsha", (seven, 0)) == 7
    other.close()
    client.close()


def test_an_async_connection_the_server_closed_is_opened_again(redis_url: str) -> None:
    async def main() -> None:
        backend = AsyncRedisBackend(named_url(redis_url, "wire-killed"))
        limiter = AsyncLimiter(backend, rates=["1000/minute"])
        other = redis.Redis.from_url(redis_url)
        for _ in range(3):
            assert (await limiter.try_acquire("k")).allowed
            assert other.client_kill_filter(_type="normal", skipme=True) >= 1
            await asyncio.sleep(0.01)  # (the loop reads the end of the stream)
        assert (await limiter.try_acquire("k")).allowed
        other.close()
        await backend.aclose()

    asyncio.run(main())


def test_the_pool_s_other_users_never_wait_for_the_wire(redis_url: str) -> None:
    """The Wire's connection is its own, not one of the pool's: the client's users may
    hold every connection of the pool (subscriptions, a WATCH), and decisions still go;
    and after decisions from many threads at once, every connection the pool made waits
    in it. The backend's calls open at most as many connections as the pool holds."""
    backend = RedisBackend(named_url(redis_url, "wire-threads"))
    limiter = Limiter(backend, rates=["100000/minute"])
    runner: Any = backend._runner
    pool = runner.connection_pool
    pool.timeout = 5  # (a failure, not a hang, if none is free)
    named = ("PING",) if redis_wire._NAMED else ()  # (redis-py < 5.3 names the command)
    held = [pool.get_connection(*named) for _ in range(pool.max_connections)]
    assert limiter.acquire("k").allowed
    for conn in held:
        pool.release(conn)
    for conn in held:
        conn.disconnect()
    barrier = threading.Barrier(8)

    def decide() -> None:
        barrier.wait(10)
        for _ in range(200):
            # (acquire: on a busy machine an answer may come back after its slot's
            # margin, and try_acquire cannot wait for the new slot that books)
            assert limiter.acquire("k").allowed

    threads = [threading.Thread(target=decide) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert limiter.usage("k").rates[0].used >= 1601
    assert connections(redis_url, "wire-threads") <= pool.max_connections
    held = [pool.get_connection(*named) for _ in range(pool.max_connections)]
    for conn in held:
        pool.release(conn)
    backend.close()


def test_a_resp3_client_s_calls_go_through_its_pool(redis_url: str) -> None:
    """Where the pool does more than hand out connections (RESP3: maintenance
    notifications, client-side caching), the Wire makes no connection of its own."""
    backend = RedisBackend(named_url(redis_url, "wire-resp3") + "&protocol=3")
    limiter = Limiter(backend, rates=["1000/minute"])
    for _ in range(5):
        assert limiter.try_acquire("k").allowed
    runner: Any = backend._runner
    made = [c for c in runner.connection_pool._connections if c is not None]
    assert len(made) == 1 and connections(redis_url, "wire-resp3") == 1
    backend.close()


def test_a_forked_child_opens_its_own_connection(redis_url: str) -> None:
    """The Wire's connection is the parent's: a child deciding on the same backend at
    the same time as its parent never sends on it (their replies would cross)."""
    backend = RedisBackend(redis_url)
    limiter = Limiter(backend, rates=["100000/minute"])
    assert limiter.acquire("forked").allowed
    wire: Any = backend._wire
    parents = list(wire._spare)
    assert len(parents) == 1
    pid = os.fork()
    if pid == 0:  # the child: its answers, or a failure, in its exit status
        status = 1
        try:
            if all(limiter.acquire("forked").allowed for _ in range(300)):
                status = 3 if wire._spare == parents else 0
        finally:
            os._exit(status)
    parent = all(limiter.acquire("forked").allowed for _ in range(300))
    _, status = os.waitpid(pid, 0)
    assert parent
    assert os.waitstatus_to_exitcode(status) == 0
    assert limiter.usage("forked").rates[0].used >= 601
    backend.close()


def test_the_script_s_other_commands_answer_as_through_redis_py(redis_url: str) -> None:
    """Loading the script again, and the store's eviction policy, sent on the wire alone
    or pipelined, answer as redis-py's methods of those names answer; in a pipeline an
    error reply is a value, as with ``raise_on_error=False``."""
    client = redis.Redis.from_url(redis_url)
    wire = redis_wire.Wire(client)
    script = "return 5"
    assert wire.call("script_load", (script,)) == client.script_load(script).encode()
    assert wire.call("config_get", ("maxmemory*",)) == {
        k.encode(): v.encode() for k, v in client.config_get("maxmemory*").items()
    }
    steps = (("config_get", ("maxmemory-policy",)), ("evalsha", ("0" * 40, 0)))
    mine = wire.call("pipeline", steps)
    pipe = client.pipeline(transaction=False)
    pipe.config_get("maxmemory-policy")
    pipe.evalsha("0" * 40, 0)
    theirs = pipe.execute(raise_on_error=False)
    assert mine[0] == {k.encode(): v.encode() for k, v in theirs[0].items()}
    assert type(mine[1]) is type(theirs[1]) is rx.NoScriptError
    library = "#!lua name=wiretest\nredis.register_function('wiretest', function() return 3 end)"
    try:
        loaded = wire.call("function_load", (library, True))
    except rx.ResponseError:  # Redis 6.2 has no functions: refused alike by both
        with pytest.raises(rx.ResponseError):
            client.function_load(library, replace=True)
    else:
        assert loaded == b"wiretest"
        assert client.function_load(library, replace=True) in ("wiretest", b"wiretest")
        assert wire.call("fcall", ("wiretest", 0)) == 3
        client.function_delete("wiretest")
    assert wire.call("evalsha", (client.script_load(script), 0)) == 5  # (still in step)
    client.close()


def speaking(redis_url: str, name: str) -> list[str]:
    """The protocol (CLIENT LIST's ``resp``) of each connection of that name."""
    admin = redis.Redis.from_url(redis_url)
    try:
        return [str(c.get("resp")) for c in admin.client_list() if c.get("name") == name]
    finally:
        admin.close()


@pytest.mark.parametrize("given", ["url", "client"])
def test_the_backend_speaks_resp2_unless_told_and_keeps_its_own_connection(
    redis_url: str, given: str
) -> None:
    """redis-py 8 speaks RESP3 by default, whose pool also handles maintenance
    notifications (a MOVING moves the pool's connections, never one beside it): the
    backend's own clients speak RESP2 unless the URL or the client asks for RESP3, so the
    Wire may keep its connection; one that asks is served through its pool."""
    url = named_url(redis_url, f"wire-resp-{given}")
    yours = redis.Redis.from_url(url)
    backend = RedisBackend(url if given == "url" else yours)
    limiter = Limiter(backend, rates=["1000/minute"])
    for _ in range(5):
        assert limiter.try_acquire("k").allowed
    wire: Any = backend._wire
    assert wire._own and len(wire._spare) == 1
    assert speaking(redis_url, f"wire-resp-{given}") in (["2"], ["None"])  # (6.2: not said)
    backend.close()
    yours.close()


def test_a_connection_given_back_after_close_is_disconnected() -> None:
    """close() may run while a call is in flight, between any two of its steps: the
    connection the call gives back afterwards is disconnected, never kept by a closed
    Wire (which makes no other)."""
    client = redis.Redis(protocol=2)  # (nothing is sent: its connections never open)
    wire = redis_wire.Wire(client)
    conn = wire._take()
    assert conn is not None
    assert wire.close() == []  # (the call still holds it)
    assert wire._give(conn) == [conn]  # the caller disconnects it
    assert wire._spare == [] and wire._take() is None
    client.close()
