"""The Redis store: one Lua script (package data), over redis-py's own clients.

Sync and asyncio backends share everything but the call itself: the script,
how an operation becomes KEYS/ARGV, how the reply becomes a result, how driver
errors become ours (``_redis_errors``), and the bounded connections the script runs
over (``_redis_clients``), and the queue that batches the operations which come while
those are busy (``batching``). Each call is one FCALL (EVALSHA on Redis 6.2) carrying one
operation or a batch of them; when the server has lost the script it is loaded again
and the call repeated, so a ``SCRIPT FLUSH``, a restart or a failover is invisible to
callers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import re
import threading
import time
import warnings
from collections.abc import Awaitable, Callable, Generator, Iterator, Sequence
from importlib import resources
from typing import Any, NamedTuple, TypeVar, cast

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
from redis import exceptions as rx
from redis._parsers.base import BaseParser
from redis.crc import key_slot

from .._cards import Disagreements
from .._errors import BackendError, ConfigurationError
from .._flow import arun, run
from . import history
from .answers import Snapshot, Verdict
from .base import AsyncBackend, Backend
from .batching import Batcher, Send, Wait
from .history import HistorySpec
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
    StoreCard,
    namespace_prefix,
    namespace_record,
)
from .pushback import Pushback, pushback_at
from .quota import Buckets, Quota
from .redis_clients import (
    CONNECTIONS,
    async_copy,
    async_from_url,
    check_url,
    pool_size,
    sync_copy,
    sync_from_url,
    warn_if_evicting,
)
from .redis_doorbell import RedisDoorbell, subscriber_clients
from .redis_errors import DRIVER_ERRORS, translate
from .repair import RepairNotice

T = TypeVar("T")

# The script, one file per concern, joined in an order in which each part uses only what
# the parts before it define (lua/core.lua's header describes the whole).
PARTS = (
    "core",
    "repair",
    "log",
    "bounded",
    "calendar",
    "slots",
    "history",
    "leases",
    "records",
    "learned",
    "acquire",
    "operations",
)
_LUA = resources.files(__package__).joinpath("lua")
SCRIPT = "".join(_LUA.joinpath(f"{part}.lua").read_text("utf-8") for part in PARTS)
SHA = hashlib.sha1(SCRIPT.encode()).hexdigest()
# On Redis >= 7 the same text is loaded as a function library (FUNCTION LOAD) and called
# with FCALL: its ~45 local functions are then defined once, not on every call (~15% of
# the server's time per decision, benchmarks/README.md). Named by the script's hash, so
# two versions of the library never collide on one server.
FUNCTION = f"throttle_client_{SHA[:16]}"
_RUN = "return run(KEYS, ARGV)\n"
assert SCRIPT.endswith(_RUN)
LIBRARY = (
    f"#!lua name={FUNCTION}\n{SCRIPT.removesuffix(_RUN)}"
    f"redis.register_function('{FUNCTION}', function(keys, args) return run(keys, args) end)\n"
)


# Every decision of a limiter sends the same keys and quota: both are formatted once
# (as bytes, which redis-py sends as they are) and remembered, not rebuilt per call.
@functools.lru_cache(maxsize=4096)
def redis_keys(key: str) -> tuple[bytes, bytes]:
    """The Redis keys of one store key: its log (a sorted set) and its meta (a string)."""
    prefix = f"tc:{key}:".encode()
    return prefix + b"log", prefix + b"meta"


def card_key(key: str) -> bytes:
    """A key's card (``_cards``): a string beside its log and meta."""
    return f"tc:{key}:card".encode()


def history_key(key: str) -> bytes:
    """A key's usage history (history.py): a hash beside its log and meta."""
    return f"tc:{key}:history".encode()


def pushback_key(key: str) -> bytes:
    """A key's pushback (pushback.Pushback): a hash beside its log and meta."""
    return f"tc:{key}:pushback".encode()


CARDS_STEP = 500  # keys a read of every card (SCAN's COUNT) asks for at once


def _whole(*texts: str) -> bool:
    """Whether each text is a whole number as the script writes one (a damaged field,
    or another version's, is left out)."""
    return all(text.isdigit() for text in texts)


def _text(value: bytes | str) -> str:
    # (A damaged card reads as text its parser refuses: the reader counts it, and goes on.)
    return value.decode(errors="replace") if isinstance(value, bytes) else value


@functools.lru_cache(maxsize=4096)
def lease_keys(key: str) -> tuple[bytes, bytes, bytes]:
    """A capped key's lease keys: its holders, its queue, and its tickets' lives."""
    prefix = f"tc:{key}:".encode()
    return prefix + b"hold", prefix + b"queue", prefix + b"alive"


