"""A driver retry of an Acquire gets its booked slot back, on every store.

When the reply to an Acquire is lost (a dropped connection after the script ran), the
driver sends the same operation again, with the same call id. The contract
(``Acquire`` in ``throttle_client/_backends/base.py``) answers it with the slot the
call already holds, and books nothing more. The case that needs care is a retry that,
as a new call, would now be refused: its own booking pushed the next free slot past
its max wait. The Lua script has a branch of its own for it (the refusal branch looks
the call id up before refusing); ``sliding_log.acquire`` looks the id up before
anything else. Both must give the same answer, so the test runs on memory and SQLite
(``sliding_log.py``) and on a real Redis (the script).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from throttle_client import MemoryBackend, RedisBackend, SQLiteBackend, store_key
from throttle_client._backends.base import Acquire, Backend, Inspect, Pause, Quota

US = 1_000_000
NOW = 1_700_000_000 * US
# 1 per second and 5 per 10 seconds: the second rate's remaining count tells apart
# "remaining at the booked slot" (what a retry answers) from "remaining now".
QUOTA = Quota(limits=((1, US), (5, 10 * US)), min_interval_us=0)
KEY = store_key("EAAB-token-of-the-retried-call", namespace="idempotence")


@pytest.fixture(params=["memory", "sqlite", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    backend: Backend
    if request.param == "memory":
        backend = MemoryBackend()
    elif request.param == "sqlite":
        backend = SQLiteBackend(tmp_path / "limits.db")
    else:
        backend = RedisBackend(request.getfixturevalue("redis_url"))
    with backend:
        yield backend


def answer(verdict: Any) -> tuple[Any, ...]:
    return (
        verdict.allowed,
        verdict.now_us,
        verdict.slot_us,
        verdict.pause_until_us,
        verdict.remaining,
    )


def logged(store: Backend, now: int) -> tuple[tuple[int, ...], int]:
    """Units used per rate, and units booked ahead, as the store sees them at ``now``."""
    snapshot = store.execute(Inspect(key=KEY, quota=QUOTA, now_us=now))
    return snapshot.used, snapshot.booked


def test_a_retry_that_would_now_be_refused_gets_its_slot_now(store: Backend) -> None:
    call = Acquire(key=KEY, quota=QUOTA, cost=1, max_wait_us=US // 2, call_id="call-1", now_us=NOW)
    first = store.execute(call)
    assert answer(first) == (True, NOW, NOW, 0, (0, 4))
    # As a new call it would wait 1 s, past its max wait of 0.5 s: refused.
    new_call = store.execute(replace(call, call_id="call-2"))
    assert answer(new_call) == (False, NOW, NOW + US, 0, (0, 4))
    # The retry is not a new call: it keeps the slot it booked, and books nothing.
    assert answer(store.execute(replace(call, retry=True))) == answer(first)
    assert logged(store, NOW) == ((1, 1), 0)


def test_a_retry_that_would_now_be_refused_gets_its_slot_ahead(store: Backend) -> None:
    """The booked slot lies ahead, time has moved on, and a pause came meanwhile: the
    retry answers at its own time, with the booked slot and the pause now in force."""
    head = Acquire(key=KEY, quota=QUOTA, cost=1, max_wait_us=0, call_id="head", now_us=NOW)
    assert store.execute(head).allowed
    call = replace(head, max_wait_us=3 * US // 2, call_id="call-1")
    first = store.execute(call)
    assert answer(first) == (True, NOW, NOW + US, 0, (0, 3))
    pause_until = store.execute(Pause(key=KEY, quota=QUOTA, duration_us=US // 2, now_us=NOW))
    assert pause_until == NOW + US // 2

    later = NOW + US // 5
    retry = replace(call, now_us=later, retry=True)
    # As a new call it would wait until NOW + 2 s, 1.8 s away: past its max wait of 1.5 s.
    new_call = store.execute(replace(retry, call_id="call-2"))
    assert answer(new_call) == (False, later, NOW + 2 * US, pause_until, (0, 3))
    assert answer(store.execute(retry)) == (True, later, NOW + US, pause_until, (0, 3))
    assert logged(store, later) == ((1, 1), 1)  # head used, call-1 booked: nothing more
