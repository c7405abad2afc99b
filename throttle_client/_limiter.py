"""Limiter and AsyncLimiter: the public front of the sliding-window log.

A limiter's state is kept by :class:`~._core.LimiterCore`, and what it does is written
once, as flows, for both worlds (see ``_flow``): ``_acquiring`` (book, sleep, check the
arrival), ``_calls`` (a store call, its retries, ``on_unavailable``), ``_key_flows``
(usage, history, pause, reset) and ``_learning`` (limits learned from the upstream).
The two classes below only perform the flows' steps in their world: call the store,
sleep, read the clock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, NoReturn, overload

import httpx

from ._acquiring import acquire_flow, waiting_flow
from ._backends import legacy
from ._backends.base import AsyncBackend, Backend
from ._config import check_priority
from ._core import LimiterCore
from ._feedback import QuotaView
from ._flow import AwaitGrant, Call, Introduce, LimiterStep, Sleep, arun, refuse_in_event_loop, run
from ._history import UsageHistory
from ._key_flows import history_flow, pause_flow, reset_flow, usage_flow
from ._learning import DEFAULT_MAX_PAUSE, learn_checked, learn_flow
from ._lease import AsyncLease, Lease, _Held
from ._results import Decision, Usage


class Limiter(LimiterCore):
    """A shared sliding-window limiter, one log per key (usually an access token).

    >>> limiter = Limiter(RedisBackend("redis://localhost:6379/0"),
    ...                   rates=[Rate(5000, 3600), "10/second"], min_interval=0.1)
    >>> limiter.acquire(token, timeout=30)   # waits its turn, or ThrottleTimeout
    >>> limiter.try_acquire(token).retry_after

    ``margin`` (seconds, default 25 ms) is how much later than its slot a request may
    reach the upstream, which counts arrivals, not slots: every window and the minimum
    interval are widened by it, and a call that wakes later than its slot + margin books
    a new slot before it returns (``Decision.late_wakeups``), at most three times. 0
    turns this off: nothing is widened and no lateness judged, so only the slots are
    exact; requests then reach the upstream a little after their slots, and need the
    headroom of rates and a gap a little stricter than the upstream's.

    ``on_unavailable`` says what happens when the store cannot be reached after
    ``retry_for`` seconds of retries: ``"raise"`` (BackendUnavailable, the default),
    ``"allow"`` (fail open) or ``LocalFallback(expected_workers=N)``.

    ``max_concurrent``: the most calls of a key in flight at once, across every process
    of the store; a call then holds a lease while it runs (:meth:`lease`, the transports,
    ``@throttled``), and ``acquire``/``try_acquire`` are refused. ``lease_ttl`` (seconds,
    default 30): how soon the lease of a holder that died (``kill -9``) frees its slot;
    living holders renew theirs every third of it.

    ``label``: a function of a key giving what operators see instead of it ("account
    42"): in events, metrics, logs, and the key's card (:class:`~throttle_client.Card`:
    the record of its label and the limiter's rules that the store keeps beside the key),
    which ``throttle-client status`` and ``top`` read. At most 64 printable characters, never
    the key itself. By default a key shows as the first 8 characters of its keyed hash.

    ``history``: count each key's calls per hour, day and month in the store
    (:meth:`history`). Off by default: a history outlives its key by the longest period
    it keeps (24 months unless told), so a fleet that keeps making new keys would fill
    the store with them. ``True`` keeps the defaults of :class:`~throttle_client.History`,
    ``History(...)`` what it says.

    ``low_priority_patience`` (seconds, default 30): the longest a ``priority="low"``
    call lets calls of the usual priority go first; it then queues as they do.

    ``clock`` and ``sleep`` are for tests (see ``throttle_client.testing``). With a
    clock, Redis follows it instead of its own TIME.
    """

    def _adopt(self, backend: object) -> Backend:
        store = backend
        if not isinstance(store, (Backend, AsyncBackend)):
            store = legacy.adopt(store, 3) or _not_a_backend(store, "Limiter")
        if not isinstance(store, Backend):
            raise TypeError(f"{type(store).__name__} is asynchronous: use AsyncLimiter with it")
        return store

    def _default_sleep(self) -> Callable[[float], Any]:
        return time.sleep

    _world = "sync"
    backend: Backend

    def _perform(self, step: LimiterStep) -> Any:
        """One step of a flow, with blocking calls (see ``_flow``)."""
        if isinstance(step, Call):
            return self.backend.execute(step.op), self._local()
        if isinstance(step, Introduce):
            held = self.backend.fingerprint(step.namespace, step.fingerprint, step.keep)
            return held, self._local()
        if isinstance(step, Sleep):
            self._sleep(step.seconds)
        elif isinstance(step, AwaitGrant):
            bell = self.backend.doorbell.wait_for(step.lease_id)
            rang = bell.wait(step.seconds)
            bell.clear()
            return rang, self._local()
        return self._local()  # after a Sleep, or for a ReadClock

    def try_acquire(
        self,
        key: str,
        cost: int = 1,
        *,
        also: Sequence[tuple[Limiter, str] | tuple[Limiter, str, int]] = (),
    ) -> Decision:
        """Admit the call now if its slot is now. A refusal records nothing, but for
        one whose answer came back too late (``late_wakeups``): its slot stays booked.
        ``also``: as for :meth:`acquire`."""
        refuse_in_event_loop("Limiter.try_acquire()")
        self._refuse_capped(also, "try_acquire")
        flow = acquire_flow(self, key, cost, 0, self._local(), refusal=True, also=also)
        return run(flow, self._perform)

    def acquire(
        self,
        key: str,
        cost: int = 1,
        timeout: float | timedelta | None = None,
        *,
        also: Sequence[tuple[Limiter, str] | tuple[Limiter, str, int]] = (),
        priority: str = "normal",
    ) -> Decision:
        """Book the earliest slot and sleep until it: one store round trip, one sleep.
        (Refused on a limiter with ``max_concurrent``: use :meth:`lease`.)

        Raises ThrottleTimeout (with ``retry_after``), booking nothing, when the slot
        is more than ``timeout`` seconds away.

        ``also``: (limiter, key) pairs the call is charged to as well, all or nothing,
        in the same atomic step: one slot that every limiter's quota allows, booked in
        every key's log, or, refused, in none (``[(account_limiter, account_id)]``). A
        third item charges that key another cost (``(endpoint_limiter, route, 5)``). The
        limiters share this one's backend; the call arrives within the narrowest of
        their margins; this limiter's ``on_unavailable`` and ``retry_for`` decide for the
        whole call. The Decision's ``rates`` and ``remaining`` list this limiter's rates,
        then each other's.

        ``priority="low"`` (a background crawl beside interactive calls): the call lets
        the calls of the usual priority, ``"normal"``, go first, in every process of the
        store. It books only a slot due within the limiter's margin (or within one slot
        of the key, if that is shorter), and otherwise sleeps until its slot comes that
        near and asks again; a normal call that comes meanwhile takes that slot, and
        waits for no low-priority call that asked after it. After yielding for the
        limiter's ``low_priority_patience`` (30 s by default) it queues as a normal call
        does; ``timeout`` bounds the whole wait.
        """
        refuse_in_event_loop("Limiter.acquire()")
        self._refuse_capped(also, "acquire")
        level = priority if priority == "normal" else check_priority(priority, "priority")
        flow = waiting_flow(self, key, cost, timeout, self._local(), also=also, priority=level)
        return run(flow, self._perform)

    def acquire_any(
        self,
        keys: Sequence[str],
        cost: int = 1,
        timeout: float | timedelta | None = None,
        *,
        also: Sequence[tuple[Limiter, str] | tuple[Limiter, str, int]] = (),
        priority: str = "normal",
    ) -> Decision:
        """:meth:`acquire` on a pool of keys used as one (several tokens of one quota):
        book the earliest slot among ``keys``, in one atomic step, and sleep until it.
        ``Decision.key`` says which key the call took, and is charged: each key stays
        within its own rates and gap, so the pool's throughput is the sum of its keys'.
        A key paused by its upstream, or booked ahead, is passed over while another has
        an earlier slot; of equal slots, the key used least lately is taken (so an idle
        pool spreads its calls over its keys), then the first in ``keys``. On a Redis
        Cluster the keys must share a hash slot (``tag=``).

        ``also``: as :meth:`acquire`'s, charged whichever key is taken (an account the
        tokens share): the key taken is the one whose slot with them is earliest."""
        refuse_in_event_loop("Limiter.acquire_any()")
        pool = self._pool(keys, "acquire_any")
        self._refuse_capped(also, "acquire_any")
        level = priority if priority == "normal" else check_priority(priority, "priority")
        flow = waiting_flow(
            self, pool[0], cost, timeout, self._local(), also=also, pool=pool, priority=level
        )
        return run(flow, self._perform)

    def try_acquire_any(
        self,
        keys: Sequence[str],
        cost: int = 1,
        *,
        also: Sequence[tuple[Limiter, str] | tuple[Limiter, str, int]] = (),
    ) -> Decision:
        """:meth:`try_acquire` on a pool of keys (see :meth:`acquire_any`): admitted on
        the key whose slot is now, if one is; a refusal names the key whose slot is
        earliest, and ``retry_after`` is when it is."""
        refuse_in_event_loop("Limiter.try_acquire_any()")
        pool = self._pool(keys, "try_acquire_any")
        self._refuse_capped(also, "try_acquire_any")
        flow = acquire_flow(
            self, pool[0], cost, 0, self._local(), refusal=True, also=also, pool=pool
        )
        return run(flow, self._perform)

    def lease(
        self,
        key: str,
        cost: int = 1,
        timeout: float | timedelta | None = None,
        *,
        also: Sequence[tuple[Limiter, str] | tuple[Limiter, str, int]] = (),
        priority: str = "normal",
    ) -> Lease:
        """A call held from its admission until the block ends: ``with limiter.lease(key)
        as decision:``. Entering waits, as :meth:`acquire` does, for the call's slot and,
        on a limiter with ``max_concurrent`` (or a partner in ``also`` with one), for room
        under every cap, in arrival order; ``timeout`` bounds the whole wait
        (ThrottleTimeout). Leaving ends the lease, and the next waiter goes at once.
        ``timeout=0`` does not wait: a full cap raises ThrottleTimeout at once. Without a
        cap it is an :meth:`acquire` whose end does nothing (and may have a ``priority``:
        see :meth:`acquire`)."""
        return Lease(_Held(self, key, cost, timeout, also, False, priority))

    def slot(
        self,
        key: str,
        cost: int = 1,
        timeout: float | timedelta | None = None,
        *,
        also: Sequence[tuple[Limiter, str] | tuple[Limiter, str, int]] = (),
        priority: str = "normal",
    ) -> Lease:
        """``with limiter.slot(key):`` waits for the call's turn, then runs the block: for
        code that just wants to wait its turn. The same as :meth:`lease` (on a limiter
        with ``max_concurrent``, the call is held in flight until the block ends)."""
        return self.lease(key, cost, timeout, also=also, priority=priority)

    @overload
    def usage(self, key: str) -> Usage: ...

    @overload
    def usage(self, *, store_key: str) -> Usage: ...

    def usage(self, key: str | None = None, *, store_key: str | None = None) -> Usage:
        """Per rate used / remaining / seconds until a unit frees; the next slot; any pause.
        Read-only.

        ``store_key=`` reads a key known by its store key only (as ``Backend.all_cards``
        and ``throttle-client top`` find them, or ``status`` shows them), instead of the
        key itself; it must be one of this limiter's namespace::

            >>> limiter.usage("ghp_token").rates[0].remaining
            4999
            >>> limiter.usage(store_key=limiter.store_key("ghp_token")).rates[0].remaining
            4999
        """
        target = self._usage_key(key, store_key)
        return run(usage_flow(self, target, self._local()), self._perform)

    def history(self, key: str) -> UsageHistory:
        """``key``'s use per hour, day and month, as the store counted it (see
        :class:`~throttle_client.History`), by every limiter that counts on the key; one
        that keeps none places the periods at the offset they were counted at."""
        return run(history_flow(self, self.store_key(key), self._local()), self._perform)

    def pause(self, key: str, seconds: float | timedelta) -> float:
        """No slot for ``key`` before ``now + seconds``, for every worker; returns the
        pause's end (epoch seconds). A pause only ever moves forward."""
        return run(pause_flow(self, key, seconds, self._local()), self._perform)[0]

    def reset(self, key: str) -> None:
        """Forget everything about ``key``."""
        run(reset_flow(self, key, self._local()), self._perform)

    def learn(
        self,
        key: str,
        decision: Decision,
        headers: httpx.Headers | Mapping[str, str],
        *,
        max_pause: float = DEFAULT_MAX_PAUSE,
    ) -> QuotaView | None:
        """Read the quota headers of the response to the call ``decision`` admitted for
        ``key`` (``X-RateLimit-*``, or the IETF ``RateLimit`` fields): when the upstream
        allows fewer calls than this limiter's rates, every worker holds to that until
        its reset, ``max_pause`` seconds at most (see ``usage(key).learned``). The
        throttled transports do this for every response; call it when you send with a
        client of your own. Returns what was read (None: nothing usable)."""
        view = learn_checked(self, decision, headers, max_pause)
        flow = learn_flow(self, key, decision, view, self._local(), max_pause)
        return run(flow, self._perform)[0]


