"""The Redis stores' doorbell: grants arrive by Pub/Sub, one subscriber per process.

The script publishes each lease it grants to the waiter's process channel,
``tc:w:<nonce>`` (the nonce leads every lease id this process makes), so each grant
wakes one waiter of one process: no herd, and no waiter polls the store. A thread of
this process subscribes to that channel while it has waiters, on a connection of its
own (never one of the pool the script runs on, which ``batching`` counts), and rings
the bell of each lease named.

Pub/Sub is at-most-once: a message sent while the subscriber is reconnecting is lost.
So after every (re)subscription every waiter of the process is rung once and asks the
store again, and a waiter also asks again on its own now and then (``_limiter``):
the grant itself is in the store, a lost message only costs time. On a Cluster, a
PUBLISH (not SPUBLISH) reaches every node, so the subscriber listens on any one of them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.sentinel
import redis.cluster
import redis.connection
import redis.sentinel
from redis import exceptions as rx

from .doorbell import Doorbell
from .redis_clients import bounded, sync_copy

log = logging.getLogger("throttle_client")

# How long the thread waits for its subscription's confirmation at a time, and how long
# it outlives the last waiter (so a steady trickle of waiters does not resubscribe each time).
_READY_WAIT = 1.0
_IDLE_EXIT = 30.0
_RETRY_MAX = 5.0  # the longest pause between attempts to subscribe again


class RedisDoorbell(Doorbell):
    """Rings this process's waiters as grants arrive on its channel."""

    def __init__(self, clients: Callable[[], list[redis.Redis]]) -> None:
        super().__init__()
        self._clients = clients  # connections to subscribe on: any node will do
        self._start = threading.Lock()
        self._thread: threading.Thread | None = None  # None: no subscriber runs
        self._unable = False  # no way to subscribe with this client: waiters poll
        self._stop = threading.Event()
        self._open: list[Any] = []  # the subscription and its clients, for close()

    def watch(self) -> None:
        """Start the subscriber if none runs. Never waits for it: a grant sent before
        the subscription is found by the ring that follows every subscription."""
        self._check_fork()
        with self._start:
            if self._thread is None and not self._unable:
                self._stop = threading.Event()
                self._thread = threading.Thread(
                    target=self._listen, args=(self._stop,), name="throttle-client-grants"
                )
                self._thread.daemon = True
                self._thread.start()

    def forked(self) -> None:
        self._start = threading.Lock()
        self._thread = None

    def close(self) -> None:
        """Stop listening, and close the subscription's connection now (not whenever the
        thread next wakes)."""
        self._stop.set()
        with self._start:
            self._thread = None  # a later wait starts a new one
        if self._open:
            _close(self._open[0], self._open[1:])

    def _listen(self, stop: threading.Event) -> None:
        attempt = 0
        idle = 0.0
        while not stop.is_set():
            pubsub = None
            clients: list[redis.Redis] = []
            try:
                clients = self._clients()
                if not clients:
                    log.info(
                        "no way to subscribe to grants with this client; "
                        "waiters for a full cap look again every third of the lease TTL"
                    )
                    with self._start:
                        self._unable, self._thread = True, None
                    return
                channel = f"tc:w:{self.nonce}"
                pubsub = clients[attempt % len(clients)].pubsub()  # type: ignore[no-untyped-call]
                with self._start:
                    if stop is not self._stop or stop.is_set():  # closed meanwhile
                        return
                    self._open = [pubsub, *clients]
                pubsub.subscribe(channel)
                while pubsub.get_message(timeout=_READY_WAIT) is None:  # the confirmation
                    if stop.is_set():
                        return
                attempt = 0
                self.ring(self.waiting())  # whatever was sent before this subscription
                while not stop.is_set() and channel == f"tc:w:{self.nonce}":
                    message = pubsub.get_message(timeout=1.0)
                    if message is not None and message["type"] == "message":
                        data = message["data"]
                        self.ring([data.decode() if isinstance(data, bytes) else data])
                    idle = 0.0 if self.waiting() else idle + (0.0 if message else 1.0)
                    if idle >= _IDLE_EXIT:
                        with self._start:  # a waiter that comes now starts a new thread
                            if not self.waiting():
                                self._thread = None
                                return
                        idle = 0.0
            except (rx.NoPermissionError, rx.AuthenticationError) as exc:
                # Refused, not failing: it will be refused again. Waiters look again on
                # their own; say once what to grant.
                log.warning(
                    "the store refused the subscription to grants (%s): "
                    "waiters for a full cap look again every third of the lease TTL; "
                    "allow SUBSCRIBE on the channels tc:w:* (docs/operations/acl.md)",
                    exc,
                )
                with self._start:
                    self._unable, self._thread = True, None
                return
            except Exception as exc:  # a thread's error reaches nobody: log, try again
                log.debug("grant subscription lost (%s); again", exc)
                attempt += 1
                pause = min(_RETRY_MAX, 0.2 * 2 ** min(attempt - 1, 8))
                idle = 0.0 if self.waiting() else idle + pause
                if idle >= _IDLE_EXIT:  # a store that stays down, and nobody waits
                    with self._start:
                        if not self.waiting():
                            self._thread = None
                            return
                stop.wait(pause)
            finally:
                _close(pubsub, clients)


