"""Acquiring a slot, written once for both worlds: book, sleep, check the arrival.

``acquire_flow`` is try_acquire, acquire and a lease's admission: it books the earliest
slot that every key of the call allows (in one atomic step), sleeps until the store's
clock reaches it, and makes sure the call is still within ``margin`` of it, booking
again if not. ``send_flow`` is the acquire the clients built on a limiter (the
transports, ``@throttled``) make before each request, and ``lease_flow`` and
``end_flow`` a lease's admission and its end (renewal or release).
"""

from __future__ import annotations

import dataclasses
import logging
from datetime import timedelta

from ._backends import leases
from ._backends.base import (
    Acquire,
    AcquireAll,
    AcquireAny,
    Charge,
    Release,
    Renew,
    StoreCard,
    Verdict,
)
from ._calls import ask_flow, execute_flow, introduce_flow, look_flow
from ._config import NORMAL, US, us_to_seconds
from ._core import Also, LimiterCore, also_entry
from ._errors import ThrottleTimeout
from ._events import ADMITTED, LATE_WAKEUP, REFUSED, TIMED_OUT
from ._flow import AwaitGrant, Flow, Sleep
from ._planning import Planners, acquire_all, expecting, rebook, remember, rewindowed, unsent
from ._rate import Rate
from ._results import Decision

log = logging.getLogger("throttle_client")

# The most a real sleep ends early (timer granularity: uvloop rounds to milliseconds).
EARLY = 0.005
# How much earlier than a round trip and a half before its slot a sleeping call looks at
# its key (seconds): room for the wake-up's own lateness and a slower answer.
LOOK_AHEAD = 0.002
# The shortest sleep before a slot in which a limiter asks the namespace's record of its
# key secret, once (seconds, and four round trips to the store).
INTRODUCE_IN = 0.05
# Late wake-ups after which a call goes anyway (with a warning) rather than book again.
MAX_REBOOKS = 3
# A low-priority call books only a slot due within its limiter's margin (or one of its
# key's slots, if shorter; two round trips to the store, if longer), and never one
# less than this (µs) ahead.
REACH_US = 5_000
# Its shortest sleep between two asks (µs).
MIN_NAP_US = 1_000


def charges(core: LimiterCore, key: str, cost: int, also: Also, now: float) -> tuple[Charge, ...]:
    """Each key a call is charged to, with its quota and its cost, checked."""
    found = [core._plan.charge(key, cost, now)]
    for other, other_key, other_cost in (also_entry(entry, cost) for entry in also):
        core._check_partner(other)
        found.append(other._plan.charge(other_key, other_cost, now))
    return tuple(found)


def acquire_op(
    core: LimiterCore,
    key: str,
    cost: int,
    max_wait_us: int,
    now: float,
    also: Also = (),
    lease_id: str = "",
    mark: bool = False,
    pool: tuple[str, ...] = (),
) -> Acquire | AcquireAll:
    """The store operation of a call. ``mark``: the answer marks where a limit learned
    from the response would count from (a call of the clients, which read the
    response's headers). ``pool``: a pool's call, on one of these keys."""
    mark_us = core._config.margin_us if mark else -1
    if pool:
        if not also:
            return core._plan.acquire_any(pool, cost, max_wait_us, now, mark_us)
        # A pool's call charged to keys its tokens share (also=): an account.
        partners = charges(core, pool[0], cost, also, now)[1:]
        op = core._plan.acquire_any(
            pool,
            cost,
            max_wait_us,
            now,
            mark_us,
            list(zip([other._plan for other, *_ in also], partners, strict=True)),
        )
        core._together([*op.keys, *(partner.key for partner in partners)])
        return op
    if not also and not lease_id:
        return core._plan.acquire(key, cost, max_wait_us, now, mark_us)
    # A stacked call (also=), or a capped one (lease_id: the store keeps its lease
    # with its slot).
    charged = charges(core, key, cost, also, now)
    if len(charged) > 1:
        core._together([charge.key for charge in charged])
    planners = [limiter._plan for limiter in core._with(also)]
    return acquire_all(planners, charged, max_wait_us, now, lease_id, mark_us)


