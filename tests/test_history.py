"""Usage history: calls and cost per hour, day and month, local to a
zone, counted by the store in the step that books each call, the newest periods kept."""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
import sqlite3
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
import redis

from throttle_client import (
    Backend,
    ConfigurationError,
    History,
    Limiter,
    MemoryBackend,
    RedisBackend,
    SQLiteBackend,
)
from throttle_client._acquiring import acquire_op
from throttle_client._backends.base import Acquire
from throttle_client._backends.history import HistorySpec
from throttle_client._history import Offsets
from throttle_client.testing import FakeClock

TOKEN = "ghp_history_test_token_3c7a"
ACL_PAGE = Path(__file__).resolve().parent.parent / "docs" / "operations" / "acl.md"
LA = "America/Los_Angeles"


@pytest.fixture
def store(every_store: Backend) -> Backend:
    return every_store


def reference(calls: list[tuple[float, int]], zone: str) -> dict[str, Counter[dt.datetime]]:
    """Calls and cost per local hour, day and month, with zoneinfo (not the store's
    arithmetic): (slot in epoch seconds, cost) -> grain -> start -> [calls, cost]."""
    tz = ZoneInfo(zone)
    counts: dict[str, Counter[dt.datetime]] = {g: Counter() for g in ("hc", "hu", "dc", "du")}
    counts |= {"mc": Counter(), "mu": Counter()}
    for slot, cost in calls:
        local = dt.datetime.fromtimestamp(slot, tz).replace(tzinfo=None)
        starts = {
            "h": local.replace(minute=0, second=0, microsecond=0),
            "d": local.replace(hour=0, minute=0, second=0, microsecond=0),
            "m": local.replace(day=1, hour=0, minute=0, second=0, microsecond=0),
        }
        for grain, start in starts.items():
            counts[grain + "c"][start] += 1
            counts[grain + "u"][start] += cost
    return counts


def test_every_store_counts_local_hours_days_and_months_alike(store: Backend) -> None:
    """Calls every 3.7 hours across a month's end and Los Angeles' spring DST change
    (2026-03-08 02:00 local): each store counts what zoneinfo says, and keeps the
    newest 48 hours, 62 days and 24 months."""
    clock = FakeClock(dt.datetime(2026, 2, 27, 20, 0, tzinfo=dt.timezone.utc).timestamp())
    limiter = Limiter(
        store, rates="1000/second", clock=clock, history=History(zone=LA), namespace="h"
    )
    calls = []
    for step in range(80):
        cost = (1, 2, 5)[step % 3]
        decision = limiter.try_acquire(TOKEN, cost=cost)
        assert decision.allowed
        calls.append((decision.slot, cost))
        clock.advance(3.7 * 3600)
    used = limiter.history(TOKEN)
    want = reference(calls, LA)
    tz = ZoneInfo(LA)

    def seen(periods: tuple) -> dict[dt.datetime, tuple[int, int]]:
        assert all(p.start.tzinfo == tz for p in periods)
        return {p.start.replace(tzinfo=None): (p.calls, p.cost) for p in periods}

    for grain, periods in (("d", used.days), ("m", used.months)):
        assert seen(periods) == {
            start: (n, want[grain + "u"][start]) for start, n in want[grain + "c"].items()
        }, grain
    # The newest 48 hours (by local hour): of the 80 calls 3.7 h apart, the last 13.
    hours = seen(used.hours)
    newest = max(want["hc"])
    assert hours == {
        start: (n, want["hu"][start])
        for start, n in want["hc"].items()
        if start > newest - dt.timedelta(hours=48)
    }
    assert len(hours) == 13 and len(seen(used.days)) == 13 and len(seen(used.months)) == 2
    assert used.zone == LA


def test_a_retried_call_is_counted_once(store: Backend) -> None:
    limiter = Limiter(store, rates="10/second", clock=FakeClock(), namespace="r", history=True)
    op = acquire_op(limiter, TOKEN, 1, 0, limiter._local())
    assert isinstance(op, Acquire) and op.history
    first = store.execute(op)
    again = store.execute(replace(op, retry=True))  # same call id: found, not booked
    assert first.allowed and again.slot_us == first.slot_us
    assert [p.calls for p in limiter.history(TOKEN).hours] == [1]


def test_a_stacked_call_counts_in_each_keys_history(store: Backend) -> None:
    clock = FakeClock()
    token = Limiter(
        store, rates="10/second", namespace="tok", tag=lambda _: "a1", clock=clock, history=True
    )
    account = Limiter(
        store, rates="99/second", namespace="acct", tag=lambda _: "a1", clock=clock, history=True
    )
    quiet = Limiter(store, rates="50/second", namespace="q", clock=clock)  # the default: none
    for _ in range(3):
        assert token.try_acquire(TOKEN, also=[(account, "acct-1", 2)]).allowed
    assert quiet.try_acquire(TOKEN).allowed
    assert [(p.calls, p.cost) for p in token.history(TOKEN).days] == [(3, 3)]
    assert [(p.calls, p.cost) for p in account.history("acct-1").days] == [(3, 6)]
    assert quiet.history(TOKEN).days == ()  # nothing counted
    token.reset(TOKEN)
    assert token.history(TOKEN).days == ()  # a reset forgets it too


