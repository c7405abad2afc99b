"""What a worker knows of its keys' lives in the store, to tell a store that lost them.

A store that restarts without persistence, fails over to a replica that lagged, or is
restored from an older snapshot comes back without the recent calls of its keys: they
look new, and the fleet would spend their quota a second time. Every answer to an
acquire says when each of its keys' logs began (its *life*, ``Verdict.lives``) and its
running total (``Verdict.totals``); a worker remembers them, with how long its own
booking keeps the key alive (its slot plus the quota's horizon). While that lasts the key
must still hold that life, and at least that total, so the worker sends them with its
next call (``Acquire.expect``, ``Acquire.seen``); a store that finds the key begun
afresh since, or counting fewer units, holds it as if every window had been full then
(``lost_history`` in the script and in ``sliding_log``), and says so. A reset begins a
life that no one takes for a loss. Only the newest ``REMEMBERED`` keys are known: one
past them goes unchecked.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

log = logging.getLogger("throttle_client")

REMEMBERED = 1 << 15  # keys, newest first: about 4 MB at most
US = 1_000_000


class Lives:
    """Store key -> (its life, the highest running total seen in it, until when this
    worker's bookings keep it alive, µs)."""

    def __init__(self) -> None:
        self._known: OrderedDict[str, tuple[int, int, int]] = OrderedDict()
        self._lock = threading.Lock()
        self._warned = False

    def expect(
        self, store_key: str, store_time_us: Callable[[float], int], now: float
    ) -> tuple[int, int]:
        """The life and the running total to send with a call on the key at local time
        ``now``: the ones known, while this worker's own booking must still be in the
        log; else (-1, -1)."""
        known = self._known.get(store_key)
        if known is None:
            return -1, -1
        life, seen, until = known
        return (life, seen) if store_time_us(now) < until else (-1, -1)

    def saw(self, store_key: str, life: int, total: int, slot_us: int, horizon_us: int) -> None:
        """An answer about the key: its ``life`` and ``total``, and the slot booked (-1:
        none)."""
        with self._lock:
            known = self._known.get(store_key)
            if known is None and slot_us < 0:
                return  # (nothing of this worker's is in the key: nothing to expect)
            seen, until = (known[1], known[2]) if known is not None and known[0] == life else (0, 0)
            self._known[store_key] = (life, max(seen, total), max(until, slot_us + horizon_us))
            self._known.move_to_end(store_key)
            if len(self._known) > REMEMBERED:
                self._known.popitem(last=False)

    def forget(self, store_key: str) -> None:
        with self._lock:
            self._known.pop(store_key, None)

    def told_lost(self, labels: list[str], namespace: str, held_for_us: int) -> None:
        """The store found the key had lost its recent history, and held it: said once
        at WARNING (a store that lost one key lost them all), then at DEBUG."""
        with self._lock:
            level = logging.DEBUG if self._warned else logging.WARNING
            self._warned = True
        log.log(
            level,
            "the store lost the recent calls of key %s (namespace %r): it restarted without "
            "persistence, failed over to a replica that lagged, or was restored from an "
            "older copy. The key is held %.1f s more, as if every window had been full "
            "when it was lost, so that the fleet does not spend its quota twice. Redis "
            "with appendonly yes and appendfsync everysec keeps the calls.",
            " and ".join(labels),
            namespace,
            max(0, held_for_us) / US,
        )
