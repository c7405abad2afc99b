"""An asyncio crawler: many tasks, a few tokens, one AsyncThrottledClient.

Every request waits for its token's slot in a Redis-backed AsyncLimiter. The
local API (StrictUpstream) answers the first request of each token with
``429 Retry-After: 1``, as a provider under strain would: the client pauses that
token for every task (and every other process on the same Redis), and retries the
refused request once the pause is over.

    python examples/async_crawler.py
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections import Counter

from throttle_client import AsyncLimiter, AsyncRedisBackend, AsyncThrottledClient
from throttle_client.cli.upstream import StrictUpstream
from throttle_client.testing import RedisServer

TOKENS = ["token-1", "token-2", "token-3"]
PAGES_PER_TOKEN = 12
RATES = ["10/second"]
MIN_INTERVAL = 0.05


async def crawl(redis_url: str, api_url: str) -> list[int]:
    backend = AsyncRedisBackend(redis_url)
    limiter = AsyncLimiter(backend, rates=RATES, min_interval=MIN_INTERVAL, namespace="async")
    async with AsyncThrottledClient(limiter, base_url=api_url) as client:
        # The first request of an AsyncClient loads its network backend (tens of ms);
        # get it out of the way (no token: this one is keyed by host) before the crawl.
        await client.get("/health")

        async def fetch(token: str, page: int) -> int:
            response = await client.get(
                f"/repos/{page}", headers={"Authorization": f"Bearer {token}"}
            )
            return response.status_code

        # Every task starts at once; the limiter queues them per token, first come first served.
        statuses = await asyncio.gather(
            *(fetch(token, page) for page in range(PAGES_PER_TOKEN) for token in TOKENS)
        )
    await backend.aclose()
    return list(statuses)


def main() -> int:
    # The library logs pauses and retries (never the token) on the "throttle_client" logger.
    logging.basicConfig(level=logging.INFO, format="  log: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    with (
        RedisServer() as redis_server,
        StrictUpstream(
            rates=RATES, min_interval=MIN_INTERVAL, tolerance=0.04, storm_retry_after=1
        ) as api,
    ):
        started = time.monotonic()
        statuses = asyncio.run(crawl(redis_server.url, api.url))
        elapsed = time.monotonic() - started
        refused = sum(len(api.refusals(token)) for token in TOKENS)

    print(f"{len(statuses)} pages over {len(TOKENS)} tokens in {elapsed:.1f}s")
    print(f"429s sent by the API: {refused} (one storm per token, and any stragglers)")
    print(f"final statuses: {dict(Counter(statuses))}")
    ok = statuses == [200] * len(statuses)
    print("OK: every refused request was retried after the shared pause" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
