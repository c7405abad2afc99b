"""Metrics: Prometheus, scraped over HTTP from a real /metrics endpoint, and
OpenTelemetry, read with the SDK's in-memory reader; both built on a limiter's events,
with keys as their labels and bounded cardinality. Also the key label itself, shared by
events, metrics and the transports' logs, and a transport's listeners."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from throttle_client import (
    AsyncLimiter,
    Event,
    Limiter,
    MemoryBackend,
    RedisBackend,
    RetryPolicy,
    Route,
    ThrottledClient,
    ThrottledTransport,
    ThrottleTimeout,
    otel,
    prometheus,
)
from throttle_client._metrics import OTHER, Bounded
from throttle_client._redis_server import free_port
from throttle_client.testing import FakeClock

TOKEN = "ghp_metricsSecretToken"
URL = "https://api.example.com/items"


def limiter(namespace: str = "ig") -> tuple[Limiter, FakeClock]:
    clock = FakeClock()
    made = Limiter(
        MemoryBackend(),
        rates=["2/second"],
        namespace=namespace,
        margin=0,
        clock=clock,
        sleep=clock.sleep,
    )
    return made, clock


def exercise(target: Limiter) -> None:
    """3 admitted (one after a 1 s wait), 1 refused, 1 timed out, a pause; other keys."""
    assert target.try_acquire(TOKEN).allowed
    assert target.try_acquire(TOKEN).allowed
    assert not target.try_acquire(TOKEN).allowed
    with pytest.raises(ThrottleTimeout):
        target.acquire(TOKEN, timeout=0.1)
    assert target.acquire(TOKEN).waited == pytest.approx(1.0, abs=0.01)
    target.pause(TOKEN, 5)
    for other in ("tok-second", "tok-third", "tok-fourth"):
        target.try_acquire(other)


def throttled_429_then_200(target: Limiter) -> None:
    """One request through a transport: a 429 with Retry-After, then a 200."""
    answers = iter([httpx.Response(429, headers={"Retry-After": "1"}), httpx.Response(200)])
    transport = ThrottledTransport(
        target,
        transport=httpx.MockTransport(lambda request: next(answers)),
        retry=RetryPolicy(max_attempts=2),
    )
    with httpx.Client(transport=transport) as client:
        assert client.get(URL, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def unreachable() -> Limiter:
    """A store that refuses connections, answered for by on_unavailable="allow"."""
    return Limiter(
        RedisBackend(f"redis://127.0.0.1:{free_port()}/0"),
        rates=["10/second"],
        namespace="down",
        on_unavailable="allow",
        retry_for=0,
    )


# -- Prometheus: a real endpoint, scraped ---------------------------------------------


@pytest.fixture
def scraped() -> Iterator[tuple[CollectorRegistry, str]]:
    registry = CollectorRegistry()
    server, thread = start_http_server(free_port(), addr="127.0.0.1", registry=registry)
    yield registry, f"http://127.0.0.1:{server.server_port}/metrics"
    server.shutdown()
    server.server_close()
    thread.join()


def samples(url: str) -> tuple[str, dict[tuple[str, frozenset[tuple[str, str]]], float]]:
    text = httpx.get(url).text
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[sample.name, frozenset(sample.labels.items())] = sample.value
    return text, found


def value(found: dict[Any, float], name: str, **labels: str) -> float:
    return found.get((name, frozenset(labels.items())), 0.0)


def test_prometheus_counts_what_limiters_do_on_a_real_endpoint(scraped) -> None:
    registry, url = scraped
    target, _ = limiter()
    stop = prometheus.instrument(target, registry=registry, top_keys=2)
    exercise(target)
    throttled_429_then_200(target)
    down = unreachable()
    prometheus.instrument(down, registry=registry, top_keys=2)
    assert down.try_acquire(TOKEN).allowed  # on_unavailable="allow" answered
    text, found = samples(url)

    assert TOKEN not in text and "tok-" not in text  # keys appear as labels only
    label = target.label(TOKEN)
    decisions = "throttle_client_decisions_total"
    mine = {"namespace": "ig", "key": label}
    # The token's 3 admitted in exercise() and 2 through the transport, and tok-second's;
    # tok-third and tok-fourth are past top_keys=2: counted as "other".
    assert value(found, decisions, **mine, outcome="admitted") == 5
    assert value(found, decisions, **mine, outcome="refused") == 1
    assert value(found, decisions, **mine, outcome="timed_out") == 1
    second = {"namespace": "ig", "key": target.label("tok-second")}
    assert value(found, decisions, **second, outcome="admitted") == 1
    assert value(found, decisions, namespace="ig", key=OTHER, outcome="admitted") == 2
    assert value(found, "throttle_client_wait_seconds_count", **mine) == 5
    assert value(found, "throttle_client_wait_seconds_sum", **mine) >= 1.0
    assert value(found, "throttle_client_wait_seconds_bucket", **mine, le="0.001") >= 2
    pauses = "throttle_client_pauses_total"
    assert value(found, pauses, **mine, reason="", source="caller") == 1
    assert value(found, pauses, **mine, reason="Retry-After", source="upstream") == 1
    route = {**mine, "route": "GET api.example.com"}  # no Route matched: host only
    assert value(found, "throttle_client_upstream_responses_total", **route, status="429") == 1
    assert value(found, "throttle_client_upstream_responses_total", **route, status="200") == 1
    errors = "throttle_client_store_errors_total"
    assert value(found, errors, namespace="down", reason="ConnectionError") == 1
    assert value(found, "throttle_client_fallbacks_total", namespace="down", reason="allow") == 1

    stop()  # stops counting this limiter
    target.try_acquire("tok-second")
    _, after = samples(url)
    assert value(after, decisions, **second, outcome="admitted") == 1
    down.backend.close()


def test_limiters_share_a_registrys_metrics(scraped) -> None:
    """Instrumenting a second limiter into the same registry adds to the same metrics
    (told apart by namespace), where prometheus_client would refuse a second metric."""
    registry, url = scraped
    first, _ = limiter("first")
    second, _ = limiter("second")
    prometheus.instrument(first, registry=registry)
    prometheus.instrument(second, registry=registry)
    first.try_acquire(TOKEN)
    second.try_acquire(TOKEN)
    _, found = samples(url)
    for namespace, target in (("first", first), ("second", second)):
        labels = {"namespace": namespace, "key": target.label(TOKEN), "outcome": "admitted"}
        assert value(found, "throttle_client_decisions_total", **labels) == 1


def test_instrument_refuses_what_is_not_a_limiter() -> None:
    with pytest.raises(TypeError, match="not 'a limiter'"):
        prometheus.instrument("a limiter", registry=CollectorRegistry())
    with pytest.raises(ValueError, match="not -1"):
        prometheus.instrument(limiter()[0], registry=CollectorRegistry(), top_keys=-1)


# -- OpenTelemetry: the SDK's in-memory reader ----------------------------------------


def points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    found: dict[str, list[Any]] = {}
    data = reader.get_metrics_data()
    assert data is not None
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                found.setdefault(metric.name, []).extend(metric.data.data_points)
    return found


def test_opentelemetry_records_the_same_instruments() -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    target, _ = limiter()
    otel.instrument(target, meter=provider.get_meter("test"), top_keys=1)
    exercise(target)
    found = points(reader)
    decisions = {
        (p.attributes["key"], p.attributes["outcome"]): p.value
        for p in found["throttle_client_decisions"]
    }
    label = target.label(TOKEN)
    assert decisions[label, "admitted"] == 3
    assert decisions[label, "refused"] == 1
    assert decisions[label, "timed_out"] == 1
    assert decisions[OTHER, "admitted"] == 3  # the three other keys, past top_keys=1
    (wait,) = [p for p in found["throttle_client_wait_seconds"] if p.attributes["key"] == label]
    assert wait.count == 3 and wait.sum == pytest.approx(1.0, abs=0.01)
    assert wait.explicit_bounds[0] == 0.001
    (pause,) = found["throttle_client_pauses"]
    assert dict(pause.attributes) == {
        "namespace": "ig",
        "key": label,
        "reason": "",
        "source": "caller",
    }
    assert all(TOKEN not in str(p.attributes) for ps in found.values() for p in ps)
    provider.shutdown()


def test_leases_held_go_up_and_down_on_both_exporters(scraped) -> None:
    """A capped key's leases this process holds: a gauge (an UpDownCounter in
    OpenTelemetry), up when a lease is entered, down when it ends, sync and asyncio."""
    registry, url = scraped
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    backend = MemoryBackend()
    capped = Limiter(backend, rates="100/second", max_concurrent=3, namespace="caps")
    prometheus.instrument(capped, registry=registry)
    otel.instrument(capped, meter=provider.get_meter("test"))
    held = {"namespace": "caps", "key": capped.label(TOKEN)}
    gauge = "throttle_client_leases_held"

    def otel_held() -> float:
        return sum(p.value for p in points(reader).get(gauge, ()))

    with capped.lease(TOKEN), capped.lease(TOKEN):
        assert value(samples(url)[1], gauge, **held) == 2
        assert otel_held() == 2
        with capped.lease(TOKEN):
            assert value(samples(url)[1], gauge, **held) == 3
    assert value(samples(url)[1], gauge, **held) == 0
    assert otel_held() == 0

    async def in_a_task() -> float:
        limiter = AsyncLimiter(backend, rates="100/second", max_concurrent=3, namespace="caps")
        prometheus.instrument(limiter, registry=registry)
        async with limiter.lease(TOKEN):
            return value(samples(url)[1], gauge, **held)

    assert asyncio.run(in_a_task()) == 1
    assert value(samples(url)[1], gauge, **held) == 0
    provider.shutdown()


def test_a_later_instrument_call_may_leave_the_bounds_out() -> None:
    registry = CollectorRegistry()
    first, _ = limiter()
    second = Limiter(MemoryBackend(), rates="5/second", namespace="second")
    prometheus.instrument(first, registry=registry, top_keys=2)
    prometheus.instrument(second, registry=registry)  # the registry's: top_keys=2
    with pytest.raises(ValueError, match="top_keys=2"):
        prometheus.instrument(second, registry=registry, top_keys=5)


# -- the parts they are built on ------------------------------------------------------


def test_bounded_keeps_the_first_values_and_counts_the_rest_as_other() -> None:
    bounded = Bounded(2)
    assert [bounded(v) for v in "abcab"] == ["a", "b", OTHER, "a", "b"]
    assert [Bounded(0)(v) for v in "ab"] == [OTHER, OTHER]
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=repr(bad)):
            Bounded(bad)  # type: ignore[arg-type]


def test_the_key_label_is_the_same_in_events_metrics_and_logs(caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="throttle_client")
    target, _ = limiter()
    heard: list[Event] = []
    target.listen(heard.append)
    throttled_429_then_200(target)
    label = target.label(TOKEN)
    assert len(label) == 8 and TOKEN not in label
    assert {event.key for event in heard} == {label}
    logged = [r.getMessage() for r in caplog.records if r.name == "throttle_client"]
    assert any(f"key#{label}" in line for line in logged), logged
    assert not any(TOKEN in line for line in logged)


def test_a_transport_and_a_client_listen_to_every_limiter_they_use() -> None:
    main, _ = limiter("main")
    search, _ = limiter("search")
    heard: list[Event] = []
    client = ThrottledClient(
        main,
        routes=[Route(search, path="/search")],
        transport=httpx.MockTransport(lambda request: httpx.Response(200)),
    )
    stop = client.listen(heard.append)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    client.get("https://api.example.com/items", headers=headers)
    client.get("https://api.example.com/search", headers=headers)
    namespaces = [(event.namespace, event.kind) for event in heard]
    assert ("main", "admitted") in namespaces and ("search", "admitted") in namespaces
    stop()
    client.get("https://api.example.com/search", headers=headers)
    assert [(e.namespace, e.kind) for e in heard] == namespaces  # nothing heard after stop
    client.close()


def test_a_limiter_instrumented_twice_is_counted_once(scraped) -> None:
    """Once alone and once through a client that uses it (and a second client on it):
    every decision counts once; stopping one call's counting leaves the others'."""
    registry, url = scraped
    target, _ = limiter()
    client = ThrottledClient(target, transport=httpx.MockTransport(lambda r: httpx.Response(200)))
    again = ThrottledClient(target, transport=httpx.MockTransport(lambda r: httpx.Response(200)))
    stop_alone = prometheus.instrument(target, registry=registry)
    prometheus.instrument(client, registry=registry)
    prometheus.instrument(again, registry=registry)
    target.try_acquire(TOKEN)
    client.get(URL, headers={"Authorization": f"Bearer {TOKEN}"})
    labels = {"namespace": "ig", "key": target.label(TOKEN), "outcome": "admitted"}
    assert value(samples(url)[1], "throttle_client_decisions_total", **labels) == 2
    stop_alone()  # the limiter was counted by this call: it stops
    target.try_acquire(TOKEN)
    assert value(samples(url)[1], "throttle_client_decisions_total", **labels) == 2
    with pytest.raises(ValueError, match="already counts with top_keys=100"):
        prometheus.instrument(target, registry=registry, top_keys=5)
    client.close()
    again.close()


def test_no_request_path_reaches_a_label(scraped) -> None:
    """A path may carry a secret (a webhook's, a bot's token) or an id per call: routes
    are labelled by method, host and the matched Route's path only."""
    registry, url = scraped
    target, _ = limiter()
    search, _ = limiter("search")
    client = ThrottledClient(
        target,
        routes=[Route(search, path="/search")],
        transport=httpx.MockTransport(lambda request: httpx.Response(200)),
    )
    prometheus.instrument(client, registry=registry)
    client.get("https://hooks.example.com/services/T000/B000/XXXXSECRETXXXX")
    client.get("https://api.example.com/search/users/12345")
    text, found = samples(url)
    assert "SECRET" not in text and "12345" not in text
    responses = "throttle_client_upstream_responses_total"
    host = target.label("hooks.example.com")
    hooks = {"namespace": "ig", "key": host, "route": "GET hooks.example.com", "status": "200"}
    assert value(found, responses, **hooks) == 1
    key = search.label("api.example.com")
    found_search = {"namespace": "search", "key": key, "route": "GET api.example.com/search"}
    assert value(found, responses, **found_search, status="200") == 1
    client.close()


def test_a_listener_added_twice_is_removed_once_per_removal() -> None:
    target, _ = limiter()
    heard: list[Event] = []
    stop_first = target.listen(heard.append)
    target.listen(heard.append)
    stop_first()
    stop_first()  # again: the other addition stays
    target.try_acquire(TOKEN)
    assert len(heard) == 1
