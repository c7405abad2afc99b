"""Limiter and AsyncLimiter: the public front of the sliding-window log.

All the thinking (validation, key hashing, turning a store's verdict into a
Decision or a ThrottleTimeout) happens in ``_LimiterCore``, which does no I/O.
The two classes below only do the I/O for their world: call the store, sleep.
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import math
import os
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import tenacity

from ._errors import BackendUnavailable, ConfigurationError, CostTooHigh, ThrottleTimeout
from ._failure import FailureGuard, OnUnavailable, shrink
from ._keys import check_namespace, resolve_secret, store_key
from ._ops import (
    Acquire,
    AsyncBackend,
    Backend,
    Inspect,
    Op,
    Pause,
    Policy,
    Reset,
    Snapshot,
    Verdict,
)
from ._ranges import MAX_RATES, MAX_SECONDS
from ._rate import Rate, bounded_seconds, coerce_rate, to_seconds
from ._results import Decision, RateUsage, Usage

T = TypeVar("T")
US = 1_000_000


def _seconds(us: int) -> float:
    return us / US


# Call ids need only be unique within one key's log, not unguessable: a private
# generator seeded from os.urandom makes them 3x cheaper than secrets.token_urlsafe.
# It is private so that a caller's random.seed() cannot make two workers draw the
# same ids, and it is reseeded in every forked child for the same reason.
_ids = random.Random()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_ids.seed)


def _call_id() -> str:
    """11 url-safe characters from 64 random bits, like ``secrets.token_urlsafe(8)``."""
    return base64.urlsafe_b64encode(_ids.getrandbits(64).to_bytes(8, "big"))[:11].decode()


class _LimiterCore:
    """Configuration and every decision that needs no I/O."""

    def __init__(
        self,
        *,
        rates: Sequence[Rate | str] | Rate | str,
        min_interval: float | timedelta = 0.0,
        namespace: str = "default",
        key_secret: bytes | str | None = None,
        clock: Callable[[], float] | None = None,
        on_unavailable: OnUnavailable = "raise",
        retry_for: float | timedelta = 1.0,
    ) -> None:
        listed = [rates] if isinstance(rates, (Rate, str)) else list(rates)
        if not 1 <= len(listed) <= MAX_RATES:
            raise ConfigurationError(
                f"a limiter needs from 1 to {MAX_RATES} rates, not {len(listed)}"
            )
        self.rates: tuple[Rate, ...] = tuple(coerce_rate(rate) for rate in listed)
        gap = bounded_seconds(min_interval, "min_interval")
        self.min_interval = gap
        self.namespace = check_namespace(namespace)
        self._secret = resolve_secret(key_secret)
        self._clock = clock
        self._policy = Policy(
            limits=tuple((rate.limit, rate.period_us) for rate in self.rates),
            min_interval_us=round(gap * US),
        )
        self._max_cost = min(rate.limit for rate in self.rates)
        self._guard = FailureGuard(on_unavailable, to_seconds(retry_for, "retry_for"))

    # -- validation -----------------------------------------------------------------

    def _key(self, key: str) -> str:
        return store_key(self._secret, self.namespace, key)

    def _cost(self, cost: int) -> int:
        if isinstance(cost, bool) or not isinstance(cost, int) or cost < 1:
            raise ConfigurationError(f"cost must be a positive integer, not {cost!r}")
        if cost > self._max_cost:
            raise CostTooHigh(
                f"cost {cost} can never be admitted: it is above the limit of "
                f"{min(self.rates, key=lambda r: r.limit)!r}"
            )
        return cost

    def _max_wait_us(self, timeout: float | timedelta | None) -> int:
        # No slot is booked more than 10 years ahead (see _ranges): a longer timeout,
        # or None, waits for any slot there is, the same on every store.
        seconds = MAX_SECONDS if timeout is None else to_seconds(timeout, "timeout")
        if math.isnan(seconds) or seconds < 0:
            raise ConfigurationError(f"timeout must be >= 0 seconds or None, not {timeout!r}")
        return round(min(seconds, MAX_SECONDS) * US)

    def _now_us(self) -> int | None:
        """The caller's clock, only when one was injected; else the store's own clock."""
        return None if self._clock is None else round(self._clock() * US)

    # -- operations and their answers ---------------------------------------------

    def _acquire_op(self, key: str, cost: int, max_wait_us: int) -> Acquire:
        return Acquire(
            key=self._key(key),
            policy=self._policy,
            cost=self._cost(cost),
            max_wait_us=max_wait_us,
            # A fresh id per call: equal slots never collapse, a driver retry never books twice.
            call_id=_call_id(),
            now_us=self._now_us(),
        )

    def _decision(self, verdict: Verdict, cost: int, *, waits: bool) -> Decision:
        delay = _seconds(max(0, verdict.slot_us - verdict.now_us))
        return Decision(
            allowed=verdict.allowed,
            retry_after=0.0 if verdict.allowed else delay,
            waited=delay if verdict.allowed and waits else 0.0,
            slot=_seconds(verdict.slot_us),
            cost=cost,
            remaining=verdict.remaining,
            rates=self.rates,
            paused_until=_seconds(verdict.pause_until_us)
            if verdict.pause_until_us > verdict.now_us
            else None,
        )

    def _admitted(self, verdict: Verdict, cost: int) -> Decision:
        """``acquire``'s answer: the booked slot, or ThrottleTimeout when it was too far."""
        decision = self._decision(verdict, cost, waits=True)
        if not decision.allowed:
            raise ThrottleTimeout(decision.retry_after)
        return decision

    def _inspect_op(self, key: str) -> Inspect:
        return Inspect(key=self._key(key), policy=self._policy, now_us=self._now_us())

    def _usage(self, snap: Snapshot) -> Usage:
        now = snap.now_us
        return Usage(
            rates=tuple(
                RateUsage(
                    rate=rate,
                    used=used,
                    booked=snap.booked,
                    remaining=max(0, rate.limit - used - snap.booked),
                    resets_in=_seconds(max(0, ready - now)),
                )
                for rate, used, ready in zip(self.rates, snap.used, snap.ready_at_us, strict=True)
            ),
            next_slot_in=_seconds(max(0, snap.next_slot_us - now)),
            paused_for=_seconds(max(0, snap.pause_until_us - now)),
            paused_until=_seconds(snap.pause_until_us) if snap.pause_until_us > now else None,
        )

    def _pause_op(self, key: str, seconds: float | timedelta) -> Pause:
        duration = bounded_seconds(seconds, "pause seconds")
        return Pause(
            key=self._key(key),
            policy=self._policy,
            duration_us=round(duration * US),
            now_us=self._now_us(),
        )

    def _reset_op(self, key: str) -> Reset:
        return Reset(key=self._key(key))

    def __repr__(self) -> str:
        rates = ", ".join(map(repr, self.rates))
        return (
            f"{type(self).__name__}(rates=[{rates}], min_interval={self.min_interval:g}, "
            f"namespace={self.namespace!r})"
        )


