"""Bounded rates: a coarse log per rate, one entry per bucket, instead of every call.

A bounded rate (Rate.bounded) counts in a *coarse log* of its own (:class:`Coarse`): a
log with one entry per bucket (a fixed slice of the rate's period) instead of one per
call, each at the bucket's last moment, carrying the key's running total after the
bucket's last call. The window arithmetic of ``sliding_log`` runs over it unchanged, so
it counts each call as if it came at the end of its bucket: in a window until the
bucket's last moment leaves it. That is never
fewer than the calls' own slots count (never over the limit), and holds a call back at
most one bucket longer. A calendar rate's buckets end at its windows' boundaries (the
end, and the margin before it), the only times its windows are read at: exact there.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from typing import Protocol

from .quota import Buckets, Period, Quota, Windows


class Counts(Protocol):
    """What the window arithmetic reads: a key's log, or one of its coarse logs."""

    @property
    def total(self) -> int: ...
    @property
    def base(self) -> int: ...
    @property
    def trimmed(self) -> int: ...
    def time_at_cum(self, target: int) -> int: ...
    def cum_through(self, t: int) -> int: ...


class Coarse:
    """A bounded rate's log: ``(slot, running total)`` entries, one per bucket at the
    bucket's last moment. The first entry is the base: every unit up to its total lies
    at or before its slot, which is before every window still read (the marker a trim
    leaves), so no separate ``base`` has to be kept. One entry per bucket from the
    window's start to the newest booked slot: about ``buckets + 3`` for a sliding rate
    (its window widened by the margin) while no call is booked further ahead."""

    __slots__ = ("cums", "times")

    def __init__(self, flat: Sequence[int]) -> None:
        """From ``[slot, total, slot, total, ...]`` (:meth:`flat`)."""
        self.times = list(flat[0::2])
        self.cums = list(flat[1::2])

    @property
    def total(self) -> int:
        return self.cums[-1]

    @property
    def base(self) -> int:
        return self.cums[0]

    @property
    def trimmed(self) -> int:  # (the base's units all lie at or before its slot)
        return self.times[0]

    def flat(self) -> list[int]:
        return [n for pair in zip(self.times, self.cums, strict=True) for n in pair]

    def time_at_cum(self, target: int) -> int:
        return self.times[bisect_left(self.cums, target)]

    def cum_through(self, t: int) -> int:
        index = bisect_right(self.times, t)
        return self.cums[index - 1] if index else self.cums[0]

    def add(self, placed: int, cost: int) -> None:
        """``cost`` more in the bucket ending at ``placed`` (a bucket before the newest
        one's end, which never comes from a slot: counted in the newest, later)."""
        if placed <= self.times[-1]:
            self.cums[-1] += cost
        else:
            self.times.append(placed)
            self.cums.append(self.cums[-1] + cost)

    def trim(self, cutoff: int) -> None:
        """Drop the entries no window from now on reads: all before the newest entry at
        or before ``cutoff``, which stays as the base."""
        index = bisect_right(self.times, cutoff) - 1
        if index > 0:
            del self.times[:index], self.cums[:index]


class Logged(Counts, Protocol):
    """What the coarse logs read of a key's log (a ``log_view.LogView``)."""

    @property
    def last(self) -> int | None: ...
    def coarse(self, name: str) -> Coarse | None: ...


def coarse_of(log: Logged, name: str) -> Coarse:
    """The key's coarse log ``name``, holding every unit the key's log holds. A key
    without one (new, or its rate just made bounded, or lost: the stores keep it with
    the meta) begins one; units it lacks (calls booked while the rate was not bounded)
    are put at the newest slot, as a lost log is repaired: never too few. Either is kept
    only when a call is booked in it (:func:`book`), on every store alike."""
    coarse = log.coarse(name)
    if coarse is None or coarse.total > log.total:
        return Coarse([0, log.total] if log.last is None else [0, 0, log.last, log.total])
    if coarse.total < log.total:
        assert log.last is not None
        coarse = Coarse(coarse.flat())  # (a copy: the stored one is left as it is)
        coarse.add(log.last, log.total - coarse.total)
    return coarse


def counted_before(log: Logged, quota: Quota, t: int, now: int) -> int | None:
    """Units before ``t`` as the coarse logs of the key's bounded rates whose windows
    still reach ``t`` count them: none more than there were (each counts a call at its
    bucket's end, never earlier), so the largest is a lower bound, which errs towards
    counting more from ``t`` on. (Such a log's base lies before every window it still
    reads, so before ``t``.) None when no bounded rate's window reaches ``t``."""
    bounds = [
        coarse_of(log, name).cum_through(t - 1)
        for name, (_, cutoff) in coarse_rates(quota, now).items()
        if cutoff < t
    ]
    return max(bounds, default=None)


def counts(log: Logged, period: Period) -> Counts:
    """The log that counts a rate: its coarse log if it is bounded, else the key's."""
    name = "" if isinstance(period, int) else period.name
    return coarse_of(log, name) if name else log


def coarse_rates(quota: Quota, now: int) -> dict[str, tuple[Buckets | Windows, int]]:
    """A quota's coarse logs by name: the period of a bounded rate counted in it, and
    the slot at or before which no window from ``now`` on reads it."""
    rates: dict[str, tuple[Buckets | Windows, int]] = {}
    for _, period in quota.limits:
        if isinstance(period, Buckets):
            rates[period.name] = (period, now - period.period_us)
        elif isinstance(period, Windows) and period.name:
            rates[period.name] = (period, period.keep_from - period.margin_us - 1)
    return rates
