"""What ThrottledTransport adds to a request over plain httpx.

Each request goes to an ``httpx.MockTransport`` that answers 200 at once, so what is
timed is the client's own work: plain httpx, then the same client through a
``ThrottledTransport`` whose limiter decides on a local redis-server (started here on a
free loopback port) and on memory. Beside them, a bare ``try_acquire`` on the same
limiter and a bare ``EVALSHA`` of ``return 1`` (one round trip and nothing else). The
candidates run round-robin in rounds, so that drift hits all of them alike; each
figure is the lowest per-round median (µs).

    python benchmarks/bench_transport.py [--redis-server PATH] [--calls N] [--rounds N]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import httpx
import redis

from throttle_client import Limiter, MemoryBackend, RedisBackend, ThrottledTransport
from throttle_client.testing import RedisServer

HEADERS = {"Authorization": "Bearer T"}


def median_us(call: Callable[[], object], calls: int) -> float:
    for _ in range(calls // 10):  # (warm)
        call()
    times = []
    for _ in range(calls):
        started = time.perf_counter_ns()
        call()
        times.append(time.perf_counter_ns() - started)
    return statistics.median(times) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-server", default=None, help="the redis-server binary")
    parser.add_argument("--calls", type=int, default=1500, help="calls per candidate and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    answer = httpx.MockTransport(lambda request: httpx.Response(200))
    with RedisServer(binary=args.redis_server) as server:
        client = redis.Redis.from_url(server.url)
        floor = client.script_load("return 1")
        on_redis = Limiter(RedisBackend(server.url), rates=["1000000000/hour"])
        on_memory = Limiter(MemoryBackend(), rates=["1000000000/hour"])
        plain = httpx.Client(transport=answer)
        through_redis = httpx.Client(transport=ThrottledTransport(on_redis, transport=answer))
        through_memory = httpx.Client(transport=ThrottledTransport(on_memory, transport=answer))
        url = "http://api.test/items"
        candidates: dict[str, Callable[[], object]] = {
            "plain httpx": lambda: plain.get(url, headers=HEADERS),
            "throttled, Redis": lambda: through_redis.get(url, headers=HEADERS),
            "throttled, memory": lambda: through_memory.get(url, headers=HEADERS),
            "try_acquire, Redis": lambda: on_redis.try_acquire("T"),
            "EVALSHA floor": lambda: client.evalsha(floor, 1, "x"),
        }
        figures: dict[str, list[float]] = {name: [] for name in candidates}
        for _ in range(args.rounds):
            for name, call in candidates.items():
                figures[name].append(median_us(call, args.calls))
        version = client.info("server")["redis_version"]
    best = {name: min(values) for name, values in figures.items()}
    print(
        f"redis-server {version} on loopback; Python {platform.python_version()}, "
        f"httpx {httpx.__version__}, redis-py {redis.__version__}; {args.rounds} rounds of "
        f"{args.calls} calls, the lowest round's median"
    )
    for name, value in best.items():
        print(f"  {name:20s} {value:7.1f} µs")
    plain_us = best["plain httpx"]
    for store in ("Redis", "memory"):
        added = best[f"throttled, {store}"] - plain_us
        print(f"added by the transport over plain httpx, {store}: {added:.0f} µs")


if __name__ == "__main__":
    main()
