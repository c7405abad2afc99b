"""A crawler on requests: a ThrottledSession, shared by threads, against a strict API.

Code written for ``requests`` keeps its ``Session``: ``ThrottledSession(limiter)`` (or
``ThrottledAdapter(limiter)`` mounted on a session of your own) asks the limiter before
each request, keyed by the request's token, and reads each answer: a 429 with
Retry-After pauses the token for every thread and process of the store, and the request
is sent again through the limiter, so the caller gets the answer that came after it.

The local API (StrictUpstream) holds each token to 5 requests per second and 100 ms
between requests, judged by arrival, and answers the first request of each token with
429 Retry-After: 1 (as an API does to a fleet that just started). Worker threads crawl
with 3 tokens for a few seconds; it prints the 429s the API sent, those that reached
the callers, and the share of the quota used from the end of the pause.

    python examples/requests_crawl.py [--seconds 3] [--threads 6]
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
import threading
import time

from throttle_client import Limiter, MemoryBackend, ThrottleTimeout
from throttle_client.cli.upstream import StrictUpstream
from throttle_client.requests import ThrottledSession

PER_SECOND, GAP, MARGIN = 5, 0.1, 0.05
TOKENS = ["token-a", "token-b", "token-c"]


def capacity(seconds: float) -> int:
    """The most requests one token can send in ``seconds``: 5 a second, 100 ms apart."""
    sent, left = 0, seconds
    while left > 0:
        sent += min(PER_SECOND, int(left / GAP) + 1)
        left -= 1.0
    return sent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--threads", type=int, default=6)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="  log: %(message)s")
    print(f"{args.threads} threads, {len(TOKENS)} tokens of {PER_SECOND}/s (>= {GAP:g}s apart)")
    seen: list[int] = []
    with (
        StrictUpstream(
            rates=[f"{PER_SECOND}/second"], min_interval=GAP, storm_retry_after=1
        ) as api,
        MemoryBackend() as store,
    ):
        limiter = Limiter(store, rates=[f"{PER_SECOND}/second"], min_interval=GAP, margin=MARGIN)
        session = ThrottledSession(limiter)
        turns, lock = itertools.cycle(TOKENS), threading.Lock()
        deadline = time.monotonic() + args.seconds + 1.0  # (the first second: the pause)

        def worker() -> None:
            while (left := deadline - time.monotonic()) > 0:
                with lock:
                    token = next(turns)
                headers = {"Authorization": f"Bearer {token}"}
                try:
                    response = session.get(f"{api.url}/items", headers=headers, timeout=5)
                except ThrottleTimeout:
                    return
                seen.append(response.status_code)
                if left < 0.5:
                    return

        threads = [threading.Thread(target=worker) for _ in range(args.threads)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        session.close()
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
