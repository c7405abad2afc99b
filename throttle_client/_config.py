"""A limiter's configuration: its keyword arguments, checked once, and what follows from them.

A :class:`Config` never changes after the limiter is made, so every part of a limiter
(planning its operations, pacing its calls, reading what the upstream says) reads it
without a lock, and a stacked call reads each partner's as it is.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

from ._backends.base import Buckets, Quota
from ._cards import Card, rate_text
from ._errors import ConfigurationError, CostTooHigh
from ._failure import LocalFallback, OnUnavailable
from ._history import History
from ._keys import check_namespace, resolve_secret
from ._ranges import MAX_CONCURRENT, MAX_RATES, MAX_SECONDS
from ._rate import Rate, bounded_seconds, coerce_rate, split_rates, to_seconds

US = 1_000_000
log = logging.getLogger("throttle_client")


def check_priority(value: object, where: str) -> str:
    """``value`` as a call's priority, or a ConfigurationError naming it and ``where``."""
    if value not in PRIORITIES:
        raise ConfigurationError(f"{where} must be 'normal' or 'low', not {value!r}")
    return str(value)


def us_to_seconds(us: int) -> float:
    """µs, as the store counts, in seconds, as the user reads them."""
    return us / US


# How much later than its slot a request may leave, by default (seconds): see ``margin``
# in Limiter and the measurements behind this number in docs/benchmarks.md.
DEFAULT_MARGIN = 0.025
# How long a lease lives unless renewed (seconds): a worker killed with kill -9 frees its
# slots within this; the living renew theirs every third of it (Redisson's watchdog
# convention). The least allowed keeps renewals (and tests of crashes) sane.
DEFAULT_LEASE_TTL = 30.0
# A call's priorities: a "low" one lets "normal" ones go first (_acquiring.yielding_flow),
# for at most its limiter's low_priority_patience (seconds; this by default).
NORMAL, LOW = "normal", "low"
PRIORITIES = (NORMAL, LOW)
DEFAULT_PATIENCE = 30.0
MIN_LEASE_TTL = 0.1


