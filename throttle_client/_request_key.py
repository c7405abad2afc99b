"""The throttling key of an outbound request: its access token, else its host.

The token is only ever handed to the limiter, which hashes it before it reaches a
store; :func:`key_label` gives the form that may appear in logs.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import httpx

# Schemes whose credentials are the token whatever they look like ("token": GitHub's).
_TOKEN_SCHEMES = ("bearer", "token")
# Another scheme's credentials count when they are one token68 (RFC 9110 §11.4): Basic's
# base64, a vendor's "Bot …". Auth-params ('Digest username="u", response="…"', AWS
# SigV4's "Credential=…, Signature=…") sign each call: keyed by them, every call would
# have a quota of its own.
_TOKEN68 = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
# One of these alone is a scheme whose credentials were left out, not a bare token.
_SCHEMES = frozenset({"bearer", "token", "basic", "digest", "negotiate"})
_KEY_HEADERS = ("X-API-Key", "Api-Key", "X-Auth-Token", "X-Access-Token")
# Not "key": it is Google's API key, but also a common name for values that are no
# credential (a sort key, an object key, a search term). Keyed by those, one token's
# quota would be split per value: silent over-use. A request that carries "key" is
# keyed by its host, and the transport's log says so (see credential_names).
_KEY_PARAMS = ("access_token", "api_key", "apikey")

# Header, query parameter and cookie names that suggest credentials ...
_CREDENTIAL_NAME = re.compile(
    r"(token|key|secret|auth|authorization|credentials?|passw(or)?d|signature|session(id)?|sessid)$"
)
# ... though these carry none: per-call or per-form values, pagination cursors, and a
# proxy's own credentials.
_NOT_CREDENTIALS = re.compile(
    r"csrf|xsrf|idempotency|websocket|^proxy-"
    r"|(page|next|pagination|continuation|sync|cursor)[-_.]?(token|key)$"
)


def request_key(request: httpx.Request) -> str:
    """The access token of ``request``, else its host. The first found of:

    1. ``Authorization``: the credentials of ``Bearer …`` or ``token …``; of another
       scheme when they are a single token (``Basic <base64>`` as sent: it is only ever
       hashed); or a bare token with no scheme. Not a signature made per call
       (``Digest``, AWS's): that would give every call a quota of its own.
    2. The headers ``X-API-Key``, ``Api-Key``, ``X-Auth-Token``, ``X-Access-Token``.
    3. The query parameters ``access_token``, ``api_key``, ``apikey``.
    4. The host.

    >>> request_key(httpx.Request("GET", "https://api.example.com/x?access_token=abc"))
    'abc'
    >>> request_key(httpx.Request("GET", "https://api.example.com/x"))
    'api.example.com'
    """
    headers = request.headers
    token = _authorization_token(headers.get("Authorization", ""))
    for name in _KEY_HEADERS:
        token = token or headers.get(name, "").strip()
    if not token and request.url.query:  # parsing the query costs more than the rest
        params = request.url.params
        for name in _KEY_PARAMS:
            token = token or params.get(name, "")
    return token or request.url.host


def _authorization_token(value: str) -> str:
    """The token an ``Authorization`` value carries, or "" for none."""
    scheme, _, credentials = value.strip().partition(" ")
    credentials = credentials.strip()
    if scheme.lower() in _TOKEN_SCHEMES:
        return credentials
    if not credentials:  # one word
        return "" if scheme.lower() in _SCHEMES else scheme
    return credentials if _TOKEN68.fullmatch(credentials) else ""


def credential_names(request: httpx.Request) -> list[str]:
    """What in ``request`` looks like credentials by its name, for a warning when the
    request is keyed by its host anyway: ``"header 'X-Goog-Api-Key'"``, ``"query
    parameter 'key'"``, ``"cookie 'sessionid'"``. Names only, never a value."""
    found = [("header", name.decode("latin-1")) for name, _ in request.headers.raw]
    if request.url.query:
        found += [("query parameter", name) for name in request.url.params]
    for cookie in request.headers.get_list("Cookie"):
        found += [("cookie", part.partition("=")[0].strip()) for part in cookie.split(";")]
    names = [
        f"{kind} {name!r}"
        for kind, name in found
        if _CREDENTIAL_NAME.search(name.lower()) and not _NOT_CREDENTIALS.search(name.lower())
    ]
    return list(dict.fromkeys(names))


def key_label(key: str, host: str, label: Callable[[str], str]) -> str:
    """What a log line may say about ``key`` of a request to ``host``: the host itself, or
    ``key#`` and the key's label (``Limiter.label``: as events and metrics show it) for a
    token."""
    if key == host:
        return key
    return "key#" + label(key)
