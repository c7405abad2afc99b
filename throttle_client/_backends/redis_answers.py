"""How the Redis script's reply becomes an operation's answer (see the header of
lua/core.lua): one line per operation of a batch, an error as "!" and the server's
message, a repaired key said by the word that leads its line."""

from __future__ import annotations

from typing import Any, TypeVar, cast

from redis._parsers.base import BaseParser

from .._cards import Disagreements
from .._errors import BackendError
from .answers import Snapshot, Verdict
from .ops import (
    Acquire,
    AcquireAll,
    AcquireAny,
    Fingerprint,
    Inspect,
    Op,
    Pause,
    ReadHistory,
    Renew,
)
from .redis_codec import alone, as_text, declared
from .redis_errors import translate
from .repair import RepairNotice

T = TypeVar("T")


# The word that leads a reply when the script rebuilt a lost part of the key (bytes, or
# str from a client made with decode_responses=True), and which part it was.
_REPAIRED: dict[bytes | str, str] = {
    b"repaired:log": "log",
    b"repaired:meta": "meta",
    "repaired:log": "log",
    "repaired:meta": "meta",
    b"repaired:older": "older",
    "repaired:older": "older",
    b"repaired:damaged": "damaged",
    "repaired:damaged": "damaged",
}


def decode(op: Op[T], reply: Any, notice: RepairNotice | None = None) -> T:
    words = reply.split()
    if isinstance(op, Fingerprint):  # ("": a read found no record)
        return cast(T, as_text(reply) or None)
    if isinstance(op, ReadHistory):  # "field count field count ...": no number is lost
        pairs = zip(words[::2], words[1::2], strict=True)
        return cast(T, {as_text(name): int(n) for name, n in pairs})
    chosen = -1
    if isinstance(op, AcquireAny):  # "any:<n>": the n-th key of the pool, which it took
        chosen = int(words.pop(0)[4:]) - 1
    part = _REPAIRED.get(words[0])
    if part is not None:
        del words[0]
        if notice is not None:
            notice(op.key, part)
    elif isinstance(op, (AcquireAll, AcquireAny)):
        # "repaired:<part>:<n>": the n-th key of the stacked call, or of the pool; a
        # word for each key rebuilt.
        named = op.all_keys if isinstance(op, AcquireAny) else [c.key for c in op.charges]
        while words[0][:9] in (b"repaired:", "repaired:"):
            word = words.pop(0)
            _, part, index = (word.decode() if isinstance(word, bytes) else word).split(":")
            if notice is not None:
                notice(named[int(index) - 1], part)
    lost = words[0] in (b"lost", "lost")  # (after any repair: see Verdict.lost)
    if lost:
        del words[0]
    stale = words[0] in (b"stale", "stale")  # stale NOW AT: see Verdict.stale
    values = [int(word) for word in words[stale:]]
    if stale:
        now, at = values
        if isinstance(op, Inspect):
            return cast(T, Snapshot(now, at, 0, 0, (), (), stale=True))
        return cast(T, Verdict(False, now, at, 0, (), stale=True))
    if isinstance(op, (Acquire, AcquireAll)):
        # ALLOWED: 1 admitted, 0 refused, 2 queued behind a full cap, 3 queued at the head,
        # 4 refused for a full cap.
        allowed, now, slot, pause, *remaining = values
        keys = len(op.charges) if isinstance(op, AcquireAll) else 1
        if isinstance(op, AcquireAny):  # (with partners: the chosen key's acquire_all)
            keys += len(op.partners)
        ends = remaining[-2 * keys :]  # each key's life and total end the answer
        del remaining[-2 * keys :]
        mark = born = -1
        if allowed == 1 and op.mark_us >= 0:  # MARK BORN follow
            born, mark = remaining.pop(), remaining.pop()
        waiting, head, full = allowed in (2, 3), allowed == 3, allowed >= 2
        verdict = Verdict(
            allowed == 1,
            now,
            slot,
            pause,
            tuple(remaining),
            waiting,
            head,
            full,
            mark=mark,
            born=born,
            lives=tuple(ends[0::2]),
            totals=tuple(ends[1::2]),
            lost=lost,
            chosen=chosen,
        )
        return cast(T, verdict)
    if isinstance(op, Renew):
        return cast(T, bool(values[0]))
    if isinstance(op, Inspect):
        now, next_slot, pause, booked, in_flight, queued, limit, units, until, *per_rate = values
        used, ready = tuple(per_rate[::2]), tuple(per_rate[1::2])
        learned = (limit, units, until) if until >= 0 else None
        snapshot = Snapshot(
            now,
            next_slot,
            pause,
            booked,
            used,
            ready,
            in_flight,
            queued,
            learned=learned,
        )
        return cast(T, snapshot)
    if isinstance(op, Pause):
        return cast(T, values[0])
    return cast(T, None)


def decode_batch(
    ops: list[Op[Any]],
    reply: Any,
    notice: RepairNotice,
    disagree: Disagreements | None = None,
) -> list[Any]:
    """Per operation, its answer or the exception to raise: the script answers a batch with
    one line per operation, an error as "!" and the server's message. A card's line is
    "1", or the card it replaced when that one said otherwise (``disagree`` hears it)."""
    if not ops:  # (a call that opened a connection: "")
        return []
    if alone(ops):
        return [_read(ops[0], reply, notice)]
    # Per operation, the items that go before it (its history) and after it (its cards).
    around = [(len(declared(op)), len(getattr(op, "cards", ()))) for op in ops]
    extra = sum(before + after for before, after in around)
    lines = reply.split(b"\n" if isinstance(reply, bytes) else "\n")
    if len(lines) != len(ops) + extra:
        raise BackendError(f"Redis answered {len(lines)} lines for {len(ops) + extra} items")
    if extra:  # each operation's own line (the others': "1", or an error shrugged off)
        own, at = [], 0
        for op, (before, after) in zip(ops, around, strict=True):
            own.append(lines[at + before])
            cards = getattr(op, "cards", ())
            said = lines[at + before + 1 : at + before + 1 + after]
            for card, line in zip(cards, said, strict=True):
                if disagree and line not in (b"1", "1") and line[:1] not in (b"!", "!"):
                    disagree(card.key, line, card.text)
            at += before + 1 + after
        lines = own
    outcomes: list[Any] = []
    for op, line in zip(ops, lines, strict=True):
        if line[:1] in (b"!", "!"):
            text = line[1:].decode() if isinstance(line, bytes) else line[1:]
            error = BaseParser.parse_error(text)  # type: ignore[no-untyped-call]  # as redis-py would
            outcomes.append(_raised(translate(error), error))
            continue
        try:
            outcomes.append(_read(op, line, notice))
        except BackendError as exc:
            outcomes.append(exc)
    return outcomes


def _read(op: Op[Any], line: Any, notice: RepairNotice) -> Any:
    """``decode``, an answer this version cannot read raised as a BackendError."""
    try:
        return decode(op, line, notice)
    except Exception as exc:
        raise _raised(BackendError(f"Redis answered {line!r}: {exc}"), exc) from exc


def _raised(error: BackendError, cause: BaseException) -> BackendError:
    error.__cause__ = cause
    return error
