"""What the SQLite store keeps beside its keys' logs: cards, pushback, usage histories,
and a namespace's record of its key secret; each written in the transaction of the
operation that carries it."""

from __future__ import annotations

import json
import sqlite3
from typing import cast

from . import history
from .beside import kept_record
from .ops import Fingerprint
from .pushback import PUSHBACK_STEP_US, PUSHBACK_STEPS, PushbackRecord
from .sqlite_schema import (
    CARD,
    CARDS_OF,
    FORGET_HISTORY,
    FORGET_PUSHBACK,
    HISTORY,
    HISTORY_OF,
    KEEP_RECORD,
    PUSH_BACK,
    PUSHBACK_OF,
    RECORD,
)


class SQLiteBeside:
    """What the store keeps beside its keys (``beside.BesideView``): rows of its tables,
    inside the current transaction of ``db``."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def card(self, key: str, now: int) -> str | None:
        row = self.db.execute(CARDS_OF, (key, now)).fetchone()
        return None if row is None else cast(str, row[1])

    def keep_card(self, key: str, text: str, expires: int) -> None:
        self.db.execute(CARD, (key, text, expires))  # (the later expiry of the two wins)

    def pushback_of(self, key: str) -> PushbackRecord | None:
        row = self.db.execute(PUSHBACK_OF, (key,)).fetchone()
        return None if row is None else (row[1], row[2], pushback_steps(row[3]))

    def keep_pushback(self, key: str, record: PushbackRecord, now: int) -> None:
        reason, until, steps = record
        expires = max(until, now + (PUSHBACK_STEPS + 1) * PUSHBACK_STEP_US)
        self.db.execute(PUSH_BACK, (key, reason, until, json.dumps(list(steps.items())), expires))

    def history_of(self, key: str, now: int) -> dict[str, int]:
        row = self.db.execute(HISTORY_OF, (key, now)).fetchone()
        fields = history_fields(row[0]) if row else {}
        fields.pop(history.SKIPPED, None)  # (what was left out is not written back)
        return fields

    def keep_history(self, key: str, fields: dict[str, int], expires: int) -> None:
        self.db.execute(HISTORY, (key, json.dumps(fields, separators=(",", ":")), expires))

    def forget(self, key: str) -> None:
        # (Its card went with its log: see FORGET_KEY.)
        self.db.execute(FORGET_PUSHBACK, (key,))
        self.db.execute(FORGET_HISTORY, (key,))

    def record(self, op: Fingerprint, now: int) -> str | None:
        """A namespace's record (``beside.kept_record``)."""
        row = self.db.execute(RECORD, (op.key, now)).fetchone()
        held = None if row is None else str(row[0])
        told, write = kept_record(held, op.fingerprint, op.ttl_us > 0)
        if write:
            self.db.execute(KEEP_RECORD, (op.key, op.fingerprint, now + op.ttl_us))
        return told


def history_fields(text: str) -> dict[str, int]:
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


def pushback_steps(text: str) -> dict[int, int]:
    """The refusals per step as stored; a damaged record counts none (never an error in
    the pause that reads it)."""
    try:
        return {int(step): int(n) for step, n in json.loads(text)}
    except (ValueError, TypeError):
        return {}
