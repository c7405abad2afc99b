"""Reading upstream feedback: every header shape, and every malformed value we could think of."""

from datetime import datetime, timezone
from email.utils import format_datetime

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from throttle_client._feedback import read_feedback

NOW = 1_750_000_000.0  # a fixed "now", epoch seconds
MAX = 300.0


def feedback(status, headers, *, fallback=1.0, max_pause=MAX):
    # As a real response carries them: bytes on the wire, decoded by httpx.
    wire = httpx.Headers({name: value.encode() for name, value in headers.items()})
    return read_feedback(status, wire, now=NOW, max_pause=max_pause, fallback=fallback)


def http_date(seconds_from_now):
    return format_datetime(
        datetime.fromtimestamp(NOW + seconds_from_now, timezone.utc), usegmt=True
    )


# -- Retry-After -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "pause"),
    [("2", 2.0), ("0", 0.0), ("1.5", 1.5), (" 7 ", 7.0), ("120", 120.0)],
)
def test_retry_after_seconds(value, pause):
    answer = feedback(429, {"Retry-After": value})
    assert answer.refused
    assert answer.pause == pause
    assert answer.reason == "Retry-After"
    assert answer.problems == ()


def test_retry_after_http_date():
    answer = feedback(429, {"Retry-After": http_date(42)})
    assert answer.pause == pytest.approx(42.0)
    assert answer.problems == ()


def test_retry_after_http_date_in_the_past_means_go_now():
    assert feedback(503, {"Retry-After": http_date(-3600)}).pause == 0.0


def test_retry_after_http_date_with_unknown_zone_is_utc():
    value = http_date(10).replace("GMT", "-0000")
    assert feedback(429, {"Retry-After": value}).pause == pytest.approx(10.0)


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("abc", "neither delay-seconds nor an HTTP-date"),
        ("", "neither"),
        ("-1", "negative"),
        ("-0.5", "negative"),
        ("1e3", "not a non-negative number"),
        ("0x10", "not a non-negative number"),
        ("nan", "neither"),
        ("inf", "neither"),
        ("Infinity", "neither"),
        ("2, 3", "not a non-negative number"),  # the header sent twice
        ("2 seconds", "not a non-negative number"),
        ("١٢", "neither"),  # Arabic-Indic digits: float() would take them
        ("²", "neither"),  # "²".isdigit() is True
        ("9" * 400, "absurdly large"),
        ("99999999999", "absurdly large"),
        ("Wed, 99 Foo 2015 07:28:00 GMT", "neither"),
        ("Fri, 31 Dec 9999 23:59:59 GMT", "absurdly far away"),
    ],
)
def test_malformed_retry_after_is_ignored_with_a_problem_and_falls_back(value, why):
    answer = feedback(429, {"Retry-After": value}, fallback=4.0)
    assert answer.refused
    assert answer.pause == 4.0
    assert answer.reason == "backoff"
    [problem] = answer.problems
    assert problem.header == "Retry-After"
    assert why in problem.message


def test_retry_after_above_max_pause_is_capped_with_a_problem():
    answer = feedback(429, {"Retry-After": "3600"})
    assert answer.pause == MAX
    [problem] = answer.problems
    assert "capped" in problem.message and "3600" in problem.message


def test_429_without_retry_after_falls_back():
    answer = feedback(429, {})
    assert (answer.refused, answer.pause, answer.reason, answer.problems) == (
        True,
        1.0,
        "backoff",
        (),
    )


def test_fallback_is_capped_too():
    assert feedback(429, {}, fallback=1000.0).pause == MAX


@pytest.mark.parametrize(
    ("status", "headers", "refused", "pause"),
    [
        (503, {"Retry-After": "5"}, True, 5.0),
        (503, {}, False, None),  # an outage, not a quota: nothing to pause
        (500, {"Retry-After": "5"}, False, None),
        (200, {"Retry-After": "5"}, False, None),
        (403, {}, False, None),
        (403, {"Retry-After": "6"}, True, 6.0),  # GitHub's secondary rate limit
        (200, {}, False, None),
    ],
)
def test_which_statuses_are_refusals(status, headers, refused, pause):
    answer = feedback(status, headers)
    assert (answer.refused, answer.pause) == (refused, pause)