def lease_cards(
    core: LimiterCore, also: Also, charged: tuple[Charge, ...], at_least: float
) -> tuple[StoreCard, ...]:
    """The cards of a lease's capped keys, to last ``at_least`` seconds: a call in flight
    longer than its keys' windows keeps them in ``throttle-client top``."""
    owners = core._with(also)
    return tuple(
        card
        for index in leases.capped(charged)
        for card in owners[index]._plan.card_of(charged[index].key, at_least)
    )


def _decision(
    core: LimiterCore,
    verdict: Verdict,
    cost: int,
    *,
    waited: float = 0.0,
    late_wakeups: int = 0,
    rates: tuple[Rate, ...] | None = None,
    key: str | None = None,
) -> Decision:
    return Decision(
        allowed=verdict.allowed,
        retry_after=0.0
        if verdict.allowed
        else us_to_seconds(max(0, verdict.slot_us - verdict.now_us)),
        waited=waited,
        slot=us_to_seconds(verdict.slot_us),
        cost=cost,
        remaining=verdict.remaining,
        rates=core.rates if rates is None else rates,
        paused_until=us_to_seconds(verdict.pause_until_us)
        if verdict.pause_until_us > verdict.now_us
        else None,
        late_wakeups=late_wakeups,
        key=key,
        _slot_us=verdict.slot_us,
        _mark=verdict.mark,
        _born=verdict.born,
    )


