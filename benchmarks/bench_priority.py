"""Priorities across processes: how long an interactive call waits beside a saturated
background crawl on the same key, and what the crawl gets and costs.

Starts its own redis-server on a free loopback port (never a shared one). One key,
"1200/minute" with ``min_interval=0.05``: a slot every 75 ms (the gap widened by the
25 ms margin). The crawl: 2 processes of 4 threads each, every thread calling
``acquire`` in a loop, so that the key is always wanted. The interactive calls: one
process that calls ``acquire`` at random moments 200-400 ms apart, at the usual
priority. Run twice: the crawl at the usual priority (first come, first served: what
every peer library offers, none having priorities across processes), then at
``priority="low"``.

It prints, for the interactive calls, how long each waited for its slot (in slots),
and how many crawl calls went ahead of each: booked after it asked, before its slot
(so, waits beyond its own turn); the share of the key's slots used, from the first
call to the last; and the store calls made per admitted call (the cost of asking again
as each slot is let go).

Then a hot token beside its account (a stacked call, ``also=``): four tokens of 8/s and
their account of 20/s, four threads on one token and four on the others, that token's
calls at the usual priority, then at ``priority="low"``: the account's share used.

    python benchmarks/bench_priority.py [--seconds 6] [--redis-server /usr/bin/redis-server]
"""

from __future__ import annotations

import argparse
import multiprocessing
import platform
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from throttle_client import Limiter, RedisBackend, ThrottleTimeout
from throttle_client.testing import RedisServer

RATES = ["1200/minute"]
GAP = 0.05
MARGIN = 0.025
SLOT = GAP + MARGIN  # the store's spacing of one key's calls
# A crawl call booked this soon after an interactive one asked may go first: a
# low-priority call books only a slot due within the margin, and its ask may have
# crossed the other's (seconds; with what the two clocks read apart).
REACH = MARGIN + 0.005
CRAWLERS, THREADS = 2, 4


