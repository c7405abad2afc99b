"""The script's commands on the wire: packed here and sent on a connection of the
backend's own, without redis-py's command layer.

A decision is one FCALL (EVALSHA on Redis 6.2) of a dozen arguments. redis-py's
``execute_command`` spends ~10 µs on it before and after the round trip (packing
each argument through its encoder, the retry wrapper, its own metrics), and taking a
connection from its pool and giving it back ~7 µs more (~11 µs under asyncio: its
queue, a probe of the socket, its metrics), together more than the rest of the
decision's Python. On a standalone client of the backend's own (built from a URL, or
a copy of the user's: ``redis_clients``) the script's commands (``WIRED``: the call,
and loading the library or script after the server lost it) are packed once, as RESP,
and sent with none of that layer in between: the same settings (TLS, AUTH, health
checks) and errors (the server's error replies as they are; a connection whose read or
write failed in any other way is closed, as redis-py's command layer closes it).
redis-py's retries are off on those clients (``redis_clients.bounded``), so nothing of
that layer is lost; a client of the user's (a subclass, a single connection, a pool we
do not know) and a Cluster's go through redis-py as they are.

They go on one connection the ``Wire`` keeps beside the pool while no other call uses
it, and on one of the pool's while one does (calls at once). That connection is made
as the pool makes its own, but is never the pool's: nothing else waits for it, and the
pool's other users (the backend's reads, a client's own commands) keep every one of
the pool's. At most as many script calls are in flight as the pool has connections
(``batching``), and one of them is on the Wire's, so they still use at most that many;
the pool's other users (reads for operators, ``backend.client``'s own commands) may
meanwhile open the pool's last one: one connection more than before, at most. Where the
pool does more than hand out connections it stays the only way: a Sentinel's (it
follows the master through a failover), RESP3's (maintenance notifications, client-side
caching; the backend's own clients speak RESP2 unless told otherwise:
``redis_clients.bounded``) and a credential provider's (re-authentication).
"""

from __future__ import annotations

import inspect
import os
import select
import threading
from collections.abc import Awaitable, Iterable, Sequence
from typing import Any, cast

import redis
import redis.asyncio
from redis.exceptions import ResponseError

# The script's commands (backend steps of redis_script) that go this way, by name: the
# call, and what loads the script again; everything else is rare.
WIRED = frozenset({"fcall", "evalsha", "pipeline", "function_load", "script_load", "config_get"})

# redis-py < 5.3 names the command when it hands out a connection; later versions warn
# when anything is given.
_NAMED = (
    inspect.signature(redis.ConnectionPool.get_connection).parameters["command_name"].default
    is inspect.Parameter.empty
)

