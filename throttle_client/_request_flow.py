"""One request's course through a throttled transport, written once for both worlds.

Every decision (which limiter and key, how long the upstream wants us to hold off,
whether to retry, what to log) lives in :class:`TransportCore`, and one request's
whole course in its ``flow``: admit (the limiter's acquire flow, or a lease when a key
is capped), send, read the feedback, pause the keys, retry. The transports only
perform the flow's steps in their world (see ``_flow``). Every attempt goes through the
limiter again, so a retry waits for the shared pause and for its own
first-come-first-served slot. A capped request's lease ends when its response is
closed (``Releasing``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Generic, cast

import httpx

from ._acquiring import send_flow
from ._config import NORMAL, check_priority
from ._errors import ConfigurationError
from ._events import UPSTREAM_STATUS, Listener
from ._feedback import Feedback, read_feedback
from ._flow import Flow
from ._key_flows import pause_flow
from ._learning import learn_flow
from ._lease import AsyncLease, Lease, _Held
from ._limiter import AsyncLimiter, Limiter
from ._request_key import credential_names, key_label, request_key
from ._routes import (
    AlsoSpec,
    CostFunc,
    KeyFunc,
    L,
    PausesFunc,
    RetryPolicy,
    Route,
    TokenPool,
    acquire_timeout,
    also_for,
    checked_also,
    checked_pauses,
    checked_pool,
)

logger = logging.getLogger("throttle_client")

# A wait for a slot longer than this is worth a line in the log.
LONG_WAIT = 10.0
# The request extension that bounds one request's wait for its slot, instead of the
# transport's acquire_timeout: client.get(url, extensions={"acquire_timeout": 2.5}).
ACQUIRE_TIMEOUT = "acquire_timeout"
# The request extension that sets one request's priority, instead of the transport's:
# client.get(url, extensions={"priority": "low"}).
PRIORITY = "priority"


@dataclass(frozen=True)
class Hold:
    """A step of a request's flow on a capped limiter: wait for the request's turn and
    take a lease (``Limiter.lease``). Result: ``(decision, lease)``."""

    plan: Plan[Any]
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
class Plan(Generic[L]):
    """How one request is throttled."""

    limiter: L
    key: str
    cost: int
    also: tuple[tuple[L, str, int], ...]  # the other limiters it is charged to: key, cost
    host: str  # the request's host (and the key's, when it has no credentials)
    # "GET host" and the matched route's path, for logs, events and metrics: never the
    # request's own path, which may carry a secret (a webhook's, a bot's token) or an id
    # per call, nor its query, which may carry a token.
    route: str
    retryable: bool
    timeout: float | None  # the longest wait for a slot, each attempt's (None: no limit)
    pauses: PausesFunc[L] | None = None  # the route's, else the transport's (see paused)
    # The route's, else the transport's: the request goes out with the token whose slot
    # is earliest, and ``key`` is that token once it is admitted (the first before).
    pool: TokenPool | None = None
    priority: str = NORMAL  # "low": it lets the requests of the usual priority go first

    @functools.cached_property  # (only a log line asks: most requests never do)
    def label(self) -> str:
        """What logs may say about the key: the host, or a digest of the token."""
        return key_label(self.key, self.host, self.limiter.label)


@dataclass
class TransportCore(Generic[L]):
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
    pauses: PausesFunc[L] | None = None  # which limiters a pause holds (None: the own)
    pool: TokenPool | None = None  # the tokens requests go out with (None: their own)
    priority: str = NORMAL  # its requests', unless one's extension says otherwise
    _warned: set[str] = field(default_factory=set)
    _warned_routes: set[str] = field(default_factory=set)  # of credentials keyed by host

    def __post_init__(self) -> None:
        transport = "ThrottledTransport" if self.kind is Limiter else "AsyncThrottledTransport"
        self.routes = tuple(self.routes)
        self.also = checked_also(self.also)
        checked_pauses(self.pauses)
        checked_pool(self.pool)
        self.priority = check_priority(self.priority, f"{transport}'s priority")
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
        self.acquire_timeout = acquire_timeout(self.acquire_timeout, "acquire_timeout")
        if self.priority != NORMAL:
            capped = [one for one in self.limiters() if one.max_concurrent]
            if capped:
                raise ConfigurationError(
                    f"{transport}: priority={self.priority!r} with {capped[0]!r}: a capped "
                    "call waits for its lease in one queue, whatever its priority"
                )
        checks: list[tuple[Any, Sequence[Any], TokenPool | None]] = [
            (self.limiter, self.also, self.pool)
        ]
        for each in self.routes:
            checks.append((each.limiter, list(each.also) + list(self.also), each.pool or self.pool))
        for limiter, also, pool in checks:
            held = _capped_among(limiter, also)
            if pool is not None and held is not None:
                raise ConfigurationError(
                    f"{transport}: a TokenPool's requests cannot be held in flight: "
                    f"{held!r} has max_concurrent"
                )

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

    def plan(self, request: httpx.Request) -> Plan[L] | None:
        """The limiter, key and cost of ``request``; None: it passes unthrottled."""
        route: Route[L] | None = next((r for r in self.routes if r.matches(request)), None)
        # A route's limiter, and its own also= before the transport's (which every
        # request is charged to); else the transport's limiter.
        limiter: L | None = self.limiter
        also: tuple[AlsoSpec[L], ...] = tuple(self.also)
        pauses = self.pauses
        if route is not None:
            limiter = route.limiter
            also = tuple(route.also) + also
            if route.pauses is not None:
                pauses = route.pauses
        if limiter is None:
            return None
        timeout = cast("float | None", self.acquire_timeout)
        if ACQUIRE_TIMEOUT in request.extensions:
            timeout = acquire_timeout(
                request.extensions[ACQUIRE_TIMEOUT], "the request extension acquire_timeout"
            )
        priority = self.priority
        if PRIORITY in request.extensions:
            asked = request.extensions[PRIORITY]
            priority = check_priority(asked, "the request extension priority")
        pool = route.pool if route is not None and route.pool is not None else self.pool
        if pool is not None and not pool.serves(request):
            pool = None  # (another host, or the request's own credentials: no token of it)
        key = pool.tokens[0] if pool is not None else self.key(request)
        cost = self.cost if isinstance(self.cost, int) else self.cost(request)
        host = request.url.host
        route_name = f"{request.method} {host}{route.path if route else ''}"
        if pool is None and self.key is request_key and key == host:
            self.warn_missed_credentials(request, route_name)
        charged = tuple(also_for(spec, request, cost) for spec in also)
        if priority != NORMAL and limiter._capped(charged):
            raise ConfigurationError(
                f"priority={priority!r} on a request to a capped limiter ({limiter!r}, or "
                "one of also=): a capped call waits for its lease in one queue, whatever "
                "its priority"
            )
        return Plan(
            limiter=limiter,
            key=key,
            cost=cost,
            also=charged,
            host=host,
            route=route_name,
            retryable=request.method in self.retry.methods
            # A streamed body cannot be sent twice.
            and isinstance(request.stream, httpx.ByteStream),
            timeout=timeout,
            pauses=pauses,
            pool=pool,
            priority=priority,
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

    def flow(self, plan: Plan[L], request: httpx.Request, now: float) -> Flow[httpx.Response]:
        """One request's course, from local time ``now``, for both worlds: wait for its
        slot, send it, pause the key for every worker if the upstream pushed back, and
        send it again (through the limiter) while the retry policy allows. When the
        attempts run out the last response is returned, whatever its status."""
        limiter = plan.limiter
        attempts, attempt = self.retry.max_attempts, 1
        capped = limiter._capped(plan.also)
        while True:
            lease, outgoing = None, request
            if capped:  # in flight from admission until the response is closed
                decision, lease = yield Hold(plan, plan.timeout)
            elif plan.pool is None:
                decision = yield from send_flow(
                    limiter,
                    plan.key,
                    plan.cost,
                    plan.timeout,
                    now,
                    also=plan.also,
                    priority=plan.priority,
                )
            else:  # the token whose slot is earliest: it goes on the request
                pool = plan.pool
                tokens = limiter._pool(pool.tokens, "TokenPool")  # (checked once: a Cluster's slot)
                decision = yield from send_flow(
                    limiter,
                    plan.key,
                    plan.cost,
                    plan.timeout,
                    now,
                    also=plan.also,
                    pool=tokens,
                    priority=plan.priority,
                )
                plan = dataclasses.replace(plan, key=decision.key or tokens[0])
                # On a copy: httpx builds a redirect from the request it was given, which
                # then carries no token to another host, wherever apply put it.
                outgoing = httpx.Request(
                    request.method,
                    request.url,
                    headers=request.headers.copy(),
                    stream=request.stream,
                    extensions=request.extensions,
                )
                pool.apply(outgoing, plan.key)
            if decision.waited > LONG_WAIT:
                logger.info(
                    "waited %.1fs for a slot for %s (%s)", decision.waited, plan.route, plan.label
                )
            sent: tuple[httpx.Response, float, float] = yield Send(outgoing, lease)
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
                held = self.paused(plan, response)
                self.log_pause(plan, response, feedback, held)
                told = {"reason": reason, "source": "upstream", "route": plan.route}
                refused = response.status_code == 429
                for other, other_key in held:
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
        self, plan: Plan[L], response: httpx.Response, attempt: int, *, now: float
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
            self.warn_once(problem.header, f"{problem.message} from {plan.route} ({plan.label})")
        return feedback

    def paused(self, plan: Plan[L], response: httpx.Response) -> list[tuple[L, str]]:
        """The keys a pause from ``response`` holds: the request's own key, unless the
        plan's ``pauses`` names limiters (every key of the request under each one named;
        naming none, the request's own key all the same).
        Which quota a response refers to only the upstream knows (a header naming the
        bucket, the route): pausing the request's own key alone keeps a 429 on one
        token from holding back every other token of its account. A mistake in
        ``pauses`` shows in the log, never as a lost pause: the response has arrived,
        and the request's own key is paused instead."""
        own = (plan.limiter, plan.key)
        if plan.pauses is None:
            return [own]
        charged = [own] + [(other, key) for other, key, _ in plan.also]
        try:
            answer: object = plan.pauses(response)
            if answer is None:
                return [own]
            if inspect.iscoroutine(answer):
                answer.close()
                raise TypeError("pauses= must be a plain function, not a coroutine function")
            many = not isinstance(answer, (Limiter, AsyncLimiter))
            named = list(cast("Iterable[object]", answer)) if many else [answer]
        except Exception:
            logger.exception("pauses= failed for %s: pausing its own key", plan.route)
            return [own]
        held = [(limiter, key) for limiter, key in charged if any(limiter is x for x in named)]
        stray = [x for x in named if not any(x is limiter for limiter, _ in charged)]
        if stray:
            self.warn_once(
                f"pauses:{plan.route}:{id(stray[0])}",
                f"pauses= named {stray[0]!r} for {plan.route}, which is not charged to it "
                "(it may name the request's own limiter and those of also=): ignored",
            )
        # (None named, or none that counts: the request's own key, never no key at all,
        # or its retries would go out at once to an upstream that asked them to wait.)
        return held or [own]

    def warn_once(self, topic: str, message: str) -> None:
        """``message`` at WARNING the first time ``topic`` comes up, at DEBUG after."""
        level = logging.DEBUG if topic in self._warned else logging.WARNING
        self._warned.add(topic)
        logger.log(level, "%s", message)

    def log_pause(
        self,
        plan: Plan[L],
        response: httpx.Response,
        feedback: Feedback,
        held: list[tuple[L, str]],
    ) -> None:
        """One line for a pause the upstream asked for, naming every key it holds."""
        # (Each key with its namespace: whose quota it is, a token's or an account's.)
        keys = ", ".join(
            f"{key_label(key, plan.host, lim.label)} of {lim.namespace}" for lim, key in held
        )
        if feedback.refused:
            logger.warning(
                "upstream refused %s (HTTP %d): pausing %s for %.2fs (%s)",
                plan.route,
                response.status_code,
                keys,
                feedback.pause,
                feedback.reason,
            )
        else:
            logger.info(
                "upstream says the quota of %s is spent: pausing %s for %.2fs (%s)",
                plan.label,
                keys,
                feedback.pause,
                feedback.reason,
            )


def lease_of(step: Hold) -> _Held:
    plan = step.plan
    return _Held(plan.limiter, plan.key, plan.cost, step.timeout, plan.also, before_request=True)


class Releasing(httpx.SyncByteStream):
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


class AsyncReleasing(httpx.AsyncByteStream):
    """The asyncio twin of :class:`Releasing`."""

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


def drain(response: httpx.Response) -> None:
    """Read and close a response thrown away: a drained one gives its connection back."""
    try:
        response.read()
    except httpx.TransportError:
        pass  # the body of a response we throw away is not worth an error
    finally:
        response.close()


async def adrain(response: httpx.Response) -> None:
    try:
        await response.aread()
    except httpx.TransportError:
        pass
    finally:
        await response.aclose()


def _capped_among(limiter: Any, also: Sequence[Any]) -> Any:
    """The first of a route's limiter and its also= partners with max_concurrent, if any."""
    return next(
        (one for one in (limiter, *(s[0] for s in also)) if one and one.max_concurrent), None
    )
