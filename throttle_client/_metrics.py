"""Metrics built on events: one table of instruments, read the same way by the
Prometheus and the OpenTelemetry exporters (``prometheus``, ``otel``), which only say how
an instrument is made and how a value is recorded in their world.

Cardinality is bounded: a process gives its own series to the first ``top_keys`` key
labels it sees (and the first ``top_routes`` routes); the rest are counted together
under ``"other"``. First seen, not busiest: a series once exported must go on counting
(an OpenTelemetry cumulative exporter cannot withdraw one, and a counter that moved
between series would break ``rate()``), and a crawler's keys are few and steady.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ._core import LimiterCore
from ._events import (
    ADMITTED,
    FALLBACK,
    LATE_WAKEUP,
    LEASED,
    PAUSED,
    REFUSED,
    RELEASED,
    STORE_ERROR,
    TIMED_OUT,
    UPSTREAM_STATUS,
    Event,
    Listener,
)

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
OTHER = "other"  # the label of the keys (routes) past the first top_keys (top_routes)
TOP_KEYS = 100
TOP_ROUTES = 100


@dataclass(frozen=True)
class Instrument:
    """One metric of ``labels``: a counter, a gauge (both ``add``: a gauge by +1 and
    -1) or a histogram (``observe``)."""

    name: str  # Prometheus appends _total to a counter's
    kind: str  # COUNTER, GAUGE or HISTOGRAM
    unit: str
    help: str
    labels: tuple[str, ...]


DECISIONS = Instrument(
    "throttle_client_decisions",
    COUNTER,
    "1",
    "Decisions by outcome: admitted, refused (try_acquire), timed_out (acquire)",
    ("namespace", "key", "outcome"),
)
WAIT = Instrument(
    "throttle_client_wait_seconds",
    HISTOGRAM,
    "s",
    "Seconds an admitted call slept for its slot",
    ("namespace", "key"),
)
LATE_WAKEUPS = Instrument(
    "throttle_client_late_wakeups",
    COUNTER,
    "1",
    "Calls that woke (or were answered) past their slot by more than the margin, and booked again",
    ("namespace", "key"),
)
PAUSES = Instrument(
    "throttle_client_pauses",
    COUNTER,
    "1",
    "Pauses of a key, by reason (the header, or backoff) and source (caller or upstream)",
    ("namespace", "key", "reason", "source"),
)
UPSTREAM = Instrument(
    "throttle_client_upstream_responses",
    COUNTER,
    "1",
    "Responses a throttled transport received, by route and HTTP status",
    ("namespace", "key", "route", "status"),
)
STORE_ERRORS = Instrument(
    "throttle_client_store_errors",
    COUNTER,
    "1",
    "Calls the store failed (after retries), by the error's class",
    ("namespace", "reason"),
)
FALLBACKS = Instrument(
    "throttle_client_fallbacks",
    COUNTER,
    "1",
    "Answers on_unavailable gave instead of the store, by policy",
    ("namespace", "reason"),
)
LEASES = Instrument(
    "throttle_client_leases_held",
    GAUGE,
    "1",
    "Leases this process holds on a capped key (calls in flight under max_concurrent)",
    ("namespace", "key"),
)
INSTRUMENTS = (
    DECISIONS,
    WAIT,
    LATE_WAKEUPS,
    PAUSES,
    UPSTREAM,
    STORE_ERRORS,
    FALLBACKS,
    LEASES,
)

# Seconds: a wait of a gap (ms) up to a calendar rate's next window (an hour or more).
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 3600)


class Bounded:
    """The first ``limit`` distinct values seen, as they are; any other, ``OTHER``."""

    def __init__(self, limit: int) -> None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ValueError(f"a label limit must be a whole number >= 0, not {limit!r}")
        self.limit = limit
        self._kept: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: str) -> str:
        if value in self._kept:
            return value
        with self._lock:
            if len(self._kept) < self.limit:
                self._kept.add(value)
                return value
        return OTHER


def readings(
    event: Event, keys: Bounded, routes: Bounded
) -> Iterator[tuple[Instrument, tuple[str, ...], float]]:
    """What ``event`` adds to which instrument, with which label values."""
    kind, namespace = event.kind, event.namespace
    if kind in (ADMITTED, REFUSED, TIMED_OUT):
        key = keys(event.key)
        yield DECISIONS, (namespace, key, kind), 1
        if kind == ADMITTED:
            yield WAIT, (namespace, key), event.waited
    elif kind == LATE_WAKEUP:
        yield LATE_WAKEUPS, (namespace, keys(event.key)), 1
    elif kind == PAUSED:
        yield PAUSES, (namespace, keys(event.key), event.reason, event.source), 1
    elif kind == UPSTREAM_STATUS:
        labels = (namespace, keys(event.key), routes(event.route), str(event.status))
        yield UPSTREAM, labels, 1
    elif kind == STORE_ERROR:
        yield STORE_ERRORS, (namespace, event.reason), 1
    elif kind == FALLBACK:
        yield FALLBACKS, (namespace, event.reason), 1
    elif kind in (LEASED, RELEASED):
        yield LEASES, (namespace, keys(event.key)), 1 if kind == LEASED else -1


Record = Callable[[Instrument, tuple[str, ...], float], None]


def recording(record: Record, keys: Bounded, routes: Bounded) -> Listener:
    """A listener that records every reading of each event with ``record``."""

    def listener(event: Event) -> None:
        for instrument, labels, value in readings(event, keys, routes):
            record(instrument, labels, value)

    return listener


def limiters_of(target: Any) -> list[Any]:
    """The limiters of ``target``: a limiter itself, or every limiter a throttled
    transport or client uses."""
    if isinstance(target, LimiterCore):
        return [target]
    core = getattr(getattr(target, "_throttled", target), "_core", None)
    if core is None or not callable(getattr(core, "limiters", None)):
        raise TypeError(
            "metrics need a Limiter, an AsyncLimiter, or a throttled transport or client, "
            f"not {target!r}"
        )
    return list(core.limiters())


class Sink:
    """Where one registry (one meter) records: its label bounds, set by the first call
    for it, and the limiters it counts, each once (a limiter instrumented again, alone
    or through a client that uses it, is not counted twice)."""

    def __init__(self, make: Callable[[], Record], top_keys: int, top_routes: int) -> None:
        keys, routes = Bounded(top_keys), Bounded(top_routes)  # (bad ones: nothing is made)
        self.bounds = (top_keys, top_routes)
        self._listener = recording(make(), keys, routes)
        self._counted: weakref.WeakKeyDictionary[Any, Callable[[], None]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def check(self, top_keys: int, top_routes: int) -> None:
        if (top_keys, top_routes) != self.bounds:
            raise ValueError(
                f"this registry (meter) already counts with top_keys={self.bounds[0]}, "
                f"top_routes={self.bounds[1]}: not top_keys={top_keys}, "
                f"top_routes={top_routes}"
            )

    def attach(self, target: Any) -> Callable[[], None]:
        """Count ``target``'s limiters not counted yet; returns what stops those."""
        added = []
        with self._lock:
            for limiter in limiters_of(target):
                if limiter not in self._counted:
                    self._counted[limiter] = limiter.listen(self._listener)
                    added.append(limiter)

        def detach() -> None:
            with self._lock:
                for limiter in added:
                    stop = self._counted.pop(limiter, None)
                    if stop is not None:
                        stop()

        return detach


class Sinks:
    """The Sink of each registry (meter): made, with its instruments, by the first call
    for it. What an exporter keeps; ``make()`` makes its instruments and returns what
    records into them."""

    def __init__(self) -> None:
        self._sinks: weakref.WeakKeyDictionary[Any, Sink] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def attach(
        self,
        owner: Any,
        make: Callable[[], Record],
        target: Any,
        top_keys: int | None,
        top_routes: int | None,
    ) -> Callable[[], None]:
        """Count ``target``'s limiters into ``owner``'s Sink; returns what stops it. Bounds
        of None: the Sink's (TOP_KEYS, TOP_ROUTES for a new one)."""
        with self._lock:
            sink = self._sinks.get(owner)
            if sink is None:
                keys = TOP_KEYS if top_keys is None else top_keys
                routes = TOP_ROUTES if top_routes is None else top_routes
                sink = self._sinks[owner] = Sink(make, keys, routes)
            else:
                sink.check(
                    sink.bounds[0] if top_keys is None else top_keys,
                    sink.bounds[1] if top_routes is None else top_routes,
                )
        return sink.attach(target)
