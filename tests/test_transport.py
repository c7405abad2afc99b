"""ThrottledTransport / AsyncThrottledTransport over httpx.MockTransport.

Each behaviour is written once and run sync and async: ``World`` builds the limiter,
client and calls for either, with a FakeClock so no test really waits. Only the options
a client hands to the transport it builds are judged by a real local server (at the end).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import itertools
import logging
import ssl
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import httpx
import pytest

from throttle_client import (
    AsyncLimiter,
    AsyncThrottledClient,
    AsyncThrottledTransport,
    ConfigurationError,
    Limiter,
    MemoryBackend,
    RetryPolicy,
    Route,
    ThrottledClient,
    ThrottledTransport,
    ThrottleTimeout,
    request_key,
)
from throttle_client.testing import FakeClock

from .tls import make_certs

TOKEN = "s3cr3t-t0ken-value"
URL = "https://api.example.com/items"


class Body(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A response body that remembers whether it was read and closed."""

    def __init__(self) -> None:
        self.read = False
        self.closed = False

    def __iter__(self) -> Iterator[bytes]:
        self.read = True
        yield b"{}"

    async def __aiter__(self) -> Any:
        self.read = True
        yield b"{}"

    def close(self) -> None:
        self.closed = True

    async def aclose(self) -> None:
        self.closed = True


class Upstream:
    """A scripted upstream: answers from ``script`` in order, then 200s; records sends."""

    def __init__(self, clock: FakeClock, script: list[tuple[int, dict[str, str]]]) -> None:
        self.clock = clock
        self.script = list(script)
        self.sent: list[tuple[float, httpx.Request]] = []
        self.bodies: list[Body] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.sent.append((self.clock(), request))
        status, headers = self.script.pop(0) if self.script else (200, {})
        body = Body()
        self.bodies.append(body)
        return httpx.Response(status, headers=headers, stream=body)

    @property
    def times(self) -> list[float]:
        return [t - self.clock.start for t, _ in self.sent]


