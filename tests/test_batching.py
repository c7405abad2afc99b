"""Batched decisions: the operations that queue while a backend's
connections are busy go together, many in one script call, and answer exactly as
they would have one by one.

The script's batch is compared with the same operations run one at a time (Hypothesis,
on Redis 7 by FCALL and on the suite's 6.2 by EVALSHA); then the backends: coalescing
with at most 4 connections, the order of a key's calls, one bad operation failing
alone, and a Cluster batching per hash slot only.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.cluster
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from throttle_client import (
    AsyncLimiter,
    AsyncRedisBackend,
    BackendError,
    Limiter,
    RedisBackend,
)
from throttle_client._backends import redis as R
from throttle_client._backends import redis_answers, redis_codec, redis_script
from throttle_client._backends.base import (
    Acquire,
    Buckets,
    Inspect,
    Learn,
    Op,
    Pause,
    Quota,
    Reset,
)
from throttle_client._backends.batching import Batcher, Wait
from throttle_client._flow import arun
from throttle_client.testing import RedisServer

from .conftest import started
from .test_redis_backend import BINARIES

T0 = 1_800_000_000_000_000  # µs
S = 1_000_000

QUOTAS = [
    Quota(limits=((3, S),), min_interval_us=100_000),
    Quota(limits=((4, S), (6, 10 * S)), min_interval_us=0),
    Quota(limits=((5, 2 * S), (8, Buckets(10 * S, 2 * S))), min_interval_us=50_000),
]


def run_ops(client: redis.Redis, ops: list[Op[Any]]) -> list[Any]:
    """One script call for ``ops`` (EVALSHA: the same text as the function), each one's
    answer or the error it raises."""
    keys, args = redis_codec.encode_batch(ops)
    client.script_load(redis_script.SCRIPT)
    try:
        reply = client.evalsha(redis_script.SHA, len(keys), *keys, *args)
    except redis.exceptions.ResponseError as exc:  # (one operation alone: raised)
        assert len(ops) == 1
        return [R.translate(exc)]
    return redis_answers.decode_batch(ops, reply, R.RepairNotice())


# The meta with its expiry (field 7) zeroed: a batch writes a key's meta once, with the
# latest TTL any of its operations asked for, where one by one the first may have set it.
WITHOUT_EXPIRY = """
local function zeroed(...)
  local fields = {...}
  fields[7] = 0
  return cmsgpack.pack(unpack(fields, 1, select('#', ...)))
end
return zeroed(cmsgpack.unpack(ARGV[1]))
"""


def state(client: redis.Redis, key: str) -> tuple[Any, ...]:
    """What the store holds for ``key``: its log, and its meta but for its expiry."""
    log, meta = R.redis_keys(key)
    entries = client.zrange(log, 0, -1, withscores=True)
    packed = client.get(meta)
    return tuple(entries), packed and client.eval(WITHOUT_EXPIRY, 0, packed)


def comparable(outcome: Any) -> Any:
    if isinstance(outcome, BaseException):  # the same class, and the script's own words
        return type(outcome), str(outcome).split("throttle_client: ")[-1]
    return outcome


@pytest.fixture(scope="module", params=sorted(BINARIES))
def client(request: pytest.FixtureRequest) -> Iterator[redis.Redis]:
    """Each redis-server at hand (6.2: EVALSHA, 7: the same script as run by FCALL)."""
    server = started(RedisServer(binary=BINARIES[request.param]))
    conn = redis.Redis.from_url(server.url)
    yield conn
    conn.close()
    server.close()


# -- the script: a batch answers as its operations one by one ------------------------------

KEYS = ["a", "b"]


@st.composite
def operations(draw: st.DrawFn) -> list[Op[Any]]:
    """Operations on two keys, at times that never go back, some retried (an id again)."""
    ops: list[Op[Any]] = []
    now = T0
    for _ in range(draw(st.integers(1, 40))):
        now += draw(st.sampled_from([0, 0, 1, 30_000, 400_000, 3 * S]))
        key = draw(st.sampled_from(KEYS))
        quota = QUOTAS[draw(st.integers(0, len(QUOTAS) - 1))]
        kind = draw(st.sampled_from(["acquire"] * 6 + ["inspect", "pause", "learn", "reset"]))
        if kind == "acquire":
            cost = draw(st.integers(1, 4))  # 4: above the first quota's limit, an error
            wait = draw(st.sampled_from([0, -1, S // 2]))
            call_id = f"id{draw(st.integers(0, 12))}"
            ops.append(Acquire(key, quota, cost, wait, call_id, now_us=now))
        elif kind == "inspect":
            ops.append(Inspect(key, quota, now_us=now))
        elif kind == "pause":
            ops.append(Pause(key, quota, draw(st.sampled_from([0, S // 4, 2 * S])), now_us=now))
        elif kind == "learn":
            ops.append(Learn(key, quota, now - S, now + 2 * S, draw(st.integers(0, 4)), now_us=now))
        else:
            ops.append(Reset(key, now_us=now))
    return ops


def renamed(op: Op[Any], prefix: str) -> Op[Any]:
    import dataclasses

    return dataclasses.replace(op, key=prefix + op.key)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=operations())
def test_a_batch_answers_as_its_operations_one_by_one(
    client: redis.Redis, ops: list[Op[Any]]
) -> None:
    client.flushall()
    alone = [comparable(run_ops(client, [renamed(op, "one-")])[0]) for op in ops]
    together = [
        comparable(outcome) for outcome in run_ops(client, [renamed(op, "bat-") for op in ops])
    ]
    assert together == alone
    for key in KEYS:
        assert state(client, "bat-" + key) == state(client, "one-" + key)


# -- the backends: coalescing, order, errors -----------------------------------------------


def script_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("fcall", "evalsha"))


def connections(client: redis.Redis) -> int:
    """Client connections but ``client``'s own."""
    return len(client.client_list()) - 1