def acquire_flow(
    core: LimiterCore,
    key: str,
    cost: int,
    max_wait_us: int,
    started: float,
    *,
    refusal: bool,
    recheck_pause: bool = False,
    also: Also = (),
    lease_id: str = "",
    pool: tuple[str, ...] = (),
    polling: int | None = None,
) -> Flow[Decision]:
    """try_acquire (``max_wait_us`` 0) and acquire, written once for both worlds.

    Book a slot, sleep until the store's clock reaches it, and check the call is
    still within ``margin`` of it. One that is not (a wake-up or an answer that came
    too late) would crowd the window it was counted in as the upstream sees it: it
    books a new slot instead, and the late one stays booked (under-use, never
    over-use). ``refusal``: a refusal is returned (try_acquire), not raised.

    ``recheck_pause`` (the transports): a call that slept reads the key once more
    before it goes, so it does not walk into a pause another worker set while it
    slept (the upstream said 429); if one is in force it books a slot after it.

    ``also``: (limiter, key) pairs the call is charged to as well, in the same atomic
    step (a stacked call: the token and its account). The look for a pause reads
    this limiter's key only.

    ``lease_id``: a capped call (a lease). A key that is full queues it in the store;
    it waits for its grant (the doorbell) and asks again, as long as its wait allows.

    ``pool``: a pool's call (acquire_any), on the one of these keys whose slot is
    earliest; once answered, it is a call on that key (``Decision.key``), and a call
    that books again (a pause found while it slept, a late wake-up) chooses again.

    ``polling``: one ask of a low-priority call (``yielding_flow``), which may wait
    ``polling`` µs in all: an acquire whose refusal, a slot beyond ``max_wait_us``, is
    returned and is no event of its own.
    """
    # The transports (recheck_pause) read the response's quota headers: mark for them.
    op = acquire_op(core, key, cost, max_wait_us, started, also, lease_id, recheck_pause, pool)
    pooled, picked = (op, key) if pool else (None, None)
    planners = [core._plan, *(other._plan for other, *_ in also)]
    rates = (core.rates + tuple(r for other, *_ in also for r in other.rates)) if also else None
    injected = core._config.clock is not None
    # Each limiter widened its windows by its own margin: a stacked call must arrive
    # within the narrowest of them.
    margin = min([core.margin, *(other.margin for other, *_ in also)])
    slept, late_wakeups, sent = 0.0, 0, started
    # This limiter's first call: its answer also waits for a connection to open and
    # the script to load, so its round trip says nothing of the store's.
    cold = core._pacing.cold()
    if not refusal and margin and 4 * core._pacing.rtt > margin:
        # A store whose answers take a good part of the margin: a slot due now would
        # be answered too late to meet, and booked again. Ask for one that the answer
        # reaches in time (twice the round trip ahead) from the start.
        # (No longer than the wait allowed: an idle key still answers within it.)
        op = dataclasses.replace(op, lead_us=min(round(2 * core._pacing.rtt * US), max_wait_us))
    while True:
        usual_rtt = core._pacing.rtt  # (before this answer: its own round trip excuses nothing)
        try:
            verdict, from_store, now = yield from ask_flow(core, op, sent, planners)
        except BaseException:
            unsent(op, planners)
            raise
        if not from_store:
            unsent(op, planners)
        if verdict.chosen >= 0:  # a pool's call: from here on, a call on the key it took
            assert isinstance(op, AcquireAny)
            op, picked = op.choice(verdict.chosen), pool[verdict.chosen]
        # on_unavailable's answers are made here, at the end of the call: none came late.
        clock = core._pacing.observe(
            from_store, sent if from_store else now, now, verdict.now_us, timed=not cold
        )
        if from_store and verdict.lives:
            _remember(core, op, verdict, planners)
        if verdict.waiting and isinstance(op, AcquireAll):
            left = max_wait_us - round((now - started) * US)
            if left > 0:
                # Queued behind a full cap: the grant's ring wakes it. Should a ring
                # be lost, it looks again now and then (a third of its shortest TTL,
                # which keeps its ticket alive), and the head waiter when a lease
                # could next expire on its own.
                wait = us_to_seconds(leases.shortest_ttl_us(op.charges)) / 3
                if verdict.head:
                    wait = min(wait, max(0.001, us_to_seconds(verdict.slot_us - verdict.now_us)))
                wait = min(wait, left / US)
                # An injected clock moves only with the injected sleep: the bell is
                # only looked at, and the wait slept.
                rang, now = yield AwaitGrant(op.lease_id, 0.0 if injected else wait)
                if not rang and injected:
                    now = yield Sleep(wait)
                left = max(0, max_wait_us - round((now - started) * US))
                op = dataclasses.replace(op, max_wait_us=left, now_us=core._plan.at(now))
                # (A long wait may outlast the calendar windows the call was given.)
                windowed = rewindowed(op, planners, now, core._pacing.store_time_us(now), ())
                assert isinstance(windowed, AcquireAll)
                again = expecting(windowed, planners, now)
                assert isinstance(again, AcquireAll)
                op = again
                sent = now
                continue
            verdict = verdict._replace(waiting=False)
        if not verdict.allowed:
            refused = _decision(
                core, verdict, cost, late_wakeups=late_wakeups, rates=rates, key=picked
            )
            if polling is not None:
                return refused
            if core._listeners:
                kind = REFUSED if refusal else TIMED_OUT
                core._emit(kind, op.key, cost=cost, retry_after=refused.retry_after)
            if refusal:
                return refused
            if verdict.full:
                raise ThrottleTimeout(
                    refused.retry_after,
                    "no room within the timeout: a capped key of the call (this "
                    "limiter's, or an also= partner's) has max_concurrent calls in "
                    "flight, or waiters ahead (a holder frees its slot when its call "
                    "ends, a streamed response when it is closed); retry_after, "
                    f"{refused.retry_after:.3f}s, is when the first lease would expire "
                    "if its holder stopped renewing it",
                    late_wakeups=late_wakeups,
                )
            raise ThrottleTimeout(refused.retry_after, late_wakeups=late_wakeups)
        slot = us_to_seconds(verdict.slot_us)
        wake = clock.wake_at(slot)
        rtt = now - sent  # this call's last round trip to the store
        # What a slot found within the wait the store was told of may still add: the
        # answer's way back, and what is not known of the store's clock.
        slack = EARLY + clock.spread(now) + 2 * usual_rtt
        # (A low-priority call's ask is judged by all the wait it has left.)
        if not refusal and (wake - started - slack) * US > (polling or max_wait_us):
            # The store found a slot within the wait it was told of, but the call got
            # there late (a connection to open, the script to load, retries): counted
            # from the caller's start, it would wait past its timeout. The slot stays
            # booked, unused (counted with the late wake-ups' slots): under-use, never a
            # wait the caller did not allow.
            if polling is not None:
                late_verdict = verdict._replace(allowed=False)
                return _decision(core, late_verdict, cost, rates=rates, key=picked)
            if core._listeners:
                core._emit(TIMED_OUT, op.key, cost=cost, retry_after=max(0.0, wake - now))
            raise ThrottleTimeout(max(0.0, wake - now), late_wakeups=late_wakeups + 1)
        answered_late = wake - now < 5e-7  # no sleep ahead (less is float rounding)
        if not answered_late:
            # A look at the key before the slot: for a pause another worker set while
            # this one slept (recheck_pause: the upstream said 429), and after a long
            # sleep, because what is known of the store's clock has aged past the
            # margin (DRIFT; sleeps shorter than about margin / (2 * DRIFT), 25 s by
            # default, never need it, nor does a store whose round trip alone is
            # longer than the margin). It is sent a round trip and a half before the
            # wake-up, so that its answer is back by the slot: read after the slot,
            # it would make every call late by a round trip, and a store a few
            # milliseconds away would have every call book again, for ever.
            look = recheck_pause or (margin and clock.spread(wake) > margin >= clock.width())
            ahead = 1.5 * rtt + (0.0 if injected else LOOK_AHEAD)
            if look and wake - now > 2 * ahead:
                if ahead:
                    slept += wake - ahead - now
                    now = yield Sleep(wake - ahead - now)
                else:  # (an injected clock: answers take no time, the look goes at the wake)
                    slept += wake - now
                    now = yield Sleep(wake - now)
                asked = now
                snap, seen, now = yield from look_flow(core, op.key, now)
                if snap is not None and seen is not None:  # (None: the slot stands)
                    clock, rtt = seen, now - asked
                    # (A pause that ends by the slot is one the call was booked after.)
                    if recheck_pause and snap.pause_until_us > verdict.slot_us:
                        log.debug("paused while it slept; queueing again")
                        again = pooled or op  # (a pool's call chooses again)
                        op = rebook(again, planners, max_wait_us, started, now, round(2 * rtt * US))
                        sent = now
                        continue
                wake = clock.wake_at(slot)  # (what the look said of the clock, too)
            if not core._introduced and wake - now > INTRODUCE_IN + 4 * rtt:
                now = yield from introduce_flow(core, now)  # (a sleep long enough for it)
            if wake - now >= 5e-7:
                slept += wake - now
                now = yield Sleep(wake - now)
                # A sleep may end a little early (uvloop's millisecond timers): sleep
                # the rest, once. (Not with an injected clock, which moves only as the
                # injected sleep moves it, nor after a sleep that did not sleep at
                # all: a test's.)
                if not injected and 5e-7 <= wake - now <= EARLY:
                    now = yield Sleep(wake - now)
        # A call that can wait may book again if its own answer came too late to
        # tell (not a sleep whose wake-up only the width of the bracket blurs).
        rebook_if_unsure = answered_late and not refusal
        late = core._pacing.late_by(clock, slot, now, rebook_if_unsure, margin) if margin else 0.0
        if late > margin and cold and not refusal:
            # A cold answer also waited for a connection to open and the script to
            # load, so it says little of the store's clock. A look at the key on the
            # open connection says more, before the call books again (and spends a
            # slot) for what may have been only its connection's set-up.
            asked = now
            _, seen, now = yield from look_flow(core, op.key, now)
            if seen is not None:
                clock, rtt = seen, now - asked
                late = core._pacing.late_by(clock, slot, now, rebook_if_unsure, margin)
            cold = False
        if late <= margin:
            if core._listeners:
                core._emit(ADMITTED, op.key, cost=cost, waited=slept, slot=slot)
            return _decision(
                core,
                verdict,
                cost,
                waited=slept,
                late_wakeups=late_wakeups,
                rates=rates,
                key=picked,
            )
        late_wakeups += 1
        if core._listeners:
            core._emit(LATE_WAKEUP, op.key, cost=cost, late_by=late)
        if late_wakeups > MAX_REBOOKS and not refusal:
            # Late again and again: this process cannot keep its calls within the
            # margin (a store too far or too slow for it, an overloaded event loop).
            # Booking again cannot help it, and each booking spends a slot: the call
            # goes, and the operator is told once what to change.
            core._pacing.warn_slow(late, rtt, margin)
            if core._listeners:
                core._emit(ADMITTED, op.key, cost=cost, waited=slept, slot=slot)
            return _decision(
                core,
                verdict,
                cost,
                waited=slept,
                late_wakeups=late_wakeups,
                rates=rates,
                key=picked,
            )
        log.debug(
            "%.1f ms past its slot (margin %.1f ms): booking a new one",
            late * 1000,
            margin * 1000,
        )
        if refusal:  # try_acquire asks once: its late slot is its answer, unused
            late_verdict = verdict._replace(allowed=False)
            refused = _decision(
                core, late_verdict, cost, late_wakeups=late_wakeups, rates=rates, key=picked
            )
            if core._listeners:
                core._emit(REFUSED, op.key, cost=cost, retry_after=refused.retry_after)
            return refused
        cold = False
        # The new slot lies twice the last round trip ahead, so that its answer is
        # back before it (one due now would be answered too late again), and is
        # slept to.
        op = rebook(pooled or op, planners, max_wait_us, started, now, round(2 * rtt * US))
        sent = now


