"""httpx transports and clients that ask a limiter before every request.

``ThrottledTransport`` and ``AsyncThrottledTransport`` run one request's course
(:mod:`._request_flow`: admit, send, read the feedback, pause, retry), each performing
its steps in its world; ``ThrottledClient`` and ``AsyncThrottledClient`` are httpx
clients over them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import httpx

from ._events import Listener
from ._flow import arun, refuse_in_event_loop, run
from ._lease import AsyncLease, Lease
from ._limiter import AsyncLimiter, Limiter
from ._request_flow import (
    AsyncReleasing,
    Discard,
    Hold,
    Releasing,
    Send,
    TransportCore,
    adrain,
    drain,
    lease_of,
)
from ._request_key import request_key
from ._routes import AlsoSpec, CostFunc, KeyFunc, PausesFunc, RetryPolicy, Route, TokenPool

# httpx.Client options that configure its default transport: ThrottledClient hands
# them to the inner transport it builds, so they keep working.
_TRANSPORT_OPTIONS = ("verify", "cert", "trust_env", "http1", "http2", "limits")


class ThrottledTransport(httpx.BaseTransport):
    """An httpx transport that waits for the limiter before each request and pauses
    the key for every worker when the upstream pushes back.

    >>> limiter = Limiter(RedisBackend(url), rates=["5000/hour"], min_interval=0.1)
    >>> client = httpx.Client(transport=ThrottledTransport(limiter))
    >>> client.get("https://api.example.com/me", headers={"Authorization": "Bearer t"})

    ``key``: the request's key, by default its access token, else its host
    (:func:`request_key`). ``routes``: limiters for some hosts/paths (the first match
    wins); what matches none uses ``limiter``, or passes unthrottled when it is None.
    ``cost``: units per request, or a function of the request. ``retry``: see
    :class:`RetryPolicy`. ``acquire_timeout``: the longest wait for a slot (None: no
    limit); beyond it ``ThrottleTimeout`` propagates to the caller and nothing is sent.
    One request may set its own in the request extension ``"acquire_timeout"`` (seconds,
    or None for no limit), e.g. to wait no later than a deadline::

        left = deadline - time.monotonic()
        client.get(url, extensions={"acquire_timeout": max(0.0, left)})

    When the attempts run out the last response is returned, whatever its status.
    Closing the transport closes ``transport`` (default ``httpx.HTTPTransport()``).
    ``learn``: quota headers (``X-RateLimit-*``, ``RateLimit``) that allow fewer calls
    than the limiter's rates hold the key to them, for every worker, until their reset
    (:meth:`Limiter.learn`); False ignores them (a 429 still pauses the key).

    ``also``: (limiter, key function) pairs every request is charged to as well, in the
    same atomic step (an account beside its tokens; see :class:`Route`). ``pauses``:
    which of a request's limiters (its own, those of ``also``) a pause its response
    asks for holds, as a function of the response that returns them (or None: the
    request's own). By default the request's own key alone is paused, so that a 429 on
    one token leaves the other tokens of its account sending::

        def pauses(response):  # the upstream names the quota it refused
            if response.headers.get("X-RateLimit-Scope") == "account":
                return [account]  # (also=: every token of the account waits)
            return None

    A limiter named that the request is not charged to is ignored with a warning, and
    a ``pauses`` that fails is logged; when it names none that counts, the request's
    own key is paused (a pause never holds no key: the retries would go at once).

    ``pool``: a :class:`TokenPool`: each request goes out with the token of the pool
    whose slot is earliest (:meth:`Limiter.acquire_any`), set on it by the pool, instead
    of its own key; a retry may take another token, and a 429 pauses the token it was
    sent with. A route's ``pool`` wins.

    ``priority``: its requests' (:meth:`Limiter.acquire`); ``"low"`` lets the requests
    of the usual priority, of this transport or any other, go first. One request's own
    is set by the extension ``priority``: ``client.get(url, extensions={"priority":
    "low"})``. Not on a limiter with ``max_concurrent``.

    On a limiter with ``max_concurrent`` each request holds a lease from its admission
    until its response is closed: read (``client.get``), or, streamed, closed by you
    (``with client.stream(...)``); a body already in memory ends it at once.
    """

    def __init__(
        self,
        limiter: Limiter | None = None,
        *,
        transport: httpx.BaseTransport | None = None,
        routes: Sequence[Route[Limiter]] = (),
        key: KeyFunc = request_key,
        cost: int | CostFunc = 1,
        retry: RetryPolicy = RetryPolicy(),
        acquire_timeout: float | timedelta | None = None,
        also: Sequence[AlsoSpec[Limiter]] = (),
        learn: bool = True,
        pauses: PausesFunc[Limiter] | None = None,
        pool: TokenPool | None = None,
        priority: str = "normal",
    ) -> None:
        self._core = TransportCore(
            Limiter,
            limiter,
            routes,
            key,
            cost,
            retry,
            acquire_timeout,
            also,
            learn,
            pauses,
            pool,
            priority,
        )
        self._transport = transport if transport is not None else httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        plan = self._core.plan(request)
        if plan is None:
            return self._transport.handle_request(request)
        refuse_in_event_loop("ThrottledTransport (a sync httpx.Client)")
        limiter = plan.limiter

        def perform(step: Any) -> Any:
            if isinstance(step, Hold):
                lease = Lease(lease_of(step))
                return lease.__enter__(), lease
            if isinstance(step, Send):
                try:
                    response = self._transport.handle_request(step.request)
                except BaseException:
                    if step.lease is not None:
                        step.lease.release()
                    raise
                if step.lease is not None:
                    if isinstance(response.stream, httpx.ByteStream):
                        step.lease.release()  # the whole body is here: nothing in flight
                    else:
                        response.stream = Releasing(response.stream, step.lease)
                return response, limiter._local(), limiter._wall()
            if isinstance(step, Discard):
                drain(step.response)
                return limiter._local()
            return limiter._perform(step)

        return run(self._core.flow(plan, request, limiter._local()), perform)

    def listen(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener`` with every :class:`~throttle_client.Event` of the limiters
        this transport uses; returns the function that stops it."""
        return self._core.listen(listener)

    def close(self) -> None:
        self._transport.close()


class AsyncThrottledTransport(httpx.AsyncBaseTransport):
    """The asyncio twin of :class:`ThrottledTransport`, over an :class:`AsyncLimiter`.

    >>> limiter = AsyncLimiter(AsyncRedisBackend(url), rates=["5000/hour"])
    >>> async with httpx.AsyncClient(transport=AsyncThrottledTransport(limiter)) as client:
    ...     await client.get("https://api.example.com/me", params={"access_token": t})
    """

    def __init__(
        self,
        limiter: AsyncLimiter | None = None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
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
        self._core = TransportCore(
            AsyncLimiter,
            limiter,
            routes,
            key,
            cost,
            retry,
            acquire_timeout,
            also,
            learn,
            pauses,
            pool,
            priority,
        )
        self._transport = transport if transport is not None else httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        plan = self._core.plan(request)
        if plan is None:
            return await self._transport.handle_async_request(request)
        limiter = plan.limiter

        async def perform(step: Any) -> Any:
            if isinstance(step, Hold):
                lease = AsyncLease(lease_of(step))
                return await lease.__aenter__(), lease
            if isinstance(step, Send):
                try:
                    response = await self._transport.handle_async_request(step.request)
                except BaseException:
                    if step.lease is not None:
                        await step.lease.release()
                    raise
                if step.lease is not None:
                    if isinstance(response.stream, httpx.ByteStream):
                        await step.lease.release()
                    else:
                        response.stream = AsyncReleasing(response.stream, step.lease)
                return response, limiter._local(), limiter._wall()
            if isinstance(step, Discard):
                await adrain(step.response)
                return limiter._local()
            return await limiter._perform(step)

        return await arun(self._core.flow(plan, request, limiter._local()), perform)

    def listen(self, listener: Listener) -> Callable[[], None]:
        """As :meth:`ThrottledTransport.listen`."""
        return self._core.listen(listener)

    async def aclose(self) -> None:
        await self._transport.aclose()


class ThrottledClient(httpx.Client):
    """An ``httpx.Client`` whose every request goes through a :class:`ThrottledTransport`.

    >>> with ThrottledClient(limiter, base_url="https://api.github.com",
    ...                      routes=[Route(search_limiter, path="/search")]) as client:
    ...     client.get("/user", headers={"Authorization": "token t"})

    Takes the throttling arguments of :class:`ThrottledTransport` and every usual
    ``httpx.Client`` argument. ``transport`` is the inner transport; without one, the
    client's ``verify``/``cert``/``http2``/``limits``/``proxy``/``trust_env`` build it.
    Transports in ``mounts`` are not throttled: wrap them in ThrottledTransport yourself.
    """

    def __init__(
        self,
        limiter: Limiter | None = None,
        *,
        routes: Sequence[Route[Limiter]] = (),
        key: KeyFunc = request_key,
        cost: int | CostFunc = 1,
        retry: RetryPolicy = RetryPolicy(),
        acquire_timeout: float | timedelta | None = None,
        also: Sequence[AlsoSpec[Limiter]] = (),
        learn: bool = True,
        pauses: PausesFunc[Limiter] | None = None,
        pool: TokenPool | None = None,
        priority: str = "normal",
        transport: httpx.BaseTransport | None = None,
        **kwargs: Any,
    ) -> None:
        if transport is None:
            transport = httpx.HTTPTransport(**_client_transport_options(kwargs))
        throttled = ThrottledTransport(
            limiter,
            transport=transport,
            routes=routes,
            key=key,
            cost=cost,
            retry=retry,
            acquire_timeout=acquire_timeout,
            also=also,
            learn=learn,
            pauses=pauses,
            pool=pool,
            priority=priority,
        )
        super().__init__(transport=throttled, **kwargs)
        self._throttled = throttled

    def listen(self, listener: Listener) -> Callable[[], None]:
        """As :meth:`ThrottledTransport.listen`."""
        return self._throttled.listen(listener)


class AsyncThrottledClient(httpx.AsyncClient):
    """An ``httpx.AsyncClient`` whose every request goes through an
    :class:`AsyncThrottledTransport`; arguments as for :class:`ThrottledClient`.

    >>> async with AsyncThrottledClient(limiter, base_url=upstream) as client:
    ...     await client.get("/items", headers={"Authorization": "Bearer t"})
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
        transport: httpx.AsyncBaseTransport | None = None,
        **kwargs: Any,
    ) -> None:
        if transport is None:
            transport = httpx.AsyncHTTPTransport(**_client_transport_options(kwargs))
        throttled = AsyncThrottledTransport(
            limiter,
            transport=transport,
            routes=routes,
            key=key,
            cost=cost,
            retry=retry,
            acquire_timeout=acquire_timeout,
            also=also,
            learn=learn,
            pauses=pauses,
            pool=pool,
            priority=priority,
        )
        super().__init__(transport=throttled, **kwargs)
        self._throttled = throttled

    def listen(self, listener: Listener) -> Callable[[], None]:
        """As :meth:`ThrottledTransport.listen`."""
        return self._throttled.listen(listener)


def _client_transport_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The inner transport's share of httpx.Client arguments. ``proxy`` moves there
    entirely: left to the client it would mount a transport that bypasses the limiter."""
    options = {name: kwargs[name] for name in _TRANSPORT_OPTIONS if name in kwargs}
    if "proxy" in kwargs:
        proxy = kwargs.pop("proxy")
        # A transport takes only a Proxy before httpx 0.26; a client took a URL too.
        options["proxy"] = httpx.Proxy(proxy) if isinstance(proxy, (str, httpx.URL)) else proxy
    return options
