"""A key's pushback (issue 12, part 4): the reason of a pause a transport set, and the
429s of the last minute, kept in the store so that ``throttle-client top`` shows them."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from throttle_client import (
    Backend,
    Limiter,
    MemoryBackend,
    RedisBackend,
    SQLiteBackend,
    ThrottledTransport,
)
from throttle_client._backends.base import Pushback
from throttle_client._flow import run

TOKEN = "ghp_pushback_test_token_9d0e"


@pytest.fixture(params=["memory", "sqlite", "redis", "cluster"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    kind = request.param
    backend: Backend
    if kind == "memory":
        backend = MemoryBackend()
    elif kind == "sqlite":
        backend = SQLiteBackend(tmp_path / "limits.db")
    else:
        backend = RedisBackend(request.getfixturevalue(f"{kind}_url"), cluster=kind == "cluster")
    yield backend
    backend.close()


def upstream_pause(limiter: Limiter, key: str, seconds: float, reason: str, refused: bool) -> None:
    """What a transport does when the upstream pushes back (``_TransportCore.flow``)."""
    flow = limiter._pause_flow(
        key, seconds, limiter._local(), reason=reason, source="upstream", refused=refused
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
    assert store.pushback([key, "api:{nothing}"]) == {key: Pushback("Retry-After", 1)}


def test_refusals_count_for_a_minute_and_the_reason_while_its_pause_holds(store: Backend) -> None:
    limiter = Limiter(store, rates="10/second", namespace="api")
    key = limiter.store_key(TOKEN)
    limiter.pause(TOKEN, 60)  # the caller's: no pushback
    assert store.pushback([key]) == {}
    # A shorter pause than the one in force: its refusal counts, its reason does not hold.
    upstream_pause(limiter, TOKEN, 5, "Retry-After", refused=True)
    assert store.pushback([key]) == {key: Pushback(None, 1)}

    other = limiter.store_key("other")
    upstream_pause(limiter, "other", 120, "X-RateLimit-Reset", refused=False)
    upstream_pause(limiter, "other", 1, "backoff", refused=True)
    upstream_pause(limiter, "other", 1, "backoff", refused=True)
    assert store.pushback([key, other]) == {
        key: Pushback(None, 1),
        other: Pushback("X-RateLimit-Reset", 2),
    }
    limiter.reset("other")
    assert store.pushback([other]) == {}


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
        upstream_pause(limiter, TOKEN, 60, "Retry-After", refused=True)
        upstream_pause(limiter, TOKEN, 1, "Retry-After", refused=True)
        look = top("--sqlite", str(path), "--json")
        text = top("--sqlite", str(path), "--iterations", "1")
    (row,) = json.loads(look.stdout)["keys"]
    assert (row["label"], row["reason"], row["refused"]) == ("acct 1", "Retry-After", 2)
    assert 59 < row["paused_for"] <= 60
    line = text.stdout.splitlines()[1]
    assert line.split()[:2] == ["acct", "1"] and "paused on Retry-After" in line
    assert line.split()[6] == "2"  # the 429s column, after "acct 1", api, full, "59.9 s"
