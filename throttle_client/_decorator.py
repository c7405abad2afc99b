"""``@throttled``: a fetch function that waits for its slot before every call.

``_CallPlan`` (no I/O) works out a call's key and cost from its arguments; the two
wrappers only acquire, in their world, call, and, told how (``feedback=``), read the
upstream's answer from what the call returned or raised: a pause it asks for holds the
key for every worker, and quota headers hold it to the upstream's limit, as a
transport's response does.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import Any, ParamSpec, TypeGuard, TypeVar, cast

import httpx

from ._config import check_priority
from ._core import LimiterCore
from ._errors import ConfigurationError
from ._feedback import read_feedback
from ._flow import Flow, arun, run
from ._key_flows import pause_flow
from ._learning import learn_flow, report_problems
from ._limiter import AsyncLimiter, Limiter
from ._results import Decision
from ._routes import RetryPolicy

logger = logging.getLogger("throttle_client")

# What a call's outcome (its result, or the exception it raised) says the upstream
# answered: (status, headers), or None for nothing to read.
Feedback = Callable[[Any], "tuple[int, Any] | None"]
_POLICY = RetryPolicy()  # (the transports' default pauses: at most 300 s, 1 s if unsaid)

P = ParamSpec("P")
R = TypeVar("R")


def _name(func: Callable[..., Any]) -> str:
    """What messages call ``func``; a callable object or a partial has no __qualname__."""
    if isinstance(func, functools.partial):
        return f"partial({_name(func.func)})"
    name: str | None = getattr(func, "__qualname__", None)
    return name or f"{type(func).__qualname__}.__call__"


def _is_async(func: Callable[..., Any]) -> TypeGuard[Callable[..., Awaitable[Any]]]:
    """A coroutine function, a partial of one, or an object whose __call__ is one."""
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__)


class _CallPlan:
    """Reads the key and cost of a call of ``func`` from its arguments."""

    def __init__(
        self,
        func: Callable[..., Any],
        key: str | Callable[..., str],
        cost: int | str | Callable[..., int],
        also: Sequence[tuple[Any, ...]] = (),
    ) -> None:
        self.signature = inspect.signature(func)
        self.key = key
        self.cost = cost
        self.also = tuple(also)
        for entry in self.also:
            if not (isinstance(entry, tuple) and len(entry) in (2, 3)):
                raise TypeError(
                    f"also= takes (limiter, key) or (limiter, key, cost), not {entry!r}"
                )
        specs = [("key", key), ("cost", cost)]
        for entry in self.also:
            specs += [("also key", entry[1])] + (
                [("also cost", entry[2])] if len(entry) == 3 else []
            )
        for what, spec in specs:
            if isinstance(spec, str):
                self._check_name(func, what, spec)
            elif what.endswith("cost") and isinstance(spec, int) and not isinstance(spec, bool):
                if spec < 1:
                    raise ConfigurationError(f"cost must be a positive integer, not {spec!r}")
            elif not callable(spec):
                kind = "an argument name or a callable" + (
                    ", or an int" if what.endswith("cost") else ""
                )
                raise TypeError(f"{what} must be {kind}, not {spec!r}")

    def _check_name(self, func: Callable[..., Any], what: str, name: str) -> None:
        params = self.signature.parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        if name not in params and not takes_any:
            raise ConfigurationError(
                f"{what}={name!r} names no argument of {_name(func)}{self.signature}"
            )

    def _argument(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        if name in bound.arguments and self.signature.parameters[name].kind not in (
            inspect.Parameter.VAR_KEYWORD,
            inspect.Parameter.VAR_POSITIONAL,
        ):
            return bound.arguments[name]
        if name in kwargs:  # it came through **kwargs
            return kwargs[name]
        raise TypeError(f"the call passed no argument {name!r} to throttle on")

    def key_of(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        spec: str | Callable[..., str] | None = None,
    ) -> str:
        spec = self.key if spec is None else spec
        if isinstance(spec, str):
            key: str = self._argument(spec, args, kwargs)
            return key
        return spec(*args, **kwargs)

    def also_of(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """The other limiters the call is charged to, with its keys (and costs) there."""
        return [
            (entry[0], self.key_of(args, kwargs, entry[1]))
            + ((self.cost_of(args, kwargs, entry[2]),) if len(entry) == 3 else ())
            for entry in self.also
        ]

    def cost_of(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        spec: int | str | Callable[..., int] | None = None,
    ) -> int:
        spec = self.cost if spec is None else spec
        if isinstance(spec, int):
            return spec
        if isinstance(spec, str):
            cost: int = self._argument(spec, args, kwargs)
            return cost
        return spec(*args, **kwargs)


def throttled(
    limiter: Limiter | AsyncLimiter,
    *,
    key: str | Callable[..., str],
    cost: int | str | Callable[..., int] = 1,
    timeout: float | timedelta | None = None,
    also: Sequence[tuple[Any, ...]] = (),
    priority: str = "normal",
    feedback: Feedback | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Make every call of the decorated function wait for its slot first; on a limiter
    with ``max_concurrent`` the call holds a lease while it runs (see ``Limiter.lease``).

    ``key``: the name of the argument that holds the key (usually the token), or a
    callable over the call's arguments. ``cost``: units per call, fixed, the name of an
    argument, or a callable over the call's arguments. ``timeout``: the longest wait
    for a slot; beyond it ``ThrottleTimeout`` is raised and the function is not called.
    ``also``: (limiter, key) pairs each call is charged to as well, all or nothing, the
    key given as ``key`` is (an argument name, or a callable over the call's arguments);
    a third item, given as ``cost`` is, charges that key another cost. ``priority``:
    ``"low"`` lets calls of the usual priority go first (see ``Limiter.acquire``).
    ``feedback``: a function of what a call returned, or of the exception it raised,
    that gives the upstream's answer as ``(status, headers)`` (None: nothing to read):
    a 429 (or a 503 with Retry-After, or a spent quota) pauses the call's key for every
    worker, and quota headers hold the key to the upstream's limit, as a throttled
    transport does with a response; the call's own outcome is returned or raised as it
    is. ``feedback=lambda r: (r.status_code, r.headers)`` for a function that returns a
    response; one that fails is logged, and nothing is read.
    A plain function needs a :class:`Limiter`, a coroutine function (or an object
    whose ``__call__`` is one) an :class:`AsyncLimiter`. Name, docstring and signature
    are kept; methods work. Generator functions are refused: their body runs while
    they are iterated, not when they are called.

    >>> @throttled(limiter, key="token")
    ... def fetch(token: str, url: str) -> bytes:
    ...     return httpx.get(url, headers={"Authorization": f"Bearer {token}"}).content
    >>> @throttled(async_limiter, key=lambda client, user: user.token, cost=2)
    ... async def profile(client: httpx.AsyncClient, user: User) -> dict: ...
    """
    check_priority(priority, "priority")  # (here, not at the first call)
    if feedback is not None and (not callable(feedback) or _is_async(feedback)):
        raise TypeError(f"feedback must be a plain function of a call's outcome, not {feedback!r}")
    if priority != "normal" and any(
        getattr(one, "max_concurrent", None) for one in [limiter, *(spec[0] for spec in also)]
    ):
        raise ConfigurationError(
            f"priority={priority!r} with a capped limiter: a capped call waits for its "
            "lease in one queue, whatever its priority"
        )

    def decorate(func: Callable[P, R]) -> Callable[P, R]:
        for kind, test in (
            ("an async generator", inspect.isasyncgenfunction),
            ("a generator", inspect.isgeneratorfunction),
        ):
            if test(func):
                # Calling one only builds the generator; its body, and the requests in
                # it, run later, while it is iterated: a slot taken at the call would
                # be spent on nothing.
                raise TypeError(
                    f"{_name(func)} is {kind} function, whose body runs only while it is "
                    "iterated: throttle the requests it makes instead (limiter.acquire in "
                    "it, or a ThrottledTransport)"
                )
        plan = _CallPlan(func, key, cost, also)
        if _is_async(func):
            if not isinstance(limiter, AsyncLimiter):
                raise TypeError(
                    f"{_name(func)} is a coroutine function: throttle it with an "
                    f"AsyncLimiter, not {limiter!r}"
                )
            async_limiter = limiter

            @functools.wraps(func)
            async def async_wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
                key = plan.key_of(args, kwargs)
                # A lease: on a capped limiter the call counts as in flight while it runs.
                async with async_limiter.lease(
                    key,
                    plan.cost_of(args, kwargs),
                    timeout=timeout,
                    also=plan.also_of(args, kwargs),
                    priority=priority,
                ) as decision:
                    try:
                        result = await func(*args, **kwargs)
                    except Exception as error:
                        told = _heard(feedback, error, func)
                        await _aheeded(async_limiter, key, decision, told, func)
                        raise
                    told = _heard(feedback, result, func)
                    await _aheeded(async_limiter, key, decision, told, func)
                    return result

            return cast(Callable[P, R], async_wrapper)
        if not isinstance(limiter, Limiter):
            raise TypeError(
                f"{_name(func)} is a plain function: throttle it with a Limiter, not {limiter!r}"
            )
        sync_limiter = limiter

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            key = plan.key_of(args, kwargs)
            with sync_limiter.lease(
                key,
                plan.cost_of(args, kwargs),
                timeout=timeout,
                also=plan.also_of(args, kwargs),
                priority=priority,
            ) as decision:
                try:
                    result = func(*args, **kwargs)
                except Exception as error:
                    _heeded(sync_limiter, key, decision, _heard(feedback, error, func), func)
                    raise
                _heeded(sync_limiter, key, decision, _heard(feedback, result, func), func)
                return result

        return wrapper

    return decorate


