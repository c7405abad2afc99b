"""The SQLite store: the semantics of docs/design.md §1 for every process on one host, no server.

Each operation is one ``BEGIN IMMEDIATE`` transaction that runs ``leases.execute``
over a view whose every lookup is one indexed query, so processes queue on
SQLite's write lock (WAL mode, a busy timeout) and see each other's slots at
once. The time is read *after* the lock is taken: a slot computed from a time
read while waiting for the lock would already lie in the past.

Tables (keys are the limiter's hashed store keys, never an access token)::

    tc_entries(key, slot, cum, call_id)   one row per admitted call
    tc_meta(key, last, total, base, pause_until, expires_at, born, trimmed)
    tc_holders(key, lease_id, expires_at)   a capped key's leases (``leases``)
    tc_tickets(key, lease_id, number, alive_until)   and its queue of waiters
    tc_learned(key, since, until, lim, from_cum)   a limit learned from the upstream
    tc_coarse(key, logs)   its bounded rates' coarse logs, JSON (``coarse.Coarse``)

All are written in one transaction, so only hands from outside can leave a key's
rows without its meta, a meta without its rows, a meta this version cannot read, or one
at odds with its rows (a total below its base or its newest row's); the operation that
finds such a key rebuilds it by the rules in ``repair``, or refuses it (a time
further ahead than any limiter sets) until it is reset.

A grant made here rings this process's doorbell after the commit; a waiter in another
process hears of it through :class:`SQLiteDoorbell`, a thread that watches the file.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar, cast

from .._cards import Disagreements
from .._errors import BackendError, BackendUnavailable, ConfigurationError
from .._ranges import FAR_AHEAD_US, MAX_TOTAL
from . import history, leases, sliding_log
from .answers import Verdict
from .base import Backend, ThreadedAsync, host_clock
from .coarse import Coarse
from .doorbell import Doorbell
from .ops import (
    RECORD_TTL_US,
    Acquire,
    AcquireAll,
    Fingerprint,
    Inspect,
    Learn,
    Op,
    Pause,
    ReadHistory,
    Release,
    Renew,
    Reset,
    history_cost,
    namespace_prefix,
    namespace_record,
)
from .pushback import PUSHBACK_STEP_US, PUSHBACK_STEPS, Pushback, pushback_at, pushed_back
from .quota import KEPT_US, Quota
from .repair import RepairNotice, rebuilt_base, still_matters

T = TypeVar("T")
logger = logging.getLogger("throttle_client")

_SCHEMA = """
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
# slots never go backwards, so ordering by slot then cum follows the (key, slot, cum) index.
# The meta, and the key's newest entry (its slot and running total: the highest), which
# the meta must agree with: a meta whose entries are gone, or that counts otherwise than
# they do, is repaired. (A learned limit, sliding_log.learn, lives in a table of its own,
# read with the meta.)
_META = (
    "SELECT m.last, m.total, m.base, m.pause_until, m.expires_at, e.slot, e.cum, "
    "l.since, l.until, l.lim, l.from_cum, m.born, m.trimmed, m.life "
    "FROM tc_meta AS m LEFT JOIN tc_learned AS l ON l.key = m.key "
    "LEFT JOIN tc_entries AS e ON e.key = m.key "
    "AND e.cum = (SELECT max(cum) FROM tc_entries WHERE key = m.key) WHERE m.key = ?"
)
_NEWEST = "SELECT slot, cum FROM tc_entries WHERE key = ? ORDER BY slot DESC, cum DESC LIMIT 1"
_OLDEST = "SELECT slot, cum, call_id FROM tc_entries WHERE key = ? ORDER BY slot, cum LIMIT 1"
_SLOT_OF = "SELECT slot FROM tc_entries WHERE key = ? AND call_id = ?"
_TIME_AT_CUM = "SELECT slot FROM tc_entries WHERE key = ? AND cum >= ? ORDER BY cum LIMIT 1"
_CUM_THROUGH = (
    "SELECT cum FROM tc_entries WHERE key = ? AND slot <= ? ORDER BY slot DESC, cum DESC LIMIT 1"
)
_FIRST_AFTER = "SELECT slot FROM tc_entries WHERE key = ? AND slot > ? ORDER BY slot, cum LIMIT 1"
_TRIM = "DELETE FROM tc_entries WHERE key = ? AND slot <= ?"
_FORGET_ENTRIES = "DELETE FROM tc_entries WHERE key = ?"
_FORGET_META = "DELETE FROM tc_meta WHERE key = ?"
_FORGET_LEARNED = "DELETE FROM tc_learned WHERE key = ?"
# A key's bounded rates' coarse logs (Coarse), as JSON {name: [slot, total,
# ...]}: a few entries each, read and written whole, and only by limiters with one.
_COARSE = "SELECT logs FROM tc_coarse WHERE key = ?"
_FORGET_COARSE = "DELETE FROM tc_coarse WHERE key = ?"
# Everything a key holds, but its leases: what a reset or an expiry forgets.
CARDS_STEP = 500  # cards read at once by all_cards
_FORGET_CARD = "DELETE FROM tc_cards WHERE key = ?"
_FORGET_PUSHBACK = "DELETE FROM tc_pushback WHERE key = ?"
# A key's usage history (history.py): its fields as JSON; it outlives the key, by design
# (kept only for limiters that ask for one).
_HISTORY_OF = "SELECT fields FROM tc_history WHERE key = ? AND expires_at > ?"
_HISTORY = "INSERT OR REPLACE INTO tc_history (key, fields, expires_at) VALUES (?, ?, ?)"
_FORGET_HISTORY = "DELETE FROM tc_history WHERE key = ?"
_EXPIRED_HISTORY = (
    "DELETE FROM tc_history WHERE key IN (SELECT key FROM tc_history WHERE expires_at <= ? LIMIT ?)"
)
# A key forgotten (reset, or expired) takes its card along. Its pushback (the upstream's
# refusals of the last minute) outlives an expired key on its own TTL; a reset drops it.
_FORGET_KEY = (_FORGET_ENTRIES, _FORGET_META, _FORGET_LEARNED, _FORGET_COARSE, _FORGET_CARD)
# A key's pushback (pushback.Pushback): steps, JSON of [[step, refusals], ...].
_PUSHBACK_OF = "SELECT key, reason, until, steps FROM tc_pushback WHERE key = ?"
_PUSH_BACK = (
    "INSERT OR REPLACE INTO tc_pushback (key, reason, until, steps, expires_at) "
    "VALUES (?, ?, ?, ?, ?)"
)
_EXPIRED_PUSHBACK = (
    "DELETE FROM tc_pushback WHERE key IN "
    "(SELECT key FROM tc_pushback WHERE expires_at <= ? LIMIT ?)"
)
# A key's card (``_cards``): it lasts as long as the key, and its own TTL at least.
_CARD = (
    "INSERT INTO tc_cards (key, card, expires_at) VALUES (?, ?, ?) ON CONFLICT (key) "
    "DO UPDATE SET card = excluded.card, expires_at = max(expires_at, excluded.expires_at)"
)
_CARDS_OF = "SELECT key, card FROM tc_cards WHERE key = ? AND expires_at > ?"
_ALL_CARDS = (
    "SELECT key, card FROM tc_cards WHERE key > ? AND key < ? AND expires_at > ? "
    "ORDER BY key LIMIT ?"
)
_EXPIRED_CARDS = (
    "DELETE FROM tc_cards WHERE key IN (SELECT key FROM tc_cards WHERE expires_at <= ? LIMIT ?)"
)
_RECORD = "SELECT value FROM tc_records WHERE key = ? AND expires_at > ?"
_KEEP_RECORD = "INSERT OR REPLACE INTO tc_records (key, value, expires_at) VALUES (?, ?, ?)"
_EXPIRED = "SELECT key FROM tc_meta WHERE expires_at > 0 AND expires_at <= ? LIMIT ?"
# A capped key's holders and queue (``_SQLiteLeases``), each one index search too.
_PRUNE = "DELETE FROM tc_holders WHERE key = ? AND expires_at <= ?"
_HOLDING = "SELECT count(*) FROM tc_holders WHERE key = ?"
_IN_FLIGHT = "SELECT count(*) FROM tc_holders WHERE key = ? AND expires_at > ?"
_WAITING = "SELECT count(*) FROM tc_tickets WHERE key = ? AND alive_until > ?"
_HOLDS = "SELECT 1 FROM tc_holders WHERE key = ? AND lease_id = ?"
_UNHOLD = "DELETE FROM tc_holders WHERE key = ? AND lease_id = ?"
_EARLIEST = "SELECT min(expires_at) FROM tc_holders WHERE key = ?"
_HEAD = "SELECT lease_id, alive_until FROM tc_tickets WHERE key = ? ORDER BY number LIMIT 1"
_QUEUED = "SELECT 1 FROM tc_tickets WHERE key = ? AND lease_id = ?"
_NEWEST_TICKET = "SELECT max(number) FROM tc_tickets WHERE key = ?"
_KEEP_ALIVE = "UPDATE tc_tickets SET alive_until = ? WHERE key = ? AND lease_id = ?"
_DEQUEUE = "DELETE FROM tc_tickets WHERE key = ? AND lease_id = ?"
_FORGET_HOLDERS = "DELETE FROM tc_holders WHERE key = ?"
_FORGET_TICKETS = "DELETE FROM tc_tickets WHERE key = ?"
LOOKUPS = (
    _META,
    _NEWEST,
    _OLDEST,
    _SLOT_OF,
    _TIME_AT_CUM,
    _CUM_THROUGH,
    _FIRST_AFTER,
    _TRIM,
    _FORGET_ENTRIES,
    _FORGET_META,
    _FORGET_LEARNED,
    _COARSE,
    _FORGET_COARSE,
    _EXPIRED,
    _PRUNE,
    _HOLDING,
    _HOLDS,
    _UNHOLD,
    _EARLIEST,
    _HEAD,
    _QUEUED,
    _NEWEST_TICKET,
    _KEEP_ALIVE,
    _DEQUEUE,
    _FORGET_HOLDERS,
    _FORGET_TICKETS,
    _IN_FLIGHT,
    _WAITING,
)

