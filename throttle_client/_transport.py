"""httpx transports and clients that ask a limiter before every request.

Every decision (which limiter and key, how long the upstream wants us to hold off,
whether to retry, what to log) lives in ``_TransportCore``, and one request's whole
course in its ``flow``: admit (the limiter's acquire flow), send, read the feedback,
pause the key, retry. ``ThrottledTransport`` and ``AsyncThrottledTransport`` only
perform the flow's steps in their world (see ``_flow``). Every attempt goes through
the limiter again, so a retry waits for the shared pause and for its own
first-come-first-served slot.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Generic, TypeVar, cast

import httpx

from ._acquiring import send_flow
from ._errors import ConfigurationError
from ._events import UPSTREAM_STATUS, Listener
from ._feedback import Feedback, read_feedback
from ._flow import Flow, arun, refuse_in_event_loop, run
from ._key_flows import pause_flow
from ._learning import learn_flow
from ._lease import AsyncLease, Lease, _Held
from ._limiter import AsyncLimiter, Limiter
from ._rate import bounded_seconds, to_seconds
from ._request_key import credential_names, key_label, request_key

logger = logging.getLogger("throttle_client")

IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"})
# A wait for a slot longer than this is worth a line in the log.
LONG_WAIT = 10.0
# The request extension that bounds one request's wait for its slot, instead of the
# transport's acquire_timeout: client.get(url, extensions={"acquire_timeout": 2.5}).
ACQUIRE_TIMEOUT = "acquire_timeout"

L = TypeVar("L", Limiter, AsyncLimiter)
KeyFunc = Callable[[httpx.Request], str]
CostFunc = Callable[[httpx.Request], int]
# Another limiter a request is charged to: with a function of the request for its key,
# and optionally the cost charged there (an int, or a function of the request).
AlsoSpec = tuple[L, KeyFunc] | tuple[L, KeyFunc, int | CostFunc]

# The port a URL without one is sent to (httpx reports it as None).
_DEFAULT_PORTS = {"http": 80, "https": 443}

# httpx.Client options that configure its default transport: ThrottledClient hands
# them to the inner transport it builds, so they keep working.
_TRANSPORT_OPTIONS = ("verify", "cert", "trust_env", "http1", "http2", "limits")


@dataclass(frozen=True)
class Route(Generic[L]):
    """Requests to ``host`` (any host when None) whose path is ``path`` or lies below
    it go through ``limiter``. The first matching route wins. A host with a port
    (``"127.0.0.1:8080"``, ``"[::1]:8080"``) matches that port only; a bare one, any port.
    ``also``: (limiter, key function) pairs such a request is charged to as well, in the
    same atomic step (see ``Limiter.acquire``), with the transport's own ``also``; a third
    item, an int or a function of the request, charges that key another cost.
    ``methods``: only requests of these HTTP methods match (None: any).

    >>> search = Limiter(backend, rates=["30/minute"], namespace="github-search")
    >>> Route(search, host="api.github.com", path="/search", also=[(core, request_key)])
    >>> Route(writes, methods={"POST", "PATCH", "PUT", "DELETE"}, also=[(core, request_key)])
    """

    limiter: L
    host: str | None = None
    path: str = "/"
    also: Sequence[AlsoSpec[L]] = ()
    methods: Collection[str] | None = None
    _name: str | None = field(default=None, init=False, repr=False, compare=False)
    _port: int | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "also", _checked_also(self.also))
        if self.methods is not None:
            if not isinstance(self.methods, str):  # a generator is read once, here
                object.__setattr__(self, "methods", tuple(self.methods))
            if (
                isinstance(self.methods, str)
                or not self.methods
                or not all(isinstance(m, str) and m for m in self.methods)
            ):
                raise ConfigurationError(
                    f"a route's methods must be a collection of HTTP method names, such as "
                    f'{{"POST", "PUT"}}, not {self.methods!r}'
                )
            object.__setattr__(self, "methods", frozenset(m.upper() for m in self.methods))
        if not isinstance(self.path, str) or not self.path.startswith("/"):
            raise ConfigurationError(f"a route's path must start with '/', not {self.path!r}")
        if self.host is not None:
            name, port = _host_and_port(self.host)
            object.__setattr__(self, "host", self.host.lower())
            object.__setattr__(self, "_name", name)
            object.__setattr__(self, "_port", port)

    def matches(self, request: httpx.Request) -> bool:
        if self.methods is not None and request.method not in self.methods:
            return False
        url = request.url
        if self._name is not None and url.host != self._name:
            return False
        if self._port is not None and (url.port or _DEFAULT_PORTS.get(url.scheme)) != self._port:
            return False
        prefix = self.path.rstrip("/")
        path = request.url.path
        # On a segment boundary: "/search" covers "/search/code", not "/searchable".
        return not prefix or path == prefix or path.startswith(prefix + "/")


def _host_and_port(spec: object) -> tuple[str, int | None]:
    """``"api.example.com"``, ``"127.0.0.1:8080"``, ``"[::1]:8080"`` or ``"::1"`` as the
    host httpx reports for a request (lower case, IPv6 without brackets) and the port."""
    problem = f"a route's host must be a host name, optionally with ':port', not {spec!r}"
    if not isinstance(spec, str) or not spec or any(c in spec for c in "/@?# "):
        raise ConfigurationError(problem)
    host, port = spec.lower(), None
    if host.startswith("["):  # an IPv6 address, with a port or without
        host, bracket, rest = host[1:].partition("]")
        if not bracket or rest[:1] not in ("", ":"):
            raise ConfigurationError(problem)
        port = rest[1:] if rest else None
    elif host.count(":") == 1:  # more than one: a bare IPv6 address
        host, port = host.split(":")
    if not host or (port is not None and not (port.isascii() and port.isdigit())):
        raise ConfigurationError(problem)
    if port is not None and not 1 <= int(port) <= 65535:
        raise ConfigurationError(problem)
    return host, None if port is None else int(port)


@dataclass(frozen=True)
class RetryPolicy:
    """How a throttled transport answers an upstream that pushes back.

    ``max_attempts``: sends per request, the first included (1: never retry).
    ``methods``: the methods worth retrying (idempotent ones by default).
    ``max_pause``: the longest pause (seconds) any header may impose; longer ones are
    capped, with a warning. ``backoff``: the pause after a refusal that carries no
    usable value, doubled at each further attempt.

    >>> ThrottledTransport(limiter, retry=RetryPolicy(max_attempts=5, max_pause=60))
    """

    max_attempts: int = 3
    methods: frozenset[str] = IDEMPOTENT_METHODS
    max_pause: float = 300.0
    backoff: float = 1.0

    def __post_init__(self) -> None:
        attempts = self.max_attempts
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise ConfigurationError(f"max_attempts must be an integer >= 1, not {attempts!r}")
        for name in ("max_pause", "backoff"):
            # Within the limiter's range for a pause, or a 429 would end in its error.
            object.__setattr__(self, name, bounded_seconds(getattr(self, name), name))
        object.__setattr__(self, "methods", frozenset(m.upper() for m in self.methods))

    def fallback(self, attempt: int) -> float:
        return min(self.max_pause, self.backoff * 2.0 ** min(attempt - 1, 64))  # no overflow


@dataclass(frozen=True)
class Hold:
    """A step of a request's flow on a capped limiter: wait for the request's turn and
    take a lease (``Limiter.lease``). Result: ``(decision, lease)``."""

    plan: _Plan[Any]
    timeout: float | timedelta | None


@dataclass(frozen=True)
class Send:
    """A step of a request's flow: send ``request`` upstream. Result: ``(response, local
    time, wall-clock time)``. ``lease``: ended when the response is closed (its body
    read, or a streamed one closed), or at once if the request fails."""

    request: httpx.Request
    lease: Any = None


@dataclass(frozen=True)
class Discard:
    """A step of a request's flow: drain and close ``response`` (it gives its connection
    back). Result: the local time."""

    response: httpx.Response


@dataclass(frozen=True)
class _Plan(Generic[L]):
    """How one request is throttled."""

    limiter: L
    key: str
    cost: int
    also: tuple[tuple[L, str, int], ...]  # the other limiters it is charged to: key, cost
    label: str  # what logs may say about the key: a host, or a digest of the token
    # "GET host" and the matched route's path, for logs, events and metrics: never the
    # request's own path, which may carry a secret (a webhook's, a bot's token) or an id
    # per call, nor its query, which may carry a token.
    route: str
    retryable: bool
    timeout: float | None  # the longest wait for a slot, each attempt's (None: no limit)


@dataclass
class _TransportCore(Generic[L]):
    """Every decision of a throttled transport; no I/O."""

    kind: type[L]
    limiter: L | None
    routes: Sequence[Route[L]]
    key: KeyFunc
    cost: int | CostFunc
    retry: RetryPolicy
    acquire_timeout: float | timedelta | None
    also: Sequence[AlsoSpec[L]] = ()
    learn: bool = True  # hold a key to quota headers stricter than its rates
    _warned: set[str] = field(default_factory=set)
    _warned_routes: set[str] = field(default_factory=set)  # of credentials keyed by host

    def __post_init__(self) -> None:
        transport = "ThrottledTransport" if self.kind is Limiter else "AsyncThrottledTransport"
        self.routes = tuple(self.routes)
        self.also = _checked_also(self.also)
        if self.limiter is None and not self.routes:
            raise ConfigurationError(f"{transport} needs a limiter, routes, or both")
        partners: list[L] = [spec[0] for spec in self.also]
        for route in self.routes:
            partners += [spec[0] for spec in route.also]
        for limiter in [self.limiter, *(route.limiter for route in self.routes), *partners]:
            if limiter is not None and not isinstance(limiter, self.kind):
                raise TypeError(
                    f"{transport} needs {self.kind.__name__} objects, not {limiter!r}; "
                    "use ThrottledTransport with a Limiter, AsyncThrottledTransport with "
                    "an AsyncLimiter"
                )
        if not isinstance(self.retry, RetryPolicy):
            raise TypeError(f"retry must be a RetryPolicy, not {self.retry!r}")
        self.acquire_timeout = _acquire_timeout(self.acquire_timeout, "acquire_timeout")

    def limiters(self) -> list[L]:
        """Every limiter the transport uses (its own, its routes', and their ``also=``
        partners), once each."""
        every = [self.limiter, *(route.limiter for route in self.routes)]
        every += [spec[0] for spec in self.also]
        every += [spec[0] for route in self.routes for spec in route.also]
        unique = {id(limiter): limiter for limiter in every if limiter is not None}
        return cast(list[L], list(unique.values()))

    def listen(self, listener: Listener) -> Callable[[], None]:
        """``listener`` on every limiter the transport uses, once each; returns the
        function that stops it."""
        removes = [limiter.listen(listener) for limiter in self.limiters()]

        def remove() -> None:
            for stop in removes:
                stop()

        return remove

    # -- before sending ---------------------------------------------------------------

    def plan(self, request: httpx.Request) -> _Plan[L] | None:
        """The limiter, key and cost of ``request``; None: it passes unthrottled."""
        route: Route[L] | None = next((r for r in self.routes if r.matches(request)), None)
        # A route's limiter, and its own also= before the transport's (which every
        # request is charged to); else the transport's limiter.
        limiter: L | None = self.limiter
        also: tuple[AlsoSpec[L], ...] = tuple(self.also)
        if route is not None:
            limiter = route.limiter
            also = tuple(route.also) + also
        if limiter is None:
            return None
        timeout = cast("float | None", self.acquire_timeout)
        if ACQUIRE_TIMEOUT in request.extensions:
            timeout = _acquire_timeout(
                request.extensions[ACQUIRE_TIMEOUT], "the request extension acquire_timeout"
            )
        key = self.key(request)
        cost = self.cost if isinstance(self.cost, int) else self.cost(request)
        route_name = f"{request.method} {request.url.host}{route.path if route else ''}"
        if self.key is request_key and key == request.url.host:
            self.warn_missed_credentials(request, route_name)
        return _Plan(
            limiter=limiter,
            key=key,
            cost=cost,
            also=tuple(_also_for(spec, request, cost) for spec in also),
            label=key_label(key, request, limiter.label),
            route=route_name,
            retryable=request.method in self.retry.methods
            # A streamed body cannot be sent twice.
            and isinstance(request.stream, httpx.ByteStream),
            timeout=timeout,
        )

    def warn_missed_credentials(self, request: httpx.Request, route: str) -> None:
        """Warn, once per route, of a request keyed by its host by the default key
        function though it carries what looks like a token: every token sent there then
        shares one quota. A key function of the user's own is their decision."""
        if route in self._warned_routes:
            return
        names = credential_names(request)
        if names:
            self._warned_routes.add(route)
            logger.warning(
                "%s is keyed by its host, though the request carries what looks like "
                "credentials (%s): every token sent there shares one quota. Pass key=, a "
                "function of the request that returns its token (or its host, to keep one "
                "quota)",
                route,
                ", ".join(names),
            )

    def flow(self, plan: _Plan[L], request: httpx.Request, now: float) -> Flow[httpx.Response]:
        """One request's course, from local time ``now``, for both worlds: wait for its
        slot, send it, pause the key for every worker if the upstream pushed back, and
        send it again (through the limiter) while the retry policy allows. When the
        attempts run out the last response is returned, whatever its status."""
        limiter = plan.limiter
        attempts, attempt = self.retry.max_attempts, 1
        capped = limiter._capped(plan.also)
        while True:
            lease = None
            if capped:  # in flight from admission until the response is closed
                decision, lease = yield Hold(plan, plan.timeout)
            else:
                decision = yield from send_flow(
                    limiter, plan.key, plan.cost, plan.timeout, now, also=plan.also
                )
            if decision.waited > LONG_WAIT:
                logger.info(
                    "waited %.1fs for a slot for %s (%s)", decision.waited, plan.route, plan.label
                )
            sent: tuple[httpx.Response, float, float] = yield Send(request, lease)
            response, now, wall = sent
            if limiter._listeners:
                store_key = limiter.store_key(plan.key)
                limiter._emit(
                    UPSTREAM_STATUS, store_key, status=response.status_code, route=plan.route
                )
            feedback = self.judge(plan, response, attempt, now=wall)  # (headers read once)
            if self.learn:
                _, now = yield from learn_flow(
                    limiter, plan.key, decision, feedback.view, now, self.retry.max_pause
                )
            pause, retry, reason = (
                feedback.pause or 0.0,
                feedback.refused and plan.retryable,
                feedback.reason,
            )
            if pause > 0:
                # Which of the call's quotas the upstream meant, it does not say: every
                # key of the call is paused (under-use at worst, never another refusal).
                told = {"reason": reason, "source": "upstream", "route": plan.route}
                refused = response.status_code == 429
                _, now = yield from pause_flow(
                    limiter, plan.key, pause, now, refused=refused, **told
                )
                for other, other_key, _ in plan.also:
                    _, now = yield from pause_flow(
                        other, other_key, pause, now, refused=refused, **told
                    )
            if not retry or attempt == attempts:
                return response
            logger.info(
                "retrying %s for %s (attempt %d of %d) after HTTP %d",
                plan.route,
                plan.label,
                attempt + 1,
                attempts,
                response.status_code,
            )
            now = yield Discard(response)
            attempt += 1

    # -- after the response -------------------------------------------------------------

    def judge(
        self, plan: _Plan[L], response: httpx.Response, attempt: int, *, now: float
    ) -> Feedback:
        """Read the upstream's feedback at wall-clock time ``now`` and log it: how long
        to pause the key for every worker, whether it refused the call, and (for a
        transport that learns limits) what the headers say of the quota."""
        feedback = read_feedback(
            response.status_code,
            response.headers,
            now=now,
            max_pause=self.retry.max_pause,
            fallback=self.retry.fallback(attempt),
            quota=self.learn,
        )
        for problem in feedback.problems:
            # One warning per header per transport: a fleet would repeat it on every call.
            level = logging.DEBUG if problem.header in self._warned else logging.WARNING
            self._warned.add(problem.header)
            logger.log(level, "%s from %s (%s)", problem.message, plan.route, plan.label)
        if feedback.pause:
            if feedback.refused:
                logger.warning(
                    "upstream refused %s (HTTP %d): pausing %s for %.2fs (%s)",
                    plan.route,
                    response.status_code,
                    plan.label,
                    feedback.pause,
                    feedback.reason,
                )
            else:
                logger.info(
                    "upstream says the quota of %s is spent: pausing it for %.2fs (%s)",
                    plan.label,
                    feedback.pause,
                    feedback.reason,
                )
        return feedback


