"""A key's usage history: the calls admitted and the units they cost,
per hour, day and month, counted by the store in the step that books each call.

Periods are local to a zone (UTC, or a calendar rate's): the limiter sends the zone's
offset from UTC with each decision, and the store counts a call in the periods holding
its slot, ``slot + offset``. A period's id is a whole number: hours and days since
1970-01-01 00:00 local time, months as ``year * 12 + month - 1``. Each granularity keeps
its newest ``keep`` periods; the rest go when a new period begins.

The store keeps, per period, two counters: ``h<id>`` (``d``, ``m``) the calls, and
``H<id>`` (``D``, ``M``) the units beyond one per call, written only by calls that cost
more than 1 (most cost 1: one write per granularity); and ``o``, the offset the newest
call was counted at, so that a reader who does not know the zone can place the periods.
A call that woke too late and booked again (``late_wakeup``) counts twice, as it does
in the windows.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterator
from typing import NamedTuple

HOUR_US = 3_600_000_000
DAY_US = 24 * HOUR_US
GRAINS = ("h", "d", "m")  # hour, day, month: each one's calls field prefix
FIELD = re.compile(r"[hdmHDM]-?[0-9]+\Z")  # a period's field, as the script too reads one
OFFSET = "o"  # the field of the zone's offset from UTC (µs) the newest call was counted in
# In what a store reads back (ReadHistory), not in what it keeps: how many fields it left
# out as no store writes them (a hand in the store), for the reader to report.
SKIPPED = "?"


class HistorySpec(NamedTuple):
    """What a decision asks the store to count, for one key of it."""

    key: str  # the store key
    keep: tuple[int, int, int]  # hours, days, months kept
    offset_us: int  # the zone's offset from UTC at the decision


def month_of_day(day: int) -> int:
    """The month id of day ``day`` (days since 1970-01-01)."""
    date = dt.date(1970, 1, 1) + dt.timedelta(days=day)
    return date.year * 12 + date.month - 1


def period_ids(slot_us: int, offset_us: int) -> tuple[int, int, int]:
    """The hour, day and month that hold ``slot_us`` in a zone ``offset_us`` from UTC."""
    local = slot_us + offset_us
    day = local // DAY_US
    return local // HOUR_US, day, month_of_day(day)


def counted(slot_us: int, cost: int, offset_us: int) -> Iterator[tuple[str, int]]:
    """The fields a call of ``cost`` at ``slot_us`` adds to, and by how much."""
    for grain, period in zip(GRAINS, period_ids(slot_us, offset_us), strict=True):
        yield f"{grain}{period}", 1
        if cost > 1:
            yield f"{grain.upper()}{period}", cost - 1


def counts(op: object, first_log: object) -> bool:
    """Whether ``op``, run on a store's logs (``first_log``: its first key's), counts
    its booking in histories: it carries some, and its call id was not booked before
    (a retry that finds its call booked was counted by its first attempt)."""
    if not getattr(op, "history", ()):
        return False
    return first_log.slot_of(op.call_id) is None  # type: ignore[attr-defined]


def record(fields: dict[str, int], spec: HistorySpec, slot_us: int, cost: int) -> None:
    """Count a call in ``fields`` (a key's history as a store keeps it), dropping the
    periods that fall out of what is kept when a new one begins; ``o`` holds the offset
    counted in (set when a period begins), for a reader that does not know the zone."""
    for name, n in counted(slot_us, cost, spec.offset_us):
        fresh = name not in fields
        fields[name] = fields.get(name, 0) + n
        if fresh and name[0] in GRAINS:
            fields[OFFSET] = spec.offset_us  # (as the script: when a period begins)
            keep = spec.keep[GRAINS.index(name[0])]
            oldest = int(name[1:]) - keep
            for old in [f for f in fields if f[0].lower() == name[0] and int(f[1:]) <= oldest]:
                del fields[old]


def kept_us(keep: tuple[int, int, int]) -> int:
    """How long a history outlives its last call: the longest of what it keeps."""
    return max(keep[0] * HOUR_US, keep[1] * DAY_US, keep[2] * 31 * DAY_US)
