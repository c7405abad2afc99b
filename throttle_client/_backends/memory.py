"""In-process store: the limiter's semantics for the threads and tasks of one process."""

from __future__ import annotations

import threading
import time
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, cast

from .._cards import Disagreements
from . import beside, history, leases
from .answers import Verdict
from .base import Backend, InlineAsync, host_clock
from .beside import kept_record
from .coarse import Coarse
from .expiries import Expiring, GivenTimes
from .ops import (
    RECORD_TTL_US,
    AcquireAny,
    Op,
    ReadHistory,
    namespace_prefix,
)
from .pushback import Pushback, PushbackRecord, in_force, pushback_ends
from .quota import KEPT_US
from .sliding_log import LIFE_RESET

T = TypeVar("T")

# The most keys whose time is up an operation forgets of each kind of state, per key it
# touches: more than it can begin (one of each per key), so the store keeps up with any
# churn of keys, a few at a time.
_FORGET_STEP = 4


class _MemoryLog:
    """One key's log as parallel sorted lists (slot times, running totals)."""

    __slots__ = (
        "base",
        "born",
        "call_ids",
        "coarse_logs",
        "cums",
        "expires_at",
        "ids",
        "last",
        "learned",
        "life",
        "pause_until",
        "times",
        "total",
        "trimmed",
    )

    def __init__(self) -> None:
        self.times: list[int] = []
        self.cums: list[int] = []
        self.call_ids: list[str] = []
        self.ids: dict[str, int] = {}
        self.last: int | None = None
        self.total = 0
        self.base = 0
        self.trimmed = 0
        self.pause_until = 0
        self.learned: tuple[int, int, int, int] | None = None
        self.born = 0  # set by the store when it begins the key
        self.life = 0  # how it began (sliding_log.LIFE_*)
        self.expires_at = 0
        self.coarse_logs: dict[str, Coarse] = {}

    def slot_of(self, call_id: str) -> int | None:
        return self.ids.get(call_id)

    def time_at_cum(self, target: int) -> int:
        return self.times[bisect_left(self.cums, target)]

    def cum_through(self, t: int) -> int:
        if t < self.trimmed:
            return 0
        index = bisect_right(self.times, t)
        return self.cums[index - 1] if index else self.base

    def entries_after(self, t: int, most: int) -> list[tuple[int, int]]:
        index = bisect_right(self.times, t)
        end = index + most
        return list(zip(self.times[index:end], self.cums[index:end], strict=True))

    def insert(self, t: int, cost: int, call_id: str) -> None:
        index = bisect_right(self.times, t)
        cum = (self.cums[index - 1] if index else self.base) + cost
        for later in range(index, len(self.cums)):
            self.cums[later] += cost
        self.times.insert(index, t)
        self.cums.insert(index, cum)
        self.call_ids.insert(index, call_id)
        self.ids[call_id] = t
        self.total += cost

    def append(self, t: int, cost: int, call_id: str) -> None:
        self.total += cost
        self.times.append(t)
        self.cums.append(self.total)
        self.call_ids.append(call_id)
        self.ids[call_id] = t
        self.last = t

    def trim(self, cutoff: int) -> None:
        count = bisect_right(self.times, cutoff)
        if count:
            self.base, self.trimmed = self.cums[count - 1], cutoff
            for call_id in self.call_ids[:count]:
                del self.ids[call_id]
            del self.times[:count], self.cums[:count], self.call_ids[:count]

    def set_pause(self, until: int) -> None:
        self.pause_until = until

    def set_learned(self, learned: tuple[int, int, int, int]) -> None:
        self.learned = learned

    def set_life(self, life: int) -> None:
        self.life = life

    def delete(self) -> None:
        ends = self.expires_at
        self.__init__()  # type: ignore[misc]
        self.expires_at = ends  # (see begin)

    def begin(self, now: int, life: int) -> None:
        self.born, self.life = now, life

    def expire_at(self, when: int) -> None:
        self.expires_at = max(self.expires_at, when)

    def coarse(self, name: str) -> Coarse | None:
        return self.coarse_logs.get(name)

    def keep_coarse(self, name: str, coarse: Coarse) -> None:
        self.coarse_logs[name] = coarse