def test_refusals_are_not_counted(store: Backend) -> None:
    limiter = Limiter(store, rates="2/second", clock=FakeClock(), namespace="x", history=True)
    assert [limiter.try_acquire(TOKEN).allowed for _ in range(4)] == [True, True, False, False]
    assert [(p.calls, p.cost) for p in limiter.history(TOKEN).months] == [(2, 2)]


def test_redis_keeps_the_history_beside_the_key_bounded(redis_url: str) -> None:
    clock = FakeClock()
    limiter = Limiter(
        RedisBackend(redis_url), rates="100/second", clock=clock, history=History(hours=3)
    )
    for _ in range(10):
        limiter.try_acquire(TOKEN)
        clock.advance(3600)
    client = redis.Redis.from_url(redis_url)
    key = f"tc:{limiter.store_key(TOKEN)}:history"
    fields = {k.decode(): int(v) for k, v in client.hgetall(key).items()}
    # 3 hours, 1 day (10 hours from 1700000000 = 22:13 UTC cross a midnight: 2 days), 1
    # month, and the offset counted at (UTC: 0). No cost fields: every call cost 1.
    assert sorted(k[0] for k in fields) == ["d", "d", "h", "h", "h", "m", "o"]
    assert fields["o"] == 0
    ttl = client.pttl(key)
    assert 24 * 31 * 86_400_000 - 60_000 < ttl <= 24 * 31 * 86_400_000  # the longest kept
    client.close()


def test_a_reader_without_the_zone_places_periods_at_the_offset_counted(tmp_path: Path) -> None:
    store = SQLiteBackend(tmp_path / "limits.db")
    limiter = Limiter(store, rates="100/second", history=History(zone="Asia/Kolkata"))
    assert limiter.try_acquire(TOKEN).allowed
    reader = Limiter(store, rates="1/second", history=False)
    (hour,) = reader.history(TOKEN).hours
    assert reader.history(TOKEN).zone == "UTC+05:30"
    (own,) = limiter.history(TOKEN).hours
    assert hour.start == own.start  # the same moment, told in two ways
    store.close()


def test_the_history_command(tmp_path: Path) -> None:
    path = tmp_path / "limits.db"
    store = SQLiteBackend(path)
    # A key's card (its label) lasts 1.6 of its windows past its last call: a minute's
    # window outlasts the two commands below, however slowly a busy machine starts them.
    limiter = Limiter(
        store, rates="100/minute", namespace="crawl", label=lambda k: "acct 9", history=History()
    )
    for cost in (1, 4):
        limiter.try_acquire(TOKEN, cost=cost)
    command = [sys.executable, "-m", "throttle_client", "history", "--sqlite", str(path)]
    command += ["--namespace", "crawl"]
    as_json = subprocess.run([*command, "--json", TOKEN], capture_output=True, text=True)
    text = subprocess.run([*command, TOKEN], capture_output=True, text=True)
    store.close()
    assert as_json.returncode == 0, as_json.stderr
    (entry,) = json.loads(as_json.stdout)["keys"]
    assert (entry["label"], entry["zone"]) == ("acct 9", "UTC")
    assert [(p["calls"], p["cost"]) for p in entry["days"]] == [(2, 5)]
    assert TOKEN not in as_json.stdout + text.stdout
    lines = text.stdout.splitlines()
    assert lines[0].endswith("label 'acct 9'), in UTC")
    assert lines[1].endswith("2 calls, cost 5") and len(lines) == 4


@pytest.mark.parametrize(
    ("history", "message"),
    [
        (History, "hours"),
        ("yes", "history must be a History"),
    ],
)
def test_bad_history_settings_are_refused(history: object, message: str) -> None:
    with pytest.raises((ConfigurationError, TypeError), match=message):
        if history is History:
            History(hours=0)
        else:
            Limiter(MemoryBackend(), rates="1/second", history=history)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="unknown time zone 'Mars/Olympus'"):
        History(zone="Mars/Olympus")


def test_spec_names_the_offset_in_force() -> None:
    limiter = Limiter(MemoryBackend(), rates="1/second", history=History(zone=LA))
    winter = dt.datetime(2026, 1, 15, 12, tzinfo=dt.timezone.utc).timestamp()
    summer = dt.datetime(2026, 7, 15, 12, tzinfo=dt.timezone.utc).timestamp()
    hour = 3_600_000_000
    assert limiter._plan._offsets.at(round(winter * 1e6)) == -8 * hour
    assert limiter._plan._offsets.at(round(summer * 1e6)) == -7 * hour
    assert isinstance(limiter._plan.history_of("k")[0], HistorySpec)


