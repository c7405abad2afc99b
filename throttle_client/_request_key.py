"""The throttling key of an outbound request: its access token, else its host.

The token is only ever handed to the limiter, which hashes it before it reaches a
store; :func:`key_label` gives the form that may appear in logs.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx

_TOKEN_SCHEMES = ("bearer", "token")  # "token" is GitHub's classic scheme


def request_key(request: httpx.Request) -> str:
    """The access token of ``request`` (``Authorization: Bearer …`` / ``token …``, or an
    ``access_token`` query parameter), else its host.

    >>> request_key(httpx.Request("GET", "https://api.example.com/x?access_token=abc"))
    'abc'
    >>> request_key(httpx.Request("GET", "https://api.example.com/x"))
    'api.example.com'
    """
    authorization: str = request.headers.get("Authorization", "")
    scheme, _, credentials = authorization.strip().partition(" ")
    if scheme.lower() in _TOKEN_SCHEMES and credentials.strip():
        return credentials.strip()
    token: str | None = request.url.params.get("access_token")
    if token:
        return token
    return request.url.host


def key_label(key: str, request: httpx.Request, label: Callable[[str], str]) -> str:
    """What a log line may say about ``key``: the host itself, or ``key#`` and the key's
    label (``Limiter.label``: as events and metrics show it) for a token."""
    if key == request.url.host:
        return key
    return "key#" + label(key)
