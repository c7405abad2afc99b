"""A key's card: what the store keeps beside a key so that an operator can read it
without the key: its label, and the limiter's namespace and rules.

Keys are hashed in the store, so ``throttle-client status`` and ``top`` cannot say which
token is which, nor, for ``top``, what its limits are. Each limiter sends a key's card
with a decision on that key (in the same atomic step: no round trip of its own), the
first in this process and again every half of the key's horizon, so that the card lasts
while the key does: the store gives it the key's TTL, or the horizon if longer.

A label is the user's (``label=``: a function of the key, such as "account 42"), or none;
the card never holds the key itself.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal

from ._errors import ConfigurationError
from ._events import key_label
from ._rate import Rate

log = logging.getLogger("throttle_client")

MAX_LABEL = 64  # characters
# Keys whose label and card's next send a limiter keeps in mind, the newest: one past
# them has its label asked and its card sent again (a process with more keys in use
# sends their cards more often). About 6 MB at most.
REMEMBERED = 1 << 15


def checked_label(value: object, key: str) -> str | None:
    """What ``label(key)`` returned, checked: a short printable string that does not
    hold the key (a label is stored and shown; a key may be a secret), or None for no
    label of the user's (the key then shows as its hash's). An error never shows the
    value, which may hold the key: only its type or length."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigurationError(
            f"label= must return a string (or None), not a {type(value).__name__}"
        )
    if len(key) >= 4 and key in value:
        raise ConfigurationError("label= returned a label that holds the key itself")
    if not 1 <= len(value) <= MAX_LABEL:
        raise ConfigurationError(
            f"label= must return 1 to {MAX_LABEL} characters, not {len(value)}"
        )
    if not value.isprintable() or not value.strip():
        raise ConfigurationError("label= returned a label that is blank or not printable")
    return value


def rate_text(rate: Rate) -> str:
    """``rate`` as Rate.parse reads it back, equal where it can be (str() gives a period
    6 digits, in an exponent when very short or long, which Rate.parse does not read).
    One it cannot write so makes a card no reader reads (counted, not shown): never an
    error in the decision that carries it."""
    text = str(rate)
    if _reads_back(text, rate):
        return text
    buckets = f" in {rate.buckets} buckets" if rate.buckets else ""
    return f"{rate.limit}/{format(Decimal(repr(rate.period)), 'f')}s{buckets}"


def _reads_back(text: str, rate: Rate) -> bool:
    try:
        return Rate.parse(text) == rate
    except ConfigurationError:
        return False