@functools.lru_cache(maxsize=256)
def quota_arg(quota: Quota) -> bytes:
    """ARGV[2]: msgpack of [gap, limit, period, ...], encoded once per quota; a bounded
    sliding rate's period is [period, width], a calendar rate's an array, [keep_from,
    margin, start, end, start, end, ...], led by its coarse log's name if it is bounded.

    Every number is a non-negative integer below 2**64, so arrays of uint64s or positive
    fixints are all it takes.
    """
    items = [_uint(quota.min_interval_us)]
    for limit, period in quota.limits:
        items.append(_uint(limit))
        if isinstance(period, int):
            items.append(_uint(period))
        elif isinstance(period, Buckets):  # a bounded sliding rate: [period, width]
            items.append(_array(2) + _uint(period.period_us) + _uint(period.width_us))
        else:  # a bounded one's windows are led by the name of its coarse log
            numbers = (
                period.keep_from,
                period.margin_us,
                *(t for span in period.spans for t in span),
            )
            name = _str(period.name) if period.name else b""
            items.append(_array(len(numbers) + bool(name)) + name + b"".join(map(_uint, numbers)))
    return _array(len(items)) + b"".join(items)


def _str(text: str) -> bytes:
    data = text.encode()
    if len(data) < 32:
        return bytes([0xA0 | len(data)]) + data
    return b"\xd9" + bytes([len(data)]) + data  # (a name is under 256 bytes)


def _uint(n: int) -> bytes:
    return bytes([n]) if n < 128 else b"\xcf" + n.to_bytes(8, "big")


def _array(count: int) -> bytes:
    return bytes([0x90 | count]) if count < 16 else b"\xdc" + count.to_bytes(2, "big")


