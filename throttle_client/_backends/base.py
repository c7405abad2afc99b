"""The backend contract: what a limiter asks of a store, and what comes back.

Everything here is in whole microseconds and already carries the *hashed* store
key: a backend never sees an access token. A store answers five operations
(:class:`Acquire`, :class:`AcquireAll` for several keys at once, :class:`Inspect`,
:class:`Pause`, :class:`Reset`) with exactly the semantics of docs/design.md §1, each
in one atomic step. A blocking store
subclasses :class:`Backend` (``execute``/``close``), an asyncio one
:class:`AsyncBackend` (``aexecute``/``aclose``): the two worlds have distinct
method names, so a limiter tells them apart by type, never by inspecting methods.

:class:`Verdict` and :class:`Snapshot` are the store's raw answers, in µs since the
epoch on the store's clock; the limiter turns them into the public
:class:`~throttle_client.Decision` and :class:`~throttle_client.Usage`, in seconds.
"""

from __future__ import annotations

import abc
import asyncio
import contextvars
import functools
import inspect
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeGuard, TypeVar

from .._errors import ConfigurationError
from .doorbell import Doorbell
from .history import HistorySpec

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
B = TypeVar("B", bound="Backend")
A = TypeVar("A", bound="AsyncBackend")


@dataclass(frozen=True)
class Windows:
    """A calendar rate's fixed windows, as far as the limiter computed them (issue 11).

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
    # unless its holder renews it (docs/design.md §1, "Concurrency caps").
    max_concurrent: int = 0
    lease_ttl_us: int = 0

    @property
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


class Op(Generic[T_co]):
    """An operation on one key's log whose answer is a ``T_co``."""

    __slots__ = ()
    key: str  # the hashed store key
    now_us: int | None  # the time to run at (tests inject one); None: the store's clock

    def time_us(self, clock: Callable[[], float] = time.time) -> int:
        """When the operation runs: the time it carries, else the host's clock (a store
        with a clock of its own, Redis, reads that instead)."""
        return self.now_us if self.now_us is not None else int(clock() * 1_000_000)


# A NamedTuple, not a frozen dataclass: one is made for every decision, and a tuple is
# built in a fifth of the time (a decision's Python time is what issue 13 cuts).
class Verdict(NamedTuple):
    """The answer to :class:`Acquire`."""

    allowed: bool
    now_us: int
    slot_us: int
    pause_until_us: int
    remaining: tuple[int, ...]
    # A capped call that found a key full and was queued (``slot_us`` is then when to
    # look again if nothing wakes it: the earliest a holder's lease can expire), and
    # whether it heads every queue it is in; ``full``: refused or queued for a full cap.
    waiting: bool = False
    head: bool = False
    full: bool = False
    # The calendar windows the limiter gave do not reach ``slot_us``, a time the decision
    # needs (the store's now, or a slot): nothing was written; ask again with windows there.
    stale: bool = False
    # An admitted call that asked for it (Acquire.mark_us): the running total of the
    # (first) key's entries before its slot less mark_us; -1: not asked. ``born``: when
    # that key's running totals began (a key forgotten and begun again counts from 0).
    mark: int = -1
    born: int = -1
    # Each key's life, in the order of the call's keys: when its log began, and its running
    # total after this call (a worker that sends them back as Acquire.expect and
    # Acquire.seen learns if the store lost the key, or its latest calls, since).
    lives: tuple[int, ...] = ()
    totals: tuple[int, ...] = ()
    # This call found a key of it that had lost its history, and held it (see Acquire).
    lost: bool = False


@dataclass(frozen=True)
class Snapshot:
    """The answer to :class:`Inspect`: the log seen at ``now_us``, unchanged."""

    now_us: int
    next_slot_us: int
    pause_until_us: int
    booked: int  # units in slots after now
    used: tuple[int, ...]  # per rate, units in slots in the window (now - period, now]
    ready_at_us: tuple[int, ...]  # per rate, when a call of cost 1 fits it (>= now)
    in_flight: int = 0  # a capped key: leases held (unexpired)
    waiting: int = 0  # a capped key: live tickets queued
    stale: bool = False  # the calendar windows given do not hold ``now_us``: ask again
    # A learned limit in force (see Learn): (its limit, the units it counts, its end µs).
    learned: tuple[int, int, int] | None = None


class StoreCard(NamedTuple):
    """A key's card (``_cards``) that a decision writes beside its key, in the same
    atomic step; it lasts as long as the key, and ``ttl_us`` at least."""

    key: str  # the store key
    text: str
    ttl_us: int


