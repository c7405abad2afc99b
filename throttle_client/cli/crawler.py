"""The demo's crawler processes: each fetches pages for its tokens through
``ThrottledTransport``, counts what went over the wire in counters it shares with the
parent, and reports the slot of every request it sent.

A crawler is started by :func:`~throttle_client.cli.demo.run_demo` in a fresh
interpreter (``spawn``) with a :class:`CrawlPlan`; it opens the shared store itself.
"""

from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import httpx

from throttle_client import Event, Limiter, Rate, ThrottledTransport, ThrottleTimeout

from .settings import FIELDS, OK, REFUSED, SENT, WAITING, Store
from .summary import quiet


@dataclass(frozen=True)
class CrawlPlan:
    index: int
    store: Store
    namespace: str
    rates: tuple[Rate, ...]
    min_interval: float
    margin: float
    duration: float
    upstream_url: str
    tokens: tuple[tuple[int, str], ...]  # (token number, token) this crawler fetches for


@dataclass
class CrawlReport:
    index: int
    slots: dict[int, list[float]] = field(default_factory=dict)  # token number -> slots
    error: str | None = None


class _Waiting:
    """Whether one crawler thread's request is waiting for its slot, kept in the shared
    count of its token's waiting crawlers (each thread fetches for one token)."""

    def __init__(self, counters: Any, number: int) -> None:
        self._counters = counters
        self._field = number * FIELDS + WAITING
        self._waiting = False

    def set(self, waiting: bool) -> None:
        if waiting != self._waiting:
            self._waiting = waiting
            with self._counters.get_lock():
                self._counters[self._field] += 1 if waiting else -1


class _CountingTransport(httpx.BaseTransport):
    """Counts what really went over the wire, 429s included, before any retry. It is
    called once a request has its slot: the request no longer waits, until a 429 sends
    it back to the limiter for another."""

    def __init__(self, counters: Any, numbers: dict[str, int], waiting: _Waiting) -> None:
        self._inner = httpx.HTTPTransport()
        self._counters = counters
        self._numbers = numbers
        self._waiting = waiting

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        token = request.headers["Authorization"].partition(" ")[2]
        if token not in self._numbers:
            return self._inner.handle_request(request)  # a warm-up request, not the crawl's
        self._waiting.set(False)
        response = self._inner.handle_request(request)
        base = self._numbers[token] * FIELDS
        with self._counters.get_lock():
            self._counters[base + SENT] += 1
            self._counters[base + (REFUSED if response.status_code == 429 else OK)] += 1
        if response.status_code == 429:
            self._waiting.set(True)  # retried through the limiter, unless the attempts ran out
        return response

    def close(self) -> None:
        self._inner.close()


def crawl(plan: CrawlPlan, counters: Any, barrier: Any, results: Any) -> None:
    """Crawler process: one thread per token, each fetching pages until the deadline."""
    quiet()  # 429s are counted and shown by the parent; log lines would garble its display
    report = CrawlReport(plan.index)
    try:
        limiter = Limiter(
            plan.store.open(),
            rates=plan.rates,
            min_interval=plan.min_interval,
            margin=plan.margin,
            namespace=plan.namespace,
        )
        numbers = {token: number for number, token in plan.tokens}
        # The slot each request of the crawl got, from the limiter's events (which name a
        # key by its label, never the token).
        by_label = {limiter.label(token): number for token, number in numbers.items()}

        def keep_slot(event: Event) -> None:
            number = by_label.get(event.key)
            if event.kind == "admitted" and number is not None:
                report.slots[number].append(event.slot)

        limiter.listen(keep_slot)
        for number, token in plan.tokens:
            report.slots[number] = []
            limiter.usage(token)  # open the store before the start, writing nothing
        errors: list[str] = []

        waiting = {number: _Waiting(counters, number) for number in numbers.values()}
        clients = [
            httpx.Client(
                transport=ThrottledTransport(
                    limiter, transport=_CountingTransport(counters, numbers, waiting[number])
                ),
                base_url=plan.upstream_url,
                headers={"Authorization": f"Bearer {token}"},
                timeout=30,
            )
            for number, token in plan.tokens
        ]
        for number, client in zip(numbers.values(), clients, strict=True):
            # Open the connection and run every code path once before the start, under a
            # key of its own: a first request is slow, and would arrive late after its slot.
            warm_up = {"Authorization": f"Bearer warm-up-{plan.namespace}-{plan.index}-{number}"}
            client.get("/warm-up", headers=warm_up).read()

        def fetch(client: httpx.Client, waits: _Waiting, deadline: float) -> None:
            try:
                page = 0
                while (left := deadline - time.monotonic()) > 0:
                    page += 1
                    waits.set(True)
                    # No slot past the end: one would stretch the run (with 1/second, two
                    # crawlers of one token and --duration 0.5, the second would book 1 s,
                    # the first then 2 s).
                    params, wait = {"page": page}, {"acquire_timeout": left}
                    client.get("/items", params=params, extensions=wait).read()
                    waits.set(False)
            except ThrottleTimeout:
                pass  # the next slot lies after the end: this crawler is done
            except Exception:
                errors.append(traceback.format_exc())
            finally:
                waits.set(False)
                client.close()

        barrier.wait(timeout=120)
        deadline = time.monotonic() + plan.duration
        threads = [
            threading.Thread(target=fetch, args=(client, waiting[number], deadline), daemon=True)
            for (number, _), client in zip(plan.tokens, clients, strict=True)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            report.error = errors[0]
    except BaseException:
        report.error = traceback.format_exc()
        barrier.abort()
    results.put(report)