class _MemoryLeases:
    """One capped key's holders and queue (``leases.LeaseView``)."""

    __slots__ = ("holders", "newest", "queue")

    def __init__(self) -> None:
        self.holders: dict[str, int] = {}  # lease id -> expiry
        self.queue: dict[str, tuple[int, int]] = {}  # lease id -> (number, alive until)
        self.newest = 0

    def prune(self, now: int) -> None:
        for lease_id in [i for i, until in self.holders.items() if until <= now]:
            del self.holders[lease_id]

    def holding(self) -> int:
        return len(self.holders)

    def holds(self, lease_id: str) -> bool:
        return lease_id in self.holders

    def hold(self, lease_id: str, until: int) -> None:
        self.holders[lease_id] = until

    def unhold(self, lease_id: str) -> bool:
        return self.holders.pop(lease_id, None) is not None

    def earliest_expiry(self) -> int | None:
        return min(self.holders.values(), default=None)

    def head(self, now: int) -> str | None:
        # Tickets are numbered in the order they are queued here, so the dict's order
        # is the queue's.
        while self.queue:
            lease_id = next(iter(self.queue))
            if self.queue[lease_id][1] > now:
                return lease_id
            del self.queue[lease_id]
        return None

    def queued(self, lease_id: str) -> bool:
        return lease_id in self.queue

    def newest_ticket(self) -> int:
        return self.newest

    def enqueue(self, lease_id: str, number: int, alive_until: int) -> None:
        self.queue[lease_id] = (number, alive_until)
        self.newest = max(self.newest, number)

    def keep_alive(self, lease_id: str, alive_until: int) -> None:
        self.queue[lease_id] = (self.queue[lease_id][0], alive_until)

    def dequeue(self, lease_id: str) -> bool:
        return self.queue.pop(lease_id, None) is not None

    def counts(self, now: int) -> tuple[int, int]:
        held = sum(1 for expiry in self.holders.values() if expiry > now)
        return held, sum(1 for _, alive in self.queue.values() if alive > now)

    def ends(self) -> int:
        """When every lease and ticket here will have expired, unless renewed."""
        alive = (until for _, until in self.queue.values())
        return max(*self.holders.values(), *alive, 0)

    def forget(self) -> None:
        self.holders.clear()
        self.queue.clear()


def _log_ends(log: _MemoryLog) -> int | None:
    """When a key's log may go (None: when it is given a time): KEPT_US past its horizon."""
    return log.expires_at + KEPT_US if log.expires_at else None


