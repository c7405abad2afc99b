"""A pool of tokens used as one: ``acquire_any`` books the earliest slot among several keys
of one quota, in one atomic step, and says which key it took; ``TokenPool`` puts that
key on a request. Every store (memory, SQLite, Redis, Cluster), sync and async; the
random sequences against the reference model are in test_model.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from throttle_client import (
    AsyncLimiter,
    AsyncThrottledTransport,
    ConfigurationError,
    Limiter,
    MemoryBackend,
    Route,
    ThrottledTransport,
    TokenPool,
)
from throttle_client._backends.base import AcquireAny, Choice, Inspect, Quota
from throttle_client.testing import FakeClock

TOKENS = ["tok-a", "tok-b", "tok-c"]
HOST = "api.example.com"


def pooled(make_limiter: Callable[..., Any], **options: Any) -> tuple[Any, FakeClock]:
    """A limiter whose keys share one hash slot (a pool's call is one atomic step, which a
    Cluster can take only on keys of one slot), and its clock."""
    clock = FakeClock()
    options.setdefault("rates", ["2/second"])
    limiter = make_limiter(clock=clock, tag=lambda key: "pool", **options)
    return limiter, clock


def test_a_pool_takes_the_earliest_slot_among_its_keys(make_limiter: Any) -> None:
    """Of equal slots the first key is taken, so an idle pool's calls go to each key in
    turn; each key keeps its own rate and gap, and the pool's calls add up to the sum of
    its keys' (2 per second each: 6 per second from three)."""
    limiter, clock = pooled(make_limiter, min_interval=0.1)
    start = clock()
    taken = [
        (d.key, round(d.slot - start, 6)) for d in (limiter.acquire_any(TOKENS) for _ in range(12))
    ]
    assert taken == [
        ("tok-a", 0.0), ("tok-b", 0.0), ("tok-c", 0.0),
        ("tok-a", 0.1), ("tok-b", 0.1), ("tok-c", 0.1),
        ("tok-a", 1.0), ("tok-b", 1.0), ("tok-c", 1.0),
        ("tok-a", 1.1), ("tok-b", 1.1), ("tok-c", 1.1),
    ]  # fmt: skip
    assert round(clock() - start, 6) == 1.1  # each call slept until its slot
    for token in TOKENS:  # charged to the key it took, and to no other
        assert limiter.usage(token).rates[0].used == 2


def test_a_paused_key_is_passed_over_until_its_pause_ends(make_limiter: Any) -> None:
    limiter, clock = pooled(make_limiter, min_interval=0.1)
    limiter.pause("tok-a", 5)
    start = clock()
    taken = [limiter.acquire_any(TOKENS).key for _ in range(4)]
    assert taken == ["tok-b", "tok-c", "tok-b", "tok-c"]
    assert round(clock() - start, 6) == 0.1  # (b and c's second slots: their gap)
    clock.advance(5)
    assert limiter.acquire_any(TOKENS).key == "tok-a"


def test_try_acquire_any_refuses_with_the_key_that_frees_first(make_limiter: Any) -> None:
    limiter, clock = pooled(make_limiter, rates=["1/second"])
    assert [limiter.try_acquire_any(TOKENS).key for _ in range(2)] == ["tok-a", "tok-b"]
    clock.advance(0.25)
    assert limiter.try_acquire_any(TOKENS).key == "tok-c"
    refused = limiter.try_acquire_any(TOKENS)
    assert (refused.allowed, refused.key, round(refused.retry_after, 6)) == (False, "tok-a", 0.75)
    clock.advance(0.75)  # the refusal booked nothing: a's slot is free at once
    admitted = limiter.try_acquire_any(TOKENS)
    assert (admitted.allowed, admitted.key) == (True, "tok-a")


def test_acquire_any_times_out_booking_nothing(make_limiter: Any) -> None:
    from throttle_client import ThrottleTimeout

    limiter, _ = pooled(make_limiter, rates=["1/second"])
    for _ in range(3):
        limiter.acquire_any(TOKENS)
    with pytest.raises(ThrottleTimeout) as timed_out:
        limiter.acquire_any(TOKENS, timeout=0.5)
    assert round(timed_out.value.retry_after, 6) > 0.5
    assert [limiter.usage(t).rates[0].booked for t in TOKENS] == [0, 0, 0]