def _close(pubsub: Any, clients: list[redis.Redis]) -> None:
    """Close a subscription and the clients made for it, pools included (a client given
    a pool leaves it open when closed)."""
    for close in [
        *([pubsub.close] if pubsub is not None else []),
        *(client.close for client in clients),
        *(client.connection_pool.disconnect for client in clients),
    ]:
        with contextlib.suppress(Exception):  # a broken connection
            close()


def subscriber_clients(client: Any) -> list[redis.Redis]:
    """Sync clients of our own, one per node, to subscribe with: from a sync or async,
    standalone, Sentinel or Cluster client. Empty when there is no way (an asyncio
    Sentinel client): waiters then look again on their own."""
    if isinstance(client, (redis.cluster.RedisCluster, redis.asyncio.cluster.RedisCluster)):
        nodes = client.get_nodes() or list(client.nodes_manager.startup_nodes.values())
        plain = []
        for node in nodes:
            if isinstance(node, redis.cluster.ClusterNode):
                pool = node.redis_connection.connection_pool
                kwargs, kind = dict(pool.connection_kwargs), pool.connection_class
            else:
                kwargs, kind = dict(node.connection_kwargs), node.connection_class
            kwargs.update(host=node.host, port=node.port)
            plain.append(_plain(kwargs, kind))
        return plain
    if isinstance(client, redis.Redis):
        if isinstance(client.connection_pool, redis.sentinel.SentinelConnectionPool):
            copy = sync_copy(client)
            return [copy] if copy is not None else []
        pool = client.connection_pool
        return [_plain(dict(pool.connection_kwargs), pool.connection_class)]
    if isinstance(client, redis.asyncio.Redis):
        if isinstance(client.connection_pool, redis.asyncio.sentinel.SentinelConnectionPool):
            return []
        pool = client.connection_pool
        return [_plain(dict(pool.connection_kwargs), pool.connection_class)]
    return []


# What a subscriber needs of a client's settings to reach the same server as the same
# user; the rest (parsers, retry objects, handlers) differs between redis-py's worlds
# and versions, and an asyncio one breaks a sync connection.
_KEPT = ("host", "port", "path", "db", "username", "password", "credential_provider",
         "client_name", "socket_connect_timeout", "socket_keepalive")  # fmt: skip


def _plain(kwargs: dict[str, Any], kind: type) -> redis.Redis:
    """A sync client of one connection with these settings (an asyncio connection class
    becomes the sync class of the same name)."""
    tls = {key: value for key, value in kwargs.items() if key.startswith("ssl_")}
    if kwargs.get("ssl") or tls or "SSL" in kind.__name__:
        sync_kind: type = redis.connection.SSLConnection
    elif "path" in kwargs or "Unix" in kind.__name__:
        sync_kind = redis.connection.UnixDomainSocketConnection
    else:
        sync_kind = redis.connection.Connection
    settings = {key: kwargs[key] for key in _KEPT if key in kwargs}
    if sync_kind is redis.connection.SSLConnection:
        settings.update(tls)
    settings = bounded(settings, asyncio=False)
    settings["socket_timeout"] = None  # a subscriber waits for messages as long as it takes
    pool = redis.ConnectionPool(connection_class=sync_kind, max_connections=2, **settings)
    return redis.Redis(connection_pool=pool)