class Limiter(_LimiterCore):
    """A shared sliding-window limiter, one log per key (usually an access token).

    >>> limiter = Limiter(RedisBackend("redis://localhost:6379/0"),
    ...                   rates=[Rate(5000, 3600), "10/second"], min_interval=0.1)
    >>> limiter.acquire(token, timeout=30)   # waits its turn, or ThrottleTimeout
    >>> limiter.try_acquire(token).retry_after

    ``on_unavailable`` says what happens when the store cannot be reached after
    ``retry_for`` seconds of retries: ``"raise"`` (BackendUnavailable, the default),
    ``"allow"`` (fail open) or ``LocalFallback(expected_workers=N)``.

    ``clock`` and ``sleep`` are for tests (see ``throttle_client.testing``). With a
    clock, Redis follows it instead of its own TIME.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        rates: Sequence[Rate | str] | Rate | str,
        min_interval: float | timedelta = 0.0,
        namespace: str = "default",
        key_secret: bytes | str | None = None,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        on_unavailable: OnUnavailable = "raise",
        retry_for: float | timedelta = 1.0,
    ) -> None:
        if inspect.iscoroutinefunction(getattr(backend, "execute", None)):
            raise TypeError(f"{type(backend).__name__} is asynchronous: use AsyncLimiter with it")
        if not callable(getattr(backend, "execute", None)):
            raise TypeError(f"a Limiter needs a backend, not {backend!r}")
        super().__init__(
            rates=rates,
            min_interval=min_interval,
            namespace=namespace,
            key_secret=key_secret,
            clock=clock,
            on_unavailable=on_unavailable,
            retry_for=retry_for,
        )
        self.backend = backend
        self._sleep = sleep

    def _execute(self, op: Op[T]) -> T:
        """Ask the store, retrying what may pass; if it stays silent, the policy answers."""
        guard = self._guard
        if not guard.store_resting():
            started = time.monotonic()
            try:
                result = self.backend.execute(op)  # the common case: no retry machinery
            except BackendUnavailable as first:
                options = guard.retry_options(op, started)
                try:
                    if options is None:
                        raise first
                    for attempt in tenacity.Retrying(**options):
                        with attempt:
                            result = self.backend.execute(shrink(op, started))
                except BackendUnavailable as exc:
                    guard.failed(exc)
                    return guard.substitute(op)()
            guard.succeeded()
            return result
        return guard.substitute(op)()

    def try_acquire(self, key: str, cost: int = 1) -> Decision:
        """Admit the call now if its slot is now; a refusal records nothing."""
        op = self._acquire_op(key, cost, 0)
        return self._decision(self._execute(op), op.cost, waits=False)

    def acquire(
        self, key: str, cost: int = 1, timeout: float | timedelta | None = None
    ) -> Decision:
        """Book the earliest slot and sleep until it: one store round trip, one sleep.

        Raises ThrottleTimeout (with ``retry_after``), booking nothing, when the slot
        is more than ``timeout`` seconds away.
        """
        op = self._acquire_op(key, cost, self._max_wait_us(timeout))
        decision = self._admitted(self._execute(op), op.cost)
        if decision.waited > 0:
            self._sleep(decision.waited)
        return decision

    def usage(self, key: str) -> Usage:
        """Per rate used / remaining / seconds until a unit frees; the next slot; any pause."""
        return self._usage(self._execute(self._inspect_op(key)))

    def pause(self, key: str, seconds: float | timedelta) -> float:
        """No slot for ``key`` before ``now + seconds``, for every worker; returns the
        pause's end (epoch seconds). A pause only ever moves forward."""
        return _seconds(self._execute(self._pause_op(key, seconds)))

    def reset(self, key: str) -> None:
        """Forget everything about ``key``."""
        self._execute(self._reset_op(key))


