"""throttle_client.requests: the httpx transports' course, for a requests.Session.

The upstream is a function of the request, served by an adapter below ThrottledAdapter
(as httpx.MockTransport serves the transports' tests); the limiter runs on a fake
clock, so waits are read off the clock, not timed.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
import requests
from requests.adapters import HTTPAdapter

from throttle_client import (
    ConfigurationError,
    Limiter,
    MemoryBackend,
    RetryPolicy,
    Route,
    TokenPool,
)
from throttle_client.requests import ThrottledAdapter, ThrottledSession
from throttle_client.testing import FakeClock

HOST = "api.example.com"
Answer = tuple[int, dict[str, str]]


class _Upstream(HTTPAdapter):
    """Answers each request with ``answer(request)`` (status, headers), noting it and the
    clock's time; never touches the network."""

    answer: Callable[[requests.PreparedRequest], Answer]
    clock: FakeClock

    def send(  # type: ignore[override]
        self, request: requests.PreparedRequest, **options: Any
    ) -> requests.Response:
        self.seen.append((request, self.clock()))
        status, headers = self.answer(request)
        response = requests.Response()
        response.status_code, response.url, response.request = status, request.url, request
        response.headers.update(headers)
        response.raw = io.BytesIO(b'{"ok": true}')  # (read as a socket's would be)
        self.opened = getattr(self, "opened", 0) + 1
        return response


class _Adapter(ThrottledAdapter, _Upstream):
    """ThrottledAdapter over the fake upstream (its HTTPAdapter.send)."""


def a_session(
    limiter: Limiter, clock: FakeClock, answer: Callable[..., Answer] | None = None, **options: Any
) -> tuple[requests.Session, _Adapter]:
    adapter = _Adapter(limiter, **options)
    adapter.answer = answer or (lambda request: (200, {}))
    adapter.clock, adapter.seen = clock, []
    session = requests.Session()
    session.mount("https://", adapter)
    return session, adapter


def a_limiter(clock: FakeClock, **options: Any) -> Limiter:
    options.setdefault("rates", ["2/second"])
    return Limiter(MemoryBackend(), clock=clock, sleep=clock.sleep, margin=0, **options)


def test_each_request_waits_for_its_tokens_slot() -> None:
    clock = FakeClock()
    limiter = a_limiter(clock)
    session, upstream = a_session(limiter, clock)
    start = clock()

    def get(token: str) -> requests.Response:
        headers = {"Authorization": f"Bearer {token}"}
        return session.get(f"https://{HOST}/items", headers=headers)

    for token in ["t-1", "t-1", "t-2"]:
        response = get(token)
        assert isinstance(response, requests.Response) and response.json() == {"ok": True}
    used = [limiter.usage(token).rates[0].used for token in ["t-1", "t-2", "t-3"]]
    assert used == [2, 1, 0]  # each request keyed by its token
    get("t-1")  # the token is full until a second later
    assert [round(at - start, 3) for _, at in upstream.seen] == [0.0, 0.0, 0.0, 1.0]


def test_a_429_pauses_the_key_for_every_session_and_is_retried_through_the_limiter() -> None:
    clock = FakeClock()
    limiter = a_limiter(clock)
    answers = iter([(429, {"Retry-After": "3"}), (200, {})])
    first, upstream = a_session(limiter, clock, lambda request: next(answers))
    other, elsewhere = a_session(limiter, clock)
    start = clock()
    headers = {"Authorization": "Bearer t-1"}
    assert first.get(f"https://{HOST}/items", headers=headers).status_code == 200
    assert [round(at - start, 3) for _, at in upstream.seen] == [0.0, 3.0]  # the pause, kept
    other.get(f"https://{HOST}/items", headers=headers)
    assert round(elsewhere.seen[0][1] - start, 3) >= 3.0  # the other session waited it out too
    no_retry, refused = a_session(
        limiter,
        clock,
        lambda request: (429, {"Retry-After": "1"}),
        retry=RetryPolicy(max_attempts=1),
    )
    assert no_retry.get(f"https://{HOST}/x", headers=headers).status_code == 429  # returned
    assert len(refused.seen) == 1


def test_quota_headers_hold_the_key_to_the_upstreams_limit() -> None:
    clock = FakeClock()
    limiter = a_limiter(clock, rates=["100/minute"])
    reset = int(clock() + 60)

    def answer(request: requests.PreparedRequest) -> Answer:
        return 200, {
            "X-RateLimit-Limit": "2",
            "X-RateLimit-Remaining": "0",
            "X-RateLimit-Reset": str(reset),
        }

    session, upstream = a_session(limiter, clock, answer)
    session.get(f"https://{HOST}/items", headers={"Authorization": "Bearer t-1"})
    session.get(f"https://{HOST}/items", headers={"Authorization": "Bearer t-1"})
    assert round(upstream.seen[1][1] - upstream.seen[0][1]) >= 59  # held to the upstream's count


