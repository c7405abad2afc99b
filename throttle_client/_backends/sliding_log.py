"""The sliding-window log algorithm, written once over a small storage view.

The memory and SQLite backends run this module. The Redis Lua script
(``lua/*.lua``, joined by redis_script.py) runs the same algorithm, step for step, over a storage
laid out for as few Redis calls as possible (see its header); the test suite holds
all of them to a naive reference model, on the same random sequences.

A key's log is a list of admitted calls in slot order. Each entry keeps its slot
time ``t`` and ``cum``, the running total of costs up to and including it. Time order
and ``cum`` order agree (a call booked among later entries of a key it shares moves
their totals up: ``filling``), so "how much cost lies after time X" and "when did the
running total cross Y" are both one indexed lookup: the work per decision is O(log n)
per rate, whatever the cost of a call.
Entries older than the longest exact window are trimmed (5 s when every rate is
bounded, below); ``base`` is the running total at the newest trimmed entry.

Bounded rates count in coarse logs of their own (``coarse``), calendar rates and a limit
learned from the upstream in fixed windows (``calendar_windows``); a store that lost part
of a key rebuilds it by the rules of ``repair`` ("partial state").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar, cast

from .answers import Snapshot, Verdict
from .calendar_windows import (
    Stale,
    calendar_slot,
    check_now,
    counted,
    counting,
    learned_units,
    since_keep_from,
)
from .coarse import Counts, coarse_of, coarse_rates, counted_before, counts
from .filling import Fills, fillable
from .log_view import LogView
from .ops import Acquire, AcquireAll, AcquireAny, Charge, Inspect, Learn, Op, Pause, Reset
from .quota import Buckets, Period, Quota, Windows

T = TypeVar("T")


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
    for name, (period, cutoff) in coarse_rates(quota, now).items():
        coarse = coarse_of(log, name)
        coarse.add(placed(period, slot), cost)
        coarse.trim(cutoff)
        log.keep_coarse(name, coarse)
    if log.last is not None and slot < log.last:  # among the bookings of a shared key
        log.insert(slot, cost, call_id)
    else:
        log.append(slot, cost, call_id)
    log.trim(quota.keep_from(now) - 1)  # (a learned limit needs none of them)
    log.expire_at(max(slot, log.pause_until) + quota.horizon_us)


def sliding(period: Period) -> int | None:
    """A sliding rate's period in µs (exact or bounded); None for a calendar rate."""
    if isinstance(period, int):
        return period
    return period.period_us if isinstance(period, Buckets) else None


def fits_at(log: Counts, limit: int, period: int, cost: int) -> int:
    """When ``cost`` more fits under one sliding rate, as far as it goes (0: at any time).

    A key's own calls are booked after its newest (``filling`` books a key a call
    shares otherwise), so every entry lies at or before a new slot: the window
    ending there must drop every entry up to the one at which the running total reaches
    total - limit + cost; if that one is already trimmed, it lies at or before
    ``trimmed`` (which a log's own rates have long left behind).
    """
    target = log.total - limit + cost
    if target <= 0:
        return 0
    return (log.time_at_cum(target) if target > log.base else log.trimmed) + period


def mark(log: LogView, op: Acquire | AcquireAll, slot: int) -> int:
    """Verdict.mark for an admitted call at ``slot``, if it asked for it."""
    return log.cum_through(slot - op.mark_us - 1) if op.mark_us >= 0 else -1


