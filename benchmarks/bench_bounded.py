"""Huge quotas: Redis memory per key and server time per decision, exact and bounded.

The aim of bounded rates: with ``Rate(..., bounded=True)`` a key's memory is bounded
whatever the limit (<= 2 KB for ``70000/day`` or
``1000000/month``), where a sliding-window log holds one entry per call of the window.
Starts its own redis-server on a free loopback port and fills one key per candidate,
then reads ``MEMORY USAGE`` over every key written and the script's server time (``INFO
commandstats``) per call:

  tc 70000/day exact         throttle_client's exact log, 70,000 calls paced over a day
                             (an injected clock), so a whole window is held
  tc 70000/day, 48 buckets   the same calls, bounded: ``Rate(70000, 86400, buckets=48)``
  tc 70000/day, 48, burst    5000 calls in 1 s (the key keeps its last 5 s of calls
                             and their ids, for retries), and after 30 calls paced
                             1 s apart from 11 s on
  tc 1000000/month bounded   ``Rate(1000000, "month", tz="UTC", bounded=True)``, --calls
                             calls paced over 31 days (the bytes do not grow with calls)
  limits moving 70000/day    limits' moving window: one list entry per call, all at once
  limits fixed 70000/day     limits' fixed window: one counter (not sliding)
  pyrate 70000/day           pyrate-limiter's RedisBucket (a sorted set), all at once
  limits moving 1000000/month  --calls calls only: its bytes grow with every call, so
                             the full window's are --calls' times limit / calls

then the under-use: when the 6001st call at 600/minute may go, for workers that always
have a call ready, exact (10 windows) and in 60, 12 and 6 buckets (at most one bucket of
delay per window: 1/buckets of it).

    python benchmarks/bench_bounded.py --redis-server /usr/bin/redis-server
    python benchmarks/bench_bounded.py --calls 20000   # a quicker run
"""

from __future__ import annotations

import argparse
import platform
from collections.abc import Callable

import redis

SCRIPT_CALLS = ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_fcall")
DAY = 86400.0


def script_usec(conn: redis.Redis) -> float:
    stats = conn.info("commandstats")
    return float(sum(stats[name]["usec"] for name in SCRIPT_CALLS if name in stats))


