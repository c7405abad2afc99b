"""What each client's adapter adds to a request over the bare client.

A local HTTP server (a thread of this process, on a free loopback port, answering 200 at
once, connections kept alive) serves every candidate: httpx, requests and aiohttp, each
bare and through its throttling adapter (``ThrottledClient``, ``ThrottledSession``,
``ThrottledMiddleware``) over a limiter on ``MemoryBackend`` with a quota far above what
is sent, so that what is timed is the adapter's own work (the decision, the flow, the
translation), not a store's round trip or a wait. The candidates run round-robin in
rounds, so that drift hits all of them alike; each figure is the lowest per-round
median (µs per request, requests one after another).

    python benchmarks/bench_clients.py [--calls N] [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import aiohttp
import httpx
import requests

from throttle_client import AsyncLimiter, Limiter, MemoryBackend, ThrottledClient
from throttle_client.aiohttp import ThrottledMiddleware
from throttle_client.requests import ThrottledSession

HEADERS = {"Authorization": "Bearer T"}
RATES = ["1000000000/hour"]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, format: str, *args: Any) -> None:
        pass


def median_us(call: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(calls):
        started = time.perf_counter_ns()
        call()
        times.append(time.perf_counter_ns() - started)
    return statistics.median(times) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/items"
    loop = asyncio.new_event_loop()

    def on_loop(make: Callable[[], Any]) -> Any:
        async def made() -> Any:
            return make()

        return loop.run_until_complete(made())

    bare_aiohttp = on_loop(aiohttp.ClientSession)
    middleware = ThrottledMiddleware(AsyncLimiter(MemoryBackend(), rates=RATES))
    throttled_aiohttp = on_loop(lambda: aiohttp.ClientSession(middlewares=[middleware]))

    def aiohttp_get(session: aiohttp.ClientSession) -> Callable[[], object]:
        async def get() -> None:
            async with session.get(url, headers=HEADERS) as response:
                await response.read()

        return lambda: loop.run_until_complete(get())

    bare_httpx, bare_requests = httpx.Client(), requests.Session()
    throttled_httpx = ThrottledClient(Limiter(MemoryBackend(), rates=RATES))
    throttled_requests = ThrottledSession(Limiter(MemoryBackend(), rates=RATES))
    pairs: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "httpx": (
            lambda: bare_httpx.get(url, headers=HEADERS),
            lambda: throttled_httpx.get(url, headers=HEADERS),
        ),
        "requests": (
            lambda: bare_requests.get(url, headers=HEADERS),
            lambda: throttled_requests.get(url, headers=HEADERS),
        ),
        "aiohttp": (aiohttp_get(bare_aiohttp), aiohttp_get(throttled_aiohttp)),
    }
    best: dict[tuple[str, int], float] = {}
    for bare, throttled in pairs.values():  # (connections open, caches warm)
        for _ in range(50):
            bare()
            throttled()
    for _ in range(args.rounds):
        for name, candidates in pairs.items():
            for which, call in enumerate(candidates):
                figure = median_us(call, args.calls)
                best[name, which] = min(best.get((name, which), figure), figure)
    print(f"Python {platform.python_version()}; a local HTTP server; MemoryBackend limiter")
    print(f"{'client':<10}{'bare µs':>10}{'throttled µs':>14}{'added µs':>10}")
    for name in pairs:
        bare_us, throttled_us = best[name, 0], best[name, 1]
        print(f"{name:<10}{bare_us:>10.1f}{throttled_us:>14.1f}{throttled_us - bare_us:>10.1f}")
    for session in (bare_aiohttp, throttled_aiohttp):
        loop.run_until_complete(session.close())
    loop.close()
    server.shutdown()


if __name__ == "__main__":
    main()
