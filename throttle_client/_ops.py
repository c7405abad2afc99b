"""What a limiter asks of a backend, and what comes back.

Everything here is in whole microseconds and already carries the *hashed* store
key: a backend never sees an access token. A backend has one method,
``execute(op)``; the Redis script, the memory store and the SQLite store all
answer the same four operations with exactly the semantics of DESIGN §2.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


@dataclass(frozen=True)
class Policy:
    """The rates as ``(limit, period_us)`` pairs and the minimum gap between calls."""

    limits: tuple[tuple[int, int], ...]
    min_interval_us: int

    @property
    def horizon_us(self) -> int:
        """How long an entry can still matter after its slot."""
        return max(max(period for _, period in self.limits), self.min_interval_us)

    @property
    def longest_period_us(self) -> int:
        return max(period for _, period in self.limits)


class Op(Generic[T_co]):
    """An operation on one key's log whose answer is a ``T_co``."""

    __slots__ = ()
    key: str  # the hashed store key
    now_us: int | None  # the time to run at (tests inject one); None: the store's clock

    def time_us(self, clock: Callable[[], float]) -> int:
        """When the operation runs: the time it carries, else ``clock`` (host seconds)."""
        return self.now_us if self.now_us is not None else int(clock() * 1_000_000)


@dataclass(frozen=True)
class Verdict:
    """The answer to :class:`Acquire`."""

    allowed: bool
    now_us: int
    slot_us: int
    pause_until_us: int
    remaining: tuple[int, ...]


@dataclass(frozen=True)
class Snapshot:
    """The answer to :class:`Inspect`: the log seen at ``now_us``, unchanged."""

    now_us: int
    next_slot_us: int
    pause_until_us: int
    booked: int  # units in slots after now
    used: tuple[int, ...]  # per rate, units in slots in the window (now - period, now]
    ready_at_us: tuple[int, ...]  # per rate, when a call of cost 1 fits it (>= now)


@dataclass(frozen=True)
class Acquire(Op[Verdict]):
    """Find the earliest slot for ``cost``; book it if it is at most ``max_wait_us`` away.

    ``max_wait_us`` of 0 is try_acquire, -1 waits for any slot. ``call_id`` makes the
    call idempotent: a call whose id is already in the log gets its booked slot back.
    ``lead_us``: no slot earlier than ``now + lead_us`` (a call whose answers come back
    slowly asks for a slot its answer can reach in time).
    """

    key: str
    policy: Policy
    cost: int
    max_wait_us: int
    call_id: str
    now_us: int | None = None
    lead_us: int = 0


@dataclass(frozen=True)
class Inspect(Op[Snapshot]):
    key: str
    policy: Policy
    now_us: int | None = None


@dataclass(frozen=True)
class Pause(Op[int]):
    """No slot before ``now + duration_us``; answers the pause in force (µs since the epoch)."""

    key: str
    policy: Policy
    duration_us: int
    now_us: int | None = None


@dataclass(frozen=True)
class Reset(Op[None]):
    key: str
    now_us: int | None = None


class Backend(Protocol):
    """A store that executes operations for a :class:`~throttle_client.Limiter`."""

    def execute(self, op: Op[T]) -> T: ...


class AsyncBackend(Protocol):
    """A store that executes operations for an :class:`~throttle_client.AsyncLimiter`."""

    async def execute(self, op: Op[T]) -> T: ...


class InlineAsync:
    """An AsyncBackend over a store whose ``execute`` never blocks (memory)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    async def execute(self, op: Op[T]) -> T:
        return self.backend.execute(op)

    def __repr__(self) -> str:
        return f"InlineAsync({self.backend!r})"


class ThreadedAsync:
    """An AsyncBackend over a store whose ``execute`` may block (SQLite waiting on a lock).

    Writes run on one thread of their own, in the order they were asked (they would
    take turns at the store's write lock anyway), and reads on two others, so a read
    (the look for a pause before a request goes) never queues behind a thousand
    tasks' bookings, as it would in asyncio's shared default pool.
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._pools: tuple[int, ThreadPoolExecutor, ThreadPoolExecutor] | None = None
        self._lock = threading.Lock()

    def _pool(self, op: Op[Any]) -> ThreadPoolExecutor:
        with self._lock:
            # Threads do not cross a fork: a child makes its own pools.
            if self._pools is None or self._pools[0] != os.getpid():
                writer = ThreadPoolExecutor(1, thread_name_prefix="throttle-client-write")
                readers = ThreadPoolExecutor(2, thread_name_prefix="throttle-client-read")
                self._pools = (os.getpid(), writer, readers)
            return self._pools[2] if isinstance(op, Inspect) else self._pools[1]

    async def execute(self, op: Op[T]) -> T:
        pool = self._pool(op)
        run = functools.partial(contextvars.copy_context().run, self.backend.execute, op)
        return await asyncio.get_running_loop().run_in_executor(pool, run)

    def shutdown(self) -> None:
        """Let this process's threads go (a later operation starts new ones)."""
        with self._lock:
            pools, self._pools = self._pools, None
        if pools is not None and pools[0] == os.getpid():
            pools[1].shutdown(wait=False)
            pools[2].shutdown(wait=False)

    def __repr__(self) -> str:
        return f"ThreadedAsync({self.backend!r})"
