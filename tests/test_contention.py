"""Contention: 8 processes on one key, in real time.

Half the processes are sync (one loop each), half asyncio (several loops each);
they mix acquire() with long and short timeouts and try_acquire(), start together
at a barrier, and ask for one key for a few seconds, far beyond its quota.

The verdict comes from the slots the store handed out (``Decision.slot``, in the
store's clock, compared in whole microseconds), never from when a process woke up,
so a loaded machine can slow the test down but not change its answer:

- every half-open window ``(t - W, t]`` of each rate holds at most its limit;
- consecutive slots are at least ``min_interval`` apart;
- the slots use >= 99% of what the best possible schedule would have admitted
  between the first and the last slot (demand exceeds the quota all along).
"""

from __future__ import annotations

import bisect
import collections
import itertools
import multiprocessing
import queue
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from tests import contention_worker as worker
from throttle_client import Rate
from throttle_client._config import DEFAULT_MARGIN

RATES = ((20, 1.0), (50, 3.0))  # (limit, period seconds)
MIN_INTERVAL = 0.02
# The default margin: the slots keep the exact quota, and the schedule they are held to
# is the best one for the windows and gap the margin widens (what the limiter aims at).
MARGIN = DEFAULT_MARGIN
DURATION = 4.0  # seconds of demand after the common start
# Roles (see contention_worker): the many "wait" loops keep reservations queued ahead, so
# demand exceeds the quota even when a process wakes late; "brief" and "try" are then
# mostly refused, and a refusal that booked anything would show up as unused quota.
SYNC_ROLES = ("wait", "brief", "try", "wait")  # one sync process per entry
ASYNC_ROLES = ("wait",) * 5 + ("brief", "try")  # tasks in each async process
ASYNC_PROCESSES = 4
MIN_USE = 0.99
US = 1_000_000

