"""Per-key state of an in-process store that goes when its time is up, a few keys at a time.

A store in memory keeps, per key, state that it may forget once nothing in it can
matter any more (a log past its horizon, leases whose holders died, a card, a pushback,
a usage history past their TTLs). Looking at every key to find those would cost a sweep
O(keys); a heap of the times to look again finds the few that are due, and the store
forgets a few of them per operation, so that its size follows the keys in use, never
the keys it ever saw, and no operation pays for all of them. Which operations' times
may forget keys at all (:class:`GivenTimes`) is the same in every store.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Generic, TypeVar

V = TypeVar("V")

# Fewer keys than this are never copied into smaller tables (see Expiring._compact).
_COMPACT_FROM = 1024


class Expiring(Generic[V]):
    """One kind of per-key state (``items``, the store's own dict) and, for each key, a
    time to look at it again: ``ends(value)`` says when a key's state may go (µs since
    the epoch; None: not on its own). One heap entry per key, made when the key is
    written and not yet scheduled: a key whose time moved later meanwhile is scheduled
    again when its look comes (one more look, never an entry per operation); one reset
    and begun again with an earlier time goes at its old time (late, never early)."""

    def __init__(self, items: dict[str, V], ends: Callable[[V], int | None]) -> None:
        self.items = items
        self._ends = ends
        self._heap: list[tuple[int, str]] = []
        self._scheduled: set[str] = set()
        self._peak = 0  # the most keys scheduled since the tables were last compacted

    def __len__(self) -> int:
        """How many keys have a look scheduled."""
        return len(self._scheduled)

    def written(self, key: str) -> None:
        """Schedule a look at ``key``, just written, for when its state may go."""
        if key in self._scheduled:
            return
        value = self.items.get(key)
        when = None if value is None else self._ends(value)
        if when is not None:
            self._scheduled.add(key)
            heapq.heappush(self._heap, (when, key))
            self._peak = max(self._peak, len(self._scheduled))

    def forget(self, now: int, most: int) -> None:
        """Look at up to ``most`` keys whose time has come at ``now``, soonest first:
        forget each one's state if its time is up, else schedule it again."""
        heap, forgot = self._heap, False
        for _ in range(most):
            if not heap or heap[0][0] > now:
                break
            key = heapq.heappop(heap)[1]
            self._scheduled.discard(key)
            value = self.items.get(key)
            when = None if value is None else self._ends(value)
            if when is None:  # gone already (reset, or emptied), or kept until written
                continue
            if when <= now:
                del self.items[key]
                forgot = True
            else:
                self._scheduled.add(key)
                heapq.heappush(heap, (when, key))
        if forgot and self._peak >= _COMPACT_FROM and 4 * len(self.items) < self._peak:
            self._compact()

    def _compact(self) -> None:
        """Python's dicts and sets keep their tables at the largest they have been: once
        the keys are down to a quarter of that (a burst of keys gone idle), copy them into
        tables of their size. O(keys left), paid once per three times as many forgotten."""
        kept = self.items.copy()
        self.items.clear()  # (the same dict: the store holds it)
        self.items.update(kept)
        self._scheduled = set(self._scheduled)
        self._peak = len(self._scheduled)


class GivenTimes:
    """Which operations' times a store may forget expired keys by: keys expire by the
    clock their operations carry. In a store driven by a test's clock, an operation on
    the host's (ping, Backend.forget) forgets nothing, as every key would look long
    expired to it."""

    def __init__(self) -> None:
        self.given = False  # whether operations carry their time (a test's clock)

    def may_forget(self, now_us: int | None) -> bool:
        """Whether an operation that carries ``now_us`` (None: the store's clock) may."""
        self.given = self.given or now_us is not None
        return now_us is not None or not self.given
