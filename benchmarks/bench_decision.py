"""Cost of one throttling decision over Redis: throttle_client beside the floor and two peers.

Starts its own redis-server on a free loopback port (never a shared one) and runs,
interleaved round-robin in short batches so that drift (other load on the machine,
CPU frequency, the log growing) hits every candidate alike:

  floor          a bare EVALSHA of ``return 1`` with one key: one round trip, nothing more
  tc try_acquire throttle_client ``Limiter.try_acquire``, admitted (10**9/hour)
  tc history     the same with ``history=True``: what counting each call per hour, day
                 and month (opt-in) costs is the difference
  tc 2 rates+gap ``try_acquire`` held to 10**9/hour and 10**9/second and a 1 µs gap:
                 the plain decision of two rates (the second's window reaches past the
                 oldest entry, so one lookup per call)
  tc refused     ``try_acquire`` on a spent key (1/hour): the refusal path
  tc acquire     ``Limiter.acquire``, admitted at once (no sleep)
  tc stacked     ``try_acquire`` charged to a token and its account at once (``also=``):
                 two keys' logs decided and booked in one script call
  tc capped      ``with limiter.lease(key)`` on a limiter with ``max_concurrent``, never
                 full: admission (rates and cap in one script call) and release, two
                 round trips, timed together
  tc calendar    ``try_acquire`` on a sliding hourly rate and a calendar day in
                 America/Los_Angeles: the windows travel with the quota
  tc learn       ``Limiter.learn`` of quota headers stricter than the rates: the write a
                 response costs when the upstream's view binds
  limits         limits' ``MovingWindowRateLimiter.hit`` over its ``RedisStorage``
  limits fixed   limits' ``FixedWindowRateLimiter.hit`` (windows aligned to the epoch, not
                 to a calendar in a zone: the nearest a peer comes to a calendar day)
  pyrate         pyrate-limiter's ``Limiter(RedisBucket).try_acquire`` (non-blocking)

each first in 1 worker process, then in 2 worker processes that hit the same key at
once (the workers start every batch together, at a barrier). It prints p50 / p99
latency per decision and decisions per second, then Redis memory per logged call
after 5000 admitted calls (``MEMORY USAGE`` summed over every key written), and the
server's own time per decision, each candidate alone (``INFO commandstats``: the time
of its script calls, which includes the commands they run; ``INFO cpu``: the server
process's CPU, network included).

    python benchmarks/bench_decision.py            # about 3 s per candidate and phase
    python benchmarks/bench_decision.py --quick    # a smoke run, well under 20 s
    python benchmarks/bench_decision.py --json out.json
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

# (name, what is expected of every call: admitted or refused)
CANDIDATES: list[tuple[str, bool]] = [
    ("floor", True),
    ("tc try_acquire", True),
    ("tc history", True),
    ("tc 2 rates+gap", True),
    ("tc refused", False),
    ("tc acquire", True),
    ("tc stacked", True),
    ("tc capped", True),
    ("tc calendar", True),
    ("tc learn", True),
    ("limits", True),
    ("limits fixed", True),
    ("pyrate", True),
]
HIGH = 10**9  # calls per hour: never reached, so every call is admitted
HIGH_CAP = 1000  # calls in flight: never reached either
MEMORY_ENTRIES = 5000


def client(url: str) -> redis.Redis:
    """The same client settings for the floor and for throttle_client."""
    return redis.Redis.from_url(url)


def build(name: str, url: str) -> Callable[[], object]:
    """One decision of candidate ``name``, as a zero-argument call (built in the worker)."""
    if name == "floor":
        conn = client(url)
        sha = conn.script_load("return 1")
        return lambda: conn.evalsha(sha, 1, "bench:floor")
    if name.startswith("tc "):
        from throttle_client import Limiter, Rate, RedisBackend

        backend = RedisBackend(client(url))
        if name == "tc refused":
            spent = Limiter(backend, rates=[Rate(1, 3600)], namespace="bench-refused")
            spent.try_acquire("token-refused")  # use the one call; every later one is refused
            return lambda: spent.try_acquire("token-refused").allowed
        limiter = Limiter(backend, rates=[Rate(HIGH, 3600)], namespace="bench")
        if name == "tc history":
            counted = Limiter(backend, rates=[Rate(HIGH, 3600)], namespace="bench-h", history=True)
            return lambda: counted.try_acquire("token-history").allowed
        if name == "tc acquire":
            return lambda: limiter.acquire("token-acquire").allowed
        if name == "tc capped":
            capped = Limiter(
                backend, rates=[Rate(HIGH, 3600)], namespace="bench-capped", max_concurrent=HIGH_CAP
            )

            def lease() -> bool:
                with capped.lease("token-capped") as decision:
                    return decision.allowed

            return lease
        if name == "tc calendar":
            daily = Limiter(
                backend,
                rates=[Rate(HIGH, 3600), Rate(HIGH, "day", tz="America/Los_Angeles")],
                namespace="bench-calendar",
            )
            return lambda: daily.try_acquire("token-calendar").allowed
        if name == "tc 2 rates+gap":
            two = Limiter(
                backend,
                rates=[Rate(HIGH, 3600), Rate(HIGH, 1)],
                min_interval=1e-6,
                margin=0,
                namespace="bench-two",
            )
            return lambda: two.try_acquire("token-two").allowed
        if name == "tc learn":
            decision = limiter.acquire("token-learn")
            stricter = {"X-RateLimit-Remaining": str(HIGH // 2), "X-RateLimit-Reset": "60"}
            return lambda: limiter.learn("token-learn", decision, stricter) is not None
        if name == "tc stacked":
            account = Limiter(backend, rates=[Rate(HIGH, 3600)], namespace="bench-account")
            both = [(account, "account-stacked")]
            return lambda: limiter.try_acquire("token-stacked", also=both).allowed
        return lambda: limiter.try_acquire("token-try").allowed
    if name == "limits":
        from limits import RateLimitItemPerHour
        from limits.storage import RedisStorage
        from limits.strategies import MovingWindowRateLimiter

        moving = MovingWindowRateLimiter(RedisStorage(url))
        item = RateLimitItemPerHour(HIGH)
        return lambda: moving.hit(item, "token-limits")
    if name == "limits fixed":
        from limits import RateLimitItemPerDay
        from limits.storage import RedisStorage
        from limits.strategies import FixedWindowRateLimiter

        fixed = FixedWindowRateLimiter(RedisStorage(url))
        day = RateLimitItemPerDay(HIGH)
        return lambda: fixed.hit(day, "token-limits-fixed")
    if name == "pyrate":
        from pyrate_limiter import Duration, RedisBucket
        from pyrate_limiter import Limiter as PyrateLimiter
        from pyrate_limiter import Rate as PyrateRate

        bucket = RedisBucket.init([PyrateRate(HIGH, Duration.HOUR)], client(url), "bench:pyrate")
        pyrate = PyrateLimiter(bucket)
        return lambda: pyrate.try_acquire("token-pyrate", blocking=False)
    raise ValueError(f"unknown candidate {name!r}")


def worker(
    url: str,
    names: list[str],
    rounds: int,
    batch_seconds: float,
    barrier: Any,
    results: Any,
) -> None:
    """Run every candidate in turn, ``rounds`` times, one timed batch each; report back."""
    calls = {name: build(name, url) for name in names}
    expected = dict(CANDIDATES)
    for call in calls.values():  # warm up: connections, script caches, code paths
        for _ in range(200):
            call()
    latencies = {name: array("q") for name in names}
    busy = dict.fromkeys(names, 0)  # ns spent inside batches
    wrong = dict.fromkeys(names, 0)  # calls whose answer was not the expected one
    clock = time.perf_counter_ns
    for r in range(rounds):
        shift = r % len(names)  # rotate, so no candidate always follows the same one
        for name in names[shift:] + names[:shift]:
            call, want, lat = calls[name], expected[name], latencies[name]
            barrier.wait()
            start = clock()
            stop = start + int(batch_seconds * 1e9)
            t1 = start
            while t1 < stop:
                t0 = clock()
                got = call()
                t1 = clock()
                lat.append(t1 - t0)
                if bool(got) is not want:
                    wrong[name] += 1
            busy[name] += t1 - start
    results.put(
        {
            name: {"lat": latencies[name].tobytes(), "busy_ns": busy[name], "wrong": wrong[name]}
            for name in names
        }
    )


def percentile(ordered: array[int] | list[int], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000  # µs


def run_phase(
    url: str, names: list[str], processes: int, seconds: float, batch: float
) -> dict[str, dict[str, float]]:
    ctx = mp.get_context("spawn")  # no inherited sockets or threads
    barrier = ctx.Barrier(processes)
    results = ctx.Queue()
    rounds = max(1, round(seconds / batch))
    procs = [
        ctx.Process(target=worker, args=(url, names, rounds, batch, barrier, results))
        for _ in range(processes)
    ]
    for proc in procs:
        proc.start()
    reports = [results.get() for _ in procs]
    for proc in procs:
        proc.join()
        if proc.exitcode != 0:
            raise SystemExit(f"a benchmark worker failed (exit code {proc.exitcode})")
    summary: dict[str, dict[str, float]] = {}
    for name in names:
        lat = array("q")
        rate = 0.0
        wrong = 0
        for report in reports:
            mine = array("q")
            mine.frombytes(report[name]["lat"])
            lat.extend(mine)
            rate += len(mine) / (report[name]["busy_ns"] / 1e9)  # each worker's own rate
            wrong += report[name]["wrong"]
        ordered = sorted(lat)
        summary[name] = {
            "p50_us": percentile(ordered, 0.50),
            "p99_us": percentile(ordered, 0.99),
            "per_second": rate,
            "calls": len(ordered),
            "unexpected": wrong,
        }
    return summary


def beside_the_key(url: str) -> dict[str, int]:
    """Bytes (MEMORY USAGE) of what the store keeps beside a key: its card,
    and its usage history once full (a call an hour for 62 days: 48 hours, 62 days and 3
    months of counters; 24 months would add 21 small fields)."""
    from throttle_client import Limiter, RedisBackend
    from throttle_client.testing import FakeClock

    conn = client(url)
    conn.flushall()
    clock = FakeClock()
    limiter = Limiter(
        RedisBackend(client(url)),
        rates=["5000/hour"],
        namespace="bench-beside",
        clock=clock,
        history=True,
    )
    for _ in range(62 * 24):
        assert limiter.try_acquire("token-beside").allowed
        clock.advance(3600)
    prefix = f"tc:{limiter.store_key('token-beside')}:"
    sizes = {part: conn.memory_usage(prefix + part, samples=0) or 0 for part in ("card", "history")}
    conn.flushall()
    return sizes


def memory_per_call(url: str) -> dict[str, float]:
    """Bytes of Redis memory per logged call with MEMORY_ENTRIES calls in one key's log."""
    conn = client(url)
    rate_text = f"{MEMORY_ENTRIES}/hour"
    out: dict[str, float] = {}

    def measure(name: str, call: Callable[[], object]) -> None:
        conn.flushall()
        for _ in range(MEMORY_ENTRIES):
            if not call():
                raise SystemExit(f"{name}: a call was refused while filling the log")
        used = sum(conn.memory_usage(key, samples=0) or 0 for key in conn.scan_iter(count=1000))
        out[name] = used / MEMORY_ENTRIES

    from throttle_client import Limiter, RedisBackend
    from throttle_client.testing import FakeClock

    # Paced as the rate allows (an injected clock, 0.72 s per call): a log filled over an
    # hour, whose call ids (kept 5 s after their slot) are mostly gone.
    clock = FakeClock()
    paced = Limiter(
        RedisBackend(client(url)), rates=[rate_text], namespace="bench-memory", clock=clock
    )

    def paced_call() -> bool:
        clock.advance(3600 / MEMORY_ENTRIES)
        return paced.try_acquire("token-memory").allowed

    measure("throttle_client", paced_call)
    # All at once, as the peers are measured: every entry is still within its id's 5 s.
    limiter = Limiter(RedisBackend(client(url)), rates=[rate_text], namespace="bench-memory")
    measure("tc, at once", lambda: limiter.try_acquire("token-memory").allowed)

    from limits import parse
    from limits.storage import RedisStorage
    from limits.strategies import MovingWindowRateLimiter

    moving = MovingWindowRateLimiter(RedisStorage(url))
    item = parse(rate_text)
    measure("limits", lambda: moving.hit(item, "token-memory"))

    from pyrate_limiter import Duration, RedisBucket
    from pyrate_limiter import Limiter as PyrateLimiter
    from pyrate_limiter import Rate as PyrateRate

    bucket = RedisBucket.init([PyrateRate(MEMORY_ENTRIES, Duration.HOUR)], client(url), "bm")
    pyrate = PyrateLimiter(bucket)
    measure("pyrate", lambda: pyrate.try_acquire("token-memory", blocking=False))
    pyrate.close()
    conn.flushall()
    return out


