"""When the store fails, with real redis-server processes: kill -9, SIGSTOP, SCRIPT FLUSH, failover.

Every server here belongs to the test that started it, so it can be killed freely.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import itertools
import logging
import math
import multiprocessing
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio
import redis.cluster

from tests.conftest import started
from tests.workers import failover_worker
from throttle_client import (
    AsyncLimiter,
    AsyncRedisBackend,
    BackendError,
    BackendUnavailable,
    Limiter,
    LocalFallback,
    MemoryBackend,
    RedisBackend,
)
from throttle_client._backends.redis import redis_keys
from throttle_client.testing import (
    FakeClock,
    RedisClusterServers,
    RedisServer,
)

HARD_CAP = 15.0  # an unbounded wait or call fails the test instead of hanging it


def seconds_until_the_store_answers(limiter: Limiter, key: str) -> float:
    """Seconds until a read (usage) is answered by the store again, or inf after HARD_CAP.
    It judges nothing: the caller's assertion on the time it returns is the test."""
    start = time.monotonic()
    while True:
        try:
            limiter.usage(key)
            return time.monotonic() - start
        except BackendUnavailable:
            if time.monotonic() - start > HARD_CAP:
                return math.inf
            time.sleep(0.05)


@pytest.fixture
def own_backend(own_redis: RedisServer) -> Iterator[RedisBackend]:
    """A backend on the test's own server, closed after it (no socket left to the GC)."""
    with RedisBackend(own_redis.url) as backend:
        yield backend


def test_raise_policy_then_recovery_without_restart(
    own_redis: RedisServer, own_backend: RedisBackend
) -> None:
    limiter = Limiter(own_backend, rates=["100/second"])
    assert limiter.try_acquire("token").allowed
    own_redis.kill()
    with pytest.raises(BackendUnavailable) as info:
        limiter.try_acquire("token")
    assert isinstance(info.value.__cause__, redis.ConnectionError)
    # While resting, the store is not waited on again: the policy answers at once.
    with pytest.raises(BackendUnavailable):
        limiter.try_acquire("token")
    own_redis.start()  # same port, empty dataset
    # docs/operations/redis-failures.md: calls succeed again within 2 s of a restart.
    waited = seconds_until_the_store_answers(limiter, "token")
    assert waited <= 2.0, waited
    assert limiter.try_acquire("another token").allowed
    # The key this worker used lost its calls with the dataset: it is held for its
    # window, no longer (tests/test_lost_store.py).
    held = limiter.try_acquire("token")
    assert not held.allowed and 0 < held.retry_after <= 1.025
    assert limiter.usage("token").rates[0].used == 0


def test_allow_policy_fails_open_and_says_so_once(own_redis, own_backend, caplog) -> None:
    limiter = Limiter(own_backend, rates=["1/hour"], on_unavailable="allow", retry_for=0.1)
    assert limiter.try_acquire("token").allowed
    assert not limiter.try_acquire("token").allowed  # the store still rules while it answers
    own_redis.kill()
    with caplog.at_level(logging.WARNING, logger="throttle_client"):
        decisions = [limiter.try_acquire("token") for _ in range(5)]
    assert all(d.allowed for d in decisions)
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 1
    assert "token" not in caplog.text  # the raw key never reaches the logs
    with pytest.raises(BackendUnavailable):  # a read has no answer under "allow"
        limiter.usage("token")


def test_wrongtype_is_an_error_even_when_failing_open(
    own_redis: RedisServer, own_backend: RedisBackend
) -> None:
    limiter = Limiter(own_backend, rates=["5/second"], on_unavailable="allow")
    client = redis.Redis.from_url(own_redis.url)
    client.set(redis_keys(limiter.store_key("token"))[0], "not a sorted set")
    with pytest.raises(BackendError) as info:
        limiter.try_acquire("token")
    assert not isinstance(info.value, BackendUnavailable)
    assert "WRONGTYPE" in str(info.value)
    client.close()


