"""The ``throttle-client`` command: ``demo``, ``status KEY...``, ``reset KEY...``.

Every failure the user can cause or meet (a bad rate, a bad URL, a store that does
not answer) ends in one line on stderr and a non-zero exit status, never a
traceback. Keys are access tokens: they are never printed; they may come from an
environment variable or standard input so they stay out of shell history.

``demo`` shows a live view on a terminal when rich is installed (the ``cli`` extra);
otherwise, or when its output is not a terminal, a plain progress line on stderr about
once a second; ``--json`` prints only the summary, as one JSON object.

Exit status: 0 success; 1 the demo saw a rejected request or a crawler failed;
2 bad arguments; 3 the store could not be reached (BackendUnavailable); 4 the store
answered with an error that waiting will not mend (BackendError: a damaged key, a wrong
password or a missing permission, a file that is not a database).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit, urlunsplit

from throttle_client import (
    Backend,
    BackendError,
    BackendUnavailable,
    Card,
    ConfigurationError,
    History,
    Limiter,
    Rate,
    RedisBackend,
    SQLiteBackend,
    ThrottleError,
    store_key,
)

from . import demo as _demo
from . import top as _top

PROG = "throttle-client"
# Where the library reads its key secret when none is given (README, "Tokens are
# secrets"): status and reset hash keys with it, as every worker's limiter does.
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


class _UsageError(Exception):
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


def _redact(url: str) -> str:
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
        "a capped key. It reads each key's card (kept in the store beside the key by the "
        "limiters that use it) with SCAN in steps of bounded cost, never KEYS, on a Redis "
        "Cluster too, and changes nothing.",
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
                "of the key's card, which its limiters keep in the store)",
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


# -- commands ----------------------------------------------------------------------------------


def _keys(args: argparse.Namespace) -> list[str]:
    keys: list[str] = []
    for key in args.keys:
        if key == "-":
            keys += [line.strip() for line in sys.stdin if line.strip()]
        else:
            keys.append(key)
    for name in args.key_env:
        value = os.environ.get(name, "").strip()
        if not value:
            raise _UsageError(f"environment variable {name} is not set or empty")
        keys.append(value)
    if not keys:
        raise _UsageError("no keys given: pass KEY..., '-' for standard input, or --key-env NAME")
    return keys


def _open_store(args: argparse.Namespace) -> Backend:
    if args.cluster and args.redis is None:
        raise _UsageError("--cluster goes with --redis URL")
    if args.redis is not None:
        try:
            return RedisBackend(args.redis, cluster=args.cluster)
        except ValueError as exc:
            raise _UsageError(f"bad Redis URL {_redact(args.redis)!r}: {exc}") from None
    if not os.path.isfile(args.sqlite):
        raise _UsageError(f"no SQLite store at {args.sqlite!r}")
    return SQLiteBackend(args.sqlite)


def _label(number: int, hashed: str) -> dict[str, str]:
    # Never the key itself: it is an access token. Its store key is safe to show.
    return {"key": f"key {number}", "store_key": hashed}


def cmd_status(args: argparse.Namespace) -> int:
    if args.rate is None and (args.min_interval is not None or args.margin is not None):
        raise _UsageError(
            "--min-interval and --margin go with --rate: without it, the card's rules apply"
        )
    keys = _keys(args)
    tag = None if args.tag is None else (lambda _key: args.tag)
    with _open_store(args) as backend:
        hashed = [store_key(key, namespace=args.namespace, tag=args.tag) for key in keys]
        # Each key's card: the label and the rules its limiters gave it.
        cards = {k: Card.parse(text) for k, text in backend.cards(hashed).items()}
        usages = []
        for number, (key, hashed_key) in enumerate(zip(keys, hashed, strict=True), 1):
            card = cards.get(hashed_key)
            rules: tuple[list[Any], float, float, int | None]
            if args.rate is not None:
                gap = 0.0 if args.min_interval is None else args.min_interval
                margin = _demo.DEFAULT_MARGIN if args.margin is None else args.margin
                rules = (args.rate, gap, margin, None)
            elif card is not None:
                rules = (list(card.rates), card.min_interval, card.margin, card.max_concurrent)
            else:
                raise _UsageError(
                    f"key {number} has no card in the store that this version can read: "
                    "no limiter used it within its longest window (is --namespace right? "
                    f"the key secret in ${SECRET_ENV}?), or its card is damaged; pass its "
                    "rates with --rate"
                )
            rates, gap, margin, cap = rules
            limiter = Limiter(
                backend,
                rates=rates,
                min_interval=gap,
                margin=margin,
                namespace=args.namespace,
                tag=tag,
                max_concurrent=cap,
            )
            usages.append(limiter.usage(key))
    report: list[dict[str, Any]] = []
    for number, (hashed_key, usage) in enumerate(zip(hashed, usages, strict=True), 1):
        card = cards.get(hashed_key)
        report.append(
            {
                **_label(number, hashed_key),
                "label": None if card is None else card.label,
                "rates": [
                    {
                        "rate": str(r.rate),
                        "used": r.used,
                        "booked": r.booked,
                        "remaining": r.remaining,
                        "resets_in": round(r.resets_in, 6),
                        "resets_at": r.resets_at,  # a calendar rate: its window's end
                    }
                    for r in usage.rates
                ],
                "next_slot_in": round(usage.next_slot_in, 6),
                "paused_for": round(usage.paused_for, 6),
                "paused_until": usage.paused_until,
                "in_flight": usage.in_flight,  # a capped key: calls in flight, queued
                "waiting": usage.waiting,
                "learned": None
                if usage.learned is None
                else {
                    "limit": usage.learned.limit,
                    "used": usage.learned.used,
                    "resets_at": usage.learned.resets_at,
                },
            }
        )
    if args.json:
        print(json.dumps({"namespace": args.namespace, "keys": report}))
        return EXIT_OK
    for entry in report:
        label = "" if entry["label"] is None else f", label {entry['label']!r}"
        print(f"{entry['key']}  (store key {entry['store_key']}{label})")
        width = max(14, *(len(r["rate"]) for r in entry["rates"]))  # (one column of rates)
        for r in entry["rates"]:
            wait = f", a call can go in {r['resets_in']:.3f} s" if r["resets_in"] else ""
            counts = f"used {r['used']}, booked {r['booked']}, remaining {r['remaining']}"
            window = "" if r["resets_at"] is None else f", window ends {_when(r['resets_at'])}"
            print(f"  {r['rate']:<{width}} {counts}{wait}{window}")
        learned = entry["learned"]
        if learned is not None:
            print(
                f"  learned from the upstream: {learned['used']} of {learned['limit']} "
                f"until {_when(learned['resets_at'])}"
            )
        wait = entry["next_slot_in"]
        print(f"  next free slot: {'now' if wait == 0 else f'in {wait:.3f} s'}")
        paused = entry["paused_for"]
        print(f"  paused: {'no' if paused == 0 else f'for {paused:.3f} s more'}")
        if entry["in_flight"] is not None:
            print(f"  in flight: {entry['in_flight']}, queued: {entry['waiting']}")
    return EXIT_OK


def _when(epoch: float) -> str:
    """An epoch time as UTC, to the second."""
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def cmd_reset(args: argparse.Namespace) -> int:
    keys = _keys(args)
    with _open_store(args) as backend:
        for number, key in enumerate(keys, 1):
            # The store key alone names the log: no rates are needed to forget it.
            hashed = store_key(key, namespace=args.namespace, tag=args.tag)
            backend.forget(hashed)
            label = _label(number, hashed)
            print(f"reset {label['key']} (store key {label['store_key']})")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    if args.plot is not None:
        _check_plot(args.plot)
    if args.redis is not None:
        try:
            backend = RedisBackend(args.redis)
        except ValueError as exc:
            raise _UsageError(f"bad Redis URL {_redact(args.redis)!r}: {exc}") from None
        with backend:
            backend.ping()  # reachable, before anything starts
    config = _demo.DemoConfig(
        workers=args.workers,
        tokens=args.tokens,
        duration=args.duration,
        rates=tuple(args.rate) if args.rate else _demo.DemoConfig.rates,
        min_interval=args.min_interval,
        margin=args.margin,
        tolerance=args.tolerance,
        redis_url=args.redis,
    )
    live = None if args.json or not sys.stdout.isatty() else _live_view()
    if live is not None:
        run = live(config)
    elif args.json:
        run = _demo.run_demo(config)
    else:
        print(
            f"running the demo for {config.duration:g} s ({_demo.describe_quota(config)})...",
            file=sys.stderr,
        )
        if sys.stdout.isatty():
            print(f"(for a live view: pip install '{PROG}[cli]')", file=sys.stderr)
        run = _demo.run_demo(config, watch=_demo.ProgressLines(sys.stderr))
    ok = run.summary["rejected"] == 0 and not run.errors
    if args.plot is not None:
        _demo.plot_run(run, args.plot)
    if args.json:
        print(json.dumps({**run.summary, "ok": ok, "errors": run.errors}))
    else:
        print(_demo.summary_text(run.summary, run.errors))
        if args.plot is not None:
            print(f"the quota's picture: {args.plot}")
    return EXIT_OK if ok else EXIT_FAILED


def _check_plot(path: str) -> None:
    """Before the demo runs, not after: a picture it could not draw."""
    target = Path(path)
    if target.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise _UsageError(f"--plot {path!r}: the file's name must end in .png, .svg or .pdf")
    if not target.resolve().parent.is_dir():
        raise _UsageError(f"--plot {path!r}: no such directory")
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        raise _UsageError(f"--plot needs matplotlib: pip install '{PROG}[plot]'") from None


def cmd_history(args: argparse.Namespace) -> int:
    keys = _keys(args)
    report: list[dict[str, Any]] = []
    with _open_store(args) as backend:
        for number, key in enumerate(keys, 1):
            hashed = store_key(key, namespace=args.namespace, tag=args.tag)
            card = Card.parse(backend.cards([hashed]).get(hashed, ""))
            # The zone the limiters count in, as their card says; with no card (it
            # lasts as long as the key, the history far longer), the offset the store
            # kept. (The rates do not matter to a read of the history.)
            zone = card.zone if card is not None else None
            reader = Limiter(
                backend,
                rates="1/second",
                namespace=args.namespace,
                tag=None if args.tag is None else (lambda _key: args.tag),
                history=History(zone=zone) if zone else False,
            )
            used = reader.history(key)
            report.append(
                {
                    **_label(number, hashed),
                    "label": None if card is None else card.label,
                    "zone": used.zone,
                    **{
                        grain: [
                            {"start": p.start.isoformat(), "calls": p.calls, "cost": p.cost}
                            for p in getattr(used, grain)
                        ]
                        for grain in ("hours", "days", "months")
                    },
                }
            )
    if args.json:
        print(json.dumps({"namespace": args.namespace, "keys": report}))
        return EXIT_OK
    shapes = {"hours": "%Y-%m-%d %H:00", "days": "%Y-%m-%d", "months": "%Y-%m"}
    for entry in report:
        label = "" if entry["label"] is None else f", label {entry['label']!r}"
        print(f"{entry['key']}  (store key {entry['store_key']}{label}), in {entry['zone']}")
        for grain, shape in shapes.items():
            rows = entry[grain]
            if not rows:
                print(f"  {grain}: none")
            for row in rows:
                start = datetime.fromisoformat(row["start"]).strftime(shape)
                cost = f", cost {row['cost']}" if row["cost"] != row["calls"] else ""
                print(f"  {start:<16} {row['calls']} calls{cost}")
    return EXIT_OK


def cmd_top(args: argparse.Namespace) -> int:
    with _open_store(args) as backend:

        def look() -> _top.Look:
            return _top.look(backend, args.namespace, args.scan_limit)

        if args.json:
            print(json.dumps(look().to_json()))
            return EXIT_OK
        live = _live_top()
        if live is not None and sys.stdout.isatty():
            live(look, args.interval, args.iterations, args.rows)
            return EXIT_OK
        looks = 0
        try:
            while True:
                print(_top.text_table(look(), args.rows), flush=True)
                looks += 1
                if args.iterations is not None and looks >= args.iterations:
                    return EXIT_OK
                time.sleep(args.interval)
                print()
        except KeyboardInterrupt:
            return EXIT_OK


def _live_top() -> Callable[..., None] | None:
    """top's live view, or None without rich (as ``_live_view``)."""
    try:
        from .live import watch_top
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != "rich":
            raise
        return None
    return watch_top


