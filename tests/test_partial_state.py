"""Partial, foreign or damaged state heals, never wedges a key.

A key lives in two parts: its entries (Redis: the log zset; SQLite: tc_entries rows)
and their summary (Redis: the meta string; SQLite: the tc_meta row). Either can be
lost alone (maxmemory eviction, a DEL, a hand in the SQLite file) or be unreadable, or
the summary can read well and hold what no limiter writes (a total below its base or its
entries', a log it calls empty while it holds entries). Whatever is left, the next call
repairs the key in its own atomic step, says so in one warning, and never admits a call
that the lost state would have refused: every test runs the store beside the naive
reference model (tests/model.py), which saw every call and lost nothing, and holds each
slot the store hands out to be no earlier than the one the reference allows. Slots, not
wall-clock time, are judged throughout. A time no limiter sets (a pause thousands of
years ahead) has no such repair: the key is refused, by name, until it is reset.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sqlite3
import time
from collections.abc import Callable, Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any, ClassVar

import pytest
import redis
import redis.cluster

from tests.model import Model
from throttle_client import (
    AsyncLimiter,
    AsyncRedisBackend,
    BackendError,
    BackendUnavailable,
    Limiter,
    MemoryBackend,
    Rate,
    RedisBackend,
    SQLiteBackend,
)
from throttle_client._backends.base import Snapshot
from throttle_client._backends.redis import redis_keys
from throttle_client.testing import FakeClock

TOKEN = "EAAB-very-secret-access-token-5f3c"
US = 1_000_000
# Times are multiples of 1/8 s from a whole second, exact in a float, so the slots in
# seconds and the model's microseconds agree to the microsecond.
RATES = [Rate(4, 1), Rate(10, 10)]
GAP = 0.125


def us(seconds: float) -> int:
    return round(seconds * US)


# -- the stores, and hands that break a key from outside --------------------------------------


class RedisStore:
    def __init__(self, url: str, *, cluster: bool) -> None:
        factory = redis.cluster.RedisCluster if cluster else redis.Redis
        self.client: Any = factory.from_url(url)
        self.backend = RedisBackend(url, cluster=cluster)
        self.kind = "cluster" if cluster else "redis"

    def part(self, key: str, part: str) -> bytes:
        log, meta = redis_keys(key)
        return log if part == "log" else meta

    def drop(self, key: str, part: str) -> None:
        assert self.client.delete(self.part(key, part)) == 1

    def spoil_meta(self, key: str) -> None:
        assert self.client.set(self.part(key, "meta"), b"\xc1 not what this version writes")

    # The meta's fields by their place in its msgpack (see the header of lua/core.lua).
    FIELDS: ClassVar[dict[str, int]] = {"last": 2, "total": 3, "base": 4, "pause": 5, "first": 6}
    FIELDS |= {"since": 8, "until": 9, "limit": 10, "from": 11}

    def rewrite_meta(self, key: str, **fields: float | None) -> None:
        """The meta unpacked, ``fields`` set (None: -1, no slot), and packed again."""
        args = [
            a for name, v in fields.items() for a in (self.FIELDS[name], -1 if v is None else v)
        ]
        self.client.eval(
            "local t = {cmsgpack.unpack(redis.call('GET', KEYS[1]))}"
            " for i = 1, #ARGV, 2 do t[tonumber(ARGV[i])] = tonumber(ARGV[i + 1]) end"
            " redis.call('SET', KEYS[1], cmsgpack.pack(unpack(t, 1, 16)), 'KEEPTTL')",
            1,
            self.part(key, "meta"),
            *args,
        )

    def drop_newest(self, key: str, n: int) -> None:
        """The log's ``n`` newest entries deleted (call ids score below every entry)."""
        assert self.client.zremrangebyrank(self.part(key, "log"), -n, -1) == n

    def close(self) -> None:
        self.backend.close()
        self.client.close()


