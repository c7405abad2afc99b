"""The Redis connections a backend runs its script over, and how many calls may use them.

Bounds (docs/operations/redis-failures.md): a call to a hung or dead store must end within
the limiter's timeout plus one socket timeout, however the client was built. So the
backend runs its script over connections it owns, with its own timeouts and no
retries hidden inside redis-py (whose defaults, a 5 s socket timeout where set at all
and up to 10 retries with backoff, outlast any sensible ``acquire`` timeout):

- from a URL: a client built with those options over a ``BlockingConnectionPool``;
- from a user's standalone or Sentinel client: a pool of its own that copies the
  user's connection settings (connection class, host or unix socket, db,
  credentials, TLS, protocol; for Sentinel the same service and Sentinel object),
  with the stricter of the user's timeouts and ours. The user's client is never
  changed, and its pool is never drawn on, so its other users cannot exhaust it;
- a user's Cluster client is used as it is (its node pools and retries are its own):
  set ``socket_timeout`` and ``socket_connect_timeout`` on it.

And pool exhaustion is never an outage: at most as many calls are in flight as the
pool has connections (``batching``); the operations that come meanwhile wait, and go
together in the next call.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.sentinel
import redis.cluster
import redis.sentinel
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.connection import parse_url
from redis.retry import Retry

log = logging.getLogger("throttle_client")

SOCKET_TIMEOUT = 1.0  # seconds a hung server may hold one command
CONNECT_TIMEOUT = 1.0
HEALTH_CHECK_INTERVAL = 15  # an idle connection is PINGed before use after this many seconds
# Connections per backend, and so calls in flight at once: the operations that queue
# behind them go together, many in one call (batching), so a few connections serve
# thousands of waiting tasks; more would only add round trips the server runs one by one.
CONNECTIONS = 4

# Keys of a pool's connection_kwargs that belong to that pool, not to the connection
# settings: the Sentinel pool's back-reference, redis-py 8's maintenance-notification
# handler, and the "original" timeouts it restores after relaxing them (ours replace them).
_POOL_OWN_KEYS = frozenset(
    {
        "connection_pool",
        "maint_notifications_pool_handler",
        "orig_host_address",
        "orig_socket_timeout",
        "orig_socket_connect_timeout",
        "himport_registry",
    }
)


def bounded(settings: Mapping[str, Any], *, asyncio: bool) -> dict[str, Any]:
    """Connection settings with the limiter's bounds: the stricter timeout, no retries."""
    options = {key: value for key, value in settings.items() if key not in _POOL_OWN_KEYS}
    limits = {"socket_timeout": SOCKET_TIMEOUT, "socket_connect_timeout": CONNECT_TIMEOUT}
    for key, ours in limits.items():
        theirs = options.get(key)
        options[key] = ours if theirs is None else min(theirs, ours)
    # RESP2 unless RESP3 is asked for (redis-py 8 speaks RESP3 by default): the script's
    # reply is one bulk string either way, and a RESP2 pool only hands out connections,
    # so the backend may keep one of its own beside it (redis_wire).
    # (redis-py 8's maintenance notifications, "auto" by default, are RESP3's: a client
    # that turned them on explicitly keeps its RESP3.)
    notified = getattr(options.get("maint_notifications_config"), "enabled", None) is True
    if options.get("protocol") is None and not notified:
        options["protocol"] = 2
        options.pop("maint_notifications_config", None)
    # The limiter retries within the call's deadline; redis-py must not retry inside it.
    options["retry"] = (AsyncRetry if asyncio else Retry)(NoBackoff(), 0)
    options["retry_on_error"] = []
    interval = options.get("health_check_interval") or HEALTH_CHECK_INTERVAL
    options["health_check_interval"] = min(interval, HEALTH_CHECK_INTERVAL)
    return options


def check_url(url: str) -> None:
    """A malformed URL fails when the backend is built, not at its first call."""
    parse_url(url)  # type: ignore[no-untyped-call]


def url_options(*, asyncio: bool) -> dict[str, Any]:
    return bounded({}, asyncio=asyncio)


def sync_from_url(url: str, *, cluster: bool) -> redis.Redis | redis.cluster.RedisCluster:
    if cluster:
        # Per node: a blocking pool of CONNECTIONS (the batcher keeps calls within it anyway).
        return redis.cluster.RedisCluster.from_url(
            url,
            connection_pool_class=redis.BlockingConnectionPool,
            max_connections=CONNECTIONS,
            **url_options(asyncio=False),
        )
    # timeout=None: wait for a connection as long as it takes. Every connection of the
    # pool has the socket timeout, so whoever holds one gives it back soon enough.
    pool = redis.BlockingConnectionPool.from_url(
        url, max_connections=CONNECTIONS, timeout=None, **url_options(asyncio=False)
    )
    return redis.Redis(connection_pool=pool)