class Peak:
    """The most connections seen while a block ran, sampled every few ms."""

    def __init__(self, client: redis.Redis) -> None:
        self.client, self.most = client, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample)

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.most = max(self.most, connections(self.client))

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def test_64_tasks_share_script_calls_over_at_most_4_connections(redis_url: str) -> None:
    admin = redis.Redis.from_url(redis_url)
    backend = AsyncRedisBackend(redis_url)
    limiter = AsyncLimiter(backend, rates=["1000000/hour"], margin=0)
    keys = ["one"] * 64 + [f"key-{i}" for i in range(64)]
    admin.config_resetstat()
    with Peak(admin) as peak:
        for _ in range(5):
            decisions = await asyncio.gather(*(limiter.acquire(key) for key in keys))
            assert all(d.allowed for d in decisions)
    calls = script_calls(admin)
    assert calls <= 5 * len(keys) / 4, calls  # many decisions per call (~64 here)
    assert 1 <= peak.most <= 4, peak.most
    assert (await limiter.usage("one")).rates[0].used == 320
    await backend.aclose()
    admin.close()


def test_64_threads_share_script_calls_over_at_most_4_connections(redis_url: str) -> None:
    admin = redis.Redis.from_url(redis_url)
    backend = RedisBackend(redis_url)
    limiter = Limiter(backend, rates=["1000000/hour"], margin=0)
    start = threading.Barrier(64)
    errors: list[BaseException] = []

    def work(key: str) -> None:
        start.wait()
        try:
            for _ in range(20):
                assert limiter.acquire(key).allowed
        except BaseException as exc:
            errors.append(exc)

    admin.config_resetstat()
    threads = [threading.Thread(target=work, args=(f"k{i % 2}",)) for i in range(64)]
    with Peak(admin) as peak:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert errors == []
    assert script_calls(admin) < 64 * 20, script_calls(admin)
    assert 1 <= peak.most <= 4, peak.most
    assert [limiter.usage(k).rates[0].used for k in ("k0", "k1")] == [640, 640]
    backend.close()
    admin.close()


async def test_a_keys_calls_keep_their_order_in_a_batch(redis_url: str) -> None:
    """Tasks queued in order get slots in that order: the gap between calls spaces them
    out one by one, whichever call carried them."""
    clock = 1_700_000_000.0
    backend = AsyncRedisBackend(redis_url)
    limiter = AsyncLimiter(
        backend,
        rates=["1000/second"],
        min_interval=0.01,
        margin=0,
        clock=lambda: clock,
        sleep=lambda seconds: asyncio.sleep(0),
    )
    # One place: calls in flight at once on two connections reach the server in either
    # order, as any concurrent calls do; this is about the order within and across calls.
    backend._batcher.size = 1
    decisions = await asyncio.gather(*(limiter.acquire("token") for _ in range(100)))
    slots = [round((d.slot - clock) * 1000) for d in decisions]
    assert slots == [10 * i for i in range(100)]  # in the order the tasks asked
    await backend.aclose()