def test_a_retried_pool_call_gets_back_the_slot_it_booked(every_store: Any) -> None:
    """A retry (its answer lost, the same call sent again) finds its id in whichever
    key's log holds it, and books nothing more, on every store."""
    quota = Quota(limits=((2, 1_000_000),), min_interval_us=100_000)
    keys = ("pool:{p}a", "pool:{p}b", "pool:{p}c")
    now = 1_700_000_000_000_000

    def call(call_id: str, retry: bool = False) -> Any:
        op = AcquireAny(
            key=keys[0],
            quota=quota,
            cost=1,
            max_wait_us=-1,
            call_id=call_id,
            now_us=now,
            retry=retry,
            others=tuple(Choice(key) for key in keys[1:]),
        )
        return every_store.execute(op)

    first = [call(f"{n:012x}") for n in range(4)]
    assert [(v.chosen, v.slot_us - now) for v in first] == [
        (0, 0), (1, 0), (2, 0), (0, 100_000)
    ]  # fmt: skip
    again = call(f"{2:012x}", retry=True)
    assert (again.allowed, again.chosen, again.slot_us) == (True, 2, now)
    snapshots = [every_store.execute(Inspect(key, quota, now_us=now)) for key in keys]
    # One call at now on each key, and a's second 100 ms on: nothing booked twice.
    assert [(s.used[0], s.booked) for s in snapshots] == [(1, 1), (1, 0), (1, 0)]


def test_a_pool_on_a_cluster_needs_its_keys_in_one_slot(
    every_store: Any, request: pytest.FixtureRequest
) -> None:
    """A Cluster refuses, before anything is sent, a pool whose keys lie in several hash
    slots; given ``tag=``, its keys share one, and the pool works on every store."""
    limiter = Limiter(every_store, rates=["5/second"], clock=FakeClock(), sleep=lambda s: None)
    if request.node.callspec.params["every_store"] == "cluster":
        with pytest.raises(ConfigurationError, match=r"hash slot|tag"):
            limiter.acquire_any(TOKENS)
    else:
        assert limiter.acquire_any(TOKENS).key == "tok-a"
    tagged = Limiter(
        every_store,
        rates=["5/second"],
        namespace="tagged",
        tag=lambda key: "pool",
        clock=FakeClock(),
        sleep=lambda s: None,
    )
    assert tagged.acquire_any(TOKENS).key == "tok-a"


@pytest.mark.parametrize(
    ("keys", "error", "words"),
    [
        ("tok-a", TypeError, "a list of keys, not a str"),
        ([], ConfigurationError, "at least one key"),
        (["tok-a", ""], ConfigurationError, "non-empty string keys, not an empty string"),
        (["tok-a", 7], ConfigurationError, "not a int value"),
        (["tok-a", b"tok-b"], ConfigurationError, "not a bytes value"),
        (["tok-a", "tok-b", "tok-a"], ConfigurationError, "one key twice"),
    ],
)
def test_a_bad_pool_is_refused_before_anything_is_sent(
    keys: Any, error: type[Exception], words: str
) -> None:
    backend = MemoryBackend()
    limiter = Limiter(backend, rates=["5/second"])
    with pytest.raises(error, match=words) as raised:
        limiter.acquire_any(keys)
    assert "tok-a" not in str(raised.value)  # (a key is a token: no message shows one)
    assert backend._logs == {}


def test_a_pool_of_capped_keys_is_refused() -> None:
    limiter = Limiter(MemoryBackend(), rates=["5/second"], max_concurrent=2)
    with pytest.raises(ConfigurationError, match="max_concurrent"):
        limiter.acquire_any(TOKENS)