_EXPIRED_HOLDERS = "SELECT key, lease_id FROM tc_holders WHERE expires_at <= ? LIMIT ?"
_DEAD_TICKETS = "SELECT key, lease_id FROM tc_tickets WHERE alive_until <= ? LIMIT ?"

_INSERT = "INSERT INTO tc_entries (key, slot, cum, call_id) VALUES (?, ?, ?, ?)"
# The call id of an entry rebuilt by repair() (no caller's id begins so); one that adds
# the units missing from a log that still holds entries carries its total after it.
_REPAIRED_ID = "(repaired)"

# Writes (per connection) between sweeps of expired keys; a connection's first write
# sweeps too, so that short jobs, each opening the file for a few calls on a key of its
# own, clear what the jobs before them left.
# The lives a stored meta may name (sliding_log.LIFE_*); anything else reads as afresh.
_LIVES = (
    sliding_log.LIFE_AFRESH,
    sliding_log.LIFE_RESET,
    sliding_log.LIFE_HELD,
    sliding_log.LIFE_REBUILT,
)

_SWEEP_EVERY = 32
# Keys forgotten per sweep at most (of each table): four per write, more than writes
# begin (one key each, a stacked call a few), so the file keeps up with any churn of
# keys, and no single operation does much work.
_SWEEP_BATCH = 4 * _SWEEP_EVERY


