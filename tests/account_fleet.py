"""A hot token beside its account, judged by arrival: four tokens of one account, each
held by the upstream to 8 a second and the account to 20, and eight workers of one
process crawling through one client that charges each request to its token and to the
account (``also=``): four on token A alone, four on B, C and D.

A's own rate keeps its calls booked ahead, and each of them holds a slot of the account
too; the others must still get the account's room between them (``_backends/filling``),
so that together they use the account's whole quota. The upstream (``arrivals_harness``
``_serve``, tolerance 0) journals every arrival; the judgement is ``pool_fleet``'s: a
stalled arrival is put back at its slot plus the margin, then each token's arrivals
must keep 8 a second, the account's 20 a second, and every 429 be explained by a stall.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tests.arrivals_harness import Arrival, _serve
from tests.pool_fleet import (
    Sent,
    _AsyncNoting,
    _listen,
    _Noting,
    _noting,
    breaches,
    put_back,
)
from throttle_client import (
    AsyncLimiter,
    AsyncRedisBackend,
    AsyncThrottledClient,
    Limiter,
    Rate,
    RedisBackend,
    Route,
    ThrottledClient,
    ThrottleTimeout,
)
from throttle_client.cli.judge import most_calls

TOKEN_RATE, ACCOUNT_RATE, MARGIN = Rate.parse("8/second"), Rate.parse("20/second"), 0.05
# Which token each worker uses: four on A, four on the others.
WORKERS = "AAAABCDB"


@dataclass(frozen=True)
class Verdict:
    sent: int
    refused: int  # 429s
    unexcused_429s: int
    over_within_promise: int  # windows over a token's or the account's rate, as judged
    stalled: int
    used: int  # requests the upstream admitted
    possible: int  # what the account allows in the crawl's time
    hot: int  # of them, token A's


def crawl(url: str, *, cluster: bool, mode: str, seconds: float) -> Verdict:
    """The crawl, for ``seconds``, on the store at ``url``; judged."""
    ctx = multiprocessing.get_context("forkserver")
    conn, child = ctx.Pipe()
    tokens = {name: f"tok-{name}-{secrets.token_hex(4)}" for name in "ABCD"}
    options = {"accounts": dict.fromkeys(tokens.values(), "acct"), "account_rates": [ACCOUNT_RATE]}
    upstream = ctx.Process(target=_serve, args=(child, (TOKEN_RATE,), 0.0, options), daemon=True)
    upstream.start()
    sent: dict[int, Sent] = {}
    try:
        if not conn.poll(60):
            raise RuntimeError("the upstream did not start")
        api = conn.recv()
        run = _crawl_sync if mode == "sync" else _run_async
        run(url, cluster, api, [tokens[name] for name in WORKERS], sent, seconds)
        conn.send("stop")
        journal: list[Arrival] = conn.recv() if conn.poll(30) else []
    finally:
        upstream.join(timeout=10)
        if upstream.is_alive():
            upstream.kill()
            upstream.join()
    return judge(sent, journal, seconds, tokens["A"])


def _limiters(make: Callable[..., Any], backend: Any) -> tuple[Any, Any]:
    """The token limiter and the account's, their keys in one hash slot (a Cluster's)."""
    namespace = f"hot-{secrets.token_hex(4)}"
    token = make(
        backend, rates=[TOKEN_RATE], margin=MARGIN, tag=lambda key: "acct", namespace=namespace
    )
    account = make(
        backend,
        rates=[ACCOUNT_RATE],
        margin=MARGIN,
        tag=lambda key: key,
        namespace=f"{namespace}-a",
    )
    token.listen(_listen)
    return token, account


def _route(token: Any, account: Any) -> Route[Any]:
    return Route(token, path="/items", also=[(account, lambda request: "acct")])


def _crawl_sync(
    url: str, cluster: bool, api: str, workers: list[str], sent: dict[int, Sent], seconds: float
) -> None:
    token, account = _limiters(Limiter, RedisBackend(url, cluster=cluster))
    inner = _Noting(_noting(sent))
    with ThrottledClient(routes=[_route(token, account)], base_url=api, transport=inner) as client:
        with ThreadPoolExecutor(len(workers)) as pool:  # (the connections, opened first)
            list(pool.map(lambda _: client.get("/health"), workers))
            list(pool.map(lambda _: token.usage("warm-up"), workers))
        deadline = time.monotonic() + seconds

        def worker(name: str) -> None:
            headers = {"Authorization": f"Bearer {name}"}
            while (left := deadline - time.monotonic()) > 0:
                try:
                    client.get("/items", headers=headers, extensions={"acquire_timeout": left})
                except ThrottleTimeout:
                    return

        with ThreadPoolExecutor(len(workers)) as pool:
            list(pool.map(worker, workers))
    token.backend.close()


def _run_async(
    url: str, cluster: bool, api: str, workers: list[str], sent: dict[int, Sent], seconds: float
) -> None:
    asyncio.run(_crawl_async(url, cluster, api, workers, sent, seconds))


async def _crawl_async(
    url: str, cluster: bool, api: str, workers: list[str], sent: dict[int, Sent], seconds: float
) -> None:
    backend = AsyncRedisBackend(url, cluster=cluster)
    token, account = _limiters(AsyncLimiter, backend)
    inner = _AsyncNoting(_noting(sent))
    routes = [_route(token, account)]
    async with AsyncThrottledClient(routes=routes, base_url=api, transport=inner) as client:
        await asyncio.gather(*(client.get("/health") for _ in workers))
        await asyncio.gather(*(token.usage("warm-up") for _ in workers))
        deadline = time.monotonic() + seconds

        async def worker(name: str) -> None:
            headers = {"Authorization": f"Bearer {name}"}
            while (left := deadline - time.monotonic()) > 0:
                try:
                    extensions = {"acquire_timeout": left}
                    await client.get("/items", headers=headers, extensions=extensions)
                except ThrottleTimeout:
                    return

        await asyncio.gather(*(worker(name) for name in workers))
    await backend.aclose()


def judge(sent: dict[int, Sent], journal: list[Arrival], seconds: float, hot: str) -> Verdict:
    placed, stalled = put_back(sent, journal, MARGIN)
    over = 0
    for name in {token for token, _ in placed}:
        over += breaches([item for token, item in placed if token == name], TOKEN_RATE, 0.0)[0]
    account_over, _, unexcused = breaches([item for _, item in placed], ACCOUNT_RATE, 0.0)
    ours = [a for a in journal if a.slot_us in sent]
    return Verdict(
        sent=len(ours),
        refused=sum(a.status == 429 for a in ours),
        unexcused_429s=unexcused,
        over_within_promise=over + account_over,
        stalled=stalled,
        used=sum(a.status == 200 for a in ours),
        # (half-open: a call at the crawl's very end is not sent)
        possible=most_calls((ACCOUNT_RATE,), 0.0, seconds - 1e-3),
        hot=sum(token == hot and item[1].status == 200 for token, item in placed),
    )
