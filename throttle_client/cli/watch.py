"""``demo`` and ``top``: the commands that watch something as it runs, redrawn live with
rich when it is installed (the ``cli`` extra) and the output is a terminal, else printed
in plain lines.

:mod:`.live` draws the live views; this module is the one place that imports it, and
so the one place where rich may be missing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from throttle_client import RedisBackend

from . import demo as _demo
from . import top as _top
from .arguments import EXIT_FAILED, EXIT_OK, PROG, UsageError, open_store, redact


def cmd_demo(args: argparse.Namespace) -> int:
    if args.plot is not None:
        _check_plot(args.plot)
    if args.redis is not None:
        try:
            backend = RedisBackend(args.redis)
        except ValueError as exc:
            raise UsageError(f"bad Redis URL {redact(args.redis)!r}: {exc}") from None
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
        raise UsageError(f"--plot {path!r}: the file's name must end in .png, .svg or .pdf")
    if not target.resolve().parent.is_dir():
        raise UsageError(f"--plot {path!r}: no such directory")
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        raise UsageError(f"--plot needs matplotlib: pip install '{PROG}[plot]'") from None


def cmd_top(args: argparse.Namespace) -> int:
    with open_store(args) as backend:

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