@dataclass(frozen=True)
class Acquire(Op[Verdict]):
    """Find the earliest slot for ``cost``; book it if it is at most ``max_wait_us`` away.

    ``max_wait_us`` of 0 is try_acquire, -1 waits for any slot. ``call_id`` makes the
    call idempotent: a call whose id is already in the log gets its booked slot back.
    ``lead_us``: no slot earlier than ``now + lead_us`` (a call whose answers come back
    slowly asks for a slot its answer can reach in time).
    """

    key: str
    quota: Quota
    cost: int
    max_wait_us: int
    call_id: str
    now_us: int | None = None
    lead_us: int = 0
    # >= 0: the answer marks where a limit learned from this call's response would count
    # from (Verdict.mark): the running total through its slot less this (the margin).
    mark_us: int = -1
    cards: tuple[StoreCard, ...] = ()  # written with the decision, whatever it is
    history: tuple[HistorySpec, ...] = ()  # where a call it books is counted (history.py)
    # The key's life as this worker last saw it (Verdict.lives), while its own bookings
    # must still be in the log; -1: none; and the running total it saw (Verdict.totals).
    # A key begun afresh since (not at a reset, not rebuilt from its log) lost its
    # history, one that counts fewer units lost its latest calls: the store holds it, as
    # if every window had been full when it began again (or now), while they count.
    expect: int = -1
    seen: int = -1


@dataclass(frozen=True)
class Charge:
    """One key of a stacked acquire: its store key, its quota, and the cost charged to it;
    ``expect`` and ``seen`` as :class:`Acquire`'s."""

    key: str
    quota: Quota
    cost: int
    expect: int = -1
    seen: int = -1


@dataclass(frozen=True)
class AcquireAll(Op[Verdict]):
    """:class:`Acquire` for several keys at once, all or nothing (issue 10, in progress).

    One slot for every key: the earliest that each key's quota, gap and pause allow
    (past a key's newest slot, when a cost fits only grows later, so it is the latest of
    each key's earliest slot). Booked in every key's log in one atomic step, or, when it
    is more than ``max_wait_us`` away, written nowhere. ``call_id`` is booked in every
    log; a call whose id is in the first key's log gets its slot back. The answer's
    ``remaining`` lists each key's rates in turn; ``pause_until`` is the latest pause.
    """

    charges: tuple[Charge, ...]
    max_wait_us: int
    call_id: str
    now_us: int | None = None
    lead_us: int = 0
    # The lease a capped call holds (or waits for) on its capped keys: the first call
    # id of the call, kept when it books again (a late wake-up) so it never holds two.
    lease_id: str = ""
    mark_us: int = -1  # as Acquire's, for the first key
    cards: tuple[StoreCard, ...] = ()  # as Acquire's
    history: tuple[HistorySpec, ...] = ()  # as Acquire's, for each key that keeps one

    def __post_init__(self) -> None:
        keys = [charge.key for charge in self.charges]
        if not keys or len(set(keys)) != len(keys):
            raise ConfigurationError(
                f"a call is charged to one key twice (store keys {keys}): a stacked call "
                "needs distinct keys, so each of its limiters needs its own key or namespace"
            )

    @property
    def key(self) -> str:  # type: ignore[override]
        """The first key: where a retried call's id is looked for."""
        return self.charges[0].key


@dataclass(frozen=True)
class _OnLease:
    """What ends or renews a lease names: the call's keys, and the lease."""

    charges: tuple[Charge, ...]
    lease_id: str
    now_us: int | None = None
    # A renewal's: a call in flight longer than its keys' windows keeps their cards.
    cards: tuple[StoreCard, ...] = ()

    @property
    def key(self) -> str:
        return self.charges[0].key


@dataclass(frozen=True)
class Release(_OnLease, Op[None]):  # type: ignore[override]  # key: a property
    """End lease ``lease_id`` on the capped keys of ``charges`` (held or still waited
    for); the capacity it frees goes to the next waiters, in order. Idempotent: a lease
    already released or expired frees nothing, least of all another's."""


@dataclass(frozen=True)
class Renew(_OnLease, Op[bool]):  # type: ignore[override]  # key: a property
    """Extend lease ``lease_id`` by each key's lease TTL. False if some key had lost
    it (it expired, or the store lost it): it is held again, even over the cap, since
    the call it stands for is in flight."""


@dataclass(frozen=True)
class Inspect(Op[Snapshot]):
    key: str
    quota: Quota
    now_us: int | None = None


@dataclass(frozen=True)
class ReadHistory(Op[dict[str, int]]):
    """A key's usage history as the store keeps it (``history.py``): field -> count."""

    key: str
    now_us: int | None = None


