"""Real stores for the suite: private redis-server processes on free loopback ports.

Nothing here mocks Redis. When no redis-server can be started the tests that need
one fail with a message saying how to get one; they never skip.
"""

from __future__ import annotations

import asyncio
import fcntl
import gc
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
from hypothesis import configuration as hypothesis_configuration

from throttle_client import (
    AsyncLimiter,
    AsyncRedisBackend,
    Backend,
    Limiter,
    MemoryBackend,
    RedisBackend,
    SQLiteBackend,
)
from throttle_client.testing import (
    FakeClock,
    RedisClusterServers,
    RedisServer,
    RedisUnavailableError,
)

S = TypeVar("S", RedisServer, RedisClusterServers)


def pytest_configure(config: pytest.Config) -> None:
    """Hypothesis keeps its files in ``.hypothesis/`` under the working directory unless
    told otherwise: keep them in pytest's cache (a temporary directory without one), so
    a test run leaves the checkout clean. HYPOTHESIS_STORAGE_DIRECTORY still wins."""
    if os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        return
    cache = getattr(config, "cache", None)  # None under -p no:cacheprovider
    home = cache.mkdir("hypothesis") if cache is not None else None
    if home is None:
        user = os.getuid() if hasattr(os, "getuid") else "user"
        home = Path(tempfile.gettempdir()) / f"throttle_client-hypothesis-{user}"
    hypothesis_configuration.set_hypothesis_home_dir(home)


def started(servers: S) -> S:
    """``servers`` started, or the test fails (never skips) saying how to get Redis."""
    try:
        return servers.start()
    except RedisUnavailableError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(autouse=True)
def slow_tests_take_turns(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """A test of the second tier (``-m slow``: fleets of processes, a thousand tasks,
    examples against strict upstreams, judged by arrival time) holds a lock while it
    runs: the pytest workers take turns at them, so that none is judged on the load of
    another beside it on the machine's cores. (A lock file in the run's directory, which
    every worker of the run shares; the first tier's tests take no lock.)"""
    if request.node.get_closest_marker("slow") is None:
        yield
        return
    lock = tmp_path_factory.getbasetemp().parent / "slow-tests-take-turns.lock"
    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = started(RedisServer())
    yield server
    server.close()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServers]:
    cluster = started(RedisClusterServers(masters=3))
    yield cluster
    cluster.close()


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server of this test's own, to kill, pause and restart at will."""
    server = started(RedisServer())
    yield server
    server.close()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """The session's standalone server, flushed for this test."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    yield redis_server.url


@pytest.fixture
def cluster_url(redis_cluster: RedisClusterServers) -> Iterator[str]:
    """The session's cluster, every primary flushed for this test."""
    client = redis.cluster.RedisCluster.from_url(redis_cluster.url)
    client.flushall(target_nodes=redis.cluster.RedisCluster.PRIMARIES)
    client.close()
    yield redis_cluster.url


class SyncView:
    """Drives an AsyncLimiter from sync test code, so each behaviour is written once."""

    def __init__(self, limiter: AsyncLimiter, loop: asyncio.AbstractEventLoop) -> None:
        self.limiter = limiter
        self.loop = loop

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.limiter, name)
        if not callable(attr) or not asyncio.iscoroutinefunction(attr):
            return attr
        return lambda *args, **kwargs: self.loop.run_until_complete(attr(*args, **kwargs))


BACKENDS = ["memory", "sqlite", "redis", "cluster"]


@pytest.fixture(params=BACKENDS)
def every_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """Each store in turn, sync: memory, an SQLite file, Redis, a Redis Cluster."""
    kind = request.param
    backend: Backend
    if kind == "memory":
        backend = MemoryBackend()
    elif kind == "sqlite":
        backend = SQLiteBackend(tmp_path / "limits.db")
    else:
        backend = RedisBackend(request.getfixturevalue(f"{kind}_url"), cluster=kind == "cluster")
    with backend:
        yield backend


@pytest.fixture(params=[f"{b}-{mode}" for b in BACKENDS for mode in ("sync", "async")])
def make_limiter(request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    """``make_limiter(rates=..., min_interval=..., clock=...)`` over every backend, sync and
    async, with a fake clock by default (Redis then follows it instead of TIME)."""
    kind, mode = request.param.split("-")
    loop = asyncio.new_event_loop()
    closers: list[Callable[[], Any]] = []

    def backend() -> Any:
        if kind == "memory":
            return MemoryBackend()
        if kind == "sqlite":
            path = request.getfixturevalue("tmp_path") / "limits.db"
            sqlite = SQLiteBackend(path)
            closers.append(sqlite.close)
            return sqlite
        url = request.getfixturevalue("redis_url" if kind == "redis" else "cluster_url")
        cluster = kind == "cluster"
        if mode == "sync":
            sync = RedisBackend(url, cluster=cluster)
            closers.append(sync.close)
            return sync
        backend = AsyncRedisBackend(url, cluster=cluster)
        closers.append(lambda: loop.run_until_complete(backend.aclose()))
        return backend

    def factory(**kwargs: Any) -> Any:
        # The behaviours here are the slot arithmetic itself; the margin that widens it
        # for arrivals has tests of its own (tests/test_margin.py).
        kwargs.setdefault("margin", 0)
        clock = kwargs.setdefault("clock", FakeClock())
        store = kwargs.pop("backend", None) or backend()  # another limiter's, to share it
        if mode == "sync":
            kwargs.setdefault("sleep", clock.sleep)
            return Limiter(store, **kwargs)
        kwargs.setdefault("sleep", clock.asleep)
        return SyncView(AsyncLimiter(store, **kwargs), loop)

    factory.kind = kind  # type: ignore[attr-defined]
    factory.mode = mode  # type: ignore[attr-defined]
    yield factory
    for close in closers:
        close()
    loop.close()


@pytest.fixture(scope="module")
def redis_stores() -> Iterator[dict[str, RedisBackend]]:
    """One Redis and one Cluster backend for every example of the module: a client per
    example would leave redis-py's Cluster sockets for the collector to find."""
    stores: dict[str, RedisBackend] = {}
    yield stores
    for store in stores.values():
        store.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