class _SQLiteLog:
    """One key's log inside the current transaction of ``db`` (``sliding_log.LogView``)."""

    def __init__(self, db: sqlite3.Connection, key: str, now: int, *, writable: bool) -> None:
        self.db = db
        self.key = key
        self.last: int | None = None
        self.total = 0
        self.base = 0
        self.trimmed = 0  # (sliding_log.LogView.trimmed)
        self.pause_until = 0
        self.learned: tuple[int, int, int, int] | None = None
        self.learned_dirty = False
        self.born = now  # a key begun in this step (a stored one says when it began)
        self.life = 0  # how it began (sliding_log.LIFE_*)
        self.ended = 0  # the time to go of what delete() forgot
        self.expires_at = 0
        self.dirty = False  # meta must be written back
        self.coarse_logs: dict[str, Coarse] | None = None  # read when first asked
        self.coarse_dirty = False
        self.live = True  # False: the stored rows are expired and must be ignored
        # The part found lost, unreadable or damaged ("log", "part", "meta" or "damaged"),
        # for repair() to rebuild; a meta that is merely missing is "meta" only if entries
        # are left.
        self.lost: str | None = None
        self.unreadable = False
        self.newest = 0  # the newest entry's slot, for a repair of "part"
        row = db.execute(_META, (key,)).fetchone()
        if row is None:
            if db.execute(_NEWEST, (key,)).fetchone() is not None:
                self.lost = "meta"
        elif not _readable(row):
            self.lost, self.unreadable = "meta", True
        elif not 0 < row[4] <= now - KEPT_US:  # (0: no time to go yet, so not gone)
            self.last, self.total, self.base, self.pause_until, self.expires_at = row[:5]
            if all(type(n) is int for n in row[7:11]):
                self.learned = row[7:11]
            self.born = row[11] if type(row[11]) is int else 0
            self.trimmed = row[12] if type(row[12]) is int else 0
            self.life = row[13] if row[13] in _LIVES else sliding_log.LIFE_AFRESH
            self.lost = _damage(row)
            self.newest = row[5] or 0
        elif writable:  # nothing in it matters any more: start afresh
            self.delete()
        else:  # a read must not write: look as if the key were gone
            self.live = False

    def repair(self, quota: Quota, now: int) -> str | None:
        """Rebuild the lost part by the rules of ``repair`` (in this transaction); answers
        which part was rebuilt, or None when nothing lost could still matter."""
        lost, self.lost = self.lost, None
        if lost == "log":
            assert self.last is not None
            if not still_matters(self.last, quota, now):
                self.base, self.dirty = self.total, True  # no window reaches them: no loss
                return None
            # All of the lost units at the newest slot.
            self.db.execute(_INSERT, (self.key, self.last, self.total, _REPAIRED_ID))
        elif lost == "part":  # the units its entries lack, at the newest slot too
            assert self.last is not None
            self.last = max(self.last, self.newest)
            repaired_id = f"{_REPAIRED_ID}{self.total}"
            self.db.execute(_INSERT, (self.key, self.last, self.total, repaired_id))
            lost = "log"
        else:
            # A damaged meta's pause is kept (only ever more careful); an unreadable one's
            # is lost with it.
            pause = self.pause_until if lost == "damaged" and self.pause_until > 0 else 0
            self.last, self.total, self.base, self.trimmed, self.born = None, 0, 0, 0, now
            self.life = sliding_log.LIFE_REBUILT
            self.db.execute(_FORGET_META, (self.key,))
            # A learned limit goes with its meta (as on Redis, where it lives in the meta):
            # the running total it counts from may not be the rebuilt one's.
            self.db.execute(_FORGET_LEARNED, (self.key,))
            self.learned = None
            newest = self.db.execute(_NEWEST, (self.key,)).fetchone()
            if newest is None or not still_matters(newest[0], quota, now):
                self.db.execute(_FORGET_ENTRIES, (self.key,))
                self.life = sliding_log.LIFE_AFRESH  # (nothing left to rebuild it from)
                if lost == "meta" and not self.unreadable:
                    return None  # a key whose time was up: nothing was lost
            else:
                oldest = self.db.execute(_OLDEST, (self.key,)).fetchone()
                self.last, self.total = newest
                repaired = oldest[2].startswith(_REPAIRED_ID)
                self.base = rebuilt_base(oldest[1], quota, repaired=repaired)
            self.pause_until = pause
        self.dirty = True
        self.expire_at(max(now, self.last or 0, self.pause_until) + quota.horizon_us)
        return lost

    def _one(self, sql: str, *args: object) -> Any:
        if not self.live:
            return None
        row = self.db.execute(sql, (self.key, *args)).fetchone()
        return None if row is None else row[0]

    def slot_of(self, call_id: str) -> int | None:
        slot: int | None = self._one(_SLOT_OF, call_id)
        return slot

    def time_at_cum(self, target: int) -> int:
        slot: int = self._one(_TIME_AT_CUM, target)
        return slot

    def cum_through(self, t: int) -> int:
        if t < self.trimmed:
            return 0
        cum: int | None = self._one(_CUM_THROUGH, t)
        return self.base if cum is None else cum

    def first_after(self, t: int) -> int | None:
        slot: int | None = self._one(_FIRST_AFTER, t)
        return slot

    def check(self, now: int) -> None:
        """BackendError for a key no call may use until it is reset: a time further ahead
        than any limiter sets (waiting for it would stall the key for that long), or a
        running total past what a store keeps."""
        until = self.learned[1] if self.learned is not None else 0
        times = {"newest slot": self.last or 0, "pause": self.pause_until, "learned limit": until}
        for what, at in times.items():
            if at > now + FAR_AHEAD_US:
                years = (at - now) / (365.25 * 86400e6)
                raise _damaged(self.key, f"its {what} is {years:.0f} years ahead")
        if not 0 <= self.base <= self.total < MAX_TOTAL:
            raise _damaged(self.key, f"its running total {self.total} is out of range")

    def append(self, t: int, cost: int, call_id: str) -> None:
        if self.total + cost >= MAX_TOTAL:  # (as the Redis script, whose entries hold 6 bytes)
            raise BackendError(
                f"store key {self.key}: running total {self.total} + {cost} reaches 2^48: "
                "reset() the key"
            )
        self.total += cost
        self.last = t
        self.dirty = True
        self.db.execute(_INSERT, (self.key, t, self.total, call_id))

    def trim(self, cutoff: int) -> None:
        newest = self._one(_CUM_THROUGH, cutoff)
        if newest is not None:
            self.base, self.trimmed = newest, max(self.trimmed, cutoff)
            self.dirty = True
            self.db.execute(_TRIM, (self.key, cutoff))

    def set_pause(self, until: int) -> None:
        self.pause_until = until
        self.dirty = True

    def set_learned(self, learned: tuple[int, int, int, int]) -> None:
        self.learned = learned
        self.learned_dirty = self.dirty = True

    def set_life(self, life: int) -> None:
        self.life = life
        self.dirty = True

    def begin(self, now: int, life: int) -> None:
        self.born, self.life, self.expires_at = now, life, self.ended
        self.dirty = self.ended > 0  # (a key that had no time to go leaves nothing)

    def delete(self) -> None:
        self.ended = self.expires_at  # (see begin)
        for forget in _FORGET_KEY:
            self.db.execute(forget, (self.key,))
        self.coarse_logs, self.coarse_dirty = {}, False
        self.last, self.total, self.base, self.pause_until, self.expires_at = None, 0, 0, 0, 0
        self.learned, self.dirty, self.learned_dirty, self.trimmed = None, False, False, 0

    def expire_at(self, when: int) -> None:
        if when > self.expires_at:
            self.expires_at = when
            self.dirty = True

    def coarse(self, name: str) -> Coarse | None:
        if self.coarse_logs is None:
            self.coarse_logs = {}
            stored = self._one(_COARSE)
            try:
                logs = json.loads(stored) if stored is not None else {}
                for key, flat in logs.items():
                    if _well_formed(flat):
                        self.coarse_logs[key] = Coarse(flat)
            except (ValueError, AttributeError, TypeError):
                pass  # unreadable: each is begun again as if lost (coarse.coarse_of)
        return self.coarse_logs.get(name)

    def keep_coarse(self, name: str, coarse: Coarse) -> None:
        self.coarse(name)  # (the others are read first, and written back with it)
        assert self.coarse_logs is not None
        self.coarse_logs[name] = coarse
        self.coarse_dirty = True

    def save(self) -> None:
        if self.coarse_dirty and self.coarse_logs is not None:
            logs = {name: coarse.flat() for name, coarse in self.coarse_logs.items()}
            self.db.execute(
                "INSERT OR REPLACE INTO tc_coarse (key, logs) VALUES (?, ?)",
                (self.key, json.dumps(logs, separators=(",", ":"))),
            )
        if self.dirty:
            self.db.execute(
                "INSERT INTO tc_meta "
                "(key, last, total, base, pause_until, expires_at, born, trimmed, life) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (key) DO UPDATE SET "
                "last = excluded.last, total = excluded.total, base = excluded.base, "
                "pause_until = excluded.pause_until, expires_at = excluded.expires_at, "
                "born = excluded.born, trimmed = excluded.trimmed, life = excluded.life",
                (
                    self.key,
                    self.last,
                    self.total,
                    self.base,
                    self.pause_until,
                    self.expires_at,
                    self.born,
                    self.trimmed,
                    self.life,
                ),
            )
        if self.learned_dirty and self.learned is not None:
            self.db.execute(
                "INSERT OR REPLACE INTO tc_learned (key, since, until, lim, from_cum) "
                "VALUES (?, ?, ?, ?, ?)",
                (self.key, *self.learned),
            )


