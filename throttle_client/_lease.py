"""Leases: a capped call's hold on its keys, from its admission until the call ends.

``Limiter.lease(key)`` gives a :class:`Lease`, ``AsyncLimiter.lease(key)`` an
:class:`AsyncLease`. Entering one waits for the call's turn (its rates, its gap, and
room under every cap, in one atomic step, in arrival order), leaving it ends the
lease, and the store hands the freed room to the next waiter at once. Meanwhile the
lease is renewed every third of its TTL, so that only a holder that died (``kill -9``)
or lost its store lets its lease expire. A lease nobody holds any more (collected,
never released) is no longer renewed: it expires within its TTL.

The flows (acquire and wait, renew, release) are written once (the limiter's, and
``_Held``'s); these classes only run them, in their world, and keep the renewals going:
for blocking leases a scheduler thread and a few renewal workers per process, for an
asyncio lease a task of its own.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import os
import threading
import time
import warnings
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from ._acquiring import charges, end_flow, lease_cards, lease_flow
from ._backends import leases
from ._backends.base import Charge
from ._config import NORMAL, check_priority
from ._core import LimiterCore
from ._errors import BackendError, BackendUnavailable, ConfigurationError
from ._events import LEASED, RELEASED
from ._flow import arun, refuse_in_event_loop, run
from ._planning import call_id
from ._results import Decision

log = logging.getLogger("throttle_client")

_RENEWERS = 4  # threads per process that renew blocking leases


class _Held:
    """What a lease is, either world: its keys and its id, once entered."""

    def __init__(
        self,
        limiter: LimiterCore,
        key: str,
        cost: int,
        timeout: float | timedelta | None,
        also: Sequence[Any],
        before_request: bool,
        priority: str = NORMAL,
    ) -> None:
        self.limiter = limiter
        # (checked only when not the usual one: no cost to a plain call)
        self.priority = priority if priority == NORMAL else check_priority(priority, "priority")
        self.key, self.cost, self.timeout, self.also = key, cost, timeout, tuple(also)
        self.before_request = before_request  # the transports: look for a pause after a sleep
        self.charges: tuple[Charge, ...] = ()
        self.lease_id = ""  # "": the call has no cap, so nothing is held
        self.decision: Decision | None = None
        self.ended = False
        self.holding = False  # granted, and not yet released: the listeners were told
        self.lost_warned = False
        self.pid = os.getpid()  # a forked child must not end its parent's lease

    def begin(self) -> None:
        limiter = self.limiter
        if limiter._capped(self.also):
            if self.priority != NORMAL:
                raise ConfigurationError(
                    f"priority={self.priority!r} on a capped call ({limiter!r} or an also= "
                    "partner has max_concurrent): its leases are granted in one queue, "
                    "whatever the priority; leave priority out"
                )
            self.charges = charges(limiter, self.key, self.cost, self.also, limiter._local())
            doorbell = limiter._backend().doorbell
            self.lease_id = doorbell.lease_id(call_id())
            doorbell.expect(self.lease_id)  # before the call that may queue it

    def flow(self) -> Any:
        limiter = self.limiter
        return lease_flow(
            limiter,
            self.key,
            self.cost,
            self.timeout,
            limiter._local(),
            also=self.also,
            lease_id=self.lease_id,
            before_request=self.before_request,
            priority=self.priority,
        )

    def granted(self) -> None:
        """Entered: the listeners of each capped key hear that this process holds a
        lease on it (``leased``), and later that it no longer does (``released``)."""
        if self.lease_id:
            self.holding = True
            self._tell(LEASED)

    def let_go(self) -> None:
        if self.holding:
            self.holding = False
            self._tell(RELEASED)

    def _tell(self, kind: str) -> None:
        owners = self.limiter._with(self.also)
        for index in leases.capped(self.charges):
            owner, charge = owners[index], self.charges[index]
            if owner._listeners:
                owner._emit(kind, charge.key, cost=charge.cost)

    def done_waiting(self) -> None:
        if self.lease_id:
            self.limiter._backend().doorbell.forget(self.lease_id)

    def release_flow(self) -> Any:
        return end_flow(self.limiter, self.charges, self.lease_id, self.limiter._local(), False)

    def renew_flow(self) -> Any:
        """Renew the lease; and, should the renewal have crossed the release (the keeper
        renewed as the caller released), holding the lease again, release it again."""
        # Each capped key's card lasts until the next renewal at least.
        cards = lease_cards(self.limiter, self.also, self.charges, 2 * self.every)
        kept = yield from end_flow(
            self.limiter, self.charges, self.lease_id, self.limiter._local(), True, cards
        )
        if self.renewed(kept):
            yield from self.release_flow()

    def mine(self) -> bool:
        """Whether this process holds the lease (not a child that inherited the object)."""
        return bool(self.lease_id) and self.pid == os.getpid()

    def renewed(self, kept: bool) -> bool:
        """After a renewal: whether to release once more (it crossed the release, which
        is no stall)."""
        if self.ended:
            return True
        if not kept and not self.lost_warned:
            self.lost_warned = True
            log.warning(
                "a lease on %s had expired in the store before it was "
                "renewed (a stall longer than lease_ttl=%gs, or a store that lost it); it "
                "is held again, possibly over the cap for a while",
                self.charges[0].key,
                self.limiter.lease_ttl,
            )
        return False

    @property
    def every(self) -> float:
        """Seconds between renewals: a third of the shortest TTL among its keys."""
        return leases.shortest_ttl_us(self.charges) / 3e6


def _ending_failed(held: _Held, what: str, exc: Exception) -> None:
    # Never raised into the caller's code: a lease that cannot be ended or renewed
    # expires on its own, within its TTL.
    unavailable = isinstance(exc, BackendUnavailable) or not isinstance(exc, BackendError)
    level = logging.INFO if unavailable else logging.ERROR
    log.log(level, "could not %s a lease (%s); it expires on its own", what, exc)


def _never_ended(held: _Held) -> None:
    """A lease collected while still held (an unclosed streamed response, a lease entered
    and dropped): nothing renews it any more, and its slot frees when its TTL passes."""
    if not held.ended and held.mine():
        warnings.warn(
            f"a lease on store key {held.charges[0].key} was never ended (an unclosed "
            "streamed response? a lease entered but not left?): its slot stays taken until "
            f"its lease_ttl ({held.limiter.lease_ttl:g}s) passes",
            ResourceWarning,
            stacklevel=1,
        )
        held.let_go()  # (no longer held by anyone here: it expires on its own)


class Lease:
    """A blocking lease: ``with limiter.lease(key) as decision:``. See the module."""

    def __init__(self, held: _Held) -> None:
        self._held = held

    @property
    def decision(self) -> Decision | None:
        """The admission's Decision, once entered."""
        return self._held.decision

    def __enter__(self) -> Decision:
        refuse_in_event_loop("a Limiter's lease")
        held = self._held
        limiter = held.limiter
        held.begin()
        try:
            held.decision = run(held.flow(), limiter._perform)
        except BaseException:
            self.release()  # a queued ticket or a granted lease must not linger
            raise
        finally:
            held.done_waiting()
        if held.lease_id:
            held.granted()
            _KEEPER.add(self)
            weakref.finalize(self, _never_ended, held)
        return held.decision

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def release(self) -> None:
        """End the lease (idempotent); the next waiter is admitted at once."""
        held = self._held
        if held.ended:
            return
        held.ended = True
        if held.mine():
            limiter = held.limiter
            try:
                run(held.release_flow(), limiter._perform)
            except Exception as exc:
                _ending_failed(held, "release", exc)
            held.let_go()

    def _renew(self) -> None:
        held = self._held
        if held.ended or not held.mine():
            return
        limiter = held.limiter
        try:
            run(held.renew_flow(), limiter._perform)
        except Exception as exc:
            _ending_failed(held, "renew", exc)