class World:
    """Limiters, clients and calls for one mode ("sync" or "async")."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        # A fixed epoch time, years from the host's: HTTP-dates and resets are judged by
        # the limiter's clock, never the host's.
        self.clock = FakeClock(start=1_700_000_000.0)
        self.clock.start = self.clock.now  # type: ignore[attr-defined]
        self.loop = asyncio.new_event_loop()
        self.sleep_hook: Callable[[], Any] | None = None

    def _take_hook(self) -> Callable[[], Any] | None:
        hook, self.sleep_hook = self.sleep_hook, None
        return hook

    def _sleep(self, seconds: float) -> None:
        self.clock.sleep(seconds)
        hook = self._take_hook()
        if hook is not None:
            hook()

    async def _asleep(self, seconds: float) -> None:
        self.clock.sleep(seconds)
        hook = self._take_hook()
        if hook is not None:
            await hook()
        await asyncio.sleep(0)

    def limiter(self, rates: Any = "10/second", **kwargs: Any) -> Any:
        kwargs.setdefault("clock", self.clock)
        if self.mode == "sync":
            return Limiter(MemoryBackend(), rates=rates, margin=0, sleep=self._sleep, **kwargs)
        return AsyncLimiter(MemoryBackend(), rates=rates, margin=0, sleep=self._asleep, **kwargs)

    def run(self, value: Any) -> Any:
        return self.loop.run_until_complete(value) if asyncio.iscoroutine(value) else value

    def client(self, limiter: Any, upstream: Upstream, **kwargs: Any) -> Any:
        mock = httpx.MockTransport(upstream)
        if self.mode == "sync":
            return ThrottledClient(limiter, transport=mock, **kwargs)
        return AsyncThrottledClient(limiter, transport=mock, **kwargs)

    def transport(self, limiter: Any, **kwargs: Any) -> Any:
        cls = ThrottledTransport if self.mode == "sync" else AsyncThrottledTransport
        return cls(limiter, **kwargs)

    def request(self, client: Any, method: str, url: str, **kwargs: Any) -> httpx.Response:
        response: httpx.Response = self.run(client.request(method, url, **kwargs))
        return response

    def get(self, client: Any, url: str = URL, **kwargs: Any) -> httpx.Response:
        kwargs.setdefault("headers", {"Authorization": f"Bearer {TOKEN}"})
        return self.request(client, "GET", url, **kwargs)

    def send_streaming(self, client: Any) -> httpx.Response:
        """A GET whose body the client leaves unread: what the transport closed shows."""
        request = client.build_request("GET", URL, headers={"Authorization": f"Bearer {TOKEN}"})
        response: httpx.Response = self.run(client.send(request, stream=True))
        return response

    def usage(self, limiter: Any, key: str) -> Any:
        return self.run(limiter.usage(key))

    def close(self, client: Any) -> None:
        self.run(client.close() if self.mode == "sync" else client.aclose())


@pytest.fixture(params=["sync", "async"])
def world(request: pytest.FixtureRequest) -> Iterator[World]:
    w = World(request.param)
    yield w
    w.loop.close()


# -- the key and the route -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "headers", "key"),
    [
        (URL, {"Authorization": f"Bearer {TOKEN}"}, TOKEN),
        (URL, {"Authorization": f"token {TOKEN}"}, TOKEN),
        (URL, {"Authorization": f"BEARER   {TOKEN} "}, TOKEN),
        (URL + f"?access_token={TOKEN}&page=2", {}, TOKEN),
        (URL + f"?api_key={TOKEN}", {}, TOKEN),
        (URL + f"?apikey={TOKEN}", {}, TOKEN),
        (URL, {"Authorization": TOKEN}, TOKEN),  # a bare token, no scheme
        (URL, {"Authorization": "Basic dXNlcjpwYXNz"}, "dXNlcjpwYXNz"),  # as sent: hashed
        (URL, {"Authorization": f"Bot {TOKEN}"}, TOKEN),
        (URL, {"X-API-Key": TOKEN}, TOKEN),
        (URL, {"api-key": TOKEN}, TOKEN),
        (URL, {"X-Auth-Token": TOKEN}, TOKEN),
        (URL, {"x-access-token": TOKEN}, TOKEN),
        # Precedence: Authorization, then the key headers, then the query.
        (URL + "?access_token=q", {"X-API-Key": "h", "Authorization": f"Bearer {TOKEN}"}, TOKEN),
        (URL + "?access_token=q", {"X-Auth-Token": TOKEN}, TOKEN),
        (URL, {"Authorization": "Bearer "}, "api.example.com"),
        # A signature differs per call: each call would have a quota of its own.
        (URL, {"Authorization": 'Digest username="u", nonce="n", response="r"'}, "api.example.com"),
        (URL, {"Authorization": "AWS4-HMAC-SHA256 Credential=A/B, Signature=s"}, "api.example.com"),
        (URL + f"?key={TOKEN}", {}, "api.example.com"),  # "key" names many things
        (URL, {}, "api.example.com"),
    ],
)
def test_default_key(world, url, headers, key):
    assert request_key(httpx.Request("GET", url, headers=headers)) == key
    limiter = world.limiter()
    client = world.client(limiter, Upstream(world.clock, []))
    assert world.request(client, "GET", url, headers=headers).status_code == 200
    assert world.usage(limiter, key).rates[0].used == 1
    world.close(client)


def test_a_callable_key_replaces_the_default(world):
    limiter = world.limiter()
    client = world.client(
        limiter, Upstream(world.clock, []), key=lambda request: request.headers["X-Account"]
    )
    world.get(client, headers={"X-Account": "acct-7", "Authorization": f"Bearer {TOKEN}"})
    assert world.usage(limiter, "acct-7").rates[0].used == 1
    assert world.usage(limiter, TOKEN).rates[0].used == 0
    world.close(client)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "throttle_client" and r.levelno == logging.WARNING
    ]


def test_credentials_the_default_key_missed_are_warned_once_per_route(world, caplog):
    caplog.set_level(logging.DEBUG, logger="throttle_client")
    core, search = world.limiter(), world.limiter()
    upstream = Upstream(world.clock, [])
    client = world.client(core, upstream, routes=[Route(search, path="/search")])
    headers = {"X-Goog-Api-Key": TOKEN}
    for _ in range(3):
        world.get(client, headers=headers)
        world.get(client, "https://api.example.com/search/users/12345", headers=headers)
    assert world.usage(core, "api.example.com").rates[0].used == 3  # keyed by the host
    warned = warnings_of(caplog)
    assert len(warned) == 2, warned
    assert warned[0].startswith("GET api.example.com is keyed by its host")
    assert warned[1].startswith("GET api.example.com/search is keyed by its host")
    for line in warned:
        assert "header 'X-Goog-Api-Key'" in line and "key=" in line
        assert TOKEN not in line and "12345" not in line
    world.close(client)


@pytest.mark.parametrize(
    ("url", "headers", "named"),
    [
        (URL + f"?key={TOKEN}&q=shoes", {}, "query parameter 'key'"),
        (URL + f"?client_secret={TOKEN}", {}, "query parameter 'client_secret'"),
        (URL, {"Cookie": f"theme=dark; sessionid={TOKEN}"}, "cookie 'sessionid'"),
        (URL, {"Authorization": f"Digest username={TOKEN}, response=r"}, "header 'Authorization'"),
    ],
)
def test_the_warning_names_what_looks_like_credentials_never_its_value(
    world, caplog, url, headers, named
):
    caplog.set_level(logging.WARNING, logger="throttle_client")
    client = world.client(world.limiter(), Upstream(world.clock, []))
    world.request(client, "GET", url, headers=headers)
    warned = warnings_of(caplog)
    assert len(warned) == 1 and named in warned[0], warned
    assert TOKEN not in warned[0]
    world.close(client)


@pytest.mark.parametrize(
    ("url", "headers", "key"),
    [
        # Keyed by a token: nothing was missed.
        (URL, {"Authorization": f"Bearer {TOKEN}", "X-Other-Token": "t"}, None),
        # Names that carry no credentials.
        (URL + "?keyword=shoes&pageToken=p&next_token=n", {"Idempotency-Key": "i"}, None),
        (URL, {"Cookie": "csrftoken=c; theme=dark", "X-CSRF-Token": "c"}, None),
        # A key function of the user's own: their decision.
        (URL, {"X-Goog-Api-Key": TOKEN}, lambda request: request.url.host),
    ],
)
def test_no_warning_when_no_credentials_were_missed(world, caplog, url, headers, key):
    caplog.set_level(logging.WARNING, logger="throttle_client")
    options = {} if key is None else {"key": key}
    client = world.client(world.limiter(), Upstream(world.clock, []), **options)
    world.request(client, "GET", url, headers=headers)
    assert warnings_of(caplog) == []
    world.close(client)


def test_cost_may_be_computed_from_the_request(world):
    limiter = world.limiter()
    client = world.client(
        limiter,
        Upstream(world.clock, []),
        cost=lambda request: 3 if request.url.path.startswith("/bulk") else 1,
    )
    world.get(client, "https://api.example.com/bulk/x")
    world.get(client)
    assert world.usage(limiter, TOKEN).rates[0].used == 4
    world.close(client)


def test_routes_pick_a_limiter_by_host_and_path_prefix(world):
    core = world.limiter("100/second")
    search = world.limiter("2/second")
    other_host = world.limiter("100/second")
    upstream = Upstream(world.clock, [])
    client = world.client(
        core,
        upstream,
        routes=[
            Route(search, host="api.example.com", path="/search"),
            Route(other_host, host="uploads.example.com"),
        ],
    )
    for path in ("/search", "/search/code", "/searchable", "/user"):
        world.get(client, "https://api.example.com" + path)
    world.get(client, "https://uploads.example.com/search")
    assert world.usage(search, TOKEN).rates[0].used == 2  # /search and /search/code only
    assert world.usage(core, TOKEN).rates[0].used == 2
    assert world.usage(other_host, TOKEN).rates[0].used == 1
    world.close(client)


def test_a_route_host_with_a_port_matches_that_port_only(world):
    local = world.limiter("100/second")
    secure = world.limiter("100/second")
    v6 = world.limiter("100/second")
    core = world.limiter("100/second")
    routes = [
        Route(local, host="127.0.0.1:8080"),
        Route(secure, host="API.Example.com:443"),
        Route(v6, host="[::1]:8081", path="/v6"),
    ]
    client = world.client(core, Upstream(world.clock, []), routes=routes)
    for url in (
        "http://127.0.0.1:8080/a",  # local
        "http://127.0.0.1:8081/a",  # core: another port
        "http://127.0.0.1/a",  # core: port 80
        "https://api.example.com/a",  # secure: https is port 443
        "http://api.example.com/a",  # core: port 80
        "https://api.example.com:8443/a",  # core
        "http://[::1]:8081/v6/x",  # v6
        "http://[::1]:8080/v6/x",  # core
    ):
        world.get(client, url)
    used = [world.usage(limiter, TOKEN).rates[0].used for limiter in (local, secure, v6, core)]
    assert used == [1, 1, 1, 5]
    world.close(client)


@pytest.mark.parametrize(
    ("host", "name", "port"),
    [
        ("api.example.com", "api.example.com", None),
        ("127.0.0.1:8080", "127.0.0.1", 8080),
        ("[::1]:8080", "::1", 8080),
        ("[::1]", "::1", None),
        ("::1", "::1", None),
        ("Example.COM:443", "example.com", 443),
    ],
)
def test_a_route_host_is_a_name_and_maybe_a_port(host, name, port):
    route = Route(Limiter(MemoryBackend(), rates="1/second"), host=host)
    assert (route._name, route._port, route.host) == (name, port, host.lower())


@pytest.mark.parametrize(
    "host",
    ["", "https://x.com", "x.com:", "x.com:0", "x.com:65536", "x.com:http", "x.com:\uff18\uff10",
     "[::1", "[::1]8080", "user@x.com", ":8080", "x.com/path"],
)  # fmt: skip
def test_a_bad_route_host_is_refused_by_name(host):
    with pytest.raises(ConfigurationError) as caught:
        Route(Limiter(MemoryBackend(), rates="1/second"), host=host)
    assert repr(host) in str(caught.value)


def test_without_a_default_limiter_unrouted_requests_pass_unthrottled(world):
    search = world.limiter("1/second")
    upstream = Upstream(world.clock, [])
    client = world.client(None, upstream, routes=[Route(search, path="/search")])
    for _ in range(3):
        world.get(client, "https://api.example.com/user")
    assert world.clock.slept == []  # three calls at one instant: nothing held them
    world.get(client, "https://api.example.com/search")
    world.get(client, "https://api.example.com/search")
    assert world.clock.slept == [1.0]
    assert len(upstream.sent) == 5
    world.close(client)


# -- retries and pauses ------------------------------------------------------------------------


def test_a_429_pauses_the_key_and_is_retried_after_the_pause(world):
    limiter = world.limiter()
    upstream = Upstream(world.clock, [(429, {"Retry-After": "3"})])
    client = world.client(limiter, upstream)
    response = world.send_streaming(client)
    assert response.status_code == 200
    assert upstream.times == [0.0, pytest.approx(3.0)]
    first = upstream.bodies[0]
    assert first.read and first.closed  # drained, so its connection goes back to the pool
    assert not upstream.bodies[1].read and not upstream.bodies[1].closed  # the caller's
    world.run(response.aclose() if world.mode == "async" else response.close())
    world.close(client)


def test_the_pause_holds_every_request_of_the_key_not_only_the_retry(world):
    limiter = world.limiter()
    upstream = Upstream(world.clock, [(429, {"Retry-After": "5"})])
    client = world.client(limiter, upstream, retry=RetryPolicy(max_attempts=1))
    assert world.get(client).status_code == 429
    assert world.usage(limiter, TOKEN).paused_for == pytest.approx(5.0)
    world.get(client)
    assert upstream.times == [0.0, pytest.approx(5.0)]
    world.close(client)


def test_a_503_with_retry_after_is_retried_a_503_without_is_not(world):
    upstream = Upstream(world.clock, [(503, {"Retry-After": "1"}), (503, {})])
    client = world.client(world.limiter(), upstream)
    assert world.get(client).status_code == 503  # the second 503, returned as is
    assert len(upstream.sent) == 2
    world.close(client)


def test_when_attempts_run_out_the_last_response_is_returned(world):
    upstream = Upstream(world.clock, [(429, {"Retry-After": "1"})] * 5)
    client = world.client(world.limiter(), upstream, retry=RetryPolicy(max_attempts=3))
    response = world.send_streaming(client)
    assert response.status_code == 429
    assert len(upstream.sent) == 3
    assert [b.closed for b in upstream.bodies] == [True, True, False]
    # Still readable: the caller sees what the upstream said.
    world.run(response.aread() if world.mode == "async" else response.read())
    assert response.json() == {}
    world.close(client)


def test_a_429_without_usable_retry_after_backs_off_growing(world):
    upstream = Upstream(world.clock, [(429, {})] * 3 + [(429, {"Retry-After": "soon"})])
    client = world.client(world.limiter(), upstream, retry=RetryPolicy(max_attempts=5))
    assert world.get(client).status_code == 200
    gaps = [b - a for a, b in itertools.pairwise(upstream.times)]
    assert gaps == [pytest.approx(1.0), pytest.approx(2.0), pytest.approx(4.0), pytest.approx(8.0)]
    world.close(client)


def test_non_idempotent_methods_pause_but_are_not_retried(world):
    limiter = world.limiter()
    upstream = Upstream(world.clock, [(429, {"Retry-After": "2"})])
    client = world.client(limiter, upstream)
    response = world.request(
        client, "POST", URL, json={"a": 1}, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert response.status_code == 429
    assert len(upstream.sent) == 1
    assert world.usage(limiter, TOKEN).paused_for == pytest.approx(2.0)
    world.close(client)


def test_retry_methods_are_configurable(world):
    upstream = Upstream(world.clock, [(429, {"Retry-After": "1"})])
    client = world.client(world.limiter(), upstream, retry=RetryPolicy(methods=frozenset({"post"})))
    response = world.request(
        client, "POST", URL, content=b"x", headers={"Authorization": "Bearer t"}
    )
    assert response.status_code == 200
    assert [r.content for _, r in upstream.sent] == [b"x", b"x"]
    world.close(client)


def test_a_streamed_body_is_never_sent_twice(world):
    upstream = Upstream(world.clock, [(429, {"Retry-After": "1"})])
    client = world.client(world.limiter(), upstream)

    def chunks() -> Iterator[bytes]:
        yield b"part"

    async def achunks() -> Any:
        yield b"part"

    body = chunks() if world.mode == "sync" else achunks()
    response = world.request(
        client, "PUT", URL, content=body, headers={"Authorization": "Bearer t"}
    )
    assert response.status_code == 429
    assert len(upstream.sent) == 1
    world.close(client)


def test_quota_spent_headers_pause_without_retrying(world):
    limiter = world.limiter()
    reset = int(world.clock()) + 20
    upstream = Upstream(
        world.clock, [(200, {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": str(reset)})]
    )
    client = world.client(limiter, upstream)
    assert world.get(client).status_code == 200
    assert len(upstream.sent) == 1
    world.get(client)
    # The reset is read against the limiter's clock (here the fake one, at a fixed epoch
    # years from the host's): the pause ends exactly at it (to the store's microsecond).
    assert upstream.sent[1][0] == pytest.approx(reset, abs=1e-6)
    world.close(client)


def test_ietf_headers_pause_too(world):
    limiter = world.limiter()
    upstream = Upstream(world.clock, [(200, {"RateLimit": '"default";r=0;t=6'})])
    client = world.client(limiter, upstream)
    world.get(client)
    world.get(client)
    assert upstream.times == [0.0, pytest.approx(6.0)]
    world.close(client)


def test_max_pause_caps_what_a_header_may_impose(world):
    upstream = Upstream(world.clock, [(429, {"Retry-After": "86400"})])
    client = world.client(world.limiter(), upstream, retry=RetryPolicy(max_pause=30))
    assert world.get(client).status_code == 200
    assert upstream.times == [0.0, pytest.approx(30.0)]
    world.close(client)


def test_a_pause_set_while_a_request_waits_for_its_slot_holds_it_too(world):
    """Another worker's 429 lands while this request sleeps towards its booked slot."""
    limiter = world.limiter("1/second")
    upstream = Upstream(world.clock, [])
    client = world.client(limiter, upstream)
    world.get(client)  # takes the slot at 0; the next one is at 1.0

    # Another worker's 429, landing while this one sleeps towards its slot at 1.0.
    world.sleep_hook = lambda: limiter.pause(TOKEN, 10)
    world.get(client)
    # It did not go at 1.0 into the pause: it queued again behind it (pause set at 1.0).
    assert upstream.times == [0.0, pytest.approx(11.0)]
    world.close(client)


