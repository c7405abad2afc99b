"""Limits learned from the upstream, written once for both worlds.

A response's quota headers say how many calls the upstream still allows until its
reset. A view stricter than the limiter's rates becomes the key's learned limit in the
store, for every worker, until that reset (``max_pause`` at most); a looser one is
only reported. The limit counts from the answered call's *mark*: the key's running total
(every unit its log admitted since the key began) up to that call's slot less the
margin, which the store reports when it admits the call (``Decision._mark``). The limiter
keeps the last view read per key for ``usage().upstream``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from ._backends.base import Learn
from ._calls import execute_flow
from ._config import US
from ._core import LimiterCore
from ._errors import BackendError, ConfigurationError
from ._feedback import ABSURD, Problem, QuotaView, read_feedback
from ._flow import Flow
from ._rate import bounded_seconds
from ._results import Decision, UpstreamView

log = logging.getLogger("throttle_client")

# The longest a learned limit holds by default (seconds), as RetryPolicy.max_pause's: a
# reset further off is more often a bug upstream than advice.
DEFAULT_MAX_PAUSE = 300.0
# How many keys' last quota headers a limiter keeps for usage().upstream.
UPSTREAM_VIEWS = 4096


def learn_checked(
    core: LimiterCore, decision: object, headers: Any, max_pause: float
) -> QuotaView | None:
    """learn()'s arguments checked, and the headers read (once): what they say of the
    quota. Header values it cannot read are reported, once per header."""
    if not isinstance(decision, Decision) or not decision.allowed:
        raise ConfigurationError(
            f"learn() needs the Decision of an admitted call (the one the response "
            f"answers), not {decision!r}"
        )
    bounded_seconds(max_pause, "max_pause")
    feedback = read_feedback(
        200, headers, now=core._wall(), max_pause=ABSURD, fallback=0, quota=True
    )
    report_problems(core, feedback.problems)
    return feedback.view


def report_problems(core: LimiterCore, problems: Iterable[Problem], where: str = "") -> None:
    """Header values that could not be read, at WARNING the first time a limiter meets
    each header, at DEBUG after (a fleet would repeat it on every call)."""
    for problem in problems:
        level = logging.DEBUG if problem.header in core._told_headers else logging.WARNING
        core._told_headers.add(problem.header)
        log.log(level, "%s%s", problem.message, where)


def learn_flow(
    core: LimiterCore,
    key: str,
    decision: Decision,
    view: QuotaView | None,
    now: float,
    max_pause: float,
) -> Flow[tuple[QuotaView | None, float]]:
    """What a response's quota headers said (``view``, read by ``read_feedback``) of
    the call ``decision`` admitted: a view stricter than the rates is kept in the
    store, for ``max_pause`` seconds at most. Returns the view and the local time after."""
    if view is None or not decision.remaining:
        return view, now
    span = min(view.resets_in, max_pause)
    until = core._pacing.store_time_us(now) + round(span * US)
    slot = decision._slot_us if decision._slot_us >= 0 else round(decision.slot * US)
    since = slot - core._config.margin_us
    # It counts from the answered call's slot (less the margin), so the calls admitted
    # while its answer was on its way count too: stricter is fewer, itself included,
    # than the rates could let through over that whole span.
    allows = core._config.allows(max(0, until - since) / US)
    stricter = view.remaining + decision.cost < allows
    store_key = core.store_key(key)
    views = core._upstream
    views[store_key] = UpstreamView(view.remaining, until / US, view.limit, stricter)
    views.move_to_end(store_key)
    if len(views) > UPSTREAM_VIEWS:
        views.popitem(last=False)
    if not core._learns:  # (a store that keeps no learned limit: the view is only read)
        return view, now
    if not stricter:
        if not core._told_looser:
            core._told_looser = True
            log.info(
                "the upstream allows more than %r is configured for "
                "(%s says %d left for %.0fs; the rates allow at most %d): the "
                "configured limits stay",
                core,
                view.header,
                view.remaining,
                view.resets_in,
                allows,
            )
        return view, now
    # Every call whose slot lies from this one's less the margin on may have reached
    # the upstream after it, so may not be in the count the header gave: each is
    # counted against what it said remained (those it did count, twice: under-use
    # by at most the calls in flight, never over-use). This call itself too, hence
    # its cost on top.
    op = Learn(
        key=store_key,
        quota=core._plan.quota_at(now),
        since_us=since,
        until_us=until,
        limit=view.remaining + decision.cost,
        now_us=core._plan.at(now),
        from_cum=decision._mark,
        born=decision._born,
        cards=core._plan.card_of(store_key),  # (a learned limit may outlast the card)
    )
    log.debug(
        "the upstream says %d left for %.1fs (%s), fewer than the "
        "rates allow (at most %d): held to it",
        view.remaining,
        view.resets_in,
        view.header,
        allows,
    )
    try:
        _, _, now = yield from execute_flow(core, op, now)
    except BackendError as exc:  # the response stands; the configured rates still hold
        log.warning("could not keep what the upstream said: %s", exc)
    return view, now
