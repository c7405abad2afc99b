"""Arrivals at a strict upstream against the limiter's margin: how to pick it.

Runs the scenarios of tests/test_arrivals.py (8 processes; 200 threads on one Limiter;
1000 tasks on one AsyncLimiter; one token, 20/second + 50/3 seconds, 20 ms apart,
demand far above the quota) over several margins, on a private redis-server and on an
SQLite file, against StrictUpstream with tolerance 0 in its own process. Per run:

  429s       requests the upstream refused (it counts arrivals, exactly)
  over       arrivals whose window (t - W, t] held more than the limit, all rates
  close      arrivals less than min_interval after the one before
  late       slots booked and given up because the call woke more than margin late
  use/slot   used slots over the most the exact quota allows between first and last slot
  use/arr    admitted arrivals over the most the quota allows between first and last
  arrival - slot (ms)  p50 / p99 / max, then where the max comes from: wake (the limiter
             let the call go, after its slot), send (the upstream stamped the arrival,
             after that)

    PYTHONPATH=. python benchmarks/bench_arrivals.py                # ~4 min
    PYTHONPATH=. python benchmarks/bench_arrivals.py --hog 2        # with 2 busy loops
    PYTHONPATH=. python benchmarks/bench_arrivals.py --margins 0.025 --stores redis
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the harness lives in tests/

from tests import arrivals_harness as harness
from throttle_client.testing import RedisServer

MARGINS = (0.0, 0.005, 0.01, 0.025, 0.05)


def _spin() -> None:
    while True:
        pass


@contextmanager
def cpu_hog(processes: int) -> Iterator[None]:
    """``processes`` busy loops for the duration: a loaded machine."""
    ctx = multiprocessing.get_context("spawn")
    hogs = [ctx.Process(target=_spin, daemon=True) for _ in range(processes)]
    for hog in hogs:
        hog.start()
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.join()


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def row(outcome: harness.Outcome) -> str:
    q = harness.quantile
    lateness = outcome.lateness
    return (
        f"{outcome.scenario[:14]:<14} {outcome.store:<6} {outcome.margin * 1000:>6g} "
        f"{outcome.rejected:>5} {outcome.over_by_arrival:>5} {outcome.close_by_arrival:>5} "
        f"{outcome.late_wakeups:>5} "
        f"{outcome.use_by_slot:>8.1%} {outcome.use_by_arrival:>8.1%} "
        f"{ms(q(lateness, 0.5)):>6} {ms(q(lateness, 0.99)):>6} {ms(q(lateness, 1.0)):>6}  "
        f"{ms(q(outcome.waking, 1.0)):>5} {ms(q(outcome.in_flight, 1.0)):>5}"
    )


HEADER = (
    f"{'scenario':<14} {'store':<6} {'margin':>6} {'429s':>5} {'over':>5} {'close':>5} {'late':>5} "
    f"{'use/slot':>8} {'use/arr':>8} {'p50':>6} {'p99':>6} {'max':>6}  {'wake':>5} {'send':>5}\n"
    f"{'':<14} {'':<6} {'ms':>6} {'':>5} {'':>5} {'':>5} {'':>5} {'':>8} {'':>8} "
    f"{'arrival - slot, ms':>20}  {'max, ms':>11}"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--margins", type=float, nargs="+", default=MARGINS)
    parser.add_argument(
        "--stores", nargs="+", choices=("redis", "sqlite"), default=("redis", "sqlite")
    )
    parser.add_argument(
        "--scenarios", nargs="+", choices=tuple(harness.SCENARIOS), default=tuple(harness.SCENARIOS)
    )
    parser.add_argument("--hog", type=int, default=0, help="busy-loop processes during the runs")
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds of demand per run (default: each scenario's)",
    )
    parser.add_argument(
        "--redis-server", default=None, help="redis-server binary (default: found on PATH)"
    )
    args = parser.parse_args()

    load = os.getloadavg()
    print(
        f"Python {platform.python_version()}, {os.cpu_count()} CPUs, load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} before the runs; {args.hog} busy loops; "
        f"{args.duration or harness.DURATION:g} s of demand per run (1000 tasks: "
        f"{args.duration or harness.SCENARIOS['tasks'].duration:g} s); quota "
        f"{' + '.join(map(str, harness.RATES))}, min_interval {harness.MIN_INTERVAL:g} s"
    )
    print(HEADER)
    server = RedisServer(binary=args.redis_server).start() if "redis" in args.stores else None
    try:
        with cpu_hog(args.hog), tempfile.TemporaryDirectory() as tmp:
            for number, (margin, store, name) in enumerate(
                (m, st, sc) for m in args.margins for st in args.stores for sc in args.scenarios
            ):
                url = server.url if store == "redis" and server else f"sqlite:///{tmp}/{number}.db"
                outcome = harness.run(
                    harness.SCENARIOS[name],
                    url,
                    margin=margin,
                    duration=args.duration,
                    log_level=100,  # 429s are counted, not printed
                )
                print(row(outcome), flush=True)
                time.sleep(1)  # let the previous run's windows pass and its processes go
    finally:
        if server is not None:
            server.close()
    load = os.getloadavg()
    print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
