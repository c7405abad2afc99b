"""How a demo run is judged: the most calls its quota allows, the fullest window of its
slots and of its arrivals, and the summary the command prints (``--json``).

The most calls a quota allows in a span is counted with the library's own algorithm,
on a clock of its own: no schedule of the same calls could do better.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from itertools import pairwise
from typing import TYPE_CHECKING, Any

from throttle_client import Limiter, MemoryBackend, Rate

if TYPE_CHECKING:
    from .settings import DemoConfig


class _Timeline:
    """Time that moves only when the limiter sleeps: a schedule is counted, not waited for."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def most_calls(rates: Sequence[Rate], min_interval: float, span: float) -> int:
    """The most calls the quota admits in a closed span of ``span`` seconds: the library's
    own earliest-slot schedule from an empty log, on a clock of its own (no schedule of
    the same calls places its k-th call earlier)."""
    clock = _Timeline()
    limiter = Limiter(
        MemoryBackend(),
        rates=list(rates),
        min_interval=min_interval,
        margin=0,  # the quota exactly as the upstream counts it
        clock=clock,
        sleep=clock.sleep,
    )
    count = 0
    while limiter.acquire("k").slot <= span + 1e-6:  # slots are whole µs: allow rounding
        count += 1
    return count


def fullest_window(slots: Sequence[float], period: float) -> int:
    """The most slots in any half-open window ``(t - period, t]`` (``slots`` sorted)."""
    return max(
        (bisect_right(slots, t) - bisect_right(slots, t - period + 1e-7) for t in slots),
        default=0,
    )


def judge(
    config: DemoConfig,
    slots: dict[int, list[float]],
    upstream: dict[str, Any],
    tokens: Sequence[str],
    elapsed: float,
) -> dict[str, Any]:
    """The summary of a run, as ``--json`` prints it."""
    per_token = []
    admitted_total = possible_total = 0
    for number, token in enumerate(tokens):
        mine = sorted(slots.get(number, []))
        admitted = int(upstream["per_token"].get(token, 0))
        span = mine[-1] - mine[0] if mine else 0.0
        possible = most_calls(config.rates, config.min_interval, span) if mine else 0
        admitted_total += admitted
        possible_total += possible
        per_token.append(
            {"token": f"token {number + 1}", "admitted": admitted, "possible": possible,
             "span": round(span, 3)}
        )  # fmt: skip
    all_slots = [sorted(slots.get(number, [])) for number in range(len(tokens))]
    arrivals = [sorted(upstream.get("arrivals", {}).get(token, [])) for token in tokens]
    peaks = {
        str(rate): {
            "limit": rate.limit,
            "by_slot": max((fullest_window(s, rate.period) for s in all_slots), default=0),
            # Exact windows: an arrival jitter of a microsecond can show limit + 1 here.
            "by_arrival": max((fullest_window(a, rate.period) for a in arrivals), default=0),
            # As the upstream judges: windows shortened by the tolerance.
            "by_arrival_within_tolerance": max(
                (fullest_window(a, rate.period - config.tolerance) for a in arrivals), default=0
            ),
        }
        for rate in config.rates
    }
    slot_gaps = [b - a for s in all_slots for a, b in pairwise(s)]
    admitted = sum(int(upstream["per_token"].get(token, 0)) for token in tokens)
    return {
        "requests": admitted + int(upstream["rejected"]),
        "admitted": admitted,
        "rejected": int(upstream["rejected"]),
        "utilisation": round(admitted_total / possible_total, 4) if possible_total else 0.0,
        "possible": possible_total,
        "peak_in_window": peaks,
        "min_gap": {
            "limit": config.min_interval,
            "by_arrival": upstream["min_gap"],
            "by_slot": round(min(slot_gaps), 6) if slot_gaps else None,
        },
        "per_token": per_token,
        "workers": config.workers,
        "tokens": len(tokens),
        "duration": config.duration,
        "elapsed": round(elapsed, 3),
        "rates": [str(rate) for rate in config.rates],
        "min_interval": config.min_interval,
        "margin": config.margin,
        "tolerance": config.tolerance,
        "store": "redis" if config.redis_url else "sqlite",
    }
