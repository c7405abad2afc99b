"""Calendar windows (issue 11 §1, the first piece): where the window holding a moment
begins and ends, in a time zone, across DST changes, month ends, leap days and anchors.
(The stores do not count in them yet.)"""

from __future__ import annotations

from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from throttle_client import ConfigurationError
from throttle_client._calendar import UNITS, CalendarWindow

LA = "America/Los_Angeles"
ZONES = [
    "UTC",
    LA,
    "Europe/Berlin",
    "Australia/Lord_Howe",  # a 30-minute DST change
    "America/Havana",  # clocks jump at midnight: no midnight that day
    "Asia/Kolkata",  # a half-hour offset
    "Pacific/Chatham",  # a 45-minute offset
]


def at(zone: str, *wall: int) -> float:
    return datetime(*wall, tzinfo=ZoneInfo(zone)).timestamp()  # type: ignore[misc]


def local(zone: str, instant: float) -> datetime:
    return datetime.fromtimestamp(instant, ZoneInfo(zone)).replace(tzinfo=None)


def test_a_pacific_day_is_23_and_25_hours_long_on_the_days_the_clocks_change() -> None:
    day = CalendarWindow("day", LA)
    for wall, hours in (((2026, 3, 8, 12), 23), ((2026, 11, 1, 12), 25), ((2026, 6, 1, 12), 24)):
        start, end = day.bounds(at(LA, *wall))
        assert (end - start) / 3600 == hours
        assert local(LA, start) == datetime(*wall[:3])
        assert local(LA, end) == datetime(*wall[:3]) + timedelta(days=1)


def test_a_day_whose_midnight_is_skipped_begins_when_the_clocks_jump() -> None:
    start, end = CalendarWindow("day", "America/Havana").bounds(
        at("America/Havana", 2026, 3, 8, 12)
    )
    assert local("America/Havana", start) == datetime(2026, 3, 8, 1)
    assert (end - start) / 3600 == 23


def test_the_repeated_hour_is_two_hour_windows() -> None:
    hour = CalendarWindow("hour", LA)
    first = at(LA, 2026, 11, 1, 1, 30)  # 01:30 PDT
    second = first + 3600  # 01:30 PST, the same wall time an hour later
    assert hour.bounds(first)[1] == hour.bounds(second)[0]
    assert all(end - start == 3600 for start, end in map(hour.bounds, (first, second)))


def test_a_half_hour_change_of_offset_cuts_the_hour_it_falls_in() -> None:
    zone = "Australia/Lord_Howe"  # 02:00 -> 02:30 on 2026-10-04
    hour = CalendarWindow("hour", zone)
    before = hour.bounds(at(zone, 2026, 10, 4, 1, 50))
    after = hour.bounds(at(zone, 2026, 10, 4, 2, 40))
    assert before[1] == after[0]  # the hour before ends at the jump, the next begins there
    assert (before[1] - before[0], after[1] - after[0]) == (3600, 1800)


@pytest.mark.parametrize(
    ("anchor", "moment", "start", "end"),
    [
        (30, (2026, 2, 15), (2026, 1, 30), (2026, 2, 28)),
        (30, (2026, 3, 1), (2026, 2, 28), (2026, 3, 30)),
        (30, (2026, 3, 30), (2026, 3, 30), (2026, 4, 30)),
        (31, (2024, 2, 29), (2024, 2, 29), (2024, 3, 31)),  # leap day
        (29, (2025, 2, 28), (2025, 2, 28), (2025, 3, 29)),
        (29, (2024, 2, 28), (2024, 1, 29), (2024, 2, 29)),
        (31, (2026, 12, 31), (2026, 12, 31), (2027, 1, 31)),
        (1, (2026, 12, 31), (2026, 12, 1), (2027, 1, 1)),
    ],
)
def test_a_month_anchored_on_a_late_day_clamps_to_shorter_months(
    anchor: int, moment: tuple[int, ...], start: tuple[int, ...], end: tuple[int, ...]
) -> None:
    month = CalendarWindow("month", "UTC", anchor)
    got = month.bounds(at("UTC", *moment, 12))
    assert (local("UTC", got[0]), local("UTC", got[1])) == (datetime(*start), datetime(*end))


@settings(max_examples=400)
@given(
    zone=st.sampled_from(ZONES),
    unit=st.sampled_from(UNITS),
    anchor=st.integers(1, 31),
    moment=st.floats(at("UTC", 2000, 1, 1), at("UTC", 2040, 1, 1)),
)
def test_windows_hold_their_moment_and_tile_time(
    zone: str, unit: str, anchor: int, moment: float
) -> None:
    window = CalendarWindow(unit, zone, anchor if unit == "month" else 1)
    start, end = window.bounds(moment)
    assert start <= moment < end
    assert window.bounds(start) == (start, end)  # a window's start is in it
    assert window.bounds(end)[0] == end  # and the next begins where it ends
    hours = (end - start) / 3600
    low, high = {
        "minute": (1 / 60, 1 / 60),
        "hour": (1, 1),
        "day": (22, 26),
        "week": (166, 170),
        "month": (28 * 24 - 2, 31 * 24 + 2),
    }[unit]
    assert low <= hours <= high


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"unit": "fortnight"}, "fortnight"),
        ({"unit": "day", "tz": "Mars/Olympus"}, "Mars/Olympus"),
        ({"unit": "month", "anchor_day": 32}, "32"),
        ({"unit": "day", "anchor_day": 15}, "monthly"),
    ],
)
def test_a_bad_window_is_refused_naming_the_value(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        CalendarWindow(**kwargs)  # type: ignore[arg-type]
