"""A crawl through a token pool, judged by arrival: workers of one process share a
client whose requests go out with the pool's earliest token, against a strict upstream
in a process of its own (``arrivals_harness._serve``: tolerance 0, every request to
/items journaled with its arrival).

Each request carries a number of its own (``?slot=<n>``, which the upstream journals),
under which the client noted the slot its token was admitted at and when the limiter
returned; the upstream's journal then says, per token, when each request arrived. The
judgement is the one of ``arrivals_harness``: within the limiter's promise, an arrival
that left the limiter within the margin of its slot but reached the upstream later
(stalled on its way, on a busy machine) is put back at its slot plus the margin; every
token's arrivals must then keep its rates and gap, and every 429 be explained by such a
stall. The client's connections to the upstream (by requests its route leaves
unthrottled) and to the store (by reads) are opened before the crawl begins: a request
that opens one may reach the upstream later than the margin allows, and a Cluster's
first call waits for its map of the slots.
"""

from __future__ import annotations

import asyncio
import bisect
import contextvars
import itertools
import multiprocessing
import secrets
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from tests.arrivals_harness import NS, US, Arrival, _serve
from throttle_client import (
    AsyncLimiter,
    AsyncRedisBackend,
    AsyncThrottledClient,
    Event,
    Limiter,
    Rate,
    RedisBackend,
    Route,
    ThrottledClient,
    ThrottleTimeout,
    TokenPool,
)
from throttle_client.cli.judge import most_calls

RATE, GAP, MARGIN = Rate.parse("4/second"), 0.1, 0.05

# The slot the current thread or task was just admitted at, and when: set by the
# limiter's "admitted" event (sent in the thread or task that made the call), read by
# the inner transport.
_admitted: contextvars.ContextVar[tuple[int, float]] = contextvars.ContextVar("admitted")


@dataclass
class Sent:
    token: str
    slot_us: int
    returned: float  # time.time() when the limiter let it go


@dataclass(frozen=True)
class Verdict:
    sent: int
    refused: int
    unexcused_429s: int
    over_within_promise: int  # windows over a token's rate once stalls are put back
    close_within_promise: int  # a token's gaps under the minimum, likewise
    stalled: int
    used: int  # requests the upstream admitted
    possible: int  # what the tokens allow in the crawl's time


class _Plan:
    """The tokens of a crawl, and how a request gets one: from the pool (``token_pool``),
    or the next in turn (``next``: its header)."""

    def __init__(self, tokens: list[str], pool: bool, paused: float, paused_tokens: int) -> None:
        self.tokens, self.paused, self.paused_tokens = tokens, paused, paused_tokens
        self.token_pool = TokenPool(tokens, host="127.0.0.1") if pool else None
        self._turns = itertools.cycle(tokens)
        self._lock = threading.Lock()

    def next(self) -> dict[str, str]:
        if self.token_pool is not None:
            return {}
        with self._lock:
            return {"Authorization": f"Bearer {next(self._turns)}"}


def _noting(sent: dict[int, Sent]) -> Callable[[httpx.Request], None]:
    numbers = itertools.count()

    def note(request: httpx.Request) -> None:
        admitted = _admitted.get(None)
        if admitted is None or request.url.path != "/items":
            return
        number = next(numbers)
        token = request.headers["Authorization"].removeprefix("Bearer ")
        sent[number] = Sent(token, *admitted)
        request.url = request.url.copy_set_param("slot", str(number))

    return note


class _Noting(httpx.HTTPTransport):
    def __init__(self, note: Callable[[httpx.Request], None]) -> None:
        super().__init__()
        self.note = note

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.note(request)
        return super().handle_request(request)


class _AsyncNoting(httpx.AsyncHTTPTransport):
    def __init__(self, note: Callable[[httpx.Request], None]) -> None:
        super().__init__()
        self.note = note

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.note(request)
        return await super().handle_async_request(request)


def _listen(event: Event) -> None:
    if event.kind == "admitted":
        _admitted.set((round(event.slot * US), time.time()))