def async_from_url(
    url: str, *, cluster: bool
) -> redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster:
    if cluster:
        # redis.asyncio's Cluster has no blocking pool: the batcher keeps calls within it.
        return redis.asyncio.cluster.RedisCluster.from_url(
            url, max_connections=CONNECTIONS, **url_options(asyncio=True)
        )
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        url, max_connections=CONNECTIONS, timeout=None, **url_options(asyncio=True)
    )
    return redis.asyncio.Redis(connection_pool=pool)


def sync_copy(client: redis.Redis) -> redis.Redis | None:
    """A client of our own with ``client``'s connection settings; None for a pool
    we do not know how to copy (then the user's client is used as it is)."""
    pool = client.connection_pool
    settings = bounded(pool.connection_kwargs, asyncio=False)
    if isinstance(pool, redis.sentinel.SentinelConnectionPool):
        own: redis.ConnectionPool = redis.sentinel.SentinelConnectionPool(  # type: ignore[no-untyped-call]
            pool.service_name,
            pool.sentinel_manager,  # the user's Sentinel: only asked where the master is
            is_master=pool.is_master,
            check_connection=pool.check_connection,
            connection_class=pool.connection_class,
            max_connections=CONNECTIONS,
            **settings,
        )
    elif type(pool) in (redis.ConnectionPool, redis.BlockingConnectionPool):
        own = redis.BlockingConnectionPool(  # type: ignore[no-untyped-call]
            connection_class=pool.connection_class,
            max_connections=CONNECTIONS,
            timeout=None,
            **settings,
        )
    else:
        return None
    return redis.Redis(connection_pool=own)


def async_copy(client: redis.asyncio.Redis) -> redis.asyncio.Redis | None:
    """As :func:`sync_copy`, for a ``redis.asyncio`` client."""
    pool = client.connection_pool
    settings = bounded(pool.connection_kwargs, asyncio=True)
    if isinstance(pool, redis.asyncio.sentinel.SentinelConnectionPool):
        own: redis.asyncio.ConnectionPool = redis.asyncio.sentinel.SentinelConnectionPool(  # type: ignore[no-untyped-call]
            pool.service_name,
            pool.sentinel_manager,
            is_master=pool.is_master,
            check_connection=pool.check_connection,
            connection_class=pool.connection_class,
            max_connections=CONNECTIONS,
            **settings,
        )
    elif type(pool) in (redis.asyncio.ConnectionPool, redis.asyncio.BlockingConnectionPool):
        own = redis.asyncio.BlockingConnectionPool(
            connection_class=pool.connection_class,
            max_connections=CONNECTIONS,
            timeout=None,
            **settings,
        )
    else:
        return None
    return redis.asyncio.Redis(connection_pool=own)


def pool_size(client: Any) -> int:
    """How many calls may be in flight on a client we use as it is: its pool's size
    (per node for a Cluster, whose calls for one key all go to one node)."""
    if isinstance(client, (redis.cluster.RedisCluster, redis.asyncio.cluster.RedisCluster)):
        size = client.nodes_manager.connection_kwargs.get("max_connections")
    else:
        size = getattr(client.connection_pool, "max_connections", None)
    return size if isinstance(size, int) and size > 0 else CONNECTIONS


def evicting_policy(config: Any) -> str | None:
    """The ``maxmemory-policy`` that may evict the limiter's keys, from CONFIG GET's reply
    (one node's mapping, or a Cluster's mapping of node to mapping); None when none does.

    Every key of the limiter has a TTL, so with ``maxmemory`` set every policy but
    ``noeviction`` (volatile-* included) can evict a log and forget admitted calls.
    """
    if not isinstance(config, Mapping):
        return None
    text = {_text(k): v for k, v in config.items()}
    if "maxmemory-policy" not in text:  # a Cluster: one mapping per node
        found = [evicting_policy(node) for node in config.values()]
        return next((policy for policy in found if policy), None)
    policy = _text(text["maxmemory-policy"])
    if _text(text.get("maxmemory", "0")) in ("0", "") or policy == "noeviction":
        return None
    return policy


def warn_if_evicting(config: Any) -> None:
    """Log once per backend (the caller asks once) when Redis may evict the limiter's keys."""
    policy = evicting_policy(config)
    if policy is not None:
        log.warning(
            "Redis has maxmemory set with maxmemory-policy %s, so when it "
            "fills up it may evict the limiter's logs and forget calls it admitted (the "
            "quota would be exceeded); set maxmemory-policy noeviction",
            policy,
        )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
