"""Stores written to the old, structural contract (deprecated).

Before the contract became two base classes, a store was any object with an
``execute(op)`` method, plain for a Limiter, a coroutine function for an
AsyncLimiter. Such a store still works, wrapped here, with a DeprecationWarning
that says to subclass :class:`Backend` or :class:`AsyncBackend`. This is the only
place that inspects a method to tell the two worlds apart; it goes when the
old contract does.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, TypeVar

from .base import AsyncBackend, Backend
from .ops import Op

T = TypeVar("T")


class _SyncStore(Backend):
    def __init__(self, store: Any) -> None:
        self.store = store

    def execute(self, op: Op[T]) -> T:
        result: T = self.store.execute(op)
        return result

    def close(self) -> None:
        close = getattr(self.store, "close", None)
        if callable(close):
            close()

    def __repr__(self) -> str:
        return repr(self.store)


class _AsyncStore(AsyncBackend):
    def __init__(self, store: Any) -> None:
        self.store = store

    async def aexecute(self, op: Op[T]) -> T:
        result: T = await self.store.execute(op)
        return result

    async def aclose(self) -> None:
        aclose = getattr(self.store, "aclose", None)
        if callable(aclose):
            await aclose()

    def __repr__(self) -> str:
        return repr(self.store)


def adopt(store: object, stacklevel: int) -> Backend | AsyncBackend | None:
    """``store`` wrapped if it keeps the old contract (a DeprecationWarning, pointing
    ``stacklevel`` frames up, says so), else None."""
    execute = getattr(store, "execute", None)
    if not callable(execute):
        return None
    kind = "AsyncBackend" if inspect.iscoroutinefunction(execute) else "Backend"
    warnings.warn(
        f"{type(store).__name__} has an execute() method but is not a subclass of "
        f"throttle_client.{kind}: subclass it (stores of the old contract are deprecated)",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )
    return _AsyncStore(store) if kind == "AsyncBackend" else _SyncStore(store)
