"""Configured like a real API: GitHub's REST quotas, scaled down to run in seconds.

GitHub allows 5000 requests per hour per token, and its search endpoints have a
quota of their own: 30 per minute. It reports the state of each quota in
``X-RateLimit-Remaining`` / ``X-RateLimit-Reset`` (epoch seconds), and refuses with
403 or 429 (with ``Retry-After`` or a spent ``X-RateLimit-Remaining``) beyond it.

Here the core quota becomes 30 per 2 s and search 6 per 2 s, enforced by a local
API (StrictUpstream) that sends the same headers. One ThrottledClient carries both
limiters: a Route sends /search/* to the search limiter, everything else to the
core one, each keyed by the request's token. When a response says a quota is spent,
the client pauses that token for every worker until the reset it announced.

    python examples/github_like.py
"""

from __future__ import annotations

import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from throttle_client import Limiter, MemoryBackend, Rate, RetryPolicy, Route, ThrottledClient
from throttle_client.cli.upstream import StrictUpstream

CORE = Rate(30, 2)  # GitHub: Rate(5000, 3600) per token
SEARCH = Rate(6, 2)  # GitHub: Rate.parse("30/minute") per token, apart from the core quota
TOKENS = ["ghp_exampleTokenOne", "ghp_exampleTokenTwo"]
CORE_CALLS, SEARCH_CALLS = 20, 9  # per token: search asks for more than one window holds


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="  log: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # One backend, two namespaces: the two quotas never share a log. With many
    # processes, use RedisBackend(redis_url) here instead; nothing else changes.
    backend = MemoryBackend()
    core = Limiter(backend, rates=[CORE], namespace="github-core")
    search = Limiter(backend, rates=[SEARCH], namespace="github-search")

    # tolerance: a call reaches the API a few ms after its slot, by a delay that
    # varies, so the API forgives arrivals up to 40 ms early against its windows.
    with (
        StrictUpstream(
            rates=[CORE], path_rates={"/search": [SEARCH]}, send_headers=True, tolerance=0.04
        ) as api,
        ThrottledClient(
            core,
            routes=[Route(search, path="/search")],
            base_url=api.url,
            headers={"Accept": "application/vnd.github+json"},
            retry=RetryPolicy(max_attempts=4, max_pause=3600),  # GitHub resets within the hour
        ) as client,
    ):

        def call(token: str, path: str) -> int:
            headers = {"Authorization": f"token {token}"}  # GitHub's classic scheme
            return client.get(path, headers=headers).status_code

        jobs = [(token, f"/repos/octo/repo-{i}") for token in TOKENS for i in range(CORE_CALLS)]
        jobs += [(token, f"/search/code?q=q{i}") for token in TOKENS for i in range(SEARCH_CALLS)]
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=8) as pool:
            statuses = list(pool.map(lambda job: call(*job), jobs))
        elapsed = time.monotonic() - started
        stats = api.stats()

    searches = sum(n for name, n in stats["per_token"].items() if name.endswith("/search"))
    print(f"{len(statuses)} calls in {elapsed:.1f}s: {statuses.count(200)} answered 200")
    print(f"core calls: {stats['admitted'] - searches}, search calls: {searches}")
    print(f"refused by the API (429): {stats['rejected']}")
    ok = stats["rejected"] == 0 and statuses.count(200) == len(jobs)
    print("OK: both quotas of every token were honoured" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
