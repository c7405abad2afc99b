"""The slots a process's low-priority calls sleep for, one each.

Told of the same next slot, every low-priority call of a process that waits on a key
would wake for it and ask, and all but one would ask again a slot later: as many asks a
slot as there are waiters. So each waiter takes a slot of its own to wake for: the one
it was told of, or the first after it, a key's slot apart, that no other waiter of the
process holds. About one ask a slot per process, whatever the number of waiters.
"""

from __future__ import annotations

import threading


class LowTurns:
    """The slots (store time, µs) that a limiter's waiting low-priority calls hold, per
    key, or per pool of keys."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, ...], set[int]] = {}
        self._lock = threading.Lock()  # (threads of one limiter; a task never waits on it)

    def take(self, name: tuple[str, ...], slot_us: int, step_us: int) -> int:
        """The slot to wake for, told of ``slot_us``: the first, ``step_us`` apart from
        it, that lies at least a step from every other waiter's."""
        with self._lock:
            held = self._held.setdefault(name, set())
            clash = [other for other in held if abs(other - slot_us) < step_us]
            while clash:
                slot_us = max(clash) + step_us
                clash = [other for other in held if abs(other - slot_us) < step_us]
            held.add(slot_us)
            return slot_us

    def give_back(self, name: tuple[str, ...], slot_us: int) -> None:
        with self._lock:
            held = self._held.get(name)
            if held is not None:
                held.discard(slot_us)
                if not held:
                    del self._held[name]