def _remember(
    core: LimiterCore, op: Acquire | AcquireAll, verdict: Verdict, planners: Planners
) -> None:
    """What the store said of the call's keys' lives, and a warning if it found one
    that had lost its history."""
    lost = remember(op, verdict, planners)
    if lost:
        labels = [core._plan.label_of(store_key) for store_key in lost]
        core._plan.lives.told_lost(labels, core.namespace, verdict.pause_until_us - verdict.now_us)


def waiting_flow(
    core: LimiterCore,
    key: str,
    cost: int,
    timeout: float | timedelta | None,
    now: float,
    *,
    recheck_pause: bool = False,
    also: Also = (),
    lease_id: str = "",
    pool: tuple[str, ...] = (),
    priority: str = NORMAL,
) -> Flow[Decision]:
    """The flow of an acquire (raising ThrottleTimeout), from local time ``now``."""
    wait = core._config.max_wait_us(timeout)
    if priority != NORMAL:
        return yielding_flow(
            core, key, cost, wait, now, recheck_pause=recheck_pause, also=also, pool=pool
        )
    return acquire_flow(
        core,
        key,
        cost,
        wait,
        now,
        refusal=False,
        recheck_pause=recheck_pause,
        also=also,
        lease_id=lease_id,
        pool=pool,
    )


