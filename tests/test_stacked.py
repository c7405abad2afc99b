"""Stacked limits: one call charged to several keys, each
under its own quota, all or nothing. Every store's AcquireAll (memory, SQLite, Redis,
Cluster) against the naive model:
same verdict and slot on random sequences that mix single-key calls, stacked calls and
pauses; a refusal writes nothing in any key's log."""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from throttle_client import (
    Backend,
    ConfigurationError,
    MemoryBackend,
    RedisBackend,
    SQLiteBackend,
    store_key,
)
from throttle_client._backends.base import (
    Acquire,
    AcquireAll,
    AcquireAny,
    Charge,
    Inspect,
    Pause,
    Quota,
)
from throttle_client._backends.ops import Choice
from throttle_client._backends.redis_codec import lease_keys, redis_keys
from throttle_client._redis_server import free_port
from throttle_client.testing import FakeClock

from .model import Model, StackedModel

KEYS = ("token-a", "token-b", "account")
MS = 1000
_ids = itertools.count()


def call_id() -> str:
    return f"c{next(_ids)}"


quotas = st.builds(
    lambda rates, gap: Quota(limits=tuple(rates), min_interval_us=gap),
    st.lists(
        st.tuples(st.integers(1, 4), st.sampled_from([100 * MS, 250 * MS, 1000 * MS])),
        min_size=1,
        max_size=2,
    ),
    st.sampled_from([0, 0, 30 * MS, 100 * MS]),
)

steps = st.lists(
    st.one_of(
        st.tuples(
            st.just("advance"), st.sampled_from([1, 29 * MS, 50 * MS, 99 * MS, 100 * MS, 250 * MS])
        ),
        st.tuples(st.just("one"), st.sampled_from(KEYS), st.sampled_from([0, 200 * MS, None])),
        st.tuples(
            st.just("all"),
            st.lists(st.sampled_from(KEYS), min_size=2, max_size=3, unique=True),
            st.sampled_from([0, 200 * MS, None]),
        ),
        st.tuples(st.just("pause"), st.sampled_from(KEYS), st.sampled_from([50 * MS, 300 * MS])),
    ),
    max_size=40,
)


# Tokens slower than the account they share (as in a fleet: the account's quota is
# several tokens' worth), so that the account is seldom what holds a call back.
token_quotas = st.builds(
    lambda limit, period, gap: Quota(limits=((limit, period),), min_interval_us=gap),
    st.integers(1, 2),
    st.sampled_from([250 * MS, 1000 * MS]),
    st.sampled_from([0, 100 * MS]),
)
account_quotas = st.builds(
    lambda rates, gap: Quota(limits=tuple(rates), min_interval_us=gap),
    st.lists(
        st.tuples(st.integers(2, 5), st.sampled_from([250 * MS, 1000 * MS])), min_size=1, max_size=2
    ),
    st.sampled_from([0, 0, 30 * MS]),
)

# Calls charged to a token and the account they share, most of them, so that one token's
# calls booked ahead leave room in the account that the other token's calls may take.
_busy_all = st.tuples(
    st.just("all"),
    st.sampled_from(
        [
            ["token-a", "account"],
            ["token-a", "account"],
            ["token-b", "account"],
            ["account", "token-a"],
            ["token-b", "token-a", "account"],
        ]
    ),
    st.sampled_from([0, 200 * MS, None, None]),
    st.sampled_from([1, 1, 2]),  # the account's cost (its limits are 2 or more)
)
busy_steps = st.lists(
    st.one_of(
        _busy_all,
        _busy_all,
        _busy_all,
        st.tuples(st.just("advance"), st.sampled_from([1, 29 * MS, 50 * MS, 100 * MS])),
        st.tuples(st.just("one"), st.sampled_from(KEYS), st.sampled_from([0, None])),
        st.tuples(st.just("pause"), st.sampled_from(KEYS), st.sampled_from([50 * MS])),
        st.tuples(st.just("pool"), st.sampled_from([0, 200 * MS, None])),
    ),
    min_size=10,
    max_size=40,
)


