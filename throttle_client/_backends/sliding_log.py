"""The sliding-window log algorithm of docs/design.md §1, written once over a small storage view.

The memory and SQLite backends run this module. The Redis Lua script
(``lua/*.lua``, joined by redis.py) runs the same algorithm, step for step, over a storage
laid out for as few Redis calls as possible (see its header); the test suite holds
all of them to a naive reference model, on the same random sequences.

A key's log is a list of admitted calls in slot order. Each entry keeps its slot
time ``t`` and ``cum``, the running total of costs up to and including it. Because
slots never go backwards, time order and ``cum`` order agree, so "how much cost
lies after time X" and "when did the running total cross Y" are both one indexed
lookup: the work per decision is O(log n) per rate, whatever the cost of a call.
Entries older than the longest exact window are trimmed (5 s when every rate is
bounded, below); ``base`` is the running total at the newest trimmed entry.

A bounded rate (Rate.bounded, docs/design.md §1 "Bounded rates") counts in a coarse log
of its own instead (:class:`Coarse`): one entry per bucket, at the bucket's last moment,
carrying the key's running total after the bucket's last call. The window arithmetic
below runs over it unchanged, so it counts each call as if it came at the end of its
bucket: in a window until the bucket's last moment leaves it. That is never fewer than
the calls' own slots count (never over the limit), and holds a call back at most one
bucket longer. A calendar rate's buckets end at its windows' boundaries (the end, and
the margin before it), the only times its windows are read at: exact there.
"""

from __future__ import annotations

import logging
import threading
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from typing import Protocol, TypeVar, cast

from .answers import Snapshot, Verdict
from .ops import Acquire, AcquireAll, Charge, Inspect, Learn, Op, Pause, Reset
from .quota import Buckets, Period, Quota, Windows

T = TypeVar("T")
MAX_TIME = 2**63  # after any time a store works with (see _ranges)
logger = logging.getLogger("throttle_client")


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
    # What the upstream said (base.Learn): (since, until, limit, from_cum), or None.
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

    def first_after(self, t: int) -> int | None:
        """Slot of the oldest entry with slot > t."""

    def append(self, t: int, cost: int, call_id: str) -> None:
        """Log a call at ``t``; updates ``last`` and ``total``."""

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


class Counts(Protocol):
    """What the window arithmetic reads: a key's log, or one of its coarse logs."""

    @property
    def total(self) -> int: ...
    @property
    def base(self) -> int: ...
    @property
    def trimmed(self) -> int: ...
    def time_at_cum(self, target: int) -> int: ...
    def cum_through(self, t: int) -> int: ...


class Coarse:
    """A bounded rate's log: ``(slot, running total)`` entries, one per bucket at the
    bucket's last moment. The first entry is the base: every unit up to its total lies
    at or before its slot, which is before every window still read (the marker a trim
    leaves), so no separate ``base`` has to be kept. One entry per bucket from the
    window's start to the newest booked slot: about ``buckets + 3`` for a sliding rate
    (its window widened by the margin) while no call is booked further ahead."""

    __slots__ = ("cums", "times")

    def __init__(self, flat: Sequence[int]) -> None:
        """From ``[slot, total, slot, total, ...]`` (:meth:`flat`)."""
        self.times = list(flat[0::2])
        self.cums = list(flat[1::2])

    @property
    def total(self) -> int:
        return self.cums[-1]

    @property
    def base(self) -> int:
        return self.cums[0]

    @property
    def trimmed(self) -> int:  # (the base's units all lie at or before its slot)
        return self.times[0]

    def flat(self) -> list[int]:
        return [n for pair in zip(self.times, self.cums, strict=True) for n in pair]

    def time_at_cum(self, target: int) -> int:
        return self.times[bisect_left(self.cums, target)]

    def cum_through(self, t: int) -> int:
        index = bisect_right(self.times, t)
        return self.cums[index - 1] if index else self.cums[0]

    def add(self, placed: int, cost: int) -> None:
        """``cost`` more in the bucket ending at ``placed`` (a bucket before the newest
        one's end, which never comes from a slot: counted in the newest, later)."""
        if placed <= self.times[-1]:
            self.cums[-1] += cost
        else:
            self.times.append(placed)
            self.cums.append(self.cums[-1] + cost)

    def trim(self, cutoff: int) -> None:
        """Drop the entries no window from now on reads: all before the newest entry at
        or before ``cutoff``, which stays as the base."""
        index = bisect_right(self.times, cutoff) - 1
        if index > 0:
            del self.times[:index], self.cums[:index]


