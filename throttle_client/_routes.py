"""What a throttled transport is told: routes (which limiter, key and cost a request
has), the other limiters a request is charged to, token pools, and the retry policy."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Generic, TypeVar

import httpx

from ._errors import ConfigurationError
from ._limiter import AsyncLimiter, Limiter
from ._rate import bounded_seconds, to_seconds

IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"})

L = TypeVar("L", Limiter, AsyncLimiter)
KeyFunc = Callable[[httpx.Request], str]
CostFunc = Callable[[httpx.Request], int]
# Another limiter a request is charged to: with a function of the request for its key,
# and optionally the cost charged there (an int, or a function of the request).
AlsoSpec = tuple[L, KeyFunc] | tuple[L, KeyFunc, int | CostFunc]
# Which of a request's limiters (its own, and those of also=) a pause its response asks
# for holds: a function of the response (its status, its headers, its request) that
# returns them (one or several), or None for the request's own. By default, the
# request's own limiter only: a 429 on one token does not pause the account that token
# shares with others, unless the response says it was the account's.
PausesFunc = Callable[[httpx.Response], Iterable[L] | L | None]


def bearer(request: httpx.Request, token: str) -> None:
    """Send ``request`` with ``token`` as its bearer token (``Authorization: Bearer``)."""
    request.headers["Authorization"] = f"Bearer {token}"


@dataclass(frozen=True, repr=False)
class TokenPool:
    """Tokens of one quota each, used as one (``Limiter.acquire_any``): each request to
    ``host`` goes out with the token whose slot is earliest, which ``apply`` sets on it
    (by default as its bearer token). Each token stays within its limiter's rates and
    gap, and a token its upstream paused is passed over until its pause ends.

    The tokens are sent to ``host`` only (as a route's: ``"api.github.com"``, or with a
    port, ``"127.0.0.1:8080"``), over https, unless the host is a loopback one or names
    its port (a redirect to plain http gets no token): a request to another host, a
    redirect to one among them,
    passes as if there were no pool (the token is set on a copy of the request, which
    httpx does not follow a redirect from). With the default ``apply``, a request that
    carries its own ``Authorization`` header keeps it, and is keyed by it; a custom
    ``apply`` is given every request to ``host``, and decides (it may leave a request
    that carries credentials of its own as it is, but that request is still charged to
    the token it was given).

    With the transport's or route's ``also=`` (an account the tokens share), each request
    is charged to those keys too, and takes the token whose slot with them is earliest;
    their key functions see the request before its token is set.

    >>> pool = TokenPool(["ghp_a", "ghp_b", "ghp_c"], host="api.github.com")
    >>> ThrottledTransport(token_limiter, pool=pool)
    >>> def api_key(request, key):
    ...     request.headers["X-Api-Key"] = key
    >>> TokenPool(keys, host="api.example.com", apply=api_key)
    """

    tokens: Sequence[str]
    host: str = field(kw_only=True)
    apply: Callable[[httpx.Request, str], None] = field(default=bearer, kw_only=True)
    _name: str = field(default="", init=False, compare=False)
    _port: int | None = field(default=None, init=False, compare=False)

    def __repr__(self) -> str:  # (never the tokens: a repr reaches tracebacks and logs)
        n = len(self.tokens)
        return f"TokenPool({n} token{'s' * (n != 1)}, host={self.host!r})"

    def serves(self, request: httpx.Request) -> bool:
        """Whether ``request`` goes out with a token of the pool: it is sent to the pool's
        host, and (with the default ``apply``) carries no ``Authorization`` of its own."""
        if not _at(request, self._name, self._port):
            return False
        if request.url.scheme != "https" and self._port is None and self._name not in _LOOPBACK:
            return False  # (a redirect down to http: no token in the clear)
        return self.apply is not bearer or "authorization" not in request.headers

    def __post_init__(self) -> None:
        if isinstance(self.tokens, (str, bytes)) or not isinstance(self.tokens, Sequence):
            raise TypeError(f"TokenPool takes a list of tokens, not a {type(self.tokens).__name__}")
        tokens = tuple(self.tokens)
        if not tokens:
            raise ConfigurationError("a TokenPool needs one or more tokens: it was given none")
        for place, token in enumerate(tokens, 1):  # (named by place: a token is a secret)
            if not isinstance(token, str) or not token:
                what = "an empty string" if token == "" else f"a {type(token).__name__} value"
                raise ConfigurationError(f"a TokenPool's token #{place} is {what}, not a token")
            if not token.isprintable() or (self.apply is bearer and not token.isascii()):
                raise ConfigurationError(
                    f"a TokenPool's token #{place} holds a character no header may carry "
                    "(a control character, a line break; or, for the default apply, one "
                    "outside ASCII)"
                )
        if len(set(tokens)) != len(tokens):
            raise ConfigurationError(
                f"a TokenPool was given a token twice (token #{_first_repeat(tokens) + 1}): "
                "give each once"
            )
        if not callable(self.apply):
            raise TypeError(
                "TokenPool(apply=) takes a function (request, token) that sets the token "
                f"on the request, not {self.apply!r}"
            )
        name, port = _host_and_port(self.host, "a TokenPool's host")
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_port", port)


# Hosts whose plain http never leaves the machine.
_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})


def _first_repeat(items: tuple[str, ...]) -> int:
    """The place of the first item seen before (never the item itself: a token)."""
    seen: set[str] = set()
    for index, item in enumerate(items):
        if item in seen:
            return index
        seen.add(item)
    return -1


# The port a URL without one is sent to (httpx reports it as None).
_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class Route(Generic[L]):
    """Requests to ``host`` (any host when None) whose path is ``path`` or lies below
    it go through ``limiter``. The first matching route wins. A host with a port
    (``"127.0.0.1:8080"``, ``"[::1]:8080"``) matches that port only; a bare one, any port.
    ``also``: (limiter, key function) pairs such a request is charged to as well, in the
    same atomic step (see ``Limiter.acquire``), with the transport's own ``also``; a third
    item, an int or a function of the request, charges that key another cost.
    ``methods``: only requests of these HTTP methods match (None: any). ``pauses``: which
    of the request's limiters a pause its response asks for holds (see
    :class:`ThrottledTransport`); None: the transport's ``pauses``. ``pool``: the route's
    requests go out with a token of this :class:`TokenPool`; None: the transport's.

    >>> search = Limiter(backend, rates=["30/minute"], namespace="github-search")
    >>> Route(search, host="api.github.com", path="/search", also=[(core, request_key)])
    >>> Route(writes, methods={"POST", "PATCH", "PUT", "DELETE"}, also=[(core, request_key)])
    """

    limiter: L
    host: str | None = None
    path: str = "/"
    also: Sequence[AlsoSpec[L]] = ()
    methods: Collection[str] | None = None
    pauses: PausesFunc[L] | None = None
    pool: TokenPool | None = None
    _name: str | None = field(default=None, init=False, repr=False, compare=False)
    _port: int | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "also", checked_also(self.also))
        checked_pauses(self.pauses)
        checked_pool(self.pool)
        if self.pool is not None and self.host is not None:
            route_host = _host_and_port(self.host)
            if route_host[0] != self.pool._name or self.pool._port not in (None, route_host[1]):
                raise ConfigurationError(
                    f"a route to {self.host!r} has a TokenPool for {self.pool.host!r}: its "
                    "requests would never carry a token of it; give both the same host"
                )
        if self.methods is not None:
            if not isinstance(self.methods, str):  # a generator is read once, here
                object.__setattr__(self, "methods", tuple(self.methods))
            if (
                isinstance(self.methods, str)
                or not self.methods
                or not all(isinstance(m, str) and m for m in self.methods)
            ):
                raise ConfigurationError(
                    f"a route's methods must be a collection of HTTP method names, such as "
                    f'{{"POST", "PUT"}}, not {self.methods!r}'
                )
            object.__setattr__(self, "methods", frozenset(m.upper() for m in self.methods))
        if not isinstance(self.path, str) or not self.path.startswith("/"):
            raise ConfigurationError(f"a route's path must start with '/', not {self.path!r}")
        if self.host is not None:
            name, port = _host_and_port(self.host)
            object.__setattr__(self, "host", self.host.lower())
            object.__setattr__(self, "_name", name)
            object.__setattr__(self, "_port", port)

    def matches(self, request: httpx.Request) -> bool:
        if self.methods is not None and request.method not in self.methods:
            return False
        if self._name is not None and not _at(request, self._name, self._port):
            return False
        prefix = self.path.rstrip("/")
        path = request.url.path
        # On a segment boundary: "/search" covers "/search/code", not "/searchable".
        return not prefix or path == prefix or path.startswith(prefix + "/")


def _at(request: httpx.Request, name: str, port: int | None) -> bool:
    """Whether ``request`` goes to host ``name`` (and ``port``, unless None: any port)."""
    url = request.url
    if url.host != name:
        return False
    return port is None or (url.port or _DEFAULT_PORTS.get(url.scheme)) == port


def _host_and_port(spec: object, what: str = "a route's host") -> tuple[str, int | None]:
    """``"api.example.com"``, ``"127.0.0.1:8080"``, ``"[::1]:8080"`` or ``"::1"`` as the
    host httpx reports for a request (lower case, IPv6 without brackets) and the port."""
    problem = f"{what} must be a host name, optionally with ':port', not {spec!r}"
    if not isinstance(spec, str) or not spec or any(c in spec for c in "/@?# "):
        raise ConfigurationError(problem)
    host, port = spec.lower(), None
    if host.startswith("["):  # an IPv6 address, with a port or without
        host, bracket, rest = host[1:].partition("]")
        if not bracket or rest[:1] not in ("", ":"):
            raise ConfigurationError(problem)
        port = rest[1:] if rest else None
    elif host.count(":") == 1:  # more than one: a bare IPv6 address
        host, port = host.split(":")
    if not host or (port is not None and not (port.isascii() and port.isdigit())):
        raise ConfigurationError(problem)
    if port is not None and not 1 <= int(port) <= 65535:
        raise ConfigurationError(problem)
    return host, None if port is None else int(port)


@dataclass(frozen=True)
class RetryPolicy:
    """How a throttled transport answers an upstream that pushes back.

    ``max_attempts``: sends per request, the first included (1: never retry).
    ``methods``: the methods worth retrying (idempotent ones by default).
    ``max_pause``: the longest pause (seconds) any header may impose; longer ones are
    capped, with a warning. ``backoff``: the pause after a refusal that carries no
    usable value, doubled at each further attempt.

    >>> ThrottledTransport(limiter, retry=RetryPolicy(max_attempts=5, max_pause=60))
    """

    max_attempts: int = 3
    methods: frozenset[str] = IDEMPOTENT_METHODS
    max_pause: float = 300.0
    backoff: float = 1.0

    def __post_init__(self) -> None:
        attempts = self.max_attempts
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise ConfigurationError(f"max_attempts must be an integer >= 1, not {attempts!r}")
        for name in ("max_pause", "backoff"):
            # Within the limiter's range for a pause, or a 429 would end in its error.
            object.__setattr__(self, name, bounded_seconds(getattr(self, name), name))
        object.__setattr__(self, "methods", frozenset(m.upper() for m in self.methods))

    def fallback(self, attempt: int) -> float:
        return min(self.max_pause, self.backoff * 2.0 ** min(attempt - 1, 64))  # no overflow


def acquire_timeout(value: float | timedelta | None, what: str) -> float | None:
    """A wait for a slot, in seconds (None: no limit), from seconds or a timedelta."""
    if value is None:
        return None
    seconds = to_seconds(value, what)
    if math.isnan(seconds) or seconds < 0:
        raise ConfigurationError(f"{what} must be >= 0, not {seconds!r}")
    return seconds


def checked_also(also: Sequence[AlsoSpec[L]]) -> tuple[AlsoSpec[L], ...]:
    specs = tuple(also)
    for spec in specs:
        if not (
            isinstance(spec, tuple)
            and len(spec) in (2, 3)
            and callable(spec[1])
            and (len(spec) == 2 or isinstance(spec[2], int) or callable(spec[2]))
        ):
            raise TypeError(
                "also= takes (limiter, key function of the request) pairs, or triples with "
                f"a cost (an int or a function of the request), not {spec!r}"
            )
    return specs


def checked_pauses(pauses: object) -> None:
    if pauses is not None and not callable(pauses):
        raise TypeError(
            "pauses= takes a function of the response that returns the limiters a pause "
            f"holds (the request's own, those of also=), not {pauses!r}"
        )


def checked_pool(pool: object) -> None:
    if pool is not None and not isinstance(pool, TokenPool):
        raise TypeError(f"pool= takes a TokenPool, not {pool!r}")


def also_for(spec: AlsoSpec[L], request: httpx.Request, cost: int) -> tuple[L, str, int]:
    """One also= entry for ``request``: its limiter, key and cost (the request's own
    unless the entry names one)."""
    other, key_of, *rest = spec
    if rest:
        cost = rest[0] if isinstance(rest[0], int) else rest[0](request)
    return other, key_of(request), cost
