"""A background crawl and interactive requests on one pool of tokens: the crawl yields.

A service crawls an API with a pool of tokens of one account in the background, and its
users' own requests go through the same tokens. With one queue, a user's request waits
behind every crawl request booked before it. The crawl's client is made with
``priority="low"``: its requests book only a slot due at once, so a request of the
usual priority that comes finds the next slot free, whichever process the crawl runs in.

The local API (StrictUpstream) holds each token to 5 requests per second and 100 ms
between requests, and the account, which all the tokens share, to 12 requests per
second, judged by each request's arrival; it answers 429 beyond that. Each request takes
the pool's earliest token and is charged to the account too (``also=``), in one step.
The crawl runs in worker threads for a few seconds, once at the usual priority and once
at ``priority="low"``; a user's requests come at random moments meanwhile. It prints,
for each run, the API's 429s, the share of the account's quota used, how long the
user's requests waited, and how many crawl requests went ahead of each: booked after the
user asked, sent before the user's request. (The account is held to its quota all
along, so a user's request may still wait for the next slot to free up.)

    python examples/priority_crawl.py [--tokens 4] [--seconds 4] [--threads 10]
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import statistics
import sys
import threading
import time

from throttle_client import (
    Event,
    Limiter,
    RedisBackend,
    ThrottledClient,
    ThrottleTimeout,
    TokenPool,
)
from throttle_client.cli.upstream import StrictUpstream
from throttle_client.testing import RedisServer

PER_SECOND = 5
GAP = 0.1
ACCOUNT_PER_SECOND = 12  # (less than the tokens' 20 together: the account is the limit)
MARGIN = 0.05
# A crawl request booked this soon after a user asked may go first: a low-priority
# request books only a slot due within the margin, and its ask may reach the store
# before the user's does (the user's request spends some milliseconds in the client
# first, more on a busy machine: seconds).
REACH = MARGIN + 0.025


def capacity(seconds: float) -> int:
    """The most requests the account allows in ``seconds``: 12 in each second begun."""
    return ACCOUNT_PER_SECOND * math.ceil(seconds)


def run(
    redis_url: str, api_url: str, tokens: list[str], seconds: float, threads: int, crawl: str
) -> list[tuple[float, int]]:
    """The crawl's threads send until the time is up, at priority ``crawl``; meanwhile one
    thread, the user, sends requests of the usual priority. Returns, for each of the
    user's, how long it waited and how many crawl requests went ahead of it: their slots
    came after the user asked (and more than a moment after: REACH), before the user's."""
    backend = RedisBackend(redis_url)
    limiter = Limiter(backend, rates=[f"{PER_SECOND}/second"], min_interval=GAP, margin=MARGIN)
    account = Limiter(
        backend, rates=[f"{ACCOUNT_PER_SECOND}/second"], margin=MARGIN, namespace="account"
    )
    also = [(account, lambda request: "the-account")]
    pool = TokenPool(tokens, host="127.0.0.1")
    crawl_slots: list[float] = []
    user_slot = [0.0]  # the slot of the user's request (of its last attempt)
    asks: list[tuple[float, float, float]] = []  # the user's: asked (epoch s), waited, slot
    deadline = time.monotonic() + seconds

    def note(event: Event) -> None:  # every request's slot (the store's clock, epoch s)
        if event.kind == "admitted":
            if threading.current_thread() is user:
                user_slot[0] = event.slot
            else:
                crawl_slots.append(event.slot)

    with (
        ThrottledClient(limiter, base_url=api_url, pool=pool, also=also, priority=crawl) as crawler,
        ThrottledClient(limiter, base_url=api_url, pool=pool, also=also) as interactive,
    ):

        def crawl_worker(index: int) -> None:
            page = index
            while (left := deadline - time.monotonic()) > 0:
                try:
                    crawler.get(f"/items/{page}", extensions={"acquire_timeout": left})
                except ThrottleTimeout:
                    return  # the next slot lies past the end
                page += threads

        def use() -> None:
            chance = random.Random(1)
            time.sleep(0.5)  # the crawl has the pool busy by now
            while deadline - time.monotonic() > 0.5:
                asked, began = time.time(), time.monotonic()
                interactive.get("/me")  # (its wait for a slot, and a local round trip)
                asks.append((asked, time.monotonic() - began, user_slot[0]))
                time.sleep(chance.uniform(0.1, 0.3))

        user = threading.Thread(target=use)
        workers = [threading.Thread(target=crawl_worker, args=(i,)) for i in range(threads)]
        stop = limiter.listen(note)
        for thread in [*workers, user]:
            thread.start()
        for thread in [*workers, user]:
            thread.join()
        stop()
    limiter.backend.close()
    return [
        (waited, sum(1 for slot in crawl_slots if asked + REACH < slot < mine))
        for asked, waited, mine in asks
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--threads", type=int, default=10)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="  log: %(message)s")
    print(
        f"{args.threads} crawl threads and one user, {args.tokens} tokens of {PER_SECOND}/s "
        f"(>= {GAP:g}s apart), their account {ACCOUNT_PER_SECOND}/s"
    )
    print(
        f"{'crawl priority':<16}{'429s':>6}{'quota used':>12}{'user waits p50':>16}"
        f"{'max':>8}{'crawl calls ahead p50':>23}{'max':>5}"
    )
    ok = True
    ahead: dict[str, list[int]] = {}
    for crawl in ("normal", "low"):
        tokens = [f"{crawl}-token-{n:02d}" for n in range(args.tokens)]
        with (
            RedisServer() as redis_server,
            StrictUpstream(
                rates=[f"{PER_SECOND}/second"],
                min_interval=GAP,
                accounts=dict.fromkeys(tokens, "the-account"),
                account_rates=[f"{ACCOUNT_PER_SECOND}/second"],
            ) as api,
        ):
            started = time.monotonic()  # (the API journals arrivals by this clock)
            users = run(redis_server.url, api.url, tokens, args.seconds, args.threads, crawl)
            arrivals = [t for t in api.account_arrivals("the-account") if t >= started]
            refused = sum(len(api.refusals(token)) for token in tokens)
        first = min(arrivals)
        used = sum(1 for t in arrivals if t < first + args.seconds)
        share = used / capacity(args.seconds)
        waits = [1000 * waited for waited, _ in users]
        ahead[crawl] = [count for _, count in users]
        print(
            f"{crawl:<16}{refused:>6}{share:>11.1%}{statistics.median(waits):>13.0f} ms"
            f"{max(waits):>5.0f} ms{statistics.median(ahead[crawl]):>23.0f}{max(ahead[crawl]):>5}"
        )
        ok = ok and refused == 0 and share >= 0.95
    # With the crawl at low priority no crawl request booked after a user's asked goes
    # ahead of it; in one queue, those booked before it are in its way.
    ok = ok and max(ahead["low"]) == 0 and statistics.median(ahead["normal"]) > 0
    print(
        "OK: the crawl used the account's quota, and the user's requests went first"
        if ok
        else "FAILED"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
