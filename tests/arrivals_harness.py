"""One run of the arrival scenarios: many clients on one token, a strict upstream
that counts arrivals, and the slots the store handed out. Used by tests/test_arrivals.py
and benchmarks/bench_arrivals.py (one copy of the harness for both).

A run has three kinds of process, all from a fork server (no connection crosses a fork):

- the upstream: ``StrictUpstream`` with tolerance 0, alone in its process so that no
  client thread holds its GIL while it stamps an arrival. It journals every request:
  its arrival (its own monotonic clock, which is how it judges, and the same instant
  on the wall clock, which is the clock of the slots) and the slot the request says
  it was sent for;
- the clients: each process builds its own limiter on the shared store and its own
  throttled httpx client, and runs ``threads`` requesters (sync) or ``tasks`` (async)
  that fetch in a loop until the common deadline, on one token, far above the quota.
  A requester whose next slot lies past the deadline stops (ThrottleTimeout): with 200
  of them the queue is full to the end from the first instant;
- the parent, which starts them together at a barrier and judges (``judge``).

Each request carries its slot (``?slot=<µs>``, added by the inner transport: slots are
not secret), so an arrival is paired with its slot exactly, never by order.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import contextvars
import gc
import itertools
import logging
import math
import multiprocessing
import os
import queue
import secrets
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx

from tests.contention_worker import StoreSpec, make_backend
from throttle_client import (
    AsyncLimiter,
    AsyncThrottledClient,
    Event,
    Limiter,
    Rate,
    RetryPolicy,
    ThrottledClient,
    ThrottleTimeout,
)
from throttle_client.cli.demo import most_calls
from throttle_client.cli.upstream import StrictUpstream

# Both windows and the gap bind within a few seconds: 20 calls take 0.38 s at the gap
# (0.855 s with the default margin's wider gap), so the first second is gap-paced, then
# full; the 3-second window binds from the third second on (16.7/s on average).
RATES = (Rate.parse("20/second"), Rate.parse("50/3 seconds"))
REFUSAL_PAUSE = 1.0  # StrictUpstream's Retry-After on a 429, seconds
MIN_INTERVAL = 0.02
DURATION = 5.0  # seconds of demand after the common start
US = 1_000_000
NS = 1_000_000_000


@dataclass(frozen=True)
class Scenario:
    """Client processes: ("sync", threads) or ("async", tasks) each; seconds of demand."""

    name: str
    processes: tuple[tuple[str, int], ...]
    duration: float = DURATION


SCENARIOS = {
    "processes": Scenario("8 processes", (("sync", 2),) * 4 + (("async", 4),) * 4),
    "threads": Scenario("200 threads on one Limiter", (("sync", 200),)),
    # 1000 tasks that start together keep one event loop busy for the first few hundred
    # ms (each task's first step, then each answer): the slots due then wake late and are
    # given up, 2 to 9 of them (more on SQLite, whose answers come through threads). A
    # longer run keeps that fixed cost from deciding the utilisation.
    "tasks": Scenario("1000 tasks on one AsyncLimiter", (("async", 1000),), duration=8.0),
}


@dataclass(frozen=True)
class Setup:
    """What every client process is given (picklable)."""

    store: str  # a redis:// URL or sqlite:///path
    upstream_url: str
    namespace: str
    token: str
    margin: float
    duration: float
    log_level: int = logging.WARNING  # of the library's logger in the clients
    rates: tuple[Rate, ...] = RATES
    min_interval: float = MIN_INTERVAL


@dataclass
class Call:
    """One admitted decision of a client, by its slot (store clock, whole µs)."""

    slot_us: int
    returned: float  # time.time() when the limiter let it go
    sent: float = math.nan  # time.time() when the inner transport began to send it


@dataclass
class ClientReport:
    index: int
    calls: dict[int, Call] = field(default_factory=dict)
    late: int = 0  # slots booked and given up for being late (see _LateCounter)
    error: str | None = None


@dataclass(frozen=True)
class Arrival:
    """One request as the upstream saw it."""

    slot_us: int | None  # the slot it was sent for (None: the request did not say)
    at_ns: int  # the upstream's monotonic clock: how it judged the request
    wall: float  # the same instant on the wall clock, the clock of the slots
    status: int


# -- the upstream process -------------------------------------------------------------------


class _JournalingUpstream(StrictUpstream):
    """StrictUpstream that also journals every request to /items (warm-ups go elsewhere)."""

    journal: list[Arrival]

    def _judge(self, token: str, path: str, now: float) -> tuple[int, dict[str, str]]:
        wall = now + (time.time() - time.monotonic())
        status, headers = super()._judge(token, path, now)
        url = urlsplit(path)
        if url.path == "/items":
            slot = parse_qs(url.query).get("slot")
            self.journal.append(
                Arrival(int(slot[0]) if slot else None, round(now * NS), wall, status)
            )
        return status, headers


def settle_garbage() -> None:
    """Keep what a process imported out of the garbage collector's way. multiprocessing
    imports the parent's main module into each child: under the ``pytest`` script that
    is all of pytest, and a full collection over it stalls a process ~30 ms, once a run
    (the upstream stamping late, or a client sending late). Not the library's doing,
    and no user process carries a test runner."""
    gc.collect()
    gc.freeze()


def _serve(
    conn: Connection, rates: tuple[Rate, ...], gap: float, options: dict[str, Any] | None = None
) -> None:
    """Upstream process: send the URL, serve until told to stop, send the journal.
    ``options``: more of StrictUpstream's (an account's quota)."""
    # A real upstream does not share the clients' CPUs: on this small machine it goes
    # first (as root; elsewhere it stays as it is), so its stamps are not held back by
    # a client process that happens to hold the core when a request lands.
    with contextlib.suppress(OSError):
        os.nice(-10)
    settle_garbage()
    upstream = _JournalingUpstream(rates=rates, min_interval=gap, tolerance=0.0, **(options or {}))
    upstream.journal = []
    upstream.start()
    conn.send(upstream.url)
    try:
        conn.recv()
        conn.send(list(upstream.journal))
    finally:
        upstream.stop()


# -- the client processes ---------------------------------------------------------------------

# The slot of the request the current thread or task is about to send: set by the
# recorder (the limiter's "admitted" event, sent in the thread or task that made the
# call), read by the inner transport (threads and tasks each have their own).
_slot: contextvars.ContextVar[int] = contextvars.ContextVar("slot")


def _record(limiter: Limiter | AsyncLimiter, token: str, calls: dict[int, Call]) -> None:
    """Keep each admitted call of the crawl's token (not the warm-up's) in ``calls``."""
    label = limiter.label(token)

    def admitted(event: Event) -> None:
        if event.kind == "admitted" and event.key == label:
            slot_us = round(event.slot * US)
            calls[slot_us] = Call(slot_us, time.time())
            _slot.set(slot_us)

    limiter.listen(admitted)


def _until(deadline: float) -> dict[str, Any]:
    """A request's extensions that book nothing past the end: a requester whose next slot
    lies past it stops (ThrottleTimeout)."""
    return {"acquire_timeout": max(0.0, deadline - time.monotonic())}


def _stamp(request: httpx.Request, calls: dict[int, Call]) -> None:
    """Tell the upstream which slot ``request`` goes for, and note when it left."""
    slot_us = _slot.get(None)
    if slot_us is not None and request.url.path == "/items":
        request.url = request.url.copy_set_param("slot", str(slot_us))
        calls[slot_us].sent = time.time()


class _StampingTransport(httpx.HTTPTransport):
    def __init__(self, calls: dict[int, Call]) -> None:
        super().__init__()
        self.calls = calls

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        _stamp(request, self.calls)
        return super().handle_request(request)


class _AsyncStampingTransport(httpx.AsyncHTTPTransport):
    def __init__(self, calls: dict[int, Call]) -> None:
        super().__init__()
        self.calls = calls

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        _stamp(request, self.calls)
        return await super().handle_async_request(request)


def _limiter_args(setup: Setup) -> dict[str, Any]:
    return {
        "rates": setup.rates,
        "min_interval": setup.min_interval,
        "margin": setup.margin,
        "namespace": setup.namespace,
    }


def _client_args(setup: Setup) -> dict[str, Any]:
    return {
        "base_url": setup.upstream_url,
        "headers": {"Authorization": f"Bearer {setup.token}"},
        # A 429 is what the run is judged on: never retried, so never hidden.
        "retry": RetryPolicy(max_attempts=1),
        "timeout": 30,
    }


def _warm_up_headers(setup: Setup, index: int) -> dict[str, str]:
    # A first request is slow (connecting, first use of every code path): one before the
    # start, under a key of its own, so that no crawl request pays for it.
    return {"Authorization": f"Bearer warm-up-{setup.namespace}-{index}"}


def _sync_client(
    setup: Setup, index: int, threads: int, barrier: Any, report: ClientReport
) -> None:
    backend = make_backend(StoreSpec(setup.store), asynchronous=False)
    limiter = Limiter(backend, **_limiter_args(setup))
    _record(limiter, setup.token, report.calls)
    errors: list[str] = []
    transport = _StampingTransport(report.calls)
    with ThrottledClient(limiter, transport=transport, **_client_args(setup)) as client:
        # Open the store first, writing nothing: the warm-up's acquire then hears back
        # at once, as every later call will (a first answer that took a connection's
        # set-up would say the store's clock is known only to within that long).
        limiter.usage(setup.token)
        client.get("/warm-up", headers=_warm_up_headers(setup, index))
        barrier.wait(timeout=120)
        deadline = time.monotonic() + setup.duration

        def fetch() -> None:
            try:
                while time.monotonic() < deadline:
                    client.get("/items", extensions=_until(deadline))
            except ThrottleTimeout:
                pass  # its next slot lies past the end: this requester is done
            except Exception:
                errors.append(traceback.format_exc())

        workers = [threading.Thread(target=fetch, daemon=True) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    backend.close()
    if errors:
        report.error = errors[0]


async def _async_client(
    setup: Setup, index: int, tasks: int, barrier: Any, report: ClientReport
) -> None:
    backend = make_backend(StoreSpec(setup.store), asynchronous=True)
    limiter = AsyncLimiter(backend, **_limiter_args(setup))
    _record(limiter, setup.token, report.calls)
    transport = _AsyncStampingTransport(report.calls)
    async with AsyncThrottledClient(limiter, transport=transport, **_client_args(setup)) as client:
        # As many connections as the tasks will use at once (the pool's size at most).
        await asyncio.gather(*(limiter.usage(setup.token) for _ in range(min(tasks, 64))))
        await client.get("/warm-up", headers=_warm_up_headers(setup, index))
        barrier.wait(timeout=120)  # blocking the loop is harmless: no task runs yet
        deadline = time.monotonic() + setup.duration

        async def fetch() -> None:
            try:
                while time.monotonic() < deadline:
                    await client.get("/items", extensions=_until(deadline))
            except ThrottleTimeout:
                pass

        await asyncio.gather(*(fetch() for _ in range(tasks)))
    aclose = getattr(backend, "aclose", None)
    if aclose is not None:
        await aclose()
    else:
        backend.close()


class _LateCounter(logging.Handler):
    """Counts the limiter's "past its slot ... booking a new one" lines. Decision.late_wakeups
    misses a late call whose new slot lay past the end (it raised ThrottleTimeout instead),
    and here every requester ends that way, so the log line is what counts them all."""

    def __init__(self, report: ClientReport) -> None:
        super().__init__(logging.DEBUG)
        self.report = report

    def emit(self, record: logging.LogRecord) -> None:
        if "past its slot" in str(record.msg):
            self.report.late += 1


def client_process(
    setup: Setup, index: int, kind: str, count: int, barrier: Any, results: Any
) -> None:
    """Process entry point: put a ClientReport on ``results`` (with any traceback)."""
    settle_garbage()
    report = ClientReport(index)
    logger = logging.getLogger("throttle_client")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(_LateCounter(report))
    shown = logging.StreamHandler()  # what logging would print with no handler of ours
    shown.setLevel(setup.log_level)
    logger.addHandler(shown)
    try:
        if kind == "sync":
            _sync_client(setup, index, count, barrier, report)
        else:
            asyncio.run(_async_client(setup, index, count, barrier, report))
    except BaseException:
        report.error = traceback.format_exc()
        barrier.abort()  # do not leave the others waiting for a process that is gone
    results.put(report)


# -- running and judging ------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """A run, judged. Windows are half-open ``(t - W, t]``, exact, no tolerance."""

    scenario: str
    store: str
    margin: float
    sent: int  # requests that reached the upstream
    rejected: int  # 429s
    over_by_arrival: int  # arrivals whose window (any rate) held more than the limit
    close_by_arrival: int  # arrivals less than min_interval after the one before
    fullest_by_arrival: tuple[int, ...]  # per rate, the most arrivals in one window
    fullest_by_slot: tuple[int, ...]  # per rate, the most used slots in one window
    closest_slots_us: int  # the least distance between two used slots
    late_wakeups: int
    used: int  # slots used (sent for)
    possible_by_slot: int  # the most calls the exact quota allows between first and last slot
    possible_by_arrival: int  # the same between the first and last admitted arrival
    admitted: int
    lateness: tuple[float, ...]  # arrival - slot, seconds, sorted
    # Where the lateness comes from, seconds, each sorted:
    waking: tuple[float, ...]  # the limiter let the call go, after its slot
    preparing: tuple[float, ...]  # the inner transport began to send, after that
    in_flight: tuple[float, ...]  # the upstream stamped the arrival, after that
    # What the limiter promises (docs/concepts.md, "Slots and arrivals"): a request that
    # leaves within the margin of its slot, and arrives within it, never crowds a window or
    # the gap as the upstream counts them. A request the limiter let go in time, but that
    # reached the upstream later than its slot plus the margin (the machine stalled it
    # between the limiter and the upstream), is outside that promise: ``stalled``. The
    # windows and the gap are judged again with each stalled arrival put back at its
    # slot plus the margin (the latest the promise covers), and a 429 is excused when a
    # window or gap it was refused for holds a stalled arrival. A call the limiter let go
    # late is never excused: that lateness is the limiter's to prevent.
    stalled: int = 0
    over_within_promise: int = 0
    close_within_promise: int = 0
    unexcused_429s: int = 0
    # A 429 pauses the key for every worker for its Retry-After, as the transports
    # promise to: the schedule between the first slot and the last, less the time so
    # paused (REFUSAL_PAUSE after each, merged), is what the run could use.
    possible_unpaused: int = 0

    @property
    def use_promised(self) -> float:
        """The slots used, and those booked by late wake-ups (left unused: under-use, as
        the limiter promises), of the schedule the run could use (possible_unpaused)."""
        possible = self.possible_unpaused or self.possible_by_slot
        return (self.used + self.late_wakeups) / possible if possible else 0.0

    @property
    def use_by_slot(self) -> float:
        return self.used / self.possible_by_slot if self.possible_by_slot else 0.0

    @property
    def use_by_arrival(self) -> float:
        return self.admitted / self.possible_by_arrival if self.possible_by_arrival else 0.0

    def summary(self) -> str:
        return (
            f"{self.scenario} on {self.store}, margin {self.margin * 1000:g} ms: "
            f"{self.rejected} 429s of {self.sent} ({self.unexcused_429s} not excused), "
            f"{self.over_by_arrival} over-limit windows by arrival ({self.over_within_promise} "
            f"within the promise), {self.stalled} stalled after release, "
            f"{self.late_wakeups} late wake-ups, utilisation by slot "
            f"{self.use_by_slot:.1%} ({self.used}/{self.possible_by_slot}; with late "
            f"wake-ups, out of the time not paused by 429s: {self.use_promised:.1%}), "
            "arrival - slot "
            f"p50 {quantile(self.lateness, 0.5) * 1000:.1f} ms, "
            f"max {max(self.lateness, default=0.0) * 1000:.1f} ms (of it at most: waking "
            f"{max(self.waking, default=0.0) * 1000:.1f}, preparing "
            f"{max(self.preparing, default=0.0) * 1000:.1f}, in flight "
            f"{max(self.in_flight, default=0.0) * 1000:.1f} ms)"
        )


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile of sorted ``values`` (0 for none)."""
    if not values:
        return 0.0
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def crowded(times: Sequence[int], period: int, limit: int) -> tuple[int, int]:
    """(how many windows ``(t - period, t]`` ending at a point of ``times`` hold more than
    ``limit`` points, the most any holds); ``times`` sorted integers. A window's count
    only grows when its right edge reaches a point: those are the windows to check."""
    counts = [bisect.bisect_right(times, t) - bisect.bisect_right(times, t - period) for t in times]
    return sum(count > limit for count in counts), max(counts, default=0)