class MemoryBackend(Backend):
    """Keeps logs in this process; safe under threads and asyncio tasks.

    Each operation runs under one lock and never awaits, so it is atomic for both.
    Keys are forgotten once nothing in them can matter any more.

    >>> limiter = Limiter(MemoryBackend(), rates=["10/second"])
    """

    def __init__(self, *, clock: Callable[[], float] | None = None) -> None:
        self._clock = host_clock(clock, "MemoryBackend")
        self._logs: dict[str, _MemoryLog] = {}
        self._leases: dict[str, _MemoryLeases] = {}
        self._cards: dict[str, tuple[str, int]] = {}  # store key -> (card, expires µs)
        self._pushback: dict[str, PushbackRecord] = {}
        self._history: dict[str, tuple[dict[str, int], int]] = {}  # (fields, expires µs)
        # Each kind of per-key state, and when each key's may go: a log past its horizon
        # (one without an expiry stays until an operation gives it one), leases whose
        # holders and waiters all stopped renewing, a card, a pushback or a history past
        # its time. Forgotten a few at a time as operations run (see expiries).
        self._expiring_logs = Expiring(self._logs, _log_ends)
        self._expiring_leases = Expiring(self._leases, _MemoryLeases.ends)
        self._expiring_cards = Expiring(self._cards, lambda card: card[1])
        self._expiring_pushback = Expiring(self._pushback, pushback_ends)
        self._expiring_history = Expiring(self._history, lambda kept: kept[1])
        self._expiring: tuple[Expiring[Any], ...] = (
            self._expiring_logs,
            self._expiring_leases,
            self._expiring_cards,
            self._expiring_pushback,
            self._expiring_history,
        )
        self._beside = _MemoryBeside(
            self._expiring_cards, self._expiring_pushback, self._expiring_history
        )
        self._seen = 0  # the latest time an operation ran at (µs): cards read at it
        self._disagree = Disagreements()  # workers whose cards of one key differ
        # Namespace -> its record (Backend.fingerprint): the fingerprint, its expiry µs.
        self._records: dict[str, tuple[str, int]] = {}
        self._times = GivenTimes()  # which operations' times may forget keys
        self._lock = threading.Lock()

    def execute(self, op: Op[T]) -> T:
        granted: list[str] = []
        with self._lock:
            now = op.time_us(self._clock)
            self._seen = max(self._seen, now)
            result = self._run(op, now, granted)
            if self._times.may_forget(op.now_us):
                most = _FORGET_STEP * max(1, len(leases.log_keys(op)))
                for kind in self._expiring:
                    kind.forget(now, most)
        self.doorbell.ring(granted)  # the waiters this step granted a lease, if any
        return result

    def _run(self, op: Op[T], now: int, granted: list[str]) -> T:
        if isinstance(op, ReadHistory):
            fields, expires = self._history.get(op.key, ({}, 0))
            return cast(T, dict(fields) if expires > now else {})
        keys = leases.log_keys(op)
        opened = logs = [self._log(key, now) for key in keys]
        chosen, run = -1, cast(Op[Any], op)
        if isinstance(op, AcquireAny):  # a pool's call: the plain acquire it makes
            chosen, run, logs = leases.narrowed(op, opened, now)
        counts = history.counts(run, logs[0]) if logs else False
        touched: list[str] = []

        def view(key: str) -> _MemoryLeases:
            touched.append(key)
            return self._leases.setdefault(key, _MemoryLeases())

        result: T = leases.execute(run, logs, view, now, granted)
        beside.write(run, result, logs, counts, now, self._beside, self._disagree)
        if chosen >= 0:
            result = cast(T, cast(Verdict, result)._replace(chosen=chosen))
        for key, log in zip(keys, opened, strict=True):
            if (
                not log.times
                and log.pause_until <= now
                and log.last is None
                and (log.learned is None or log.learned[1] <= now)
                and (log.life != LIFE_RESET or log.expires_at <= now)
            ):  # nothing in it (not even a reset to tell of): forgotten at once
                del self._logs[key]
            else:
                self._expiring_logs.written(key)
        for key in touched:  # a key with nobody holding or waiting is forgotten
            held = self._leases.get(key)
            if held is not None and not held.holders and not held.queue:
                del self._leases[key]
            else:
                self._expiring_leases.written(key)
        return result

    def _log(self, key: str, now: int) -> _MemoryLog:
        log = self._logs.get(key)
        if log is None or (log.expires_at and log.expires_at + KEPT_US <= now):
            log = self._logs[key] = _MemoryLog()
            log.born = now
        return log

    def fingerprint(self, namespace: str, value: str, keep: bool = True) -> str | None:
        """As :meth:`Backend.fingerprint`: by the host's clock (a record lasts a month),
        apart from the keys' operations, whose clock may be a test's."""
        now = int(time.time() * 1_000_000)
        with self._lock:
            held, expires = self._records.get(namespace, (value, 0))
            told, write = kept_record(held if expires > now else None, value, keep)
            if write:
                self._records[namespace] = (value, now + RECORD_TTL_US)
        return told

    def cards(self, store_keys: Sequence[str]) -> dict[str, str]:
        with self._lock:
            now, found = self._seen, {key: self._cards.get(key) for key in store_keys}
        return {key: card[0] for key, card in found.items() if card and card[1] > now}

    def pushback(self, store_keys: Sequence[str]) -> dict[str, Pushback]:
        with self._lock:
            now, found = self._seen, [(key, self._pushback.get(key)) for key in store_keys]
        return in_force(found, now)

    def all_cards(self, namespace: str | None = None) -> Iterator[tuple[str, str]]:
        prefix = namespace_prefix(namespace)
        with self._lock:
            now, every = self._seen, list(self._cards.items())
        return iter(
            [(k, text) for k, (text, expires) in every if expires > now and k.startswith(prefix)]
        )

    def to_async(self) -> InlineAsync:
        """What AsyncLimiter uses: the same store, called inline (it never blocks)."""
        return InlineAsync(self)

    def __repr__(self) -> str:
        return f"MemoryBackend(keys={len(self._logs)})"


class _MemoryBeside:
    """What the store keeps beside its keys (``beside.BesideView``): its dicts, each kind
    scheduled to be forgotten once its time is up (``expiries``)."""

    def __init__(
        self,
        cards: Expiring[tuple[str, int]],
        pushback: Expiring[PushbackRecord],
        history: Expiring[tuple[dict[str, int], int]],
    ) -> None:
        self.cards, self.pushback, self.history = cards, pushback, history

    def card(self, key: str, now: int) -> str | None:
        found = self.cards.items.get(key)
        return found[0] if found is not None and found[1] > now else None

    def keep_card(self, key: str, text: str, expires: int) -> None:
        self.cards.items[key] = (text, expires)
        self.cards.written(key)

    def pushback_of(self, key: str) -> PushbackRecord | None:
        return self.pushback.items.get(key)

    def keep_pushback(self, key: str, record: PushbackRecord, now: int) -> None:
        self.pushback.items[key] = record
        self.pushback.written(key)

    def history_of(self, key: str, now: int) -> dict[str, int]:
        # (One past its time is counted in as it is: history.record drops the periods
        # no longer kept when a new one begins.)
        return self.history.items.get(key, ({}, 0))[0]

    def keep_history(self, key: str, fields: dict[str, int], expires: int) -> None:
        self.history.items[key] = (fields, expires)
        self.history.written(key)

    def forget(self, key: str) -> None:
        for kind in (self.cards, self.pushback, self.history):
            kind.items.pop(key, None)
