"""The storage view the shared algorithm runs over: one key's log inside one atomic step.

Memory (``memory.py``) and SQLite (``sqlite_log.py``) each give one; ``sliding_log``,
``calendar_windows`` and ``coarse`` decide over it, the same for both.
"""

from __future__ import annotations

from typing import Protocol

from .coarse import Coarse


class LogView(Protocol):
    """One key's log inside one atomic step of a store."""

    last: int | None  # slot of the newest admitted call, kept after it is trimmed
    total: int  # running total of all admitted costs
    base: int  # running total at the newest trimmed entry
    # The log holds every entry after this slot; those at or before it may be gone (0:
    # none). A decision that reaches back before it (a limiter whose rates reach further
    # than those that trimmed the log: rates changed, or made bounded or exact) counts
    # every trimmed unit as at this slot, the latest it can be: never too few.
    trimmed: int
    pause_until: int
    # What the upstream said (ops.Learn): (since, until, limit, from_cum), or None.
    learned: tuple[int, int, int, int] | None
    born: int  # when the running totals began: a key forgotten begins again from 0
    # How this life of the key began (LIFE_*): afresh, at a reset, after a loss (held),
    # or rebuilt from its log.
    life: int

    def slot_of(self, call_id: str) -> int | None:
        """The slot booked by ``call_id``, if it is in the log."""

    def time_at_cum(self, target: int) -> int:
        """Slot of the first entry whose running total is >= target (one exists)."""

    def cum_through(self, t: int) -> int:
        """Running total at the newest entry with slot <= t (``base`` if none; 0 before
        ``trimmed``: how many of the trimmed units lie before it is not known)."""

    def entries_after(self, t: int, most: int) -> list[tuple[int, int]]:
        """(slot, running total) of the oldest ``most`` entries with slot > t, in order."""

    def append(self, t: int, cost: int, call_id: str) -> None:
        """Log a call at ``t`` (>= ``last``); updates ``last`` and ``total``."""

    def insert(self, t: int, cost: int, call_id: str) -> None:
        """Log a call at ``t`` (< ``last``: see ``filling``), after the entries at ``t``:
        the running total of every later entry grows by ``cost``; updates ``total``."""

    def trim(self, cutoff: int) -> None:
        """Drop entries with slot <= cutoff; updates ``base``."""

    def set_pause(self, until: int) -> None: ...

    def set_life(self, life: int) -> None: ...

    def begin(self, now: int, life: int) -> None:
        """The key's log begins a new ``life`` at ``now`` (after ``delete``), kept, when
        it had a time to go, until then (a reset: see Reset)."""

    def set_learned(self, learned: tuple[int, int, int, int]) -> None: ...

    def delete(self) -> None: ...

    def expire_at(self, when: int) -> None:
        """Nothing in the log matters after ``when``: the store may forget the key then."""

    def coarse(self, name: str) -> Coarse | None:
        """The key's coarse log ``name`` (a bounded rate's), if it has one."""

    def keep_coarse(self, name: str, coarse: Coarse) -> None:
        """Store ``coarse`` as the key's coarse log ``name`` (with the key's life)."""
