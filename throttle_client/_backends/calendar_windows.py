"""Calendar rates: fixed windows aligned to a zone's calendar, and a limit learned from
the upstream, a window of its own.

A calendar rate counts the units of each fixed window, from its start less the margin to
its end (see quota.Windows). A slot counts in its own window and, within the margin of
that window's end, in the next one too. A key with a calendar rate books each call after
its newest (``filling`` never books such a key among later entries), so a new slot lies
at or after every entry: a window that is full at the earliest slot moves it to the
window's end, where the next window holds nothing but entries within the margin of its
start; so a rate moves a slot at most twice, and the other constraints, met at the
earlier slot, stay met at the later one.
"""

from __future__ import annotations

from bisect import bisect_right

from .coarse import counts
from .log_view import LogView
from .quota import Quota, Windows

MAX_TIME = 2**63  # after any time a store works with (see _ranges)


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
    """Units a learned limit counts: slots from its ``since`` up to its ``until``. Every
    entry after the running total it starts from (``from_cum``, marked when the answered
    call was admitted) lies from ``since`` on, or was booked among later entries since
    (``filling``, which moved theirs up: counted too, never too few): that count holds
    whatever has been trimmed since."""
    assert log.learned is not None
    _, until, _, from_cum = log.learned
    return log.cum_through(until - 1) - from_cum


def check_now(quota: Quota, now: int) -> None:
    """Stale unless every calendar rate's windows begin at or before ``now``."""
    for _, period in quota.limits:
        if isinstance(period, Windows) and now < period.keep_from:
            raise Stale(now)