def _heard(
    feedback: Feedback | None, outcome: Any, func: Callable[..., Any]
) -> tuple[int, httpx.Headers] | None:
    """The upstream's answer in a call's outcome, as ``feedback`` reads it; a feedback
    that fails, or gives something else, is logged, and nothing is read (the call's own
    outcome still goes to its caller)."""
    if feedback is None:
        return None
    try:
        told = feedback(outcome)
        if told is None:
            return None
        status, headers = told
        if isinstance(status, bool) or not isinstance(status, int):
            raise TypeError(f"feedback= gave the status {status!r}, not an int")
        # (Any mapping of names to values, or pairs: a client's own headers, urllib's
        # Message, ints or bytes as values; None for none.)
        pairs = headers.items() if hasattr(headers, "items") else headers or ()
        return status, httpx.Headers([(_text(k), _text(v)) for k, v in pairs])
    except Exception:
        # A feedback written for responses may not know an exception (a lost
        # connection): the caller sees that exception; the log says it quietly.
        log = logger.debug if isinstance(outcome, BaseException) else logger.exception
        log("feedback= failed for %s: its answer was not read", _name(func), exc_info=True)
        return None


def _text(value: object) -> str:
    return value.decode("latin-1") if isinstance(value, bytes) else str(value)


def _heed(
    limiter: LimiterCore, key: str, decision: Decision, told: tuple[int, httpx.Headers], name: str
) -> Flow[None]:
    """What a transport does with a response: learn the quota, pause the key."""
    status, headers = told
    read = read_feedback(
        status,
        headers,
        now=limiter._wall(),
        max_pause=_POLICY.max_pause,
        fallback=_POLICY.fallback(1),
        quota=True,
    )
    report_problems(limiter, read.problems, f" from {name}")
    now = limiter._local()
    _, now = yield from learn_flow(limiter, key, decision, read.view, now, _POLICY.max_pause)
    if read.pause:
        logger.warning(
            "upstream refused %s (HTTP %d): pausing its key for %.2fs (%s)",
            name,
            status,
            read.pause,
            read.reason,
        )
        fields = {"reason": read.reason, "source": "upstream", "route": name}
        yield from pause_flow(limiter, key, read.pause, now, refused=status == 429, **fields)


def _heeded(
    limiter: Limiter,
    key: str,
    decision: Decision,
    told: tuple[int, httpx.Headers] | None,
    func: Callable[..., Any],
) -> None:
    """:func:`_heed` run; a store out of reach is logged (the call's own outcome still
    goes to its caller)."""
    if told is None:
        return
    try:
        run(_heed(limiter, key, decision, told, _name(func)), limiter._perform)
    except Exception:
        logger.exception("the upstream's answer to %s could not be shared", _name(func))


async def _aheeded(
    limiter: AsyncLimiter,
    key: str,
    decision: Decision,
    told: tuple[int, httpx.Headers] | None,
    func: Callable[..., Any],
) -> None:
    """:func:`_heeded` in asyncio."""
    if told is None:
        return
    try:
        await arun(_heed(limiter, key, decision, told, _name(func)), limiter._perform)
    except Exception:
        logger.exception("the upstream's answer to %s could not be shared", _name(func))
