"""What this process knows of the store's clock: enough to wake on time, and to know
when it woke too late.

Slots are times on the store's clock (Redis: ``TIME``); a worker sleeps on its own
monotonic clock. Each answer is stamped with the store's time, and the store
answered between our send and our receipt, so each answer brackets the offset
``store - local`` in ``[store_now - received, store_now - sent]``. The tightest
brackets seen are kept. An old bracket is widened by the most two clocks can drift
apart since it was taken (``DRIFT``), so it never claims more than it knows.

Waking at ``slot - low`` never wakes before the slot on the store's clock; at local
time ``t`` the store's clock reads at most ``t + high``, so ``t + high - slot`` bounds
how late a call is. Both answers are exact when the limiter's clock is the store's
(an injected clock): then every bracket has width zero.
"""

from __future__ import annotations

# 500 ppm: the fastest rate at which NTP slews a clock, so two disciplined clocks drift
# apart no faster than this (about 2 ms per 4 s); a fresh bracket arrives with every call.
DRIFT = 5e-4
ROUNDING = 2e-6  # whole µs, and float seconds since the epoch (a quarter µs apart)


class StoreClock:
    """The tightest known bracket of ``store time - local time``, in seconds.

    Shared by every thread and task of a limiter without a lock: each bracket is one
    tuple, replaced whole, so a race can only keep a looser one for a call.
    """

    __slots__ = ("_drift", "_high", "_low", "answers")

    def __init__(self, *, drift: float = DRIFT) -> None:
        self._drift = drift  # 0 when the store follows this very clock (an injected one)
        self.answers = 0  # how many were observed (racy under threads: a rough count)
        self._low: tuple[float, float] | None = None  # (offset, local time it was taken)
        self._high: tuple[float, float] | None = None

    def observe(self, sent: float, received: float, store_now: float) -> None:
        """One answer stamped ``store_now`` (store seconds), asked at local ``sent``,
        read at local ``received``."""
        self.answers += 1
        low, high = (store_now - received, received), (store_now - sent, sent)
        if (
            self._low is None
            or self._high is None
            # An answer outside what is known: the store's clock stepped, or another
            # clock answered (a failover, another Cluster node). What was known is wrong.
            # (Beyond ROUNDING: times are whole µs of the store and float seconds here.)
            or low[0] > self.high(received) + ROUNDING
            or high[0] < self.low(sent) - ROUNDING
        ):
            self._low, self._high = low, high
            self.answers = 1  # a new clock: its warm-up starts again
            return
        if low[0] >= self.low(received):
            self._low = low
        if high[0] <= self.high(sent):
            self._high = high

    def low(self, now: float) -> float:
        """The store's clock is at least ``now + low(now)`` at local time ``now``."""
        assert self._low is not None, "observe() an answer first"
        offset, at = self._low
        return offset - self._drift * abs(now - at)

    def high(self, now: float) -> float:
        """The store's clock is at most ``now + high(now)`` at local time ``now``."""
        assert self._high is not None, "observe() an answer first"
        offset, at = self._high
        return offset + self._drift * abs(now - at)

    def width(self) -> float:
        """How wide the bracket was when taken: what a read of the store's time can give."""
        assert self._low is not None and self._high is not None, "observe() an answer first"
        return self._high[0] - self._low[0]

    def spread(self, now: float) -> float:
        """How wide the bracket is at local time ``now``: the uncertainty of the store's time."""
        return self.high(now) - self.low(now)

    def wake_at(self, slot: float) -> float:
        """The earliest local time at which the store's clock has surely reached ``slot``."""
        assert self._low is not None, "observe() an answer first"
        # The bracket is aged to the moment of waking, which is about slot - offset.
        return slot - self.low(slot - self._low[0])

    def late_by(self, slot: float, now: float) -> float:
        """At most how far past ``slot`` the store's clock is at local time ``now``."""
        return now + self.high(now) - slot

    def __repr__(self) -> str:
        if self._low is None or self._high is None:
            return "StoreClock(unknown)"
        return f"StoreClock(offset in [{self._low[0]:.6f}, {self._high[0]:.6f}] s)"
