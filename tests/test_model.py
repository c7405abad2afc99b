"""Every backend (memory, SQLite, Redis) and the naive model (tests/model.py) must agree.

Random sequences of clock moves and operations on a few keys are run against all
of them; every answer is compared in whole microseconds. The clock is driven in
integer microseconds, so float seconds never blur an edge of a window.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)

from throttle_client import (
    CostTooHigh,
    Decision,
    Limiter,
    MemoryBackend,
    Rate,
    RedisBackend,
    SQLiteBackend,
    ThrottleTimeout,
)
from throttle_client._backends.redis import redis_keys

from .model import Bucketed, Calendar, Model

US = 1_000_000
NAMES = ["alpha", "beta", "gamma"]
KEYS = st.sampled_from(NAMES)
PERIODS = st.one_of(
    st.sampled_from([1, 1000, 250_000, 1_000_000, 1_500_000]), st.integers(1, 2_000_000)
)
RATES = st.lists(st.tuples(st.integers(1, 5), PERIODS), min_size=1, max_size=3)
GAPS = st.one_of(st.sampled_from([0, 0, 1, 100_000, 333_333]), st.integers(0, 600_000))
# Microseconds of margin: none, the smallest, and a typical one.
MARGINS = st.sampled_from([0, 1, 25_000])
STEPS = st.one_of(st.sampled_from([0, 1, 999_999, 1_000_000]), st.integers(0, 2_500_000))


def _local(zone: str, *wall: int) -> int:
    return round(datetime(*wall, tzinfo=ZoneInfo(zone)).timestamp()) * US  # type: ignore[misc]


# Calendar rates: where the clock starts, just before a boundary that is not
# plain: both DST changes of a year, a 30-minute change, month ends, a leap day, the
# year's end; and the unit, zone and anchor day of the rate. The machine steps onto the
# windows' edges with advance_to_calendar_edge.
LA, LORD_HOWE = "America/Los_Angeles", "Australia/Lord_Howe"
CALENDAR_STARTS = [
    (_local(LA, 2026, 3, 7, 23, 59, 58), LA),  # the night before the 23-hour day
    (_local(LA, 2026, 3, 8, 1, 59, 58), LA),  # 02:00 does not exist
    (_local(LA, 2026, 10, 31, 23, 59, 58), LA),  # the 25-hour day
    (_local(LA, 2026, 11, 1, 0, 59, 58), LA),  # 01:00-02:00 comes twice
    (_local(LORD_HOWE, 2026, 4, 5, 1, 29, 58), LORD_HOWE),  # 02:00 -> 01:30
    (_local("UTC", 2026, 1, 31, 23, 59, 58), "UTC"),
    (_local("UTC", 2028, 2, 28, 23, 59, 58), "UTC"),  # a leap day
    (_local("UTC", 2026, 12, 31, 23, 59, 58), "UTC"),
    (_local("Europe/Berlin", 2027, 2, 27, 23, 59, 58), "Europe/Berlin"),
]
CALENDARS = st.one_of(
    st.none(),
    st.tuples(
        st.integers(1, 5),
        st.sampled_from(["minute", "hour", "day", "week", "month"]),
        st.sampled_from(CALENDAR_STARTS),
        st.sampled_from([1, 1, 28, 29, 30, 31]),
        st.booleans(),  # bounded: counted per window
    ),
)
# Per rate: 0, an exact sliding rate; else a bounded one in that many buckets.
BUCKETS = st.lists(st.sampled_from([0, 0, 2, 3, 10]), min_size=3, max_size=3)

_namespaces = itertools.count()


class IntClock:
    """Epoch seconds as a float, but moved in whole microseconds, so rounding is exact."""

    def __init__(self) -> None:
        self.us = 1_700_000_000 * US

    def __call__(self) -> float:
        return self.us / US


def to_us(seconds: float) -> int:
    return round(seconds * US)


def no_sleep(seconds: float) -> None:
    """The machine moves the clock itself; an acquire's sleep must not."""