def _live_view() -> Callable[[_demo.DemoConfig], _demo.DemoRun] | None:
    """The demo with its live view, or None without rich (the ``cli`` extra): the one
    place where rich may be missing."""
    try:
        from .live import run_live
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != "rich":
            raise  # a module of our own is missing: a broken install, not an option
        return None
    return run_live


COMMANDS = {
    "demo": cmd_demo,
    "status": cmd_status,
    "reset": cmd_reset,
    "top": cmd_top,
    "history": cmd_history,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``throttle-client`` console script and ``python -m throttle_client``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # The command reports failures itself, in one line: the library's log lines (a store
    # unavailable, an upstream 429) would only repeat them, or garble the live display.
    _demo.quiet()
    prefix = f"{PROG} {args.command}: error:"
    try:
        return COMMANDS[args.command](args)
    except (_UsageError, ConfigurationError) as exc:
        print(f"{prefix} {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BackendUnavailable as exc:  # it may answer again: worth trying later
        print(f"{prefix} {exc}", file=sys.stderr)
        return EXIT_STORE
    except BackendError as exc:  # it answered: someone must mend the key or the settings
        print(f"{prefix} {exc}", file=sys.stderr)
        return EXIT_STORE_ERROR
    except (ThrottleError, _demo.DemoError, OSError) as exc:
        print(f"{prefix} {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
