"""End to end: worker processes share a Redis-backed limiter and call a real local HTTP
server (StrictUpstream) that enforces the same quota by its own clock and answers 429 to
any request that breaks it; through each client: httpx (sync and async), requests and
aiohttp.

Real time, real processes, real sockets: these tests are about what the upstream sees.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
from typing import Any

import aiohttp
import pytest

from throttle_client import (
    AsyncLimiter,
    AsyncRedisBackend,
    AsyncThrottledClient,
    Limiter,
    Rate,
    RedisBackend,
    RetryPolicy,
    ThrottledClient,
)
from throttle_client._config import DEFAULT_MARGIN
from throttle_client.aiohttp import ThrottledMiddleware
from throttle_client.cli.upstream import StrictUpstream
from throttle_client.requests import ThrottledSession

from .workers import start_together

# The second tier (pytest -m slow): see pyproject.toml.
pytestmark = pytest.mark.slow

WORKERS = 8
RATE = Rate(10, 1)  # per token, sliding
GAP = 0.06  # the minimum interval between two calls of one token (10 take 0.54 s < 1 s)
# The upstream counts arrivals exactly, as a provider does: no tolerance. The limiters'
# default margin absorbs the delay from a slot to its request's arrival.
TOLERANCE = 0.0
MARGIN = DEFAULT_MARGIN

# Workers come from a forkserver: a clean single-threaded process (the parent runs a
# server thread, and forking a threaded process is asking for trouble) that has
# imported httpx, redis and this library once, so eight workers start in about a second.
SPAWN = multiprocessing.get_context("forkserver")
SPAWN.set_forkserver_preload([__name__])


CLIENTS = ["httpx", "httpx-async", "requests", "aiohttp"]


def crawl(
    client: str,
    redis_url: str,
    upstream_url: str,
    tokens: list[str],
    calls: int,
    start: Any,
    results: Any,
) -> None:
    """One worker: ``calls`` GETs through ``client``, round-robin over ``tokens``;
    reports the statuses its caller got. Its connection to the upstream is opened before
    the start (a request of its own, keyed by the host): a request that opens one may
    reach the upstream later than the margin allows."""
    options: dict[str, Any] = {"rates": [RATE], "min_interval": GAP, "namespace": "e2e"}
    retry = RetryPolicy(max_attempts=6)
    headers = [{"Authorization": f"Bearer {tokens[i % len(tokens)]}"} for i in range(calls)]
    url, warm = f"{upstream_url}/items", f"{upstream_url}/health"
    statuses: list[int] = []
    if client == "httpx":
        limiter = Limiter(RedisBackend(redis_url), **options)
        with ThrottledClient(limiter, retry=retry, timeout=30) as httpx_client:
            httpx_client.get(warm)
            start.wait()
            statuses += [httpx_client.get(url, headers=h).status_code for h in headers]
    elif client == "requests":
        session = ThrottledSession(Limiter(RedisBackend(redis_url), **options), retry=retry)
        session.get(warm, timeout=30)
        start.wait()
        statuses += [session.get(url, headers=h, timeout=30).status_code for h in headers]
        session.close()
    else:

        async def main() -> None:
            backend = AsyncRedisBackend(redis_url)
            limiter = AsyncLimiter(backend, **options)
            if client == "httpx-async":
                async with AsyncThrottledClient(limiter, retry=retry, timeout=30) as each:
                    await each.get(warm)
                    start.wait()
                    for h in headers:
                        statuses.append((await each.get(url, headers=h)).status_code)
            else:
                middleware = ThrottledMiddleware(limiter, retry=retry)
                async with aiohttp.ClientSession(middlewares=[middleware]) as session:
                    async with session.get(warm):
                        pass
                    start.wait()
                    for h in headers:
                        async with session.get(url, headers=h) as response:
                            statuses.append(response.status)
            await backend.aclose()

        asyncio.run(main())
    results.put(statuses)


def run_workers(
    client: str, redis_url: str, upstream: StrictUpstream, tokens: list[str], calls: int
) -> list[list[int]]:
    start = SPAWN.Barrier(WORKERS + 1)
    results = SPAWN.Queue()
    args = (client, redis_url, upstream.url, tokens, calls, start, results)
    workers = [SPAWN.Process(target=crawl, args=args) for _ in range(WORKERS)]
    return start_together(workers, start, results)


def quickest_span(count: int) -> float:
    """The shortest time from first to last of ``count`` calls the limiter allows: full
    windows (widened by the margin) back to back, each window's calls ``GAP`` (+ margin)
    apart. What the margin costs against the bare quota: docs/concepts.md, "The margin"."""
    windows, rest = divmod(count - 1, RATE.limit)
    return windows * (RATE.period + MARGIN) + rest * (GAP + MARGIN)


@pytest.mark.parametrize("client", CLIENTS)
def test_eight_processes_share_the_quota_with_no_429_and_use_it_all(redis_url, client):
    tokens = ["token-a", "token-b"]
    with StrictUpstream(rates=[RATE], min_interval=GAP, tolerance=TOLERANCE) as upstream:
        # 40 calls per token: four full windows, more than the quota serves at once.
        statuses = run_workers(client, redis_url, upstream, tokens, calls=10)
        stats = upstream.stats()
        upstream_refusals = {token: upstream.refusals(token) for token in tokens}

    # (The warm-ups, keyed by the host, are no part of the crawl: its tokens are judged.)
    assert sum(len(upstream_refusals[token]) for token in tokens) == 0, stats
    assert all(status == 200 for worker in statuses for status in worker)
    assert {token: stats["per_token"][token] for token in tokens} == {"token-a": 40, "token-b": 40}
    # Windows were full, and by exact arrival never over: the upstream forgave nothing.
    assert stats["peak_in_window"][str(RATE)] == RATE.limit
    for token in tokens:
        arrivals = upstream.arrivals(token)
        assert min(b - a for a, b in itertools.pairwise(arrivals)) >= GAP, token
        used = quickest_span(len(arrivals)) / (arrivals[-1] - arrivals[0])
        assert used >= 0.95, f"{token}: {used:.1%} of the quota used"


@pytest.mark.parametrize("client", CLIENTS)
def test_a_429_storm_holds_every_worker_for_the_retry_after(redis_url, client):
    with StrictUpstream(
        rates=[RATE],
        min_interval=GAP,
        tolerance=TOLERANCE,
        storm_retry_after=2,
        send_headers=True,  # (X-RateLimit-*: what the clients learn from)
    ) as upstream:
        statuses = run_workers(client, redis_url, upstream, ["storm-token"], calls=2)
        admitted = upstream.arrivals("storm-token")
        refused = upstream.refusals("storm-token")

    assert [worker[-1] for worker in statuses] == [200] * WORKERS
    assert all(status == 200 for worker in statuses for status in worker)  # retried, not lost
    assert len(admitted) == 2 * WORKERS
    storm, *in_flight = refused
    # Only requests already on their way when the pause was written may hit it; a worker
    # that slept towards a slot booked before the pause looks again and waits. The pause
    # is written once the first 429's worker has read it, which a machine busy with 8
    # workers, the upstream and Redis on 2 CPUs delays by up to a few gaps (85 ms each).
    assert all(t - storm < 0.3 for t in in_flight), [round(t - storm, 3) for t in in_flight]
    assert len(in_flight) < WORKERS
    assert min(admitted) - storm >= 2.0 - TOLERANCE
