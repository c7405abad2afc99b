"""The demo's settings, the store its processes share, and the record of a run: what the
demo's parts (its run, crawlers, judge and summary) all read."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from throttle_client import Backend, Limiter, Rate, RedisBackend, SQLiteBackend

# Per token, in a shared array: requests sent, answered 200, answered 429, workers waiting.
SENT, OK, REFUSED, WAITING = range(4)
FIELDS = 4

# The demo's quota: a provider's "N per hour, M per second, calls at least g apart",
# scaled down so that both windows bind within a few seconds.
DEFAULT_RATES = ("10/second", "80/10 seconds")
DEFAULT_MIN_INTERVAL = 0.05
# The upstream counts arrivals with no forgiveness: the limiters' margin absorbs the delay.
DEFAULT_TOLERANCE = 0.0
DEFAULT_DURATION = 10.0
DEFAULT_WORKERS = 4
DEFAULT_TOKENS = 2
# The limiters' margin unless told otherwise: the library's own default, read where the
# library documents it (Limiter's signature), so the demo shows what a worker gets.
DEFAULT_MARGIN: float = inspect.signature(Limiter).parameters["margin"].default


@dataclass(frozen=True)
class DemoConfig:
    workers: int = DEFAULT_WORKERS
    tokens: int = DEFAULT_TOKENS
    duration: float = DEFAULT_DURATION
    rates: tuple[Rate, ...] = tuple(Rate.parse(r) for r in DEFAULT_RATES)
    min_interval: float = DEFAULT_MIN_INTERVAL
    margin: float = DEFAULT_MARGIN
    tolerance: float = DEFAULT_TOLERANCE
    redis_url: str | None = None


@dataclass(frozen=True)
class Store:
    """Picklable: each crawler process opens the store itself."""

    sqlite_path: str | None = None
    redis_url: str | None = None

    def open(self) -> Backend:
        if self.redis_url is not None:
            return RedisBackend(self.redis_url)
        assert self.sqlite_path is not None
        return SQLiteBackend(self.sqlite_path)

    @property
    def name(self) -> str:
        return "Redis" if self.redis_url is not None else "SQLite (a temporary file)"


@dataclass
class DemoRun:
    """What the live display and the summary read while and after the demo runs."""

    config: DemoConfig
    store: Store
    limiter: Limiter
    tokens: tuple[str, ...]
    counters: Any
    started: float = 0.0
    upstream_stats: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    slots: dict[int, list[float]] = field(default_factory=dict)  # token number -> slots

    def counts(self, number: int) -> tuple[int, int, int, int]:
        base = number * FIELDS
        values = self.counters[base : base + FIELDS]
        return int(values[0]), int(values[1]), int(values[2]), int(values[3])