def crawl(
    url: str,
    *,
    cluster: bool,
    mode: str,
    tokens: int,
    workers: int,
    seconds: float,
    pool: bool = True,
    paused: float = 0.0,
    paused_tokens: int = 1,
) -> Verdict:
    """``workers`` threads (sync) or tasks (async) crawl /items for ``seconds`` through one
    client with a pool of ``tokens`` tokens on the store at ``url``; judged. Without
    ``pool``, each request takes the next token in turn instead (round-robin), on the
    same limiter. ``paused``: the first ``paused_tokens`` tokens are paused that long as
    the crawl begins (as a 429 with Retry-After would pause them)."""
    ctx = multiprocessing.get_context("forkserver")
    conn, child = ctx.Pipe()
    upstream = ctx.Process(target=_serve, args=(child, (RATE,), GAP), daemon=True)
    upstream.start()
    try:
        if not conn.poll(60):
            raise RuntimeError("the upstream did not start")
        api = conn.recv()
        names = [f"tok-{n:02d}-{secrets.token_hex(4)}" for n in range(tokens)]
        sent: dict[int, Sent] = {}
        options: dict[str, Any] = {
            "rates": [RATE],
            "min_interval": GAP,
            "margin": MARGIN,
            "tag": lambda key: "pool",
            "namespace": f"pool-{secrets.token_hex(4)}",
        }
        plan = _Plan(names, pool, paused, paused_tokens)
        if mode == "sync":
            _crawl_sync(url, cluster, api, plan, sent, options, workers, seconds)
        else:
            asyncio.run(_crawl_async(url, cluster, api, plan, sent, options, workers, seconds))
        conn.send("stop")
        journal: list[Arrival] = conn.recv() if conn.poll(30) else []
    finally:
        upstream.join(timeout=10)
        if upstream.is_alive():
            upstream.kill()
            upstream.join()
    return judge(names, sent, journal, seconds, paused, paused_tokens if paused else 0)


def _crawl_sync(
    url: str,
    cluster: bool,
    api: str,
    plan: _Plan,
    sent: dict[int, Sent],
    options: dict[str, Any],
    workers: int,
    seconds: float,
) -> None:
    limiter = Limiter(RedisBackend(url, cluster=cluster), **options)
    limiter.listen(_listen)
    route = Route(limiter, path="/items", pool=plan.token_pool)
    inner = _Noting(_noting(sent))
    with ThrottledClient(routes=[route], base_url=api, transport=inner) as client:
        with ThreadPoolExecutor(workers) as pool:  # (the connections, opened first)
            list(pool.map(lambda _: client.get("/health"), range(workers)))
            list(pool.map(lambda _: limiter.usage(plan.tokens[0]), range(workers)))
        for token in plan.tokens[: plan.paused_tokens] if plan.paused else ():
            limiter.pause(token, plan.paused)
        deadline = time.monotonic() + seconds

        def worker(_: int) -> None:
            while (left := deadline - time.monotonic()) > 0:
                try:
                    extensions = {"acquire_timeout": left}
                    client.get("/items", headers=plan.next(), extensions=extensions)
                except ThrottleTimeout:
                    return

        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(worker, range(workers)))
    limiter.backend.close()


async def _crawl_async(
    url: str,
    cluster: bool,
    api: str,
    plan: _Plan,
    sent: dict[int, Sent],
    options: dict[str, Any],
    workers: int,
    seconds: float,
) -> None:
    backend = AsyncRedisBackend(url, cluster=cluster)
    limiter = AsyncLimiter(backend, **options)
    limiter.listen(_listen)
    route = Route(limiter, path="/items", pool=plan.token_pool)
    inner = _AsyncNoting(_noting(sent))
    async with AsyncThrottledClient(routes=[route], base_url=api, transport=inner) as client:
        await asyncio.gather(*(client.get("/health") for _ in range(workers)))
        await asyncio.gather(*(limiter.usage(plan.tokens[0]) for _ in range(workers)))
        for token in plan.tokens[: plan.paused_tokens] if plan.paused else ():
            await limiter.pause(token, plan.paused)
        deadline = time.monotonic() + seconds

        async def worker() -> None:
            while (left := deadline - time.monotonic()) > 0:
                try:
                    extensions = {"acquire_timeout": left}
                    await client.get("/items", headers=plan.next(), extensions=extensions)
                except ThrottleTimeout:
                    return

        await asyncio.gather(*(worker() for _ in range(workers)))
    await backend.aclose()


