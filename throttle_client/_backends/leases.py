"""Concurrency caps: leases and their FIFO queue, written once over a small storage view.

A capped key (a limiter with ``max_concurrent``) keeps, beside its log:

- its **holders**: lease id -> expiry (µs). A lease is held from admission until its
  call ends (released) or, if its holder stops renewing it (a worker killed with
  ``kill -9``), until it expires. Holders are kept by id, never only counted, so a
  release of a lease that is gone (released before, or expired) frees nothing, least
  of all another's;
- its **queue**: lease id -> (ticket number, alive until). A call that finds the key
  full and may wait takes a ticket; tickets are served in number order (FIFO). A
  waiter keeps its ticket alive by asking again now and then; one that stops (killed)
  drops out when its ticket's time is up.

Every operation first *settles* each capped key it touches: expired holders and dead
tickets go, and the freed capacity is handed to the head tickets, in order, as leases
(a **grant**). The store names the leases it granted, so that their waiters are woken
(``doorbell``). A granted waiter asks once more and is admitted: its lease is held for
it, and its rate slot is booked then, with every other key's.

A call charged to several keys is admitted when every capped key lets it hold a lease
and the rates allow its slot, all in one step. While some key is full it holds the
free ones (it was served there) and waits in order at the full ones, under one ticket
number, larger than any ticket already queued at any of its keys: so two waiters are in
the same order at every key they share, and none can wait on another that waits on it.

The memory and SQLite stores run this module; the Redis script mirrors it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, cast

from . import sliding_log
from .answers import Snapshot, Verdict
from .log_view import LogView
from .ops import Acquire, AcquireAll, AcquireAny, Charge, Inspect, Op, Release, Renew, Reset

T = TypeVar("T")
L = TypeVar("L", bound=LogView)


class LeaseView(Protocol):
    """One capped key's holders and queue inside one atomic step of a store."""

    def prune(self, now: int) -> None:
        """Drop holders whose lease expired at or before ``now``."""

    def holding(self) -> int:
        """How many leases are held."""

    def holds(self, lease_id: str) -> bool: ...

    def hold(self, lease_id: str, until: int) -> None:
        """Hold (or renew) ``lease_id`` until ``until``."""

    def unhold(self, lease_id: str) -> bool:
        """Drop ``lease_id``'s lease; whether it was held."""

    def earliest_expiry(self) -> int | None: ...

    def head(self, now: int) -> str | None:
        """The lease id of the first live ticket, if any; dead ones before it are dropped
        (only the head's life matters: a dead ticket further back waits its turn to go)."""

    def queued(self, lease_id: str) -> bool: ...

    def newest_ticket(self) -> int:
        """The largest ticket number queued (0: none)."""

    def enqueue(self, lease_id: str, number: int, alive_until: int) -> None:
        """Queue a new ticket."""

    def keep_alive(self, lease_id: str, alive_until: int) -> None:
        """A queued ticket lives on until ``alive_until`` (its number is kept)."""

    def dequeue(self, lease_id: str) -> bool: ...

    def counts(self, now: int) -> tuple[int, int]:
        """(leases held, live tickets) at ``now``, read only."""

    def forget(self) -> None:
        """Drop every holder and ticket (a reset)."""


def log_keys(op: Op[Any]) -> list[str]:
    """The keys whose logs ``op`` reads, in order (none: it touches leases only)."""
    if isinstance(op, (Release, Renew)):
        return []
    if isinstance(op, AcquireAny):
        return list(op.all_keys)
    return [c.key for c in op.charges] if isinstance(op, AcquireAll) else [op.key]


def narrowed(
    op: AcquireAny, logs: Sequence[L], now: int
) -> tuple[int, Acquire | AcquireAll, list[L]]:
    """A pool's call as the call it makes (``sliding_log.choose``; ``logs``: those of
    ``op.all_keys``): the place of the key it takes, that key's :class:`Acquire` (with
    partners, :class:`AcquireAll`), and the logs that call reads."""
    chosen = len(op.keys)
    index = sliding_log.choose(logs[:chosen], op, now, logs[chosen:])
    return index, op.choice(index), [logs[index], *logs[chosen:]]


def execute(
    op: Op[T],
    logs: Sequence[LogView],
    view: Callable[[str], LeaseView],
    now: int,
    granted: list[str],
) -> T:
    """Run any operation, for a store that gives the logs of ``log_keys(op)`` (opened,
    repaired) and a key's lease view; ``granted`` collects the leases granted."""
    if isinstance(op, Release):
        release([view(op.charges[i].key) for i in capped(op.charges)], op, now, granted)
        return cast(T, None)
    if isinstance(op, Renew):
        views = [view(op.charges[i].key) for i in capped(op.charges)]
        return cast(T, renew(views, op, now, granted))
    if isinstance(op, AcquireAll) and op.lease_id:
        some = [view(c.key) if c.quota.max_concurrent else None for c in op.charges]
        return cast(T, acquire(logs, some, op, now, granted))
    if isinstance(op, AcquireAll):
        return cast(T, sliding_log.acquire_all(logs, op, now))
    result = sliding_log.execute(logs[0], op, now)
    if isinstance(op, Inspect) and op.quota.max_concurrent:
        return cast(T, with_counts(cast(Snapshot, result), view(op.key), now))
    if isinstance(op, Reset):  # forget all: its leases and waiters too
        view(op.key).forget()
    return result


