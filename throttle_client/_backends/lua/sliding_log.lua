-- throttle_client: one key's sliding-window log, decided and booked in one atomic step.
-- The algorithm is sliding_log.py's (see that module for the reasoning); the storage is
-- shaped so that an admission costs five redis.call()s: TIME, GET, ZSCORE, ZADD, SET.
--
-- KEYS[1] L, the log: one zset holding each admitted call twice,
--            "s" .. running total (zero-padded) with score = slot (µs, >= 0), and
--            "c" .. call id                      with score = -(running total) (<= -1);
--         so L answers both "running total at the newest slot <= t" and "slot at which
--         the running total reaches y" with one lookup each, and one ZADD NX books
--         a call and refuses a second booking of the same call id.
-- KEYS[2] M, the meta: msgpack of ("tc1", last, total, base, pause, first, exp) (µs and
--            costs; -1 for no entry). L and M are given one TTL together.
--   Both share one {hash tag}, so the script is legal on a Redis Cluster.
--
-- ARGV[1] the operation: acquire | inspect | pause | reset
-- ARGV[2] the quota, msgpack of [gap, limit, period, limit, period, ...] (µs), which a
--         limiter encodes once: cmsgpack decodes it in C, far cheaper than parsing text
-- ARGV[3] now in µs, or "-" to use the server's TIME (only tests pass a time)
-- then    acquire: cost, max wait µs (-1 = any), call id, lead µs (no slot before
--         now + lead; optional, 0);  pause: duration µs
-- The reply is one string of integers: a single bulk string costs a client far less
-- to read than an array:
--   acquire: ALLOWED NOW SLOT PAUSE REMAINING...   inspect: NOW NEXT PAUSE BOOKED (USED READY)...
--   pause: PAUSE NOW   reset: 1
--
-- `first` (the oldest logged slot) lets a window that starts before it skip its
-- lookup; trimming runs in batches, once that entry is a tenth of the longest
-- period past the longest window; the TTLs are renewed only when the horizon
-- passes `exp`. Numbers travel as integers formatted with %d: Lua's own conversion
-- of a number would give 1.7e+15 for a timestamp in µs.
--
-- A part of the key that is lost (L or M) or unreadable (M) is rebuilt, conservatively,
-- by whichever call finds it so (see "Partial state" below); that call's reply is led
-- by the word "repaired:log" or "repaired:meta", so that the client can say so.

if redis.replicate_commands then
  redis.replicate_commands() -- Redis 6.2: TIME followed by writes needs effects replication
end

local log, meta = KEYS[1], KEYS[2]
local format = string.format

local function fail(message)
  return redis.error_reply('ERR throttle_client: ' .. message)
end

-- A whole number >= low and < 2^53 (so exact in a double), or nil: nan, inf,
-- fractions and junk all fail one of the comparisons.
local function whole(value, low)
  local x = tonumber(value)
  if x and x % 1 == 0 and x >= low and x < 9007199254740992 then return x end
end

local repaired -- the part of the key this call rebuilt: 'log' or 'meta' (or nil)

local function reply(values) -- integers, formatted with %d: never 1.7e+15
  for i = 1, #values do values[i] = format('%d', values[i]) end
  if repaired then return 'repaired:' .. repaired .. ' ' .. table.concat(values, ' ') end
  return table.concat(values, ' ')
end

local op = ARGV[1]
if op == 'reset' then
  redis.call('DEL', log, meta)
  return '1'
end

local now
if ARGV[3] == '-' then
  local t = redis.call('TIME')
  now = t[1] * 1000000 + t[2]
else
  now = whole(ARGV[3], 0)
  if not now then return fail('bad time ' .. tostring(ARGV[3])) end
end