# -- timeouts, logging, closing ----------------------------------------------------------------


def test_acquire_timeout_raises_throttle_timeout_and_sends_nothing(world):
    limiter = world.limiter("1/minute")
    upstream = Upstream(world.clock, [])
    client = world.client(limiter, upstream, acquire_timeout=5)
    world.get(client)
    with pytest.raises(ThrottleTimeout) as caught:
        world.get(client)
    assert caught.value.retry_after == pytest.approx(60.0)
    assert len(upstream.sent) == 1
    world.close(client)


def test_a_request_bounds_its_own_wait_with_the_acquire_timeout_extension(world):
    """The extension wins over the transport's acquire_timeout, either way: a crawler
    that must stop at a deadline books no slot past it."""
    limiter = world.limiter("1/minute")
    upstream = Upstream(world.clock, [])
    client = world.client(limiter, upstream, acquire_timeout=120)
    world.get(client)
    with pytest.raises(ThrottleTimeout) as caught:  # the next slot is 60 s away
        world.get(client, extensions={"acquire_timeout": 59.5})
    assert caught.value.retry_after == pytest.approx(60.0)
    with pytest.raises(ThrottleTimeout):
        world.get(client, extensions={"acquire_timeout": timedelta(seconds=30)})
    assert len(upstream.sent) == 1 and world.clock.now == world.clock.start  # nothing waited
    world.get(client, extensions={"acquire_timeout": None})  # no limit: waits its 60 s
    assert len(upstream.sent) == 2 and world.clock.now == world.clock.start + 60
    strict = world.client(limiter, upstream, acquire_timeout=0)
    world.get(strict, extensions={"acquire_timeout": 61})  # (the transport's 0 would refuse)
    assert len(upstream.sent) == 3 and world.clock.now == world.clock.start + 120
    for bad in [-1, "soon", float("nan")]:
        with pytest.raises(ConfigurationError, match="request extension acquire_timeout"):
            world.get(client, extensions={"acquire_timeout": bad})
    assert len(upstream.sent) == 3
    world.close(client)
    world.close(strict)


