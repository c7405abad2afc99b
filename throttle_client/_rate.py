"""Rates: "at most ``limit`` units in any sliding window of ``period``", or in each fixed
calendar window (a day from local midnight in a zone, a month from an anchor day)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from zoneinfo import ZoneInfo

from ._calendar import UNITS as CALENDAR_UNITS
from ._calendar import CalendarWindow
from ._errors import ConfigurationError
from ._ranges import MAX_LIMIT, MAX_SECONDS, MIN_PERIOD

_UNITS = {
    "ms": 0.001, "millisecond": 0.001, "milliseconds": 0.001,
    "s": 1.0, "sec": 1.0, "second": 1.0, "seconds": 1.0,
    "m": 60.0, "min": 60.0, "minute": 60.0, "minutes": 60.0,
    "h": 3600.0, "hr": 3600.0, "hour": 3600.0, "hours": 3600.0,
    "d": 86400.0, "day": 86400.0, "days": 86400.0,
}  # fmt: skip
# ASCII only: a Unicode \d would read Arabic-Indic or full-width digits as a number.
_ZONE = r"\s+in\s+(?P<tz{n}>[A-Za-z0-9_+\-/]+)"
_FROM = r"\s+from\s+(?:(?P<anchor{n}>\d{{4}}-\d\d-\d\d)|(?:day\s+)?(?P<day{n}>\d{{1,2}}))"
_RATE_RE = re.compile(
    r"^\s*(?P<limit>\d+)\s*(?:/|per)\s*(?P<count>\d+(?:\.\d+)?)?\s*(?P<unit>[a-z]+)"
    # A calendar window's zone and anchor, in either order.
    rf"(?:(?:{_ZONE.format(n=1)})?(?:{_FROM.format(n=1)})?|{_FROM.format(n=2)}{_ZONE.format(n=2)})"
    # A bounded rate: "..., bounded" or "... in 48 buckets".
    r"(?:(?:\s*,\s*|\s+)(?P<bounded>bounded)|\s+in\s+(?P<buckets>\d+)\s+buckets?)?"
    r"\s*$",
    re.I | re.ASCII,
)


# A bounded sliding rate's buckets per window, unless told (under-use at most 1/60 of it),
# and the range allowed (each bucket is one entry of the key's meta: a few bytes each).
DEFAULT_BUCKETS = 60
MAX_BUCKETS = 1000
# A calendar window's nominal length (``Rate.period``, for display and rough sums only:
# the store counts in the real windows, 23- to 25-hour days, 28- to 31-day months).
_NOMINAL = {"minute": 60.0, "hour": 3600.0, "day": 86400.0, "week": 604800.0,
            "month": 2629746.0}  # fmt: skip


def to_seconds(value: float | timedelta, name: str) -> float:
    """Seconds as a float from seconds or a timedelta; names ``name`` when ``value`` is wrong."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(f"{name} must be seconds or a timedelta, not {value!r}")
    return float(value)


def bounded_seconds(value: float | timedelta, name: str, *, lowest: float = 0.0) -> float:
    """``to_seconds(value)``, refused unless from ``lowest`` to 10 years (``_ranges``)."""
    seconds = to_seconds(value, name)
    if not lowest <= seconds <= MAX_SECONDS:  # NaN fails too
        low = "1 microsecond" if lowest == MIN_PERIOD else f"{lowest:g} s"
        raise ConfigurationError(
            f"{name} must be from {low} to 10 years ({MAX_SECONDS:.0f} s), not {value!r}"
        )
    return seconds


