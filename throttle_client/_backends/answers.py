"""What a store answers: :class:`Verdict` to an acquire, :class:`Snapshot` to an inspect.

In µs since the epoch on the store's clock; the limiter turns them into the public
:class:`~throttle_client.Decision` and :class:`~throttle_client.Usage`, in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


# A NamedTuple, not a frozen dataclass: one is made for every decision, and a tuple is
# built in a fifth of the time (a decision's Python time is on the hot path).
class Verdict(NamedTuple):
    """The answer to :class:`Acquire` (and AcquireAll, AcquireAny)."""

    allowed: bool
    now_us: int
    slot_us: int
    pause_until_us: int
    remaining: tuple[int, ...]
    # A capped call that found a key full and was queued (``slot_us`` is then when to
    # look again if nothing wakes it: the earliest a holder's lease can expire), and
    # whether it heads every queue it is in; ``full``: refused or queued for a full cap.
    waiting: bool = False
    head: bool = False
    full: bool = False
    # The calendar windows the limiter gave do not reach ``slot_us``, a time the decision
    # needs (the store's now, or a slot): nothing was written; ask again with windows there.
    stale: bool = False
    # An admitted call that asked for it (Acquire.mark_us): the running total of the
    # (first) key's entries before its slot less mark_us; -1: not asked. ``born``: when
    # that key's running totals began (a key forgotten and begun again counts from 0).
    mark: int = -1
    born: int = -1
    # Each key's life, in the order of the call's keys: when its log began, and its running
    # total after this call (a worker that sends them back as Acquire.expect and
    # Acquire.seen learns if the store lost the key, or its latest calls, since).
    lives: tuple[int, ...] = ()
    totals: tuple[int, ...] = ()
    # This call found a key of it that had lost its history, and held it (see Acquire).
    lost: bool = False
    # A pool's call (AcquireAny): the place of the key it took among the pool's; -1: none.
    chosen: int = -1


@dataclass(frozen=True)
class Snapshot:
    """The answer to :class:`Inspect`: the log seen at ``now_us``, unchanged."""

    now_us: int
    next_slot_us: int
    pause_until_us: int
    booked: int  # units in slots after now
    used: tuple[int, ...]  # per rate, units in slots in the window (now - period, now]
    ready_at_us: tuple[int, ...]  # per rate, when a call of cost 1 fits it (>= now)
    in_flight: int = 0  # a capped key: leases held (unexpired)
    waiting: int = 0  # a capped key: live tickets queued
    stale: bool = False  # the calendar windows given do not hold ``now_us``: ask again
    # A learned limit in force (see Learn): (its limit, the units it counts, its end µs).
    learned: tuple[int, int, int] | None = None
