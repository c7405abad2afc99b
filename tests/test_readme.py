"""The README's test command is what CI (`.ci/run`) runs: read from the README itself.
(Its Python examples run in tests/test_docs.py, with the site's.)"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def readme_test_commands(readme: str) -> tuple[list[str], list[str]]:
    """The README's install and test commands: the second line of its first bash block,
    ``pip install ... && <test command>``, split as a shell splits them."""
    first = re.search(r"```bash\n(.*?)```", readme, re.DOTALL)
    assert first is not None
    install, _, test = first[1].splitlines()[1].partition("#")[0].partition("&&")
    return shlex.split(install), shlex.split(test)


def ci_dry_run(root: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(root / ".ci" / "run")],
        env={**os.environ, "CI_DRY_RUN": "1", "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )


def ci_commands(root: Path, tmp_path: Path) -> list[list[str]]:
    """What ``.ci/run`` in ``root`` would run, in order, from its dry run: each command's
    words. The apt-get installs, which depend on what the machine already has, are left
    out."""
    result = ci_dry_run(root, tmp_path)
    assert result.returncode == 0, result.stderr
    commands = [shlex.split(line) for line in result.stdout.splitlines() if line]
    return [words for words in commands if words[0] != "apt-get"]


def expected_ci(install: list[str], test: list[str], tmp_path: Path) -> list[list[str]]:
    """What CI runs for a README whose test line is ``install && test``, but for the
    files of the oldest-dependencies run."""
    assert install[:2] == ["pip", "install"]
    oldest = f"{tmp_path}/throttle-client-oldest"
    quiet = ["--quiet", "--disable-pip-version-check"]
    return [
        # The README's install, upgrading what is installed to the newest allowed.
        ["python3", "-m", "pip", "install", *quiet, "--upgrade", "--upgrade-strategy",
         "eager", *install[2:]],
        # The documentation site, built with every warning an error.
        ["python3", "-m", "pip", "install", *quiet, "--upgrade", "-e", ".[docs]"],
        ["python3", "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir",
         f"{tmp_path}/throttle-client-site"],
        ["python3", "-m", "tests.tls"],  # the TLS redis-server, built before the suite
        test,
        [*test, "-m", "slow"],
        ["python3", "-m", "venv", oldest],
        [f"{oldest}/bin/python", "-m", "pip", "install", *quiet, "-c", ".ci/oldest.txt",
         *install[2:]],
    ]  # fmt: skip


def test_ci_runs_the_readme_test_command_then_its_second_tier_then_the_oldest_dependencies(
    tmp_path: Path,
) -> None:
    install, test = readme_test_commands(README.read_text())
    assert install == ["pip", "install", "-e", ".[test]"] and test == ["pytest"]
    commands = ci_commands(ROOT, tmp_path)
    assert commands[:-2] == expected_ci(install, test, tmp_path)
    # Both tiers of the layers that talk to the dependencies, on their oldest versions,
    # each in a run of its own (the default tier, then -m slow), on the same files.
    python = f"{tmp_path}/throttle-client-oldest/bin/python"
    pytest = [python, "-m", "pytest", "-p", "no:cacheprovider"]
    default, slow = commands[-2:]
    assert default[:5] == pytest and slow[:7] == [*pytest, "-m", "slow"]
    files = default[5:]
    assert files == slow[7:]
    assert files and all((ROOT / name).is_file() for name in files), files


def test_ci_takes_the_test_command_from_the_readme(tmp_path: Path) -> None:
    """A README that says another test command makes CI run that one: the two cannot
    disagree."""
    copy = tmp_path / "repo"
    (copy / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "run", copy / ".ci" / "run")
    readme = README.read_text()
    said = "pip install -e '.[test]' && pytest"
    assert said in readme
    readme = readme.replace(said, "pip install -e '.[test,bench]' && pytest -x -q", 1)
    (copy / "README.md").write_text(readme)
    install, test = readme_test_commands(readme)
    assert (install, test) == (["pip", "install", "-e", ".[test,bench]"], ["pytest", "-x", "-q"])
    assert ci_commands(copy, tmp_path)[:-2] == expected_ci(install, test, tmp_path)
    # A README without a test command there: CI says so and runs nothing.
    for broken in ["&& pytest -x -q", "pytest -x -q"]:
        (copy / "README.md").write_text(readme.replace(broken, "", 1))
        result = ci_dry_run(copy, tmp_path)
        assert result.returncode == 2 and result.stdout == "", result.stderr
        assert "README.md's first bash block has no second line" in result.stderr


def collected(*options: str) -> set[str]:
    """The ids of the tests in tests/test_cli.py that the README's test command, with
    ``options``, would run."""
    _, test = readme_test_commands(README.read_text())
    assert test[0] == "pytest"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", *test[1:], *options, "--collect-only", "-q", "-n",
         "0", "-p", "no:cacheprovider", "tests/test_cli.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return {line for line in result.stdout.splitlines() if "::" in line}


def test_the_second_tier_runs_what_the_first_leaves_out() -> None:
    first, second, every = collected(), collected("-m", "slow"), collected("-m", "")
    assert second and first and not first & second
    assert first | second == every