def yielding_flow(
    core: LimiterCore,
    key: str,
    cost: int,
    max_wait_us: int,
    started: float,
    *,
    recheck_pause: bool,
    also: Also,
    pool: tuple[str, ...],
) -> Flow[Decision]:
    """A low-priority acquire: it lets calls of the usual priority go first.

    A call books its slot when it asks, and the calls that ask later queue behind it:
    so a low-priority call books only a slot that is due within ``reach`` (the
    narrowest margin of the call's limiters, or one slot of a key if that is shorter:
    the widened gap, or the tightest rate's period over its limit; never less than two
    round trips to the store, nor REACH_US), and between asks sleeps until the slot
    it was told of comes within reach. A call of the usual priority that comes
    meanwhile books that slot, and waits for no low-priority call but one booked at
    most ``reach`` ahead of it: less than one slot beyond its own turn. (A reach as
    long as the lateness the margin allows keeps a wake-up that late from losing the
    slot it woke for.) The cost: an ask for every slot the call lets go. Once it has
    yielded for the limiter's ``low_priority_patience``, it queues as any call does
    (never starved longer); its timeout still bounds the whole wait. Its ``waited``
    is what it slept, between asks and for its slot."""
    patience_us = round(core._config.low_priority_patience * US)
    within_us = min(min(c._config.margin_us, c._config.spacing_us) for c in core._with(also))
    now, napped_us = started, 0
    while True:
        # (What it slept counts, not only the clock: an injected sleep may not move it.)
        spent_us = max(round((now - started) * US), napped_us)
        left_us = max_wait_us - spent_us
        reach_us = max(REACH_US, within_us, round(2 * core._pacing.rtt * US))
        if spent_us < patience_us and left_us > reach_us:
            decision = yield from acquire_flow(
                core,
                key,
                cost,
                reach_us,
                now,
                refusal=False,
                recheck_pause=recheck_pause,
                also=also,
                pool=pool,
                polling=left_us,
            )
            if decision.allowed:
                return dataclasses.replace(decision, waited=decision.waited + napped_us / US)
            slot_in_us = round(decision.retry_after * US)
            if slot_in_us <= left_us:
                # Asleep until the slot it was told of is within reach, its patience is
                # spent, or the rest of its wait is only reach: whichever comes first.
                nap_us = min(slot_in_us - reach_us, patience_us - spent_us, left_us - reach_us)
                nap_us = max(MIN_NAP_US, nap_us)
                napped_us += nap_us
                now = yield Sleep(nap_us / US)
                continue
            # Its slot lies past its whole wait (slots never come sooner): the ask below
            # says so at once, as a normal call's would.
        decision = yield from acquire_flow(
            core,
            key,
            cost,
            max(0, left_us),
            now,
            refusal=False,
            recheck_pause=recheck_pause,
            also=also,
            pool=pool,
        )
        return dataclasses.replace(decision, waited=decision.waited + napped_us / US)