def seen(store: Backend, key: str, quota: Quota, now: int) -> Any:
    """What a key's log says at ``now`` (a pause that has ended says nothing)."""
    snap = store.execute(Inspect(key, quota, now_us=now))
    pause = snap.pause_until_us if snap.pause_until_us > now else None
    return (snap.next_slot_us, snap.booked, snap.used, snap.ready_at_us, pause)


def wait_us(max_wait: int | None) -> int:
    return -1 if max_wait is None else max_wait


_examples = itertools.count()


@contextlib.contextmanager
def a_store(
    kind: str, request: pytest.FixtureRequest, shared: dict[str, RedisBackend]
) -> Iterator[tuple[Backend, dict[str, str]]]:
    """A store, and the store keys this example uses for KEYS: fresh ones, sharing one
    hash tag so that a Cluster holds them in one slot."""
    n = next(_examples)
    names = {key: f"ex{n}:{{t{n}}}{key}" for key in KEYS}
    if kind == "memory":
        yield MemoryBackend(), names
    elif kind == "sqlite":
        with tempfile.TemporaryDirectory() as folder, SQLiteBackend(Path(folder) / "s.db") as db:
            yield db, names
    else:
        if kind not in shared:
            server = request.getfixturevalue("redis_server" if kind == "redis" else "redis_cluster")
            shared[kind] = RedisBackend(server.url, cluster=kind == "cluster")
        yield _Lasting(shared[kind], names), names


class _Lasting(Backend):
    """A Redis store whose keys do not expire while an example runs: Redis counts their
    TTLs in real time, the example's clock jumps by seconds in a few milliseconds."""

    def __init__(self, backend: RedisBackend, names: dict[str, str]) -> None:
        self.backend, self.names = backend, names

    def execute(self, op: Any) -> Any:
        answer = self.backend.execute(op)
        client = self.backend.client
        for name in self.names.values():
            for stored in redis_keys(name) + lease_keys(name):  # (test_leases' too)
                client.persist(stored)  # type: ignore[union-attr]
        return answer


@pytest.mark.parametrize("kind", ["memory", "sqlite", "redis", "cluster"])
@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(quota_list=st.lists(quotas, min_size=3, max_size=3), script=steps)
def test_a_stacked_acquire_agrees_with_the_naive_model(
    request: pytest.FixtureRequest,
    redis_stores: dict[str, RedisBackend],
    kind: str,
    quota_list: list[Quota],
    script: Any,
) -> None:
    with a_store(kind, request, redis_stores) as (store, names):
        run_against_the_model(store, names, quota_list, script)


@pytest.mark.parametrize("kind", ["memory", "sqlite", "redis", "cluster"])
@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    # (one quota for both tokens: a pool's call takes either)
    quota_list=st.tuples(token_quotas, account_quotas).map(lambda q: [q[0], q[0], q[1]]),
    script=busy_steps,
)
def test_a_shared_key_lends_its_room_as_the_naive_model_does(
    request: pytest.FixtureRequest,
    redis_stores: dict[str, RedisBackend],
    kind: str,
    quota_list: list[Quota],
    script: Any,
) -> None:
    with a_store(kind, request, redis_stores) as (store, names):
        run_against_the_model(store, names, quota_list, script)