@dataclass(frozen=True)
class Card:
    """A key's card: a small record (JSON) that the limiters using a key write into the
    store beside it, with their decisions, so that an operator (``throttle-client status``
    and ``top``) can tell what a hashed key is and how it is limited. It holds the key's
    ``label`` (``label=``; None when they give none), their ``namespace`` and their rules.
    ``Backend.cards()`` and ``Backend.all_cards()`` read the JSON, ``Card.parse`` reads a
    card from it."""

    label: str | None
    namespace: str
    rates: tuple[str, ...]  # as Rate.parse reads them
    min_interval: float = 0.0
    margin: float = 0.0
    max_concurrent: int | None = None
    zone: str | None = None  # the zone of its usage history's periods; None: none kept

    def text(self) -> str:
        fields = {
            "label": self.label,
            "namespace": self.namespace,
            "rates": list(self.rates),
            "min_interval": self.min_interval,
            "margin": self.margin,
            "max_concurrent": self.max_concurrent,
            "zone": self.zone,
        }
        return json.dumps(fields, separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def parse(cls, text: str | bytes) -> Card | None:
        """The card ``text`` holds, or None if it holds none this version can read
        (another version's, or damaged): a reader shows what it can."""
        try:
            fields = json.loads(text)
            card = cls(
                label=fields["label"],
                namespace=fields["namespace"],
                rates=tuple(fields["rates"]),
                min_interval=fields.get("min_interval", 0.0),
                margin=fields.get("margin", 0.0),
                max_concurrent=fields.get("max_concurrent"),
                zone=fields.get("zone"),
            )
        except (ValueError, TypeError, KeyError, AttributeError):
            return None
        return card if card._sound() else None

    def _sound(self) -> bool:
        """Whether a limiter can be made from the card, and its label shown as it is."""
        label, cap = self.label, self.max_concurrent
        if label is not None and not (
            isinstance(label, str) and 1 <= len(label) <= MAX_LABEL and label.isprintable()
        ):
            return False
        if not isinstance(self.namespace, str) or not self.namespace.isprintable():
            return False
        if not self.rates or not all(isinstance(r, str) for r in self.rates):
            return False
        if self.zone is not None and not (isinstance(self.zone, str) and self.zone.isprintable()):
            return False
        seconds = (self.min_interval, self.margin)
        if not all(_number(x) and 0 <= x < 1e9 for x in seconds):
            return False
        if cap is not None and not (isinstance(cap, int) and not isinstance(cap, bool) and cap > 0):
            return False
        try:
            for rate in self.rates:
                Rate.parse(rate)
        except ConfigurationError:
            return False
        return True


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


class Cards:
    """One limiter's memory of its keys' labels and of when each key's card is next due
    in the store (local clock), for the newest REMEMBERED keys: a key forgotten here only
    has its label asked again and its card sent again."""

    def __init__(self, label: Callable[[str], str] | None, card: Card, every: float) -> None:
        if label is not None and not callable(label):
            raise TypeError(f"label must be a function of a key, not {label!r}")
        self._label = label
        self._card = card  # (its label: each key's own)
        self._every = every  # seconds between sends of one key's card
        # Store key -> the user's label, "" for none (asked once).
        self._labels: OrderedDict[str, str] = OrderedDict()
        self._due: OrderedDict[str, float] = OrderedDict()  # store key -> next send
        self._lock = threading.Lock()

    def label(self, store_key: str, key: str | None = None) -> str | None:
        """The user's label of the key (asked once, with ``key``), or None."""
        if self._label is None:
            return None
        known = self._labels.get(store_key)
        if known is not None or key is None:
            return known or None
        failed = None
        try:
            given = self._label(key)
        except Exception as exc:  # (its message may hold the key: a KeyError's does)
            failed = type(exc).__name__
        if failed is not None:  # (raised out here: nothing of the first is attached)
            raise ConfigurationError(
                f"label= raised {failed} (a label function must return a string, or None "
                "for no label of its own, for every key)"
            )
        value = checked_label(given, key)
        with self._lock:
            self._labels[store_key] = value or ""
            if len(self._labels) > REMEMBERED:
                self._labels.popitem(last=False)
        return value

    def known(self, store_key: str) -> bool:
        """Whether the key's label is known here (always, without a label function)."""
        return self._label is None or store_key in self._labels

    def text(self, store_key: str) -> str:
        """The card of a key whose label was asked (``label``)."""
        return dataclasses.replace(self._card, label=self.label(store_key)).text()

    def due(self, store_key: str, now: float) -> bool:
        """Whether a decision made now carries the key's card; if so, the next is due
        later (a call that did not reach the store gives it back: ``unsent``)."""
        with self._lock:
            if self._due.get(store_key, now) > now:
                return False
            self._due[store_key] = now + self._every
            self._due.move_to_end(store_key)
            if len(self._due) > REMEMBERED:
                self._due.popitem(last=False)
            return True

    def unsent(self, store_key: str) -> None:
        with self._lock:
            self._due.pop(store_key, None)


class Disagreements:
    """Says when workers disagree about a key: a card a decision replaced held other
    rules (rates, gap, margin, cap) than the one it wrote, so two workers hold one key to
    different quotas, and the looser lets more through than the upstream allows. One
    WARNING per key, for the newest REMEMBERED keys (a fleet would repeat it per call)."""

    def __init__(self) -> None:
        self._told: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, store_key: str, theirs: str | bytes, ours: str) -> None:
        """``theirs``: the card the store held for ``store_key``; ``ours``: the one written."""
        before, now = Card.parse(theirs), Card.parse(ours)
        if before is None or now is None or _rules(before) == _rules(now):
            return
        with self._lock:
            if store_key in self._told:
                return
            self._told[store_key] = None
            if len(self._told) > REMEMBERED:
                self._told.popitem(last=False)
        label = now.label or before.label or key_label(store_key)
        log.warning(
            "workers disagree about key %s (namespace %r): this one holds it to %s, another "
            "to %s. Each holds the key to its own rules only, so the looser one lets more "
            "calls through than the other allows: give every worker of a key the same rates, "
            "min_interval, margin and max_concurrent",
            label,
            now.namespace,
            _said(now),
            _said(before),
        )


def _rules(card: Card) -> tuple[object, ...]:
    return (card.namespace, card.rates, card.min_interval, card.margin, card.max_concurrent)


def _said(card: Card) -> str:
    rules = f"rates {list(card.rates)}, min_interval={card.min_interval:g}, margin={card.margin:g}"
    return rules + (f", max_concurrent={card.max_concurrent}" if card.max_concurrent else "")
