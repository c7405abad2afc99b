"""The script's call on the wire: packed here and sent on a connection of the client's
pool, without redis-py's command layer.

A decision is one FCALL (EVALSHA on Redis 6.2) of a dozen arguments. redis-py's
``execute_command`` spends ~10 µs on it before and after the round trip (packing
each argument through its encoder, the retry wrapper, its own metrics), more than the
rest of the decision's Python. On a standalone client of the backend's own (built from
a URL, or a copy of the user's: ``redis_clients``) the call is packed once, as RESP,
and sent on a connection taken from the client's pool and given back: the same
connections, settings (TLS, AUTH, RESP3, health checks, Sentinel's failover) and
errors (the server's error replies as they are; a connection whose read or write failed
in any other way is closed, as redis-py's command layer closes it), with none of the
layer in between. redis-py's retries are off on those clients
(``redis_clients.bounded``), so nothing of that layer is lost; a client of the user's
(a subclass, a single connection, a pool we do not know) and a Cluster's go through
redis-py as they are.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Iterable
from typing import Any, cast

import redis
import redis.asyncio
from redis.exceptions import ResponseError

# The commands that go this way: the script's calls (everything else is rare).
WIRED = frozenset({"fcall", "evalsha"})

# redis-py < 5.3 names the command when it hands out a connection; later versions warn
# when anything is given.
_NAMED = (
    inspect.signature(redis.ConnectionPool.get_connection).parameters["command_name"].default
    is inspect.Parameter.empty
)


def pack(command: str, args: Iterable[Any]) -> bytes:
    """``command`` and ``args`` (bytes, str or int) as one RESP array."""
    parts = [b""]
    for arg in args:
        if type(arg) is not bytes:  # (most are)
            arg = arg.encode() if isinstance(arg, str) else b"%d" % arg
        parts.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    word = command.upper().encode()
    parts[0] = b"*%d\r\n$%d\r\n%s\r\n" % (len(parts), len(word), word)
    return b"".join(parts)


def wired(client: Any, owned: bool) -> bool:
    """Whether ``client``'s script calls may go on the wire: one of our own, a plain
    standalone client (not a single-connection one)."""
    plain = type(client) in (redis.Redis, redis.asyncio.Redis)
    return owned and plain and getattr(client, "connection", None) is None


def call(client: Any, command: str, args: Iterable[Any]) -> Any:
    """``command`` on a connection of ``client``'s pool (a ``redis.Redis`` that
    :func:`wired` allows): its reply, or the error it is."""
    pool = client.connection_pool
    conn = pool.get_connection(command) if _NAMED else pool.get_connection()
    try:
        conn.send_packed_command([pack(command, args)])
        return conn.read_response()
    except ResponseError:
        raise  # the server's error reply: the connection is in step
    except BaseException:
        # Anything else may leave the reply on its way (a Sentinel's connection keeps
        # itself open on a timed-out read; redis-py's command layer closes it): the
        # next command on it would read this one's reply.
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


async def acall(client: Any, command: str, args: Iterable[Any]) -> Any:
    """As :func:`call`, for a ``redis.asyncio`` client."""
    pool = client.connection_pool
    get = pool.get_connection(command) if _NAMED else pool.get_connection()
    conn = await cast(Awaitable[Any], get)
    try:
        await conn.send_packed_command([pack(command, args)])
        return await conn.read_response()
    except ResponseError:
        raise
    except BaseException:
        await conn.disconnect(nowait=True)  # (as call(): never a reply left on its way)
        raise
    finally:
        await cast(Awaitable[None], pool.release(conn))
