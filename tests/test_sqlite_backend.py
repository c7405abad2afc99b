"""What only the SQLite store has to get right: its file, its connections, its indexes.

The semantics themselves are held by the conformance suite, which runs over SQLite
through ``make_limiter``; the multi-process contention test holds it under load.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import pickle
import shutil
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from throttle_client import (
    AsyncLimiter,
    BackendError,
    BackendUnavailable,
    ConfigurationError,
    Limiter,
    MemoryBackend,
    Rate,
    SQLiteBackend,
    ThrottleTimeout,
)
from throttle_client._backends import sqlite as _sqlite
from throttle_client._backends import sqlite_schema
from throttle_client.testing import FakeClock

TOKEN = "tok_live_8f3a9c2e51d04b7e"
US = 1_000_000


def limiter_on(path: Path, clock: FakeClock, **kwargs: object) -> Limiter:
    return Limiter(SQLiteBackend(path), margin=0, clock=clock, sleep=clock.sleep, **kwargs)  # type: ignore[arg-type]


def test_every_lookup_is_an_index_search(tmp_path: Path) -> None:
    """O(log n) per lookup: SQLite must search an index, never scan or sort a table."""
    db = SQLiteBackend(tmp_path / "l.db")._connection().db
    for sql in sqlite_schema.LOOKUPS:
        args = (1,) * sql.count("?")
        plan = " | ".join(row[3] for row in db.execute("EXPLAIN QUERY PLAN " + sql, args))
        assert "SEARCH" in plan and "SCAN" not in plan and "TEMP B-TREE" not in plan, (sql, plan)


def test_old_rows_are_pruned(tmp_path: Path) -> None:
    clock = FakeClock()
    limiter = limiter_on(tmp_path / "l.db", clock, rates=["5/second"])
    for _ in range(200):
        limiter.acquire(TOKEN)
    db = sqlite3.connect(tmp_path / "l.db")
    # Only what the one-second window can still see is kept (plus the newest trimmed run).
    assert db.execute("SELECT count(*) FROM tc_entries").fetchone()[0] <= 10
    assert limiter.usage(TOKEN).rates[0].used == 5


def keys_in(backend: SQLiteBackend) -> int:
    with sqlite3.connect(backend.path) as db:
        return int(db.execute("SELECT count(*) FROM tc_meta").fetchone()[0])


def test_expired_keys_are_forgotten(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_sqlite, "_SWEEP_EVERY", 10)
    clock = FakeClock()
    backend = SQLiteBackend(tmp_path / "l.db")
    limiter = Limiter(backend, margin=0, rates=["5/second"], clock=clock, sleep=clock.sleep)
    for n in range(8):
        limiter.try_acquire(f"idle-{n}")
    assert keys_in(backend) == 8
    clock.advance(2.5)  # every log has left its window, and the second stores keep it
    for _ in range(5):
        limiter.usage("busy")  # reads neither write nor sweep
    assert keys_in(backend) == 8
    limiter.try_acquire("busy")
    limiter.try_acquire("busy")
    assert keys_in(backend) == 9  # (the first write swept, when nothing had expired)
    limiter.try_acquire("busy")  # the 11th write on this connection sweeps again
    assert keys_in(backend) == 1
    db = sqlite3.connect(tmp_path / "l.db")
    assert db.execute("SELECT count(*) FROM tc_entries").fetchone()[0] == 3


def rows_in(path: Path) -> int:
    """Rows of every table that holds something per key."""
    tables = ("tc_meta", "tc_entries", "tc_cards", "tc_pushback", "tc_history", "tc_learned")
    with sqlite3.connect(path) as db:
        return sum(db.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in tables)


def test_a_churn_of_jobs_holds_only_the_keys_in_use(tmp_path: Path) -> None:
    """Rounds of short jobs, each opening the file for a few calls on a fresh key of its
    own (a key per job) through a limiter of the defaults: the file holds the round's
    keys, the same every round, not every key it ever saw (a sweep every 1024 writes of
    one connection never came; a usage history kept by default held each key for two
    years)."""
    clock = FakeClock()
    path = tmp_path / "l.db"
    sizes = []
    for round_ in range(4):
        for n in range(60):
            with SQLiteBackend(path) as backend:
                limiter = Limiter(backend, rates="5/second", clock=clock, sleep=clock.sleep)
                for _ in range(3):
                    assert limiter.try_acquire(f"job-{round_}-{n}").allowed
        sizes.append(rows_in(path))
        clock.advance(3)  # past every key's horizon and the second kept after it, and its card's
    assert sizes == [60 * (1 + 3 + 1)] * 4  # each job's key: its meta, 3 entries, its card


def test_an_expired_key_starts_afresh_when_used(tmp_path: Path) -> None:
    clock = FakeClock()
    limiter = limiter_on(tmp_path / "l.db", clock, rates=["2/second"], min_interval=0.1)
    limiter.pause(TOKEN, 5)
    assert not limiter.try_acquire(TOKEN)
    clock.advance(6.01)
    assert limiter.try_acquire(TOKEN) and limiter.try_acquire(TOKEN, 1).retry_after == 0.1


def test_usage_reads_without_waiting_for_the_write_lock(tmp_path: Path) -> None:
    clock = FakeClock()
    limiter = Limiter(
        SQLiteBackend(tmp_path / "l.db", busy_timeout=0.05),
        margin=0,
        rates=["2/second"],
        clock=clock,
    )
    limiter.try_acquire(TOKEN)
    limiter.pause("paused", 2)
    clock.advance(3.5)  # "paused" has expired: a read sees it gone without deleting it
    blocker = sqlite3.connect(tmp_path / "l.db", isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        assert limiter.usage("paused").paused_until is None
        assert limiter.usage(TOKEN).rates[0].used == 0
        with pytest.raises(BackendUnavailable):
            limiter.try_acquire(TOKEN)
    finally:
        blocker.execute("ROLLBACK")
    assert blocker.execute("SELECT count(*) FROM tc_meta").fetchone()[0] == 2


def test_a_token_never_reaches_the_file(tmp_path: Path) -> None:
    clock = FakeClock()
    limiter = limiter_on(tmp_path / "l.db", clock, rates=["2/second"])
    limiter.acquire(TOKEN)
    limiter.pause(TOKEN, 1)
    SQLiteBackend(tmp_path / "l.db").close()
    data = b"".join(p.read_bytes() for p in tmp_path.iterdir())
    assert TOKEN.encode() not in data and b"tc_entries" in data


def test_two_backends_on_one_file_share_the_log(tmp_path: Path) -> None:
    clock = FakeClock()
    first = limiter_on(tmp_path / "l.db", clock, rates=["2/second"])
    second = limiter_on(tmp_path / "l.db", clock, rates=["2/second"])
    assert first.try_acquire(TOKEN) and second.try_acquire(TOKEN)
    assert first.try_acquire(TOKEN).retry_after == 1.0
    second.reset(TOKEN)
    assert first.try_acquire(TOKEN)


def test_host_clock_is_used_without_an_injected_one(tmp_path: Path) -> None:
    slept: list[float] = []
    limiter = Limiter(
        SQLiteBackend(tmp_path / "l.db"),
        margin=0,
        rates=["100/second"],
        min_interval=30,
        sleep=slept.append,
    )
    before = time.time()
    first = limiter.acquire(TOKEN)
    between = time.time()
    second = limiter.acquire(TOKEN)
    after = time.time()
    # The store read the host's clock while each call ran (1 µs: it keeps whole µs).
    assert before - 1e-6 <= first.slot <= between
    assert second.slot - first.slot == pytest.approx(30)
    # It wakes on the store's clock, never before the slot: the sleep, asked for by
    # ``after``, reaches the slot; and a few ms after it at most (what is known of the
    # host's clock beside its own, aged over the 30 s sleep), counted from ``between``,
    # before the store read its clock. Bounds from the host's clock, not a tolerance
    # around 30 s: a loaded machine that delays the calls moves them with it.
    assert len(slept) == 1
    assert second.slot - after <= slept[0] <= second.slot - between + 0.05


def test_threads_get_distinct_spaced_slots(tmp_path: Path) -> None:
    backend = SQLiteBackend(tmp_path / "l.db")
    limiter = Limiter(
        backend, margin=0, rates=["1000/second"], min_interval=0.5, sleep=lambda s: None
    )
    slots: list[float] = []

    def worker() -> None:
        for _ in range(10):
            slots.append(limiter.acquire(TOKEN).slot)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    slots.sort()
    assert len(slots) == 80
    assert all(b - a >= 0.5 - 1e-6 for a, b in pairwise(slots))
    assert len(backend._all) == 8 + 1  # one connection per thread, plus the constructor's


def _book_in_child(backend: SQLiteBackend, queue: multiprocessing.Queue[float]) -> None:
    limiter = Limiter(
        backend, margin=0, rates=["1000/second"], min_interval=60, sleep=lambda s: None
    )
    queue.put(limiter.acquire(TOKEN).slot)


@pytest.mark.parametrize("method", ["fork", "spawn"])
@pytest.mark.filterwarnings("ignore:This process .* use of fork:DeprecationWarning")  # 3.12+
def test_processes_share_one_file(tmp_path: Path, method: str) -> None:
    """A backend built before a fork (or pickled for spawn) works in the child, on its own
    connection, and the parent sees what the child booked."""
    backend = SQLiteBackend(tmp_path / "l.db")
    limiter = Limiter(
        backend, margin=0, rates=["1000/second"], min_interval=60, sleep=lambda s: None
    )
    first = limiter.acquire(TOKEN).slot
    context = multiprocessing.get_context(method)
    queue: multiprocessing.Queue[float] = context.Queue()
    child = context.Process(target=_book_in_child, args=(backend, queue))
    child.start()
    child_slot = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert child_slot == pytest.approx(first + 60)
    assert limiter.acquire(TOKEN).slot == pytest.approx(first + 120)


def test_pickle_reopens_the_same_file(tmp_path: Path) -> None:
    backend = SQLiteBackend(tmp_path / "l.db", busy_timeout=3)
    copy = pickle.loads(pickle.dumps(backend))
    assert copy.path == backend.path and copy.busy_timeout == 3


async def test_async_limiter_runs_it_in_threads(tmp_path: Path) -> None:
    clock = FakeClock()
    limiter = AsyncLimiter(
        SQLiteBackend(tmp_path / "l.db"),
        margin=0,
        rates=["2/second"],
        clock=clock,
        sleep=clock.asleep,
    )
    assert repr(limiter.backend).startswith("ThreadedAsync(SQLiteBackend(")
    await limiter.acquire(TOKEN)
    await limiter.acquire(TOKEN)
    assert (await limiter.acquire(TOKEN)).waited == 1.0


# -- the file's version: a new file, a file of 0.1 or 0.2, a file of a newer version ---------

# The tables 0.1.0 made (throttle_client/_backends/sqlite.py, _SCHEMA), word for word.
SCHEMA_0_1 = """
CREATE TABLE IF NOT EXISTS tc_entries (
    key TEXT NOT NULL,
    slot INTEGER NOT NULL,
    cum INTEGER NOT NULL,
    call_id TEXT NOT NULL,
    PRIMARY KEY (key, cum)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS tc_entries_slot ON tc_entries (key, slot, cum);
CREATE UNIQUE INDEX IF NOT EXISTS tc_entries_call ON tc_entries (key, call_id);
CREATE TABLE IF NOT EXISTS tc_meta (
    key TEXT PRIMARY KEY,
    last INTEGER,
    total INTEGER NOT NULL,
    base INTEGER NOT NULL,
    pause_until INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    born INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS tc_meta_expiry ON tc_meta (expires_at);
CREATE TABLE IF NOT EXISTS tc_holders (
    key TEXT NOT NULL,
    lease_id TEXT NOT NULL,
    expires_at INTEGER NOT NULL,
    PRIMARY KEY (key, lease_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS tc_holders_expiry ON tc_holders (key, expires_at);
CREATE TABLE IF NOT EXISTS tc_tickets (
    key TEXT NOT NULL,
    lease_id TEXT NOT NULL,
    number INTEGER NOT NULL,
    alive_until INTEGER NOT NULL,
    PRIMARY KEY (key, lease_id)
) WITHOUT ROWID;
CREATE UNIQUE INDEX IF NOT EXISTS tc_tickets_number ON tc_tickets (key, number);
CREATE TABLE IF NOT EXISTS tc_learned (
    key TEXT PRIMARY KEY,
    since INTEGER NOT NULL,
    until INTEGER NOT NULL,
    lim INTEGER NOT NULL,
    from_cum INTEGER NOT NULL
) WITHOUT ROWID;
"""
# The tables 0.2.0 made: the same text as 0.1.0's, unchanged by that release.
SCHEMA_0_2 = SCHEMA_0_1
RELEASED = {"0.1.0": SCHEMA_0_1, "0.2.0": SCHEMA_0_2}
START = 1_750_000_000.0  # the released file's calls, epoch seconds


def released_file(path: Path, schema: str) -> str:
    """A file as a released version left it: its tables, and one key's three calls 1 s
    apart from START, a learned limit and a lease. Returns the key's store key."""
    key = Limiter(MemoryBackend(), rates=["5/minute"]).store_key(TOKEN)
    at = int(START * US)
    db = sqlite3.connect(path, isolation_level=None)
    db.executescript(schema)
    db.executemany(
        "INSERT INTO tc_entries VALUES (?, ?, ?, ?)",
        [(key, at + n * US, n + 1, f"call-{n}") for n in range(3)],
    )
    db.execute(
        "INSERT INTO tc_meta VALUES (?, ?, 3, 0, 0, ?, ?)", (key, at + 2 * US, at + 3600 * US, at)
    )
    db.execute("INSERT INTO tc_learned VALUES (?, ?, ?, 10, 0)", (key, at, at + 60 * US))
    db.execute("INSERT INTO tc_holders VALUES (?, 'lease-1', ?)", (key, at + 30 * US))
    db.close()
    return key


def layout(path: Path) -> dict[str, list[tuple[Any, ...]]]:
    """Every table and index of the file, with its columns as SQLite reports them."""
    db = sqlite3.connect(path)
    names = db.execute("SELECT type, name FROM sqlite_master ORDER BY name").fetchall()
    found = {
        f"{kind} {name}": db.execute(
            f"PRAGMA {'table' if kind == 'table' else 'index'}_xinfo({name})"
        ).fetchall()
        for kind, name in names
    }
    db.close()
    return found


def user_version(path: Path) -> int:
    db = sqlite3.connect(path)
    try:
        return int(db.execute("PRAGMA user_version").fetchone()[0])
    finally:
        db.close()


def test_a_new_file_gets_the_schema_version(tmp_path: Path) -> None:
    SQLiteBackend(tmp_path / "new.db").close()
    assert sqlite_schema.SCHEMA_VERSION >= 1
    assert user_version(tmp_path / "new.db") == sqlite_schema.SCHEMA_VERSION


@pytest.mark.parametrize("release", sorted(RELEASED))
def test_a_file_of_a_release_is_migrated_and_keeps_its_rows(tmp_path: Path, release: str) -> None:
    """A file made by 0.1.0 or 0.2.0 (user_version 0) gets the columns and tables they
    lacked, in one transaction, keeps every row, and reports the current version: the
    same layout as a new file's."""
    path = tmp_path / "released.db"
    key = released_file(path, RELEASED[release])
    assert user_version(path) == 0
    clock = FakeClock(START + 3)
    with SQLiteBackend(path) as backend:
        limiter = Limiter(backend, rates=["5/minute"], margin=0, clock=clock, sleep=clock.sleep)
        usage = limiter.usage(TOKEN)
        assert usage.rates[0].used == 3  # the released file's calls count
        assert usage.learned is not None and usage.learned.limit == 10
        assert limiter.acquire(TOKEN).allowed  # and it takes new ones
    assert user_version(path) == sqlite_schema.SCHEMA_VERSION
    db = sqlite3.connect(path)
    assert db.execute("SELECT count(*) FROM tc_entries WHERE key = ?", (key,)).fetchone() == (4,)
    assert db.execute("SELECT lease_id FROM tc_holders").fetchall() == [("lease-1",)]
    assert db.execute("SELECT born, trimmed, life FROM tc_meta").fetchall() == [
        (int(START * US), 0, 0)
    ]
    db.close()
    SQLiteBackend(tmp_path / "new.db").close()
    assert layout(path) == layout(tmp_path / "new.db")
    SQLiteBackend(path).close()  # opened again: nothing more to do
    assert layout(path) == layout(tmp_path / "new.db")


def test_processes_opening_a_released_file_together_migrate_it_once(tmp_path: Path) -> None:
    path = tmp_path / "released.db"
    released_file(path, SCHEMA_0_2)
    start = threading.Barrier(8)
    failures: list[BaseException] = []

    def open_it() -> None:
        start.wait()
        try:
            SQLiteBackend(path, busy_timeout=30).close()
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=open_it) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert user_version(path) == sqlite_schema.SCHEMA_VERSION


def test_a_file_of_a_newer_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "newer.db"
    SQLiteBackend(path).close()
    newer = sqlite_schema.SCHEMA_VERSION + 1
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {newer}")
    db.close()
    with pytest.raises(BackendError) as refused:
        SQLiteBackend(path)
    assert not isinstance(refused.value, BackendUnavailable)  # never an outage
    message = str(refused.value)
    assert str(path) in message and "newer version" in message
    assert f"schema version {newer}" in message
    assert f"this version reads {sqlite_schema.SCHEMA_VERSION}" in message
    assert user_version(path) == newer  # left as it was


def test_a_file_of_no_released_layout_is_refused(tmp_path: Path) -> None:
    """user_version 0 and tables no release made (here tc_meta without ``born``): not
    guessed at, and left as it is."""
    path = tmp_path / "other.db"
    db = sqlite3.connect(path)
    db.executescript(SCHEMA_0_1.replace(",\n    born INTEGER NOT NULL DEFAULT 0", ""))
    db.close()
    before = layout(path)
    with pytest.raises(BackendError, match="no released version") as refused:
        SQLiteBackend(path)
    assert not isinstance(refused.value, BackendUnavailable)
    assert str(path) in str(refused.value) and "schema version 0" in str(refused.value)
    assert layout(path) == before and user_version(path) == 0


# -- paths it cannot use: misconfiguration, never an outage ----------------------------------


@contextmanager
def unwritable(path: Path) -> Iterator[None]:
    """``path``, an existing file, made one this process truly cannot write: for root a
    file mode is no barrier, so as root the file is made immutable (chattr +i)."""
    if not (hasattr(os, "geteuid") and os.geteuid() == 0):
        path.chmod(0o444)
        try:
            yield
        finally:
            path.chmod(0o644)
        return
    chattr = shutil.which("chattr")
    if chattr is None or subprocess.run([chattr, "+i", path], capture_output=True).returncode:
        pytest.skip("root cannot make a file read-only here: no chattr +i on this filesystem")
    try:
        yield
    finally:
        subprocess.run([chattr, "-i", path], check=True)


@contextmanager
def made_unusable(path: Path, how: str) -> Iterator[None]:
    """Turns ``path`` (a database file in a directory of its own) into one SQLite
    cannot write, in one of the ways a deployment gets it wrong."""
    if how == "read-only":
        SQLiteBackend(path).close()
        with unwritable(path):
            yield
        return
    shutil.rmtree(path.parent, ignore_errors=True)
    if how == "a directory":
        path.mkdir(parents=True)
    elif how == "under a file":
        path.parent.write_text("a file, not a directory")
    yield


UNUSABLE = ["missing directory", "a directory", "under a file", "read-only"]


@pytest.mark.parametrize("how", UNUSABLE)
def test_a_path_it_cannot_write_is_refused_when_built(tmp_path: Path, how: str) -> None:
    path = tmp_path / "store" / "l.db"
    path.parent.mkdir()
    with made_unusable(path, how), pytest.raises(BackendError) as raised:
        SQLiteBackend(path)
    assert not isinstance(raised.value, BackendUnavailable)  # waiting will not mend it
    assert str(path) in str(raised.value)


@pytest.mark.parametrize("how", UNUSABLE)
def test_a_path_that_becomes_unusable_is_never_failed_open(tmp_path: Path, how: str) -> None:
    path = tmp_path / "store" / "l.db"
    path.parent.mkdir()
    backend = SQLiteBackend(path)
    limiter = Limiter(backend, margin=0, rates=["5/second"], on_unavailable="allow", retry_for=0)
    assert limiter.try_acquire(TOKEN)
    backend.close()  # the next operation opens the file again, as a new process would
    with made_unusable(path, how):
        for call in (limiter.try_acquire, limiter.acquire, limiter.usage):
            with pytest.raises(BackendError) as raised:
                call(TOKEN)
            assert not isinstance(raised.value, BackendUnavailable)
            assert str(path) in str(raised.value) and TOKEN not in str(raised.value)


def test_a_full_disk_is_an_outage(tmp_path: Path) -> None:
    """SQLITE_FULL passes without a change of configuration (space is freed, logs
    rotate): the failure policy applies, as for a lock held past the busy timeout."""
    backend = SQLiteBackend(tmp_path / "l.db")
    limiter = Limiter(backend, margin=0, rates=["1000/second"], retry_for=0)
    db = backend._connection().db
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    db.execute(f"PRAGMA max_page_count = {pages}")  # this connection's file is now "full"
    with pytest.raises(BackendUnavailable, match="full") as raised:
        for n in range(1000):  # each new key needs room, soon a new page
            limiter.try_acquire(f"key-{n}")
    assert isinstance(raised.value.__cause__, sqlite3.OperationalError)


@pytest.mark.parametrize("path", [":memory:", "", "file:x?mode=memory"])
def test_paths_that_share_nothing_are_refused(path: str) -> None:
    with pytest.raises(ConfigurationError):
        SQLiteBackend(path)


def test_a_locked_file_becomes_backend_unavailable(tmp_path: Path) -> None:
    backend = SQLiteBackend(tmp_path / "l.db", busy_timeout=0.05)
    limiter = Limiter(backend, margin=0, rates=["2/second"])
    blocker = sqlite3.connect(tmp_path / "l.db", isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(BackendUnavailable, match="locked") as caught:
            limiter.try_acquire(TOKEN)
        assert isinstance(caught.value.__cause__, sqlite3.OperationalError)
        assert TOKEN not in str(caught.value)
    finally:
        blocker.execute("ROLLBACK")
    # Once the lock is gone the file works again (a fresh limiter: the one above leaves a
    # failed store alone for a moment, by its failure policy).
    assert Limiter(backend, margin=0, rates=["2/second"]).try_acquire(TOKEN)
    assert os.path.exists(tmp_path / "l.db-wal")  # WAL mode


OPS = st.lists(
    st.tuples(
        st.sampled_from(["try", "acquire", "wait", "usage", "pause", "reset"]),
        st.sampled_from(["alpha", "beta"]),
        st.integers(1, 3),  # cost, or pause seconds / 4
        st.integers(0, 1_500_000),  # µs the clock moves first
    ),
    max_size=40,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=OPS, gap=st.sampled_from([0, 100_000, 333_333]))
def test_sqlite_and_memory_agree(
    tmp_path: Path, ops: list[tuple[str, str, int, int]], gap: int
) -> None:
    """Random sequences give the same answers, in whole microseconds, from both stores."""
    clock = IntClock()
    options: dict[str, Any] = {
        "rates": [Rate(3, 1.0), Rate(5, 2.5)],
        "min_interval": gap / US,
        "clock": clock,
        "sleep": lambda seconds: None,  # the test moves the clock itself
    }
    path = tmp_path / f"agree-{next(_files)}.db"
    limiters = [Limiter(MemoryBackend(), **options), Limiter(SQLiteBackend(path), **options)]
    for name, key, amount, step in ops:
        clock.us += step
        answers = [_apply(limiter, name, key, amount) for limiter in limiters]
        assert answers[0] == answers[1], (name, key, amount)


class IntClock:
    """Epoch seconds moved in whole microseconds, so no float rounding blurs an edge."""

    def __init__(self) -> None:
        self.us = 1_700_000_000 * US

    def __call__(self) -> float:
        return self.us / US


_files = itertools.count()


def _apply(limiter: Limiter, name: str, key: str, amount: int) -> object:
    try:
        if name == "try":
            return limiter.try_acquire(key, amount)
        if name == "acquire":
            return limiter.acquire(key, amount, timeout=0.5)
        if name == "wait":
            return limiter.acquire(key, amount)
        if name == "usage":
            return limiter.usage(key)
        if name == "pause":
            return limiter.pause(key, amount / 4)
        return limiter.reset(key)
    except ThrottleTimeout as exc:
        return ("timeout", exc.retry_after)