def test_a_store_without_pools_is_named() -> None:
    class NoPools(MemoryBackend):
        features = MemoryBackend.features - {"pool"}

    limiter = Limiter(NoPools(), rates=["5/second"])
    with pytest.raises(ConfigurationError, match="NoPools does not keep pools"):
        limiter.try_acquire_any(TOKENS)


# -- the transports ----------------------------------------------------------------------


def through_pool(
    mode: str, statuses: list[int], requests: int, **pool: Any
) -> tuple[list[str], Any, float]:
    """``requests`` GETs through a transport with a pool of TOKENS (2 per second each)
    against an upstream that answers ``statuses`` in turn (then 200; a 429 says
    Retry-After: 5). Returns the credentials each request arrived with, the limiter and
    how long the requests took on the fake clock."""
    clock = FakeClock()
    arrived: list[str] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        arrived.append(request.headers.get("Authorization") or request.headers["X-Api-Key"])
        status = statuses.pop(0) if statuses else 200
        return httpx.Response(status, headers={"Retry-After": "5"} if status == 429 else {})

    url = "https://api.example.com/items"
    if mode == "sync":
        limiter: Any = Limiter(MemoryBackend(), rates=["2/second"], clock=clock, sleep=clock.sleep)
        transport: Any = ThrottledTransport(
            limiter,
            transport=httpx.MockTransport(upstream),
            pool=TokenPool(TOKENS, host=HOST, **pool),
        )
        with httpx.Client(transport=transport) as client:
            for _ in range(requests):
                client.get(url)
        return arrived, limiter, clock() - 1_700_000_000.0

    async def run() -> None:
        async with httpx.AsyncClient(transport=transport) as client:
            for _ in range(requests):
                await client.get(url)

    limiter = AsyncLimiter(MemoryBackend(), rates=["2/second"], clock=clock, sleep=clock.asleep)
    transport = AsyncThrottledTransport(
        limiter, transport=httpx.MockTransport(upstream), pool=TokenPool(TOKENS, host=HOST, **pool)
    )
    asyncio.run(run())
    return arrived, limiter, clock() - 1_700_000_000.0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_transport_sends_each_request_with_the_pools_earliest_token(mode: str) -> None:
    arrived, _, took = through_pool(mode, [], 6)
    assert arrived == [f"Bearer {t}" for t in TOKENS * 2]
    assert took == 0.0  # six requests, three tokens of 2 per second: none waited


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_429_pauses_its_token_and_the_retry_takes_another(mode: str) -> None:
    arrived, limiter, took = through_pool(mode, [429], 3)
    # a's 429: its retry goes at once with b; then c, then b again (a is paused for 5 s)
    assert arrived == ["Bearer tok-a", "Bearer tok-b", "Bearer tok-c", "Bearer tok-b"]
    assert took == 0.0
    usage = limiter.usage("tok-a")
    if mode == "async":
        usage = asyncio.run(usage)
    assert round(usage.paused_for, 6) == 5.0


@pytest.mark.parametrize("mode", ["sync"])
def test_a_pool_may_put_its_token_elsewhere(mode: str) -> None:
    def api_key(request: httpx.Request, token: str) -> None:
        request.headers["X-Api-Key"] = token

    arrived, _, _ = through_pool(mode, [], 2, apply=api_key)
    assert arrived == ["tok-a", "tok-b"]


def test_a_routes_pool_wins_and_a_pool_cannot_be_held_in_flight() -> None:
    seen: list[str] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers["Authorization"])
        return httpx.Response(200)

    limiter = Limiter(MemoryBackend(), rates=["2/second"])
    search = Limiter(limiter.backend, rates=["2/second"], namespace="search")
    transport = ThrottledTransport(
        limiter,
        routes=[Route(search, path="/search", pool=TokenPool(["s-1", "s-2"], host=HOST))],
        pool=TokenPool(TOKENS, host=HOST),
        transport=httpx.MockTransport(upstream),
    )
    with httpx.Client(transport=transport) as client:
        client.get("https://api.example.com/search/code")
        client.get("https://api.example.com/items")
    assert seen == ["Bearer s-1", "Bearer tok-a"]
    capped = Limiter(limiter.backend, rates=["2/second"], namespace="capped", max_concurrent=1)
    with pytest.raises(ConfigurationError, match="max_concurrent"):
        ThrottledTransport(routes=[Route(capped, pool=TokenPool(TOKENS, host=HOST))])
    with pytest.raises(ConfigurationError, match=r"TokenPool.*capped.*max_concurrent"):
        ThrottledTransport(
            limiter, pool=TokenPool(TOKENS, host=HOST), also=[(capped, lambda r: "acct")]
        )


