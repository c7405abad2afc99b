"""Events: what a limiter and its transports tell a listener.

Each behaviour runs sync and async over ``World`` (tests/test_transport.py): a
MemoryBackend and a FakeClock, so nothing really waits. The store's failures are real:
a Redis URL on a port where nothing listens.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

import throttle_client._core
from throttle_client import (
    AsyncLimiter,
    AsyncRedisBackend,
    Event,
    Limiter,
    RedisBackend,
    ThrottleTimeout,
)
from throttle_client._events import KINDS, key_label
from throttle_client._redis_server import free_port
from throttle_client.testing import FakeClock

from .test_transport import Upstream, World

TOKEN = "ghp_s3cr3t-token-never-in-an-event"


@pytest.fixture(params=["sync", "async"])
def world(request: pytest.FixtureRequest) -> Iterator[World]:
    w = World(request.param)
    yield w
    w.loop.close()


def heard(limiter: Any) -> list[Event]:
    events: list[Event] = []
    limiter.listen(events.append)
    return events


def never_the_token(events: list[Event]) -> None:
    assert events
    for event in events:
        assert event.kind in KINDS
        assert TOKEN not in repr(event)


def test_admitted_refused_and_timed_out(world: World) -> None:
    limiter = world.limiter("2/second", min_interval=0.25)
    events = heard(limiter)
    label = key_label(limiter.store_key(TOKEN))
    first = world.run(limiter.acquire(TOKEN))
    second = world.run(limiter.acquire(TOKEN, cost=1))  # sleeps 0.25 s for its slot
    refused = world.run(limiter.try_acquire(TOKEN))
    with pytest.raises(ThrottleTimeout) as timeout:
        world.run(limiter.acquire(TOKEN, timeout=0.1))
    assert [e.kind for e in events] == ["admitted", "admitted", "refused", "timed_out"]
    assert {(e.namespace, e.key) for e in events} == {("default", label)}
    assert len(label) == 8 and label in limiter.store_key(TOKEN)
    assert [e.waited for e in events[:2]] == [0.0, pytest.approx(0.25)]
    # The slots the two admitted calls got, as their Decisions say.
    assert [e.slot for e in events[:2]] == [first.slot, second.slot]
    assert second.slot - first.slot == pytest.approx(0.25)
    assert [e.slot for e in events[2:]] == [0.0, 0.0]  # no slot for a refused call
    assert events[2].retry_after == pytest.approx(refused.retry_after)
    assert events[3].retry_after == pytest.approx(timeout.value.retry_after)
    assert all(e.time == pytest.approx(world.clock.now, abs=1) for e in events)
    never_the_token(events)


def test_a_pause_says_who_paused(world: World) -> None:
    limiter = world.limiter()
    events = heard(limiter)
    until = world.run(limiter.pause(TOKEN, 30))
    (event,) = events
    assert (event.kind, event.source, event.reason) == ("paused", "caller", "")
    assert event.until == pytest.approx(until)
    never_the_token(events)


def test_a_transport_reports_statuses_and_the_pause_the_upstream_asked_for(world: World) -> None:
    limiter = world.limiter()
    events = heard(limiter)
    upstream = Upstream(world.clock, [(429, {"Retry-After": "7"})])
    client = world.client(limiter, upstream)
    url = f"https://api.example.com/repos?access_token={TOKEN}"
    response = world.request(client, "GET", url, headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 200  # the retry, after the pause
    kinds = [e.kind for e in events]
    assert kinds == ["admitted", "upstream_status", "paused", "admitted", "upstream_status"]
    first, pause, second = events[1], events[2], events[4]
    assert (first.status, second.status) == (429, 200)
    assert first.route == "GET api.example.com"  # no Route matched: never its own path
    assert (pause.source, pause.reason, pause.route) == ("upstream", "Retry-After", first.route)
    assert pause.until == pytest.approx(first.time + 7, abs=0.01)
    assert events[3].waited == pytest.approx(7, abs=0.01)
    never_the_token(events)


def test_a_late_wakeup_is_reported_and_the_call_booked_again() -> None:
    """A sleep that overshoots the slot by more than the margin (a stalled process)."""
    clock = FakeClock()
    overshoot = [0.5]

    def sleep(seconds: float) -> None:
        clock.advance(seconds + (overshoot.pop() if overshoot else 0.0))

    limiter = Limiter(
        throttle_client.MemoryBackend(),
        rates="10/second",
        min_interval=0.1,
        margin=0.05,
        clock=clock,
        sleep=sleep,
    )
    events = heard(limiter)
    limiter.acquire(TOKEN)
    decision = limiter.acquire(TOKEN)
    assert decision.late_wakeups == 1
    assert [e.kind for e in events] == ["admitted", "late_wakeup", "admitted"]
    assert events[1].late_by == pytest.approx(0.5)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_store_that_is_down_reports_its_error_then_the_fallback(mode: str) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    options: dict[str, Any] = {"rates": "5/second", "on_unavailable": "allow", "retry_for": 0}
    if mode == "sync":
        backend: Any = RedisBackend(url)
        limiter: Any = Limiter(backend, **options)
    else:
        backend = AsyncRedisBackend(url)
        limiter = AsyncLimiter(backend, **options)
    world = World(mode)
    try:
        events = heard(limiter)
        assert world.run(limiter.try_acquire(TOKEN)).allowed
        assert world.run(limiter.try_acquire(TOKEN)).allowed  # the store rests: no new try
        assert [(e.kind, e.reason) for e in events] == [
            ("store_error", "ConnectionError"),
            ("fallback", "allow"),
            ("admitted", ""),  # by the fallback's answer
            ("fallback", "allow"),
            ("admitted", ""),
        ]
        never_the_token(events)
    finally:
        world.run(backend.aclose() if mode == "async" else backend.close())
        world.loop.close()


def test_no_listener_no_event_made(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cheap when nobody listens: not one Event is built, on any path."""

    def no(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("an Event was made with nobody listening")

    monkeypatch.setattr(throttle_client._core, "Event", no)
    limiter = world.limiter("1/second")
    world.run(limiter.acquire(TOKEN))
    assert not world.run(limiter.try_acquire(TOKEN)).allowed
    world.run(limiter.pause(TOKEN, 1))
    stop = limiter.listen(lambda event: None)
    with pytest.raises(AssertionError, match="nobody listening"):
        world.run(limiter.pause(TOKEN, 1))  # (the patch does catch a listened event)
    stop()
    world.run(limiter.pause(TOKEN, 2))


def test_a_listener_stops_and_a_raising_one_fails_nothing(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    limiter = world.limiter("10/second")
    kept: list[Event] = []
    stop = limiter.listen(kept.append)

    def broken(event: Event) -> None:
        raise RuntimeError("a listener's bug")

    limiter.listen(broken)
    with caplog.at_level(logging.WARNING, logger="throttle_client"):
        assert world.run(limiter.try_acquire(TOKEN)).allowed
    assert "an event listener raised" in caplog.text
    stop()
    stop()  # twice is harmless
    world.run(limiter.try_acquire(TOKEN))
    assert len(kept) == 1
    with pytest.raises(TypeError, match="a listener must be a function"):
        limiter.listen("print")


def test_a_label_is_the_same_for_every_worker_of_a_fleet() -> None:
    """Two limiters (two processes) with one key secret label a key alike; another
    secret, or another key, gives another label."""
    one, two = (Limiter(throttle_client.MemoryBackend(), rates="1/second") for _ in "ab")
    other = Limiter(throttle_client.MemoryBackend(), rates="1/second", key_secret="another")
    labels = {
        key_label(limiter.store_key(key))
        for limiter, key in [(one, TOKEN), (two, TOKEN), (other, TOKEN), (one, TOKEN + "x")]
    }
    assert len(labels) == 3
    tagged = Limiter(throttle_client.MemoryBackend(), rates="1/second", tag=lambda key: "acct")
    assert key_label(tagged.store_key(TOKEN)) == key_label(one.store_key(TOKEN))
