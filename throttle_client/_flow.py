"""One control flow, two worlds: the steps a flow asks for, and the two drivers.

A control flow of the limiter or of a transport (a store call with its retries and
failure handling, an acquire, a request with its admission, feedback and retries) is
written once, as a generator. It does no I/O and reads no clock: it yields a *step*
(call the store, sleep, send a request, ...) and is sent the step's result, or has
the step's exception thrown into it. ``run`` performs the steps with blocking calls,
``arun`` awaits them; each is given a ``perform`` function of its world that knows
how to do one step. This is how httpx runs ``Auth.auth_flow`` and tenacity its
``iter()``: the logic exists once, only the I/O twice.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import httpx

from ._backends.base import Op

R = TypeVar("R")
S = TypeVar("S")  # a step
T = TypeVar("T")


@dataclass(frozen=True)
class Call(Generic[T]):
    """Run ``op`` on the store. Result: ``(answer, local time after)``."""

    op: Op[T]


@dataclass(frozen=True)
class Sleep:
    """Sleep ``seconds``. Result: the local time after.

    ``backoff``: a pause between retries of a failed store call, slept on the real
    clock whatever clock and sleep a test injected (tenacity times its retries on the
    real clock too).
    """

    seconds: float
    backoff: bool = False


@dataclass(frozen=True)
class ReadClock:
    """Result: the local time now (after a step that raised, which has no result)."""


@dataclass(frozen=True)
class Send:
    """Send ``request`` upstream. Result: ``(response, local time, wall-clock time)``."""

    request: httpx.Request


@dataclass(frozen=True)
class Discard:
    """Drain and close ``response`` (it gives its connection back). Result: local time."""

    response: httpx.Response


Step = Call[Any] | Sleep | ReadClock | Send | Discard
Flow = Generator[Step, Any, R]


def run(flow: Generator[S, Any, R], perform: Callable[[S], Any]) -> R:
    """Drive ``flow`` to its end with blocking calls; its return value is ours."""
    result: Any = None
    error: Exception | None = None
    while True:
        try:
            step = flow.send(result) if error is None else flow.throw(error)
        except StopIteration as done:
            value: R = done.value
            return value
        try:
            result, error = perform(step), None
        except Exception as exc:  # the flow decides what it handles; the rest propagates
            result, error = None, exc


async def arun(flow: Generator[S, Any, R], perform: Callable[[S], Awaitable[Any]]) -> R:
    """Drive ``flow`` to its end, awaiting each step."""
    result: Any = None
    error: Exception | None = None
    while True:
        try:
            step = flow.send(result) if error is None else flow.throw(error)
        except StopIteration as done:
            value: R = done.value
            return value
        try:
            result, error = await perform(step), None
        except Exception as exc:
            result, error = None, exc
