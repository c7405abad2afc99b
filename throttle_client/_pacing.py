"""Pacing: what a limiter knows of its store's clock, and whether a call is on time.

A slot is a time on the store's clock; a call sleeps on its own. :class:`Pacing` keeps
the estimate that relates the two (a :class:`~throttle_client._store_clock.StoreClock`
for the store's answers, another for ``on_unavailable``'s) and the latest round trip,
and judges how late a call that woke is, as the upstream would see its arrival.
"""

from __future__ import annotations

import logging
import math
import threading
import time

from ._store_clock import DRIFT, StoreClock

US = 1_000_000
log = logging.getLogger("throttle_client")

# Answers after which a store whose time is still known less precisely than the margin
# is taken to be that far for good (see Pacing.late_by).
WARM_UP = 8

# Round trips whose shortest bounds how fast an answer comes back (Pacing.observe): a
# busy moment, or a queue, is rarely as long as this many calls in a row.
TRIPS = 32


class Pacing:
    """The clock estimate and round trip of one limiter (shared by its threads: each
    update is one assignment, and any recent value will do)."""

    def __init__(self, injected: bool) -> None:
        # With an injected clock the store runs on that very clock: no drift between them.
        drift = 0.0 if injected else DRIFT
        self.injected = injected
        self.store = StoreClock(drift=drift)  # answers from the store
        self.host = StoreClock(drift=drift)  # answers from on_unavailable
        # How long the latest answer took to come back once the store had decided
        # (seconds): its round trip, less any wait before the call went out (a queue
        # behind busy connections), which says nothing of how late a slot due at the
        # store's decision is read here.
        self.rtt = 0.0
        # The latest round trips, whole: the shortest of them is the least an answer
        # may take (see observe). A tuple, replaced whole as the other fields are: a
        # thread that reads it never sees it change under it.
        self._trips: tuple[float, ...] = ()
        self._warned = threading.Event()

    def cold(self) -> bool:
        """Whether no answer has come yet: the next also waits for a connection to open
        and the script to load, so its round trip says nothing of the store's."""
        return not self.injected and not self.store.answers

    def observe(
        self, from_store: bool, sent: float, now: float, store_now_us: int, timed: bool = True
    ) -> StoreClock:
        """Learn from an answer asked at local ``sent``, read at ``now``; its StoreClock.
        ``timed``: its round trip is the store's (not a first call's, which opened the way)."""
        clock = self.store if from_store else self.host
        clock.observe(sent, now, store_now_us / US)
        if from_store and timed:
            # The store decided at store_now; the tightest bracket known says by when,
            # at most, its answer was read here. (A call that queued behind the others
            # had a longer round trip, not a later answer.) Never less than the
            # shortest recent round trip: a store clock that stepped ahead by less than
            # a round trip (or a failover to one that far ahead) is not seen as a new
            # clock, and the bracket would then take the step off the answer's way back.
            trip = now - sent
            trips = self._trips = (*self._trips[1 - TRIPS :], trip)
            self.rtt = min(trip, max(clock.late_by(store_now_us / US, now), min(trips)))
        return clock

    def store_time_us(self, now: float) -> int:
        """The store's time at local time ``now``, as well as it is known."""
        if self.injected:  # the store follows the injected clock
            return round(now * US)
        clock = self.store
        if clock.answers:
            return round((now + (clock.low(now) + clock.high(now)) / 2) * US)
        return round(time.time() * US)

    def late_by(
        self, clock: StoreClock, slot: float, now: float, rebook_if_unsure: bool, margin: float
    ) -> float:
        """How far past ``slot`` a call at local time ``now`` may be, on the store's clock.

        When the store's time is known less precisely than the margin (a round trip
        longer than the margin), no call can be proven on time. Over the first answers
        (a cold connection, a burst of tasks starting together) an acquire whose answer
        came back too late to tell counts as late: it books again, a round trip ahead,
        and its answer tightens what is known (a try_acquire is not refused for its
        cold start, nor a call for the blur of a wake-up). A store that stays that far
        (WARM_UP answers on) cannot be helped by booking again: the most hopeful
        estimate is used instead, and a warning says to widen the margin.
        """
        late = clock.late_by(slot, now)
        spread = clock.spread(now)
        if spread <= margin or (rebook_if_unsure and clock.answers < WARM_UP):
            return late
        if clock.answers >= WARM_UP:
            self.warn_slow(late, clock.width(), margin)
        return late - spread

    def warn_slow(self, late: float, rtt: float, margin: float) -> None:
        """Say once that this process's calls cannot be held within the margin."""
        if self._warned.is_set():
            return
        self._warned.set()
        log.warning(
            "the store is too slow for margin=%.1f ms: its round trip takes %.1f ms and "
            "calls reach their slots up to %.1f ms late, so arrivals cannot be held "
            "within the margin (the slots still are); widen the margin to at least "
            "%.0f ms, or bring the store closer",
            margin * 1000,
            rtt * 1000,
            late * 1000,
            math.ceil(max(late, rtt) * 1000 * 1.5),
        )
