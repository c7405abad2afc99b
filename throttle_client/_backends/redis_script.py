"""The Redis script: its parts assembled into one script and one function library, and
the flow that runs operations through it, loading it again when the server lost it.

Sync and asyncio backends run the same flow (see ``_flow``): it yields the redis-py
calls it needs (:class:`Command`) and receives their replies.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Generator
from importlib import resources
from typing import Any, NamedTuple

from redis import exceptions as rx

from .._cards import Disagreements
from .ops import Op
from .redis_answers import decode_batch
from .redis_clients import warn_if_evicting
from .redis_codec import encode_batch
from .redis_errors import DRIVER_ERRORS, translate
from .repair import RepairNotice

# The script, one file per concern, joined in an order in which each part uses only what
# the parts before it define (lua/core.lua's header describes the whole).
PARTS = (
    "core",
    "repair",
    "log",
    "bounded",
    "calendar",
    "slots",
    "history",
    "leases",
    "records",
    "learned",
    "acquire",
    "plain",
    "operations",
)
_LUA = resources.files(__package__).joinpath("lua")
SCRIPT = "".join(_LUA.joinpath(f"{part}.lua").read_text("utf-8") for part in PARTS)
SHA = hashlib.sha1(SCRIPT.encode()).hexdigest()
# On Redis >= 7 the same text is loaded as a function library (FUNCTION LOAD) and called
# with FCALL: its local functions (over 80) are then defined once, not on every call
# (~15% of the server's time per decision, docs/benchmarks.md). Named by the script's
# hash, so two versions of the library never collide on one server.
FUNCTION = f"throttle_client_{SHA[:16]}"
_RUN = "return run(KEYS, ARGV)\n"
assert SCRIPT.endswith(_RUN)
LIBRARY = (
    f"#!lua name={FUNCTION}\n{SCRIPT.removesuffix(_RUN)}"
    f"redis.register_function('{FUNCTION}', function(keys, args) return run(keys, args) end)\n"
)

# A SCRIPT FLUSH (FUNCTION FLUSH) can land between our reload of the script and the call
# after it; a few more tries are enough, as each one loads the script again.
_NOSCRIPT_TRIES = 3


class Calls:
    """How a backend calls the script: FCALL until the server shows it cannot (Redis
    6.2: an unknown command; an ACL user without ``fcall`` or ``function|load``), then
    EVALSHA for good. Also whether the first call that succeeded asked about eviction."""

    def __init__(self) -> None:
        self.functions = True
        self.memory_checked = threading.Lock()  # acquired once, by the first call that succeeds


def _no_functions(exc: Exception) -> bool:
    """Whether ``exc`` says this server or user cannot use functions (not a script error)."""
    text = str(exc).lower()
    if isinstance(exc, rx.NoPermissionError):  # for FCALL or FUNCTION LOAD themselves, not
        return "'fcall'" in text or "'function|load'" in text  # a command the script runs
    # Redis 6.2: "unknown command `FCALL`"; a Cluster client that asked 6.2 for its
    # commands knows none by that name and says so itself.
    if not ("fcall" in text or "function" in text):
        return False
    return "unknown command" in text or "doesn't exist in redis commands" in text


class Command(NamedTuple):
    """A step of ``script_flow``: one redis-py client method and its arguments (a tuple:
    one is made for every decision)."""

    name: str  # fcall, function_load, evalsha, script_load, config_get, pipeline
    args: tuple[Any, ...]


def script_flow(
    ops: list[Op[Any]],
    queued: list[float],
    calls: Calls,
    repairs: RepairNotice,
    disagree: Disagreements | None = None,
) -> Generator[Command, Any, list[Any]]:
    """Operations as the script runs them, in one call, for both backends (see ``_flow``):
    FCALL, or EVALSHA where functions cannot be used, loading the library or the script
    again when the server has lost it; driver errors become ours. The first call that
    succeeds also asks whether Redis may evict the limiter's keys. Returns each one's
    answer, or the error it raises."""
    if not ops:  # a place opening its connection ahead of the calls queued behind it
        yield from open_flow(calls)
        return []
    keys, args = encode_batch(ops, queued)
    try:
        tries_left = _NOSCRIPT_TRIES
        while True:
            # (What this attempt uses: calls in flight at once may see the flag change.)
            functions = calls.functions
            try:
                if functions:
                    reply = yield Command("fcall", (FUNCTION, len(keys), *keys, *args))
                else:
                    reply = yield Command("evalsha", (SHA, len(keys), *keys, *args))
                break
            except rx.NoScriptError:
                tries_left -= 1
                if not tries_left:
                    raise
                yield Command("script_load", (SCRIPT,))
            except rx.RedisError as exc:
                if not functions:
                    raise
                if _no_functions(exc):
                    calls.functions = False  # and the same call again, by EVALSHA
                    continue
                if "function not found" not in str(exc).lower():
                    raise  # the script's own error, or the key's
                tries_left -= 1
                if not tries_left:
                    raise
                try:
                    yield Command("function_load", (LIBRARY, True))
                except rx.RedisError as refused:
                    if not _no_functions(refused):
                        raise
                    calls.functions = False
    except DRIVER_ERRORS as exc:
        raise translate(exc) from exc
    if calls.memory_checked.acquire(blocking=False):
        # Refused (NOPERM, CONFIG renamed on a managed service): stay silent.
        with contextlib.suppress(*DRIVER_ERRORS):
            warn_if_evicting((yield Command("config_get", ("maxmemory*",))))
    return decode_batch(ops, reply, repairs, disagree)


def open_flow(calls: Calls) -> Generator[Command, Any, None]:
    """A new connection's round trip (Batcher: a call of no operation), which the calls
    queued behind it wait for: the library (or script) loaded, and, the first time, the
    store's eviction policy read, pipelined. So a store that never held the script costs
    a cold call one round trip, not three (FCALL, "function not found", FUNCTION LOAD,
    FCALL again), and the first decision does not wait for CONFIG GET. A library loaded
    already answers "already exists"; anything else it answers is the calls' to meet."""
    check = calls.memory_checked.acquire(blocking=False)
    load = ("function_load", (LIBRARY,)) if calls.functions else ("script_load", (SCRIPT,))
    steps = (load, ("config_get", ("maxmemory*",))) if check else (load,)
    try:
        replies = yield Command("pipeline", steps)
    except BaseException as exc:
        if check:
            calls.memory_checked.release()  # (asked again by the next call that succeeds)
        if isinstance(exc, DRIVER_ERRORS):
            raise translate(exc) from exc
        raise
    refused = replies[0]
    # A server without functions (Redis 6.2) goes to EVALSHA for good; a user who may not
    # load a library (NOPERM) may still call one an operator loaded: the FCALL decides.
    if (
        isinstance(refused, rx.RedisError)
        and not isinstance(refused, rx.NoPermissionError)
        and _no_functions(refused)
    ):
        calls.functions = False
    if check and not isinstance(replies[1], Exception):
        warn_if_evicting(replies[1])  # (refused, NOPERM or CONFIG renamed: silent)


def pipelined(runner: Any, steps: tuple[tuple[str, tuple[Any, ...]], ...]) -> Any:
    """A pipeline (no MULTI) of a "pipeline" step's commands, for either client to send:
    the sync one's execute() answers, the asyncio one's is awaited."""
    pipe = runner.pipeline(transaction=False)
    for name, args in steps:
        getattr(pipe, name)(*args)
    return pipe