def coarse_of(log: LogView, name: str) -> Coarse:
    """The key's coarse log ``name``, holding every unit the key's log holds. A key
    without one (new, or its rate just made bounded, or lost: the stores keep it with
    the meta) begins one; units it lacks (calls booked while the rate was not bounded)
    are put at the newest slot, as a lost log is repaired: never too few. Either is kept
    only when a call is booked in it (:func:`book`), on every store alike."""
    coarse = log.coarse(name)
    if coarse is None or coarse.total > log.total:
        return Coarse([0, log.total] if log.last is None else [0, 0, log.last, log.total])
    if coarse.total < log.total:
        assert log.last is not None
        coarse = Coarse(coarse.flat())  # (a copy: the stored one is left as it is)
        coarse.add(log.last, log.total - coarse.total)
    return coarse


def counted_before(log: LogView, quota: Quota, t: int, now: int) -> int | None:
    """Units before ``t`` as the coarse logs of the key's bounded rates whose windows
    still reach ``t`` count them: none more than there were (each counts a call at its
    bucket's end, never earlier), so the largest is a lower bound, which errs towards
    counting more from ``t`` on. (Such a log's base lies before every window it still
    reads, so before ``t``.) None when no bounded rate's window reaches ``t``."""
    bounds = [
        coarse_of(log, name).cum_through(t - 1)
        for name, (_, cutoff) in _coarse_rates(quota, now).items()
        if cutoff < t
    ]
    return max(bounds, default=None)


def counts(log: LogView, period: Period) -> Counts:
    """The log that counts a rate: its coarse log if it is bounded, else the key's."""
    name = "" if isinstance(period, int) else period.name
    return coarse_of(log, name) if name else log


def placed(period: Buckets | Windows, slot: int) -> int:
    """The last moment of the bucket that counts a call at ``slot``: of its bucket of
    ``width_us``, or of its calendar window, or of the margin before that window's end
    (a slot there counts in the next window too); Stale if its window is not given."""
    if isinstance(period, Buckets):
        width = period.width_us
        return slot - slot % width + width - 1
    end = period.spans[counting(period, slot)[0]][1]
    return end - period.margin_us - 1 if slot < end - period.margin_us else end - 1


def book(log: LogView, quota: Quota, slot: int, cost: int, call_id: str, now: int) -> None:
    """Log a call at ``slot``: in each of its bounded rates' coarse logs (once per
    log), then in the key's own; trims both, and keeps the key as long as they matter."""
    for name, (period, cutoff) in _coarse_rates(quota, now).items():
        coarse = coarse_of(log, name)
        coarse.add(placed(period, slot), cost)
        coarse.trim(cutoff)
        log.keep_coarse(name, coarse)
    log.append(slot, cost, call_id)
    log.trim(quota.keep_from(now) - 1)  # (a learned limit needs none of them)
    log.expire_at(max(slot, log.pause_until) + quota.horizon_us)


def _coarse_rates(quota: Quota, now: int) -> dict[str, tuple[Buckets | Windows, int]]:
    """A quota's coarse logs by name: the period of a bounded rate counted in it, and
    the slot at or before which no window from ``now`` on reads it."""
    rates: dict[str, tuple[Buckets | Windows, int]] = {}
    for _, period in quota.limits:
        if isinstance(period, Buckets):
            rates[period.name] = (period, now - period.period_us)
        elif isinstance(period, Windows) and period.name:
            rates[period.name] = (period, period.keep_from - period.margin_us - 1)
    return rates


