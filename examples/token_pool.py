"""A crawler with a pool of 40 tokens: each request goes out with whichever token can send first.

A fleet that holds many tokens of one quota each should get the sum of their quotas,
without picking a token per request itself (round-robin waits on a busy token while
others sit idle). ``ThrottledClient(limiter, pool=TokenPool(tokens, host=...))`` asks the shared
store, in one atomic step per request, for the earliest slot among all the tokens,
books it on that token, and sets the token on the request (``Authorization: Bearer``).

The local API (StrictUpstream) holds each token to 4 requests per second and 100 ms
between requests, judged by each request's arrival, and answers 429 beyond that.
Worker threads crawl for a few seconds; the API's journal says how many requests
arrived, how many it refused, and what share of the pool's quota was used (the most a
perfect client could have sent in that time, every token counted on its own).

One token is paused at the start (as a 429 with Retry-After would pause it): the pool
passes it over until its pause ends, and the others carry the load.

    python examples/token_pool.py [--tokens 40] [--seconds 3] [--threads 8]
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from throttle_client import Limiter, RedisBackend, ThrottledClient, ThrottleTimeout, TokenPool
from throttle_client.cli.upstream import StrictUpstream
from throttle_client.testing import RedisServer

PER_SECOND = 4
GAP = 0.1
PAUSED_FOR = 1.0  # the first token's pause, seconds
MARGIN = 0.05


def capacity(seconds: float, paused: float) -> int:
    """The most requests one token can send in ``seconds`` from its first, ``paused``
    seconds of them paused: 4 a second, at least 100 ms apart."""
    sent, windows = 0, seconds - paused
    while windows > 0:
        sent += min(PER_SECOND, int(windows / GAP) + 1)
        windows -= 1.0
    return sent


def crawl(
    redis_url: str, api_url: str, tokens: list[str], seconds: float, threads: int
) -> tuple[int, float]:
    """Worker threads send requests through one client until the time is up; returns how
    many they sent (a request that would wait past the end is not sent), and when the
    first token's pause ends."""
    # margin: how late after its slot a request may still reach the API. Many threads of
    # one process, on a busy machine, send a request some tens of ms after its slot.
    limiter = Limiter(
        RedisBackend(redis_url), rates=[f"{PER_SECOND}/second"], min_interval=GAP, margin=MARGIN
    )
    paused_until = time.monotonic() + PAUSED_FOR
    limiter.pause(tokens[0], PAUSED_FOR)  # (as a 429 with Retry-After would)
    sent, lock = 0, threading.Lock()
    token_pool = TokenPool(tokens, host="127.0.0.1")  # (the API's host: the tokens go there alone)
    with ThrottledClient(limiter, base_url=api_url, pool=token_pool) as client:
        deadline = time.monotonic() + seconds

        def worker(index: int) -> None:
            nonlocal sent
            page = index
            while (left := deadline - time.monotonic()) > 0:
                try:
                    client.get(f"/items/{page}", extensions={"acquire_timeout": left})
                except ThrottleTimeout:
                    return  # the next slot lies past the end
                with lock:
                    sent += 1
                page += threads

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(worker, range(threads)))
    limiter.backend.close()
    return sent, paused_until


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="  log: %(message)s")
    tokens = [f"token-{n:02d}" for n in range(args.tokens)]
    with (
        RedisServer() as redis_server,
        StrictUpstream(rates=[f"{PER_SECOND}/second"], min_interval=GAP) as api,
    ):
        started = time.monotonic()  # (the API journals arrivals by this clock)
        sent, paused_until = crawl(redis_server.url, api.url, tokens, args.seconds, args.threads)
        arrivals = {token: api.arrivals(token) for token in tokens}
        refused = sum(len(api.refusals(token)) for token in tokens)
    first = min(t for times in arrivals.values() for t in times if t >= started)
    # Each token's arrivals in the crawl's span, against the most it could have sent.
    used = sum(sum(1 for t in times if t < first + args.seconds) for times in arrivals.values())
    paused = max(0.0, paused_until - first)  # (of the crawl's span: the pause began before)
    possible = sum(capacity(args.seconds, paused if t == tokens[0] else 0.0) for t in tokens)
    busiest = max(len(times) for times in arrivals.values())
    print(f"{args.threads} threads, {args.tokens} tokens of {PER_SECOND}/s (>= {GAP:g}s apart)")
    print(f"{sent} requests in {args.seconds:g}s; refused by the API (429): {refused}")
    print(f"the first token, paused {PAUSED_FOR:g}s: {len(arrivals[tokens[0]])} requests")
    print(f"pool's quota used: {used} of {possible} ({100 * used / possible:.1f} %)")
    print(f"most requests on one token: {busiest}")
    ok = refused == 0 and used >= 0.95 * possible
    print("OK: the pool used its tokens' quota as one" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
