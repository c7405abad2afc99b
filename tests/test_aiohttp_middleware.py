"""throttle_client.aiohttp: the httpx transports' course, as an aiohttp client middleware.

The upstream is a real aiohttp server on a free loopback port whose answers are a
function of the request; the limiter runs on a fake clock, so waits are read off the
clock, not timed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import ClientResponseError, ClientSession, web
from aiohttp.test_utils import TestServer

from throttle_client import AsyncLimiter, MemoryBackend, TokenPool
from throttle_client.aiohttp import ThrottledMiddleware
from throttle_client.testing import FakeClock

Answer = tuple[int, dict[str, str]]


def crawl(
    clock: FakeClock,
    middleware: ThrottledMiddleware,
    requests: Callable[[ClientSession, str], Awaitable[None]],
    answer: Callable[[web.Request], Answer] | None = None,
    body: bytes | None = None,
    received: list[tuple[str, bytes]] | None = None,
) -> list[tuple[str, float]]:
    """Run ``requests`` through a session with ``middleware`` against the local upstream;
    what the upstream saw: each request's Authorization and the clock's time (and, in
    ``received``, each request's query and body)."""
    seen: list[tuple[str, float]] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append((request.headers.get("Authorization", ""), clock()))
        if received is not None:
            received.append((request.query_string, await request.read()))
        status, headers = answer(request) if answer else (200, {})
        if body is not None:  # (more than arrives at once: the client reads it in parts)
            return web.Response(body=body, status=status, headers=headers)
        return web.json_response({"ok": status == 200}, status=status, headers=headers)

    async def main() -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        async with TestServer(app, host="127.0.0.1") as server:
            base = str(server.make_url("/"))
            async with ClientSession(middlewares=[middleware]) as session:
                await requests(session, base)

    asyncio.run(main())
    return seen


def a_limiter(clock: FakeClock, **options: Any) -> AsyncLimiter:
    options.setdefault("rates", ["2/second"])
    return AsyncLimiter(MemoryBackend(), clock=clock, sleep=clock.asleep, margin=0, **options)


def test_each_request_waits_for_its_tokens_slot() -> None:
    clock = FakeClock()
    limiter = a_limiter(clock)
    used: list[int] = []

    async def requests(session: ClientSession, base: str) -> None:
        for token in ["t-1", "t-1", "t-2"]:
            async with session.get(
                f"{base}items", headers={"Authorization": f"Bearer {token}"}
            ) as r:
                assert (await r.json()) == {"ok": True}
        used.extend([(await limiter.usage(t)).rates[0].used for t in ["t-1", "t-2", "t-3"]])
        async with session.get(f"{base}items", headers={"Authorization": "Bearer t-1"}):
            pass

    start = clock()
    seen = crawl(clock, ThrottledMiddleware(limiter), requests)
    assert used == [2, 1, 0]  # each request keyed by its token
    assert [round(at - start, 3) for _, at in seen] == [0.0, 0.0, 0.0, 1.0]


def test_a_429_pauses_the_key_and_is_retried_through_the_limiter() -> None:
    clock = FakeClock()
    limiter = a_limiter(clock)
    answers = iter([(429, {"Retry-After": "3"}), (200, {})])
    statuses: list[int] = []

    async def requests(session: ClientSession, base: str) -> None:
        async with session.get(f"{base}items", headers={"Authorization": "Bearer t-1"}) as r:
            statuses.append(r.status)
        paused = (await limiter.usage("t-1")).paused_for
        statuses.append(round(paused))

    start = clock()
    seen = crawl(clock, ThrottledMiddleware(limiter), requests, lambda request: next(answers))
    assert [round(at - start, 3) for _, at in seen] == [0.0, 3.0]  # the pause, kept
    assert statuses == [200, 0]  # the caller got the answer after it


def test_a_pool_sets_its_token_per_attempt_and_an_account_is_charged_too() -> None:
    clock = FakeClock()
    tokens = a_limiter(clock)
    account = AsyncLimiter(
        tokens.backend,
        rates=["3/second"],
        namespace="acct",
        clock=clock,
        sleep=clock.asleep,
        margin=0,
    )
    pool = TokenPool(["tok-a", "tok-b"], host="127.0.0.1")
    middleware = ThrottledMiddleware(tokens, pool=pool, also=[(account, lambda r: "acct")])

    async def requests(session: ClientSession, base: str) -> None:
        for _ in range(4):
            async with session.get(f"{base}items"):
                pass

    start = clock()
    seen = crawl(clock, middleware, requests)
    assert [token for token, _ in seen] == [
        "Bearer tok-a",
        "Bearer tok-b",
        "Bearer tok-a",
        "Bearer tok-a",
    ]
    assert [round(at - start, 3) for _, at in seen] == [0.0, 0.0, 0.0, 1.0]  # the account's


def test_a_capped_request_holds_its_lease_until_its_body_is_read_or_it_is_released() -> None:
    clock = FakeClock()
    limiter = a_limiter(clock, rates=["100/second"], max_concurrent=2)
    in_flight: list[int | None] = []

    async def count() -> None:
        await asyncio.sleep(0)  # (the lease ends in a task of its own)
        await asyncio.sleep(0)
        in_flight.append((await limiter.usage("t-1")).in_flight)

    async def requests(session: ClientSession, base: str) -> None:
        headers = {"Authorization": "Bearer t-1"}
        async with session.get(f"{base}items", headers=headers) as read:
            await count()  # in flight: its body is not read
            assert len(await read.read()) == 8_000_000
            await count()  # read through: ended
        async with session.get(f"{base}items", headers=headers):
            await count()
        await count()  # released unread, as the block ends: ended

    crawl(clock, ThrottledMiddleware(limiter), requests, body=b"x" * 8_000_000)
    assert in_flight == [1, 0, 1, 0]


def test_a_body_that_can_be_sent_only_once_is_never_retried() -> None:
    """A refused request is retried only when its body can be sent again: bytes, text
    and JSON can, a stream read by the first attempt cannot (it would go out empty)."""
    clock = FakeClock()
    limiter = a_limiter(clock)
    statuses: list[int] = []

    async def stream() -> Any:
        yield b"pay"
        yield b"load"

    async def requests(session: ClientSession, base: str) -> None:
        headers = {"Authorization": "Bearer t-1"}
        for body in [b"payload", stream()]:
            async with session.put(f"{base}items/1", data=body, headers=headers) as r:
                statuses.append(r.status)

    received: list[tuple[str, bytes]] = []
    refused = [True, False, True]  # each body's first attempt is refused
    peers: list[Any] = []

    def answer(request: web.Request) -> Answer:
        assert request.transport is not None
        peers.append(request.transport.get_extra_info("peername"))
        return (429, {"Retry-After": "1"}) if refused.pop(0) else (200, {})

    seen = crawl(clock, ThrottledMiddleware(limiter), requests, answer, received=received)
    assert statuses == [200, 429]  # the bytes retried; the stream's 429 returned
    assert [body for _, body in received] == [b"payload", b"payload", b"payload"]
    assert len(seen) == 3
    assert len(set(peers)) == 1  # the refused answer was read: its connection kept


def test_a_pool_token_in_the_query_stays_out_of_the_response_the_caller_gets() -> None:
    """aiohttp builds a response's URL from the URL its request was made with, before
    any middleware: the token set on the attempt shows in neither."""
    clock = FakeClock()

    def in_query(request: Any, token: str) -> None:
        request.url = request.url.copy_add_param("access_token", token)

    pool = TokenPool(["tok-secret"], host="127.0.0.1", apply=in_query)
    shown: list[str] = []

    async def requests(session: ClientSession, base: str) -> None:
        async with session.get(f"{base}items?page=2") as response:
            shown.extend([str(response.url), repr(response.request_info)])
            try:
                response.raise_for_status()
            except ClientResponseError as error:
                shown.append(str(error))

    received: list[tuple[str, bytes]] = []
    crawl(
        clock,
        ThrottledMiddleware(a_limiter(clock), pool=pool),
        requests,
        lambda request: (404, {}),
        received=received,
    )
    assert received[0][0] == "page=2&access_token=tok-secret"  # sent with the token
    assert len(shown) == 3 and not any("tok-secret" in text for text in shown)
    assert shown[0].endswith("/items?page=2")


def test_headers_a_pool_leaves_go_as_they_came_and_its_token_stays_out_of_request_info() -> None:
    """Values beyond ASCII and repeated headers pass as aiohttp sends them; the
    response's request_info (which raise_for_status puts in its error) is the caller's."""
    from multidict import CIMultiDict

    clock = FakeClock()
    pool = TokenPool(["tok-secret"], host="127.0.0.1")
    infos: list[str] = []
    seen_headers: list[tuple[list[str], str]] = []

    def answer(request: web.Request) -> Answer:
        seen_headers.append((request.headers.getall("X-Tag"), request.headers["X-Note"]))
        return 200, {}

    async def requests(session: ClientSession, base: str) -> None:
        headers = CIMultiDict([("X-Tag", "a"), ("X-Tag", "b"), ("X-Note", "café")])
        async with session.get(f"{base}items", headers=headers) as response:
            infos.append(repr(response.request_info))

    seen = crawl(clock, ThrottledMiddleware(a_limiter(clock), pool=pool), requests, answer)
    assert seen[0][0] == "Bearer tok-secret"
    assert seen_headers == [(["a", "b"], "café")]
    assert "tok-secret" not in infos[0] and "items" in infos[0]
