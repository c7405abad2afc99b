"""Calendar windows: where the window holding a moment
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
    "America/St_Johns",  # 1987-2010: clocks went back across midnight
    "Antarctica/Casey",  # a 3-hour step back
    "Europe/Moscow",  # odd offsets before 1970
    "Pacific/Apia",  # a skipped day in 2011
    LA,
    "Europe/Berlin",
    "Australia/Lord_Howe",  # a 30-minute DST change
    "America/Havana",  # clocks jump at midnight: no midnight that day
    "Asia/Kolkata",  # a half-hour offset
    "Pacific/Chatham",  # a 45-minute offset
]


H = 3_600_000_000  # an hour, µs


def at(zone: str, *wall: int) -> int:
    """Epoch µs of a local wall time (the first, if it comes twice)."""
    return round(datetime(*wall, tzinfo=ZoneInfo(zone)).timestamp() * 1_000_000)  # type: ignore[misc]


def local(zone: str, instant: int) -> datetime:
    return datetime.fromtimestamp(instant / 1_000_000, ZoneInfo(zone)).replace(tzinfo=None)


def test_a_pacific_day_is_23_and_25_hours_long_on_the_days_the_clocks_change() -> None:
    day = CalendarWindow("day", LA)
    for wall, hours in (((2026, 3, 8, 12), 23), ((2026, 11, 1, 12), 25), ((2026, 6, 1, 12), 24)):
        start, end = day.bounds(at(LA, *wall))
        assert (end - start) / H == hours
        assert local(LA, start) == datetime(*wall[:3])
        assert local(LA, end) == datetime(*wall[:3]) + timedelta(days=1)


def test_a_day_whose_midnight_is_skipped_begins_when_the_clocks_jump() -> None:
    start, end = CalendarWindow("day", "America/Havana").bounds(
        at("America/Havana", 2026, 3, 8, 12)
    )
    assert local("America/Havana", start) == datetime(2026, 3, 8, 1)
    assert (end - start) / H == 23


def test_the_repeated_hour_is_two_hour_windows() -> None:
    hour = CalendarWindow("hour", LA)
    first = at(LA, 2026, 11, 1, 1, 30)  # 01:30 PDT
    second = first + H  # 01:30 PST, the same wall time an hour later
    assert hour.bounds(first)[1] == hour.bounds(second)[0]
    assert all(end - start == H for start, end in map(hour.bounds, (first, second)))


def test_a_half_hour_change_of_offset_cuts_the_hour_it_falls_in() -> None:
    zone = "Australia/Lord_Howe"  # 02:00 -> 02:30 on 2026-10-04
    hour = CalendarWindow("hour", zone)
    before = hour.bounds(at(zone, 2026, 10, 4, 1, 50))
    after = hour.bounds(at(zone, 2026, 10, 4, 2, 40))
    assert before[1] == after[0]  # the hour before ends at the jump, the next begins there
    assert (before[1] - before[0], after[1] - after[0]) == (H, H // 2)


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
    moment=st.integers(at("UTC", 1900, 1, 1), at("UTC", 2040, 1, 1)),
)
def test_windows_hold_their_moment_and_tile_time(
    zone: str, unit: str, anchor: int, moment: int
) -> None:
    window = CalendarWindow(unit, zone, anchor if unit == "month" else 1)
    start, end = window.bounds(moment)
    assert start <= moment < end
    assert window.bounds(start) == (start, end)  # a window's start is in it
    assert window.bounds(end)[0] == end  # and the next begins where it ends
    hours = (end - start) / H
    low, high = {
        "minute": (1 / 60, 1 / 60),
        "hour": (1, 1),
        "day": (20, 28),
        "week": (164, 172),
        "month": (28 * 24 - 4, 31 * 24 + 4),
    }[unit]
    assert low <= hours <= high


@pytest.mark.parametrize(
    ("zone", "wall"),
    [
        ("America/St_Johns", (1987, 10, 24, 23, 1)),  # after the clocks went back at 00:01
        ("Antarctica/Casey", (2010, 3, 4, 23, 30)),
    ],
)
def test_a_date_that_comes_round_again_still_holds_its_moment(
    zone: str, wall: tuple[int, ...]
) -> None:
    for unit in ("day", "week", "month"):
        for moment in (at(zone, *wall), at(zone, *wall) + H):  # (it may come twice)
            start, end = CalendarWindow(unit, zone).bounds(moment)
            assert start <= moment < end


def test_minutes_before_1970_tile() -> None:
    minute = CalendarWindow("minute", "Europe/Moscow")
    moment = -1_593_820_800_000_000
    assert minute.bounds(moment - 1)[1] == minute.bounds(moment)[0]


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
