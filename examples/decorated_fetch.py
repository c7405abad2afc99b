"""A decorated fetch function: ``@throttled`` waits for the token's slot before each call.

The same function is called from many threads at once; the limiter queues the
calls per token, first come first served. ``feedback=`` tells the decorator where the
API's answer is (here, in the error ``raise_for_status`` raises): a 429 with Retry-After
would pause the token for every worker, as a throttled transport does. The coroutine
version below does the same under asyncio with an AsyncLimiter. A MemoryBackend keeps
the example to one process; give the Limiter a RedisBackend to share the limit across
processes.

    python examples/decorated_fetch.py
"""

from __future__ import annotations

import asyncio
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from throttle_client import AsyncLimiter, Limiter, MemoryBackend, throttled
from throttle_client.cli.upstream import StrictUpstream

RATES = ["5/second"]
MIN_INTERVAL = 0.1
TOKENS = ["token-red", "token-blue"]
ITEMS = 8  # per token: more than one window's worth, so some calls wait

limiter = Limiter(MemoryBackend(), rates=RATES, min_interval=MIN_INTERVAL)
async_limiter = AsyncLimiter(MemoryBackend(), rates=RATES, min_interval=MIN_INTERVAL)


def refusal(outcome: object) -> tuple[int, httpx.Headers] | None:
    """The API's answer in what a call raised: (status, headers); None for a result."""
    if isinstance(outcome, httpx.HTTPStatusError):
        return outcome.response.status_code, outcome.response.headers
    return None


def main() -> int:
    # tolerance: a call reaches the API a few ms after its slot, by a delay that
    # varies, so the API forgives arrivals up to 40 ms early against its windows.
    with StrictUpstream(rates=RATES, min_interval=MIN_INTERVAL, tolerance=0.04) as api:
        http = httpx.Client(base_url=api.url)

        @throttled(limiter, key="token", feedback=refusal)
        def fetch(token: str, item: int) -> Any:
            """GET one item with ``token``."""
            response = http.get(f"/items/{item}", headers={"Authorization": f"Bearer {token}"})
            response.raise_for_status()
            return response.json()

        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=6) as pool:
            jobs = [pool.submit(fetch, token, i) for i in range(ITEMS) for token in TOKENS]
            results = [job.result() for job in jobs]
        elapsed = time.monotonic() - started
        print(f"threads: {len(results)} calls of {fetch.__name__}() in {elapsed:.1f}s")
        http.close()

        async def crawl() -> list[Any]:
            async with httpx.AsyncClient(base_url=api.url) as client:
                # The first request of an AsyncClient loads its network backend (tens of
                # ms). Made throttled, it would leave late and squeeze the gap to the next
                # call; so make an unthrottled one first.
                await client.get("/health")

                @throttled(async_limiter, key=lambda token, item: token)
                async def afetch(token: str, item: int) -> Any:
                    response = await client.get(f"/items/{item}", params={"access_token": token})
                    response.raise_for_status()
                    return response.json()

                return await asyncio.gather(
                    *(afetch(token, i) for i in range(ITEMS) for token in TOKENS)
                )

        # Fresh tokens for the async run: the threads' calls still fill the windows.
        TOKENS[:] = [token + "-async" for token in TOKENS]
        started = time.monotonic()
        async_results = asyncio.run(crawl())
        elapsed = time.monotonic() - started
        print(f"asyncio: {len(async_results)} calls of afetch() in {elapsed:.1f}s")
        stats = api.stats()

    print(f"refused by the API (429): {stats['rejected']}")
    ok = stats["rejected"] == 0 and all(stats["per_token"][t] == ITEMS for t in TOKENS)
    print("OK: every call waited for its slot" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
