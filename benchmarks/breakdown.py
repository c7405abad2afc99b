"""Where the time of one admitted try_acquire goes, step by step against the floor.

Starts its own redis-server on a free loopback port and times, interleaved in one
process, calls that each add one layer to the last: the bare floor, the same
round trip with our request and reply sizes, our script by bare EVALSHA, the
backend, the limiter. Then the Python side alone, with the round trip stubbed out.

    python benchmarks/breakdown.py [--redis-server PATH]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
import timeit
from collections.abc import Callable

import redis

from throttle_client import Limiter, Rate, RedisBackend
from throttle_client._backends.redis_answers import decode
from throttle_client._backends.redis_codec import encode
from throttle_client._backends.redis_script import SCRIPT
from throttle_client.testing import RedisServer

REPLY = b"1 1700000000000000 1700000000000000 0 999999"  # what the script answers


def round_trips(url: str) -> None:
    conn = redis.Redis.from_url(url)
    limiter = Limiter(RedisBackend(conn), rates=[Rate(10**9, 3600)], namespace="bench")
    floor = conn.script_load("return 1")
    sized = conn.script_load(f"return '{REPLY.decode()}'")
    ours = conn.script_load(SCRIPT)
    keys, args = encode(limiter._acquire_op("token", 1, 0, 0.0))
    ids = itertools.count()
    steps: dict[str, Callable[[], object]] = {
        "floor: EVALSHA 'return 1', one key": lambda: conn.evalsha(floor, 1, "k"),
        "+ our keys, args and reply sizes": lambda: conn.evalsha(sized, len(keys), *keys, *args),
        "+ our script's work (bare evalsha)": lambda: conn.evalsha(
            ours, len(keys), *keys, *args[:-1], b"%d" % next(ids)
        ),
        "+ RedisBackend.execute": lambda: limiter.backend.execute(
            limiter._acquire_op("token", 1, 0, 0.0)
        ),
        "+ Limiter.try_acquire": lambda: limiter.try_acquire("token"),
    }
    laps: dict[str, list[int]] = {name: [] for name in steps}
    for _ in range(40):
        for name, step in steps.items():
            for _ in range(250):
                start = time.perf_counter_ns()
                step()
                laps[name].append(time.perf_counter_ns() - start)
    conn.config_resetstat()
    for _ in range(5000):
        limiter.try_acquire("token")
    server = conn.info("commandstats")["cmdstat_evalsha"]["usec_per_call"]
    print("one process, interleaved, p50:")
    for name, lap in laps.items():
        print(f"  {name:40} {statistics.median(lap) / 1000:7.1f} µs")
    print(f"  server time of our script (INFO commandstats): {server:.1f} µs per call")
    conn.close()


def python_side() -> None:
    backend = RedisBackend(redis.Redis.from_url("redis://127.0.0.1:1/0"))  # never connects
    # The script runs over the backend's own copy of the client: stub that one.
    backend._runner.evalsha = lambda *args: REPLY  # type: ignore[method-assign,union-attr]
    limiter = Limiter(backend, rates=[Rate(10**9, 3600)], namespace="bench")
    op = limiter._acquire_op("token", 1, 0, 0.0)
    verdict = decode(op, REPLY)
    keys, args = encode(op)
    conn = redis.Redis.from_url("redis://127.0.0.1:1/0").connection_pool.make_connection()
    steps: dict[str, Callable[[], object]] = {
        "_acquire_op (key, checks, call id)": lambda: limiter._acquire_op("token", 1, 0, 0.0),
        "encode": lambda: encode(op),
        "decode": lambda: decode(op, REPLY),
        "_decision": lambda: limiter._decision(verdict, 1),
        "try_acquire, round trip stubbed out": lambda: limiter.try_acquire("token"),
        "redis-py pack_command, ours": lambda: conn.pack_command(
            "EVALSHA", "x" * 40, len(keys), *keys, *args
        ),
        "redis-py pack_command, floor": lambda: conn.pack_command("EVALSHA", "x" * 40, 1, "k"),
    }
    print("Python side, hot loop (min of 7 x 20000):")
    for name, step in steps.items():
        best = min(timeit.repeat(step, number=20000, repeat=7)) / 20000
        print(f"  {name:40} {best * 1e6:7.2f} µs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis-server", metavar="PATH", help="default: from PATH")
    opts = parser.parse_args()
    server = RedisServer()
    if opts.redis_server:
        server.binary = opts.redis_server
    with server:
        round_trips(server.url)
    python_side()


if __name__ == "__main__":
    main()