def run_against_the_model(
    store: Backend, names: dict[str, str], quota_list: list[Quota], script: Any
) -> None:
    quota = dict(zip(KEYS, quota_list, strict=True))
    model = StackedModel(
        {k: Model(rates=list(q.limits), min_interval=q.min_interval_us) for k, q in quota.items()}
    )
    now = 1_000_000 * MS
    for step in script:
        if step[0] == "advance":
            now += step[1]
        elif step[0] == "one":
            key, max_wait = step[1], step[2]
            verdict = store.execute(
                Acquire(names[key], quota[key], 1, wait_us(max_wait), call_id(), now_us=now)
            )
            expected = model.models[key].acquire(key, now, 1, max_wait)
            assert (verdict.allowed, verdict.slot_us) == (expected.allowed, expected.slot)
        elif step[0] == "all":
            keys, max_wait = step[1], step[2]
            costs = {k: step[3] if k == "account" and len(step) > 3 else 1 for k in keys}
            before = {k: seen(store, names[k], quota[k], now) for k in KEYS}
            charges = tuple(Charge(names[k], quota[k], costs[k]) for k in keys)
            verdict = store.execute(AcquireAll(charges, wait_us(max_wait), call_id(), now_us=now))
            allowed, slot = model.acquire_all([(k, costs[k]) for k in keys], now, max_wait)
            assert (verdict.allowed, verdict.slot_us) == (allowed, slot)
            if not allowed:  # a refusal leaves no trace in any log
                after = {k: seen(store, names[k], quota[k], now) for k in KEYS}
                assert after == before
        elif step[0] == "pool":  # a pool of both tokens, charged to the account too
            max_wait = step[1]
            tokens = ["token-a", "token-b"]
            others = (Choice(names["token-b"]),)
            account = (Charge(names["account"], quota["account"], 1),)
            verdict = store.execute(
                AcquireAny(
                    names["token-a"],
                    quota["token-a"],
                    1,
                    wait_us(max_wait),
                    call_id(),
                    now_us=now,
                    others=others,
                    partners=account,
                )
            )
            horizon = quota["token-a"].horizon_us
            key, allowed, slot = model.acquire_any(tokens, [("account", 1)], now, max_wait, horizon)
            took = tokens[verdict.chosen]
            assert (took, verdict.allowed, verdict.slot_us) == (key, allowed, slot)
        else:
            key, duration = step[1], step[2]
            store.execute(Pause(names[key], quota[key], duration, now_us=now))
            model.models[key].pause(key, now, duration)


def test_a_stacked_call_takes_the_slot_that_suits_every_key() -> None:
    """Token: 2 per second; account: 3 per second, shared with another token."""
    store = MemoryBackend()
    token = Quota(limits=((2, 1000 * MS),), min_interval_us=0)
    account = Quota(limits=((3, 1000 * MS),), min_interval_us=0)
    now = 10_000 * MS

    def both(token_key: str, max_wait: int = -1) -> Any:
        charges = (Charge(token_key, token, 1), Charge("account", account, 1))
        return store.execute(AcquireAll(charges, max_wait, call_id(), now_us=now))

    assert [both("a").slot_us, both("a").slot_us] == [now, now]  # the token is full
    assert both("b").slot_us == now  # the account's third unit
    refused = both("b", max_wait=0)  # the account is full until a second later
    assert not refused.allowed and refused.slot_us == now + 1000 * MS
    assert store.execute(Inspect("b", token, now_us=now)).used == (1,)  # refusal: no trace
    assert both("b").slot_us == now + 1000 * MS
    assert both("a").remaining == (1, 1)  # at the new slot: token a 1 of 2, account 2 of 3


def test_a_retried_stacked_call_gets_its_slot_back() -> None:
    store = MemoryBackend()
    quota = Quota(limits=((1, 1000 * MS),), min_interval_us=0)
    op = AcquireAll((Charge("x", quota, 1), Charge("y", quota, 1)), -1, "same", now_us=0)
    first = store.execute(op)
    again = store.execute(replace(op, retry=True))  # sent again after a lost answer
    assert first.slot_us == again.slot_us == 0
    assert store.execute(Inspect("x", quota, now_us=0)).used == (1,)  # booked once


def test_the_same_key_twice_is_refused() -> None:
    quota = Quota(limits=((1, 1000 * MS),), min_interval_us=0)
    with pytest.raises(ValueError, match="distinct keys"):
        AcquireAll((Charge("x", quota, 1), Charge("x", quota, 1)), -1, "id")


# -- the public API: also= -----------------------------------------------------------------

ACCOUNT_OF = {"token-1": "acct-9", "token-2": "acct-9"}


