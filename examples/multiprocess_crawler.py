"""A multi-process crawler whose workers share per-token limits through Redis.

Each worker process wraps its httpx.Client in a ThrottledTransport over a Limiter
on one Redis: before every request it asks Redis for the token's next slot, so
together the workers use each token's whole quota and never exceed it.

It starts what it needs: a private redis-server on a free port and a local API
(StrictUpstream) that enforces the same quota by its own clock and answers 429
to any request that breaks it.

    python examples/multiprocess_crawler.py
"""

from __future__ import annotations

import multiprocessing
import sys
import time
from typing import Any

import httpx

from throttle_client import Limiter, Rate, RedisBackend, ThrottledTransport
from throttle_client.cli.upstream import StrictUpstream
from throttle_client.testing import RedisServer

TOKENS = ["token-alice", "token-bob"]
RATE = Rate.parse("10/second")  # per token, across all workers
MIN_INTERVAL = 0.05
WORKERS = 4
PAGES_PER_WORKER = 10


def worker(redis_url: str, api_url: str, number: int, results: Any) -> None:
    limiter = Limiter(
        RedisBackend(redis_url), rates=[RATE], min_interval=MIN_INTERVAL, namespace="crawler"
    )
    statuses = []
    # The key of a request is its bearer token: one shared log per token in Redis.
    with httpx.Client(transport=ThrottledTransport(limiter), base_url=api_url) as client:
        for page in range(PAGES_PER_WORKER):
            token = TOKENS[page % len(TOKENS)]
            response = client.get(
                "/items",
                params={"page": page, "worker": number},
                headers={"Authorization": f"Bearer {token}"},
            )
            statuses.append(response.status_code)
    results.put(statuses)


def main() -> int:
    # tolerance: a request reaches the API a few ms after its slot, by a delay that
    # varies, so the API forgives arrivals up to 40 ms early against its windows.
    with (
        RedisServer() as redis_server,
        StrictUpstream(rates=[RATE], min_interval=MIN_INTERVAL, tolerance=0.04) as api,
    ):
        context = multiprocessing.get_context("spawn")
        results = context.Queue()
        workers = [
            context.Process(target=worker, args=(redis_server.url, api.url, n, results))
            for n in range(WORKERS)
        ]
        started = time.monotonic()
        for process in workers:
            process.start()
        statuses = [status for _ in workers for status in results.get(timeout=60)]
        for process in workers:
            process.join()
        elapsed = time.monotonic() - started
        stats = api.stats()

    print(f"{WORKERS} worker processes sent {len(statuses)} requests in {elapsed:.1f}s")
    print(f"answered 200: {statuses.count(200)}; refused by the API (429): {stats['rejected']}")
    print(f"per token: {stats['per_token']} (quota {RATE} each, min interval {MIN_INTERVAL}s)")
    ok = stats["rejected"] == 0 and statuses.count(200) == WORKERS * PAGES_PER_WORKER
    print("OK: every token's quota was shared and never exceeded" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
