"""The backend contract: what a limiter asks of a store, and what comes back.

A store runs every operation of :mod:`.ops` in one atomic step and replies with
:mod:`.answers`: those of the plain decision (:class:`Acquire`, :class:`Inspect`,
:class:`Pause`, :class:`Reset`), then those of the features it keeps (``FEATURES``):
:class:`AcquireAll` (one call charged to several keys), :class:`AcquireAny` (the
earliest slot among a pool's keys), :class:`Release` and :class:`Renew` (leases),
:class:`Learn` (learned limits), :class:`ReadHistory` (usage history) and
:class:`Fingerprint` (a namespace's record of its key secret). A blocking store
subclasses :class:`Backend` (``execute``/``close``), an asyncio one
:class:`AsyncBackend` (``aexecute``/``aclose``): the two worlds have distinct
method names, so a limiter tells them apart by type, never by inspecting methods.
:class:`InlineAsync` and :class:`ThreadedAsync` make a blocking store an asyncio one.

The vocabulary of the contract (operations, answers, quotas) lives in modules of its
own and is named here too, where the limiter and its users import it from.
"""

from __future__ import annotations

import abc
import asyncio
import contextvars
import functools
import inspect
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from .._errors import ConfigurationError
from .answers import Snapshot, Verdict
from .doorbell import Doorbell
from .ops import (
    Acquire,
    AcquireAll,
    AcquireAny,
    Charge,
    Choice,
    Fingerprint,
    Inspect,
    Learn,
    Op,
    Pause,
    ReadHistory,
    Release,
    Renew,
    Reset,
    StoreCard,
)
from .pushback import Pushback
from .quota import Buckets, Period, Quota, Windows

__all__ = [
    "FEATURES",
    "Acquire",
    "AcquireAll",
    "AcquireAny",
    "AsyncBackend",
    "Backend",
    "Buckets",
    "Charge",
    "Choice",
    "Fingerprint",
    "InlineAsync",
    "Inspect",
    "Learn",
    "Op",
    "Pause",
    "Period",
    "Pushback",
    "Quota",
    "ReadHistory",
    "Release",
    "Renew",
    "Reset",
    "Snapshot",
    "StoreCard",
    "ThreadedAsync",
    "Verdict",
    "Windows",
    "host_clock",
]

T = TypeVar("T")
B = TypeVar("B", bound="Backend")
A = TypeVar("A", bound="AsyncBackend")


def host_clock(clock: Callable[[], float] | None, backend: str) -> Callable[[], float]:
    """The clock a store that has none of its own reads: the host's. ``clock`` is the
    deprecated way to set another; a limiter's ``clock`` now reaches every store."""
    if clock is None:
        return time.time
    warnings.warn(
        f"{backend}(clock=...) is deprecated: give the clock to the Limiter, which "
        "passes its time to the store with every operation",
        DeprecationWarning,
        stacklevel=3,
    )
    return clock


# What ping() asks: a read of a key no limiter uses (no namespace holds braces but ours,
# and ours are followed by a colon-free hash), under a quota that cannot be refused.
_PING = Inspect(
    key="throttle-client:{ping}", quota=Quota(limits=((1, 1_000_000),), min_interval_us=0)
)


def _checked(store_key: str) -> str:
    if not isinstance(store_key, str) or not store_key:
        raise ConfigurationError(f"a store key must be a non-empty string, not {store_key!r}")
    return store_key


# What a store may do beyond the plain decision (Acquire, Inspect, Pause, Reset), each a
# feature a limiter opts into: "leases" (max_concurrent: Renew, Release, a lease id with
# AcquireAll), "stacked" (also=: AcquireAll), "pool" (acquire_any: AcquireAny), "calendar"
# and "bounded" (rates of those kinds in a Quota), "learned" (Learn), "history"
# (ReadHistory, Acquire.history), "cards" (Acquire.cards and the like, cards(),
# all_cards()), "records" (fingerprint()). A store
# declares those it keeps in ``features``: a limiter that needs one it lacks is refused
# when it is made, naming it, and one it could do without (cards, records, learned) is
# never sent.
FEATURES = frozenset(
    {
        "leases",
        "stacked",
        "pool",
        "calendar",
        "bounded",
        "learned",
        "history",
        "cards",
        "records",
    }
)


