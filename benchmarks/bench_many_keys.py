"""Many tokens at 5000/hour: Redis memory, decisions per second and p99, beside two peers.

Starts its own redis-server on a free loopback port (never a shared one; ``--maxmemory
1536mb``, so a run that overshoots fails instead of swapping the machine) and, for each
library in turn (FLUSHALL between them), runs two phases with worker processes (2 by
default) that make one decision per call, pipeline-free, as a worker serving requests
would:

  fleet  ``--tokens`` tokens (100,000), each called ``--calls-per-key`` times (2):
         round-robin passes over the tokens, each worker over its own half, so the
         keyspace grows by one entry per token and pass; the logs of lightly used tokens
  full   ``--full-tokens`` tokens (4), each called 5000 times: round-robin over them,
         every call admitted, the last one at the quota; a token used up to its limit,
         whose log holds a full window

The rate is 5000/hour scaled in time: 5000 per ``3600 / --scale`` seconds (50x: 5000
per 72 s), so that a full window's log (5000 entries) is reached in a second or two,
not in an hour, while the fleet phase (~20-40 s per library on 2 cores) still ends
inside one window: nothing ages out before memory is read. (At 100x, a window of 36 s,
the fleet phases of throttle_client and pyrate take 35-38 s on 2 cores: longer than the
window.)

Each library is driven the way its documentation shows (W = the scaled window):

  throttle_client  ``Limiter(RedisBackend(redis.Redis), rates=[Rate(5000, W)],
                   min_interval=0).try_acquire(token).allowed``
  limits           ``MovingWindowRateLimiter(RedisStorage(url)).hit(parse("5000/W
                   seconds"), token)``
  pyrate           ``Limiter(factory).try_acquire(token, blocking=False)`` where
                   ``factory`` is the per-name ``BucketFactory`` of pyrate's README
                   ("Custom routing"): one ``RedisBucket`` (one sorted set) per token,
                   made on first use with ``self.create``, which also registers it with
                   pyrate's background leaker (a thread that trims every bucket every
                   10 s: 50,000 round trips per sweep per worker at the default size;
                   registering probes the bucket with one more round trip, so a
                   token's first call costs two). pyrate's ``Limiter(RedisBucket)``
                   alone is one bucket for every name: it cannot limit per token.

Tokens are named ``token-000042`` (12 characters): limits and pyrate put the name in
their Redis key, pyrate also in every logged member; throttle_client stores a fixed-size
keyed hash of it.

Printed per library and phase: calls, admitted, keys in Redis afterwards (``DBSIZE``),
wall seconds, decisions per second (calls per busy second, summed over the workers),
p50 / p99 per decision, the Redis ``used_memory`` delta (``INFO memory``, read while
the workers are connected and idle, before and after the phase) and that delta per
token and per logged (admitted) call; then the memory of 100,000 tokens each at a
full window (100,000 x 5000 calls), extrapolated from the full phase's bytes per token.

What it leaves out, and why:

- Not 100,000 tokens x 5000 calls: that is 500M log entries (over 100 GB for
  throttle_client). The fleet phase keeps all 100,000 tokens with a short log; the full
  phase gives the per-token cost of a full window; the product is extrapolated.
- Not 20 calls per token by default: at ~9000 decisions/s (2 workers on 2 cores)
  100,000 x 20 calls takes ~4 minutes per library. 2 calls take ~25 s, so the
  three libraries run in ~2.5 minutes; ``--calls-per-key 20`` runs the larger fleet.
- Short logs understate a full log's bytes per call: Redis keeps a sorted set of up
  to 128 members as one compact listpack, past that as a skiplist (about 3x the bytes
  per member). Per-call figures from the fleet phase therefore do not extrapolate to
  5000-entry logs; the full phase measures those.
- The fleet's logs must not age out of the window before memory is read: the script
  warns when a phase took longer than the window (then lengthen the window with a
  smaller ``--scale``, or use fewer calls). No phase runs past one window, so trimming
  of aged entries at steady state (throttle_client trims in batches, limits only at the
  limit's length, pyrate in its leaker) is not measured, nor Redis' fragmentation
  (``used_memory_rss``), nor client-side memory (pyrate keeps a bucket object per token
  in every process).
- Every call should be admitted. A refused one is reported with the slowest refused
  call's latency: throttle_client refuses an admission whose answer came back later
  than its ``margin`` (25 ms), so a stalled round trip shows up as a refusal.

    python benchmarks/bench_many_keys.py                   # about 2 minutes
    python benchmarks/bench_many_keys.py --quick           # 5,000 tokens, well under 30 s
    python benchmarks/bench_many_keys.py --redis-server /usr/bin/redis-server --json out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import time
from array import array
from collections.abc import Callable
from typing import Any

import redis

LIBRARIES = ["throttle_client", "limits", "pyrate"]
LIMIT = 5000  # calls per hour, scaled in time by --scale
FLEET = 100_000  # tokens in the extrapolation
WARM_CALLS = 200
MAXMEMORY = "1536mb"


def client(url: str) -> redis.Redis:
    """The same client settings as benchmarks/bench_decision.py."""
    return redis.Redis.from_url(url)


def build(
    library: str, url: str, period: float
) -> tuple[Callable[[str], object], Callable[[], None]]:
    """One decision for a token, as a one-argument call (built in the worker); and a close."""
    if library == "throttle_client":
        from throttle_client import Limiter, Rate, RedisBackend

        limiter = Limiter(
            RedisBackend(client(url)),
            rates=[Rate(LIMIT, period)],
            min_interval=0,
            namespace="bench-many",
        )
        return (lambda token: limiter.try_acquire(token).allowed), lambda: None
    if library == "limits":
        from limits import parse
        from limits.storage import RedisStorage
        from limits.strategies import MovingWindowRateLimiter

        moving = MovingWindowRateLimiter(RedisStorage(url))
        item = parse(f"{LIMIT}/{period:g} seconds")
        return (lambda token: moving.hit(item, token)), lambda: None
    if library == "pyrate":
        from pyrate_limiter import AbstractBucket, BucketFactory, RateItem, RedisBucket
        from pyrate_limiter import Limiter as PyrateLimiter
        from pyrate_limiter import Rate as PyrateRate
        from pyrate_limiter.buckets.redis_bucket import LuaScript

        conn = client(url)
        rates = [PyrateRate(LIMIT, int(period * 1000))]
        script = conn.script_load(LuaScript.PUT_ITEM)

        class PerToken(BucketFactory):
            """pyrate's README "PerNameFactory", over Redis: one bucket per token."""

            def __init__(self) -> None:
                self.buckets: dict[str, AbstractBucket] = {}

            def wrap_item(self, name: str, weight: int = 1) -> RateItem:
                return RateItem(name, time.time_ns() // 1_000_000, weight=weight)

            def get(self, item: RateItem) -> AbstractBucket:
                bucket = self.buckets.get(item.name)
                if bucket is None:
                    bucket = self.create(RedisBucket, rates, conn, f"pyrate:{item.name}", script)
                    self.buckets[item.name] = bucket
                return bucket

        pyrate = PyrateLimiter(PerToken())
        return (lambda token: pyrate.try_acquire(token, blocking=False)), pyrate.close
    raise ValueError(f"unknown library {library!r}")


def worker(
    url: str,
    library: str,
    period: float,
    tokens: list[str],
    passes: int,
    barrier: Any,
    results: Any,
) -> None:
    """Warm up, wait for the start, make ``passes`` round-robin passes over ``tokens``."""
    decide, close = build(library, url, period)
    warm = f"warm-{os.getpid()}"
    for _ in range(WARM_CALLS):  # connections, script caches, code paths
        decide(warm)
    barrier.wait()  # every worker ready: the parent reads memory
    barrier.wait()  # go
    lat = array("q")
    refused = 0
    slowest_refused = 0  # ns
    clock = time.perf_counter_ns
    start = clock()
    for _ in range(passes):
        for token in tokens:
            t0 = clock()
            got = decide(token)
            t1 = clock()
            lat.append(t1 - t0)
            if not got:
                refused += 1
                slowest_refused = max(slowest_refused, t1 - t0)
    busy = clock() - start
    results.put(
        {"lat": lat.tobytes(), "busy_ns": busy, "refused": refused, "slowest": slowest_refused}
    )
    barrier.wait()  # the parent reads memory while the connections are still open
    close()


def percentile(ordered: array[int] | list[int], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000  # µs


def used_memory(conn: redis.Redis) -> int:
    return int(conn.info("memory")["used_memory"])


def run_phase(
    url: str, library: str, period: float, token_lists: list[list[str]], passes: int
) -> dict[str, float]:
    conn = client(url)
    conn.flushall()
    ctx = mp.get_context("spawn")  # no inherited sockets or threads
    barrier = ctx.Barrier(len(token_lists) + 1)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(url, library, period, tokens, passes, barrier, results))
        for tokens in token_lists
    ]
    for proc in procs:
        proc.start()
    barrier.wait()
    before = used_memory(conn)
    keys_before = conn.dbsize()
    barrier.wait()
    began = time.perf_counter()
    reports = [results.get() for _ in procs]
    wall = time.perf_counter() - began
    after = used_memory(conn)
    keys_after = conn.dbsize()
    barrier.wait()
    for proc in procs:
        proc.join()
        if proc.exitcode != 0:
            raise SystemExit(f"a benchmark worker failed (exit code {proc.exitcode})")
    lat = array("q")
    rate = 0.0
    refused = 0
    slowest_refused = 0
    for report in reports:
        mine = array("q")
        mine.frombytes(report["lat"])
        lat.extend(mine)
        rate += len(mine) / (report["busy_ns"] / 1e9)  # each worker's own rate
        refused += report["refused"]
        slowest_refused = max(slowest_refused, report["slowest"])
    ordered = sorted(lat)
    tokens = sum(len(t) for t in token_lists)
    admitted = len(ordered) - refused
    delta = after - before
    return {
        "tokens": tokens,
        "calls": len(ordered),
        "admitted": admitted,
        "refused": refused,
        "slowest_refused_ms": slowest_refused / 1e6,
        "redis_keys": keys_after - keys_before,
        "seconds": wall,
        "per_second": rate,
        "p50_us": percentile(ordered, 0.50),
        "p99_us": percentile(ordered, 0.99),
        "memory_bytes": delta,
        "bytes_per_token": delta / tokens,
        "bytes_per_call": delta / max(1, admitted),
    }


