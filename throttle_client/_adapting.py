"""What the adapters of other HTTP clients (``requests``, ``aiohttp``) share: the views
of their requests and responses that the httpx transports' flow reads.

The flow (``_request_flow``) is written once over httpx objects: an adapter shows it each
request as an ``httpx.Request`` (method, URL, headers; not the body) and each response as
an ``httpx.Response`` (status and headers), which carries the client's own response, and
it carries what the flow set on the view of a request (a pool's token, in a header or
the query) over to the client's request.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import httpx

# Where the view of a response keeps the client's own response.
ORIGINAL = "throttle_client.original_response"


def request_view(
    method: str, url: str, headers: Iterable[tuple[str | bytes, str | bytes]], *, replayable: bool
) -> httpx.Request:
    """What the flow reads of a request. ``replayable``: its body can be sent again (none,
    or bytes in memory); a body read from a file or a generator cannot, so the flow
    never retries it (its view has a stream, as an httpx request with such a body has).
    Header values go in as bytes (a str as UTF-8), so that any value the client itself
    would send is read, not only ASCII."""
    stream = None if replayable else _SentOnce()
    raw = [(_bytes(name, "latin-1"), _bytes(value, "utf-8")) for name, value in headers]
    return httpx.Request(method, url, headers=raw, stream=stream)


def _bytes(text: str | bytes, encoding: str) -> bytes:
    return text if isinstance(text, bytes) else text.encode(encoding)


class _SentOnce(httpx.SyncByteStream, httpx.AsyncByteStream):
    """The stand-in for a body that can be sent once: the flow never reads it."""


def response_view(
    status: int, headers: Iterable[tuple[str, str]], request: httpx.Request, original: Any
) -> httpx.Response:
    """What the flow reads of a response; ``original`` rides in its extensions."""
    return httpx.Response(
        status, headers=list(headers), request=request, extensions={ORIGINAL: original}
    )


def original_of(response: httpx.Response) -> Any:
    """The client's own response behind a view."""
    return response.extensions[ORIGINAL]


def changes(
    view: httpx.Request, outgoing: httpx.Request
) -> tuple[dict[str, list[str]], list[str], str | None]:
    """What the flow set on a request's view before sending it (``outgoing``): each header
    set or changed, with all its values (a repeated header keeps every one), headers
    removed, and the new URL (None: the same). Headers are compared as bytes, as sent."""
    before, after = _by_name(view.headers.raw), _by_name(outgoing.headers.raw)
    changed = {
        spelled: [_text(value) for value in values]
        for key, (spelled, values) in after.items()
        if key not in before or before[key][1] != values
    }
    removed = [spelled for key, (spelled, _) in before.items() if key not in after]
    return changed, removed, None if outgoing.url == view.url else str(outgoing.url)


def _by_name(raw: list[tuple[bytes, bytes]]) -> dict[bytes, tuple[str, list[bytes]]]:
    """Each header's values, by its name in lower case, with the name as first written
    ("Authorization", as the pool sets it)."""
    grouped: dict[bytes, tuple[str, list[bytes]]] = {}
    for name, value in raw:
        grouped.setdefault(name.lower(), (name.decode("latin-1"), []))[1].append(value)
    return grouped


def _text(value: bytes) -> str:
    try:
        return value.decode()
    except UnicodeDecodeError:
        return value.decode("latin-1")