@dataclass(frozen=True)
class Pause(Op[int]):
    """No slot before ``now + duration_us``; answers the pause in force (µs since the epoch).

    A transport's pause says why (``reason``: the header, or "backoff"), and whether the
    response refused the call (``refused``: a 429); the store keeps both as the key's
    pushback (:class:`Pushback`)."""

    key: str
    quota: Quota
    duration_us: int
    now_us: int | None = None
    reason: str = ""
    refused: bool = False
    cards: tuple[StoreCard, ...] = ()  # as Acquire's: a pause outlasts the card's TTL


def namespace_prefix(namespace: str | None) -> str:
    """What the store keys of ``namespace`` begin with ("" for any): ``<namespace>:{``
    (a namespace holds no brace, so no other namespace's keys begin so)."""
    return "" if namespace is None else f"{namespace}:{{"


def history_cost(op: Acquire | AcquireAll, store_key: str) -> int:
    """The cost a call charges to ``store_key``, one of its keys (its usage history)."""
    if isinstance(op, Acquire):
        return op.cost
    return next(charge.cost for charge in op.charges if charge.key == store_key)


# The refusals a key's pushback counts: in steps of 10 s, the last 6 (a minute).
PUSHBACK_STEP_US = 10_000_000
PUSHBACK_STEPS = 6


class Pushback(NamedTuple):
    """What the upstream told the transports about a key lately, as the store keeps it:
    the ``reason`` of the pause in force that one of them set (the header it read, or
    "backoff"; None when no such pause is in force), and the calls it ``refused`` (429)
    in the last minute, counted in steps of 10 seconds."""

    reason: str | None
    refused: int
    until: float | None = None  # the end of that pause (epoch seconds), to match it


def pushback_step(now_us: int) -> int:
    return now_us // PUSHBACK_STEP_US


def refused_lately(steps: dict[int, int], now_us: int) -> int:
    """The refusals counted in the steps of the last minute."""
    newest = pushback_step(now_us)
    return sum(n for step, n in steps.items() if newest - PUSHBACK_STEPS < step <= newest)


def pushed_back(
    record: tuple[str, int, dict[int, int]], op: Pause, pause_until: int, now: int
) -> tuple[str, int, dict[int, int]]:
    """A key's pushback as a store keeps it (the reason of the transports' pause in
    force, its end, the refusals per step), after a transport's pause ``op`` at ``now``
    that left ``pause_until`` in force."""
    reason, until, steps = record
    if op.reason and pause_until == now + op.duration_us:  # (this pause is in force)
        reason, until = op.reason, pause_until
    if op.refused:
        step = pushback_step(now)
        steps = {s: n for s, n in steps.items() if s > step - PUSHBACK_STEPS}
        steps[step] = steps.get(step, 0) + 1
    return reason, until, steps


def pushback_at(reason: str, until_us: int, steps: dict[int, int], now_us: int) -> Pushback | None:
    """A key's pushback as it stands at ``now_us``, from what a store keeps (the reason
    of the transports' pause, its end, the refusals per step); None if nothing holds."""
    if until_us > now_us and reason:
        return Pushback(reason, refused_lately(steps, now_us), until_us / 1e6)
    said = Pushback(None, refused_lately(steps, now_us))
    return said if said.refused else None


@dataclass(frozen=True)
class Learn(Op[None]):
    """What the upstream's headers said of a key, when stricter than its quota (issue 11
    §2): at most ``limit`` units in the slots from ``since_us`` up to ``until_us``, the
    upstream's reset. Every decision of the key holds to it until then, on top of its
    rates. The newest report (the latest ``since_us``) replaces an older one.

    ``from_cum``: the key's running total through ``since_us - 1`` as the answered call's
    admission marked it (Verdict.mark): it counts from there whatever has been trimmed
    since. -1: unknown; the store reads it from the log, and ignores the report if the
    log may have lost entries from ``since_us`` on."""

    key: str
    quota: Quota
    since_us: int
    until_us: int
    limit: int
    now_us: int | None = None
    from_cum: int = -1
    born: int = -1  # Verdict.born of the mark: a mark of another life of the key counts all
    cards: tuple[StoreCard, ...] = ()  # as Pause's


@dataclass(frozen=True)
class Reset(Op[None]):
    key: str
    now_us: int | None = None


