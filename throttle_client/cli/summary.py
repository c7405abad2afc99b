"""What the user reads of a demo run: its quota in words, a progress line about once a
second, and the summary at the end; and the library's log lines kept off the terminal.

The live view, redrawn with rich, is :mod:`.live`'s; these are the plain lines a log,
a pipe or a terminal without rich gets.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from .settings import DemoConfig, DemoRun


def quiet() -> None:
    """Keep the library's log lines (a store unavailable, an upstream 429) off the terminal:
    the command reports failures itself, and they would garble the live display."""
    logging.getLogger("throttle_client").setLevel(logging.ERROR)


def describe_quota(config: DemoConfig) -> str:
    rates = " and ".join(str(rate) for rate in config.rates)
    return f"{rates} per token, calls at least {config.min_interval:g} s apart"


def progress_line(run: DemoRun, elapsed: float) -> str:
    """One plain line of the run so far, for a terminal without the live view or a log."""
    counts = [run.counts(number) for number in range(len(run.tokens))]
    sent, ok, refused, waiting = (sum(column) for column in zip(*counts, strict=True))
    return (
        f"{min(elapsed, run.config.duration):5.1f} / {run.config.duration:g} s   "
        f"sent {sent}, admitted {ok}, 429s {refused}, crawlers waiting for a slot {waiting}"
    )


class ProgressLines:
    """A ``watch`` for :func:`~.demo.run_demo` that writes a :func:`progress_line` about once a
    second (it is called four times as often): lines that read as well in a log or a
    pipe as on a terminal, where a redrawn view would need rich."""

    def __init__(self, out: TextIO, *, every: float = 1.0) -> None:
        self._out = out
        self._every = every
        self._next = every

    def __call__(self, run: DemoRun) -> None:
        elapsed = time.monotonic() - run.started if run.started else 0.0
        if elapsed < self._next:
            return
        self._next = (elapsed // self._every + 1) * self._every
        print(progress_line(run, elapsed), file=self._out, flush=True)


def summary_text(summary: dict[str, Any], errors: Sequence[str]) -> str:
    by_slot = ", ".join(
        f"{p['by_slot']} in {rate} (limit {p['limit']})"
        for rate, p in summary["peak_in_window"].items()
    )
    by_arrival = ", ".join(
        f"{p['by_arrival']} in {rate} ({p['by_arrival_within_tolerance']} within the tolerance)"
        for rate, p in summary["peak_in_window"].items()
    )
    gap = summary["min_gap"]
    closest = (
        "-"
        if gap["by_slot"] is None
        else f"{gap['by_arrival']:.4f} s by arrival, {gap['by_slot']:.4f} s by slot "
        f"(at least {gap['limit']:g} s)"
    )
    rates = " and ".join(summary["rates"])
    lines = [
        f"throttle-client demo: {summary['workers']} crawler processes, {summary['tokens']} "
        f"tokens, {summary['elapsed']:.1f} s, limits shared through {summary['store']}",
        f"  quota per token      {rates}, calls at least {summary['min_interval']:g} s apart",
        f"  requests             {summary['requests']}",
        f"  429s received        {summary['rejected']}",
        f"  utilisation          {summary['utilisation']:.1%}  ({summary['admitted']} admitted of "
        f"the {summary['possible']} the quota allows between each token's first and last slot)",
        f"  fullest window       by slot: {by_slot}",
        f"                       by arrival: {by_arrival}",
        f"  closest two calls    {closest}",
        "",
        "  The limiter hands out slots within the exact quota (the 'by slot' figures), its",
        f"  windows and gap widened by margin={summary['margin']:g} s: a request reaches the "
        "upstream a",
        "  little after its slot, by a delay that varies, and the upstream counts arrivals"
        + (
            f" (forgiving one up to {summary['tolerance']:g} s early)."
            if summary["tolerance"]
            else ", exactly."
        ),
    ]
    lines += [f"  error: {error.splitlines()[-1]}" for error in errors]
    if summary["rejected"] == 0 and not errors:
        lines.append("OK: no request was rejected.")
    else:
        lines.append(f"FAILED: {summary['rejected']} requests rejected, {len(errors)} errors.")
    return "\n".join(lines)
