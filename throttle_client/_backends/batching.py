"""Coalescing: the operations that queue while every connection is busy go as one call.

A Redis backend keeps at most ``size`` script calls in flight (4: ``CONNECTIONS``). An
operation that finds a place free goes at once, alone, so one decision at a time
waits for nothing. The others queue; whenever a call comes back, the place it held
passes to the first operation queued, which takes with it the operations queued
behind it (up to ``MAX_BATCH``, and on a Cluster only those of its own hash slot) as
one script call; those that queue before it runs go too, unless a later call has
taken some already. Under load each round trip then carries many decisions, and the
script reads what they share once (the server's time, each quota, each key's meta).
Operations go in the order they queued: a key's calls keep their order (FIFO).

Written once for both worlds, as a flow (``_flow``): it yields the script's commands,
and ``Wait`` for its turn, the one step that differs (a ``threading.Event``, or an
asyncio future). The bookkeeping is under a lock in both: uncontended under asyncio.

- **Failures.** A call that fails fails every operation it carried, each with the same
  error; each one's own flow retries it as it would a call of its own (the same call
  id: an attempt that did book is found, never booked twice). When the call failed as
  unavailable, the operations queued behind it fail with it at once, instead of each
  round of the queue waiting out a dead socket: a hung store costs the queue one
  socket timeout.
- **Cancellation.** A task cancelled while it waits leaves the queue (one already
  taken into a call still goes: a slot booked and unused, never over-use), or passes
  on the place it was handed. A leader cancelled or interrupted while its call is in
  flight puts the others back at the head of the queue: the next call carries them,
  under the same call ids, so an operation the server did run is found, not run twice.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Generator, Hashable
from typing import Any, Generic, NamedTuple, TypeVar

from .._errors import BackendUnavailable
from .base import Op

S = TypeVar("S")  # a step of the call's flow
T = TypeVar("T")

# At most this many operations in one script call: the server runs a call as one atomic
# step, so a bigger one holds up every other client (64 decisions of ~15-40 µs each).
MAX_BATCH = 64

_QUEUED, _LEAD, _TAKEN, _DONE = 0, 1, 2, 3


class _Entry:
    """One operation and how it stands: queued, handed a place (it leads the next call),
    taken into another's call, or done (its outcome: the answer, or the exception)."""

    __slots__ = ("batch", "group", "op", "outcome", "state", "ticket", "waker")

    def __init__(self, op: Op[Any], group: Hashable) -> None:
        self.op = op
        self.group = group
        self.state = _QUEUED
        self.outcome: Any = None
        self.waker: Any = None
        self.batch: list[_Entry] = []  # handed a place: the operations it takes along
        self.ticket = 0  # and which hand-off that was

    def answer(self) -> Any:
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


class Wait(NamedTuple):
    """A step: wait until ``waker`` is set (the operation is done, or leads)."""

    waker: Any


# What a call of several operations is: a flow (of script commands) that returns, per
# operation, its answer or the exception it raises.
Send = Callable[[list[Op[Any]]], Generator[S, Any, list[Any]]]