def split(tokens: list[str], workers: int) -> list[list[str]]:
    return [tokens[w::workers] for w in range(workers)]


def render_phase(title: str, phase: dict[str, dict[str, float]], period: float) -> list[str]:
    lines = [
        title,
        f"{'library':<16}{'calls':>10}{'admitted':>10}{'keys':>9}{'wall s':>8}{'dec/s':>8}"
        f"{'p50 µs':>8}{'p99 µs':>8}{'memory MB':>11}{'B/token':>10}{'B/call':>8}",
    ]
    for library, s in phase.items():
        lines.append(
            f"{library:<16}{s['calls']:>10.0f}{s['admitted']:>10.0f}{s['redis_keys']:>9.0f}"
            f"{s['seconds']:>8.1f}{s['per_second']:>8.0f}{s['p50_us']:>8.1f}{s['p99_us']:>8.1f}"
            f"{s['memory_bytes'] / 1e6:>11.2f}{s['bytes_per_token']:>10.0f}"
            f"{s['bytes_per_call']:>8.1f}"
        )
    for library, s in phase.items():
        if s["refused"]:
            lines.append(
                f"WARNING: {library}: {s['refused']:.0f} calls were refused (the slowest "
                f"refused call took {s['slowest_refused_ms']:.1f} ms)"
            )
        if s["seconds"] > period:
            lines.append(
                f"WARNING: {library}: the phase took {s['seconds']:.1f} s, longer than the "
                f"{period:g} s window: early entries may have aged out before memory was read"
            )
    return lines


