"""Stacked keys without head-of-line blocking: a call's slot in a key it shares.

A call charged to a token and to its account (``also=``) books one slot in both logs. The
token's log is its own queue, first come first served, so its slot comes after every
call booked on it. The account's log is shared: a busy token books it ahead, at the
slots that token's own rate allows, and leaves room between them. If the account's
slot also had to follow its newest booking, another token's call would wait behind the
busy token's future calls while the account had room now. So in a key a call shares
(every key of a stacked call after its first), the call takes the earliest slot at which
it fits among the bookings already there: each window that would hold it, before and
after, stays within its limit, and the gap holds on both sides. The bookings already
there stay where they are.

Only a key of exact sliding rates (and a gap no longer than its longest window), with no
learned limit in force, is filled so; and only when its bookings around the call number
at most FILL_MOST, so that a decision's work stays bounded. Any other key is booked after
its newest call, as a call's own key is.
The Redis script (``lua/slots.lua``, ``fill_slot``) runs the same steps.
"""

from __future__ import annotations

from .log_view import LogView
from .quota import Quota

# The most bookings of a key a fill reads (those from the longest window before the
# earliest slot on): past it, the call is booked after the key's newest call.
FILL_MOST = 256


def fillable(log: LogView, quota: Quota, floor: int) -> bool:
    """Whether a call from ``floor`` on may be booked among ``log``'s bookings: the key
    holds a booking at or after ``floor``, counts only exact sliding rates, has no learned
    limit in force, and still holds every entry the windows around ``floor`` need."""
    if log.last is None or log.last < floor:
        return False  # nothing booked ahead: its newest call is no hindrance
    if log.learned is not None and log.learned[1] > floor:
        return False
    if not all(isinstance(period, int) for _, period in quota.limits):
        return False
    # A gap longer than every window would need entries that trimming may have dropped.
    longest = reach(quota)
    return quota.min_interval_us <= longest and floor - longest >= log.trimmed


def reach(quota: Quota) -> int:
    """How far before a slot a booking can bear on it: the longest period."""
    return max(p for _, p in quota.limits if isinstance(p, int))


class Fills:
    """The spans in which a call does not fit, per key, for the fills of one decision:
    each key's bookings are read and swept once. Spans read from a floor on stay true
    from any later floor on (the bookings before a floor's reach bear on no window that
    ends after it), so the rounds of ``common_slot`` and the keys of a pool share them."""

    def __init__(self) -> None:
        # id of the log -> (the floor they were read from, the cost, the spans in
        # order, or None: too many bookings to fill among)
        self._read: dict[int, tuple[int, int, list[tuple[int, int]] | None]] = {}

    def slot(self, log: LogView, quota: Quota, floor: int, cost: int, latest: int) -> int:
        """The earliest slot from ``floor`` on (``latest`` at most: the slot after the
        key's newest call, which always fits) at which ``cost`` fits among its bookings."""
        read = self._read.get(id(log))
        if read is None or read[0] > floor or read[1] != cost:
            read = (floor, cost, spans_from(log, quota, floor, cost))
            self._read[id(log)] = read
        spans = read[2]
        if spans is None:
            return latest
        slot = floor
        for start, end in spans:  # the first moment no span covers
            if start > slot:
                break
            slot = max(slot, end)
        return min(slot, latest)


def spans_from(log: LogView, quota: Quota, floor: int, cost: int) -> list[tuple[int, int]] | None:
    """The spans, in order, in which ``cost`` does not fit among the key's bookings, from
    ``floor`` on; None when more than FILL_MOST bookings bear on them."""
    since = floor - reach(quota)
    entries = log.entries_after(since, FILL_MOST + 1)
    if len(entries) > FILL_MOST:
        return None
    before = log.cum_through(since)
    booked = []  # (slot, cost) in slot order
    for slot, cum in entries:
        booked.append((slot, cum - before))
        before = cum
    return sorted(blocked_spans(booked, quota, cost))


def blocked_spans(booked: list[tuple[int, int]], quota: Quota, cost: int) -> list[tuple[int, int]]:
    """The spans of time ``[start, end)`` in which a call of ``cost`` does not fit among
    ``booked``: too near a booking for the gap, or inside a window that would go over."""
    gap = quota.min_interval_us
    spans = [(slot - gap + 1, slot + gap) for slot, _ in booked] if gap > 0 else []
    for limit, period in quota.limits:
        assert isinstance(period, int)
        # Sweep the windows' ends s: the window (s - period, s] holds more than
        # limit - cost from the moment a booking enters it until one leaves it again.
        # A call at t is in the windows ending from t to t + period - 1, so a window
        # over from a to b (exclusive) keeps out every t in (a - period, b).
        events = sorted(
            [(slot, units) for slot, units in booked]
            + [(slot + period, -units) for slot, units in booked]
        )
        held, over_from = 0, None
        for at, units in events:
            held += units
            # (Every event of one moment applies before the window is read at it.)
            if over_from is None and held > limit - cost:
                over_from = at
            elif over_from is not None and held <= limit - cost:
                spans.append((over_from - period + 1, at))
                over_from = None
        assert over_from is None  # every booking leaves its windows
    return spans
