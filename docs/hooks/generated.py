"""MkDocs hook: the parts of the reference read from the code when the site is built,
so that they cannot drift from it: the command's --help, and the valid ranges."""

from __future__ import annotations

import argparse
import inspect
from typing import Any

from throttle_client import Limiter, _ranges
from throttle_client.cli.arguments import build_parser


def _command_help() -> str:
    parser = build_parser()
    parts = ["## throttle-client", "", "```text", parser.format_help().rstrip(), "```"]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                parts += ["", f"## throttle-client {name}", "", "```text"]
                parts += [sub.format_help().rstrip(), "```"]
    return "\n".join(parts)


def _ranges_table() -> str:
    rows = [
        ("a rate's limit (so a cost)", f"1 to {_ranges.MAX_LIMIT:,} units"),
        ("a rate's period", f"1 µs to {_ranges.MAX_SECONDS:,.0f} s (10 years)"),
        ("the minimum interval, the margin, a pause", f"0 to {_ranges.MAX_SECONDS:,.0f} s"),
        ("a timeout", "0 or more (None: no limit); no slot is booked over 10 years ahead"),
        ("rates per limiter", f"1 to {_ranges.MAX_RATES}"),
        ("the margin", "below the shortest period, and below the minimum interval if any"),
        ("max_concurrent", f"1 to {_ranges.MAX_CONCURRENT:,}"),
        ("a key's running total of admitted units", f"below {_ranges.MAX_TOTAL:,} (2**48)"),
    ]
    lines = ["| value | valid range |", "|---|---|"]
    lines += [f"| {what} | {valid} |" for what, valid in rows]
    return "\n".join(lines)


# What each of the limiter's arguments does, in a line; the names and defaults are read
# from the signature, and an argument missing here fails the build.
_OPTIONS = {
    "backend": "the store the fleet shares: `RedisBackend`, `SQLiteBackend`, `MemoryBackend`",
    "rates": "one or more rates: `Rate`s or strings (`'5000/hour'`, `'5000/hour; 10/second'`)",
    "min_interval": "the least time between two calls of a key (seconds or a `timedelta`)",
    "margin": "how late after its slot a request may reach the upstream; widens windows and gap",
    "namespace": "whose quota the keys are: limiters of one store and namespace share keys",
    "key_secret": "hashes the keys (else `$THROTTLE_CLIENT_KEY_SECRET`, else a fixed one)",
    "tag": "on a Redis Cluster, a function of a key naming the hash slot of one call's keys",
    "clock": "for tests: the time in epoch seconds (Redis then follows it, not its own `TIME`)",
    "sleep": "for tests: how to sleep (`FakeClock.sleep`)",
    "on_unavailable": "the store out of reach: `'raise'`, `'allow'` or `LocalFallback(...)`",
    "retry_for": "how long to retry a store out of reach before `on_unavailable` applies",
    "max_concurrent": "the most calls of a key in flight at once, fleet-wide (calls hold a lease)",
    "lease_ttl": "how soon the lease of a holder that died frees its place (30 s if not given)",
    "label": "a function of a key: what operators see instead of it (events, metrics, `top`)",
    "history": "count each key's calls per hour, day and month (`True`, or a `History`)",
    "low_priority_patience": "the longest a low-priority call lets the usual ones go first",
}


def _options_table() -> str:
    lines = ["| argument | default | what it does |", "|---|---|---|"]
    for name, parameter in inspect.signature(Limiter.__init__).parameters.items():
        if name == "self":
            continue
        if name not in _OPTIONS:
            raise KeyError(f"Limiter's argument {name!r} has no line in docs/hooks/generated.py")
        default = "required" if parameter.default is parameter.empty else f"`{parameter.default!r}`"
        lines.append(f"| `{name}` | {default} | {_OPTIONS[name]} |")
    return "\n".join(lines)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if "<!-- command-help -->" in markdown:
        markdown = markdown.replace("<!-- command-help -->", _command_help())
    if "<!-- limiter-options -->" in markdown:
        markdown = markdown.replace("<!-- limiter-options -->", _options_table())
    if "<!-- ranges -->" in markdown:
        markdown = markdown.replace("<!-- ranges -->", _ranges_table())
    return markdown
