"""The sliding-window log algorithm of docs/design.md §1, written once over a small storage view.

The memory and SQLite backends run this module. The Redis Lua script
(``lua/sliding_log.lua``) runs the same algorithm, step for step, over a storage
laid out for as few Redis calls as possible (see its header); the test suite holds
all of them to a naive reference model, on the same random sequences.

A key's log is a list of admitted calls in slot order. Each entry keeps its slot
time ``t`` and ``cum``, the running total of costs up to and including it. Because
slots never go backwards, time order and ``cum`` order agree, so "how much cost
lies after time X" and "when did the running total cross Y" are both one indexed
lookup: the work per decision is O(log n) per rate, whatever the cost of a call.
Entries older than the longest period are trimmed; ``base`` is the running total
at the newest trimmed entry.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Protocol, TypeVar, cast

from .base import (
    Acquire,
    AcquireAll,
    Charge,
    Inspect,
    Op,
    Pause,
    Quota,
    Reset,
    Snapshot,
    Verdict,
)

T = TypeVar("T")
logger = logging.getLogger("throttle_client")


class LogView(Protocol):
    """One key's log inside one atomic step of a store."""

    last: int | None  # slot of the newest admitted call, kept after it is trimmed
    total: int  # running total of all admitted costs
    base: int  # running total at the newest trimmed entry
    pause_until: int

    def slot_of(self, call_id: str) -> int | None:
        """The slot booked by ``call_id``, if it is in the log."""

    def time_at_cum(self, target: int) -> int:
        """Slot of the first entry whose running total is >= target (one exists)."""

    def cum_through(self, t: int) -> int:
        """Running total at the newest entry with slot <= t (``base`` if none)."""

    def first_after(self, t: int) -> int | None:
        """Slot of the oldest entry with slot > t."""

    def append(self, t: int, cost: int, call_id: str) -> None:
        """Log a call at ``t``; updates ``last`` and ``total``."""

    def trim(self, cutoff: int) -> None:
        """Drop entries with slot <= cutoff; updates ``base``."""

    def set_pause(self, until: int) -> None: ...

    def delete(self) -> None: ...

    def expire_at(self, when: int) -> None:
        """Nothing in the log matters after ``when``: the store may forget the key then."""


def fits_at(log: LogView, limit: int, period: int, cost: int) -> int:
    """When ``cost`` more fits under one rate, as far as that rate goes (0: at any time).

    Slots never go backwards, so every entry lies at or before any new slot: the window
    ending there must drop every entry up to the one at which the running total reaches
    total - limit + cost; if that one is already trimmed, it is long gone from every window.
    """
    target = log.total - limit + cost
    return log.time_at_cum(target) + period if target > log.base else 0


def earliest_slot(log: LogView, quota: Quota, now: int, cost: int) -> int:
    """docs/design.md §1: max(now, last + gap, pause, and for each rate the time the cost fits)."""
    slot = max(now, log.pause_until)
    if log.last is not None:
        slot = max(slot, log.last + quota.min_interval_us)
    for limit, period in quota.limits:
        slot = max(slot, fits_at(log, limit, period, cost))
    return slot


def remaining_at(log: LogView, quota: Quota, point: int) -> tuple[int, ...]:
    """Per rate, the units still free in the window that ends at ``point``."""
    return tuple(
        max(0, limit - (log.total - log.cum_through(point - period)))
        for limit, period in quota.limits
    )


def acquire(log: LogView, op: Acquire, now: int) -> Verdict:
    booked = log.slot_of(op.call_id)
    if booked is not None:  # the same call again (a driver retry): it already holds its slot
        return Verdict(True, now, booked, log.pause_until, remaining_at(log, op.quota, booked))
    slot = max(earliest_slot(log, op.quota, now, op.cost), now + op.lead_us)
    if op.max_wait_us >= 0 and slot - now > op.max_wait_us:
        # Refused: nothing is written, so a refusal leaves no trace.
        return Verdict(False, now, slot, log.pause_until, remaining_at(log, op.quota, now))
    log.append(slot, op.cost, op.call_id)
    log.trim(now - op.quota.longest_period_us)
    log.expire_at(max(slot, log.pause_until) + op.quota.horizon_us)
    return Verdict(True, now, slot, log.pause_until, remaining_at(log, op.quota, slot))


