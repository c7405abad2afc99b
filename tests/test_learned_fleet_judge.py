"""The learned-limit fleet's judge of which 429s a limiter could have foreseen."""

from __future__ import annotations

from tests.quota_upstream import Arrival, QuotaUpstream
from tests.test_learned_fleet import _raced


def _upstream() -> QuotaUpstream:
    upstream = QuotaUpstream.__new__(QuotaUpstream)  # (its judge only: no server)
    upstream.window = 3.0
    return upstream


def test_a_429_after_the_outside_client_spent_what_the_fleet_was_told_of_is_excused() -> None:
    arrivals = [
        Arrival(3.10, "fleet-0", 200, 2),
        Arrival(3.20, "outside", 200, 1),
        Arrival(3.30, "outside", 200, 0),
        Arrival(5.90, "fleet-1", 429, 0),
    ]
    assert _raced(_upstream(), arrivals, arrivals[-1])


def test_a_429_after_the_fleet_had_the_last_word_counts() -> None:
    arrivals = [
        Arrival(3.10, "outside", 200, 2),
        Arrival(3.20, "fleet-0", 200, 1),
        Arrival(3.30, "fleet-1", 200, 0),
        Arrival(3.40, "fleet-2", 429, 0),
    ]
    assert not _raced(_upstream(), arrivals, arrivals[-1])


def test_the_outside_client_in_an_earlier_window_excuses_nothing() -> None:
    arrivals = [
        Arrival(2.90, "outside", 200, 0),
        Arrival(3.10, "fleet-0", 200, 0),
        Arrival(3.40, "fleet-2", 429, 0),
    ]
    assert not _raced(_upstream(), arrivals, arrivals[-1])