def judge(
    scenario: Scenario,
    store: str,
    setup: Setup,
    reports: list[ClientReport],
    journal: list[Arrival],
) -> Outcome:
    calls = {slot: call for report in reports for slot, call in report.calls.items()}
    slots = sorted(calls)
    arrivals = sorted(journal, key=lambda a: a.at_ns)
    at = [a.at_ns for a in arrivals]
    over, by_arrival = 0, []
    for rate in setup.rates:
        count, fullest = crowded(at, round(rate.period * NS), rate.limit)
        over += count
        by_arrival.append(fullest)
    gap_ns = round(setup.min_interval * NS)
    close = sum(b - a < gap_ns for a, b in itertools.pairwise(at))
    by_slot = tuple(crowded(slots, rate.period_us, rate.limit)[1] for rate in setup.rates)
    admitted = [a.wall for a in arrivals if a.status == 200]
    paired = [(a, calls[a.slot_us]) for a in arrivals if a.slot_us in calls]
    promise = _within_promise(setup, arrivals, calls)
    # The pauses the 429s cause (Retry-After: REFUSAL_PAUSE), merged, within the span of
    # the slots. (Every 429 pauses the key; a run with a 429 not excused fails anyway.)
    paused, until = 0.0, -math.inf
    first, last = (slots[0] / US, slots[-1] / US) if slots else (0.0, 0.0)
    for a in arrivals:
        if a.status == 429:
            start, end = max(a.wall, until, first), min(a.wall + REFUSAL_PAUSE, last)
            paused += max(0.0, end - start)
            until = max(until, a.wall + REFUSAL_PAUSE)
    span = last - first if slots else None
    unpaused = _possible(setup, None if span is None else max(0.0, span - paused))
    return Outcome(
        scenario=scenario.name,
        store=store,
        margin=setup.margin,
        sent=len(arrivals),
        rejected=sum(a.status == 429 for a in arrivals),
        over_by_arrival=over,
        close_by_arrival=close,
        fullest_by_arrival=tuple(by_arrival),
        fullest_by_slot=by_slot,
        closest_slots_us=min((b - a for a, b in itertools.pairwise(slots)), default=0),
        late_wakeups=sum(report.late for report in reports),
        used=len(slots),
        possible_by_slot=_possible(setup, (slots[-1] - slots[0]) / US if slots else None),
        possible_by_arrival=_possible(setup, admitted[-1] - admitted[0] if admitted else None),
        admitted=len(admitted),
        lateness=tuple(sorted(a.wall - call.slot_us / US for a, call in paired)),
        waking=tuple(sorted(call.returned - call.slot_us / US for _, call in paired)),
        preparing=tuple(sorted(call.sent - call.returned for _, call in paired)),
        in_flight=tuple(sorted(a.wall - call.sent for a, call in paired)),
        possible_unpaused=unpaused,
        **promise,
    )


