"""What a limiter does when its store fails.

First, a store error that may pass (a refused or broken connection, a timeout, a
cluster failover) is retried briefly with tenacity, never past the call's own
deadline. If the store still does not answer, the limiter's ``on_unavailable``
decides:

- ``"raise"`` (default): BackendUnavailable. Nothing is sent; crawls stall.
- ``"allow"``: fail open. Every call goes; the upstream's quota may be exceeded.
- ``LocalFallback(expected_workers=N)``: an in-process limiter holding this
  worker's share of the quota (each limit divided by N, the minimum interval
  multiplied by N). The fleet stays within the quota if N is right.

After a failure the store is left alone for ``COOLDOWN`` seconds (calls go
straight to ``on_unavailable`` instead of each waiting on a dead socket); the next call
after that tries the store again, so recovery needs no restart. A store that
answers with an error (a key of the wrong type, a script error) is never a reason
to let a call through: that BackendError always propagates.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

import tenacity

from ._backends.base import (
    Acquire,
    AcquireAll,
    AcquireAny,
    Inspect,
    Learn,
    Op,
    Pause,
    Quota,
    Release,
    Renew,
    Verdict,
)
from ._backends.memory import MemoryBackend
from ._errors import BackendUnavailable, ConfigurationError

T = TypeVar("T")
log = logging.getLogger("throttle_client")

COOLDOWN = 0.5  # seconds a failed store is left alone before it is tried again
_RETRY_IF = tenacity.retry_if_exception_type(BackendUnavailable)
_WAIT = tenacity.wait_random_exponential(multiplier=0.02, max=0.25)


@dataclass(frozen=True)
class LocalFallback:
    """While the store is unavailable, admit calls from an in-process limiter that
    holds ``1 / expected_workers`` of each rate and spaces calls ``expected_workers``
    times the minimum interval. Each worker keeps at least one call per window (and one
    in flight under a cap): a rate whose limit is below ``expected_workers`` cannot be
    shared without the store, and the fleet may then send up to ``expected_workers``
    per window while it is down (the limiter says so when it is made).

    >>> Limiter(backend, rates=["5000/hour"], on_unavailable=LocalFallback(expected_workers=8))
    """

    expected_workers: int

    def __post_init__(self) -> None:
        n = self.expected_workers
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigurationError(f"expected_workers must be a positive integer, not {n!r}")

    def share(self, quota: Quota) -> Quota:
        n = self.expected_workers
        return Quota(
            limits=tuple((max(1, limit // n), period) for limit, period in quota.limits),
            min_interval_us=quota.min_interval_us * n,
            max_concurrent=max(1, quota.max_concurrent // n) if quota.max_concurrent else 0,
            lease_ttl_us=quota.lease_ttl_us,
        )


OnUnavailable = Literal["raise", "allow"] | LocalFallback


class Budget(tenacity.stop.stop_base):
    """Stop once ``spent`` (set by the flow, on the limiter's clock) reaches ``seconds``:
    retries are timed on the limiter's clock, as its sleeps are, not on tenacity's."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.spent = 0.0

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        return self.spent >= self.seconds


class FailureGuard:
    """The no-I/O half of failure handling: when to try the store, how to retry it, and
    what answers instead. Times are the limiter's local clock, passed in.
    """

    def __init__(self, on_unavailable: OnUnavailable, retry_for: float) -> None:
        if on_unavailable not in ("raise", "allow") and not isinstance(
            on_unavailable, LocalFallback
        ):
            raise ConfigurationError(
                "on_unavailable must be 'raise', 'allow' or LocalFallback(expected_workers=N), "
                f"not {on_unavailable!r}"
            )
        if not math.isfinite(retry_for) or retry_for < 0:
            raise ConfigurationError(f"retry_for must be >= 0 seconds, not {retry_for!r}")
        self.on_unavailable = on_unavailable
        self.retry_for = retry_for
        self.fallback = MemoryBackend() if isinstance(on_unavailable, LocalFallback) else None
        # Under "allow", a pool's calls take its keys in turn (no store says which is free).
        self._turns = itertools.count()
        self._down_until = 0.0
        self._down = False
        self.last_error = BackendUnavailable("the store has not answered yet")
        self._lock = threading.Lock()

    def ring_through(self, store: Any) -> None:
        """The in-process fallback grants leases to the limiter's waiters, who wait on
        the store's doorbell: it rings that one. (Made here, with the limiter, so that
        threads of a capped key never make two at once: a lease named for one that no
        subscriber hears would wait for its grant to be looked for.)"""
        doorbell = store.doorbell
        if self.fallback is not None:
            self.fallback.doorbell = doorbell

    # -- before and after the store is asked ------------------------------------------

    def store_resting(self, now: float) -> bool:
        """True while a recent failure says: don't wait on the store, answer without it."""
        return now < self._down_until

    def retrying(self, op: Op[Any], spent: float) -> tuple[tenacity.Retrying, Budget] | None:
        """What decides the retries of ``op`` whose first attempt failed ``spent``
        seconds after it began, and the budget the flow keeps up to date: BackendUnavailable
        is retried for at most ``retry_for`` seconds in all, and never past an acquire's
        own timeout. None when no time is left (a hung store already took it: another
        attempt would wait a socket timeout). Only tenacity's ``iter()`` is used: the
        limiter's flow makes the attempts and the sleeps."""
        budget = self.retry_for
        if isinstance(op, (Acquire, AcquireAll)) and op.max_wait_us > 0:
            budget = min(budget, op.max_wait_us / 1_000_000)
        budget -= spent
        if budget <= 0:
            return None
        left = Budget(budget)
        retrying = tenacity.Retrying(
            retry=_RETRY_IF, stop=tenacity.stop_after_attempt(3) | left, wait=_WAIT, reraise=True
        )
        return retrying, left

    def succeeded(self) -> None:
        if self._down:
            with self._lock:
                if self._down:
                    self._down = False
                    log.warning("the store answers again")

    def failed(self, exc: BackendUnavailable, now: float) -> None:
        with self._lock:
            self.last_error = _detached(exc)
            self._down_until = now + COOLDOWN
            if not self._down:
                self._down = True
                log.warning(
                    "the store is unavailable (%s); on_unavailable=%r applies",
                    self.last_error,  # (a record may be kept: not the error with its frames)
                    self.on_unavailable,
                )

    # -- instead of the store -----------------------------------------------------------

    def substitute(self, op: Op[T]) -> Callable[[], T]:
        """What answers ``op`` instead of the store: raises BackendUnavailable where
        ``on_unavailable`` gives no answer (always for reset, and for a read under "allow")."""
        last = self.last_error
        if self.fallback is not None and isinstance(
            op, (Acquire, AcquireAll, Inspect, Pause, Learn, Release, Renew)
        ):
            assert isinstance(self.on_unavailable, LocalFallback)
            share = self.on_unavailable.share
            if isinstance(op, (AcquireAll, Release, Renew)):
                # (expect: the life of the store's key, which this log is not.)
                charges = tuple(
                    dataclasses.replace(c, quota=share(c.quota), expect=-1) for c in op.charges
                )
                local = cast(Op[T], dataclasses.replace(op, charges=charges))
            elif isinstance(op, Learn):  # this process's share of what the upstream allows
                n = self.on_unavailable.expected_workers
                local = cast(
                    Op[T],
                    dataclasses.replace(
                        op, quota=share(op.quota), limit=op.limit // n, from_cum=-1
                    ),
                )
            elif isinstance(op, AcquireAny):
                partners = tuple(dataclasses.replace(p, quota=share(p.quota)) for p in op.partners)
                forgot = op.forgetting()
                shared = dataclasses.replace(forgot, quota=share(op.quota), partners=partners)
                local = cast(Op[T], shared)
            elif isinstance(op, Acquire):
                local = cast(Op[T], dataclasses.replace(op, quota=share(op.quota), expect=-1))
            else:
                local = cast(Op[T], dataclasses.replace(op, quota=share(op.quota)))
            if isinstance(local, (Acquire, AcquireAll)) and local.mark_us >= 0:
                # A mark is a running total of the store's log: this log's would mislead a
                # limit learned later in the store (and the store's, one learned here).
                local = cast(Op[T], dataclasses.replace(local, mark_us=-1))
            fallback = self.fallback
            return lambda: fallback.execute(local)
        if isinstance(op, Learn) and self.on_unavailable == "allow":
            return lambda: None  # type: ignore[return-value]  # nothing is held to: no use
        if isinstance(op, (Release, Renew)):
            # Under "allow" a call held nothing; otherwise the store's lease expires by TTL.
            kept = self.on_unavailable == "allow" if isinstance(op, Renew) else None
            if self.on_unavailable == "allow":
                return lambda: kept  # type: ignore[return-value]
        if self.on_unavailable == "allow" and isinstance(op, (Acquire, AcquireAll, Pause)):
            now = op.time_us()
            if isinstance(op, (Acquire, AcquireAll)):
                quotas = [c.quota for c in op.charges] if isinstance(op, AcquireAll) else [op.quota]
                if isinstance(op, AcquireAny):
                    quotas += [p.quota for p in op.partners]
                limits = tuple(limit for quota in quotas for limit, _ in quota.limits)
                verdict = Verdict(True, now, now, 0, limits)
                if isinstance(op, AcquireAny):
                    verdict = verdict._replace(chosen=next(self._turns) % len(op.keys))
                return lambda: verdict  # type: ignore[return-value]
            # The pause cannot be shared; the caller still gets its end, as if it held.
            return lambda: now + op.duration_us  # type: ignore[return-value]

        def unavailable() -> T:
            # A fresh exception per call, chained to the driver's last error: re-raising
            # one shared object from every call and thread would grow its traceback with
            # each raise (and share it between threads).
            raise BackendUnavailable(str(last)) from last.__cause__ or last

        return unavailable


def shrink(op: Op[T], spent: float) -> Op[T]:
    """``op`` as it must be sent ``spent`` seconds late: an acquire waits that much
    less, so retries never stretch it past its timeout. The call id stays, so an
    attempt that did book its slot is found again, never booked twice: the op says it
    is a retry, so that the store looks for it."""
    if isinstance(op, (Acquire, AcquireAll)):
        left = op.max_wait_us
        if left > 0:
            left = max(0, left - max(0, int(spent * 1_000_000)))
        return cast(Op[T], dataclasses.replace(op, max_wait_us=left, retry=True))
    return op


def _detached(exc: BackendUnavailable) -> BackendUnavailable:
    """``exc`` as the guard keeps it, chained to a copy of the driver's error, neither
    with a traceback: a traceback holds the frames it passed through, the limiter's among
    them, and the limiter holds the guard: a cycle that would keep the limiter and its
    connections alive until the collector runs. (The refusals raised from it say the
    driver error's type and message; the first one logged its place.)"""
    cause = exc.__cause__
    if cause is not None:
        try:
            cause = copy.copy(cause).with_traceback(None)
        except Exception:  # (an exception type that cannot be copied: its message)
            cause = BackendUnavailable(f"{type(cause).__name__}: {cause}")
    kept = BackendUnavailable(str(exc))
    kept.__cause__ = cause
    return kept
