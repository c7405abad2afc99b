"""Every error redis-py can raise, sorted into what the limiter does about it.

Three outcomes, decided here and nowhere else:

- **unavailable** (BackendUnavailable): the store may well answer again soon. The
  limiter retries briefly, then its ``on_unavailable`` applies.
- **misconfigured** (BackendError): waiting will not mend it (a wrong password, a CA
  that does not verify, a missing ACL permission, ``cluster=True`` against a
  standalone server). Never an outage, so ``on_unavailable="allow"`` cannot turn a
  misconfiguration into unthrottled traffic.
- **error** (BackendError): the store answered, with an error (a key of the wrong
  type, a script error). Never a reason to let a call through either.

redis-py's Cluster errors (``RedisClusterException``, ``SlotNotCoveredError``) are
not ``RedisError`` subclasses, hence ``DRIVER_ERRORS``: catch that, then classify.
"""

from __future__ import annotations

from redis import exceptions as rx

from .._errors import BackendError, BackendUnavailable

DRIVER_ERRORS = (rx.RedisError, rx.RedisClusterException)

UNAVAILABLE, MISCONFIGURED, ERROR = "unavailable", "misconfigured", "error"

# (driver error, text its message must contain or "", outcome). The first row that
# matches decides, so subclasses come before their bases. Why each row is there:
TABLE: tuple[tuple[type[BaseException], str, str], ...] = (
    # A wrong password or user (WRONGPASS, NOAUTH, invalid password).
    (rx.AuthenticationError, "", MISCONFIGURED),
    # Redis refused this user the connection (ACL).
    (rx.AuthorizationError, "", MISCONFIGURED),
    # NOPERM: the ACL user lacks a command or key pattern the limiter needs
    # (docs/operations/acl.md).
    (rx.NoPermissionError, "", MISCONFIGURED),
    # TLS: the server's certificate does not verify against the CA given.
    (rx.ConnectionError, "CERTIFICATE_VERIFY_FAILED", MISCONFIGURED),
    # cluster=True (or a RedisCluster client) against a server without cluster mode;
    # redis-py wraps it in "Redis Cluster cannot be connected ...: Cluster mode is not
    # enabled on this node", so the text is looked for anywhere in the message.
    (rx.RedisClusterException, "Cluster mode is not enabled", MISCONFIGURED),
    # MOVED reaching us: a standalone client pointed at a Cluster node (a RedisCluster
    # client follows MOVED itself). Needs cluster=True or a RedisCluster client.
    (rx.MovedError, "", MISCONFIGURED),
    (rx.ResponseError, "MOVED ", MISCONFIGURED),  # redis-py 5's standalone parser
    # CROSSSLOT: a key's log and meta always share a hash tag; seeing this is a bug.
    (rx.ClusterCrossSlotError, "", ERROR),
    # LOADING: a restarted server reading its dataset; it answers in a moment.
    (rx.BusyLoadingError, "", UNAVAILABLE),
    # Refused, reset or broken connections, "max number of clients reached", and a
    # pool with no connection left (redis-py's "Too many connections" /
    # MaxConnectionsError; the backend bounds its calls in flight so that it does
    # not happen, and when a client shared with other code runs out anyway, a retry
    # a moment later gets a connection).
    (rx.ConnectionError, "", UNAVAILABLE),
    # A socket timeout: a hung, paused or overloaded server.
    (rx.TimeoutError, "", UNAVAILABLE),
    # CLUSTERDOWN / MASTERDOWN: a Cluster failover in progress, or a replica whose
    # master link is down.
    (rx.ClusterDownError, "", UNAVAILABLE),
    # TRYAGAIN: a slot mid-migration during resharding.
    (rx.TryAgainError, "", UNAVAILABLE),
    # READONLY: a former master demoted to replica, before the client learns of the
    # new master (Sentinel or Cluster failover).
    (rx.ReadOnlyError, "", UNAVAILABLE),
    # OOM: maxmemory reached under "noeviction"; writes succeed again once memory is
    # freed (idle keys expire), so it is treated as an outage of the store.
    (rx.OutOfMemoryError, "", UNAVAILABLE),
    # BUSY: another client's script runs past lua-time-limit; the server answers
    # again when it ends or is killed.
    (rx.ResponseError, "BUSY ", UNAVAILABLE),
    # NOREPLICAS: min-replicas-to-write not met (a replica is down or lagging); MISCONF:
    # the last RDB save failed and stop-writes-on-bgsave-error refuses writes. Both
    # pass once the replicas or the disk are back, without a change on our side.
    (rx.ResponseError, "NOREPLICAS ", UNAVAILABLE),
    (rx.ResponseError, "MISCONF ", UNAVAILABLE),
    # redis-py's Cluster client gave up after its own retries (ClusterError: "TTL
    # exhausted"), e.g. during a failover.
    (rx.ClusterError, "", UNAVAILABLE),
    # SlotNotCoveredError: during a Cluster failover the slot has no primary yet.
    (rx.SlotNotCoveredError, "", UNAVAILABLE),
    # Any other Cluster client failure: no node reachable ("Redis Cluster cannot be
    # connected"), slot table being rebuilt. The misconfiguration above is excluded.
    (rx.RedisClusterException, "", UNAVAILABLE),
    # Everything else the server answered: WRONGTYPE, a script error, NOSCRIPT that
    # persisted through reloads, a data error.
    (rx.RedisError, "", ERROR),
)


def classify(exc: BaseException) -> str:
    """The outcome for a driver error: UNAVAILABLE, MISCONFIGURED or ERROR."""
    text = str(exc)
    for kind, fragment, outcome in TABLE:
        if isinstance(exc, kind) and fragment in text:
            return outcome
    return ERROR


def translate(exc: BaseException) -> BackendError:
    """Our exception for a driver error (the caller raises it ``from exc``)."""
    outcome = classify(exc)
    if outcome == MISCONFIGURED:
        name = type(exc).__name__
        return BackendError(f"Redis refused this client's configuration ({name}): {exc}")
    if outcome == UNAVAILABLE:
        return BackendUnavailable(f"Redis is unavailable: {exc}")
    return BackendError(f"Redis answered with an error: {exc}")
