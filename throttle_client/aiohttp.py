"""aiohttp: a client middleware that asks an AsyncLimiter before each request.

``ThrottledMiddleware`` runs each request through the very course the httpx transports
run (``_request_flow``: admit, send, read the feedback, pause, retry), with their options:
keys from the request's credentials, routes, ``also=``, token pools, priorities, caps, 429
/ Retry-After and rate-limit headers shared with every worker, limits learned from them,
and retries through the limiter. It only translates (``_adapting``): the flow sees the
request and each response as httpx objects, and aiohttp's own are sent and returned.

    pip install 'throttle-client[aiohttp]'

    async with aiohttp.ClientSession(middlewares=[ThrottledMiddleware(limiter)]) as session:
        async with session.get(url, headers={"Authorization": f"Bearer {token}"}) as response:
            ...
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import aiohttp
import httpx
from aiohttp import ClientRequest, ClientResponse, RequestInfo
from aiohttp.client_middlewares import ClientHandlerType
from aiohttp.payload import BytesPayload
from multidict import CIMultiDict, CIMultiDictProxy

from ._adapting import changes, original_of, request_view, response_view
from ._events import Listener
from ._flow import arun
from ._lease import AsyncLease
from ._limiter import AsyncLimiter
from ._request_flow import Discard, Hold, Send, TransportCore, lease_of
from ._request_key import request_key
from ._routes import AlsoSpec, CostFunc, KeyFunc, PausesFunc, RetryPolicy, Route, TokenPool

__all__ = ["ThrottledMiddleware"]

logger = logging.getLogger("throttle_client")

# The ends of capped requests' leases under way: each task is kept until it is done.
_ENDING: set[asyncio.Task[None]] = set()


class ThrottledMiddleware:
    """An aiohttp client middleware (aiohttp 3.12 or later) that waits for the limiter
    before each request and pauses the key for every worker when the upstream pushes
    back; the options are :class:`~throttle_client.AsyncThrottledTransport`'s, and behave
    the same.

    >>> session = aiohttp.ClientSession(middlewares=[ThrottledMiddleware(limiter)])

    The functions it is given (``key``, ``cost``, the key functions of ``also``,
    ``pauses``) see the request and the response as httpx objects with the same method,
    URL, headers and status (``response.extensions["throttle_client.original_response"]``
    is aiohttp's own). A pool's token is set on the request for the attempt that takes it.
    With ``max_concurrent`` a request holds its lease until its body has been read
    through, or its response is released or closed (``async with`` ends), whichever
    comes first.
    """

    def __init__(
        self,
        limiter: AsyncLimiter | None = None,
        *,
        routes: Sequence[Route[AsyncLimiter]] = (),
        key: KeyFunc = request_key,
        cost: int | CostFunc = 1,
        retry: RetryPolicy = RetryPolicy(),
        acquire_timeout: float | timedelta | None = None,
        also: Sequence[AlsoSpec[AsyncLimiter]] = (),
        learn: bool = True,
        pauses: PausesFunc[AsyncLimiter] | None = None,
        pool: TokenPool | None = None,
        priority: str = "normal",
    ) -> None:
        options = (key, cost, retry, acquire_timeout, also, learn, pauses, pool, priority)
        self._core = TransportCore(AsyncLimiter, limiter, routes, *options)

    async def __call__(self, request: ClientRequest, handler: ClientHandlerType) -> ClientResponse:
        view = request_view(
            request.method,
            str(request.url),
            request.headers.items(),
            # (bytes, text and JSON in memory can be sent again; a file or a stream cannot)
            replayable=request.body == b"" or isinstance(request.body, BytesPayload),
        )
        plan = self._core.plan(view)
        if plan is None:
            return await handler(request)
        limiter = plan.limiter
        headers, url = request.headers.copy(), request.url

        async def perform(step: Any) -> Any:
            if isinstance(step, Hold):
                lease = AsyncLease(lease_of(step))
                return await lease.__aenter__(), lease
            if isinstance(step, Send):
                _as_sent(request, headers, url, view, step.request)
                try:
                    response = await handler(request)
                except BaseException:
                    if step.lease is not None:
                        await step.lease.release()
                    raise
                if step.lease is not None:
                    _hold_until_done(response, step.lease)
                seen = response_view(
                    response.status, response.headers.items(), step.request, response
                )
                return seen, limiter._local(), limiter._wall()
            if isinstance(step, Discard):
                await _drain(original_of(step.response))  # (a retry: its body is not wanted)
                return limiter._local()
            return await limiter._perform(step)

        answer = await arun(self._core.flow(plan, view, limiter._local()), perform)
        final: ClientResponse = original_of(answer)
        if plan.pool is not None:
            _as_asked(final, url, headers)
        return final

    def listen(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener`` with every :class:`~throttle_client.Event` of the limiters
        this middleware uses; returns the function that stops it."""
        return self._core.listen(listener)


def _as_sent(
    request: ClientRequest,
    headers: Any,
    url: Any,
    view: httpx.Request,
    outgoing: httpx.Request,
) -> None:
    """``request`` as the flow sends this attempt: its own headers and URL, with what a
    token pool set on the view (each attempt may take another token)."""
    if outgoing is view:  # (no pool: the request goes as it came)
        return
    changed, removed, new_url = changes(view, outgoing)
    request.headers.clear()
    request.headers.extend(headers)
    for name, values in changed.items():
        request.headers.popall(name, None)
        for value in values:  # (a repeated header keeps every value)
            request.headers.add(name, value)
    for name in removed:
        request.headers.popall(name, None)
    request.url = url if new_url is None else type(url)(new_url)


async def _drain(response: ClientResponse) -> None:
    """Read and release a response thrown away: a drained one gives its connection back
    (released unread, it would be closed)."""
    try:
        await response.read()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        pass  # the body of a response we throw away is not worth an error
    finally:
        response.release()


def _as_asked(response: ClientResponse, url: Any, headers: Any) -> None:
    """The caller's request on the response's ``request_info`` (which ``raise_for_status``
    puts in its error), not the attempt that carried a pool's token. (aiohttp keeps it
    in a private field, the same from 3.12 on; a response without it is left alone.)"""
    info = getattr(response, "_request_info", None)
    if isinstance(info, RequestInfo):
        asked = RequestInfo(url, info.method, CIMultiDictProxy(CIMultiDict(headers)), info.real_url)
        response._request_info = asked


def _hold_until_done(response: ClientResponse, lease: AsyncLease) -> None:
    """A capped request's lease ends when its body has been read through, or when its
    response is released or closed, whichever comes first (aiohttp calls neither
    asynchronously: the end is a task of its own)."""
    loop, ended = asyncio.get_running_loop(), [False]

    def end() -> None:
        if not ended[0]:
            ended[0] = True
            task = loop.create_task(_end(lease))
            _ENDING.add(task)
            task.add_done_callback(_ENDING.discard)

    for name in ("release", "close"):
        original = getattr(response, name)

        def ending(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            try:
                return _original(*args, **kwargs)
            finally:
                end()

        setattr(response, name, ending)
    response.content.on_eof(end)


async def _end(lease: AsyncLease) -> None:
    try:
        await lease.release()
    except Exception:  # (the store is out of reach: the lease ends with its TTL)
        logger.exception("a capped request's lease could not be ended now")