def _well_formed(flat: Any) -> bool:
    """Whether a stored coarse log is one (Coarse.flat): slots and totals
    that never go back; a row edited by hand may hold anything."""
    if not isinstance(flat, list) or len(flat) < 2 or len(flat) % 2:
        return False
    if not all(type(n) is int and n >= 0 for n in flat):
        return False
    return all(flat[i] <= flat[i + 2] for i in range(len(flat) - 2))


def _readable(row: tuple[Any, ...]) -> bool:
    """Whether a tc_meta row holds numbers where this version writes them (a column of
    SQLite takes any value, whatever its declared type)."""
    last, total, base, pause_until, expires_at = row[:5]
    numbers = (total, base, pause_until, expires_at)
    return all(type(n) is int for n in numbers) and (last is None or type(last) is int)


def _damage(row: tuple[Any, ...]) -> str | None:
    """What repair() must rebuild of a readable key (``_META``'s row): "damaged" for a
    meta that no step writes (out of range, at odds with itself, or counting fewer units
    than its entries or another newest slot: rebuilt from them), "part" for entries
    that lack units it counts, "log" for none left; None when the two agree."""
    last, total, base, pause_until, _, slot, cum = row[:7]
    if not 0 <= base <= total < MAX_TOTAL or pause_until < 0:
        return "damaged"
    if last is None and total != base:  # (a key only ever paused has no last slot)
        return "damaged"
    if cum is None:
        return "log" if total > base else None
    # Every entry's running total lies above base: those below it were trimmed.
    if cum <= base or cum > total or (cum == total and slot != last):
        return "damaged"
    return "part" if cum < total else None