def _within_promise(
    setup: Setup, arrivals: list[Arrival], calls: dict[int, Call]
) -> dict[str, int]:
    """The judgement within the limiter's promise (see Outcome.stalled): how many
    arrivals were stalled, the windows over their limit and the gaps crowded once each
    stalled arrival is put back at its slot plus the margin, and the 429s for which no
    window or gap that refused them holds a stalled arrival."""
    margin_ns = round(setup.margin * NS)
    stalled = set()
    placed = []  # (the time the promise covers, ns; the arrival's index)
    for index, a in enumerate(arrivals):
        call = None if a.slot_us is None else calls.get(a.slot_us)
        at = a.at_ns
        if call is not None:
            # (Wall clocks of one host: the client's and the upstream's stamps compare.)
            late = a.wall - call.slot_us / US
            if call.returned - call.slot_us / US <= setup.margin < late:
                stalled.add(index)  # put back at its slot + margin, on the upstream's clock
                at = a.at_ns - round(late * NS) + margin_ns
        placed.append((at, index))
    placed.sort()
    times = [at for at, _ in placed]
    over = sum(crowded(times, round(rate.period * NS), rate.limit)[0] for rate in setup.rates)
    gap_ns = round(setup.min_interval * NS)
    close = sum(b - a < gap_ns for a, b in itertools.pairwise(times))
    unexcused = 0
    real = [a.at_ns for a in arrivals]  # (sorted: arrivals are)
    for index, a in enumerate(arrivals):
        if a.status != 429 or index in stalled:
            continue
        # Every arrival the upstream counted in any of its windows ending at this one,
        # and the one before it (the gap).
        first = min(
            bisect.bisect_right(real, a.at_ns - round(rate.period * NS)) for rate in setup.rates
        )
        near = set(range(max(0, min(first, index - 1)), index + 1))
        if not near & stalled:
            unexcused += 1
    return {
        "stalled": len(stalled),
        "over_within_promise": over,
        "close_within_promise": close,
        "unexcused_429s": unexcused,
    }