class Agreement(RuleBasedStateMachine):
    def __init__(self, redis_backend: RedisBackend, sqlite_file: Path, admin: redis.Redis) -> None:
        super().__init__()
        self.redis = redis_backend
        self.sqlite_file = sqlite_file
        self.persist = admin.register_script(
            "for _, key in ipairs(KEYS) do redis.call('PERSIST', key) end"
        )
        self.last_wait = 0  # the latest retry_after / wait seen, to step exactly onto edges

    @initialize(rates=RATES, gap=GAPS, margin=MARGINS, calendar=CALENDARS, buckets=BUCKETS)
    def build(
        self, rates: list[tuple[int, int]], gap: int, margin: int, calendar: Any, buckets: list[int]
    ) -> None:
        # The limiter's margin widens every window and a non-zero gap: the model is
        # given the widened ones, so both sides must agree on exactly that arithmetic.
        # A bounded rate's buckets are of its own period (Rate.bucket_us), at most one a µs.
        buckets = [n if n <= period else 0 for n, (_, period) in zip(buckets, rates, strict=False)]
        model_rates: list[tuple[int, Any]] = [
            (limit, Bucketed(period + margin, -(-period // n)) if n else period + margin)
            for (limit, period), n in zip(rates, buckets[: len(rates)], strict=True)
        ]
        limiter_rates = [
            Rate(limit, period / US, buckets=n or None)
            for (limit, period), n in zip(rates, buckets[: len(rates)], strict=True)
        ]
        self.clock = IntClock()
        self.calendar: Calendar | None = None
        if calendar is not None:
            limit, unit, (start, zone), anchor, bounded = calendar
            rate = Rate(
                limit, unit, tz=zone, anchor=anchor if unit == "month" else None, bounded=bounded
            )
            assert rate.calendar is not None
            self.calendar = Calendar(rate.calendar.bounds, margin, bounded)
            model_rates.insert(0, (limit, self.calendar))
            limiter_rates.insert(0, rate)
            self.clock.us = start
        self.model = Model(model_rates, gap and gap + margin)
        self.margin = margin
        self.min_limit = min(limit for limit, _ in model_rates)
        options: dict[str, Any] = {
            "rates": limiter_rates,
            "min_interval": gap / US,
            "margin": margin / US,
            "clock": self.clock,
            "sleep": no_sleep,
        }
        # The shared stores get a fresh namespace per example, so no example sees the
        # keys of another (a file or a server per example would cost far more time).
        # SQLite gets a backend (a connection) per example on the one file, as memory
        # gets a store per example: a store sweeps expired keys every 1024 writes, and
        # the sweep that follows a reset reads the host's clock, not the injected one,
        # so it forgets keys the injected time still needs (a library issue: Reset
        # carries no time). No example writes 1024 times, so none sweeps.
        namespace = f"model{next(_namespaces)}"
        self.sqlite = SQLiteBackend(self.sqlite_file)
        self.limiters = {
            "memory": Limiter(MemoryBackend(), **options),
            "sqlite": Limiter(self.sqlite, namespace=namespace, **options),
            "redis": Limiter(self.redis, namespace=namespace, **options),
        }

    def teardown(self) -> None:
        if hasattr(self, "sqlite"):
            self.sqlite.close()

    def lift_ttls(self, key: str) -> None:
        """Redis expires keys by its own clock, in real time, while the injected clock
        moves only as the machine moves it: a loaded machine that took a second or two
        over a few steps let Redis drop a key that the injected time still needed (a
        pause lost). Only the algorithm is compared here (the TTLs have tests of their
        own, in test_redis_backend.py), so every write to Redis is followed by this."""
        self.persist(keys=redis_keys(self.limiters["redis"].store_key(key)))

    # -- the clock -----------------------------------------------------------------

    @rule(step=STEPS)
    def advance(self, step: int) -> None:
        self.clock.us += step

    @precondition(lambda self: self.last_wait > 0)
    @rule(offset=st.sampled_from([-1, 0, 0, 1]))
    def advance_to_edge(self, offset: int) -> None:
        """To just before, at, or just after the moment the last refusal named."""
        self.clock.us += max(0, self.last_wait + offset)
        self.last_wait = 0

    @precondition(lambda self: self.calendar is not None)
    @rule(offset=st.sampled_from(["-margin-1", "-margin", -1, 0, 0, 1]), windows=st.integers(0, 2))
    def advance_to_calendar_edge(self, offset: Any, windows: int) -> None:
        """To just before, at or just after the end of this calendar window (or a later
        one), or to where the next one starts counting (the margin before it)."""
        assert self.calendar is not None
        end = self.calendar.bounds(self.clock.us)[1]
        for _ in range(windows):
            end = self.calendar.bounds(end)[1]
        shift = {"-margin-1": -self.calendar.margin - 1, "-margin": -self.calendar.margin}
        self.clock.us = max(self.clock.us, end + shift.get(offset, offset))

    def _exits(self) -> list[int]:
        """Future moments at which some logged entry leaves some sliding window."""
        now = self.clock.us
        exits = {
            period.placed(t) + period.period if isinstance(period, Bucketed) else t + period
            for log in self.model.logs.values()
            for t, _ in log.entries
            for _, period in self.model.rates
            if not isinstance(period, Calendar)
        }
        return sorted(t for t in exits if t > now)

    @precondition(lambda self: bool(self._exits()))
    @rule(pick=st.integers(0, 10_000), offset=st.sampled_from([-1, 0, 0, 1]))
    def advance_to_window_edge(self, pick: int, offset: int) -> None:
        """To just before, at, or just after an entry leaves a window: the half-open edge."""
        exits = self._exits()
        self.clock.us = max(self.clock.us, exits[pick % len(exits)] + offset)

    # -- operations ----------------------------------------------------------------

    def _cost_or_raise(self, cost: int, call: Any) -> bool:
        """True when the cost is acceptable; else every limiter must refuse it at once."""
        if cost <= self.min_limit:
            return True
        for limiter in self.limiters.values():
            with pytest.raises(CostTooHigh):
                call(limiter)
        return False

    @rule(key=KEYS, cost=st.integers(1, 6))
    def try_acquire(self, key: str, cost: int) -> None:
        if not self._cost_or_raise(cost, lambda limiter: limiter.try_acquire(key, cost)):
            return
        expected = self.model.acquire(key, self.clock.us, cost, max_wait=0)
        for name, limiter in self.limiters.items():
            decision = limiter.try_acquire(key, cost)
            got = (
                decision.allowed,
                to_us(decision.slot),
                to_us(decision.retry_after),
                decision.remaining,
                None if decision.paused_until is None else to_us(decision.paused_until),
            )
            want = (
                expected.allowed,
                expected.slot,
                expected.retry_after,
                expected.remaining,
                expected.paused_until,
            )
            assert got == want, name
        self.lift_ttls(key)
        self.last_wait = expected.retry_after

    @rule(
        key=KEYS,
        cost=st.integers(1, 6),
        timeout=st.one_of(st.none(), st.integers(0, 3_000_000)),
    )
    def acquire(self, key: str, cost: int, timeout: int | None) -> None:
        self._acquire(key, cost, timeout)

    @precondition(lambda self: self.last_wait > 0)
    @rule(key=KEYS, offset=st.sampled_from([-1, 0, 0, 1]))
    def acquire_with_timeout_at_edge(self, key: str, offset: int) -> None:
        """A timeout just under, at, or just over the last wait seen."""
        self._acquire(key, 1, max(0, self.last_wait + offset))

    def _acquire(self, key: str, cost: int, timeout: int | None) -> None:
        seconds = None if timeout is None else timeout / US
        if not self._cost_or_raise(cost, lambda limiter: limiter.acquire(key, cost, seconds)):
            return
        expected = self.model.acquire(key, self.clock.us, cost, max_wait=timeout)
        for name, limiter in self.limiters.items():
            if expected.allowed:
                decision = limiter.acquire(key, cost, seconds)
                got = (to_us(decision.slot), to_us(decision.waited), decision.remaining)
                want = (expected.slot, expected.slot - self.clock.us, expected.remaining)
                assert got == want, name
            else:
                with pytest.raises(ThrottleTimeout) as refused:
                    limiter.acquire(key, cost, seconds)
                assert to_us(refused.value.retry_after) == expected.retry_after, name
        self.lift_ttls(key)
        self.last_wait = expected.slot - self.clock.us

    @rule(
        keys=st.lists(KEYS, min_size=1, max_size=3, unique=True),
        cost=st.integers(1, 6),
        timeout=st.one_of(st.sampled_from([0, None]), st.integers(0, 3_000_000)),
    )
    def acquire_any(self, keys: list[str], cost: int, timeout: int | None) -> None:
        """A pool's call: the key whose slot is earliest, as try_acquire_any (timeout 0)
        and acquire_any."""
        seconds = None if timeout is None else timeout / US

        def call(limiter: Any) -> Any:
            if timeout == 0:
                return limiter.try_acquire_any(keys, cost)
            return limiter.acquire_any(keys, cost, seconds)

        if not self._cost_or_raise(cost, call):
            return
        # (The stores' horizon: how long a booking still matters, the model's to tell.)
        horizon = self.limiters["memory"]._plan.quota_at(self.clock()).horizon_us
        chosen, expected = self.model.acquire_any(
            keys, self.clock.us, horizon, cost, max_wait=timeout
        )
        for name, limiter in self.limiters.items():
            if expected.allowed or timeout == 0:
                decision = call(limiter)
                got = (decision.key, decision.allowed, to_us(decision.slot), decision.remaining)
                want = (chosen, expected.allowed, expected.slot, expected.remaining)
                assert got == want, name
            else:
                with pytest.raises(ThrottleTimeout) as refused:
                    call(limiter)
                assert to_us(refused.value.retry_after) == expected.retry_after, name
        self.lift_ttls(chosen)
        self.last_wait = expected.slot - self.clock.us

    @rule(key=KEYS, duration=st.one_of(st.sampled_from([0, 1]), st.integers(0, 2_000_000)))
    def pause(self, key: str, duration: int) -> None:
        expected = self.model.pause(key, self.clock.us, duration)
        for name, limiter in self.limiters.items():
            assert to_us(limiter.pause(key, duration / US)) == expected, name
        self.lift_ttls(key)

    @rule(
        key=KEYS,
        back=st.sampled_from([0, 1, 30_000, 500_000, 4_999_999, 5_000_000, 6_000_000]),
        remaining=st.integers(0, 4),
        reset=st.sampled_from([1, 250_000, 1_000_000, 2_500_000]),
    )
    def learn(self, key: str, back: int, remaining: int, reset: int) -> None:
        """Headers of a response to a call whose slot was ``back`` µs ago said
        ``remaining`` more before ``reset`` µs from now. The limiter keeps it when it is
        stricter than its rates could be (usage().upstream says which): so does the model."""
        now = self.clock.us
        headers = {
            "X-RateLimit-Remaining": str(remaining),
            "X-RateLimit-Reset": f"{reset / US:.6f}",
        }
        stricter = set()
        for limiter in self.limiters.values():
            decision = Decision(
                allowed=True,
                retry_after=0.0,
                waited=0.0,
                slot=(now - back) / US,
                cost=1,
                remaining=(0,) * len(limiter.rates),
                rates=limiter.rates,
                paused_until=None,
            )
            view = limiter.learn(key, decision, headers)
            assert view is not None and view.remaining == remaining
            upstream = limiter.usage(key).upstream
            assert upstream is not None
            stricter.add(upstream.stricter)
        assert len(stricter) == 1  # every limiter judged alike
        if stricter.pop():
            slot = round((now - back) / US * US)  # as the Decision's float seconds carry it
            self.model.learn(key, now, slot - self.margin, now + reset, remaining + 1)
        self.lift_ttls(key)

    @rule(key=KEYS)
    def reset(self, key: str) -> None:
        self.model.reset(key)
        for limiter in self.limiters.values():
            limiter.reset(key)

    @rule(key=KEYS)
    def usage(self, key: str) -> None:
        expected = self.model.usage(key, self.clock.us)
        for name, limiter in self.limiters.items():
            usage = limiter.usage(key)
            got = (
                tuple(r.used for r in usage.rates),
                {r.booked for r in usage.rates},
                tuple(r.remaining for r in usage.rates),
                tuple(to_us(r.resets_in) for r in usage.rates),
                to_us(usage.next_slot_in),
                to_us(usage.paused_for),
                None
                if usage.learned is None
                else (usage.learned.limit, usage.learned.used, to_us(usage.learned.resets_at)),
            )
            want = (
                expected.used,
                {expected.booked},
                expected.remaining,
                expected.resets_in,
                expected.next_slot_in,
                expected.paused_for,
                self.model.learned(key, self.clock.us),
            )
            assert got == want, name
        self.last_wait = expected.next_slot_in


def test_model_and_every_backend_agree(redis_url: str, tmp_path: Path) -> None:
    redis_backend = RedisBackend(redis_url)
    admin = redis.Redis.from_url(redis_url)
    try:
        run_state_machine_as_test(
            lambda: Agreement(redis_backend, tmp_path / "model.db", admin),
            settings=settings(
                max_examples=150,
                stateful_step_count=50,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    finally:
        redis_backend.close()
        admin.close()


def test_model_follows_the_design_on_a_worked_example() -> None:
    """The model itself, against numbers worked out by hand from the semantics."""
    model = Model([(2, 1_000_000), (3, 10_000_000)], min_interval=100_000)
    assert model.acquire("k", 0, max_wait=0).slot == 0
    assert model.acquire("k", 0, max_wait=0).retry_after == 100_000  # the gap
    assert model.acquire("k", 100_000).slot == 100_000
    # 2/second is full until the entry at 0 leaves (0, 1s]; then 3/10s is full.
    assert model.acquire("k", 100_000, max_wait=0).slot == 1_000_000
    assert model.acquire("k", 100_000).slot == 1_000_000
    assert model.acquire("k", 100_000, max_wait=0).slot == 10_000_000
    usage = model.usage("k", 100_000)
    assert (usage.used, usage.booked) == ((2, 2), 1)  # the slot at 1 s is booked, not used
    assert usage.remaining == (0, 0) and usage.resets_in == (1_000_000, 9_900_000)


def test_hypothesis_keeps_its_files_in_the_pytest_cache(tmp_path: Path) -> None:
    """A test run leaves no .hypothesis/ in the working directory (tests/conftest.py)."""
    tests = Path(__file__).resolve().parent
    env = {k: v for k, v in os.environ.items() if k != "HYPOTHESIS_STORAGE_DIRECTORY"}
    cache = tmp_path / "cache"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-o", f"cache_dir={cache}",
         str(tests / "test_feedback.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert not (tmp_path / ".hypothesis").exists()
    assert (cache / "d" / "hypothesis").is_dir()
