"""The doorbell of one SQLite file, which hears of the grants other processes make."""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path

from .doorbell import Doorbell

logger = logging.getLogger("throttle_client")

# While this process has waiters, how often its watcher looks whether the file changed,
# and how long it waits before it tries again after an error.
_WATCH_EVERY = 0.001
_WATCH_RETRY = 0.1
_WATCH_BATCH = 500  # lease ids per look: SQLite takes at least 999 parameters
# Which of some lease ids hold their lease and wait nowhere any more: granted. (A call
# served at some keys holds there while it waits at others, under a ticket.) Both lookups
# by lease id scan their table; it holds only the calls in flight or waiting.
_GRANTED = (
    "SELECT DISTINCT lease_id FROM tc_holders WHERE lease_id IN ({}) "
    "AND lease_id NOT IN (SELECT lease_id FROM tc_tickets)"
)


class SQLiteDoorbell(Doorbell):
    """The doorbell of one SQLite file: it rings for the grants of other processes too.

    While some waiter of this process waits, a daemon thread reads the file's
    ``PRAGMA data_version`` every millisecond on a connection of its own; it changes
    when any other connection commits, and then the thread rings those of this process's
    waiters that were granted their lease. It sleeps while nobody waits, and stops when
    the backend is closed. A ring is only a hint (see ``doorbell``): an error is logged
    and the thread tries again later, while waiters look again on their own.
    """

    def __init__(self, path: Path) -> None:
        super().__init__()
        self._path = path
        self._cond = threading.Condition()  # the thread sleeps on it while nobody waits
        self._stop: threading.Event | None = None  # the running thread's; None: none runs

    def forked(self) -> None:
        # The parent's thread did not cross the fork: the next watch() starts our own.
        self._cond = threading.Condition()
        self._stop = None

    def watch(self) -> None:
        with self._cond:
            if self._stop is None:
                self._stop = threading.Event()
                threading.Thread(
                    target=self._watch,
                    args=(self._stop,),
                    name="throttle-client-sqlite-doorbell",
                    daemon=True,
                ).start()
            self._cond.notify_all()  # a thread closed meanwhile may sleep on it too

    def close(self) -> None:
        """Stop the thread; a later wait starts a new one."""
        self._check_fork()  # a child must not touch a lock its parent's thread held
        with self._cond:
            if self._stop is not None:
                self._stop.set()
                self._stop = None
                self._cond.notify_all()

    def _watch(self, stop: threading.Event) -> None:
        db: sqlite3.Connection | None = None
        seen = None
        try:
            while True:
                with self._cond:
                    while not stop.is_set() and not self._bells:
                        self._cond.wait()
                if stop.is_set():
                    return
                try:
                    if db is None:
                        db = sqlite3.connect(self._path, timeout=_WATCH_RETRY, isolation_level=None)
                    # Read before the holders: a grant committed after this changes it.
                    version = db.execute("PRAGMA data_version").fetchone()[0]
                    if version != seen:
                        self.ring(_granted(db, self.waiting()))
                        seen = version
                except sqlite3.Error as exc:
                    logger.debug(
                        "the doorbell could not read SQLite store %r (%s); it tries again",
                        str(self._path),
                        exc,
                    )
                    if db is not None:
                        db.close()
                    db, seen = None, None
                    stop.wait(_WATCH_RETRY)
                    continue
                stop.wait(_WATCH_EVERY)
        finally:
            if db is not None:
                db.close()


def _granted(db: sqlite3.Connection, lease_ids: list[str]) -> list[str]:
    """Which of ``lease_ids`` were granted (one query, unless very many wait)."""
    found: list[str] = []
    for start in range(0, len(lease_ids), _WATCH_BATCH):
        batch = lease_ids[start : start + _WATCH_BATCH]
        sql = _GRANTED.format(", ".join("?" * len(batch)))
        found += [row[0] for row in db.execute(sql, batch)]
    return found
