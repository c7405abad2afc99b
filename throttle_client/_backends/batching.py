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
  socket timeout. Their error (``NotSent``) says how long that call waited on the
  store, which their retries count as spent: they waited on it too.
- **Cancellation.** A task cancelled while it waits leaves the queue (one already
  taken into a call still goes: a slot booked and unused, never over-use), or passes
  on the place it was handed. A leader cancelled or interrupted while its call is in
  flight puts the others back at the head of the queue: the next call carries them,
  under the same call ids, so an operation the server did run is found, not run twice.
- **Opening connections.** A place whose connection may not be open yet (at first, and
  after an outage) first makes a call that carries no operation: it opens the
  connection and readies the store (loads the script), while the operation waits in
  the queue like any other; then it carries the queue's head. Else a call held up
  opening a connection or loading the script (milliseconds) would let the calls that
  came after it go first, over a connection already open, and take the slots before
  theirs. A place given back while the queue's head is busy opening one goes with it:
  the flow that gives it carries that call.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Generator, Hashable
from typing import Any, Generic, NamedTuple, TypeVar

from .._errors import BackendUnavailable, shed_frames
from .ops import Op

S = TypeVar("S")  # a step of the call's flow
T = TypeVar("T")

# At most this many operations in one script call: the server runs a call as one atomic
# step, so a bigger one holds up every other client (64 decisions of ~15-40 µs each).
MAX_BATCH = 64

_QUEUED, _LEAD, _TAKEN, _DONE = 0, 1, 2, 3


class _Entry:
    """One operation and how it stands: queued, handed a place (it leads the next call),
    taken into another's call, or done (its outcome: the answer, or the exception)."""

    __slots__ = ("batch", "group", "op", "opening", "outcome", "since", "state", "ticket", "waker")

    def __init__(self, op: Op[Any], group: Hashable) -> None:
        self.op = op
        self.group = group
        self.state = _QUEUED
        self.outcome: Any = None
        self.waker: Any = None
        self.batch: list[_Entry] = []  # handed a place: the operations it takes along
        self.ticket = 0  # and which hand-off that was
        self.opening = False  # its flow is busy opening a place's connection
        self.since = 0.0  # when it queued (time.monotonic()); 0.0: it never did

    def answer(self) -> Any:
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


class NotSent(BackendUnavailable):
    """An operation not sent: a call ahead of it found the store unavailable after
    waiting ``waited`` seconds on it (real time), while this one waited for a place."""

    def __init__(self, message: str, waited: float = 0.0) -> None:
        super().__init__(message)
        self.waited = waited


class Wait(NamedTuple):
    """A step: wait until ``waker`` is set (the operation is done, or leads)."""

    waker: Any


# What a call of several operations is: a flow (of script commands) that returns, per
# operation, its answer or the exception it raises; given, per operation, the seconds it
# waited in the queue (an acquire waits that much less). A call of none opens a connection.
Send = Callable[[list[Op[Any]], list[float]], Generator[S, Any, list[Any]]]


