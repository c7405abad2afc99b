"""How an operation goes to the Redis script: its KEYS and ARGV (see the header of
lua/core.lua), one operation or a batch of them in one call.

Every decision of a limiter sends the same keys and quota: both are formatted once (as
bytes, which redis-py sends as they are) and remembered, not rebuilt per call. A batch
packs each operation as one msgpack argument, since redis-py spends ~2 µs on every
argument of a command.
"""

from __future__ import annotations

import functools
from typing import Any

from . import history
from .history import HistorySpec
from .ops import (
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
    Reset,
    StoreCard,
)
from .quota import Buckets, Quota


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


def as_text(value: bytes | str) -> str:
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


def _call(call_id: str, retry: bool) -> bytes:
    """A call's id as the script reads it: "~" before a retry's (the one attempt that has
    the script look for a booking of its id), "=" before a first attempt's; a limiter's
    id (12 hex digits) as its 6 bytes, which an entry keeps."""
    try:
        packed = bytes.fromhex(call_id) if len(call_id) == 12 else call_id.encode()
    except ValueError:
        packed = call_id.encode()
    return (b"~" if retry else b"=") + packed


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
        call = _call(op.call_id, op.retry)
        if leased:
            return keys, (b"lease", marks, now, wait, call, lead, op.lease_id, *per_key)
        return keys, (b"acquire_all", marks, now, wait, call, lead, *per_key)
    if isinstance(op, AcquireAny):
        return _any(op, now, queued_us)
    assert isinstance(op, (Acquire, Inspect, Pause, Learn))
    keys, quota = redis_keys(op.key), quota_arg(op.quota)
    if isinstance(op, Acquire):
        cost, wait = b"%d" % op.cost, _wait(op.max_wait_us, queued_us)
        call = _call(op.call_id, op.retry)
        if op.history or op.mark_us >= 0 or op.expect >= 0:
            lead, marks, expect = (
                b"%d" % op.lead_us,
                b"%d" % op.mark_us,
                _expected(op.expect, op.seen),
            )
            args = (b"acquire", quota, now, cost, wait, call, lead, marks, expect)
            if op.history:  # its usage history in its own arguments (no item: declared)
                return (*keys, history_key(op.key)), args + _history_args(op.history[0])
            return keys, args
        if op.lead_us:
            lead = b"%d" % op.lead_us
            return keys, (b"acquire", quota, now, cost, wait, call, lead)
        return keys, (b"acquire", quota, now, cost, wait, call)
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


def _any(
    op: AcquireAny, now: bytes, queued_us: int
) -> tuple[tuple[bytes, ...], tuple[bytes | str, ...]]:
    """A pool's call: what its keys share once (the quota, the call, its usage history's
    periods), then what each key's log knows of its life; KEYS: each key's log and meta,
    and its usage history when kept."""
    spec = op.history[0] if op.history else None
    kept = _history_args(spec) if spec else ()
    keys: tuple[bytes, ...] = ()
    expects = [_expected(op.expect, op.seen)]
    for key in op.keys:
        keys += redis_keys(key) + ((history_key(key),) if spec else ())
    expects += [_expected(other.expect, other.seen) for other in op.others]
    call = (b"%d" % op.cost, _wait(op.max_wait_us, queued_us), _call(op.call_id, op.retry))
    marks = (b"%d" % op.lead_us, b"%d" % op.mark_us, b"%d" % len(kept))
    if op.partners:  # keys its tokens share: their keys and arguments after the pool's
        shared: tuple[bytes | str, ...] = (b"%d" % len(op.partners),)
        for partner in op.partners:
            keys += redis_keys(partner.key)
            shared += (quota_arg(partner.quota), b"%d" % partner.cost)
            shared += (_expected(partner.expect, partner.seen),)
        args = (b"acquire_any_also", quota_arg(op.quota), now, *call, *marks, *shared)
        return keys, (*args, *kept, *expects)
    return keys, (b"acquire_any", quota_arg(op.quota), now, *call, *marks, *kept, *expects)


def _expected(born: int, seen: int) -> bytes:
    """A key's life as a worker knows it (Acquire.expect, Acquire.seen): "born,total"."""
    return b"-1" if born < 0 else b"%d,%d" % (born, max(0, seen))


def _cap_args(quota: Quota) -> tuple[bytes, bytes]:
    return b"%d" % quota.max_concurrent, b"%d" % quota.lease_ttl_us


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
    if alone(ops):
        return encode(ops[0], int(queued[0] * 1_000_000) if queued else 0)
    waits = [int(q * 1_000_000) for q in queued] if queued else [0] * len(ops)
    items: list[tuple[tuple[bytes, ...], tuple[bytes | str, ...]]] = []
    for op, queued_us in zip(ops, waits, strict=True):
        now = b"-" if op.now_us is None else b"%d" % op.now_us
        items += [_history_item(spec, now) for spec in declared(op)]
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


def alone(ops: list[Op[Any]]) -> bool:
    """Whether a call carries one operation and nothing beside it (no history declared
    before it, no card after it): the common case, sent and answered as it is, not as
    a batch."""
    return len(ops) == 1 and not declared(ops[0]) and not getattr(ops[0], "cards", ())


def declared(op: Op[Any]) -> tuple[HistorySpec, ...]:
    """The histories an operation's call declares in items of their own, before it: a
    stacked call's (an acquire carries its own in its arguments)."""
    if isinstance(op, AcquireAny):  # (the pool's keys carry theirs in its arguments)
        return op.partner_history
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
