"""What a limiter does to a key besides admitting calls, written once for both worlds:
read its usage and its history, pause it, reset it."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

from ._backends.base import ReadHistory, Snapshot
from ._calls import ask_flow, execute_flow, introduce_flow
from ._config import us_to_seconds
from ._core import LimiterCore
from ._errors import BackendError
from ._events import PAUSED
from ._flow import Flow
from ._history import UsageHistory, read_history
from ._ranges import MAX_TOTAL
from ._results import LearnedLimit, RateUsage, Usage


def usage_flow(core: LimiterCore, store_key: str, now: float) -> Flow[Usage]:
    if not core._looked:  # (a read is never in a hurry: see introduce_flow)
        now = yield from introduce_flow(core, now, keep=False)
    snap, _, _ = yield from ask_flow(core, core._plan.inspect(store_key, now), now)
    # The stores repair or refuse a damaged key; whatever damage gets past them is
    # refused here rather than reported as units no key can have used.
    counts = (snap.booked, *snap.used)
    if not all(0 <= n < MAX_TOTAL for n in counts):
        raise BackendError(
            f"store key {store_key} is damaged: it reads as {counts} units used or "
            "booked; reset() the key"
        )
    return dataclasses.replace(usage_of(core, snap), upstream=core._upstream.get(store_key))


def usage_of(core: LimiterCore, snap: Snapshot) -> Usage:
    """A key's snapshot as the user reads it, in seconds, per rate of ``core``."""
    now = snap.now_us
    capped = bool(core.max_concurrent)
    return Usage(
        rates=tuple(
            RateUsage(
                rate=rate,
                used=used,
                booked=snap.booked,
                remaining=max(0, rate.limit - used - snap.booked),
                resets_in=us_to_seconds(max(0, ready - now)),
                resets_at=us_to_seconds(rate.calendar.bounds(now)[1]) if rate.calendar else None,
            )
            for rate, used, ready in zip(core.rates, snap.used, snap.ready_at_us, strict=True)
        ),
        next_slot_in=us_to_seconds(max(0, snap.next_slot_us - now)),
        paused_for=us_to_seconds(max(0, snap.pause_until_us - now)),
        paused_until=us_to_seconds(snap.pause_until_us) if snap.pause_until_us > now else None,
        in_flight=snap.in_flight if capped else None,
        waiting=snap.waiting if capped else None,
        learned=None
        if snap.learned is None
        else LearnedLimit(
            limit=snap.learned[0], used=snap.learned[1], resets_at=us_to_seconds(snap.learned[2])
        ),
    )


def history_flow(core: LimiterCore, store_key: str, now: float) -> Flow[UsageHistory]:
    op = ReadHistory(key=store_key, now_us=core._plan.at(now))
    fields, _, _ = yield from ask_flow(core, op, now)
    # (A limiter that keeps no history reads one at the offset it was counted at.)
    return read_history(fields, core._plan.zone, store_key)


def pause_flow(
    core: LimiterCore,
    key: str,
    seconds: float | timedelta,
    now: float,
    *,
    reason: str = "",
    source: str = "caller",
    route: str = "",
    refused: bool = False,
) -> Flow[tuple[float, float]]:
    """Pause ``key``: the pause's end (epoch seconds), and the local time after.
    ``reason``, ``source``, ``route``: what the event says (see Event); a pause a
    client sets also keeps its ``reason``, and whether the upstream ``refused``
    the call (a 429), in the store as the key's pushback (``top`` shows it)."""
    op = core._plan.pause(key, seconds, now)
    if reason or refused:
        op = dataclasses.replace(op, reason=reason, refused=refused)
    until, _, now = yield from execute_flow(core, op, now)
    if core._listeners:
        fields = {"reason": reason, "source": source, "route": route}
        core._emit(PAUSED, op.key, until=us_to_seconds(until), **fields)
    return us_to_seconds(until), now


def reset_flow(core: LimiterCore, key: str, now: float) -> Flow[None]:
    op = core._plan.reset(key, now)
    yield from execute_flow(core, op, now)
    core._upstream.pop(op.key, None)
    core._plan.lives.forget(op.key)
