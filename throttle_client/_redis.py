"""The Redis store: one Lua script (package data) per decision, over redis-py's own clients.

Sync and asyncio backends share everything but the call itself: the script,
how an operation becomes KEYS/ARGV, how the reply becomes a result, and how
driver errors become ours. Each call is one EVALSHA; on NOSCRIPT the script is
loaded again and the call repeated, so a ``SCRIPT FLUSH``, a restart or a failover
is invisible to callers.
"""

from __future__ import annotations

import functools
import hashlib
from importlib import resources
from typing import Any, TypeVar, cast

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
from redis import exceptions as rx
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from ._errors import BackendError, BackendUnavailable
from ._log import RepairNotice
from ._ops import Acquire, Inspect, Op, Pause, Policy, Reset, Snapshot, Verdict

T = TypeVar("T")

SCRIPT = resources.files(__package__).joinpath("lua/sliding_log.lua").read_text("utf-8")
SHA = hashlib.sha1(SCRIPT.encode()).hexdigest()

# Set on clients built from a URL: a hung store must not hang a worker (DESIGN §5).
# No retries inside redis-py (its default is ten, with backoff, and each one may wait
# a whole socket timeout on a hung server): the limiter's own retry is bounded by
# the call's deadline, and its first retry reconnects a pooled connection that died.
URL_CLIENT_OPTIONS: dict[str, Any] = {
    "socket_connect_timeout": 1.0,
    "socket_timeout": 1.0,
    "health_check_interval": 15,
}


def url_client_options(*, asyncio: bool) -> dict[str, Any]:
    retry = (AsyncRetry if asyncio else Retry)(NoBackoff(), 0)
    return {**URL_CLIENT_OPTIONS, "retry": retry}


# Errors after which the store may well answer again: the failure policy applies.
UNAVAILABLE = (
    rx.ConnectionError,
    rx.TimeoutError,
    rx.ClusterDownError,
    rx.TryAgainError,
    rx.ReadOnlyError,
    rx.RedisClusterException,
)


# Every decision of a limiter sends the same keys and policy: both are formatted once
# (as bytes, which redis-py sends as they are) and remembered, not rebuilt per call.
@functools.lru_cache(maxsize=4096)
def store_keys(key: str) -> tuple[bytes, bytes]:
    """The log (a sorted set) and the meta (a string) of one hashed key."""
    prefix = f"tc:{key}:".encode()
    return prefix + b"log", prefix + b"meta"


@functools.lru_cache(maxsize=256)
def policy_arg(policy: Policy) -> bytes:
    """ARGV[2]: msgpack of [gap, limit, period, ...], encoded once per policy.

    Every number is a non-negative integer below 2**64, so an array (a fixarray up to
    15 numbers, seven rates; an array16 beyond) of uint64s or positive fixints is all
    it takes. The limiter holds the number of rates to _ranges.MAX_RATES.
    """
    numbers = [policy.min_interval_us]
    for limit, period in policy.limits:
        numbers += [limit, period]
    count = len(numbers)
    header = bytes([0x90 | count]) if count < 16 else b"\xdc" + count.to_bytes(2, "big")
    packed = [bytes([n]) if n < 128 else b"\xcf" + n.to_bytes(8, "big") for n in numbers]
    return header + b"".join(packed)


def encode(op: Op[Any]) -> tuple[tuple[bytes, ...], tuple[bytes | str, ...]]:
    """KEYS and ARGV for ``op`` (see the header of sliding_log.lua)."""
    if isinstance(op, Reset):
        return store_keys(op.key), (b"reset",)
    assert isinstance(op, (Acquire, Inspect, Pause))
    now = b"-" if op.now_us is None else b"%d" % op.now_us
    keys, policy = store_keys(op.key), policy_arg(op.policy)
    if isinstance(op, Acquire):
        cost, wait = b"%d" % op.cost, b"%d" % op.max_wait_us
        return keys, (b"acquire", policy, now, cost, wait, op.call_id)
    if isinstance(op, Pause):
        return keys, (b"pause", policy, now, b"%d" % op.duration_us)
    return keys, (b"inspect", policy, now)


# The word that leads a reply when the script rebuilt a lost part of the key (bytes, or
# str from a client made with decode_responses=True), and which part it was.
_REPAIRED: dict[bytes | str, str] = {
    b"repaired:log": "log",
    b"repaired:meta": "meta",
    "repaired:log": "log",
    "repaired:meta": "meta",
}