async def test_one_bad_operation_fails_alone(redis_url: str) -> None:
    """A key of the wrong type is an error for its own calls, not for the calls that shared
    a script call with them."""
    admin = redis.Redis.from_url(redis_url)
    backend = AsyncRedisBackend(redis_url)
    limiter = AsyncLimiter(backend, rates=["1000/second"], margin=0)
    admin.set(R.redis_keys(limiter.store_key("broken"))[0], "not a sorted set")
    admin.set(R.redis_keys(limiter.store_key("broken"))[1], "not a meta either")
    keys = ["good", "broken"] * 32
    admin.config_resetstat()
    outcomes = await asyncio.gather(*(limiter.acquire(key) for key in keys), return_exceptions=True)
    assert script_calls(admin) < len(keys)  # they did share calls
    for key, outcome in zip(keys, outcomes, strict=True):
        if key == "good":
            assert not isinstance(outcome, BaseException) and outcome.allowed
        else:
            assert isinstance(outcome, BackendError) and "WRONGTYPE" in str(outcome)
    assert (await limiter.usage("good")).rates[0].used == 32
    await backend.aclose()
    admin.close()


@pytest.mark.cluster
async def test_a_cluster_batches_the_calls_of_one_hash_slot_only(cluster_url: str) -> None:
    backend = AsyncRedisBackend(cluster_url, cluster=True)
    limiter = AsyncLimiter(backend, rates=["1000/hour"], margin=0)
    keys = [f"token-{i}" for i in range(48)] * 3  # keys all over the cluster's slots
    decisions = await asyncio.gather(*(limiter.acquire(key) for key in keys))
    assert all(d.allowed for d in decisions)
    for key in keys[:48]:
        assert (await limiter.usage(key)).rates[0].used == 3
    await backend.aclose()


