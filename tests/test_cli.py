"""The ``throttle-client`` command, run as a user runs it: ``python -m throttle_client``."""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from throttle_client import (
    BackendError,
    BackendUnavailable,
    Limiter,
    MemoryBackend,
    Rate,
    SQLiteBackend,
)
from throttle_client._keys import SECRET_ENV
from throttle_client.cli import command, demo, live
from throttle_client.cli.command import build_parser, main
from throttle_client.testing import FakeClock

TOKEN = "ghp_cli_test_token_5c1d9e"
README = Path(__file__).resolve().parent.parent / "README.md"


def cli(*args: str, stdin: str | None = None, env: dict[str, str] | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "throttle_client", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def check_demo_summary(summary: dict[str, Any]) -> None:
    assert summary["ok"] is True and summary["errors"] == []
    assert summary["rejected"] == 0
    assert summary["requests"] == summary["admitted"] >= 2 * 10
    assert summary["utilisation"] >= 0.95
    for peak in summary["peak_in_window"].values():
        assert peak["by_slot"] <= peak["limit"]
        assert peak["by_arrival_within_tolerance"] <= peak["limit"]
    assert summary["min_gap"]["by_slot"] >= summary["min_interval"] - 1e-6


# The demo's own defaults, as a user runs it: an upstream that counts arrivals exactly
# (no tolerance), limiters with the default margin. Shorter, so the suite stays quick.
DEMO_ARGS = ("--duration", "5", "--json")


@pytest.mark.slow
def test_demo_on_sqlite() -> None:
    result = cli("demo", *DEMO_ARGS)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)  # one JSON object, nothing else on stdout
    assert summary["store"] == "sqlite" and summary["workers"] == 4 and summary["tokens"] == 2
    check_demo_summary(summary)


@pytest.mark.slow
def test_demo_on_redis(redis_url: str) -> None:
    result = cli("demo", *DEMO_ARGS, "--redis", redis_url, "--workers", "3", "--tokens", "3")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["store"] == "redis" and summary["tokens"] == 3
    check_demo_summary(summary)


