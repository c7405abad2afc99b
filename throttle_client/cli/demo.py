"""``throttle-client demo``: crawler processes share one quota and never get a 429.

The parent process starts a strict upstream API (``StrictUpstream``, in a process
of its own so nothing else competes with it for the GIL while it timestamps
arrivals), then ``workers`` crawler processes. Each crawler fetches through
``ThrottledTransport`` with a ``Limiter`` on the shared store (an SQLite file, or
Redis); the parent only watches: shared counters, ``usage()`` of each token, and
the upstream's own statistics.

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
import inspect
import logging
import multiprocessing
import queue
import secrets
import tempfile
import threading
import time
import traceback
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, TextIO

import httpx

from throttle_client import (
    Backend,
    Event,
    Limiter,
    MemoryBackend,
    Rate,
    RedisBackend,
    SQLiteBackend,
    ThrottledTransport,
    ThrottleTimeout,
)

from .upstream import StrictUpstream

# The demo's quota: a provider's "N per hour, M per second, calls at least g apart",
# scaled down so that both windows bind within a few seconds.
DEFAULT_RATES = ("10/second", "80/10 seconds")
DEFAULT_MIN_INTERVAL = 0.05
# The upstream counts arrivals with no forgiveness: the limiters' margin absorbs the delay.
DEFAULT_TOLERANCE = 0.0
DEFAULT_DURATION = 10.0
DEFAULT_WORKERS = 4
DEFAULT_TOKENS = 2
# The limiters' margin unless told otherwise: the library's own default, read where the
# library documents it (Limiter's signature), so the demo shows what a worker gets.
DEFAULT_MARGIN: float = inspect.signature(Limiter).parameters["margin"].default

# Per token, in a shared array: requests sent, answered 200, answered 429, workers waiting.
_SENT, _OK, _REFUSED, _WAITING = range(4)
_FIELDS = 4


@dataclass(frozen=True)
class DemoConfig:
    workers: int = DEFAULT_WORKERS
    tokens: int = DEFAULT_TOKENS
    duration: float = DEFAULT_DURATION
    rates: tuple[Rate, ...] = tuple(Rate.parse(r) for r in DEFAULT_RATES)
    min_interval: float = DEFAULT_MIN_INTERVAL
    margin: float = DEFAULT_MARGIN
    tolerance: float = DEFAULT_TOLERANCE
    redis_url: str | None = None


@dataclass(frozen=True)
class _Store:
    """Picklable: each crawler process opens the store itself."""

    sqlite_path: str | None = None
    redis_url: str | None = None

    def open(self) -> Backend:
        if self.redis_url is not None:
            return RedisBackend(self.redis_url)
        assert self.sqlite_path is not None
        return SQLiteBackend(self.sqlite_path)

    @property
    def name(self) -> str:
        return "Redis" if self.redis_url is not None else "SQLite (a temporary file)"


@dataclass(frozen=True)
class _CrawlPlan:
    index: int
    store: _Store
    namespace: str
    rates: tuple[Rate, ...]
    min_interval: float
    margin: float
    duration: float
    upstream_url: str
    tokens: tuple[tuple[int, str], ...]  # (token number, token) this crawler fetches for


@dataclass
class _CrawlReport:
    index: int
    slots: dict[int, list[float]] = field(default_factory=dict)  # token number -> slots
    error: str | None = None


# -- the crawler processes ---------------------------------------------------------------


class _Waiting:
    """Whether one crawler thread's request is waiting for its slot, kept in the shared
    count of its token's waiting crawlers (each thread fetches for one token)."""

    def __init__(self, counters: Any, number: int) -> None:
        self._counters = counters
        self._field = number * _FIELDS + _WAITING
        self._waiting = False

    def set(self, waiting: bool) -> None:
        if waiting != self._waiting:
            self._waiting = waiting
            with self._counters.get_lock():
                self._counters[self._field] += 1 if waiting else -1


