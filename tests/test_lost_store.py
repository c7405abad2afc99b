"""A store that lost its recent history never gives the fleet a second quota.

A Redis without persistence killed and restarted (or a failover to a replica that
lagged, a restore from an older copy) comes back without the calls of the last
window: each key looks new. Every answer tells the worker when its key's log began;
a worker whose own bookings must still be in the log sends that back, and a store
that finds the key begun afresh since holds it as if every window had been full when
it was lost. Judged by the slots the store hands out, on an injected clock, so the
restart itself takes no part in the timing.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from throttle_client import Limiter, RedisBackend, SQLiteBackend, ThrottleTimeout
from throttle_client._backends.redis import redis_keys
from throttle_client.testing import FakeClock, RedisServer

US = 1_000_000
RATES = ["5/10 seconds"]
GAP = 0.1


@pytest.fixture
def store(own_redis: RedisServer) -> Iterator[RedisServer]:
    yield own_redis


def worker(server: RedisServer, clock: FakeClock, **options: Any) -> Limiter:
    """A worker of the fleet (a limiter of its own; ``backend=`` to share one)."""
    options.setdefault("rates", RATES)
    options.setdefault("min_interval", GAP)
    backend = options.pop("backend", None) or RedisBackend(server.url)
    return Limiter(backend, margin=0, clock=clock, sleep=clock.sleep, **options)


def us(seconds: float) -> int:
    return round(seconds * US)


def lose(backend: Any, store_key: str) -> None:
    """The store loses the key's log and meta: an SQLite file restored from an older
    copy, a Redis (or Cluster node) that lost its keys."""
    if isinstance(backend, SQLiteBackend):
        with sqlite3.connect(backend.path) as db:
            db.execute("DELETE FROM tc_entries WHERE key = ?", (store_key,))
            db.execute("DELETE FROM tc_meta WHERE key = ?", (store_key,))
    else:
        backend._runner.delete(*redis_keys(store_key))


def lost(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "lost the recent calls" in r.getMessage()]


def test_a_restart_without_persistence_holds_the_key_for_a_window(
    store: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    limiter = worker(store, clock)
    slots = [us(limiter.acquire("token").slot) for _ in range(5)]  # the window is full
    store.restart()  # kill -9 and start again: an empty dataset
    with caplog.at_level(logging.WARNING, logger="throttle_client"):
        after = [us(limiter.acquire("token").slot) for _ in range(5)]
    # Nothing before the lost window would have let a call go (the first slot + 10 s),
    # and the key is held from its new beginning for a whole window: never sooner.
    assert after[0] >= slots[0] + 10 * US
    every = slots + after
    assert all(sum(1 for u in every if t - 10 * US < u <= t) <= 5 for t in every)
    assert len(lost(caplog)) == 1 and "token" not in caplog.text


def test_without_the_check_the_lost_window_is_spent_twice(store: RedisServer) -> None:
    """What the check prevents: a worker that knew nothing of the key before the loss
    (a process started after it) sees a new key, and is answered at once."""
    clock = FakeClock()
    limiter = worker(store, clock)
    for _ in range(5):
        limiter.acquire("token")
    store.restart()
    newcomer = worker(store, clock)
    assert newcomer.try_acquire("token").allowed


def test_a_worker_that_knew_the_key_holds_it_after_a_newcomer_began_it(
    store: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    old = worker(store, clock)
    for _ in range(5):
        old.acquire("token")
    store.restart()
    clock.advance(1)
    began = us(clock.now)
    newcomer = worker(store, clock)
    assert newcomer.try_acquire("token").allowed  # it cannot know
    with caplog.at_level(logging.WARNING, logger="throttle_client"):
        decision = old.try_acquire("token")
    assert not decision.allowed
    # Held from when the key began again, for the longest window: no one goes sooner.
    assert us(decision.retry_after) >= began + 10 * US - us(clock.now)
    assert not newcomer.try_acquire("token").allowed
    assert len(lost(caplog)) == 1


def test_a_reset_is_not_taken_for_a_loss(store: RedisServer) -> None:
    clock = FakeClock()
    one, other = worker(store, clock), worker(store, clock)
    for _ in range(5):
        other.acquire("token")
    one.reset("token")
    decisions = [other.try_acquire("token") for _ in range(2)]
    assert decisions[0].allowed  # the reset forgot the calls; nothing holds the key
    assert not decisions[1].allowed and us(decisions[1].retry_after) == us(GAP)


def test_a_key_rebuilt_from_its_own_log_is_not_held(store: RedisServer) -> None:
    """A meta lost beside a log that kept every call (an eviction of one part) is
    rebuilt from the log: no call was lost, so nothing is held for it."""
    clock = FakeClock()
    limiter = worker(store, clock, rates=["50/10 seconds"])
    limiter.acquire("token")
    client = redis.Redis.from_url(store.url)
    client.delete(redis_keys(limiter.store_key("token"))[1])
    client.close()
    clock.advance(1)
    assert limiter.try_acquire("token").allowed


def test_a_stacked_call_holds_each_key_that_lost_its_history(store: RedisServer) -> None:
    clock = FakeClock()
    tokens = worker(store, clock, namespace="token", rates=["100/10 seconds"], min_interval=0)
    account = worker(store, clock, namespace="account", backend=tokens.backend)
    for _ in range(5):
        tokens.acquire("t1", also=[(account, "acct")])
    store.restart()
    decision = tokens.try_acquire("t1", also=[(account, "acct")])
    assert not decision.allowed and decision.retry_after >= 9.9
    assert not account.try_acquire("acct").allowed  # held for everyone


def test_a_capped_call_holds_a_key_that_lost_its_history(store: RedisServer) -> None:
    clock = FakeClock()
    limiter = worker(store, clock, max_concurrent=5)
    for _ in range(5):
        with limiter.lease("token"):
            pass
    store.restart()
    with pytest.raises(ThrottleTimeout), limiter.lease("token", timeout=1):
        pass


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("cluster", marks=pytest.mark.cluster)])
def test_every_store_holds_a_key_whose_calls_it_lost(
    kind: str, request: pytest.FixtureRequest, tmp_path: Any
) -> None:
    """An SQLite file restored from an older copy, a Cluster node that lost its keys:
    the key's log and meta are gone, the worker that booked on it holds it."""
    clock = FakeClock()
    if kind == "sqlite":
        backend: Any = SQLiteBackend(tmp_path / "limits.db")
    else:
        backend = RedisBackend(request.getfixturevalue("cluster_url"), cluster=True)
    limiter = Limiter(
        backend, rates=RATES, min_interval=GAP, margin=0, clock=clock, sleep=clock.sleep
    )
    first = us(limiter.acquire("token").slot)
    for _ in range(4):
        limiter.acquire("token")
    store_key = limiter.store_key("token")
    lose(backend, store_key)
    decision = limiter.try_acquire("token")
    assert not decision.allowed and us(decision.slot) >= first + 10 * US
    backend.close()


