"""One key's log in the SQLite file (``sliding_log.LogView``): every lookup one indexed
query, inside the transaction of the operation that opened it.

All of a key's tables are written in one transaction, so only hands from outside can
leave a key's rows without its meta, a meta without its rows, a meta this version cannot
read, or one at odds with its rows (a total below its base or its newest row's); the
view that finds such a key rebuilds it by the rules in ``repair``, or refuses it (a time
further ahead than any limiter sets) until it is reset.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from .._errors import BackendError
from .._ranges import FAR_AHEAD_US, MAX_TOTAL
from . import sliding_log
from .coarse import Coarse
from .quota import KEPT_US, Quota
from .repair import rebuilt_base, still_matters
from .sqlite_schema import (
    COARSE,
    CUM_THROUGH,
    ENTRIES_AFTER,
    FORGET_ENTRIES,
    FORGET_KEY,
    FORGET_LEARNED,
    FORGET_META,
    INSERT,
    META,
    NEWEST,
    OLDEST,
    SHIFT_AFTER,
    SHIFTED,
    SLOT_OF,
    TIME_AT_CUM,
    TRIM,
)

# The call id of an entry rebuilt by repair() (no caller's id begins so); one that adds
# the units missing from a log that still holds entries carries its total after it.
_REPAIRED_ID = "(repaired)"

# The lives a stored meta may name (sliding_log.LIFE_*); anything else reads as afresh.
_LIVES = (
    sliding_log.LIFE_AFRESH,
    sliding_log.LIFE_RESET,
    sliding_log.LIFE_HELD,
    sliding_log.LIFE_REBUILT,
)


class SQLiteLog:
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
        row = db.execute(META, (key,)).fetchone()
        if row is None:
            if db.execute(NEWEST, (key,)).fetchone() is not None:
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
            self.db.execute(INSERT, (self.key, self.last, self.total, _REPAIRED_ID))
        elif lost == "part":  # the units its entries lack, at the newest slot too
            assert self.last is not None
            self.last = max(self.last, self.newest)
            repaired_id = f"{_REPAIRED_ID}{self.total}"
            self.db.execute(INSERT, (self.key, self.last, self.total, repaired_id))
            lost = "log"
        else:
            # A damaged meta's pause is kept (only ever more careful); an unreadable one's
            # is lost with it.
            pause = self.pause_until if lost == "damaged" and self.pause_until > 0 else 0
            self.last, self.total, self.base, self.trimmed, self.born = None, 0, 0, 0, now
            self.life = sliding_log.LIFE_REBUILT
            self.db.execute(FORGET_META, (self.key,))
            # A learned limit goes with its meta (as on Redis, where it lives in the meta):
            # the running total it counts from may not be the rebuilt one's.
            self.db.execute(FORGET_LEARNED, (self.key,))
            self.learned = None
            newest = self.db.execute(NEWEST, (self.key,)).fetchone()
            if newest is None or not still_matters(newest[0], quota, now):
                self.db.execute(FORGET_ENTRIES, (self.key,))
                self.life = sliding_log.LIFE_AFRESH  # (nothing left to rebuild it from)
                if lost == "meta" and not self.unreadable:
                    return None  # a key whose time was up: nothing was lost
            else:
                oldest = self.db.execute(OLDEST, (self.key,)).fetchone()
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
        slot: int | None = self._one(SLOT_OF, call_id)
        return slot

    def time_at_cum(self, target: int) -> int:
        slot: int = self._one(TIME_AT_CUM, target)
        return slot

    def cum_through(self, t: int) -> int:
        if t < self.trimmed:
            return 0
        cum: int | None = self._one(CUM_THROUGH, t)
        return self.base if cum is None else cum

    def entries_after(self, t: int, most: int) -> list[tuple[int, int]]:
        if not self.live:
            return []
        return self.db.execute(ENTRIES_AFTER, (self.key, t, most)).fetchall()

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

    def _check_total(self, cost: int) -> None:
        if self.total + cost >= MAX_TOTAL:  # (as the Redis script, whose entries hold 6 bytes)
            raise BackendError(
                f"store key {self.key}: running total {self.total} + {cost} reaches 2^48: "
                "reset() the key"
            )

    def append(self, t: int, cost: int, call_id: str) -> None:
        self._check_total(cost)
        self.total += cost
        self.last = t
        self.dirty = True
        self.db.execute(INSERT, (self.key, t, self.total, call_id))

    def insert(self, t: int, cost: int, call_id: str) -> None:
        cum = self.cum_through(t) + cost
        self._check_total(cost)
        self.total += cost
        self.dirty = True
        self.db.execute(SHIFT_AFTER, (cost, self.key, t))
        self.db.execute(SHIFTED, (self.key,))
        self.db.execute(INSERT, (self.key, t, cum, call_id))

    def trim(self, cutoff: int) -> None:
        newest = self._one(CUM_THROUGH, cutoff)
        if newest is not None:
            self.base, self.trimmed = newest, max(self.trimmed, cutoff)
            self.dirty = True
            self.db.execute(TRIM, (self.key, cutoff))

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
        for forget in FORGET_KEY:
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
            stored = self._one(COARSE)
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
    """What repair() must rebuild of a readable key (``META``'s row): "damaged" for a
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
