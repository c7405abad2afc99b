"""Partial state: how a store rebuilds a key that lost part of itself, and says so.

A store may lose one part of a key and keep the other (Redis: maxmemory eviction, a
DEL; SQLite: rows removed by hand), or hold a part it cannot read. The store rebuilds
what is missing in the same atomic step, by the rules below, which never admit a call
that the lost state would have refused:

- entries lost, summary kept: all of the lost units are put at the newest slot
  (``last``), so a rate they fill waits until ``last`` + its period: a stall of at
  most one period after the last slot, never over-use;
- summary lost or unreadable, entries kept: ``last`` and ``total`` come from the newest
  entry, ``base`` from the oldest (:func:`rebuilt_base`); a pause in force is lost.
- Entries that no window can reach any more are simply dropped: that is a key that
  expired, not a loss.

Or the summary reads well and holds what no step writes (a hand in the store, a backup
restored): numbers out of range or at odds with each other, or with the newest entry,
which the stores read with the summary at no extra cost. A summary that counts fewer
units than the entries hold (or says there are none) is rebuilt from them as if lost,
its pause kept ("damaged"); entries that hold fewer units than it counts get the
missing ones at the newest slot ("log"). A time further ahead than any limiter sets
(_ranges.FAR_AHEAD_US) has no such repair: the store refuses the key, by name, until
it is reset.
"""

from __future__ import annotations

import logging
import threading

from .quota import Quota

logger = logging.getLogger("throttle_client")


def rebuilt_base(oldest_cum: int, quota: Quota, *, repaired: bool = False) -> int:
    """``base`` for a log whose summary is lost, from the running total at its oldest
    entry: that entry cost at most the smallest limit (a larger cost is never admitted),
    so this counts too much, never too little. An entry made by a repair (all of a lost
    log's units at one slot) may hold any number of units: then 0."""
    if repaired:
        return 0
    return max(0, oldest_cum - min(limit for limit, _ in quota.limits))


def still_matters(newest_slot: int, quota: Quota, now: int) -> bool:
    """Whether an entry at ``newest_slot`` can still bear on a decision at ``now``."""
    return newest_slot + quota.horizon_us > now


REPAIRS = {
    "log": "its log was lost (evicted, deleted, or expired before its meta; or only some of "
    "its entries); the units it lacks are now counted at its newest slot, so it may wait up "
    "to its longest period after that slot",
    "meta": "its meta was lost or unreadable; it was rebuilt from the log, counting "
    "conservatively, and any pause in force was lost",
    "damaged": "its meta held values no limiter writes (a running total below its base or "
    "unlike its log's, a log it called empty, a negative or fractional field); it was rebuilt "
    "from the log, counting conservatively, and a pause in force was kept",
    "older": "it was written by an older version's Redis layout and is rewritten in this "
    "one, entry for entry; the call ids it held are dropped, so a retry begun before the "
    "upgrade books a new slot",
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
        logger.log(level, "repaired store key %s: %s", key, REPAIRS[part])
