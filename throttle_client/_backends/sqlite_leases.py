"""One capped key's holders and queue in the SQLite file (``leases.LeaseView``): every
lookup one indexed query, inside the transaction of the operation that opened it."""

from __future__ import annotations

import sqlite3
from typing import Any, cast

from .sqlite_schema import (
    DEQUEUE,
    EARLIEST,
    FORGET_HOLDERS,
    FORGET_TICKETS,
    HEAD,
    HOLDING,
    HOLDS,
    IN_FLIGHT,
    KEEP_ALIVE,
    NEWEST_TICKET,
    PRUNE,
    QUEUED,
    UNHOLD,
    WAITING,
)


class SQLiteLeases:
    """One capped key's holders and queue inside the current transaction of ``db``
    (``leases.LeaseView``)."""

    def __init__(self, db: sqlite3.Connection, key: str) -> None:
        self.db = db
        self.key = key

    def _one(self, sql: str, *args: object) -> Any:
        row = self.db.execute(sql, (self.key, *args)).fetchone()
        return None if row is None else row[0]

    def prune(self, now: int) -> None:
        self.db.execute(PRUNE, (self.key, now))

    def holding(self) -> int:
        count: int = self._one(HOLDING)
        return count

    def holds(self, lease_id: str) -> bool:
        return self._one(HOLDS, lease_id) is not None

    def hold(self, lease_id: str, until: int) -> None:
        self.db.execute(
            "INSERT INTO tc_holders (key, lease_id, expires_at) VALUES (?, ?, ?) "
            "ON CONFLICT (key, lease_id) DO UPDATE SET expires_at = excluded.expires_at",
            (self.key, lease_id, until),
        )

    def unhold(self, lease_id: str) -> bool:
        return self.db.execute(UNHOLD, (self.key, lease_id)).rowcount > 0

    def earliest_expiry(self) -> int | None:
        earliest: int | None = self._one(EARLIEST)
        return earliest

    def head(self, now: int) -> str | None:
        # Mostly one look: a dead ticket at the front (a waiter killed while queued) is rare.
        while True:
            row = self.db.execute(HEAD, (self.key,)).fetchone()
            if row is None:
                return None
            lease_id, alive_until = row
            if alive_until > now:
                return cast(str, lease_id)
            self.dequeue(lease_id)

    def queued(self, lease_id: str) -> bool:
        return self._one(QUEUED, lease_id) is not None

    def newest_ticket(self) -> int:
        newest: int | None = self._one(NEWEST_TICKET)
        return newest or 0

    def enqueue(self, lease_id: str, number: int, alive_until: int) -> None:
        self.db.execute(
            "INSERT INTO tc_tickets (key, lease_id, number, alive_until) VALUES (?, ?, ?, ?)",
            (self.key, lease_id, number, alive_until),
        )

    def keep_alive(self, lease_id: str, alive_until: int) -> None:
        self.db.execute(KEEP_ALIVE, (alive_until, self.key, lease_id))

    def dequeue(self, lease_id: str) -> bool:
        return self.db.execute(DEQUEUE, (self.key, lease_id)).rowcount > 0

    def forget(self) -> None:
        self.db.execute(FORGET_HOLDERS, (self.key,))
        self.db.execute(FORGET_TICKETS, (self.key,))

    def counts(self, now: int) -> tuple[int, int]:
        held: int = self._one(IN_FLIGHT, now)
        waiting: int = self._one(WAITING, now)
        return held, waiting
