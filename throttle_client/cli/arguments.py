"""The command line's grammar: the parser of every subcommand, the type that checks each
argument, the exit statuses, and the keys and the store that the arguments name.

A bad argument ends in one line that names it, and exit status 2 (``EXIT_USAGE``):
argparse's own errors through :class:`_Parser`, the ones found after parsing (an
empty environment variable, a store that is not there) as :class:`UsageError`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any, NoReturn
from urllib.parse import urlsplit, urlunsplit

from throttle_client import Backend, ConfigurationError, Rate, RedisBackend, SQLiteBackend

from . import demo as _demo
from . import top as _top

PROG = "throttle-client"
# Where the library reads its key secret when none is given (docs/concepts.md, "Keys and
# hashing"): status and reset hash keys with it, as every worker's limiter does.
SECRET_ENV = "THROTTLE_CLIENT_KEY_SECRET"
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_STORE, EXIT_STORE_ERROR = 0, 1, 2, 3, 4


def _store_arguments(parser: argparse.ArgumentParser) -> None:
    """--redis URL | --sqlite PATH (one of them), and --cluster."""
    store = parser.add_mutually_exclusive_group(required=True)
    store.add_argument("--redis", metavar="URL", help="the Redis the limiters use")
    store.add_argument("--sqlite", metavar="PATH", help="the SQLite file the limiters use")
    parser.add_argument(
        "--cluster", action="store_true", help="the Redis URL is a node of a Redis Cluster"
    )


class UsageError(Exception):
    """A bad argument found after parsing (exit 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, not argparse's usage block: the message already names the bad value.
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


# -- argument types: each names the bad value -------------------------------------------------


def _rate(text: str) -> Rate:
    try:
        return Rate.parse(text)
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 256:
        raise argparse.ArgumentTypeError(f"expected a whole number from 1 to 256, not {text!r}")
    return value


def _positive(text: str) -> int:
    """A whole number >= 1, of any size."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a whole number >= 1 is needed, not {text!r}")
    return value


def _seconds(low: float, *, inclusive: bool) -> Any:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        ok = math.isfinite(value) and (value >= low if inclusive else value > low)
        if not ok:
            bound = f">= {low:g}" if inclusive else f"> {low:g}"
            raise argparse.ArgumentTypeError(f"expected seconds {bound}, not {text!r}")
        return value

    return parse


def redact(url: str) -> str:
    """The URL without its password, fit for an error message."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        netloc = parts.netloc.rpartition("@")[2]
        user = f"{parts.username}:***@" if parts.username else ":***@"
        return urlunsplit(parts._replace(netloc=user + netloc))
    except ValueError:
        return "<unparsable URL>"


# -- the parser ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Client-side throttling shared by many workers: a live demo, and a look at "
        "(or reset of) a key's limits in Redis or SQLite.",
        epilog="Exit status: 0 success; 1 the demo saw a rejected request or a crawler failed; "
        "2 bad arguments; 3 the store could not be reached; 4 the store answered with an error "
        "(a damaged key, a wrong password or permission, a file that is not a database).",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True

    demo = commands.add_parser(
        "demo",
        help="crawler processes share one quota against a strict local API",
        description="Start a local API that enforces a per-token quota by the arrival time "
        "of each request and answers 429 beyond it, then crawler processes that fetch from it "
        "through ThrottledTransport, sharing their limits through an SQLite file (default) or "
        "Redis. Shows them live, then a summary: requests, 429s, utilisation of the quota "
        "(admitted / the most the quota allows in the time), the fullest window. Exits 0 only "
        "if no request was rejected.",
    )
    demo.add_argument(
        "--workers",
        type=_count,
        default=_demo.DEFAULT_WORKERS,
        help="crawler processes (default %(default)s)",
    )
    demo.add_argument(
        "--tokens",
        type=_count,
        default=_demo.DEFAULT_TOKENS,
        help="access tokens, each with its own quota (default %(default)s)",
    )
    demo.add_argument(
        "--duration",
        type=_seconds(0, inclusive=False),
        default=_demo.DEFAULT_DURATION,
        metavar="SECONDS",
        help="how long the crawlers fetch (default %(default)s)",
    )
    demo.add_argument(
        "--rate",
        type=_rate,
        action="append",
        metavar="RATE",
        help="the per-token quota, repeatable, e.g. '20/second' (default: "
        + " and ".join(_demo.DEFAULT_RATES)
        + ")",
    )
    demo.add_argument(
        "--min-interval",
        type=_seconds(0, inclusive=True),
        default=_demo.DEFAULT_MIN_INTERVAL,
        metavar="SECONDS",
        help="least time between two calls of a token (default %(default)s)",
    )
    demo.add_argument(
        "--tolerance",
        type=_seconds(0, inclusive=True),
        default=_demo.DEFAULT_TOLERANCE,
        metavar="SECONDS",
        help="how early an arrival the upstream forgives (default %(default)s: none, "
        "as a provider counts)",
    )
    demo.add_argument(
        "--margin",
        type=_seconds(0, inclusive=True),
        default=_demo.DEFAULT_MARGIN,
        metavar="SECONDS",
        help="the limiters' margin: how much after its slot a request may arrive "
        "(default %(default)s)",
    )
    demo.add_argument(
        "--redis",
        metavar="URL",
        help="share limits through this Redis instead of a temporary SQLite file",
    )
    demo.add_argument(
        "--json", action="store_true", help="print the summary as one JSON object, no live display"
    )
    demo.add_argument(
        "--plot",
        metavar="PATH",
        help="draw the quota, by slot and by arrival, into this image (.png, .svg, .pdf); "
        "needs matplotlib (the plot extra)",
    )

    top = commands.add_parser(
        "top",
        help="the keys in use, nearest their limits first, redrawn live",
        description="The keys in use in a store, nearest their limits first: label, per rate "
        "used + booked of the limit, calls booked ahead, a pause in force, in-flight calls of "
        "a capped key. It reads each key's card (the record of its label and rules that the "
        "limiters using it keep in the store beside the key) with SCAN in steps of bounded "
        "cost, never KEYS, on a Redis Cluster too, and changes nothing.",
    )
    _store_arguments(top)
    top.add_argument("--namespace", help="only the keys of this namespace (default: all)")
    top.add_argument("--json", action="store_true", help="print one look as JSON, and stop")
    top.add_argument(
        "--rows", type=_positive, default=20, metavar="N", help="keys shown (default %(default)s)"
    )
    top.add_argument(
        "--interval",
        type=_seconds(0.1, inclusive=True),
        default=2.0,
        metavar="SECONDS",
        help="seconds between looks (default %(default)s)",
    )
    top.add_argument(
        "--scan-limit",
        type=_positive,
        default=_top.SCAN_LIMIT,
        metavar="N",
        help="the most keys read per look (default %(default)s)",
    )
    top.add_argument(
        "--iterations", type=_positive, metavar="N", help="stop after N looks (default: Ctrl-C)"
    )

    for name, summary in (
        ("status", "per rate, used, booked ahead and remaining; the next free slot; any pause"),
        ("reset", "forget everything about the keys"),
        ("history", "the calls admitted and their cost per hour, day and month"),
    ):
        sub = commands.add_parser(
            name,
            help=summary,
            description=f"{summary[0].upper()}{summary[1:]}. Keys are hashed with the namespace "
            f"and the secret in ${SECRET_ENV} (if set) exactly as the library hashes them. "
            "To keep tokens out of shell history, pass '-' to read keys from standard input "
            "(one per line) or --key-env NAME to read one from an environment variable.",
        )
        _store_arguments(sub)
        sub.add_argument(
            "--namespace", default="default", help="the limiter's namespace (default %(default)s)"
        )
        sub.add_argument(
            "--tag",
            metavar="VALUE",
            help="the tag the limiter gives these keys (tag=, for stacked calls on a Cluster)",
        )
        sub.add_argument(
            "--key-env",
            action="append",
            default=[],
            metavar="NAME",
            help="read a key from this environment variable (repeatable)",
        )
        if name == "status":
            sub.add_argument(
                "--rate",
                type=_rate,
                action="append",
                metavar="RATE",
                help="the limiter's rates, repeatable, e.g. '5000/hour' (by default those "
                "of the key's card: the record of its label and rules that its limiters "
                "keep in the store beside it)",
            )
            sub.add_argument(
                "--min-interval",
                type=_seconds(0, inclusive=True),
                metavar="SECONDS",
                help="the limiter's minimum interval (with --rate; default 0)",
            )
            sub.add_argument(
                "--margin",
                type=_seconds(0, inclusive=True),
                metavar="SECONDS",
                help=f"the limiter's margin (with --rate; default {_demo.DEFAULT_MARGIN}): "
                "it widens the windows",
            )
            sub.add_argument("--json", action="store_true", help="print one JSON object")
        if name == "history":
            sub.add_argument("--json", action="store_true", help="print one JSON object")
        sub.add_argument("keys", nargs="*", metavar="KEY", help="keys (access tokens), or '-'")
    return parser


# -- what the arguments name --------------------------------------------------------------


def read_keys(args: argparse.Namespace) -> list[str]:
    """The keys given as KEY..., on standard input ('-', one a line) and by --key-env."""
    keys: list[str] = []
    for key in args.keys:
        if key == "-":
            keys += [line.strip() for line in sys.stdin if line.strip()]
        else:
            keys.append(key)
    for name in args.key_env:
        value = os.environ.get(name, "").strip()
        if not value:
            raise UsageError(f"environment variable {name} is not set or empty")
        keys.append(value)
    if not keys:
        raise UsageError("no keys given: pass KEY..., '-' for standard input, or --key-env NAME")
    return keys


def open_store(args: argparse.Namespace) -> Backend:
    """The store of --redis or --sqlite. A missing SQLite file is a bad argument: opening
    it would create an empty store, and show every key unused."""
    if args.cluster and args.redis is None:
        raise UsageError("--cluster goes with --redis URL")
    if args.redis is not None:
        try:
            return RedisBackend(args.redis, cluster=args.cluster)
        except ValueError as exc:
            raise UsageError(f"bad Redis URL {redact(args.redis)!r}: {exc}") from None
    if not os.path.isfile(args.sqlite):
        raise UsageError(f"no SQLite store at {args.sqlite!r}")
    return SQLiteBackend(args.sqlite)
