"""``throttle-client top`` and ``status`` reading keys' cards."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from rich.console import Console

from throttle_client import Backend, Limiter, MemoryBackend, Rate, RedisBackend, SQLiteBackend
from throttle_client._flow import run
from throttle_client._key_flows import pause_flow
from throttle_client.cli import live, top

TOKEN = "ghp_top_test_token_41b2"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "throttle_client", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@contextlib.contextmanager
def seeded(backend: Backend) -> Iterator[dict[str, Limiter]]:
    """Keys at 20 %, 60 % and 100 % of a limit, one paused, and one capped key holding a
    lease (while the block runs), in two namespaces."""
    crawl = Limiter(
        backend, rates=["5/minute", "100/hour"], namespace="crawl", label=lambda k: k.upper()
    )
    for key, calls in (("low", 1), ("mid", 3), ("full", 5), ("paused", 1)):
        for _ in range(calls):
            assert crawl.try_acquire(f"{TOKEN}-{key}").allowed
    crawl.pause(f"{TOKEN}-paused", 300)
    capped = Limiter(backend, rates="100/minute", namespace="caps", max_concurrent=4)
    with capped.lease(f"{TOKEN}-capped"), backend:  # held: 1 of 4 in flight
        yield {"crawl": crawl, "caps": capped}


def labels_of(look: dict[str, Any]) -> list[str]:
    return [row["label"] for row in look["keys"]]


def test_top_json_on_sqlite_sorts_nearest_first_and_filters(tmp_path: Path) -> None:
    path = tmp_path / "limits.db"
    with seeded(SQLiteBackend(path)) as limiters:
        result = cli("top", "--sqlite", str(path), "--json")
        only = cli("top", "--sqlite", str(path), "--json", "--namespace", "caps")
        cut = cli("top", "--sqlite", str(path), "--json", "--scan-limit", "2")
    assert result.returncode == 0, result.stderr
    look = json.loads(result.stdout)
    suffix = TOKEN.upper()
    capped_label = limiters["caps"].label(f"{TOKEN}-capped")
    # A paused key first, then by how much of a limit is used or booked.
    assert labels_of(look) == [
        f"{suffix}-PAUSED",
        f"{suffix}-FULL",
        f"{suffix}-MID",
        capped_label,  # 1 of 4 in flight: 25 %
        f"{suffix}-LOW",
    ]
    rows = {row["label"]: row for row in look["keys"]}
    full = rows[f"{suffix}-FULL"]
    assert full["fullness"] == 1.0 and full["namespace"] == "crawl"
    assert [(r["rate"], r["used"], r["limit"]) for r in full["rates"]] == [
        ("5/60s", 5, 5),
        ("100/3600s", 5, 100),
    ]
    # (300 s less however long the three commands took to start and read the store.)
    assert 240 < rows[f"{suffix}-PAUSED"]["paused_for"] <= 300
    capped = rows[capped_label]
    assert (capped["in_flight"], capped["max_concurrent"], capped["waiting"]) == (1, 4, 0)
    assert (look["read"], look["unreadable"], look["truncated"]) == (5, 0, False)
    assert TOKEN not in result.stdout  # labels and store keys only

    assert [row["namespace"] for row in json.loads(only.stdout)["keys"]] == ["caps"]
    cut_look = json.loads(cut.stdout)
    assert (cut_look["read"], cut_look["truncated"], len(cut_look["keys"])) == (2, True, 2)


@pytest.mark.parametrize("where", ["redis", "cluster"])
def test_top_json_on_redis_and_a_cluster(where: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue(f"{where}_url")
    cluster = where == "cluster"
    with seeded(RedisBackend(url, cluster=cluster)) as limiters:
        # A card another version wrote (or a damaged one) is counted, not shown.
        junk = f"tc:{limiters['crawl'].store_key('junk')}:card"
        client = limiters["crawl"].backend.client  # type: ignore[attr-defined]
        client.set(junk, b"\xff not json", px=60_000)
        # JSON, but rules no limiter can keep (a cap of "3"): counted too, never an error.
        odd = {"label": "x", "namespace": "crawl", "rates": ["5/60s"], "max_concurrent": "3"}
        odd_key = f"tc:{limiters['crawl'].store_key('odd')}:card"
        client.set(odd_key, json.dumps(odd), px=60_000)
        result = cli("top", "--redis", url, "--json", *(["--cluster"] if cluster else []))
    assert result.returncode == 0, result.stderr
    look = json.loads(result.stdout)
    assert len(look["keys"]) == 5 and look["read"] == 7 and look["unreadable"] == 2
    assert look["keys"][0]["label"].endswith("-PAUSED")
    assert look["keys"][1]["fullness"] == 1.0


def test_top_prints_plain_tables_without_a_terminal(tmp_path: Path) -> None:
    path = tmp_path / "limits.db"
    with seeded(SQLiteBackend(path)):
        result = cli("top", "--sqlite", str(path), "--iterations", "2", "--interval", "0.1")
    assert result.returncode == 0, result.stderr
    tables = result.stdout.strip().split("\n\n")
    assert len(tables) == 2
    lines = tables[0].splitlines()
    assert lines[0].split()[:3] == ["label", "namespace", "full"]
    assert lines[1].startswith(f"{TOKEN.upper()}-PAUSED")
    assert "5+0/5 per 5/60s" in lines[2] and "100%" in lines[2]
    assert lines[-1] == "5 of 5 keys shown"


def test_top_live_view_renders_the_look(tmp_path: Path) -> None:
    with seeded(SQLiteBackend(tmp_path / "limits.db")) as limiters:
        look = top.look(limiters["crawl"].backend)
    console = Console(record=True, width=200)
    console.print(live.top_view(look, rows=2))
    text = console.export_text()
    assert f"{TOKEN.upper()}-PAUSED" in text and f"{TOKEN.upper()}-FULL" in text
    assert f"{TOKEN.upper()}-MID" not in text  # two rows asked
    assert "2 of 5 keys shown" in text


def test_status_reads_the_rules_and_label_from_the_card(tmp_path: Path) -> None:
    path = tmp_path / "limits.db"
    with seeded(SQLiteBackend(path)):
        mid = cli("status", "--sqlite", str(path), "--namespace", "crawl", "--json", f"{TOKEN}-mid")
        unknown = cli("status", "--sqlite", str(path), "--namespace", "crawl", "never-used")
        given = cli("status", "--sqlite", str(path), "--rate", "9/second", "--json", "never-used")
    assert mid.returncode == 0, mid.stderr
    (entry,) = json.loads(mid.stdout)["keys"]
    assert entry["label"] == f"{TOKEN.upper()}-MID"
    assert [(r["rate"], r["used"]) for r in entry["rates"]] == [("5/60s", 3), ("100/3600s", 3)]
    # A key no limiter used: no card, so its rates must be given.
    assert unknown.returncode == 2
    assert "has no card" in unknown.stderr and "--rate" in unknown.stderr
    assert "never-used" not in unknown.stderr
    assert json.loads(given.stdout)["keys"][0]["label"] is None


def test_top_reads_only_the_namespace_asked_and_names_a_pause_by_its_setter(
    tmp_path: Path,
) -> None:
    path = tmp_path / "limits.db"
    with SQLiteBackend(path) as backend:
        other = Limiter(backend, rates="5/minute", namespace="other")
        for n in range(6):
            other.try_acquire(f"{TOKEN}-{n}")
        mine = Limiter(backend, rates="5/minute", namespace="mine")
        mine.try_acquire(TOKEN)
        # A 429's pause, then a longer one of the caller's: not "paused on Retry-After".
        told = {"reason": "Retry-After", "source": "upstream", "refused": True}
        run(pause_flow(mine, TOKEN, 2, mine._local(), **told), mine._perform)
        mine.pause(TOKEN, 300)
        look = json.loads(
            cli(
                "top", "--sqlite", str(path), "--json", "--namespace", "mine", "--scan-limit", "1"
            ).stdout
        )
    (row,) = look["keys"]
    assert (look["read"], look["truncated"]) == (1, False)  # the other 6 were not read
    assert row["paused_for"] > 290 and row["reason"] is None and row["refused"] == 1


def test_a_long_call_keeps_its_key_in_top(tmp_path: Path) -> None:
    """A lease held past the key's windows: its renewals keep the key's card."""
    backend = MemoryBackend()
    capped = Limiter(backend, rates=[Rate(10, 0.1)], max_concurrent=2, lease_ttl=1)
    with capped.lease(TOKEN):
        time.sleep(1.5)  # ~4 renewals; the card alone would have lasted 0.2 s
        # (The memory store reads cards at the time it last ran: a call on another key.)
        Limiter(backend, rates="5/second").try_acquire("other key")
        cards = [key for key, _ in backend.all_cards()]
    assert capped.store_key(TOKEN) in cards


def damage(where: str, target: str, store_key: str, how: str = "pause") -> None:
    """Damage a key with raw store calls: a pause of 2**62 µs (146,000 years), or (Redis)
    its meta replaced by a hash, a key of the wrong type."""
    if where == "sqlite":
        db = sqlite3.connect(target, isolation_level=None)
        sql = "UPDATE tc_meta SET pause_until = ? WHERE key = ?"
        assert db.execute(sql, (2**62, store_key)).rowcount == 1
        db.close()
        return
    client = redis.Redis.from_url(target)
    meta = f"tc:{store_key}:meta"
    if how == "wrong type":
        client.delete(meta)
        client.hset(meta, "total", "5")
    else:
        client.eval(
            "local t = {cmsgpack.unpack(redis.call('GET', KEYS[1]))} t[5] = tonumber(ARGV[1])"
            " redis.call('SET', KEYS[1], cmsgpack.pack(unpack(t, 1, 16)), 'KEEPTTL')",
            1,
            meta,
            2**62,
        )
    client.close()


@pytest.mark.parametrize(
    ("where", "how"), [("sqlite", "pause"), ("redis", "pause"), ("redis", "wrong type")]
)
def test_top_leaves_out_a_damaged_key_and_shows_the_rest(
    where: str, how: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """One key the store refuses to read (a pause no limiter sets, a meta of the wrong
    type): top shows the others, names that one, and exits 0 (it showed the pause as if
    set, or exited 3, "unreachable", showing nothing)."""
    target = (
        str(tmp_path / "limits.db") if where == "sqlite" else request.getfixturevalue("redis_url")
    )
    backend = SQLiteBackend(target) if where == "sqlite" else RedisBackend(target)
    args = ["--sqlite" if where == "sqlite" else "--redis", target]
    with seeded(backend) as limiters:
        damaged = limiters["crawl"].store_key(f"{TOKEN}-mid")
        damage(where, target, damaged, how)
        result = cli("top", *args, "--json")
        plain = cli("top", *args, "--iterations", "1")
    assert result.returncode == 0, result.stderr
    look = json.loads(result.stdout)
    assert damaged not in [row["store_key"] for row in look["keys"]] and len(look["keys"]) == 4
    assert look["damaged"] == [damaged]
    assert plain.returncode == 0, plain.stderr
    footer = plain.stdout.strip().splitlines()[-1]
    assert footer == f"4 of 4 keys shown; 1 damaged key(s) left out, reset them: {damaged}"
    assert TOKEN not in result.stdout + plain.stdout + plain.stderr


def test_top_warns_of_the_key_it_leaves_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "limits.db"
    with seeded(SQLiteBackend(path)) as limiters:
        damaged = limiters["crawl"].store_key(f"{TOKEN}-low")
        damage("sqlite", str(path), damaged)
        with caplog.at_level("WARNING", logger="throttle_client"):
            look = top.look(limiters["crawl"].backend)
    assert look.damaged == (damaged,) and len(look.keys) == 4
    [warning] = [r.getMessage() for r in caplog.records if r.name == "throttle_client"]
    assert f"top left out store key {damaged}" in warning and "reset() the key" in warning
