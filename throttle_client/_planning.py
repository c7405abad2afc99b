"""Planning: the operation a limiter sends its store, made from its configuration and what
it knows of each key.

A :class:`Planner` turns a call (a key, a cost, a wait) into the store's operation: the
key hashed, the quota with its calendar windows around the store's now, what this
worker expects of the key's life (``_lives``), and only the side data the limiter uses
(a key's card when one is due, its usage history when kept). It keeps what that needs
between calls: the keys' cards and lives, and the quota's current calendar windows.
A call charged to several keys is planned by each key's own planner.
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TypeVar

from ._backends.base import (
    Acquire,
    AcquireAll,
    AcquireAny,
    Charge,
    Choice,
    Inspect,
    Op,
    Pause,
    Quota,
    Reset,
    StoreCard,
    Verdict,
    Windows,
)
from ._backends.history import HistorySpec
from ._calendar import AHEAD, CalendarWindow
from ._cards import Cards
from ._config import US, Config
from ._events import key_label
from ._history import Offsets, spec_for
from ._keys import hashed_key
from ._lives import Lives
from ._pacing import Pacing
from ._rate import bounded_seconds

T = TypeVar("T")

# Call ids need only be unique among a key's calls of the last few seconds (a retry
# looks for its id there), not unguessable: 48 random bits, as 12 hex digits, which the
# Redis log keeps in each entry as 6 bytes. A private generator seeded from os.urandom is
# 3x cheaper than the secrets module; private so that a caller's random.seed() cannot
# make two workers draw the same ids, and reseeded in every forked child for that reason.
_ids = random.Random()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_ids.seed)


def call_id() -> str:
    """12 hex digits: 48 random bits."""
    return f"{_ids.getrandbits(48):012x}"


def windows_for(
    window: CalendarWindow,
    margin_us: int,
    now_us: int,
    around_us: tuple[int, ...] = (),
    *,
    bounded: bool = False,
) -> Windows:
    """What the store needs of ``window`` for a decision at store time ``now_us``: the
    start of the window holding now, and from the windows holding now and each time of
    ``around_us`` (times stale answers named), that one and ``AHEAD`` more. A bounded
    rate's are named for the coarse log that counts them (quota.Windows.name)."""
    keep_from = window.bounds(now_us)[0]
    spans: set[tuple[int, int]] = set()
    for moment in (now_us, *around_us):
        span = window.bounds(moment)
        for _ in range(AHEAD + 1):
            spans.add(span)
            span = window.bounds(span[1])
    name = f"{window.unit}/{window.tz}/{window.anchor_day}/{margin_us}" if bounded else ""
    return Windows(keep_from, tuple(sorted(spans)), margin_us, name)


