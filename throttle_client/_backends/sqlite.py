"""The SQLite store: the limiter's semantics for every process on one host, no server.

Each operation is one ``BEGIN IMMEDIATE`` transaction that runs ``leases.execute``
over a view whose every lookup is one indexed query, so processes queue on
SQLite's write lock (WAL mode, a busy timeout) and see each other's slots at
once. The time is read *after* the lock is taken: a slot computed from a time
read while waiting for the lock would already lie in the past.

The file's tables and queries are ``sqlite_schema``'s; a key's log and its leases are
views of them (``sqlite_log``, ``sqlite_leases``), what is kept beside a key is
``sqlite_beside``'s. A grant made here rings this process's doorbell after the commit;
a waiter in another process hears of it through
:class:`~.sqlite_doorbell.SQLiteDoorbell`, a thread that watches the file.
"""

from __future__ import annotations

import functools
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar, cast

from .._cards import Disagreements
from .._errors import BackendUnavailable, ConfigurationError
from . import beside, history, leases
from .base import Backend, ThreadedAsync, host_clock
from .expiries import GivenTimes
from .ops import (
    RECORD_TTL_US,
    Acquire,
    AcquireAll,
    AcquireAny,
    Fingerprint,
    Inspect,
    Learn,
    Op,
    Pause,
    ReadHistory,
    Release,
    Renew,
    namespace_prefix,
    namespace_record,
)
from .pushback import Pushback, in_force
from .quota import KEPT_US, Quota
from .repair import RepairNotice
from .sqlite_beside import SQLiteBeside, history_fields
from .sqlite_doorbell import SQLiteDoorbell
from .sqlite_leases import SQLiteLeases
from .sqlite_log import SQLiteLog
from .sqlite_schema import (
    ALL_CARDS,
    CARDS_OF,
    CARDS_STEP,
    DEAD_TICKETS,
    DEQUEUE,
    EXPIRED,
    EXPIRED_CARDS,
    EXPIRED_HISTORY,
    EXPIRED_HOLDERS,
    EXPIRED_PUSHBACK,
    FORGET_KEY,
    HISTORY_OF,
    UNHOLD,
    open_file,
    transaction,
    translate,
)

T = TypeVar("T")

# Writes (per connection) between sweeps of expired keys; a connection's first write
# sweeps too, so that short jobs, each opening the file for a few calls on a key of its
# own, clear what the jobs before them left.
_SWEEP_EVERY = 32
# Keys forgotten per sweep at most (of each table): four per write, more than writes
# begin (one key each, a stacked call a few), so the file keeps up with any churn of
# keys, and no single operation does much work.
_SWEEP_BATCH = 4 * _SWEEP_EVERY


class _RepairNeeded(Exception):
    """A read found part of a key lost or unreadable: repairing it needs the write lock."""


