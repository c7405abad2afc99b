"""requests: a transport adapter for a ``requests.Session`` that asks a limiter first.

``ThrottledAdapter`` runs each request through the very course the httpx transports run
(``_request_flow``: admit, send, read the feedback, pause, retry): keys from the request's
credentials, routes, ``also=``, token pools, priorities, caps, 429 / Retry-After and
rate-limit headers shared with every worker, limits learned from them, and retries
through the limiter. It only translates: the flow sees each ``PreparedRequest`` as an
``httpx.Request`` (method, URL, headers) and each response as an ``httpx.Response``
(status and headers; the body stays with requests), and the adapter sends and returns
requests' own objects. ``ThrottledSession`` is a ``requests.Session`` with it mounted.

    pip install 'throttle-client[requests]'
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any
from urllib.parse import quote

import httpx
import requests
from requests.adapters import HTTPAdapter
from requests.exceptions import RequestException

from ._adapting import changes, original_of, request_view, response_view
from ._events import Listener
from ._flow import refuse_in_event_loop, run
from ._lease import Lease
from ._limiter import Limiter
from ._request_flow import Discard, Hold, Send, TransportCore, lease_of
from ._request_key import request_key
from ._routes import AlsoSpec, CostFunc, KeyFunc, PausesFunc, RetryPolicy, Route, TokenPool

__all__ = ["ThrottledAdapter", "ThrottledSession"]


class ThrottledAdapter(HTTPAdapter):
    """A ``requests`` transport adapter that waits for the limiter before each request
    and pauses the key for every worker when the upstream pushes back; the options are
    :class:`~throttle_client.ThrottledTransport`'s, and behave the same.

    >>> session = requests.Session()
    >>> session.mount("https://", ThrottledAdapter(limiter))
    >>> session.get("https://api.example.com/me", headers={"Authorization": "Bearer t"})

    The functions it is given (``key``, ``cost``, the key functions of ``also``, ``pauses``)
    see the request and the response as httpx objects with the same method, URL, headers
    and status (``response.extensions["throttle_client.original_response"]`` is requests'
    own). With ``max_concurrent`` a request holds its lease until its body is read, or,
    with ``stream=True``, until its response is closed (``with session.get(...,
    stream=True) as response:``). Other keyword arguments go to ``HTTPAdapter``
    (``pool_connections``, ``pool_maxsize``, ``max_retries``).
    """

    def __init__(
        self,
        limiter: Limiter | None = None,
        *,
        routes: Sequence[Route[Limiter]] = (),
        key: KeyFunc = request_key,
        cost: int | CostFunc = 1,
        retry: RetryPolicy = RetryPolicy(),
        acquire_timeout: float | timedelta | None = None,
        also: Sequence[AlsoSpec[Limiter]] = (),
        learn: bool = True,
        pauses: PausesFunc[Limiter] | None = None,
        pool: TokenPool | None = None,
        priority: str = "normal",
        **adapter_options: Any,
    ) -> None:
        super().__init__(**adapter_options)
        options = (key, cost, retry, acquire_timeout, also, learn, pauses, pool, priority)
        self._core = TransportCore(Limiter, limiter, routes, *options)

    def send(  # type: ignore[override]
        self, request: requests.PreparedRequest, **options: Any
    ) -> requests.Response:
        view = _request_view(request)
        plan = self._core.plan(view)
        if plan is None:
            return super().send(request, **options)
        refuse_in_event_loop("ThrottledAdapter (a requests.Session)")
        limiter = plan.limiter

        def perform(step: Any) -> Any:
            if isinstance(step, Hold):
                lease = Lease(lease_of(step))
                return lease.__enter__(), lease
            if isinstance(step, Send):
                outgoing = _with_changes(request, view, step.request)
                scrubbed = None
                try:
                    response = super(ThrottledAdapter, self).send(outgoing, **options)
                    if step.lease is not None:
                        _hold_until_read(response, step.lease, bool(options.get("stream")))
                except BaseException as error:
                    if step.lease is not None:
                        step.lease.release()
                    if outgoing is request or not isinstance(error, RequestException):
                        raise
                    scrubbed = _without_token(error, request, view, step.request)
                if scrubbed is not None:  # (raised here, it carries no trace of the token)
                    raise scrubbed
                seen = response_view(
                    response.status_code, response.headers.items(), step.request, response
                )
                return seen, limiter._local(), limiter._wall()
            if isinstance(step, Discard):
                _drain(original_of(step.response))  # (a retry: this one's body is not wanted)
                return limiter._local()
            return limiter._perform(step)

        answer = run(self._core.flow(plan, view, limiter._local()), perform)
        final: requests.Response = original_of(answer)
        # The caller's request, not the copy that carried a pool's token: the token
        # stays out of response.url, raise_for_status()'s message and redirects.
        final.url, final.request = request.url or final.url, request
        return final

    def listen(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener`` with every :class:`~throttle_client.Event` of the limiters
        this adapter uses; returns the function that stops it."""
        return self._core.listen(listener)


