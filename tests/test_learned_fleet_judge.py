"""The learned-limit fleet's judge of which 429s a limiter could have foreseen."""

from __future__ import annotations

import pytest

from tests.quota_upstream import Arrival, QuotaUpstream
from tests.test_learned_fleet import _raced


def _upstream() -> QuotaUpstream:
    upstream = QuotaUpstream.__new__(QuotaUpstream)  # (its judge only: no server)
    upstream.window = 3.0
    return upstream


@pytest.mark.parametrize(
    ("arrivals", "excused"),
    [
        pytest.param(
            [("fleet-0", 3.1, 200), ("outside", 3.2, 200), ("outside", 3.3, 200)],
            True,
            id="the outside client spent what the fleet was told of",
        ),
        pytest.param(
            [("outside", 3.1, 200), ("fleet-0", 3.2, 200), ("fleet-1", 3.3, 200)],
            False,
            id="the fleet had the last word",
        ),
        pytest.param(
            [("outside", 2.9, 200), ("fleet-0", 3.1, 200)],
            False,
            id="the outside client spent in an earlier window",
        ),
    ],
)
def test_a_429_is_excused_only_when_the_outside_client_spent_after_the_fleet_s_last_word(
    arrivals: list[tuple[str, float, int]], excused: bool
) -> None:
    journal = [Arrival(at, client, status, 0) for client, at, status in arrivals]
    refused = Arrival(5.9, "fleet-2", 429, 0)
    assert _raced(_upstream(), [*journal, refused], refused) is excused
