"""Concurrency caps: leases held from admission until a call ends.

Every store (memory, SQLite, Redis, Cluster) against the plain reference model of
``tests/model.py`` (``CapModel``): the same answers on random sequences of capped
calls over several keys, releases, renewals and time passing, and a refusal writes
nothing anywhere. Then the limiter's side: ``lease()`` in both worlds on every store.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from throttle_client import (
    AsyncLimiter,
    AsyncRedisBackend,
    Backend,
    ConfigurationError,
    Limiter,
    MemoryBackend,
    RedisBackend,
    SQLiteBackend,
    ThrottleTimeout,
)
from throttle_client._backends.base import AcquireAll, Charge, Inspect, Quota, Release, Renew
from throttle_client.testing import FakeClock

from .handoff import InFlight, handoff_seconds
from .model import CapModel, Model, StackedModel
from .test_stacked import a_store, seen

MS = 1000
KEYS = ("token-a", "token-b", "account")
LEASES = tuple(f"n.lease{i}" for i in range(5))
_examples = itertools.count()
_calls = itertools.count()

caps = st.tuples(st.integers(1, 2), st.sampled_from([300 * MS, 1000 * MS]))
steps = st.lists(
    st.one_of(
        st.tuples(st.just("advance"), st.sampled_from([1, 100 * MS, 299 * MS, 300 * MS, 600 * MS])),
        st.tuples(
            st.just("acquire"),
            st.sampled_from(LEASES),
            st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True),
            st.sampled_from([0, 0, 200 * MS, None]),
        ),
        st.tuples(st.just("release"), st.sampled_from(LEASES)),
        st.tuples(st.just("renew"), st.sampled_from(LEASES)),
    ),
    max_size=40,
)


@pytest.mark.parametrize("kind", ["memory", "sqlite", "redis", "cluster"])
@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    cap_list=st.lists(st.one_of(st.none(), caps), min_size=3, max_size=3),
    limits=st.lists(st.integers(1, 3), min_size=3, max_size=3),
    script=steps,
)
def test_leases_agree_with_the_reference_model(
    request: pytest.FixtureRequest,
    redis_stores: dict[str, RedisBackend],
    kind: str,
    cap_list: list[tuple[int, int] | None],
    limits: list[int],
    script: Any,
) -> None:
    if all(cap is None for cap in cap_list):
        cap_list = [(1, 300 * MS), *cap_list[1:]]
    quota = {
        key: Quota(((limit, 1000 * MS),), 0, *(cap or (0, 0)))
        for key, cap, limit in zip(KEYS, cap_list, limits, strict=True)
    }
    rates = StackedModel({k: Model(rates=list(q.limits), min_interval=0) for k, q in quota.items()})
    model = CapModel(rates, {k: cap for k, cap in zip(KEYS, cap_list, strict=True) if cap})
    held_keys: dict[str, list[str]] = {}  # a lease id -> the keys its last acquire named
    with a_store(kind, request, redis_stores) as (store, names):
        now = 1_000_000 * MS
        for step in script:
            if step[0] == "advance":
                now += step[1]
                continue
            lease = step[1]
            if step[0] == "acquire":
                keys, max_wait = step[2], step[3]
                held_keys[lease] = keys
                charges = tuple(Charge(names[k], quota[k], 1) for k in keys)
                if not any(c.quota.max_concurrent for c in charges):
                    continue  # an uncapped call holds no lease (test_stacked's ground)
                before = {k: seen(store, names[k], quota[k], now) for k in KEYS}
                wait = -1 if max_wait is None else max_wait
                verdict = store.execute(
                    AcquireAll(charges, wait, f"c{next(_calls)}", now_us=now, lease_id=lease)
                )
                outcome, slot, head, _ = model.acquire(lease, [(k, 1) for k in keys], now, max_wait)
                got = "admitted" if verdict.allowed else "waiting" if verdict.waiting else "refused"
                assert (got, verdict.slot_us, verdict.head) == (outcome, slot, head), step
                if outcome != "admitted":  # nothing of it in any log
                    assert {k: seen(store, names[k], quota[k], now) for k in KEYS} == before
            else:
                keys = [k for k in held_keys.get(lease, []) if k in model.caps]
                if not keys:
                    continue
                charges = tuple(Charge(names[k], quota[k], 1) for k in keys)
                if step[0] == "release":
                    store.execute(Release(charges, lease, now_us=now))
                    model.release(lease, keys, now)
                else:
                    kept = store.execute(Renew(charges, lease, now_us=now))
                    assert kept == model.renew(lease, keys, now)[0], step
            for key in model.caps:  # usage(): the calls in flight and waiting, per key
                snap = store.execute(Inspect(names[key], quota[key], now_us=now))
                assert (snap.in_flight, snap.waiting) == model.counts(key, now), (key, step)


def test_a_grant_rings_the_waiter_it_admits_and_no_other() -> None:
    store = MemoryBackend()
    quota = Quota(((100, 1000 * MS),), 0, 1, 1000 * MS)
    charge = (Charge("k", quota, 1),)
    rang: list[str] = []
    store.doorbell.ring = rang.extend  # type: ignore[method-assign]
    for lease in ("n.a", "n.b", "n.c"):
        store.execute(AcquireAll(charge, -1, lease + "-call", now_us=1, lease_id=lease))
    assert rang == []
    store.execute(Release(charge, "n.a", now_us=2))
    assert rang == ["n.b"]
    store.execute(Release(charge, "n.a", now_us=3))  # again: frees nothing
    assert rang == ["n.b"]


# -- the limiter's side ---------------------------------------------------------------


def test_a_capped_limiter_admits_through_lease_only(make_limiter: Any) -> None:
    limiter = make_limiter(rates=["100/second"], max_concurrent=1)
    with pytest.raises(ConfigurationError, match="lease"):
        limiter.acquire("k")
    with pytest.raises(ConfigurationError, match="lease"):
        limiter.try_acquire("k")


_opened: list[tuple[Any, Any]] = []  # (limiter, lease) entered by _enter in this test


@pytest.fixture(autouse=True)
def _leave_what_a_test_left() -> Iterator[None]:
    """Leaves the leases a test kept (a lease dropped while held warns, as it should)."""
    yield
    while _opened:
        limiter, lease = _opened.pop()
        if isinstance(limiter, Limiter):
            _leave(limiter, lease)
        else:  # its event loop is closed by now: let it go without a word to the store
            lease._held.ended = True


def _enter(limiter: Any, key: str, **kwargs: Any) -> Any:
    """Enter a lease in either world; (lease, decision)."""
    lease = limiter.lease(key, **kwargs)
    if isinstance(limiter, Limiter):
        decision = lease.__enter__()
    else:
        decision = limiter.loop.run_until_complete(lease.__aenter__())
    _opened.append((limiter, lease))
    return lease, decision


def _leave(limiter: Any, lease: Any) -> None:
    if isinstance(limiter, Limiter):
        lease.__exit__(None, None, None)
    else:
        limiter.loop.run_until_complete(lease.__aexit__(None, None, None))


def test_a_full_cap_refuses_a_call_that_may_not_wait_and_a_release_makes_room(
    make_limiter: Any,
) -> None:
    limiter = make_limiter(rates=["100/second"], max_concurrent=2)
    first, decision = _enter(limiter, "k")
    assert decision.allowed
    _enter(limiter, "k")
    with pytest.raises(ThrottleTimeout):
        _enter(limiter, "k", timeout=0)
    _, other_key = _enter(limiter, "other")  # another key has its own cap
    assert other_key.allowed
    _leave(limiter, first)
    _leave(limiter, first)  # twice: frees nothing more
    _, decision = _enter(limiter, "k", timeout=0)
    assert decision.allowed
    with pytest.raises(ThrottleTimeout):
        _enter(limiter, "k", timeout=0)


def test_a_waiter_times_out_and_leaves_no_ticket_behind(make_limiter: Any) -> None:
    limiter = make_limiter(rates=["100/second"], max_concurrent=1, lease_ttl=10)
    holder, _ = _enter(limiter, "k")
    clock = limiter._config.clock
    started = clock()
    with pytest.raises(ThrottleTimeout):
        _enter(limiter, "k", timeout=2)
    assert 2 <= clock() - started < 5  # woke up to look again, then gave up at its timeout
    _leave(limiter, holder)
    _, decision = _enter(limiter, "k", timeout=0)  # no dead ticket queued ahead of it
    assert decision.allowed


def test_a_lease_nobody_renews_expires_and_its_room_goes_to_the_next(make_limiter: Any) -> None:
    limiter = make_limiter(rates=["100/second"], max_concurrent=1, lease_ttl=3)
    limiter._config.clock.advance(0)
    _enter(limiter, "k")  # held, and never renewed: the fake clock jumps past its TTL
    limiter._config.clock.advance(3.5)
    _, decision = _enter(limiter, "k", timeout=0)
    assert decision.allowed


@pytest.mark.parametrize("value", [0, -1, 2**21, 1.5, True, "3"])
def test_a_bad_cap_is_refused_naming_it(value: Any) -> None:
    with pytest.raises(ConfigurationError, match=f"max_concurrent.*{value!r}"[:40]):
        Limiter(MemoryBackend(), rates=["1/second"], max_concurrent=value)


def test_a_bad_lease_ttl_is_refused_naming_it() -> None:
    with pytest.raises(ConfigurationError, match="lease_ttl"):
        Limiter(MemoryBackend(), rates=["1/second"], max_concurrent=1, lease_ttl=0.01)


def test_a_lease_on_an_uncapped_limiter_is_an_acquire() -> None:
    clock = FakeClock()
    limiter = Limiter(MemoryBackend(), rates=["1/second"], clock=clock, sleep=clock.sleep)
    with limiter.lease("k") as first:
        assert first.allowed
    with limiter.lease("k") as second:
        assert second.waited == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("kind", ["memory", "sqlite", "redis"])
def test_threads_never_exceed_the_cap_and_go_in_turn(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    if kind == "memory":
        store: Backend = MemoryBackend()
    elif kind == "sqlite":
        store = SQLiteBackend(tmp_path / "caps.db")
    else:
        store = RedisBackend(request.getfixturevalue("redis_url"))
    limiter = Limiter(store, rates=["10000/second"], max_concurrent=3, margin=0)
    counted = InFlight()

    def work() -> None:
        with limiter.lease("k"), counted:
            time.sleep(0.01)

    threads = [threading.Thread(target=work) for _ in range(40)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    took = time.monotonic() - started
    store.close()
    assert (counted.peak, counted.done) == (3, 40)
    # 40 calls of 10 ms, 3 at a time: about 0.14 s if each freed slot is taken at once;
    # a waiter that only looked again on its own would take 10 s (a third of the TTL).
    assert took < 3.0


@pytest.mark.parametrize("kind", ["memory", "redis", "cluster"])
def test_tasks_never_exceed_the_cap_and_a_cancelled_one_gives_its_place_up(
    kind: str, request: pytest.FixtureRequest
) -> None:
    started = time.monotonic()

    async def main() -> tuple[int, int]:
        fixture = {"redis": "redis_url", "cluster": "cluster_url"}.get(kind)
        url = request.getfixturevalue(fixture) if fixture else ""
        store: Any = (
            MemoryBackend()
            if kind == "memory"
            else AsyncRedisBackend(url, cluster=kind == "cluster")
        )
        limiter = AsyncLimiter(store, rates=["10000/second"], max_concurrent=2, margin=0)
        inside, peak = 0, 0

        async def work() -> None:
            nonlocal inside, peak
            async with limiter.lease("k"):
                inside += 1
                peak = max(peak, inside)
                await asyncio.sleep(0.01)
                inside -= 1

        holders = [limiter.lease("k") for _ in range(2)]
        for holder in holders:
            await holder.__aenter__()
        doomed = asyncio.ensure_future(work())
        await asyncio.sleep(0.05)
        doomed.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await doomed
        for holder in holders:
            await holder.release()
        await asyncio.gather(*(work() for _ in range(30)))
        # The cancelled task's ticket was released: had it been granted a lease and kept
        # it, only one slot would be left and this would time out.
        async with limiter.lease("k", timeout=1), limiter.lease("k", timeout=1):
            pass
        if kind != "memory":
            await store.aclose()
        return peak, inside

    assert asyncio.run(main()) == (2, 0)
    # 30 calls of 10 ms, 2 at a time, woken by their grants: well under a second. A
    # waiter left to look again on its own would wait a third of the TTL (10 s).
    assert time.monotonic() - started < 5


# -- the transports and the decorator hold a lease for the call ---------------------------


class _Body(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A response body that arrives in pieces, as from a socket (bytes would be read at
    once by httpx, and the response never closed)."""

    def __iter__(self) -> Iterator[bytes]:
        yield b"x" * 50
        yield b"x" * 50

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b"x" * 50
        yield b"x" * 50


