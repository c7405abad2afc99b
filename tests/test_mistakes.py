"""Common mistakes are refused or said, never passed over in silence.

A blocking limiter called from asyncio code, a margin given in milliseconds, a gap
that leaves a rate out of reach, a fallback share below one call per window, a
timeout a cold connection would overrun.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

import httpx
import pytest

from throttle_client import (
    AsyncLimiter,
    AsyncRedisBackend,
    Backend,
    Decision,
    Limiter,
    LocalFallback,
    MemoryBackend,
    RedisBackend,
    ThrottledClient,
    ThrottleTimeout,
)
from throttle_client.testing import FakeClock, RedisServer

from .delay_proxy import DelayProxy


def test_a_blocking_limiter_in_an_event_loop_is_refused_before_it_books() -> None:
    """``await limiter.acquire()`` on a sync Limiter is refused before it books a slot
    (it would fail only on the await); so is a plain sync call in a coroutine, which
    would stall the whole loop while it slept."""
    limiter = Limiter(MemoryBackend(), rates=["1/second"])

    async def misuse() -> list[str]:
        refused = []
        client = ThrottledClient(
            limiter, transport=httpx.MockTransport(lambda r: httpx.Response(200))
        )
        for call in (
            lambda: limiter.acquire("k"),
            lambda: limiter.try_acquire("k"),
            lambda: limiter.lease("k").__enter__(),
            lambda: client.get("https://api.test/", headers={"Authorization": "Bearer k"}),
        ):
            with pytest.raises(RuntimeError, match="event loop") as caught:
                await call()  # type: ignore[misc]
            refused.append(str(caught.value))
        return refused

    messages = asyncio.run(misuse())
    assert all("AsyncLimiter" in message for message in messages)
    assert limiter.usage("k").rates[0].used == 0  # nothing was booked
    assert limiter.acquire("k").allowed  # outside a loop it works as ever


def test_a_blocking_limiter_runs_in_a_thread_of_an_asyncio_program() -> None:
    limiter = Limiter(MemoryBackend(), rates=["5/second"])

    async def offloaded() -> bool:
        decision = await asyncio.to_thread(limiter.acquire, "k")
        return decision.allowed

    assert asyncio.run(offloaded())


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"rates": ["10/second"], "margin": 25}, "margin=25 s is not shorter than the window"),
        (
            {"rates": ["2/second"], "min_interval": 0.01},
            "margin=0.025 s is not shorter than min_interval=0.01 s",
        ),
        (
            {"rates": ["5000/hour"], "min_interval": 1},
            "lets at most 3601 calls into any window of 5000/3600s",
        ),
        (
            {"rates": ["2/second"], "on_unavailable": LocalFallback(8)},
            "the fleet may send up to 8 per window, not 2",
        ),
        (
            {"rates": ["100/second"], "max_concurrent": 2, "on_unavailable": LocalFallback(4)},
            "more than max_concurrent=2",
        ),
    ],
)
def test_a_doubtful_configuration_is_said_when_the_limiter_is_made(
    options: dict[str, Any], said: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="throttle_client"):
        Limiter(MemoryBackend(), **options)
    assert [r.getMessage() for r in caplog.records if said in r.getMessage()]


def test_a_sound_configuration_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="throttle_client"):
        Limiter(
            MemoryBackend(),
            rates=["5000/hour", "10/second"],
            min_interval=0.1,
            on_unavailable=LocalFallback(4),
        )
    assert not caplog.records


def test_a_cold_connection_counts_against_the_timeout() -> None:
    """A store's first call also opens a connection and loads its script before the
    store decides: here 0.5 s. The next slot is 1.025 s away, past the caller's 0.9 s
    timeout; by the time the store decides it is only 0.525 s away, within the wait it
    was told of. Counted from the caller's start the call would wait 1.025 s: it raises
    ThrottleTimeout instead of sleeping past the timeout it was given."""
    clock = FakeClock()
    inner = MemoryBackend()
    opening = [0.0, 0.0, 0.5]  # the third call finds its connection closed

    class ColdStore(Backend):
        def execute(self, op: Any) -> Any:
            clock.advance(opening.pop(0) if opening else 0.0)
            return inner.execute(dataclasses.replace(op, now_us=round(clock.now * 1e6)))

    limiter = Limiter(ColdStore(), rates=["1/second"], clock=clock, sleep=clock.sleep)
    limiter.acquire("k")
    assert not limiter.try_acquire("k").allowed
    started = clock.now
    with pytest.raises(ThrottleTimeout):
        limiter.acquire("k", timeout=0.9)
    assert clock.now - started == pytest.approx(0.5)  # the cold call, and no sleep after it


@pytest.mark.parametrize("world", ["sync", "async"])
def test_a_cold_call_to_a_distant_store_spends_few_round_trips(
    world: str, own_redis: RedisServer
) -> None:
    """A new process's first call to a store 100 ms away that never held the script: the
    connection's handshake (redis-py's PING, HELLO and two CLIENT SETINFO), then the
    script loaded with the store's eviction policy read in one pipelined round trip,
    then the decision: about seven of the store's round trips, 0.7 s. It took 1.4 s: a
    call of no keys to open the connection, FCALL, "function not found", FUNCTION LOAD,
    FCALL again, the decision, then CONFIG GET, and the cold answer then came too late
    to tell (an inspect and a second booking, a slot spent). A margin wide enough for
    the round trip keeps this about the connection, not a store too slow for it; the
    set-up then takes less than the margin (the case of the next test is longer)."""
    delay = 0.1
    with DelayProxy(own_redis.port, delay=delay) as proxy:
        started = time.monotonic()
        if world == "sync":
            backend = RedisBackend(proxy.url)
            decision = Limiter(backend, rates=["100/hour"], margin=1.0).acquire("k")
            backend.close()
        else:

            async def first_call() -> Decision:
                backend = AsyncRedisBackend(proxy.url)
                limiter = AsyncLimiter(backend, rates=["100/hour"], margin=1.0)
                decision = await limiter.acquire("k")
                await backend.aclose()
                return decision

            decision = asyncio.run(first_call())
        took = time.monotonic() - started
    assert decision.allowed and decision.late_wakeups == 0
    assert took < 11 * delay  # (seven round trips, and room for a busy machine)


def test_a_cold_call_whose_set_up_outlasts_the_margin_looks_before_it_books_again(
    own_redis: RedisServer,
) -> None:
    """The set-up (0.6 s here) outlasts the margin (0.5 s): the cold answer cannot tell
    whether the call is still within the margin of its slot. A look at the key on the
    open connection (one round trip) can: the call goes, in its slot, and spends no
    second one."""
    with DelayProxy(own_redis.port, delay=0.1) as proxy:
        backend = RedisBackend(proxy.url)
        limiter = Limiter(backend, rates=["100/hour"], margin=0.5)
        decision = limiter.acquire("k")
        usage = limiter.usage("k").rates[0]
        booked = usage.used + usage.booked
        backend.close()
    assert decision.allowed and decision.late_wakeups == 0
    assert booked == 1


def test_log_lines_do_not_repeat_the_logger_name(caplog: pytest.LogCaptureFixture) -> None:
    """Every line goes to the "throttle_client" logger, whose name a handler prints: a
    message that names it again reads "throttle_client: throttle_client: ..."."""
    from throttle_client import RedisBackend
    from throttle_client._redis_server import free_port

    with caplog.at_level(logging.DEBUG, logger="throttle_client"):
        down = RedisBackend(f"redis://127.0.0.1:{free_port()}/0")
        limiter = Limiter(down, rates=["2/second"], min_interval=0.01, on_unavailable="allow")
        limiter.try_acquire("k")  # the store is unavailable, and the policy applies
        down.close()
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("throttle_client")]
    assert len(messages) >= 2
    assert not [m for m in messages if m.startswith("throttle_client")]


@pytest.fixture(params=["memory", "sqlite", "redis"])
def shared_store(request: pytest.FixtureRequest, tmp_path: Any) -> Any:
    """One store that two workers share (each a limiter of its own)."""
    from throttle_client import RedisBackend, SQLiteBackend

    if request.param == "memory":
        backend: Any = MemoryBackend()
    elif request.param == "sqlite":
        backend = SQLiteBackend(tmp_path / "limits.db")
    else:
        backend = RedisBackend(request.getfixturevalue("redis_url"))
    yield backend
    backend.close()


def test_workers_that_disagree_about_a_key_are_told(
    shared_store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Each worker holds a key to its own rules only: one of 10/second and one of
    5/second on one token let 10 through where the upstream allows 5. The store keeps
    each key's rules beside it; a worker that finds other rules there says which."""
    clock = FakeClock()
    strict = Limiter(shared_store, rates=["5/second"], clock=clock, sleep=clock.sleep)
    loose = Limiter(shared_store, rates=["10/second"], min_interval=0.05, clock=clock)
    with caplog.at_level(logging.WARNING, logger="throttle_client"):
        strict.try_acquire("token")
        loose.try_acquire("token")
        loose.try_acquire("token")  # (said once per key)
        loose.try_acquire("other token")  # (a key only one of them uses: nothing to say)
    said = [r.getMessage() for r in caplog.records if "disagree" in r.getMessage()]
    assert len(said) == 1
    assert "['10/1s']" in said[0] and "['5/1s']" in said[0] and "min_interval=0.05" in said[0]
    assert "token" not in said[0].replace("token to", "")  # (the key's label, never the key)


