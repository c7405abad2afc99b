"""How soon a waiter for a full concurrency cap goes once a slot frees, across processes.

A holder process takes the one slot of a key (``max_concurrent=1``), lets a waiter in
another process queue behind it, and releases; the waiter, woken by the store (Redis:
Pub/Sub from the script to its process; SQLite: its watcher thread), is admitted and
reports when. Printed per store: p50 / p99 / max of release start -> waiter admitted,
over ``--rounds`` rounds. Starts its own redis-server on a free loopback port.

    python benchmarks/bench_wakeup.py --redis-server /usr/bin/redis-server
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from throttle_client import Limiter, RedisBackend, SQLiteBackend
from throttle_client._redis_server import RedisServer


def _limiter(store: str) -> Limiter:
    backend: Any = RedisBackend(store) if store.startswith("redis") else SQLiteBackend(store)
    return Limiter(backend, rates=["1000000/second"], max_concurrent=1, margin=0)


def waiter(store: str, rounds: int, pipe: Any) -> None:
    limiter = _limiter(store)
    with limiter.lease("warm-up"):
        pass
    for _ in range(rounds):
        pipe.recv()  # the holder holds the slot
        with limiter.lease("key", timeout=10):
            admitted = time.time()
        pipe.send(admitted)


def measure(store: str, rounds: int) -> list[float]:
    here, there = mp.Pipe()
    child = mp.get_context("spawn").Process(target=waiter, args=(store, rounds, there))
    child.start()
    limiter = _limiter(store)
    latencies = []
    try:
        for _ in range(rounds):
            lease = limiter.lease("key", timeout=10)
            lease.__enter__()
            here.send("held")
            time.sleep(0.02)  # the waiter queues behind the holder
            released = time.time()
            lease.release()
            latencies.append(here.recv() - released)
    finally:
        child.join(30)
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--redis-server", metavar="PATH", help="default: from PATH")
    args = parser.parse_args()
    server = RedisServer(binary=args.redis_server).start()
    try:
        version = redis.Redis.from_url(server.url).info()["redis_version"]
        print(
            f"redis-server {version}; Python {platform.python_version()}, redis-py "
            f"{redis.__version__}; {args.rounds} rounds; release -> waiter in another "
            "process admitted"
        )
        with tempfile.TemporaryDirectory() as folder:
            for name, store in (
                ("redis", server.url),
                ("sqlite", str(Path(folder) / "wake.db")),
            ):
                got = sorted(measure(store, args.rounds))
                p99 = got[min(len(got) - 1, int(len(got) * 0.99))]
                print(
                    f"{name:7} p50 {statistics.median(got) * 1000:6.2f} ms   "
                    f"p99 {p99 * 1000:6.2f} ms   max {got[-1] * 1000:6.2f} ms"
                )
    finally:
        server.close()


if __name__ == "__main__":
    main()
