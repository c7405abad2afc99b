-- throttle_client: one key's sliding-window log, decided and booked in one atomic step.
-- A port of throttle_client/_log.py; see that module for the reasoning.
--
-- KEYS[1] log by slot:        zset, score = slot (µs since the epoch), member = call id
-- KEYS[2] log by running cost: zset, score = running total of costs,     member = call id
-- KEYS[3] meta:               hash, last / total / base / pause
--   All three share one {hash tag}, so the script is legal on a Redis Cluster.
--
-- ARGV[1] op: acquire | inspect | pause | reset
-- ARGV[2] now in µs, or "" to use the server's TIME (only tests pass a time)
-- ARGV[3] minimum gap between slots, µs
-- ARGV[4] number of rates R, then R pairs (limit, period µs)
-- then    acquire: cost, max wait µs (-1 = any), call id;  pause: duration µs
--
-- Numbers travel as integers formatted with %d: tostring() of a Lua number would
-- give 1.7e+15 for a timestamp in µs.

if redis.replicate_commands then
  redis.replicate_commands() -- Redis 6.2: TIME followed by writes needs effects replication
end

local by_slot, by_cum, meta = KEYS[1], KEYS[2], KEYS[3]
local op = ARGV[1]

local function fail(message)
  return redis.error_reply('ERR throttle_client: ' .. message)
end

local function int(x)
  return string.format('%d', x)
end

-- A finite whole number >= low, or nil.
local function whole(value, low)
  local x = tonumber(value)
  if x == nil or x ~= x or x == math.huge or x == -math.huge or x ~= math.floor(x) or x < low then
    return nil
  end
  return x
end

if op == 'reset' then
  redis.call('DEL', by_slot, by_cum, meta)
  return 1
end

local now
if ARGV[2] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = whole(ARGV[2], 0)
  if not now then return fail('bad time ' .. tostring(ARGV[2])) end
end

local gap = whole(ARGV[3], 0)
local nrates = whole(ARGV[4], 1)
if not gap or not nrates then return fail('bad policy') end
local limits, periods, longest = {}, {}, 0
for i = 1, nrates do
  local limit, period = whole(ARGV[3 + 2 * i], 1), whole(ARGV[4 + 2 * i], 1)
  if not limit or not period then return fail('bad rate #' .. i) end
  limits[i], periods[i] = limit, period
  if period > longest then longest = period end
end
local horizon = math.max(longest, gap)
local arg = 5 + 2 * nrates -- first argument of the operation

local state = redis.call('HMGET', meta, 'last', 'total', 'base', 'pause')
local last = tonumber(state[1]) -- nil until the first call
local total = tonumber(state[2]) or 0
local base = tonumber(state[3]) or 0
local pause = tonumber(state[4]) or 0

local function time_at_cum(target)
  local id = redis.call('ZRANGEBYSCORE', by_cum, int(target), '+inf', 'LIMIT', 0, 1)[1]
  return tonumber(redis.call('ZSCORE', by_slot, id))
end

local function cum_through(t)
  local n = redis.call('ZCOUNT', by_slot, '-inf', int(t))
  if n == 0 then return base end
  return tonumber(redis.call('ZRANGE', by_cum, n - 1, n - 1, 'WITHSCORES')[2])
end

local function first_after(t)
  local hit = redis.call('ZRANGEBYSCORE', by_slot, '(' .. int(t), '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  return tonumber(hit[2])
end

local function earliest_slot(cost)
  local slot = math.max(now, pause)
  if last then slot = math.max(slot, last + gap) end
  for i = 1, nrates do
    local target = total - limits[i] + cost
    if target > base then
      slot = math.max(slot, time_at_cum(target) + periods[i])
    end
  end
  return slot
end

local function remaining_at(point, out)
  for i = 1, nrates do
    out[#out + 1] = math.max(0, limits[i] - (total - cum_through(point - periods[i])))
  end
  return out
end

-- Every key this script writes expires once nothing in it can matter.
local function expire_at(when)
  local ttl = math.floor((when - now) / 1000) + 1000
  redis.call('PEXPIRE', by_slot, ttl)
  redis.call('PEXPIRE', by_cum, ttl)
  redis.call('PEXPIRE', meta, ttl)
end

if op == 'acquire' then
  local cost, max_wait, id = whole(ARGV[arg], 1), whole(ARGV[arg + 1], -1), ARGV[arg + 2]
  if not cost then return fail('bad cost ' .. tostring(ARGV[arg])) end
  if not max_wait then return fail('bad max wait') end
  if not id or id == '' then return fail('missing call id') end
  for i = 1, nrates do
    if cost > limits[i] then return fail('cost ' .. int(cost) .. ' above limit ' .. int(limits[i])) end
  end

  local booked = tonumber(redis.call('ZSCORE', by_slot, id))
  if booked then -- the same call again (a driver retry): it already holds its slot
    return remaining_at(booked, {1, now, booked, pause})
  end

  local slot = earliest_slot(cost)
  if max_wait >= 0 and slot - now > max_wait then
    return remaining_at(now, {0, now, slot, pause}) -- refused: nothing written
  end

  total = total + cost
  redis.call('ZADD', by_slot, int(slot), id)
  redis.call('ZADD', by_cum, int(total), id)
  redis.call('HSET', meta, 'last', int(slot), 'total', int(total))
  last = slot

  local stale = redis.call('ZCOUNT', by_slot, '-inf', int(now - longest))
  if stale > 0 then
    base = tonumber(redis.call('ZRANGE', by_cum, stale - 1, stale - 1, 'WITHSCORES')[2])
    redis.call('ZREMRANGEBYRANK', by_slot, 0, stale - 1)
    redis.call('ZREMRANGEBYRANK', by_cum, 0, stale - 1)
    redis.call('HSET', meta, 'base', int(base))
  end
  expire_at(math.max(slot, pause) + horizon)
  return remaining_at(slot, {1, now, slot, pause})
end

if op == 'inspect' then
  local reply = {now, earliest_slot(1), pause}
  for i = 1, nrates do
    local used = total - cum_through(now - periods[i])
    local frees = 0
    if used > 0 then frees = (first_after(now - periods[i]) or -periods[i]) + periods[i] end
    reply[#reply + 1] = used
    reply[#reply + 1] = frees
  end
  return reply
end

if op == 'pause' then
  local duration = whole(ARGV[arg], 0)
  if not duration then return fail('bad pause duration') end
  if now + duration > pause then -- a pause only ever moves forward
    pause = now + duration
    redis.call('HSET', meta, 'pause', int(pause))
    expire_at(math.max(pause, last or 0) + horizon)
  end
  return {pause, now}
end

return fail('unknown op ' .. tostring(op))
