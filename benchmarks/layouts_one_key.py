"""A key's log and its state in one key or in two: the store's cost of each, measured.

The script keeps a key in two: L, the log (a sorted set), and M, its state (msgpack),
given one TTL together. Two keys can come apart (one evicted, one expired first, one
lost in a failover), which is why every decision checks L's newest entry against M.
One key cannot: M would be a member of L itself, scored below every slot (-1), read
with L's lowest rank and replaced in the same ZADD that books the call.

Both layouts run here as minimal scripts of the same plain decision (one sliding
rate: read the state, book the call, write the state; no window lookups, which are the
same in both), on one key, then on many keys, and the store's time per decision
(``INFO commandstats``) and memory (``MEMORY USAGE``) are printed. Starts its own
redis-server (needs Redis >= 7: FCALL) on a free loopback port.

    python benchmarks/layouts_one_key.py [--redis-server PATH]
"""

from __future__ import annotations

import argparse
import subprocess

import redis

from throttle_client.testing import RedisServer

# The state as today's meta holds it: a tag and 16 numbers (µs, totals) and a nil.
STATE = """
local function state(slot, total)
  return cmsgpack.pack('tc2', slot, total, 0, 0, 1795838172064415, 1795838192064415, 0, 0,
                       0, 0, 1795838172064415, 0, -1, nil, 0, 1)
end
local function now()
  local t = redis.call('TIME')
  return t[1] * 1000000 + t[2]
end
"""

# Two keys: TIME, GET M, ZRANGE (L's newest, checked against M), ZADD, SET M KEEPTTL.
TWO = """
local function two(keys, args)
  local t = now()
  local m = redis.call('GET', keys[2])
  local total = 0
  if m then total = select(3, cmsgpack.unpack(m)) end
  local top = redis.call('ZRANGE', keys[1], -1, -1, 'WITHSCORES')
  if top[1] and struct.unpack('>I6', top[1]) ~= total then return redis.error_reply('apart') end
  total = total + 1
  redis.call('ZADD', keys[1], t, struct.pack('>I6', total))
  redis.call('SET', keys[2], state(t, total), 'KEEPTTL')
  return total
end
"""

# One key: TIME, ZRANGE L 0 0 (the state, scored -1), ZREMRANGEBYSCORE -1 -1 (the old
# state), ZADD of the call and the new state together.
ONE = """
local function one(keys, args)
  local t = now()
  local low = redis.call('ZRANGE', keys[1], 0, 0, 'WITHSCORES')
  local total, held = 0, low[2] == '-1'
  if held then total = select(3, cmsgpack.unpack(low[1])) end
  total = total + 1
  if held then redis.call('ZREMRANGEBYSCORE', keys[1], -1, -1) end
  redis.call('ZADD', keys[1], t, struct.pack('>I6', total), -1, state(t, total))
  return total
end
"""

LIBRARY = (
    "#!lua name=layouts\n"
    + STATE
    + TWO
    + ONE
    + "redis.register_function('two', two)\nredis.register_function('one', one)\n"
)


def script_us(conn: redis.Redis) -> float:
    stats = conn.info("commandstats")
    return float(stats["cmdstat_fcall"]["usec_per_call"])


def run(conn: redis.Redis, layout: str, keys: int, calls: int) -> tuple[float, float]:
    """Script µs per decision, and bytes per key, for ``calls`` decisions over ``keys``
    keys (round robin)."""
    conn.flushall()
    conn.config_resetstat()
    pipe = conn.pipeline(transaction=False)
    for i in range(calls):
        tag = f"{{k{i % keys}}}"
        if layout == "two":
            pipe.fcall("two", 2, f"tc:{tag}:log", f"tc:{tag}:meta")
        else:
            pipe.fcall("one", 1, f"tc:{tag}:log")
        if i % 1000 == 999:
            pipe.execute()
    pipe.execute()
    per_call = script_us(conn)
    used = sum(conn.memory_usage(name, samples=0) or 0 for name in conn.scan_iter(count=1000))
    return per_call, used / keys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-server", default=None, help="the redis-server to start")
    options = parser.parse_args()
    with RedisServer(binary=options.redis_server) as server:
        conn = redis.Redis.from_url(server.url)
        version = conn.info("server")["redis_version"]
        conn.function_load(LIBRARY, replace=True)
        print(f"redis-server {version}: a plain decision's store cost, by layout")
        print(f"  {'layout':<16} {'case':<26} {'script µs':>10} {'bytes/key':>10}")
        for keys, calls, case in [
            (1, 20000, "1 key, 20000 calls"),
            (1000, 20000, "1000 keys, 20 calls each"),
            (20000, 20000, "20000 keys, 1 call each"),
        ]:
            for layout, name in (("two", "L and M (today)"), ("one", "M inside L")):
                us, size = run(conn, layout, keys, calls)
                print(f"  {name:<16} {case:<26} {us:>10.2f} {size:>10.0f}")


if __name__ == "__main__":
    try:
        main()
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"redis-server failed: {exc}") from exc