class AsyncLease:
    """An asyncio lease: ``async with limiter.lease(key) as decision:``. See the module."""

    def __init__(self, held: _Held) -> None:
        self._held = held
        self._renewal: asyncio.Task[None] | None = None

    @property
    def decision(self) -> Decision | None:
        return self._held.decision

    async def __aenter__(self) -> Decision:
        held = self._held
        limiter = held.limiter
        held.begin()
        try:
            held.decision = await arun(held.flow(), limiter._perform)
        except BaseException:
            await asyncio.shield(self.release())
            raise
        finally:
            held.done_waiting()
        if held.lease_id:
            held.granted()
            self._renewal = asyncio.get_running_loop().create_task(
                _renew_every(weakref.ref(self), held.every)
            )
            weakref.finalize(self, _never_ended, held)
        return held.decision  # type: ignore[return-value]

    def __enter__(self) -> None:
        raise TypeError("an AsyncLimiter's lease is entered with `async with`, not `with`")

    def __exit__(self, *exc_info: object) -> None:  # never entered: see __enter__
        pass

    async def __aexit__(self, *exc_info: object) -> None:
        # Shielded: a task cancelled as it leaves (a cancel scope) still ends its lease.
        await asyncio.shield(self.release())

    async def release(self) -> None:
        """End the lease (idempotent); the next waiter is admitted at once."""
        held = self._held
        if held.ended:
            return
        held.ended = True
        if self._renewal is not None:
            self._renewal.cancel()
        if held.mine():
            limiter = held.limiter
            try:
                await arun(held.release_flow(), limiter._perform)
            except Exception as exc:
                _ending_failed(held, "release", exc)
            held.let_go()

    async def _renew(self) -> None:
        held = self._held
        limiter = held.limiter
        try:
            await arun(held.renew_flow(), limiter._perform)
        except Exception as exc:
            _ending_failed(held, "renew", exc)