# -- X-RateLimit-* ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reset", "pause"),
    [
        (str(int(NOW) + 30), 30.0),  # epoch seconds, as GitHub sends
        (str(int(NOW * 1000) + 45_000), 45.0),  # epoch milliseconds
        ("30", 30.0),  # delta seconds
        ("0", 0.0),
        (str(int(NOW) - 100), 0.0),  # a reset already past: the quota is back
    ],
)
def test_x_ratelimit_spent_pauses_until_the_reset(reset, pause):
    answer = feedback(200, {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": reset})
    assert not answer.refused
    assert answer.pause == pytest.approx(pause)
    assert answer.reason == "X-RateLimit-Reset"


def test_x_ratelimit_with_quota_left_says_nothing():
    answer = feedback(200, {"X-RateLimit-Remaining": "3", "X-RateLimit-Reset": "30"})
    assert answer.pause is None and answer.problems == ()


def test_x_ratelimit_remaining_zero_without_reset_says_nothing():
    assert feedback(200, {"X-RateLimit-Remaining": "0"}).pause is None


def test_github_primary_limit_403_is_a_refusal():
    headers = {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": str(int(NOW) + 60)}
    answer = feedback(403, headers)
    assert answer.refused and answer.pause == pytest.approx(60.0)


@pytest.mark.parametrize(
    ("remaining", "reset", "header"),
    [
        ("zero", "30", "X-RateLimit-Remaining"),
        ("-1", "30", "X-RateLimit-Remaining"),
        ("0.0", "30", "X-RateLimit-Remaining"),
        ("0", "soon", "X-RateLimit-Reset"),
        ("0", "-30", "X-RateLimit-Reset"),
        ("0", "1e12", "X-RateLimit-Reset"),
        ("0", "9" * 30, "X-RateLimit-Reset"),  # epoch ms far beyond any sane date
    ],
)
def test_malformed_x_ratelimit_is_ignored_with_a_problem(remaining, reset, header):
    answer = feedback(200, {"X-RateLimit-Remaining": remaining, "X-RateLimit-Reset": reset})
    assert answer.pause is None
    [problem] = answer.problems
    assert problem.header == "X-RateLimit-Reset"  # reported under the pair's reset field
    assert header in problem.message


def test_x_ratelimit_reset_far_ahead_is_capped():
    headers = {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": str(int(NOW) + 86_400)}
    answer = feedback(200, headers)
    assert answer.pause == MAX
    assert "capped" in answer.problems[0].message


def test_the_longest_pause_asked_wins():
    headers = {
        "Retry-After": "2",
        "X-RateLimit-Remaining": "0",
        "X-RateLimit-Reset": str(int(NOW) + 40),
    }
    answer = feedback(429, headers)
    assert answer.pause == pytest.approx(40.0)
    assert answer.reason == "X-RateLimit-Reset"


def test_a_malformed_field_does_not_hide_a_good_one():
    headers = {"Retry-After": "garbage", "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "9"}
    answer = feedback(429, headers)
    assert answer.pause == 9.0
    assert [p.header for p in answer.problems] == ["Retry-After"]


# -- IETF RateLimit fields -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "pause"),
    [
        # drafts 00-06: separate fields
        ({"RateLimit-Remaining": "0", "RateLimit-Reset": "12"}, 12.0),
        ({"RateLimit-Remaining": "5", "RateLimit-Reset": "12"}, None),
        ({"RateLimit-Limit": "10", "RateLimit-Remaining": "0"}, None),
        # draft 07: one dictionary
        ({"RateLimit": "limit=10, remaining=0, reset=5"}, 5.0),
        ({"RateLimit": "limit=10, remaining=4, reset=5"}, None),
        ({"RateLimit": "limit=10, remaining=0", "RateLimit-Reset": "8"}, 8.0),
        # draft 08 on: named items, r = remaining, t = seconds to reset
        ({"RateLimit": '"default";r=0;t=7'}, 7.0),
        ({"RateLimit": '"default";r=3;t=7'}, None),
        ({"RateLimit": '"burst";r=0;t=2, "daily";r=0;t=90'}, 90.0),
        ({"RateLimit": '"burst";r=5;t=2, "daily";r=0;t=90'}, 90.0),
        # no t=: one whole window of the named policy
        ({"RateLimit": '"day";r=0', "RateLimit-Policy": '"day";q=100;w=60'}, 60.0),
        ({"RateLimit": '"day";r=0'}, None),
    ],
)
def test_ietf_fields(headers, pause):
    answer = feedback(200, headers)
    assert answer.pause == pause
    assert answer.problems == ()
    assert not answer.refused


@pytest.mark.parametrize(
    "headers",
    [
        {"RateLimit-Remaining": "none", "RateLimit-Reset": "12"},
        {"RateLimit-Remaining": "0", "RateLimit-Reset": "-12"},
        {"RateLimit": "limit=10, remaining=lots, reset=5"},
        {"RateLimit": "limit=10, remaining=0, reset=later"},
        {"RateLimit": '"default";t=7'},  # no r=
        {"RateLimit": '"default";r=0;t=-7'},
        {"RateLimit": '"default";r=0;t=1e9999'},
        {"RateLimit": '"default";r=x;t=7'},
    ],
)
def test_malformed_ietf_fields_are_ignored_with_a_problem(headers):
    answer = feedback(200, headers)
    assert answer.pause is None
    [problem] = answer.problems
    assert problem.header == "RateLimit"
    assert problem.message.startswith("ignored RateLimit")


def test_ietf_on_a_429_beats_the_fallback():
    answer = feedback(429, {"RateLimit": '"default";r=0;t=6'}, fallback=1.0)
    assert answer.refused and answer.pause == 6.0 and answer.reason == "RateLimit"


# -- nothing crashes -------------------------------------------------------------------------

HEADER_NAMES = [
    "Retry-After",
    "X-RateLimit-Remaining",
    "X-RateLimit-Reset",
    "RateLimit",
    "RateLimit-Remaining",
    "RateLimit-Reset",
    "RateLimit-Policy",
]
header_text = st.text(
    alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40
) | st.sampled_from(["0", "1", "-1", "1e9", "1e12", "", '"a";r=0', "r=0;t=", "remaining=0"])


@given(
    status=st.sampled_from([200, 403, 429, 500, 503]),
    headers=st.dictionaries(st.sampled_from(HEADER_NAMES), header_text, max_size=5),
    fallback=st.floats(min_value=0, max_value=1000),
)
def test_any_headers_give_a_bounded_pause_or_none(status, headers, fallback):
    answer = feedback(status, headers, fallback=fallback)
    assert answer.pause is None or 0.0 <= answer.pause <= MAX
    if answer.refused:
        assert answer.pause is not None
    for problem in answer.problems:
        assert problem.header in HEADER_NAMES


def test_plain_mappings_are_read_case_insensitively():
    plain = read_feedback(429, {"RETRY-AFTER": "3"}, now=NOW, max_pause=MAX, fallback=1.0)
    assert plain.pause == 3.0
    odd = read_feedback(429, {"Retry-After": "١٢"}, now=NOW, max_pause=MAX, fallback=1.0)
    assert odd.pause == 1.0 and odd.problems