def sliding(period: Period) -> int | None:
    """A sliding rate's period in µs (exact or bounded); None for a calendar rate."""
    if isinstance(period, int):
        return period
    return period.period_us if isinstance(period, Buckets) else None


def fits_at(log: Counts, limit: int, period: int, cost: int) -> int:
    """When ``cost`` more fits under one sliding rate, as far as it goes (0: at any time).

    Slots never go backwards, so every entry lies at or before any new slot: the window
    ending there must drop every entry up to the one at which the running total reaches
    total - limit + cost; if that one is already trimmed, it lies at or before
    ``trimmed`` (which a log's own rates have long left behind).
    """
    target = log.total - limit + cost
    if target <= 0:
        return 0
    return (log.time_at_cum(target) if target > log.base else log.trimmed) + period


# -- calendar rates (issue 11) ---------------------------------------------------------------
# A calendar rate counts the units of each fixed window, from its start less the margin to
# its end (see base.Windows). A slot counts in its own window and, within the margin of
# that window's end, in the next one too. Slots never go backwards, so a new slot lies at
# or after every entry: a window that is full at the earliest slot moves it to the
# window's end, where the next window holds nothing but entries within the margin of its
# start; so a rate moves a slot at most twice, and the other constraints, met at the
# earlier slot, stay met at the later one.


class Stale(Exception):
    """A decision needs a calendar window the limiter did not give: ``at`` is the time."""

    def __init__(self, at: int) -> None:
        super().__init__(at)
        self.at = at


def counting(windows: Windows, slot: int) -> range:
    """The indices of the given windows that count ``slot``: its own, and the next one
    too within the margin of its end; Stale if one of them is not given."""
    spans, margin = windows.spans, windows.margin_us
    own = bisect_right(spans, (slot, MAX_TIME)) - 1
    if own < 0 or slot >= spans[own][1]:
        raise Stale(slot)
    if slot < spans[own][1] - margin:
        return range(own, own + 1)
    if own + 1 == len(spans) or spans[own + 1][0] != spans[own][1]:
        raise Stale(slot)
    return range(own, own + 2)


def counted(log: LogView, windows: Windows, i: int) -> int:
    """Units window ``i`` counts: slots from the margin before its start to its end."""
    start, end = windows.spans[i]
    source = counts(log, windows)
    return source.cum_through(end - 1) - source.cum_through(start - windows.margin_us - 1)


def since_keep_from(log: LogView, windows: Windows, through: int | None = None) -> int:
    """Units in the window that holds now (it starts at ``keep_from``), through
    ``through`` (None: every booked slot, of this window or later: an upper bound).
    (The key's log gives ``through``: a bounded rate's coarse log is exact only at
    its windows' boundaries, and the running totals are the key's in both.)"""
    older = counts(log, windows).cum_through(windows.keep_from - windows.margin_us - 1)
    return (log.total if through is None else log.cum_through(through)) - older


def calendar_slot(log: LogView, quota: Quota, slot: int, cost: int, *, learned: bool = True) -> int:
    """The earliest slot from ``slot`` at which ``cost`` fits every calendar rate, and
    (``learned``) the limit learned from the upstream: a window of its own, which moves
    a slot inside it that does not fit to its end, the upstream's reset."""
    moved = True
    while moved:
        moved = False
        for limit, period in quota.limits:
            if isinstance(period, Windows):
                for i in counting(period, slot):
                    if counted(log, period, i) + cost > limit:
                        slot, moved = period.spans[i][1], True
                        break
        if learned and log.learned is not None:
            since, until, limit, _ = log.learned
            if since <= slot < until and learned_units(log) + cost > limit:
                slot, moved = until, True
    return slot


