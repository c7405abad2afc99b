"""OpenTelemetry metrics of what limiters do, with the ``otel`` extra
(``opentelemetry-api``; the application brings the SDK and its exporter)::

    from throttle_client.otel import instrument

    stop = instrument(limiter)  # the global meter provider's meter, or meter=...

The same instruments as ``throttle_client.prometheus`` (``_metrics``), with the label
values as attributes: counters, and a histogram of wait seconds. Keys appear as their
label, and only the first ``top_keys`` keys (``top_routes`` routes) of a process get
attributes of their own. Every limiter instrumented with one meter shares its
instruments and its bounds, set by the first call for that meter; one instrumented
twice is recorded once. The instruments keep the Prometheus names (without ``_total``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    from opentelemetry import metrics as otel_metrics
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "throttle_client.otel needs opentelemetry-api: pip install 'throttle-client[otel]'"
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


def _recorder(meter: otel_metrics.Meter) -> Record:
    """The instruments, made with ``meter``, and what records into them."""
    made: dict[str, Any] = {}
    for instrument in INSTRUMENTS:
        if instrument.kind == COUNTER:
            made[instrument.name] = meter.create_counter(
                instrument.name, unit=instrument.unit, description=instrument.help
            )
        elif instrument.kind == GAUGE:  # (one that goes up and down: an UpDownCounter)
            made[instrument.name] = meter.create_up_down_counter(
                instrument.name, unit=instrument.unit, description=instrument.help
            )
        else:
            made[instrument.name] = meter.create_histogram(
                instrument.name,
                unit=instrument.unit,
                description=instrument.help,
                explicit_bucket_boundaries_advisory=WAIT_BUCKETS,
            )

    def record(instrument: Instrument, labels: tuple[str, ...], value: float) -> None:
        attributes = dict(zip(instrument.labels, labels, strict=True))
        if instrument.kind == HISTOGRAM:
            made[instrument.name].record(value, attributes)
        else:
            made[instrument.name].add(value, attributes)

    return record


# By the meter given, else by the global meter provider: before an application sets one,
# each get_meter() is a new proxy, and the bounds must hold for all of them together.
_sinks = Sinks()


def instrument(
    target: Any,
    *,
    meter: otel_metrics.Meter | None = None,
    top_keys: int | None = None,
    top_routes: int | None = None,
) -> Callable[[], None]:
    """Record what ``target`` (a limiter, or a throttled transport or client: every
    limiter it uses) does with ``meter`` (the global meter provider's "throttle_client"
    meter if None). Returns the function that stops recording it. A limiter already
    recorded with that meter is not recorded twice; the first call for a meter sets its
    bounds (100 each by default); a later one may leave them out, or must give the same."""
    if meter is not None:
        return _sinks.attach(meter, lambda: _recorder(meter), target, top_keys, top_routes)
    provider = otel_metrics.get_meter_provider()

    def make() -> Record:
        return _recorder(provider.get_meter("throttle_client"))

    return _sinks.attach(provider, make, target, top_keys, top_routes)
