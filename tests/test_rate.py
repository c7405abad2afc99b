"""Rate: its three spellings and how a limiter accepts them."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest

from throttle_client import ConfigurationError, Limiter, MemoryBackend, Rate
from throttle_client._ranges import MAX_LIMIT, MAX_RATES, MAX_SECONDS, MIN_PERIOD


def test_three_spellings_are_one_rate() -> None:
    assert Rate(5000, timedelta(hours=1)) == Rate(5000, 3600) == Rate.parse("5000/hour")
    assert hash(Rate(5000, 3600)) == hash(Rate.parse("5000/hour"))


@pytest.mark.parametrize(
    ("text", "limit", "period"),
    [
        ("10/second", 10, 1.0),
        ("10/s", 10, 1.0),
        ("100/15 minutes", 100, 900.0),
        ("100 / 15 minutes", 100, 900.0),
        ("30 per minute", 30, 60.0),
        ("5000/HOUR", 5000, 3600.0),
        ("2/day", 2, 86400.0),
        ("7/250ms", 7, 0.25),
        ("1/1.5 seconds", 1, 1.5),
        ("  3/min  ", 3, 60.0),
    ],
)
def test_parse(text: str, limit: int, period: float) -> None:
    rate = Rate.parse(text)
    assert (rate.limit, rate.period) == (limit, period)


def test_period_in_microseconds() -> None:
    assert Rate(1, 0.000001).period_us == 1
    assert Rate(1, timedelta(milliseconds=250)).period_us == 250_000
    assert Rate(1, 2.01).period_us == 2_010_000


def test_a_rate_is_frozen_and_reads_well() -> None:
    rate = Rate(10, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rate.limit = 11  # type: ignore[misc]
    assert repr(rate) == "Rate(10, 1)" and str(rate) == "10/1s"
    assert isinstance(rate.period, float)


def test_a_limiter_takes_rates_and_strings() -> None:
    backend = MemoryBackend()
    assert Limiter(backend, rates="10/second").rates == (Rate(10, 1),)
    assert Limiter(backend, rates=Rate(10, 1)).rates == (Rate(10, 1),)
    mixed = Limiter(backend, rates=[Rate(5000, 3600), "10/second"])
    assert mixed.rates == (Rate(5000, 3600), Rate(10, 1))
    assert "Rate(5000, 3600)" in repr(mixed)
    with pytest.raises(ConfigurationError, match="from 1 to 16 rates, not 0"):
        Limiter(backend, rates=[])
    assert len(Limiter(backend, rates=["1/second"] * MAX_RATES).rates) == MAX_RATES


def test_the_edges_of_the_valid_ranges_are_inside() -> None:
    assert Rate(MAX_LIMIT, MAX_SECONDS).period_us == 315_576_000_000_000
    assert Rate(1, MIN_PERIOD).period_us == 1
    assert Rate.parse("1099511627776/3652.5 days") == Rate(MAX_LIMIT, MAX_SECONDS)
    limiter = Limiter(MemoryBackend(), rates=["1/second"], min_interval=MAX_SECONDS)
    assert limiter.min_interval == MAX_SECONDS


@pytest.mark.parametrize(
    "text",
    [
        "\u0661\u0660/second",  # Arabic-Indic ten
        "\uff11\uff10/second",  # full-width ten
        "10/\u0661 seconds",
        "10\u00a0/second",  # a no-break space
        "10/\u017fecond",  # long s, which re.I alone folds to 's'
        "9" * 5000 + "/second",  # more digits than int() will read
    ],
)
def test_parse_takes_ascii_digits_only(text: str) -> None:
    with pytest.raises(ConfigurationError) as error:
        Rate.parse(text)
    assert repr(text)[:60] in str(error.value)


def test_several_rates_in_one_string() -> None:
    backend = MemoryBackend()
    both = Limiter(backend, rates="5000/hour; 10/second")
    assert both.rates == (Rate(5000, 3600), Rate(10, 1))
    listed = Limiter(backend, rates=["5000/hour;10/second", Rate(3, 1)])
    assert listed.rates == (Rate(5000, 3600), Rate(10, 1), Rate(3, 1))
    for text in ("5000/hour;", "; 10/second", "5000/hour;; 10/second"):
        with pytest.raises(ConfigurationError, match="separated by ';'") as raised:
            Limiter(backend, rates=text)
        assert repr(text) in str(raised.value)
    with pytest.raises(ConfigurationError, match="cannot parse rate 'ten/second'"):
        Limiter(backend, rates="5000/hour; ten/second")
    with pytest.raises(ConfigurationError, match="from 1 to 16 rates, not 17"):
        Limiter(backend, rates="; ".join(["1/second"] * (MAX_RATES + 1)))
