"""Calendar windows: where the fixed window that holds a moment begins and ends.

A calendar rate ("10000 per day, resetting at midnight in America/Los_Angeles", "a month
from the 30th of each month") counts calls in fixed windows aligned to a calendar in a
time zone, not in a window that slides. Which window a moment falls in is a question
of time-zone rules, which only Python has (the Lua script has no zone data): so the
limiter computes the window's bounds here, in whole epoch microseconds (the stores'
unit, exact in integers), and the store only compares them with its own clock.

- Days, weeks (from Monday) and months begin at a local midnight, turned into an
  instant: the first instant the local clock reads that midnight or later. So a day is
  23 or 25 hours long when the clocks change, a day whose midnight is skipped (America/
  Havana) begins when the clocks jump, and a month anchored on day 29, 30 or 31 begins
  on the last day of a shorter month (anchor 30 January: 28 February, then 30 March).
  The boundaries are instants, in order, and the windows lie between them: where the
  clocks go back across midnight (St John's 1987) the repeated stretch of the old date
  belongs to the window that began at the first midnight.
- Minutes and hours are real ones, aligned to the local clock: the repeated hour when
  DST ends is two windows, and a change of offset that is not whole hours (Lord Howe's
  30 minutes) cuts the window it falls in at the change.
"""

from __future__ import annotations

import calendar
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from ._errors import ConfigurationError

UNITS = ("minute", "hour", "day", "week", "month")
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_US = timedelta(microseconds=1)


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

    def bounds(self, moment_us: int) -> tuple[int, int]:
        """(start, end), epoch µs, of the window that holds ``moment_us``:
        start <= moment < end."""
        zone = ZoneInfo(self.tz)
        local = (_EPOCH + moment_us * _US).astimezone(zone)
        if self.unit in ("minute", "hour"):
            into = (local.second * 1_000_000) + local.microsecond
            if self.unit == "hour":
                into += local.minute * 60_000_000
            start = moment_us - into
            end = start + (60_000_000 if self.unit == "minute" else 3_600_000_000)
            offset = local.utcoffset()
            if _offset(start, zone) != offset:
                start = _change_between(start, moment_us, zone)
            if _offset(end - 1, zone) != offset:
                end = _change_between(moment_us, end - 1, zone)
            return start, end
        wall = self._first_wall(local.replace(tzinfo=None))
        start, end = _instant(wall, zone), _instant(self._next_wall(wall), zone)
        # The boundaries are instants in order: where the clocks went back across a
        # boundary, the moment may lie past the next one, or before this one.
        while end <= moment_us:
            wall = self._next_wall(wall)
            start, end = end, _instant(self._next_wall(wall), zone)
        while start > moment_us:
            wall = self._previous_wall(wall)
            start, end = _instant(wall, zone), start
        return start, end

    def _first_wall(self, wall: datetime) -> datetime:
        """The naive local start of the window holding local wall time ``wall``."""
        midnight = wall.replace(hour=0, minute=0, second=0, microsecond=0)
        if self.unit == "day":
            return midnight
        if self.unit == "week":  # ISO weeks, from Monday
            return midnight - timedelta(days=midnight.weekday())
        first = _anchored(midnight.year, midnight.month, self.anchor_day)
        if first > midnight:  # this month's anchor is still ahead: it began last month
            first = _anchored(*_month_before(midnight.year, midnight.month), self.anchor_day)
        return first

    def _next_wall(self, wall: datetime) -> datetime:
        if self.unit == "day":
            return wall + timedelta(days=1)
        if self.unit == "week":
            return wall + timedelta(weeks=1)
        return _anchored(*_month_after(wall.year, wall.month), self.anchor_day)

    def _previous_wall(self, wall: datetime) -> datetime:
        if self.unit == "day":
            return wall - timedelta(days=1)
        if self.unit == "week":
            return wall - timedelta(weeks=1)
        return _anchored(*_month_before(wall.year, wall.month), self.anchor_day)


def _month_before(year: int, month: int) -> tuple[int, int]:
    return (year, month - 1) if month > 1 else (year - 1, 12)


def _month_after(year: int, month: int) -> tuple[int, int]:
    return (year, month + 1) if month < 12 else (year + 1, 1)


def _anchored(year: int, month: int, day: int) -> datetime:
    """Local midnight of ``day`` in that month, clamped to the month's last day."""
    return datetime(year, month, min(day, calendar.monthrange(year, month)[1]))


def _us(aware: datetime) -> int:
    return (aware - _EPOCH) // _US


def _wall(instant_us: int, zone: ZoneInfo) -> datetime:
    return (_EPOCH + instant_us * _US).astimezone(zone).replace(tzinfo=None)


def _offset(instant_us: int, zone: ZoneInfo) -> timedelta | None:
    return (_EPOCH + instant_us * _US).astimezone(zone).utcoffset()


def _instant(wall: datetime, zone: ZoneInfo) -> int:
    """The first instant (µs) at which the local clock reads ``wall`` or later: the
    earlier of two in a repeated stretch, the end of the gap for a time the clocks skip."""
    instant = _us(wall.replace(tzinfo=zone, fold=0))
    if _wall(instant, zone) == wall:
        return instant
    # In a gap: between the instant whose local time is before it (fold=1 reads the wall
    # with the offset after the jump) and the one after it, find the jump.
    low, high = _us(wall.replace(tzinfo=zone, fold=1)), instant
    if low > high:
        low, high = high, low
    while high - low > 1:
        middle = (low + high) // 2
        if _wall(middle, zone) >= wall:
            high = middle
        else:
            low = middle
    return high


def _change_between(low: int, high: int, zone: ZoneInfo) -> int:
    """The instant in (low, high] from which the offset is the one in force at ``high``."""
    target = _offset(high, zone)
    while high - low > 1:
        middle = (low + high) // 2
        if _offset(middle, zone) == target:
            high = middle
        else:
            low = middle
    return high


# How many windows a decision is given after the one holding a time it is about: a
# slot up to two whole windows further on needs no second round trip.
AHEAD = 3
