"""A limiter's call to its store, written once for both worlds: retries, and what answers
when the store does not.

``execute_flow`` asks the store once, retries what may pass (as tenacity decides, within
``retry_for``), and if the store stays silent lets ``on_unavailable`` answer
(:mod:`._failure`). ``ask_flow`` asks again while a calendar rate's windows went stale,
``look_flow`` reads a key to refine the clock, and ``introduce_flow`` compares key
secrets across the fleet once, while a call sleeps anyway.
"""

from __future__ import annotations

import logging
from typing import TypeVar

import tenacity

from ._backends.base import Op, Snapshot, Verdict
from ._backends.batching import NotSent
from ._core import LimiterCore
from ._errors import BackendError, BackendUnavailable, shed_frames
from ._events import FALLBACK, STORE_ERROR
from ._failure import shrink
from ._flow import Call, Flow, Introduce, ReadClock, Sleep
from ._keys import SECRET_ENV, fingerprint
from ._planning import Planners, rewindowed
from ._store_clock import StoreClock

T = TypeVar("T")
log = logging.getLogger("throttle_client")

# Stale answers in a row (calendar windows asked again) before the store is given up on.
STALE_TRIES = 8


def execute_flow(core: LimiterCore, op: Op[T], now: float) -> Flow[tuple[T, bool, float]]:
    """Ask the store at local time ``now``, retrying what may pass; if it stays
    silent, ``on_unavailable`` answers. Returns the answer, whether the store gave it
    (False: on_unavailable did), and the local time it came back."""
    guard = core._guard
    if guard.store_resting(now):
        return fallback(core, op), False, now
    try:
        result, now = yield Call(op)  # the common case: no retry machinery at all
    except BackendUnavailable as first:
        failed_at = yield ReadClock()
        try:
            result, now = yield from _retry_flow(core, op, first, now, failed_at)
        except BackendUnavailable as exc:
            now = yield ReadClock()
            guard.failed(exc, now)
            if core._listeners:
                core._emit(STORE_ERROR, op.key, reason=type(exc.__cause__ or exc).__name__)
            shed_frames(exc)  # (what is raised from here on is made from the guard's copy)
            return fallback(core, op), False, now
    guard.succeeded()
    return result, True, now


def ask_flow(
    core: LimiterCore, op: Op[T], now: float, planners: Planners = ()
) -> Flow[tuple[T, bool, float]]:
    """``execute_flow``, asked again while the answer is stale: the calendar windows
    given did not reach a time the decision needed (the store's now, or a slot a
    window or more ahead), so they are given again around that time. ``planners``:
    those of a call's keys (its own limiter's when none is given)."""
    planners = planners or (core._plan,)
    around: tuple[int, ...] = ()
    for _ in range(STALE_TRIES):
        result, from_store, now = yield from execute_flow(core, op, now)
        if not isinstance(result, (Verdict, Snapshot)) or not result.stale:
            return result, from_store, now
        around += (result.slot_us if isinstance(result, Verdict) else result.next_slot_us,)
        op = rewindowed(op, planners, now, result.now_us, around)
    raise BackendError(
        f"the calendar windows of {core!r} moved on {STALE_TRIES} times in a row: the "
        "store's clock is jumping"
    )


def fallback(core: LimiterCore, op: Op[T]) -> T:
    """``on_unavailable``'s answer to ``op`` (or its BackendUnavailable)."""
    answer = core._guard.substitute(op)()
    if core._listeners:
        policy = core._guard.on_unavailable
        core._emit(FALLBACK, op.key, reason=policy if isinstance(policy, str) else "local")
    return answer


def _retry_flow(
    core: LimiterCore, op: Op[T], first: BackendUnavailable, started: float, now: float
) -> Flow[tuple[T, float]]:
    """The retries of ``op``, whose first attempt (begun at ``started``) failed: as
    tenacity's ``iter()`` decides, attempt by attempt. Raises the last failure."""
    # An operation failed with a call ahead of it that found the store down waited on
    # the store as long as that call did (NotSent.waited): its retries count that too,
    # so a hung store holds it one socket timeout, not two.
    spent = max(now - started, first.waited if isinstance(first, NotSent) else 0.0)
    decider = core._guard.retrying(op, spent)
    if decider is None:
        raise first
    retrying, budget = decider
    retrying.begin()
    state = tenacity.RetryCallState(retrying, fn=None, args=(), kwargs={})
    retries_began = now
    while True:
        budget.spent = now - retries_began
        action = retrying.iter(state)  # raises the last failure once it gives up
        if isinstance(action, tenacity.DoAttempt):
            try:
                # The same call id: an attempt that did book is found, not booked again.
                result, now = yield Call(shrink(op, now - started))
            except BackendUnavailable as exc:
                state.set_exception((type(exc), exc, exc.__traceback__))
                now = yield ReadClock()
            else:
                state.set_result(result)
        elif isinstance(action, tenacity.DoSleep):
            state.prepare_for_next_attempt()
            now = yield Sleep(float(action))
        else:
            return action, now


def look_flow(
    core: LimiterCore, store_key: str, now: float
) -> Flow[tuple[Snapshot | None, StoreClock | None, float]]:
    """A look at the key (Inspect) from local time ``now``: its snapshot, the clock the
    answer refined, and the local time after; (None, None, time) if the store went
    away meanwhile (what the call booked then stands)."""
    asked = now
    try:
        snap, from_store, now = yield from ask_flow(core, core._plan.inspect(store_key, now), now)
    except BackendUnavailable:
        after: float = yield ReadClock()
        return None, None, after
    return snap, core._pacing.observe(from_store, asked, now, snap.now_us), now


def introduce_flow(core: LimiterCore, now: float, *, keep: bool = True) -> Flow[float]:
    """Once per limiter: the namespace's record of its key secret (Backend.fingerprint).
    Workers that hash with different secrets (one set key_secret, or
    THROTTLE_CLIENT_KEY_SECRET, another not) give one token a log, and a quota, per
    secret: said once. Asked while a call sleeps anyway (``keep``: the record begins
    with this limiter's if it holds none), or by a read (only looked at: a read
    writes nothing), never in a call's way, and nothing fails for it. Returns the
    local time after."""
    if core._guard.store_resting(now):  # (a store just found down: not now)
        return now
    core._introduced = core._introduced or keep
    core._looked = True
    ours = fingerprint(core._config.secret)
    try:
        held, now = yield Introduce(core.namespace, ours, keep)
    except Exception as exc:  # (an outage is met again by the operations themselves)
        log.debug("could not read the record of namespace %r: %s", core.namespace, exc)
        after: float = yield ReadClock()
        return after
    if held is not None and held != ours:
        log.warning(
            "workers of namespace %r hash keys with different key secrets (this one's "
            "fingerprint is %s, the store's %s): each secret gives a token a log, and a "
            "quota, of its own. Give every worker the same key_secret (or %s)",
            core.namespace,
            ours,
            held,
            SECRET_ENV,
        )
    return now
