"""GitHub's documented limits for one token, kept by a fleet of tokens, scaled to seconds.

GitHub's REST API allows, per token:

* 5000 requests per hour (the primary limit);
* at most 100 requests in flight at once (a secondary limit);
* 900 points per minute per endpoint, a GET (HEAD, OPTIONS) costing 1 point and a
  write (POST, PATCH, PUT, DELETE) 5 (a secondary limit);
* at least 1 second between writes (a secondary limit on content-creating requests).

Three limiters on one store express them, each keyed through the request's token:

* ``token``: ``rates=[5000/hour], max_concurrent=100``, keyed by the token. A request
  holds a lease on it from admission until its response is closed.
* ``points``: ``rates=[900/minute]``, keyed by token + endpoint path, charged through
  ``also=`` with a cost function of the request (1 for a read, 5 for a write).
* ``writes``: ``min_interval=1 s``, keyed by the token, for writes only.

What cannot be said exactly with the library as it stands:

* Writes are told apart by a ``Route(writes, methods=...)``: a write goes through the
  writes limiter and is charged to the token (the route's ``also=``) and to its
  endpoint's points (the transport's ``also=``), all in one atomic step.
* "Endpoint" is keyed here by the request's concrete path, whatever the method:
  GitHub does not say whether it means the path template (``/repos/{o}/{r}/issues``)
  or counts methods apart. Keying by path is exact when each endpoint is one path,
  conservative when GitHub counts methods apart, and too generous when it counts a
  template over many paths (then key by the template, e.g. with a regex).
* A limiter needs a rate: the writes limiter gets the token's own hourly one, which
  never binds there (writes are among the token's requests). GitHub also documents
  80 content-creating requests per minute and 500 per hour: add them to its rates.
* GitHub's other secondary limit, 90 s of its CPU time per 60 s, cannot be known by
  a client; only its 403/429 with ``Retry-After`` can (the transport pauses the
  token for every worker then: a write's own limiter is the writes one, so its route
  names the token too, with ``pauses=``).

``SCALE`` is the same set of rules scaled down so that each binds within about
three seconds: an hour becomes 3 s, a minute 1 s, a second 0.2 s; the counts
become 60 requests, 4 in flight and 30 points. A local API (``GitHubLikeAPI``)
enforces exactly those rules by the arrival time of each request and answers 429
beyond any of them; the fleet must get none.

    python examples/github_limits.py [--tokens 3] [--redis redis://localhost:6379/0]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time
from collections import defaultdict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from throttle_client import (
    Backend,
    Limiter,
    MemoryBackend,
    Rate,
    RedisBackend,
    Route,
    ThrottledTransport,
    request_key,
)

WRITES = frozenset({"POST", "PATCH", "PUT", "DELETE"})


@dataclass(frozen=True)
class Rules:
    hourly: Rate  # requests per token
    concurrent: int  # requests in flight per token
    points: Rate  # points per token and endpoint
    write_gap: float  # seconds between two writes of a token
    read_cost: int = 1
    write_cost: int = 5

    def cost(self, method: str) -> int:
        return self.write_cost if method.upper() in WRITES else self.read_cost


GITHUB = Rules(hourly=Rate(5000, 3600), concurrent=100, points=Rate(900, 60), write_gap=1.0)
SCALE = Rules(hourly=Rate(60, 3), concurrent=4, points=Rate(30, 1), write_gap=0.2)


# -- the client side: what a fleet configures ---------------------------------------


def endpoint_key(request: httpx.Request) -> str:
    return f"{request_key(request)} {request.url.path}"


def github_client(
    backend: Backend, rules: Rules = GITHUB, *, margin: float | None = None, **kwargs: Any
) -> httpx.Client:
    """An httpx.Client that keeps ``rules`` for every token it carries, with every
    other client (in any process) on the same ``backend``. ``margin``: how late after
    its slot a request may reach the API (the limiters' margin; None: their default)."""
    widened: dict[str, Any] = {} if margin is None else {"margin": margin}
    token = Limiter(
        backend,
        rates=[rules.hourly],
        max_concurrent=rules.concurrent,
        namespace="gh-token",
        **widened,
    )
    points = Limiter(backend, rates=[rules.points], namespace="gh-points", **widened)
    writes = Limiter(
        backend,
        rates=[rules.hourly],
        min_interval=rules.write_gap,
        namespace="gh-writes",
        **widened,
    )
    by_points = (points, endpoint_key, lambda request: rules.cost(request.method))
    # Every request: the token's rate and cap, and its endpoint's points. A write goes
    # through the writes limiter (its gap) and is charged to the token as well.
    transport = ThrottledTransport(
        token,
        also=[by_points],
        routes=[
            Route(
                writes,
                methods=WRITES,
                also=[(token, request_key)],
                pauses=lambda response: [writes, token],  # (secondary limits: the token's)
            )
        ],
    )
    return httpx.Client(transport=transport, **kwargs)


# -- the server side: an API that enforces the rules strictly ------------------------


@dataclass
class TokenLog:
    arrivals: list[float] = field(default_factory=list)  # admitted requests
    points: dict[str, list[tuple[float, int]]] = field(default_factory=dict)  # per endpoint
    writes: list[float] = field(default_factory=list)
    in_flight: int = 0
    peak_in_flight: int = 0
    refused: dict[str, int] = field(default_factory=dict)  # rule broken -> 429s


class GitHubLikeAPI:
    """A server on 127.0.0.1 that answers 200 within ``rules`` and 429 beyond them.

    Every rule is judged on the arrival of a request; a refused request counts in
    none. A request is in flight from its arrival until its answer is written, which
    takes ``latency`` seconds.
    """

    def __init__(self, rules: Rules, latency: float = 0.05, tolerance: float = 0.04) -> None:
        self.rules = rules
        self.latency = latency
        # The rates and the write gap forgive arrivals early by at most ``tolerance`` (as
        # the other examples' StrictUpstream does): a request reaches the API a few ms
        # after its slot, by a delay that varies with the load of this machine (here
        # the API and every client thread share one process). The cap is exact.
        self.tolerance = tolerance
        self.tokens: dict[str, TokenLog] = defaultdict(TokenLog)
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def admit(self, token: str, method: str, path: str, now: float) -> str | None:
        """None when the request is admitted, else the rule it would break."""
        rules, cost = self.rules, self.rules.cost(method)
        with self._lock:
            log = self.tokens[token]
            slack = self.tolerance
            hour = sum(1 for t in log.arrivals if t > now - rules.hourly.period + slack)
            spent = log.points.setdefault(path, [])
            points = sum(c for t, c in spent if t > now - rules.points.period + slack)
            broken = None
            if log.in_flight + 1 > rules.concurrent:
                broken = "concurrent"
            elif hour + 1 > rules.hourly.limit:
                broken = "hourly"
            elif points + cost > rules.points.limit:
                broken = "points"
            elif method in WRITES and log.writes and now - log.writes[-1] < rules.write_gap - slack:
                broken = "write gap"
            if broken:
                log.refused[broken] = log.refused.get(broken, 0) + 1
                return broken
            log.arrivals.append(now)
            spent.append((now, cost))
            if method in WRITES:
                log.writes.append(now)
            log.in_flight += 1
            log.peak_in_flight = max(log.peak_in_flight, log.in_flight)
            return None

    def done(self, token: str) -> None:
        with self._lock:
            self.tokens[token].in_flight -= 1

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def _answer(self) -> None:
                now = time.monotonic()
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                token = self.headers.get("Authorization", "").partition(" ")[2]
                path = self.path.partition("?")[0]
                broken = api.admit(token, self.command, path, now)
                if broken is None:
                    time.sleep(api.latency)
                    api.done(token)  # before the answer: the client then ends its lease
                body = json.dumps({"refused": broken}).encode()
                self.send_response(429 if broken else 200)
                if broken:
                    self.send_header("Retry-After", "1")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _answer

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler

    def __enter__(self) -> GitHubLikeAPI:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


# -- the fleet ---------------------------------------------------------------------------


def jobs_of(token: str) -> list[tuple[str, str, str]]:
    """One token's calls: 70 in all (beyond the scaled hour's 60), 40 reads of one hot
    endpoint and 6 issues created there (70 points: beyond its 30 a second), 20 reads
    elsewhere, 10 writes (a 0.2 s gap apart at least), 8 of them in flight at once."""
    hot = "/repos/octo/hello/issues"
    reads = [("GET", hot)] * 40 + [("GET", f"/repos/octo/hello/pulls/{i}") for i in range(20)]
    writes = [("POST", hot)] * 6 + [("PATCH", f"{hot}/{i}") for i in range(4)]
    mixed = [job for pair in itertools.zip_longest(reads[::6], writes) for job in pair if job]
    rest = [job for i, job in enumerate(reads) if i % 6]
    return [(token, method, path) for method, path in mixed + rest]


@dataclass
class TokenReport:
    sent: int
    refused: int
    refused_by: dict[str, int]  # rule -> 429s
    peak_in_flight: int
    peak_hourly: int  # the most requests any scaled hour held
    peak_points: int  # the most points any scaled minute held on one endpoint
    min_write_gap: float | None
    # The same as the API counts it: its windows forgive arrivals early by its tolerance.
    peak_points_counted: int = 0
    arrivals: list[float] = field(default_factory=list, repr=False)  # admitted, in order


@dataclass
class FleetReport:
    elapsed: float
    statuses: dict[int, int]
    tokens: dict[str, TokenReport]

    @property
    def refused(self) -> int:
        return sum(report.refused for report in self.tokens.values())


def peak(times: list[tuple[float, int]], period: float) -> int:
    """The most cost any window of ``period`` seconds held (arrivals in (t - period, t])."""
    window: deque[tuple[float, int]] = deque()
    held = best = 0
    for t, cost in times:
        window.append((t, cost))
        held += cost
        while window[0][0] <= t - period:
            held -= window.popleft()[1]
        best = max(best, held)
    return best


def run_fleet(
    backend: Backend,
    *,
    tokens: int = 3,
    threads: int = 8,
    rules: Rules = SCALE,
    margin: float | None = None,
) -> FleetReport:
    """``tokens`` tokens' calls (``jobs_of``), ``threads`` threads per token, through
    one ``github_client`` on ``backend`` against a GitHubLikeAPI keeping ``rules``, which
    forgives an arrival up to the limiters' ``margin`` (None: their default, 25 ms) and
    15 ms of its own late."""
    names = [f"ghp_fleetToken{i}" for i in range(tokens)]
    per_token = [jobs_of(name) for name in names]
    jobs = [job for row in itertools.zip_longest(*per_token) for job in row if job]
    api = GitHubLikeAPI(rules, tolerance=0.04 if margin is None else margin + 0.015)
    client = github_client(backend, rules, margin=margin, base_url=api.url)
    with api, client:

        def call(job: tuple[str, str, str]) -> int:
            token, method, path = job
            headers = {"Authorization": f"token {token}"}
            return client.request(method, path, headers=headers).status_code

        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=tokens * threads) as pool:
            statuses = list(pool.map(call, jobs))
        elapsed = time.monotonic() - started

    reports = {}
    for name in names:
        log = api.tokens[name]
        gaps = [b - a for a, b in itertools.pairwise(log.writes)]
        reports[name] = TokenReport(
            sent=len(log.arrivals) + sum(log.refused.values()),
            refused=sum(log.refused.values()),
            refused_by=dict(log.refused),
            peak_in_flight=log.peak_in_flight,
            peak_hourly=peak([(t, 1) for t in log.arrivals], rules.hourly.period),
            peak_points=max(peak(spent, rules.points.period) for spent in log.points.values()),
            min_write_gap=min(gaps) if gaps else None,
            peak_points_counted=max(
                peak(spent, rules.points.period - api.tolerance) for spent in log.points.values()
            ),
            arrivals=list(log.arrivals),
        )
    counts = {status: statuses.count(status) for status in sorted(set(statuses))}
    return FleetReport(elapsed=elapsed, statuses=counts, tokens=reports)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=3)
    parser.add_argument("--redis", metavar="URL", help="share the limits through Redis")
    args = parser.parse_args(argv)
    backend = RedisBackend(args.redis) if args.redis else MemoryBackend()
    report = run_fleet(backend, tokens=args.tokens)
    rules = SCALE
    print(
        f"rules (scaled): {rules.hourly} per token, {rules.concurrent} in flight, "
        f"{rules.points} points per endpoint (write {rules.write_cost}), "
        f"{rules.write_gap:g}s between writes"
    )
    for name, token in report.tokens.items():
        gap = f"{token.min_write_gap:.3f}s" if token.min_write_gap is not None else "-"
        print(
            f"{name}: sent {token.sent}, 429s {token.refused or 0}{token.refused_by or ''}, "
            f"peak in flight "
            f"{token.peak_in_flight}, peak hour {token.peak_hourly}, peak endpoint "
            f"points {token.peak_points}, closest writes {gap}"
        )
    print(f"{sum(report.statuses.values())} calls in {report.elapsed:.1f}s: {report.statuses}")
    print(f"refused by the API (429): {report.refused}")
    ok = report.refused == 0 and set(report.statuses) == {200}
    print("OK: every token kept all four of GitHub's limits" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