def test_a_pool_sets_its_token_on_a_copy_and_an_account_is_charged_too() -> None:
    clock = FakeClock()
    tokens = a_limiter(clock)
    account = Limiter(
        tokens.backend,
        rates=["3/second"],
        namespace="acct",
        clock=clock,
        sleep=clock.sleep,
        margin=0,
    )
    pool = TokenPool(["tok-a", "tok-b"], host=HOST)
    session, upstream = a_session(tokens, clock, pool=pool, also=[(account, lambda r: "acct")])
    start = clock()
    sent = []
    for _ in range(4):
        prepared = session.prepare_request(requests.Request("GET", f"https://{HOST}/items"))
        sent.append(prepared)
        session.send(prepared)
    assert [r.headers["Authorization"] for r, _ in upstream.seen] == [
        "Bearer tok-a",
        "Bearer tok-b",
        "Bearer tok-a",
        "Bearer tok-a",
    ]
    assert [round(at - start, 3) for _, at in upstream.seen] == [0.0, 0.0, 0.0, 1.0]  # the account
    assert all("Authorization" not in prepared.headers for prepared in sent)  # a copy got it
    assert "Authorization" in list(upstream.seen[0][0].headers)  # as it is written, not lowered


def test_a_host_no_route_covers_passes_unthrottled() -> None:
    clock = FakeClock()
    limiter = a_limiter(clock, rates=["1/minute"])
    session, upstream = a_session(None, clock, routes=[Route(limiter, host=HOST)])  # type: ignore[arg-type]
    start = clock()
    for host in ["cdn.example.net", "cdn.example.net", HOST, HOST]:
        session.get(f"https://{host}/blob")
    assert [round(at - start) for _, at in upstream.seen] == [0, 0, 0, 60]


@pytest.mark.parametrize("stream", [False, True])
def test_a_capped_request_holds_its_lease_until_its_body_is_read_or_closed(stream: bool) -> None:
    clock = FakeClock()
    limiter = a_limiter(clock, rates=["100/second"], max_concurrent=1)
    session, _ = a_session(limiter, clock)
    headers = {"Authorization": "Bearer t-1"}
    response = session.get(f"https://{HOST}/items", headers=headers, stream=stream)
    held = limiter.usage("t-1").in_flight
    assert held == (1 if stream else 0)
    response.close()
    assert limiter.usage("t-1").in_flight == 0


def test_a_streamed_capped_request_ends_its_lease_once_its_body_is_read_through() -> None:
    clock = FakeClock()
    limiter = a_limiter(clock, rates=["100/second"], max_concurrent=1)
    session, _ = a_session(limiter, clock)
    headers = {"Authorization": "Bearer t-1"}
    response = session.get(f"https://{HOST}/items", headers=headers, stream=True)
    parts = response.iter_content(4)
    next(parts)
    assert limiter.usage("t-1").in_flight == 1  # still reading
    assert b"".join(parts)
    assert limiter.usage("t-1").in_flight == 0  # read through, never closed
    again = session.get(f"https://{HOST}/items", headers=headers, stream=True)
    assert again.json() == {"ok": True} and limiter.usage("t-1").in_flight == 0


def test_a_session_mounts_the_adapter_and_bad_options_are_refused() -> None:
    limiter = Limiter(MemoryBackend(), rates=["2/second"])
    session = ThrottledSession(limiter, acquire_timeout=5)
    assert session.get_adapter("https://api.example.com/") is session.adapter
    assert session.get_adapter("http://127.0.0.1:8080/") is session.adapter
    with pytest.raises(ConfigurationError, match="priority"):
        ThrottledSession(limiter, priority="urgent")


@pytest.mark.parametrize(
    ("body", "retried"),
    [
        (b"payload", True),
        ("payload", True),
        (io.BytesIO(b"payload"), False),
        ((part for part in [b"pay", b"load"]), False),
    ],
    ids=["bytes", "text", "file", "generator"],
)
def test_a_body_that_can_be_sent_only_once_is_never_retried(body: Any, retried: bool) -> None:
    """A refused request is retried only when its body can be sent again: a file or a
    generator, read by the first attempt, would go out empty."""
    clock = FakeClock()
    limiter = a_limiter(clock)
    answers = iter([(429, {"Retry-After": "1"}), (200, {})])
    session, upstream = a_session(limiter, clock, lambda request: next(answers))
    headers = {"Authorization": "Bearer t-1"}
    response = session.put(f"https://{HOST}/items/1", data=body, headers=headers)
    assert response.status_code == (200 if retried else 429)
    assert len(upstream.seen) == (2 if retried else 1)
    if retried:
        assert upstream.seen[1][0].body in (b"payload", "payload")  # the whole body again
    else:
        assert limiter.usage("t-1").paused_for == pytest.approx(1.0)  # paused all the same