def learned_units(log: LogView) -> int:
    """Units a learned limit counts: slots from its ``since`` up to its ``until``. Slots
    never go backwards, so every entry after the running total it starts from
    (``from_cum``, marked when the answered call was admitted) lies from ``since`` on:
    that count holds whatever has been trimmed since."""
    assert log.learned is not None
    _, until, _, from_cum = log.learned
    return log.cum_through(until - 1) - from_cum


def mark(log: LogView, op: Acquire | AcquireAll, slot: int) -> int:
    """Verdict.mark for an admitted call at ``slot``, if it asked for it."""
    return log.cum_through(slot - op.mark_us - 1) if op.mark_us >= 0 else -1


def check_now(quota: Quota, now: int) -> None:
    """Stale unless every calendar rate's windows begin at or before ``now``."""
    for _, period in quota.limits:
        if isinstance(period, Windows) and now < period.keep_from:
            raise Stale(now)


def earliest_slot(log: LogView, quota: Quota, now: int, cost: int) -> int:
    """docs/design.md §1: max(now, last + gap, pause, and for each rate the time the cost
    fits); then the calendar windows, which may move it on (Stale: windows missing)."""
    check_now(quota, now)
    slot = max(now, log.pause_until)
    if log.last is not None:
        slot = max(slot, log.last + quota.min_interval_us)
    for limit, period in quota.limits:
        length = sliding(period)
        if length is not None:
            slot = max(slot, fits_at(counts(log, period), limit, length, cost))
    return calendar_slot(log, quota, slot, cost)


def remaining_at(log: LogView, quota: Quota, point: int) -> tuple[int, ...]:
    """Per rate, the units still free in the window that ends at ``point`` (a calendar
    rate: in the windows that count it; outside the windows given, in the one that holds
    now, every booked unit counted)."""
    free = []
    for limit, period in quota.limits:
        length = sliding(period)
        if length is not None:
            used = log.total - counts(log, period).cum_through(point - length)
        else:
            assert isinstance(period, Windows)
            try:
                used = max(counted(log, period, i) for i in counting(period, point))
            except Stale:
                used = since_keep_from(log, period)
        free.append(max(0, limit - used))
    return tuple(free)


# How a key's life began (LogView.life): afresh, at a reset, after its history was lost
# (and held), or rebuilt from its own log.
LIFE_AFRESH, LIFE_RESET, LIFE_HELD, LIFE_REBUILT = 0, 1, 2, 3


def lost_history(log: LogView, quota: Quota, expect: int, seen: int, now: int) -> bool:
    """A store that lost a key's recent history (a file replaced, or restored from an
    older copy) would give its calls a second quota. A worker that booked on the key
    within its horizon says which life of it it knows (``expect``) and the running total
    it saw (``seen``). A key begun afresh since (not at a reset, not rebuilt from its
    log) lost its history: it is held as if every window had been full when it began
    again. One of that life that counts fewer units lost its latest calls: held as if
    full now. Once per life. True if this call held it (the Lua script's
    ``lost_history``)."""
    if expect < 0 or log.life == LIFE_HELD:
        return False
    if log.born != expect:
        if log.life != LIFE_AFRESH:
            return False
        held = quota.counts_until(log.born)
    elif seen > log.total:
        held = quota.counts_until(now)
    else:
        return False
    if held > log.pause_until:
        log.set_pause(held)
        log.expire_at(max(held, log.last or 0) + quota.horizon_us)  # (the hold is kept)
    log.set_life(LIFE_HELD)
    return True


def hold_lost(logs: Sequence[LogView], charges: Sequence[Charge], now: int) -> bool:
    """:func:`lost_history` for each key of a call: whether any was held by this call."""
    held = [
        lost_history(log, c.quota, c.expect, c.seen, now)
        for log, c in zip(logs, charges, strict=True)
    ]
    return any(held)


