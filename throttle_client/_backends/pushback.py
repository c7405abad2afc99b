"""A key's pushback: what the upstream told the throttled clients about the key lately,
the reason for a pause one of them set (the header it read, or a backoff) and the calls
the upstream refused (429) in the last minute, as every store keeps it and reads it back."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from .ops import Pause

# The refusals a key's pushback counts: in steps of 10 s, the last 6 (a minute).
PUSHBACK_STEP_US = 10_000_000
PUSHBACK_STEPS = 6

# What a store keeps of a key's pushback: the reason of the transports' pause in force,
# its end (µs), and the refusals per step.
PushbackRecord = tuple[str, int, dict[int, int]]


class Pushback(NamedTuple):
    """What the upstream told the transports about a key lately, as the store keeps it:
    the ``reason`` of the pause in force that one of them set (the header it read, or
    "backoff"; None when no such pause is in force), and the calls it ``refused`` (429)
    in the last minute, counted in steps of 10 seconds."""

    reason: str | None
    refused: int
    until: float | None = None  # the end of that pause (epoch seconds), to match it


def pushback_step(now_us: int) -> int:
    return now_us // PUSHBACK_STEP_US


def refused_lately(steps: dict[int, int], now_us: int) -> int:
    """The refusals counted in the steps of the last minute."""
    newest = pushback_step(now_us)
    return sum(n for step, n in steps.items() if newest - PUSHBACK_STEPS < step <= newest)


def pushed_back(record: PushbackRecord, op: Pause, pause_until: int, now: int) -> PushbackRecord:
    """A key's pushback as a store keeps it (the reason of the transports' pause in
    force, its end, the refusals per step), after a transport's pause ``op`` at ``now``
    that left ``pause_until`` in force."""
    reason, until, steps = record
    if op.reason and pause_until == now + op.duration_us:  # (this pause is in force)
        reason, until = op.reason, pause_until
    if op.refused:
        step = pushback_step(now)
        steps = {s: n for s, n in steps.items() if s > step - PUSHBACK_STEPS}
        steps[step] = steps.get(step, 0) + 1
    return reason, until, steps


def pushback_at(reason: str, until_us: int, steps: dict[int, int], now_us: int) -> Pushback | None:
    """A key's pushback as it stands at ``now_us``, from what a store keeps (the reason
    of the transports' pause, its end, the refusals per step); None if nothing holds."""
    if until_us > now_us and reason:
        return Pushback(reason, refused_lately(steps, now_us), until_us / 1e6)
    said = Pushback(None, refused_lately(steps, now_us))
    return said if said.refused else None


def in_force(
    records: Iterable[tuple[str, PushbackRecord | None]], now_us: int
) -> dict[str, Pushback]:
    """The pushback of each key (store key, what the store keeps of it, if anything)
    that has any in force at ``now_us``."""
    told = {}
    for key, record in records:
        said = None if record is None else pushback_at(*record, now_us)
        if said is not None:
            told[key] = said
    return told


def pushback_ends(record: PushbackRecord) -> int:
    """When a key's pushback says nothing any more: its pause is over and its newest
    refusal has left the minute counted (refused_lately)."""
    _, until, steps = record
    counted = (max(steps, default=-PUSHBACK_STEPS) + PUSHBACK_STEPS) * PUSHBACK_STEP_US
    return max(until, counted)
