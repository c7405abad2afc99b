"""The store commands one plain decision runs inside the script, counted with MONITOR.

A plain decision: one sliding rate, the defaults (no cap, no stacked key, no calendar or
bounded rate, no learned limit, no usage history). Counted on a key's first call, in
steady state (a call on a key that has a log), and on a refusal (a spent key); beside
them, limits' moving window (``hit``), whose script the same MONITOR watches. Starts its
own redis-server on a free loopback port.

    python benchmarks/commands.py [--redis-server PATH]
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable

import httpx
import redis

from throttle_client import Limiter, RedisBackend, ThrottledTransport
from throttle_client.testing import RedisServer


def counted(url: str, client: redis.Redis, call: Callable[[], object]) -> list[str]:
    """The commands scripts ran while ``call`` ran (MONITOR's "lua" entries)."""
    monitor = redis.Redis.from_url(url, decode_responses=True)
    seen: list[tuple[str, str]] = []
    with monitor.monitor() as feed:

        def listen() -> None:
            for event in feed.listen():
                seen.append((event.get("client_type", ""), event["command"]))
                if "monitor-done" in event["command"]:
                    return

        thread = threading.Thread(target=listen, daemon=True)
        thread.start()
        time.sleep(0.1)  # (MONITOR is on before the call)
        call()
        client.echo("monitor-done")
        thread.join(10)
    monitor.close()
    return [command.split()[0] for kind, command in seen if kind == "lua"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-server", default=None, help="the redis-server binary")
    args = parser.parse_args()
    with RedisServer(binary=args.redis_server) as server:
        client = redis.Redis.from_url(server.url)
        version = client.info("server")["redis_version"]
        plain = Limiter(RedisBackend(client), rates=["1000000/hour"], namespace="plain")
        spent = Limiter(RedisBackend(client), rates=["1/hour"], namespace="spent")
        spent.try_acquire("spent key")
        rows = [
            ("throttle_client, a key's first call", lambda: plain.try_acquire("new key")),
            ("throttle_client, steady", lambda: plain.try_acquire("new key")),
            ("throttle_client, refused", lambda: spent.try_acquire("spent key")),
        ]
        try:
            from limits import parse, storage, strategies

            window = strategies.MovingWindowRateLimiter(storage.RedisStorage(server.url))
            item = parse("1000000/hour")
            window.hit(item, "warm")  # (its scripts loaded)
            rows.append(("limits moving window, hit", lambda: window.hit(item, "key")))
        except ImportError:
            print("(limits is not installed: pip install -e '.[bench]' to count it beside)")
        print(f"redis-server {version}: commands a script runs per decision (MONITOR)")
        for name, call in rows:
            commands = counted(server.url, client, call)
            print(f"  {name:38s} {len(commands):2d}  {' '.join(commands)}")
        # A key used at its full rate: its window reaches into its log, so the running
        # total at the window's start is looked up (and, once the window is full, when it
        # frees); and a key's card (its label and rules, for operators) goes with a
        # decision every half of its longest window: on a short window, that is often.
        fast = Limiter(RedisBackend(client), rates=["20/second"], namespace="fast")
        fast.try_acquire("fast key")

        def paced() -> None:
            for _ in range(40):
                fast.acquire("fast key")

        commands = counted(server.url, client, paced)
        print(f"  {'throttle_client, 20/second, 40 calls':38s} {per_call(commands, 40)}")
        # Requests through ThrottledTransport: its decisions also mark where a limit
        # learned from the response would count from (``margin`` before the slot).
        sent = Limiter(RedisBackend(client), rates=["1000000/hour"], namespace="sent")
        answer = httpx.MockTransport(lambda request: httpx.Response(200))
        headers = {"Authorization": "Bearer T"}
        http = httpx.Client(transport=ThrottledTransport(sent, transport=answer), headers=headers)
        http.get("https://api.example.com/")
        for name, apart in [("50 ms apart", 0.05), ("back to back", 0.0)]:

            def requests(apart: float = apart) -> None:
                for _ in range(20):
                    http.get("https://api.example.com/")
                    time.sleep(apart)

            commands = counted(server.url, client, requests)
            label = f"ThrottledTransport, {name}, 20 calls"
            print(f"  {label:38s} {per_call(commands, 20)}")
        http.close()


def per_call(commands: list[str], calls: int) -> str:
    each = ", ".join(f"{name} {commands.count(name)}" for name in sorted(set(commands)))
    return f"{len(commands) / calls:4.2f} a call on average ({each})"


if __name__ == "__main__":
    main()
