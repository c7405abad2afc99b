"""How a waiter for a concurrency cap learns, promptly, that the store granted it a lease.

A call that finds a capped key full is queued *in the store*. When a lease ends, the
store itself hands the freed capacity to the head of the queue, in the same atomic step,
and names the lease it granted. That name reaches the waiter's process through its
store's :class:`Doorbell`, the per-process object a waiter blocks on until the store
rings it with the waiter's lease id: the memory and SQLite stores ring it in
the releasing process, Redis publishes it from the script to the waiter's process
channel (``tc:w:<nonce>``) and a subscriber thread rings it, a SQLite watcher thread
rings it for grants made by other processes. Only the granted waiter wakes: no herd.

A ring is only ever a hint that saves time: the grant is in the store. A waiter also
looks again on its own, rarely (see ``_limiter``), so a lost message (Pub/Sub is
at-most-once) costs time, never a slot.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable

# Bells kept at most: a waiter's bell is made before the call that may queue it (so a
# grant that lands before its wait still rings it) and dropped after; past this many in
# one process the oldest are dropped, and their waiters only look again on their own.
_KEPT = 65536


class Bell:
    """One waiter's bell: wait on it from a thread or a task."""

    __slots__ = ("_event", "_future")

    def __init__(self) -> None:
        self._event = threading.Event()
        self._future: asyncio.Future[None] | None = None

    def ring(self) -> None:
        self._event.set()
        future = self._future
        if future is not None:
            # A RuntimeError: its loop is closed, so nobody is waiting.
            with contextlib.suppress(RuntimeError):
                future.get_loop().call_soon_threadsafe(_settle, future)

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds; whether it rang."""
        return self._event.wait(max(0.0, timeout))

    async def await_(self, timeout: float) -> bool:
        """Await up to ``timeout`` seconds; whether it rang."""
        if self._event.is_set():
            return True
        self._future = asyncio.get_running_loop().create_future()
        if self._event.is_set():  # rang between the look above and the future
            return True
        try:
            await asyncio.wait_for(asyncio.shield(self._future), max(0.0, timeout))
        except asyncio.TimeoutError:
            return self._event.is_set()
        finally:
            self._future = None
        return True

    def clear(self) -> None:
        self._event.clear()


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Doorbell:
    """The bells of this process's waiters on one store, by lease id.

    ``nonce`` names this process to the store (lease ids start with it, so Redis knows
    which channel to publish a grant to); a forked child gets a new one.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bells: OrderedDict[str, Bell] = OrderedDict()
        self._pid = os.getpid()
        self.nonce = _nonce()

    def _check_fork(self) -> None:
        if self._pid != os.getpid():  # the parent's waiters are not ours
            self._pid, self.nonce = os.getpid(), _nonce()
            self._lock = threading.Lock()
            self._bells = OrderedDict()
            self.forked()

    def forked(self) -> None:
        """Let go of what did not cross the fork (a subclass's thread)."""

    def lease_id(self, call_id: str) -> str:
        self._check_fork()
        return f"{self.nonce}.{call_id}"

    def expect(self, lease_id: str) -> Bell:
        """The bell ``lease_id`` will ring; ask for it before the call that may queue."""
        self._check_fork()
        with self._lock:
            bell = self._bells.get(lease_id)
            if bell is None:
                bell = self._bells[lease_id] = Bell()
                while len(self._bells) > _KEPT:
                    self._bells.popitem(last=False)
        return bell

    def wait_for(self, lease_id: str) -> Bell:
        """The bell of a waiter about to wait, with this store listening for grants made
        elsewhere."""
        bell = self.expect(lease_id)
        self.watch()
        return bell

    def forget(self, lease_id: str) -> None:
        with self._lock:
            self._bells.pop(lease_id, None)
        if not self._bells:
            self.unwatch()

    def ring(self, lease_ids: Iterable[str]) -> None:
        for lease_id in lease_ids:
            with self._lock:
                bell = self._bells.get(lease_id)
            if bell is not None:
                bell.ring()

    def waiting(self) -> list[str]:
        with self._lock:
            return list(self._bells)

    def watch(self) -> None:
        """Start listening for grants made elsewhere (a subclass: a thread); idempotent."""

    def unwatch(self) -> None:
        """Nobody waits any more: a subclass may stop listening."""


def _nonce() -> str:
    return base64.urlsafe_b64encode(os.urandom(6)).decode()