class Backend(abc.ABC):
    """A blocking store for a :class:`~throttle_client.Limiter`.

    A subclass answers every operation in ``execute``, atomically for every worker
    that shares the store. It is a context manager: leaving the block closes it.
    ``features``: what it keeps beyond the plain decision (``FEATURES``, all by default).
    """

    features: frozenset[str] = FEATURES

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if inspect.iscoroutinefunction(cls.__dict__.get("execute")):
            raise TypeError(
                f"{cls.__name__}.execute is a coroutine function: an asyncio store "
                "subclasses AsyncBackend and defines aexecute"
            )

    @abc.abstractmethod
    def execute(self, op: Op[T]) -> T:
        """Run ``op`` in one atomic step and answer it."""

    def forget(self, store_key: str) -> None:
        """Forget everything about one key, named by its store key (``Limiter.store_key``,
        :func:`throttle_client.store_key`), whatever rates it was used with."""
        self.execute(Reset(key=_checked(store_key)))

    def cards(self, store_keys: Sequence[str]) -> dict[str, str]:
        """The cards kept beside these keys: store key -> card (JSON), for the keys that
        have one. A key's card is the record its limiters write into the store beside it
        (its label, their namespace and rules: :class:`~throttle_client.Card`), so that an
        operator can see what a hashed key is and how it is limited."""
        raise NotImplementedError(f"{type(self).__name__} keeps no cards of its keys")

    def all_cards(self, namespace: str | None = None) -> Iterator[tuple[str, str]]:
        """Every key's card in the store (store key, card; see :meth:`cards`), of
        ``namespace`` or of any, read in steps of bounded cost, in no order; a key
        written meanwhile may be missed or given twice."""
        raise NotImplementedError(f"{type(self).__name__} keeps no cards of its keys")

    def pushback(self, store_keys: Sequence[str]) -> dict[str, Pushback]:
        """The pushback of these keys (:class:`Pushback`), for those that have any in
        force. A key's pushback is what the upstream recently told the throttled clients
        about it: the reason for a pause one of them set (the header, or a backoff) and
        the requests it refused (429) in the last minute."""
        raise NotImplementedError(f"{type(self).__name__} keeps no pushback of its keys")

    def ping(self) -> None:
        """Raise BackendUnavailable or BackendError if the store cannot be used; changes
        nothing in it."""
        self.execute(_PING)

    def fingerprint(self, namespace: str, value: str, keep: bool = True) -> str | None:
        """Keep ``value``, the fingerprint of a limiter's key secret, as ``namespace``'s
        record unless it holds one (:class:`Fingerprint`); answers the one it holds (with
        ``keep`` False, only answers: a read writes nothing). None: this store keeps no
        such record, and no limiter can learn that its workers hash with different
        secrets."""
        return None

    @functools.cached_property
    def doorbell(self) -> Doorbell:
        """The doorbell: how this process's calls waiting for room under a concurrency
        cap (``max_concurrent``) hear, without polling, that the store granted them a
        lease; the store rings it with the granted lease's id. A store that never rings
        it still works: its waiters look again on their own, later."""
        return Doorbell()

    def check_together(self, store_keys: list[str]) -> None:  # noqa: B027 (most fit all)
        """Raise ConfigurationError if one atomic step cannot hold these keys (a Redis
        Cluster: keys in different hash slots). Every key fits by default."""

    def to_async(self) -> AsyncBackend:
        """The same store for an :class:`~throttle_client.AsyncLimiter`: by default each
        operation runs in a worker thread (:class:`ThreadedAsync`), as it may block."""
        return ThreadedAsync(self)

    def close(self) -> None:  # noqa: B027 (a store with nothing to let go keeps this one)
        """Let go of this process's connections or files; a later operation may open
        new ones."""

    def __enter__(self: B) -> B:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncBackend(abc.ABC):
    """An asyncio store for an :class:`~throttle_client.AsyncLimiter`.

    A subclass answers every operation in ``aexecute``; ``async with`` closes it.
    ``features``: as :attr:`Backend.features`.
    """

    features: frozenset[str] = FEATURES

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        aexecute = cls.__dict__.get("aexecute")
        if aexecute is not None and not inspect.iscoroutinefunction(aexecute):
            raise TypeError(
                f"{cls.__name__}.aexecute must be a coroutine function (async def); a "
                "blocking store subclasses Backend and defines execute"
            )

    @abc.abstractmethod
    async def aexecute(self, op: Op[T]) -> T:
        """Run ``op`` in one atomic step and answer it."""

    async def aforget(self, store_key: str) -> None:
        """As :meth:`Backend.forget`."""
        await self.aexecute(Reset(key=_checked(store_key)))

    async def aping(self) -> None:
        """As :meth:`Backend.ping`."""
        await self.aexecute(_PING)

    async def afingerprint(self, namespace: str, value: str, keep: bool = True) -> str | None:
        """As :meth:`Backend.fingerprint`."""
        return None

    @functools.cached_property
    def doorbell(self) -> Doorbell:
        """As :attr:`Backend.doorbell`."""
        return Doorbell()

    def check_together(self, store_keys: list[str]) -> None:  # noqa: B027
        """As :meth:`Backend.check_together`."""

    async def aclose(self) -> None:  # noqa: B027
        """Let go of this process's connections."""

    async def __aenter__(self: A) -> A:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class InlineAsync(AsyncBackend):
    """An AsyncBackend over a store whose ``execute`` never blocks (memory)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.features = backend.features

    @property
    def doorbell(self) -> Doorbell:
        return self.backend.doorbell

    async def aexecute(self, op: Op[T]) -> T:
        return self.backend.execute(op)

    async def afingerprint(self, namespace: str, value: str, keep: bool = True) -> str | None:
        return self.backend.fingerprint(namespace, value, keep)

    async def aclose(self) -> None:
        self.backend.close()

    def __repr__(self) -> str:
        return f"InlineAsync({self.backend!r})"


class ThreadedAsync(AsyncBackend):
    """An AsyncBackend over a store whose ``execute`` may block (SQLite waiting on a lock).

    Writes run on one thread of their own, in the order they were asked (they would
    take turns at the store's write lock anyway), and reads on two others, so a read
    (the look for a pause before a request goes) never queues behind a thousand
    tasks' bookings, as it would in asyncio's shared default pool.
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.features = backend.features
        self._pools: tuple[int, ThreadPoolExecutor, ThreadPoolExecutor] | None = None
        self._lock = threading.Lock()

    @property
    def doorbell(self) -> Doorbell:
        return self.backend.doorbell

    def _pool(self, read: bool) -> ThreadPoolExecutor:
        with self._lock:
            # Threads do not cross a fork: a child makes its own pools.
            if self._pools is None or self._pools[0] != os.getpid():
                writer = ThreadPoolExecutor(1, thread_name_prefix="throttle-client-write")
                readers = ThreadPoolExecutor(2, thread_name_prefix="throttle-client-read")
                self._pools = (os.getpid(), writer, readers)
            return self._pools[2] if read else self._pools[1]

    async def aexecute(self, op: Op[T]) -> T:
        pool = self._pool(isinstance(op, Inspect))
        run = functools.partial(contextvars.copy_context().run, self.backend.execute, op)
        return await asyncio.get_running_loop().run_in_executor(pool, run)

    async def afingerprint(self, namespace: str, value: str, keep: bool = True) -> str | None:
        record = functools.partial(self.backend.fingerprint, namespace, value, keep)
        return await asyncio.get_running_loop().run_in_executor(self._pool(False), record)

    def shutdown(self) -> None:
        """Let this process's threads go (a later operation starts new ones)."""
        with self._lock:
            pools, self._pools = self._pools, None
        if pools is not None and pools[0] == os.getpid():
            pools[1].shutdown(wait=False)
            pools[2].shutdown(wait=False)

    async def aclose(self) -> None:
        """Stop the threads and close the store they ran on."""
        self.shutdown()
        self.backend.close()

    def __repr__(self) -> str:
        return f"ThreadedAsync({self.backend!r})"
