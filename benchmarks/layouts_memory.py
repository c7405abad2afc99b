"""Memory per logged call of sorted-set layouts a log could use.

Starts its own redis-server (``/usr/bin/redis-server`` on port 7555: pass another as
the first argument) and prints ``MEMORY USAGE`` per call for 5000 entries per layout.

    python benchmarks/layouts_memory.py [/path/to/redis-server]
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import time

import redis

from throttle_client._redis_server import free_port

N = 5000
T0 = 1_800_000_000_000_000  # slots in epoch µs, 1 ms apart


def call_id() -> str:
    return base64.urlsafe_b64encode(os.urandom(8))[:11].decode()


def main() -> None:
    binary = sys.argv[1] if len(sys.argv) > 1 else "/usr/bin/redis-server"
    port = free_port()
    args = [binary, "--port", str(port), "--save", "", "--appendonly", "no"]
    server = subprocess.Popen(args, stdout=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        r = redis.Redis(port=port)
        layouts = {
            "the old layout: s<cum> (score slot) and c<id> (score -cum)": lambda i: {
                f"s{i:015d}": T0 + i * 1000,
                "c" + call_id(): -i,
            },
            "one member: the running total (score slot)": lambda i: {str(i): T0 + i * 1000},
            "one member: the running total, 6 bytes (today's layout)": lambda i: {
                i.to_bytes(6, "big"): T0 + i * 1000
            },
            "one member: the call id (score slot)": lambda i: {call_id(): T0 + i * 1000},
            "one member: 6 chars of the id + the total": lambda i: {
                call_id()[:6] + str(i): T0 + i * 1000
            },
        }
        for n, (name, member) in enumerate(layouts.items()):
            pipe = r.pipeline()
            for i in range(1, N + 1):
                pipe.zadd(f"layout{n}", member(i))
            pipe.execute()
            used = r.memory_usage(f"layout{n}", samples=0)
            print(f"{used / N:7.1f} B per call  {name}")
        pipe = r.pipeline()
        for i in range(1, N + 1):
            pipe.rpush("packed", (T0 + i * 1000).to_bytes(8, "big") + i.to_bytes(8, "big"))
        pipe.execute()
        used = r.memory_usage("packed", samples=0)
        print(f"{used / N:7.1f} B per call  a list of packed (slot, cum) pairs")
    finally:
        server.terminate()


if __name__ == "__main__":
    main()
