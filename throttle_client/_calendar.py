"""Calendar windows: where the fixed window that holds a moment begins and ends (issue 11).

A calendar rate ("10000 per day, resetting at midnight in America/Los_Angeles", "a month
from the 30th of each month") counts calls in fixed windows aligned to a calendar in a
time zone, not in a window that slides. Which window a moment falls in is a question
of time-zone rules, which only Python has (the Lua script has no zone data): so the
limiter computes the window's bounds here, in epoch microseconds, and the store only
compares them with its own clock.

Bounds are local wall-clock boundaries turned into instants, so a day is 23 or 25
hours long on the days a zone's clocks change, and a boundary that falls in a skipped
hour (a zone whose midnight does not exist on its DST day) is the first instant after
the gap. A month anchored on day 29, 30 or 31 begins on the last day of a shorter month
(anchor 30 January: 28 February, then 30 March), as subscription renewals do.
"""

from __future__ import annotations

import calendar
from dataclasses import dataclass
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from ._errors import ConfigurationError

UNITS = ("minute", "hour", "day", "week", "month")


@dataclass(frozen=True)
class CalendarWindow:
    """Fixed windows of one ``unit`` in zone ``tz``; a month from ``anchor_day`` (1-31)."""

    unit: str
    tz: str = "UTC"
    anchor_day: int = 1

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise ConfigurationError(
                f"a calendar window is one of {', '.join(UNITS)}, not {self.unit!r}"
            )
        try:
            ZoneInfo(self.tz)
        except (ZoneInfoNotFoundError, ValueError, TypeError) as exc:
            raise ConfigurationError(
                f"unknown time zone {self.tz!r}: give an IANA name such as "
                "'America/Los_Angeles' or 'UTC'"
            ) from exc
        day = self.anchor_day
        if isinstance(day, bool) or not isinstance(day, int) or not 1 <= day <= 31:
            raise ConfigurationError(f"anchor_day must be from 1 to 31, not {day!r}")
        if day != 1 and self.unit != "month":
            raise ConfigurationError(f"anchor_day applies to monthly windows, not to {self.unit!r}")

    def bounds(self, moment: float) -> tuple[float, float]:
        """(start, end) in epoch seconds of the window that holds ``moment``:
        start <= moment < end."""
        zone = ZoneInfo(self.tz)
        local = datetime.fromtimestamp(moment, zone)
        if self.unit in ("minute", "hour"):
            # Real minutes and hours, aligned to the local clock: a repeated hour at the
            # end of DST is two windows, as it is two hours of calls. A change of offset
            # that is not whole hours (Lord Howe's 30 minutes) cuts the window it falls
            # in at the change.
            into = local.second + local.microsecond / 1e6
            if self.unit == "hour":
                into += local.minute * 60
            start = moment - into
            end = start + (60.0 if self.unit == "minute" else 3600.0)
            offset = local.utcoffset()
            if _offset(start, zone) != offset:
                start = _change_between(start, moment, zone)
            if _offset(end - 1, zone) != offset:
                end = _change_between(moment, end - 1, zone)
            return start, end
        midnight = local.replace(tzinfo=None, hour=0, minute=0, second=0, microsecond=0)
        if self.unit == "day":
            first, after = midnight, midnight + timedelta(days=1)
        elif self.unit == "week":  # ISO weeks, from Monday
            first = midnight - timedelta(days=midnight.weekday())
            after = first + timedelta(weeks=1)
        else:
            first = _anchored(midnight.year, midnight.month, self.anchor_day)
            if first > midnight:  # this month's anchor is still ahead: it began last month
                first = _anchored(*_month_before(midnight.year, midnight.month), self.anchor_day)
            after = _anchored(*_month_after(first.year, first.month), self.anchor_day)
        return _instant(first, zone), _instant(after, zone)


def _month_before(year: int, month: int) -> tuple[int, int]:
    return (year, month - 1) if month > 1 else (year - 1, 12)


def _month_after(year: int, month: int) -> tuple[int, int]:
    return (year, month + 1) if month < 12 else (year + 1, 1)


def _anchored(year: int, month: int, day: int) -> datetime:
    """Local midnight of ``day`` in that month, clamped to the month's last day."""
    return datetime(year, month, min(day, calendar.monthrange(year, month)[1]))


def _instant(wall: datetime, zone: ZoneInfo) -> float:
    """The first instant at which the local clock reads ``wall`` or later: the earlier
    of two in a repeated hour, the end of the gap for a time the clocks skip (a zone
    whose clocks jump at midnight has no midnight that day)."""
    instant = wall.replace(tzinfo=zone, fold=0).timestamp()
    if _wall(instant, zone) == wall:
        return instant
    # In a gap: between the instant whose local time is before it (fold=1 reads the wall
    # with the offset after the jump) and the one after it, find the jump, to the second.
    low = int(wall.replace(tzinfo=zone, fold=1).timestamp())
    high = int(instant) + 1
    while high - low > 1:
        middle = (low + high) // 2
        if _wall(middle, zone) >= wall:
            high = middle
        else:
            low = middle
    return float(high)


def _offset(instant: float, zone: ZoneInfo) -> timedelta | None:
    return datetime.fromtimestamp(instant, zone).utcoffset()


def _change_between(low: float, high: float, zone: ZoneInfo) -> float:
    """The instant in (low, high] from which the offset is the one in force at ``high``
    (offsets change on whole seconds)."""
    target = _offset(high, zone)
    lo, hi = int(low), int(high) + (0 if high == int(high) else 1)
    while hi - lo > 1:
        middle = (lo + hi) // 2
        if _offset(middle, zone) == target:
            hi = middle
        else:
            lo = middle
    return float(hi)


def _wall(instant: float, zone: ZoneInfo) -> datetime:
    return datetime.fromtimestamp(instant, zone).replace(tzinfo=None)