def crawler(url: str, namespace: str, priority: str, start: float, end: float, out: Any) -> None:
    limiter = Limiter(RedisBackend(url), rates=RATES, min_interval=GAP, namespace=namespace)
    admitted = [0] * THREADS
    slots: list[float] = []
    limiter.listen(lambda event: event.kind == "admitted" and slots.append(event.slot))

    def crawl(index: int) -> None:
        time.sleep(max(0.0, start - time.time()))
        while time.time() < end:
            limiter.acquire("token", timeout=60, priority=priority)
            admitted[index] += 1

    threads = [threading.Thread(target=crawl, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out.put(("crawl", (sum(admitted), slots)))


def interactive(url: str, namespace: str, start: float, end: float, out: Any) -> None:
    limiter = Limiter(RedisBackend(url), rates=RATES, min_interval=GAP, namespace=namespace)
    chance = random.Random(7)
    calls: list[tuple[float, float, float]] = []  # asked (epoch s), waited, slot
    time.sleep(max(0.0, start + 0.5 - time.time()))  # the crawl saturates the key first
    while time.time() < end - 0.5:
        time.sleep(chance.uniform(0.2, 0.4))
        asked = time.time()
        decision = limiter.acquire("token", timeout=60)
        calls.append((asked, decision.waited, decision.slot))
    out.put(("interactive", calls))


def scenario(url: str, priority: str, seconds: float) -> dict[str, Any]:
    admin = redis.Redis.from_url(url)
    admin.config_resetstat()
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    start = time.time() + 2.0  # after every process's imports
    end = start + seconds
    namespace = f"priority-{priority}"
    procs = [
        context.Process(target=crawler, args=(url, namespace, priority, start, end, out))
        for _ in range(CRAWLERS)
    ]
    procs.append(context.Process(target=interactive, args=(url, namespace, start, end, out)))
    for proc in procs:
        proc.start()
    results = [out.get(timeout=seconds + 120) for _ in procs]
    for proc in procs:
        proc.join(30)
    stats = admin.info("commandstats")
    store_calls = sum(
        entry["calls"]
        for name, entry in stats.items()
        if name in ("cmdstat_evalsha", "cmdstat_fcall")
    )
    admin.close()
    crawled = sum(value[0] for kind, value in results if kind == "crawl")
    crawl_slots = [slot for kind, value in results if kind == "crawl" for slot in value[1]]
    calls = next(value for kind, value in results if kind == "interactive")
    # Crawl calls that went ahead of an interactive one: booked after it asked (later
    # than REACH after it), with a slot before its.
    ahead = [sum(1 for s in crawl_slots if asked + REACH < s < slot) for asked, _, slot in calls]
    waits = [waited for _, waited, _ in calls]
    every = crawl_slots + [slot for _, _, slot in calls]
    capacity = (max(every) - min(every)) / SLOT + 1  # the slots of the run's span
    return {
        "crawled": crawled,
        "waits": waits,
        "ahead": ahead,
        "used": len(every) / capacity,
        "store_calls": store_calls,
    }


def hot_token(url: str, priority: str, seconds: float) -> tuple[float, int]:
    """Four tokens of 8/s, charged with their account of 20/s (``also=``); four threads
    on token A, four on B, C and D (two on B). A stacked call books every key at its slot, so A's
    calls, held back by A's own rate, book the account's later slots ahead of B's. A's
    calls at ``priority`` (B's, C's and D's at the usual one). Returns the share of the
    account's slots used (from the first call to the last) and the calls made."""
    store = RedisBackend(url)
    token = Limiter(store, rates=["8/second"], namespace=f"hot-{priority}-token")
    account = Limiter(store, rates=["20/second"], namespace=f"hot-{priority}-account")
    slots: list[float] = []
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def call(key: str, level: str) -> None:
        while (left := end - time.monotonic()) > 0:
            try:
                decision = token.acquire(
                    key, timeout=left, also=[(account, "account")], priority=level
                )
            except ThrottleTimeout:
                return
            with lock:
                slots.append(decision.slot)

    threads = [threading.Thread(target=call, args=("A", priority)) for _ in range(4)]
    threads += [threading.Thread(target=call, args=(k, "normal")) for k in "BCDB"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    store.close()
    slots.sort()
    # What a sliding 20/s allows from the first slot to the last: 20 at once, then 20 a second.
    return len(slots) / ((slots[-1] - slots[0]) * 20 + 20), len(slots)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--redis-server", default=None, help="the redis-server binary to start")
    args = parser.parse_args()
    print(f"Python {platform.python_version()}, {platform.machine()}")
    with RedisServer(binary=args.redis_server) as server:
        version = redis.Redis.from_url(server.url).info("server")["redis_version"]
        print(
            f"redis-server {version}; one key {RATES[0]}, min_interval {GAP * 1000:.0f} ms "
            f"(a slot every {SLOT * 1000:.0f} ms); crawl {CRAWLERS} processes x {THREADS} "
            f"threads; interactive calls 200-400 ms apart; {args.seconds:g} s each"
        )
        print(
            f"{'crawl priority':<16}{'interactive':>12}{'wait p50':>10}{'max':>6}"
            f"{'crawl calls ahead p50':>23}{'max':>5}{'key used':>10}{'script calls':>14}"
        )
        for priority in ("normal", "low"):
            found = scenario(server.url, priority, args.seconds)
            waits = [wait / SLOT for wait in found["waits"]]
            admitted = found["crawled"] + len(waits)
            print(
                f"{priority:<16}{len(waits):>12}{statistics.median(waits):>10.2f}"
                f"{max(waits):>6.2f}{statistics.median(found['ahead']):>23.0f}"
                f"{max(found['ahead']):>5}{found['used']:>9.0%}"
                f"{found['store_calls'] / admitted:>14.1f}"
            )
        print(
            f"\nA hot token beside its account: 4 tokens of 8/s, account 20/s (also=), "
            f"4 threads on token A, 4 on B, C, D (two on B); {args.seconds:g} s"
        )
        print(f"{'token A priority':<18}{'calls':>7}{'account used':>14}")
        for priority in ("normal", "low"):
            used, calls = hot_token(server.url, priority, args.seconds)
            print(f"{priority:<18}{calls:>7}{used:>13.1%}")
    print(
        "wait: how long an interactive call waited for its slot, in slots; crawl calls "
        "ahead: crawl calls booked after an interactive call asked (more than the margin "
        "after) that went before it; key used: every call, against the slots from the "
        "first to the last; script calls: EVALSHA/FCALL calls per admitted call, every "
        "process's (fewer than one: calls batched together)"
    )


if __name__ == "__main__":
    main()