class AsyncLimiter(LimiterCore):
    """The asyncio twin of :class:`Limiter`; same arguments, awaitable methods.

    >>> limiter = AsyncLimiter(AsyncRedisBackend("redis://localhost"), rates=["10/second"])
    >>> await limiter.acquire(token, timeout=30)
    """

    def _adopt(self, backend: object) -> AsyncBackend:
        store = backend
        if not isinstance(store, (Backend, AsyncBackend)):
            store = legacy.adopt(store, 3) or _not_a_backend(store, "AsyncLimiter")
        return store if isinstance(store, AsyncBackend) else store.to_async()

    def _default_sleep(self) -> Callable[[float], Any]:
        return asyncio.sleep

    _world = "async"
    backend: AsyncBackend

    async def _perform(self, step: LimiterStep) -> Any:
        """One step of a flow, awaited (see ``_flow``)."""
        if isinstance(step, Call):
            return await self.backend.aexecute(step.op), self._local()
        if isinstance(step, Introduce):
            held = await self.backend.afingerprint(step.namespace, step.fingerprint, step.keep)
            return held, self._local()
        if isinstance(step, Sleep):
            await self._sleep(step.seconds)
        elif isinstance(step, AwaitGrant):
            bell = self.backend.doorbell.wait_for(step.lease_id)
            rang = await bell.await_(step.seconds)
            bell.clear()
            return rang, self._local()
        return self._local()

    async def try_acquire(
        self,
        key: str,
        cost: int = 1,
        *,
        also: Sequence[tuple[AsyncLimiter, str] | tuple[AsyncLimiter, str, int]] = (),
    ) -> Decision:
        """Admit the call now if its slot is now. A refusal records nothing, but for
        one whose answer came back too late (``late_wakeups``): its slot stays booked."""
        self._refuse_capped(also, "try_acquire")
        flow = acquire_flow(self, key, cost, 0, self._local(), refusal=True, also=also)
        return await arun(flow, self._perform)

    async def acquire(
        self,
        key: str,
        cost: int = 1,
        timeout: float | timedelta | None = None,
        *,
        also: Sequence[tuple[AsyncLimiter, str] | tuple[AsyncLimiter, str, int]] = (),
        priority: str = "normal",
    ) -> Decision:
        """Book the earliest slot and sleep until it; ThrottleTimeout if it is too far.
        ``also`` and ``priority``: see :meth:`Limiter.acquire`.

        A task cancelled while it sleeps keeps its booked slot: the quota errs on the
        side of under-use, never over-use.
        """
        self._refuse_capped(also, "acquire")
        level = priority if priority == "normal" else check_priority(priority, "priority")
        flow = waiting_flow(self, key, cost, timeout, self._local(), also=also, priority=level)
        return await arun(flow, self._perform)

    async def acquire_any(
        self,
        keys: Sequence[str],
        cost: int = 1,
        timeout: float | timedelta | None = None,
        *,
        also: Sequence[tuple[AsyncLimiter, str] | tuple[AsyncLimiter, str, int]] = (),
        priority: str = "normal",
    ) -> Decision:
        """See :meth:`Limiter.acquire_any`: ``(await limiter.acquire_any(tokens)).key``."""
        pool = self._pool(keys, "acquire_any")
        self._refuse_capped(also, "acquire_any")
        level = priority if priority == "normal" else check_priority(priority, "priority")
        flow = waiting_flow(
            self, pool[0], cost, timeout, self._local(), also=also, pool=pool, priority=level
        )
        return await arun(flow, self._perform)

    async def try_acquire_any(
        self,
        keys: Sequence[str],
        cost: int = 1,
        *,
        also: Sequence[tuple[AsyncLimiter, str] | tuple[AsyncLimiter, str, int]] = (),
    ) -> Decision:
        """See :meth:`Limiter.try_acquire_any`."""
        pool = self._pool(keys, "try_acquire_any")
        self._refuse_capped(also, "try_acquire_any")
        flow = acquire_flow(
            self, pool[0], cost, 0, self._local(), refusal=True, also=also, pool=pool
        )
        return await arun(flow, self._perform)

    def lease(
        self,
        key: str,
        cost: int = 1,
        timeout: float | timedelta | None = None,
        *,
        also: Sequence[tuple[AsyncLimiter, str] | tuple[AsyncLimiter, str, int]] = (),
        priority: str = "normal",
    ) -> AsyncLease:
        """``async with limiter.lease(key) as decision:``; see :meth:`Limiter.lease`.
        A task cancelled while it waits gives its place up."""
        return AsyncLease(_Held(self, key, cost, timeout, also, False, priority))

    def slot(
        self,
        key: str,
        cost: int = 1,
        timeout: float | timedelta | None = None,
        *,
        also: Sequence[tuple[AsyncLimiter, str] | tuple[AsyncLimiter, str, int]] = (),
        priority: str = "normal",
    ) -> AsyncLease:
        """``async with limiter.slot(key):``; see :meth:`Limiter.slot`."""
        return self.lease(key, cost, timeout, also=also, priority=priority)

    @overload
    async def usage(self, key: str) -> Usage: ...

    @overload
    async def usage(self, *, store_key: str) -> Usage: ...

    async def usage(self, key: str | None = None, *, store_key: str | None = None) -> Usage:
        """See :meth:`Limiter.usage`: ``await limiter.usage(token)``, or ``await
        limiter.usage(store_key=...)``."""
        target = self._usage_key(key, store_key)
        return await arun(usage_flow(self, target, self._local()), self._perform)

    async def history(self, key: str) -> UsageHistory:
        return await arun(history_flow(self, self.store_key(key), self._local()), self._perform)

    async def pause(self, key: str, seconds: float | timedelta) -> float:
        return (await arun(pause_flow(self, key, seconds, self._local()), self._perform))[0]

    async def reset(self, key: str) -> None:
        await arun(reset_flow(self, key, self._local()), self._perform)

    async def learn(
        self,
        key: str,
        decision: Decision,
        headers: httpx.Headers | Mapping[str, str],
        *,
        max_pause: float = DEFAULT_MAX_PAUSE,
    ) -> QuotaView | None:
        """See :meth:`Limiter.learn`."""
        view = learn_checked(self, decision, headers, max_pause)
        flow = learn_flow(self, key, decision, view, self._local(), max_pause)
        return (await arun(flow, self._perform))[0]


def _not_a_backend(thing: object, limiter: str) -> NoReturn:
    """A TypeError that names what was given briefly and says what to give instead."""
    kind = type(thing).__name__
    if isinstance(thing, str):
        hint = "a URL: give RedisBackend(url) or SQLiteBackend(path)"
    elif type(thing).__module__.startswith("redis.asyncio"):
        hint = "a redis-py client: wrap it, AsyncRedisBackend(client)"
    elif type(thing).__module__.startswith("redis"):
        hint = "a redis-py client: wrap it, RedisBackend(client)"
    elif limiter == "Limiter":
        hint = "give MemoryBackend(), SQLiteBackend(path), RedisBackend(...) or a Backend subclass"
    else:
        hint = (
            "give AsyncRedisBackend(...), MemoryBackend(), SQLiteBackend(path), or a "
            "subclass of AsyncBackend or Backend"
        )
    raise TypeError(f"a {limiter} needs a backend, not a {kind}; {hint}")