class _CountingTransport(httpx.BaseTransport):
    """Counts what really went over the wire, 429s included, before any retry. It is
    called once a request has its slot: the request no longer waits, until a 429 sends
    it back to the limiter for another."""

    def __init__(self, counters: Any, numbers: dict[str, int], waiting: _Waiting) -> None:
        self._inner = httpx.HTTPTransport()
        self._counters = counters
        self._numbers = numbers
        self._waiting = waiting

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        token = request.headers["Authorization"].partition(" ")[2]
        if token not in self._numbers:
            return self._inner.handle_request(request)  # a warm-up request, not the crawl's
        self._waiting.set(False)
        response = self._inner.handle_request(request)
        base = self._numbers[token] * _FIELDS
        with self._counters.get_lock():
            self._counters[base + _SENT] += 1
            self._counters[base + (_REFUSED if response.status_code == 429 else _OK)] += 1
        if response.status_code == 429:
            self._waiting.set(True)  # retried through the limiter, unless the attempts ran out
        return response

    def close(self) -> None:
        self._inner.close()


def quiet() -> None:
    """Keep the library's log lines (a store unavailable, an upstream 429) off the terminal:
    the command reports failures itself, and they would garble the live display."""
    logging.getLogger("throttle_client").setLevel(logging.ERROR)