class AsyncLimiter(_LimiterCore):
    """The asyncio twin of :class:`Limiter`; same arguments, awaitable methods.

    >>> limiter = AsyncLimiter(AsyncRedisBackend("redis://localhost"), rates=["10/second"])
    >>> await limiter.acquire(token, timeout=30)
    """

    def __init__(
        self,
        backend: AsyncBackend | Backend,
        *,
        rates: Sequence[Rate | str] | Rate | str,
        min_interval: float | timedelta = 0.0,
        namespace: str = "default",
        key_secret: bytes | str | None = None,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
        on_unavailable: OnUnavailable = "raise",
        retry_for: float | timedelta = 1.0,
    ) -> None:
        super().__init__(
            rates=rates,
            min_interval=min_interval,
            namespace=namespace,
            key_secret=key_secret,
            clock=clock,
            on_unavailable=on_unavailable,
            retry_for=retry_for,
        )
        self.backend = _as_async(backend)
        self._sleep = sleep

    async def _execute(self, op: Op[T]) -> T:
        """As Limiter._execute, awaiting the store."""
        guard = self._guard
        if not guard.store_resting():
            started = time.monotonic()
            try:
                result = await self.backend.execute(op)
            except BackendUnavailable as first:
                options = guard.retry_options(op, started)
                try:
                    if options is None:
                        raise first
                    async for attempt in tenacity.AsyncRetrying(**options):
                        with attempt:
                            result = await self.backend.execute(shrink(op, started))
                except BackendUnavailable as exc:
                    guard.failed(exc)
                    return guard.substitute(op)()
            guard.succeeded()
            return result
        return guard.substitute(op)()

    async def try_acquire(self, key: str, cost: int = 1) -> Decision:
        """Admit the call now if its slot is now; a refusal records nothing."""
        op = self._acquire_op(key, cost, 0)
        return self._decision(await self._execute(op), op.cost, waits=False)

    async def acquire(
        self, key: str, cost: int = 1, timeout: float | timedelta | None = None
    ) -> Decision:
        """Book the earliest slot and sleep until it; ThrottleTimeout if it is too far.

        A task cancelled while it sleeps keeps its booked slot: the quota errs on the
        side of under-use, never over-use.
        """
        op = self._acquire_op(key, cost, self._max_wait_us(timeout))
        decision = self._admitted(await self._execute(op), op.cost)
        if decision.waited > 0:
            await self._sleep(decision.waited)
        return decision

    async def usage(self, key: str) -> Usage:
        return self._usage(await self._execute(self._inspect_op(key)))

    async def pause(self, key: str, seconds: float | timedelta) -> float:
        return _seconds(await self._execute(self._pause_op(key, seconds)))

    async def reset(self, key: str) -> None:
        await self._execute(self._reset_op(key))


def _as_async(backend: AsyncBackend | Backend) -> AsyncBackend:
    execute = getattr(backend, "execute", None)
    if inspect.iscoroutinefunction(execute):
        return backend  # type: ignore[return-value]
    to_async = getattr(backend, "to_async", None)
    if callable(to_async):
        result: AsyncBackend = to_async()
        return result
    name = type(backend).__name__
    if name == "RedisBackend":
        raise TypeError("RedisBackend wraps a sync client: AsyncLimiter needs AsyncRedisBackend")
    raise TypeError(f"AsyncLimiter needs an asynchronous backend, not {backend!r}")
