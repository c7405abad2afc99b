"""The arrival judge of the second tier (tests/arrivals_harness.py) excuses exactly what the
limiter does not promise: a request stalled after the limiter let it go in time."""

from __future__ import annotations

from tests.arrivals_harness import Arrival, Call, Setup, _within_promise
from throttle_client import Rate

US, NS = 1_000_000, 1_000_000_000
MARGIN = 0.025
SETUP = Setup(
    store="",
    upstream_url="",
    namespace="",
    token="",
    margin=MARGIN,
    duration=1.0,
    rates=(Rate.parse("2/second"),),
    min_interval=0.0,
)
T0 = 1_000.0  # the wall clock of the first slot; the upstream's clock reads it in ns


def run(*requests: tuple[float, float, float, int]) -> dict[str, int]:
    """Each request: (slot, when the limiter let it go, arrival, status), seconds after T0."""
    calls, arrivals = {}, []
    for slot, let_go, arrival, status in requests:
        slot_us = round((T0 + slot) * US)
        calls[slot_us] = Call(slot_us, T0 + let_go)
        arrivals.append(Arrival(slot_us, round((T0 + arrival) * NS), T0 + arrival, status))
    arrivals.sort(key=lambda a: a.at_ns)
    return _within_promise(SETUP, arrivals, calls)


def test_requests_within_the_margin_are_judged_as_they_arrived() -> None:
    # Slots 0, 0.5, 1.0 of 2/second: three arrivals in one second, though each within
    # the margin of its slot, would be a limiter at fault; here they are 1 s apart.
    judged = run((0.0, 0.001, 0.010, 200), (0.5, 0.501, 0.51, 200), (1.0, 1.001, 1.012, 200))
    assert judged == {
        "stalled": 0,
        "over_within_promise": 0,
        "close_within_promise": 0,
        "unexcused_429s": 0,
    }


def test_a_request_stalled_after_a_timely_release_is_put_back_and_its_429_excused() -> None:
    # Slot 0 let go at once but arriving 0.6 s later, beside the calls of slots 0.5 and
    # 1.03 (a window and a margin after the first): three arrivals within one second,
    # the third refused.
    judged = run((0.0, 0.001, 0.6, 200), (0.5, 0.501, 0.51, 200), (1.03, 1.031, 1.04, 429))
    assert judged["stalled"] == 1
    assert judged["over_within_promise"] == 0  # back at 0.025: 0.51 and 1.04 only
    assert judged["unexcused_429s"] == 0


def test_a_request_the_limiter_let_go_late_is_never_excused() -> None:
    # The same arrivals, but the limiter itself let slot 0 go 0.6 s after it.
    judged = run((0.0, 0.6, 0.6, 200), (0.5, 0.501, 0.51, 200), (1.03, 1.031, 1.04, 429))
    assert judged["stalled"] == 0
    assert judged["over_within_promise"] == 1 and judged["unexcused_429s"] == 1


def test_a_429_with_no_stalled_request_near_it_is_not_excused() -> None:
    # A request stalled long before, out of every window of the refused one.
    judged = run(
        (0.0, 0.001, 0.2, 200),
        (2.0, 2.001, 2.01, 200),
        (2.5, 2.501, 2.51, 200),
        (2.6, 2.601, 2.61, 429),
    )
    assert judged["stalled"] == 1 and judged["unexcused_429s"] == 1
