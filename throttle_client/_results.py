"""What limiters answer: a Decision per call, a Usage per look at a key."""

from __future__ import annotations

from dataclasses import dataclass

from ._rate import Rate


@dataclass(frozen=True)
class Decision:
    """The answer to ``try_acquire`` / ``acquire``.

    ``allowed``: the call was admitted (``acquire`` only ever returns admitted ones).
    ``retry_after``: for a refusal, seconds until the same call would be admitted.
    ``waited``: seconds ``acquire`` slept until its slot (0 for ``try_acquire``).
    ``slot``: the admitted (or next possible) slot, in the store's clock, epoch seconds.
    ``remaining``: per rate, in the order of ``rates``, the units still free in the
    window that ends at the slot (at now, for a refusal).
    ``paused_until``: an upstream pause in force (epoch seconds), or None.
    ``late_wakeups``: how many slots this call booked and gave up because it woke (or
    heard back) more than the limiter's ``margin`` after them; each stays booked, unused.

    A Decision is truthy when the call was admitted::

        if limiter.try_acquire(token):
            send()
    """

    allowed: bool
    retry_after: float
    waited: float
    slot: float
    cost: int
    remaining: tuple[int, ...]
    rates: tuple[Rate, ...]
    paused_until: float | None
    late_wakeups: int = 0

    def __bool__(self) -> bool:
        return self.allowed


@dataclass(frozen=True)
class RateUsage:
    """One rate of a key, at the moment ``usage()`` looked.

    ``used``: units admitted in slots up to now that are still in the window.
    ``booked``: units in slots booked ahead by waiting ``acquire`` calls (the same
    number for every rate of the key: those slots are not in any window yet).
    ``remaining``: units of ``rate.limit`` neither used nor booked (never below 0).
    ``resets_in``: seconds until a call of cost 1 could go as far as this rate is
    concerned (0: now); ``Usage.next_slot_in`` adds the other rates, the minimum
    interval, the queue of booked slots and any pause.
    """

    rate: Rate
    used: int
    booked: int
    remaining: int
    resets_in: float


@dataclass(frozen=True)
class Usage:
    """A read-only look at a key: per-rate usage, when a call of cost 1 could next go
    (``next_slot_in`` seconds from now, everything counted), and any pause in force."""

    rates: tuple[RateUsage, ...]
    next_slot_in: float
    paused_for: float
    paused_until: float | None
    # A limiter with max_concurrent: the key's calls in flight (leases held) and the
    # calls waiting for room, across every worker; None without a cap.
    in_flight: int | None = None
    waiting: int | None = None