class Batcher(Generic[S]):
    """The queue and the places of one backend.

    ``new_waker()`` makes what a queued operation waits on, ``wake(waker)`` sets it,
    ``gone(waker)`` says its waiter was cancelled; ``group(op)`` says which operations
    may share a call (equal groups; None for all).
    """

    def __init__(
        self,
        size: int,
        send: Send[S],
        new_waker: Callable[[], Any],
        wake: Callable[[Any], None],
        group: Callable[[Op[Any]], Hashable] = lambda op: None,
        gone: Callable[[Any], bool] = lambda waker: False,
    ) -> None:
        self.size = size
        self.busy = 0  # places held: calls in flight, or handed on and about to be
        self.queue: collections.deque[_Entry] = collections.deque()
        self._send = send
        self._new_waker = new_waker
        self._wake = wake
        self._group = group
        self._gone = gone  # whether a waiter's task has been cancelled (asyncio)
        self._lock = threading.Lock()
        self._handoffs = 0  # places handed to a queued operation, ever
        self.last_failure: BaseException | None = None

    def flow(self, op: Op[T]) -> Generator[S | Wait, Any, T]:
        """``op``'s answer: sent now if a place is free, else with the next call."""
        entry = _Entry(op, self._group(op))
        with self._lock:
            # (While operations queue every place is held: a place given back goes to them.)
            lead = self.busy < self.size
            if lead:
                self.busy += 1
                entry.state, entry.batch = _LEAD, [entry]
            else:
                entry.waker = self._new_waker()
                self.queue.append(entry)
        if not lead:
            try:
                yield Wait(entry.waker)
            except BaseException:
                self._leave(entry)
                raise
            if entry.state == _DONE:
                return entry.answer()  # type: ignore[no-any-return]
        # This entry holds a place: from here on, whatever happens, the place goes on.
        batch, unavailable = entry.batch, False
        try:
            if not lead:  # (one that found a place free found the queue empty)
                with self._lock:
                    if entry.ticket == self._handoffs:  # no later call took any: more may come
                        self._take(batch)
            try:
                outcomes = yield from self._send([e.op for e in batch])
            except Exception as exc:
                outcomes = [_copy(exc) for _ in batch]
                unavailable = isinstance(exc, BackendUnavailable)
                if unavailable:
                    self.last_failure = exc.__cause__ or exc
            for e, outcome in zip(batch, outcomes, strict=True):
                e.outcome, e.state = outcome, _DONE
                if e is not entry:
                    self._wake(e.waker)
        except BaseException:
            # Cancelled or interrupted in flight (or before): the others go with the next
            # call, under the same call ids, so that an operation the server did run is
            # found, not run twice.
            with self._lock:
                self._requeue(batch[1:])
            raise
        finally:
            with self._lock:
                self._pass_on(unavailable)
        return entry.answer()  # type: ignore[no-any-return]

    def _take(self, batch: list[_Entry]) -> None:
        """Add to ``batch`` the queued operations that may go with its first, in order
        (under the lock). One whose task was cancelled meanwhile is left out."""
        queue, group = self.queue, batch[0].group
        kept: list[_Entry] = []  # (a Cluster: the operations of other hash slots)
        while queue and len(batch) < MAX_BATCH:
            e = queue.popleft()
            if self._gone(e.waker):
                e.state = _DONE
            elif group is None or e.group == group:
                e.state = _TAKEN
                batch.append(e)
            else:
                kept.append(e)
        queue.extendleft(reversed(kept))

    def _requeue(self, entries: list[_Entry]) -> None:
        """Put operations taken but not answered back at the head of the queue."""
        waiting = [e for e in entries if e.state != _DONE and not self._gone(e.waker)]
        for e in waiting:
            e.state = _QUEUED
        self.queue.extendleft(reversed(waiting))

    def _pass_on(self, unavailable: bool) -> None:
        """Give a place back (under the lock): to the first operation queued, which leads
        the next call with the operations queued behind it, taken now, so that a later
        call never carries operations queued before it; after an outage, fail the whole
        queue instead."""
        if unavailable:
            failed, self.queue = self.queue, collections.deque()
            for e in failed:
                e.outcome, e.state = self._given_up(), _DONE
                self._wake(e.waker)
        while self.queue:
            e = self.queue.popleft()
            if self._gone(e.waker):
                e.state = _DONE
                continue
            e.batch = [e]
            self._take(e.batch)
            self._handoffs += 1
            e.state, e.ticket = _LEAD, self._handoffs
            self._wake(e.waker)
            return  # (busy stays: the place changes hands)
        self.busy -= 1

    def _leave(self, entry: _Entry) -> None:
        """A waiter that stops waiting (cancelled): out of the queue, or, handed a place,
        the operations it had taken back at the head of the queue and the place on. (One
        already taken into another's call still goes: a slot booked and not used.)"""
        with self._lock:
            if entry.state == _QUEUED:
                self.queue.remove(entry)
            elif entry.state == _LEAD:
                self._requeue(entry.batch[1:])
                self._pass_on(False)
            entry.state = _DONE

    def _given_up(self) -> BackendUnavailable:
        error = BackendUnavailable(
            "Redis is unavailable: a call ahead of this one failed while it waited for a connection"
        )
        error.__cause__, error.__suppress_context__ = self.last_failure, True
        return error


def _copy(exc: Exception) -> Exception:
    """An exception of its own for each operation of a failed call (one instance raised
    in many tasks would gather all their tracebacks): the same class, message and cause."""
    try:
        copy = type(exc)(*exc.args)
    except Exception:  # a class built otherwise: shared, then
        return exc
    copy.__cause__, copy.__suppress_context__ = exc.__cause__, exc.__suppress_context__
    return copy
