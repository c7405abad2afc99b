"""Server time per decision of two versions of the script, and limits', in turns.

On a noisy machine the server time of one candidate moves by 20-30 % from one run to
the next, so figures from separate runs cannot tell a change of 10 %. This loads the
script of each checkout given (its ``throttle_client/_backends``: the Lua parts and
``redis_script.PARTS``) as a function library of its own on one redis-server, and runs
a ``try_acquire`` through each, and limits' moving window ``hit``, in short turns for
several rounds, reading ``INFO commandstats`` after each turn. It prints, per
candidate, the median and the lowest of the rounds' µs per call, and each script's
median over limits'.

    python benchmarks/script_ab.py BEFORE_CHECKOUT [AFTER_CHECKOUT] [--two-rates]
        [--redis-server PATH] [--calls N] [--rounds N]

(A checkout: a directory holding ``throttle_client``, e.g. ``git worktree add
/tmp/before <rev>``; the default second one is this one.) ``--two-rates``: 10**9/hour,
10**9/second and a 1 µs gap, margin 0, as bench_decision's ``tc 2 rates+gap``;
otherwise one rate of 10**9/hour with the defaults.
"""

from __future__ import annotations

import argparse
import re
import statistics
from collections.abc import Callable
from pathlib import Path

import redis

from throttle_client import Limiter, Rate, RedisBackend
from throttle_client._backends import redis_script
from throttle_client.testing import RedisServer

HERE = Path(__file__).resolve().parent.parent
RUN = "return run(KEYS, ARGV)\n"
SCRIPT_CALLS = ("cmdstat_fcall", "cmdstat_evalsha")


def library(checkout: Path, name: str) -> str:
    """The script of ``checkout`` as a function library registering ``name``."""
    backends = checkout / "throttle_client" / "_backends"
    source = (backends / "redis_script.py").read_text()
    listed = source[source.index("PARTS = (") : source.index(")", source.index("PARTS = ("))]
    parts = re.findall(r'"(\w+)"', listed)
    script = "".join((backends / "lua" / f"{part}.lua").read_text() for part in parts)
    body = script.removesuffix(RUN)
    return (
        f"#!lua name={name}\n{body}"
        f"redis.register_function('{name}', function(keys, args) return run(keys, args) end)\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkouts", nargs="+", type=Path, metavar="CHECKOUT")
    parser.add_argument("--two-rates", action="store_true")
    parser.add_argument("--redis-server", metavar="PATH", help="default: redis-server on PATH")
    parser.add_argument("--calls", type=int, default=3000, help="calls per turn")
    parser.add_argument("--rounds", type=int, default=10)
    opts = parser.parse_args()
    checkouts = opts.checkouts if len(opts.checkouts) > 1 else [opts.checkouts[0], HERE]
    with RedisServer(binary=opts.redis_server) as server:
        conn = redis.Redis.from_url(server.url)
        version = conn.info("server")["redis_version"]
        calls: dict[str, Callable[[], object]] = {}
        for index, checkout in enumerate(checkouts):
            name = f"script_ab_{index}"
            conn.function_load(library(checkout, name), replace=True)
            rates = [Rate(10**9, 3600), Rate(10**9, 1)] if opts.two_rates else [Rate(10**9, 3600)]
            extra = {"min_interval": 1e-6, "margin": 0} if opts.two_rates else {}
            limiter = Limiter(RedisBackend(conn), rates=rates, namespace=name, **extra)

            def call(limiter: Limiter = limiter, name: str = name) -> object:
                redis_script.FUNCTION = name  # (this version's library)
                return limiter.try_acquire("token")

            calls[str(checkout)] = call
        from limits import RateLimitItemPerHour
        from limits.storage import RedisStorage
        from limits.strategies import MovingWindowRateLimiter

        moving = MovingWindowRateLimiter(RedisStorage(server.url))
        item = RateLimitItemPerHour(10**9)
        calls["limits"] = lambda: moving.hit(item, "token-limits")
        rounds: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(opts.rounds):
            for name, call in calls.items():
                for _ in range(opts.calls // 10):  # (warm)
                    call()
                conn.config_resetstat()
                for _ in range(opts.calls):
                    call()
                stats = conn.info("commandstats")
                used = sum(stats[c]["usec"] for c in SCRIPT_CALLS if c in stats)
                rounds[name].append(used / opts.calls)
    print(
        f"redis-server {version}; {'two rates and a gap' if opts.two_rates else 'one rate'}; "
        f"{opts.rounds} rounds of {opts.calls} calls per candidate, in turns"
    )
    print(f"{'candidate':<44}{'median':>8}{'lowest':>8}  µs of script time per call")
    peer = statistics.median(rounds["limits"])
    for name, figures in rounds.items():
        ratio = "" if name == "limits" else f"   {statistics.median(figures) / peer:.2f}x limits"
        print(f"{name:<44}{statistics.median(figures):>8.1f}{min(figures):>8.1f}{ratio}")


if __name__ == "__main__":
    main()
