"""Helpers for tests of code that uses throttle_client (and for its own tests).

>>> clock = FakeClock()
>>> limiter = Limiter(
...     MemoryBackend(), rates=["2/second"], margin=0, clock=clock, sleep=clock.sleep
... )
>>> limiter.acquire("t"); limiter.acquire("t"); limiter.acquire("t").waited
1.0
"""

from __future__ import annotations

import asyncio
import typing
import warnings

from ._backends.memory import MemoryBackend
from ._redis_server import (
    RedisClusterServers,
    RedisSentinelServers,
    RedisServer,
    RedisUnavailableError,
)

__all__ = [
    "FakeClock",
    "MemoryBackend",
    "RedisClusterServers",
    "RedisSentinelServers",
    "RedisServer",
    "RedisUnavailableError",
]


def __getattr__(name: str) -> typing.Any:
    # StrictUpstream moved to the command's package, which this module must not import
    # (the library never does): the old name still works, on first use, with a warning.
    if name == "StrictUpstream":
        warnings.warn(
            "throttle_client.testing.StrictUpstream is deprecated: import it from "
            "throttle_client.cli.upstream",
            DeprecationWarning,
            stacklevel=2,
        )
        from .cli.upstream import StrictUpstream

        return StrictUpstream
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class FakeClock:
    """A clock that only moves when told to; its ``sleep`` moves it instead of waiting.

    Pass ``clock=fake`` and ``sleep=fake.sleep`` (or ``sleep=fake.asleep`` for an
    AsyncLimiter). Every sleep is recorded in ``slept``.
    """

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock only moves forward, not by {seconds!r}")
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.advance(seconds)

    async def asleep(self, seconds: float) -> None:
        self.sleep(seconds)
        await asyncio.sleep(0)  # still a real suspension point, as asyncio.sleep would be

    def __repr__(self) -> str:
        return f"FakeClock(now={self.now!r})"