_PLAIN_POOLS = (
    redis.ConnectionPool,
    redis.BlockingConnectionPool,
    redis.asyncio.ConnectionPool,
    redis.asyncio.BlockingConnectionPool,
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


def _raw(name: str, args: Sequence[Any]) -> tuple[str, Sequence[Any]]:
    """The command a backend step names (a redis-py method's name) as sent."""
    if name == "function_load":  # (code, replace=False)
        replace = ("REPLACE",) if len(args) > 1 and args[1] else ()
        return "FUNCTION", ("LOAD", *replace, args[0])
    if name == "script_load":
        return "SCRIPT", ("LOAD", *args)
    if name == "config_get":
        return "CONFIG", ("GET", *args)
    return name, args


def _requests(name: str, args: Sequence[Any]) -> tuple[list[bytes], list[str]]:
    """What to send for a step, and the names of the replies it gets."""
    if name == "pipeline":
        return [pack(*_raw(step, more)) for step, more in args], [step for step, _ in args]
    return [pack(*_raw(name, args))], [name]


def _shaped(name: str, reply: Any) -> Any:
    """A reply in the shape redis-py's method of that name gives it (CONFIG GET: a
    mapping), its text as it came (bytes, unless the client decodes responses)."""
    if name == "config_get" and type(reply) is list:
        return dict(zip(reply[::2], reply[1::2], strict=False))
    return reply


def _own_allowed(pool: Any) -> bool:
    """Whether a connection of the pool's kind may live beside it (see the module)."""
    kwargs = pool.connection_kwargs
    return (
        type(pool) in _PLAIN_POOLS
        and getattr(pool, "cache", None) is None
        and kwargs.get("protocol") in (2, "2")  # (None: redis-py 8's default is RESP3)
        and "maint_notifications_pool_handler" not in kwargs
        and kwargs.get("credential_provider") is None
    )


class Wire:
    """The script's commands of one client that :func:`wired` allows: ``call`` for a
    ``redis.Redis``, ``acall`` for a ``redis.asyncio.Redis``."""

    def __init__(self, client: Any) -> None:
        self.pool = client.connection_pool
        self._own = _own_allowed(self.pool)
        self._spare: list[Any] = []  # the Wire's connection while no call uses it
        self._made = False
        self._closed = False
        self._pid = os.getpid()
        self._lock = threading.Lock()  # (for making the connection: never across an await)

    def _take(self) -> Any:
        """The Wire's connection, made at the first call; None while a call uses it
        (the caller then takes one of the pool's)."""
        if self._pid != os.getpid():
            # A forked child: the parent's socket is not this process's to send on (their
            # replies would cross). The child makes its own.
            self._pid, self._spare, self._made = os.getpid(), [], False
            self._lock = threading.Lock()
        try:
            return self._spare.pop()  # (atomic: one thread gets it)
        except IndexError:
            pass
        if self._made or not self._own or self._closed:
            return None  # (the common case when calls overlap: no lock taken for it)
        with self._lock:
            if self._made or self._closed:  # (another thread made it meanwhile)
                return None
            self._made = True
        return self.pool.connection_class(**self.pool.connection_kwargs)

    def call(self, name: str, args: Sequence[Any]) -> Any:
        """The step ``name`` (a redis-py method's name, or a "pipeline" of them): its
        reply, the error it is, or for a pipeline a list of replies and errors."""
        packed, names = _requests(name, args)
        conn = self._take()
        pooled = conn is None
        if pooled:
            conn = self.pool.get_connection(names[0]) if _NAMED else self.pool.get_connection()
        try:
            if not pooled and conn._sock is not None and _unread(conn._sock):
                conn.disconnect()  # the server closed it meanwhile: sending opens it again
            conn.send_packed_command(packed)
            if name == "pipeline":  # (an error reply is one of its values)
                reply: Any = [_shaped(step, _read(conn)) for step in names]
            else:
                reply = _shaped(name, conn.read_response())
        except ResponseError:
            raise  # the server's error reply: the connection is in step
        except BaseException:
            # Anything else may leave a reply on its way (a Sentinel's connection keeps
            # itself open on a timed-out read; redis-py's command layer closes it): the
            # next command on it would read this one's reply.
            conn.disconnect()
            raise
        finally:
            if pooled:
                self.pool.release(conn)
            else:
                for closed in self._give(conn):
                    closed.disconnect()
        return reply

    async def acall(self, name: str, args: Sequence[Any]) -> Any:
        """As :meth:`call`, for a ``redis.asyncio`` client."""
        packed, names = _requests(name, args)
        conn = self._take()
        pooled = conn is None
        if pooled:
            get = self.pool.get_connection(names[0]) if _NAMED else self.pool.get_connection()
            conn = await cast(Awaitable[Any], get)
        try:
            reader = None if pooled else getattr(conn, "_reader", None)
            if reader is not None and reader.at_eof():
                await conn.disconnect(nowait=True)  # the server closed it meanwhile
            await conn.send_packed_command(packed)
            if name == "pipeline":
                reply: Any = [_shaped(step, await _aread(conn)) for step in names]
            else:
                reply = _shaped(name, await conn.read_response())
        except ResponseError:
            raise
        except BaseException:
            await conn.disconnect(nowait=True)  # (as call(): never a reply left on its way)
            raise
        finally:
            if pooled:
                await cast(Awaitable[None], self.pool.release(conn))
            else:
                for closed in self._give(conn):
                    await closed.disconnect(nowait=True)
        return reply

    def _give(self, conn: Any) -> list[Any]:
        """Keep ``conn`` for the next call; what is to be disconnected if the Wire was
        closed meanwhile (close() may run between any two lines here: whichever sees the
        connection in the list after the other's step disconnects it)."""
        self._spare.append(conn)
        return self.close() if self._closed else []

    def close(self) -> list[Any]:
        """Make no more connections; the one not in use, to be disconnected by the
        caller (a call in flight disconnects its own when it ends)."""
        self._closed = True
        spare, self._spare = self._spare, []
        return spare


def _read(conn: Any) -> Any:
    """The next reply on a connection, or the error reply it is, as a value."""
    try:
        return conn.read_response()
    except ResponseError as error:
        # A value now: without its traceback, whose frames (the caller's among them,
        # still running) would hold the value in a cycle.
        return error.with_traceback(None)


async def _aread(conn: Any) -> Any:
    """As :func:`_read`, on an asyncio connection."""
    try:
        return await conn.read_response()
    except ResponseError as error:
        return error.with_traceback(None)


if hasattr(select, "poll"):

    def _unread(sock: Any) -> bool:
        """Whether a socket whose every reply was read reads as ready: the server closed
        it (EOF), or sent what no command asked for. poll(), unlike select(), takes any
        file number."""
        probe = select.poll()
        probe.register(sock, select.POLLIN)
        return bool(probe.poll(0))

else:  # (Windows)

    def _unread(sock: Any) -> bool:
        return bool(select.select([sock], [], [], 0)[0])