def test_logs_say_what_happened_once_and_never_the_token(world, caplog):
    caplog.set_level(logging.DEBUG, logger="throttle_client")
    script = [(429, {"Retry-After": "bogus"}), (429, {"Retry-After": "bogus"})]
    upstream = Upstream(world.clock, script)
    client = world.client(world.limiter(), upstream)
    world.get(client, URL + f"?access_token={TOKEN}", headers={})
    records = [r for r in caplog.records if r.name == "throttle_client"]
    text = "\n".join(r.getMessage() for r in records)
    assert TOKEN not in text
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    malformed = [m for m in warnings if "ignored Retry-After" in m]
    assert len(malformed) == 1  # the second bogus value goes to DEBUG
    assert any("pausing key#" in m for m in warnings)
    assert sum("retrying GET api.example.com for" in r.getMessage() for r in records) == 2
    world.close(client)


def test_logs_name_the_route_never_the_request_path(world, caplog):
    """A path may carry a secret (a webhook's token) or an id per call: log lines say the
    method, host and matched route's path, as metrics do."""
    caplog.set_level(logging.DEBUG, logger="throttle_client")
    core, search = world.limiter("1/minute"), world.limiter("1/minute")
    refused = (429, {"Retry-After": "bogus"})
    upstream = Upstream(world.clock, [refused, refused])
    client = world.client(core, upstream, routes=[Route(search, path="/search")])
    world.get(client, "https://hooks.example.com/services/T000/XXXXSECRETXXXX")
    world.get(client, "https://api.example.com/search/users/12345")
    world.get(client, "https://api.example.com/search/users/67890")  # waits for its slot
    lines = [r.getMessage() for r in caplog.records if r.name == "throttle_client"]
    text = "\n".join(lines)
    for secret in ("SECRET", "services", "12345", "67890", "users"):
        assert secret not in text, text
    assert "upstream refused GET hooks.example.com (HTTP 429)" in text
    assert "retrying GET hooks.example.com for" in text
    assert "from GET hooks.example.com (" in text  # the malformed header
    assert "for a slot for GET api.example.com/search (" in text
    world.close(client)


