"""``throttle-client top``: the keys in use in a store, nearest their limits first.

It reads the store only: every key's card (:class:`throttle_client.Card`: its label and
the rules its limiters keep, written beside it by their decisions), found with SCAN in
steps of bounded cost (never KEYS), then each key's usage under those rules, one read
(``Limiter.usage(store_key=...)``) per key. At most ``scan_limit`` keys are read per
look: a store of more keys shows the fullest of those read, and says that it stopped
there. A key the store refuses to read (damaged: see ``sliding_log``, "partial state")
is left out with a warning, and the look names it; a store that cannot be reached fails
the look.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

from throttle_client import (
    Backend,
    BackendError,
    BackendUnavailable,
    Card,
    ConfigurationError,
    Limiter,
    key_label,
)

SCAN_LIMIT = 10_000  # keys read per look, by default
logger = logging.getLogger("throttle_client")


@dataclass(frozen=True)
class RateRow:
    rate: str
    used: int
    booked: int
    limit: int


@dataclass(frozen=True)
class KeyRow:
    """One key as ``top`` shows it."""

    label: str  # the user's label (label=), else the first characters of its hash
    store_key: str
    namespace: str
    rates: tuple[RateRow, ...]
    fullness: float  # the most of any limit used or booked (1.0: at the limit)
    paused_for: float  # seconds of a pause in force (0: none)
    paused_until: float  # its end, epoch seconds (0: none)
    reason: str | None  # why, when a transport set it: the header, or "backoff"
    refused: int  # the calls the upstream refused (429) in the last minute
    booked: int  # units booked ahead: calls waiting for their slots
    in_flight: int | None  # a capped key: its calls in flight, and its cap
    max_concurrent: int | None
    waiting: int | None  # a capped key: calls queued for room
    learned: tuple[int, int] | None  # a limit learned from the upstream: used, limit


@dataclass(frozen=True)
class Look:
    """One look at the store: its keys, fullest first."""

    keys: tuple[KeyRow, ...]
    read: int  # keys whose card was read
    unreadable: int  # cards this version cannot read (another version's, or damaged)
    truncated: bool  # more keys than scan_limit: not all were read
    damaged: tuple[str, ...] = ()  # store keys whose usage the store refused to read

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def look(backend: Backend, namespace: str | None = None, scan_limit: int = SCAN_LIMIT) -> Look:
    """Read every key's card (up to ``scan_limit``) in ``backend``, of ``namespace`` or
    of any, and each key's usage under its rules."""
    limiters: dict[Card, Limiter] = {}  # one per set of rules
    rows, read, unreadable, truncated = [], 0, 0, False
    damaged: list[str] = []
    for store_key, text in backend.all_cards(namespace):
        if read == scan_limit:
            truncated = True
            break
        read += 1
        card = Card.parse(text)
        if card is None:
            unreadable += 1
            continue
        if namespace is not None and card.namespace != namespace:
            continue
        rules = dataclasses.replace(card, label=None)
        limiter = limiters.get(rules)
        if limiter is None:
            try:
                limiter = limiters[rules] = Limiter(
                    backend,
                    rates=list(card.rates),
                    min_interval=card.min_interval,
                    margin=card.margin,
                    namespace=card.namespace,
                    max_concurrent=card.max_concurrent,
                )
            except ConfigurationError:  # rules this version cannot keep: as unreadable
                unreadable += 1
                continue
        try:
            rows.append(_row(store_key, card, limiter))
        except BackendUnavailable:
            raise  # the store, not this key: no look at all
        except BackendError as exc:  # this key only: the others are shown
            logger.warning("top left out store key %s: %s", store_key, exc)
            damaged.append(store_key)
    told = backend.pushback([row.store_key for row in rows])
    for number, row in enumerate(rows):
        said = told.get(row.store_key)
        if said is not None:
            # The reason holds if the pause in force is the transport's (not a caller's
            # longer one, set since).
            ends = said.until is not None and abs(said.until - row.paused_until) < 0.001
            reason = said.reason if row.paused_for and ends else None
            rows[number] = dataclasses.replace(row, reason=reason, refused=said.refused)
    rows.sort(key=lambda row: (row.paused_for > 0, row.fullness, row.booked), reverse=True)
    return Look(tuple(rows), read, unreadable, truncated, tuple(damaged))


def _row(store_key: str, card: Card, limiter: Limiter) -> KeyRow:
    usage = limiter.usage(store_key=store_key)
    rates = tuple(RateRow(str(r.rate), r.used, r.booked, r.rate.limit) for r in usage.rates)
    shares = [(r.used + r.booked) / r.limit for r in rates]
    if usage.in_flight is not None and card.max_concurrent:
        shares.append(usage.in_flight / card.max_concurrent)
    learned = None
    if usage.learned is not None:
        learned = (usage.learned.used, usage.learned.limit)
        shares.append(usage.learned.used / usage.learned.limit if usage.learned.limit else 1.0)
    return KeyRow(
        label=card.label or key_label(store_key),
        store_key=store_key,
        namespace=card.namespace,
        rates=rates,
        fullness=round(max(shares), 6),
        paused_for=round(usage.paused_for, 6),
        paused_until=usage.paused_until or 0.0,
        reason=None,
        refused=0,
        booked=rates[0].booked,
        in_flight=usage.in_flight,
        max_concurrent=card.max_concurrent,
        waiting=usage.waiting,
        learned=learned,
    )


def text_table(view: Look, rows: int) -> str:
    """The look as plain text: one line per key, the fullest ``rows``."""
    shown = view.keys[:rows]
    width = max([5, *(len(row.label) for row in shown)])
    space = max([9, *(len(row.namespace) for row in shown)])
    head = f"{'label':<{width}} {'namespace':<{space}} {'full':>5}  {'paused':>8}  {'429s':>4}"
    lines = [f"{head}  {'ahead':>5}  rates"]
    for row in shown:
        rates = ", ".join(f"{r.used}+{r.booked}/{r.limit} per {r.rate}" for r in row.rates)
        if row.max_concurrent:
            rates += f", in flight {row.in_flight}/{row.max_concurrent}, queued {row.waiting}"
        if row.learned is not None:
            rates += f", learned {row.learned[0]}/{row.learned[1]}"
        paused = f"{row.paused_for:.1f} s" if row.paused_for else "-"
        if row.reason:
            rates += f", paused on {row.reason}"
        lines.append(
            f"{row.label:<{width}} {row.namespace:<{space}} {_percent(row.fullness):>5}  "
            f"{paused:>8}  {row.refused:>4}  {row.booked:>5}  {rates}"
        )
    lines.append(footer(view, rows))
    return "\n".join(lines)


def footer(view: Look, rows: int) -> str:
    shown = min(rows, len(view.keys))
    parts = [f"{shown} of {len(view.keys)} keys shown"]
    if view.truncated:
        parts.append(f"stopped after reading {view.read} key(s) (--scan-limit)")
    if view.unreadable:
        parts.append(f"{view.unreadable} cards of another version skipped")
    if view.damaged:
        keys = ", ".join(view.damaged)
        parts.append(f"{len(view.damaged)} damaged key(s) left out, reset them: {keys}")
    return "; ".join(parts)


def _percent(share: float) -> str:
    return "inf" if math.isinf(share) else f"{share:.0%}"