def test_a_sync_cluster_batches_too(cluster_url: str) -> None:
    backend = RedisBackend(cluster_url, cluster=True)
    limiter = Limiter(backend, rates=["1000/hour"], margin=0)
    keys = [f"token-{i}" for i in range(32)]
    threads = [
        threading.Thread(target=lambda k=key: [limiter.acquire(k) for _ in range(4)])
        for key in keys * 2
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {limiter.usage(key).rates[0].used for key in keys} == {8}
    backend.close()


# -- the queue itself, with a send of the test's own ------------------------------------


class Held:
    """A Batcher (of one place, by default) whose calls return when the test says so."""

    def __init__(self, size: int = 1, opens: bool = False) -> None:
        self.calls: list[list[str]] = []
        self.release: list[asyncio.Future[None]] = []
        self.batcher = Batcher(
            size,
            self._send,
            lambda: asyncio.get_running_loop().create_future(),
            R._resolve,
            gone=asyncio.Future.cancelled,
            opens=opens,
        )

    def _send(self, ops: list[Any], queued: list[float]) -> Iterator[Any]:
        self.calls.append([op.key for op in ops])
        yield "call"
        return [op.key for op in ops]

    async def _perform(self, step: Any) -> Any:
        if isinstance(step, Wait):
            return await step.waker
        gate = asyncio.get_running_loop().create_future()
        self.release.append(gate)
        await gate

    async def ask(self, name: str) -> Any:
        return await arun(self.batcher.flow(Reset(name)), self._perform)

    async def queued_behind_p(self) -> tuple[asyncio.Task[Any], dict[str, asyncio.Task[Any]]]:
        """P's call in flight, L, E and F queued behind it, then P's answer let through."""
        p = asyncio.create_task(self.ask("P"))
        await asyncio.sleep(0)
        tasks = {name: asyncio.create_task(self.ask(name)) for name in "LEF"}
        await asyncio.sleep(0)
        self.release[0].set_result(None)
        return p, tasks


async def test_cancelled_waiters_never_hold_the_queue_up() -> None:
    """P in flight, L, E, F queued; P's answer comes, then E and L are cancelled before
    they run: F still goes, nothing of E's goes, and the place is free again."""
    held = Held()
    p, tasks = await held.queued_behind_p()
    await asyncio.sleep(0)
    tasks["E"].cancel()
    tasks["L"].cancel()
    assert await p == "P"
    for _ in range(5):
        await asyncio.sleep(0)
    held.release[-1].set_result(None)
    assert await asyncio.wait_for(tasks["F"], 1) == "F"
    assert held.calls == [["P"], ["F"]]
    assert held.batcher.busy == 0 and not held.batcher.queue


async def test_a_leader_cancelled_in_flight_hands_the_others_on() -> None:
    """The call carrying L, E, F is cancelled with L: E and F go with the next call
    (the same operations, so a retried acquire keeps its call id), not failed."""
    held = Held()
    p, tasks = await held.queued_behind_p()
    assert await p == "P"
    for _ in range(5):
        await asyncio.sleep(0)
    assert held.calls[-1] == ["L", "E", "F"]
    tasks["L"].cancel()
    for _ in range(5):
        await asyncio.sleep(0)
    held.release[-1].set_result(None)
    assert [await tasks[name] for name in "EF"] == ["E", "F"]
    assert held.calls[-1] == ["E", "F"]
    assert held.batcher.busy == 0 and not held.batcher.queue


async def test_a_place_opening_its_connection_carries_nothing_ahead_of_the_queue() -> None:
    """Two places, one connection open. P goes over it; A finds the other place, whose
    connection must be opened first (a call of no operation), so A queues, and B and C
    behind it. P's answer comes while A's place is still opening: P's flow carries A, B
    and C itself (A's flow is busy), in their order; the opened place finds none left."""
    held = Held(size=2, opens=True)
    held.batcher.warm = 1
    p = asyncio.create_task(held.ask("P"))
    await asyncio.sleep(0)
    tasks = {name: asyncio.create_task(held.ask(name)) for name in "ABC"}
    await asyncio.sleep(0)
    assert held.calls == [["P"], []] and [e.op.key for e in held.batcher.queue] == list("ABC")
    held.release[0].set_result(None)  # P's answer
    for _ in range(5):
        await asyncio.sleep(0)
    assert held.calls[-1] == ["A", "B", "C"] and not p.done()  # P carries them
    held.release[1].set_result(None)  # A's place is open: nothing queued for it
    for _ in range(5):
        await asyncio.sleep(0)
    assert held.batcher.warm == 2 and held.batcher.busy == 1
    held.release[2].set_result(None)
    assert [await tasks[name] for name in "ABC"] == list("ABC") and await p == "P"
    assert held.calls == [["P"], [], ["A", "B", "C"]]
    assert held.batcher.busy == 0 and not held.batcher.queue


async def test_a_place_given_back_never_goes_to_a_head_busy_opening() -> None:
    """P in flight, A opening the second place, B and C queued behind A. P is cancelled:
    its place is not handed to A (whose flow could not lead before its open ends) nor to
    anyone after A; D, coming then, queues (and opens a place) too. When A's place is
    open it carries A, B, C and D, in their order."""
    held = Held(size=2, opens=True)
    held.batcher.warm = 1
    p = asyncio.create_task(held.ask("P"))
    await asyncio.sleep(0)
    tasks = {"A": asyncio.create_task(held.ask("A"))}
    await asyncio.sleep(0)
    tasks.update({name: asyncio.create_task(held.ask(name)) for name in "BC"})
    await asyncio.sleep(0)
    p.cancel()
    for _ in range(5):
        await asyncio.sleep(0)
    tasks["D"] = asyncio.create_task(held.ask("D"))
    for _ in range(5):
        await asyncio.sleep(0)
    assert [e.op.key for e in held.batcher.queue] == list("ABCD")
    held.release[1].set_result(None)  # A's place is open
    for _ in range(5):
        await asyncio.sleep(0)
    assert held.calls == [["P"], [], [], ["A", "B", "C", "D"]]
    for gate in held.release[2:]:
        gate.set_result(None)
    assert [await tasks[name] for name in "ABCD"] == list("ABCD")
    assert held.batcher.busy == 0 and not held.batcher.queue