def test_an_unusually_long_wait_is_logged_once(world, caplog):
    caplog.set_level(logging.INFO, logger="throttle_client")
    client = world.client(world.limiter("1/minute"), Upstream(world.clock, []))
    world.get(client)
    world.get(client)
    waits = [r.getMessage() for r in caplog.records if "for a slot" in r.getMessage()]
    assert len(waits) == 1
    assert waits[0].startswith("waited 60.0s for a slot for GET api.example.com (key#")
    assert TOKEN not in waits[0]
    world.close(client)


def test_closing_closes_the_inner_transport(world):
    closed = []

    class Inner(httpx.MockTransport):
        def close(self) -> None:
            closed.append("close")

        async def aclose(self) -> None:
            closed.append("aclose")

    limiter = world.limiter()
    transport = world.transport(limiter, transport=Inner(Upstream(world.clock, [])))
    if world.mode == "sync":
        with httpx.Client(transport=transport) as client:
            client.get(URL)
        with transport:
            pass
        assert closed == ["close", "close"]
    else:

        async def use() -> None:
            async with httpx.AsyncClient(transport=transport) as client:
                await client.get(URL)
            async with transport:
                pass

        world.run(use())
        assert closed == ["aclose", "aclose"]


# -- configuration -------------------------------------------------------------------------------