class _Connection:
    """A connection owned by one thread of one process, and its operation count."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self.pid = os.getpid()
        self.ops = 0


class SQLiteBackend(Backend):
    """Limits shared through one SQLite file by every process and thread on this host.

    No server: the zero-setup store for a single box. Each thread of each process
    uses its own connection (opened on first use, and again in a forked child);
    an operation waits up to ``busy_timeout`` seconds for the file's write lock.
    The file records the version of its layout (``PRAGMA user_version``): a file of 0.1
    or 0.2 is brought up to date when first opened, and one written by a newer version
    is refused with a BackendError when the backend is built.

    >>> limiter = Limiter(SQLiteBackend("/var/tmp/limits.db"), rates=["10/second"])
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        busy_timeout: float = 30.0,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ConfigurationError(f"SQLiteBackend needs a file path, not {path!r}")
        if os.fspath(path) == ":memory:" or os.fspath(path).startswith("file:"):
            # Every connection would get its own private database: nothing would be shared.
            raise ConfigurationError(
                f"SQLiteBackend needs a file shared by its processes, not {path!r}; "
                "use MemoryBackend for one process"
            )
        self.path = Path(path)
        self.busy_timeout = busy_timeout
        self._clock = host_clock(clock, "SQLiteBackend")
        self._local = threading.local()
        self._lock = threading.Lock()
        self._writers = (os.getpid(), threading.Lock())
        self._async: ThreadedAsync | None = None
        self._all: list[_Connection] = []  # this process's connections, for close()
        self._repairs = RepairNotice()
        self._disagree = Disagreements()  # workers whose cards of one key differ
        self._times = GivenTimes()  # which operations' times may forget keys
        self._connection()  # fail now, naming the path, if the file cannot be used

    def _connection(self) -> _Connection:
        conn: _Connection | None = getattr(self._local, "conn", None)
        if conn is not None and conn.pid == os.getpid():
            return conn
        # A connection must never cross a fork: the child opens its own. The parent's
        # is left unclosed on purpose (closing it here could disturb the parent's locks).
        try:
            db = open_file(self.path, self.busy_timeout)
        except sqlite3.Error as exc:
            raise translate(exc, self.path) from exc
        conn = _Connection(db)
        self._local.conn = conn
        with self._lock:
            if self._all and self._all[0].pid != conn.pid:
                self._all = []  # inherited across a fork: not ours to close
            self._all.append(conn)
        return conn

    def execute(self, op: Op[T]) -> T:
        conn = self._connection()
        if isinstance(op, ReadHistory):  # (a read of its own table: no log, no lock)
            try:
                now = op.time_us(self._clock)
                row = conn.db.execute(HISTORY_OF, (op.key, now)).fetchone()
            except sqlite3.Error as exc:
                raise translate(exc, self.path) from exc
            return cast(T, history_fields(row[0]) if row else {})
        # A read (usage) takes a snapshot and never queues behind writers (WAL); every
        # other operation takes the write lock first, so its read-decide-write is atomic.
        writable = not isinstance(op, Inspect)
        try:
            try:
                if writable:
                    with self._writer_lock():
                        result, repaired, granted = self._run(conn, op, writable=True)
                else:
                    result, repaired, granted = self._run(conn, op, writable=False)
            except _RepairNeeded:  # a read found part of the key lost: again, as a write
                with self._writer_lock():
                    result, repaired, granted = self._run(conn, op, writable=True)
        except sqlite3.Error as exc:
            raise translate(exc, self.path) from exc
        for key, part in repaired:  # said once it is committed
            self._repairs(key, part)
        if granted:  # committed: wake this process's waiters it granted a lease to
            self.doorbell.ring(granted)
        return result

    @contextmanager
    def _writer_lock(self) -> Iterator[None]:
        """The threads of one process take turns at the file's write lock through this one:
        a Python lock hands over at once, where SQLite's busy handler makes the waiters
        sleep and retry (up to 100 ms apart), leaving the lock idle meanwhile and a burst
        of threads booking slots later than they asked. Waited for no longer than
        ``busy_timeout``, as SQLite's own lock is. Per process: a lock held by another
        thread at a fork would never be released in the child."""
        pid, lock = self._writers
        if pid != os.getpid():  # rare: made under the backend's lock, not looked up under it
            with self._lock:
                pid, lock = self._writers
                if pid != os.getpid():
                    lock = threading.Lock()
                    self._writers = (os.getpid(), lock)
        if not lock.acquire(timeout=self.busy_timeout):
            raise BackendUnavailable(
                f"SQLite store {str(self.path)!r} is unavailable: this process's other "
                f"threads held it past busy_timeout={self.busy_timeout:g}s"
            )
        try:
            yield
        finally:
            lock.release()

    def _run(
        self, conn: _Connection, op: Op[T], *, writable: bool
    ) -> tuple[T, list[tuple[str, str]], list[str]]:
        """``op`` in one transaction; the parts of keys it repaired (key, part), and the
        leases it granted to waiters."""
        db = conn.db
        repaired: list[tuple[str, str]] = []
        granted: list[str] = []
        with transaction(db, "BEGIN IMMEDIATE" if writable else "BEGIN"):
            now = op.time_us(self._clock)
            opened = logs = self._logs(db, op, now, repaired, writable=writable)
            chosen, run = -1, cast(Op[Any], op)
            if isinstance(op, AcquireAny):  # a pool's call: the plain acquire it makes
                chosen, run, logs = leases.narrowed(op, opened, now)
            counts = history.counts(run, logs[0]) if logs else False
            result = leases.execute(run, logs, lambda key: SQLiteLeases(db, key), now, granted)
            if chosen >= 0:
                result = result._replace(chosen=chosen)
            if writable:
                for log in opened:
                    log.save()
                beside.write(run, result, logs, counts, now, SQLiteBeside(db), self._disagree)
                trusted = self._times.may_forget(op.now_us)  # (first: it notes a given time)
                if conn.ops % _SWEEP_EVERY == 0 and trusted:
                    _sweep(db, now)
                conn.ops += 1
        return result, repaired, granted

    def _logs(
        self,
        db: sqlite3.Connection,
        op: Op[Any],
        now: int,
        repaired: list[tuple[str, str]],
        *,
        writable: bool,
    ) -> list[SQLiteLog]:
        """The logs ``op`` reads, each repaired first if part of it was lost (a write)."""
        parts: list[tuple[str, Quota | None]]
        if isinstance(op, AcquireAll):  # a stacked acquire: every key's log at once
            parts = [(c.key, c.quota) for c in op.charges]
        elif isinstance(op, AcquireAny):  # a pool's call: every key's, to choose one
            parts = [(key, op.quota) for key in op.keys]
            parts += [(partner.key, partner.quota) for partner in op.partners]
        elif isinstance(op, (Release, Renew)):  # leases only: no log is read
            parts = []
        else:
            quota = op.quota if isinstance(op, (Acquire, Inspect, Pause, Learn)) else None
            parts = [(op.key, quota)]
        logs: list[SQLiteLog] = []
        for key, quota in parts:
            log = SQLiteLog(db, key, now, writable=writable)
            if quota is None:  # a reset forgets all
                logs.append(log)
                continue
            if log.lost:
                if not writable:
                    raise _RepairNeeded
                part = log.repair(quota, now)
                if part:
                    repaired.append((key, part))
            log.check(now)
            logs.append(log)
        return logs

    @functools.cached_property
    def doorbell(self) -> SQLiteDoorbell:
        """As :attr:`Backend.doorbell`; it also hears of grants made by other processes."""
        return SQLiteDoorbell(self.path)

    def fingerprint(self, namespace: str, value: str, keep: bool = True) -> str | None:
        """As :meth:`Backend.fingerprint`."""
        op = Fingerprint(namespace_record(namespace), value, RECORD_TTL_US if keep else 0)
        conn = self._connection()
        try:
            with self._writer_lock(), transaction(conn.db, "BEGIN IMMEDIATE"):
                return SQLiteBeside(conn.db).record(op, op.time_us(time.time))
        except sqlite3.Error as exc:
            raise translate(exc, self.path) from exc

    def cards(self, store_keys: Sequence[str]) -> dict[str, str]:
        now, found = int(self._clock() * 1_000_000), dict[str, str]()
        try:
            db = self._connection().db
            with transaction(db, "BEGIN"):
                for key in store_keys:
                    found.update(db.execute(CARDS_OF, (key, now)).fetchall())
        except sqlite3.Error as exc:
            raise translate(exc, self.path) from exc
        return found

    def pushback(self, store_keys: Sequence[str]) -> dict[str, Pushback]:
        now = int(self._clock() * 1_000_000)
        try:
            db = self._connection().db
            with transaction(db, "BEGIN"):
                view = SQLiteBeside(db)
                found = [(key, view.pushback_of(key)) for key in store_keys]
        except sqlite3.Error as exc:
            raise translate(exc, self.path) from exc
        return in_force(found, now)

    def all_cards(self, namespace: str | None = None) -> Iterator[tuple[str, str]]:
        """As :meth:`Backend.all_cards`: CARDS_STEP cards per read, by key."""
        prefix = namespace_prefix(namespace)
        # (Keys of the namespace sort from its prefix up to the prefix with "{" made "|";
        # with none, a bound past every key: the longest code point, repeated.)
        after, end = prefix, (prefix[:-1] + "|" if prefix else "\U0010ffff" * 1024)
        now = int(self._clock() * 1_000_000)
        while True:
            try:
                db = self._connection().db
                rows = db.execute(ALL_CARDS, (after, end, now, CARDS_STEP)).fetchall()
            except sqlite3.Error as exc:
                raise translate(exc, self.path) from exc
            yield from rows
            if len(rows) < CARDS_STEP:
                return
            after = rows[-1][0]

    def to_async(self) -> ThreadedAsync:
        """What AsyncLimiter uses: each operation in a worker thread, as it may wait on a
        lock. One for the backend, however many limiters use it: its threads each hold
        a connection."""
        with self._lock:
            if self._async is None:
                self._async = ThreadedAsync(self)
            return self._async

    def close(self) -> None:
        """Close this process's connections and stop its doorbell's watcher; a later
        operation opens a new one."""
        with self._lock:
            mine = [conn for conn in self._all if conn.pid == os.getpid()]
            self._all = []
        for conn in mine:
            conn.db.close()
        self._local = threading.local()
        doorbell = self.__dict__.get("doorbell")  # only if made: looking would make one
        if doorbell is not None:
            doorbell.close()
        if self._async is not None:
            self._async.shutdown()

    def __reduce__(self) -> tuple[Any, ...]:
        # Picklable for multiprocessing "spawn": the child opens the same file itself.
        # (An injected clock does not travel: the child uses the host clock.)
        return (_reopen, (self.path, self.busy_timeout))

    def __repr__(self) -> str:
        return f"SQLiteBackend({str(self.path)!r})"


def _reopen(path: Path, busy_timeout: float) -> SQLiteBackend:
    return SQLiteBackend(path, busy_timeout=busy_timeout)


def _sweep(db: sqlite3.Connection, now: int) -> None:
    """Forget a batch of keys that expired: nothing in their logs can matter any more;
    and a batch of leases that expired and tickets that died (their holders and waiters
    were killed) on keys nobody settles any more."""
    keys = db.execute(EXPIRED, (now - KEPT_US, _SWEEP_BATCH)).fetchall()
    for forget in FORGET_KEY:
        db.executemany(forget, keys)
    # These two scan their table, which holds only the calls in flight or waiting (and
    # the few such leftovers), never a row for every key.
    held = db.execute(EXPIRED_HOLDERS, (now, _SWEEP_BATCH)).fetchall()
    db.executemany(UNHOLD, held)
    dead = db.execute(DEAD_TICKETS, (now, _SWEEP_BATCH)).fetchall()
    db.executemany(DEQUEUE, dead)
    db.execute(EXPIRED_CARDS, (now, _SWEEP_BATCH))
    db.execute(EXPIRED_PUSHBACK, (now, _SWEEP_BATCH))
    db.execute(EXPIRED_HISTORY, (now, _SWEEP_BATCH))
