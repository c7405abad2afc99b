"""Rates: "at most ``limit`` units in any sliding window of ``period``"."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta

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
_RATE_RE = re.compile(
    r"^\s*(?P<limit>\d+)\s*(?:/|per)\s*(?P<count>\d+(?:\.\d+)?)?\s*(?P<unit>[a-z]+)\s*$",
    re.I | re.ASCII,
)


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
    """At most ``limit`` units of cost in any window of ``period`` seconds.

    >>> Rate(5000, 3600) == Rate(5000, timedelta(hours=1)) == Rate.parse("5000/hour")
    True
    """

    limit: int
    period: float

    def __init__(self, limit: int, period: float | timedelta) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
            raise ConfigurationError(
                f"rate limit must be a whole number from 1 to 2**40 ({MAX_LIMIT}), not {limit!r}"
            )
        seconds = bounded_seconds(period, "rate period", lowest=MIN_PERIOD)
        object.__setattr__(self, "limit", limit)
        object.__setattr__(self, "period", seconds)

    @classmethod
    def parse(cls, text: str) -> Rate:
        """``"5000/hour"``, ``"10/second"``, ``"100/15 minutes"``, ``"30 per minute"``."""
        if not isinstance(text, str):
            raise ConfigurationError(f"a rate string is needed, not {text!r}")
        match = _RATE_RE.match(text)
        unit = match and _UNITS.get(match["unit"].lower())
        if not match or unit is None:
            raise ConfigurationError(
                f"cannot parse rate {text!r}: expected '<limit>/<period>' such as "
                "'5000/hour', '10/second' or '100/15 minutes'"
            )
        count = float(match["count"]) if match["count"] else 1.0
        try:
            if len(match["limit"].lstrip("0")) > len(str(MAX_LIMIT)):
                # Above the range for sure; int() would refuse thousands of digits on its own.
                raise ConfigurationError(f"rate limit must be at most 2**40 ({MAX_LIMIT})")
            return cls(int(match["limit"]), count * unit)
        except ConfigurationError as exc:
            raise ConfigurationError(f"bad rate {text!r}: {exc}") from None

    @property
    def period_us(self) -> int:
        """The period in whole microseconds, the unit every store works in."""
        return max(1, round(self.period * 1_000_000))

    def __str__(self) -> str:
        return f"{self.limit}/{self.period:g}s"

    def __repr__(self) -> str:
        return f"Rate({self.limit}, {self.period:g})"


def coerce_rate(value: Rate | str) -> Rate:
    """Accept a Rate or a rate string, as limiters do for their ``rates``."""
    if isinstance(value, Rate):
        return value
    if isinstance(value, str):
        return Rate.parse(value)
    raise ConfigurationError(f"a rate must be a Rate or a string like '10/second', not {value!r}")