@dataclass(frozen=True)
class Fingerprint(Op[str]):
    """Keep ``fingerprint`` (of the key secret its limiters hash keys with) as the record
    ``key`` of a namespace, unless it holds one already, for ``ttl_us`` more; answers the
    fingerprint the record holds. Workers whose secrets differ hash one token to two keys,
    each with a quota of its own: the limiter that finds another fingerprint says so."""

    key: str  # the namespace's record (namespace_record)
    fingerprint: str
    ttl_us: int  # 0: only read the record
    now_us: int | None = None


# How long a namespace's record of its key secret lives (µs), renewed by each limiter
# made: a fleet that starts a worker a month apart still finds its secret told.
RECORD_TTL_US = 30 * 86_400 * 1_000_000


def namespace_record(namespace: str) -> str:
    """The store key of a namespace's record: no store key of a limiter's is like it (a
    hash tag of 22 characters follows its namespace's colon)."""
    return f"{namespace}:{{record}}"


def host_clock(clock: Callable[[], float] | None, backend: str) -> Callable[[], float]:
    """The clock a store that has none of its own reads: the host's. ``clock`` is the
    deprecated way to set another; a limiter's ``clock`` now reaches every store."""
    if clock is None:
        return time.time
    warnings.warn(
        f"{backend}(clock=...) is deprecated: give the clock to the Limiter, which "
        "passes its time to the store with every operation",
        DeprecationWarning,
        stacklevel=3,
    )
    return clock


# What ping() asks: a read of a key no limiter uses (no namespace holds braces but ours,
# and ours are followed by a colon-free hash), under a quota that cannot be refused.
_PING = Inspect(
    key="throttle-client:{ping}", quota=Quota(limits=((1, 1_000_000),), min_interval_us=0)
)


def _checked(store_key: str) -> str:
    if not isinstance(store_key, str) or not store_key:
        raise ConfigurationError(f"a store key must be a non-empty string, not {store_key!r}")
    return store_key