class Planner:
    """One limiter's operations, and what it keeps between them to make them."""

    def __init__(
        self, config: Config, pacing: Pacing, wall: Callable[[], float], *, cards: bool = True
    ) -> None:
        self.config = config
        self._keeps_cards = cards  # (a store that keeps no cards is sent none)
        self.pacing = pacing  # (the store's time, as estimated)
        self._wall = wall
        self.lives = Lives()  # what this worker knows of its keys' lives in the store
        self._offsets = Offsets(config.zone)
        # Each key's card in the store (its label and this limiter's rules, for status
        # and top), sent with a decision on the key every half of its horizon.
        self.cards = Cards(config.label, config.card, every=config.horizon / 2)
        # Acquires renew the key's TTL (the horizon past its newest slot, and a tenth
        # more in Redis) and send its card every half horizon: a card that lasts 1.6
        # horizons outlives the key, by less than that. A pause or a learned limit that
        # holds the key longer sends its card along, which then lasts as long as it.
        self._card_ttl_us = round(1.6 * config.horizon * US)
        # The quota with the calendar windows around the store's now, and the store
        # times it holds for: (quota, from, until), replaced whole (no lock needed).
        self._windowed: tuple[Quota, int, int] | None = None

    # -- keys -------------------------------------------------------------------------

    def store_key(self, key: str) -> str:
        """The name of ``key``'s log in the store."""
        config = self.config
        tag = None if config.tag is None else config.tag(key)
        store_key = hashed_key(config.secret, config.namespace, key, tag)
        self.cards.label(store_key, key)  # (label=: asked once per key, and checked)
        return store_key

    def label_of(self, store_key: str) -> str:
        return self.cards.label(store_key) or key_label(store_key)

    # -- the quota --------------------------------------------------------------------

    def at(self, now: float) -> int | None:
        """An operation's time for local time ``now``: only with an injected clock."""
        return None if self.config.clock is None else round(now * US)

    def quota_at(
        self, now: float, *, store_now_us: int | None = None, around_us: tuple[int, ...] = ()
    ) -> Quota:
        """The quota of a decision at local time ``now``. A calendar rate's windows are
        the ones around the store's time (as estimated, or ``store_now_us`` as the store
        said it), and around each of ``around_us`` (times stale answers named)."""
        config = self.config
        if not config.calendar:
            return config.quota
        if store_now_us is None:
            store_now_us = self.pacing.store_time_us(now)
        cached = self._windowed
        if not around_us and cached is not None and cached[1] <= store_now_us < cached[2]:
            return cached[0]
        limits = tuple(
            (
                limit,
                windows_for(
                    rate.calendar,
                    config.margin_us,
                    store_now_us,
                    around_us,
                    bounded=rate.bounded,
                ),
            )
            if rate.calendar
            else (limit, period)
            for rate, (limit, period) in zip(config.rates, config.quota.limits, strict=True)
        )
        quota = dataclasses.replace(config.quota, limits=limits)
        if not around_us:
            given = [p for _, p in limits if isinstance(p, Windows)]
            valid = (max(w.keep_from for w in given), min(w.spans[0][1] for w in given))
            self._windowed = (quota, *valid)
        return quota

    # -- side data ----------------------------------------------------------------------

    def cards_due(self, store_key: str, now: float) -> tuple[StoreCard, ...]:
        """The key's card, if a decision made now is to write it."""
        if not self._keeps_cards:
            return ()
        return self.card_of(store_key) if self.cards.due(store_key, now) else ()

    def card_of(self, store_key: str, at_least: float = 0.0) -> tuple[StoreCard, ...]:
        """The key's card, to last its TTL, and ``at_least`` seconds (a lease's)."""
        if not self._keeps_cards or not self.cards.known(store_key):
            return ()  # (no cards in this store; or a card without its label: not written)
        ttl_us = max(self._card_ttl_us, round(at_least * US))
        return (StoreCard(store_key, self.cards.text(store_key), ttl_us),)

    def history_of(self, store_key: str) -> tuple[HistorySpec, ...]:
        """Where a call booked on the key is counted: its usage history, if kept."""
        history = self.config.history
        if history is None:
            return ()
        # (UTC's offset is 0: no clock is read. Another zone's is asked of the wall clock.)
        wall_us = 0 if self._offsets.fixed else round(self._wall() * US)
        return (spec_for(store_key, history, self._offsets, wall_us),)

    @property
    def zone(self) -> str | None:
        """The zone usage history is read in: None for a limiter that keeps none."""
        return self._offsets.zone if self.config.history else None

    # -- operations -----------------------------------------------------------------------

    def charge(self, key: str, cost: int, now: float) -> Charge:
        """``key`` charged ``cost``, with its quota and what is known of its life."""
        store_key = self.store_key(key)
        quota, known = (
            self.quota_at(now),
            self.lives.expect(store_key, self.pacing.store_time_us, now),
        )
        return Charge(store_key, quota, self.config.cost(cost), *known)

    def acquire(self, key: str, cost: int, max_wait_us: int, now: float, mark_us: int) -> Acquire:
        """The operation of a call charged to ``key`` alone and holding no lease."""
        store_key = self.store_key(key)
        expect, seen = self.lives.expect(store_key, self.pacing.store_time_us, now)
        return Acquire(
            key=store_key,
            quota=self.quota_at(now),
            cost=self.config.cost(cost),
            max_wait_us=max_wait_us,
            # A fresh id per call: equal slots never collapse, a retry never books twice.
            call_id=call_id(),
            now_us=self.at(now),
            mark_us=mark_us,
            cards=self.cards_due(store_key, now),
            history=self.history_of(store_key),
            expect=expect,
            seen=seen,
        )

    def acquire_any(
        self,
        keys: Sequence[str],
        cost: int,
        max_wait_us: int,
        now: float,
        mark_us: int,
        partners: Sequence[tuple[Planner, Charge]] = (),
    ) -> AcquireAny:
        """The operation of a pool's call: one of ``keys``, the one whose slot is earliest;
        charged to ``partners`` (each key's planner and charge) too."""
        store_time, expect = self.pacing.store_time_us, self.lives.expect
        choices = []
        cards: tuple[StoreCard, ...] = ()
        for key in keys:
            store_key = self.store_key(key)
            cards += self.cards_due(store_key, now)  # (every key's due: whichever is taken)
            choices.append(
                Choice(store_key, *expect(store_key, store_time, now), self.history_of(store_key))
            )
        for planner, charge in partners:
            cards += planner.cards_due(charge.key, now)
        first = choices[0]
        return AcquireAny(
            key=first.key,
            quota=self.quota_at(now),
            cost=self.config.cost(cost),
            max_wait_us=max_wait_us,
            call_id=call_id(),
            now_us=self.at(now),
            mark_us=mark_us,
            cards=cards,
            history=first.history,
            expect=first.expect,
            seen=first.seen,
            others=tuple(choices[1:]),
            partners=tuple(charge for _, charge in partners),
            partner_history=tuple(
                spec for planner, charge in partners for spec in planner.history_of(charge.key)
            ),
        )

    def inspect(self, store_key: str, now: float) -> Inspect:
        return Inspect(key=store_key, quota=self.quota_at(now), now_us=self.at(now))

    def pause(self, key: str, seconds: float | timedelta, now: float) -> Pause:
        duration = bounded_seconds(seconds, "pause seconds")
        store_key = self.store_key(key)
        return Pause(
            key=store_key,
            quota=self.quota_at(now),
            duration_us=round(duration * US),
            now_us=self.at(now),
            cards=self.card_of(store_key),  # (a pause may outlast the card)
        )

    def reset(self, key: str, now: float) -> Reset:
        # The time matters to a reset too: the store may sweep expired keys in its step.
        return Reset(key=self.store_key(key), now_us=self.at(now))


