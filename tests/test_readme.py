"""The README's Python examples run as written, pointed at this suite's servers."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from throttle_client import Limiter, RedisBackend
from throttle_client.cli.upstream import StrictUpstream

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)


def taken(limiter: Limiter) -> int:
    """Units of the token's first rate in slots up to now or booked ahead."""
    usage = limiter.usage("ACCESS-TOKEN").rates[0]
    return usage.used + usage.booked


def test_the_readme_opens_with_the_live_demo_then_the_suite_ci_runs() -> None:
    first = re.search(r"```bash\n(.*?)```", README.read_text(), re.DOTALL)
    assert first is not None
    commands = [line.partition("#")[0].strip() for line in first[1].splitlines()]
    # The live view needs rich, which only the cli extra installs.
    assert commands == [
        "pip install -e '.[cli]' && throttle-client demo",
        "pip install -e '.[test]' && pytest",
    ]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "-e '.[test]'" in ci and "\npytest\n" in ci
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(dep.startswith("rich") for dep in project["dependencies"])
    assert any(dep.startswith("rich") for dep in project["optional-dependencies"]["cli"])
    assert "throttle-client[cli]" in project["optional-dependencies"]["test"]


def test_the_readme_has_sync_and_async_examples() -> None:
    assert len(BLOCKS) >= 2
    assert any("asyncio.run" in block for block in BLOCKS)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index: int, redis_url: str) -> None:
    with StrictUpstream(rates=["100/second"]) as upstream:
        source = BLOCKS[index].replace("redis://localhost:6379/0", redis_url)
        source = source.replace("https://api.example.com", upstream.url)
        namespace: dict[str, object] = {"__name__": f"readme_{index}"}
        exec(compile(source, f"README.md block {index}", "exec"), namespace)
        limiter = namespace.get("limiter")
        if "fetch" in namespace:  # the decorated function: call it once, for real
            fetch = namespace["fetch"]
            assert callable(fetch) and isinstance(limiter, Limiter)
            before = taken(limiter)
            assert b'"ok": true' in fetch("ACCESS-TOKEN", f"{upstream.url}/items")
            assert taken(limiter) == before + 1  # one call, one slot: not counted twice
        stats = upstream.stats()
        # The sync snippet keeps clients and a Redis connection for the process's life.
        for client in namespace.values():
            if isinstance(client, httpx.Client):
                client.close()
        if isinstance(limiter, Limiter) and isinstance(limiter.backend, RedisBackend):
            limiter.backend.close()
    assert stats["rejected"] == 0
    if "httpx" in BLOCKS[index]:  # an HTTP example (the others assert on their own)
        assert stats["admitted"] >= 1  # the example did reach the upstream