def test_local_fallback_keeps_the_fleet_within_the_quota(own_redis: RedisServer) -> None:
    """N workers, each with its own fallback share: together never above the limit."""
    workers, limit = 4, 12
    clock = FakeClock()
    closing = contextlib.ExitStack()
    fleet = [
        Limiter(
            closing.enter_context(RedisBackend(own_redis.url)),
            rates=[f"{limit}/second"],
            min_interval=0.01,
            on_unavailable=LocalFallback(expected_workers=workers),
            retry_for=0.05,
            clock=clock,
        )
        for _ in range(workers)
    ]
    own_redis.kill()
    admitted: list[list[float]] = [[] for _ in fleet]
    for _ in range(300):  # 3 s of fake time, every worker asking every 10 ms
        for index, limiter in enumerate(fleet):
            decision = limiter.try_acquire("token")
            if decision.allowed:
                admitted[index].append(clock.now)
        clock.advance(0.01)
    closing.close()
    everyone = sorted(t for times in admitted for t in times)
    assert len(everyone) >= workers * (limit // workers) * 2  # the fallback does admit
    for t in everyone:
        in_window = [u for u in everyone if t - 1.0 < u <= t + 1e-6]
        assert len(in_window) <= limit
    for times in admitted:  # each worker within its share, spaced N times the gap
        for t in times:
            assert len([u for u in times if t - 1.0 < u <= t + 1e-6]) <= limit // workers
        assert all(b - a >= 0.04 - 1e-6 for a, b in itertools.pairwise(times))


@pytest.mark.slow
def test_kill_9_under_load_then_every_worker_recovers(own_redis: RedisServer) -> None:
    """Several processes work through a kill -9 and a restart on the same port."""
    context = multiprocessing.get_context("spawn")
    events = context.Queue()
    start = time.time() + 2.0  # workers start together, after their imports
    procs = [
        context.Process(target=failover_worker, args=(own_redis.url, start, 7.0, events))
        for _ in range(4)
    ]
    for proc in procs:
        proc.start()
    try:
        time.sleep(max(0.0, start + 1.5 - time.time()))
        own_redis.kill()
        killed = time.time()
        time.sleep(1.5)
        own_redis.start()
        back = time.time()
        results = [events.get(timeout=30) for _ in procs]
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    for outcomes in results:
        assert "error" not in outcomes, outcomes.get("error")
        ok = outcomes["ok"]
        unavailable = outcomes["unavailable"]
        assert any(t < killed for t in ok)  # it worked before
        assert any(killed <= t < back for t in unavailable)  # the policy applied during
        first_after = min(t for t in ok if t >= back)  # and it works again after
        assert first_after - back < 2.0, first_after - back


def test_sigstop_longer_than_the_timeout_is_bounded(
    own_redis: RedisServer, own_backend: RedisBackend
) -> None:
    """A hung store: no call outlives its timeout by more than the client timeout."""
    limiter = Limiter(own_backend, rates=["100/second"])  # 1 s socket timeout
    assert limiter.try_acquire("token").allowed
    own_redis.pause()
    try:
        started = time.monotonic()
        with pytest.raises(BackendUnavailable):
            limiter.acquire("token", timeout=0.5)
        elapsed = time.monotonic() - started
        assert elapsed < 0.5 + 1.0 + 0.3, elapsed
    finally:
        own_redis.resume()
    waited = seconds_until_the_store_answers(limiter, "token")
    assert waited < 3.0, waited
    assert limiter.acquire("token", timeout=1).allowed


def test_script_flush_every_100ms_is_invisible(own_redis: RedisServer) -> None:
    admin = redis.Redis.from_url(own_redis.url)
    stop = threading.Event()
    errors: list[BaseException] = []
    admitted = [0]
    lock = threading.Lock()

    def flusher() -> None:
        while not stop.is_set():
            admin.script_flush()
            time.sleep(0.1)

    def worker() -> None:
        # margin=0: a reload after a flush can make an answer late, and a late try_acquire
        # is refused with its slot left booked; this test counts bookings, not arrivals.
        with RedisBackend(own_redis.url) as backend:
            limiter = Limiter(backend, rates=["100000/hour"], margin=0)
            try:
                while not stop.is_set():
                    decision = limiter.try_acquire("token")
                    with lock:
                        admitted[0] += decision.allowed
            except BaseException as exc:  # every error counts against the test
                errors.append(exc)

    threads = [threading.Thread(target=flusher)]
    threads += [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(2.0)
    stop.set()
    for thread in threads:
        thread.join()
    assert errors == []
    limiter = Limiter(MemoryBackend(), rates=["100000/hour"])  # (its key's name only)
    booked = admin.zcount(redis_keys(limiter.store_key("token"))[0], 0, "+inf")  # slot entries
    assert admitted[0] > 100 and booked == admitted[0]  # nothing counted twice, none lost
    admin.close()


@pytest.mark.cluster
@pytest.mark.slow
def test_cluster_primary_killed_calls_succeed_after_failover() -> None:
    cluster = started(RedisClusterServers(masters=3, replicas=1, node_timeout_ms=1000))
    backend = RedisBackend(cluster.url, cluster=True)
    try:
        limiter = Limiter(backend, rates=["1000/second"])
        assert limiter.try_acquire("token").allowed
        client = redis.cluster.RedisCluster.from_url(cluster.url)
        primary = client.get_node_from_key(redis_keys(limiter.store_key("token"))[0])
        client.close()
        # Replication is asynchronous: the call is on the replica before its primary dies.
        with redis.Redis(host=primary.host, port=primary.port) as direct:
            assert direct.wait(1, 5000) == 1
        victim = next(node for node in cluster.nodes if node.port == primary.port)
        victim.kill()
        killed = time.monotonic()
        recovered, errors = None, set()
        while time.monotonic() - killed < 20:
            try:
                if limiter.try_acquire("token").allowed:
                    recovered = time.monotonic() - killed
                    break
            except BackendUnavailable as exc:
                errors.add(f"{exc} (from {exc.__cause__!r})")
                time.sleep(0.1)
        assert recovered is not None, f"no call succeeded within 20 s of the failover: {errors}"
        assert recovered < 1.0 + 8.0  # node timeout + a few seconds for the election
        assert limiter.usage("token").rates[0].used >= 1  # the new primary holds the log
    finally:
        backend.close()
        cluster.close()
        # redis-py's RedisCluster can keep a socket to a node it reached during the
        # failover past its close(): collect it here, quietly, rather than let the
        # warning land on whichever test (or the session's end) collects it later.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()


def test_each_refusal_is_a_fresh_exception_chained_to_the_driver_error(
    own_redis: RedisServer, own_backend: RedisBackend
) -> None:
    """During the cool-down, 1,000 calls (from several threads) raise 1,000 exceptions
    with short tracebacks, never one object whose traceback grows with every raise."""
    limiter = Limiter(own_backend, rates=["100/second"], retry_for=0)
    own_redis.kill()
    raised: list[BackendUnavailable] = []

    def call(times: int) -> None:
        for _ in range(times):
            try:
                limiter.try_acquire("token")
            except BackendUnavailable as exc:
                raised.append(exc)

    threads = [threading.Thread(target=call, args=(250,)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(raised) == 1000
    assert len({id(exc) for exc in raised}) == 1000
    depth = max(len(traceback.extract_tb(exc.__traceback__)) for exc in raised)
    assert depth < 10, depth
    assert all(isinstance(exc.__cause__, redis.ConnectionError) for exc in raised)


@pytest.mark.parametrize("policy", ["raise", "allow", "local"])
def test_a_limiter_that_met_an_outage_is_freed_at_once(own_redis: RedisServer, policy: str) -> None:
    """The guard keeps the last error without the frames it passed through (the
    limiter's among them): a limiter dropped after an outage is freed at once, its
    connections with it, not whenever the collector runs."""
    on_unavailable: Any = LocalFallback(expected_workers=2) if policy == "local" else policy
    own_redis.kill()
    gc.collect()
    gc.disable()
    try:
        backend = RedisBackend(own_redis.url)
        limiter = Limiter(backend, rates=["5/second"], on_unavailable=on_unavailable, retry_for=0)
        for _ in range(2):
            with contextlib.suppress(BackendUnavailable):
                limiter.try_acquire("token")
        assert limiter._guard.last_error.__cause__ is not None  # the driver's error, kept
        gone = weakref.ref(limiter)
        del limiter
        assert gone() is None
        backend.close()
    finally:
        gc.enable()


# -- a client the user built with redis-py's defaults ------------------------------------

# docs/operations/redis-failures.md: a call during an outage ends within min(timeout, retry_for)
# plus one socket timeout (1 s); calls succeed again within 2 s of a restart or SIGCONT.
SOCKET_TIMEOUT = 1.0
SLACK = 0.5  # a loaded 2-core machine


class UserClientLimiter:
    """A limiter over a client built as users build it (no timeouts, redis-py's default
    retries), sync or asyncio; every call runs with a hard cap."""

    def __init__(self, port: int, asynchronous: bool) -> None:
        self.asynchronous = asynchronous
        if asynchronous:
            self.loop = asyncio.new_event_loop()
            self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
            self.thread.start()
            self.client: Any = redis.asyncio.Redis(host="127.0.0.1", port=port)
            self.limiter: Any = AsyncLimiter(AsyncRedisBackend(self.client), rates=["1000/second"])
        else:
            self.client = redis.Redis(host="127.0.0.1", port=port)
            self.limiter = Limiter(RedisBackend(self.client), rates=["1000/second"])
            self.pool = concurrent.futures.ThreadPoolExecutor(1)

    def acquire(self, timeout: float) -> float:
        """Seconds the call took; raises what it raised."""
        started = time.monotonic()
        if self.asynchronous:
            coro = self.limiter.acquire("token", timeout=timeout)
            asyncio.run_coroutine_threadsafe(coro, self.loop).result(HARD_CAP)
        else:
            self.pool.submit(self.limiter.acquire, "token", timeout=timeout).result(HARD_CAP)
        return time.monotonic() - started

    def seconds_until_it_answers(self) -> float:
        started = time.monotonic()
        while time.monotonic() - started < HARD_CAP:
            with contextlib.suppress(BackendUnavailable):
                # (A key that lost its calls in a restart is held for its window, 1 s.)
                self.acquire(timeout=2)
                return time.monotonic() - started
            time.sleep(0.05)
        raise AssertionError(f"the store did not answer within {HARD_CAP}s")

    def close(self) -> None:
        if self.asynchronous:
            asyncio.run_coroutine_threadsafe(self.limiter.backend.aclose(), self.loop).result(5)
            asyncio.run_coroutine_threadsafe(self.client.aclose(), self.loop).result(5)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
            self.loop.close()
        else:
            self.limiter.backend.close()
            self.client.close()
            self.pool.shutdown()


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def user_built(request: pytest.FixtureRequest, own_redis: RedisServer) -> Iterator[Any]:
    limiter = UserClientLimiter(own_redis.port, asynchronous=request.param)
    yield limiter
    limiter.close()


def test_user_built_client_killed_and_restarted(own_redis: RedisServer, user_built) -> None:
    user_built.acquire(timeout=2)
    own_redis.kill()
    started = time.monotonic()
    with pytest.raises(BackendUnavailable):
        user_built.acquire(timeout=2)
    elapsed = time.monotonic() - started
    assert elapsed < min(2, 1.0) + SOCKET_TIMEOUT + SLACK, elapsed  # retry_for is 1 s
    own_redis.start()  # same port, empty dataset
    assert user_built.seconds_until_it_answers() < 2.0


def test_user_built_client_stopped_and_continued(own_redis: RedisServer, user_built) -> None:
    user_built.acquire(timeout=2)
    own_redis.pause()
    try:
        started = time.monotonic()
        with pytest.raises(BackendUnavailable):
            user_built.acquire(timeout=2)
        elapsed = time.monotonic() - started
    finally:
        own_redis.resume()
    assert elapsed < min(2, 1.0) + SOCKET_TIMEOUT + SLACK, elapsed
    assert user_built.seconds_until_it_answers() < 2.0
