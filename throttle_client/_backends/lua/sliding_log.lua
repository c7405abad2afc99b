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
-- ARGV[1] the operation: acquire | inspect | pause | reset | acquire_all
-- ARGV[2] the quota, msgpack of [gap, limit, period, limit, period, ...] (µs), which a
--         limiter encodes once: cmsgpack decodes it in C, far cheaper than parsing text
-- ARGV[3] now in µs, or "-" to use the server's TIME (only tests pass a time)
-- then    acquire: cost, max wait µs (-1 = any), call id, lead µs (no slot before
--         now + lead; optional, 0);  pause: duration µs
-- acquire_all (one call charged to several keys, all or nothing): KEYS are L, M pairs,
--         one per key, all in one hash slot; ARGV[2] "-", ARGV[3] now, then max wait,
--         call id, lead, and per key its quota and its cost. One slot for every key, the
--         latest of their earliest slots, booked in every L under one call id, or nowhere.
-- The reply is one string of integers: a single bulk string costs a client far less
-- to read than an array:
--   acquire, acquire_all: ALLOWED NOW SLOT PAUSE REMAINING...  (acquire_all: each key's
--   rates in turn, PAUSE the latest)   inspect: NOW NEXT PAUSE BOOKED (USED READY)...
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
-- by the word "repaired:log" or "repaired:meta" (acquire_all: "repaired:log:2" names its
-- second key), so that the client can say so.

if redis.replicate_commands then
  redis.replicate_commands() -- Redis 6.2: TIME followed by writes needs effects replication
end

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

local repaired -- the part of a key this call rebuilt: 'log' or 'meta', ':' and which key in
               -- an acquire_all (or nil)

local function reply(values) -- integers, formatted with %d: never 1.7e+15
  for i = 1, #values do values[i] = format('%d', values[i]) end
  if repaired then return 'repaired:' .. repaired .. ' ' .. table.concat(values, ' ') end
  return table.concat(values, ' ')
end

local op = ARGV[1]
if op == 'reset' then
  redis.call('DEL', KEYS[1], KEYS[2])
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