def test_a_transport_holds_the_lease_until_the_response_is_closed() -> None:
    from throttle_client import ThrottledClient

    limiter = Limiter(MemoryBackend(), rates=["1000/second"], max_concurrent=1, margin=0)

    def upstream(request: httpx.Request) -> httpx.Response:
        # A body that arrives in pieces, as from a socket (bytes would be read at once).
        return httpx.Response(200, stream=_Body())

    with ThrottledClient(limiter, transport=httpx.MockTransport(upstream)) as client:
        assert client.get("https://api.example.com/a").status_code == 200
        # read and closed: the lease ended, so the next request goes at once
        assert client.get("https://api.example.com/a").status_code == 200
        with client.stream("GET", "https://api.example.com/a") as streamed:
            # still open: the one lease is held, and a caller that may not wait is refused
            with pytest.raises(ThrottleTimeout), limiter.lease("api.example.com", timeout=0):
                pass
            assert streamed.read() == b"x" * 100
        with limiter.lease("api.example.com", timeout=0) as decision:
            assert decision.allowed


def test_a_transport_ends_the_lease_of_a_request_that_failed() -> None:
    from throttle_client import ThrottledClient

    limiter = Limiter(MemoryBackend(), rates=["1000/second"], max_concurrent=1, margin=0)

    def upstream(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    with ThrottledClient(limiter, transport=httpx.MockTransport(upstream)) as client:
        for _ in range(2):
            with pytest.raises(httpx.ConnectError):
                client.get("https://api.example.com/a")
    with limiter.lease("api.example.com", timeout=0) as decision:
        assert decision.allowed


def test_an_async_transport_holds_the_lease_until_the_response_is_closed() -> None:
    from throttle_client import AsyncThrottledClient

    async def main() -> None:
        limiter = AsyncLimiter(MemoryBackend(), rates=["1000/second"], max_concurrent=1)

        def upstream(request: httpx.Request) -> httpx.Response:
            return httpx.Response(200, stream=_Body())

        transport = httpx.MockTransport(upstream)
        async with AsyncThrottledClient(limiter, transport=transport) as client:
            for _ in range(3):  # each one's lease ends with its response
                assert (await client.get("https://api.example.com/a")).status_code == 200
            async with client.stream("GET", "https://api.example.com/a"):
                with pytest.raises(ThrottleTimeout):
                    async with limiter.lease("api.example.com", timeout=0):
                        pass

    asyncio.run(main())


def test_the_decorator_holds_a_lease_while_the_function_runs() -> None:
    from throttle_client import throttled

    limiter = Limiter(MemoryBackend(), rates=["1000/second"], max_concurrent=2, margin=0)
    counted = InFlight()

    @throttled(limiter, key="token")
    def fetch(token: str) -> None:
        with counted:
            time.sleep(0.01)

    threads = [threading.Thread(target=fetch, args=("t",)) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert counted.peak == 2


# -- leases at the edges: a renewal crossing a release, the fallback, no subscription ------


def test_a_renewal_that_crosses_the_release_does_not_hold_the_lease_again() -> None:
    """The keeper renews as the caller releases, and the Release reaches the store
    first: the Renew holds the lease again, so it is released once more."""
    limiter: Limiter

    class Crossing(MemoryBackend):
        def execute(self, op: Any) -> Any:
            if isinstance(op, Renew):
                lease.release()  # the caller's release lands first
            return super().execute(op)

    limiter = Limiter(Crossing(), rates=["1000/second"], max_concurrent=1, lease_ttl=30)
    lease = limiter.lease("k")
    lease.__enter__()
    lease._renew()  # as the keeper does, having seen the lease still held
    with limiter.lease("k", timeout=0) as decision:  # not blocked for 30 s
        assert decision.allowed


def test_a_lease_is_held_through_the_sleep_to_its_slot(make_limiter: Any) -> None:
    limiter = make_limiter(rates=["1/10s"], max_concurrent=1, lease_ttl=5)
    _leave(limiter, _enter(limiter, "k")[0])
    sleeper, _ = _enter(limiter, "k")  # its slot is 10 s ahead: it sleeps there, holding
    limiter._config.clock.advance(1)  # 1 s into its call: its lease lasts until slot + TTL
    with pytest.raises(ThrottleTimeout):
        _enter(limiter, "k", timeout=0)
    _leave(limiter, sleeper)


def test_under_local_fallback_a_release_wakes_the_next_waiter() -> None:
    from throttle_client import BackendUnavailable, LocalFallback

    class Down(Backend):
        def execute(self, op: Any) -> Any:
            raise BackendUnavailable("down")

    limiter = Limiter(
        Down(),
        rates=["1000/second"],
        max_concurrent=1,
        lease_ttl=30,
        on_unavailable=LocalFallback(expected_workers=1),
        retry_for=0,
    )
    assert handoff_seconds(limiter, hold=0.1) < 1.0  # rung by the fallback's grant


def test_an_uncontended_lease_never_waits_for_a_subscription(redis_url: str) -> None:
    import redis

    admin = redis.Redis.from_url(redis_url)
    admin.execute_command("ACL", "SETUSER", "nosub", "on", ">pw", "~*", "&*", "+@all", "-subscribe")
    url = redis_url.replace("redis://", "redis://nosub:pw@")
    try:

        async def main() -> float:
            limiter = AsyncLimiter(AsyncRedisBackend(url), rates=["1000/second"], max_concurrent=5)
            started = time.monotonic()
            for _ in range(3):
                async with limiter.lease("k"):
                    pass
            await limiter.backend.aclose()
            return time.monotonic() - started

        assert asyncio.run(main()) < 0.5
    finally:
        admin.execute_command("ACL", "DELUSER", "nosub")
        admin.close()


# -- what a user is told -------------------------------------------------------------------


def test_a_full_cap_says_so_and_names_what_frees_a_slot() -> None:
    limiter = Limiter(MemoryBackend(), rates=["1000/second"], max_concurrent=1)
    full = pytest.raises(ThrottleTimeout, match="max_concurrent calls in flight")
    with limiter.lease("k"), full, limiter.lease("k", timeout=0):
        pass


def test_a_capped_partner_is_named_when_acquire_is_refused() -> None:
    store = MemoryBackend()
    plain = Limiter(store, rates=["10/second"], namespace="token")
    account = Limiter(store, rates=["10/second"], namespace="account", max_concurrent=2)
    with pytest.raises(ConfigurationError, match="also= \\(namespace 'account'\\)"):
        plain.acquire("t", also=[(account, "acct")])


def test_an_async_lease_entered_with_plain_with_says_to_use_async_with() -> None:
    limiter = AsyncLimiter(MemoryBackend(), rates=["10/second"], max_concurrent=1)
    with pytest.raises(TypeError, match="async with"), limiter.lease("k"):  # type: ignore[attr-defined]
        pass


def test_a_lease_ttl_without_a_cap_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="lease_ttl=5 without max_concurrent"):
        Limiter(MemoryBackend(), rates=["10/second"], lease_ttl=5)


def test_a_lease_dropped_while_held_warns() -> None:
    import gc

    limiter = Limiter(MemoryBackend(), rates=["1000/second"], max_concurrent=1)
    lease = limiter.lease("k")
    lease.__enter__()
    with pytest.warns(ResourceWarning, match="never ended"):
        del lease
        gc.collect()


def test_usage_counts_the_calls_in_flight_and_waiting(make_limiter: Any) -> None:
    limiter = make_limiter(rates=["100/second"], max_concurrent=2, lease_ttl=30)
    assert (limiter.usage("k").in_flight, limiter.usage("k").waiting) == (0, 0)
    _enter(limiter, "k")
    _enter(limiter, "k")
    held = limiter.usage("k")
    assert (held.in_flight, held.waiting) == (2, 0)
    plain = make_limiter(rates=["100/second"], backend=limiter.backend, namespace="plain")
    assert (plain.usage("k").in_flight, plain.usage("k").waiting) == (None, None)


def test_a_renewal_stuck_on_a_slow_store_does_not_hold_up_the_others() -> None:
    renewed: dict[str, int] = {}

    class Slow(MemoryBackend):
        def execute(self, op: Any) -> Any:
            if isinstance(op, Renew):
                key = "stuck" if "stuck" in str(op.charges[0].key) else "free"
                renewed[key] = renewed.get(key, 0) + 1
                if key == "stuck":
                    time.sleep(1.0)
            return super().execute(op)

    store = Slow()
    stuck = Limiter(store, rates=["100/second"], max_concurrent=1, lease_ttl=0.3, namespace="stuck")
    free = Limiter(store, rates=["100/second"], max_concurrent=1, lease_ttl=0.3, namespace="free")
    with stuck.lease("k"):
        time.sleep(0.15)  # its first renewal is due at 0.1 s, and takes a second
        with free.lease("k"):
            time.sleep(0.8)
    assert renewed.get("free", 0) >= 4  # every 0.1 s, while the other renewal hangs


def test_a_refused_subscription_is_said_once_and_not_retried(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    import redis

    admin = redis.Redis.from_url(redis_url)
    admin.execute_command("ACL", "SETUSER", "nochan", "on", ">pw", "~*", "resetchannels", "+@all")
    url = redis_url.replace("redis://", "redis://nochan:pw@")
    try:
        limiter = Limiter(
            RedisBackend(url), rates=["100/second"], max_concurrent=1, lease_ttl=0.6, margin=0
        )
        holder = limiter.lease("k")
        holder.__enter__()
        threading.Timer(0.1, holder.release).start()
        with caplog.at_level("WARNING", logger="throttle_client"):
            with limiter.lease("k", timeout=5):  # served all the same, by looking again
                pass
            time.sleep(0.3)
        said = [r for r in caplog.records if "refused the subscription" in r.getMessage()]
        assert len(said) == 1
        doorbell = limiter.backend.doorbell
        assert doorbell._unable and doorbell._thread is None  # no thread keeps trying
        limiter.backend.close()
    finally:
        admin.execute_command("ACL", "DELUSER", "nochan")
        admin.close()
