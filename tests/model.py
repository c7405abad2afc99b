"""A naive reference model of the limiter's semantics, for the property tests.

Deliberately the slowest obvious reading of the spec: every admitted call is kept
forever in a plain list of (time, cost), every window sum is a brute-force sum, and
the earliest slot is found by trying candidate times in order. It shares no code
with ``throttle_client._backends.sliding_log`` (which keeps running totals, trims, and answers by
indexed lookups), so agreement between the two means something.

All times are whole microseconds.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Calendar:
    """A calendar rate's fixed windows: ``bounds(t)`` is the (start, end) of the window
    holding t (the library's CalendarWindow, which tests/test_calendar.py checks on its
    own). A window counts every entry from ``margin`` before its start to its end."""

    bounds: Callable[[int], tuple[int, int]]
    margin: int
    bounded: bool = False  # counted per window (Rate.bounded): the same counts, exactly

    def placed(self, t: int) -> int:
        """Where a bounded one counts an entry: at the end of its window, or of the
        margin before that end."""
        end = self.bounds(t)[1]
        return end - self.margin - 1 if t < end - self.margin else end - 1

    def counting(self, slot: int) -> list[tuple[int, int]]:
        """The windows that count an entry at ``slot``: tried one by one."""
        own = self.bounds(slot)
        after = self.bounds(own[1])
        return [own] + ([after] if slot >= after[0] - self.margin else [])


@dataclass(frozen=True)
class Bucketed:
    """A bounded sliding rate (Rate.bounded): each call counts as if it came at the last
    moment of its bucket of ``width`` (epoch-aligned), in windows of ``period``."""

    period: int
    width: int

    def placed(self, t: int) -> int:
        return t - t % self.width + self.width - 1


# How long a store keeps a logged call at least (base.KEEP_IDS_US): a key with only
# bounded rates keeps no more, which decides which reports of the upstream it can count.
KEEP_IDS = 5_000_000


@dataclass(frozen=True)
class Outcome:
    """What try_acquire / acquire answered (an acquire that timed out: allowed=False)."""

    allowed: bool
    slot: int
    retry_after: int
    remaining: tuple[int, ...]
    paused_until: int | None


@dataclass(frozen=True)
class ModelUsage:
    used: tuple[int, ...]
    booked: int
    remaining: tuple[int, ...]
    resets_in: tuple[int, ...]
    next_slot_in: int
    paused_for: int


@dataclass
class KeyLog:
    entries: list[tuple[int, int]] = field(default_factory=list)  # (slot, cost), never trimmed
    pause_until: int = 0
    # (since, until, limit, before): from the upstream; it counts the units of slots
    # before ``until`` less ``before`` (those of slots before ``since``, or fewer).
    learned: tuple[int, int, int, int] | None = None


@dataclass
class Model:
    """``rates`` as (limit, period µs or Calendar) pairs; ``min_interval`` in µs."""

    rates: list[tuple[int, Any]]
    min_interval: int
    logs: dict[str, KeyLog] = field(default_factory=dict)

    def _log(self, key: str) -> KeyLog:
        return self.logs.setdefault(key, KeyLog())

    @staticmethod
    def _in_window(log: KeyLog, end: int, period: int | Bucketed) -> int:
        """Cost of the entries after ``end - period``. Entries booked after ``end``
        count too: they are promised, so they are not free. A bounded rate counts an
        entry until the end of its bucket leaves the window."""
        if isinstance(period, Bucketed):
            return sum(c for t, c in log.entries if period.placed(t) > end - period.period)
        return sum(cost for t, cost in log.entries if t > end - period)

    @staticmethod
    def _in_calendar(log: KeyLog, window: tuple[int, int], margin: int) -> int:
        start, end = window
        return sum(cost for t, cost in log.entries if start - margin <= t < end)

    def _used_at(self, log: KeyLog, slot: int, period: Any) -> int:
        """Units counted against a call at ``slot`` (a calendar rate: the fullest window
        of those that would count it)."""
        if isinstance(period, Calendar):
            return max(self._in_calendar(log, w, period.margin) for w in period.counting(slot))
        return self._in_window(log, slot, period)

    def _fits(self, log: KeyLog, slot: int, cost: int, learned: bool = True) -> bool:
        if learned and log.learned is not None:
            since, until, limit, _ = log.learned
            if since <= slot < until and self._learned_units(log) + cost > limit:
                return False
        return all(self._used_at(log, slot, period) + cost <= limit for limit, period in self.rates)

    @staticmethod
    def _learned_units(log: KeyLog) -> int:
        assert log.learned is not None
        _, until, _, before = log.learned
        return sum(cost for t, cost in log.entries if t < until) - before

    @staticmethod
    def _first(
        floor: int,
        logs: list[tuple[Model, KeyLog]],
        fits: Callable[[int], bool],
        more: set[int] = frozenset(),  # type: ignore[assignment]
    ) -> int:
        """The first moment from ``floor`` on at which ``fits``, tried in order among the
        floor and every later moment at which some window sum may drop: an entry leaving
        a sliding window, or the end of a calendar window that counts a moment tried."""
        moments = {floor} | {
            period.placed(t) + period.period if isinstance(period, Bucketed) else t + period
            for model, log in logs
            for _, period in model.rates
            if not isinstance(period, Calendar)
            for t, _ in log.entries
        }
        moments |= {log.learned[1] for _, log in logs if log.learned is not None} | more
        heap = sorted(m for m in moments if m >= floor)
        while True:
            moment = heapq.heappop(heap)
            if fits(moment):
                return moment
            for model, _ in logs:
                for _, period in model.rates:
                    if isinstance(period, Calendar):
                        for _, end in period.counting(moment):
                            if end not in moments:
                                moments.add(end)
                                heapq.heappush(heap, end)

    def _fits_between(self, log: KeyLog, slot: int, cost: int) -> bool:
        """Whether ``cost`` fits at ``slot`` with ``log``'s bookings where they are, some
        of them later (exact sliding rates): the gap on both sides, and each window
        (end - period, end] that would hold it, ending from ``slot`` to a period after."""
        if any(abs(t - slot) < self.min_interval for t, _ in log.entries):
            return False
        for limit, period in self.rates:
            ends = {slot} | {t for t, _ in log.entries if slot < t < slot + period}
            for end in ends:
                held = sum(c for t, c in log.entries if end - period < t <= end)
                if held + cost > limit:
                    return False
        return True

    def _never_over(self, log: KeyLog) -> bool:
        """No window of any exact rate holds more than its limit, nor are two calls
        nearer than the gap."""
        slots = [t for t, _ in log.entries]
        if any(b - a < self.min_interval for a, b in itertools.pairwise(slots)):
            return False
        return all(
            sum(c for t, c in log.entries if end - period < t <= end) <= limit
            for limit, period in self.rates
            if isinstance(period, int)
            for end in slots
        )

    def earliest_slot(self, key: str, now: int, cost: int) -> int:
        return self._earliest(self.logs.get(key, KeyLog()), now, cost)

    def _earliest(self, log: KeyLog, now: int, cost: int) -> int:
        floor = max(now, log.pause_until)
        if log.entries:
            floor = max(floor, log.entries[-1][0] + self.min_interval)
        return self._first(floor, [(self, log)], lambda slot: self._fits(log, slot, cost))

    def _remaining(self, log: KeyLog, point: int) -> tuple[int, ...]:
        return tuple(
            max(0, limit - self._used_at(log, point, period)) for limit, period in self.rates
        )

    def _outcome(self, log: KeyLog, allowed: bool, now: int, slot: int) -> Outcome:
        return Outcome(
            allowed=allowed,
            slot=slot,
            retry_after=0 if allowed else slot - now,
            remaining=self._remaining(log, slot if allowed else now),
            paused_until=log.pause_until if log.pause_until > now else None,
        )

    def acquire(self, key: str, now: int, cost: int = 1, max_wait: int | None = None) -> Outcome:
        """try_acquire is ``max_wait=0``; ``None`` waits for any slot."""
        if any(cost > limit for limit, _ in self.rates):
            raise ValueError(f"cost {cost} can never be admitted")
        log = self._log(key)
        slot = self._earliest(log, now, cost)
        self._check_bounded(log, now, cost, slot)
        if max_wait is not None and slot - now > max_wait:
            return self._outcome(log, False, now, slot)
        log.entries.append((slot, cost))
        for limit, period in self.rates:  # by the calls' own slots, never over any limit
            if isinstance(period, Bucketed):
                assert self._in_window(log, slot, period.period) <= limit
        return self._outcome(log, True, now, slot)

    def acquire_any(
        self, keys: list[str], now: int, horizon: int, cost: int = 1, max_wait: int | None = None
    ) -> tuple[str, Outcome]:
        """A pool's call: ``acquire`` on the key whose slot is earliest; of equal ones the
        key whose newest booking is the oldest (none, or one ``horizon`` or more ago: -1),
        then the first. The key it took, and its outcome."""
        if any(cost > limit for limit, _ in self.rates):
            raise ValueError(f"cost {cost} can never be admitted")

        def newest(key: str) -> int:
            entries = self.logs[key].entries if key in self.logs else []
            return entries[-1][0] if entries and entries[-1][0] + horizon > now else -1

        ranks = [(self.earliest_slot(key, now, cost), newest(key)) for key in keys]
        key = keys[ranks.index(min(ranks))]
        return key, self.acquire(key, now, cost, max_wait)

    def _check_bounded(self, log: KeyLog, now: int, cost: int, slot: int) -> None:
        """The promise of bounded rates, on this very log: a slot from the exact one to
        one bucket later (without calendar rates, whose window ends it could cross)."""
        widths = [p.width for _, p in self.rates if isinstance(p, Bucketed)]
        if not widths or any(isinstance(p, Calendar) for _, p in self.rates):
            return
        exact = Model(
            [(limit, p.period if isinstance(p, Bucketed) else p) for limit, p in self.rates],
            self.min_interval,
        )
        earliest = exact._earliest(log, now, cost)
        assert earliest <= slot <= earliest + max(widths), (earliest, slot, widths)

    def pause(self, key: str, now: int, duration: int) -> int:
        log = self._log(key)
        log.pause_until = max(log.pause_until, now + duration)
        return log.pause_until

    def learn(self, key: str, now: int, since: int, until: int, limit: int) -> None:
        """What the upstream said: at most ``limit`` units in slots [since, until). The
        newest report (the latest ``since``) replaces one still in force."""
        log = self._log(key)
        old = log.learned

        # A report counting from before what every window still looks at is ignored
        # (Limiter.learn given a Decision of acquire(), which marks nothing: the store
        # may have dropped entries it would count). Before what the stores keep of the
        # calls themselves (the exact rates' windows; 5 s with only bounded rates), the
        # units before ``since`` are as the bounded rates whose windows reach it count
        # them, by their buckets' ends: the most of those.
        def keep(period: Any) -> int:
            if isinstance(period, Calendar):
                return period.bounds(now)[0] - period.margin
            return now - (period.period if isinstance(period, Bucketed) else period) + 1

        def bounded(period: Any) -> bool:
            return isinstance(period, Bucketed) or (isinstance(period, Calendar) and period.bounded)

        exact = [keep(p) for _, p in self.rates if not bounded(p)]
        if since >= min(exact, default=now - KEEP_IDS):
            before = sum(cost for t, cost in log.entries if t < since)
        else:
            reaching = [p for _, p in self.rates if bounded(p) and keep(p) <= since]
            if not reaching:
                return
            before = max(
                sum(cost for t, cost in log.entries if p.placed(t) < since) for p in reaching
            )
        if until > now and (old is None or old[1] <= now or since >= old[0]):
            log.learned = (since, until, limit, before)

    def learned(self, key: str, now: int) -> tuple[int, int, int] | None:
        """(limit, units it counts, until) of a learned limit in force, or None."""
        log = self.logs.get(key, KeyLog())
        if log.learned is None or log.learned[1] <= now:
            return None
        return (log.learned[2], self._learned_units(log), log.learned[1])  # limit, units, until

    def reset(self, key: str) -> None:
        self.logs.pop(key, None)

    def usage(self, key: str, now: int) -> ModelUsage:
        log = self.logs.get(key, KeyLog())
        booked = sum(cost for t, cost in log.entries if t > now)
        used = tuple(
            self._in_calendar(log, (period.bounds(now)[0], now + 1), period.margin)
            if isinstance(period, Calendar)
            else self._in_window(log, now, period) - booked
            for _, period in self.rates
        )
        resets_in = []
        for limit, period in self.rates:
            # The first moment from now on at which one more unit fits this rate alone.
            alone = Model([(limit, period)], 0)
            # (As far as this rate goes: not a limit learned from the upstream.)
            fits = self._first(
                now, [(alone, log)], functools.partial(alone._fits, log, cost=1, learned=False)
            )
            resets_in.append(fits - now)
        return ModelUsage(
            used=used,
            booked=booked,
            remaining=tuple(
                max(0, limit - u - booked) for (limit, _), u in zip(self.rates, used, strict=True)
            ),
            resets_in=tuple(resets_in),
            next_slot_in=self._earliest(log, now, 1) - now,
            paused_for=max(0, log.pause_until - now),
        )


@dataclass
class StackedModel:
    """Several keys, each under its own rates and gap (one Model each), and calls charged
    to several of them at once: one slot, the first moment every key's quota allows,
    found by trying every candidate moment of every key (no use of the library's claim
    that the latest of the keys' earliest slots is that moment)."""

    models: dict[str, Model]

    def acquire_all(
        self, charges: list[tuple[str, int]], now: int, max_wait: int | None
    ) -> tuple[bool, int]:
        """(admitted, slot) for ``charges`` as (key, cost) pairs. The call's slot follows
        every booking of its own key (the first); in a key it shares (the others) it may
        fall between bookings, wherever every window that would hold it stays within its
        limit and the gap holds on both sides: a key with room is never held up by
        another key's calls booked later in it."""
        slot = self._slot(charges, now)
        if max_wait is not None and slot - now > max_wait:
            return False, slot
        for key, cost in charges:
            model, log = self.models[key], self.models[key]._log(key)
            log.entries.append((slot, cost))
            log.entries.sort()
            assert model._never_over(log), (slot, log.entries)  # by the calls' own slots
        return True, slot

    def acquire_any(
        self,
        keys: list[str],
        partners: list[tuple[str, int]],
        now: int,
        max_wait: int | None,
        horizon: int,
    ) -> tuple[str, bool, int]:
        """A pool's call charged to ``partners`` too: ``acquire_all`` on the key whose
        slot with them is earliest; of equal ones the key whose newest booking is the
        oldest (none, or one ``horizon`` or more ago: -1), then the first. The key it
        took, whether it was admitted, and its slot."""

        def newest(key: str) -> int:
            entries = self.models[key].logs[key].entries if key in self.models[key].logs else []
            return entries[-1][0] if entries and entries[-1][0] + horizon > now else -1

        ranks = [(self._slot([(key, 1), *partners], now), newest(key)) for key in keys]
        key = keys[ranks.index(min(ranks))]
        return (key, *self.acquire_all([(key, 1), *partners], now, max_wait))

    def _slot(self, charges: list[tuple[str, int]], now: int) -> int:
        """The slot of a call charged to ``charges``, writing nothing."""
        logs = [(self.models[key], self.models[key]._log(key), cost) for key, cost in charges]
        own_model, own, _ = logs[0]
        floor = max([now, *(log.pause_until for _, log, _ in logs)])
        if own.entries:
            floor = max(floor, own.entries[-1][0] + own_model.min_interval)
        near = {  # a shared key's booking ends the gap it keeps around it
            t + model.min_interval for model, log, _ in logs[1:] for t, _ in log.entries
        }

        def fits(s: int) -> bool:
            return own_model._fits(own, s, logs[0][2]) and all(
                model._fits_between(log, s, cost) for model, log, cost in logs[1:]
            )

        return Model._first(floor, [(model, log) for model, log, _ in logs], fits, near)


@dataclass
class CapModel:
    """Concurrency caps as a list of holders and a list of tickets per key, done the
    plainest way; rates and gaps come from a
    :class:`StackedModel`. A call is admitted when it holds, or may take, room under
    every cap and the rates allow its slot; else it waits in ticket order, or, if it
    may not wait, is refused with nothing written."""

    rates: StackedModel
    caps: dict[str, tuple[int, int]]  # key -> (cap, ttl); a key without one is uncapped
    holders: dict[str, dict[str, int]] = field(default_factory=dict)  # key -> id -> expiry
    tickets: dict[str, list[list[Any]]] = field(default_factory=dict)  # [number, id, alive]

    def _settle(self, key: str, now: int, granted: list[str]) -> None:
        cap, ttl = self.caps[key]
        held = self.holders.setdefault(key, {})
        for lease in [i for i, expiry in held.items() if expiry <= now]:
            del held[lease]
        while len(held) < cap and (first := self._head(key, now)) is not None:
            self._drop_ticket(key, first)
            held[first] = now + ttl
            granted.append(first)

    def _head(self, key: str, now: int) -> str | None:
        queue = self.tickets.setdefault(key, [])
        while queue and queue[0][2] <= now:  # dead tickets go when they reach the front
            queue.pop(0)
        return queue[0][1] if queue else None

    def _drop_ticket(self, key: str, lease: str) -> None:
        self.tickets[key] = [t for t in self.tickets.setdefault(key, []) if t[1] != lease]

    def acquire(
        self, lease: str, charges: list[tuple[str, int]], now: int, max_wait: int | None
    ) -> tuple[str, int, bool, list[str]]:
        """(``admitted`` | ``refused`` | ``waiting``, slot or hint, at the head, granted)."""
        granted: list[str] = []
        capped = [key for key, _ in charges if key in self.caps]
        for key in capped:
            self._settle(key, now, granted)
        full = [
            key
            for key in capped
            if lease not in self.holders[key]
            and not (
                len(self.holders[key]) < self.caps[key][0] and self._head(key, now) in (None, lease)
            )
        ]
        if not full:
            allowed, slot = self.rates.acquire_all(charges, now, max_wait)
            if allowed:  # held from now through the sleep to its slot, then the TTL
                for key in capped:
                    self._drop_ticket(key, lease)
                    self.holders[key][lease] = max(slot, now) + self.caps[key][1]
            return ("admitted" if allowed else "refused"), slot, False, granted
        hint = min((e for key in full for e in self.holders[key].values()), default=now)
        if max_wait == 0:
            return "refused", hint, False, granted
        number = 1 + max((t[0] for key in capped for t in self.tickets[key]), default=0)
        for key in capped:
            alive = now + self.caps[key][1]
            if key not in full:
                self._drop_ticket(key, lease)
                self.holders[key][lease] = alive
            else:
                mine = [t for t in self.tickets[key] if t[1] == lease]
                if mine:
                    mine[0][2] = alive
                else:
                    self.tickets[key].append([number, lease, alive])
        head = all(self._head(key, now) == lease for key in full)
        return "waiting", hint, head, granted

    def release(self, lease: str, keys: list[str], now: int) -> list[str]:
        granted: list[str] = []
        for key in keys:
            self.holders.setdefault(key, {}).pop(lease, None)
            self._drop_ticket(key, lease)
            self._settle(key, now, granted)
        return granted

    def renew(self, lease: str, keys: list[str], now: int) -> tuple[bool, list[str]]:
        granted: list[str] = []
        kept = True
        for key in keys:
            self._settle(key, now, granted)
            if lease not in self.holders[key]:
                kept = False
                self._drop_ticket(key, lease)
            self.holders[key][lease] = now + self.caps[key][1]
        return kept, granted

    def counts(self, key: str, now: int) -> tuple[int, int]:
        """(leases held, live tickets) of ``key`` at ``now``."""
        held = sum(1 for expiry in self.holders.get(key, {}).values() if expiry > now)
        return held, sum(1 for ticket in self.tickets.get(key, []) if ticket[2] > now)
