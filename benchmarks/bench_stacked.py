"""A hot token beside its account: what a stacked call costs, and what a crawl gets.

Starts its own redis-server (and a Redis Cluster of three) on free loopback ports, then:

1. **A decision's cost.** ``try_acquire(token, also=[(account, ...)])`` on a fresh token
   each time: into an account with room and nothing booked ahead (its slot follows the
   account's newest call), and into one where a busy token has booked 10 calls ahead,
   100 ms apart, so that the call takes the room among them (``_backends/filling.py``).
   p50 / p99 µs per call, and the server's own time per script call (``INFO
   commandstats``).
2. **A crawl** (``tests/account_fleet.py``): four tokens of 8/s share an account of
   20/s; eight workers of one process send through one ``ThrottledClient`` for 3 s,
   four on token A alone and four on B, C and D, each request charged to its token and
   the account (``also=``), against an upstream in a process of its own that holds both
   quotas by arrival. It prints the requests admitted against what the account allows
   in that time, token A's share, and the 429s; sync and asyncio on one Redis, sync on
   the Cluster.

    python benchmarks/bench_stacked.py [--quick] [--redis-server /usr/bin/redis-server]
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # (tests.account_fleet)

from tests.account_fleet import crawl
from throttle_client import Limiter, RedisBackend
from throttle_client._redis_server import RedisClusterServers
from throttle_client.testing import RedisServer


def script_time(admin: redis.Redis) -> tuple[int, int]:
    """The server's µs in script calls so far, and their count (``INFO commandstats``)."""
    stats = admin.info("commandstats")
    names = ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_fcall")
    scripts = [v for k, v in stats.items() if k.lower() in names]
    return sum(v["usec"] for v in scripts), sum(v["calls"] for v in scripts)


def decisions(url: str, calls: int) -> None:
    store = RedisBackend(url)
    admin = redis.Redis.from_url(url)
    tokens = Limiter(store, rates=["1/second"], namespace="bench-t", tag=lambda key: "acct")
    busy = Limiter(
        store, rates=["10/second"], min_interval=0.1, namespace="bench-b", tag=lambda key: "acct"
    )
    fresh = itertools.count()
    print(f"{'stacked try_acquire':<36}{'calls':>7}{'p50 µs':>9}{'p99 µs':>9}{'server µs':>11}")
    for ahead in (0, 10):
        spent: list[int] = []
        server = [0, 0]  # the script calls' µs and count, of the measured calls only
        for round_ in range(calls // 20):
            # A new account each 20 calls: room for all of them, and 10 calls of a busy
            # token booked ahead of them (or none).
            account = Limiter(
                store, rates=["40/second"], namespace=f"bench-a{ahead}-{round_}", tag=str
            )
            for _ in range(ahead):
                busy.acquire(f"busy-{round_}", also=[(account, "acct")])
            before = script_time(admin)
            for _ in range(20):
                began = time.perf_counter_ns()
                decision = tokens.try_acquire(f"t{next(fresh)}", also=[(account, "acct")])
                spent.append(time.perf_counter_ns() - began)
                assert decision.allowed
            after = script_time(admin)
            server = [server[0] + after[0] - before[0], server[1] + after[1] - before[1]]
        spent.sort()
        name = f"{ahead} calls booked ahead" if ahead else "nothing booked ahead"
        p50, p99 = statistics.median(spent) / 1000, spent[int(0.99 * (len(spent) - 1))] / 1000
        per_call = server[0] / max(1, server[1])
        print(f"{name:<36}{len(spent):>7}{p50:>9.1f}{p99:>9.1f}{per_call:>11.1f}")
    store.close()
    admin.close()


def crawls(url: str, cluster_url: str, seconds: float) -> None:
    print()
    print(f"{'4 tokens of 8/s, account 20/s':<34}{'admitted':>9}{'possible':>10}{'used':>8}"
          f"{'token A':>9}{'429s':>6}")  # fmt: skip
    for name, where, mode in (
        ("Redis, sync", url, "sync"),
        ("Redis, asyncio", url, "async"),
        ("Cluster, sync", cluster_url, "sync"),
    ):
        verdict = crawl(where, cluster=where == cluster_url, mode=mode, seconds=seconds)
        share = 100 * verdict.used / max(1, verdict.possible)
        print(
            f"{name:<34}{verdict.used:>9}{verdict.possible:>10}{share:>7.1f}%"
            f"{verdict.hot:>9}{verdict.refused:>6}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run, well under 30 s")
    parser.add_argument("--redis-server", default="redis-server")
    args = parser.parse_args()
    with RedisServer(binary=args.redis_server) as server:
        cluster = RedisClusterServers(masters=3)
        for node in cluster.nodes:
            node.binary = args.redis_server
        with cluster:
            version = redis.Redis.from_url(server.url).info("server")["redis_version"]
            print(
                f"redis-server {version}, Python {platform.python_version()}, {os.cpu_count()} CPUs"
            )
            decisions(server.url, 200 if args.quick else 2000)
            crawls(server.url, cluster.url, 1.5 if args.quick else 3.0)


if __name__ == "__main__":
    main()
