"""``@throttled``: a fetch function that waits for its slot before every call.

``_CallPlan`` (no I/O) works out a call's key and cost from its arguments; the two
wrappers only acquire, in their world, and call.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import Any, ParamSpec, TypeGuard, TypeVar, cast

from ._config import check_priority
from ._errors import ConfigurationError
from ._limiter import AsyncLimiter, Limiter

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
                # A lease: on a capped limiter the call counts as in flight while it runs.
                async with async_limiter.lease(
                    plan.key_of(args, kwargs),
                    plan.cost_of(args, kwargs),
                    timeout=timeout,
                    also=plan.also_of(args, kwargs),
                    priority=priority,
                ):
                    return await func(*args, **kwargs)

            return cast(Callable[P, R], async_wrapper)
        if not isinstance(limiter, Limiter):
            raise TypeError(
                f"{_name(func)} is a plain function: throttle it with a Limiter, not {limiter!r}"
            )
        sync_limiter = limiter

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            with sync_limiter.lease(
                plan.key_of(args, kwargs),
                plan.cost_of(args, kwargs),
                timeout=timeout,
                also=plan.also_of(args, kwargs),
                priority=priority,
            ):
                return func(*args, **kwargs)

        return wrapper

    return decorate
