"""What a store keeps beside its keys' logs, written once for the stores that run the
algorithm in Python (memory, SQLite); the Redis script does the same in Lua.

Beside a key's log a store keeps its card (``_cards``), its pushback (``pushback``) and
its usage history (``history``), each written in the atomic step of the operation that
carries it; and, per namespace, the record of its key secret (``ops.Fingerprint``). The
rules are the same in every store: a store only says where it keeps them, through a
:class:`BesideView` of its storage inside that step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from . import history
from .answers import Verdict
from .ops import Acquire, AcquireAll, Op, Pause, Reset, history_cost
from .pushback import PushbackRecord, pushed_back


class BesideView(Protocol):
    """Where a store keeps what lies beside its keys, inside one atomic step."""

    def card(self, key: str, now: int) -> str | None:
        """The key's card, if one is in force at ``now``."""

    def keep_card(self, key: str, text: str, expires: int) -> None:
        """Keep ``text`` as the key's card until ``expires`` at least."""

    def pushback_of(self, key: str) -> PushbackRecord | None:
        """The key's pushback as kept (reason, pause end, refusals per step), if any."""

    def keep_pushback(self, key: str, record: PushbackRecord, now: int) -> None: ...

    def history_of(self, key: str, now: int) -> dict[str, int]:
        """The key's usage history, to count a call in (``history.record``)."""

    def keep_history(self, key: str, fields: dict[str, int], expires: int) -> None: ...

    def forget(self, key: str) -> None:
        """A reset: the key's pushback and history go, and its card if it does not go
        with its log already."""


class Lives(Protocol):
    """A key's log as far as its card is concerned: when the store may forget it."""

    expires_at: int


def write(
    op: Op[Any],
    result: object,
    logs: Sequence[Lives],
    counts: bool,
    now: int,
    view: BesideView,
    disagree: Callable[[str, str, str], None],
) -> None:
    """Keep what ``op``, answered ``result`` at ``now``, says beside its keys: its cards
    (``disagree`` hears of a card in force that says otherwise), a transport's pause as
    the key's pushback, a reset's forgetting, and, if ``counts`` (``history.counts``)
    and it was admitted, the call in its keys' usage histories."""
    for card in getattr(op, "cards", ()):
        lives = max((log.expires_at for log in logs), default=0)
        before = view.card(card.key, now)
        if before is not None and before != card.text:
            disagree(card.key, before, card.text)
        view.keep_card(card.key, card.text, max(lives, now + card.ttl_us))
    if isinstance(op, Pause) and (op.reason or op.refused):
        assert isinstance(result, int)
        record = view.pushback_of(op.key) or ("", 0, {})
        view.keep_pushback(op.key, pushed_back(record, op, result, now), now)
    if isinstance(op, Reset):
        view.forget(op.key)
    if counts and isinstance(result, Verdict) and result.allowed:
        assert isinstance(op, (Acquire, AcquireAll))
        for spec in op.history:
            fields = view.history_of(spec.key, now)
            history.record(fields, spec, result.slot_us, history_cost(op, spec.key))
            view.keep_history(spec.key, fields, result.slot_us + history.kept_us(spec.keep))


def kept_record(held: str | None, value: str, keep: bool) -> tuple[str | None, bool]:
    """A namespace's record (``ops.Fingerprint``) that holds ``held`` (None: none in
    force), asked to keep ``value``: the fingerprint to answer, and whether the store
    writes ``value`` as the record for another term. A record holding another
    fingerprint is kept as it is, and answered; with ``keep`` False nothing is written."""
    if held is None:
        return (value, True) if keep else (None, False)
    return held, keep and held == value
