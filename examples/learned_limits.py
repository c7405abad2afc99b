"""Limits learned from the upstream: a plan smaller than the one configured.

The limiter is configured for 800 requests per second per token, but the API's real
plan allows half that: 400 per window of one second, windows aligned to whole
seconds, counted by the arrival of each request. The API says so on every answer,
as GitHub and many others do:

    X-RateLimit-Limit: 400
    X-RateLimit-Remaining: 17
    X-RateLimit-Reset: 1763812346.000000      (the window's end, epoch seconds)

and answers 429 (with ``Retry-After``) beyond it. An outside client (``--outside N``:
a script that knows nothing of the limiter) may try N requests of the same token's
quota in every window, evenly spaced (the workers take what it does not).

``ThrottledClient`` reads those headers on every response. When they allow fewer
requests than the limiter's own rates, the limiter keeps a *learned limit* in its
store, for every worker that shares it: at most what the API said remains, until the
API's reset (``limiter.usage(token).learned``; ``.upstream`` is the last view read).
The workers then send as fast as the learned limit lets them, and no faster.

Worker threads share one ``MemoryBackend`` (``--redis URL``: a Redis store, as a
fleet of processes or hosts would share it). The run succeeds (exit status 0) when
no request got a 429 once the fleet had its first answer (before any answer, the
fleet knows nothing of the API's plan), and the windows were used to at least 90 %.
Each window the fleet stops short of the limit by about the requests in flight plus
its rate x the limiter's margin (25 ms): a learned limit counts every request sent
from the margin before the answered one on, some of which the API had already counted.

    python examples/learned_limits.py [--outside 100] [--redis redis://localhost:6379/0]
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from throttle_client import (
    Backend,
    Limiter,
    MemoryBackend,
    Rate,
    RedisBackend,
    RetryPolicy,
    ThrottledClient,
)

LIMIT, WINDOW = 400, 1.0  # the API's real plan: 400 requests per 1-second window
CONFIGURED = Rate(2 * LIMIT, WINDOW)  # what the limiter was told: twice that
TOKEN = "example-token"
WORKERS = 4


class QuotaAPI:
    """A local API: ``limit`` requests per token per fixed window of ``window`` seconds,
    judged by arrival, stated in ``X-RateLimit-*`` headers; 429 beyond. It journals
    every arrival: (time, client, status)."""

    def __init__(self, limit: int, window: float) -> None:
        self.limit, self.window = limit, window
        self.journal: list[tuple[float, str, int]] = []
        self._used: Counter[tuple[str, int]] = Counter()
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> QuotaAPI:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def window_of(self, t: float) -> int:
        return math.floor(t / self.window)

    def judge(self, token: str, client: str) -> tuple[int, dict[str, str]]:
        with self._lock:
            now = time.time()
            index = self.window_of(now)
            status = 200 if self._used[token, index] < self.limit else 429
            if status == 200:
                self._used[token, index] += 1
            remaining = self.limit - self._used[token, index]
            self.journal.append((now, client, status))
        end = (index + 1) * self.window
        headers = {
            "X-RateLimit-Limit": str(self.limit),
            "X-RateLimit-Remaining": str(remaining),
            "X-RateLimit-Reset": f"{end:.6f}",
        }
        if status == 429:
            headers["Retry-After"] = str(max(1, math.ceil(end - now)))
        return status, headers

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # or the body waits ~40 ms for a delayed ACK

            def do_GET(self) -> None:
                token = self.headers.get("Authorization", "").removeprefix("Bearer ")
                status, headers = api.judge(token, self.headers.get("X-Client", "-"))
                body = b"{}" if status == 200 else b'{"message": "rate limit exceeded"}'
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler


def outside_client(api: QuotaAPI, per_window: int, stop: threading.Event) -> None:
    """Spends ``per_window`` requests of the token in every window, evenly, without
    asking any limiter."""
    gap = api.window / per_window
    headers = {"Authorization": f"Bearer {TOKEN}", "X-Client": "outside"}
    with httpx.Client(base_url=api.url) as client:
        due = time.monotonic()
        while not stop.is_set():
            client.get("/items", headers=headers)
            due = max(due + gap, time.monotonic())  # its pace: no burst to catch up
            stop.wait(due - time.monotonic())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=4.5, help="seconds of demand")
    parser.add_argument(
        "--outside", type=int, default=0, metavar="N", help="an outside client tries N a window"
    )
    parser.add_argument("--redis", metavar="URL", help="share the limits through Redis")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="  log: %(message)s")

    backend: Backend = RedisBackend(args.redis) if args.redis else MemoryBackend()
    limiter = Limiter(backend, rates=[CONFIGURED], namespace="learned-example")
    limiter.reset(TOKEN)  # a Redis store may remember an earlier run
    outside_says = f", an outside client tries {args.outside} a window" if args.outside else ""
    print(
        f"{WORKERS} worker threads, configured for {CONFIGURED} per token; the API allows "
        f"{LIMIT}/{WINDOW:g}s (fixed windows){outside_says}; "
        f"{'redis' if args.redis else 'memory'} store"
    )

    first_answer: list[float] = []  # when any worker first read a response
    mid_run: list[Any] = []  # limiter.usage(TOKEN) while the fleet runs
    stop = threading.Event()
    # No retries: a 429 shows in the journal instead of being sent again.
    retry = RetryPolicy(max_attempts=1)
    with (
        QuotaAPI(LIMIT, WINDOW) as api,
        ThrottledClient(limiter, base_url=api.url, retry=retry) as client,
    ):
        outside = threading.Thread(target=outside_client, args=(api, args.outside, stop))
        if args.outside:
            outside.start()
        deadline = time.time() + args.duration

        def work(name: str) -> None:
            headers = {"Authorization": f"Bearer {TOKEN}", "X-Client": name}
            while time.time() < deadline:
                client.get("/items", headers=headers)
                if not first_answer:
                    first_answer.append(time.time())
                if name == "worker-0" and not mid_run and time.time() > deadline - 1:
                    mid_run.append(limiter.usage(TOKEN))

        workers = [threading.Thread(target=work, args=(f"worker-{i}",)) for i in range(WORKERS)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        stop.set()
        if args.outside:
            outside.join()
    if args.redis:
        backend.close()

    fleet = [(t, status) for t, who, status in api.journal if who.startswith("worker-")]
    late = sum(1 for t, status in fleet if status == 429 and t > first_answer[0])
    early = sum(1 for t, status in fleet if status == 429 and t <= first_answer[0])
    windows = range(api.window_of(fleet[0][0]) + 1, api.window_of(deadline))  # full ones
    admitted = Counter(api.window_of(t) for t, _, status in api.journal if status == 200)
    by_outside = Counter(
        api.window_of(t) for t, who, status in api.journal if who == "outside" and status == 200
    )
    for number, w in enumerate(windows, 1):
        outside_got = f" ({by_outside[w]} by the outside client)" if args.outside else ""
        print(f"  window {number}: {admitted[w]}/{LIMIT} admitted{outside_got}")
    utilisation = sum(admitted[w] for w in windows) / (len(windows) * LIMIT)
    print(f"{len(fleet)} requests from the workers: {sum(s == 200 for _, s in fleet)} answered 200")
    print(f"refused by the API (429): {early} before the fleet's first answer, {late} after it")
    print(f"utilisation: {utilisation:.1%} of the API's limit over {len(windows)} full windows")
    if mid_run:
        print(f"usage(token).learned:  {mid_run[0].learned}")
        print(f"usage(token).upstream: {mid_run[0].upstream}")
    if late == 0 and utilisation >= 0.9 and len(windows) >= 2:
        print(f"OK: the workers held to the limit the API stated ({utilisation:.0%} of it used)")
        return 0
    print("FAILED: 429s after the first answer, or less than 90% of the limit used")
    return 1


if __name__ == "__main__":
    sys.exit(main())