def render(phases: dict[str, dict[str, dict[str, float]]], opts: argparse.Namespace) -> str:
    lines = render_phase(
        f"fleet: {opts.tokens:,} tokens x {opts.calls_per_key} calls each, round-robin "
        "(lightly used tokens)",
        phases["fleet"],
        opts.period,
    )
    lines.append("")
    lines += render_phase(
        f"full: {opts.full_tokens} tokens x {LIMIT} calls each, round-robin (a full window "
        "per token)",
        phases["full"],
        opts.period,
    )
    lines.append("")
    lines.append(
        f"extrapolated: {FLEET:,} tokens each with a full window ({FLEET:,} x {LIMIT} "
        "calls), from the full phase's bytes per token:"
    )
    for library, s in phases["full"].items():
        lines.append(f"  {library:<16}{FLEET * s['bytes_per_token'] / 1e9:>7.1f} GB")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=FLEET, help="tokens in the fleet phase")
    parser.add_argument("--calls-per-key", type=int, default=2, help="calls per fleet token")
    parser.add_argument(
        "--full-tokens", type=int, default=4, help=f"tokens called {LIMIT} times each"
    )
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    parser.add_argument(
        "--scale", type=float, default=50.0, help=f"time scale: {LIMIT} per 3600/SCALE seconds"
    )
    parser.add_argument(
        "--libraries", default=",".join(LIBRARIES), help="comma-separated subset to run"
    )
    parser.add_argument("--quick", action="store_true", help="a fast smoke run")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument(
        "--redis-server", metavar="PATH", help="the redis-server binary (default: from PATH)"
    )
    opts = parser.parse_args()
    if opts.quick:
        opts.tokens, opts.calls_per_key, opts.full_tokens = 5000, 2, 2
    if opts.full_tokens < opts.workers or opts.tokens < opts.workers:
        raise SystemExit("every worker needs a token: --tokens and --full-tokens >= --workers")
    libraries = [name for name in opts.libraries.split(",") if name]
    if unknown := set(libraries) - set(LIBRARIES):
        raise SystemExit(f"unknown libraries: {', '.join(sorted(unknown))}")
    opts.period = 3600 / opts.scale

    from throttle_client.testing import RedisServer

    fleet_tokens = split([f"token-{i:06d}" for i in range(opts.tokens)], opts.workers)
    full_tokens = split([f"full-{i:06d}" for i in range(opts.full_tokens)], opts.workers)
    phases: dict[str, dict[str, dict[str, float]]] = {"fleet": {}, "full": {}}
    server = RedisServer(args=("--maxmemory", MAXMEMORY))
    if opts.redis_server:
        server.binary = opts.redis_server
    with server:
        version = client(server.url).info("server")["redis_version"]
        for library in libraries:
            phases["fleet"][library] = run_phase(
                server.url, library, opts.period, fleet_tokens, opts.calls_per_key
            )
            phases["full"][library] = run_phase(
                server.url, library, opts.period, full_tokens, LIMIT
            )

    print(
        f"redis-server {version} on loopback; Python {platform.python_version()}, "
        f"redis-py {redis.__version__}, {os.cpu_count()} CPUs; {opts.workers} worker "
        f"processes; rate {LIMIT} per {opts.period:g} s ({LIMIT}/hour scaled {opts.scale:g}x)"
    )
    print()
    print(render(phases, opts))
    if opts.json:
        with open(opts.json, "w") as out:
            json.dump(
                {
                    "phases": phases,
                    "redis": version,
                    "period_s": opts.period,
                    "extrapolated_gb": {
                        library: FLEET * s["bytes_per_token"] / 1e9
                        for library, s in phases["full"].items()
                    },
                },
                out,
                indent=2,
            )


if __name__ == "__main__":
    main()