def _damaged(key: str, what: str) -> BackendError:
    return BackendError(f"store key {key} is damaged: {what}; reset() the key")


class _SQLiteLeases:
    """One capped key's holders and queue inside the current transaction of ``db``
    (``leases.LeaseView``)."""

    def __init__(self, db: sqlite3.Connection, key: str) -> None:
        self.db = db
        self.key = key

    def _one(self, sql: str, *args: object) -> Any:
        row = self.db.execute(sql, (self.key, *args)).fetchone()
        return None if row is None else row[0]

    def prune(self, now: int) -> None:
        self.db.execute(_PRUNE, (self.key, now))

    def holding(self) -> int:
        count: int = self._one(_HOLDING)
        return count

    def holds(self, lease_id: str) -> bool:
        return self._one(_HOLDS, lease_id) is not None

    def hold(self, lease_id: str, until: int) -> None:
        self.db.execute(
            "INSERT INTO tc_holders (key, lease_id, expires_at) VALUES (?, ?, ?) "
            "ON CONFLICT (key, lease_id) DO UPDATE SET expires_at = excluded.expires_at",
            (self.key, lease_id, until),
        )

    def unhold(self, lease_id: str) -> bool:
        return self.db.execute(_UNHOLD, (self.key, lease_id)).rowcount > 0

    def earliest_expiry(self) -> int | None:
        earliest: int | None = self._one(_EARLIEST)
        return earliest

    def head(self, now: int) -> str | None:
        # Mostly one look: a dead ticket at the front (a waiter killed while queued) is rare.
        while True:
            row = self.db.execute(_HEAD, (self.key,)).fetchone()
            if row is None:
                return None
            lease_id, alive_until = row
            if alive_until > now:
                return cast(str, lease_id)
            self.dequeue(lease_id)

    def queued(self, lease_id: str) -> bool:
        return self._one(_QUEUED, lease_id) is not None

    def newest_ticket(self) -> int:
        newest: int | None = self._one(_NEWEST_TICKET)
        return newest or 0

    def enqueue(self, lease_id: str, number: int, alive_until: int) -> None:
        self.db.execute(
            "INSERT INTO tc_tickets (key, lease_id, number, alive_until) VALUES (?, ?, ?, ?)",
            (self.key, lease_id, number, alive_until),
        )

    def keep_alive(self, lease_id: str, alive_until: int) -> None:
        self.db.execute(_KEEP_ALIVE, (alive_until, self.key, lease_id))

    def dequeue(self, lease_id: str) -> bool:
        return self.db.execute(_DEQUEUE, (self.key, lease_id)).rowcount > 0

    def forget(self) -> None:
        self.db.execute(_FORGET_HOLDERS, (self.key,))
        self.db.execute(_FORGET_TICKETS, (self.key,))

    def counts(self, now: int) -> tuple[int, int]:
        held: int = self._one(_IN_FLIGHT, now)
        waiting: int = self._one(_WAITING, now)
        return held, waiting