def _possible(setup: Setup, span: float | None) -> int:
    return 0 if span is None else most_calls(setup.rates, setup.min_interval, span)


def run(
    scenario: Scenario,
    store: str,
    *,
    margin: float,
    duration: float | None = None,
    log_level: int = logging.WARNING,
) -> Outcome:
    """Run ``scenario`` against ``store`` (a redis:// URL or sqlite:///path) and judge it.
    ``duration``: seconds of demand (default: the scenario's). ``log_level``: of the
    library's logger in the clients (each 429 is a warning)."""
    duration = scenario.duration if duration is None else duration
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    conn, child = ctx.Pipe()
    upstream = ctx.Process(target=_serve, args=(child, RATES, MIN_INTERVAL), daemon=True)
    upstream.start()
    processes: list[Any] = []
    results = ctx.Queue()
    try:
        if not conn.poll(60):
            raise RuntimeError("the upstream did not start")
        setup = Setup(
            store=store,
            upstream_url=conn.recv(),
            namespace=f"arrivals-{secrets.token_hex(4)}",
            token=f"token-{secrets.token_hex(8)}",
            margin=margin,
            duration=duration,
            log_level=log_level,
        )
        barrier = ctx.Barrier(len(scenario.processes) + 1)
        for index, (kind, count) in enumerate(scenario.processes):
            args = (setup, index, kind, count, barrier, results)
            processes.append(ctx.Process(target=client_process, args=args, daemon=True))
            processes[-1].start()
        # A broken barrier: a client failed before the start, and its report says why.
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout=120)
        reports = _collect(processes, results, give_up=time.monotonic() + duration + 60)
        conn.send("stop")
        journal: list[Arrival] = conn.recv() if conn.poll(30) else []
    finally:
        for process in [*processes, upstream]:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        results.close()
        results.join_thread()
    errors = [f"client {r.index}:\n{r.error}" for r in reports if r.error]
    if len(reports) < len(processes):
        errors.append(f"only {len(reports)} of {len(processes)} clients reported")
    if errors:
        raise RuntimeError("\n".join(errors))
    kind = "SQLite" if store.startswith("sqlite") else "Redis"
    return judge(scenario, kind, setup, reports, journal)


def _collect(processes: list[Any], results: Any, *, give_up: float) -> list[ClientReport]:
    reports: list[ClientReport] = []
    while len(reports) < len(processes) and time.monotonic() < give_up:
        try:
            reports.append(results.get(timeout=0.5))
        except queue.Empty:
            if all(not p.is_alive() for p in processes) and results.empty():
                break
    return reports