def token_and_account(make_limiter: Any) -> tuple[Any, Any, Any]:
    """A token limiter (2/second) and an account limiter (3/second) on one store, their
    keys tagged by the account so that a Cluster holds a call's keys in one slot; and
    the account limiter as ``also=`` takes it (the AsyncLimiter behind a SyncView)."""
    clock = FakeClock()
    tokens = make_limiter(
        rates=["2/second"], namespace="token", tag=ACCOUNT_OF.__getitem__, clock=clock
    )
    account = make_limiter(
        rates=["3/second"],
        namespace="account",
        tag=lambda account_id: account_id,
        clock=clock,
        backend=tokens.backend,
    )
    return tokens, account, getattr(account, "limiter", account)


def test_a_call_charged_to_a_token_and_its_account_is_held_to_both(make_limiter: Any) -> None:
    tokens, account, partner = token_and_account(make_limiter)
    both = [(partner, "acct-9")]
    first = tokens.try_acquire("token-1", also=both)
    assert first.allowed
    assert [(r.limit, r.period) for r in first.rates] == [(2, 1.0), (3, 1.0)]
    assert first.remaining == (1, 2)  # the token's rate, then the account's
    assert tokens.try_acquire("token-1", also=both).allowed
    refused = tokens.try_acquire("token-1", also=both)  # the token is full
    assert not refused.allowed and refused.retry_after == pytest.approx(1.0)
    assert account.usage("acct-9").rates[0].used == 2  # the refusal wrote nothing there
    assert tokens.try_acquire("token-2", also=both).allowed  # the account's third unit
    assert not tokens.try_acquire("token-2", also=both).allowed  # the account is full
    assert tokens.usage("token-2").rates[0].used == 1  # nothing written for token-2 either
    waited = tokens.acquire("token-2", also=both)  # the first slot both allow
    assert waited.slot - first.slot == pytest.approx(1.0)


def test_a_stacked_call_on_keys_a_cluster_cannot_hold_together_is_refused_first(
    make_limiter: Any,
) -> None:
    tokens = make_limiter(rates=["2/second"], namespace="token")
    account = make_limiter(rates=["3/second"], namespace="account", backend=tokens.backend)
    partner = getattr(account, "limiter", account)
    if make_limiter.kind != "cluster":  # one store, one step: untagged keys are fine
        assert tokens.try_acquire("token-1", also=[(partner, "acct-9")]).allowed
        return
    with pytest.raises(ConfigurationError, match=r"share a hash slot.*same tag="):
        tokens.try_acquire("token-1", also=[(partner, "acct-9")])
    assert tokens.usage("token-1").rates[0].used == 0  # refused before anything was sent


def test_a_stacked_call_needs_limiters_of_one_store_and_distinct_keys(make_limiter: Any) -> None:
    tokens = make_limiter(rates=["2/second"], namespace="token")
    elsewhere = make_limiter(rates=["3/second"], namespace="account")
    partner = getattr(elsewhere, "limiter", elsewhere)
    with pytest.raises(ConfigurationError, match="another store"):
        tokens.try_acquire("t", also=[(partner, "a")])
    same = getattr(tokens, "limiter", tokens)
    with pytest.raises(ConfigurationError, match="one key twice"):
        tokens.try_acquire("t", also=[(same, "t")])
    with pytest.raises(TypeError, match="also= takes"):
        tokens.try_acquire("t", also=[(object(), "a")])


def test_a_tag_changes_where_a_key_is_kept_but_not_that_it_is_secret() -> None:
    tagged = store_key("token-1", namespace="token", tag="acct-9")
    account = store_key("acct-9", namespace="account", tag="acct-9")
    assert tagged != store_key("token-1", namespace="token")  # a key keeps one tag, always
    assert tagged.split("}")[0] == "token:" + account.split(":", 1)[1].split("}")[0]
    assert "token-1" not in tagged and "acct-9" not in tagged + account
    with pytest.raises(ConfigurationError, match="a tag must be a non-empty string, not a int"):
        store_key("token-1", tag=42)  # type: ignore[arg-type]