def _acquire_timeout(value: float | timedelta | None, what: str) -> float | None:
    """A wait for a slot, in seconds (None: no limit), from seconds or a timedelta."""
    if value is None:
        return None
    seconds = to_seconds(value, what)
    if math.isnan(seconds) or seconds < 0:
        raise ConfigurationError(f"{what} must be >= 0, not {seconds!r}")
    return seconds


def _checked_also(also: Sequence[AlsoSpec[L]]) -> tuple[AlsoSpec[L], ...]:
    specs = tuple(also)
    for spec in specs:
        if not (
            isinstance(spec, tuple)
            and len(spec) in (2, 3)
            and callable(spec[1])
            and (len(spec) == 2 or isinstance(spec[2], int) or callable(spec[2]))
        ):
            raise TypeError(
                "also= takes (limiter, key function of the request) pairs, or triples with "
                f"a cost (an int or a function of the request), not {spec!r}"
            )
    return specs


def _also_for(spec: AlsoSpec[L], request: httpx.Request, cost: int) -> tuple[L, str, int]:
    """One also= entry for ``request``: its limiter, key and cost (the request's own
    unless the entry names one)."""
    other, key_of, *rest = spec
    if rest:
        cost = rest[0] if isinstance(rest[0], int) else rest[0](request)
    return other, key_of(request), cost