def measure(conn: redis.Redis, calls: int, call: Callable[[], object]) -> tuple[int, float]:
    """Bytes of every key after ``calls`` admitted calls, and script µs per call."""
    conn.flushall()
    conn.config_resetstat()
    for _ in range(calls):
        if not call():
            raise SystemExit("a call was refused while filling the key")
    used = sum(conn.memory_usage(key, samples=0) or 0 for key in conn.scan_iter(count=1000))
    return used, script_usec(conn) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=100_000, help="calls for the monthly rates")
    parser.add_argument("--redis-server", metavar="PATH", help="the redis-server binary")
    opts = parser.parse_args()

    from limits import parse
    from limits.storage import RedisStorage
    from limits.strategies import FixedWindowRateLimiter, MovingWindowRateLimiter
    from pyrate_limiter import Duration, RedisBucket
    from pyrate_limiter import Limiter as PyrateLimiter
    from pyrate_limiter import Rate as PyrateRate

    from throttle_client import Limiter, Rate, RedisBackend
    from throttle_client.testing import FakeClock, RedisServer

    server = RedisServer()
    if opts.redis_server:
        server.binary = opts.redis_server
    rows: list[tuple[str, int, int, float | None]] = []
    with server:
        conn = redis.Redis.from_url(server.url)
        version = conn.info("server")["redis_version"]

        def ours(name: str, rate: Rate, calls: int, span: float) -> None:
            clock = FakeClock()
            limiter = Limiter(RedisBackend(server.url), rates=[rate], clock=clock)

            def call() -> bool:
                clock.advance(span / calls)
                return limiter.try_acquire("token").allowed

            used, usec = measure(conn, calls, call)
            rows.append((name, calls, used, usec))

        ours("tc 70000/day exact", Rate(70000, DAY), 70000, DAY)
        # A burst: the key keeps its last 5 s of calls (their ids, for retries) beside
        # its buckets; measured right after 5000 calls in 1 s, and once they have aged.
        ours("tc 70000/day, 48, burst", Rate(70000, DAY, buckets=48), 5000, 1.0)
        clock = FakeClock()
        aged = Limiter(RedisBackend(server.url), rates=[Rate(70000, DAY, buckets=48)], clock=clock)

        def burst_then_later() -> bool:
            clock.advance(1 / 5000)
            return aged.try_acquire("token").allowed

        measure(conn, 5000, burst_then_later)
        clock.advance(11)  # past KEEP_IDS and a batch: the next call drops the ids
        for _ in range(30):  # (Redis shrinks a sorted set's table over the next writes)
            aged.try_acquire("token")
            clock.advance(1)
        used = sum(conn.memory_usage(key, samples=0) or 0 for key in conn.scan_iter())
        rows.append(("  ... then 30 calls 1 s apart", 5030, used, None))
        ours("tc 70000/day, 48 buckets", Rate(70000, DAY, buckets=48), 70000, DAY)
        ours(
            "tc 1000000/month bounded",
            Rate(1_000_000, "month", tz="UTC", bounded=True),
            opts.calls,
            31 * DAY,
        )
        moving = MovingWindowRateLimiter(RedisStorage(server.url))
        fixed = FixedWindowRateLimiter(RedisStorage(server.url))
        day = parse("70000/day")
        used, usec = measure(conn, 70000, lambda: moving.hit(day, "token"))
        rows.append(("limits moving 70000/day", 70000, used, usec))
        used, _ = measure(conn, 70000, lambda: fixed.hit(day, "token"))
        rows.append(("limits fixed 70000/day", 70000, used, None))
        bucket = RedisBucket.init([PyrateRate(70000, Duration.DAY)], conn, "bounded")
        pyrate = PyrateLimiter(bucket)
        used, usec = measure(conn, 70000, lambda: pyrate.try_acquire("token", blocking=False))
        rows.append(("pyrate 70000/day", 70000, used, usec))
        pyrate.close()
        month = parse("1000000/month")
        used, usec = measure(conn, opts.calls, lambda: moving.hit(month, "token"))
        rows.append(("limits moving 1000000/month", opts.calls, used, usec))
        # Under-use: workers that always have a call ready (acquire, sleeping on an
        # injected clock) at 600/minute, exact and in 60, 12, 6 buckets: when the
        # 6001st call may go (exact: 10 windows after the first).
        use: list[tuple[str, float]] = []
        for buckets in (None, 60, 12, 6):
            clock = FakeClock()
            greedy = Limiter(
                RedisBackend(server.url),
                rates=[Rate(600, 60, buckets=buckets)],
                clock=clock,
                sleep=clock.sleep,
                namespace=f"use{buckets}",
            )
            start = clock.now
            for _ in range(6000):
                greedy.acquire("token")
            after = greedy.acquire("token").slot - start
            use.append(("exact" if buckets is None else f"{buckets} buckets", after))
        conn.close()

    print(
        f"redis-server {version} on loopback; Python {platform.python_version()}, "
        f"redis-py {redis.__version__}"
    )
    print()
    print(f"{'candidate':<30} {'calls':>9} {'bytes in Redis':>15} {'script µs/call':>15}")
    for name, calls, used, usec in rows:
        cost = "-" if usec is None else f"{usec:.1f}"
        print(f"{name:<30} {calls:>9,} {used:>15,} {cost:>15}")
    print("\nUnder-use at 600/minute, a call always ready: when the 6001st call goes")
    exact = use[0][1]
    for label, after in use:
        print(
            f"  {label:<12} {after:7.2f} s  ({after / exact - 1:+6.1%}: the limit's "
            f"{exact / after:6.1%})"
        )
    name, calls, used, _ = rows[-1]
    print(
        f"\n{name}: {used / calls:.1f} B per call, so ~{used / calls * 1_000_000 / 1e6:.0f} MB "
        "for a full month's million calls"
    )


if __name__ == "__main__":
    main()