@dataclass(frozen=True, eq=False)
class Config:
    """What a limiter was told, checked, and what its decisions derive from it."""

    rates: tuple[Rate, ...]
    min_interval: float  # seconds
    margin: float  # seconds
    namespace: str
    secret: bytes = field(repr=False)  # the key secret, resolved (never stored, never shown)
    tag: Callable[[str], str] | None
    clock: Callable[[], float] | None  # injected (tests): the store follows it too
    on_unavailable: OnUnavailable
    retry_for: float  # seconds
    max_concurrent: int | None
    lease_ttl: float  # seconds
    label: Callable[[str], str] | None
    history: History | None  # None: no usage history is kept
    low_priority_patience: float  # seconds
    # What follows from the above:
    quota: Quota  # a calendar rate's windows hold 0: Planner.quota_at fills them in
    margin_us: int
    calendar: bool  # whether some rate is a calendar rate
    max_cost: int  # the largest cost that can ever be admitted
    horizon: float  # the longest a call counts after its slot (seconds)
    spacing_us: int  # a slot, at saturation: the widened gap, or the tightest rate's share
    zone: str  # the zone usage history is counted in
    card: Card  # the rules every key's card shows

    @classmethod
    def build(
        cls,
        *,
        rates: Sequence[Rate | str] | Rate | str,
        min_interval: float | timedelta,
        margin: float | timedelta,
        namespace: str,
        key_secret: bytes | str | None,
        tag: Callable[[str], str] | None,
        clock: Callable[[], float] | None,
        on_unavailable: OnUnavailable,
        retry_for: float | timedelta,
        max_concurrent: int | None,
        lease_ttl: float | timedelta | None,
        label: Callable[[str], str] | None,
        history: History | bool,
        low_priority_patience: float | timedelta = DEFAULT_PATIENCE,
    ) -> Config:
        """The limiter's keyword arguments, each checked: a bad one raises
        ConfigurationError (or TypeError) naming it and its value."""
        listed = [rates] if isinstance(rates, (Rate, str)) else _listed(rates)
        listed = [rate for item in listed for rate in split_rates(item)]  # ("a; b")
        if not 1 <= len(listed) <= MAX_RATES:
            raise ConfigurationError(
                f"a limiter needs from 1 to {MAX_RATES} rates, not {len(listed)}"
            )
        checked = tuple(coerce_rate(rate) for rate in listed)
        gap = bounded_seconds(min_interval, "min_interval")
        slack = bounded_seconds(margin, "margin")
        name = check_namespace(namespace)
        secret = resolve_secret(key_secret)
        if tag is not None and not callable(tag):
            raise TypeError(f"tag must be a function of a key, not {tag!r}")
        cap = max_concurrent
        if cap is not None and (
            isinstance(cap, bool) or not isinstance(cap, int) or not 1 <= cap <= MAX_CONCURRENT
        ):
            raise ConfigurationError(
                f"max_concurrent must be a whole number from 1 to {MAX_CONCURRENT}, or None, "
                f"not {cap!r}"
            )
        if lease_ttl is not None and cap is None:
            raise ConfigurationError(
                f"lease_ttl={lease_ttl!r} without max_concurrent: only a capped limiter's "
                "calls hold leases"
            )
        ttl = bounded_seconds(
            DEFAULT_LEASE_TTL if lease_ttl is None else lease_ttl, "lease_ttl", lowest=MIN_LEASE_TTL
        )
        for rate in checked:
            if rate.calendar and slack > rate.period / 4:
                raise ConfigurationError(
                    f"margin={margin!r} is too wide for {rate!r}: a calendar window must "
                    "last longer than four margins"
                )
        if history is True:
            history = History()
        if history is not False and not isinstance(history, History):
            raise TypeError(f"history must be a History, True or False, not {history!r}")
        kept = history or None
        # The margin widens every window and the gap in the slot arithmetic: requests
        # that leave up to ``margin`` after their slots still never crowd a window, nor
        # come closer than the gap, as the upstream counts them on arrival. With no gap
        # there is no spacing to protect, and widening it would cap the rate at 1/margin.
        margin_us, gap_us = round(slack * US), round(gap * US)
        quota = Quota(
            limits=tuple(
                (rate.limit, 0 if rate.calendar else _sliding(rate, margin_us)) for rate in checked
            ),
            min_interval_us=gap_us + margin_us if gap_us else 0,
            max_concurrent=cap or 0,
            lease_ttl_us=round(ttl * US) if cap else 0,
        )
        # Usage history is counted in the zone of the first calendar rate unless told.
        zones = [rate.calendar.tz for rate in checked if rate.calendar is not None]
        zone = (kept and kept.zone) or (zones[0] if zones else "UTC")
        rules = tuple(rate_text(rate) for rate in checked)
        return cls(
            rates=checked,
            min_interval=gap,
            margin=slack,
            namespace=name,
            secret=secret,
            tag=tag,
            clock=clock,
            on_unavailable=on_unavailable,
            retry_for=to_seconds(retry_for, "retry_for"),
            max_concurrent=cap,
            lease_ttl=ttl,
            label=label,
            history=kept,
            low_priority_patience=bounded_seconds(low_priority_patience, "low_priority_patience"),
            quota=quota,
            margin_us=margin_us,
            calendar=any(rate.calendar for rate in checked),
            max_cost=min(rate.limit for rate in checked),
            horizon=max(gap, *(rate.period for rate in checked)) + slack,
            spacing_us=max(
                quota.min_interval_us, *(round(rate.period * US / rate.limit) for rate in checked)
            ),
            zone=zone,
            card=Card(None, name, rules, gap, slack, cap, zone if kept else None),
        )

    def needs(self) -> dict[str, str]:
        """The store features (``_backends.base.FEATURES``) this configuration cannot do
        without, each with the setting that needs it."""
        needed = {}
        if self.max_concurrent:
            needed["leases"] = f"max_concurrent={self.max_concurrent}"
        if self.history:
            needed["history"] = "history="
        for rate in self.rates:
            if rate.calendar:
                needed["calendar"] = f"the calendar rate {rate}"
            if rate.bounded:
                needed["bounded"] = f"the bounded rate {rate}"
        return needed

    def cost(self, cost: int) -> int:
        """``cost``, checked: a positive whole number that some slot can admit."""
        if isinstance(cost, bool) or not isinstance(cost, int) or cost < 1:
            raise ConfigurationError(f"cost must be a positive integer, not {cost!r}")
        if cost > self.max_cost:
            raise CostTooHigh(
                f"cost {cost} can never be admitted: it is above the limit of "
                f"{min(self.rates, key=lambda r: r.limit)!r}"
            )
        return cost

    def max_wait_us(self, timeout: float | timedelta | None) -> int:
        """A call's timeout, checked, in µs."""
        # No slot is booked more than 10 years ahead (see _ranges): a longer timeout,
        # or None, waits for any slot there is, the same on every store.
        seconds = MAX_SECONDS if timeout is None else to_seconds(timeout, "timeout")
        if math.isnan(seconds) or seconds < 0:
            raise ConfigurationError(f"timeout must be >= 0 seconds or None, not {timeout!r}")
        return round(min(seconds, MAX_SECONDS) * US)

    def allows(self, span: float) -> float:
        """At most how many units the rates and gap can let through in any ``span``
        seconds, whatever the logs hold: a sliding rate N per W, N for each W the span
        reaches into; a calendar rate, N for each window it touches; the gap, one call
        (of the largest cost) per gap. (What the rates have left now says nothing of the
        span: units leave a sliding window all through it.)"""
        bounds: list[float] = [
            rate.limit * (math.ceil(span / rate.period) + (1 if rate.calendar else 0))
            for rate in self.rates
        ]
        if self.min_interval:
            bounds.append((math.floor(span / self.min_interval) + 1) * self.max_cost)
        return min(bounds)

    def doubtful(self) -> list[str]:
        """What in this valid configuration is most likely a mistake, said once when the
        limiter is made: a margin as long as a window or the gap (``margin=25`` meant as
        milliseconds makes every call wait 25 s), a gap that leaves a rate out of reach,
        a fallback share of less than one call per window."""
        rates, gap, margin, cap = self.rates, self.min_interval, self.margin, self.max_concurrent
        problems = []
        shortest = min(rates, key=lambda rate: rate.period)
        if margin and margin >= shortest.period:
            problems.append(
                f"margin={margin:g} s is not shorter than the window of {shortest} (margin is "
                "in seconds: how late after its slot a request may arrive; 0.025 is the "
                "default): every window is widened by it, so far fewer calls go than the rate "
                "says"
            )
        if gap and margin >= gap:
            problems.append(
                f"margin={margin:g} s is not shorter than min_interval={gap:g} s: calls go at "
                f"least {gap + margin:g} s apart (the gap widened by the margin, so that "
                "arrivals keep it too)"
            )
        if gap:
            for rate in rates:
                most = math.floor(rate.period / gap) + 1
                if most < rate.limit:
                    problems.append(
                        f"min_interval={gap:g} s lets at most {most} calls into any window of "
                        f"{rate}: that rate can never be reached"
                    )
        if isinstance(self.on_unavailable, LocalFallback):
            workers = self.on_unavailable.expected_workers
            for rate in (rate for rate in rates if rate.limit < workers):
                problems.append(
                    f"{self.on_unavailable!r} gives each worker at least one call per window "
                    f"of {rate}, fewer than the {workers} workers: while the store is down "
                    f"the fleet may send up to {workers} per window, not {rate.limit}"
                )
            if cap is not None and cap < workers:
                problems.append(
                    f"{self.on_unavailable!r} lets each worker hold at least one call in "
                    f"flight, more than max_concurrent={cap} across the fleet while the store "
                    "is down"
                )
        return problems


def _listed(rates: object) -> list[Rate | str]:
    """``rates=`` given as a sequence, or a TypeError that names what was given."""
    if not isinstance(rates, Iterable):
        raise TypeError(
            f"rates must be a Rate, a string such as '10/second', or a list of them, not {rates!r}"
        )
    return list(rates)


def _sliding(rate: Rate, margin_us: int) -> int | Buckets:
    """A sliding rate's period as the store counts it, widened by the margin: a bounded
    one's in buckets of its width (Rate.bucket_us)."""
    period = rate.period_us + margin_us
    return Buckets(period, rate.bucket_us) if rate.buckets else period