def _client_transport_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The inner transport's share of httpx.Client arguments. ``proxy`` moves there
    entirely: left to the client it would mount a transport that bypasses the limiter."""
    options = {name: kwargs[name] for name in _TRANSPORT_OPTIONS if name in kwargs}
    if "proxy" in kwargs:
        proxy = kwargs.pop("proxy")
        # A transport takes only a Proxy before httpx 0.26; a client took a URL too.
        options["proxy"] = httpx.Proxy(proxy) if isinstance(proxy, (str, httpx.URL)) else proxy
    return options


def _lease_of(step: Hold) -> _Held:
    plan = step.plan
    return _Held(plan.limiter, plan.key, plan.cost, step.timeout, plan.also, before_request=True)


class _Releasing(httpx.SyncByteStream):
    """A response body that ends its request's lease when it is closed."""

    def __init__(self, stream: Any, lease: Lease) -> None:
        self._stream, self._lease = stream, lease

    def __iter__(self) -> Iterator[bytes]:
        yield from self._stream

    def close(self) -> None:
        try:
            self._stream.close()
        finally:
            self._lease.release()


class _AsyncReleasing(httpx.AsyncByteStream):
    """The asyncio twin of :class:`_Releasing`."""

    def __init__(self, stream: Any, lease: AsyncLease) -> None:
        self._stream, self._lease = stream, lease

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._stream:
            yield chunk

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            await asyncio.shield(self._lease.release())  # even when cancelled meanwhile