def test_when_the_store_is_down_on_unavailable_answers_a_stacked_call_too() -> None:
    from throttle_client import Limiter, LocalFallback, RedisBackend

    port = free_port()
    for choice, admitted in (("allow", 5), (LocalFallback(expected_workers=2), 1)):
        with RedisBackend(f"redis://127.0.0.1:{port}") as down:  # nothing listens there
            options: dict[str, Any] = {"on_unavailable": choice, "retry_for": 0}
            tokens = Limiter(down, rates=["2/second"], namespace="token", **options)
            account = Limiter(down, rates=["3/second"], namespace="account", **options)
            decisions = [tokens.try_acquire("t", also=[(account, "a")]) for _ in range(5)]
            assert sum(d.allowed for d in decisions) == admitted  # a share of 1 for each key
            assert decisions[0].remaining == ((2, 3) if choice == "allow" else (0, 0))


def stacked_pair(mode: str) -> tuple[Any, Any, FakeClock]:
    from throttle_client import AsyncLimiter, Limiter

    clock = FakeClock()
    store = MemoryBackend()

    def make(**options: Any) -> Any:
        if mode == "sync":
            return Limiter(store, margin=0, clock=clock, sleep=clock.sleep, **options)
        return AsyncLimiter(store, margin=0, clock=clock, sleep=clock.asleep, **options)

    return (
        make(rates=["2/second"], namespace="token"),
        make(rates=["3/second"], namespace="account"),
        clock,
    )


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_transport_charges_each_request_to_its_token_and_its_account(mode: str) -> None:
    import asyncio

    import httpx

    from throttle_client import AsyncThrottledTransport, ThrottledTransport

    tokens, account, clock = stacked_pair(mode)
    sent: list[tuple[float, str]] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        sent.append((clock.now, request.headers["Authorization"]))
        return httpx.Response(200)

    also = [(account, lambda request: "acct-9")]
    requests = [("A", "Bearer A"), ("A", "Bearer A"), ("B", "Bearer B"), ("B", "Bearer B")]
    if mode == "sync":
        with httpx.Client(
            transport=ThrottledTransport(tokens, also=also, transport=httpx.MockTransport(upstream))
        ) as client:
            for _, header in requests:
                client.get("https://api.example.com/x", headers={"Authorization": header})
    else:

        async def crawl() -> None:
            transport = AsyncThrottledTransport(
                tokens, also=also, transport=httpx.MockTransport(upstream)
            )
            async with httpx.AsyncClient(transport=transport) as client:
                for _, header in requests:
                    await client.get("https://api.example.com/x", headers={"Authorization": header})

        asyncio.run(crawl())
    start = sent[0][0]
    # Three at once fill the account (3/second); the fourth waits for its window.
    assert [round(t - start, 6) for t, _ in sent] == [0.0, 0.0, 0.0, 1.0]


def test_the_decorator_charges_each_call_to_the_keys_its_arguments_name() -> None:
    from throttle_client import throttled

    tokens, account, clock = stacked_pair("sync")

    @throttled(tokens, key="token", also=[(account, "account_id")])
    def fetch(token: str, account_id: str) -> float:
        return clock.now

    times = [fetch(token, "acct-9") for token in ("A", "A", "B", "B")]
    assert [t - times[0] for t in times] == [0.0, 0.0, 0.0, 1.0]
    assert account.usage("acct-9").rates[0].used == 1  # the fourth: the window is now past 3
    assert tokens.usage("B").rates[0].used == 1  # B's second call, in its own window
    with pytest.raises(ConfigurationError, match="names no argument"):
        throttled(tokens, key="token", also=[(account, "acount")])(fetch)


def test_a_key_can_be_charged_its_own_cost() -> None:
    """GitHub: a write costs 5 of the endpoint's 900 points and 1 of the token's 5000."""
    tokens, endpoint, _ = stacked_pair("sync")
    decision = tokens.try_acquire("A", 1, also=[(endpoint, "POST /repos", 3)])
    assert decision.remaining == (1, 0)  # token: 1 of 2 left; endpoint: 3 of 3 spent
    refused = tokens.try_acquire("B", 1, also=[(endpoint, "POST /repos", 1)])
    assert not refused.allowed
    with pytest.raises(TypeError, match=r"\(limiter, key\) or \(limiter, key, cost\)"):
        tokens.try_acquire("A", also=[endpoint])  # type: ignore[list-item]