# A call charged to several keys: each key's planner, in the order of the call's keys.
Planners = Sequence[Planner]


def acquire_all(
    planners: Planners,
    charges: tuple[Charge, ...],
    max_wait_us: int,
    now: float,
    lease_id: str,
    mark_us: int,
) -> AcquireAll:
    """The operation of a call charged to several keys, or holding a lease."""
    pairs = list(zip(planners, charges, strict=True))
    return AcquireAll(
        charges,
        max_wait_us,
        call_id(),
        now_us=planners[0].at(now),
        lease_id=lease_id,
        mark_us=mark_us,
        cards=tuple(card for p, charge in pairs for card in p.cards_due(charge.key, now)),
        history=tuple(spec for p, charge in pairs for spec in p.history_of(charge.key)),
    )


def rewindowed(
    op: Op[T], planners: Planners, now: float, store_now_us: int, around_us: tuple[int, ...]
) -> Op[T]:
    """``op`` again, its calendar windows around the store's now and ``around_us``,
    the times stale answers named (every key's planner computes its own)."""

    def quota(planner: Planner) -> Quota:
        return planner.quota_at(now, store_now_us=store_now_us, around_us=around_us)

    if isinstance(op, AcquireAll):
        charges = tuple(
            dataclasses.replace(charge, quota=quota(planner))
            for charge, planner in zip(op.charges, planners, strict=True)
        )
        return dataclasses.replace(op, charges=charges)  # type: ignore[return-value]
    if isinstance(op, AcquireAny) and op.partners:
        partners = tuple(
            dataclasses.replace(partner, quota=quota(planner))
            for partner, planner in zip(op.partners, planners[1:], strict=True)
        )
        return dataclasses.replace(op, quota=quota(planners[0]), partners=partners)  # type: ignore[return-value]
    assert isinstance(op, (Acquire, Inspect, Pause))
    return dataclasses.replace(op, quota=quota(planners[0]))  # type: ignore[return-value]