def encode(op: Op[Any], queued_us: int = 0) -> tuple[tuple[bytes, ...], tuple[bytes | str, ...]]:
    """KEYS and ARGV for ``op`` (see the header of lua/core.lua). ``queued_us``: how
    long it waited in the backend's queue; an acquire waits that much less for its slot,
    so a call never outlasts its timeout by the time it queued."""
    now = b"-" if op.now_us is None else b"%d" % op.now_us
    if isinstance(op, Reset):
        beside = (card_key(op.key), pushback_key(op.key), history_key(op.key))
        return redis_keys(op.key) + lease_keys(op.key) + beside, (b"reset", b"-", now)
    if isinstance(op, ReadHistory):
        return (history_key(op.key),), (b"history_read",)
    if isinstance(op, Fingerprint):
        ttl_ms = b"%d" % (op.ttl_us // 1000)
        return (f"tc:{op.key}".encode(),), (b"fingerprint", b"-", now, op.fingerprint, ttl_ms)
    if isinstance(op, (Release, Renew)):
        capped = [c for c in op.charges if c.quota.max_concurrent]
        keys = tuple(name for c in capped for name in lease_keys(c.key))
        caps = tuple(arg for c in capped for arg in _cap_args(c.quota))
        verb = b"release" if isinstance(op, Release) else b"renew"
        return keys, (verb, b"-", now, op.lease_id, *caps)
    if isinstance(op, AcquireAll):  # a capped call ("lease") also sends its lease keys
        leased = bool(op.lease_id)
        keys = ()
        per_key: tuple[bytes | str, ...] = ()
        for c in op.charges:
            holds = leased and bool(c.quota.max_concurrent)
            keys += redis_keys(c.key) + (lease_keys(c.key) if holds else ())
            per_key += (quota_arg(c.quota), b"%d" % c.cost, _expected(c.expect, c.seen))
            per_key += _cap_args(c.quota) if leased else ()
        wait, lead = _wait(op.max_wait_us, queued_us), b"%d" % op.lead_us
        marks = b"-" if op.mark_us < 0 else b"%d" % op.mark_us
        if leased:
            return keys, (b"lease", marks, now, wait, op.call_id, lead, op.lease_id, *per_key)
        return keys, (b"acquire_all", marks, now, wait, op.call_id, lead, *per_key)
    assert isinstance(op, (Acquire, Inspect, Pause, Learn))
    keys, quota = redis_keys(op.key), quota_arg(op.quota)
    if isinstance(op, Acquire):
        cost, wait = b"%d" % op.cost, _wait(op.max_wait_us, queued_us)
        if op.history or op.mark_us >= 0 or op.expect >= 0:
            lead, marks, expect = (
                b"%d" % op.lead_us,
                b"%d" % op.mark_us,
                _expected(op.expect, op.seen),
            )
            args = (b"acquire", quota, now, cost, wait, op.call_id, lead, marks, expect)
            if op.history:  # its usage history in its own arguments (no item: _declared)
                return (*keys, history_key(op.key)), args + _history_args(op.history[0])
            return keys, args
        if op.lead_us:
            lead = b"%d" % op.lead_us
            return keys, (b"acquire", quota, now, cost, wait, op.call_id, lead)
        return keys, (b"acquire", quota, now, cost, wait, op.call_id)
    if isinstance(op, Pause):
        if op.reason or op.refused:  # a transport's: the key's pushback too
            told = (op.reason, b"1" if op.refused else b"0")
            duration = b"%d" % op.duration_us
            return (*keys, pushback_key(op.key)), (b"pause", quota, now, duration, *told)
        return keys, (b"pause", quota, now, b"%d" % op.duration_us)
    if isinstance(op, Learn):
        learned = (op.since_us, op.until_us, op.limit, op.from_cum, op.born)
        return keys, (b"learn", quota, now, *(b"%d" % n for n in learned))
    if op.quota.max_concurrent:  # it counts the calls in flight and waiting too
        keys += lease_keys(op.key)
    return keys, (b"inspect", quota, now)


def _expected(born: int, seen: int) -> bytes:
    """A key's life as a worker knows it (Acquire.expect, Acquire.seen): "born,total"."""
    return b"-1" if born < 0 else b"%d,%d" % (born, max(0, seen))


def _cap_args(quota: Quota) -> tuple[bytes, bytes]:
    return b"%d" % quota.max_concurrent, b"%d" % quota.lease_ttl_us


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
        return cast(T, _text(reply) or None)
    if isinstance(op, ReadHistory):  # "field count field count ...": no number is lost
        pairs = zip(words[::2], words[1::2], strict=True)
        return cast(T, {_text(name): int(n) for name, n in pairs})
    part = _REPAIRED.get(words[0])
    if part is not None:
        del words[0]
        if notice is not None:
            notice(op.key, part)
    elif isinstance(op, AcquireAll) and words[0][:9] in (b"repaired:", "repaired:"):
        # "repaired:<part>:<n>": the n-th key of the stacked call.
        word = words.pop(0)
        _, part, index = (word.decode() if isinstance(word, bytes) else word).split(":")
        if notice is not None:
            notice(op.charges[int(index) - 1].key, part)
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


# A SCRIPT FLUSH (FUNCTION FLUSH) can land between our reload of the script and the call
# after it; a few more tries are enough, as each one loads the script again.
_NOSCRIPT_TRIES = 3


class _Calls:
    """How a backend calls the script: FCALL until the server shows it cannot (Redis
    6.2: an unknown command; an ACL user without ``fcall`` or ``function|load``), then
    EVALSHA for good. Also whether the first call that succeeded asked about eviction."""

    def __init__(self) -> None:
        self.functions = True
        self.memory_checked = threading.Lock()  # acquired once, by the first call that succeeds


def _no_functions(exc: Exception) -> bool:
    """Whether ``exc`` says this server or user cannot use functions (not a script error)."""
    text = str(exc).lower()
    if isinstance(exc, rx.NoPermissionError):  # for FCALL or FUNCTION LOAD themselves, not
        return "'fcall'" in text or "'function|load'" in text  # a command the script runs
    # Redis 6.2: "unknown command `FCALL`"; a Cluster client that asked 6.2 for its
    # commands knows none by that name and says so itself.
    if not ("fcall" in text or "function" in text):
        return False
    return "unknown command" in text or "doesn't exist in redis commands" in text


class _Command(NamedTuple):
    """A step of ``_script_flow``: one redis-py client method and its arguments (a tuple:
    one is made for every decision)."""

    name: str  # fcall, function_load, evalsha, script_load, config_get, pipeline
    args: tuple[Any, ...]


def _wait(max_wait_us: int, queued_us: int) -> bytes | str:
    """An acquire's wait, less the time it queued (-1: any wait; 0: none). A shortened
    one goes as a str, which the batch packs as it comes, leaving the cache of
    recurring arguments (``_recurring``) to the ones that do recur."""
    if queued_us <= 0 or max_wait_us <= 0:
        return b"%d" % max_wait_us
    return str(max(0, max_wait_us - queued_us))


def encode_batch(
    ops: list[Op[Any]], queued: list[float] | None = None
) -> tuple[tuple[bytes, ...], tuple[bytes | str, ...]]:
    """KEYS and ARGV for several operations in one script call (the script's "batch");
    one operation goes as it is. KEYS holds each key once; each operation is one
    argument, msgpack of [n, its n keys' places in KEYS, its arguments...]: redis-py
    spends ~2 µs on every argument of a command, several times what this costs.
    ``queued``: per operation, the seconds it waited in the queue (``encode``). The
    cards an acquire carries go after it, each an operation of the batch."""
    waits = [int(q * 1_000_000) for q in queued] if queued else [0] * len(ops)
    items: list[tuple[tuple[bytes, ...], tuple[bytes | str, ...]]] = []
    for op, queued_us in zip(ops, waits, strict=True):
        now = b"-" if op.now_us is None else b"%d" % op.now_us
        items += [_history_item(spec, now) for spec in _declared(op)]
        items.append(encode(op, queued_us))
        items += [_card_item(card, now) for card in getattr(op, "cards", ())]
    if len(items) == 1:
        return items[0]
    places: dict[bytes, int] = {}
    args: list[bytes | str] = [b"batch"]
    for op_keys, op_args in items:
        packed = [_array(1 + len(op_keys) + len(op_args)), _uint(len(op_keys))]
        for key in op_keys:
            packed.append(_uint(places.setdefault(key, len(places) + 1)))
        if op_args[0] == b"history":  # (the same for every call on the key: packed once)
            packed.append(_packed(op_args))
        else:
            packed += [_bin(a.encode()) if isinstance(a, str) else _recurring(a) for a in op_args]
        args.append(b"".join(packed))
    return tuple(places), tuple(args)


@functools.lru_cache(maxsize=4096)
def _packed(args: tuple[bytes | str, ...]) -> bytes:
    return b"".join(_bin(a.encode()) if isinstance(a, str) else _bin(a) for a in args)


def _declared(op: Op[Any]) -> tuple[HistorySpec, ...]:
    """The histories an operation's call declares in items of their own, before it: a
    stacked call's (an acquire carries its own in its arguments)."""
    return () if isinstance(op, Acquire) else getattr(op, "history", ())


@functools.lru_cache(maxsize=4096)
def _history_args(spec: HistorySpec) -> tuple[bytes, ...]:
    """What a usage history asks of the script: the periods kept, the offset, the TTL."""
    ttl = history.kept_us(spec.keep) // 1000
    return (*(b"%d" % n for n in spec.keep), b"%d" % spec.offset_us, b"%d" % ttl)


@functools.lru_cache(maxsize=4096)
def _history_item(
    spec: HistorySpec, now: bytes
) -> tuple[tuple[bytes, ...], tuple[bytes | str, ...]]:
    """Where the operation after it counts its bookings (the script's "history")."""
    keys = (redis_keys(spec.key)[1], history_key(spec.key))
    return keys, (b"history", b"-", now, *_history_args(spec))


def _card_item(card: StoreCard, now: bytes) -> tuple[tuple[bytes, ...], tuple[bytes | str, ...]]:
    """A key's card, written beside its log and meta (the script's "card"), at the time
    of the operation it rides with."""
    ttl_ms = b"%d" % max(1, -(-card.ttl_us // 1000))
    return (redis_keys(card.key)[1], card_key(card.key)), (b"card", b"-", now, card.text, ttl_ms)


def _bin(data: bytes) -> bytes:
    """One argument as a msgpack string (the script reads its bytes as they are)."""
    n = len(data)
    if n < 32:
        return bytes((0xA0 | n,)) + data
    if n < 256:
        return b"\xd9" + bytes((n,)) + data
    return b"\xdb" + n.to_bytes(4, "big") + data


# The arguments that recur (verbs, quotas, small numbers), packed once each; call ids
# (str) never recur and go straight to _bin.
_recurring = functools.lru_cache(maxsize=1024)(_bin)


def decode_batch(
    ops: list[Op[Any]],
    reply: Any,
    notice: RepairNotice,
    disagree: Disagreements | None = None,
) -> list[Any]:
    """Per operation, its answer or the exception to raise: the script answers a batch with
    one line per operation, an error as "!" and the server's message. A card's line is
    "1", or the card it replaced when that one said otherwise (``disagree`` hears it)."""
    # Per operation, the items that go before it (its history) and after it (its cards).
    around = [(len(_declared(op)), len(getattr(op, "cards", ()))) for op in ops]
    extra = sum(before + after for before, after in around)
    if len(ops) <= 1 and not extra:  # (none: a call that opened a connection: "")
        return [decode(ops[0], reply, notice)] if ops else []
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
            outcomes.append(decode(op, line, notice))
        except Exception as exc:  # (an answer this version cannot read: its own error)
            outcomes.append(_raised(BackendError(f"Redis answered {line!r}: {exc}"), exc))
    return outcomes


def _raised(error: BackendError, cause: BaseException) -> BackendError:
    error.__cause__ = cause
    return error


def _script_flow(
    ops: list[Op[Any]],
    queued: list[float],
    calls: _Calls,
    repairs: RepairNotice,
    disagree: Disagreements | None = None,
) -> Generator[_Command, Any, list[Any]]:
    """Operations as the script runs them, in one call, for both backends (see ``_flow``):
    FCALL, or EVALSHA where functions cannot be used, loading the library or the script
    again when the server has lost it; driver errors become ours. The first call that
    succeeds also asks whether Redis may evict the limiter's keys. Returns each one's
    answer, or the error it raises."""
    if not ops:  # a place opening its connection ahead of the calls queued behind it
        yield from _open_flow(calls)
        return []
    keys, args = encode_batch(ops, queued)
    try:
        tries_left = _NOSCRIPT_TRIES
        while True:
            # (What this attempt uses: calls in flight at once may see the flag change.)
            functions = calls.functions
            try:
                if functions:
                    reply = yield _Command("fcall", (FUNCTION, len(keys), *keys, *args))
                else:
                    reply = yield _Command("evalsha", (SHA, len(keys), *keys, *args))
                break
            except rx.NoScriptError:
                tries_left -= 1
                if not tries_left:
                    raise
                yield _Command("script_load", (SCRIPT,))
            except rx.RedisError as exc:
                if not functions:
                    raise
                if _no_functions(exc):
                    calls.functions = False  # and the same call again, by EVALSHA
                    continue
                if "function not found" not in str(exc).lower():
                    raise  # the script's own error, or the key's
                tries_left -= 1
                if not tries_left:
                    raise
                try:
                    yield _Command("function_load", (LIBRARY, True))
                except rx.RedisError as refused:
                    if not _no_functions(refused):
                        raise
                    calls.functions = False
    except DRIVER_ERRORS as exc:
        raise translate(exc) from exc
    if calls.memory_checked.acquire(blocking=False):
        # Refused (NOPERM, CONFIG renamed on a managed service): stay silent.
        with contextlib.suppress(*DRIVER_ERRORS):
            warn_if_evicting((yield _Command("config_get", ("maxmemory*",))))
    return decode_batch(ops, reply, repairs, disagree)


def _open_flow(calls: _Calls) -> Generator[_Command, Any, None]:
    """A new connection's round trip (Batcher: a call of no operation), which the calls
    queued behind it wait for: the library (or script) loaded, and, the first time, the
    store's eviction policy read, pipelined. So a store that never held the script costs
    a cold call one round trip, not three (FCALL, "function not found", FUNCTION LOAD,
    FCALL again), and the first decision does not wait for CONFIG GET. A library loaded
    already answers "already exists"; anything else it answers is the calls' to meet."""
    check = calls.memory_checked.acquire(blocking=False)
    load = ("function_load", (LIBRARY,)) if calls.functions else ("script_load", (SCRIPT,))
    steps = (load, ("config_get", ("maxmemory*",))) if check else (load,)
    try:
        replies = yield _Command("pipeline", steps)
    except BaseException as exc:
        if check:
            calls.memory_checked.release()  # (asked again by the next call that succeeds)
        if isinstance(exc, DRIVER_ERRORS):
            raise translate(exc) from exc
        raise
    refused = replies[0]
    # A server without functions (Redis 6.2) goes to EVALSHA for good; a user who may not
    # load a library (NOPERM) may still call one an operator loaded: the FCALL decides.
    if (
        isinstance(refused, rx.RedisError)
        and not isinstance(refused, rx.NoPermissionError)
        and _no_functions(refused)
    ):
        calls.functions = False
    if check and not isinstance(replies[1], Exception):
        warn_if_evicting(replies[1])  # (refused, NOPERM or CONFIG renamed: silent)


def _queued(runner: Any, steps: tuple[tuple[str, tuple[Any, ...]], ...]) -> Any:
    """A pipeline (no MULTI) of a "pipeline" step's commands, for either client to send:
    the sync one's execute() answers, the asyncio one's is awaited."""
    pipe = runner.pipeline(transaction=False)
    for name, args in steps:
        getattr(pipe, name)(*args)
    return pipe


def _one_slot(store_keys: list[str]) -> None:
    """On a Cluster one script reaches the keys of one hash slot only: refuse the others
    here, with what to do, rather than let the server answer CROSSSLOT."""
    slots = {key_slot(redis_keys(key)[0]) for key in store_keys}
    if len(slots) > 1:
        raise ConfigurationError(
            f"on a Redis Cluster the keys of one call must share a hash slot, and the store "
            f"keys {store_keys} do not: give every limiter of the call the same tag= (a "
            "function of its key that names what they share, e.g. the account id)"
        )


def _batcher(
    runner: Any,
    owned: bool,
    send: Send[_Command],
    new_waker: Callable[[], Any],
    wake: Callable[[Any], None],
    *,
    cluster: bool,
    gone: Callable[[Any], bool] = lambda waker: False,
) -> Batcher[_Command]:
    """A backend's queue: as many calls in flight as it has connections (CONNECTIONS, or
    fewer in a client of the user's); on a Cluster only one hash slot's operations share
    a call (a script reaches one slot), and a place opens no connection ahead: a call of
    no keys would go to any node, and each node has a pool of its own."""
    size = CONNECTIONS if owned or runner is None else min(CONNECTIONS, pool_size(runner))
    if cluster:
        return Batcher(size, send, new_waker, wake, _slot_of, gone)
    return Batcher(size, send, new_waker, wake, gone=gone, opens=True)


def _slot_of(op: Op[Any]) -> int:
    return key_slot(redis_keys(op.key)[0])


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():  # (cancelled: its task leaves the queue, or passes its place on)
        future.set_result(None)


def _copied(client: redis.asyncio.Redis) -> redis.asyncio.Redis:
    """``async_copy`` of a client it did copy before."""
    copy = async_copy(client)
    assert copy is not None
    return copy


SyncClient = redis.Redis | redis.cluster.RedisCluster
AsyncClient = redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster


class RedisBackend(Backend):
    """Limits shared through Redis: standalone, Sentinel (a master client) or Cluster.

    Give it a redis-py client, or a URL (``redis://``, ``rediss://``, ``unix://``);
    ``cluster=True`` makes a URL into a ``RedisCluster``. The script runs over
    connections of the backend's own, with bounded timeouts and no hidden retries
    (see ``_redis_clients``); a standalone or Sentinel client you pass is copied for
    that, never changed, and stays yours to close.

    >>> backend = RedisBackend(redis.Redis.from_url("redis://localhost:6379/0"))
    """

    def __init__(self, client: SyncClient | str, *, cluster: bool = False) -> None:
        self._lock = threading.Lock()
        self._url: str | None = None
        self._runner: SyncClient | None = None  # what runs the script
        self._owned = True  # whether the runner is ours to close
        self.client: SyncClient | None = None  # the client given, or built from the URL
        if isinstance(client, str):
            check_url(client)  # a malformed URL fails here, not at the first call
            if cluster:
                # A RedisCluster connects when it is built: build it at the first call
                # instead, so a Cluster that is down at start-up is an outage like any
                # other, handled by the limiter's on_unavailable.
                self._url = client
            else:
                self.client = self._runner = sync_from_url(client, cluster=False)
        elif isinstance(client, (redis.asyncio.Redis, redis.asyncio.cluster.RedisCluster)):
            raise TypeError("this is an asyncio Redis client: use AsyncRedisBackend with it")
        elif isinstance(client, redis.Redis):
            self.client = client
            self._runner = sync_copy(client)
            if self._runner is None:
                self._runner, self._owned = client, False
        elif isinstance(client, redis.cluster.RedisCluster):
            self.client = self._runner = client
            self._owned = False
        else:
            raise TypeError(f"RedisBackend needs a redis-py client or a URL, not {client!r}")
        self._repairs = RepairNotice()
        self._disagree = Disagreements()
        self._calls = _Calls()
        self._batcher = _batcher(
            self._runner,
            self._owned,
            lambda ops, queued: _script_flow(
                ops, queued, self._calls, self._repairs, self._disagree
            ),
            threading.Event,
            threading.Event.set,
            cluster=self._url is not None or isinstance(client, redis.cluster.RedisCluster),
        )

    def _connect(self) -> SyncClient:
        with self._lock:
            if self._runner is None:
                assert self._url is not None
                self.client = self._runner = sync_from_url(self._url, cluster=True)
            return self._runner

    def execute(self, op: Op[T]) -> T:
        return run(self._batcher.flow(op), self._perform)

    def _perform(self, step: _Command | Wait) -> Any:
        if isinstance(step, Wait):
            return step.waker.wait()
        # Connecting a Cluster URL's client may fail too: the flow translates it.
        runner = self._runner or self._connect()
        if step.name == "pipeline":
            return _queued(runner, step.args).execute(raise_on_error=False)
        return getattr(runner, step.name)(*step.args)

    @functools.cached_property
    def doorbell(self) -> RedisDoorbell:
        return RedisDoorbell(lambda: subscriber_clients(self._runner or self._connect()))

    def close(self) -> None:
        """Close the connections the backend opened (a client you passed stays open)."""
        if "doorbell" in self.__dict__:
            self.doorbell.close()
        runner = self._runner
        if runner is not None and self._owned:
            runner.close()
            if isinstance(runner, redis.Redis):
                runner.connection_pool.disconnect()  # a pool we gave it is not closed with it

    def _each(self, command: str, names: list[bytes]) -> list[Any]:
        """``command`` on each of ``names``, pipelined (a Cluster's pipeline sends each
        to its node): what an operator's read of many keys costs, one round trip."""
        try:
            pipe = (self._runner or self._connect()).pipeline(transaction=False)
            for name in names:
                getattr(pipe, command)(name)
            return list(pipe.execute())
        except DRIVER_ERRORS as exc:
            raise translate(exc) from exc

    def fingerprint(self, namespace: str, value: str, keep: bool = True) -> str | None:
        """As :meth:`Backend.fingerprint`."""
        op = Fingerprint(namespace_record(namespace), value, RECORD_TTL_US if keep else 0)
        return run(self._batcher.flow(op), self._perform)

    def cards(self, store_keys: Sequence[str]) -> dict[str, str]:
        keys = list(store_keys)
        found = self._each("get", [card_key(key) for key in keys])
        return {key: _text(card) for key, card in zip(keys, found, strict=True) if card}

    def all_cards(self, namespace: str | None = None) -> Iterator[tuple[str, str]]:
        """As :meth:`Backend.all_cards`: SCAN (never KEYS), CARDS_STEP keys per step, on
        every primary of a Cluster, matching the namespace's keys only."""
        prefix = re.sub(r"([*?\[\]\\])", r"\\\1", namespace_prefix(namespace))
        match = f"tc:{prefix}*:card".encode()
        try:
            runner = self._runner or self._connect()
            names: list[bytes] = []
            for name in runner.scan_iter(match=match, count=CARDS_STEP):
                names.append(name.encode() if isinstance(name, str) else name)
                if len(names) == CARDS_STEP:
                    yield from self._read_cards(names)
                    names = []
            yield from self._read_cards(names)
        except DRIVER_ERRORS as exc:
            raise translate(exc) from exc

    def pushback(self, store_keys: Sequence[str]) -> dict[str, Pushback]:
        keys = list(store_keys)
        found = self._each("hgetall", [pushback_key(key) for key in keys])
        now, told = int(time.time() * 1_000_000), {}
        for key, fields in zip(keys, found, strict=True):
            record = {_text(name): _text(value) for name, value in fields.items()}
            steps = {int(n[2:]): int(v) for n, v in record.items() if _whole(n[2:], v)}
            until = int(record["until"]) if _whole(record.get("until", "")) else 0
            said = pushback_at(record.get("reason", ""), until, steps, now)
            if said is not None:
                told[key] = said
        return told

    def _read_cards(self, names: list[bytes]) -> Iterator[tuple[str, str]]:
        keys = [name[3:-5].decode() for name in names]  # (tc:KEY:card)
        yield from self.cards(keys).items()

    def to_async(self) -> AsyncBackend:
        raise TypeError("RedisBackend wraps a sync client: AsyncLimiter needs AsyncRedisBackend")

    def check_together(self, store_keys: list[str]) -> None:
        if self._url is not None or isinstance(self.client, redis.cluster.RedisCluster):
            _one_slot(store_keys)

    def __repr__(self) -> str:
        shown = self.client if self.client is not None else "Cluster URL, connects at first use"
        return f"RedisBackend({shown!r})"


class AsyncRedisBackend(AsyncBackend):
    """The asyncio twin of :class:`RedisBackend`, over ``redis.asyncio`` clients.

    >>> backend = AsyncRedisBackend(redis.asyncio.Redis.from_url("redis://localhost"))
    """

    def __init__(self, client: AsyncClient | str, *, cluster: bool = False) -> None:
        self._owned = True
        self._runner: AsyncClient
        # How to open the backend's connections again in another event loop (None: the
        # client is the user's, used as it is).
        self._remake: Callable[[], AsyncClient] | None = None
        if isinstance(client, str):
            check_url(client)
            # An asyncio RedisCluster only connects at its first command.
            self._remake = functools.partial(async_from_url, client, cluster=cluster)
            self._runner = self._remake()
            self.client: AsyncClient = self._runner
        elif isinstance(client, (redis.Redis, redis.cluster.RedisCluster)):
            raise TypeError("this is a sync Redis client: use RedisBackend with it")
        elif isinstance(client, redis.asyncio.Redis):
            self.client = client
            copy = async_copy(client)
            self._runner, self._owned = (client, False) if copy is None else (copy, True)
            if copy is not None:
                self._remake = functools.partial(_copied, client)
        elif isinstance(client, redis.asyncio.cluster.RedisCluster):
            self.client = self._runner = client
            self._owned = False
        else:
            raise TypeError(
                f"AsyncRedisBackend needs a redis.asyncio client or a URL, not {client!r}"
            )
        self._repairs = RepairNotice()
        self._disagree = Disagreements()
        self._calls = _Calls()
        self._loop: asyncio.AbstractEventLoop | None = None  # the one its connections are of
        self._batcher = self._new_batcher()

    def _new_batcher(self) -> Batcher[_Command]:
        return _batcher(
            self._runner,
            self._owned,
            lambda ops, queued: _script_flow(
                ops, queued, self._calls, self._repairs, self._disagree
            ),
            lambda: asyncio.get_running_loop().create_future(),
            _resolve,
            cluster=isinstance(self._runner, redis.asyncio.cluster.RedisCluster),
            gone=asyncio.Future.cancelled,
        )

    async def aexecute(self, op: Op[T]) -> T:
        if asyncio.get_running_loop() is not self._loop:
            self._bind()
        return await arun(self._batcher.flow(op), self._perform)

    def _bind(self) -> None:
        """Serve the running event loop. redis.asyncio's connections belong to the loop
        that opened them: a backend used again after its loop ended (a second
        ``asyncio.run``, a test's loop) opens its connections anew; one whose loop still
        runs (in another thread) is an error. A client of the user's, used as it is, is
        the user's to open in the loop it serves."""
        loop, old = asyncio.get_running_loop(), self._loop
        if old is not None:
            if not old.is_closed() and old.is_running():
                raise RuntimeError(
                    f"{self!r} serves an event loop that still runs (in another thread): "
                    "an AsyncRedisBackend serves one loop at a time; give each loop its own"
                )
            if self._remake is not None:
                # (The old one's sockets went with its loop.) Built from a URL, the
                # client given is the runner itself.
                old_runner, self._runner = self._runner, self._remake()
                if self.client is old_runner:
                    self.client = self._runner
            self._batcher = self._new_batcher()
        self._loop = loop

    async def _perform(self, step: _Command | Wait) -> Any:
        if isinstance(step, Wait):
            return await step.waker
        if step.name == "pipeline":
            return await _queued(self._runner, step.args).execute(raise_on_error=False)
        # (redis-py types the sync and async clients' methods as one, before 8.0)
        method = getattr(self._runner, step.name)
        return await cast(Awaitable[Any], method(*step.args))

    async def afingerprint(self, namespace: str, value: str, keep: bool = True) -> str | None:
        """As :meth:`Backend.fingerprint`."""
        op = Fingerprint(namespace_record(namespace), value, RECORD_TTL_US if keep else 0)
        return await self.aexecute(op)

    def check_together(self, store_keys: list[str]) -> None:
        if isinstance(self._runner, redis.asyncio.cluster.RedisCluster):
            _one_slot(store_keys)

    async def execute(self, op: Op[T]) -> T:
        """Deprecated: ``aexecute``, the asyncio stores' name for it."""
        warnings.warn(
            "AsyncRedisBackend.execute is deprecated: use aexecute",
            DeprecationWarning,
            stacklevel=2,
        )
        return await self.aexecute(op)

    @functools.cached_property
    def doorbell(self) -> RedisDoorbell:
        return RedisDoorbell(lambda: subscriber_clients(self._runner))

    async def aclose(self) -> None:
        """Close the connections the backend opened (a client you passed stays open)."""
        if "doorbell" in self.__dict__:
            self.doorbell.close()
        if self._owned:
            # redis-py 5.0.0, the oldest allowed, has close() only; aclose() came in 5.0.1.
            close = getattr(self._runner, "aclose", None) or self._runner.close
            await close()
            if isinstance(self._runner, redis.asyncio.Redis):
                await self._runner.connection_pool.disconnect()

    def __repr__(self) -> str:
        return f"AsyncRedisBackend({self.client!r})"