class _RepairNeeded(Exception):
    """A read found part of a key lost or unreadable: repairing it needs the write lock."""


class _Connection:
    """A connection owned by one thread of one process, and its operation count."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self.pid = os.getpid()
        self.ops = 0


def _use_wal(db: sqlite3.Connection, busy_timeout: float) -> None:
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


class SQLiteBackend(Backend):
    """Limits shared through one SQLite file by every process and thread on this host.

    No server: the zero-setup store for a single box. Each thread of each process
    uses its own connection (opened on first use, and again in a forked child);
    an operation waits up to ``busy_timeout`` seconds for the file's write lock.

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
        self._given_times = False  # whether operations carry their time (a test's clock)
        self._connection()  # fail now, naming the path, if the file cannot be used

    def _connection(self) -> _Connection:
        conn: _Connection | None = getattr(self._local, "conn", None)
        if conn is not None and conn.pid == os.getpid():
            return conn
        # A connection must never cross a fork: the child opens its own. The parent's
        # is left unclosed on purpose (closing it here could disturb the parent's locks).
        try:
            db = sqlite3.connect(
                self.path,
                timeout=self.busy_timeout,
                isolation_level=None,  # we issue BEGIN IMMEDIATE / COMMIT ourselves
                check_same_thread=False,  # only so close() may close it from any thread
            )
            _use_wal(db, self.busy_timeout)
            db.execute("PRAGMA synchronous = NORMAL")  # safe in WAL; only durability on power loss
            # One statement at a time inside our own transaction (executescript would
            # commit first): processes that start together create the tables once.
            with _transaction(db, "BEGIN IMMEDIATE"):
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        db.execute(statement)
                # A file made before tc_meta had ``born`` (issue 11) gets it: 0, a life
                # begun before any mark was taken.
                columns = {row[1] for row in db.execute("PRAGMA table_info(tc_meta)")}
                if "born" not in columns:
                    db.execute("ALTER TABLE tc_meta ADD COLUMN born INTEGER NOT NULL DEFAULT 0")
                if "trimmed" not in columns:  # (issue 13: 0, a log that lost nothing)
                    db.execute("ALTER TABLE tc_meta ADD COLUMN trimmed INTEGER NOT NULL DEFAULT 0")
                if "life" not in columns:  # (0: begun afresh, as every key was before)
                    db.execute("ALTER TABLE tc_meta ADD COLUMN life INTEGER NOT NULL DEFAULT 0")
                columns = {row[1] for row in db.execute("PRAGMA table_info(tc_learned)")}
                if "from_cum" not in columns:  # (made between two commits of issue 11)
                    db.execute("DROP TABLE tc_learned")
                    learned = _SCHEMA[_SCHEMA.index("CREATE TABLE IF NOT EXISTS tc_learned") :]
                    db.execute(learned[: learned.index(";")])
                # Tables that exist already are not written to above: this write of
                # nothing fails on a file this process cannot write.
                db.execute("DELETE FROM tc_meta WHERE 0")
        except sqlite3.Error as exc:
            raise _translate(exc, self.path) from exc
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
                row = conn.db.execute(_HISTORY_OF, (op.key, now)).fetchone()
            except sqlite3.Error as exc:
                raise _translate(exc, self.path) from exc
            return cast(T, _fields(row[0]) if row else {})
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
            raise _translate(exc, self.path) from exc
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
        with _transaction(db, "BEGIN IMMEDIATE" if writable else "BEGIN"):
            now = op.time_us(self._clock)
            logs = self._logs(db, op, now, repaired, writable=writable)
            counts = history.counts(op, logs[0]) if logs else False
            result = leases.execute(op, logs, lambda key: _SQLiteLeases(db, key), now, granted)
            if writable:
                for log in logs:
                    log.save()
                for card in getattr(op, "cards", ()):
                    lives = max((log.expires_at for log in logs), default=0)
                    before = db.execute(_CARDS_OF, (card.key, now)).fetchone()
                    if before is not None and before[1] != card.text:
                        self._disagree(card.key, before[1], card.text)
                    db.execute(_CARD, (card.key, card.text, max(lives, now + card.ttl_us)))
                if isinstance(op, Pause) and (op.reason or op.refused):
                    _push_back(db, op, cast(int, result), now)
                if isinstance(op, Reset):
                    db.execute(_FORGET_PUSHBACK, (op.key,))
                    db.execute(_FORGET_HISTORY, (op.key,))
                if counts and cast(Verdict, result).allowed:
                    assert isinstance(op, (Acquire, AcquireAll))
                    _count(db, op, cast(Verdict, result).slot_us, now)
                # Keys expire by the clock their operations carry: with a test's clock, an
                # operation on the host's (Backend.forget) sweeps nothing, as every key
                # would look long expired to it.
                self._given_times = self._given_times or op.now_us is not None
                if conn.ops % _SWEEP_EVERY == 0 and (
                    op.now_us is not None or not self._given_times
                ):
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
    ) -> list[_SQLiteLog]:
        """The logs ``op`` reads, each repaired first if part of it was lost (a write)."""
        parts: list[tuple[str, Quota | None]]
        if isinstance(op, AcquireAll):  # a stacked acquire: every key's log at once
            parts = [(c.key, c.quota) for c in op.charges]
        elif isinstance(op, (Release, Renew)):  # leases only: no log is read
            parts = []
        else:
            quota = op.quota if isinstance(op, (Acquire, Inspect, Pause, Learn)) else None
            parts = [(op.key, quota)]
        logs: list[_SQLiteLog] = []
        for key, quota in parts:
            log = _SQLiteLog(db, key, now, writable=writable)
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
            with self._writer_lock(), _transaction(conn.db, "BEGIN IMMEDIATE"):
                return _fingerprint(conn.db, op, op.time_us(time.time))
        except sqlite3.Error as exc:
            raise _translate(exc, self.path) from exc

    def cards(self, store_keys: Sequence[str]) -> dict[str, str]:
        now, found = int(self._clock() * 1_000_000), dict[str, str]()
        try:
            db = self._connection().db
            with _transaction(db, "BEGIN"):
                for key in store_keys:
                    found.update(db.execute(_CARDS_OF, (key, now)).fetchall())
        except sqlite3.Error as exc:
            raise _translate(exc, self.path) from exc
        return found

    def pushback(self, store_keys: Sequence[str]) -> dict[str, Pushback]:
        now, told = int(self._clock() * 1_000_000), dict[str, Pushback]()
        try:
            db = self._connection().db
            with _transaction(db, "BEGIN"):
                rows = [db.execute(_PUSHBACK_OF, (key,)).fetchone() for key in store_keys]
        except sqlite3.Error as exc:
            raise _translate(exc, self.path) from exc
        for row in rows:
            said = None if row is None else pushback_at(row[1], row[2], _steps(row[3]), now)
            if said is not None:
                told[row[0]] = said
        return told

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
                rows = db.execute(_ALL_CARDS, (after, end, now, CARDS_STEP)).fetchall()
            except sqlite3.Error as exc:
                raise _translate(exc, self.path) from exc
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