def test_a_copy_restored_with_fewer_calls_is_held(store: RedisServer) -> None:
    """A restore from an older copy (or a failover to a replica that lagged) keeps the
    key's life but loses its latest calls: it counts fewer units than the worker saw."""
    clock = FakeClock()
    limiter = worker(store, clock)
    limiter.acquire("token")
    client = redis.Redis.from_url(store.url)
    names = redis_keys(limiter.store_key("token"))
    copy = {name: client.dump(name) for name in names}
    for _ in range(4):
        limiter.acquire("token")  # the window is full
    for name, dumped in copy.items():
        client.restore(name, 0, dumped, replace=True)  # back to one call
    client.close()
    decision = limiter.try_acquire("token")
    assert not decision.allowed and decision.retry_after >= 9.9


def test_a_refused_call_keeps_the_hold_on_sqlite(tmp_path: Any) -> None:
    """The hold is kept even when the call that found the loss was refused: a worker
    that never saw the key finds it held too."""
    clock = FakeClock()
    path = tmp_path / "limits.db"

    def sqlite_worker() -> Limiter:
        backend = SQLiteBackend(path)
        return Limiter(backend, rates=RATES, margin=0, clock=clock, sleep=clock.sleep)

    old = sqlite_worker()
    for _ in range(5):
        old.acquire("token")
    with sqlite3.connect(path) as db:
        for table in ("tc_entries", "tc_meta"):
            db.execute(f"DELETE FROM {table} WHERE key = ?", (old.store_key("token"),))
    assert not old.try_acquire("token").allowed  # held
    newcomer = sqlite_worker()
    assert not newcomer.try_acquire("token").allowed


def test_a_calendar_rate_is_held_to_the_end_of_its_window(store: RedisServer) -> None:
    """Calls lost in today's window count until midnight, not for a day from now."""
    from datetime import datetime, timezone

    from throttle_client import Rate

    clock = FakeClock(datetime(2026, 3, 2, 23, 50, tzinfo=timezone.utc).timestamp())
    limiter = worker(store, clock, rates=[Rate(100, "day", tz="UTC")], min_interval=0)
    for _ in range(3):
        limiter.acquire("token")
    store.restart()
    decision = limiter.try_acquire("token")
    assert not decision.allowed
    midnight = datetime(2026, 3, 3, tzinfo=timezone.utc).timestamp()
    assert decision.slot == pytest.approx(midnight, abs=1)


def test_the_local_fallback_is_never_taken_for_a_lost_store(store: RedisServer) -> None:
    """While the store is down, LocalFallback's own log is new: a life the worker knew in
    the store must not hold it."""
    from throttle_client import LocalFallback

    limiter = Limiter(
        RedisBackend(store.url),
        rates=["100/hour"],
        on_unavailable=LocalFallback(expected_workers=2),
        retry_for=0.05,
    )
    assert limiter.acquire("token").allowed
    store.kill()
    assert limiter.try_acquire("token").allowed  # this worker's share, in memory


@pytest.mark.parametrize("kind", ["redis", "sqlite"])
def test_a_pool_passes_over_a_key_that_lost_its_history(
    kind: str, store: RedisServer, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A key of a pool whose log and meta the store lost would look empty, the pool's
    best; the hold its call would set (a whole minute from the loss) counts in the
    choice, so the pool takes the key with room, and then the one that frees first."""
    clock = FakeClock()
    if kind == "sqlite":
        backend: Any = SQLiteBackend(tmp_path / "limits.db")
    else:
        backend = RedisBackend(store.url)
    limiter = Limiter(backend, rates=["10/minute"], margin=0, clock=clock, sleep=clock.sleep)
    pool = ["tok-a", "tok-b"]
    assert [limiter.acquire_any(pool).key for _ in range(2)] == pool
    store_key = limiter.store_key("tok-a")
    lose(backend, store_key)
    clock.advance(1)
    decision = limiter.try_acquire_any(pool)
    assert (decision.allowed, decision.key) == (True, "tok-b")
    taken = [limiter.try_acquire_any(pool).key for _ in range(8)]
    assert taken == ["tok-b"] * 8  # b's quota, 10 a minute, is spent
    refused = limiter.try_acquire_any(pool)
    # b frees a unit 60 s after its first call; a's hold ends 60 s after the loss, later.
    assert (refused.allowed, refused.key, round(refused.retry_after, 3)) == (False, "tok-b", 59)
    backend.close()