def test_a_transport_refuses_a_limiter_of_the_other_world():
    sync = Limiter(MemoryBackend(), rates="1/second")
    asynchronous = AsyncLimiter(MemoryBackend(), rates="1/second")
    with pytest.raises(TypeError, match="AsyncThrottledTransport"):
        ThrottledTransport(asynchronous)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="AsyncLimiter"):
        AsyncThrottledTransport(sync)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Limiter"):
        ThrottledTransport(sync, routes=[Route(asynchronous, path="/x")])  # type: ignore[list-item]


def test_a_transport_needs_something_to_throttle_with():
    with pytest.raises(ConfigurationError, match="needs a limiter, routes, or both"):
        ThrottledTransport()


@pytest.mark.parametrize(
    ("make", "bad"),
    [
        (lambda: RetryPolicy(max_attempts=0), "0"),
        (lambda: RetryPolicy(max_attempts=2.5), "2.5"),  # type: ignore[arg-type]
        (lambda: RetryPolicy(max_pause=-1), "-1"),
        (lambda: RetryPolicy(backoff=float("nan")), "nan"),
        # Above the limiter's longest pause: a 429 would end in its ConfigurationError.
        (lambda: RetryPolicy(max_pause=1e10), "10000000000"),
        (lambda: RetryPolicy(backoff=timedelta(days=4000)), "days=4000"),
        (lambda: Route(None, path="search"), "'search'"),  # type: ignore[arg-type]
        (lambda: Route(None, host="https://x.com"), "https://x.com"),  # type: ignore[arg-type]
        (
            lambda: ThrottledTransport(
                Limiter(MemoryBackend(), rates="1/second"), acquire_timeout=-2
            ),
            "-2",
        ),
    ],
)
def test_bad_configuration_names_the_value(make, bad):
    with pytest.raises(ConfigurationError) as caught:
        make()
    assert bad in str(caught.value)


