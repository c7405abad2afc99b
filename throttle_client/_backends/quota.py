"""What one key's log is held to: its rates' periods (sliding, bounded, calendar), the
gap between calls, the concurrency cap; and how long a store keeps what they count.

All in whole microseconds, as the limiter widened them by its margin.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TypeGuard


@dataclass(frozen=True)
class Windows:
    """A calendar rate's fixed windows, as far as the limiter computed them.

    The store has no time-zone rules: the limiter gives it the windows ``[start, end)``
    around the times a decision needs, in order (runs of consecutive windows, with gaps
    between runs), and ``keep_from``, the start of the window that holds the store's now
    as the limiter guessed it. A window counts every call whose slot lies from
    ``margin_us`` before its start to its end, since a call may reach the upstream up to
    the margin after its slot. A decision that needs a window not given (the store's now
    before ``keep_from``, or a slot outside them) answers *stale* with that time, and
    the limiter asks again with windows around it as well.
    """

    keep_from: int
    spans: tuple[tuple[int, int], ...]
    margin_us: int
    # A bounded rate's (Rate.bounded) coarse log: it names the windows' unit, zone and
    # anchor, and the margin, so that rates on the same windows share one. "": exact.
    name: str = ""

    @property
    def longest_us(self) -> int:
        """The most a given window spans, margin included: how long an entry may matter."""
        return max(end - start for start, end in self.spans) + self.margin_us


@dataclass(frozen=True)
class Buckets:
    """A bounded sliding rate (Rate.bounded): its period, counted in buckets of
    ``width_us`` (each bucket's calls as if all came at its last moment)."""

    period_us: int
    width_us: int

    @property
    def name(self) -> str:
        """The coarse log it counts in: rates of one period and width share one."""
        return f"{self.period_us}/{self.width_us}"


# A sliding period in µs, a bounded sliding rate's, or a calendar rate's windows.
Period = int | Buckets | Windows

# How long past its horizon (the last time anything in it can matter) a store keeps a
# key, its life included: a worker whose clock reads the store's a little behind may
# still send that life with a call (Acquire.expect), and must find it, not a new key.
# (Redis keeps a key a tenth of its horizon more, and at least this.)
KEPT_US = 1_000_000

# How long a store keeps a key's logged calls (so their ids) when every rate of the
# quota is bounded: a retry of a call comes within its retry_for (1 s by default) and a
# timeout, and such a key would otherwise drop every entry at once.
KEEP_IDS_US = 5_000_000


@dataclass(frozen=True)
class Quota:
    """What one key's log is held to: the rates as ``(limit, period)`` pairs (a sliding
    period in µs, or a calendar rate's :class:`Windows`) and the minimum gap between
    calls, all as the limiter widened them by its margin."""

    limits: tuple[tuple[int, Period], ...]
    min_interval_us: int
    # The most calls of the key in flight at once (0: no cap), and how long a lease lives
    # unless its holder renews it (``leases``).
    max_concurrent: int = 0
    lease_ttl_us: int = 0

    @functools.cached_property  # (asked on every decision: the quota never changes)
    def horizon_us(self) -> int:
        """How long an entry, or a bounded rate's count, can still matter after its slot
        (at least the KEEP_IDS_US that keep_from keeps a log of only bounded rates)."""
        exact = any(_exact(p) for _, p in self.limits)
        return max(
            *(span(p) for _, p in self.limits), self.min_interval_us, 0 if exact else KEEP_IDS_US
        )

    def counts_until(self, logged: int) -> int:
        """Until when a call logged at ``logged`` may still count in a window: a sliding
        rate's period after it (a bounded one's bucket more), a calendar rate's window that
        counts it to its end (the longest window when it lies outside those given), the
        gap: what a key that lost its calls up to then is held to (sliding_log)."""
        ends = [logged + self.min_interval_us]
        for _, period in self.limits:
            if isinstance(period, Windows):
                counting = [
                    end for start, end in period.spans if start - period.margin_us <= logged < end
                ]
                ends.append(max(counting, default=logged + period.longest_us))
            else:
                ends.append(logged + span(period))
        return max(ends)

    def keep_from(self, now: int) -> int:
        """The oldest slot of the log of calls that any decision from ``now`` on can
        count: older entries may go. (A sliding window ending at now holds the slots
        after now - period.) Bounded rates count in coarse logs of their own, so a key
        with only those keeps its calls KEEP_IDS_US."""
        return min(
            (
                now - p + 1 if isinstance(p, int) else p.keep_from - p.margin_us
                for _, p in self.limits
                if _exact(p)
            ),
            default=now - KEEP_IDS_US,
        )


def _exact(period: Period) -> TypeGuard[int | Windows]:
    """Whether a rate counts in the key's log of calls (not bounded)."""
    return not isinstance(period, Buckets) and not (isinstance(period, Windows) and period.name)


def span(period: Period) -> int:
    """How long a rate counts a call after its slot, at most."""
    if isinstance(period, int):
        return period
    if isinstance(period, Buckets):
        return period.period_us + period.width_us
    return period.longest_us