def test_a_header_given_as_bytes_keys_the_request_and_no_pool_token_replaces_it() -> None:
    clock = FakeClock()
    limiter = a_limiter(clock, rates=["1/minute"])
    pool = TokenPool(["tok-a"], host=HOST)
    session, upstream = a_session(limiter, clock, pool=pool)
    start = clock()
    for _ in range(2):
        session.get(f"https://{HOST}/items", headers={"Authorization": b"Bearer own"})
    assert [r.headers["Authorization"] for r, _ in upstream.seen] == [b"Bearer own"] * 2
    assert [round(at - start) for _, at in upstream.seen] == [0, 60]  # keyed by its token
    assert limiter.usage("own").rates[0].used == 1 and limiter.usage("tok-a").rates[0].used == 0


@pytest.mark.parametrize("where", ["header", "query"])
def test_a_pool_token_stays_out_of_the_response_the_caller_gets(where: str) -> None:
    clock = FakeClock()
    limiter = a_limiter(clock)
    pool = TokenPool(["tok-secret"], host=HOST)
    if where == "query":
        pool = TokenPool(["tok-secret"], host=HOST, apply=_in_query)
    session, upstream = a_session(limiter, clock, pool=pool, answer=lambda request: (404, {}))
    response = session.get(f"https://{HOST}/items?page=2")
    sent = upstream.seen[0][0]
    assert "tok-secret" in (sent.headers.get("Authorization", "") + (sent.url or ""))
    assert response.url == f"https://{HOST}/items?page=2"
    assert "Authorization" not in response.request.headers
    with pytest.raises(requests.HTTPError) as raised:
        response.raise_for_status()
    assert "tok-secret" not in str(raised.value)


def _in_query(request: Any, token: str) -> None:
    request.url = request.url.copy_add_param("access_token", token)


@pytest.mark.parametrize("where", ["header", "query"])
def test_a_pool_token_stays_out_of_an_error_the_caller_gets(where: str) -> None:
    clock = FakeClock()
    limiter = a_limiter(clock)
    pool = TokenPool(
        ["tok-secret"], host=HOST, **({"apply": _in_query} if where == "query" else {})
    )

    def unreachable(request: requests.PreparedRequest) -> Answer:
        raise requests.ConnectionError(f"Max retries exceeded with url: {request.path_url}")

    session, _ = a_session(limiter, clock, pool=pool, answer=unreachable)
    with pytest.raises(requests.ConnectionError) as raised:
        session.get(f"https://{HOST}/items?page=2")
    error = raised.value
    assert "page=2" in str(error) and "tok-secret" not in str(error)
    assert error.request is not None and "tok-secret" not in str(error.request.headers)
    assert error.request.url == f"https://{HOST}/items?page=2"
    assert error.__context__ is None and error.__cause__ is None


def test_header_values_beyond_ascii_go_as_requests_sends_them() -> None:
    clock = FakeClock()
    limiter = a_limiter(clock)
    session, upstream = a_session(limiter, clock, pool=TokenPool(["tok-a"], host=HOST))
    for value in ["café", "café".encode(), "naïve".encode("latin-1")]:
        session.get(f"https://{HOST}/items", headers={"X-Note": value})
    assert [r.headers["X-Note"] for r, _ in upstream.seen] == [
        "café",
        "café".encode(),
        "naïve".encode("latin-1"),
    ]
    assert all(r.headers["Authorization"] == "Bearer tok-a" for r, _ in upstream.seen)


def test_a_streamed_capped_body_that_breaks_off_ends_its_lease() -> None:
    class Broken(io.RawIOBase):
        def readinto(self, buffer: Any) -> int:
            raise OSError("connection reset mid-body")

    clock = FakeClock()
    limiter = a_limiter(clock, rates=["100/second"], max_concurrent=1)
    session, _ = a_session(limiter, clock)
    headers = {"Authorization": "Bearer t-1"}
    response = session.get(f"https://{HOST}/items", headers=headers, stream=True)
    response.raw = Broken()
    with pytest.raises(OSError, match="reset"):
        response.json()
    assert limiter.usage("t-1").in_flight == 0  # never closed, yet nothing held


def test_a_session_is_heard_and_counted_as_a_client_is() -> None:
    from prometheus_client import CollectorRegistry

    from throttle_client import key_label
    from throttle_client.prometheus import instrument

    limiter = Limiter(MemoryBackend(), rates=["2/second"])
    session = ThrottledSession(limiter)
    heard: list[str] = []
    stop = session.listen(lambda event: heard.append(event.kind))
    registry = CollectorRegistry()
    instrument(session, registry=registry)
    limiter.try_acquire("t-1")
    stop()
    assert "admitted" in heard
    key = key_label(limiter.store_key("t-1"))
    labels = {"key": key, "namespace": "default", "outcome": "admitted"}
    assert registry.get_sample_value("throttle_client_decisions_total", labels) == 1.0
