"""What the adapters of other HTTP clients (``requests``, ``aiohttp``) share: the views
of their requests and responses that the httpx transports' flow reads.

The flow (``_request_flow``) is written once over httpx objects: an adapter shows it each
request as an ``httpx.Request`` (method, URL, headers; not the body) and each response as
an ``httpx.Response`` (status and headers), which carries the client's own response, and
it carries what the flow set on the view of a request (a pool's token, in a header or
the query) over to the client's request.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import httpx

# Where the view of a response keeps the client's own response.
ORIGINAL = "throttle_client.original_response"


def request_view(
    method: str, url: str, headers: Iterable[tuple[str, str]], *, replayable: bool
) -> httpx.Request:
    """What the flow reads of a request. ``replayable``: its body can be sent again (none,
    or bytes in memory); a body read from a file or a generator cannot, so the flow
    never retries it (its view has a stream, as an httpx request with such a body has)."""
    stream = None if replayable else _SentOnce()
    return httpx.Request(method, url, headers=list(headers), stream=stream)


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
) -> tuple[dict[str, str], list[str], str | None]:
    """What the flow set on a request's view before sending it (``outgoing``): headers set
    or changed, headers removed, and the new URL (None: the same)."""
    before: Mapping[str, str] = view.headers
    # (The names as they were set, "Authorization", not as httpx compares them.)
    encoding = outgoing.headers.encoding
    changed: dict[str, str] = {}
    for raw_name, raw_value in outgoing.headers.raw:
        name, value = raw_name.decode("latin-1"), raw_value.decode(encoding)
        if before.get(name) != value:
            changed[name] = value
    removed = [name for name in before if name not in outgoing.headers]
    return changed, removed, None if outgoing.url == view.url else str(outgoing.url)
