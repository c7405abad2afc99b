"""A key's pushback: the reason of a pause a transport set, and the
429s of the last minute, kept in the store so that ``throttle-client top`` shows them."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis

from throttle_client import (
    Backend,
    Limiter,
    MemoryBackend,
    Rate,
    RedisBackend,
    SQLiteBackend,
    ThrottledTransport,
)
from throttle_client._flow import run
from throttle_client._key_flows import pause_flow
from throttle_client.testing import FakeClock

TOKEN = "ghp_pushback_test_token_9d0e"


@pytest.fixture
def store(every_store: Backend) -> Backend:
    return every_store


def told(store: Backend, keys: list[str]) -> dict[str, tuple[str | None, int]]:
    """A store's pushback of ``keys``: reason and refusals (the pause's end aside)."""
    return {key: (said.reason, said.refused) for key, said in store.pushback(keys).items()}


def upstream_pause(limiter: Limiter, key: str, seconds: float, reason: str, refused: bool) -> None:
    """What a transport does when the upstream pushes back (``TransportCore.flow``)."""
    flow = pause_flow(
        limiter, key, seconds, limiter._local(), reason=reason, source="upstream", refused=refused
    )
    run(flow, limiter._perform)


def test_a_transport_keeps_the_reason_and_the_refusal_in_the_store(store: Backend) -> None:
    limiter = Limiter(store, rates="10/second", namespace="api")
    answers = iter([httpx.Response(429, headers={"Retry-After": "30"})])
    transport = ThrottledTransport(
        limiter, transport=httpx.MockTransport(lambda request: next(answers))
    )
    with httpx.Client(transport=transport, base_url="https://api.example.com") as client:
        response = client.post("/things", headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 429
    key = limiter.store_key(TOKEN)
    assert told(store, [key, "api:{nothing}"]) == {key: ("Retry-After", 1)}


def test_refusals_count_for_a_minute_and_the_reason_while_its_pause_holds(store: Backend) -> None:
    limiter = Limiter(store, rates="10/second", namespace="api")
    key = limiter.store_key(TOKEN)
    limiter.pause(TOKEN, 60)  # the caller's: no pushback
    assert told(store, [key]) == {}
    # A shorter pause than the one in force: its refusal counts, its reason does not hold.
    upstream_pause(limiter, TOKEN, 5, "Retry-After", refused=True)
    assert told(store, [key]) == {key: (None, 1)}

    other = limiter.store_key("other")
    upstream_pause(limiter, "other", 120, "X-RateLimit-Reset", refused=False)
    upstream_pause(limiter, "other", 1, "backoff", refused=True)
    upstream_pause(limiter, "other", 1, "backoff", refused=True)
    assert told(store, [key, other]) == {
        key: (None, 1),
        other: ("X-RateLimit-Reset", 2),
    }
    limiter.reset("other")
    assert told(store, [other]) == {}


def test_refusals_leave_the_count_after_a_minute_and_the_reason_with_its_pause() -> None:
    clock = FakeClock()
    store = MemoryBackend()
    limiter = Limiter(store, rates="10/second", namespace="api", clock=clock)
    key = limiter.store_key(TOKEN)
    upstream_pause(limiter, TOKEN, 30, "Retry-After", refused=True)
    clock.advance(25)
    upstream_pause(limiter, TOKEN, 1, "backoff", refused=True)
    assert told(store, [key]) == {key: ("Retry-After", 2)}
    clock.advance(10)  # the pause ended; both refusals are within the minute
    limiter.try_acquire("another")  # (the memory store reads at the time it last ran)
    assert told(store, [key]) == {key: (None, 2)}
    clock.advance(30)  # 65 s after the first, 40 after the second
    limiter.try_acquire("another")
    assert told(store, [key]) == {key: (None, 1)}
    clock.advance(30)
    limiter.try_acquire("another")
    assert told(store, [key]) == {}


def test_damaged_pushback_counts_nothing_and_fails_nothing(tmp_path: Path, redis_url: str) -> None:
    limiter = Limiter(RedisBackend(redis_url), rates="10/second", namespace="api")
    key = limiter.store_key(TOKEN)
    client = redis.Redis.from_url(redis_url)
    client.hset(f"tc:{key}:pushback", mapping={"s:abc": "1", "until": "12.5", "s:1": "x"})
    assert told(limiter.backend, [key]) == {}  # type: ignore[arg-type]
    client.close()
    sqlite = SQLiteBackend(tmp_path / "limits.db")
    on_sqlite = Limiter(sqlite, rates="10/second", namespace="api")
    upstream_pause(on_sqlite, TOKEN, 1, "backoff", refused=True)
    sqlite._connection().db.execute("UPDATE tc_pushback SET steps = 'not json'")
    upstream_pause(on_sqlite, TOKEN, 1, "backoff", refused=True)  # no error: counts anew
    assert told(sqlite, [key]) == {key: ("backoff", 1)}
    sqlite.close()


def test_sqlite_keeps_the_refusals_when_the_key_expires(tmp_path: Path) -> None:
    store = SQLiteBackend(tmp_path / "limits.db")
    limiter = Limiter(store, rates=[Rate(10, 0.05)], namespace="api", margin=0)
    key = limiter.store_key(TOKEN)
    upstream_pause(limiter, TOKEN, 0.05, "backoff", refused=True)
    time.sleep(0.3)  # the key (a 50 ms window) expired; its 429 is still in the minute
    for _ in range(1100):  # enough operations for a sweep (every 1024)
        limiter.try_acquire("another")
    assert limiter.try_acquire(TOKEN).allowed
    upstream_pause(limiter, TOKEN, 1, "backoff", refused=True)
    assert told(store, [key]) == {key: ("backoff", 2)}
    store.close()


def test_a_redis_pushback_lives_with_its_pause_or_a_minute(redis_url: str) -> None:
    limiter = Limiter(RedisBackend(redis_url), rates="10/second", namespace="api")
    upstream_pause(limiter, TOKEN, 1, "backoff", refused=True)
    upstream_pause(limiter, "long", 300, "Retry-After", refused=True)
    client = redis.Redis.from_url(redis_url)
    short = client.pttl(f"tc:{limiter.store_key(TOKEN)}:pushback")
    long = client.pttl(f"tc:{limiter.store_key('long')}:pushback")
    client.close()
    assert 60_000 < short <= 70_000  # the refusals' minute, and a step
    assert 290_000 < long <= 300_000  # its pause


def top(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "throttle_client", "top", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_top_shows_the_reason_and_the_429s(tmp_path: Path) -> None:
    path = tmp_path / "limits.db"
    with SQLiteBackend(path) as backend:
        limiter = Limiter(backend, rates="10/second", namespace="api", label=lambda k: "acct 1")
        limiter.try_acquire(TOKEN)
        paused = time.monotonic()
        upstream_pause(limiter, TOKEN, 60, "Retry-After", refused=True)
        upstream_pause(limiter, TOKEN, 1, "Retry-After", refused=True)
        look = top("--sqlite", str(path), "--json")
        read = time.monotonic() - paused  # (the command's start: over a second when busy)
        text = top("--sqlite", str(path), "--iterations", "1")
    (row,) = json.loads(look.stdout)["keys"]
    assert (row["label"], row["reason"], row["refused"]) == ("acct 1", "Retry-After", 2)
    assert 60 - read <= row["paused_for"] <= 60  # the 60 s pause, less what went by
    line = text.stdout.splitlines()[1]
    assert line.split()[:2] == ["acct", "1"] and "paused on Retry-After" in line
    assert line.split()[6] == "2"  # the 429s column, after "acct 1", api, full, "59.9 s"
