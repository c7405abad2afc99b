"""What the SQLite store keeps beside its keys' logs: cards, pushback, usage histories,
and a namespace's record of its key secret; each written in the transaction of the
operation that carries it."""

from __future__ import annotations

import json
import sqlite3

from . import history
from .ops import Acquire, AcquireAll, Fingerprint, Pause, history_cost
from .pushback import PUSHBACK_STEP_US, PUSHBACK_STEPS, pushed_back
from .sqlite_schema import HISTORY, HISTORY_OF, KEEP_RECORD, PUSH_BACK, PUSHBACK_OF, RECORD


def keep_record(db: sqlite3.Connection, op: Fingerprint, now: int) -> str | None:
    """A namespace's record (ops.Fingerprint): the fingerprint it holds, kept if it is
    ``op``'s, begun with ``op``'s if it holds none (``ttl_us`` 0: only read)."""
    row = db.execute(RECORD, (op.key, now)).fetchone()
    if not op.ttl_us:
        return None if row is None else str(row[0])
    held: str = op.fingerprint if row is None else row[0]
    if held == op.fingerprint:
        db.execute(KEEP_RECORD, (op.key, held, now + op.ttl_us))
    return held


def count_history(db: sqlite3.Connection, op: Acquire | AcquireAll, slot: int, now: int) -> None:
    """Count a call ``op`` booked at ``slot`` in each of its keys' usage history."""
    for spec in op.history:
        row = db.execute(HISTORY_OF, (spec.key, now)).fetchone()
        fields = history_fields(row[0]) if row else {}
        fields.pop(history.SKIPPED, None)  # (what was left out is not written back)
        history.record(fields, spec, slot, history_cost(op, spec.key))
        expires = slot + history.kept_us(spec.keep)
        db.execute(HISTORY, (spec.key, json.dumps(fields, separators=(",", ":")), expires))


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


def push_back(db: sqlite3.Connection, op: Pause, pause_until: int, now: int) -> None:
    """Keep what a transport's pause says (pushback.Pushback), in the pause's transaction."""
    row = db.execute(PUSHBACK_OF, (op.key,)).fetchone()
    record = ("", 0, {}) if row is None else (row[1], row[2], pushback_steps(row[3]))
    reason, until, steps = pushed_back(record, op, pause_until, now)
    expires = max(until, now + (PUSHBACK_STEPS + 1) * PUSHBACK_STEP_US)
    db.execute(PUSH_BACK, (op.key, reason, until, json.dumps(list(steps.items())), expires))


def pushback_steps(text: str) -> dict[int, int]:
    """The refusals per step as stored; a damaged record counts none (never an error in
    the pause that reads it)."""
    try:
        return {int(step): int(n) for step, n in json.loads(text)}
    except (ValueError, TypeError):
        return {}