class Batcher(Generic[S]):
    """The queue and the places of one backend.

    ``new_waker()`` makes what a queued operation waits on, ``wake(waker)`` sets it,
    ``gone(waker)`` says its waiter was cancelled; ``group(op)`` says which operations
    may share a call (equal groups; None for all); ``opens`` says whether a place opens
    its connection before it carries operations (not where a call of none cannot open
    the connection the next will use: a Cluster's).
    """

    def __init__(
        self,
        size: int,
        send: Send[S],
        new_waker: Callable[[], Any],
        wake: Callable[[Any], None],
        group: Callable[[Op[Any]], Hashable] = lambda op: None,
        gone: Callable[[Any], bool] = lambda waker: False,
        opens: bool = False,
    ) -> None:
        self.size = size
        self.busy = 0  # places held: calls in flight, or handed on and about to be
        # Places whose connection is known open. The pool hands a call an idle connection
        # if it has one, and opens one only when all are in use: so the place taken while
        # ``busy`` (this one included) exceeds it would open one.
        self.warm = 0 if opens else size
        self._opens = opens
        self.queue: collections.deque[_Entry] = collections.deque()
        self._send = send
        self._new_waker = new_waker
        self._wake = wake
        self._group = group
        self._gone = gone  # whether a waiter's task has been cancelled (asyncio)
        self._lock = threading.Lock()
        self._handoffs = 0  # calls formed from the queue, ever (see _carry's ticket)

    def flow(self, op: Op[T]) -> Generator[S | Wait, Any, T]:
        """``op``'s answer: sent now if a place is free, else with the next call."""
        with self._lock:
            lead = opens = False
            if self.busy < self.size:
                opens = self.busy >= self.warm  # this place's connection may not be open
                # (A place free while operations queue waits for the queue's head, which
                # is busy opening a place of its own: none goes ahead of it.)
                lead = not opens and not self.queue
                if opens or lead:
                    self.busy += 1
            if not lead:
                entry = _Entry(op, self._group(op))
                entry.waker, entry.opening = self._new_waker(), opens
                entry.since = time.monotonic()
                self.queue.append(entry)
        if lead:
            return (yield from self._alone(op))
        try:
            if opens:  # the operation waits in the queue meanwhile, in its order
                yield from self._open_place(entry)
            yield Wait(entry.waker)
        except BaseException:
            self._leave(entry)
            raise
        if entry.state == _LEAD:  # handed a place: it leads the next call
            yield from self._carry(entry.batch, entry, entry.ticket)
        return entry.answer()  # type: ignore[no-any-return]

    def _alone(self, op: Op[T]) -> Generator[S, Any, T]:
        """``op`` in a call of its own, from the place this flow took: as ``_carry``
        carries a batch of one, without the batch (most calls overlap no other)."""
        sent = time.monotonic()
        failure: tuple[BaseException, float] | None = None
        try:
            answer = (yield from self._send([op], [0.0]))[0]  # (it queued for none)
        except Exception as exc:
            answer, failure = exc, _failure(exc, sent)
        except BaseException:  # cancelled or interrupted in flight
            self._cut([])
            raise
        with self._lock:
            batch = self._pass_on(failure, carry=True)
        if batch:  # the queue's head is busy opening a place: this flow carries its call
            yield from self._carry(batch, None)
        if isinstance(answer, BaseException):
            raise answer
        return answer  # type: ignore[no-any-return]

    def _carry(
        self, batch: list[_Entry], own: _Entry | None, ticket: int | None = None
    ) -> Generator[S, Any, None]:
        """Send ``batch``'s operations in one call, from the place this flow holds, and
        answer them (all but ``own``, this flow's, are woken); then the place goes on,
        whatever happens. ``ticket``: the call was formed from the queue then, and may
        take along the operations queued since, unless a later call was formed. When
        the place would go to an operation whose flow is busy opening a place (it could
        not lead at once), this flow carries that call too."""
        while batch:
            failure: tuple[BaseException, float] | None = None
            try:
                if ticket is not None:
                    with self._lock:
                        if ticket == self._handoffs:
                            self._take(batch)
                sent = time.monotonic()
                queued = [sent - e.since if e.since else 0.0 for e in batch]
                try:
                    outcomes = yield from self._send([e.op for e in batch], queued)
                except Exception as exc:
                    outcomes, failure = [_copy(exc) for _ in batch], _failure(exc, sent)
                for e, outcome in zip(batch, outcomes, strict=True):
                    e.outcome, e.state = outcome, _DONE
                    if e is not own:
                        self._wake(e.waker)
            except BaseException:  # cancelled or interrupted in flight (or before)
                self._cut([e for e in batch if e is not own])
                raise
            with self._lock:
                batch, own, ticket = self._pass_on(failure, carry=True), None, None

    def _cut(self, others: list[_Entry]) -> None:
        """A call cancelled or interrupted in flight (or before): ``others``, the
        operations it carried for other flows, go with the next call, under the same
        call ids, so that an operation the server did run is found, not run twice; the
        place goes on."""
        with self._lock:
            self._requeue(others)
            if self._opens:  # (redis-py drops a connection whose command is cut)
                self.warm = max(0, self.warm - 1)
            self._pass_on()

    def _open_place(self, entry: _Entry) -> Generator[S, Any, None]:
        """Open the connection of the place just taken (a call of no operation), then
        carry the first operations queued from it (``entry``, queued meanwhile, may be
        among them), and hand the places freed meanwhile on. Open once the store
        answered, even with an error (refused by an ACL, say): only an unavailable store
        leaves it closed, and fails the queue."""
        failure: BackendUnavailable | None = None
        sent = time.monotonic()
        try:
            yield from self._send([], [])
        except BackendUnavailable as exc:
            failure = exc
            shed_frames(exc)  # (held in this frame, which its traceback holds: a cycle)
        except Exception:
            pass  # the store answered: the operations' own call will meet the error
        except BaseException:
            with self._lock:
                entry.opening = False
                self._pass_on()
            raise
        with self._lock:
            entry.opening = False
            if failure is not None:
                if entry.state == _QUEUED:  # the call was its own: its own error, not NotSent
                    self.queue.remove(entry)
                    entry.outcome, entry.state = _copy(failure), _DONE
                    self._wake(entry.waker)
                self._pass_on((failure.__cause__ or failure, time.monotonic() - sent))
                return
            self.warm = min(self.size, self.warm + 1)
            batch = self._first()
            if not batch:
                self.busy -= 1
            self._fill()
        if batch:
            yield from self._carry(batch, None)

    def _head(self) -> _Entry | None:
        """The first operation queued, dropping those whose task was cancelled meanwhile
        (under the lock)."""
        queue = self.queue
        while queue and self._gone(queue[0].waker):
            queue.popleft().state = _DONE
        return queue[0] if queue else None

    def _first(self) -> list[_Entry]:
        """A call formed from the queue (under the lock): its first operation and those
        that may go with it, taken; none if the queue is empty."""
        head = self._head()
        if head is None:
            return []
        self.queue.popleft()
        head.state, batch = _TAKEN, [head]
        self._take(batch)
        self._handoffs += 1
        return batch

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

    def _pass_on(
        self, failure: tuple[BaseException, float] | None = None, carry: bool = False
    ) -> list[_Entry]:
        """Give a place back (under the lock), after a call that found the store
        unavailable (``failure``: the cause, and how long it waited) failing the whole
        queue first. ``carry``: when the queue's head is busy opening a place, its call
        is returned for the caller to carry, and the place stays with it."""
        if failure is not None:
            self.warm = 0 if self._opens else self.size  # (some may have been dropped)
            failed, self.queue = self.queue, collections.deque()
            for e in failed:
                e.outcome, e.state = _not_sent(*failure), _DONE
                self._wake(e.waker)
        if carry:
            head = self._head()
            if head is not None and head.opening:
                return self._first()
        self.busy -= 1
        self._fill()
        return []

    def _fill(self) -> None:
        """Hand the free places to the operations queued first (under the lock): each
        leads a call of those queued behind it, formed now, so that a later call never
        carries operations queued before it. Not to one whose flow is busy opening a
        place: it could not lead at once, and a later call would go first; it hands
        them on itself once its place is open."""
        while self.busy < self.size:
            head = self._head()
            if head is None or head.opening:
                return
            batch = self._first()
            self.busy += 1
            head.state, head.batch, head.ticket = _LEAD, batch, self._handoffs
            self._wake(head.waker)

    def _leave(self, entry: _Entry) -> None:
        """A waiter that stops waiting (cancelled): out of the queue, or, handed a place,
        the operations it had taken back at the head of the queue and the place on. (One
        already taken into another's call still goes: a slot booked and not used.)"""
        with self._lock:
            if entry.state == _QUEUED:
                self.queue.remove(entry)
            elif entry.state == _LEAD:
                self._requeue(entry.batch[1:])
                self._pass_on()
            entry.state = _DONE


def _failure(exc: Exception, sent: float) -> tuple[BaseException, float] | None:
    """What a failed call sent at ``sent`` (time.monotonic()) tells the queue: when it
    found the store unavailable, the cause and how long it waited on it; else None."""
    if isinstance(exc, BackendUnavailable):
        return exc.__cause__ or exc, time.monotonic() - sent
    return None


def _not_sent(cause: BaseException, waited: float) -> NotSent:
    error = NotSent(
        f"Redis is unavailable: a call ahead of this one failed ({cause}) while it waited "
        "for a connection",
        waited,
    )
    error.__cause__, error.__suppress_context__ = cause, True
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
