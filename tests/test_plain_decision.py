"""The plain decision (lua/plain.lua) answers and writes exactly what the whole
operation (op_acquire) would.

The script is loaded twice on one server: as shipped, and with plain() turned off, so
that every acquire runs the whole way. The same random sequence of operations, at the
same given times, runs through each on a key of its own: their replies, logs and metas
must be the same byte for byte after every step, and their TTLs within a second.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from throttle_client import Limiter, MemoryBackend, Rate
from throttle_client._backends.redis_codec import quota_arg
from throttle_client._backends.redis_script import SCRIPT
from throttle_client.testing import RedisServer

SEND_PLAIN = "  if op == 'acquire' and not in_batch then"
START = 1_800_000_000_000_000  # µs: the given times start here
US = 1_000_000


def _quota(rates: list[Rate], min_interval: float = 0.0, margin: float = 0.025) -> bytes:
    limiter = Limiter(MemoryBackend(), rates=rates, min_interval=min_interval, margin=margin)
    return quota_arg(limiter._config.quota)


QUOTAS = [
    _quota([Rate(3, 1)]),
    _quota([Rate(2, 1), Rate(5, 60)], min_interval=0.1),
    _quota([Rate(4, 2), Rate(6, 10)], min_interval=0.25),
    _quota([Rate(3, 1, bounded=True)]),  # not plain: the whole way in both
]


# A field of a key's meta changed in place, as a hand in the store or a bad copy would.
DAMAGE = """
local meta = redis.call('GET', KEYS[1])
if not meta then return 0 end
local function changed(...)
  local fields, field = {...}, tonumber(ARGV[1])
  if type(fields[field]) == 'number' then fields[field] = fields[field] + tonumber(ARGV[2]) end
  return cmsgpack.pack(unpack(fields, 1, select('#', ...)))
