"""throttle_client: outbound, client-side throttling shared by a fleet of workers.

Every worker asks one shared authority, "may I send now, and if not, exactly
when?", before each outbound call; a sliding-window log per key (usually an
access token) in Redis, SQLite or memory answers.
"""

import typing as _typing

from ._backends.base import AsyncBackend, Backend
from ._backends.memory import MemoryBackend
from ._backends.sqlite import SQLiteBackend
from ._cards import Card
from ._decorator import throttled
from ._errors import (
    BackendError,
    BackendUnavailable,
    ConfigurationError,
    CostTooHigh,
    ThrottleError,
    ThrottleTimeout,
)
from ._events import Event, key_label
from ._failure import LocalFallback
from ._feedback import QuotaView
from ._history import History, Period, UsageHistory
from ._keys import store_key
from ._limiter import AsyncLimiter, Limiter
from ._rate import Rate
from ._request_key import request_key
from ._results import Decision, LearnedLimit, RateUsage, UpstreamView, Usage
from ._routes import RetryPolicy, Route, TokenPool
from ._transport import (
    AsyncThrottledClient,
    AsyncThrottledTransport,
    ThrottledClient,
    ThrottledTransport,
)

if _typing.TYPE_CHECKING:
    from ._backends.redis import AsyncRedisBackend, RedisBackend

__version__ = "0.2.0"


if not _typing.TYPE_CHECKING:  # (type checkers see the imports above, and any typo)

    def __getattr__(name: str) -> _typing.Any:
        # The Redis backends load redis-py (~80 ms, and its memory): a worker on memory or
        # SQLite never pays for it; the first use of either name imports them.
        if name in ("AsyncRedisBackend", "RedisBackend"):
            from ._backends import redis

            globals()[name] = value = getattr(redis, name)
            return value
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*globals(), *__all__})


__all__ = [
    "AsyncBackend",
    "AsyncLimiter",
    "AsyncRedisBackend",
    "AsyncThrottledClient",
    "AsyncThrottledTransport",
    "Backend",
    "BackendError",
    "BackendUnavailable",
    "Card",
    "ConfigurationError",
    "CostTooHigh",
    "Decision",
    "Event",
    "History",
    "LearnedLimit",
    "Limiter",
    "LocalFallback",
    "MemoryBackend",
    "Period",
    "QuotaView",
    "Rate",
    "RateUsage",
    "RedisBackend",
    "RetryPolicy",
    "Route",
    "SQLiteBackend",
    "ThrottleError",
    "ThrottleTimeout",
    "ThrottledClient",
    "ThrottledTransport",
    "TokenPool",
    "UpstreamView",
    "Usage",
    "UsageHistory",
    "__version__",
    "key_label",
    "request_key",
    "store_key",
    "throttled",
]
