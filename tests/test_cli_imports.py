"""The command's package stands apart: the library never loads it, and it uses the
library only through its public names, as any user's program would."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import throttle_client

from . import private_names

CLI = Path(throttle_client.__file__).resolve().parent / "cli"
ROOT = Path(__file__).resolve().parent.parent


def loaded_after(statement: str, *, without_rich: bool = False) -> list[str]:
    """Modules of the command's package, or of rich, loaded by ``statement`` in a fresh
    interpreter (where rich cannot be imported, if ``without_rich``)."""
    block = "sys.modules['rich'] = None; " if without_rich else ""
    probe = (
        f"import json, sys; {block}{statement}; print(json.dumps(sorted(m for m, module in "
        "sys.modules.items() if module is not None and (m.split('.')[0] == 'rich' "
        "or m.startswith('throttle_client.cli')))))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr
    loaded: list[str] = json.loads(result.stdout)
    return loaded


LIBRARY = ["import throttle_client", "import throttle_client.testing"]


@pytest.mark.parametrize("statement", LIBRARY)
def test_the_library_works_without_rich_and_without_the_command(statement: str) -> None:
    """As after ``pip install .``: no rich to import, and the library never asks for it."""
    assert loaded_after(statement, without_rich=True) == []


@pytest.mark.parametrize("statement", LIBRARY)
def test_the_library_loads_no_rich_of_its_own(statement: str) -> None:
    # httpx loads rich itself for its own command line when click and rich are both
    # installed: the library may load no module of rich that httpx did not.
    by_httpx = set(loaded_after("import httpx"))
    assert [name for name in loaded_after(statement) if name not in by_httpx] == []


def test_the_probe_sees_the_command_and_rich_when_they_are_loaded() -> None:
    loaded = loaded_after("import throttle_client.cli, rich.live")
    assert {"throttle_client.cli.command", "rich.live"} <= set(loaded)


def imports(path: Path) -> list[tuple[str, str | None]]:
    """(module, name) for every import in ``path``, a module of the flat package
    ``throttle_client.cli``, relative ones made absolute; name is None for ``import m``."""
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = "throttle_client.cli".rsplit(".", node.level - 1)[0]
                module = f"{base}.{module}" if module else base
            found += [(module, alias.name) for alias in node.names]
    return found


# -- only public names, as it runs ----------------------------------------------------------

TOKEN = "ghp_guarded_token_0b7e"

# Every subcommand, on a store that holds a key with a card, a label, slots used and
# booked ahead, a pause and a history (so that status, top and history have each thing
# to show); the exit statuses, as the last line.
EVERY_SUBCOMMAND = f"""
import json, sys
from throttle_client import Limiter, SQLiteBackend
from throttle_client.cli.command import main

store, picture = sys.argv[1:]
with SQLiteBackend(store) as backend:
    limiter = Limiter(backend, rates=["3/second", "50/minute"], namespace="guarded",
                      history=True, label=lambda key: "account 7", sleep=lambda s: None)
    for _ in range(4):
        limiter.acquire({TOKEN!r})
    limiter.pause({TOKEN!r}, 30)
stored = ["--sqlite", store]
keys = [*stored, "--namespace", "guarded", {TOKEN!r}]
runs = [
    ["demo", "--duration", "1", "--workers", "2", "--tokens", "1", "--json", "--plot", picture],
    ["status", *keys], ["status", "--json", *keys],
    ["top", "--iterations", "1", *stored], ["top", "--json", *stored],
    ["history", *keys], ["history", "--json", *keys],
    ["reset", *keys],
]
print(json.dumps([main(args) for args in runs]))
"""


def test_the_command_touches_no_private_name_of_the_library(tmp_path: Path) -> None:
    """Every subcommand runs with the guard of ``tests/private_names.py`` in every process
    (the demo's crawlers too, through a ``sitecustomize``): a private name of the library
    that the command reads, imports or overrides is reported."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import tests.private_names\n")
    report = tmp_path / "private-names.txt"
    path = os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", EVERY_SUBCOMMAND, str(tmp_path / "limits.db"),
         str(tmp_path / "quota.png")],
        env={**os.environ, "PYTHONPATH": path, "PRIVATE_NAMES_REPORT": str(report)},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == [0] * 8, result.stdout + result.stderr
    # The command's own process, the demo's upstream and its two crawlers, at least.
    assert len((tmp_path / "private-names.txt.processes").read_text().split()) >= 4
    assert not report.exists(), "".join(sorted(set(report.read_text().splitlines(True))))


PROBE = """
import httpx
import throttle_client
from throttle_client import Limiter, MemoryBackend, ThrottledTransport, store_key
from throttle_client import testing

limiter = Limiter(MemoryBackend(), rates="10/second")
limiter.acquire("k")
limiter.usage("k"), limiter.usage(store_key=store_key("k")), limiter.rates
limiter._local()
throttle_client._limiter
from throttle_client._keys import SECRET_ENV
from throttle_client import _rate
from throttle_client import hashed_key


class Watched(Limiter):
    def _perform(self, step):
        return super()._perform(step)


upstream = httpx.MockTransport(lambda request: httpx.Response(200))
watched = Watched(MemoryBackend(), rates="10/second")
with httpx.Client(transport=ThrottledTransport(watched, transport=upstream)) as client:
    client.get("https://api.example.com/", headers={"Authorization": "Bearer t"})
"""


def test_the_guard_finds_each_way_to_a_private_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """Code run as a module of the command: what it touches of the library's private
    names is found, each once; its public calls, and the library's own private names
    as the library reads them, are not."""
    # A name of the package that is not in its __all__ (there is none today).
    monkeypatch.setattr(throttle_client, "hashed_key", lambda *args: "", raising=False)
    uninstall = private_names.install()
    try:
        private_names.found.clear()
        module = {"__name__": "throttle_client.cli.probe", "__package__": "throttle_client.cli"}
        exec(compile(PROBE, "probe.py", "exec"), module)
    finally:
        uninstall()
    assert [line.partition(": ")[2] for line in private_names.found] == [
        "reads Limiter._local",
        "reads throttle_client._limiter",
        "imports throttle_client._keys",
        "reads throttle_client._rate",
        "imports hashed_key from throttle_client, which is not in its __all__",
        "the library reads _perform, which the command's Watched defines over the library's own",
    ]
    assert private_names.found[0].startswith("throttle_client.cli.probe:")


@pytest.mark.parametrize("name", ["demo", "upstream"])
def test_the_demo_and_its_upstream_do_not_import_the_command(name: str) -> None:
    # The command imports the demo; an import back (the package's __init__ imports the
    # command) would be a cycle.
    targets = {module for module, _ in imports(CLI / f"{name}.py")}
    targets |= {f"{module}.{name}" for module, name in imports(CLI / f"{name}.py") if name}
    assert not targets & {"throttle_client.cli", "throttle_client.cli.command"}


def test_the_import_reader_finds_the_command(tmp_path: Path) -> None:
    bad = tmp_path / "demo.py"
    bad.write_text("from .upstream import StrictUpstream\nfrom . import command\n")
    assert ("throttle_client.cli", "command") in imports(bad)