end
redis.call('SET', KEYS[1], changed(cmsgpack.unpack(meta)), 'KEEPTTL')
return 1
"""


@pytest.fixture(scope="module")
def scripts(redis_server: RedisServer) -> Iterator[tuple[redis.Redis, str, str]]:
    client = redis.Redis.from_url(redis_server.url)
    assert SCRIPT.count(SEND_PLAIN) == 1
    shipped = client.script_load(SCRIPT)
    whole = client.script_load(SCRIPT.replace(SEND_PLAIN, "  if false then"))
    yield client, shipped, whole
    client.close()


def _run(client: redis.Redis, sha: str, keys: tuple[str, str], args: list[Any]) -> Any:
    try:
        return client.evalsha(sha, 2, *keys, *args)
    except redis.ResponseError as exc:  # (without the script's name, which differs)
        return "error: " + str(exc).replace(sha, "<script>")


def _state(client: redis.Redis, keys: tuple[str, str]) -> tuple[Any, ...]:
    log, meta = keys
    ttls = (client.pttl(log), client.pttl(meta))
    return client.zrange(log, 0, -1, withscores=True), client.get(meta), ttls


step = st.tuples(
    # since the step before (a store's clock that went back too)
    st.one_of(st.integers(0, US // 2), st.integers(0, 20 * US), st.integers(-US, 0)),
    st.sampled_from(
        ["acquire"] * 12 + ["retry", "pause", "learn", "lose log", "lose meta", "reset", "damage"]
    ),
    st.integers(1, 3),  # cost
    st.sampled_from([0, -1, US // 2]),  # max wait
    st.sampled_from([0, 0, 30_000]),  # lead
    st.sampled_from([-1, -1, 25_000]),  # mark
    st.sampled_from(["known", "known", "none", "other life", "more units"]),  # expect
    st.sampled_from(range(2, 18)),  # the meta's field a damage changes (last, total, ...)
    st.sampled_from([-1, 1, -1000, 1000, -20 * US]),  # and by how much
)
# Calls close together for long enough that the log trims its oldest entries, between
# the TTLs' renewals: bookings that trim, and bookings that renew.
STEADY = [(300_000, "acquire", 1, -1, 0, -1, "known", 2, 0)] * 40


def damaged(field: int, by: int) -> list[tuple[Any, ...]]:
    """Two calls, a field of the meta changed, a third call."""
    call = (US, "acquire", 1, 0, 0, -1, "none", 2, 0)  # (no expectation to hide it)
    return [call, call, (0, "damage", 1, 0, 0, -1, "known", field, by), call]


@settings(
    max_examples=int(os.environ.get("PLAIN_EXAMPLES", "100")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(quota=st.sampled_from(QUOTAS), steps=st.lists(step, min_size=1, max_size=40))
@example(quota=QUOTAS[0], steps=STEADY)
@example(quota=QUOTAS[1], steps=damaged(2, 1000))  # its newest slot
@example(quota=QUOTAS[1], steps=damaged(2, -1000))
@example(quota=QUOTAS[1], steps=damaged(3, -1))  # its running total
@example(quota=QUOTAS[1], steps=damaged(6, -1))  # its oldest slot
@example(quota=QUOTAS[1], steps=damaged(7, 3 * 10**15))  # its TTL's end, beyond any set
@example(quota=QUOTAS[1], steps=damaged(14, 2**53))  # its oldest id's slot
def test_the_plain_decision_answers_and_writes_what_the_whole_operation_does(
    scripts: tuple[redis.Redis, str, str], quota: bytes, steps: list[tuple[Any, ...]]
) -> None:
    client, shipped, whole = scripts
    client.flushall()
    ours = ("tc:a:{a}:log", "tc:a:{a}:meta")
    theirs = ("tc:b:{b}:log", "tc:b:{b}:meta")
    now, ids, life = START, 0, (-1, 0)  # life: the key's (born, total), from its last answer
    for gap, kind, cost, wait, lead, mark, expect, field, by in steps:
        now += gap
        at = b"%d" % now
        if kind in ("acquire", "retry"):
            ids += kind == "acquire"
            call = ("~" if kind == "retry" else "=") + f"id{ids:04d}"
            born, total = life
            expected = {
                "known": f"{born},{total}" if born >= 0 else "-1",
                "none": "-1",
                "other life": f"{born + 1},{total}",
                "more units": f"{born},{total + 2}",
            }[expect]
            args = [b"acquire", quota, at, cost, wait, call, lead, mark, expected]
        elif kind == "pause":
            args = [b"pause", quota, at, gap // 2]
        elif kind == "learn":
            args = [b"learn", quota, at, now - US, now + 2 * US, 1, -1, -1]
        elif kind == "reset":
            args = [b"reset", quota, at]
        elif kind == "damage":
            client.eval(DAMAGE, 1, ours[1], field, by)
            client.eval(DAMAGE, 1, theirs[1], field, by)
            continue
        else:  # a part of each key lost, as eviction would lose it
            client.delete(ours[kind == "lose meta"], theirs[kind == "lose meta"])
            continue
        answer = _run(client, shipped, ours, args)
        assert answer == _run(client, whole, theirs, args), (kind, args)
        if kind in ("acquire", "retry") and isinstance(answer, bytes):
            words = answer.split()
            life = (int(words[-2]), int(words[-1]))
        (log, meta, ttls), (their_log, their_meta, their_ttls) = (
            _state(client, ours),
            _state(client, theirs),
        )
        assert (log, meta) == (their_log, their_meta), (kind, args)
        assert all(abs(a - b) <= 1000 for a, b in zip(ttls, their_ttls, strict=True)), ttls


def test_a_steady_plain_decision_reads_its_key_once(
    scripts: tuple[redis.Redis, str, str],
) -> None:
    """The plain path is the one taken: the whole operation would GET the meta again.
    (Calls a period apart: the rate's window starts at the newest entry, no lookup.)"""
    client, shipped, _ = scripts
    client.flushall()
    keys = ("tc:c:{c}:log", "tc:c:{c}:meta")
    quota = _quota([Rate(2, 1), Rate(5, 60)], margin=0)
    for i in range(3):  # a key's first call, then two in steady state
        now = b"%d" % (START + i * US)
        answer = _run(client, shipped, keys, [b"acquire", quota, now, 1, 0, f"=id{i:04d}"])
        assert isinstance(answer, bytes) and answer.startswith(b"1 "), answer
        if i == 0:
            client.config_resetstat()
    stats = client.info("commandstats")
    inside = {
        name.removeprefix("cmdstat_"): figures["calls"]
        for name, figures in stats.items()
        if name != "cmdstat_evalsha" and not name.startswith("cmdstat_config")
    }
    assert inside == {"get": 2, "zrange": 2, "zadd": 2, "set": 2}, inside
