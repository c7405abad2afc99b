"""An asyncio crawler on aiohttp: one ClientSession with ThrottledMiddleware, many tasks.

Code written for ``aiohttp`` keeps its ``ClientSession``: ``ThrottledMiddleware(limiter)``
in its ``middlewares`` asks the limiter before each request, keyed by the request's token,
and reads each answer: a 429 with Retry-After pauses the token for every task and
process of the store, and the request is sent again through the limiter, so the caller
gets the answer that came after it.

The local API (StrictUpstream) holds each token to 5 requests per second and 100 ms
between requests, judged by arrival, and answers the first request of each token with
429 Retry-After: 1. Tasks crawl with 3 tokens for a few seconds; it prints the 429s the
API sent, those that reached the callers, and the share of the quota used from the end
of the pause.

    python examples/aiohttp_crawl.py [--seconds 3] [--tasks 12]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import sys
import time

import aiohttp

from throttle_client import AsyncLimiter, MemoryBackend, ThrottleTimeout
from throttle_client.aiohttp import ThrottledMiddleware
from throttle_client.cli.upstream import StrictUpstream

PER_SECOND, GAP, MARGIN = 5, 0.1, 0.05
TOKENS = ["token-a", "token-b", "token-c"]


def capacity(seconds: float) -> int:
    """The most requests one token can send in ``seconds``: 5 a second, 100 ms apart."""
    sent, left = 0, seconds
    while left > 0:
        sent += min(PER_SECOND, int(left / GAP) + 1)
        left -= 1.0
    return sent


async def crawl(url: str, seconds: float, tasks: int) -> list[int]:
    """The tasks send until the time is up; the statuses their callers got."""
    limiter = AsyncLimiter(
        MemoryBackend(), rates=[f"{PER_SECOND}/second"], min_interval=GAP, margin=MARGIN
    )
    seen: list[int] = []
    turns = itertools.cycle(TOKENS)
    deadline = time.monotonic() + seconds + 1.0  # (the first second: the pause)
    async with aiohttp.ClientSession(middlewares=[ThrottledMiddleware(limiter)]) as session:

        async def worker() -> None:
            while (left := deadline - time.monotonic()) > 0:
                headers = {"Authorization": f"Bearer {next(turns)}"}
                try:
                    async with session.get(f"{url}/items", headers=headers) as response:
                        seen.append(response.status)
                except ThrottleTimeout:
                    return
                if left < 0.5:
                    return

        await asyncio.gather(*(worker() for _ in range(tasks)))
    return seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--tasks", type=int, default=12)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="  log: %(message)s")
    print(f"{args.tasks} tasks, {len(TOKENS)} tokens of {PER_SECOND}/s (>= {GAP:g}s apart)")
    with StrictUpstream(
        rates=[f"{PER_SECOND}/second"], min_interval=GAP, storm_retry_after=1
    ) as api:
        seen = asyncio.run(crawl(api.url, args.seconds, args.tasks))
        stats = api.stats()
        arrivals = sorted(t for token in TOKENS for t in api.arrivals(token))
        sent_429 = sum(len(api.refusals(token)) for token in TOKENS)
    passed = seen.count(429)
    first = arrivals[0] if arrivals else 0.0
    used = sum(1 for t in arrivals if t < first + args.seconds)
    share = used / (capacity(args.seconds) * len(TOKENS))
    print(f"429s sent by the API: {sent_429}, passed to callers: {passed}")
    print(f"quota used from the end of the pause: {share:.0%}")
    ok = passed == 0 and stats["rejected"] == 0 and share >= 0.9
    print("OK: every token paused once, no 429 reached a caller" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