def told(verdict: Verdict, logs: Sequence[LogView], lost: bool) -> Verdict:
    """``verdict`` with what every answer to an acquire ends with: each key's life and
    running total, and whether the call held a key that lost its history."""
    lives = tuple(log.born for log in logs)
    return verdict._replace(lives=lives, totals=tuple(log.total for log in logs), lost=lost)


def acquire(log: LogView, op: Acquire, now: int) -> Verdict:
    lost = lost_history(log, op.quota, op.expect, op.seen, now)
    booked = log.slot_of(op.call_id)
    if booked is not None:  # the same call again (a driver retry): it already holds its slot
        # (Not marked: entries before it may be trimmed since it was booked.)
        remaining = remaining_at(log, op.quota, booked)
        return told(Verdict(True, now, booked, log.pause_until, remaining), [log], lost)
    try:
        slot = earliest_slot(log, op.quota, now, op.cost)
        if now + op.lead_us > slot:  # a slot the lead moves on must fit the windows there too
            slot = calendar_slot(log, op.quota, now + op.lead_us, op.cost)
    except Stale as stale:  # nothing written: the limiter asks again with windows there
        return Verdict(False, now, stale.at, log.pause_until, (), stale=True)
    if op.max_wait_us >= 0 and slot - now > op.max_wait_us:
        # Refused: nothing is written, so a refusal leaves no trace.
        remaining = remaining_at(log, op.quota, now)
        return told(Verdict(False, now, slot, log.pause_until, remaining), [log], lost)
    marked = mark(log, op, slot)  # before this call's own entry
    book(log, op.quota, slot, op.cost, op.call_id, now)
    remaining = remaining_at(log, op.quota, slot)
    born = log.born if marked >= 0 else -1
    verdict = Verdict(True, now, slot, log.pause_until, remaining, mark=marked, born=born)
    return told(verdict, [log], lost)


def acquire_all(logs: Sequence[LogView], op: AcquireAll, now: int) -> Verdict:
    """:class:`AcquireAll` over the logs of its charges, in order."""
    charges = op.charges
    pairs = list(zip(logs, charges, strict=True))
    lost = hold_lost(logs, charges, now)
    pause_until = max(log.pause_until for log in logs)
    booked = logs[0].slot_of(op.call_id)
    if booked is not None:  # the same call again: it holds its slot in every log (unmarked)
        remaining = remaining_all(logs, charges, booked)
        return told(Verdict(True, now, booked, pause_until, remaining), logs, lost)
    # Past a log's newest slot a window only loses entries as time goes on: the latest
    # of the keys' earliest slots is the earliest that suits them all, once it also fits
    # every key's calendar windows (which may move it on: so round again until it stays).
    try:
        slot = max(
            now + op.lead_us, *(earliest_slot(log, c.quota, now, c.cost) for log, c in pairs)
        )
        while (later := max(calendar_slot(log, c.quota, slot, c.cost) for log, c in pairs)) != slot:
            slot = later
    except Stale as stale:
        return Verdict(False, now, stale.at, pause_until, (), stale=True)
    if op.max_wait_us >= 0 and slot - now > op.max_wait_us:
        remaining = remaining_all(logs, charges, now)
        return told(Verdict(False, now, slot, pause_until, remaining), logs, lost)
    marked = mark(logs[0], op, slot)  # before this call's own entry
    for log, charge in pairs:
        book(log, charge.quota, slot, charge.cost, op.call_id, now)
    remaining = remaining_all(logs, charges, slot)
    born = logs[0].born if marked >= 0 else -1
    verdict = Verdict(True, now, slot, pause_until, remaining, mark=marked, born=born)
    return told(verdict, logs, lost)


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
    used, ready = [], []
    try:
        next_slot = earliest_slot(log, op.quota, now, 1)
        for limit, period in op.quota.limits:
            length = sliding(period)
            if length is not None:
                source = counts(log, period)
                used.append(through_now - source.cum_through(now - length))
                ready.append(max(now, fits_at(source, limit, length, 1)))
            else:
                assert isinstance(period, Windows)
                if period.spans[0][0] == period.keep_from and now >= period.spans[0][1]:
                    raise Stale(now)  # now is past the window the limiter took for now's
                alone = Quota(((limit, period),), 0)  # when a call of cost 1 fits this rate
                used.append(since_keep_from(log, period, now))
                ready.append(calendar_slot(log, alone, now, 1, learned=False))
    except Stale as stale:
        return Snapshot(now, stale.at, log.pause_until, 0, (), (), stale=True)
    learned = None
    if log.learned is not None and log.learned[1] > now:
        learned = (log.learned[2], learned_units(log), log.learned[1])
    return Snapshot(
        now_us=now,
        next_slot_us=next_slot,
        pause_until_us=log.pause_until,
        booked=log.total - through_now,
        used=tuple(used),
        ready_at_us=tuple(ready),
        learned=learned,
    )