def test_the_backoff_of_many_attempts_stays_capped():
    assert RetryPolicy(max_attempts=5000, max_pause=60).fallback(2000) == 60


def test_clients_take_the_usual_httpx_arguments():
    limiter = Limiter(MemoryBackend(), rates="10/second")
    seen = []
    with ThrottledClient(
        limiter,
        base_url="https://api.example.com",
        headers={"Authorization": f"Bearer {TOKEN}"},
        transport=httpx.MockTransport(lambda r: seen.append(r) or httpx.Response(204)),
    ) as client:
        assert client.get("/me").status_code == 204
    assert str(seen[0].url) == "https://api.example.com/me"
    assert limiter.usage(TOKEN).rates[0].used == 1


# -- without a transport, the client's own options build the inner one --------------------------
# httpx has no public way to read a transport's options back, so they are judged by what a
# real local server sees, each against a client without the option.


class Recorder(http.server.BaseHTTPRequestHandler):
    """Answers 200 to anything and records (client port, request target): a new port is a
    new connection, and a target with a scheme is a request sent to a forward proxy."""

    protocol_version = "HTTP/1.1"  # keep-alive, so reusing a connection is visible
    seen: list[tuple[int, str]]

    def do_GET(self) -> None:
        self.seen.append((self.client_address[1], self.path))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


class LocalServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that refuses the certificate hangs up: expected, not news


@contextlib.contextmanager
def local_server(tls: ssl.SSLContext | None = None) -> Iterator[tuple[str, list[tuple[int, str]]]]:
    seen: list[tuple[int, str]] = []
    handler = type("Handler", (Recorder,), {"seen": seen})
    server = LocalServer(("127.0.0.1", 0), handler)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{server.server_port}", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def get_all(mode: str, urls: list[str], **options: Any) -> tuple[list[int], int]:
    """GETs ``urls`` in turn through a ThrottledClient (or its async twin) made with
    ``options`` and no transport; the statuses, and the calls the limiter admitted."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    if mode == "sync":
        limiter = Limiter(MemoryBackend(), rates="100/second")
        with ThrottledClient(limiter, **options) as client:
            statuses = [client.get(url, headers=headers).status_code for url in urls]
        return statuses, limiter.usage(TOKEN).rates[0].used

    async def run() -> tuple[list[int], int]:
        limiter = AsyncLimiter(MemoryBackend(), rates="100/second")
        async with AsyncThrottledClient(limiter, **options) as client:
            statuses = [(await client.get(url, headers=headers)).status_code for url in urls]
        return statuses, (await limiter.usage(TOKEN)).rates[0].used

    return asyncio.run(run())


@pytest.fixture(params=["sync", "async"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_a_client_without_a_transport_takes_verify(mode, tmp_path):
    certs = make_certs(tmp_path)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(certs["server"], certs["server-key"])
    with local_server(tls) as (url, seen):
        # Signed by a CA nobody trusts. (httpx before 0.26 lets the asyncio transport's
        # ssl error through unwrapped.)
        with pytest.raises((httpx.ConnectError, ssl.SSLError)):
            get_all(mode, [url])
        assert get_all(mode, [url], verify=False) == ([200], 1)
        trusting = ssl.create_default_context(cafile=certs["ca"])
        assert get_all(mode, [url], verify=trusting) == ([200], 1)
    assert len(seen) == 2


def test_a_client_without_a_transport_takes_limits(mode):
    with local_server() as (url, seen):
        assert get_all(mode, [url, url]) == ([200, 200], 2)
        assert len({port for port, _ in seen}) == 1  # one kept-alive connection
        seen.clear()
        no_keepalive = httpx.Limits(max_keepalive_connections=0)
        assert get_all(mode, [url, url], limits=no_keepalive) == ([200, 200], 2)
        assert len({port for port, _ in seen}) == 2  # a connection per request


def test_a_client_proxy_carries_the_throttled_requests(mode):
    """Left to httpx.Client, ``proxy`` would mount a transport of its own that bypasses
    the limiter: the requests must reach the proxy and be counted by the limiter."""
    target = "http://api.example.invalid/items"
    with local_server() as (proxy, seen):
        assert get_all(mode, [target], proxy=proxy) == ([200], 1)
    assert [path for _, path in seen] == [target]  # the proxy's absolute form


def test_a_route_can_match_by_method() -> None:
    from throttle_client import MemoryBackend

    writes = Limiter(MemoryBackend(), rates=["1/hour"], namespace="writes")
    route = Route(writes, methods={"post", "PUT"})
    assert route.methods == frozenset({"POST", "PUT"})
    assert route.matches(httpx.Request("POST", "https://api.example.com/x"))
    assert not route.matches(httpx.Request("GET", "https://api.example.com/x"))


@pytest.mark.parametrize("methods", ["POST", [""], [1], []])
def test_bad_route_methods_are_refused_by_value(methods: Any) -> None:
    from throttle_client import MemoryBackend

    limiter = Limiter(MemoryBackend(), rates=["1/hour"])
    with pytest.raises(ConfigurationError, match="methods"):
        Route(limiter, methods=methods)


def test_route_methods_may_be_any_iterable() -> None:
    from throttle_client import MemoryBackend

    limiter = Limiter(MemoryBackend(), rates=["1/hour"])
    route = Route(limiter, methods=(m for m in ["post"]))
    assert route.matches(httpx.Request("POST", "https://api.example.com/x"))