class SQLiteStore:
    TABLES: ClassVar[dict[str, str]] = {"log": "tc_entries", "meta": "tc_meta"}

    def __init__(self, path: Path) -> None:
        self.backend = SQLiteBackend(path)
        self.db = sqlite3.connect(path, isolation_level=None)
        self.kind = "sqlite"

    def drop(self, key: str, part: str) -> None:
        deleted = self.db.execute(f"DELETE FROM {self.TABLES[part]} WHERE key = ?", (key,))
        assert deleted.rowcount >= 1

    def spoil_meta(self, key: str) -> None:
        spoiled = self.db.execute("UPDATE tc_meta SET total = 'garbage' WHERE key = ?", (key,))
        assert spoiled.rowcount == 1

    COLUMNS: ClassVar[dict[str, str]] = {"last": "last", "total": "total", "base": "base"}
    COLUMNS |= {"pause": "pause_until"}

    def rewrite_meta(self, key: str, **fields: float | None) -> None:
        """tc_meta's columns set (SQLite has no ``first``: a log said empty has no last
        slot); ``until``: a learned limit of 1 unit, from 0, until then."""
        until = fields.pop("until", None)
        fields.pop("first", None)
        if until is not None:
            self.db.execute(
                "INSERT OR REPLACE INTO tc_learned VALUES (?, 0, ?, 1, 0)", (key, until)
            )
        for name, value in fields.items():
            sql = f"UPDATE tc_meta SET {self.COLUMNS[name]} = ? WHERE key = ?"
            assert self.db.execute(sql, (value, key)).rowcount == 1

    def drop_newest(self, key: str, n: int) -> None:
        newest = "SELECT cum FROM tc_entries WHERE key = ? ORDER BY cum DESC LIMIT ?"
        cums = [cum for (cum,) in self.db.execute(newest, (key, n))]
        self.db.executemany(
            "DELETE FROM tc_entries WHERE key = ? AND cum = ?", [(key, c) for c in cums]
        )
        assert len(cums) == n

    def close(self) -> None:
        self.backend.close()
        self.db.close()


Store = RedisStore | SQLiteStore


def redis_store(request: pytest.FixtureRequest, *, cluster: bool) -> RedisStore:
    url = request.getfixturevalue("cluster_url" if cluster else "redis_url")
    return RedisStore(url, cluster=cluster)