def pause(log: LogView, op: Pause, now: int) -> int:
    until = now + op.duration_us
    if until > log.pause_until:  # a pause only ever moves forward
        log.set_pause(until)
        log.expire_at(max(until, log.last or 0) + op.quota.horizon_us)
    return log.pause_until


def learn(log: LogView, op: Learn, now: int) -> None:
    """Hold the key to what the upstream said, unless a newer report holds already."""
    old = log.learned
    if op.until_us <= now or (old is not None and old[1] > now and op.since_us < old[0]):
        return
    from_cum = op.from_cum
    if from_cum < 0:  # not marked: read from the log, if it still holds every entry needed
        if op.since_us >= op.quota.keep_from(now):
            from_cum = log.cum_through(op.since_us - 1)
        else:
            # An answer that came back later than the log keeps its entries (the
            # longest exact window; 5 s with only bounded rates): the bounded rates'
            # coarse logs may still say how many came before, never too many; else it
            # is ignored, as counting too few would let too many through.
            before = counted_before(log, op.quota, op.since_us, now)
            if before is None:
                return
            from_cum = before
    elif op.born != log.born or from_cum > log.total:  # the key was forgotten since: count all
        from_cum = 0
    log.set_learned((op.since_us, op.until_us, op.limit, from_cum))
    # The entries it counts must last until its end.
    log.expire_at(max(op.until_us, max(log.last or 0, log.pause_until) + op.quota.horizon_us))


def execute(log: LogView, op: Op[T], now: int) -> T:
    """Run ``op`` on ``log`` at ``now`` (µs); the caller provides atomicity."""
    if isinstance(op, Acquire):
        return cast(T, acquire(log, op, now))
    if isinstance(op, Inspect):
        return cast(T, inspect(log, op, now))
    if isinstance(op, Pause):
        return cast(T, pause(log, op, now))
    if isinstance(op, Learn):
        return cast(T, learn(log, op, now))
    if isinstance(op, Reset):
        # What a reset leaves is a key begun again at the reset, no older than the one
        # forgotten: a worker that knew that one does not take it for a store that lost
        # it (lost_history).
        forgotten = log.born  # (the new life begins after it: never the same, see Lives)
        log.delete()
        log.begin(max(now, forgotten + 1), LIFE_RESET)
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
#
# Or the summary reads well and holds what no step writes (a hand in the store, a backup
# restored): numbers out of range or at odds with each other, or with the newest entry,
# which the stores read with the summary at no extra cost. A summary that counts fewer
# units than the entries hold (or says there are none) is rebuilt from them as if lost,
# its pause kept ("damaged"); entries that hold fewer units than it counts get the
# missing ones at the newest slot ("log"). A time further ahead than any limiter sets
# (_ranges.FAR_AHEAD_US) has no such repair: the store refuses the key, by name, until
# it is reset.


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
