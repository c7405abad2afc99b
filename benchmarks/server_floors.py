"""Redis server time per admitted decision: the script beside the floors of its layout.

The aim: the server time of a decision (two rates and a gap) no more than limits' moving
window; where it is more, the floor of the layout shows how much of it any script of
that layout must spend. This starts its own redis-server and measures, one candidate at
a time, ``INFO commandstats``' time per call of the script (which includes the commands
it runs):

  bare EVALSHA        ``return 1``: what any script costs
  floor, 1 member     straight-line Lua doing only what an admission in the one-member
                      layout must: TIME, GET (meta), EXISTS (lost log), ZADD of one
                      member, SET (meta), msgpack in and out, and the reply; no decision
  floor, + id         the same, the ZADD adding the call id beside the entry
  floor, + lookup     the same, plus the one lookup a second, shorter rate costs
  floor, batch of 8   a batch's floor: eight admissions of one key in one
                      script call (TIME, GET, EXISTS once; one ZADD of eight entries and
                      their ids; one SET; eight replies), per admission
  throttle_client     the real script (FCALL on Redis 7): 10**9/hour and 10**9/second
                      and a 1 µs gap
  limits              limits' moving window (``hit``, one rate)

    python benchmarks/server_floors.py [--redis-server PATH] [--calls N]
"""

from __future__ import annotations

import argparse
import platform

import redis

from throttle_client import Limiter, Rate, RedisBackend
from throttle_client._acquiring import acquire_op
from throttle_client.testing import RedisServer

HIGH = 10**9

# What every admission reads (the server's time, the quota, the meta, the lost-log
# check) and writes back (the meta): the same in the floors below.
READ = """
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local quota = cmsgpack.unpack(ARGV[2])
local state = redis.call('GET', KEYS[2])
local last, total, born = -1, 0, now
if state then
  local _
  _, last, total, _, _, _, _, _, _, _, _, born = cmsgpack.unpack(state)
  redis.call('EXISTS', KEYS[1])
end
"""
WRITE = """
local meta = cmsgpack.pack('tc2', slot, total, 0, 0, 0, 0, 0, 0, 0, 0, born, 0, -1)
redis.call('SET', KEYS[2], meta, 'PX', 3600000)
"""

FLOOR = (
    READ
    + """
local slot = math.max(now, last + quota[1])
total = total + 1
local args = {string.format('%d', slot), struct.pack('>I6', total)}
if WITH_ID then args[3], args[4] = string.format('%d', -slot - 1), 'c' .. ARGV[6] end
redis.call('ZADD', KEYS[1], unpack(args))
if WITH_LOOKUP then
  redis.call('ZREVRANGEBYSCORE', KEYS[1], string.format('%d', now - 1000000), 0, 'LIMIT', 0, 1)
end
"""
    + WRITE
    + """
return string.format('%d %d %d %d %d %d', 1, now, slot, 0, 999, 999)
"""
)


# Eight admissions of one key in one call: what a batch op could share (target 4).
BATCH = 8
FLOOR_BATCH = (
    READ
    + """
local args, replies, slot = {}, {}, last
for i = 1, BATCH do
  slot = math.max(now, slot + quota[1])
  total = total + 1
  args[#args + 1] = string.format('%d', slot)
  args[#args + 1] = struct.pack('>I6', total)
  args[#args + 1] = string.format('%d', -slot - 1)
  args[#args + 1] = 'c' .. ARGV[6] .. '.' .. i
  replies[i] = string.format('%d %d %d %d %d %d', 1, now, slot, 0, 999, 999)
end
redis.call('ZADD', KEYS[1], unpack(args))
"""
    + WRITE
    + """
return table.concat(replies, ',')
"""
)


def per_call(conn: redis.Redis, call: object, calls: int) -> float:
    assert callable(call)
    for _ in range(200):
        call()
    conn.config_resetstat()
    for _ in range(calls):
        call()
    stats = conn.info("commandstats")
    scripts = ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_fcall")  # ours: FCALL on Redis 7
    return sum(stats[c]["usec"] for c in scripts if c in stats) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis-server", metavar="PATH", help="default: redis-server on PATH")
    parser.add_argument("--calls", type=int, default=5000)
    opts = parser.parse_args()
    server = RedisServer()
    if opts.redis_server:
        server.binary = opts.redis_server
    with server:
        conn = redis.Redis.from_url(server.url)
        limiter = Limiter(
            RedisBackend(conn),
            rates=[Rate(HIGH, 3600), Rate(HIGH, 1)],
            min_interval=1e-6,
            margin=0,
            namespace="floors",
        )
        from throttle_client._backends.redis_codec import encode

        keys, args = encode(acquire_op(limiter, "token", 1, 0, 0.0))
        ids = iter(range(10**9))

        def script(source: str) -> object:
            sha = conn.script_load(source)
            return lambda: conn.evalsha(sha, len(keys), *keys, *args[:5], b"%d" % next(ids))

        bare = conn.script_load("return 1")
        candidates = {
            "bare EVALSHA": lambda: conn.evalsha(bare, 1, "k"),
            "floor, 1 member": script("local WITH_ID, WITH_LOOKUP = false, false\n" + FLOOR),
            "floor, + id": script("local WITH_ID, WITH_LOOKUP = true, false\n" + FLOOR),
            "floor, + lookup": script("local WITH_ID, WITH_LOOKUP = true, true\n" + FLOOR),
            "floor, batch of 8": script(f"local BATCH = {BATCH}\n" + FLOOR_BATCH),
            "throttle_client": lambda: limiter.try_acquire("token"),
        }
        from limits import RateLimitItemPerHour
        from limits.storage import RedisStorage
        from limits.strategies import MovingWindowRateLimiter

        moving = MovingWindowRateLimiter(RedisStorage(server.url))
        item = RateLimitItemPerHour(HIGH)
        candidates["limits"] = lambda: moving.hit(item, "token-limits")
        version = conn.info("server")["redis_version"]
        rows = []
        for _ in range(2):  # twice, in turns: drift shows as a difference between rounds
            for name, call in candidates.items():
                conn.flushall()
                if name.startswith("floor") or name == "throttle_client":
                    limiter.reset("token")
                share = BATCH if name == "floor, batch of 8" else 1  # (per admission)
                rows.append((name, per_call(conn, call, opts.calls) / share))
    print(
        f"redis-server {version}, Python {platform.python_version()}, redis-py "
        f"{redis.__version__}; {opts.calls} calls per candidate, two rounds"
    )
    print(f"{'candidate':<18}{'round 1':>9}{'round 2':>9}  µs of script time per call")
    half = len(rows) // 2
    for (name, first), (_, second) in zip(rows[:half], rows[half:], strict=True):
        print(f"{name:<18}{first:>9.1f}{second:>9.1f}")


if __name__ == "__main__":
    main()
