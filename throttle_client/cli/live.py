"""The demo's live view: a table redrawn in the terminal while the crawlers run.

It needs rich, which the ``cli`` extra installs (``pip install 'throttle-client[cli]'``);
the command imports this module in one place and, without rich, prints plain progress
lines instead (:class:`~throttle_client.cli.demo.ProgressLines`).
"""

from __future__ import annotations

import time

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from . import demo
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
