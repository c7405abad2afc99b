"""One control flow, two worlds: the two drivers, and the limiter's steps.

A control flow that must run both blocking and under asyncio (a store call with its
retries and failure handling, an acquire, a request with its admission, feedback and
retries, the Redis script's NOSCRIPT reload) is written once, as a generator. It does
no I/O: it yields a *step* (call the store, sleep, send a request, ...) and is sent
the step's result, or has the step's exception thrown into it. ``run`` performs the
steps with blocking calls, ``arun`` awaits them; each is given a ``perform`` function
of its world that knows how to do one step. This is how httpx runs
``Auth.auth_flow`` and tenacity its ``iter()``: the logic exists once, only the I/O
twice. This module imports nothing of the library, so every layer may use it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Generator
from typing import Any, NamedTuple, TypeVar

R = TypeVar("R")
S = TypeVar("S")  # a step


def run(flow: Generator[S, Any, R], perform: Callable[[S], Any]) -> R:
    """Drive ``flow`` to its end with blocking calls; its return value is ours."""
    result: Any = None
    error: Exception | None = None
    try:
        while True:
            try:
                step = flow.send(result) if error is None else flow.throw(error)
            except StopIteration as done:
                value: R = done.value
                return value
            finally:
                # Not kept once thrown: a frame holding the exception that holds the
                # frame would leave it to the cycle collector.
                error = None
            try:
                result = perform(step)
            except Exception as exc:  # the flow decides what it handles; the rest propagates
                result, error = None, exc
    except BaseException:
        # Cancelled, interrupted, or the flow's own error: its finally blocks run now,
        # not whenever the generator is collected.
        flow.close()
        raise


async def arun(flow: Generator[S, Any, R], perform: Callable[[S], Awaitable[Any]]) -> R:
    """Drive ``flow`` to its end, awaiting each step."""
    result: Any = None
    error: Exception | None = None
    try:
        while True:
            try:
                step = flow.send(result) if error is None else flow.throw(error)
            except StopIteration as done:
                value: R = done.value
                return value
            finally:
                error = None
            try:
                result = await perform(step)
            except Exception as exc:
                result, error = None, exc
    except BaseException:
        flow.close()
        raise


def refuse_in_event_loop(what: str) -> None:
    """Refuse a blocking call made from a thread that runs an event loop, before it does
    anything: it would stall every task of the loop while it waits (and ``await`` on its
    result, a slot already booked, fails after the fact)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return  # no loop runs in this thread: blocking is what the caller wants
    raise RuntimeError(
        f"{what} blocks, and this thread runs an asyncio event loop: it would stall every "
        "task of the loop while it waits for the store and its slot (and `await` on it "
        "fails only after a slot is booked). In asyncio code use AsyncLimiter (over "
        "AsyncRedisBackend, or MemoryBackend/SQLiteBackend as they are) and `await` it; "
        "or run the blocking call in a thread (`await asyncio.to_thread(...)`)."
    )


# -- the limiter's steps ------------------------------------------------------------------


# Steps are NamedTuples: one is made for every store call, and a tuple is several times
# cheaper to build than a frozen dataclass (a decision's Python time counts).
class Call(NamedTuple):
    """Run ``op`` on the store. Result: ``(answer, local time after)``. (Not generic: a
    generic NamedTuple needs Python 3.11.)"""

    op: Any  # a store operation (``_backends.base.Op``: this module imports nothing above it)


class Sleep(NamedTuple):
    """Sleep ``seconds`` (with the limiter's sleep). Result: the local time after."""

    seconds: float


class ReadClock(NamedTuple):
    """Result: the local time now (after a step that raised, which has no result)."""


class AwaitGrant(NamedTuple):
    """Wait up to ``seconds`` for the store to grant lease ``lease_id`` (its doorbell
    rings). Result: ``(rang, local time after)``."""

    lease_id: str
    seconds: float


class Introduce(NamedTuple):
    """Keep this limiter's key secret ``fingerprint`` as ``namespace``'s record in the
    store, unless it holds one (Backend.fingerprint). Result: ``(the one it holds, or None
    for a store that keeps no such record, local time after)``."""

    namespace: str
    fingerprint: str
    keep: bool  # False: only read the record (a read writes nothing)


LimiterStep = Call | Sleep | ReadClock | AwaitGrant | Introduce
Flow = Generator[Any, Any, R]
