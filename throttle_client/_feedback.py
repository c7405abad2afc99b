"""What an upstream response says about the quota, turned into one pause duration.

No I/O and no clock of its own: :func:`read_feedback` takes the status, the headers
and ``now``, and answers how long every worker should hold off the request's key.
It understands

- ``Retry-After`` as delay-seconds or an HTTP-date (RFC 9110), on a 429 or a 503;
- ``X-RateLimit-Remaining: 0`` with ``X-RateLimit-Reset`` (epoch seconds as GitHub
  sends them, epoch milliseconds, or delta seconds);
- the IETF fields of draft-ietf-httpapi-ratelimit-headers in their three shapes:
  ``RateLimit-Remaining`` / ``RateLimit-Reset`` (drafts 00-06),
  ``RateLimit: limit=10, remaining=0, reset=5`` (draft 07), and
  ``RateLimit: "default";r=0;t=5`` with ``RateLimit-Policy: "default";q=10;w=60``
  (draft 08 on).

A value that cannot be read, is negative or absurd is ignored and reported as a
problem (the caller logs it); one above ``max_pause`` is capped and reported. A
refusal with no usable value falls back to ``fallback`` seconds.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timezone
from email.utils import parsedate_to_datetime

import httpx

# Above this a reset value is an epoch timestamp, not a delay: 1e9 s is September
# 2001, and no quota window is 31 years long. Above 1e12 it is epoch milliseconds.
EPOCH_SECONDS = 1e9
EPOCH_MILLISECONDS = 1e12
# A delay longer than this is a bug upstream (or a unit mix-up), not advice: ignore it.
ABSURD = 365 * 24 * 3600.0

_NUMBER = re.compile(r"[0-9]+(\.[0-9]+)?")  # ASCII only: "²".isdigit() is True


@dataclass(frozen=True)
class Problem:
    """A header value that was ignored or capped; ``header`` names it, ``message`` says why."""

    header: str
    message: str


@dataclass(frozen=True)
class Feedback:
    """What one response said.

    ``refused``: the upstream did not serve the request (429, or 503 with Retry-After),
    so it is worth retrying. ``pause``: seconds every worker should hold off the key,
    or None. ``reason``: the header (or ``"backoff"``) the pause came from. ``view``:
    what the headers say of the quota, spent or not (read when asked for: ``quota=True``).
    """

    refused: bool
    pause: float | None
    reason: str
    problems: tuple[Problem, ...] = ()
    view: QuotaView | None = None


class _Malformed(ValueError):
    """A header value that cannot be used; the message says which and why."""


def _bad(header: str, value: str, why: str) -> _Malformed:
    # Quota headers carry numbers and dates, never credentials, so echoing one is safe.
    return _Malformed(f"ignored {header}: {value[:60]!r} ({why})")


def _number(header: str, value: str) -> float:
    """A non-negative decimal; negative, exponent, nan/inf or junk is malformed."""
    text = value.strip()
    if text.startswith("-") and _NUMBER.fullmatch(text[1:]):
        raise _bad(header, value, "negative")
    if not _NUMBER.fullmatch(text):
        raise _bad(header, value, "not a non-negative number")
    number = float(text)
    if not math.isfinite(number):
        raise _bad(header, value, "absurdly large")
    return number


def _delay(header: str, value: str) -> float:
    delay = _number(header, value)
    if delay > ABSURD:
        raise _bad(header, value, "absurdly large")
    return delay


def _reset_delay(header: str, value: str, now: float) -> float:
    """A reset given as epoch seconds, epoch milliseconds or delta seconds, as a delay."""
    reset = _number(header, value)
    if reset > EPOCH_MILLISECONDS:
        reset = reset / 1000.0 - now
    elif reset > EPOCH_SECONDS:
        reset -= now
    if reset > ABSURD:
        raise _bad(header, value, "absurdly far away")
    return max(0.0, reset)  # a reset already past: the quota is back, no pause


def _retry_after(value: str, now: float) -> float:
    text = value.strip()
    if text and text[0] in "0123456789-":
        return _delay("Retry-After", value)
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        raise _bad("Retry-After", value, "neither delay-seconds nor an HTTP-date") from None
    if when.tzinfo is None:  # "-0000": RFC 5322's UTC of unknown origin
        when = when.replace(tzinfo=timezone.utc)
    delay = when.timestamp() - now
    if delay > ABSURD:
        raise _bad("Retry-After", value, "absurdly far away")
    return max(0.0, delay)  # a date already past: go now


def _spent(header: str, value: str) -> bool:
    """Is a "remaining" count zero?"""
    if not re.fullmatch(r"[0-9]+", value.strip()):
        raise _bad(header, value, "not a non-negative integer")
    return int(value) == 0


def _x_ratelimit(headers: httpx.Headers, now: float) -> float | None:
    """GitHub's and many others' ``X-RateLimit-Remaining: 0`` + ``X-RateLimit-Reset``."""
    remaining = headers.get("X-RateLimit-Remaining")
    reset = headers.get("X-RateLimit-Reset")
    if remaining is None or reset is None or not _spent("X-RateLimit-Remaining", remaining):
        return None
    return _reset_delay("X-RateLimit-Reset", reset, now)


def _params(member: str) -> tuple[str, dict[str, str]]:
    """``"name";a=1;b=2`` -> ("name", {"a": "1", "b": "2"}) (RFC 8941 items, loosely)."""
    head, *params = (part.strip() for part in member.split(";"))
    fields = {}
    for param in params:
        name, _, value = param.partition("=")
        fields[name.strip().lower()] = value.strip().strip('"')
    return head.strip('"'), fields


def _ietf(headers: httpx.Headers, now: float) -> float | None:
    """The pause the IETF RateLimit fields ask for, or None."""
    combined = headers.get("RateLimit")
    if combined is None:  # drafts 00-06: separate fields, reset in delta seconds
        remaining = headers.get("RateLimit-Remaining")
        reset = headers.get("RateLimit-Reset")
        if remaining is None or reset is None or not _spent("RateLimit-Remaining", remaining):
            return None
        return _reset_delay("RateLimit-Reset", reset, now)
    members = [m.strip() for m in combined.split(",") if m.strip()]
    if members and all("=" in m and ";" not in m for m in members):
        # Draft 07: one dictionary, "limit=10, remaining=0, reset=5".
        fields = {
            name.strip().lower(): v.strip() for name, _, v in (m.partition("=") for m in members)
        }
        remaining = fields.get("remaining")
        reset = fields.get("reset") or headers.get("RateLimit-Reset")
        if remaining is None or reset is None or not _spent("RateLimit", remaining):
            return None
        return _reset_delay("RateLimit", reset, now)
    # Draft 08 on: named items; r = remaining quota units, t = seconds until it resets.
    windows = {}
    for member in (headers.get("RateLimit-Policy") or "").split(","):
        if member.strip():
            name, fields = _params(member)
            if "w" in fields:
                windows[name] = fields["w"]
    pauses = []
    for member in members:
        name, fields = _params(member)
        if "r" not in fields:
            raise _bad("RateLimit", combined, "an item without r=")
        if not _spent("RateLimit", fields["r"]):
            continue
        # No t=: wait one whole window of the named policy, the longest it can take.
        reset = fields.get("t") or windows.get(name)
        if reset is not None:
            pauses.append(_delay("RateLimit", reset))
    return max(pauses) if pauses else None


# Every field read_feedback and read_quota_view read, as httpx keys them (lower case): a
# response with none of them (most are) says nothing of the quota, at the cost of one
# look at its field names.
_QUOTA_FIELDS = frozenset(
    {
        "retry-after",
        "x-ratelimit-remaining",
        "x-ratelimit-reset",
        "x-ratelimit-limit",
        "ratelimit",
        "ratelimit-remaining",
        "ratelimit-reset",
        "ratelimit-limit",
        "ratelimit-policy",
    }
)


def _silent(headers: httpx.Headers) -> bool:
    return _QUOTA_FIELDS.isdisjoint(headers.keys())


def read_feedback(
    status: int,
    headers: httpx.Headers | Mapping[str, str],
    *,
    now: float,
    max_pause: float,
    fallback: float,
    quota: bool = False,
) -> Feedback:
    """Read a response: was it refused, and how long should every worker hold off?

    Refused: a 429; a 503 with ``Retry-After``; a 403 with ``Retry-After`` or a spent
    ``X-RateLimit-Remaining`` (GitHub's way of refusing). ``now`` is epoch seconds, for
    HTTP-dates and epoch resets; ``fallback`` is the pause for a refusal that carries
    no usable value (the caller grows it per attempt). The longest pause asked wins.
    ``quota``: also read what the headers say of the quota (``Feedback.view``, as
    :func:`read_quota_view`), so that a response's headers are read once.

    >>> read_feedback(429, {"Retry-After": "2"}, now=time.time(), max_pause=300, fallback=1)
    Feedback(refused=True, pause=2.0, reason='Retry-After', problems=(), view=None)
    """
    if not isinstance(headers, httpx.Headers):
        headers = httpx.Headers(headers, encoding="utf-8")
    if status != 429 and _silent(headers):
        return Feedback(refused=False, pause=None, reason="", problems=())
    candidates: list[tuple[float, str]] = []
    problems: list[Problem] = []
    view = _quota_view(headers, now) if quota else None

    def consider(header: str, read: Callable[[], float | None]) -> None:
        try:
            pause = read()
        except _Malformed as why:
            problems.append(Problem(header, str(why)))
            return
        if pause is not None:
            candidates.append((pause, header))

    if "Retry-After" in headers and status in (403, 429, 503):
        consider("Retry-After", lambda: _retry_after(headers["Retry-After"], now))
    consider("X-RateLimit-Reset", lambda: _x_ratelimit(headers, now))
    consider("RateLimit", lambda: _ietf(headers, now))

    refused = (
        status == 429
        or (status == 503 and "Retry-After" in headers)
        or (status == 403 and ("Retry-After" in headers or _says_spent(headers)))
    )
    if candidates:
        pause, reason = max(candidates)
    elif refused:
        pause, reason = fallback, "backoff"
    else:
        return Feedback(refused=False, pause=None, reason="", problems=tuple(problems), view=view)
    pause = float(pause)
    if pause > max_pause and reason != "backoff":  # our own backoff is capped quietly
        problems.append(
            Problem(reason, f"capped {reason}: {pause:.0f}s is above max_pause={max_pause:g}s")
        )
    pause = min(pause, max_pause)
    return Feedback(refused, pause, reason, tuple(problems), view)


def _says_spent(headers: httpx.Headers) -> bool:
    remaining: str = headers.get("X-RateLimit-Remaining", "")
    return remaining.strip() == "0"


@dataclass(frozen=True)
class QuotaView:
    """What a response's headers say of the quota, spent or not:
    ``remaining`` units until the reset, ``resets_in`` seconds from now, out of ``limit``
    (None when not said). ``header`` names the field it came from."""

    remaining: int
    resets_in: float
    limit: int | None
    header: str


def _count(value: str | None) -> int | None:
    """A non-negative whole number, or None (a header that cannot be read is ignored here:
    read_feedback reports it)."""
    if value is None or not re.fullmatch(r"\s*[0-9]{1,15}\s*", value):
        return None
    return int(value)


def read_quota_view(headers: httpx.Headers | Mapping[str, str], *, now: float) -> QuotaView | None:
    """The strictest "``remaining`` more before ``reset``" a response's headers state:
    ``X-RateLimit-Remaining`` / ``-Reset`` / ``-Limit``, the IETF ``RateLimit`` fields in
    their three shapes (as :func:`read_feedback` reads them), or None. ``now`` is epoch
    seconds, for resets given as epoch times.

    >>> read_quota_view({"X-RateLimit-Remaining": "7", "X-RateLimit-Reset": "30"}, now=0)
    QuotaView(remaining=7, resets_in=30.0, limit=None, header='X-RateLimit-Remaining')
    """
    if not isinstance(headers, httpx.Headers):
        headers = httpx.Headers(headers, encoding="utf-8")
    return None if _silent(headers) else _quota_view(headers, now)


def _quota_view(headers: httpx.Headers, now: float) -> QuotaView | None:
    views: list[QuotaView] = []

    def add(header: str, remaining: str | None, reset: str | None, limit: str | None) -> None:
        count = _count(remaining)
        if count is None or reset is None:
            return
        try:
            delay = _reset_delay(header, reset, now)
        except _Malformed:
            return
        if delay > 0:  # a reset already past says nothing of what is left
            views.append(QuotaView(count, delay, _count(limit), header))

    add(
        "X-RateLimit-Remaining",
        headers.get("X-RateLimit-Remaining"),
        headers.get("X-RateLimit-Reset"),
        headers.get("X-RateLimit-Limit"),
    )
    combined = headers.get("RateLimit")
    if combined is None:  # drafts 00-06
        add(
            "RateLimit-Remaining",
            headers.get("RateLimit-Remaining"),
            headers.get("RateLimit-Reset"),
            headers.get("RateLimit-Limit"),
        )
    else:
        members = [m.strip() for m in combined.split(",") if m.strip()]
        if members and all("=" in m and ";" not in m for m in members):  # draft 07
            fields = {
                name.strip().lower(): v.strip()
                for name, _, v in (m.partition("=") for m in members)
            }
            reset = fields.get("reset") or headers.get("RateLimit-Reset")
            add("RateLimit", fields.get("remaining"), reset, fields.get("limit"))
        else:  # draft 08 on: named items, with their policies' quota and window
            policies = {}
            for member in (headers.get("RateLimit-Policy") or "").split(","):
                if member.strip():
                    name, params = _params(member)
                    policies[name] = params
            for member in members:
                name, params = _params(member)
                policy = policies.get(name, {})
                add(
                    "RateLimit",
                    params.get("r"),
                    params.get("t") or policy.get("w"),
                    policy.get("q"),
                )
    return min(views, key=lambda view: view.remaining, default=None)