@contextmanager
def _transaction(db: sqlite3.Connection, begin: str) -> Iterator[None]:
    """``begin``, then COMMIT; on any error (or interruption) ROLLBACK, if still open."""
    db.execute(begin)
    try:
        yield
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


def _reopen(path: Path, busy_timeout: float) -> SQLiteBackend:
    return SQLiteBackend(path, busy_timeout=busy_timeout)


def _fingerprint(db: sqlite3.Connection, op: Fingerprint, now: int) -> str | None:
    """A namespace's record (ops.Fingerprint): the fingerprint it holds, kept if it is
    ``op``'s, begun with ``op``'s if it holds none (``ttl_us`` 0: only read)."""
    row = db.execute(_RECORD, (op.key, now)).fetchone()
    if not op.ttl_us:
        return None if row is None else str(row[0])
    held: str = op.fingerprint if row is None else row[0]
    if held == op.fingerprint:
        db.execute(_KEEP_RECORD, (op.key, held, now + op.ttl_us))
    return held


def _sweep(db: sqlite3.Connection, now: int) -> None:
    """Forget a batch of keys that expired: nothing in their logs can matter any more;
    and a batch of leases that expired and tickets that died (their holders and waiters
    were killed) on keys nobody settles any more."""
    keys = db.execute(_EXPIRED, (now - KEPT_US, _SWEEP_BATCH)).fetchall()
    for forget in _FORGET_KEY:
        db.executemany(forget, keys)
    # These two scan their table, which holds only the calls in flight or waiting (and
    # the few such leftovers), never a row for every key.
    held = db.execute(_EXPIRED_HOLDERS, (now, _SWEEP_BATCH)).fetchall()
    db.executemany(_UNHOLD, held)
    dead = db.execute(_DEAD_TICKETS, (now, _SWEEP_BATCH)).fetchall()
    db.executemany(_DEQUEUE, dead)
    db.execute(_EXPIRED_CARDS, (now, _SWEEP_BATCH))
    db.execute(_EXPIRED_PUSHBACK, (now, _SWEEP_BATCH))
    db.execute(_EXPIRED_HISTORY, (now, _SWEEP_BATCH))


