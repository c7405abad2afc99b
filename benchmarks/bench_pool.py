"""A pool of tokens used as one: what a decision costs, and what a crawl gets from it.

Starts its own redis-server on a free loopback port (never a shared one), then:

1. **A decision's cost**, interleaved in short batches so that drift hits every
   candidate alike: ``try_acquire`` on one key (the plain decision, the floor a pool's
   call builds on) beside ``try_acquire_any`` over pools of 1, 10 and 40 keys, every
   call admitted. p50 / p99 µs per call, and the server's own time per call (``INFO
   commandstats``: the script calls' time, which includes the commands they run).
2. **A crawl** (``tests/pool_fleet.py``): 8 worker threads of one process send through
   one ``ThrottledClient`` for 3 s, 40 tokens each held to 4/s and 100 ms apart, by
   arrival, by an upstream in a process of its own; none paused, or 10 of them paused
   for the first second (as a burst of 429s with Retry-After: 1 would). With the pool
   (``TokenPool``: each request takes the token whose slot is earliest) beside the way
   a client without one shares tokens (round-robin: each request takes the next token
   in turn, through the same limiter). It prints the requests the upstream admitted,
   against what the tokens allow in the crawl's time (a paused token's from the end
   of its pause), and its 429s.

    python benchmarks/bench_pool.py [--quick] [--redis-server /usr/bin/redis-server]
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # (tests.pool_fleet)

from tests.pool_fleet import crawl
from throttle_client import Limiter, RedisBackend
from throttle_client.testing import RedisServer


def decisions(url: str, seconds: float) -> None:
    limiter = Limiter(RedisBackend(url), rates=["1000000000/hour"], namespace="bench")
    admin = redis.Redis.from_url(url)
    pools = {n: [f"token-{n}-{i:02d}" for i in range(n)] for n in (1, 10, 40)}
    candidates: dict[str, Callable[[], Any]] = {
        "try_acquire, one key": lambda: limiter.try_acquire("token"),
        **{
            f"try_acquire_any, {n} key{'s' * (n > 1)}": (
                lambda keys=keys: limiter.try_acquire_any(keys)
            )
            for n, keys in pools.items()
        },
    }
    for call in candidates.values():  # (connections open, script loaded)
        call()
    timings: dict[str, list[int]] = {name: [] for name in candidates}
    deadline = time.monotonic() + seconds * len(candidates)
    order = list(candidates)
    for round_ in itertools.count():
        if time.monotonic() > deadline:
            break
        for name in order[round_ % len(order) :] + order[: round_ % len(order)]:
            call, spent = candidates[name], timings[name]
            end = time.perf_counter() + 0.05
            while time.perf_counter() < end:
                began = time.perf_counter_ns()
                decision = call()
                spent.append(time.perf_counter_ns() - began)
                assert decision.allowed
    print(f"{'candidate':<26}{'calls':>8}{'p50 µs':>9}{'p99 µs':>9}{'server µs':>11}")
    for name, call in candidates.items():
        admin.config_resetstat()
        for _ in range(500):
            call()
        stats = admin.info("commandstats")
        scripts = [
            v
            for k, v in stats.items()
            if k.lower() in ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_fcall")
        ]
        server = sum(v["usec"] for v in scripts) / max(1, sum(v["calls"] for v in scripts))
        spent = sorted(timings[name])
        p50 = statistics.median(spent) / 1000
        p99 = spent[int(0.99 * (len(spent) - 1))] / 1000
        print(f"{name:<26}{len(spent):>8}{p50:>9.1f}{p99:>9.1f}{server:>11.1f}")
    limiter.backend.close()
    admin.close()


def crawls(url: str, seconds: float) -> None:
    print()
    print(
        f"{'40 tokens of 4/s, 8 threads':<30}{'paused':>8}{'admitted':>10}{'possible':>10}"
        f"{'used':>8}{'429s':>6}"
    )
    for pool, paused in itertools.product((True, False), (0.0, 1.0)):
        verdict = crawl(
            url,
            cluster=False,
            mode="sync",
            tokens=40,
            workers=8,
            seconds=seconds,
            pool=pool,
            paused=paused,
            paused_tokens=10,
        )
        name = "TokenPool" if pool else "round-robin, one limiter"
        share = 100 * verdict.used / max(1, verdict.possible)
        print(
            f"{name:<30}{'10, 1 s' if paused else 'none':>8}{verdict.used:>10}"
            f"{verdict.possible:>10}{share:>7.1f}%{verdict.refused:>6}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run, well under 30 s")
    parser.add_argument("--redis-server", default="redis-server")
    args = parser.parse_args()
    with RedisServer(binary=args.redis_server) as server:
        version = redis.Redis.from_url(server.url).info("server")["redis_version"]
        print(f"redis-server {version}, Python {platform.python_version()}, {os.cpu_count()} CPUs")
        decisions(server.url, 0.3 if args.quick else 2.0)
        crawls(server.url, 1.5 if args.quick else 3.0)


if __name__ == "__main__":
    main()
