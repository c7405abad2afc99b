"""The command's package stands apart: the library never loads it, and it uses the
library only through its public names, as any user's program would."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import throttle_client

CLI = Path(throttle_client.__file__).resolve().parent / "cli"
# Private library names the command's package may import, each with its reason. None.
JUSTIFIED: set[str] = set()


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


def private_imports(path: Path) -> list[str]:
    """What ``path`` imports from the library that is not in ``throttle_client.__all__``
    or a public module (the command's own package aside)."""
    private = []
    for module, name in imports(path):
        if module.split(".")[0] != "throttle_client" or module.startswith("throttle_client.cli"):
            continue
        dotted = f"{module}.{name}" if name else module
        outside_all = module == "throttle_client" and name not in throttle_client.__all__
        if outside_all or any(part.startswith("_") for part in dotted.split(".")[1:]):
            private.append(dotted)
    return private


MODULES = sorted(CLI.glob("*.py"))


def test_every_module_of_the_command_is_checked() -> None:
    assert {"__init__", "command", "demo", "upstream"} <= {path.stem for path in MODULES}


@pytest.mark.parametrize("path", MODULES, ids=lambda path: path.name)
def test_the_command_imports_only_public_library_names(path: Path) -> None:
    assert [name for name in private_imports(path) if name not in JUSTIFIED] == []


@pytest.mark.parametrize("name", ["demo", "upstream"])
def test_the_demo_and_its_upstream_do_not_import_the_command(name: str) -> None:
    # The command imports the demo; an import back (the package's __init__ imports the
    # command) would be a cycle.
    targets = {module for module, _ in imports(CLI / f"{name}.py")}
    targets |= {f"{module}.{name}" for module, name in imports(CLI / f"{name}.py") if name}
    assert not targets & {"throttle_client.cli", "throttle_client.cli.command"}


def test_the_checks_find_what_they_look_for(tmp_path: Path) -> None:
    bad = tmp_path / "demo.py"
    bad.write_text(
        "import throttle_client._keys\n"
        "from .._limiter import WARM_UP\n"
        "from throttle_client import Limiter, hashed_key\n"
        "from .upstream import StrictUpstream\n"
        "from . import command\n"
    )
    assert private_imports(bad) == [
        "throttle_client._keys",
        "throttle_client._limiter.WARM_UP",
        "throttle_client.hashed_key",
    ]
    assert ("throttle_client.cli", "command") in imports(bad)
