-- The script, part 8: concurrency caps (leases), and their operations.

-- Concurrency caps (leases.py, step for step). A capped key has three more keys:
--   H, its holders: zset lease id -> expiry (µs);  Q, its queue: zset lease id -> ticket
--   number;  A: zset lease id -> when its ticket dies unless its waiter asks again.
-- A grant is published to the waiter's process channel, tc:w:<the id up to its '.'>.
local function lease_key(h, q, a, cap, ttl)
  return {hold = h, queue = q, alive = a, cap = cap, ttl = ttl, written = false, reach = 0}
end

local function touch(lk) -- nothing in a lease key outlives its latest expiry: keep them that long
  if lk.written then
    local ms = format('%d', math.ceil((math.max(lk.reach, now + lk.ttl) - now) / 1000) + 1000)
    redis.call('PEXPIRE', lk.hold, ms)
    redis.call('PEXPIRE', lk.queue, ms)
    redis.call('PEXPIRE', lk.alive, ms)
  end
end

local function hold(lk, id, expiry)
  redis.call('ZADD', lk.hold, format('%d', expiry), id)
  lk.written = true
  if expiry > lk.reach then lk.reach = expiry end
end

local function dequeue(lk, id)
  if redis.call('ZREM', lk.queue, id) == 1 then
    redis.call('ZREM', lk.alive, id)
    lk.written = true
  end
end

local function head(lk) -- the first live ticket; dead ones before it go
  while true do
    local first = redis.call('ZRANGE', lk.queue, 0, 0)[1]
    if not first then return nil end
    local alive = tonumber(redis.call('ZSCORE', lk.alive, first))
    if alive and alive > now then return first end
    dequeue(lk, first)
  end
end

local function settle(lk) -- expired holders go; free room goes to the head tickets
  if redis.call('ZREMRANGEBYSCORE', lk.hold, '-inf', format('%d', now)) > 0 then lk.written = true end
  while redis.call('ZCARD', lk.hold) < lk.cap do
    local first = head(lk)
    if not first then return end
    dequeue(lk, first)
    hold(lk, first, now + lk.ttl)
    redis.call('PUBLISH', 'tc:w:' .. string.match(first, '^[^.]*'), first)
  end
end

local function read_cap(cap, ttl) -- a cap (0: none) and a lease TTL (µs), checked
  cap, ttl = whole(cap, 0), whole(ttl, 0)
  if not cap or not ttl or (cap > 0 and ttl < 1) then return nil end
  return cap, ttl
end

local server_now -- the server's TIME, read once per script call (a batch shares it)


-- release, renew: a capped call's lease, ended or renewed.
local function op_release_or_renew(keys, argv, op)
  -- keys: H, Q, A per capped key; argv: op, -, now, lease id, then cap, ttl per key.
  local id, n = argv[4], #keys / 3
  if not id or id == '' then return fail('missing lease id') end
  if n < 1 or n % 1 ~= 0 or #argv ~= 4 + 2 * n then return fail('bad keys for ' .. op) end
  local lks = {}
  for i = 1, n do
    local cap, ttl = read_cap(argv[3 + 2 * i], argv[4 + 2 * i])
    if not cap or cap < 1 then return fail('bad cap for key #' .. i) end
    lks[i] = lease_key(keys[3 * i - 2], keys[3 * i - 1], keys[3 * i], cap, ttl)
  end
  local kept = 1
  for i = 1, n do
    local lk = lks[i]
    if op == 'release' then
      if redis.call('ZREM', lk.hold, id) == 1 then lk.written = true end
      dequeue(lk, id)
      settle(lk)
    else
      settle(lk)
      if not redis.call('ZSCORE', lk.hold, id) then
        kept = 0 -- in flight all the same: held again, even over the cap
        dequeue(lk, id)
      end
      hold(lk, id, now + lk.ttl)
    end
    touch(lk)
  end
  return format('%d', kept)
end
