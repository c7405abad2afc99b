"""Every driver error is classified on purpose: an outage, where the policy
applies, or a misconfiguration / store error, which is never failed open.

The table is checked row by row with redis-py's own exception classes; the cases
that matter most are also produced by real servers below.
"""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio
import redis.cluster
from redis import exceptions as rx

from throttle_client import (
    AsyncLimiter,
    AsyncRedisBackend,
    BackendError,
    BackendUnavailable,
    Limiter,
    RedisBackend,
)
from throttle_client._backends.redis import redis_keys
from throttle_client._backends.redis_errors import (
    DRIVER_ERRORS,
    ERROR,
    MISCONFIGURED,
    UNAVAILABLE,
    classify,
    translate,
)
from throttle_client._redis_server import free_port
from throttle_client.testing import RedisServer

CASES = [
    (rx.AuthenticationError("invalid username-password pair"), MISCONFIGURED),
    (rx.AuthorizationError("denied"), MISCONFIGURED),
    (
        rx.NoPermissionError("this user has no permissions to run the 'evalsha' command"),
        MISCONFIGURED,
    ),
    (
        rx.ConnectionError("[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed"),
        MISCONFIGURED,
    ),
    (
        rx.RedisClusterException(
            "Redis Cluster cannot be connected. Please provide at least one reachable node: "
            "Cluster mode is not enabled on this node"
        ),
        MISCONFIGURED,
    ),
    (rx.MovedError("3999 127.0.0.1:6381"), MISCONFIGURED),
    (rx.ResponseError("MOVED 3999 127.0.0.1:6381"), MISCONFIGURED),
    (rx.ClusterCrossSlotError(), ERROR),
    (rx.BusyLoadingError("Redis is loading the dataset in memory"), UNAVAILABLE),
    (rx.ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused."), UNAVAILABLE),
    (rx.MaxConnectionsError("Too many connections"), UNAVAILABLE),
    (rx.TimeoutError("Timeout reading from socket"), UNAVAILABLE),
    (rx.ClusterDownError("The cluster is down"), UNAVAILABLE),
    (rx.MasterDownError("Link with MASTER is down"), UNAVAILABLE),
    (rx.TryAgainError("Multiple keys request during rehashing of slot"), UNAVAILABLE),
    (rx.ReadOnlyError("You can't write against a read only replica."), UNAVAILABLE),
    (rx.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."), UNAVAILABLE),
    (rx.ResponseError("BUSY Redis is busy running a script."), UNAVAILABLE),
    (rx.ResponseError("NOREPLICAS Not enough good replicas to write."), UNAVAILABLE),
    (
        rx.ResponseError(
            "MISCONF Redis is configured to save RDB snapshots, but it's currently unable "
            "to persist to disk."
        ),
        UNAVAILABLE,
    ),
    (rx.ClusterError("TTL exhausted."), UNAVAILABLE),
    (rx.SlotNotCoveredError("Command # 1 (EVALSHA) of pipeline caused error"), UNAVAILABLE),
    (rx.RedisClusterException("Redis Cluster cannot be connected."), UNAVAILABLE),
    (rx.ResponseError("WRONGTYPE Operation against a key holding the wrong kind"), ERROR),
    (rx.NoScriptError("No matching script."), ERROR),
    (rx.DataError("Invalid input"), ERROR),
]


@pytest.mark.parametrize(("exc", "outcome"), CASES, ids=[type(e).__name__ for e, _ in CASES])
def test_each_driver_error_has_a_deliberate_outcome(exc: BaseException, outcome: str) -> None:
    assert isinstance(exc, DRIVER_ERRORS)
    assert classify(exc) == outcome
    ours = translate(exc)
    assert isinstance(ours, BackendError)
    assert isinstance(ours, BackendUnavailable) == (outcome == UNAVAILABLE)


def test_cluster_errors_are_not_redis_errors_yet_are_caught() -> None:
    """Why DRIVER_ERRORS exists: redis-py's Cluster errors sit outside RedisError."""
    assert not issubclass(rx.RedisClusterException, rx.RedisError)
    assert not issubclass(rx.SlotNotCoveredError, rx.RedisError)
    assert issubclass(rx.SlotNotCoveredError, DRIVER_ERRORS)


# -- from real servers ---------------------------------------------------------------------


def test_a_cluster_that_is_down_is_an_outage_not_a_crash_at_construction() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nobody listens
    backend = RedisBackend(url, cluster=True)  # does not connect yet
    limiter = Limiter(backend, rates=["5/second"], retry_for=0.1)
    with pytest.raises(BackendUnavailable) as info:
        limiter.try_acquire("token")
    assert isinstance(info.value.__cause__, rx.RedisClusterException)
    allowing = Limiter(backend, rates=["5/second"], retry_for=0.1, on_unavailable="allow")
    assert allowing.try_acquire("token").allowed  # the policy decides, as for standalone
    backend.close()


def test_a_cluster_that_comes_up_after_the_backend_is_used(own_redis: RedisServer) -> None:
    """Lazily built means built at the first call that can: not stuck on a failed build."""
    port = own_redis.port
    own_redis.kill()
    backend = RedisBackend(f"redis://127.0.0.1:{port}/0", cluster=True)
    limiter = Limiter(backend, rates=["5/second"], retry_for=0)
    with pytest.raises(BackendUnavailable):
        limiter.try_acquire("token")
    own_redis.start()  # a standalone server: now a misconfiguration, said as such
    limiter._guard._down_until = 0.0  # skip the cool-down rather than sleep it
    with pytest.raises(BackendError) as info:
        limiter.try_acquire("token")
    assert not isinstance(info.value, BackendUnavailable)


async def test_async_cluster_that_is_down_is_an_outage() -> None:
    backend = AsyncRedisBackend(f"redis://127.0.0.1:{free_port()}/0", cluster=True)
    limiter = AsyncLimiter(backend, rates=["5/second"], retry_for=0.1)
    with pytest.raises(BackendUnavailable) as info:
        await limiter.try_acquire("token")
    assert isinstance(info.value.__cause__, rx.RedisClusterException)
    await backend.aclose()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
async def test_cluster_mode_against_a_standalone_server_is_a_misconfiguration(
    redis_url: str, asynchronous: bool
) -> None:
    options = {"rates": ["5/second"], "on_unavailable": "allow"}
    with pytest.raises(BackendError, match="Cluster mode is not enabled") as info:
        if asynchronous:
            backend = AsyncRedisBackend(redis_url, cluster=True)
            try:
                await AsyncLimiter(backend, **options).try_acquire("token")
            finally:
                await backend.aclose()
        else:
            limiter = Limiter(RedisBackend(redis_url, cluster=True), **options)
            await asyncio.to_thread(limiter.try_acquire, "token")  # (blocking: in a thread)
    assert not isinstance(info.value, BackendUnavailable)


@pytest.mark.cluster
def test_a_standalone_client_on_a_cluster_node_is_a_misconfiguration(cluster_url: str) -> None:
    cluster = redis.cluster.RedisCluster.from_url(cluster_url)
    node = redis.Redis.from_url(cluster_url)
    limiter = Limiter(RedisBackend(node), rates=["5/second"], on_unavailable="allow")
    token = next(  # a token whose keys live on another node than the one the client names
        f"token-{n}"
        for n in range(1000)
        if cluster.get_node_from_key(redis_keys(limiter.store_key(f"token-{n}"))[0]).port
        != node.connection_pool.connection_kwargs["port"]
    )
    with pytest.raises(BackendError, match=r"MOVED|MovedError") as info:
        limiter.try_acquire(token)
    assert not isinstance(info.value, BackendUnavailable)
    node.close()
    cluster.close()


def test_a_missing_acl_permission_is_never_failed_open(own_redis: RedisServer) -> None:
    admin = redis.Redis.from_url(own_redis.url)
    admin.acl_setuser(
        "noscript", enabled=True, passwords=["+pw"], keys=["tc:*"], commands=["+ping"]
    )
    url = f"redis://noscript:pw@127.0.0.1:{own_redis.port}/0"
    limiter = Limiter(RedisBackend(url), rates=["5/second"], on_unavailable="allow")
    with pytest.raises(BackendError, match="permission") as info:
        limiter.try_acquire("token")
    assert not isinstance(info.value, BackendUnavailable)
    admin.close()
