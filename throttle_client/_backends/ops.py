"""The operations a limiter asks of a store, each one atomic step.

Every operation is in whole microseconds and already carries the *hashed* store key: a
backend never sees an access token. An ``Op[T]`` is answered by a ``T``
(:mod:`.answers`); a key is held to its :class:`~.quota.Quota`.

Two words recur. A key's *running total* counts every unit its log admitted since the key
began; when it began is the key's *born* time (a key forgotten or expired and used again
is born anew, its running total from 0). A *mark* is the running total up to an admitted
call's slot less the margin, which its answer reports (``Acquire.mark_us``), so that a
limit learned from that call's response counts only the units booked after it
(:class:`Learn`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

from .._errors import ConfigurationError
from .answers import Snapshot, Verdict
from .history import HistorySpec
from .quota import Quota

T_co = TypeVar("T_co", covariant=True)


class Op(Generic[T_co]):
    """An operation on one key's log whose answer is a ``T_co``."""

    __slots__ = ()
    key: str  # the hashed store key
    now_us: int | None  # the time to run at (tests inject one); None: the store's clock

    def time_us(self, clock: Callable[[], float] = time.time) -> int:
        """When the operation runs: the time it carries, else the host's clock (a store
        with a clock of its own, Redis, reads that instead)."""
        return self.now_us if self.now_us is not None else int(clock() * 1_000_000)


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
    call idempotent: a ``retry`` (an attempt sent again after one whose answer did not
    come) whose id is already in the log gets its booked slot back. A first attempt's id
    is new, so a store may look for it only when ``retry`` says so (Redis does: the id
    lives in its entry, found by a scan of the last KEEP_IDS_US). ``lead_us``: no slot
    earlier than ``now + lead_us`` (a call whose answers come back slowly asks for a slot
    its answer can reach in time).
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
    retry: bool = False


class Choice(NamedTuple):
    """A key of a pool other than the first (:class:`AcquireAny`): what differs from
    the first's :class:`Acquire` fields."""

    key: str
    expect: int = -1
    seen: int = -1
    history: tuple[HistorySpec, ...] = ()


@dataclass(frozen=True)
class AcquireAny(Acquire):
    """:class:`Acquire` on one of several keys of one quota (a pool of tokens): the key
    whose slot is earliest (of equal ones, the one whose newest booking is the oldest,
    then the first; ``sliding_log.choose``), booked in that key's log alone, in one
    atomic step with the choice. The Acquire fields are the first key's, and the call's
    (the cost, the wait, the call id); ``others`` the other keys'. The answer says which
    key it took (``Verdict.chosen``, 0 for the first), and is that key's
    :class:`Acquire` answer; a ``retry`` takes the key whose log holds its id. The
    ``cards`` are every key's that are due, written whatever the choice.

    ``partners``: keys the call is charged to as well, whichever key it takes (``also=``:
    an account its tokens share), with the usage histories they keep
    (``partner_history``). Then the call takes the key whose :class:`AcquireAll` with
    them has the earliest slot, and that is the call it makes (``choice``)."""

    others: tuple[Choice, ...] = ()
    partners: tuple[Charge, ...] = ()
    partner_history: tuple[HistorySpec, ...] = ()

    def __post_init__(self) -> None:
        keys = self.keys
        if len(set(keys)) != len(keys):
            raise ConfigurationError(
                f"a pool holds one key twice (store keys {list(keys)}): give each token once"
            )
        every = self.all_keys
        twice = [key for index, key in enumerate(every) if key in every[:index]]
        if twice:
            raise ConfigurationError(
                f"a pool's call is charged to one key twice (store key {twice[0]}): also= "
                "must name keys other than the pool's, each once"
            )

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.key, *(other.key for other in self.others))

    @property
    def all_keys(self) -> tuple[str, ...]:
        """The pool's keys, then its partners'."""
        return (*self.keys, *(partner.key for partner in self.partners))

    def choice(self, index: int) -> Acquire | AcquireAll:
        """The call on the ``index``-th key, as the store runs it: a plain
        :class:`Acquire`, or with partners an :class:`AcquireAll` (that key first)."""
        if index == 0:
            key, expect, seen, history = self.key, self.expect, self.seen, self.history
        else:
            key, expect, seen, history = self.others[index - 1]
        if self.partners:
            return AcquireAll(
                (Charge(key, self.quota, self.cost, expect, seen), *self.partners),
                self.max_wait_us,
                self.call_id,
                now_us=self.now_us,
                lead_us=self.lead_us,
                mark_us=self.mark_us,
                cards=self.cards,
                history=history + self.partner_history,
                retry=self.retry,
            )
        return Acquire(
            key=key,
            quota=self.quota,
            cost=self.cost,
            max_wait_us=self.max_wait_us,
            call_id=self.call_id,
            now_us=self.now_us,
            lead_us=self.lead_us,
            mark_us=self.mark_us,
            cards=self.cards,
            history=history,
            expect=expect,
            seen=seen,
            retry=self.retry,
        )

    def forgetting(self) -> AcquireAny:
        """This call as a store that is not the one its keys' lives were seen in runs it
        (``on_unavailable``'s local store): expecting no life of any key."""
        others = tuple(other._replace(expect=-1, seen=-1) for other in self.others)
        partners = tuple(dataclasses.replace(p, expect=-1, seen=-1) for p in self.partners)
        return dataclasses.replace(self, expect=-1, seen=-1, others=others, partners=partners)


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
    """:class:`Acquire` for several keys at once, all or nothing.

    One slot for every key: the earliest that each key's quota, gap and pause allow,
    after every call booked on the first key (the call's own) and, in the others (keys
    it shares, such as an account), among their bookings where it fits (``filling``).
    Booked in every key's log in one atomic step, or, when it is more than
    ``max_wait_us`` away, written nowhere. ``call_id`` is booked in the first key's log;
    a ``retry`` whose id is there gets its slot back. The answer's ``remaining`` lists
    each key's rates in turn; ``pause_until`` is the latest pause.
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
    retry: bool = False  # as Acquire's

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


@dataclass(frozen=True)
class Learn(Op[None]):
    """What the upstream's headers said of a key, when stricter than its quota: at most
    ``limit`` units in the slots from ``since_us`` up to ``until_us``, the upstream's
    reset. Every decision of the key holds to it until then, on top of its rates. The
    newest report (the latest ``since_us``) replaces an older one.

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


def namespace_prefix(namespace: str | None) -> str:
    """What the store keys of ``namespace`` begin with ("" for any): ``<namespace>:{``
    (a namespace holds no brace, so no other namespace's keys begin so)."""
    return "" if namespace is None else f"{namespace}:{{"


def history_cost(op: Acquire | AcquireAll, store_key: str) -> int:
    """The cost a call charges to ``store_key``, one of its keys (its usage history)."""
    if isinstance(op, Acquire):
        return op.cost
    return next(charge.cost for charge in op.charges if charge.key == store_key)