def _drain(response: httpx.Response) -> None:
    """Read and close a response thrown away: a drained one gives its connection back."""
    try:
        response.read()
    except httpx.TransportError:
        pass  # the body of a response we throw away is not worth an error
    finally:
        response.close()


async def _adrain(response: httpx.Response) -> None:
    try:
        await response.aread()
    except httpx.TransportError:
        pass
    finally:
        await response.aclose()


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
    ) -> None:
        self._core = _TransportCore(
            Limiter, limiter, routes, key, cost, retry, acquire_timeout, also, learn
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
                lease = Lease(_lease_of(step))
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
                        response.stream = _Releasing(response.stream, step.lease)
                return response, limiter._local(), limiter._wall()
            if isinstance(step, Discard):
                _drain(step.response)
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
    ) -> None:
        self._core = _TransportCore(
            AsyncLimiter, limiter, routes, key, cost, retry, acquire_timeout, also, learn
        )
        self._transport = transport if transport is not None else httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        plan = self._core.plan(request)
        if plan is None:
            return await self._transport.handle_async_request(request)
        limiter = plan.limiter

        async def perform(step: Any) -> Any:
            if isinstance(step, Hold):
                lease = AsyncLease(_lease_of(step))
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
                        response.stream = _AsyncReleasing(response.stream, step.lease)
                return response, limiter._local(), limiter._wall()
            if isinstance(step, Discard):
                await _adrain(step.response)
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
        )
        super().__init__(transport=throttled, **kwargs)
        self._throttled = throttled

    def listen(self, listener: Listener) -> Callable[[], None]:
        """As :meth:`ThrottledTransport.listen`."""
        return self._throttled.listen(listener)