SCRIPT_CALLS = ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_fcall")


def server_time(url: str, names: list[str], calls: int) -> dict[str, dict[str, float]]:
    """Redis's own time per decision, one candidate at a time after a warm-up."""
    conn = client(url)
    out: dict[str, dict[str, float]] = {}
    for name in names:
        call = build(name, url)
        for _ in range(200):
            call()
        conn.config_resetstat()
        cpu = conn.info("cpu")
        for _ in range(calls):
            call()
        after = conn.info("cpu")
        stats = conn.info("commandstats")
        script = sum(stats[c]["usec"] for c in SCRIPT_CALLS if c in stats)
        used = sum(after[k] - cpu[k] for k in ("used_cpu_sys", "used_cpu_user"))
        out[name] = {"script_us": script / calls, "cpu_us": used * 1e6 / calls}
    conn.close()
    return out


def processes(n: int) -> str:
    return f"{n} process" + ("es" if n > 1 else "")


def render(
    phases: dict[int, dict[str, dict[str, float]]],
    memory: dict[str, float],
    server: dict[str, dict[str, float]],
    beside: dict[str, int],
) -> str:
    counts = sorted(phases)
    lines = [
        f"{'':<16}" + "".join(f"{f'-- {processes(n)} --':^27}   " for n in counts),
        f"{'candidate':<16}"
        + "".join(f"{'p50 µs':>9}{'p99 µs':>9}{'dec/s':>9}   " for _ in counts),
    ]
    for name, _ in CANDIDATES:
        row = f"{name:<16}"
        for n in counts:
            s = phases[n][name]
            row += f"{s['p50_us']:>9.1f}{s['p99_us']:>9.1f}{s['per_second']:>9.0f}   "
        lines.append(row)
    lines = [line.rstrip() for line in lines]
    lines.append("")
    for n in counts:
        p50 = {name: s["p50_us"] for name, s in phases[n].items()}
        ratios = ", ".join(f"{name} {p50[name] / p50['floor']:.2f}x" for name, _ in CANDIDATES[1:])
        lines.append(f"p50 / floor p50, {processes(n)}: {ratios}")
    for n in counts:
        p50 = {name: s["p50_us"] for name, s in phases[n].items()}
        ours = p50["tc try_acquire"]
        verdicts = [
            f"{ours / p50['floor']:.2f}x the floor (target <= 1.15x: "
            f"{'met' if ours <= 1.15 * p50['floor'] else 'not met'})",
            *(
                f"{'no slower' if ours <= p50[peer] else 'slower'} than {peer}"
                for peer in ("limits", "pyrate")
            ),
        ]
        lines.append(f"target, {processes(n)}: tc try_acquire p50 is " + "; ".join(verdicts))
    for n in counts:
        for name, _ in CANDIDATES:
            if phases[n][name]["unexpected"]:
                lines.append(
                    f"WARNING: {name}, {processes(n)}: {phases[n][name]['unexpected']:.0f} "
                    "calls did not get the expected answer"
                )
    lines.append("")
    lines.append("Redis's own time per decision, each candidate alone (µs):")
    lines.append(f"  {'candidate':<16}{'scripts':>9}{'cpu':>9}")
    for name, _ in CANDIDATES:
        lines.append(f"  {name:<16}{server[name]['script_us']:>9.1f}{server[name]['cpu_us']:>9.1f}")
    ours, peer = server["tc 2 rates+gap"]["script_us"], server["limits"]["script_us"]
    lines.append(
        f"target: tc 2 rates+gap's script time is {ours / peer:.2f}x limits' moving window "
        f"(target <= 2.00x: {'met' if ours <= 2 * peer else 'not met'})"
    )
    lines.append("")
    lines.append(
        f"Redis memory per logged call, {MEMORY_ENTRIES} calls in one key's log "
        "(throttle_client: paced over an hour, and at once, within ~2 s; targets: paced "
        "<= 110 bytes, at once <= 130):"
    )
    for name, size in memory.items():
        lines.append(f"  {name:<16}{size:>7.1f} bytes")
    lines.append("Redis bytes beside a key (its card; its usage history, full):")
    for name, size in beside.items():
        lines.append(f"  {name:<16}{size:>7d} bytes")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="per candidate and phase")
    parser.add_argument("--batch", type=float, default=0.1, help="seconds per interleaved batch")
    parser.add_argument("--quick", action="store_true", help="a fast smoke run")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument(
        "--redis-server", metavar="PATH", help="the redis-server binary (default: from PATH)"
    )
    opts = parser.parse_args()
    if opts.quick:
        opts.seconds, opts.batch = 0.4, 0.05

    from throttle_client.testing import RedisServer

    names = [name for name, _ in CANDIDATES]
    server = RedisServer()
    if opts.redis_server:
        server.binary = opts.redis_server
    with server:
        version = client(server.url).info("server")["redis_version"]
        phases = {n: run_phase(server.url, names, n, opts.seconds, opts.batch) for n in (1, 2)}
        memory = memory_per_call(server.url)
        beside = beside_the_key(server.url)
        own = server_time(server.url, names, 500 if opts.quick else 5000)

    print(
        f"redis-server {version} on loopback; Python {platform.python_version()}, "
        f"redis-py {redis.__version__}, {os.cpu_count()} CPUs; "
        f"{opts.seconds:g} s per candidate and phase in {opts.batch:g} s interleaved batches"
    )
    print()
    print(render(phases, memory, own, beside))
    if opts.json:
        with open(opts.json, "w") as out:
            json.dump(
                {
                    "phases": phases,
                    "memory_bytes_per_call": memory,
                    "bytes_beside_a_key": beside,
                    "server_us": own,
                    "redis": version,
                },
                out,
                indent=2,
            )


if __name__ == "__main__":
    main()