def test_a_stacked_call_arrives_within_the_narrowest_margin() -> None:
    """The account's windows were widened by 10 ms only: a call 50 ms late for its slot
    is late for the account, whatever the token's own 100 ms margin allows."""
    from throttle_client import Limiter

    clock = FakeClock()
    store = MemoryBackend()
    late = [0.05]

    def sleep(seconds: float) -> None:
        clock.advance(seconds + (late.pop() if late else 0.0))

    tokens = Limiter(store, rates=["5/second"], margin=0.1, clock=clock, sleep=sleep)
    account = Limiter(store, rates=["1/second"], namespace="account", margin=0.01, clock=clock)
    tokens.acquire("A", also=[(account, "acct")])
    decision = tokens.acquire("A", also=[(account, "acct")])  # sleeps ~1 s, wakes 50 ms late
    assert decision.late_wakeups == 1  # booked again rather than crowd the account


Pauses = Callable[[Any, Any], Any]  # (search, account) -> a pauses= function


def refused_once(
    mode: str, route_pauses: Pauses | None = None, transport_pauses: Pauses | None = None
) -> tuple[Any, Any, Any, float]:
    """A request routed to a search limiter, charged to its account too (the
    transport's also=), refused once with a 429 and Retry-After: 5, then one with
    another token. Returns the account's usage after the 429, the search key's,
    the other token's on the search limiter, and how long the other token's request
    waited."""
    import asyncio

    import httpx

    from throttle_client import AsyncThrottledTransport, RetryPolicy, Route, ThrottledTransport

    tokens, account, clock = stacked_pair(mode)
    sleep = clock.sleep if mode == "sync" else clock.asleep
    search = type(tokens)(
        tokens.backend, rates=["10/second"], namespace="search", clock=clock, sleep=sleep
    )
    statuses = [429, 200]

    def upstream(request: httpx.Request) -> httpx.Response:
        status = statuses.pop(0) if statuses else 200
        return httpx.Response(status, headers={"Retry-After": "5"} if status == 429 else {})

    own = route_pauses(search, account) if route_pauses else None
    cls = ThrottledTransport if mode == "sync" else AsyncThrottledTransport
    transport = cls(
        tokens,
        routes=[Route(search, path="/search", pauses=own)],
        also=[(account, lambda request: "acct-9")],
        transport=httpx.MockTransport(upstream),
        retry=RetryPolicy(max_attempts=1),
        pauses=transport_pauses(search, account) if transport_pauses else None,
    )
    url, headers = "https://api.example.com/search/code", {"Authorization": "Bearer A"}
    other_token = {"Authorization": "Bearer B"}
    if mode == "sync":
        with httpx.Client(transport=transport) as client:
            assert client.get(url, headers=headers).status_code == 429
            paused = account.usage("acct-9"), search.usage("A"), search.usage("B")
            sent_at = clock()  # another token of the account, right after the 429
            assert client.get(url, headers=other_token).status_code == 200
        return (*paused, clock() - sent_at)

    async def run() -> tuple[Any, Any, Any, float]:
        async with httpx.AsyncClient(transport=transport) as client:
            assert (await client.get(url, headers=headers)).status_code == 429
            paused = (
                await account.usage("acct-9"),
                await search.usage("A"),
                await search.usage("B"),
            )
            sent_at = clock()
            assert (await client.get(url, headers=other_token)).status_code == 200
        return (*paused, clock() - sent_at)

    return asyncio.run(run())


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "throttle_client" and r.levelno == logging.WARNING
    ]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_refusal_pauses_the_request_s_own_key_and_leaves_its_account_sending(
    mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Which quota a 429 refers to, the upstream alone knows: by default the request's
    own key is paused, and the account it shares with other tokens is not."""
    caplog.set_level(logging.WARNING, logger="throttle_client")
    account, searched, other, waited = refused_once(mode)
    warnings = warnings_of(caplog)
    assert account.rates[0].used == 1  # the routed request was charged to the account too
    assert searched.paused_for == pytest.approx(5.0)  # the 429 paused the route's own key
    assert account.paused_for == 0  # and not the account: its other tokens keep sending
    assert other.paused_for == 0 and waited == 0
    assert len(warnings) == 1 and "pausing key#" in warnings[0], warnings


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_route_s_pauses_names_the_limiters_a_refusal_holds_and_the_log_names_each_key(
    mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    def both(search: Any, account: Any) -> Any:
        return lambda response: [account, search] if response.status_code == 429 else []

    caplog.set_level(logging.WARNING, logger="throttle_client")
    account, searched, other, waited = refused_once(mode, route_pauses=both)
    warnings = warnings_of(caplog)
    assert account.paused_for == pytest.approx(5.0)
    assert searched.paused_for == pytest.approx(5.0)
    assert other.paused_for == 0  # another token of the search limiter: not this key
    assert waited == pytest.approx(5.0)  # but of the account: it waits out its pause
    line = warnings[0]
    assert "of search" in line and "of account" in line and "acct-9" not in line, line


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_route_s_pauses_wins_over_the_transport_s(
    mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    def account_only(search: Any, account: Any) -> Any:
        return lambda response: [account]

    def nothing(search: Any, account: Any) -> Any:
        return lambda response: ()

    caplog.set_level(logging.WARNING, logger="throttle_client")
    account, searched, _, _ = refused_once(mode, transport_pauses=account_only)
    assert (account.paused_for, searched.paused_for) == (pytest.approx(5.0), 0)
    caplog.clear()
    account, searched, _, _ = refused_once(
        mode, route_pauses=nothing, transport_pauses=account_only
    )
    # The route's, naming none: its own key all the same (never no key: its retries
    # would go at once to an upstream that asked them to wait).
    assert (account.paused_for, searched.paused_for) == (0, pytest.approx(5.0))
    warnings = warnings_of(caplog)
    assert len(warnings) == 1 and "of search for 5.00s" in warnings[0], warnings


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_pauses_may_answer_one_limiter_or_none_for_the_request_s_own(mode: str) -> None:
    account, searched, _, _ = refused_once(mode, route_pauses=lambda search, acct: lambda r: acct)
    assert (account.paused_for, searched.paused_for) == (pytest.approx(5.0), 0)
    account, searched, _, _ = refused_once(mode, route_pauses=lambda search, acct: lambda r: None)
    assert (account.paused_for, searched.paused_for) == (0, pytest.approx(5.0))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_mistake_in_pauses_is_logged_and_never_loses_the_pause(
    mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The response has arrived: a limiter the request is not charged to, a function
    that fails or a coroutine function are logged, and the request's own key is paused
    (the 429 still reaches the caller)."""
    tokens, _, clock = stacked_pair(mode)
    stranger = type(tokens)(tokens.backend, rates=["1/second"], namespace="stranger", clock=clock)

    def fails(response: Any) -> Any:
        raise ValueError("no such header")

    async def coroutine(response: Any) -> Any:
        return []

    caplog.set_level(logging.WARNING, logger="throttle_client")
    for pauses, said in [
        (lambda response: [stranger], r"pauses= named .*stranger.* not charged to it"),
        (fails, r"pauses= failed for GET api.example.com/search: pausing its own key"),
        (coroutine, r"pauses= failed for GET api.example.com/search"),
    ]:
        caplog.clear()
        account, searched, _, _ = refused_once(mode, route_pauses=lambda s, a, p=pauses: p)
        assert (account.paused_for, searched.paused_for) == (0, pytest.approx(5.0))
        lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert any(re.search(said, line) for line in lines), lines
    with pytest.raises(TypeError, match=r"pauses= takes a function of the response"):
        from throttle_client import Route

        Route(tokens, pauses=[stranger])  # type: ignore[arg-type]


def test_tags_that_differ_are_refused_on_every_store_once_one_key_is_tagged() -> None:
    from throttle_client import Limiter

    store = MemoryBackend()
    tokens = Limiter(store, rates=["2/second"], namespace="token", tag=lambda t: "acct:" + t)
    account = Limiter(store, rates=["3/second"], namespace="account", tag=lambda a: a)
    with pytest.raises(ConfigurationError, match=r"different tags.*same key_secret"):
        tokens.try_acquire("A", also=[(account, "A")])  # "acct:A" is not "A"
    assert tokens.usage("A").rates[0].used == 0  # refused before anything was written
    same = Limiter(store, rates=["3/second"], namespace="account", tag=lambda a: "acct:" + a)
    assert tokens.try_acquire("A", also=[(same, "A")]).allowed


def test_a_repair_in_a_stacked_call_names_the_key_it_repaired(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    import redis

    from throttle_client import Limiter

    with RedisBackend(redis_url) as store:
        tokens = Limiter(store, rates=["5/second"], namespace="token")
        account = Limiter(store, rates=["5/second"], namespace="account")
        assert tokens.try_acquire("t", also=[(account, "a")])
        admin = redis.Redis.from_url(redis_url)
        admin.delete(redis_keys(account.store_key("a"))[0])  # the account's log is lost
        admin.close()
        with caplog.at_level("WARNING", logger="throttle_client"):
            assert tokens.try_acquire("t", also=[(account, "a")])
    (message,) = [r.getMessage() for r in caplog.records if "repaired" in r.getMessage()]
    assert account.store_key("a") in message and tokens.store_key("t") not in message
    assert "its log was lost" in message


# -- a fleet against an upstream that counts by arrival ----------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("store", ["redis", "cluster"])
def test_a_hot_token_leaves_its_account_room_for_the_others(
    store: str, mode: str, request: pytest.FixtureRequest
) -> None:
    """Four tokens of 8 a second share an account of 20; four workers send on token A,
    four on the others, each request charged to its token and the account (also=), for
    3 s against an upstream that holds both quotas by arrival (tests/account_fleet.py).
    A's calls, booked ahead by its own rate, leave the account's room between them to
    the others: every quota is kept by arrival within the limiter's promise, no 429 is
    left unexplained, and the account is used to at least 95 % of what it allows."""
    from tests.account_fleet import crawl

    url = request.getfixturevalue("redis_url" if store == "redis" else "cluster_url")
    verdict = crawl(url, cluster=store == "cluster", mode=mode, seconds=3.0)
    assert verdict.over_within_promise == 0, verdict
    assert verdict.unexcused_429s == 0, verdict
    assert verdict.used >= 0.95 * verdict.possible, verdict
    assert verdict.hot >= 0.9 * 8 * 3, verdict  # and A keeps its own share


@pytest.mark.parametrize("kind", ["memory", "sqlite", "redis", "cluster"])
def test_a_shared_key_with_too_many_bookings_ahead_books_after_its_newest(
    request: pytest.FixtureRequest, redis_stores: dict[str, RedisBackend], kind: str
) -> None:
    """A fill reads at most 256 bookings (a bound on a decision's work): past that, a call
    takes the slot after the shared key's newest call, on every store alike; at 256 it is
    filled in at once."""
    token = Quota(limits=((1, 10 * MS),), min_interval_us=0)
    account = Quota(limits=((1000, 1000 * MS),), min_interval_us=0)
    now = 1_000_000 * MS
    for ahead, expected in [(256, now), (257, now + 2560 * MS)]:  # (the newest: 2.56 s on)
        with a_store(kind, request, redis_stores) as (store, names):
            busy = (Charge(names["token-a"], token, 1), Charge(names["account"], account, 1))
            for _ in range(ahead):  # the busy token's calls, 10 ms apart, in the account
                store.execute(AcquireAll(busy, -1, call_id(), now_us=now))
            other = (Charge(names["token-b"], token, 1), Charge(names["account"], account, 1))
            verdict = store.execute(AcquireAll(other, -1, call_id(), now_us=now))
            assert verdict.slot_us == expected, (ahead, verdict.slot_us - now)