def _count(db: sqlite3.Connection, op: Acquire | AcquireAll, slot: int, now: int) -> None:
    """Count a call ``op`` booked at ``slot`` in each of its keys' usage history."""
    for spec in op.history:
        row = db.execute(_HISTORY_OF, (spec.key, now)).fetchone()
        fields = _fields(row[0]) if row else {}
        fields.pop(history.SKIPPED, None)  # (what was left out is not written back)
        history.record(fields, spec, slot, history_cost(op, spec.key))
        expires = slot + history.kept_us(spec.keep)
        db.execute(_HISTORY, (spec.key, json.dumps(fields, separators=(",", ":")), expires))


def _fields(text: str) -> dict[str, int]:
    """A stored history's fields as the store writes them, and how many others it held
    (``history.SKIPPED``); one that is not even JSON of an object begins again (never an
    error)."""
    try:
        stored = json.loads(text)
        if not isinstance(stored, dict):
            raise TypeError(type(stored))
    except (ValueError, TypeError):
        return {history.SKIPPED: 1}
    fields = {
        name: n
        for name, n in stored.items()
        if type(n) is int and (name == history.OFFSET or history.FIELD.match(name))
    }
    if len(fields) < len(stored):
        fields[history.SKIPPED] = len(stored) - len(fields)
    return fields


def _push_back(db: sqlite3.Connection, op: Pause, pause_until: int, now: int) -> None:
    """Keep what a transport's pause says (pushback.Pushback), in the pause's transaction."""
    row = db.execute(_PUSHBACK_OF, (op.key,)).fetchone()
    record = ("", 0, {}) if row is None else (row[1], row[2], _steps(row[3]))
    reason, until, steps = pushed_back(record, op, pause_until, now)
    expires = max(until, now + (PUSHBACK_STEPS + 1) * PUSHBACK_STEP_US)
    db.execute(_PUSH_BACK, (op.key, reason, until, json.dumps(list(steps.items())), expires))


def _steps(text: str) -> dict[int, int]:
    """The refusals per step as stored; a damaged record counts none (never an error in
    the pause that reads it)."""
    try:
        return {int(step): int(n) for step, n in json.loads(text)}
    except (ValueError, TypeError):
        return {}


# Errors that pass without anyone changing anything, so the limiter's on_unavailable applies:
# SQLITE_BUSY and SQLITE_LOCKED (another process held the lock past the busy timeout),
# SQLITE_IOERR (a failing or remote disk that may recover) and SQLITE_FULL (a full disk
# fills and empties on its own: logs rotate, temporary files go; it is an outage of the
# store, as an unreachable Redis is). Everything else -- a read-only file, a missing
# directory, a path that is a directory, a file that is not a database -- stays as it
# is until someone fixes the configuration: a BackendError, never failed open.
_TRANSIENT_CODES = {5, 6, 10, 13}  # primary result codes: BUSY, LOCKED, IOERR, FULL
# Python 3.10 gives no result code: the primary codes' messages, as sqlite3_errstr has them.
_TRANSIENT_MESSAGES = ("database is locked", "table is locked", "disk I/O error", "is full")


def _transient(exc: sqlite3.Error) -> bool:
    code: int | None = getattr(exc, "sqlite_errorcode", None)  # Python 3.11+
    if code is not None:
        return code & 0xFF in _TRANSIENT_CODES
    return any(message in str(exc) for message in _TRANSIENT_MESSAGES)


def _translate(exc: sqlite3.Error, path: Path) -> BackendError:
    if _transient(exc):
        return BackendUnavailable(f"SQLite store {str(path)!r} is unavailable: {exc}")
    return BackendError(f"SQLite store {str(path)!r} cannot be used: {exc}")
