"""Seeing what a limiter asks of its store, for the tests that count round trips."""

from __future__ import annotations

from typing import Any


def store_calls(limiter: Any) -> list[Any]:
    """Every op the limiter's store executes from now on, in order (the store's own
    ``execute``, wrapped): a list that grows as the limiter works."""
    store = limiter._backend()
    seen: list[Any] = []
    execute = store.execute

    def spy(op: Any) -> Any:
        seen.append(op)
        return execute(op)

    store.execute = spy
    return seen
