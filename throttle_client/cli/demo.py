"""``throttle-client demo``: crawler processes share one quota and never get a 429.

The parent process starts a strict upstream API (``StrictUpstream``, in a process
of its own so nothing else competes with it for the GIL while it timestamps
arrivals), then ``workers`` crawler processes. Each crawler fetches through
``ThrottledTransport`` with a ``Limiter`` on the shared store (an SQLite file, or
Redis); the parent only watches: shared counters, ``usage()`` of each token, and
the upstream's own statistics.

This module starts the processes and watches them; its parts are :mod:`.crawler` (the
crawler processes), :mod:`.judge` (how a run is judged) and :mod:`.summary` (what the
user reads of it).

How the run is judged:

- ``rejected``: the 429s the upstream answered (it enforces the quota by arrival);
- ``utilisation``: per token, the calls admitted over the most calls the quota
  allows between the token's first and last slot (the best possible schedule,
  computed with the library's own algorithm on a fake clock), summed over tokens;
- the most calls the upstream saw in any window, against the limit.

The upstream judges arrivals exactly, as a provider does (``--tolerance`` can make it
forgive arrivals that are early by that much). A request reaches it a little after
its slot, by a delay (scheduling, the HTTP round trip) that varies from request to
request; the limiters' ``margin`` widens their windows and gap by enough to absorb
that, and a crawler that wakes later than its slot + margin books a new slot.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import secrets
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from throttle_client import Limiter, Rate

from .crawler import CrawlPlan, CrawlReport, crawl
from .judge import fullest_window, judge, most_calls
from .settings import (
    DEFAULT_DURATION,
    DEFAULT_MARGIN,
    DEFAULT_MIN_INTERVAL,
    DEFAULT_RATES,
    DEFAULT_TOKENS,
    DEFAULT_TOLERANCE,
    DEFAULT_WORKERS,
    FIELDS,
    DemoConfig,
    DemoRun,
    Store,
)
from .summary import ProgressLines, describe_quota, progress_line, quiet, summary_text
from .upstream import StrictUpstream

_Store = Store  # (the name the tests know it by)

# The demo as the command and the live view use it, its parts included: they reach each
# name through this module, so that a name replaced here (as the tests replace run_demo)
# is the one they call.
__all__ = [
    "DEFAULT_DURATION",
    "DEFAULT_MARGIN",
    "DEFAULT_MIN_INTERVAL",
    "DEFAULT_RATES",
    "DEFAULT_TOKENS",
    "DEFAULT_TOLERANCE",
    "DEFAULT_WORKERS",
    "DemoConfig",
    "DemoError",
    "DemoRun",
    "ProgressLines",
    "describe_quota",
    "fullest_window",
    "judge",
    "most_calls",
    "plot_run",
    "progress_line",
    "quiet",
    "run_demo",
    "summary_text",
]

# -- the upstream process ------------------------------------------------------------------


def _serve_upstream(
    conn: Connection, rates: tuple[Rate, ...], gap: float, tolerance: float
) -> None:
    upstream = StrictUpstream(rates=rates, min_interval=gap, tolerance=tolerance).start()
    conn.send(upstream.url)
    try:
        while (command := conn.recv()) != "stop":
            assert command == "stats"
            conn.send(upstream.stats())
        stats = upstream.stats()
        stats["arrivals"] = {token: upstream.arrivals(token) for token in stats["per_token"]}
        conn.send(stats)
    finally:
        upstream.stop()


# -- running it -------------------------------------------------------------------------------


class DemoError(Exception):
    """The demo could not run (no store, a crawler failed to start): one line for the user."""


def _assign(workers: int, tokens: int) -> list[list[int]]:
    """Token numbers per crawler: with fewer tokens than crawlers, several crawlers share
    each token (the contention the demo is about); with more, crawlers take several."""
    if tokens <= workers:
        return [[index % tokens] for index in range(workers)]
    return [[t for t in range(tokens) if t % workers == index] for index in range(workers)]


@contextlib.contextmanager
def _store(config: DemoConfig) -> Iterator[Store]:
    if config.redis_url is not None:
        yield Store(redis_url=config.redis_url)
        return
    with tempfile.TemporaryDirectory(prefix="throttle-client-demo-") as tmp:
        yield Store(sqlite_path=str(Path(tmp) / "limits.db"))


def run_demo(config: DemoConfig, *, watch: Callable[[DemoRun], None] | None = None) -> DemoRun:
    """Run the demo; ``watch(run)`` is called about four times a second while it runs."""
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no connection crosses a fork
    namespace = f"demo-{secrets.token_hex(4)}"
    tokens = tuple(f"demo-token-{n + 1}-{secrets.token_hex(8)}" for n in range(config.tokens))
    with _store(config) as store:
        limiter = Limiter(
            store.open(), rates=config.rates, min_interval=config.min_interval, namespace=namespace
        )
        limiter.usage(tokens[0])  # the store answers, or BackendUnavailable before anything starts
        run = DemoRun(config, store, limiter, tokens, ctx.Array("q", FIELDS * config.tokens))
        parent_end, child_end = ctx.Pipe()
        upstream = ctx.Process(
            target=_serve_upstream,
            args=(child_end, config.rates, config.min_interval, config.tolerance),
            daemon=True,
        )
        upstream.start()
        crawlers: list[Any] = []
        results = ctx.Queue()
        try:
            give_up = time.monotonic() + 60
            while not parent_end.poll(0.1):
                if not upstream.is_alive() or time.monotonic() > give_up:
                    raise DemoError("the local upstream API did not start")
            url = parent_end.recv()
            barrier = ctx.Barrier(config.workers + 1)
            for index, numbers in enumerate(_assign(config.workers, config.tokens)):
                plan = CrawlPlan(
                    index=index,
                    store=store,
                    namespace=namespace,
                    rates=config.rates,
                    min_interval=config.min_interval,
                    margin=config.margin,
                    duration=config.duration,
                    upstream_url=url,
                    tokens=tuple((n, tokens[n]) for n in numbers),
                )
                process = ctx.Process(
                    target=crawl, args=(plan, run.counters, barrier, results), daemon=True
                )
                process.start()
                crawlers.append(process)
            # Every crawler is ready: start together. A broken barrier means a crawler
            # failed before the start; its report says why.
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait(timeout=120)
            run.started = time.monotonic()
            reports = _collect(run, crawlers, results, parent_end, watch)
            elapsed = time.monotonic() - run.started
            parent_end.send("stop")
            run.upstream_stats = parent_end.recv() if parent_end.poll(30) else {}
        finally:
            for process in [*crawlers, upstream]:
                process.join(timeout=5)
                if process.is_alive():
                    process.kill()
                    process.join()
            results.close()
            results.join_thread()
            limiter.backend.close()
        slots: dict[int, list[float]] = {}
        for report in reports:
            if report.error:
                run.errors.append(f"crawler {report.index + 1}: {report.error.strip()}")
            for number, got in report.slots.items():
                slots.setdefault(number, []).extend(got)
        if len(reports) < config.workers:
            run.errors.append(f"only {len(reports)} of {config.workers} crawlers reported")
        if not run.upstream_stats:
            raise DemoError("the local upstream API stopped answering")
        run.summary = judge(config, slots, run.upstream_stats, tokens, elapsed)
        run.slots = slots
    return run


def plot_run(run: DemoRun, path: str) -> dict[str, dict[str, int]]:
    """The picture of the run's quota (``throttle_client.plot``): per token and rate, the
    requests in the window by slot and by arrival against the limit."""
    from throttle_client.plot import plot_quota

    names = [f"token {number + 1}" for number in range(len(run.tokens))]
    arrivals = run.upstream_stats.get("arrivals", {})
    return plot_quota(
        path,
        run.config.rates,
        {names[n]: run.slots.get(n, []) for n in range(len(names))},
        {names[n]: arrivals.get(token, []) for n, token in enumerate(run.tokens)},
        title=f"throttle-client demo: {run.config.workers} crawlers, {describe_quota(run.config)}",
    )


def _collect(
    run: DemoRun, crawlers: list[Any], results: Any, upstream: Connection, watch: Any
) -> list[CrawlReport]:
    reports: list[CrawlReport] = []
    give_up = time.monotonic() + run.config.duration + 120
    while len(reports) < len(crawlers) and time.monotonic() < give_up:
        try:
            reports.append(results.get(timeout=0.25))
        except queue.Empty:
            if all(not p.is_alive() for p in crawlers) and results.empty():
                break
        if watch is not None:
            upstream.send("stats")
            run.upstream_stats = upstream.recv()
            watch(run)
    return reports