def _crawl(plan: _CrawlPlan, counters: Any, barrier: Any, results: Any) -> None:
    """Crawler process: one thread per token, each fetching pages until the deadline."""
    quiet()  # 429s are counted and shown by the parent; log lines would garble its display
    report = _CrawlReport(plan.index)
    try:
        limiter = Limiter(
            plan.store.open(),
            rates=plan.rates,
            min_interval=plan.min_interval,
            margin=plan.margin,
            namespace=plan.namespace,
        )
        numbers = {token: number for number, token in plan.tokens}
        # The slot each request of the crawl got, from the limiter's events (which name a
        # key by its label, never the token).
        by_label = {limiter.label(token): number for token, number in numbers.items()}

        def keep_slot(event: Event) -> None:
            number = by_label.get(event.key)
            if event.kind == "admitted" and number is not None:
                report.slots[number].append(event.slot)

        limiter.listen(keep_slot)
        for number, token in plan.tokens:
            report.slots[number] = []
            limiter.usage(token)  # open the store before the start, writing nothing
        errors: list[str] = []

        waiting = {number: _Waiting(counters, number) for number in numbers.values()}
        clients = [
            httpx.Client(
                transport=ThrottledTransport(
                    limiter, transport=_CountingTransport(counters, numbers, waiting[number])
                ),
                base_url=plan.upstream_url,
                headers={"Authorization": f"Bearer {token}"},
                timeout=30,
            )
            for number, token in plan.tokens
        ]
        for number, client in zip(numbers.values(), clients, strict=True):
            # Open the connection and run every code path once before the start, under a
            # key of its own: a first request is slow, and would arrive late after its slot.
            warm_up = {"Authorization": f"Bearer warm-up-{plan.namespace}-{plan.index}-{number}"}
            client.get("/warm-up", headers=warm_up).read()

        def fetch(client: httpx.Client, waits: _Waiting, deadline: float) -> None:
            try:
                page = 0
                while (left := deadline - time.monotonic()) > 0:
                    page += 1
                    waits.set(True)
                    # No slot past the end: one would stretch the run (with 1/second, two
                    # crawlers of one token and --duration 0.5, the second would book 1 s,
                    # the first then 2 s).
                    params, wait = {"page": page}, {"acquire_timeout": left}
                    client.get("/items", params=params, extensions=wait).read()
                    waits.set(False)
            except ThrottleTimeout:
                pass  # the next slot lies after the end: this crawler is done
            except Exception:
                errors.append(traceback.format_exc())
            finally:
                waits.set(False)
                client.close()

        barrier.wait(timeout=120)
        deadline = time.monotonic() + plan.duration
        threads = [
            threading.Thread(target=fetch, args=(client, waiting[number], deadline), daemon=True)
            for (number, _), client in zip(plan.tokens, clients, strict=True)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            report.error = errors[0]
    except BaseException:
        report.error = traceback.format_exc()
        barrier.abort()
    results.put(report)


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


# -- judging a run ---------------------------------------------------------------------------


class _Timeline:
    """Time that moves only when the limiter sleeps: a schedule is counted, not waited for."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def most_calls(rates: Sequence[Rate], min_interval: float, span: float) -> int:
    """The most calls the quota admits in a closed span of ``span`` seconds: the library's
    own earliest-slot schedule from an empty log, on a clock of its own (no schedule of
    the same calls places its k-th call earlier)."""
    clock = _Timeline()
    limiter = Limiter(
        MemoryBackend(),
        rates=list(rates),
        min_interval=min_interval,
        margin=0,  # the quota exactly as the upstream counts it
        clock=clock,
        sleep=clock.sleep,
    )
    count = 0
    while limiter.acquire("k").slot <= span + 1e-6:  # slots are whole µs: allow rounding
        count += 1
    return count


def fullest_window(slots: Sequence[float], period: float) -> int:
    """The most slots in any half-open window ``(t - period, t]`` (``slots`` sorted)."""
    return max(
        (bisect_right(slots, t) - bisect_right(slots, t - period + 1e-7) for t in slots),
        default=0,
    )


def judge(
    config: DemoConfig,
    slots: dict[int, list[float]],
    upstream: dict[str, Any],
    tokens: Sequence[str],
    elapsed: float,
) -> dict[str, Any]:
    """The summary of a run, as ``--json`` prints it."""
    per_token = []
    admitted_total = possible_total = 0
    for number, token in enumerate(tokens):
        mine = sorted(slots.get(number, []))
        admitted = int(upstream["per_token"].get(token, 0))
        span = mine[-1] - mine[0] if mine else 0.0
        possible = most_calls(config.rates, config.min_interval, span) if mine else 0
        admitted_total += admitted
        possible_total += possible
        per_token.append(
            {"token": f"token {number + 1}", "admitted": admitted, "possible": possible,
             "span": round(span, 3)}
        )  # fmt: skip
    all_slots = [sorted(slots.get(number, [])) for number in range(len(tokens))]
    arrivals = [sorted(upstream.get("arrivals", {}).get(token, [])) for token in tokens]
    peaks = {
        str(rate): {
            "limit": rate.limit,
            "by_slot": max((fullest_window(s, rate.period) for s in all_slots), default=0),
            # Exact windows: an arrival jitter of a microsecond can show limit + 1 here.
            "by_arrival": max((fullest_window(a, rate.period) for a in arrivals), default=0),
            # As the upstream judges: windows shortened by the tolerance.
            "by_arrival_within_tolerance": max(
                (fullest_window(a, rate.period - config.tolerance) for a in arrivals), default=0
            ),
        }
        for rate in config.rates
    }
    slot_gaps = [b - a for s in all_slots for a, b in pairwise(s)]
    admitted = sum(int(upstream["per_token"].get(token, 0)) for token in tokens)
    return {
        "requests": admitted + int(upstream["rejected"]),
        "admitted": admitted,
        "rejected": int(upstream["rejected"]),
        "utilisation": round(admitted_total / possible_total, 4) if possible_total else 0.0,
        "possible": possible_total,
        "peak_in_window": peaks,
        "min_gap": {
            "limit": config.min_interval,
            "by_arrival": upstream["min_gap"],
            "by_slot": round(min(slot_gaps), 6) if slot_gaps else None,
        },
        "per_token": per_token,
        "workers": config.workers,
        "tokens": len(tokens),
        "duration": config.duration,
        "elapsed": round(elapsed, 3),
        "rates": [str(rate) for rate in config.rates],
        "min_interval": config.min_interval,
        "margin": config.margin,
        "tolerance": config.tolerance,
        "store": "redis" if config.redis_url else "sqlite",
    }


# -- running it -------------------------------------------------------------------------------


@dataclass
class DemoRun:
    """What the live display and the summary read while and after the demo runs."""

    config: DemoConfig
    store: _Store
    limiter: Limiter
    tokens: tuple[str, ...]
    counters: Any
    started: float = 0.0
    upstream_stats: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    slots: dict[int, list[float]] = field(default_factory=dict)  # token number -> slots

    def counts(self, number: int) -> tuple[int, int, int, int]:
        base = number * _FIELDS
        values = self.counters[base : base + _FIELDS]
        return int(values[0]), int(values[1]), int(values[2]), int(values[3])


class DemoError(Exception):
    """The demo could not run (no store, a crawler failed to start): one line for the user."""


def _assign(workers: int, tokens: int) -> list[list[int]]:
    """Token numbers per crawler: with fewer tokens than crawlers, several crawlers share
    each token (the contention the demo is about); with more, crawlers take several."""
    if tokens <= workers:
        return [[index % tokens] for index in range(workers)]
    return [[t for t in range(tokens) if t % workers == index] for index in range(workers)]


@contextlib.contextmanager
def _store(config: DemoConfig) -> Iterator[_Store]:
    if config.redis_url is not None:
        yield _Store(redis_url=config.redis_url)
        return
    with tempfile.TemporaryDirectory(prefix="throttle-client-demo-") as tmp:
        yield _Store(sqlite_path=str(Path(tmp) / "limits.db"))


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
        run = DemoRun(config, store, limiter, tokens, ctx.Array("q", _FIELDS * config.tokens))
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
                plan = _CrawlPlan(
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
                    target=_crawl, args=(plan, run.counters, barrier, results), daemon=True
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
) -> list[_CrawlReport]:
    reports: list[_CrawlReport] = []
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


# -- what the user sees ---------------------------------------------------------------------


def describe_quota(config: DemoConfig) -> str:
    rates = " and ".join(str(rate) for rate in config.rates)
    return f"{rates} per token, calls at least {config.min_interval:g} s apart"


def progress_line(run: DemoRun, elapsed: float) -> str:
    """One plain line of the run so far, for a terminal without the live view or a log."""
    counts = [run.counts(number) for number in range(len(run.tokens))]
    sent, ok, refused, waiting = (sum(column) for column in zip(*counts, strict=True))
    return (
        f"{min(elapsed, run.config.duration):5.1f} / {run.config.duration:g} s   "
        f"sent {sent}, admitted {ok}, 429s {refused}, crawlers waiting for a slot {waiting}"
    )


class ProgressLines:
    """A ``watch`` for :func:`run_demo` that writes a :func:`progress_line` about once a
    second (it is called four times as often): lines that read as well in a log or a
    pipe as on a terminal, where a redrawn view would need rich."""

    def __init__(self, out: TextIO, *, every: float = 1.0) -> None:
        self._out = out
        self._every = every
        self._next = every

    def __call__(self, run: DemoRun) -> None:
        elapsed = time.monotonic() - run.started if run.started else 0.0
        if elapsed < self._next:
            return
        self._next = (elapsed // self._every + 1) * self._every
        print(progress_line(run, elapsed), file=self._out, flush=True)


def summary_text(summary: dict[str, Any], errors: Sequence[str]) -> str:
    by_slot = ", ".join(
        f"{p['by_slot']} in {rate} (limit {p['limit']})"
        for rate, p in summary["peak_in_window"].items()
    )
    by_arrival = ", ".join(
        f"{p['by_arrival']} in {rate} ({p['by_arrival_within_tolerance']} within the tolerance)"
        for rate, p in summary["peak_in_window"].items()
    )
    gap = summary["min_gap"]
    closest = (
        "-"
        if gap["by_slot"] is None
        else f"{gap['by_arrival']:.4f} s by arrival, {gap['by_slot']:.4f} s by slot "
        f"(at least {gap['limit']:g} s)"
    )
    rates = " and ".join(summary["rates"])
    lines = [
        f"throttle-client demo: {summary['workers']} crawler processes, {summary['tokens']} "
        f"tokens, {summary['elapsed']:.1f} s, limits shared through {summary['store']}",
        f"  quota per token      {rates}, calls at least {summary['min_interval']:g} s apart",
        f"  requests             {summary['requests']}",
        f"  429s received        {summary['rejected']}",
        f"  utilisation          {summary['utilisation']:.1%}  ({summary['admitted']} admitted of "
        f"the {summary['possible']} the quota allows between each token's first and last slot)",
        f"  fullest window       by slot: {by_slot}",
        f"                       by arrival: {by_arrival}",
        f"  closest two calls    {closest}",
        "",
        "  The limiter hands out slots within the exact quota (the 'by slot' figures), its",
        f"  windows and gap widened by margin={summary['margin']:g} s: a request reaches the "
        "upstream a",
        "  little after its slot, by a delay that varies, and the upstream counts arrivals"
        + (
            f" (forgiving one up to {summary['tolerance']:g} s early)."
            if summary["tolerance"]
            else ", exactly."
        ),
    ]
    lines += [f"  error: {error.splitlines()[-1]}" for error in errors]
    if summary["rejected"] == 0 and not errors:
        lines.append("OK: no request was rejected.")
    else:
        lines.append(f"FAILED: {summary['rejected']} requests rejected, {len(errors)} errors.")
    return "\n".join(lines)
