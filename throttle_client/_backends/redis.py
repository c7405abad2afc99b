"""The Redis store: one Lua script (package data), over redis-py's own clients.

Sync and asyncio backends share everything but the call itself: the script and the
flow that runs it (``redis_script``), how an operation becomes KEYS/ARGV
(``redis_codec``), how the reply becomes a result (``redis_answers``), how driver errors
become ours (``redis_errors``), the bounded connections the script runs over
(``redis_clients``), and the queue that batches the operations which come while those
are busy (``batching``). Each call is one FCALL (EVALSHA on Redis 6.2) carrying one
operation or a batch of them; when the server has lost the script it is loaded again
and the call repeated, so a ``SCRIPT FLUSH``, a restart or a failover is invisible to
callers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import re
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar, cast

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
from redis.crc import key_slot

from .._cards import Disagreements
from .._errors import ConfigurationError
from .._flow import arun, run
from .base import AsyncBackend, Backend
from .batching import Batcher, Send, Wait
from .ops import (
    RECORD_TTL_US,
    Acquire,
    AcquireAll,
    Fingerprint,
    Op,
    namespace_prefix,
    namespace_record,
)
from .pushback import Pushback, PushbackRecord, in_force
from .redis_clients import (
    CONNECTIONS,
    async_copy,
    async_from_url,
    check_url,
    pool_size,
    sync_copy,
    sync_from_url,
)
from .redis_codec import as_text, card_key, pushback_key, redis_keys
from .redis_doorbell import RedisDoorbell, subscriber_clients
from .redis_errors import DRIVER_ERRORS, translate
from .redis_script import Calls, Command, pipelined, script_flow
from .redis_wire import WIRED, Wire, wired
from .repair import RepairNotice

T = TypeVar("T")


CARDS_STEP = 500  # keys a read of every card (SCAN's COUNT) asks for at once


def _whole(*texts: str) -> bool:
    """Whether each text is a whole number as the script writes one (a damaged field,
    or another version's, is left out)."""
    return all(text.isdigit() for text in texts)


def _one_slot(store_keys: list[str]) -> None:
    """On a Cluster one script reaches the keys of one hash slot only: refuse the others
    here, with what to do, rather than let the server answer CROSSSLOT."""
    slots = {key_slot(redis_keys(key)[0]) for key in store_keys}
    if len(slots) > 1:
        shown = ", ".join(store_keys[:3]) + (
            f", ... ({len(store_keys)} keys)" if len(store_keys) > 3 else ""
        )
        raise ConfigurationError(
            f"on a Redis Cluster the keys of one call must share a hash slot, and the store "
            f"keys {shown} do not: give every limiter of the call the same tag= (a "
            "function of its key that names what they share, e.g. the account id; for a "
            "pool, any one value)"
        )


def _script_sender(calls: Calls, repairs: RepairNotice, disagree: Disagreements) -> Send[Command]:
    """What sends a backend's queued operations in one script call. It holds the
    backend's parts, not the backend: a backend its user drops without closing is then
    freed at once, its sockets closed by redis-py, not left for the collector (which may
    reach a socket before its connection and warn of it)."""
    return lambda ops, queued: script_flow(ops, queued, calls, repairs, disagree)


def _loosen(error: BaseException) -> None:
    """Clear the locals of the driver's frames ``error`` (and the errors it was raised
    from) passed through: they have all returned. redis-py raises an error reply from a
    frame that holds it as a local, and an OSError from one that keeps it to raise
    later: a cycle, through the traceback, with every frame up to the caller's, which
    keeps the backend alive, its sockets open, until the collector runs."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        traceback.clear_frames(cause.__traceback__)
        cause = cause.__cause__ or cause.__context__


def _subscribers_of(backend: weakref.ref[Any]) -> Callable[[], list[redis.Redis]]:
    """The clients a backend's doorbell subscribes with, reached weakly: the doorbell's
    thread must not keep a dropped backend alive (none, once it is gone)."""

    def clients() -> list[redis.Redis]:
        live = backend()
        return [] if live is None else cast(list[redis.Redis], live._subscribers())

    return clients


def _batcher(
    runner: Any,
    owned: bool,
    send: Send[Command],
    new_waker: Callable[[], Any],
    wake: Callable[[Any], None],
    *,
    cluster: bool,
    gone: Callable[[Any], bool] = lambda waker: False,
) -> Batcher[Command]:
    """A backend's queue: as many calls in flight as it has connections (CONNECTIONS, or
    fewer in a client of the user's); on a Cluster only one hash slot's operations share
    a call (a script reaches one slot), and a place opens no connection ahead: a call of
    no keys would go to any node, and each node has a pool of its own."""
    size = CONNECTIONS if owned or runner is None else min(CONNECTIONS, pool_size(runner))
    if cluster:
        return Batcher(size, send, new_waker, wake, _slot_of, gone)
    return Batcher(size, send, new_waker, wake, gone=gone, opens=True)


def _slot_of(op: Op[Any]) -> int:
    return key_slot(redis_keys(op.key)[0])


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():  # (cancelled: its task leaves the queue, or passes its place on)
        future.set_result(None)


def _copied(client: redis.asyncio.Redis) -> redis.asyncio.Redis:
    """``async_copy`` of a client it did copy before."""
    copy = async_copy(client)
    assert copy is not None
    return copy


SyncClient = redis.Redis | redis.cluster.RedisCluster
AsyncClient = redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster


def looking(op: Op[T]) -> Op[T]:
    """``op`` as a client of the user's runs it: that client may send a command again on
    its own (its retries are its own), so every acquire looks for its id as a retry does,
    lest a resent one book twice. (A client of ours never resends: the limiter does.)"""
    if isinstance(op, (Acquire, AcquireAll)) and not op.retry:
        return dataclasses.replace(op, retry=True)  # type: ignore[return-value]
    return op


class RedisBackend(Backend):
    """Limits shared through Redis: standalone, Sentinel (a master client) or Cluster.

    Give it a redis-py client, or a URL (``redis://``, ``rediss://``, ``unix://``);
    ``cluster=True`` makes a URL into a ``RedisCluster``. The script runs over
    connections of the backend's own, with bounded timeouts and no hidden retries
    (see ``redis_clients``); a standalone or Sentinel client you pass is copied for
    that, never changed, and stays yours to close.

    >>> backend = RedisBackend(redis.Redis.from_url("redis://localhost:6379/0"))
    """

    def __init__(self, client: SyncClient | str, *, cluster: bool = False) -> None:
        self._lock = threading.Lock()
        self._url: str | None = None
        self._runner: SyncClient | None = None  # what runs the script
        self._owned = True  # whether the runner is ours to close
        self.client: SyncClient | None = None  # the client given, or built from the URL
        if isinstance(client, str):
            check_url(client)  # a malformed URL fails here, not at the first call
            if cluster:
                # A RedisCluster connects when it is built: build it at the first call
                # instead, so a Cluster that is down at start-up is an outage like any
                # other, handled by the limiter's on_unavailable.
                self._url = client
            else:
                self.client = self._runner = sync_from_url(client, cluster=False)
        elif isinstance(client, (redis.asyncio.Redis, redis.asyncio.cluster.RedisCluster)):
            raise TypeError("this is an asyncio Redis client: use AsyncRedisBackend with it")
        elif isinstance(client, redis.Redis):
            self.client = client
            self._runner = sync_copy(client)
            if self._runner is None:
                self._runner, self._owned = client, False
        elif isinstance(client, redis.cluster.RedisCluster):
            self.client = self._runner = client
            self._owned = False
        else:
            raise TypeError(f"RedisBackend needs a redis-py client or a URL, not {client!r}")
        # The script's commands' own way to the store (None: through redis-py).
        self._wire = Wire(self._runner) if wired(self._runner, self._owned) else None
        self._repairs = RepairNotice()
        self._disagree = Disagreements()
        self._calls = Calls()
        self._batcher = _batcher(
            self._runner,
            self._owned,
            _script_sender(self._calls, self._repairs, self._disagree),
            threading.Event,
            threading.Event.set,
            cluster=self._url is not None or isinstance(client, redis.cluster.RedisCluster),
        )

    def _connect(self) -> SyncClient:
        with self._lock:
            if self._runner is None:
                assert self._url is not None
                self.client = self._runner = sync_from_url(self._url, cluster=True)
            return self._runner

    def execute(self, op: Op[T]) -> T:
        if not self._owned:
            op = looking(op)
        return run(self._batcher.flow(op), self._perform)

    def _perform(self, step: Command | Wait) -> Any:
        if isinstance(step, Wait):
            return step.waker.wait()
        try:
            # Connecting a Cluster URL's client may fail too: the flow translates it.
            runner = self._runner or self._connect()
            if self._wire is not None and step.name in WIRED:
                return self._wire.call(step.name, step.args)
            if step.name == "pipeline":
                return pipelined(runner, step.args).execute(raise_on_error=False)
            return getattr(runner, step.name)(*step.args)
        except redis.RedisError as error:
            _loosen(error)
            raise

    @functools.cached_property
    def doorbell(self) -> RedisDoorbell:
        return RedisDoorbell(_subscribers_of(weakref.ref(self)))

    def _subscribers(self) -> list[redis.Redis]:
        return subscriber_clients(self._runner or self._connect())

    def close(self) -> None:
        """Close the connections the backend opened (a client you passed stays open)."""
        if "doorbell" in self.__dict__:
            self.doorbell.close()
        if self._wire is not None:
            for conn in self._wire.close():
                conn.disconnect()
        runner = self._runner
        if runner is not None and self._owned:
            runner.close()
            if isinstance(runner, redis.Redis):
                runner.connection_pool.disconnect()  # a pool we gave it is not closed with it

    def _each(self, command: str, names: list[bytes]) -> list[Any]:
        """``command`` on each of ``names``, pipelined (a Cluster's pipeline sends each
        to its node): what an operator's read of many keys costs, one round trip."""
        try:
            pipe = (self._runner or self._connect()).pipeline(transaction=False)
            for name in names:
                getattr(pipe, command)(name)
            return list(pipe.execute())
        except DRIVER_ERRORS as exc:
            raise translate(exc) from exc

    def fingerprint(self, namespace: str, value: str, keep: bool = True) -> str | None:
        """As :meth:`Backend.fingerprint`."""
        op = Fingerprint(namespace_record(namespace), value, RECORD_TTL_US if keep else 0)
        return run(self._batcher.flow(op), self._perform)

    def cards(self, store_keys: Sequence[str]) -> dict[str, str]:
        keys = list(store_keys)
        found = self._each("get", [card_key(key) for key in keys])
        return {key: as_text(card) for key, card in zip(keys, found, strict=True) if card}

    def all_cards(self, namespace: str | None = None) -> Iterator[tuple[str, str]]:
        """As :meth:`Backend.all_cards`: SCAN (never KEYS), CARDS_STEP keys per step, on
        every primary of a Cluster, matching the namespace's keys only."""
        prefix = re.sub(r"([*?\[\]\\])", r"\\\1", namespace_prefix(namespace))
        match = f"tc:{prefix}*:card".encode()
        try:
            runner = self._runner or self._connect()
            names: list[bytes] = []
            for name in runner.scan_iter(match=match, count=CARDS_STEP):
                names.append(name.encode() if isinstance(name, str) else name)
                if len(names) == CARDS_STEP:
                    yield from self._read_cards(names)
                    names = []
            yield from self._read_cards(names)
        except DRIVER_ERRORS as exc:
            raise translate(exc) from exc

    def pushback(self, store_keys: Sequence[str]) -> dict[str, Pushback]:
        keys = list(store_keys)
        found = self._each("hgetall", [pushback_key(key) for key in keys])
        now, records = int(time.time() * 1_000_000), list[tuple[str, PushbackRecord | None]]()
        for key, fields in zip(keys, found, strict=True):
            record = {as_text(name): as_text(value) for name, value in fields.items()}
            steps = {int(n[2:]): int(v) for n, v in record.items() if _whole(n[2:], v)}
            until = int(record["until"]) if _whole(record.get("until", "")) else 0
            records.append((key, (record.get("reason", ""), until, steps)))
        return in_force(records, now)

    def _read_cards(self, names: list[bytes]) -> Iterator[tuple[str, str]]:
        keys = [name[3:-5].decode() for name in names]  # (tc:KEY:card)
        yield from self.cards(keys).items()

    def to_async(self) -> AsyncBackend:
        raise TypeError("RedisBackend wraps a sync client: AsyncLimiter needs AsyncRedisBackend")

    def check_together(self, store_keys: list[str]) -> None:
        if self._url is not None or isinstance(self.client, redis.cluster.RedisCluster):
            _one_slot(store_keys)

    def __repr__(self) -> str:
        shown = self.client if self.client is not None else "Cluster URL, connects at first use"
        return f"RedisBackend({shown!r})"


class AsyncRedisBackend(AsyncBackend):
    """The asyncio twin of :class:`RedisBackend`, over ``redis.asyncio`` clients.

    >>> backend = AsyncRedisBackend(redis.asyncio.Redis.from_url("redis://localhost"))
    """

    def __init__(self, client: AsyncClient | str, *, cluster: bool = False) -> None:
        self._owned = True
        self._runner: AsyncClient
        # How to open the backend's connections again in another event loop (None: the
        # client is the user's, used as it is).
        self._remake: Callable[[], AsyncClient] | None = None
        if isinstance(client, str):
            check_url(client)
            # An asyncio RedisCluster only connects at its first command.
            self._remake = functools.partial(async_from_url, client, cluster=cluster)
            self._runner = self._remake()
            self.client: AsyncClient = self._runner
        elif isinstance(client, (redis.Redis, redis.cluster.RedisCluster)):
            raise TypeError("this is a sync Redis client: use RedisBackend with it")
        elif isinstance(client, redis.asyncio.Redis):
            self.client = client
            copy = async_copy(client)
            self._runner, self._owned = (client, False) if copy is None else (copy, True)
            if copy is not None:
                self._remake = functools.partial(_copied, client)
        elif isinstance(client, redis.asyncio.cluster.RedisCluster):
            self.client = self._runner = client
            self._owned = False
        else:
            raise TypeError(
                f"AsyncRedisBackend needs a redis.asyncio client or a URL, not {client!r}"
            )
        self._repairs = RepairNotice()
        self._disagree = Disagreements()
        self._calls = Calls()
        self._loop: asyncio.AbstractEventLoop | None = None  # the one its connections are of
        self._wire: Wire | None = None
        self._batcher = self._new_batcher()

    def _new_batcher(self) -> Batcher[Command]:
        """The batcher (and the Wire) of the runner as it is now: a new event loop's."""
        self._wire = Wire(self._runner) if wired(self._runner, self._owned) else None
        return _batcher(
            self._runner,
            self._owned,
            _script_sender(self._calls, self._repairs, self._disagree),
            lambda: asyncio.get_running_loop().create_future(),
            _resolve,
            cluster=isinstance(self._runner, redis.asyncio.cluster.RedisCluster),
            gone=asyncio.Future.cancelled,
        )

    async def aexecute(self, op: Op[T]) -> T:
        if asyncio.get_running_loop() is not self._loop:
            self._bind()
        if not self._owned:
            op = looking(op)
        return await arun(self._batcher.flow(op), self._perform)

    def _bind(self) -> None:
        """Serve the running event loop. redis.asyncio's connections belong to the loop
        that opened them: a backend used again after its loop ended (a second
        ``asyncio.run``, a test's loop) opens its connections anew; one whose loop still
        runs (in another thread) is an error. A client of the user's, used as it is, is
        the user's to open in the loop it serves."""
        loop, old = asyncio.get_running_loop(), self._loop
        if old is not None:
            if not old.is_closed() and old.is_running():
                raise RuntimeError(
                    f"{self!r} serves an event loop that still runs (in another thread): "
                    "an AsyncRedisBackend serves one loop at a time; give each loop its own"
                )
            if self._remake is not None:
                # (The old one's sockets went with its loop.) Built from a URL, the
                # client given is the runner itself.
                old_runner, self._runner = self._runner, self._remake()
                if self.client is old_runner:
                    self.client = self._runner
            self._batcher = self._new_batcher()
        self._loop = loop

    async def _perform(self, step: Command | Wait) -> Any:
        if isinstance(step, Wait):
            return await step.waker
        try:
            if self._wire is not None and step.name in WIRED:
                return await self._wire.acall(step.name, step.args)
            if step.name == "pipeline":
                return await pipelined(self._runner, step.args).execute(raise_on_error=False)
            # (redis-py types the sync and async clients' methods as one, before 8.0)
            method = getattr(self._runner, step.name)
            return await cast(Awaitable[Any], method(*step.args))
        except redis.RedisError as error:
            _loosen(error)
            raise

    async def afingerprint(self, namespace: str, value: str, keep: bool = True) -> str | None:
        """As :meth:`Backend.fingerprint`."""
        op = Fingerprint(namespace_record(namespace), value, RECORD_TTL_US if keep else 0)
        return await self.aexecute(op)

    def check_together(self, store_keys: list[str]) -> None:
        if isinstance(self._runner, redis.asyncio.cluster.RedisCluster):
            _one_slot(store_keys)

    async def execute(self, op: Op[T]) -> T:
        """Deprecated: ``aexecute``, the asyncio stores' name for it."""
        warnings.warn(
            "AsyncRedisBackend.execute is deprecated: use aexecute",
            DeprecationWarning,
            stacklevel=2,
        )
        return await self.aexecute(op)

    @functools.cached_property
    def doorbell(self) -> RedisDoorbell:
        return RedisDoorbell(_subscribers_of(weakref.ref(self)))

    def _subscribers(self) -> list[redis.Redis]:
        return subscriber_clients(self._runner)

    async def aclose(self) -> None:
        """Close the connections the backend opened (a client you passed stays open)."""
        if "doorbell" in self.__dict__:
            self.doorbell.close()
        if self._wire is not None:
            for conn in self._wire.close():
                await conn.disconnect()
        if self._owned:
            # redis-py 5.0.0, the oldest allowed, has close() only; aclose() came in 5.0.1.
            close = getattr(self._runner, "aclose", None) or self._runner.close
            await close()
            if isinstance(self._runner, redis.asyncio.Redis):
                await self._runner.connection_pool.disconnect()

    def __repr__(self) -> str:
        return f"AsyncRedisBackend({self.client!r})"
