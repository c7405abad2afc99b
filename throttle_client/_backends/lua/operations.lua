-- The script, part 13: the other operations on a key, the dispatch, batches, and the
-- entry point.

-- reset: the key forgotten (its log and everything beside it), its life begun again.
local function op_reset(keys)
  local gone = opened[keys[2]] -- (an earlier operation of the batch wrote it: as if done)
  if gone then flush(gone); opened[keys[2]] = nil end
  -- The log, a capped key's lease keys, the card, the pushback and the history go. M
  -- stays, for the rest of its TTL, as a key begun again at a reset: a worker that
  -- knew the key's earlier life does not take the reset for a store that lost it.
  local others = {}
  for i, name in ipairs(keys) do if i ~= 2 then others[#others + 1] = name end end
  redis.call('DEL', unpack(others))
  -- Its life begins now, and after the one forgotten: never the same (a worker that
  -- knew that one would take a reset in the same µs for calls lost).
  local state = redis.call('GET', keys[2])
  if state then
    local begun = fresh_key(keys[1], keys[2], nil)
    local ok, _, _, _, _, _, _, _, _, _, _, _, born = pcall(cmsgpack.unpack, state)
    if ok and type(born) == 'number' and born >= now then begun.born = born + 1 end
    begun.life = 1
    redis.call('SET', keys[2], pack_meta(begun), 'KEEPTTL')
  end
  return '1'
end

-- inspect: a key's usage, read only (sliding_log.inspect).
local function op_inspect(k, q, keys, argv)
  local through_now = cum_through(k, now)
  local in_flight, waiting = 0, 0
  if keys[5] then -- a capped key's holders and tickets, read only: (now, +inf)
    local after = '(' .. format('%d', now)
    in_flight = redis.call('ZCOUNT', keys[3], after, '+inf')
    waiting = redis.call('ZCOUNT', keys[5], after, '+inf')
  end
  local next_slot, missing = earliest_slot(k, 1)
  if not next_slot then return stale(missing) end
  local answer = {now, next_slot, k.pause, k.total - through_now, in_flight, waiting, -1, -1, -1}
  if k["until"] > now then answer[7], answer[8], answer[9] = k.learned, learned_units(k), k["until"] end
  for i = 1, q.nrates do
    local w, used, ready = q.windows[i]
    if w then
      if w.starts[1] == w.keep and now >= w.ends[1] then return stale(now) end
      used = through_now - through(k, i, w.keep - w.margin - 1)
      ready, missing = calendar_slot(k, now, 1, i)
      if not ready then return stale(missing) end
    else
      ready = now -- when a call of cost 1 fits rate i
      local target = k.total - q.limits[i] + 1
      if target > 0 then ready = math.max(now, reach(k, i, target) + q.periods[i]) end
      used = through_now - through(k, i, now - q.periods[i])
    end
    answer[#answer + 1] = used
    answer[#answer + 1] = ready
  end
  return reply(answer)
end

-- pause: no slot before now + duration for any worker; a pause only moves forward.
local function op_pause(k, q, keys, argv)
  local duration = whole(argv[4], 0)
  if not duration then return fail('bad pause duration') end
  local moved = now + duration > k.pause
  if moved then -- a pause only ever moves forward
    k.pause = now + duration
    save(k, math.max(k.pause, k.last) + q.horizon, false)
  end
  if keys[3] then -- (best effort: what the store keeps for operators never fails a pause)
    pcall(push_back, keys[3], moved and k.pause, argv[5], argv[6] == '1')
  end
  return reply({k.pause, now})
end

-- The operations by the name ARGV[1] gives: those that open a key themselves (or none),
-- and those on one key, opened here with the quota ARGV[2] gives.
local UNKEYED = {reset = op_reset, history = op_history, fingerprint = op_fingerprint,
                 card = op_card, release = op_release_or_renew, renew = op_release_or_renew,
                 acquire_all = op_acquire_all, lease = op_acquire_all,
                 acquire_any = op_acquire_any, acquire_any_also = op_acquire_any}
local KEYED = {acquire = op_acquire, inspect = op_inspect, learn = op_learn, pause = op_pause}

local in_batch -- whether this script call is a batch (run_batch)

-- One operation, from its keys and arguments (KEYS and ARGV of the script).
local function run_one(keys, argv)
  repaired = nil
  local op = argv[1]
  if op == 'history_read' then return op_history_read(keys) end
  if argv[3] == '-' then
    if not server_now then
      local t = redis.call('TIME')
      server_now = t[1] * 1000000 + t[2]
    end
    now = server_now
  else
    now = whole(argv[3], 0)
    if not now then return fail('bad time ' .. tostring(argv[3])) end
  end
  if op == 'acquire' and not in_batch then -- (a batch shares each key's reads: open())
    local answer = plain(keys, argv)
    if answer then return answer end
  end
  local unkeyed = UNKEYED[op]
  if unkeyed then return unkeyed(keys, argv, op) end
  local keyed = KEYED[op]
  if not keyed then return fail('unknown op ' .. tostring(op)) end
  local q, problem = read_quota(argv[2])
  if not q then return fail(problem) end
  local k
  k, problem = open(keys[1], keys[2], q)
  if not k then return fail(problem) end
  return keyed(k, q, keys, argv)
end

-- A batch: several operations in one script call, run in the order given (so a key's
-- calls keep their order: FIFO), each one's reply on a line of its own, an error as
-- "!" and its message, so that one bad operation fails alone. ARGV: "batch", then one
-- argument per operation, msgpack of [n, the places in KEYS of its n keys, its
-- arguments...]; KEYS holds each key once. What the operations share is read once:
-- the server's TIME, each quota, each key's M (written once, at the end).
local function run_batch(keys, argv)
  local out = {}
  for i = 2, #argv do
    local ok, item = pcall(cmsgpack.unpack, argv[i])
    local nkeys = ok and type(item) == 'table' and whole(item[1], 0)
    if not nkeys or #item < nkeys + 2 then return fail('bad batch at operation #' .. (i - 1)) end
    local sub_keys, sub_argv = {}, {}
    for j = 1, nkeys do
      sub_keys[j] = keys[item[1 + j]]
      if not sub_keys[j] then return fail('bad batch at operation #' .. (i - 1)) end
    end
    for j = nkeys + 2, #item do sub_argv[j - nkeys - 1] = item[j] end
    local answer
    ok, answer = pcall(run_one, sub_keys, sub_argv)
    if sub_argv[1] ~= 'history' then histories = {} end -- (it declares for one operation)
    if type(answer) == 'table' then -- an error: fail()'s reply, or one a redis.call raised
      ok, answer = false, answer.err
    end
    if not ok then answer = '!' .. string.gsub(tostring(answer), '\n', ' ') end
    out[#out + 1] = answer
  end
  return table.concat(out, '\n')
end

local function run(keys, argv)
  if redis.replicate_commands then
    redis.replicate_commands() -- Redis 6.2: TIME followed by writes needs effects replication
  end
  format, opened, opened_order, server_now, histories = string.format, {}, {}, nil, {}
  local ok, answer
  in_batch = argv[1] == 'batch'
  if in_batch then ok, answer = true, run_batch(keys, argv) else ok, answer = pcall(run_one, keys, argv) end
  -- (What an operation wrote before it failed stays, as in any script: its M is written
  -- too, so that L never runs ahead of it.)
  for _, k in ipairs(opened_order) do flush(k) end
  if not ok then error(answer, 0) end
  return answer
end

return run(KEYS, ARGV)
