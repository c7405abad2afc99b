"""Concurrency caps on the SQLite store, across real processes sharing one file.

The algorithm is ``leases``'s, written once; what is the SQLite store's own is that
several processes keep one cap between them, that a waiter in one process is woken
when another process grants it its lease, and that a holder killed with ``kill -9``
lets its lease go within its TTL.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sqlite3
import threading
import time
from contextlib import closing
from pathlib import Path
from typing import Any

from throttle_client import Limiter, SQLiteBackend
from throttle_client._acquiring import charges
from throttle_client._backends.base import AcquireAll

KEY = "tok_live_8f3a9c2e51d04b7e"
SPAWN = multiprocessing.get_context("spawn")


def capped(path: Path, lease_ttl: float = 2, max_concurrent: int = 2) -> Limiter:
    return Limiter(
        SQLiteBackend(path),
        rates=["1000/second"],
        max_concurrent=max_concurrent,
        lease_ttl=lease_ttl,
    )


def rows(path: Path, table: str, what: str = "count(*)") -> Any:
    with closing(sqlite3.connect(path)) as db:
        found = db.execute(f"SELECT {what} FROM {table}").fetchall()
    return found[0][0] if what == "count(*)" else found


def until(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _hold_in_turns(path: Path, go: Any, out: Any) -> None:
    """Three threads each take 15 leases in turn; the held intervals go to ``out``."""
    limiter = capped(path)
    intervals: list[tuple[float, float]] = []

    def work() -> None:
        for _ in range(15):
            with limiter.lease(KEY):
                entered = time.time()  # after __enter__: within the held interval
                time.sleep(0.003)
                intervals.append((entered, time.time()))  # before __exit__: within it too

    threads = [threading.Thread(target=work) for _ in range(3)]
    out.put("ready")
    go.wait(30)
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out.put(intervals)


def test_the_cap_holds_across_processes(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    SQLiteBackend(path).close()  # the file and its tables, before the children race for it
    go, out = SPAWN.Event(), SPAWN.Queue()
    children = [SPAWN.Process(target=_hold_in_turns, args=(path, go, out)) for _ in range(2)]
    for child in children:
        child.start()
    assert [out.get(timeout=30) for _ in children] == ["ready", "ready"]
    go.set()
    intervals = [interval for _ in children for interval in out.get(timeout=30)]
    for child in children:
        child.join(timeout=30)
        assert child.exitcode == 0
    assert len(intervals) == 90
    # Each recorded interval lies within a held lease: more than two of them overlapping
    # would be more than two leases held at once.
    events = sorted([(t, 1) for t, _ in intervals] + [(t, -1) for _, t in intervals])
    overlap = peak = 0
    for _, step in events:  # at equal times an exit (-1) sorts first: no false overlap
        overlap += step
        peak = max(peak, overlap)
    assert peak == 2
    assert rows(path, "tc_holders") == rows(path, "tc_tickets") == 0


def _wait_for_a_lease(path: Path, out: Any) -> None:
    with capped(path, lease_ttl=10, max_concurrent=1).lease(KEY):
        out.put(time.time())


def test_a_waiter_in_another_process_is_woken_promptly(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    limiter = capped(path, lease_ttl=10, max_concurrent=1)
    out = SPAWN.Queue()
    with limiter.lease(KEY):
        child = SPAWN.Process(target=_wait_for_a_lease, args=(path, out))
        child.start()
        until(lambda: rows(path, "tc_tickets") == 1)  # the child is queued
        released = time.time()
    admitted = out.get(timeout=10)
    child.join(timeout=10)
    assert child.exitcode == 0
    # Unprompted, the child would look again only every lease_ttl / 3 = 3.3 s.
    assert admitted - released < 0.2


def _hold_until_killed(path: Path, out: Any) -> None:
    with capped(path, lease_ttl=1, max_concurrent=1).lease(KEY):
        out.put("held")
        time.sleep(60)


def test_a_killed_holder_lets_its_lease_go(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    limiter = capped(path, lease_ttl=1, max_concurrent=1)
    out = SPAWN.Queue()
    child = SPAWN.Process(target=_hold_until_killed, args=(path, out))
    child.start()
    assert out.get(timeout=30) == "held"
    assert child.pid is not None
    os.kill(child.pid, signal.SIGKILL)
    child.join(timeout=10)
    killed = time.monotonic()
    with limiter.lease(KEY, timeout=5):
        waited = time.monotonic() - killed
    # Renewed every third of its TTL, the dead lease had from 2/3 s to 1 s left.
    assert 0.3 < waited < 1.5
    assert rows(path, "tc_holders") == 0


def test_reset_forgets_the_holders_and_the_queue(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    limiter = capped(path, lease_ttl=30, max_concurrent=1)  # no renewal in the test
    store_key = limiter.store_key(KEY)
    with limiter.lease(KEY):
        queued = limiter.backend.execute(
            AcquireAll(
                charges(limiter, KEY, 1, (), 0.0), 10_000_000, "call", lease_id="elsewhere.call"
            )
        )
        assert queued.waiting
        assert rows(path, "tc_holders") == rows(path, "tc_tickets") == 1
        limiter.reset(KEY)
        assert rows(path, "tc_holders") == rows(path, "tc_tickets") == 0
        with limiter.lease(KEY, timeout=0):  # the cap has room again at once
            assert rows(path, "tc_holders", "key") == [(store_key,)]