class ThrottledSession(requests.Session):
    """A ``requests.Session`` whose requests over http and https go through a
    :class:`ThrottledAdapter` made with these options.

    >>> session = ThrottledSession(limiter, acquire_timeout=30)
    >>> session.get("https://api.example.com/me", headers={"Authorization": "Bearer t"})
    """

    def __init__(self, limiter: Limiter | None = None, **options: Any) -> None:
        super().__init__()
        self.adapter = ThrottledAdapter(limiter, **options)
        self._throttled = self.adapter  # (what metrics' instrument() counts, as a client's)
        self.mount("http://", self.adapter)
        self.mount("https://", self.adapter)

    def listen(self, listener: Listener) -> Callable[[], None]:
        """As :meth:`ThrottledAdapter.listen`."""
        return self.adapter.listen(listener)


def _request_view(request: requests.PreparedRequest) -> httpx.Request:
    """What the flow reads of a request: its method, URL and headers (not its body)."""
    replayable = request.body is None or isinstance(request.body, (bytes, str))
    headers = request.headers.items()  # (str or bytes, as requests sends them)
    return request_view(request.method or "GET", request.url or "", headers, replayable=replayable)


def _without_token(
    error: RequestException,
    request: requests.PreparedRequest,
    view: httpx.Request,
    outgoing: httpx.Request,
) -> RequestException:
    """``error`` as the caller may see it: naming the caller's request, not the copy
    that carried a pool's token, and with the token struck from its message (a URL
    with the token in its query names it)."""
    changed, _, _ = changes(view, outgoing)
    secrets = {part for values in changed.values() for value in values for part in value.split()}
    asked = set(view.url.params.multi_items())
    secrets |= {
        value
        for item in outgoing.url.params.multi_items()
        if item not in asked
        for value in item[1:]
    }
    secrets |= {quote(secret, safe="") for secret in secrets}

    def struck(argument: object) -> object:
        text = str(argument)
        if not any(secret in text for secret in secrets):
            return argument
        for secret in sorted(secrets, key=len, reverse=True):
            text = text.replace(secret, "***")
        return text

    return type(error)(*map(struck, error.args), request=request, response=error.response)


def _with_changes(
    request: requests.PreparedRequest, view: httpx.Request, outgoing: httpx.Request
) -> requests.PreparedRequest:
    """``request`` as the flow sends it: with what a token pool set on its view (a header,
    or a query parameter), on a copy, so a redirect requests builds from the original
    never carries the token elsewhere."""
    if outgoing is view:  # (no pool: the request goes as it came)
        return request
    sent = request.copy()
    changed, removed, url = changes(view, outgoing)
    for name, values in changed.items():
        sent.headers[name] = ", ".join(values)  # (requests keeps one value per name)
    for name in removed:
        sent.headers.pop(name, None)
    if url is not None:
        sent.url = url
    return sent


def _hold_until_read(response: requests.Response, lease: Lease, streamed: bool) -> None:
    """A capped request's lease: ended once its body is in memory (read here), or, for
    a streamed one, when its body has been read through or its response is closed,
    whichever comes first."""
    if not streamed:
        try:
            response.content  # noqa: B018  (read now: nothing is left in flight)
        finally:
            lease.release()
        return
    close, iter_content = response.close, response.iter_content

    def closing() -> None:
        try:
            close()
        finally:
            lease.release()

    def reading(*args: Any, **kwargs: Any) -> Iterator[Any]:
        try:
            yield from iter_content(*args, **kwargs)
        except Exception:
            lease.release()  # (the body broke off: nothing is in flight any more)
            raise
        lease.release()  # (read through: .content, .json(), iter_lines() all end here)

    response.close = closing  # type: ignore[method-assign]
    response.iter_content = reading  # type: ignore[method-assign]


def _drain(response: requests.Response) -> None:
    """Read and close a response thrown away: a drained one gives its connection back."""
    try:
        response.content  # noqa: B018
    except requests.RequestException:
        pass  # the body of a response we throw away is not worth an error
    finally:
        response.close()
