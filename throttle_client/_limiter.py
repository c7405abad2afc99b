"""Limiter and AsyncLimiter: the public front of the sliding-window log.

Everything a limiter decides (validation, key hashing, retries of a failing store and
what answers instead, turning a store's verdict into a Decision or a ThrottleTimeout,
late wake-ups) is in ``_LimiterCore``, and each operation's course is one of its
flows, written once for both worlds (see ``_flow``): ``_execute_flow`` (one store
call, its retries, ``on_unavailable``) and ``_acquire_flow`` (book, sleep, check the
arrival) built on it. The two classes below only perform the flows' steps in their
world: call the store, sleep, read the clock.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import math
import os
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, NoReturn, TypeVar, overload

import httpx
import tenacity

from ._backends import leases, legacy
from ._backends.base import (
    Acquire,
    AcquireAll,
    AsyncBackend,
    Backend,
    Buckets,
    Charge,
    InlineAsync,
    Inspect,
    Learn,
    Op,
    Pause,
    Quota,
    ReadHistory,
    Release,
    Renew,
    Reset,
    Snapshot,
    StoreCard,
    ThreadedAsync,
    Verdict,
    Windows,
)
from ._backends.batching import GivenUp
from ._backends.history import HistorySpec
from ._calendar import windows_for
from ._cards import Card, Cards, rate_text
from ._errors import (
    BackendError,
    BackendUnavailable,
    ConfigurationError,
    CostTooHigh,
    ThrottleTimeout,
)
from ._events import (
    ADMITTED,
    FALLBACK,
    LATE_WAKEUP,
    PAUSED,
    REFUSED,
    STORE_ERROR,
    TIMED_OUT,
    Event,
    Listener,
    Listeners,
    key_label,
)
from ._failure import FailureGuard, LocalFallback, OnUnavailable, shrink
from ._feedback import ABSURD, QuotaView, read_feedback, read_quota_view
from ._flow import (
    AwaitGrant,
    Call,
    Flow,
    Introduce,
    LimiterStep,
    ReadClock,
    Sleep,
    arun,
    refuse_in_event_loop,
    run,
)
from ._history import History, Offsets, UsageHistory, read_history, spec_for
from ._keys import SECRET_ENV, check_namespace, fingerprint, hashed_key, resolve_secret
from ._lease import AsyncLease, Lease, _Held
from ._lives import Lives
from ._ranges import MAX_CONCURRENT, MAX_RATES, MAX_SECONDS, MAX_TOTAL
from ._rate import Rate, bounded_seconds, coerce_rate, to_seconds
from ._results import Decision, LearnedLimit, RateUsage, UpstreamView, Usage
from ._store_clock import DRIFT, StoreClock

T = TypeVar("T")
# The other limiters a stacked call is charged to, each with its key, and the cost
# charged to it when that is not the call's own.
Also = Sequence[tuple["_LimiterCore", str] | tuple["_LimiterCore", str, int]]
US = 1_000_000
log = logging.getLogger("throttle_client")

# How much later than its slot a request may leave, by default (seconds): see ``margin``
# in Limiter and the measurements behind this number in benchmarks/README.md.
DEFAULT_MARGIN = 0.025
# Answers after which a store whose time is still known less precisely than the margin
# is taken to be that far for good (see _LimiterCore._late_by).
WARM_UP = 8
# The longest a learned limit holds by default (seconds), as RetryPolicy.max_pause's: a
# reset further off is more often a bug upstream than advice.
DEFAULT_MAX_PAUSE = 300.0
# How many keys' last quota headers a limiter keeps for usage().upstream.
UPSTREAM_VIEWS = 4096
# Stale answers in a row (calendar windows asked again) before the store is given up on.
STALE_TRIES = 8
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


# How long a lease lives unless renewed (seconds): a worker killed with kill -9 frees its
# slots within this; the living renew theirs every third of it (Redisson's watchdog
# convention). The least allowed keeps renewals (and tests of crashes) sane.
DEFAULT_LEASE_TTL = 30.0
MIN_LEASE_TTL = 0.1


def _seconds(us: int) -> float:
    return us / US


# Call ids need only be unique within one key's log, not unguessable: a private
# generator seeded from os.urandom makes them 3x cheaper than secrets.token_urlsafe.
# It is private so that a caller's random.seed() cannot make two workers draw the
# same ids, and it is reseeded in every forked child for the same reason.
_ids = random.Random()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_ids.seed)


def _call_id() -> str:
    """11 url-safe characters from 64 random bits, like ``secrets.token_urlsafe(8)``."""
    return base64.urlsafe_b64encode(_ids.getrandbits(64).to_bytes(8, "big"))[:11].decode()


class _LimiterCore:
    """Configuration and every decision that needs no I/O."""

    _world = ""  # "sync" or "async": the limiters a stacked call may combine

    def _backend(self) -> Backend | AsyncBackend:
        raise NotImplementedError

    def _together(self, store_keys: list[str]) -> None:
        """Refuse, before anything is sent, keys the store cannot decide in one step; and,
        once any of them is tagged, keys whose tags differ, on every store, so that a
        mistake shows in a test on memory rather than on a Cluster in production."""
        tags = {key.partition("{")[2].partition("}")[0] for key in store_keys}
        tagged = any(not key.endswith("}") for key in store_keys)  # "<ns>:{<tag>}<key>"
        if tagged and len(tags) > 1:
            raise ConfigurationError(
                f"the keys of one call carry different tags (store keys {store_keys}): give "
                "each limiter a tag= that names what they share, the same value for all, "
                "and the same key_secret (the tag's digest depends on it)"
            )
        _store_of(self._backend()).check_together(store_keys)

    def __init__(
        self,
        *,
        rates: Sequence[Rate | str] | Rate | str,
        min_interval: float | timedelta = 0.0,
        margin: float | timedelta = DEFAULT_MARGIN,
        namespace: str = "default",
        key_secret: bytes | str | None = None,
        tag: Callable[[str], str] | None = None,
        clock: Callable[[], float] | None = None,
        on_unavailable: OnUnavailable = "raise",
        retry_for: float | timedelta = 1.0,
        max_concurrent: int | None = None,
        lease_ttl: float | timedelta | None = None,
        label: Callable[[str], str] | None = None,
        history: History | bool = False,
    ) -> None:
        listed = [rates] if isinstance(rates, (Rate, str)) else list(rates)
        if not 1 <= len(listed) <= MAX_RATES:
            raise ConfigurationError(
                f"a limiter needs from 1 to {MAX_RATES} rates, not {len(listed)}"
            )
        self.rates: tuple[Rate, ...] = tuple(coerce_rate(rate) for rate in listed)
        gap = bounded_seconds(min_interval, "min_interval")
        self.min_interval = gap
        slack = bounded_seconds(margin, "margin")
        self.margin = slack
        self.namespace = check_namespace(namespace)
        self._secret = resolve_secret(key_secret)
        if tag is not None and not callable(tag):
            raise TypeError(f"tag must be a function of a key, not {tag!r}")
        self._tag = tag
        self._clock = clock
        # Local time: the injected clock (which the store then follows too), else a
        # monotonic one; StoreClock relates it to the store's clock.
        self._local: Callable[[], float] = clock or time.monotonic
        # Wall-clock time, for what the upstream dates in epoch seconds (X-RateLimit-Reset).
        self._wall: Callable[[], float] = clock or time.time
        # With an injected clock the store runs on that very clock: no drift between them.
        drift = 0.0 if clock else DRIFT
        self._store_clock = StoreClock(drift=drift)  # answers from the store
        self._host_clock = StoreClock(drift=drift)  # answers from on_unavailable
        self._warned_spread = threading.Event()
        self._rtt = 0.0  # the latest round trip to the store (seconds)
        self._lives = Lives()  # what this worker knows of its keys' lives in the store
        # Whether the namespace's record was kept, or looked at (_introduce_flow).
        self._introduced = self._looked = False
        # The margin widens every window and the gap in the slot arithmetic: requests
        # that leave up to ``margin`` after their slots still never crowd a window, nor
        # come closer than the gap, as the upstream counts them on arrival. With no gap
        # there is no spacing to protect, and widening it would cap the rate at 1/margin.
        margin_us = round(slack * US)
        gap_us = round(gap * US)
        cap = max_concurrent
        if cap is not None and (
            isinstance(cap, bool) or not isinstance(cap, int) or not 1 <= cap <= MAX_CONCURRENT
        ):
            raise ConfigurationError(
                f"max_concurrent must be a whole number from 1 to {MAX_CONCURRENT}, or None, "
                f"not {cap!r}"
            )
        self.max_concurrent = cap
        if lease_ttl is not None and cap is None:
            raise ConfigurationError(
                f"lease_ttl={lease_ttl!r} without max_concurrent: only a capped limiter's "
                "calls hold leases"
            )
        ttl = bounded_seconds(
            DEFAULT_LEASE_TTL if lease_ttl is None else lease_ttl, "lease_ttl", lowest=MIN_LEASE_TTL
        )
        self.lease_ttl = ttl
        # A calendar rate's windows depend on the time: _quota_at() fills them in per
        # decision; this quota holds 0 in their place and is used as it is by limiters
        # with none.
        self._quota = Quota(
            limits=tuple(
                (rate.limit, 0 if rate.calendar else _sliding(rate, margin_us))
                for rate in self.rates
            ),
            min_interval_us=gap_us + margin_us if gap_us else 0,
            max_concurrent=cap or 0,
            lease_ttl_us=round(ttl * US) if cap else 0,
        )
        self._margin_us = margin_us
        self._calendar = any(rate.calendar for rate in self.rates)
        for rate in self.rates:
            if rate.calendar and slack > rate.period / 4:
                raise ConfigurationError(
                    f"margin={margin!r} is too wide for {rate!r}: a calendar window must "
                    "last longer than four margins"
                )
        # The quota with the calendar windows around the store's now, and the store
        # times it holds for: (quota, from, until), replaced whole (no lock needed).
        self._windowed: tuple[Quota, int, int] | None = None
        # The last quota headers read per store key (usage().upstream), the newest
        # UPSTREAM_VIEWS keys only; and whether a looser view has been reported.
        self._upstream: OrderedDict[str, UpstreamView] = OrderedDict()
        self._told_looser = False
        self._told_headers: set[str] = set()  # header values learn() could not read
        self._max_cost = min(rate.limit for rate in self.rates)
        self._guard = FailureGuard(on_unavailable, to_seconds(retry_for, "retry_for"))
        for problem in _doubtful(self.rates, gap, slack, cap, on_unavailable):
            log.warning("%r: %s", self, problem)
        self._listeners = Listeners()
        # Each key's card in the store (its label and this limiter's rules, for status
        # and top), sent with a decision on the key every half of its horizon: the
        # longest a call counts after its slot.
        horizon = max(gap, *(rate.period for rate in self.rates)) + slack
        # What each key's usage history keeps (None: none, the default: it outlives the
        # key by months, see _history.History), in the zone of the first calendar rate
        # unless told.
        if history is True:
            history = History()
        if history is not False and not isinstance(history, History):
            raise TypeError(f"history must be a History, True or False, not {history!r}")
        self._history = history or None
        zones = [rate.calendar.tz for rate in self.rates if rate.calendar is not None]
        zone = (self._history and self._history.zone) or (zones[0] if zones else "UTC")
        self._offsets = Offsets(zone)
        rules = tuple(rate_text(r) for r in self.rates)
        card = Card(None, self.namespace, rules, gap, slack, cap, zone if history else None)
        self._cards = Cards(label, card, every=horizon / 2)
        # Acquires renew the key's TTL (the horizon past its newest slot, and a tenth
        # more in Redis) and send its card every half horizon: a card that lasts 1.6
        # horizons outlives the key, by less than that. A pause or a learned limit that
        # holds the key longer sends its card along, which then lasts as long as it.
        self._card_ttl_us = round(1.6 * horizon * US)

    # -- validation -----------------------------------------------------------------

    def store_key(self, key: str) -> str:
        """The name of ``key``'s log in the store (see :func:`throttle_client.store_key`)."""
        tag = None if self._tag is None else self._tag(key)
        store_key = hashed_key(self._secret, self.namespace, key, tag)
        self._cards.label(store_key, key)  # (label=: asked once per key, and checked)
        return store_key

    def label(self, key: str) -> str:
        """The label of ``key``: what events, metrics, the transports' logs and the
        store's card of the key (``status``, ``top``) show instead of the key. The one
        ``label=`` gives, else the first 8 characters of its keyed hash (its store key),
        the same in every worker that shares the key secret."""
        return self._label_of(self.store_key(key))

    def _usage_key(self, key: str | None, store_key: str | None) -> str:
        """The store key ``usage`` reads: ``key``'s, or ``store_key`` as given."""
        if key is None and store_key is None:
            raise TypeError("usage() takes a key (a str, not NoneType), or store_key=")
        if key is not None and store_key is not None:
            raise TypeError("usage() takes a key or store_key=, not both")
        if store_key is None:
            assert key is not None
            return self.store_key(key)
        # A store key of another namespace (or none at all) would be read under this
        # limiter's rules, which are not that key's.
        prefix = f"{self.namespace}:{{"
        if not isinstance(store_key, str) or not (
            store_key.startswith(prefix) and "}" in store_key[len(prefix) :]
        ):
            raise ConfigurationError(
                f"store_key={store_key!r} is not a store key of namespace "
                f"{self.namespace!r} ('{prefix}...}}...', as Limiter.store_key gives)"
            )
        return store_key

    def _label_of(self, store_key: str) -> str:
        return self._cards.label(store_key) or key_label(store_key)

    def _cards_due(self, store_key: str, now: float) -> tuple[StoreCard, ...]:
        """The key's card, if a decision made now is to write it."""
        return self._card_of(store_key) if self._cards.due(store_key, now) else ()

    def _with(self, also: Also) -> list[_LimiterCore]:
        """This limiter and its partners in a call, in the order of the call's keys."""
        return [self, *(entry[0] for entry in also)]

    def _missed(self, op: Acquire | AcquireAll, also: Also) -> None:
        """The cards of a decision the store did not answer go with the next one."""
        for limiter in self._with(also):
            for card in op.cards:
                limiter._cards.missed(card.key)

    def _history_of(self, store_key: str) -> tuple[HistorySpec, ...]:
        """Where a call booked on the key is counted: its usage history, if kept."""
        if self._history is None:
            return ()
        # (UTC's offset is 0: no clock is read. Another zone's is asked of the wall clock.)
        wall_us = 0 if self._offsets.fixed else round(self._wall() * US)
        return (spec_for(store_key, self._history, self._offsets, wall_us),)

    def _card_of(self, store_key: str, at_least: float = 0.0) -> tuple[StoreCard, ...]:
        """The key's card, to last its TTL, and ``at_least`` seconds (a lease's)."""
        if not self._cards.known(store_key):  # (a card without its label: not written)
            return ()
        ttl_us = max(self._card_ttl_us, round(at_least * US))
        return (StoreCard(store_key, self._cards.text(store_key), ttl_us),)

    def listen(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener`` with every :class:`~throttle_client.Event` of this limiter
        (admitted, refused, timed out, late wake-up, paused, upstream status, store
        error, fallback); returns the function that stops it. Keys appear as their
        label, never as themselves."""
        return self._listeners.add(listener)

    def _emit(self, kind: str, store_key: str, **fields: Any) -> None:
        """Send an event about ``store_key`` (callers test ``self._listeners`` first:
        with no listener, no event is made)."""
        event = Event(kind, self.namespace, self._label_of(store_key), self._wall(), **fields)
        self._listeners.send(event)

    def _cost(self, cost: int) -> int:
        if isinstance(cost, bool) or not isinstance(cost, int) or cost < 1:
            raise ConfigurationError(f"cost must be a positive integer, not {cost!r}")
        if cost > self._max_cost:
            raise CostTooHigh(
                f"cost {cost} can never be admitted: it is above the limit of "
                f"{min(self.rates, key=lambda r: r.limit)!r}"
            )
        return cost

    def _max_wait_us(self, timeout: float | timedelta | None) -> int:
        # No slot is booked more than 10 years ahead (see _ranges): a longer timeout,
        # or None, waits for any slot there is, the same on every store.
        seconds = MAX_SECONDS if timeout is None else to_seconds(timeout, "timeout")
        if math.isnan(seconds) or seconds < 0:
            raise ConfigurationError(f"timeout must be >= 0 seconds or None, not {timeout!r}")
        return round(min(seconds, MAX_SECONDS) * US)

    def _quota_at(
        self, now: float, *, store_now_us: int | None = None, around_us: tuple[int, ...] = ()
    ) -> Quota:
        """The quota of a decision at local time ``now``. A calendar rate's windows are
        the ones around the store's time (as estimated, or ``store_now_us`` as the store
        said it), and around each of ``around_us`` (times stale answers named)."""
        if not self._calendar:
            return self._quota
        if store_now_us is None:
            store_now_us = self._store_time_us(now)
        cached = self._windowed
        if not around_us and cached is not None and cached[1] <= store_now_us < cached[2]:
            return cached[0]
        limits = tuple(
            (
                limit,
                windows_for(
                    rate.calendar, self._margin_us, store_now_us, around_us, bounded=rate.bounded
                ),
            )
            if rate.calendar
            else (limit, period)
            for rate, (limit, period) in zip(self.rates, self._quota.limits, strict=True)
        )
        quota = dataclasses.replace(self._quota, limits=limits)
        if not around_us:
            given = [p for _, p in limits if isinstance(p, Windows)]
            valid = (max(w.keep_from for w in given), min(w.spans[0][1] for w in given))
            self._windowed = (quota, *valid)
        return quota

    def _store_time_us(self, now: float) -> int:
        """The store's time at local time ``now``, as well as this limiter knows it."""
        if self._clock is not None:  # the store follows the injected clock
            return round(now * US)
        clock = self._store_clock
        if clock.answers:
            return round((now + (clock.low(now) + clock.high(now)) / 2) * US)
        return round(time.time() * US)

    def _rewindowed(
        self, op: Op[T], also: Also, now: float, store_now_us: int, around_us: tuple[int, ...]
    ) -> Op[T]:
        """``op`` again, its calendar windows around the store's now and ``around_us``,
        the times stale answers named (every limiter of a stacked call computes its own)."""

        def quota(limiter: _LimiterCore) -> Quota:
            return limiter._quota_at(now, store_now_us=store_now_us, around_us=around_us)

        if isinstance(op, AcquireAll):
            owners = self._with(also)
            charges = tuple(
                dataclasses.replace(charge, quota=quota(owner))
                for charge, owner in zip(op.charges, owners, strict=True)
            )
            return dataclasses.replace(op, charges=charges)  # type: ignore[return-value]
        assert isinstance(op, (Acquire, Inspect, Pause))
        return dataclasses.replace(op, quota=quota(self))  # type: ignore[return-value]

    def _at(self, now: float) -> int | None:
        """An operation's time for local time ``now``: only with an injected clock."""
        return None if self._clock is None else round(now * US)

    def _capped(self, also: Also) -> bool:
        """Whether a call with these partners holds a lease: some limiter has a cap."""
        # (A malformed entry is not judged here: _charges refuses it, saying why.)
        return bool(self.max_concurrent) or any(
            isinstance(entry, tuple) and getattr(entry[0], "max_concurrent", None) for entry in also
        )

    def _charges(self, key: str, cost: int, also: Also, now: float) -> tuple[Charge, ...]:
        """Each key the call is charged to, with its quota and its cost, checked."""
        charges = [self._charge(key, cost, now)]
        for other, other_key, other_cost in (_also_entry(entry, cost) for entry in also):
            self._check_partner(other)
            charges.append(other._charge(other_key, other_cost, now))
        return tuple(charges)

    def _charge(self, key: str, cost: int, now: float) -> Charge:
        store_key = self.store_key(key)
        quota, known = self._quota_at(now), self._lives.expect(store_key, self._store_time_us, now)
        return Charge(store_key, quota, self._cost(cost), *known)

    def _acquire_op(
        self,
        key: str,
        cost: int,
        max_wait_us: int,
        now: float,
        also: Also = (),
        lease_id: str = "",
        mark: bool = False,
    ) -> Acquire | AcquireAll:
        """``mark``: the answer marks where a limit learned from the response would count
        from (a call of the transports, which read the response's headers)."""
        mark_us = self._margin_us if mark else -1
        if not also and not lease_id:
            store_key = self.store_key(key)
            expect, seen = self._lives.expect(store_key, self._store_time_us, now)
            return Acquire(
                key=store_key,
                quota=self._quota_at(now),
                cost=self._cost(cost),
                max_wait_us=max_wait_us,
                # A fresh id per call: equal slots never collapse, a retry never books twice.
                call_id=_call_id(),
                now_us=self._at(now),
                mark_us=mark_us,
                cards=self._cards_due(store_key, now),
                history=self._history_of(store_key),
                expect=expect,
                seen=seen,
            )
        # A stacked call (also=), or a capped one (lease_id: the store keeps its lease
        # with its slot).
        charges = self._charges(key, cost, also, now)
        if len(charges) > 1:
            self._together([charge.key for charge in charges])
        owners = self._with(also)
        cards = [
            c for o, ch in zip(owners, charges, strict=True) for c in o._cards_due(ch.key, now)
        ]
        counted = [
            spec
            for owner, charge in zip(owners, charges, strict=True)
            for spec in owner._history_of(charge.key)
        ]
        return AcquireAll(
            charges,
            max_wait_us,
            _call_id(),
            now_us=self._at(now),
            lease_id=lease_id,
            mark_us=mark_us,
            cards=tuple(cards),
            history=tuple(counted),
        )

    def _check_partner(self, other: object) -> None:
        """Another limiter a call is also charged to: of this world, on this store."""
        if not isinstance(other, _LimiterCore) or type(other)._world != type(self)._world:
            raise TypeError(
                f"also= takes ({type(self).__name__}, key) pairs, not a {type(other).__name__}"
            )
        if _store_of(other._backend()) is not _store_of(self._backend()):
            raise ConfigurationError(
                f"{other!r} keeps its logs in another store: the limiters of one call must "
                "share one backend, so that one atomic step can book them all"
            )

    def _rates_with(self, also: Also) -> tuple[Rate, ...]:
        """The rates a stacked call's Decision reports: this limiter's, then each other's."""
        return self.rates + tuple(rate for other, *_ in also for rate in other.rates)

    def _decision(
        self,
        verdict: Verdict,
        cost: int,
        *,
        waited: float = 0.0,
        late_wakeups: int = 0,
        rates: tuple[Rate, ...] | None = None,
    ) -> Decision:
        return Decision(
            allowed=verdict.allowed,
            retry_after=0.0
            if verdict.allowed
            else _seconds(max(0, verdict.slot_us - verdict.now_us)),
            waited=waited,
            slot=_seconds(verdict.slot_us),
            cost=cost,
            remaining=verdict.remaining,
            rates=self.rates if rates is None else rates,
            paused_until=_seconds(verdict.pause_until_us)
            if verdict.pause_until_us > verdict.now_us
            else None,
            late_wakeups=late_wakeups,
            _slot_us=verdict.slot_us,
            _mark=verdict.mark,
            _born=verdict.born,
        )

    def _acquire_flow(
        self,
        key: str,
        cost: int,
        max_wait_us: int,
        started: float,
        *,
        refusal: bool,
        recheck_pause: bool = False,
        also: Also = (),
        lease_id: str = "",
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
        """
        # The transports (recheck_pause) read the response's quota headers: mark for them.
        op = self._acquire_op(key, cost, max_wait_us, started, also, lease_id, recheck_pause)
        rates = self._rates_with(also) if also else None
        # Each limiter widened its windows by its own margin: a stacked call must arrive
        # within the narrowest of them.
        margin = min([self.margin, *(other.margin for other, *_ in also)])
        slept, late_wakeups, sent = 0.0, 0, started
        # This limiter's first call: its answer also waits for a connection to open and
        # the script to load, so its round trip says nothing of the store's.
        cold = self._clock is None and not self._store_clock.answers
        if not refusal and margin and 4 * self._rtt > margin:
            # A store whose answers take a good part of the margin: a slot due now would
            # be answered too late to meet, and booked again. Ask for one that the answer
            # reaches in time (twice the round trip ahead) from the start.
            # (No longer than the wait allowed: an idle key still answers within it.)
            op = dataclasses.replace(op, lead_us=min(round(2 * self._rtt * US), max_wait_us))
        while True:
            usual_rtt = self._rtt  # (before this answer: its own round trip excuses nothing)
            try:
                verdict, from_store, now = yield from self._ask_flow(op, sent, also)
            except BaseException:
                self._missed(op, also)
                raise
            if not from_store:
                self._missed(op, also)
            # on_unavailable's answers are made here, at the end of the call: none came late.
            clock = self._observe(
                from_store, sent if from_store else now, now, verdict.now_us, timed=not cold
            )
            if from_store and verdict.lives:
                self._remember(op, verdict, also)
            if verdict.waiting and isinstance(op, AcquireAll):
                left = max_wait_us - round((now - started) * US)
                if left > 0:
                    # Queued behind a full cap: the grant's ring wakes it. Should a ring
                    # be lost, it looks again now and then (a third of its shortest TTL,
                    # which keeps its ticket alive), and the head waiter when a lease
                    # could next expire on its own.
                    wait = _seconds(leases.shortest_ttl_us(op.charges)) / 3
                    if verdict.head:
                        wait = min(wait, max(0.001, _seconds(verdict.slot_us - verdict.now_us)))
                    wait = min(wait, left / US)
                    # An injected clock moves only with the injected sleep: the bell is
                    # only looked at, and the wait slept.
                    rang, now = yield AwaitGrant(op.lease_id, 0.0 if self._clock else wait)
                    if not rang and self._clock is not None:
                        now = yield Sleep(wait)
                    left = max(0, max_wait_us - round((now - started) * US))
                    op = dataclasses.replace(op, max_wait_us=left, now_us=self._at(now))
                    # (A long wait may outlast the calendar windows the call was given.)
                    rewindowed = self._rewindowed(op, also, now, self._store_time_us(now), ())
                    assert isinstance(rewindowed, AcquireAll)
                    expecting = self._expecting(rewindowed, also, now)
                    assert isinstance(expecting, AcquireAll)
                    op = expecting
                    sent = now
                    continue
                verdict = verdict._replace(waiting=False)
            if not verdict.allowed:
                refused = self._decision(verdict, cost, late_wakeups=late_wakeups, rates=rates)
                if self._listeners:
                    kind = REFUSED if refusal else TIMED_OUT
                    self._emit(kind, op.key, cost=cost, retry_after=refused.retry_after)
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
            slot = _seconds(verdict.slot_us)
            wake = clock.wake_at(slot)
            rtt = now - sent  # this call's last round trip to the store
            # What a slot found within the wait the store was told of may still add: the
            # answer's way back, and what is not known of the store's clock.
            slack = EARLY + clock.spread(now) + 2 * usual_rtt
            if not refusal and (wake - started - slack) * US > max_wait_us:
                # The store found a slot within the wait it was told of, but the call got
                # there late (a connection to open, the script to load, retries): counted
                # from the caller's start, it would wait past its timeout. The slot stays
                # booked, unused (counted with the late wake-ups' slots): under-use, never a
                # wait the caller did not allow.
                if self._listeners:
                    self._emit(TIMED_OUT, op.key, cost=cost, retry_after=max(0.0, wake - now))
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
                ahead = 1.5 * rtt + (0.0 if self._clock else LOOK_AHEAD)
                if look and wake - now > 2 * ahead:
                    if ahead:
                        slept += wake - ahead - now
                        now = yield Sleep(wake - ahead - now)
                    else:  # (an injected clock: answers take no time, the look goes at the wake)
                        slept += wake - now
                        now = yield Sleep(wake - now)
                    asked = now
                    snap, seen, now = yield from self._look_flow(op.key, now)
                    if snap is not None and seen is not None:  # (None: the slot stands)
                        clock, rtt = seen, now - asked
                        # (A pause that ends by the slot is one the call was booked after.)
                        if recheck_pause and snap.pause_until_us > verdict.slot_us:
                            log.debug("paused while it slept; queueing again")
                            op = self._rebook(
                                op, max_wait_us, started, now, round(2 * rtt * US), also
                            )
                            sent = now
                            continue
                    wake = clock.wake_at(slot)  # (what the look said of the clock, too)
                if not self._introduced and wake - now > INTRODUCE_IN + 4 * rtt:
                    now = yield from self._introduce_flow(now)  # (a sleep long enough for it)
                if wake - now >= 5e-7:
                    slept += wake - now
                    now = yield Sleep(wake - now)
                    # A sleep may end a little early (uvloop's millisecond timers): sleep
                    # the rest, once. (Not with an injected clock, which moves only as the
                    # injected sleep moves it, nor after a sleep that did not sleep at
                    # all: a test's.)
                    if self._clock is None and 5e-7 <= wake - now <= EARLY:
                        now = yield Sleep(wake - now)
            # A call that can wait may book again if its own answer came too late to
            # tell (not a sleep whose wake-up only the width of the bracket blurs).
            rebook_if_unsure = answered_late and not refusal
            late = self._late_by(clock, slot, now, rebook_if_unsure, margin) if margin else 0.0
            if late > margin and cold and not refusal:
                # A cold answer also waited for a connection to open and the script to
                # load, so it says little of the store's clock. A look at the key on the
                # open connection says more, before the call books again (and spends a
                # slot) for what may have been only its connection's set-up.
                asked = now
                _, seen, now = yield from self._look_flow(op.key, now)
                if seen is not None:
                    clock, rtt = seen, now - asked
                    late = self._late_by(clock, slot, now, rebook_if_unsure, margin)
                cold = False
            if late <= margin:
                if self._listeners:
                    self._emit(ADMITTED, op.key, cost=cost, waited=slept, slot=slot)
                return self._decision(
                    verdict, cost, waited=slept, late_wakeups=late_wakeups, rates=rates
                )
            late_wakeups += 1
            if self._listeners:
                self._emit(LATE_WAKEUP, op.key, cost=cost, late_by=late)
            if late_wakeups > MAX_REBOOKS and not refusal:
                # Late again and again: this process cannot keep its calls within the
                # margin (a store too far or too slow for it, an overloaded event loop).
                # Booking again cannot help it, and each booking spends a slot: the call
                # goes, and the operator is told once what to change.
                self._warn_slow(late, rtt, margin)
                if self._listeners:
                    self._emit(ADMITTED, op.key, cost=cost, waited=slept, slot=slot)
                return self._decision(
                    verdict, cost, waited=slept, late_wakeups=late_wakeups, rates=rates
                )
            log.debug(
                "%.1f ms past its slot (margin %.1f ms): booking a new one",
                late * 1000,
                margin * 1000,
            )
            if refusal:  # try_acquire asks once: its late slot is its answer, unused
                late_verdict = verdict._replace(allowed=False)
                refused = self._decision(late_verdict, cost, late_wakeups=late_wakeups, rates=rates)
                if self._listeners:
                    self._emit(REFUSED, op.key, cost=cost, retry_after=refused.retry_after)
                return refused
            cold = False
            # The new slot lies twice the last round trip ahead, so that its answer is
            # back before it (one due now would be answered too late again), and is
            # slept to.
            op, sent = self._rebook(op, max_wait_us, started, now, round(2 * rtt * US), also), now

    def _remember(self, op: Acquire | AcquireAll, verdict: Verdict, also: Also) -> None:
        """What the store said of the call's keys' lives (see Lives), and whether it found
        one that had lost its history."""
        slot = verdict.slot_us if verdict.allowed else -1
        told = zip(verdict.lives, verdict.totals, strict=True)
        if isinstance(op, Acquire):
            life, total = next(told)
            self._lives.saw(op.key, life, total, slot, op.quota.horizon_us)
        else:
            owners = self._with(also)
            for owner, charge, (life, total) in zip(owners, op.charges, told, strict=False):
                owner._lives.saw(charge.key, life, total, slot, charge.quota.horizon_us)
        if verdict.lost:
            keys = [op.key] if isinstance(op, Acquire) else [c.key for c in op.charges]
            self._lives.told_lost(self, keys, verdict.pause_until_us - verdict.now_us)

    def _new_call_id(self) -> str:
        return _call_id()

    def _lease_flow(
        self,
        key: str,
        cost: int,
        timeout: float | timedelta | None,
        now: float,
        *,
        also: Also,
        lease_id: str,
        before_request: bool,
    ) -> Flow[Decision]:
        """A lease's admission: an acquire that, capped, waits its turn under the caps."""
        if before_request:
            return self._send_flow(key, cost, timeout, now, also, lease_id=lease_id)
        return self._waiting_flow(key, cost, timeout, now, also=also, lease_id=lease_id)

    def _end_flow(
        self,
        charges: tuple[Charge, ...],
        lease_id: str,
        now: float,
        renew: bool,
        cards: tuple[StoreCard, ...] = (),
    ) -> Flow[bool]:
        """Renew a lease (False: it had been lost, and is held again) or release it;
        ``cards``: what a renewal keeps alive of its keys' cards."""
        if renew:
            op: Renew | Release = Renew(charges, lease_id, now_us=self._at(now), cards=cards)
        else:
            op = Release(charges, lease_id, now_us=self._at(now))
        kept, _, _ = yield from self._execute_flow(op, now)
        return bool(kept) if renew else True

    def _refuse_capped(self, also: Also, method: str) -> None:
        if self._capped(also):
            which = (
                "this limiter has"
                if self.max_concurrent
                else "a limiter in also= (namespace "
                + ", ".join(
                    repr(entry[0].namespace)
                    for entry in also
                    if getattr(entry[0], "max_concurrent", None)
                )
                + ") has"
            )
            raise ConfigurationError(
                f"{method}() admits a call but cannot know when it ends, and {which} "
                "max_concurrent, which counts calls in flight: use `with limiter.lease(key):` "
                "(or `async with`), the throttled transports or @throttled, which end the lease"
            )

    def _waiting_flow(
        self,
        key: str,
        cost: int,
        timeout: float | timedelta | None,
        now: float,
        *,
        recheck_pause: bool = False,
        also: Also = (),
        lease_id: str = "",
    ) -> Flow[Decision]:
        """The flow of an acquire (raising ThrottleTimeout), from local time ``now``."""
        wait = self._max_wait_us(timeout)
        return self._acquire_flow(
            key,
            cost,
            wait,
            now,
            refusal=False,
            recheck_pause=recheck_pause,
            also=also,
            lease_id=lease_id,
        )

    def _send_flow(
        self,
        key: str,
        cost: int,
        timeout: float | timedelta | None,
        now: float,
        also: Also = (),
        lease_id: str = "",
    ) -> Flow[Decision]:
        """acquire as the transports use it before each request: a call that slept looks
        for a pause first. (A subclass may wrap it, once for both worlds.)"""
        return self._waiting_flow(
            key, cost, timeout, now, recheck_pause=True, also=also, lease_id=lease_id
        )

    def _ask_flow(self, op: Op[T], now: float, also: Also = ()) -> Flow[tuple[T, bool, float]]:
        """``_execute_flow``, asked again while the answer is stale: the calendar windows
        given did not reach a time the decision needed (the store's now, or a slot a
        window or more ahead), so they are given again around that time."""
        around: tuple[int, ...] = ()
        for _ in range(STALE_TRIES):
            result, from_store, now = yield from self._execute_flow(op, now)
            if not isinstance(result, (Verdict, Snapshot)) or not result.stale:
                return result, from_store, now
            around += (result.slot_us if isinstance(result, Verdict) else result.next_slot_us,)
            op = self._rewindowed(op, also, now, result.now_us, around)
        raise BackendError(
            f"the calendar windows of {self!r} moved on {STALE_TRIES} times in a row: the "
            "store's clock is jumping"
        )

    def _execute_flow(self, op: Op[T], now: float) -> Flow[tuple[T, bool, float]]:
        """Ask the store at local time ``now``, retrying what may pass; if it stays
        silent, ``on_unavailable`` answers. Returns the answer, whether the store gave it
        (False: on_unavailable did), and the local time it came back."""
        guard = self._guard
        if guard.store_resting(now):
            return self._fallback(op), False, now
        try:
            result, now = yield Call(op)  # the common case: no retry machinery at all
        except BackendUnavailable as first:
            failed_at = yield ReadClock()
            try:
                result, now = yield from self._retry_flow(op, first, now, failed_at)
            except BackendUnavailable as exc:
                now = yield ReadClock()
                guard.failed(exc, now)
                if self._listeners:
                    self._emit(STORE_ERROR, op.key, reason=type(exc.__cause__ or exc).__name__)
                return self._fallback(op), False, now
        guard.succeeded()
        return result, True, now

    def _introduce_flow(self, now: float, *, keep: bool = True) -> Flow[float]:
        """Once per limiter: the namespace's record of its key secret (Backend.fingerprint).
        Workers that hash with different secrets (one set key_secret, or
        THROTTLE_CLIENT_KEY_SECRET, another not) give one token a log, and a quota, per
        secret: said once. Asked while a call sleeps anyway (``keep``: the record begins
        with this limiter's if it holds none), or by a read (only looked at: a read
        writes nothing), never in a call's way, and nothing fails for it. Returns the
        local time after."""
        if self._guard.store_resting(now):  # (a store just found down: not now)
            return now
        self._introduced = self._introduced or keep
        self._looked = True
        ours = fingerprint(self._secret)
        try:
            held, now = yield Introduce(self.namespace, ours, keep)
        except Exception as exc:  # (an outage is met again by the operations themselves)
            log.debug("could not read the record of namespace %r: %s", self.namespace, exc)
            after: float = yield ReadClock()
            return after
        if held is not None and held != ours:
            log.warning(
                "workers of namespace %r hash keys with different key secrets (this one's "
                "fingerprint is %s, the store's %s): each secret gives a token a log, and a "
                "quota, of its own. Give every worker the same key_secret (or %s)",
                self.namespace,
                ours,
                held,
                SECRET_ENV,
            )
        return now

    def _fallback(self, op: Op[T]) -> T:
        """``on_unavailable``'s answer to ``op`` (or its BackendUnavailable)."""
        answer = self._guard.substitute(op)()
        if self._listeners:
            policy = self._guard.on_unavailable
            self._emit(FALLBACK, op.key, reason=policy if isinstance(policy, str) else "local")
        return answer

    def _retry_flow(
        self, op: Op[T], first: BackendUnavailable, started: float, now: float
    ) -> Flow[tuple[T, float]]:
        """The retries of ``op``, whose first attempt (begun at ``started``) failed: as
        tenacity's ``iter()`` decides, attempt by attempt. Raises the last failure."""
        # An operation failed with a call ahead of it that found the store down waited on
        # the store as long as that call did (GivenUp.waited): its retries count that too,
        # so a hung store holds it one socket timeout, not two.
        spent = max(now - started, first.waited if isinstance(first, GivenUp) else 0.0)
        decider = self._guard.retrying(op, spent)
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

    def _allows(self, span: float) -> float:
        """At most how many units this limiter's rates and gap can let through in any
        ``span`` seconds, whatever its logs hold: a sliding rate N per W, N for each W
        the span reaches into; a calendar rate, N for each window it touches; the gap,
        one call (of the largest cost) per gap. (What the rates have left now says nothing
        of the span: units leave a sliding window all through it.)"""
        bounds: list[float] = [
            rate.limit * (math.ceil(span / rate.period) + (1 if rate.calendar else 0))
            for rate in self.rates
        ]
        if self.min_interval:
            bounds.append((math.floor(span / self.min_interval) + 1) * self._max_cost)
        return min(bounds)

    def _usage_flow(self, store_key: str, now: float) -> Flow[Usage]:
        if not self._looked:  # (a read is never in a hurry: see _introduce_flow)
            now = yield from self._introduce_flow(now, keep=False)
        snap, _, _ = yield from self._ask_flow(self._inspect_op(store_key, now), now)
        # The stores repair or refuse a damaged key; whatever damage gets past them is
        # refused here rather than reported as units no key can have used.
        counts = (snap.booked, *snap.used)
        if not all(0 <= n < MAX_TOTAL for n in counts):
            raise BackendError(
                f"store key {store_key} is damaged: it reads as {counts} units used or "
                "booked; reset() the key"
            )
        usage = self._usage(snap)
        return dataclasses.replace(usage, upstream=self._upstream.get(store_key))

    def _history_flow(self, store_key: str, now: float) -> Flow[UsageHistory]:
        op = ReadHistory(key=store_key, now_us=self._at(now))
        fields, _, _ = yield from self._ask_flow(op, now)
        # (A limiter that keeps no history reads one at the offset it was counted at.)
        return read_history(fields, self._offsets.zone if self._history else None, store_key)

    def _learn_flow(
        self,
        key: str,
        decision: Decision,
        headers: Any,
        now: float,
        wall: float,
        max_pause: float,
    ) -> Flow[tuple[QuotaView | None, float]]:
        """Read a response's quota headers (``wall``: epoch seconds, for epoch resets)
        for the call ``decision`` admitted. A view stricter than this limiter's rates
        becomes the key's learned limit in the store, for every worker (docs/design.md
        §1, "Limits learned from the upstream"), for ``max_pause`` seconds at most; a
        looser one is only reported."""
        view = read_quota_view(headers, now=wall)
        if view is None or not decision.remaining:
            return view, now
        span = min(view.resets_in, max_pause)
        until = self._store_time_us(now) + round(span * US)
        slot = decision._slot_us if decision._slot_us >= 0 else round(decision.slot * US)
        since = slot - self._margin_us
        # It counts from the answered call's slot (less the margin), so the calls admitted
        # while its answer was on its way count too: stricter is fewer, itself included,
        # than the rates could let through over that whole span.
        allows = self._allows(max(0, until - since) / US)
        stricter = view.remaining + decision.cost < allows
        store_key = self.store_key(key)
        self._upstream[store_key] = UpstreamView(
            view.remaining, _seconds(until), view.limit, stricter
        )
        self._upstream.move_to_end(store_key)
        if len(self._upstream) > UPSTREAM_VIEWS:
            self._upstream.popitem(last=False)
        if not stricter:
            if not self._told_looser:
                self._told_looser = True
                log.info(
                    "the upstream allows more than %r is configured for "
                    "(%s says %d left for %.0fs; the rates allow at most %d): the "
                    "configured limits stay",
                    self,
                    view.header,
                    view.remaining,
                    view.resets_in,
                    allows,
                )
            return view, now
        # Every call whose slot lies from this one's less the margin on may have reached
        # the upstream after it, so may not be in the count the header gave: each is
        # counted against what it said remained (those it did count, twice: under-use
        # by at most the calls in flight, never over-use). This call itself too, hence
        # its cost on top.
        op = Learn(
            key=store_key,
            quota=self._quota_at(now),
            since_us=since,
            until_us=until,
            limit=view.remaining + decision.cost,
            now_us=self._at(now),
            from_cum=decision._mark,
            born=decision._born,
            cards=self._card_of(store_key),  # (a learned limit may outlast the card)
        )
        log.debug(
            "the upstream says %d left for %.1fs (%s), fewer than the "
            "rates allow (at most %d): held to it",
            view.remaining,
            view.resets_in,
            view.header,
            allows,
        )
        try:
            _, _, now = yield from self._execute_flow(op, now)
        except BackendError as exc:  # the response stands; the configured rates still hold
            log.warning("could not keep what the upstream said: %s", exc)
        return view, now

    def _pause_flow(
        self,
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
        transport sets also keeps its ``reason``, and whether the upstream ``refused``
        the call (a 429), in the store as the key's pushback (``top`` shows it)."""
        op = self._pause_op(key, seconds, now)
        if reason or refused:
            op = dataclasses.replace(op, reason=reason, refused=refused)
        until, _, now = yield from self._execute_flow(op, now)
        if self._listeners:
            fields = {"reason": reason, "source": source, "route": route}
            self._emit(PAUSED, op.key, until=_seconds(until), **fields)
        return _seconds(until), now

    def _reset_flow(self, key: str, now: float) -> Flow[None]:
        yield from self._execute_flow(self._reset_op(key, now), now)
        self._upstream.pop(self.store_key(key), None)
        self._lives.forget(self.store_key(key))

    def _look_flow(
        self, store_key: str, now: float
    ) -> Flow[tuple[Snapshot | None, StoreClock | None, float]]:
        """A look at the key (Inspect) from local time ``now``: its snapshot, the clock the
        answer refined, and the local time after; (None, None, time) if the store went
        away meanwhile (what the call booked then stands)."""
        asked = now
        try:
            snap, from_store, now = yield from self._ask_flow(self._inspect_op(store_key, now), now)
        except BackendUnavailable:
            after: float = yield ReadClock()
            return None, None, after
        return snap, self._observe(from_store, asked, now, snap.now_us), now

    def _observe(
        self, from_store: bool, sent: float, now: float, store_now_us: int, timed: bool = True
    ) -> StoreClock:
        """Learn from an answer asked at local ``sent``, read at ``now``; its StoreClock.
        ``timed``: its round trip is the store's (not a first call's, which opened the way)."""
        clock = self._store_clock if from_store else self._host_clock
        clock.observe(sent, now, _seconds(store_now_us))
        if from_store and timed:
            self._rtt = now - sent  # (racy across threads: one float, any recent one will do)
        return clock

    def _rebook(
        self,
        op: Acquire | AcquireAll,
        max_wait_us: int,
        started: float,
        now: float,
        lead_us: int,
        also: Also = (),
    ) -> Acquire | AcquireAll:
        """``op`` asked again at ``now`` as a new call, with what is left of its wait."""
        left = max(0, max_wait_us - round((now - started) * US))
        lead_us = min(lead_us, left)  # (the wait allowed bounds the lead too)
        again = dataclasses.replace(
            op, call_id=_call_id(), max_wait_us=left, now_us=self._at(now), lead_us=lead_us
        )
        return self._expecting(again, also, now)

    def _expecting(self, op: Acquire | AcquireAll, also: Also, now: float) -> Acquire | AcquireAll:
        """``op`` with what is known now of its keys' lives (Acquire.expect): an
        expectation made earlier may have outlived the bookings it stood for."""
        if isinstance(op, Acquire):
            expect, seen = self._lives.expect(op.key, self._store_time_us, now)
            return dataclasses.replace(op, expect=expect, seen=seen)
        owners = self._with(also)
        charges = []
        for owner, charge in zip(owners, op.charges, strict=True):
            expect, seen = owner._lives.expect(charge.key, owner._store_time_us, now)
            charges.append(dataclasses.replace(charge, expect=expect, seen=seen))
        return dataclasses.replace(op, charges=tuple(charges))

    def _late_by(
        self, clock: StoreClock, slot: float, now: float, rebook_if_unsure: bool, margin: float
    ) -> float:
        """How far past ``slot`` a call at local time ``now`` may be, on the store's clock.

        When the store's time is known less precisely than the margin (a round trip
        longer than the margin), no call can be proven on time. Over the first answers
        (a cold connection, a burst of tasks starting together) an acquire whose answer
        came back too late to tell counts as late: it books again, a round trip ahead,
        and its answer tightens what is known (a try_acquire is not refused for its
        cold start, nor a call for the blur of a wake-up). A store that stays that far
        (WARM_UP answers on) cannot be helped by booking again: the most hopeful
        estimate is used instead, and a warning says to widen the margin.
        """
        late = clock.late_by(slot, now)
        spread = clock.spread(now)
        if spread <= margin or (rebook_if_unsure and clock.answers < WARM_UP):
            return late
        if clock.answers >= WARM_UP:
            self._warn_slow(late, clock.width(), margin)
        return late - spread

    def _warn_slow(self, late: float, rtt: float, margin: float) -> None:
        """Say once that this process's calls cannot be held within the margin."""
        if self._warned_spread.is_set():
            return
        self._warned_spread.set()
        log.warning(
            "the store is too slow for margin=%.1f ms: its round trip takes %.1f ms and "
            "calls reach their slots up to %.1f ms late, so arrivals cannot be held "
            "within the margin (the slots still are); widen the margin to at least "
            "%.0f ms, or bring the store closer",
            margin * 1000,
            rtt * 1000,
            late * 1000,
            math.ceil(max(late, rtt) * 1000 * 1.5),
        )

    def _inspect_op(self, store_key: str, now: float) -> Inspect:
        return Inspect(key=store_key, quota=self._quota_at(now), now_us=self._at(now))

    def _usage(self, snap: Snapshot) -> Usage:
        now = snap.now_us
        return Usage(
            rates=tuple(
                RateUsage(
                    rate=rate,
                    used=used,
                    booked=snap.booked,
                    remaining=max(0, rate.limit - used - snap.booked),
                    resets_in=_seconds(max(0, ready - now)),
                    resets_at=_seconds(rate.calendar.bounds(now)[1]) if rate.calendar else None,
                )
                for rate, used, ready in zip(self.rates, snap.used, snap.ready_at_us, strict=True)
            ),
            next_slot_in=_seconds(max(0, snap.next_slot_us - now)),
            paused_for=_seconds(max(0, snap.pause_until_us - now)),
            paused_until=_seconds(snap.pause_until_us) if snap.pause_until_us > now else None,
            in_flight=snap.in_flight if self.max_concurrent else None,
            waiting=snap.waiting if self.max_concurrent else None,
            learned=None
            if snap.learned is None
            else LearnedLimit(
                limit=snap.learned[0], used=snap.learned[1], resets_at=_seconds(snap.learned[2])
            ),
        )

    def _learn_checked(self, decision: object, headers: Any, max_pause: float) -> float:
        """learn()'s arguments checked, header values it cannot read reported (once per
        header): the wall-clock time to read them at."""
        if not isinstance(decision, Decision) or not decision.allowed:
            raise ConfigurationError(
                f"learn() needs the Decision of an admitted call (the one the response "
                f"answers), not {decision!r}"
            )
        bounded_seconds(max_pause, "max_pause")
        wall = self._wall()
        problems = read_feedback(200, headers, now=wall, max_pause=ABSURD, fallback=0).problems
        for problem in problems:
            level = logging.DEBUG if problem.header in self._told_headers else logging.WARNING
            self._told_headers.add(problem.header)
            log.log(level, "%s", problem.message)
        return wall

    def _pause_op(self, key: str, seconds: float | timedelta, now: float) -> Pause:
        duration = bounded_seconds(seconds, "pause seconds")
        store_key = self.store_key(key)
        return Pause(
            key=store_key,
            quota=self._quota_at(now),
            duration_us=round(duration * US),
            now_us=self._at(now),
            cards=self._card_of(store_key),  # (a pause may outlast the card)
        )

    def _reset_op(self, key: str, now: float) -> Reset:
        # The time matters to a reset too: the store may sweep expired keys in its step.
        return Reset(key=self.store_key(key), now_us=self._at(now))

    def __repr__(self) -> str:
        rates = ", ".join(map(repr, self.rates))
        capped = f", max_concurrent={self.max_concurrent}" if self.max_concurrent else ""
        return (
            f"{type(self).__name__}(rates=[{rates}], min_interval={self.min_interval:g}, "
            f"margin={self.margin:g}{capped}, namespace={self.namespace!r})"
        )


class Limiter(_LimiterCore):
    """A shared sliding-window limiter, one log per key (usually an access token).

    >>> limiter = Limiter(RedisBackend("redis://localhost:6379/0"),
    ...                   rates=[Rate(5000, 3600), "10/second"], min_interval=0.1)
    >>> limiter.acquire(token, timeout=30)   # waits its turn, or ThrottleTimeout
    >>> limiter.try_acquire(token).retry_after

    ``margin`` (seconds, default 25 ms) is how much later than its slot a request may
    reach the upstream, which counts arrivals, not slots: every window and the minimum
    interval are widened by it, and a call that wakes later than its slot + margin books
    a new slot before it returns (``Decision.late_wakeups``), at most three times. 0
    turns this off: nothing is widened and no lateness judged, so only the slots are
    exact; requests then reach the upstream a little after their slots, and need the
    headroom of rates and a gap a little stricter than the upstream's.

    ``on_unavailable`` says what happens when the store cannot be reached after
    ``retry_for`` seconds of retries: ``"raise"`` (BackendUnavailable, the default),
    ``"allow"`` (fail open) or ``LocalFallback(expected_workers=N)``.

    ``max_concurrent``: the most calls of a key in flight at once, across every process
    of the store; a call then holds a lease while it runs (:meth:`lease`, the transports,
    ``@throttled``), and ``acquire``/``try_acquire`` are refused. ``lease_ttl`` (seconds,
    default 30): how soon the lease of a holder that died (``kill -9``) frees its slot;
    living holders renew theirs every third of it.

    ``label``: a function of a key giving what operators see instead of it ("account
    42"): in events, metrics, logs, and the card the store keeps beside the key, which
    ``throttle-client status`` and ``top`` read. At most 64 printable characters, never
    the key itself. By default a key shows as the first 8 characters of its keyed hash.

    ``history``: count each key's calls per hour, day and month in the store
    (:meth:`history`). Off by default: a history outlives its key by the longest period
    it keeps (24 months unless told), so a fleet that keeps making new keys would fill
    the store with them. ``True`` keeps the defaults of :class:`~throttle_client.History`,
    ``History(...)`` what it says.

    ``clock`` and ``sleep`` are for tests (see ``throttle_client.testing``). With a
    clock, Redis follows it instead of its own TIME.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        rates: Sequence[Rate | str] | Rate | str,
        min_interval: float | timedelta = 0.0,
        margin: float | timedelta = DEFAULT_MARGIN,
        namespace: str = "default",
        key_secret: bytes | str | None = None,
        tag: Callable[[str], str] | None = None,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        on_unavailable: OnUnavailable = "raise",
        retry_for: float | timedelta = 1.0,
        max_concurrent: int | None = None,
        lease_ttl: float | timedelta | None = None,
        label: Callable[[str], str] | None = None,
        history: History | bool = False,
    ) -> None:
        if not isinstance(backend, (Backend, AsyncBackend)):
            backend = legacy.adopt(backend, 2) or _not_a_backend(backend, "Limiter")
        if not isinstance(backend, Backend):
            raise TypeError(f"{type(backend).__name__} is asynchronous: use AsyncLimiter with it")
        super().__init__(
            rates=rates,
            min_interval=min_interval,
            margin=margin,
            namespace=namespace,
            key_secret=key_secret,
            tag=tag,
            clock=clock,
            on_unavailable=on_unavailable,
            retry_for=retry_for,
            max_concurrent=max_concurrent,
            lease_ttl=lease_ttl,
            label=label,
            history=history,
        )
        self.backend = backend
        self._sleep = sleep
        self._guard.ring_through(backend.doorbell)

    _world = "sync"

    def _backend(self) -> Backend:
        return self.backend

    def _perform(self, step: LimiterStep) -> Any:
        """One step of a flow, with blocking calls (see ``_flow``)."""
        if isinstance(step, Call):
            return self.backend.execute(step.op), self._local()
        if isinstance(step, Introduce):
            held = self.backend.fingerprint(step.namespace, step.fingerprint, step.keep)
            return held, self._local()
        if isinstance(step, Sleep):
            self._sleep(step.seconds)
        elif isinstance(step, AwaitGrant):
            bell = self.backend.doorbell.wait_for(step.lease_id)
            rang = bell.wait(step.seconds)
            bell.clear()
            return rang, self._local()
        return self._local()  # after a Sleep, or for a ReadClock

    def try_acquire(
        self,
        key: str,
        cost: int = 1,
        *,
        also: Sequence[tuple[Limiter, str] | tuple[Limiter, str, int]] = (),
    ) -> Decision:
        """Admit the call now if its slot is now. A refusal records nothing, but for
        one whose answer came back too late (``late_wakeups``): its slot stays booked.
        ``also``: as for :meth:`acquire`."""
        refuse_in_event_loop("Limiter.try_acquire()")
        self._refuse_capped(also, "try_acquire")
        flow = self._acquire_flow(key, cost, 0, self._local(), refusal=True, also=also)
        return run(flow, self._perform)

    def acquire(
        self,
        key: str,
        cost: int = 1,
        timeout: float | timedelta | None = None,
        *,
        also: Sequence[tuple[Limiter, str] | tuple[Limiter, str, int]] = (),
    ) -> Decision:
        """Book the earliest slot and sleep until it: one store round trip, one sleep.
        (Refused on a limiter with ``max_concurrent``: use :meth:`lease`.)

        Raises ThrottleTimeout (with ``retry_after``), booking nothing, when the slot
        is more than ``timeout`` seconds away.

        ``also``: (limiter, key) pairs the call is charged to as well, all or nothing,
        in the same atomic step: one slot that every limiter's quota allows, booked in
        every key's log, or, refused, in none (``[(account_limiter, account_id)]``). A
        third item charges that key another cost (``(endpoint_limiter, route, 5)``). The
        limiters share this one's backend; the call arrives within the narrowest of
        their margins; this limiter's ``on_unavailable`` and ``retry_for`` decide for the
        whole call. The Decision's ``rates`` and ``remaining`` list this limiter's rates,
        then each other's.
        """
        refuse_in_event_loop("Limiter.acquire()")
        self._refuse_capped(also, "acquire")
        flow = self._waiting_flow(key, cost, timeout, self._local(), also=also)
        return run(flow, self._perform)

    def lease(
        self,
        key: str,
        cost: int = 1,
        timeout: float | timedelta | None = None,
        *,
        also: Sequence[tuple[Limiter, str] | tuple[Limiter, str, int]] = (),
    ) -> Lease:
        """A call held from its admission until the block ends: ``with limiter.lease(key)
        as decision:``. Entering waits, as :meth:`acquire` does, for the call's slot and,
        on a limiter with ``max_concurrent`` (or a partner in ``also`` with one), for room
        under every cap, in arrival order; ``timeout`` bounds the whole wait
        (ThrottleTimeout). Leaving ends the lease, and the next waiter goes at once.
        ``timeout=0`` does not wait: a full cap raises ThrottleTimeout at once. Without a
        cap it is an :meth:`acquire` whose end does nothing."""
        return Lease(_Held(self, key, cost, timeout, also, before_request=False))

    @overload
    def usage(self, key: str) -> Usage: ...

    @overload
    def usage(self, *, store_key: str) -> Usage: ...

    def usage(self, key: str | None = None, *, store_key: str | None = None) -> Usage:
        """Per rate used / remaining / seconds until a unit frees; the next slot; any pause.
        Read-only.

        ``store_key=`` reads a key known by its store key only (as ``Backend.all_cards``
        and ``throttle-client top`` find them, or ``status`` shows them), instead of the
        key itself; it must be one of this limiter's namespace::

            >>> limiter.usage("ghp_token").rates[0].remaining
            4999
            >>> limiter.usage(store_key=limiter.store_key("ghp_token")).rates[0].remaining
            4999
        """
        target = self._usage_key(key, store_key)
        return run(self._usage_flow(target, self._local()), self._perform)

    def history(self, key: str) -> UsageHistory:
        """``key``'s use per hour, day and month, as the store counted it (see
        :class:`~throttle_client.History`), by every limiter that counts on the key; one
        that keeps none places the periods at the offset they were counted at."""
        return run(self._history_flow(self.store_key(key), self._local()), self._perform)

    def pause(self, key: str, seconds: float | timedelta) -> float:
        """No slot for ``key`` before ``now + seconds``, for every worker; returns the
        pause's end (epoch seconds). A pause only ever moves forward."""
        return run(self._pause_flow(key, seconds, self._local()), self._perform)[0]

    def reset(self, key: str) -> None:
        """Forget everything about ``key``."""
        run(self._reset_flow(key, self._local()), self._perform)

    def learn(
        self,
        key: str,
        decision: Decision,
        headers: httpx.Headers | Mapping[str, str],
        *,
        max_pause: float = DEFAULT_MAX_PAUSE,
    ) -> QuotaView | None:
        """Read the quota headers of the response to the call ``decision`` admitted for
        ``key`` (``X-RateLimit-*``, or the IETF ``RateLimit`` fields): when the upstream
        allows fewer calls than this limiter's rates, every worker holds to that until
        its reset, ``max_pause`` seconds at most (see ``usage(key).learned``). The
        throttled transports do this for every response; call it when you send with a
        client of your own. Returns what was read (None: nothing usable)."""
        wall = self._learn_checked(decision, headers, max_pause)
        flow = self._learn_flow(key, decision, headers, self._local(), wall, max_pause)
        return run(flow, self._perform)[0]


class AsyncLimiter(_LimiterCore):
    """The asyncio twin of :class:`Limiter`; same arguments, awaitable methods.

    >>> limiter = AsyncLimiter(AsyncRedisBackend("redis://localhost"), rates=["10/second"])
    >>> await limiter.acquire(token, timeout=30)
    """

    def __init__(
        self,
        backend: AsyncBackend | Backend,
        *,
        rates: Sequence[Rate | str] | Rate | str,
        min_interval: float | timedelta = 0.0,
        margin: float | timedelta = DEFAULT_MARGIN,
        namespace: str = "default",
        key_secret: bytes | str | None = None,
        tag: Callable[[str], str] | None = None,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
        on_unavailable: OnUnavailable = "raise",
        retry_for: float | timedelta = 1.0,
        max_concurrent: int | None = None,
        lease_ttl: float | timedelta | None = None,
        label: Callable[[str], str] | None = None,
        history: History | bool = False,
    ) -> None:
        super().__init__(
            rates=rates,
            min_interval=min_interval,
            margin=margin,
            namespace=namespace,
            key_secret=key_secret,
            tag=tag,
            clock=clock,
            on_unavailable=on_unavailable,
            retry_for=retry_for,
            max_concurrent=max_concurrent,
            lease_ttl=lease_ttl,
            label=label,
            history=history,
        )
        self.backend = _as_async(backend)
        self._sleep = sleep
        self._guard.ring_through(self.backend.doorbell)

    _world = "async"

    def _backend(self) -> AsyncBackend:
        return self.backend

    async def _perform(self, step: LimiterStep) -> Any:
        """One step of a flow, awaited (see ``_flow``)."""
        if isinstance(step, Call):
            return await self.backend.aexecute(step.op), self._local()
        if isinstance(step, Introduce):
            held = await self.backend.afingerprint(step.namespace, step.fingerprint, step.keep)
            return held, self._local()
        if isinstance(step, Sleep):
            await self._sleep(step.seconds)
        elif isinstance(step, AwaitGrant):
            bell = self.backend.doorbell.wait_for(step.lease_id)
            rang = await bell.await_(step.seconds)
            bell.clear()
            return rang, self._local()
        return self._local()

    async def try_acquire(
        self,
        key: str,
        cost: int = 1,
        *,
        also: Sequence[tuple[AsyncLimiter, str] | tuple[AsyncLimiter, str, int]] = (),
    ) -> Decision:
        """Admit the call now if its slot is now. A refusal records nothing, but for
        one whose answer came back too late (``late_wakeups``): its slot stays booked."""
        self._refuse_capped(also, "try_acquire")
        flow = self._acquire_flow(key, cost, 0, self._local(), refusal=True, also=also)
        return await arun(flow, self._perform)

    async def acquire(
        self,
        key: str,
        cost: int = 1,
        timeout: float | timedelta | None = None,
        *,
        also: Sequence[tuple[AsyncLimiter, str] | tuple[AsyncLimiter, str, int]] = (),
    ) -> Decision:
        """Book the earliest slot and sleep until it; ThrottleTimeout if it is too far.

        A task cancelled while it sleeps keeps its booked slot: the quota errs on the
        side of under-use, never over-use.
        """
        self._refuse_capped(also, "acquire")
        flow = self._waiting_flow(key, cost, timeout, self._local(), also=also)
        return await arun(flow, self._perform)

    def lease(
        self,
        key: str,
        cost: int = 1,
        timeout: float | timedelta | None = None,
        *,
        also: Sequence[tuple[AsyncLimiter, str] | tuple[AsyncLimiter, str, int]] = (),
    ) -> AsyncLease:
        """``async with limiter.lease(key) as decision:``; see :meth:`Limiter.lease`.
        A task cancelled while it waits gives its place up."""
        return AsyncLease(_Held(self, key, cost, timeout, also, before_request=False))

    @overload
    async def usage(self, key: str) -> Usage: ...

    @overload
    async def usage(self, *, store_key: str) -> Usage: ...

    async def usage(self, key: str | None = None, *, store_key: str | None = None) -> Usage:
        """See :meth:`Limiter.usage`: ``await limiter.usage(token)``, or ``await
        limiter.usage(store_key=...)``."""
        target = self._usage_key(key, store_key)
        return await arun(self._usage_flow(target, self._local()), self._perform)

    async def history(self, key: str) -> UsageHistory:
        return await arun(self._history_flow(self.store_key(key), self._local()), self._perform)

    async def pause(self, key: str, seconds: float | timedelta) -> float:
        return (await arun(self._pause_flow(key, seconds, self._local()), self._perform))[0]

    async def reset(self, key: str) -> None:
        await arun(self._reset_flow(key, self._local()), self._perform)

    async def learn(
        self,
        key: str,
        decision: Decision,
        headers: httpx.Headers | Mapping[str, str],
        *,
        max_pause: float = DEFAULT_MAX_PAUSE,
    ) -> QuotaView | None:
        """See :meth:`Limiter.learn`."""
        wall = self._learn_checked(decision, headers, max_pause)
        flow = self._learn_flow(key, decision, headers, self._local(), wall, max_pause)
        return (await arun(flow, self._perform))[0]


def _also_entry(entry: object, cost: int) -> tuple[_LimiterCore, str, int]:
    """An ``also=`` entry as (limiter, key, cost): the call's own cost unless it names one."""
    if isinstance(entry, tuple) and len(entry) in (2, 3):
        other, key, *rest = entry
        return other, key, rest[0] if rest else cost
    raise TypeError(f"also= takes (limiter, key) or (limiter, key, cost) tuples, not {entry!r}")


def _store_of(backend: Backend | AsyncBackend) -> Backend | AsyncBackend:
    """The store behind an adapter (an AsyncLimiter over MemoryBackend or SQLiteBackend)."""
    return backend.backend if isinstance(backend, (InlineAsync, ThreadedAsync)) else backend


def _as_async(backend: AsyncBackend | Backend) -> AsyncBackend:
    if not isinstance(backend, (Backend, AsyncBackend)):
        backend = legacy.adopt(backend, 3) or _not_a_backend(backend, "AsyncLimiter")
    return backend if isinstance(backend, AsyncBackend) else backend.to_async()


def _not_a_backend(thing: object, limiter: str) -> NoReturn:
    """A TypeError that names what was given briefly and says what to give instead."""
    kind = type(thing).__name__
    if isinstance(thing, str):
        hint = "a URL: give RedisBackend(url) or SQLiteBackend(path)"
    elif type(thing).__module__.startswith("redis.asyncio"):
        hint = "a redis-py client: wrap it, AsyncRedisBackend(client)"
    elif type(thing).__module__.startswith("redis"):
        hint = "a redis-py client: wrap it, RedisBackend(client)"
    elif limiter == "Limiter":
        hint = "give MemoryBackend(), SQLiteBackend(path), RedisBackend(...) or a Backend subclass"
    else:
        hint = (
            "give AsyncRedisBackend(...), MemoryBackend(), SQLiteBackend(path), or a "
            "subclass of AsyncBackend or Backend"
        )
    raise TypeError(f"a {limiter} needs a backend, not a {kind}; {hint}")


def _doubtful(
    rates: tuple[Rate, ...],
    gap: float,
    margin: float,
    cap: int | None,
    on_unavailable: OnUnavailable,
) -> list[str]:
    """What in a valid configuration is most likely a mistake, said once when the limiter
    is made: a margin as long as a window or the gap (``margin=25`` meant as
    milliseconds makes every call wait 25 s), a gap that leaves a rate out of reach, a
    fallback share of less than one call per window."""
    problems = []
    shortest = min(rates, key=lambda rate: rate.period)
    if margin and margin >= shortest.period:
        problems.append(
            f"margin={margin:g} s is not shorter than the window of {shortest} (margin is "
            "in seconds: how late after its slot a request may arrive; 0.025 is the "
            "default): every window is widened by it, so far fewer calls go than the rate says"
        )
    if gap and margin >= gap:
        problems.append(
            f"margin={margin:g} s is not shorter than min_interval={gap:g} s: calls go at "
            f"least {gap + margin:g} s apart (the gap widened by the margin, so that arrivals "
            "keep it too)"
        )
    if gap:
        for rate in rates:
            most = math.floor(rate.period / gap) + 1
            if most < rate.limit:
                problems.append(
                    f"min_interval={gap:g} s lets at most {most} calls into any window of "
                    f"{rate}: that rate can never be reached"
                )
    if isinstance(on_unavailable, LocalFallback):
        workers = on_unavailable.expected_workers
        small = [rate for rate in rates if rate.limit < workers]
        for rate in small:
            problems.append(
                f"{on_unavailable!r} gives each worker at least one call per window of "
                f"{rate}, fewer than the {workers} workers: while the store is down the "
                f"fleet may send up to {workers} per window, not {rate.limit}"
            )
        if cap is not None and cap < workers:
            problems.append(
                f"{on_unavailable!r} lets each worker hold at least one call in flight, "
                f"more than max_concurrent={cap} across the fleet while the store is down"
            )
    return problems


def _sliding(rate: Rate, margin_us: int) -> int | Buckets:
    """A sliding rate's period as the store counts it, widened by the margin: a bounded
    one's in buckets of its width (Rate.bucket_us)."""
    period = rate.period_us + margin_us
    return Buckets(period, rate.bucket_us) if rate.buckets else period