-- A quota, read from its msgpack: {gap, limits, periods, nrates, longest, smallest,
-- horizon, slack}, or nil and what is wrong with it.
local function read_quota(packed)
  local ok, quota = pcall(cmsgpack.unpack, packed or '')
  if not ok or type(quota) ~= 'table' then return nil, 'bad quota' end
  local gap, nrates = whole(quota[1], 0), (#quota - 1) / 2
  if not gap or nrates < 1 or nrates % 1 ~= 0 then return nil, 'bad quota' end
  local q = {gap = gap, nrates = nrates, limits = {}, periods = {}, longest = 0, smallest = math.huge}
  for i = 1, nrates do
    local limit, period = whole(quota[2 * i], 1), whole(quota[2 * i + 1], 1)
    if not limit or not period then return nil, 'bad rate #' .. i end
    q.limits[i], q.periods[i] = limit, period
    if period > q.longest then q.longest = period end
    if limit < q.smallest then q.smallest = limit end
  end
  q.horizon = math.max(q.longest, gap)
  q.slack = math.max(math.floor(q.horizon / 10), 1000000) -- TTL and trimming batch, µs
  return q
end

local function entry(cum) -- the "s" member of the entry whose running total is cum
  return format('s%015d', cum)
end

-- Write a key's M. When what still matters (`needed`) reaches past `expires`, L and M
-- get one new TTL together; otherwise M keeps the TTL it has (KEEPTTL). So the two
-- parts always expire together: a TTL computed from one worker's clock and written to
-- M alone could outlive L's (two injected clocks 10 s apart left M 10 s longer than L).
local function save(k, needed, renew)
  if not renew and needed <= k.expires then
    redis.call('SET', k.meta, cmsgpack.pack('tc1', k.last, k.total, k.base, k.pause, k.first, k.expires), 'KEEPTTL')
    return
  end
  k.expires = needed + k.q.slack
  local ttl = format('%d', math.ceil((k.expires - now) / 1000))
  redis.call('PEXPIRE', k.log, ttl)
  redis.call('SET', k.meta, cmsgpack.pack('tc1', k.last, k.total, k.base, k.pause, k.first, k.expires), 'PX', ttl)
end

-- One key's state, read from its M, with whatever is lost rebuilt first.
--
-- Partial state. L and M expire together, but either can be lost alone (maxmemory
-- eviction, a DEL, keys written by an older version) and M can hold bytes this script
-- cannot read. Whatever is missing is rebuilt here, in this atomic step, so that the
-- slot arithmetic never admits a call the lost state would have refused. A key of the
-- wrong type is not repaired: the GET or ZREVRANGEBYSCORE on it fails, and stays an error.
local function open(log, meta, q, index) -- index: the key's place in an acquire_all
  local k = {log = log, meta = meta, q = q, last = -1, total = 0, base = 0, pause = 0, first = -1, expires = 0}
  local fixed
  local state = redis.call('GET', meta)
  if state then
    local ok, tag, a, b, c, d, e, f = pcall(cmsgpack.unpack, state)
    if ok and tag == 'tc1' and type(a) == 'number' and type(b) == 'number' and type(c) == 'number'
        and type(d) == 'number' and type(e) == 'number' and type(f) == 'number' then
      k.last, k.total, k.base, k.pause, k.first, k.expires = a, b, c, d, e, f
    else
      state, fixed = nil, 'meta' -- unreadable: rebuilt from L below, as if it were missing
    end
  end
  if state then
    -- L lost, M kept: M says entries exist, and its newest one ("s" .. total) always does.
    -- Nothing tells when the lost units were admitted, so all of them are put at the
    -- newest slot: a rate that they fill waits until that slot + its period. A stall of at
    -- most one period after the last slot, never over-use.
    if k.first >= 0 and not redis.call('ZSCORE', log, entry(k.total)) then
      if k.total > k.base and k.last + q.horizon > now then
        redis.call('ZADD', log, format('%d', k.last), entry(k.total), format('%d', -k.total), 'c:repaired')
        k.first, fixed = k.last, 'log'
      else -- no window reaches the lost entries any more: no loss, an empty log
        k.first, k.base = -1, k.total
      end
    end
  else
    -- No readable M: a new key, or M lost. If L still holds an entry that matters, M is
    -- rebuilt from it: last and total from the newest entry, first from the oldest, and
    -- base from the oldest's running total less the smallest limit (that entry cost no
    -- more than that: this counts too much, never too little). A pause in force is lost.
    local newest = redis.call('ZREVRANGEBYSCORE', log, '+inf', 0, 'WITHSCORES', 'LIMIT', 0, 1)
    if newest[1] and tonumber(newest[2]) + q.horizon > now then
      local oldest = redis.call('ZRANGEBYSCORE', log, 0, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
      k.last, k.total = tonumber(newest[2]), tonumber(string.sub(newest[1], 2))
      k.first = tonumber(oldest[2])
      k.base = math.max(0, tonumber(string.sub(oldest[1], 2)) - q.smallest)
      fixed = 'meta'
    else -- nothing in L can matter any more (or there is no L): a fresh start
      redis.call('ZREMRANGEBYRANK', log, 0, -1)
    end
  end
  if fixed then
    repaired = index and (fixed .. ':' .. index) or fixed
    save(k, math.max(now, k.last, k.pause) + q.horizon, true)
  end
  return k
end

local function time_at_cum(k, target)
  local hit = redis.call('ZREVRANGEBYSCORE', k.log, format('%d', -target), '-inf', 'WITHSCORES', 'LIMIT', 0, 1)
  return tonumber(redis.call('ZSCORE', k.log, entry(-hit[2])))
end

local function cum_through(k, t)
  if k.first < 0 or t < k.first then return k.base end
  local hit = redis.call('ZREVRANGEBYSCORE', k.log, format('%d', t), 0, 'LIMIT', 0, 1)[1]
  return tonumber(string.sub(hit, 2))
end

local function earliest_slot(k, cost)
  local q = k.q
  local slot = math.max(now, k.pause, k.last + q.gap)
  if k.last < 0 then slot = math.max(now, k.pause) end
  for i = 1, q.nrates do
    local target = k.total - q.limits[i] + cost
    if target > k.base then
      slot = math.max(slot, time_at_cum(k, target) + q.periods[i])
    end
  end
  return slot
end

local function remaining_at(k, point, out)
  local q = k.q
  for i = 1, q.nrates do
    out[#out + 1] = math.max(0, q.limits[i] - (k.total - cum_through(k, point - q.periods[i])))
  end
  return out
end

local function booked(k, id) -- the slot an earlier attempt of this call booked, if any
  local cum = redis.call('ZSCORE', k.log, 'c' .. id)
  return cum and tonumber(redis.call('ZSCORE', k.log, entry(-cum)))
end

local function check_cost(q, cost)
  for i = 1, q.nrates do
    if cost > q.limits[i] then return format('cost %d above limit %d', cost, q.limits[i]) end
  end
end

-- Book ``cost`` at ``slot`` under call ``id``; false if the id is already in the log.
local function book(k, slot, cost, id)
  local cum = k.total + cost
  if redis.call('ZADD', k.log, 'NX', format('%d', slot), entry(cum), format('%d', -cum), 'c' .. id) < 2 then
    redis.call('ZREM', k.log, entry(cum))
    return false
  end
  k.total, k.last = cum, slot
  local fresh = k.first < 0 -- L was empty, so it was just created: it needs its TTL
  if fresh then k.first = slot end
  local cutoff = now - k.q.longest
  if k.first <= cutoff - k.q.slack then -- trim a batch: entries no window can reach any more
    k.base = cum_through(k, cutoff)
    redis.call('ZREMRANGEBYSCORE', k.log, 0, format('%d', cutoff))
    redis.call('ZREMRANGEBYSCORE', k.log, format('%d', -k.base), -1)
    k.first = tonumber(redis.call('ZRANGEBYSCORE', k.log, 0, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)[2])
  end
  save(k, math.max(slot, k.pause) + k.q.horizon, fresh)
  return true
end

if op == 'acquire_all' then
  local max_wait, id, lead = whole(ARGV[4], -1), ARGV[5], whole(ARGV[6], 0)
  if not max_wait then return fail('bad max wait') end
  if not id or id == '' then return fail('missing call id') end
  if not lead then return fail('bad lead') end
  local n = #KEYS / 2
  if n < 1 or n % 1 ~= 0 or #ARGV ~= 6 + 2 * n then return fail('bad keys for acquire_all') end
  -- Everything is checked before the first write: a script that fails half-way is
  -- not rolled back.
  local quotas, costs = {}, {}
  for i = 1, n do
    local q, problem = read_quota(ARGV[5 + 2 * i])
    if not q then return fail(problem .. ' for key #' .. i) end
    local cost = whole(ARGV[6 + 2 * i], 1)
    if not cost then return fail('bad cost for key #' .. i) end
    problem = check_cost(q, cost)
    if problem then return fail(problem .. ' for key #' .. i) end
    quotas[i], costs[i] = q, cost
  end
  local keys, pause = {}, 0
  for i = 1, n do
    keys[i] = open(KEYS[2 * i - 1], KEYS[2 * i], quotas[i], i)
    if keys[i].pause > pause then pause = keys[i].pause end
  end
  local function remaining_all(point, out)
    for i = 1, n do remaining_at(keys[i], point, out) end
    return out
  end
  local earlier = booked(keys[1], id) -- the same call again: it holds its slot everywhere
  if earlier then return reply(remaining_all(earlier, {1, now, earlier, pause})) end
  local slot = now + lead
  for i = 1, n do slot = math.max(slot, earliest_slot(keys[i], costs[i])) end
  if max_wait >= 0 and slot - now > max_wait then
    return reply(remaining_all(now, {0, now, slot, pause})) -- refused: nothing written
  end
  for i = 1, n do book(keys[i], slot, costs[i], id) end
  return reply(remaining_all(slot, {1, now, slot, pause}))
end

local q, problem = read_quota(ARGV[2])
if not q then return fail(problem) end
local k = open(KEYS[1], KEYS[2], q)

if op == 'acquire' then
  local cost, max_wait, id = whole(ARGV[4], 1), whole(ARGV[5], -1), ARGV[6]
  local lead = whole(ARGV[7] or 0, 0)
  if not cost then return fail('bad cost ' .. tostring(ARGV[4])) end
  if not max_wait then return fail('bad max wait') end
  if not lead then return fail('bad lead') end
  if not id or id == '' then return fail('missing call id') end
  problem = check_cost(q, cost)
  if problem then return fail(problem) end

  local slot = math.max(earliest_slot(k, cost), now + lead)
  if max_wait >= 0 and slot - now > max_wait then
    local earlier = booked(k, id)
    if earlier then return reply(remaining_at(k, earlier, {1, now, earlier, k.pause})) end
    return reply(remaining_at(k, now, {0, now, slot, k.pause})) -- refused: nothing written
  end
  if not book(k, slot, cost, id) then
    -- The same call again (a driver retry): it keeps the slot it booked.
    local earlier = booked(k, id)
    return reply(remaining_at(k, earlier, {1, now, earlier, k.pause}))
  end
  return reply(remaining_at(k, slot, {1, now, slot, k.pause}))
end

if op == 'inspect' then -- sliding_log.inspect: used (slots up to now) apart from booked (ahead)
  local through_now = cum_through(k, now)
  local answer = {now, earliest_slot(k, 1), k.pause, k.total - through_now}
  for i = 1, q.nrates do
    local ready, target = now, k.total - q.limits[i] + 1 -- when a call of cost 1 fits rate i
    if target > k.base then ready = math.max(now, time_at_cum(k, target) + q.periods[i]) end
    answer[#answer + 1] = through_now - cum_through(k, now - q.periods[i])
    answer[#answer + 1] = ready
  end
  return reply(answer)
end

if op == 'pause' then
  local duration = whole(ARGV[4], 0)
  if not duration then return fail('bad pause duration') end
  if now + duration > k.pause then -- a pause only ever moves forward
    k.pause = now + duration
    save(k, math.max(k.pause, k.last) + q.horizon, false)
  end
  return reply({k.pause, now})
end

return fail('unknown op ' .. tostring(op))
