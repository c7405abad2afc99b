"""Prometheus metrics of what limiters do, with the ``prometheus`` extra
(``prometheus_client``)::

    from throttle_client.prometheus import instrument

    stop = instrument(limiter)  # or a throttled transport or client
    prometheus_client.start_http_server(9100)

The instruments and their labels are ``_metrics``'s: decisions by outcome, wait seconds,
late wake-ups, pauses by reason and source, upstream responses by route and status,
store errors and fallbacks; keys appear as their label, never as themselves, and only
the first ``top_keys`` keys (``top_routes`` routes) of a process get series of their own.
Every limiter instrumented into one registry shares its metrics (told apart by the
``namespace`` label) and its bounds, set by the first call for that registry; one
instrumented twice (alone, or through a client that uses it) is counted once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

try:
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "throttle_client.prometheus needs prometheus_client: "
        "pip install 'throttle-client[prometheus]'"
    ) from exc

from ._metrics import (
    COUNTER,
    GAUGE,
    HISTOGRAM,
    INSTRUMENTS,
    WAIT_BUCKETS,
    Instrument,
    Record,
    Sinks,
)

__all__ = ["instrument"]


def _recorder(registry: CollectorRegistry) -> Record:
    """The instruments, made in ``registry``, and what records into them."""
    made: dict[str, Any] = {}
    try:
        for instrument in INSTRUMENTS:
            made[instrument.name] = _make(instrument, registry)
    except BaseException:  # (one of that name already there: none of ours stays)
        for metric in made.values():
            registry.unregister(metric)
        raise

    def record(instrument: Instrument, labels: tuple[str, ...], value: float) -> None:
        child = made[instrument.name].labels(*labels)
        if instrument.kind == HISTOGRAM:
            child.observe(value)
        else:
            child.inc(value)

    return record


def _make(instrument: Instrument, registry: CollectorRegistry) -> Any:
    if instrument.kind == COUNTER:
        return Counter(instrument.name, instrument.help, instrument.labels, registry=registry)
    if instrument.kind == GAUGE:
        return Gauge(instrument.name, instrument.help, instrument.labels, registry=registry)
    return Histogram(
        instrument.name, instrument.help, instrument.labels, registry=registry, buckets=WAIT_BUCKETS
    )


_sinks = Sinks()


def instrument(
    target: Any,
    *,
    registry: CollectorRegistry | None = None,
    top_keys: int | None = None,
    top_routes: int | None = None,
) -> Callable[[], None]:
    """Count what ``target`` (a limiter, or a throttled transport or client: every
    limiter it uses) does in ``registry`` (prometheus_client's default one if None).
    Returns the function that stops counting it. A limiter already counted in that
    registry is not counted twice; the first call for a registry sets its bounds
    (100 each by default); a later one may leave them out, or must give the same."""
    registry = REGISTRY if registry is None else registry
    make = functools.partial(_recorder, registry)
    return _sinks.attach(registry, make, target, top_keys, top_routes)
