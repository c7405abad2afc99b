"""What limiters answer: a Decision per call, a Usage per look at a key."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    ``key``: the key a pool's call took (``acquire_any``): the one whose slot was
    earliest; None for a call on one key. (Not in the repr: a key is a token.)

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
    key: str | None = field(default=None, repr=False)  # (a token: never in a repr)
    # For Limiter.learn (not part of the answer): the slot in whole µs, and the running
    # total a limit learned from this call's response counts from (-1: not marked).
    _slot_us: int = field(default=-1, repr=False, compare=False)
    _mark: int = field(default=-1, repr=False, compare=False)
    _born: int = field(default=-1, repr=False, compare=False)  # when the mark's key began

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
    ``resets_at``: a calendar rate: when the window that holds now ends (epoch seconds,
    the store's clock), where ``used`` starts again from 0; None for a sliding rate.
    """

    rate: Rate
    used: int
    booked: int
    remaining: int
    resets_in: float
    resets_at: float | None = None


@dataclass(frozen=True)
class LearnedLimit:
    """A limit learned from the upstream's headers, held in the store for every worker
    until the upstream's reset: at most ``limit`` units in the slots it counts (from the
    slot of the request whose response said it, less the margin, on: ``used``, booked
    slots included), until ``resets_at`` (epoch seconds, the store's clock)."""

    limit: int
    used: int
    resets_at: float


@dataclass(frozen=True)
class UpstreamView:
    """The last quota headers this process read for a key: ``remaining`` units until
    ``resets_at`` (epoch seconds), out of ``limit`` (None when not said), and whether
    that was ``stricter`` than the limiter's own rates at the time (then it became the
    key's :class:`LearnedLimit`; a looser view never raises a configured limit)."""

    remaining: int
    resets_at: float
    limit: int | None
    stricter: bool


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
    # A limit learned from the upstream in force for the key (from the store, so every
    # worker's), and the last quota headers this process read for it; None when none.
    learned: LearnedLimit | None = None
    upstream: UpstreamView | None = None
