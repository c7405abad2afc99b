"""Concurrent decisions in one process: how many a second, over how many connections.

Starts its own redis-server on a free loopback port (never a shared
one) and, in one process, drives ``acquire`` (admitted at once: 10**9 calls an hour,
no gap) with

  1 task          one asyncio task, one decision after another: the one-at-a-time
                  baseline every other row is compared with
  64 tasks, 1 key     64 tasks on one ``AsyncLimiter``, every one on the same key
  64 tasks, 64 keys   64 tasks, each on its own key
  1 thread / 64 threads, 1 key / 64 threads, 64 keys: the same with threads on one
                  ``Limiter``
  limits ...      limits' async moving window (``async+redis://``) with 1 and 64
                  tasks on one key, the nearest peer that has an asyncio Redis storage

each for ``--seconds`` (3) after a short warm-up, candidates interleaved in rounds so
that drift on the machine hits them alike. Printed per candidate: decisions per second,
the ratio to its world's one-at-a-time row, p50 / p99 latency of one decision, and the
most client connections the server saw from this process while it ran (``CLIENT
LIST``, sampled every 50 ms, the sampler's own connection left out).

    python benchmarks/bench_batch.py --redis-server /usr/bin/redis-server
    python benchmarks/bench_batch.py --quick      # a smoke run, well under 20 s
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

HIGH = 10**9  # calls per hour: never reached, so every call is admitted at once
TASKS = 64


def percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class Connections:
    """The most connections the server saw while a candidate ran, beyond those open before
    it began (the benchmark's own, and any a previous candidate left to the collector)."""

    def __init__(self, url: str) -> None:
        self._conn = redis.Redis.from_url(url)
        self._stop = threading.Event()
        self.most = self._before = 0
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.most = max(self.most, self._count() - self._before)

    def _count(self) -> int:
        return len(self._conn.client_list())

    def __enter__(self) -> Connections:
        self.most, self._before = 0, self._count()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def drive_tasks(
    acquire: Callable[[str], Any], keys: list[str], seconds: float
) -> list[float]:
    """Each key's task acquires until the time is up; the latency of every decision."""
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def task(key: str) -> None:
        while True:
            start = time.perf_counter()
            if start >= deadline:
                return
            await acquire(key)
            latencies.append(time.perf_counter() - start)

    await asyncio.gather(*(task(key) for key in keys))
    return latencies


def drive_threads(acquire: Callable[[str], Any], keys: list[str], seconds: float) -> list[float]:
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    def thread(key: str) -> None:
        mine: list[float] = []
        while True:
            start = time.perf_counter()
            if start >= deadline:
                break
            acquire(key)
            mine.append(time.perf_counter() - start)
        latencies.extend(mine)  # (list.extend is atomic under the GIL)

    threads = [threading.Thread(target=thread, args=(key,)) for key in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="per candidate (3)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (3)")
    parser.add_argument("--quick", action="store_true", help="0.5 s, one round")
    parser.add_argument("--redis-server", metavar="PATH", help="the redis-server binary")
    opts = parser.parse_args()
    if opts.quick:
        opts.seconds, opts.rounds = 0.5, 1

    from limits import parse
    from limits.aio.storage import RedisStorage as AsyncRedisStorage
    from limits.aio.strategies import MovingWindowRateLimiter as AsyncMoving

    from throttle_client import AsyncLimiter, AsyncRedisBackend, Limiter, Rate, RedisBackend
    from throttle_client.testing import RedisServer

    server = RedisServer()
    if opts.redis_server:
        server.binary = opts.redis_server
    with server:
        conn = redis.Redis.from_url(server.url)
        version = conn.info("server")["redis_version"]
        rates = [Rate(HIGH, 3600)]
        one = ["k"]
        same = ["k"] * TASKS
        many = [f"k{i}" for i in range(TASKS)]

        def async_case(keys: list[str]) -> Callable[[float], list[float]]:
            def case(seconds: float) -> list[float]:
                async def go() -> list[float]:
                    backend = AsyncRedisBackend(server.url)
                    limiter = AsyncLimiter(backend, rates=rates)
                    await drive_tasks(limiter.acquire, keys, 0.2)  # warm: connections, script
                    try:
                        return await drive_tasks(limiter.acquire, keys, seconds)
                    finally:
                        await backend.aclose()

                return asyncio.run(go())

            return case

        def thread_case(keys: list[str]) -> Callable[[float], list[float]]:
            def case(seconds: float) -> list[float]:
                backend = RedisBackend(server.url)
                limiter = Limiter(backend, rates=rates)
                drive_threads(limiter.acquire, keys, 0.2)
                try:
                    return drive_threads(limiter.acquire, keys, seconds)
                finally:
                    backend.close()

            return case

        def limits_case(keys: list[str]) -> Callable[[float], list[float]]:
            def case(seconds: float) -> list[float]:
                async def go() -> list[float]:
                    storage = AsyncRedisStorage(f"async+{server.url}", implementation="redispy")
                    moving = AsyncMoving(storage)
                    item = parse(f"{HIGH}/hour")

                    async def hit(key: str) -> bool:
                        return await moving.hit(item, key)

                    await drive_tasks(hit, keys, 0.2)
                    return await drive_tasks(hit, keys, seconds)

                return asyncio.run(go())

            return case

        candidates: list[tuple[str, str, Callable[[float], list[float]]]] = [
            ("1 task", "asyncio", async_case(one)),
            (f"{TASKS} tasks, 1 key", "asyncio", async_case(same)),
            (f"{TASKS} tasks, {TASKS} keys", "asyncio", async_case(many)),
            ("1 thread", "threads", thread_case(one)),
            (f"{TASKS} threads, 1 key", "threads", thread_case(same)),
            (f"{TASKS} threads, {TASKS} keys", "threads", thread_case(many)),
            ("limits, 1 task", "limits", limits_case(one)),
            (f"limits, {TASKS} tasks, 1 key", "limits", limits_case(same)),
        ]
        results: dict[str, list[float]] = {name: [] for name, _, _ in candidates}
        seconds: dict[str, float] = {name: 0.0 for name, _, _ in candidates}
        most: dict[str, int] = {name: 0 for name, _, _ in candidates}
        sampler = Connections(server.url)
        for _ in range(opts.rounds):
            for name, _, case in candidates:
                conn.flushall()
                with sampler:
                    results[name] += case(opts.seconds)
                seconds[name] += opts.seconds
                most[name] = max(most[name], sampler.most)

    print(
        f"redis-server {version} on loopback; Python {platform.python_version()}, "
        f"redis-py {redis.__version__}, {os.cpu_count()} CPUs; "
        f"{opts.rounds} x {opts.seconds:g} s per candidate, interleaved\n"
    )
    print(f"{'candidate':<24}{'dec/s':>9}{'x one':>8}{'p50 µs':>10}{'p99 µs':>10}{'conns':>7}")
    base: dict[str, float] = {}
    for name, world, _ in candidates:
        lat = sorted(results[name])
        rate = len(lat) / seconds[name]
        base.setdefault(world, rate)
        print(
            f"{name:<24}{rate:>9.0f}{rate / base[world]:>7.1f}x"
            f"{percentile(lat, 0.5) * 1e6:>10.0f}{percentile(lat, 0.99) * 1e6:>10.0f}"
            f"{most[name]:>7}"
        )


if __name__ == "__main__":
    main()