def test_workers_that_differ_only_in_their_margin_are_told(
    shared_store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The margin widens every window a worker books in: one worker without it crowds
    the windows of one with it, as the upstream counts arrivals."""
    clock = FakeClock()
    wide = Limiter(shared_store, rates=["5/second"], margin=0.1, clock=clock)
    narrow = Limiter(shared_store, rates=["5/second"], margin=0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="throttle_client"):
        wide.try_acquire("token")
        narrow.try_acquire("token")
    said = [r.getMessage() for r in caplog.records if "disagree" in r.getMessage()]
    assert len(said) == 1 and "margin=0.1" in said[0] and "margin=0" in said[0]


def test_workers_with_one_rule_set_say_nothing(
    shared_store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    one = Limiter(shared_store, rates=["5/second"], clock=clock, label=lambda key: "account")
    other = Limiter(shared_store, rates=["5/second"], clock=clock, label=lambda key: "acct")
    with caplog.at_level(logging.WARNING, logger="throttle_client"):
        one.try_acquire("token")
        other.try_acquire("token")
    assert not [r for r in caplog.records if "disagree" in r.getMessage()]


def test_workers_with_different_key_secrets_are_told(
    shared_store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A key_secret set on some hosts only: one token hashes to two keys, two quotas. The
    namespace keeps its secret's fingerprint; a worker that finds another says so."""
    clock = FakeClock()

    def host(**secret: Any) -> Limiter:
        options = {"rates": ["1/second"], "namespace": "api", "clock": clock, **secret}
        return Limiter(shared_store, sleep=clock.sleep, **options)

    def told() -> list[str]:
        return [r.getMessage() for r in caplog.records if "different key secrets" in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="throttle_client"):
        for limiter in (host(), host(key_secret="s3cr3t-value")):
            limiter.acquire("token")
            limiter.acquire("token")  # (asked while it sleeps to its slot)
    assert len(told()) == 1 and "s3cr3t" not in told()[0] and "'api'" in told()[0]
    with caplog.at_level(logging.WARNING, logger="throttle_client"):
        host().usage("token")  # the secret the record holds: nothing to say
        host(key_secret="another").usage("token")  # a read looks, and says
    assert len(told()) == 2


def test_a_read_never_writes_the_namespace_record(shared_store: Any) -> None:
    """A one-off read (throttle-client status, usage()) with a wrong secret must not set
    the record that every worker of the namespace is then held against."""
    reader = Limiter(shared_store, rates=["5/second"], namespace="api", key_secret="wrong")
    reader.usage("token")
    assert shared_store.fingerprint("api", "the workers' own", keep=False) is None
