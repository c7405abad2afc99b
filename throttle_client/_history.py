"""Usage history as a user sees it: what to keep (:class:`History`),
and what ``limiter.history(key)`` returns (:class:`UsageHistory`), read from the fields
a store keeps (``_backends/history.py``)."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from ._backends.history import FIELD, OFFSET, SKIPPED, HistorySpec
from ._errors import ConfigurationError
from ._ranges import MAX_TOTAL

US = 1_000_000
EPOCH = dt.datetime(1970, 1, 1)
logger = logging.getLogger("throttle_client")


@dataclass(frozen=True)
class History:
    """What a limiter counts of each key's use: the calls it admits and the units they
    cost, per hour, day and month, the newest ``hours``, ``days`` and ``months`` of
    each, in the same atomic step as the decision. Periods are local to ``zone`` (an
    IANA name); None: the zone of the limiter's first calendar rate, else UTC.

    Off unless asked for: ``Limiter(..., history=True)`` keeps these defaults,
    ``history=History(days=90)`` what it says. A key's history outlives the key by the
    longest of what it keeps (24 months by default): about 150 bytes for a key used
    once, 1.5 KB once full, per key ever counted in that time.
    """

    hours: int = 48
    days: int = 62
    months: int = 24
    zone: str | None = None

    def __post_init__(self) -> None:
        for name in ("hours", "days", "months"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 10_000:
                raise ConfigurationError(
                    f"History({name}=...) must be a whole number from 1 to 10000, not {value!r}"
                )
        if self.zone is not None:
            zone_of(self.zone)


def zone_of(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, TypeError):
        raise ConfigurationError(f"unknown time zone {name!r} (an IANA name is needed)") from None


@dataclass(frozen=True)
class Period:
    """One hour, day or month of a key's use: when it ``start``\\ s (in the history's
    zone), the ``calls`` admitted in it, and the units they ``cost``."""

    start: dt.datetime
    calls: int
    cost: int


@dataclass(frozen=True)
class UsageHistory:
    """A key's use per hour, day and month, oldest first, in ``zone`` (an IANA name, or
    an offset from UTC such as "UTC-08:00" for a reader that does not know the zone the
    limiters count in); periods with no call are left out. Counts bookings: a call that
    woke too late and booked again (``Decision.late_wakeups``) counts twice, as in the
    windows."""

    zone: str
    hours: tuple[Period, ...]
    days: tuple[Period, ...]
    months: tuple[Period, ...]


def read_history(fields: Mapping[str, int], zone: str | None, key: str = "") -> UsageHistory:
    """The history a store's ``fields`` hold, its periods placed in ``zone``, else at the
    offset from UTC they were counted at. Fields no store writes (a count that is not one,
    a period no calendar holds: a hand in the store) are left out, with one warning
    naming the store ``key``; so are those the store left out itself (``SKIPPED``)."""
    skipped = fields.get(SKIPPED, 0)
    if zone is not None:
        tz: dt.tzinfo = zone_of(zone)
    else:
        try:
            tz = dt.timezone(dt.timedelta(microseconds=fields.get(OFFSET, 0)))
        except (ValueError, OverflowError, TypeError):  # not an offset a zone has
            tz, skipped = dt.timezone.utc, skipped + 1
        zone = str(tz)
    grains: dict[str, list[Period]] = {"h": [], "d": [], "m": []}
    for name, calls in fields.items():
        grain, number = name[:1], name[1:]
        if name in (OFFSET, SKIPPED) or (grain in "HDM" and FIELD.match(name)):
            continue  # (the units beyond one per call: read with their period, below)
        extra = fields.get(grain.upper() + number, 0)
        try:
            if grain not in grains or not FIELD.match(name):
                raise ValueError(name)
            if not (0 < calls < MAX_TOTAL and 0 <= extra < MAX_TOTAL):
                raise ValueError(calls, extra)
            start = _start(grain, int(number), tz)
        except (ValueError, OverflowError, TypeError):
            skipped += 1
            continue
        grains[grain].append(Period(start, calls, calls + extra))
    if skipped:
        logger.warning(
            "store key %s: %d field(s) of its usage history were left out, as no store writes them",
            key,
            skipped,
        )
    ordered = {grain: tuple(sorted(ps, key=lambda p: p.start)) for grain, ps in grains.items()}
    return UsageHistory(zone, ordered["h"], ordered["d"], ordered["m"])


def _start(grain: str, period: int, tz: dt.tzinfo) -> dt.datetime:
    if grain == "h":
        local = EPOCH + dt.timedelta(hours=period)
    elif grain == "d":
        local = EPOCH + dt.timedelta(days=period)
    else:
        local = dt.datetime(period // 12, period % 12 + 1, 1)
    return local.replace(tzinfo=tz)


STEP_US = 15 * 60 * US  # offsets change on a quarter hour of UTC at most (Adelaide: :30)


class Offsets:
    """A zone's offset from UTC at a time, for the store to count in local periods;
    asked again once per quarter hour of UTC (no zone changes its offset between two)."""

    def __init__(self, zone: str) -> None:
        self.zone = zone
        self._tz = None if zone == "UTC" else zone_of(zone)
        self.fixed = self._tz is None  # its offset never changes (UTC: 0)
        # The quarter hour last asked about (µs since the epoch // STEP_US) and its
        # offset (µs), replaced whole: no lock needed.
        self._known: tuple[int, int] | None = None

    def at(self, epoch_us: int) -> int:
        if self._tz is None:
            return 0
        step, known = epoch_us // STEP_US, self._known
        if known is not None and known[0] == step:
            return known[1]
        delta = dt.datetime.fromtimestamp(epoch_us / US, self._tz).utcoffset()
        offset = round((delta or dt.timedelta(0)).total_seconds() * US)
        self._known = (step, offset)
        return offset


def spec_for(store_key: str, history: History, offsets: Offsets, epoch_us: int) -> HistorySpec:
    keep = (history.hours, history.days, history.months)
    return HistorySpec(store_key, keep, offsets.at(epoch_us))