def test_an_offset_that_changes_on_a_half_hour_is_seen_at_once() -> None:
    """Adelaide leaves summer time at 16:30 UTC (2025-04-05): asked at 16:10 and again at
    16:40, the offset is +10:30 then +9:30 (not kept for the UTC hour)."""
    offsets = Offsets("Australia/Adelaide")
    at = dt.datetime(2025, 4, 5, 16, 10, tzinfo=dt.timezone.utc).timestamp()
    hour = 3_600_000_000
    assert offsets.at(round(at * 1e6)) == 10.5 * hour
    assert offsets.at(round((at + 30 * 60) * 1e6)) == 9.5 * hour


def test_a_damaged_sqlite_history_starts_again_and_fails_no_call(tmp_path: Path) -> None:
    store = SQLiteBackend(tmp_path / "limits.db")
    limiter = Limiter(store, rates="10/second", history=True)
    assert limiter.try_acquire(TOKEN).allowed
    store._connection().db.execute('UPDATE tc_history SET fields = \'{"hx": 1, "h1": 2}\'')
    assert limiter.try_acquire(TOKEN).allowed  # no error: the odd field is left out
    assert [p.calls for p in limiter.history(TOKEN).days] == [1]
    store.close()


def test_a_history_it_cannot_prune_still_expires(redis_url: str) -> None:
    """A user whose ACL allows HINCRBY but not HKEYS: the hash still gets its TTL."""
    admin = redis.Redis.from_url(redis_url)
    line = re.search(r"^ACL SETUSER .+$", ACL_PAGE.read_text(), re.MULTILINE)
    assert line is not None
    words = [w for w in line.group(0).split()[2:] if w != "+hkeys"]
    user, rules = words[0], [">pw" if w.startswith(">") else w for w in words[1:]]
    admin.execute_command("ACL", "SETUSER", user, "reset", *rules)
    try:
        url = redis_url.replace("redis://", f"redis://{user}:pw@")
        limiter = Limiter(RedisBackend(url), rates="10/second", history=True)
        assert limiter.try_acquire(TOKEN).allowed  # the booking stands
        assert admin.pttl(f"tc:{limiter.store_key(TOKEN)}:history") > 0
        limiter.backend.close()  # type: ignore[attr-defined]
    finally:
        admin.execute_command("ACL", "DELUSER", user)
        admin.close()


# Fields no store writes, each with what it holds: a count that is no number, a name with
# a space or a line break (a reply's separators), a month past year 9999, an hour past
# what a date holds, a negative count, an offset no zone has, cost beyond one per call
# that is no number.
JUNK = {
    "h123": "abc",
    "a b": "1",
    "d1\n2": "1",
    "m999999": "1",
    "h99999999999999999999": "1",
    "d5": "-3",
    "o": "x",
    "H7": "x",
}


@pytest.mark.parametrize("kind", ["redis", "sqlite"])
def test_junk_in_a_usage_history_is_left_out_with_one_warning(
    kind: str, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    """A hand in the store wrote fields into a key's history: history() shows the periods
    the limiters counted, and says once, naming the store key, how many fields it left
    out (it raised a bare ValueError or OverflowError, or dropped the whole history)."""
    store: Backend
    if kind == "redis":
        url = request.getfixturevalue("redis_url")
        store = RedisBackend(url)
    else:
        path = request.getfixturevalue("tmp_path") / "limits.db"
        store = SQLiteBackend(path)
    limiter = Limiter(store, rates="10/second", clock=FakeClock(), history=History(zone="UTC"))
    for cost in (1, 3):
        assert limiter.try_acquire(TOKEN, cost=cost).allowed
    key = limiter.store_key(TOKEN)
    if kind == "redis":
        client = redis.Redis.from_url(url)
        client.hset(f"tc:{key}:history", mapping=JUNK)
        client.close()
    else:
        db = sqlite3.connect(path, isolation_level=None)
        fields = json.loads(db.execute("SELECT fields FROM tc_history").fetchone()[0])
        fields |= {name: int(n) if n.lstrip("-").isdigit() else n for name, n in JUNK.items()}
        db.execute("UPDATE tc_history SET fields = ?", (json.dumps(fields),))
        db.close()
    with caplog.at_level(logging.WARNING, logger="throttle_client"):
        used = limiter.history(TOKEN)
    assert [(p.calls, p.cost) for p in (*used.hours, *used.days, *used.months)] == [(2, 4)] * 3
    [warning] = [r.getMessage() for r in caplog.records if r.name == "throttle_client"]
    assert f"store key {key}: {len(JUNK)} field(s)" in warning and TOKEN not in warning
    store.close()