class Backend(abc.ABC):
    """A blocking store for a :class:`~throttle_client.Limiter`.

    A subclass answers every operation in ``execute``, atomically for every worker
    that shares the store. It is a context manager: leaving the block closes it.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if inspect.iscoroutinefunction(cls.__dict__.get("execute")):
            raise TypeError(
                f"{cls.__name__}.execute is a coroutine function: an asyncio store "
                "subclasses AsyncBackend and defines aexecute"
            )

    @abc.abstractmethod
    def execute(self, op: Op[T]) -> T:
        """Run ``op`` in one atomic step and answer it."""

    def forget(self, store_key: str) -> None:
        """Forget everything about one key, named by its store key (``Limiter.store_key``,
        :func:`throttle_client.store_key`), whatever rates it was used with."""
        self.execute(Reset(key=_checked(store_key)))

    def cards(self, store_keys: Sequence[str]) -> dict[str, str]:
        """The cards kept beside these keys (``_cards``): store key -> card, for the keys
        that have one."""
        raise NotImplementedError(f"{type(self).__name__} keeps no cards of its keys")

    def all_cards(self, namespace: str | None = None) -> Iterator[tuple[str, str]]:
        """Every key's card in the store (store key, card), of ``namespace`` or of any,
        read in steps of bounded cost, in no order; a key written meanwhile may be
        missed or given twice."""
        raise NotImplementedError(f"{type(self).__name__} keeps no cards of its keys")

    def pushback(self, store_keys: Sequence[str]) -> dict[str, Pushback]:
        """The pushback of these keys (:class:`Pushback`), for those that have any in
        force: a pause a transport set, or refusals in the last minute."""
        raise NotImplementedError(f"{type(self).__name__} keeps no pushback of its keys")

    def ping(self) -> None:
        """Raise BackendUnavailable or BackendError if the store cannot be used; changes
        nothing in it."""
        self.execute(_PING)

    def fingerprint(self, namespace: str, value: str, keep: bool = True) -> str | None:
        """Keep ``value``, the fingerprint of a limiter's key secret, as ``namespace``'s
        record unless it holds one (:class:`Fingerprint`); answers the one it holds (with
        ``keep`` False, only answers: a read writes nothing). None: this store keeps no
        such record, and no limiter can learn that its workers hash with different
        secrets."""
        return None

    @functools.cached_property
    def doorbell(self) -> Doorbell:
        """How this process's waiters for a capped key hear that they were granted a
        lease (see ``doorbell``). A store that never rings it still works: its waiters
        look again on their own, later."""
        return Doorbell()

    def check_together(self, store_keys: list[str]) -> None:  # noqa: B027 (most fit all)
        """Raise ConfigurationError if one atomic step cannot hold these keys (a Redis
        Cluster: keys in different hash slots). Every key fits by default."""

    def to_async(self) -> AsyncBackend:
        """The same store for an :class:`~throttle_client.AsyncLimiter`: by default each
        operation runs in a worker thread (:class:`ThreadedAsync`), as it may block."""
        return ThreadedAsync(self)

    def close(self) -> None:  # noqa: B027 (a store with nothing to let go keeps this one)
        """Let go of this process's connections or files; a later operation may open
        new ones."""

    def __enter__(self: B) -> B:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncBackend(abc.ABC):
    """An asyncio store for an :class:`~throttle_client.AsyncLimiter`.

    A subclass answers every operation in ``aexecute``; ``async with`` closes it.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        aexecute = cls.__dict__.get("aexecute")
        if aexecute is not None and not inspect.iscoroutinefunction(aexecute):
            raise TypeError(
                f"{cls.__name__}.aexecute must be a coroutine function (async def); a "
                "blocking store subclasses Backend and defines execute"
            )

    @abc.abstractmethod
    async def aexecute(self, op: Op[T]) -> T:
        """Run ``op`` in one atomic step and answer it."""

    async def aforget(self, store_key: str) -> None:
        """As :meth:`Backend.forget`."""
        await self.aexecute(Reset(key=_checked(store_key)))

    async def aping(self) -> None:
        """As :meth:`Backend.ping`."""
        await self.aexecute(_PING)

    async def afingerprint(self, namespace: str, value: str, keep: bool = True) -> str | None:
        """As :meth:`Backend.fingerprint`."""
        return None

    @functools.cached_property
    def doorbell(self) -> Doorbell:
        """As :attr:`Backend.doorbell`."""
        return Doorbell()

    def check_together(self, store_keys: list[str]) -> None:  # noqa: B027
        """As :meth:`Backend.check_together`."""

    async def aclose(self) -> None:  # noqa: B027
        """Let go of this process's connections."""

    async def __aenter__(self: A) -> A:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class InlineAsync(AsyncBackend):
    """An AsyncBackend over a store whose ``execute`` never blocks (memory)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    @property
    def doorbell(self) -> Doorbell:
        return self.backend.doorbell

    async def aexecute(self, op: Op[T]) -> T:
        return self.backend.execute(op)

    async def afingerprint(self, namespace: str, value: str, keep: bool = True) -> str | None:
        return self.backend.fingerprint(namespace, value, keep)

    async def aclose(self) -> None:
        self.backend.close()

    def __repr__(self) -> str:
        return f"InlineAsync({self.backend!r})"


class ThreadedAsync(AsyncBackend):
    """An AsyncBackend over a store whose ``execute`` may block (SQLite waiting on a lock).

    Writes run on one thread of their own, in the order they were asked (they would
    take turns at the store's write lock anyway), and reads on two others, so a read
    (the look for a pause before a request goes) never queues behind a thousand
    tasks' bookings, as it would in asyncio's shared default pool.
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._pools: tuple[int, ThreadPoolExecutor, ThreadPoolExecutor] | None = None
        self._lock = threading.Lock()

    @property
    def doorbell(self) -> Doorbell:
        return self.backend.doorbell

    def _pool(self, read: bool) -> ThreadPoolExecutor:
        with self._lock:
            # Threads do not cross a fork: a child makes its own pools.
            if self._pools is None or self._pools[0] != os.getpid():
                writer = ThreadPoolExecutor(1, thread_name_prefix="throttle-client-write")
                readers = ThreadPoolExecutor(2, thread_name_prefix="throttle-client-read")
                self._pools = (os.getpid(), writer, readers)
            return self._pools[2] if read else self._pools[1]

    async def aexecute(self, op: Op[T]) -> T:
        pool = self._pool(isinstance(op, Inspect))
        run = functools.partial(contextvars.copy_context().run, self.backend.execute, op)
        return await asyncio.get_running_loop().run_in_executor(pool, run)

    async def afingerprint(self, namespace: str, value: str, keep: bool = True) -> str | None:
        record = functools.partial(self.backend.fingerprint, namespace, value, keep)
        return await asyncio.get_running_loop().run_in_executor(self._pool(False), record)

    def shutdown(self) -> None:
        """Let this process's threads go (a later operation starts new ones)."""
        with self._lock:
            pools, self._pools = self._pools, None
        if pools is not None and pools[0] == os.getpid():
            pools[1].shutdown(wait=False)
            pools[2].shutdown(wait=False)

    async def aclose(self) -> None:
        """Stop the threads and close the store they ran on."""
        self.shutdown()
        self.backend.close()

    def __repr__(self) -> str:
        return f"ThreadedAsync({self.backend!r})"