def test_the_demo_books_no_slot_after_its_duration() -> None:
    """Two crawlers of one token at 1/second for 0.5 s: the second would book the slot at
    1 s and the first then 2 s, stretching the run to 2 s; now neither books past 0.5 s."""
    result = cli("demo", "--duration", "0.5", "--rate", "1/s", "--rate", "2/s",
                 "--workers", "2", "--tokens", "1", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    (token,) = summary["per_token"]
    # One slot, or two if one crawler woke from the start barrier 0.5 s after the other.
    assert 1 <= token["admitted"] <= 2 and token["span"] <= 1.0


def test_the_live_view_shows_used_apart_from_booked() -> None:
    clock = FakeClock()
    limiter = Limiter(MemoryBackend(), rates=["10/second"], clock=clock, sleep=lambda _: None)
    for _ in range(12):
        limiter.acquire("t")  # ten slots now, two booked at 1 s
    config = demo.DemoConfig(tokens=1, rates=(Rate(10, 1),))
    run = demo.DemoRun(config, demo._Store(), limiter, ("t",), [0] * 4)
    console = Console(file=io.StringIO(), width=200, record=True)
    console.print(live.live_view(run))
    table = console.export_text()
    assert "booked" in table and "12/10" not in table
    assert re.search(r"token 1\W+0\W+0\W+0\W+0\W+2\W+10/10\W", table), table


def test_the_demo_without_rich_prints_progress_lines_then_the_summary() -> None:
    """As after ``pip install .``, with rich unimportable: not a redraw, but one plain
    line about once a second on stderr, and the summary alone on stdout."""
    run = "import sys; sys.modules['rich'] = None; from throttle_client.cli import main; "
    result = subprocess.run(
        [sys.executable, "-c", run + "raise SystemExit(main(sys.argv[1:]))",
         "demo", "--duration", "2.5", "--workers", "2", "--tokens", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("throttle-client demo: 2 crawler processes, 1 tokens")
    assert result.stdout.rstrip().endswith("OK: no request was rejected.")
    progress = re.findall(r"^ *(\d+\.\d) / 2\.5 s   sent (\d+), admitted (\d+), 429s 0, ",
                          result.stderr, re.M)  # fmt: skip
    assert len(progress) >= 2, result.stderr
    assert [float(p[0]) for p in progress] == sorted(float(p[0]) for p in progress)
    assert int(progress[-1][1]) > 0 and progress[-1][1] == progress[-1][2]
    assert "\r" not in result.stderr and "\x1b" not in result.stderr  # no cursor games


def fake_demo(monkeypatch: pytest.MonkeyPatch, limiter: Limiter | None = None) -> list[Any]:
    """Replace the demo's run by one that calls its ``watch`` twice, 1.5 s in; returns
    the watches it was given."""
    watches: list[Any] = []

    def fake_run(config: demo.DemoConfig, *, watch: Any = None) -> demo.DemoRun:
        run = demo.DemoRun(config, demo._Store(), limiter, ("t",), [3, 3, 0, 1])  # type: ignore[arg-type]
        run.started = time.monotonic() - 1.5
        watches.append(watch)
        for _ in range(2):
            watch(run)
        run.summary = {"rejected": 0}
        return run

    monkeypatch.setattr(demo, "run_demo", fake_run)
    monkeypatch.setattr(demo, "summary_text", lambda summary, errors: "SUMMARY")
    return watches


def test_on_a_terminal_without_rich_the_demo_says_how_to_get_the_live_view(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in [name for name in sys.modules if name.partition(".")[0] == "rich"]:
        monkeypatch.setitem(sys.modules, name, None)  # each, as a loaded one is reused
    monkeypatch.setitem(sys.modules, "rich", None)
    monkeypatch.delitem(sys.modules, "throttle_client.cli.live")
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    watches = fake_demo(monkeypatch)
    assert main(["demo", "--tokens", "1"]) == 0
    out, err = capsys.readouterr()
    (watch,) = watches
    assert isinstance(watch, demo.ProgressLines) and out == "SUMMARY\n"
    assert "pip install 'throttle-client[cli]'" in err
    lines = [line for line in err.splitlines() if " / 10 s " in line]
    assert lines == ["  1.5 / 10 s   sent 3, admitted 3, 429s 0, crawlers waiting for a slot 1"]


def test_on_a_terminal_with_rich_the_demo_draws_the_live_view(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    limiter = Limiter(MemoryBackend(), rates=demo.DemoConfig.rates)
    watches = fake_demo(monkeypatch, limiter)
    assert main(["demo", "--tokens", "1"]) == 0
    out, err = capsys.readouterr()
    (watch,) = watches
    assert not isinstance(watch, demo.ProgressLines)
    assert "booked" in out and "┏" in out and "upstream: 0 admitted" in out  # rich's table
    assert " / 10 s   sent" not in err and "pip install" not in err


@pytest.mark.parametrize(("rejected", "errors", "status"), [(0, [], 0), (2, [], 1), (0, ["x"], 1)])
def test_demo_exit_status_says_whether_anything_was_rejected(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    rejected: int,
    errors: list[str],
    status: int,
) -> None:
    def fake_run(config: demo.DemoConfig, **_: Any) -> demo.DemoRun:
        run = demo.DemoRun(config, demo._Store(), None, ("t",), None)  # type: ignore[arg-type]
        run.summary = {"rejected": rejected, "requests": 9}
        run.errors = errors
        return run

    monkeypatch.setattr(demo, "run_demo", fake_run)
    assert main(["demo", "--json"]) == status
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is (status == 0) and out["rejected"] == rejected


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["demo", "--rate", "ten per sec"], "cannot parse rate 'ten per sec'"),
        (["demo", "--workers", "0"], "not '0'"),
        (["demo", "--duration", "-1"], "not '-1'"),
        (["demo", "--redis", "http://user:hunter2@localhost"], "bad Redis URL"),
        (["status", "--sqlite", "x.db", TOKEN], "no SQLite store"),
        (["top", "--sqlite", "x.db", "--cluster"], "--cluster goes with --redis"),
        (["status", "--rate", "5/second", TOKEN], "--redis"),
        (["reset", "--sqlite", "/nonexistent/limits.db", TOKEN], "no SQLite store"),
        (["reset", "--sqlite", "x.db", "--key-env", "TC_UNSET_VARIABLE"], "TC_UNSET_VARIABLE"),
        (["bogus"], "invalid choice"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(args: list[str], message: str) -> None:
    result = cli(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr and "hunter2" not in result.stderr
    assert TOKEN not in result.stderr


def test_unreachable_redis_is_one_line_and_exit_3() -> None:
    for args in (["demo"], ["status", "--rate", "5/second", TOKEN], ["reset", TOKEN]):
        command, *rest = args
        result = cli(command, "--redis", "redis://127.0.0.1:1/0", *rest)
        assert result.returncode == 3, result.stderr
        assert "unavailable" in result.stderr and "127.0.0.1:1" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert TOKEN not in result.stderr + result.stdout


def test_a_store_that_answers_with_an_error_exits_4(tmp_path: Path) -> None:
    """Not "unreachable" (3, worth trying again later): a file that is no database, a
    damaged key, and a file of a newer version stay as they are until someone acts."""
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not a database, " * 100)
    not_a_db = cli("status", "--sqlite", str(junk), "--rate", "5/second", TOKEN)
    path = tmp_path / "limits.db"
    limiter = seed(path)
    db = sqlite3.connect(path, isolation_level=None)
    db.execute(
        "UPDATE tc_meta SET pause_until = ? WHERE key = ?", (2**62, limiter.store_key(TOKEN))
    )
    db.close()
    damaged = cli("status", "--sqlite", str(path), "--namespace", "crawl", TOKEN)
    newer = tmp_path / "newer.db"
    SQLiteBackend(newer).close()
    db = sqlite3.connect(newer, isolation_level=None)
    db.execute("PRAGMA user_version = 999")
    db.close()
    from_newer = cli("top", "--sqlite", str(newer), "--json")
    for result in (not_a_db, damaged, from_newer):
        assert result.returncode == 4, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert TOKEN not in result.stderr + result.stdout
    assert "not a database" in not_a_db.stderr
    assert f"store key {limiter.store_key(TOKEN)} is damaged" in damaged.stderr
    assert "newer version" in from_newer.stderr and "schema version 999" in from_newer.stderr


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (BackendUnavailable("the store did not answer"), 3),
        (BackendError("the store answered with an error"), 4),
        (BackendError("Redis refused this client's configuration (NoPermissionError)"), 4),
    ],
)
def test_exit_3_is_only_for_a_store_that_could_not_be_reached(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], error: Exception,
    status: int,
) -> None:  # fmt: skip
    """Every command: 3 for BackendUnavailable alone, 4 for any other BackendError."""

    def fails(args: object) -> int:
        raise error

    for name in command.COMMANDS:
        monkeypatch.setitem(command.COMMANDS, name, fails)
    for args in (["status", "--sqlite", "x.db", TOKEN], ["top", "--redis", "redis://x"]):
        assert main(args) == status
        assert capsys.readouterr().err.strip().endswith(str(error))


def seed(path: Path) -> Limiter:
    limiter = Limiter(SQLiteBackend(path), rates=["5/minute", "100/hour"], namespace="crawl")
    for _ in range(3):
        limiter.try_acquire(TOKEN)
    limiter.pause(TOKEN, 600)
    return limiter


def test_status_and_reset_on_sqlite(tmp_path: Path) -> None:
    path = tmp_path / "limits.db"
    limiter = seed(path)
    common = ["--sqlite", str(path), "--namespace", "crawl"]
    status = cli("status", *common, "--rate", "5/minute", "--rate", "100/hour", "--json", TOKEN)
    assert status.returncode == 0, status.stderr
    (entry,) = json.loads(status.stdout)["keys"]
    assert [r["used"] for r in entry["rates"]] == [3, 3]
    assert [r["remaining"] for r in entry["rates"]] == [2, 97]
    assert 500 < entry["paused_for"] <= 600 and entry["next_slot_in"] > 500
    assert entry["key"] == "key 1" and entry["store_key"] == limiter.store_key(TOKEN)

    text = cli("status", *common, "--rate", "5/minute", TOKEN)
    assert "used 3, booked 0, remaining 2, a call can go in" not in text.stdout  # it can now
    assert "used 3, booked 0, remaining 2" in text.stdout and "paused: for" in text.stdout
    assert TOKEN not in text.stdout + text.stderr

    reset = cli("reset", *common, "-", stdin=f"{TOKEN}\n")  # the token from standard input
    assert reset.returncode == 0 and "reset key 1" in reset.stdout
    assert limiter.usage(TOKEN).rates[0].used == 0 and limiter.usage(TOKEN).paused_for == 0


def test_status_and_reset_hash_with_the_secret_the_library_reads(tmp_path: Path) -> None:
    assert command.SECRET_ENV == SECRET_ENV  # the command names it without importing it
    path = tmp_path / "limits.db"
    env = {SECRET_ENV: "a-secret-of-our-own"}
    limiter = Limiter(SQLiteBackend(path), rates=["5/minute"], key_secret=env[SECRET_ENV])
    limiter.try_acquire(TOKEN)
    status = cli("status", "--sqlite", str(path), "--rate", "5/minute", "--json", TOKEN, env=env)
    assert json.loads(status.stdout)["keys"][0]["store_key"] == limiter.store_key(TOKEN)
    reset = cli("reset", "--sqlite", str(path), TOKEN, env=env)
    assert reset.returncode == 0 and limiter.store_key(TOKEN) in reset.stdout
    assert limiter.usage(TOKEN).rates[0].used == 0


def test_status_on_redis_with_the_token_from_the_environment(redis_url: str) -> None:
    from throttle_client import RedisBackend

    with RedisBackend(redis_url) as backend:
        Limiter(backend, rates=["5/minute"], namespace="crawl").try_acquire(TOKEN)
    result = cli("status", "--redis", redis_url, "--namespace", "crawl", "--rate", "5/minute",
                 "--key-env", "TC_TOKEN", "--json", env={"TC_TOKEN": TOKEN})  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["keys"][0]["rates"][0]["used"] == 1
    other_ns = cli("status", "--redis", redis_url, "--rate", "5/minute", "--json", TOKEN)
    assert json.loads(other_ns.stdout)["keys"][0]["rates"][0]["used"] == 0


def test_status_tells_used_from_booked(tmp_path: Path) -> None:
    path = tmp_path / "limits.db"
    limiter = Limiter(SQLiteBackend(path), rates=["10/minute"], sleep=lambda _: None)
    for _ in range(30):
        limiter.acquire(TOKEN)  # ten slots now, ten a minute on, ten two minutes on
    result = cli("status", "--sqlite", str(path), "--rate", "10/minute", "--json", TOKEN)
    assert result.returncode == 0, result.stderr
    (rate,) = json.loads(result.stdout)["keys"][0]["rates"]
    assert (rate["used"], rate["booked"], rate["remaining"]) == (10, 20, 0)
    assert 120 < rate["resets_in"] <= 180  # once the ten at two minutes are the last in
    text = cli("status", "--sqlite", str(path), "--rate", "10/minute", TOKEN).stdout
    assert "used 10, booked 20, remaining 0, a call can go in 1" in text


def test_every_command_the_docs_show_is_one_the_command_takes() -> None:
    """Each ``throttle-client ...`` line in a bash block of the README or the site parses:
    no option the docs name is missing, misspelt or given without its value."""
    root = README.parent
    shown = []
    for page in [README, *sorted((root / "docs").rglob("*.md"))]:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
            for line in block.splitlines():
                words = shlex.split(line.partition("  #")[0])
                if words[:1] == ["throttle-client"] and len(words) > 1:
                    shown.append((page.name, words[1:]))
    assert len(shown) >= 3
    parser = build_parser()
    for page, words in shown:
        try:
            parser.parse_args(words)
        except SystemExit:
            pytest.fail(f"{page}: throttle-client {' '.join(words)} does not parse")


def test_status_and_reset_find_a_tagged_key_by_its_tag(tmp_path: Path) -> None:
    path = tmp_path / "limits.db"
    store = SQLiteBackend(path)
    limiter = Limiter(store, rates=["5/minute"], namespace="crawl", tag=lambda _: "acct-9")
    limiter.try_acquire(TOKEN)
    common = ["--sqlite", str(path), "--namespace", "crawl", "--rate", "5/minute", "--json"]
    untagged = json.loads(cli("status", *common, TOKEN).stdout)["keys"][0]
    assert untagged["rates"][0]["used"] == 0  # another log: the key is kept under its tag
    tagged = json.loads(cli("status", *common, "--tag", "acct-9", TOKEN).stdout)["keys"][0]
    assert tagged["rates"][0]["used"] == 1 and tagged["store_key"] == limiter.store_key(TOKEN)
    reset = cli("reset", "--sqlite", str(path), "--namespace", "crawl", "--tag", "acct-9", TOKEN)
    assert reset.returncode == 0, reset.stderr
    assert limiter.usage(TOKEN).rates[0].used == 0
    store.close()