@dataclass(frozen=True)
class Rate:
    """At most ``limit`` units of cost in any window of ``period`` seconds (sliding), or
    in each fixed calendar window when ``period`` names a calendar unit.

    >>> Rate(5000, 3600) == Rate(5000, timedelta(hours=1)) == Rate.parse("5000/hour")
    True

    A calendar rate resets at the unit's boundary in a time zone (``tz``, an IANA name),
    with 23- and 25-hour days where the clocks change; a month may start on an
    ``anchor`` date's day, clamped to shorter months (30 January, 28 February, 30 March):

    >>> Rate(10000, "day", tz="America/Chicago") == Rate.parse("10000/day in America/Chicago")
    True
    >>> Rate(3000, "month", anchor=date(2026, 1, 30)) == Rate.parse("3000/month from 2026-01-30")
    True

    Only the anchor's day of the month counts (a plan's months, before and after the date
    alike): ``anchor=30`` says the same. ``calendar`` is the window (None for a sliding
    rate); ``period`` is then its nominal
    length (a month counts as 30.44 days there), for display only.

    ``bounded=True`` keeps the key's memory for this rate bounded whatever the limit:
    the store counts it by bucket, not by call. A
    calendar rate is then counted per window, exactly as before; a sliding rate counts
    each bucket (``buckets`` per period, from 2 to 1000, 60 unless told) until the
    bucket's last moment leaves the window, so it never admits more than the limit in
    any window, and holds a call back at most one bucket (1/buckets of the period)
    longer than the exact log:

    >>> Rate(70000, timedelta(days=1), buckets=48) == Rate.parse("70000/day in 48 buckets")
    True
    >>> Rate.parse("1000000/month bounded").bounded
    True
    """

    limit: int
    period: float
    calendar: CalendarWindow | None
    buckets: int  # a bounded sliding rate's buckets per period; 0: exact (or calendar)
    bounded: bool

    def __init__(
        self,
        limit: int,
        period: float | timedelta | str,
        *,
        tz: str | ZoneInfo | None = None,
        anchor: date | str | int | None = None,
        bounded: bool | None = None,
        buckets: int | None = None,
    ) -> None:
        if bounded is not None and not isinstance(bounded, bool):
            raise ConfigurationError(f"bounded must be True or False, not {bounded!r}")
        if buckets is not None:
            if isinstance(period, str):
                raise ConfigurationError(
                    f"buckets={buckets!r} belongs to sliding rates: a calendar rate is "
                    f"counted per window when bounded: drop buckets and give bounded=True "
                    f"(in a string: '..., bounded')"
                )
            if bounded is False:
                raise ConfigurationError(
                    f"buckets={buckets!r} makes a rate bounded, and bounded=False says "
                    "it is not: give one of them"
                )
            if (
                isinstance(buckets, bool)
                or not isinstance(buckets, int)
                or not 2 <= buckets <= MAX_BUCKETS
            ):
                raise ConfigurationError(
                    f"buckets must be a whole number from 2 to {MAX_BUCKETS}, not {buckets!r}"
                )
            bounded = True
        bounded = bool(bounded)
        object.__setattr__(self, "bounded", bounded)
        object.__setattr__(
            self,
            "buckets",
            0 if not bounded or isinstance(period, str) else buckets or DEFAULT_BUCKETS,
        )
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
            raise ConfigurationError(
                f"rate limit must be a whole number from 1 to 2**40 ({MAX_LIMIT}), not {limit!r}"
            )
        object.__setattr__(self, "limit", limit)
        if isinstance(period, str):
            window = _calendar_window(period, tz, anchor)
            object.__setattr__(self, "period", _NOMINAL[window.unit])
            object.__setattr__(self, "calendar", window)
            return
        if tz is not None or anchor is not None:
            raise ConfigurationError(
                f"tz= and anchor= belong to calendar rates, whose period is one of "
                f"{', '.join(CALENDAR_UNITS)} (such as Rate({limit}, 'day', tz='UTC')), "
                f"not to a sliding period of {period!r}"
            )
        seconds = bounded_seconds(period, "rate period", lowest=MIN_PERIOD)
        object.__setattr__(self, "period", seconds)
        object.__setattr__(self, "calendar", None)
        if self.buckets > self.period_us:
            more = f": give buckets= from 2 to {self.period_us}" if self.period_us >= 2 else ""
            raise ConfigurationError(
                f"a period of {self.period_us} µs cannot be counted in {self.buckets} "
                f"buckets (one per µs at most){more}"
            )

    @classmethod
    def parse(cls, text: str) -> Rate:
        """``"5000/hour"``, ``"10/second"``, ``"100/15 minutes"``, ``"30 per minute"``
        (sliding); ``"10000/day in America/Los_Angeles"``, ``"3000/month"`` and
        ``"3000/month from 2026-01-30"`` (calendar: a zone, an anchor or a month); any of
        them ``", bounded"``, and a sliding one ``"in 48 buckets"`` (see ``bounded``)."""
        if not isinstance(text, str):
            raise ConfigurationError(f"a rate string is needed, not {text!r}")
        match = _RATE_RE.match(text)
        tz = match and (match["tz1"] or match["tz2"])
        anchor: str | int | None = match and (match["anchor1"] or match["anchor2"])
        day = match and (match["day1"] or match["day2"])
        if day:
            anchor = int(day)
        calendar = match is not None and (
            tz is not None or anchor is not None or match["unit"].lower() in ("month", "months")
        )
        unit = match and (
            _calendar_unit(match["unit"]) if calendar else _UNITS.get(match["unit"].lower())
        )
        if match and unit is None and not calendar and _calendar_unit(match["unit"]):
            raise ConfigurationError(
                f"cannot parse rate {text!r}: a calendar {_calendar_unit(match['unit'])} "
                f"resets in some time zone: say which, such as '{match['limit']}/"
                f"{match['unit']} in UTC'"
            )
        if not match or unit is None or (calendar and match["count"] not in (None, "1")):
            raise ConfigurationError(
                f"cannot parse rate {text!r}: expected '<limit>/<period>' such as "
                "'5000/hour', '10/second' or '100/15 minutes', or a calendar window such "
                "as '10000/day in America/Los_Angeles' or '3000/month from 2026-01-30', "
                "each optionally bounded: '70000/day in 48 buckets', '3000/month, bounded'"
            )
        if tz and "bucket" in tz.lower():
            raise ConfigurationError(
                f"cannot parse rate {text!r}: write a bounded rate's buckets as "
                "'... in 48 buckets' (2 to 1000)"
            )
        bounded = bool(match["bounded"] or match["buckets"])
        buckets = None
        if match["buckets"]:
            if len(match["buckets"]) > 4:
                raise ConfigurationError(
                    f"bad rate {text!r}: buckets must be from 2 to {MAX_BUCKETS}"
                )
            buckets = int(match["buckets"])
        try:
            if len(match["limit"].lstrip("0")) > len(str(MAX_LIMIT)):
                # Above the range for sure; int() would refuse thousands of digits on its own.
                raise ConfigurationError(f"rate limit must be at most 2**40 ({MAX_LIMIT})")
            if calendar:
                assert isinstance(unit, str)
                return cls(
                    int(match["limit"]),
                    unit,
                    tz=tz or "UTC",
                    anchor=anchor,
                    bounded=bounded,
                    buckets=buckets,
                )
            count = float(match["count"]) if match["count"] else 1.0
            assert isinstance(unit, float)
            return cls(int(match["limit"]), count * unit, bounded=bounded, buckets=buckets)
        except ConfigurationError as exc:
            raise ConfigurationError(f"bad rate {text!r}: {exc}") from None

    @property
    def period_us(self) -> int:
        """The period in whole microseconds, the unit every store works in."""
        return max(1, round(self.period * 1_000_000))

    def _calendar_words(self) -> str:
        window = self.calendar
        assert window is not None
        words = f"{self.limit}/{window.unit} in {window.tz}"
        return words + (f" from day {window.anchor_day}" if window.anchor_day != 1 else "")

    @property
    def bucket_us(self) -> int:
        """A bounded sliding rate's bucket width in µs (rounded up: never under one
        bucket per ``1/buckets`` of the period); 0 for any other rate."""
        return -(-self.period_us // self.buckets) if self.buckets else 0

    def __str__(self) -> str:
        if self.calendar is not None:
            return self._calendar_words() + (", bounded" if self.bounded else "")
        return f"{self.limit}/{self.period:g}s" + (
            f" in {self.buckets} buckets" if self.buckets else ""
        )

    def __repr__(self) -> str:
        window = self.calendar
        if window is not None:
            anchor = f", anchor={window.anchor_day}" if window.anchor_day != 1 else ""
            bounded = ", bounded=True" if self.bounded else ""
            return f"Rate({self.limit}, {window.unit!r}, tz={window.tz!r}{anchor}{bounded})"
        buckets = f", buckets={self.buckets}" if self.buckets else ""
        return f"Rate({self.limit}, {self.period:g}{buckets})"


def _calendar_unit(word: str) -> str | None:
    word = word.lower()
    unit = word[:-1] if word.endswith("s") else word
    return unit if unit in CALENDAR_UNITS else None


def _calendar_window(
    unit: str, tz: str | ZoneInfo | None, anchor: date | str | int | None
) -> CalendarWindow:
    """The window of a calendar rate, every part checked and named when wrong."""
    name = _calendar_unit(unit)
    if name is None:
        raise ConfigurationError(
            f"a calendar rate's period is one of {', '.join(CALENDAR_UNITS)}, not {unit!r} "
            "(a sliding period is seconds or a timedelta)"
        )
    if tz is None and anchor is None and name != "month":
        raise ConfigurationError(
            f"a calendar {name} resets at a boundary in some time zone: say which, such as "
            f"Rate(..., {unit!r}, tz='UTC'); for a sliding {name}, give seconds or a timedelta"
        )
    day = 1
    if anchor is not None:
        if name != "month":
            raise ConfigurationError(f"anchor= applies to monthly windows, not to {unit!r}")
        if isinstance(anchor, str):
            try:
                anchor = date.fromisoformat(anchor)
            except ValueError:
                raise ConfigurationError(
                    f"anchor must be a date such as '2026-01-30', not {anchor!r}"
                ) from None
        if isinstance(anchor, int) and not isinstance(anchor, bool) and 1 <= anchor <= 31:
            day = anchor  # the day of the month the subscription began
        elif isinstance(anchor, datetime) or not isinstance(anchor, date):
            raise ConfigurationError(
                f"anchor must be a date (datetime.date, not a datetime) or a day of the month "
                f"from 1 to 31, not {anchor!r}"
            )
        else:
            day = anchor.day
    if isinstance(tz, ZoneInfo):
        tz = tz.key
    if tz is not None and (not isinstance(tz, str) or tz in ("", "localtime")):
        # "localtime" names each host's own zone: workers on hosts set apart would count
        # different windows of one key.
        raise ConfigurationError(f"tz must be an IANA zone name such as 'UTC', not {tz!r}")
    return CalendarWindow(name, tz or "UTC", day)


def split_rates(value: Rate | str) -> list[Rate | str]:
    """A string of several rates, ``"5000/hour; 10/second"``, as its rate strings; any
    other value as it is (checked by :func:`coerce_rate`)."""
    if not isinstance(value, str) or ";" not in value:
        return [value]
    parts: list[Rate | str] = [part.strip() for part in value.split(";")]
    if not all(parts):
        raise ConfigurationError(
            f"cannot parse rates {value!r}: rates are separated by ';', "
            "with a rate on each side, such as '5000/hour; 10/second'"
        )
    return parts


def coerce_rate(value: Rate | str) -> Rate:
    """Accept a Rate or a rate string, as limiters do for their ``rates``."""
    if isinstance(value, Rate):
        return value
    if isinstance(value, str):
        return Rate.parse(value)
    raise ConfigurationError(f"a rate must be a Rate or a string like '10/second', not {value!r}")