def shortest_ttl_us(charges: Sequence[Charge]) -> int:
    """The shortest lease TTL among the capped charges: what renewals and a waiter's
    looks are timed by (a third of it)."""
    return min(c.quota.lease_ttl_us for c in charges if c.quota.max_concurrent)


def capped(charges: Sequence[Charge]) -> list[int]:
    """The places of the charges whose quota has a cap."""
    return [i for i, charge in enumerate(charges) if charge.quota.max_concurrent]


def settle(view: LeaseView, charge: Charge, now: int, granted: list[str]) -> None:
    """Expired holders and dead tickets go; free capacity goes to the head tickets."""
    view.prune(now)
    quota = charge.quota
    while view.holding() < quota.max_concurrent:
        head = view.head(now)
        if head is None:
            return
        view.dequeue(head)
        view.hold(head, now + quota.lease_ttl_us)
        granted.append(head)


def acquire(
    logs: Sequence[LogView],
    views: Sequence[LeaseView | None],
    op: AcquireAll,
    now: int,
    granted: list[str],
) -> Verdict:
    """A capped :class:`AcquireAll`: ``views[i]`` is the lease view of charge i (None if
    uncapped). ``granted`` collects the leases this step granted to other waiters."""
    lease = op.lease_id
    lost = sliding_log.hold_lost(logs, op.charges, now)  # (before the caps: a hold is a pause)
    pairs = [(view, charge) for view, charge in zip(views, op.charges, strict=True) if view]
    for view, charge in pairs:
        settle(view, charge, now, granted)
    full = {
        id(view)
        for view, charge in pairs
        if not view.holds(lease)
        and not (view.holding() < charge.quota.max_concurrent and view.head(now) in (None, lease))
    }
    if not full:
        verdict = sliding_log.acquire_all(logs, op, now)
        verdict = verdict._replace(lost=verdict.lost or lost)
        if verdict.allowed:
            # Held through the sleep to its slot too: renewals begin once the call goes.
            start = max(verdict.slot_us, now)
            for view, charge in pairs:
                view.dequeue(lease)
                view.hold(lease, start + charge.quota.lease_ttl_us)
        return verdict
    # Some key is full: the earliest a lease there can end on its own is when to look
    # again, should no grant's ring come.
    blocked = [view for view, _ in pairs if id(view) in full]
    expiries = [e for view in blocked if (e := view.earliest_expiry()) is not None]
    hint = min(expiries, default=now)
    pause = max(log.pause_until for log in logs)
    remaining = sliding_log.remaining_all(logs, op.charges, now)
    if op.max_wait_us == 0:  # try: refused, and nothing of it is written
        return sliding_log.told(Verdict(False, now, hint, pause, remaining, full=True), logs, lost)
    number = 1 + max(view.newest_ticket() for view, _ in pairs)
    for view, charge in pairs:
        alive = now + charge.quota.lease_ttl_us
        if id(view) not in full:
            view.dequeue(lease)
            view.hold(lease, alive)  # served here: held for it while it waits elsewhere
        elif view.queued(lease):
            view.keep_alive(lease, alive)
        else:
            view.enqueue(lease, number, alive)
    head = all(view.head(now) == lease for view in blocked)
    verdict = Verdict(False, now, hint, pause, remaining, waiting=True, head=head, full=True)
    return sliding_log.told(verdict, logs, lost)


def release(views: Sequence[LeaseView], op: Release, now: int, granted: list[str]) -> None:
    """End a lease on every capped key (held, or still queued for): ``views[i]`` is
    the lease view of ``capped(op.charges)[i]``."""
    for view, i in zip(views, capped(op.charges), strict=True):
        view.unhold(op.lease_id)
        view.dequeue(op.lease_id)
        settle(view, op.charges[i], now, granted)


def renew(views: Sequence[LeaseView], op: Renew, now: int, granted: list[str]) -> bool:
    """Extend a held lease; False if some key had lost it (it is held again)."""
    kept = True
    for view, i in zip(views, capped(op.charges), strict=True):
        charge = op.charges[i]
        settle(view, charge, now, granted)
        if not view.holds(op.lease_id):
            kept = False  # in flight all the same: count it, even over the cap
            view.dequeue(op.lease_id)
        view.hold(op.lease_id, now + charge.quota.lease_ttl_us)
    return kept


def with_counts(snapshot: Snapshot, view: LeaseView, now: int) -> Snapshot:
    """``snapshot`` with the calls in flight and waiting of a capped key."""
    in_flight, waiting = view.counts(now)
    return dataclasses.replace(snapshot, in_flight=in_flight, waiting=waiting)