def earliest_slot(log: LogView, quota: Quota, now: int, cost: int) -> int:
    """The earliest slot: max(now, last + gap, pause, and for each rate the time the cost
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
    held = lost_hold(log, quota, expect, seen, now)
    if held is None:
        return False
    if held > log.pause_until:
        log.set_pause(held)
        log.expire_at(max(held, log.last or 0) + quota.horizon_us)  # (the hold is kept)
    log.set_life(LIFE_HELD)
    return True


def lost_hold(log: LogView, quota: Quota, expect: int, seen: int, now: int) -> int | None:
    """Until when :func:`lost_history` would hold the key, or None, writing nothing (a
    pool's choice: a key that lost its history is held once its call books)."""
    if expect < 0 or log.life == LIFE_HELD:
        return None
    if log.born != expect:
        if log.life != LIFE_AFRESH:
            return None
        return quota.counts_until(log.born)
    if seen > log.total:
        return quota.counts_until(now)
    return None


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
    # Only a retry looks for its id (a first attempt's is new): as in the Lua script, a
    # new call never takes an old call's slot for its own, whatever ids the log holds.
    booked = log.slot_of(op.call_id) if op.retry else None
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
    booked = logs[0].slot_of(op.call_id) if op.retry else None  # (as acquire's)
    if booked is not None:  # the same call again: it holds its slot in every log (unmarked)
        remaining = remaining_all(logs, charges, booked)
        return told(Verdict(True, now, booked, pause_until, remaining), logs, lost)
    try:
        slot = common_slot(pairs, now, op.lead_us)
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


def common_slot(
    pairs: Sequence[tuple[LogView, Charge]], now: int, lead: int, fills: Fills | None = None
) -> int:
    """The earliest slot that suits every key of a stacked call (Stale: windows missing).

    Past a log's newest slot a window only loses entries as time goes on, so from its
    earliest slot on every later one suits a key. The call's own key (the first) is
    booked so; a key it shares may take a slot among its bookings (``filling``), which
    suits it at some moments and not at others. So: from the latest of the keys' earliest
    slots (a shared key's counted only when it cannot be filled), each shared key's first
    slot that suits it from there, and every key's calendar windows (which may move it
    on), round again until the slot stays. (``fills``: what the fills of this decision
    read already.)
    """
    fills = Fills() if fills is None else fills
    latest = [earliest_slot(log, c.quota, now, c.cost) for log, c in pairs]
    slot = max(now + lead, latest[0])
    for (log, c), late in zip(pairs[1:], latest[1:], strict=True):
        if not fillable(log, c.quota, slot):
            slot = max(slot, late)
    while True:
        later = slot
        for index, ((log, c), late) in enumerate(zip(pairs, latest, strict=True)):
            if index and later < late and fillable(log, c.quota, later):
                later = fills.slot(log, c.quota, max(later, log.pause_until), c.cost, late)
            elif index:
                later = max(later, late)
            later = calendar_slot(log, c.quota, later, c.cost)
        if later == slot:
            return slot
        slot = later


def choose(
    logs: Sequence[LogView], op: AcquireAny, now: int, partners: Sequence[LogView] = ()
) -> int:
    """Which key of a pool's call (:class:`AcquireAny`, over the logs of its keys, in
    order) it books: for a retry, the one whose log holds its id; else the one whose
    slot is earliest, and of equal slots the one used least lately (its newest booking
    the oldest, so that a pool spreads its calls over its keys; one past the horizon,
    which a store may have forgotten, counts as none), then the first. A key that lost
    its history counts from the hold its call would set (:func:`lost_hold`). A key whose
    windows the call did not give (Stale) is taken at once: its answer asks for them.
    With ``partners`` (the logs of ``op.partners``) a key's slot is the one its call
    with them would take (:func:`common_slot`)."""
    if op.retry:
        for index, log in enumerate(logs):
            if log.slot_of(op.call_id) is not None:
                return index
    best, best_rank, horizon, fills = 0, (-1, -1), op.quota.horizon_us, Fills()
    lives = [(op.expect, op.seen), *((other.expect, other.seen) for other in op.others)]
    for index, (log, (expect, seen)) in enumerate(zip(logs, lives, strict=True)):
        try:
            if partners:
                own = Charge(op.key, op.quota, op.cost)
                pairs = [(log, own), *zip(partners, op.partners, strict=True)]
                slot = common_slot(pairs, now, op.lead_us, fills)
            else:
                slot = max(earliest_slot(log, op.quota, now, op.cost), now + op.lead_us)
        except Stale:
            return index
        held = lost_hold(log, op.quota, expect, seen, now)  # (held once its call books)
        if held is not None:
            slot = max(slot, held)
        last = log.last
        rank = (slot, last if last is not None and last + horizon > now else -1)
        if index == 0 or rank < best_rank:
            best, best_rank = index, rank
    return best


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