@pytest.fixture(params=["redis", pytest.param("cluster", marks=pytest.mark.cluster), "sqlite"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    made: Store
    if request.param == "sqlite":
        made = SQLiteStore(tmp_path / "limits.db")
    else:
        made = redis_store(request, cluster=request.param == "cluster")
    yield made
    made.close()


@pytest.fixture
def repairs(caplog: pytest.LogCaptureFixture) -> Callable[[int], list[str]]:
    """The repair messages logged so far at ``level``."""
    caplog.set_level(logging.DEBUG, logger="throttle_client")

    def logged(level: int) -> list[str]:
        ours = [r for r in caplog.records if r.name == "throttle_client" and r.levelno == level]
        return [r.getMessage() for r in ours if "repaired" in r.getMessage()]

    return logged


# -- the store beside the reference --------------------------------------------------------


class Run:
    """A limiter on one key and the reference model, fed the same calls at the same times.

    Until a part is lost the two must agree exactly; after it, the store may only be
    more careful: each slot no earlier than the reference's."""

    def __init__(self, backend: Any, rates: list[Rate] = RATES, gap: float = GAP) -> None:
        self.clock = FakeClock()
        self.backend, self.rates, self.gap = backend, rates, gap
        self.limiter = self.worker()
        self.key = self.limiter.store_key(TOKEN)
        self.model = Model([(r.limit, us(r.period)) for r in rates], us(gap))
        self.exact = True
        self.booked: list[int] = []

    def worker(self) -> Limiter:
        return Limiter(
            self.backend,
            rates=self.rates,
            min_interval=self.gap,
            margin=0,
            clock=self.clock,
            sleep=self.clock.sleep,
        )

    def newcomer(self) -> None:
        """Go on as a worker that never saw the key: one that booked on it would hold a
        key whose calls are all gone (tests/test_lost_store.py)."""
        self.limiter = self.worker()

    def lose(self, store: Store, *parts: str) -> None:
        for part in parts:
            store.drop(self.key, part)
        self.exact = False

    def acquire(self, cost: int = 1) -> int:
        reference = self.model.earliest_slot("k", us(self.clock()), cost)
        slot = us(self.limiter.acquire(TOKEN, cost).slot)
        assert slot == reference if self.exact else slot >= reference, (slot, reference)
        self.model._log("k").entries.append((slot, cost))
        self.booked.append(slot)
        return slot

    def acquire_many(self, n: int) -> None:
        for _ in range(n):
            self.acquire()

    def windows_hold(self) -> None:
        """By slot: every window of every rate within its limit, every gap kept."""
        entries = self.model._log("k").entries
        for limit, period in self.model.rates:
            for end, _ in entries:
                assert sum(c for t, c in entries if end - period < t <= end) <= limit
        slots = sorted(t for t, _ in entries)
        assert all(b - a >= self.model.min_interval for a, b in pairwise(slots))


# -- each part lost ----------------------------------------------------------------------------


def test_a_lost_log_never_wedges_the_key(store: Store, repairs: Callable[[int], list[str]]) -> None:
    """5000/hour, the window full, the log gone and the meta kept: the lost units all
    count at the newest slot, so the next call waits one period from it (no call fails
    on the meta's TTL)."""
    run = Run(store.backend, rates=[Rate(5000, 3600)], gap=60)
    for _ in range(5):
        run.acquire(cost=1000)  # 5000 units, one a minute: the hour is full
    last = run.booked[-1]
    run.lose(store, "log")
    decision = run.limiter.try_acquire(TOKEN)
    assert not decision.allowed
    # The reference frees a unit when the first call leaves the hour; the repaired key,
    # which no longer knows when its units came, waits until the last one has left.
    assert us(decision.slot) == last + 3600 * US > run.booked[0] + 3600 * US
    assert run.acquire() == last + 3600 * US
    run.acquire_many(5)
    run.windows_hold()
    assert len(repairs(logging.WARNING)) == 1


@pytest.mark.parametrize("first", ["acquire", "try_acquire", "usage", "pause"])
def test_a_lost_log_is_rebuilt_by_whichever_call_comes_first(
    store: Store, repairs: Callable[[int], list[str]], first: str
) -> None:
    run = Run(store.backend)
    run.acquire_many(12)
    run.lose(store, "log")
    if first == "acquire":
        run.acquire()
    elif first == "try_acquire":
        assert not run.limiter.try_acquire(TOKEN)  # 10 in 10 s: full
    elif first == "usage":
        usage = run.limiter.usage(TOKEN)
        assert usage.rates[1].remaining == 0
    else:
        run.limiter.pause(TOKEN, 0.5)
        run.model.pause("k", us(run.clock()), us(0.5))
    run.acquire_many(15)
    run.windows_hold()
    [warning] = repairs(logging.WARNING)
    assert run.key in warning and "log was lost" in warning and TOKEN not in warning


def test_a_lost_meta_is_rebuilt_from_the_log(
    store: Store, repairs: Callable[[int], list[str]]
) -> None:
    run = Run(store.backend)
    run.acquire_many(30)  # over 20 s of slots: the oldest entries are trimmed already
    run.lose(store, "meta")
    run.acquire_many(15)
    run.windows_hold()
    [warning] = repairs(logging.WARNING)
    assert run.key in warning and "meta was lost or unreadable" in warning


def test_a_repaired_log_then_a_lost_meta_never_over_use(
    store: Store, repairs: Callable[[int], list[str]]
) -> None:
    """The log lost and repaired (all its units in one entry), then the meta lost: the
    meta rebuilt from that one entry must not take it for a call of at most the smallest
    limit. (It did, and a minute then held 68 calls against 40.)"""
    run = Run(store.backend, rates=[Rate(10, 1), Rate(40, 60)], gap=0)
    run.acquire_many(40)  # 40 in 4 s: the minute is full
    run.lose(store, "log")
    assert run.limiter.usage(TOKEN).rates[1].remaining == 0  # repairs: 40 units at last
    run.lose(store, "meta")  # while that one entry is still in the minute
    run.acquire_many(40)
    run.windows_hold()
    assert len(repairs(logging.WARNING)) == 1


def test_an_unreadable_meta_is_rebuilt_from_the_log(
    store: Store, repairs: Callable[[int], list[str]]
) -> None:
    run = Run(store.backend)
    run.acquire_many(12)
    store.spoil_meta(run.key)
    run.exact = False
    run.acquire_many(15)
    run.windows_hold()
    assert len(repairs(logging.WARNING)) == 1


def test_an_unreadable_meta_without_a_log_is_replaced(
    store: Store, repairs: Callable[[int], list[str]]
) -> None:
    """With no entries left, what remains is a new key (as when both parts are lost)."""
    run = Run(store.backend)
    run.acquire_many(6)
    run.lose(store, "log")  # a warning: the meta said entries exist
    run.acquire()
    run.lose(store, "log")
    store.spoil_meta(run.key)
    run.model.reset("k")
    run.exact = True
    run.newcomer()
    run.acquire_many(6)
    assert len(repairs(logging.WARNING)) == 1  # the second repair is only DEBUG
    assert ["meta was lost" in m for m in repairs(logging.DEBUG)] == [True]


def test_both_parts_lost_is_a_new_key(store: Store, repairs: Callable[[int], list[str]]) -> None:
    """Nothing is left to tell the loss from a key never seen: to a worker that never
    saw it, it starts afresh, and there is no part to repair."""
    run = Run(store.backend)
    run.acquire_many(12)
    run.lose(store, "log", "meta")
    run.model.reset("k")
    run.exact = True  # exactly a new key
    run.newcomer()
    run.acquire_many(12)
    assert repairs(logging.WARNING) == []


@pytest.mark.parametrize("part", ["log", "meta"])
def test_a_part_lost_after_its_time_is_no_loss(
    store: Store, repairs: Callable[[int], list[str]], part: str
) -> None:
    """Entries that no window reaches any more matter to no decision: losing them (or
    their meta) is only an early expiry, answered exactly, without a warning."""
    run = Run(store.backend)
    run.acquire_many(12)
    run.clock.advance(10.5)  # past the longest period after the last slot
    store.drop(run.key, part)
    run.acquire_many(12)  # run.exact still holds: the same slots as the reference
    assert repairs(logging.WARNING) == []


def test_repeated_repairs_warn_once_per_backend(
    store: Store, repairs: Callable[[int], list[str]]
) -> None:
    run = Run(store.backend)
    for part in ("log", "meta", "log"):
        run.acquire_many(6)
        run.lose(store, part)
    run.acquire_many(6)
    run.windows_hold()
    assert len(repairs(logging.WARNING)) == 1
    assert len(repairs(logging.DEBUG)) == 2


# -- Redis: expiry of one part, and two clocks -------------------------------------------------


@pytest.fixture(params=["log", "meta"])
def expiring(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def gone(client: Any, key: bytes) -> bool:
    """Waits (up to 10 s of real time) for ``key`` to expire."""
    deadline = time.monotonic() + 10
    while client.exists(key) and time.monotonic() < deadline:
        time.sleep(0.01)
    return not client.exists(key)


@pytest.mark.parametrize("cluster", [False, pytest.param(True, marks=pytest.mark.cluster)])
def test_one_part_expiring_alone_is_repaired(
    request: pytest.FixtureRequest,
    expiring: str,
    cluster: bool,
    repairs: Callable[[int], list[str]],
) -> None:
    store = redis_store(request, cluster=cluster)
    run = Run(store.backend)
    run.acquire_many(12)
    key = store.part(run.key, expiring)
    store.client.pexpire(key, 1)  # what a maxmemory policy or an older version could leave
    assert gone(store.client, key)
    run.exact = False
    run.acquire_many(12)
    run.windows_hold()
    assert len(repairs(logging.WARNING)) == 1
    store.close()


def test_two_clocks_apart_never_let_the_log_expire_first(redis_url: str) -> None:
    """Two workers whose injected clocks differ by 10 s wrote one key: both parts take
    their TTL together, so the log never expires before the meta (and the key never fails
    for the 10 s between)."""
    store = RedisStore(redis_url, cluster=False)
    ahead, behind = FakeClock(1_700_000_010.0), FakeClock(1_700_000_000.0)
    limiters = [
        Limiter(store.backend, rates=["5/0.05 seconds"], margin=0, clock=clock, sleep=clock.sleep)
        for clock in (ahead, behind)
    ]
    log, meta = redis_keys(limiters[0].store_key(TOKEN))
    for limiter in limiters:
        limiter.acquire(TOKEN)  # the one behind books after the other: it waits 10 s
    assert behind.slept == [10.0]
    log_ttl = store.client.pttl(log)
    meta_ttl = store.client.pttl(meta)  # read later, so it may only be lower
    assert log_ttl > 0 and meta_ttl <= log_ttl + 2  # one millisecond of rounding on Redis 6.2
    store.close()


async def test_a_lost_log_is_repaired_for_the_async_client(
    redis_url: str, repairs: Callable[[int], list[str]]
) -> None:
    store = RedisStore(redis_url, cluster=False)
    run = Run(store.backend)  # fills the key through a sync limiter (in a thread: blocking)
    await asyncio.to_thread(run.acquire_many, 10)
    store.drop(run.key, "log")
    backend = AsyncRedisBackend(redis_url)
    clock = run.clock
    limiter = AsyncLimiter(
        backend, rates=RATES, min_interval=GAP, margin=0, clock=clock, sleep=clock.asleep
    )
    slot = us((await limiter.acquire(TOKEN)).slot)
    await backend.aclose()
    store.close()
    # 10 in 10 s, all now counted at the last slot: the reference would allow the first
    # slot + 10 s, the repaired key the last slot + 10 s.
    assert slot == run.booked[-1] + 10 * US > run.booked[0] + 10 * US
    assert len(repairs(logging.WARNING)) == 1


# -- a meta that reads well and holds what no limiter writes --------------------------------

# Each damage written into a key that holds 5 units (5 calls), with its value: a fresh
# meta's fields on Redis, its tc_meta columns on SQLite.
DAMAGES: dict[str, dict[str, float | None]] = {
    # "My log is empty, every unit trimmed" (Redis: first = -1; SQLite: no last slot).
    "an empty log": {"first": None, "last": None, "base": 5},
    "an empty log, its base kept": {"first": None, "last": None},
    "a total lowered": {"total": 2},
    "a total of zero": {"total": 0},
    "a negative total": {"total": -10},
    "a fractional total": {"total": 4.5},
    "a total past 2^48": {"total": 2**50},
    "a base above its total": {"base": 7},
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_meta_never_admits_more(
    store: Store, repairs: Callable[[int], list[str]], damage: str
) -> None:
    """A full 5-per-10 s key whose meta then says it holds less: no call goes before the
    window frees (each of these let 5 or 10 of 10 through, or failed every call), and
    usage() says what the log holds. The meta is rebuilt from the log, with one warning."""
    run = Run(store.backend, rates=[Rate(5, 10)], gap=0)
    for _ in range(5):
        run.acquire()
        run.clock.advance(0.5)
    fields = dict(DAMAGES[damage])
    if store.kind != "sqlite":
        fields.pop("last", None)  # (Redis: an empty log is said by `first` alone)
    store.rewrite_meta(run.key, **fields)
    run.exact = False
    admitted = 0
    for _ in range(10):
        run.clock.advance(0.1)
        admitted += run.limiter.try_acquire(TOKEN).allowed
    assert admitted == 0
    [rate] = run.limiter.usage(TOKEN).rates
    assert (rate.used, rate.booked, rate.remaining) == (5, 0, 0)
    run.acquire_many(10)  # each slot no earlier than the reference's
    run.windows_hold()
    [warning] = repairs(logging.WARNING)
    assert run.key in warning and "rebuilt from the log" in warning and TOKEN not in warning


def test_entries_gone_from_the_log_count_at_its_newest_slot(
    store: Store, repairs: Callable[[int], list[str]]
) -> None:
    """The log's two newest entries deleted, its meta kept: the units the log lacks are
    put at the newest slot the meta knows (as for a lost log), never left uncounted."""
    run = Run(store.backend, rates=[Rate(5, 10)], gap=0)
    for _ in range(5):
        run.acquire()
        run.clock.advance(1)
    store.drop_newest(run.key, 2)
    run.exact = False
    assert not run.limiter.try_acquire(TOKEN)
    [rate] = run.limiter.usage(TOKEN).rates
    assert (rate.used, rate.booked) == (5, 0)
    run.acquire_many(10)
    run.windows_hold()
    [warning] = repairs(logging.WARNING)
    assert run.key in warning and "log was lost" in warning


@pytest.mark.parametrize("field", ["pause", "until"])
def test_a_time_no_limiter_sets_is_refused_until_the_key_is_reset(
    store: Store, repairs: Callable[[int], list[str]], field: str
) -> None:
    """A pause (or a learned limit) 146,000 years ahead: waiting it out is no repair, and
    dropping it is no more right than keeping it. Every call on the key fails, naming
    the store key (never the token) and what to do, even for a limiter that fails open;
    the other keys go on, and a reset frees it."""
    run = Run(store.backend, rates=[Rate(5, 10)], gap=0)
    run.acquire_many(2)
    store.rewrite_meta(run.key, **{field: 2**62})
    lenient = Limiter(
        store.backend, rates=[Rate(5, 10)], margin=0, clock=run.clock, on_unavailable="allow"
    )
    for call in (
        lambda: run.limiter.try_acquire(TOKEN),
        lambda: run.limiter.acquire(TOKEN, timeout=1),
        lambda: run.limiter.usage(TOKEN),
        lambda: lenient.try_acquire(TOKEN),
    ):
        with pytest.raises(
            BackendError, match=r"is damaged: its .+ 146\d{3} years ahead"
        ) as caught:
            call()
        message = str(caught.value)
        assert not isinstance(caught.value, BackendUnavailable)
        assert run.key in message and "reset() the key" in message and TOKEN not in message
    assert run.limiter.try_acquire(TOKEN + "-other").allowed
    run.limiter.reset(TOKEN)
    assert run.limiter.try_acquire(TOKEN).allowed
    assert repairs(logging.WARNING) == []


def test_usage_never_reports_units_no_key_can_have_used() -> None:
    """Whatever damage gets past a store's checks: usage() refuses numbers out of range
    (a negative count, or one past 2^48) rather than report them."""

    class Damaged(MemoryBackend):
        def execute(self, op: Any) -> Any:
            answer = super().execute(op)
            if isinstance(answer, Snapshot):
                answer = dataclasses.replace(answer, used=(-90,), booked=2**48)
            return answer

    limiter = Limiter(Damaged(), rates=[Rate(5, 10)])
    assert limiter.try_acquire(TOKEN).allowed
    with pytest.raises(BackendError, match=r"is damaged: it reads as \(281474976710656, -90\)"):
        limiter.usage(TOKEN)