@pytest.mark.parametrize("how", ["sync", "async"])
def test_a_pools_requests_are_charged_to_the_account_its_tokens_share(how: str) -> None:
    """Three tokens of 2 a second, their account 4 a second (also=): four requests take
    the tokens in turn and fill the account; the fifth waits for the account, though
    two tokens still have room, and goes out a second later (on the first token, free
    again by then, as the others)."""
    clock = FakeClock()
    seen: list[tuple[str, float]] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append((request.headers["Authorization"], clock()))
        return httpx.Response(200)

    store = MemoryBackend()
    kind = Limiter if how == "sync" else AsyncLimiter
    sleep = clock.sleep if how == "sync" else clock.asleep
    options: dict[str, Any] = {"clock": clock, "sleep": sleep, "margin": 0}
    tokens = kind(store, rates=["2/second"], **options)
    account = kind(store, rates=["4/second"], namespace="account", **options)
    pool, also = TokenPool(TOKENS, host=HOST), [(account, lambda request: "acct")]
    start = clock()
    if how == "sync":
        transport = ThrottledTransport(
            tokens, pool=pool, also=also, transport=httpx.MockTransport(upstream)
        )
        with httpx.Client(transport=transport) as client:
            for _ in range(5):
                client.get(f"https://{HOST}/items")
    else:

        async def crawl() -> None:
            transport = AsyncThrottledTransport(
                tokens, pool=pool, also=also, transport=httpx.MockTransport(upstream)
            )
            async with httpx.AsyncClient(transport=transport) as client:
                for _ in range(5):
                    await client.get(f"https://{HOST}/items")

        asyncio.run(crawl())
    tokens_sent = [token.removeprefix("Bearer ") for token, _ in seen]
    assert tokens_sent == ["tok-a", "tok-b", "tok-c", "tok-a", "tok-a"]
    assert [round(at - start, 2) for _, at in seen] == [0.0, 0.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize(
    ("tokens", "apply", "error", "words"),
    [
        ("tok-a", None, TypeError, "a list of tokens, not a str"),
        ([], None, ConfigurationError, "one or more tokens"),
        (["tok-a", ""], None, ConfigurationError, "token #2 is an empty string"),
        (["tok-a", 7], None, ConfigurationError, "token #2 is a int value"),
        (["tok-a\nX-Other: 1"], None, ConfigurationError, "#1 holds a character no header"),
        (["tok-\u00e9"], None, ConfigurationError, "#1 holds a character no header"),
        (["tok-a", "tok-a"], None, ConfigurationError, r"token twice \(token #2\)"),
        (["tok-a"], "header", TypeError, "function"),
    ],
)
def test_a_bad_token_pool_is_refused_naming_no_token(
    tokens: Any, apply: Any, error: type[Exception], words: str
) -> None:
    options = {} if apply is None else {"apply": apply}
    with pytest.raises(error, match=words) as raised:
        TokenPool(tokens, host=HOST, **options)
    if isinstance(tokens, list):
        assert "tok-a" not in str(raised.value)


# -- a fleet against an upstream that counts by arrival ----------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("store", ["redis", "cluster"])
def test_a_pool_of_40_tokens_sends_what_they_allow_together(
    store: str, mode: str, request: pytest.FixtureRequest
) -> None:
    """Eight workers crawl for 2 s through one client with a pool of 40 tokens, each
    held by the API to 4 a second and 100 ms apart by arrival (tests/pool_fleet.py):
    every token keeps its quota by arrival within the limiter's promise, no 429 is
    left unexplained, and together they send at least 95 % of what the 40 tokens allow
    in that time."""
    from tests.pool_fleet import crawl

    url = request.getfixturevalue("redis_url" if store == "redis" else "cluster_url")
    verdict = crawl(url, cluster=store == "cluster", mode=mode, tokens=40, workers=8, seconds=2.0)
    assert verdict.over_within_promise == verdict.close_within_promise == 0, verdict
    assert verdict.unexcused_429s == 0, verdict
    assert verdict.used >= 0.95 * verdict.possible, verdict


def test_a_pool_sends_its_tokens_to_its_host_alone() -> None:
    """A request to another host, a cross-origin redirect among them, and a request with
    credentials of its own go out without a token of the pool; a pool's repr shows none."""
    seen: list[tuple[str, str | None]] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, request.headers.get("Authorization")))
        if request.url.path == "/download":
            return httpx.Response(302, headers={"Location": "https://cdn.example.net/blob"})
        return httpx.Response(200)

    limiter = Limiter(MemoryBackend(), rates=["5/second"])
    pool = TokenPool(TOKENS, host=HOST)
    transport = ThrottledTransport(limiter, pool=pool, transport=httpx.MockTransport(upstream))
    with httpx.Client(transport=transport, follow_redirects=True) as client:
        client.get(f"https://{HOST}/download")
        client.get("https://hooks.example.org/notify")
        client.get(f"https://{HOST}/items", headers={"Authorization": "Bearer own-token"})
    assert seen == [
        (HOST, "Bearer tok-a"),
        ("cdn.example.net", None),
        ("hooks.example.org", None),
        (HOST, "Bearer own-token"),
    ]
    assert limiter.usage("own-token").rates[0].used == 1  # (keyed by its own token)
    shown = repr(pool) + repr(Route(limiter, pool=pool))
    assert "tok-" not in shown and "3 tokens" in shown


