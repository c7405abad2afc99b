"""The SQLite store's file: its tables, the queries its views run, how a connection
opens it, and which of SQLite's errors are an outage.

Tables (keys are the limiter's hashed store keys, never an access token)::

    tc_entries(key, slot, cum, call_id)   one row per admitted call
    tc_meta(key, last, total, base, pause_until, expires_at, born, trimmed, life)
        a key's summary of its entries: ``born``, when its running totals began;
        ``trimmed``, the slot up to which its entries were dropped (0: none); ``life``,
        how this life of the key began: afresh, at a reset, after a loss (``sliding_log``)
    tc_holders(key, lease_id, expires_at)   a capped key's leases (``leases``)
    tc_tickets(key, lease_id, number, alive_until)   and its queue of waiters
    tc_learned(key, since, until, lim, from_cum)   a limit learned from the upstream
    tc_coarse(key, logs)   its bounded rates' coarse logs, JSON (``coarse.Coarse``)
    tc_cards(key, card, expires_at)   its card: label and rules (``_cards``)
    tc_pushback(key, reason, until, steps, expires_at)   the upstream's recent pushback
        (``pushback``): the reason for a pause in force, refusals per 10 s step
    tc_history(key, fields, expires_at)   its usage history, JSON (``history``)
    tc_records(key, value, expires_at)   a namespace's record of its key secret

The file carries the version of this layout in ``PRAGMA user_version``
(``SCHEMA_VERSION``). Releases 0.1 and 0.2 set none (0) and made the same five tables
(``RELEASED_TABLES``); the first connection of this version brings such a file up to
date, and refuses a file of any other layout, or of a newer version (``open_file``).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .._errors import BackendError, BackendUnavailable

# The version of the layout below, kept in the file's PRAGMA user_version. One more for
# each change of a table, with a migration from the one before in open_file.
SCHEMA_VERSION = 1
# The tables of a file made by 0.1.0 or 0.2.0 (user_version 0), and their columns, in order.
RELEASED_TABLES = {
    "tc_entries": ("key", "slot", "cum", "call_id"),
    "tc_meta": ("key", "last", "total", "base", "pause_until", "expires_at", "born"),
    "tc_holders": ("key", "lease_id", "expires_at"),
    "tc_tickets": ("key", "lease_id", "number", "alive_until"),
    "tc_learned": ("key", "since", "until", "lim", "from_cum"),
}
OUR_TABLES = "SELECT name FROM sqlite_master WHERE type = 'table' AND substr(name, 1, 3) = 'tc_'"
# IF NOT EXISTS: a released file's migration runs it too, for the tables it lacks.
SCHEMA = """
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
    born INTEGER NOT NULL DEFAULT 0,
    trimmed INTEGER NOT NULL DEFAULT 0,
    life INTEGER NOT NULL DEFAULT 0
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
CREATE TABLE IF NOT EXISTS tc_coarse (
    key TEXT PRIMARY KEY,
    logs TEXT NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS tc_cards (
    key TEXT PRIMARY KEY,
    card TEXT NOT NULL,
    expires_at INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS tc_cards_expiry ON tc_cards (expires_at);
CREATE TABLE IF NOT EXISTS tc_pushback (
    key TEXT PRIMARY KEY,
    reason TEXT NOT NULL,
    until INTEGER NOT NULL,
    steps TEXT NOT NULL,
    expires_at INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS tc_pushback_expiry ON tc_pushback (expires_at);
CREATE TABLE IF NOT EXISTS tc_history (
    key TEXT PRIMARY KEY,
    fields TEXT NOT NULL,
    expires_at INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS tc_history_expiry ON tc_history (expires_at);
CREATE TABLE IF NOT EXISTS tc_records (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL,
    expires_at INTEGER NOT NULL
) WITHOUT ROWID;
"""

# Every lookup below is one index search (tests/test_sqlite_backend.py checks the plans):
# slots and running totals go up together, so ordering by slot then cum follows the
# (key, slot, cum) index.
# The meta, and the key's newest entry (its slot and running total: the highest), which
# the meta must agree with: a meta whose entries are gone, or that counts otherwise than
# they do, is repaired. (A learned limit, sliding_log.learn, lives in a table of its own,
# read with the meta.)
META = (
    "SELECT m.last, m.total, m.base, m.pause_until, m.expires_at, e.slot, e.cum, "
    "l.since, l.until, l.lim, l.from_cum, m.born, m.trimmed, m.life "
    "FROM tc_meta AS m LEFT JOIN tc_learned AS l ON l.key = m.key "
    "LEFT JOIN tc_entries AS e ON e.key = m.key "
    "AND e.cum = (SELECT max(cum) FROM tc_entries WHERE key = m.key) WHERE m.key = ?"
)
NEWEST = "SELECT slot, cum FROM tc_entries WHERE key = ? ORDER BY slot DESC, cum DESC LIMIT 1"
OLDEST = "SELECT slot, cum, call_id FROM tc_entries WHERE key = ? ORDER BY slot, cum LIMIT 1"
SLOT_OF = "SELECT slot FROM tc_entries WHERE key = ? AND call_id = ?"
TIME_AT_CUM = "SELECT slot FROM tc_entries WHERE key = ? AND cum >= ? ORDER BY cum LIMIT 1"
CUM_THROUGH = (
    "SELECT cum FROM tc_entries WHERE key = ? AND slot <= ? ORDER BY slot DESC, cum DESC LIMIT 1"
)
ENTRIES_AFTER = (
    "SELECT slot, cum FROM tc_entries WHERE key = ? AND slot > ? ORDER BY slot, cum LIMIT ?"
)
# An entry logged among later ones (filling): their running totals grow by its cost. In
# two steps, as SQLite checks the key (key, cum) row by row: each moves to its new total
# negated (free: every total is >= 0), then back.
SHIFT_AFTER = "UPDATE tc_entries SET cum = -cum - ? WHERE key = ? AND slot > ?"
SHIFTED = "UPDATE tc_entries SET cum = -cum WHERE key = ? AND cum < 0"
TRIM = "DELETE FROM tc_entries WHERE key = ? AND slot <= ?"
FORGET_ENTRIES = "DELETE FROM tc_entries WHERE key = ?"
FORGET_META = "DELETE FROM tc_meta WHERE key = ?"
FORGET_LEARNED = "DELETE FROM tc_learned WHERE key = ?"
# A key's bounded rates' coarse logs (Coarse), as JSON {name: [slot, total,
# ...]}: a few entries each, read and written whole, and only by limiters with one.
COARSE = "SELECT logs FROM tc_coarse WHERE key = ?"
FORGET_COARSE = "DELETE FROM tc_coarse WHERE key = ?"
# Everything a key holds, but its leases: what a reset or an expiry forgets.
CARDS_STEP = 500  # cards read at once by all_cards
FORGET_CARD = "DELETE FROM tc_cards WHERE key = ?"
FORGET_PUSHBACK = "DELETE FROM tc_pushback WHERE key = ?"
# A key's usage history (history.py): its fields as JSON; it outlives the key, by design
# (kept only for limiters that ask for one).
HISTORY_OF = "SELECT fields FROM tc_history WHERE key = ? AND expires_at > ?"
HISTORY = "INSERT OR REPLACE INTO tc_history (key, fields, expires_at) VALUES (?, ?, ?)"
FORGET_HISTORY = "DELETE FROM tc_history WHERE key = ?"
EXPIRED_HISTORY = (
    "DELETE FROM tc_history WHERE key IN (SELECT key FROM tc_history WHERE expires_at <= ? LIMIT ?)"
)
# A key forgotten (reset, or expired) takes its card along. Its pushback (the upstream's
# refusals of the last minute) outlives an expired key on its own TTL; a reset drops it.
FORGET_KEY = (FORGET_ENTRIES, FORGET_META, FORGET_LEARNED, FORGET_COARSE, FORGET_CARD)
# A key's pushback (pushback.Pushback): steps, JSON of [[step, refusals], ...].
PUSHBACK_OF = "SELECT key, reason, until, steps FROM tc_pushback WHERE key = ?"
PUSH_BACK = (
    "INSERT OR REPLACE INTO tc_pushback (key, reason, until, steps, expires_at) "
    "VALUES (?, ?, ?, ?, ?)"
)
EXPIRED_PUSHBACK = (
    "DELETE FROM tc_pushback WHERE key IN "
    "(SELECT key FROM tc_pushback WHERE expires_at <= ? LIMIT ?)"
)
# A key's card (``_cards``): it lasts as long as the key, and its own TTL at least.
CARD = (
    "INSERT INTO tc_cards (key, card, expires_at) VALUES (?, ?, ?) ON CONFLICT (key) "
    "DO UPDATE SET card = excluded.card, expires_at = max(expires_at, excluded.expires_at)"
)
CARDS_OF = "SELECT key, card FROM tc_cards WHERE key = ? AND expires_at > ?"
ALL_CARDS = (
    "SELECT key, card FROM tc_cards WHERE key > ? AND key < ? AND expires_at > ? "
    "ORDER BY key LIMIT ?"
)
EXPIRED_CARDS = (
    "DELETE FROM tc_cards WHERE key IN (SELECT key FROM tc_cards WHERE expires_at <= ? LIMIT ?)"
)
RECORD = "SELECT value FROM tc_records WHERE key = ? AND expires_at > ?"
KEEP_RECORD = "INSERT OR REPLACE INTO tc_records (key, value, expires_at) VALUES (?, ?, ?)"
EXPIRED = "SELECT key FROM tc_meta WHERE expires_at > 0 AND expires_at <= ? LIMIT ?"
# A capped key's holders and queue (``sqlite_leases``), each one index search too.
PRUNE = "DELETE FROM tc_holders WHERE key = ? AND expires_at <= ?"
HOLDING = "SELECT count(*) FROM tc_holders WHERE key = ?"
IN_FLIGHT = "SELECT count(*) FROM tc_holders WHERE key = ? AND expires_at > ?"
WAITING = "SELECT count(*) FROM tc_tickets WHERE key = ? AND alive_until > ?"
HOLDS = "SELECT 1 FROM tc_holders WHERE key = ? AND lease_id = ?"
UNHOLD = "DELETE FROM tc_holders WHERE key = ? AND lease_id = ?"
EARLIEST = "SELECT min(expires_at) FROM tc_holders WHERE key = ?"
HEAD = "SELECT lease_id, alive_until FROM tc_tickets WHERE key = ? ORDER BY number LIMIT 1"
QUEUED = "SELECT 1 FROM tc_tickets WHERE key = ? AND lease_id = ?"
NEWEST_TICKET = "SELECT max(number) FROM tc_tickets WHERE key = ?"
KEEP_ALIVE = "UPDATE tc_tickets SET alive_until = ? WHERE key = ? AND lease_id = ?"
DEQUEUE = "DELETE FROM tc_tickets WHERE key = ? AND lease_id = ?"
FORGET_HOLDERS = "DELETE FROM tc_holders WHERE key = ?"
FORGET_TICKETS = "DELETE FROM tc_tickets WHERE key = ?"
LOOKUPS = (
    META,
    NEWEST,
    OLDEST,
    SLOT_OF,
    TIME_AT_CUM,
    CUM_THROUGH,
    ENTRIES_AFTER,
    SHIFT_AFTER,
    SHIFTED,
    TRIM,
    FORGET_ENTRIES,
    FORGET_META,
    FORGET_LEARNED,
    COARSE,
    FORGET_COARSE,
    EXPIRED,
    PRUNE,
    HOLDING,
    HOLDS,
    UNHOLD,
    EARLIEST,
    HEAD,
    QUEUED,
    NEWEST_TICKET,
    KEEP_ALIVE,
    DEQUEUE,
    FORGET_HOLDERS,
    FORGET_TICKETS,
    IN_FLIGHT,
    WAITING,
)

EXPIRED_HOLDERS = "SELECT key, lease_id FROM tc_holders WHERE expires_at <= ? LIMIT ?"
DEAD_TICKETS = "SELECT key, lease_id FROM tc_tickets WHERE alive_until <= ? LIMIT ?"

INSERT = "INSERT INTO tc_entries (key, slot, cum, call_id) VALUES (?, ?, ?, ?)"


@contextmanager
def transaction(db: sqlite3.Connection, begin: str) -> Iterator[None]:
    """``begin``, then COMMIT; on any error (or interruption) ROLLBACK, if still open."""
    db.execute(begin)
    try:
        yield
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


def open_file(path: Path, busy_timeout: float) -> sqlite3.Connection:
    """A connection of this thread to the file, in WAL mode, its tables made (a new file)
    or brought up to ``SCHEMA_VERSION`` (a file of 0.1 or 0.2). Raises BackendError for a
    file of a newer version, or of a layout no release made."""
    db = sqlite3.connect(
        path,
        timeout=busy_timeout,
        isolation_level=None,  # we issue BEGIN IMMEDIATE / COMMIT ourselves
        check_same_thread=False,  # only so close() may close it from any thread
    )
    try:
        use_wal(db, busy_timeout)
        db.execute("PRAGMA synchronous = NORMAL")  # safe in WAL; only durability on power loss
        # One transaction that takes the write lock first: processes that open a new file
        # together make its tables once, and one migrates a released file while the
        # others wait, then find it done.
        with transaction(db, "BEGIN IMMEDIATE"):
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version != SCHEMA_VERSION:
                _bring_up_to_date(db, path, version)
            # A file already at this version gets no write above: this write of nothing
            # fails on a file this process cannot write.
            db.execute("DELETE FROM tc_meta WHERE 0")
    except BaseException:
        db.close()
        raise
    return db


def _bring_up_to_date(db: sqlite3.Connection, path: Path, version: int) -> None:
    """Inside open_file's transaction: make the tables of a new file, or migrate a file of
    0.1 or 0.2, then set the version; refuse any other file."""
    if version > SCHEMA_VERSION:
        raise BackendError(
            f"SQLite store {str(path)!r} was written by a newer version of throttle_client "
            f"(schema version {version}; this version reads {SCHEMA_VERSION}): upgrade "
            "throttle_client, or give this version a file of its own"
        )
    tables = {
        name: tuple(row[1] for row in db.execute(f'PRAGMA table_info("{quoted(name)}")'))
        for (name,) in db.execute(OUR_TABLES).fetchall()
    }
    if version == 0 and tables == RELEASED_TABLES:
        # 0.1.0 and 0.2.0: tc_meta gains trimmed (0: a log that lost nothing) and life
        # (0: begun afresh); the tables made below are those they did not have.
        db.execute("ALTER TABLE tc_meta ADD COLUMN trimmed INTEGER NOT NULL DEFAULT 0")
        db.execute("ALTER TABLE tc_meta ADD COLUMN life INTEGER NOT NULL DEFAULT 0")
    elif version != 0 or tables:
        raise BackendError(
            f"SQLite store {str(path)!r} holds tables of no released version of "
            f"throttle_client (schema version {version}; this version reads "
            f"{SCHEMA_VERSION}, and migrates files of 0.1 and 0.2, version 0): give this "
            "version a file of its own"
        )
    # One statement at a time (executescript would commit first).
    for statement in SCHEMA.split(";"):
        if statement.strip():
            db.execute(statement)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


def quoted(name: str) -> str:
    """``name`` for a double-quoted SQL identifier."""
    return name.replace('"', '""')


def use_wal(db: sqlite3.Connection, busy_timeout: float) -> None:
    """Switch the file to WAL (a setting the file keeps). The switch needs the file to
    itself and SQLite may refuse it at once, without its busy handler, while other
    processes open the same new file: so retry, until the busy timeout is spent."""
    deadline = time.monotonic() + busy_timeout
    while True:
        try:
            if db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                db.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


# Errors that pass without anyone changing anything, so the limiter's on_unavailable applies:
# SQLITE_BUSY and SQLITE_LOCKED (another process held the lock past the busy timeout),
# SQLITE_IOERR (a failing or remote disk that may recover) and SQLITE_FULL (a full disk
# fills and empties on its own: logs rotate, temporary files go; it is an outage of the
# store, as an unreachable Redis is). Everything else -- a read-only file, a missing
# directory, a path that is a directory, a file that is not a database -- stays as it
# is until someone fixes the configuration: a BackendError, never failed open.
TRANSIENT_CODES = {5, 6, 10, 13}  # primary result codes: BUSY, LOCKED, IOERR, FULL
# Python 3.10 gives no result code: the primary codes' messages, as sqlite3_errstr has them.
TRANSIENT_MESSAGES = ("database is locked", "table is locked", "disk I/O error", "is full")


def transient(exc: sqlite3.Error) -> bool:
    code: int | None = getattr(exc, "sqlite_errorcode", None)  # Python 3.11+
    if code is not None:
        return code & 0xFF in TRANSIENT_CODES
    return any(message in str(exc) for message in TRANSIENT_MESSAGES)


def translate(exc: sqlite3.Error, path: Path) -> BackendError:
    if transient(exc):
        return BackendUnavailable(f"SQLite store {str(path)!r} is unavailable: {exc}")
    return BackendError(f"SQLite store {str(path)!r} cannot be used: {exc}")