def judge(
    tokens: list[str],
    sent: dict[int, Sent],
    journal: list[Arrival],
    seconds: float,
    paused: float = 0.0,
    paused_tokens: int = 0,
) -> Verdict:
    placed, stalled = put_back(sent, journal, MARGIN)
    by_token: dict[str, list[Placed]] = defaultdict(list)
    for token, item in placed:
        by_token[token].append(item)
    over = close = unexcused = 0
    for arrivals in by_token.values():
        found = breaches(arrivals, RATE, GAP)
        over, close, unexcused = over + found[0], close + found[1], unexcused + found[2]
    # What the tokens allow in the crawl's ``seconds`` (half-open: a call at its very end
    # is not sent), a paused token's only once its pause ends.
    span, spent = seconds - 1e-3, max(0.0, seconds - paused - 1e-3)
    admitted = sum(a.status == 200 for a in journal if a.slot_us in sent)
    return Verdict(
        sent=sum(a.slot_us in sent for a in journal),
        refused=sum(a.status == 429 for a in journal if a.slot_us in sent),
        unexcused_429s=unexcused,
        over_within_promise=over,
        close_within_promise=close,
        stalled=stalled,
        used=admitted,
        possible=(len(tokens) - paused_tokens) * most_calls((RATE,), GAP, span)
        + paused_tokens * most_calls((RATE,), GAP, spent),
    )


# An arrival as judged: when it counts (its arrival, or for a stalled one its slot plus
# the margin, on the upstream's clock), the arrival, and whether it stalled.
Placed = tuple[int, Arrival, bool]


def put_back(
    sent: dict[int, Sent], journal: list[Arrival], margin: float
) -> tuple[list[tuple[str, Placed]], int]:
    """Each journaled arrival of a request the crawl sent, with its token, as judged: an
    arrival that left the limiter within the margin of its slot but reached the upstream
    later (stalled on its way) is put back at its slot plus the margin. And how many
    were put back."""
    placed, stalled = [], 0
    for arrival in journal:
        if arrival.slot_us is None or arrival.slot_us not in sent:
            continue
        call = sent[arrival.slot_us]
        at, late = arrival.at_ns, arrival.wall - call.slot_us / US
        stall = call.returned - call.slot_us / US <= margin < late
        if stall:  # put back at its slot + margin, on the upstream's clock
            at = arrival.at_ns - round(late * NS) + round(margin * NS)
            stalled += 1
        placed.append((call.token, (at, arrival, stall)))
    return placed, stalled


def breaches(arrivals: list[Placed], rate: Rate, gap: float) -> tuple[int, int, int]:
    """Of one quota's arrivals: the windows over ``rate`` and the gaps under ``gap`` (the
    admitted ones, as judged), and the 429s no stalled arrival explains."""
    gap_ns, period_ns = round(gap * NS), round(rate.period * NS)
    arrivals = sorted(arrivals, key=lambda item: item[1].at_ns)
    counted = sorted(at for at, a, _ in arrivals if a.status == 200)
    over = sum(
        bisect.bisect_right(counted, t) - bisect.bisect_right(counted, t - period_ns) > rate.limit
        for t in counted
    )
    close = sum(b - a < gap_ns for a, b in itertools.pairwise(counted))
    unexcused = 0
    for index, (_, arrival, _) in enumerate(arrivals):
        if arrival.status != 429:
            continue
        # A 429 is explained by a stalled arrival in the window that refused it.
        edge = arrival.at_ns - period_ns
        near = [s for at2, a2, s in arrivals[: index + 1] if a2.at_ns > edge]
        near += [arrivals[index - 1][2]] if index else []
        if not any(near):
            unexcused += 1
    return over, close, unexcused