def expecting(op: Acquire | AcquireAll, planners: Planners, now: float) -> Acquire | AcquireAll:
    """``op`` with what is known now of its keys' lives (Acquire.expect): an
    expectation made earlier may have outlived the bookings it stood for."""
    if isinstance(op, Acquire):
        planner = planners[0]
        expect, seen = planner.lives.expect(op.key, planner.pacing.store_time_us, now)
        if isinstance(op, AcquireAny):  # (every key of the pool)
            known = planner.lives.expect
            others = tuple(
                Choice(
                    other.key, *known(other.key, planner.pacing.store_time_us, now), other.history
                )
                for other in op.others
            )
            partners = _known(op.partners, planners[1:], now)
            return dataclasses.replace(
                op, expect=expect, seen=seen, others=others, partners=partners
            )
        return dataclasses.replace(op, expect=expect, seen=seen)
    return dataclasses.replace(op, charges=_known(op.charges, planners, now))


def _known(charges: Sequence[Charge], planners: Planners, now: float) -> tuple[Charge, ...]:
    """``charges`` with what each key's planner knows now of its life."""
    found = []
    for planner, charge in zip(planners, charges, strict=True):
        expect, seen = planner.lives.expect(charge.key, planner.pacing.store_time_us, now)
        found.append(dataclasses.replace(charge, expect=expect, seen=seen))
    return tuple(found)


def rebook(
    op: Acquire | AcquireAll,
    planners: Planners,
    max_wait_us: int,
    started: float,
    now: float,
    lead_us: int,
) -> Acquire | AcquireAll:
    """``op`` asked again at ``now`` as a new call, with what is left of its wait."""
    left = max(0, max_wait_us - round((now - started) * US))
    lead_us = min(lead_us, left)  # (the wait allowed bounds the lead too)
    again = dataclasses.replace(
        op, call_id=call_id(), max_wait_us=left, now_us=planners[0].at(now), lead_us=lead_us
    )
    return expecting(again, planners, now)


def unsent(op: Acquire | AcquireAll, planners: Planners) -> None:
    """The cards of a decision the store did not answer go with the next one."""
    for planner in planners:
        for card in op.cards:
            planner.cards.unsent(card.key)


def remember(op: Acquire | AcquireAll, verdict: Verdict, planners: Planners) -> list[str]:
    """What the store said of the call's keys' lives (see Lives); the store keys it found
    had lost their history (none, usually)."""
    slot = verdict.slot_us if verdict.allowed else -1
    told = zip(verdict.lives, verdict.totals, strict=True)
    if isinstance(op, Acquire):
        life, total = next(told)
        planners[0].lives.saw(op.key, life, total, slot, op.quota.horizon_us)
    else:
        for planner, charge, (life, total) in zip(planners, op.charges, told, strict=False):
            planner.lives.saw(charge.key, life, total, slot, charge.quota.horizon_us)
    if not verdict.lost:
        return []
    return [op.key] if isinstance(op, Acquire) else [c.key for c in op.charges]
