"""Every example runs as it stands (``python examples/NAME.py``) and says it succeeded.

Each example starts the servers it needs and checks its own outcome (exit status 1
when the upstream refused a call it should not have), so this only runs them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# The second tier (pytest -m slow): see pyproject.toml.
pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

EXPECTED = {
    "github_limits.py": [
        "210 calls in",
        "refused by the API (429): 0",
        "OK: every token kept all four of GitHub's limits",
    ],
    "multiprocess_crawler.py": [
        "4 worker processes sent 40 requests",
        "answered 200: 40; refused by the API (429): 0",
        "OK: every token's quota was shared and never exceeded",
    ],
    "async_crawler.py": [
        "36 pages over 3 tokens",
        "final statuses: {200: 36}",
        "OK: every refused request was retried after the shared pause",
    ],
    "decorated_fetch.py": [
        "threads: 16 calls of fetch()",
        "asyncio: 16 calls of afetch()",
        "refused by the API (429): 0",
        "OK: every call waited for its slot",
    ],
    "learned_limits.py": [
        "4 worker threads, configured for 800/1s per token; the API allows 400/1s",
        "refused by the API (429): 0 before the fleet's first answer, 0 after it",
        "OK: the workers held to the limit the API stated",
    ],
    "github_like.py": [
        "58 answered 200",
        "core calls: 40, search calls: 18",
        "refused by the API (429): 0",
        "OK: both quotas of every token were honoured",
    ],
    "token_pool.py": [
        "8 threads, 40 tokens of 4/s (>= 0.1s apart)",
        "refused by the API (429): 0",
        "OK: the pool used its tokens' quota as one",
    ],
    "aiohttp_crawl.py": [
        "12 tasks, 3 tokens of 5/s (>= 0.1s apart)",
        "429s sent by the API: 3, passed to callers: 0",
        "OK: every token paused once, no 429 reached a caller",
    ],
    "requests_crawl.py": [
        "6 threads, 3 tokens of 5/s (>= 0.1s apart)",
        "429s sent by the API: 3, passed to callers: 0",
        "OK: every token paused once, no 429 reached a caller",
    ],
    "priority_crawl.py": [
        "10 crawl threads and one user, 4 tokens of 5/s (>= 0.1s apart), their account 12/s",
        "OK: the crawl used the account's quota, and the user's requests went first",
    ],
    "calendar_quota.py": [
        "Sun 08 Mar        40     23  00:00:00.050   Mon 09 Mar 00:00 PDT",
        "refused by the API (429): 0",
        "admitted Sat 28 Feb 00:00, window resets at Mon 30 Mar 00:00 UTC",
        "OK: every Pacific day got its quota from local midnight, every month from the 30th",
    ],
}


def test_every_example_is_covered():
    assert sorted(path.name for path in EXAMPLES.glob("*.py")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_runs(name):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=EXAMPLES.parent,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for line in EXPECTED[name]:
        assert line in result.stdout, result.stdout + result.stderr
