"""Calendar quotas: a daily quota that resets at midnight Pacific time, and a monthly plan.

Google-style APIs count "requests per day" from midnight Pacific time, not over a
sliding 24 hours, and plans are billed per month from the day you signed up.
Calendar rates say exactly that:

* ``Rate(40, "day", tz="America/Los_Angeles")`` (or ``"40/day in America/Los_Angeles"``):
  40 requests per local calendar day. The day the clocks go forward (8 March 2026)
  is 23 hours long, and the limiter knows it.
* ``Rate(3, "month", anchor=date(2026, 1, 30))`` (or ``"3/month from 2026-01-30"``): a
  month from the 30th, clamped in shorter months: 30 Jan, 28 Feb, 30 Mar, 30 Apr.

Days cannot be scaled down to seconds, so a ``FakeClock`` drives the limiter: each
sleep of ``acquire`` moves the fake clock instead of waiting. Part 1 sends 210
requests through a ``ThrottledClient`` to a fake API (an ``httpx.MockTransport``)
that counts each Pacific day by its own reckoning (``zoneinfo``) and answers 429
beyond 40. Part 2 calls ``acquire`` directly. It all takes under a second, and exits
with status 0 only if the API refused nothing and every whole day got all 40.

    python examples/calendar_quota.py [--redis redis://localhost:6379/0 | --sqlite PATH]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from datetime import date, datetime, time, timedelta
from zoneinfo import ZoneInfo

import httpx

from throttle_client import (
    Backend,
    Limiter,
    MemoryBackend,
    Rate,
    RedisBackend,
    SQLiteBackend,
    ThrottledClient,
)
from throttle_client.testing import FakeClock

PACIFIC = ZoneInfo("America/Los_Angeles")
UTC = ZoneInfo("UTC")
DAILY = 40
LATENCY = 0.05  # seconds from a request's slot to its arrival at the API
API_KEY = "AIza-demo-key"


def pacific(seconds: float) -> datetime:
    return datetime.fromtimestamp(round(seconds, 3), PACIFIC)  # to the ms: for printing


def hours_in(day: date) -> float:
    """How long a Pacific calendar day is (23 hours when the clocks go forward)."""
    start = datetime.combine(day, time(), PACIFIC)
    end = datetime.combine(day + timedelta(days=1), time(), PACIFIC)
    return (end.timestamp() - start.timestamp()) / 3600


def daily_quota(backend: Backend, requests: int = 210) -> bool:
    """Part 1: 40 a day by Pacific midnight, and 10 a (sliding) minute, through HTTP."""
    clock = FakeClock(datetime(2026, 3, 6, 23, 0, tzinfo=PACIFIC).timestamp())
    limiter = Limiter(
        backend,
        rates=[Rate(DAILY, "day", tz="America/Los_Angeles"), "10/minute"],
        clock=clock,
        sleep=clock.sleep,  # acquire "sleeps" by moving the fake clock
        margin=2 * LATENCY,  # at least how late after its slot a request may arrive
        namespace="example-daily",
    )
    limiter.reset(API_KEY)  # a Redis or SQLite store may still hold an earlier run's log

    # The API counts arrivals per Pacific day by itself, with zoneinfo alone.
    accepted: Counter[date] = Counter()
    first_arrival: dict[date, float] = {}
    refused = 0

    def upstream(request: httpx.Request) -> httpx.Response:
        nonlocal refused
        clock.advance(LATENCY)  # a request arrives a little after its slot
        arrived = datetime.fromtimestamp(clock(), PACIFIC)
        if accepted[arrived.date()] >= DAILY:
            refused += 1
            return httpx.Response(429, json={"error": "daily quota exceeded"})
        accepted[arrived.date()] += 1
        first_arrival.setdefault(arrived.date(), clock())
        return httpx.Response(200, json={"ok": True})

    window_end: dict[date, float | None] = {}  # what usage() says of each day's window
    auth = {"Authorization": f"Bearer {API_KEY}"}  # the limiter's key: the request's token
    transport = httpx.MockTransport(upstream)
    with ThrottledClient(limiter, transport=transport, base_url="https://api.example") as client:
        for i in range(requests):
            client.get(f"/v1/items/{i}", headers=auth)
            window_end[pacific(clock()).date()] = limiter.usage(API_KEY).rates[0].resets_at

    print(f"Part 1: {requests} requests at {limiter.rates[0]} and {limiter.rates[1]}")
    print("  Pacific day  accepted  hours  first arrival  usage().rates[0].resets_at")
    days = sorted(accepted)
    for day in days:
        first = pacific(first_arrival[day]).strftime("%H:%M:%S.%f")[:-3]  # to the ms
        end = window_end[day]
        resets = pacific(end).strftime("%a %d %b %H:%M %Z") if end else "-"
        print(f"  {day:%a %d %b}  {accepted[day]:>8}  {hours_in(day):>5g}  {first}   {resets}")
    print(f"  refused by the API (429): {refused}")
    # No day skipped, and every whole day full: only the first and last may be partial.
    consecutive = days == [days[0] + timedelta(days=n) for n in range(len(days))]
    return refused == 0 and consecutive and all(accepted[d] == DAILY for d in days[1:-1])


def monthly_plan(backend: Backend) -> bool:
    """Part 2: 3 a month from the 30th; each acquire takes a whole month's quota."""
    clock = FakeClock(datetime(2026, 1, 30, 9, 0, tzinfo=UTC).timestamp())
    plan = Rate(3, "month", anchor=date(2026, 1, 30))  # months in UTC unless tz= says
    limiter = Limiter(backend, rates=[plan], clock=clock, sleep=clock.sleep, namespace="plan")
    limiter.reset(API_KEY)
    print(f"Part 2: {plan}: the whole month's quota at each call (cost=3)")
    starts = []
    for _ in range(4):
        slot = limiter.acquire(API_KEY, cost=3).slot  # waits for the next month of the plan
        starts.append(datetime.fromtimestamp(slot, UTC))
        end = limiter.usage(API_KEY).rates[0].resets_at
        assert end is not None  # a calendar rate's window always ends
        resets = datetime.fromtimestamp(end, UTC)
        print(
            f"  admitted {starts[-1]:%a %d %b %H:%M}, window resets at {resets:%a %d %b %H:%M %Z}"
        )
    expected = [date(2026, 1, 30), date(2026, 2, 28), date(2026, 3, 30), date(2026, 4, 30)]
    return [start.date() for start in starts] == expected


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    store = parser.add_mutually_exclusive_group()
    store.add_argument("--redis", metavar="URL", help="keep the logs in Redis")
    store.add_argument("--sqlite", metavar="PATH", help="keep the logs in an SQLite file")
    args = parser.parse_args(argv)
    if args.redis:
        backend: Backend = RedisBackend(args.redis)
    elif args.sqlite:
        backend = SQLiteBackend(args.sqlite)
    else:
        backend = MemoryBackend()
    with backend:
        daily_ok = daily_quota(backend)
        monthly_ok = monthly_plan(backend)
    if daily_ok and monthly_ok:
        print("OK: every Pacific day got its quota from local midnight, every month from the 30th")
        return 0
    print("FAILED: " + ("the daily quota" if not daily_ok else "the monthly plan"))
    return 1


if __name__ == "__main__":
    sys.exit(main())