def test_a_pools_host_must_be_a_host() -> None:
    with pytest.raises(ConfigurationError, match="TokenPool's host must be a host name"):
        TokenPool(TOKENS, host="https://api.example.com/")
    with pytest.raises(TypeError, match="host"):
        TokenPool(TOKENS)  # type: ignore[call-arg]


def test_with_the_store_down_allow_takes_the_pools_keys_in_turn() -> None:
    """on_unavailable="allow" admits without a store to say which key is free: a pool's
    calls take its keys in turn, so a key its upstream refuses does not get them all."""
    from throttle_client import RedisBackend
    from throttle_client._redis_server import free_port

    backend = RedisBackend(f"redis://127.0.0.1:{free_port()}/0")
    limiter = Limiter(backend, rates=["5/second"], on_unavailable="allow", retry_for=0)
    taken = [limiter.try_acquire_any(TOKENS).key for _ in range(6)]
    assert taken == TOKENS * 2
    backend.close()


def test_every_key_of_a_pool_the_script_rebuilt_is_told(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A pool's call reads every key: each one whose part the store lost is rebuilt, and
    said, not only the last."""
    import logging

    from throttle_client import RedisBackend
    from throttle_client._backends.redis_codec import redis_keys

    backend = RedisBackend(redis_url)
    limiter = Limiter(backend, rates=["5/second"], namespace="rebuilt", clock=FakeClock())
    for _ in range(3):
        limiter.try_acquire_any(TOKENS)
    log_of = {t: redis_keys(limiter.store_key(t)) for t in TOKENS}
    backend._runner.delete(log_of["tok-a"][1], log_of["tok-c"][0])  # a's meta, c's log
    with caplog.at_level(logging.DEBUG, logger="throttle_client"):  # (a WARNING, then DEBUG)
        assert limiter.try_acquire_any(TOKENS).allowed
    told = [r.getMessage() for r in caplog.records if "repaired" in r.getMessage()]
    keys = [limiter.store_key(t) for t in ("tok-a", "tok-c")]
    assert len(told) == 2 and all(any(key in m for m in told) for key in keys), told
    backend.close()


def test_a_custom_apply_sends_no_token_through_a_redirect_to_another_host() -> None:
    """httpx strips Authorization on a cross-origin redirect, not a header of one's own:
    the token goes on a copy of the request, which a redirect is not built from."""
    seen: list[tuple[str, str | None]] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, request.headers.get("X-Api-Key")))
        if request.url.path == "/download":
            return httpx.Response(302, headers={"Location": "https://cdn.example.net/blob"})
        return httpx.Response(200)

    def api_key(request: httpx.Request, token: str) -> None:
        request.headers["X-Api-Key"] = token

    limiter = Limiter(MemoryBackend(), rates=["5/second"])
    pool = TokenPool(TOKENS, host=HOST, apply=api_key)
    transport = ThrottledTransport(limiter, pool=pool, transport=httpx.MockTransport(upstream))
    with httpx.Client(transport=transport, follow_redirects=True) as client:
        assert client.get(f"https://{HOST}/download").status_code == 200
    assert seen == [(HOST, "tok-a"), ("cdn.example.net", None)]


def test_a_pool_on_a_cluster_without_a_shared_slot_is_a_mistake_not_an_outage(
    cluster_url: str,
) -> None:
    """Through a transport as through acquire_any: keys in several hash slots are refused
    before anything is sent, naming tag=, whatever on_unavailable says."""
    from throttle_client import RedisBackend

    backend = RedisBackend(cluster_url, cluster=True)
    limiter = Limiter(backend, rates=["5/second"], on_unavailable="allow")
    tokens = [f"tok-{n:02d}" for n in range(20)]
    transport = ThrottledTransport(
        limiter,
        pool=TokenPool(tokens, host=HOST),
        transport=httpx.MockTransport(lambda request: httpx.Response(200)),
    )
    with (
        httpx.Client(transport=transport) as client,
        pytest.raises(ConfigurationError, match=r"tag=.*") as refused,
    ):
        client.get(f"https://{HOST}/items")
    assert "(20 keys)" in str(refused.value) and "tok-" not in str(refused.value)
    backend.close()


def test_a_routes_pool_must_be_for_the_routes_host() -> None:
    limiter = Limiter(MemoryBackend(), rates=["5/second"])
    with pytest.raises(ConfigurationError, match="give both the same host"):
        Route(limiter, host="api.example.com", pool=TokenPool(TOKENS, host="api.other.com"))
    assert repr(TokenPool(["tok-a"], host=HOST)) == "TokenPool(1 token, host='api.example.com')"


def test_a_pool_charged_to_one_of_its_own_keys_again_is_refused_before_anything_is_sent() -> None:
    limiter = Limiter(MemoryBackend(), rates=["3/second"], namespace="n")
    other = Limiter(limiter.backend, rates=["1/second"], namespace="m")
    for also in ([(limiter, "tok-b")], [(other, "acct"), (other, "acct")]):
        with pytest.raises(ConfigurationError, match="charged to one key twice"):
            limiter.try_acquire_any(["tok-a", "tok-b"], also=also)
    assert limiter.usage("tok-b").rates[0].used == 0 and other.usage("acct").rates[0].used == 0


def test_a_pools_token_never_goes_out_over_plain_http_unless_told() -> None:
    """A redirect from https down to http on the pool's host gets no token; a host the
    pool names with its port, or a loopback one, is served on either scheme."""
    seen: list[tuple[str, str | None]] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.scheme, request.headers.get("Authorization")))
        return httpx.Response(200)

    for host, url, sent in [
        (HOST, f"https://{HOST}/items", True),
        (HOST, f"http://{HOST}/items", False),
        (f"{HOST}:8080", f"http://{HOST}:8080/items", True),
        ("127.0.0.1", "http://127.0.0.1/items", True),
    ]:
        limiter = Limiter(MemoryBackend(), rates=["10/second"])
        transport = ThrottledTransport(
            limiter, transport=httpx.MockTransport(upstream), pool=TokenPool(TOKENS, host=host)
        )
        with httpx.Client(transport=transport) as client:
            client.get(url)
        assert (seen[-1][1] is not None) == sent, (host, url)