local ok, quota = pcall(cmsgpack.unpack, ARGV[2] or '')
if not ok or type(quota) ~= 'table' then return fail('bad quota') end
local gap, nrates = whole(quota[1], 0), (#quota - 1) / 2
if not gap or nrates < 1 or nrates % 1 ~= 0 then return fail('bad quota') end
local limits, periods, longest, smallest = {}, {}, 0, math.huge
for i = 1, nrates do
  local limit, period = whole(quota[2 * i], 1), whole(quota[2 * i + 1], 1)
  if not limit or not period then return fail('bad rate #' .. i) end
  limits[i], periods[i] = limit, period
  if period > longest then longest = period end
  if limit < smallest then smallest = limit end
end
local horizon = math.max(longest, gap)
local slack = math.max(math.floor(horizon / 10), 1000000) -- TTL and trimming batch, µs

local last, total, base, pause, first, expires = -1, 0, 0, 0, -1, 0

local function entry(cum) -- the "s" member of the entry whose running total is cum
  return format('s%015d', cum)
end

-- Write M. When what still matters (`needed`) reaches past `expires`, L and M get one new
-- TTL together; otherwise M keeps the TTL it has (KEEPTTL). So the two parts always
-- expire together: a TTL computed from one worker's clock and written to M alone could
-- outlive L's (two injected clocks 10 s apart left M 10 s longer than L).
local function save(needed, renew)
  if not renew and needed <= expires then
    redis.call('SET', meta, cmsgpack.pack('tc1', last, total, base, pause, first, expires), 'KEEPTTL')
    return
  end
  expires = needed + slack
  local ttl = format('%d', math.ceil((expires - now) / 1000))
  redis.call('PEXPIRE', log, ttl)
  redis.call('SET', meta, cmsgpack.pack('tc1', last, total, base, pause, first, expires), 'PX', ttl)
end

-- Partial state. L and M expire together, but either can be lost alone (maxmemory
-- eviction, a DEL, keys written by an older version) and M can hold bytes this script
-- cannot read. Whatever is missing is rebuilt here, in this atomic step, so that the
-- slot arithmetic never admits a call the lost state would have refused. A key of the
-- wrong type is not repaired: the GET or ZREVRANGEBYSCORE on it fails, and stays an error.
local state = redis.call('GET', meta)
if state then
  local ok, tag, a, b, c, d, e, f = pcall(cmsgpack.unpack, state)
  if ok and tag == 'tc1' and type(a) == 'number' and type(b) == 'number' and type(c) == 'number'
      and type(d) == 'number' and type(e) == 'number' and type(f) == 'number' then
    last, total, base, pause, first, expires = a, b, c, d, e, f
  else
    state, repaired = nil, 'meta' -- unreadable: rebuilt from L below, as if it were missing
  end
end
if state then
  -- L lost, M kept: M says entries exist, and its newest one ("s" .. total) always does.
  -- Nothing tells when the lost units were admitted, so all of them are put at the
  -- newest slot: a rate that they fill waits until that slot + its period. A stall of at
  -- most one period after the last slot, never over-use.
  if first >= 0 and not redis.call('ZSCORE', log, entry(total)) then
    if total > base and last + horizon > now then
      redis.call('ZADD', log, format('%d', last), entry(total), format('%d', -total), 'c:repaired')
      first, repaired = last, 'log'
    else -- no window reaches the lost entries any more: no loss, an empty log
      first, base = -1, total
    end
  end
else
  -- No readable M: a new key, or M lost. If L still holds an entry that matters, M is
  -- rebuilt from it: last and total from the newest entry, first from the oldest, and
  -- base from the oldest's running total less the smallest limit (that entry cost no
  -- more than that: this counts too much, never too little). A pause in force is lost.
  local newest = redis.call('ZREVRANGEBYSCORE', log, '+inf', 0, 'WITHSCORES', 'LIMIT', 0, 1)
  if newest[1] and tonumber(newest[2]) + horizon > now then
    local oldest = redis.call('ZRANGEBYSCORE', log, 0, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    last, total = tonumber(newest[2]), tonumber(string.sub(newest[1], 2))
    first = tonumber(oldest[2])
    base = math.max(0, tonumber(string.sub(oldest[1], 2)) - smallest)
    repaired = 'meta'
  else -- nothing in L can matter any more (or there is no L): a fresh start
    redis.call('ZREMRANGEBYRANK', log, 0, -1)
  end
end
if repaired then save(math.max(now, last, pause) + horizon, true) end

local function time_at_cum(target)
  local hit = redis.call('ZREVRANGEBYSCORE', log, format('%d', -target), '-inf', 'WITHSCORES', 'LIMIT', 0, 1)
  return tonumber(redis.call('ZSCORE', log, entry(-hit[2])))
end

local function cum_through(t)
  if first < 0 or t < first then return base end
  local hit = redis.call('ZREVRANGEBYSCORE', log, format('%d', t), 0, 'LIMIT', 0, 1)[1]
  return tonumber(string.sub(hit, 2))
end

local function first_after(t)
  local low = '(' .. format('%d', math.max(t, -1)) -- never below 0: "c" members live there
  return tonumber(redis.call('ZRANGEBYSCORE', log, low, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)[2])
end

local function earliest_slot(cost)
  local slot = math.max(now, pause, last + gap)
  if last < 0 then slot = math.max(now, pause) end
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

local function booked(id) -- the slot an earlier attempt of this call booked, if any
  local cum = redis.call('ZSCORE', log, 'c' .. id)
  return cum and tonumber(redis.call('ZSCORE', log, entry(-cum)))
end

if op == 'acquire' then
  local cost, max_wait, id = whole(ARGV[4], 1), whole(ARGV[5], -1), ARGV[6]
  local lead = whole(ARGV[7] or 0, 0)
  if not cost then return fail('bad cost ' .. tostring(ARGV[4])) end
  if not max_wait then return fail('bad max wait') end
  if not lead then return fail('bad lead') end
  if not id or id == '' then return fail('missing call id') end
  for i = 1, nrates do
    if cost > limits[i] then return fail(format('cost %d above limit %d', cost, limits[i])) end
  end

  local slot = math.max(earliest_slot(cost), now + lead)
  if max_wait >= 0 and slot - now > max_wait then
    local earlier = booked(id)
    if earlier then return reply(remaining_at(earlier, {1, now, earlier, pause})) end
    return reply(remaining_at(now, {0, now, slot, pause})) -- refused: nothing written
  end
  local cum = total + cost
  if redis.call('ZADD', log, 'NX', format('%d', slot), entry(cum), format('%d', -cum), 'c' .. id) < 2 then
    -- The same call again (a driver retry): it keeps the slot it booked.
    redis.call('ZREM', log, entry(cum))
    local earlier = booked(id)
    return reply(remaining_at(earlier, {1, now, earlier, pause}))
  end
  total, last = cum, slot
  local fresh = first < 0 -- L was empty, so it was just created: it needs its TTL
  if fresh then first = slot end

  local cutoff = now - longest
  if first <= cutoff - slack then -- trim a batch: entries no window can reach any more
    base = cum_through(cutoff)
    redis.call('ZREMRANGEBYSCORE', log, 0, format('%d', cutoff))
    redis.call('ZREMRANGEBYSCORE', log, format('%d', -base), -1)
    first = tonumber(redis.call('ZRANGEBYSCORE', log, 0, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)[2])
  end
  save(math.max(slot, pause) + horizon, fresh)
  return reply(remaining_at(slot, {1, now, slot, pause}))
end

if op == 'inspect' then -- sliding_log.inspect: used (slots up to now) apart from booked (ahead)
  local through_now = cum_through(now)
  local answer = {now, earliest_slot(1), pause, total - through_now}
  for i = 1, nrates do
    local ready, target = now, total - limits[i] + 1 -- when a call of cost 1 fits rate i
    if target > base then ready = math.max(now, time_at_cum(target) + periods[i]) end
    answer[#answer + 1] = through_now - cum_through(now - periods[i])
    answer[#answer + 1] = ready
  end
  return reply(answer)
end

if op == 'pause' then
  local duration = whole(ARGV[4], 0)
  if not duration then return fail('bad pause duration') end
  if now + duration > pause then -- a pause only ever moves forward
    pause = now + duration
    save(math.max(pause, last) + horizon, false)
  end
  return reply({pause, now})
end

return fail('unknown op ' .. tostring(op))
