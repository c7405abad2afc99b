"""The live views of the command: the demo's table, redrawn in the terminal while the
crawlers run, and ``top``'s.

It needs rich, which the ``cli`` extra installs (``pip install 'throttle-client[cli]'``);
the command imports this module in one place and, without rich, prints plain progress
lines instead (:class:`~throttle_client.cli.summary.ProgressLines`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from . import demo, top
from .demo import DemoConfig, DemoRun


def run_live(config: DemoConfig) -> DemoRun:
    """Run the demo with :func:`live_view` redrawn about four times a second."""
    starting = f"starting the upstream API and {config.workers} crawler processes..."
    with Live(starting, console=Console(), refresh_per_second=4) as display:
        return demo.run_demo(config, watch=lambda run: display.update(live_view(run)))


def live_view(run: DemoRun) -> Group:
    """A rich renderable of the run so far: per token, what was sent, admitted, refused,
    who is waiting, and the quota as the store sees it: used (slots up to now, never
    over the limit) and booked (slots ahead, held by the waiting crawlers)."""
    config = run.config
    table = Table(
        title=f"{config.workers} crawler processes sharing {demo.describe_quota(config)}",
        title_justify="left",
    )
    for name in ("token", "sent", "admitted", "429s", "waiting", "booked"):
        table.add_column(name, justify="left" if name == "token" else "right")
    for rate in config.rates:
        table.add_column(f"used of {rate}", justify="right")
    table.add_column("next slot in", justify="right")
    for number, token in enumerate(run.tokens):
        sent, ok, refused, waiting = run.counts(number)
        usage = run.limiter.usage(token)
        table.add_row(
            f"token {number + 1}",
            str(sent),
            str(ok),
            Text(str(refused), style="bold red" if refused else "green"),
            str(waiting),
            str(usage.rates[0].booked),
            *(f"{r.used}/{r.rate.limit}" for r in usage.rates),
            f"{usage.next_slot_in:.3f} s",
        )
    elapsed = time.monotonic() - run.started if run.started else 0.0
    rejected = int(run.upstream_stats.get("rejected", 0))
    per_token = run.upstream_stats.get("per_token", {})
    admitted = sum(int(per_token.get(token, 0)) for token in run.tokens)
    footer = Text(
        f"{min(elapsed, config.duration):4.1f} / {config.duration:g} s   store: {run.store.name}"
        f"   upstream: {admitted} admitted, {rejected} refused (429)"
    )
    return Group(table, footer)


def watch_top(
    look: Callable[[], top.Look], interval: float, iterations: int | None, rows: int
) -> None:
    """``throttle-client top``'s live view: :func:`top_view` of a new look every
    ``interval`` seconds, until Ctrl-C (or ``iterations`` looks)."""
    looks = 0
    with Live(top_view(look(), rows), console=Console(), auto_refresh=False) as display:
        try:
            while iterations is None or (looks := looks + 1) < iterations:
                time.sleep(interval)
                display.update(top_view(look(), rows), refresh=True)
        except KeyboardInterrupt:
            pass


def top_view(view: top.Look, rows: int) -> Group:
    """A rich renderable of one look: the fullest ``rows`` keys."""
    table = Table(title="keys nearest their limits", title_justify="left")
    for name in (
        "label",
        "namespace",
        "full",
        "paused",
        "429s",
        "ahead",
        "per rate: used + booked",
    ):
        table.add_column(name, justify="left" if name in ("label", "namespace") else "right")
    table.add_column("in flight", justify="right")
    for row in view.keys[:rows]:
        style = "bold red" if row.paused_for or row.fullness >= 1 else ""
        table.add_row(
            row.label,
            row.namespace,
            Text(f"{row.fullness:.0%}", style=style),
            f"{row.paused_for:.1f} s" + (f" ({row.reason})" if row.reason else "")
            if row.paused_for
            else "-",
            Text(str(row.refused), style="bold red" if row.refused else ""),
            str(row.booked),
            "  ".join(f"{r.used}+{r.booked}/{r.limit} per {r.rate}" for r in row.rates)
            + ("" if row.learned is None else f"  learned {row.learned[0]}/{row.learned[1]}"),
            f"{row.in_flight}/{row.max_concurrent} ({row.waiting} queued)"
            if row.max_concurrent
            else "-",
        )
    return Group(table, Text(top.footer(view, rows)))
