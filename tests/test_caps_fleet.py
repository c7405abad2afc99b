"""Concurrency caps across a fleet of processes, judged by an upstream outside the limiter.

Worker processes send requests through ``ThrottledClient`` on capped limiters that share
a Redis store (standalone or Cluster); ``InflightUpstream`` counts what is really in
flight per token and per account, and answers 429 to any request beyond a cap. The
limiter must never let a cap be crossed, must keep it full while callers wait, and must
free the slot of a holder killed with ``kill -9`` within its lease TTL.

Real time, real processes, real sockets.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from typing import Any

import pytest

from tests.inflight_upstream import InflightUpstream
from tests.workers import start_together
from throttle_client import Limiter, RedisBackend, RetryPolicy, ThrottledClient, ThrottleTimeout

# The second tier (pytest -m slow): see pyproject.toml.
pytestmark = pytest.mark.slow

WORKERS = 8
DURATION = 3.0  # seconds of demand
# Seconds the upstream takes over each request: an API call's, not a ping's. Each hand-off
# of a slot leaves it empty for a few ms (the holder's response read and closed, its
# release, the waiter woken and its request sent: ~3 ms with 2 CPUs shared by 8 worker
# processes), so the cap is full 1 - cap * 3 ms / HANDLING of the time: 97 % at 0.5 s,
# 94 % at 0.2 s, 55 % at 0.02 s. At 1 s, ~98 %: far
# enough from 95 % that a loaded machine does not fail the test for its own slowness.
HANDLING = 1.0
RATES = ["100000/second"]  # never binds: the caps do
# Stacked (test C): each token and the account under a rate too, and the account's the
# smaller of what its tokens could send together (4 x 12 > 30): both bind.
TOKEN_RATE, ACCOUNT_RATE = 12, 30
# How late after its slot an arrival of test C may reach the upstream: the limiters'
# margin, and what the judge forgives. Sixteen threads in eight processes on a machine
# of two cores (the upstream's threads beside them) reach it up to ~50 ms late now and
# then; the default margin, 25 ms, promises less than that, and a judge at 40 ms saw 31
# and 32 arrivals in a window of 30.
TOLERANCE = 0.1

# Workers come from a fork server that has imported httpx, redis and this library once
# (a clean single-threaded process: the parent runs the upstream's threads).
SPAWN = multiprocessing.get_context("forkserver")
SPAWN.set_forkserver_preload([__name__])


def backend(url: str, kind: str) -> RedisBackend:
    return RedisBackend(url, cluster=kind == "cluster")


def _fleet_worker(
    url: str,
    kind: str,
    upstream_url: str,
    tokens: list[str],
    stacked: bool,
    threads: int,
    start: Any,
    results: Any,
) -> None:
    """One process: ``threads`` threads, thread i on ``tokens[i]``, sending requests in a
    loop until the common deadline; reports its statuses (and any error)."""
    tag = (lambda key: "acct-1") if stacked and kind == "cluster" else None
    cap = 2 if stacked else 4
    store = backend(url, kind)  # one for both limiters: one atomic step books them all
    margin: dict[str, float] = {"margin": TOLERANCE} if stacked else {}
    limiter = Limiter(
        store,
        rates=[f"{TOKEN_RATE}/second"] if stacked else RATES,
        max_concurrent=cap,
        lease_ttl=5,
        namespace="fleet",
        tag=tag,
        **margin,
    )
    also: list[Any] = []
    if stacked:
        account = Limiter(
            store,
            rates=[f"{ACCOUNT_RATE}/second"],
            max_concurrent=3,
            lease_ttl=5,
            namespace="fleet-account",
            tag=tag,
            **margin,
        )
        also = [(account, lambda request: "acct-1")]
    statuses: list[int] = []
    errors: list[str] = []
    lock = threading.Lock()
    # No retries: a 429 must show in the statuses, not be hidden by a second attempt.
    client = ThrottledClient(
        limiter, also=also, base_url=upstream_url, retry=RetryPolicy(max_attempts=1), timeout=30
    )

    def loop(token: str, deadline: float) -> None:
        headers = {"Authorization": f"Bearer {token}", "X-Account": "acct-1"}
        try:
            while time.monotonic() < deadline:
                response = client.get("/work", headers=headers)
                with lock:
                    statuses.append(response.status_code)
        except Exception as exc:  # reported to the parent, which fails the test
            with lock:
                errors.append(repr(exc))

    start.wait(60)
    deadline = time.monotonic() + DURATION
    pool = [threading.Thread(target=loop, args=(token, deadline)) for token in tokens]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    client.close()
    results.put((statuses, errors))


def run_fleet(
    url: str, kind: str, upstream: InflightUpstream, tokens_of: list[list[str]], stacked: bool
) -> list[int]:
    """Starts the workers together; returns every status they saw."""
    start = SPAWN.Barrier(len(tokens_of) + 1)
    results = SPAWN.Queue()
    workers = [
        SPAWN.Process(
            target=_fleet_worker,
            args=(url, kind, upstream.url, tokens, stacked, len(tokens), start, results),
        )
        for tokens in tokens_of
    ]
    reports = start_together(workers, start, results)
    errors = [error for _, worker_errors in reports for error in worker_errors]
    assert not errors, errors
    return [status for statuses, _ in reports for status in statuses]


@pytest.mark.parametrize("kind", ["redis", "cluster"])
def test_a_fleet_keeps_the_cap_full_and_never_crosses_it(
    kind: str, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue("redis_url" if kind == "redis" else "cluster_url")
    cap = 4
    with InflightUpstream(token_cap=cap, handling=HANDLING) as upstream:
        statuses = run_fleet(url, kind, upstream, [["fleet-token"] * 2] * WORKERS, False)
        occupancy = upstream.occupancy("token:fleet-token", cap)
        peak = upstream.peak("token:fleet-token")
        served, refused = upstream.served, upstream.refused

    print(
        f"\n[{kind}] served {served}, refused {refused}, max in flight {peak}/{cap}, "
        f"time at cap {occupancy.utilisation():.1%} of {occupancy.span:.2f} s, "
        f"mean in flight {occupancy.mean:.2f} ({occupancy.mean / cap:.1%} of the cap), "
        f"ideal {occupancy.span * cap / HANDLING:.0f} requests"
    )
    assert refused == 0
    assert set(statuses) == {200} and len(statuses) == served
    assert peak == cap
    # Full: on average at least 95 % of the cap in flight. (The share of time at the very
    # cap also counts each handover, a store step, as time below it: on a busy machine
    # that alone took it to 94.5 % while the mean stood at 98 %.)
    assert occupancy.mean / cap >= 0.95


def _hold_forever(url: str, kind: str, holding: Any) -> None:
    limiter = Limiter(
        backend(url, kind), rates=RATES, max_concurrent=1, lease_ttl=1, namespace="kill"
    )
    with limiter.lease("tok"):
        holding.set()
        while True:
            time.sleep(60)


@pytest.mark.parametrize("kind", ["redis", "cluster"])
def test_b_a_holder_killed_with_kill_9_frees_its_slot_within_its_ttl(
    kind: str, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue("redis_url" if kind == "redis" else "cluster_url")
    holding = SPAWN.Event()
    child = SPAWN.Process(target=_hold_forever, args=(url, kind, holding))
    child.start()
    try:
        assert holding.wait(30), "the child never got its lease"
        limiter = Limiter(
            backend(url, kind), rates=RATES, max_concurrent=1, lease_ttl=1, namespace="kill"
        )
        with pytest.raises(ThrottleTimeout), limiter.lease("tok", timeout=0):
            pass  # the slot is really held: no room at once
        assert child.pid is not None
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        killed = time.monotonic()
        with limiter.lease("tok", timeout=5):
            freed = time.monotonic() - killed
    finally:
        if child.is_alive():
            child.kill()
            child.join(10)

    print(f"\n[{kind}] kill -9 of the holder: slot admitted {freed:.3f} s later (lease_ttl 1 s)")
    assert child.exitcode == -signal.SIGKILL
    assert 0 < freed < 1 + 0.5


@pytest.mark.parametrize("kind", ["redis", "cluster"])
def test_c_stacked_caps_of_tokens_and_their_account_hold_at_the_upstream(
    kind: str, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue("redis_url" if kind == "redis" else "cluster_url")
    tokens = [f"tok-{i}" for i in range(4)]
    # 8 processes, 2 threads each: every token has 4 threads, the account 16.
    tokens_of = [[tokens[(2 * w) % 4], tokens[(2 * w + 1) % 4]] for w in range(WORKERS)]
    with InflightUpstream(token_cap=2, account_cap=3, handling=0.05) as upstream:
        statuses = run_fleet(url, kind, upstream, tokens_of, True)
        account_peak = upstream.peak("account:acct-1")
        token_peaks = {token: upstream.peak(f"token:{token}") for token in tokens}
        occupancy = upstream.occupancy("account:acct-1", 3)
        served, refused = upstream.served, upstream.refused
        busiest = {
            key: upstream.most_in_any_window(key, 1.0 - TOLERANCE)
            for key in ["account:acct-1", *(f"token:{token}" for token in tokens)]
        }

    print(
        f"\n[{kind}] served {served}, refused {refused}, account max in flight "
        f"{account_peak}/3, token max {token_peaks} (cap 2), account at cap "
        f"{occupancy.utilisation():.1%} of {occupancy.span:.2f} s, mean {occupancy.mean:.2f}"
    )
    assert refused == 0
    assert set(statuses) == {200} and len(statuses) == served
    assert account_peak == 3
    assert all(1 <= peak <= 2 for peak in token_peaks.values())
    # The rates, judged by arrival at the upstream: the account's binds, and neither it
    # nor any token's is ever exceeded in any 1 s window.
    print(f"[{kind}] most arrivals in any 1 s window: {busiest}")
    assert busiest.pop("account:acct-1") == ACCOUNT_RATE
    assert all(0 < most <= TOKEN_RATE for most in busiest.values())