async def _renew_every(lease: weakref.ref[AsyncLease], every: float) -> None:
    """Renew an asyncio lease until it ends, or nobody holds it any more."""
    while True:
        await asyncio.sleep(every)
        held = lease()
        if held is None or held._held.ended:
            return
        await held._renew()
        del held  # not kept across the sleep: a lease dropped meanwhile is let go


class _Keeper:
    """One thread per process schedules the renewal of every blocking lease, each every
    third of its TTL, and a few worker threads make them: a renewal stuck on a slow store
    (a SQLite lock held for seconds) does not hold up the others'. Leases are held
    weakly: one dropped without being released stops being renewed."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._pid = 0
        self._cond = threading.Condition()
        self._due: list[tuple[float, int, weakref.ref[Lease], float]] = []
        self._order = itertools.count()
        self._workers: ThreadPoolExecutor | None = None

    def add(self, lease: Lease) -> None:
        every = lease._held.every
        with self._cond:
            if self._pid != os.getpid():  # the first lease, or the first after a fork
                self._pid, self._due = os.getpid(), []
                self._workers = ThreadPoolExecutor(_RENEWERS, "throttle-client-renew")
                thread = threading.Thread(target=self._run, name="throttle-client-leases")
                thread.daemon = True
                thread.start()
            self._schedule(weakref.ref(lease), every)

    def _schedule(self, ref: weakref.ref[Lease], every: float) -> None:
        """Its next renewal, ``every`` seconds from now (under the lock)."""
        heapq.heappush(self._due, (time.monotonic() + every, next(self._order), ref, every))
        self._cond.notify()

    def _run(self) -> None:
        pid = os.getpid()
        while True:
            with self._cond:
                if self._pid != pid:
                    return
                if not self._due:
                    self._cond.wait()
                    continue
                due, _, ref, every = self._due[0]
                wait = due - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                heapq.heappop(self._due)
                workers = self._workers
            lease = ref()
            if lease is None or lease._held.ended or workers is None:
                continue
            del lease  # the worker takes it from the weak reference, as it runs
            workers.submit(self._renew, ref, every)

    def _renew(self, ref: weakref.ref[Lease], every: float) -> None:
        lease = ref()
        if lease is None or lease._held.ended:
            return
        lease._renew()
        with self._cond:
            self._schedule(ref, every)


_KEEPER = _Keeper()
if hasattr(os, "register_at_fork"):  # the parent's thread and lock did not cross the fork
    os.register_at_fork(after_in_child=_KEEPER.reset)