def send_flow(
    core: LimiterCore,
    key: str,
    cost: int,
    timeout: float | timedelta | None,
    now: float,
    also: Also = (),
    lease_id: str = "",
    pool: tuple[str, ...] = (),
    priority: str = NORMAL,
) -> Flow[Decision]:
    """acquire as the clients built on a limiter use it before each request: a call that
    slept looks for a pause first, and the answer marks where a limit learned from the
    response counts from."""
    return waiting_flow(
        core,
        key,
        cost,
        timeout,
        now,
        recheck_pause=True,
        also=also,
        lease_id=lease_id,
        pool=pool,
        priority=priority,
    )


def lease_flow(
    core: LimiterCore,
    key: str,
    cost: int,
    timeout: float | timedelta | None,
    now: float,
    *,
    also: Also,
    lease_id: str,
    before_request: bool,
    priority: str = NORMAL,
) -> Flow[Decision]:
    """A lease's admission: an acquire that, capped, waits its turn under the caps."""
    if before_request:
        return send_flow(core, key, cost, timeout, now, also, lease_id=lease_id)
    return waiting_flow(
        core, key, cost, timeout, now, also=also, lease_id=lease_id, priority=priority
    )


def end_flow(
    core: LimiterCore,
    charged: tuple[Charge, ...],
    lease_id: str,
    now: float,
    renew: bool,
    cards: tuple[StoreCard, ...] = (),
) -> Flow[bool]:
    """Renew a lease (False: it had been lost, and is held again) or release it;
    ``cards``: what a renewal keeps alive of its keys' cards."""
    at = core._plan.at(now)
    op: Renew | Release
    op = (
        Renew(charged, lease_id, now_us=at, cards=cards)
        if renew
        else Release(charged, lease_id, now_us=at)
    )
    kept, _, _ = yield from execute_flow(core, op, now)
    return bool(kept) if renew else True