def acquire_all(logs: Sequence[LogView], op: AcquireAll, now: int) -> Verdict:
    """:class:`AcquireAll` over the logs of its charges, in order."""
    charges = op.charges
    pause_until = max(log.pause_until for log in logs)
    booked = logs[0].slot_of(op.call_id)
    if booked is not None:  # the same call again: it holds its slot in every log
        return Verdict(True, now, booked, pause_until, remaining_all(logs, charges, booked))
    # Past a log's newest slot a window only loses entries as time goes on: the latest
    # of the keys' earliest slots is the earliest that suits them all.
    slot = max(
        now + op.lead_us,
        *(earliest_slot(log, c.quota, now, c.cost) for log, c in zip(logs, charges, strict=True)),
    )
    if op.max_wait_us >= 0 and slot - now > op.max_wait_us:
        return Verdict(False, now, slot, pause_until, remaining_all(logs, charges, now))
    for log, charge in zip(logs, charges, strict=True):
        log.append(slot, charge.cost, op.call_id)
        log.trim(now - charge.quota.longest_period_us)
        log.expire_at(max(slot, log.pause_until) + charge.quota.horizon_us)
    return Verdict(True, now, slot, pause_until, remaining_all(logs, charges, slot))


def remaining_all(
    logs: Sequence[LogView], charges: Sequence[Charge], point: int
) -> tuple[int, ...]:
    return tuple(
        units
        for log, charge in zip(logs, charges, strict=True)
        for units in remaining_at(log, charge.quota, point)
    )


def inspect(log: LogView, op: Inspect, now: int) -> Snapshot:
    """Units used (slots up to now) apart from units booked (slots ahead), per rate."""
    through_now = log.cum_through(now)
    limits = op.quota.limits
    return Snapshot(
        now_us=now,
        next_slot_us=earliest_slot(log, op.quota, now, 1),
        pause_until_us=log.pause_until,
        booked=log.total - through_now,
        used=tuple(through_now - log.cum_through(now - period) for _, period in limits),
        ready_at_us=tuple(max(now, fits_at(log, limit, period, 1)) for limit, period in limits),
    )


def pause(log: LogView, op: Pause, now: int) -> int:
    until = now + op.duration_us
    if until > log.pause_until:  # a pause only ever moves forward
        log.set_pause(until)
        log.expire_at(max(until, log.last or 0) + op.quota.horizon_us)
    return log.pause_until


def execute(log: LogView, op: Op[T], now: int) -> T:
    """Run ``op`` on ``log`` at ``now`` (µs); the caller provides atomicity."""
    if isinstance(op, Acquire):
        return cast(T, acquire(log, op, now))
    if isinstance(op, Inspect):
        return cast(T, inspect(log, op, now))
    if isinstance(op, Pause):
        return cast(T, pause(log, op, now))
    if isinstance(op, Reset):
        log.delete()
        return cast(T, None)
    raise TypeError(f"unknown operation {op!r}")


# -- partial state ------------------------------------------------------------------------
# A store may lose one part of a key and keep the other (Redis: maxmemory eviction, a
# DEL; SQLite: rows removed by hand), or hold a part it cannot read. The store rebuilds
# what is missing in the same atomic step, by the rules below, which never admit a call
# that the lost state would have refused:
#
# - entries lost, summary kept: all of the lost units are put at the newest slot
#   (``last``), so a rate they fill waits until ``last`` + its period: a stall of at
#   most one period after the last slot, never over-use;
# - summary lost or unreadable, entries kept: ``last`` and ``total`` come from the newest
#   entry, ``base`` from the oldest (:func:`rebuilt_base`); a pause in force is lost.
# - Entries that no window can reach any more are simply dropped: that is a key that
#   expired, not a loss.


def rebuilt_base(oldest_cum: int, quota: Quota) -> int:
    """``base`` for a log whose summary is lost, from the running total at its oldest
    entry: that entry cost at most the smallest limit (a larger cost is never admitted),
    so this counts too much, never too little."""
    return max(0, oldest_cum - min(limit for limit, _ in quota.limits))


def still_matters(newest_slot: int, quota: Quota, now: int) -> bool:
    """Whether an entry at ``newest_slot`` can still bear on a decision at ``now``."""
    return newest_slot + quota.horizon_us > now


REPAIRS = {
    "log": "its log was lost (evicted, deleted, or expired before its meta); its units are "
    "now counted at its newest slot, so it may wait up to its longest period after that slot",
    "meta": "its meta was lost or unreadable; it was rebuilt from the log, counting "
    "conservatively, and any pause in force was lost",
}


class RepairNotice:
    """Says that a store rebuilt part of a key: one WARNING per backend, then DEBUG (an
    eviction or a flush touches many keys, and every worker would repeat it)."""

    def __init__(self) -> None:
        self._warned = False
        self._lock = threading.Lock()

    def __call__(self, key: str, part: str) -> None:
        """``key`` is the hashed store key (never a token); ``part`` a key of REPAIRS."""
        with self._lock:
            level = logging.DEBUG if self._warned else logging.WARNING
            self._warned = True
        logger.log(level, "throttle_client: repaired store key %s: %s", key, REPAIRS[part])
