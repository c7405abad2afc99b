"""The state a limiter keeps, either world: the one place its keyword arguments are declared.

A :class:`LimiterCore` is taken apart by what it keeps: its :class:`~._config.Config`
(fixed when it is made), its :class:`~._planning.Planner` (keys' cards and lives, the
quota's calendar windows), its :class:`~._pacing.Pacing` (the store's clock and round
trip), its :class:`~._failure.FailureGuard` (whether the store is down, and what answers
instead), its listeners and what the upstream last said of each key. What a limiter
*does* is written once, as flows over this state, for both worlds: ``_calls`` (a store
call, its retries, ``on_unavailable``), ``_acquiring`` (book, sleep, check the
arrival), ``_key_flows`` (usage, history, pause, reset) and ``_learning`` (limits
learned from the upstream). ``Limiter`` and ``AsyncLimiter`` run them, each in its world.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, ClassVar

from ._backends.base import AsyncBackend, Backend, InlineAsync, ThreadedAsync
from ._config import DEFAULT_MARGIN, DEFAULT_PATIENCE, Config
from ._errors import ConfigurationError
from ._events import Event, Listener, Listeners
from ._failure import FailureGuard, OnUnavailable
from ._history import History
from ._pacing import Pacing
from ._planning import Planner
from ._rate import Rate
from ._results import UpstreamView

log = logging.getLogger("throttle_client")

# The pools (acquire_any) a limiter remembers as checked: the newest this many.
POOLS_KEPT = 64

# The other limiters a stacked call is charged to, each with its key, and the cost
# charged to it when that is not the call's own.
Also = Sequence[tuple["LimiterCore", str] | tuple["LimiterCore", str, int]]


class LimiterCore:
    """What a limiter keeps, and the small decisions that need no I/O."""

    _world: ClassVar[str] = ""  # "sync" or "async": the limiters a stacked call may combine

    def __init__(
        self,
        backend: Any,
        *,
        rates: Sequence[Rate | str] | Rate | str,
        min_interval: float | timedelta = 0.0,
        margin: float | timedelta = DEFAULT_MARGIN,
        namespace: str = "default",
        key_secret: bytes | str | None = None,
        tag: Callable[[str], str] | None = None,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], Any] | None = None,
        on_unavailable: OnUnavailable = "raise",
        retry_for: float | timedelta = 1.0,
        max_concurrent: int | None = None,
        lease_ttl: float | timedelta | None = None,
        label: Callable[[str], str] | None = None,
        history: History | bool = False,
        low_priority_patience: float | timedelta = DEFAULT_PATIENCE,
    ) -> None:
        store = self._adopt(backend)  # (a wrong backend is refused before anything else)
        config = Config.build(
            rates=rates,
            min_interval=min_interval,
            margin=margin,
            namespace=namespace,
            key_secret=key_secret,
            tag=tag,
            clock=clock,
            on_unavailable=on_unavailable,
            retry_for=retry_for,
            max_concurrent=max_concurrent,
            lease_ttl=lease_ttl,
            label=label,
            history=history,
            low_priority_patience=low_priority_patience,
        )
        kept = store_of(store).features
        missing = {feature: why for feature, why in config.needs().items() if feature not in kept}
        if missing:
            raise ConfigurationError(
                f"{type(store_of(store)).__name__} does not keep "
                + ", ".join(f"{feature} (which {why} needs)" for feature, why in missing.items())
                + ": give this limiter a store that does (memory, SQLite and Redis keep all)"
            )
        self._config = config
        # The configuration as the public attributes a user reads.
        self.rates: tuple[Rate, ...] = config.rates
        self.min_interval = config.min_interval
        self.margin = config.margin
        self.namespace = config.namespace
        self.max_concurrent = config.max_concurrent
        self.lease_ttl = config.lease_ttl
        self.low_priority_patience = config.low_priority_patience
        # Local time: the injected clock (which the store then follows too), else a
        # monotonic one; Pacing relates it to the store's clock.
        self._local: Callable[[], float] = clock or time.monotonic
        # Wall-clock time, for what the upstream dates in epoch seconds (X-RateLimit-Reset).
        self._wall: Callable[[], float] = clock or time.time
        self._sleep = sleep or self._default_sleep()
        self._pacing = Pacing(injected=clock is not None)
        self._plan = Planner(config, self._pacing, self._wall, cards="cards" in kept)
        self._learns = "learned" in kept  # (a store that keeps no learned limit is sent none)
        self._guard = FailureGuard(on_unavailable, config.retry_for)
        self._listeners = Listeners()
        # Whether the namespace's record was kept, or looked at (_calls.introduce_flow): a
        # store that keeps no records is never asked.
        self._introduced = self._looked = "records" not in kept
        # The last quota headers read per store key (usage().upstream), the newest
        # UPSTREAM_VIEWS keys only; whether a looser view has been reported; header
        # values learn() could not read (each reported once).
        self._upstream: OrderedDict[str, UpstreamView] = OrderedDict()
        self._told_looser = False
        self._told_headers: set[str] = set()
        self._pools: OrderedDict[tuple[str, ...], None] = OrderedDict()  # checked (_pool)
        for problem in config.doubtful():
            log.warning("%r: %s", self, problem)
        self.backend = store
        self._guard.ring_through(store)

    # -- what each world gives ---------------------------------------------------------

    def _adopt(self, backend: Any) -> Any:
        """``backend`` as this world's store, or a TypeError saying what to give."""
        raise NotImplementedError

    def _default_sleep(self) -> Callable[[float], Any]:
        raise NotImplementedError

    def _perform(self, step: Any) -> Any:
        """One step of a flow, in this world (see ``_flow``): its result, or (async) an
        awaitable of it."""
        raise NotImplementedError

    def _backend(self) -> Backend | AsyncBackend:
        # (each world's store, as it adopted it)
        return self.backend  # type: ignore[no-any-return]

    # -- keys -------------------------------------------------------------------------

    def store_key(self, key: str) -> str:
        """The name of ``key``'s log in the store (see :func:`throttle_client.store_key`)."""
        return self._plan.store_key(key)

    def label(self, key: str) -> str:
        """The label of ``key``: what events, metrics, the transports' logs and the
        store's card of the key (``status``, ``top``) show instead of the key. The one
        ``label=`` gives, else the first 8 characters of its keyed hash (its store key),
        the same in every worker that shares the key secret."""
        return self._plan.label_of(self.store_key(key))

    def _usage_key(self, key: str | None, store_key: str | None) -> str:
        """The store key ``usage`` reads: ``key``'s, or ``store_key`` as given."""
        if key is None and store_key is None:
            raise TypeError("usage() takes a key (a str, not NoneType), or store_key=")
        if key is not None and store_key is not None:
            raise TypeError("usage() takes a key or store_key=, not both")
        if store_key is None:
            assert key is not None
            return self.store_key(key)
        # A store key of another namespace (or none at all) would be read under this
        # limiter's rules, which are not that key's.
        prefix = f"{self.namespace}:{{"
        if not isinstance(store_key, str) or not (
            store_key.startswith(prefix) and "}" in store_key[len(prefix) :]
        ):
            raise ConfigurationError(
                f"store_key={store_key!r} is not a store key of namespace "
                f"{self.namespace!r} ('{prefix}...}}...', as Limiter.store_key gives)"
            )
        return store_key

    # -- events -----------------------------------------------------------------------

    def listen(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener`` with every :class:`~throttle_client.Event` of this limiter
        (admitted, refused, timed out, late wake-up, paused, upstream status, store
        error, fallback); returns the function that stops it. Keys appear as their
        label, never as themselves."""
        return self._listeners.add(listener)

    def _emit(self, kind: str, store_key: str, **fields: Any) -> None:
        """Send an event about ``store_key`` (callers test ``self._listeners`` first:
        with no listener, no event is made)."""
        label = self._plan.label_of(store_key)
        self._listeners.send(Event(kind, self.namespace, label, self._wall(), **fields))

    # -- stacked calls ------------------------------------------------------------------

    def _with(self, also: Also) -> list[LimiterCore]:
        """This limiter and its partners in a call, in the order of the call's keys."""
        return [self, *(entry[0] for entry in also)]

    def _capped(self, also: Also) -> bool:
        """Whether a call with these partners holds a lease: some limiter has a cap."""
        # (A malformed entry is not judged here: _charges refuses it, saying why.)
        return bool(self.max_concurrent) or any(
            isinstance(entry, tuple) and getattr(entry[0], "max_concurrent", None) for entry in also
        )

    def _check_partner(self, other: object) -> None:
        """Another limiter a call is also charged to: of this world, on this store."""
        if not isinstance(other, LimiterCore) or type(other)._world != type(self)._world:
            raise TypeError(
                f"also= takes ({type(self).__name__}, key) pairs, not a {type(other).__name__}"
            )
        if "stacked" not in store_of(self._backend()).features:
            raise ConfigurationError(
                f"{type(store_of(self._backend())).__name__} cannot charge one call to several "
                "keys at once (it does not keep the 'stacked' feature): also= needs a store "
                "that does"
            )
        if store_of(other._backend()) is not store_of(self._backend()):
            raise ConfigurationError(
                f"{other!r} keeps its logs in another store: the limiters of one call must "
                "share one backend, so that one atomic step can book them all"
            )

    def _together(self, store_keys: list[str]) -> None:
        """Refuse, before anything is sent, keys the store cannot decide in one step; and,
        once any of them is tagged, keys whose tags differ, on every store, so that a
        mistake shows in a test on memory rather than on a Cluster in production."""
        tags = {key.partition("{")[2].partition("}")[0] for key in store_keys}
        tagged = any(not key.endswith("}") for key in store_keys)  # "<ns>:{<tag>}<key>"
        if tagged and len(tags) > 1:
            raise ConfigurationError(
                f"the keys of one call carry different tags (store keys {store_keys}): give "
                "each limiter a tag= that names what they share, the same value for all, "
                "and the same key_secret (the tag's digest depends on it)"
            )
        store_of(self._backend()).check_together(store_keys)

    def _pool(self, keys: Sequence[str], method: str) -> tuple[str, ...]:
        """A pool's keys (acquire_any), checked before anything is sent."""
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
            # (Named by its type: a key is a token, which no message may show.)
            raise TypeError(f"{method}() takes a list of keys, not a {type(keys).__name__}")
        pool = tuple(keys)
        if not pool:
            raise ConfigurationError(f"{method}() needs at least one key: it was given none")
        for key in pool:
            if not isinstance(key, str) or not key:
                what = "an empty string" if key == "" else f"a {type(key).__name__} value"
                raise ConfigurationError(f"{method}() takes non-empty string keys, not {what}")
        if pool in self._pools:  # (checked before: a fleet asks with the same pool again)
            return pool
        if len(set(pool)) != len(pool):
            twice = next(key for key in pool if pool.count(key) > 1)
            raise ConfigurationError(
                f"{method}() was given one key twice (the key labelled "
                f"{self._plan.label_of(self._plan.store_key(twice))!r}): give each once"
            )
        if self.max_concurrent:
            raise ConfigurationError(
                f"{method}() books a slot on one of several keys, and this limiter has "
                "max_concurrent, which counts calls in flight: a pool of capped keys is "
                "not supported; give the pool a limiter without max_concurrent"
            )
        if "pool" not in store_of(self._backend()).features:
            raise ConfigurationError(
                f"{type(store_of(self._backend())).__name__} does not keep pools, which "
                f"{method}() needs: memory, SQLite and Redis do"
            )
        if len(pool) > 1:
            self._together([self._plan.store_key(key) for key in pool])
        self._pools[pool] = None
        if len(self._pools) > POOLS_KEPT:
            self._pools.popitem(last=False)
        return pool

    def _refuse_capped(self, also: Also, method: str) -> None:
        if self._capped(also):
            which = (
                "this limiter has"
                if self.max_concurrent
                else "a limiter in also= (namespace "
                + ", ".join(
                    repr(entry[0].namespace)
                    for entry in also
                    if getattr(entry[0], "max_concurrent", None)
                )
                + ") has"
            )
            raise ConfigurationError(
                f"{method}() admits a call but cannot know when it ends, and {which} "
                "max_concurrent, which counts calls in flight: use `with limiter.lease(key):` "
                "(or `async with`), the throttled transports or @throttled, which end the lease"
            )

    def __repr__(self) -> str:
        rates = ", ".join(map(repr, self.rates))
        capped = f", max_concurrent={self.max_concurrent}" if self.max_concurrent else ""
        return (
            f"{type(self).__name__}(rates=[{rates}], min_interval={self.min_interval:g}, "
            f"margin={self.margin:g}{capped}, namespace={self.namespace!r})"
        )


def also_entry(entry: object, cost: int) -> tuple[LimiterCore, str, int]:
    """An ``also=`` entry as (limiter, key, cost): the call's own cost unless it names one."""
    if isinstance(entry, tuple) and len(entry) in (2, 3):
        other, key, *rest = entry
        return other, key, rest[0] if rest else cost
    raise TypeError(f"also= takes (limiter, key) or (limiter, key, cost) tuples, not {entry!r}")


def store_of(backend: Backend | AsyncBackend) -> Backend | AsyncBackend:
    """The store behind an adapter (an AsyncLimiter over MemoryBackend or SQLiteBackend)."""
    return backend.backend if isinstance(backend, (InlineAsync, ThreadedAsync)) else backend
