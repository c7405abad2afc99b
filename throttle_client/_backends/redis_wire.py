"""The script's call on the wire: packed here and sent on a connection of the client's
pool, without redis-py's command layer.

A decision is one FCALL (EVALSHA on Redis 6.2) of a dozen arguments. redis-py's
``execute_command`` spends ~10 µs on it before and after the round trip (packing
each argument through its encoder, the retry wrapper, its own metrics), more than the
rest of the decision's Python. On a standalone client of the backend's own (built from
a URL, or a copy of the user's: ``redis_clients``) the call is packed once, as RESP,
and sent on a connection of the client's pool (kept between calls: ``Wire``): the same
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
import os
import select
import threading
import weakref
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


class Wire:
    """The script's calls of one ``redis.Redis`` that :func:`wired` allows, keeping one
    connection between calls.

    Taking a connection from redis-py's pool and giving it back costs ~7 µs a call
    (redis-py 8: its queue, a probe of the socket for unread bytes, its metrics), a
    twentieth of a decision. The connection a call used is kept here for the next one
    instead; the pool is asked only when none is kept (calls at once in other threads).
    One only, and never while a call waits for the pool: a connection kept here is one
    the pool cannot hand out, and its other users (the backend's other commands, a
    client's own) must never wait on the pool for it. The pool still makes, counts and
    bounds the connections, and closes them with itself: to it, the kept one is in use.

    Before the kept connection is used, its socket is probed, as the pool probes one it
    hands out: if the server closed it meanwhile (a restart, its idle timeout), it is
    opened again, so the call is sent on a live one. A call answered with an error
    reply gives its connection back to the pool, which the command that follows (a
    load of the script) uses; one that failed in any other way gives it back closed (a
    Sentinel's
    connection keeps itself open on a timed-out read, as redis-py's command layer would
    not: the next command on it would read this one's reply).
    """

    def __init__(self, client: Any) -> None:
        self.client = client
        self._pool = client.connection_pool
        self._lock = threading.Lock()
        self._kept: Any = None
        self._waiting = 0  # calls asking the pool for a connection
        _WIRES.add(self)

    def _take(self) -> Any:
        """The kept connection, probed, or None: the caller asks the pool, then calls
        _asked()."""
        with self._lock:
            conn, self._kept = self._kept, None
            if conn is None:
                self._waiting += 1
                return None
        sock = conn._sock
        if sock is not None:
            probe = select.poll()
            probe.register(sock, select.POLLIN)
            if probe.poll(0):  # (every reply it was sent was read: EOF, or junk)
                conn.disconnect()  # (and sending connects it again)
        return conn

    def _asked(self) -> None:
        with self._lock:
            self._waiting -= 1

    def _give_back(self, conn: Any) -> None:
        """Keep ``conn`` for the next call, or give it back to the pool."""
        with self._lock:
            if self._kept is None and not self._waiting:
                self._kept, conn = conn, None
        if conn is not None:
            self._pool.release(conn)

    def _forget(self) -> None:
        """In a forked child: the parent's socket is not this process's to use (the
        pool makes the child its own)."""
        self._lock = threading.Lock()
        self._kept, self._waiting = None, 0

    def lend(self) -> None:
        """Give the kept connection back to the pool, for a command that goes through
        redis-py (else the pool would open another connection for it)."""
        with self._lock:
            conn, self._kept = self._kept, None
        if conn is not None:
            self._pool.release(conn)

    def close(self) -> None:
        """Forget the kept connection (the pool closes it, as its own in use)."""
        with self._lock:
            self._kept = None

    def call(self, command: str, args: Iterable[Any]) -> Any:
        """``command`` on a connection of the client's pool: its reply, or the error
        it is."""
        conn = self._take()
        if conn is None:
            try:
                pool = self._pool
                conn = pool.get_connection(command) if _NAMED else pool.get_connection()
            finally:
                self._asked()
        try:
            conn.send_packed_command([pack(command, args)])
            reply = conn.read_response()
        except ResponseError:  # the server's error reply: the connection is in step,
            self._pool.release(conn)  # and the pool's for what comes next (a load)
            raise
        except BaseException:
            conn.disconnect()
            self._pool.release(conn)
            raise
        self._give_back(conn)
        return reply


_WIRES: weakref.WeakSet[Wire] = weakref.WeakSet()


def _forget_all() -> None:
    for wire in _WIRES:
        wire._forget()


os.register_at_fork(after_in_child=_forget_all)


async def acall(client: Any, command: str, args: Iterable[Any]) -> Any:
    """``command`` on a connection of ``client``'s pool (a ``redis.asyncio.Redis`` that
    :func:`wired` allows): its reply, or the error it is."""
    pool = client.connection_pool
    get = pool.get_connection(command) if _NAMED else pool.get_connection()
    conn = await cast(Awaitable[Any], get)
    try:
        await conn.send_packed_command([pack(command, args)])
        return await conn.read_response()
    except ResponseError:
        raise  # the server's error reply: the connection is in step
    except BaseException:
        await conn.disconnect(nowait=True)  # (as Wire.call: never a reply left on its way)
        raise
    finally:
        await cast(Awaitable[None], pool.release(conn))