def decode(op: Op[T], reply: Any, notice: RepairNotice | None = None) -> T:
    words = reply.split()
    part = _REPAIRED.get(words[0])
    if part is not None:
        del words[0]
        if notice is not None:
            notice(op.key, part)
    values = [int(word) for word in words]
    if isinstance(op, Acquire):
        allowed, now, slot, pause, *remaining = values
        return cast(T, Verdict(bool(allowed), now, slot, pause, tuple(remaining)))
    if isinstance(op, Inspect):
        now, next_slot, pause, booked, *per_rate = values
        used, ready = tuple(per_rate[::2]), tuple(per_rate[1::2])
        return cast(T, Snapshot(now, next_slot, pause, booked, used, ready))
    if isinstance(op, Pause):
        return cast(T, values[0])
    return cast(T, None)


def translate(exc: rx.RedisError) -> BackendError:
    if _misconfigured(exc):
        # Waiting will not mend a wrong password or CA: never "unavailable", so a
        # fail-open policy cannot turn a misconfiguration into unthrottled traffic.
        return BackendError(f"Redis refused this client's configuration: {exc}")
    if isinstance(exc, UNAVAILABLE):
        return BackendUnavailable(f"Redis is unavailable: {exc}")
    return BackendError(f"Redis answered with an error: {exc}")


def _misconfigured(exc: rx.RedisError) -> bool:
    if isinstance(exc, (rx.AuthenticationError, rx.AuthorizationError)):
        return True
    return isinstance(exc, rx.ConnectionError) and "CERTIFICATE_VERIFY_FAILED" in str(exc)


# A SCRIPT FLUSH can land between our reload of the script and the EVALSHA after
# it; a few more tries are enough, as each one loads the script again.
_NOSCRIPT_TRIES = 3


SyncClient = redis.Redis | redis.cluster.RedisCluster
AsyncClient = redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster


class RedisBackend:
    """Limits shared through Redis: standalone, Sentinel (a master client) or Cluster.

    Give it a redis-py client, or a URL (``redis://``, ``rediss://``, ``unix://``);
    ``cluster=True`` makes a URL into a ``RedisCluster``.

    >>> backend = RedisBackend(redis.Redis.from_url("redis://localhost:6379/0"))
    """

    def __init__(self, client: SyncClient | str, *, cluster: bool = False) -> None:
        if isinstance(client, str):
            factory = redis.cluster.RedisCluster if cluster else redis.Redis
            client = factory.from_url(client, **url_client_options(asyncio=False))
        elif isinstance(client, (redis.asyncio.Redis, redis.asyncio.cluster.RedisCluster)):
            raise TypeError("this is an asyncio Redis client: use AsyncRedisBackend with it")
        elif not isinstance(client, (redis.Redis, redis.cluster.RedisCluster)):
            raise TypeError(f"RedisBackend needs a redis-py client or a URL, not {client!r}")
        self.client = client
        self._repairs = RepairNotice()

    def execute(self, op: Op[T]) -> T:
        keys, args = encode(op)
        try:
            for tries_left in reversed(range(_NOSCRIPT_TRIES)):
                try:
                    reply = self.client.evalsha(SHA, len(keys), *keys, *args)
                    break
                except rx.NoScriptError:
                    if not tries_left:
                        raise
                    self.client.script_load(SCRIPT)
        except rx.RedisError as exc:
            raise translate(exc) from exc
        return decode(op, reply, self._repairs)

    def close(self) -> None:
        self.client.close()

    def __repr__(self) -> str:
        return f"RedisBackend({self.client!r})"


class AsyncRedisBackend:
    """The asyncio twin of :class:`RedisBackend`, over ``redis.asyncio`` clients.

    >>> backend = AsyncRedisBackend(redis.asyncio.Redis.from_url("redis://localhost"))
    """

    def __init__(self, client: AsyncClient | str, *, cluster: bool = False) -> None:
        if isinstance(client, str):
            factory = redis.asyncio.cluster.RedisCluster if cluster else redis.asyncio.Redis
            client = factory.from_url(client, **url_client_options(asyncio=True))
        elif isinstance(client, (redis.Redis, redis.cluster.RedisCluster)):
            raise TypeError("this is a sync Redis client: use RedisBackend with it")
        elif not isinstance(client, (redis.asyncio.Redis, redis.asyncio.cluster.RedisCluster)):
            raise TypeError(
                f"AsyncRedisBackend needs a redis.asyncio client or a URL, not {client!r}"
            )
        self.client = client
        self._repairs = RepairNotice()

    async def execute(self, op: Op[T]) -> T:
        keys, args = encode(op)
        try:
            for tries_left in reversed(range(_NOSCRIPT_TRIES)):
                try:
                    reply = await self.client.evalsha(SHA, len(keys), *keys, *args)
                    break
                except rx.NoScriptError:
                    if not tries_left:
                        raise
                    await self.client.script_load(SCRIPT)
        except rx.RedisError as exc:
            raise translate(exc) from exc
        return decode(op, reply, self._repairs)

    async def aclose(self) -> None:
        await self.client.aclose()

    def __repr__(self) -> str:
        return f"AsyncRedisBackend({self.client!r})"
