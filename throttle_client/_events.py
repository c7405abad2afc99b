"""Events: what a limiter tells those who listen.

A listener is a plain callable of one :class:`Event`, added with ``limiter.listen(fn)``
(which returns the function that removes it). Events are made only while someone
listens: a limiter without listeners pays one truth test per event it could have sent.
A listener runs in the flow that sent the event (the acquiring thread or task), so it
should be quick; one that raises is logged and the call goes on.

No field ever holds a key: an access token must not reach logs or metrics. Keys appear
as their *label*, the first characters of the key's keyed hash (its store key), the
same for every worker of a fleet that shares the key secret.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("throttle_client")

# What happened, one word each (Event.kind).
ADMITTED = "admitted"  # an acquire got its slot; ``slot``, and ``waited``: seconds slept
REFUSED = "refused"  # a try_acquire found no slot now; ``retry_after``
TIMED_OUT = "timed_out"  # an acquire's slot lay beyond its timeout; ``retry_after``
LATE_WAKEUP = "late_wakeup"  # a call woke or was answered past its slot by more than the
# margin, and books a new one; ``late_by``
PAUSED = "paused"  # a key paused for every worker; ``until``, ``reason``, ``source``
UPSTREAM_STATUS = "upstream_status"  # a throttled transport's response; ``status``, ``route``
STORE_ERROR = "store_error"  # the store failed (after retries); ``reason``: the error's class
FALLBACK = "fallback"  # on_unavailable answered instead of the store; ``reason``: the policy
LEASED = "leased"  # a capped call of this process holds a lease on the key; ``cost``
RELEASED = "released"  # and no longer does (released, or left to expire); ``cost``
KINDS = (
    ADMITTED,
    REFUSED,
    TIMED_OUT,
    LATE_WAKEUP,
    PAUSED,
    UPSTREAM_STATUS,
    STORE_ERROR,
    FALLBACK,
    LEASED,
    RELEASED,
)

LABEL_LENGTH = 8  # characters of the key's hash: 48 bits, unique among millions of keys


@dataclass(frozen=True)
class Event:
    """One thing that happened to one key of a limiter.

    ``kind`` is one of ``KINDS``; ``namespace`` the limiter's; ``key`` the key's label
    (never the key); ``time`` the wall clock, epoch seconds. The other fields belong to
    some kinds and keep their defaults for the rest:

    - ``cost``: the units asked (admitted, refused, timed_out, late_wakeup, leased,
      released);
    - ``waited``: seconds slept for the slot (admitted);
    - ``slot``: the slot the call was admitted at, epoch seconds on the store's clock:
      the ``Decision.slot`` the call returns (admitted);
    - ``retry_after``: seconds until a slot could be had (refused, timed_out);
    - ``late_by``: seconds past the slot, on the store's clock (late_wakeup);
    - ``until``: the pause's end, epoch seconds on the store's clock (paused);
    - ``reason``: why: for a pause a transport set, the header it came from
      ("Retry-After", "X-RateLimit-Reset", ...) or "backoff" (a refusal that named no
      time; empty for ``limiter.pause``); for store_error, the error's class
      ("ConnectionError", "TimeoutError", ...); for fallback, the ``on_unavailable``
      policy ("allow", or "local" for a LocalFallback);
    - ``source``: who paused: "caller" (``limiter.pause``) or "upstream" (a transport
      read it in a response);
    - ``status``: the HTTP status (upstream_status);
    - ``route``: the request's method and host, and the path of the ``Route`` it
      matched ("GET api.github.com/search"; "GET api.github.com" when none matched):
      never the request's own path, which may carry a secret or an id per call
      (upstream_status, and a pause a transport set).

    The slots a process's calls got, per key label::

        slots = defaultdict(list)
        limiter.listen(lambda e: e.kind == "admitted" and slots[e.key].append(e.slot))
    """

    kind: str
    namespace: str
    key: str
    time: float
    cost: int = 0
    waited: float = 0.0
    retry_after: float = 0.0
    late_by: float = 0.0
    until: float = 0.0
    reason: str = ""
    source: str = ""
    status: int = 0
    route: str = ""
    slot: float = 0.0


Listener = Callable[[Event], object]


def key_label(store_key: str) -> str:
    """A key's label from its store key (``ns:{digest}``, or ``ns:{tag}digest``): the
    first LABEL_LENGTH characters of the key's own digest."""
    digest = store_key.rsplit("}", 1)[1] or store_key[store_key.index("{") + 1 : -1]
    return digest[:LABEL_LENGTH]


class Listeners:
    """A limiter's listeners. Added and removed under a lock; sending reads a snapshot
    (a tuple), so a listener may add or remove listeners, itself included."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Each addition with a token of its own: removing one (once, or twice) never
        # removes another addition of the same function.
        self._all: tuple[tuple[object, Listener], ...] = ()

    def __bool__(self) -> bool:
        return bool(self._all)

    def add(self, listener: Listener) -> Callable[[], None]:
        if not callable(listener):
            raise TypeError(f"a listener must be a function of one Event, not {listener!r}")
        token = object()
        with self._lock:
            self._all += ((token, listener),)

        def remove() -> None:
            with self._lock:
                self._all = tuple(entry for entry in self._all if entry[0] is not token)

        return remove

    def send(self, event: Event) -> None:
        for _, listener in self._all:
            try:
                listener(event)
            except Exception:  # a listener's bug must not fail the call it watches
                log.warning("an event listener raised", exc_info=True)
