"""The ``throttle-client`` command's entry point: ``main`` parses the command line, runs
the subcommand, and turns each failure into one line and an exit status.

The subcommands are kept by what they do: the parser in :mod:`.arguments`, ``status``,
``reset`` and ``history`` in :mod:`.status`, ``demo`` and ``top`` in :mod:`.watch`.

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

import sys
from collections.abc import Sequence

from throttle_client import BackendError, BackendUnavailable, ConfigurationError, ThrottleError

from . import demo as _demo
from .arguments import (
    EXIT_FAILED,
    EXIT_STORE,
    EXIT_STORE_ERROR,
    EXIT_USAGE,
    PROG,
    SECRET_ENV,
    UsageError,
    build_parser,
)
from .status import cmd_history, cmd_reset, cmd_status
from .watch import cmd_demo, cmd_top

# What others read of the command: its entry point, its parser (every command line the
# docs show is checked against it) and the variable that holds the key secret it hashes
# keys with.
__all__ = ["COMMANDS", "SECRET_ENV", "build_parser", "main"]

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
    except (UsageError, ConfigurationError) as exc:
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