# One entry per store: the fixture that gives its URL, whether it is a Redis Cluster,
# and the costs calls draw from (a new store is one entry here and one branch in
# contention_worker.make_backend).
# (The default tier runs one of each kind of store; the second tier, -m slow, the rest.)
SLOW_CLUSTER = [pytest.mark.cluster, pytest.mark.slow]
VARIANTS = [
    pytest.param("sqlite_url", False, (1,), id="sqlite"),
    pytest.param("sqlite_url", False, (1, 1, 2, 3), id="sqlite-weighted", marks=pytest.mark.slow),
    pytest.param("redis_url", False, (1, 1, 2, 3), id="redis-weighted"),
    pytest.param("redis_url", False, (1,), id="redis", marks=pytest.mark.slow),
    pytest.param("cluster_url", True, (1,), id="cluster", marks=SLOW_CLUSTER),
    pytest.param("cluster_url", True, (1, 1, 2, 3), id="cluster-weighted", marks=SLOW_CLUSTER),
]


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A fresh database file for a SQLite variant, shared by the worker processes."""
    return f"sqlite:///{tmp_path / 'contention.db'}"


def make_plans(store: worker.StoreSpec, costs: tuple[int, ...]) -> list[worker.Plan]:
    kinds = [(False, (role,)) for role in SYNC_ROLES] + [(True, ASYNC_ROLES)] * ASYNC_PROCESSES
    return [
        worker.Plan(
            index=index,
            store=store,
            key="one-shared-token",
            rates=RATES,
            min_interval=MIN_INTERVAL,
            margin=MARGIN,
            duration=DURATION,
            asynchronous=asynchronous,
            roles=roles,
            costs=costs,
            seed=index + 1,
        )
        for index, (asynchronous, roles) in enumerate(kinds)
    ]


def run_workers(plans: list[worker.Plan]) -> list[worker.Report]:
    """Start one spawned process per plan, released together by a barrier; collect reports."""
    # A fork server that imported the worker module (and nothing that connects) forks each
    # worker: no Redis connection ever crosses a fork, and no process pays for the imports.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([worker.__name__])
    barrier = ctx.Barrier(len(plans))
    results = ctx.Queue()
    processes = [
        ctx.Process(target=worker.run, args=(plan, barrier, results), daemon=True) for plan in plans
    ]
    for process in processes:
        process.start()
    reports: list[worker.Report] = []
    give_up = time.monotonic() + 60 + DURATION  # spawn on a loaded machine, then the run
    try:
        while len(reports) < len(plans) and time.monotonic() < give_up:
            try:
                reports.append(results.get(timeout=0.5))
            except queue.Empty:
                if all(not p.is_alive() for p in processes) and results.empty():
                    break
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        results.close()
        results.join_thread()
    codes = [p.exitcode for p in processes]
    assert len(reports) == len(plans), f"{len(reports)}/{len(plans)} reports; exit codes {codes}"
    errors = [f"worker {r.index}:\n{r.error}" for r in reports if r.error]
    assert not errors, "\n".join(errors)
    return reports


def fullest_window(slots: list[int], prefix: list[int], period_us: int) -> tuple[int, int]:
    """The largest cost sum in any window ``(t - W, t]`` and a ``t`` where it occurs.

    A window's sum only grows when its right edge reaches a slot, so the windows
    that end exactly at each slot are the only ones to check.
    """
    best = (0, 0)
    for t in slots:
        inside = (
            prefix[bisect.bisect_right(slots, t)]
            - prefix[bisect.bisect_right(slots, t - period_us)]
        )
        best = max(best, (inside, t))
    return best


def best_schedule(
    costs: Iterable[int], start: int, rates: list[tuple[int, int]], gap: int
) -> Iterator[tuple[int, int]]:
    """(slot, cost) of the fastest schedule for calls of these costs, in this order, from ``start``
    (demand without end): each call at the earliest time that the gap and every window
    allow. No schedule of the same calls places its k-th call any earlier."""
    log: list[tuple[int, int]] = []
    for cost in costs:
        t = log[-1][0] + gap if log else start
        for limit, period in rates:
            inside = [(s, c) for s, c in log if s > t - period]
            used = sum(c for _, c in inside)
            for s, c in inside:  # oldest first: wait for each to leave the window
                if used + cost <= limit:
                    break
                used -= c
                t = max(t, s + period)
        log.append((t, cost))
        yield t, cost


@pytest.mark.parametrize(("url_fixture", "cluster", "costs"), VARIANTS)
def test_processes_share_one_key_exactly(
    request: pytest.FixtureRequest, url_fixture: str, cluster: bool, costs: tuple[int, ...]
) -> None:
    store = worker.StoreSpec(request.getfixturevalue(url_fixture), cluster=cluster)
    plans = make_plans(store, costs)
    reports = run_workers(plans)

    admitted = sorted((round(a.slot * US), a.cost) for report in reports for a in report.admitted)
    slots = [slot for slot, _ in admitted]
    prefix = [0, *itertools.accumulate(cost for _, cost in admitted)]
    rates = [(limit, Rate(limit, period).period_us) for limit, period in RATES]
    gap = round(MIN_INTERVAL * US)
    margin = round(MARGIN * US)
    widened = [(limit, period + margin) for limit, period in rates]
    refused = sum(sum(report.refused.values()) for report in reports)
    span = (slots[-1] - slots[0]) / US if slots else 0.0
    assert span > DURATION / 2, f"only {len(slots)} calls over {span:.2f}s"
    assert refused > 0, "demand never exceeded the quota"

    for limit, period in widened:  # the exact quota's windows, widened by the margin
        inside, at = fullest_window(slots, prefix, period)
        assert inside <= limit, (
            f"{inside} units in the window ({at - period}, {at}] of {limit}/{period / US:g}s"
        )
    closest = min((b - a, a) for a, b in itertools.pairwise(slots))
    assert closest[0] >= gap + margin, f"slots {closest[0]} us apart after {closest[1]}"

    # The best schedule of these same calls (then of more unit calls) from the first slot.
    demand = itertools.chain((cost for _, cost in admitted), itertools.repeat(1))
    best = best_schedule(demand, slots[0], widened, gap + margin)
    possible = sum(cost for _, cost in itertools.takewhile(lambda e: e[0] <= slots[-1], best))
    # By slot, a late wake-up's slot counts as used: it stays booked, unused.
    used = prefix[-1] + sum(a.late * a.cost for r in reports for a in r.admitted)
    used += sum(r.late_units for r in reports)
    by_role = collections.Counter(
        f"{'async' if plans[r.index].asynchronous else 'sync'}-{a.role}"
        for r in reports
        for a in r.admitted
    )
    summary = (
        f"{len(slots)} calls, {used} units over {span:.3f}s; best schedule {possible} units; "
        f"{refused} refusals; admitted by {dict(sorted(by_role.items()))}"
    )
    print(summary)
    # The store never admits more than the best schedule (late slots aside: where they
    # lie is not reported, and one may fall outside the span of the admitted ones).
    assert prefix[-1] <= possible, f"more than the best schedule allows: {summary}"
    assert used >= MIN_USE * possible, f"quota under-used: {summary}"
