-- The script, part 11: a booking, and the operations that admit calls.

-- Book ``cost`` at ``slot`` under call ``id`` (nil: a stacked call's other keys, whose
-- retries are found in the first key).
-- A slot among the key's bookings (fill_slot): the entries after it move their running
-- totals up by `cost` (at most FILL_MOST of them); the running total of its entry.
local function shift_after(k, slot, cost)
  local from = format('(%d', slot)
  local later = redis.call('ZRANGEBYSCORE', k.log, from, '+inf', 'WITHSCORES')
  local cum = cum_through(k, slot) + cost
  redis.call('ZREMRANGEBYSCORE', k.log, from, '+inf')
  local args = {}
  for i = 1, #later, 2 do -- (each keeps what follows its total: its call id, if any)
    args[#args + 1] = later[i + 1]
    args[#args + 1] = entry(total_of(later[i]) + cost) .. string.sub(later[i], 7)
  end
  if #args > 0 then redis.call('ZADD', k.log, unpack(args)) end
  if k.wcum > cum - cost then k.wcum = k.wcum + cost end -- (its entry came later)
  return cum
end

local function book(k, slot, cost, id)
  local cum = k.total + cost
  if slot < k.last then cum = shift_after(k, slot, cost) end
  redis.call('ZADD', k.log, format('%d', slot), id and entry(cum) .. id or entry(cum))
  if id and k.idold < 0 then k.idold = slot end
  compact_ids(k)
  book_coarse(k, slot, cost)
  local h = histories[k.meta]
  -- (Best effort: a history it cannot write, an ACL without HINCRBY say, never fails or
  -- half-writes a booking.)
  if h then pcall(count_history, h, slot, cost) end
  if cost > 1 and cum > k.wcum then k.wcum = cum end
  k.total, k.last = k.total + cost, math.max(k.last, slot)
  local fresh = k.first < 0 -- L was empty, so it was just created: it needs its TTL
  if fresh or slot < k.first then k.first = slot end
  local cutoff = k.q.cutoff
  if k.first <= cutoff - k.q.batch then -- trim a batch: entries no window can reach any more
    k.base, k.trimmed = cum_through(k, cutoff), math.max(k.trimmed, cutoff)
    redis.call('ZREMRANGEBYSCORE', k.log, 0, format('%d', cutoff))
    k.first = tonumber(redis.call('ZRANGEBYSCORE', k.log, 0, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)[2])
  end
  -- The key lives while what matters does, and while its id may still be asked for.
  local needed = math.max(slot, k.pause) + k.q.horizon
  if id and slot + KEEP_IDS > needed then needed = slot + KEEP_IDS end
  save(k, needed, fresh)
end


-- acquire: one call on one key (k, read with quota q).
local function op_acquire(k, q, keys, argv)
  local problem
  -- A third key: its usage history, in argv[10..14] (lead, mark, expect are then given);
  -- expect is "born,total" (see lost_history), or -1.
  if keys[3] and not declare_history(keys[2], keys[3], argv, 10) then
    return fail('bad history')
  end
  local cost, max_wait, id, retry = whole(argv[4], 1), whole(argv[5], -1), read_id(argv[6])
  local lead, mark_us = whole(argv[7] or 0, 0), whole(argv[8] or -1, -1)
  local expect = argv[9]
  if not cost then return fail('bad cost ' .. tostring(argv[4])) end
  if not max_wait then return fail('bad max wait') end
  if not lead or not mark_us then return fail('bad lead') end
  if not id then return fail('missing or bad call id') end
  problem = check_cost(q, cost)
  if problem then return fail(problem) end
  local lost = lost_history(k, expect)

  local function answer(out) -- every answer ends with the key's life (born) and total
    out[#out + 1] = k.born
    out[#out + 1] = k.total
    return reply(out, lost and 'lost ' or nil)
  end
  local function admitted(at) -- a retry's reply: marked -1 if asked (Verdict.mark), as
    local out = remaining_at(k, at, {1, now, at, k.pause}) -- entries before it may be
    if mark_us >= 0 then out[#out + 1] = -1; out[#out + 1] = -1 end -- trimmed since then
    return answer(out)
  end
  if retry then -- the same call again: it keeps the slot it booked, if it did
    local earlier = booked(k, id)
    if earlier then return admitted(earlier) end
  end
  local earliest, missing = earliest_slot(k, cost)
  if not earliest then return stale(missing) end
  local slot = math.max(earliest, now + lead)
  if slot > earliest then -- a slot the lead moved on must fit the calendar windows there too
    slot, missing = calendar_slot(k, slot, cost)
    if not slot then return stale(missing) end
  end
  if max_wait >= 0 and slot - now > max_wait then
    tidy(k)
    return answer(remaining_at(k, now, {0, now, slot, k.pause})) -- refused: nothing booked
  end
  problem = past_totals(k, cost)
  if problem then return fail(problem) end
  local marked = mark_us >= 0 and cum_through(k, slot - mark_us - 1)
  book(k, slot, cost, id)
  local out = remaining_at(k, slot, {1, now, slot, k.pause})
  if marked then out[#out + 1] = marked; out[#out + 1] = k.born end
  return answer(out)
end

-- acquire_all, lease: one call charged to several keys, or a capped call.
local function op_acquire_all(keys, argv, op)
  -- 'lease' is a capped call: argv[7] is its lease id: per key, argv gives quota, cost,
  -- expect (the life the worker knows, -1: none; see lost_history), and for a lease its
  -- cap (0: none) and lease TTL; keys give a capped key's H, Q, A after its L and M.
  local max_wait, lead = whole(argv[4], -1), whole(argv[6], 0)
  local id, retry = read_id(argv[5])
  local mark_us = argv[2] == '-' and -1 or whole(argv[2], 0) -- Acquire.mark_us, first key
  if not mark_us then return fail('bad mark') end
  if not max_wait then return fail('bad max wait') end
  if not id then return fail('missing or bad call id') end
  if not lead then return fail('bad lead') end
  local lease = op == 'lease' and argv[7]
  local per, first_arg = 3, 7
  if lease then per, first_arg = 5, 8 end
  local n = (#argv - first_arg + 1) / per
  if n < 1 or n % 1 ~= 0 then return fail('bad keys for acquire_all') end
  -- Everything is checked before the first write: a script that fails half-way is
  -- not rolled back.
  local quotas, costs, expects, lks, logs, metas, at = {}, {}, {}, {}, {}, {}, 1
  for i = 1, n do
    local arg = first_arg + per * (i - 1)
    local q, problem = read_quota(argv[arg])
    if not q then return fail(problem .. ' for key #' .. i) end
    local cost = whole(argv[arg + 1], 1)
    if not cost then return fail('bad cost for key #' .. i) end
    expects[i] = argv[arg + 2]
    problem = check_cost(q, cost)
    if problem then return fail(problem .. ' for key #' .. i) end
    quotas[i], costs[i] = q, cost
    local log_key, meta_key = keys[at], keys[at + 1]
    at = at + 2
    if lease then
      local cap, ttl = read_cap(argv[arg + 3], argv[arg + 4])
      if not cap then return fail('bad cap for key #' .. i) end
      if cap > 0 then
        lks[i] = lease_key(keys[at], keys[at + 1], keys[at + 2], cap, ttl)
        at = at + 3
      end
    end
    logs[i], metas[i] = log_key, meta_key
  end
  if at ~= #keys + 1 or (lease and lease == '') then return fail('bad keys for acquire_all') end
  local keys, pause, lost = {}, 0, false
  for i = 1, n do
    local problem
    keys[i], problem = open(logs[i], metas[i], quotas[i], i)
    if not keys[i] then return fail(problem) end
    if lost_history(keys[i], expects[i]) then lost = true end
    if keys[i].pause > pause then pause = keys[i].pause end
    local problem = past_totals(keys[i], costs[i]) -- (before the caps write anything)
    if problem then return fail(problem .. ' for key #' .. i) end
  end
  local function remaining_all(point, out)
    for i = 1, n do remaining_at(keys[i], point, out) end
    return out
  end
  local function answer(out) -- every answer ends with each key's life and total, in order
    for i = 1, n do out[#out + 1] = keys[i].born; out[#out + 1] = keys[i].total end
    return reply(out, lost and 'lost ' or nil)
  end
  local function admitted(at, marked) -- an admitted call's reply, marked if asked (a
    local out = remaining_all(at, {1, now, at, pause}) -- retry's with -1: entries before
    if mark_us >= 0 then -- it may be trimmed since); MARK BORN
      out[#out + 1] = marked or -1
      out[#out + 1] = marked and keys[1].born or -1
    end
    return answer(out)
  end
  if retry then -- the same call again: it holds its slot everywhere, if it booked one
    local earlier = booked(keys[1], id)
    if earlier then return admitted(earlier) end
  end
  -- The caps (leases.acquire): a key is full unless the call holds a lease there, or
  -- there is room and no one queued ahead of it.
  local full, capped = {}, {}
  for i = 1, n do
    local lk = lks[i]
    if lk then
      capped[#capped + 1] = lk
      settle(lk)
      if not redis.call('ZSCORE', lk.hold, lease) then
        local first = head(lk)
        if redis.call('ZCARD', lk.hold) >= lk.cap or (first and first ~= lease) then
          full[lk] = true
        end
      end
    end
  end
  if next(full) then
    local hint = nil
    for lk in pairs(full) do
      local e = redis.call('ZRANGE', lk.hold, 0, 0, 'WITHSCORES')[2]
      if e and (not hint or tonumber(e) < hint) then hint = tonumber(e) end
    end
    hint = hint or now
    if max_wait == 0 then -- try: refused (4: for a full cap), and nothing of it is written
      for _, lk in ipairs(capped) do touch(lk) end
      return answer(remaining_all(now, {4, now, hint, pause}))
    end
    local number = 0
    for _, lk in ipairs(capped) do
      local newest = redis.call('ZRANGE', lk.queue, -1, -1, 'WITHSCORES')[2]
      if newest and tonumber(newest) > number then number = tonumber(newest) end
    end
    number = number + 1
    local at_head = 3
    for _, lk in ipairs(capped) do
      if not full[lk] then -- served here: held for it while it waits elsewhere
        dequeue(lk, lease)
        hold(lk, lease, now + lk.ttl)
      else
        if not redis.call('ZSCORE', lk.queue, lease) then
          redis.call('ZADD', lk.queue, format('%d', number), lease)
        end
        redis.call('ZADD', lk.alive, format('%d', now + lk.ttl), lease)
        lk.written = true
        if head(lk) ~= lease then at_head = 2 end
      end
      touch(lk)
    end
    return answer(remaining_all(now, {at_head, now, hint, pause})) -- 2: queued, 3: at the head
  end
  local slot, missing = common_slot(keys, costs, lead)
  if not slot then return stale(missing) end
  if max_wait >= 0 and slot - now > max_wait then
    for _, lk in ipairs(capped) do touch(lk) end
    for i = 1, n do tidy(keys[i]) end
    return answer(remaining_all(now, {0, now, slot, pause})) -- refused: nothing booked
  end
  local marked = mark_us >= 0 and cum_through(keys[1], slot - mark_us - 1) -- before booking
  book(keys[1], slot, costs[1], id)
  for i = 2, n do book(keys[i], slot, costs[i]) end
  for _, lk in ipairs(capped) do -- held through the sleep to its slot too
    dequeue(lk, lease)
    hold(lk, lease, math.max(slot, now) + lk.ttl)
    touch(lk)
  end
  return admitted(slot, marked)
end

-- acquire_any: a pool's call (ops.AcquireAny), booked as an acquire on the one of its keys
-- whose slot is earliest, of equal ones the one used least lately (a booking past the
-- horizon counts as none), then the first (a retry's: the one holding its id;
-- sliding_log.choose).
-- ARGV: QUOTA NOW COST WAIT CALL LEAD MARK, the number of history arguments and those
-- (its keys share them), then each key's EXPECT; KEYS: each key's L, M (and history).
-- The reply is that acquire's, led by "any:<place of the key, from 1>".
-- acquire_any_also: a pool's call charged to keys its tokens share (AcquireAny.partners):
-- after the number of history arguments, the number of partners and each one's QUOTA
-- COST EXPECT; KEYS end with each partner's L, M. A key's slot is then the one its call
-- with the partners would take (common_slot), and the call is that acquire_all, its
-- reply led by "any:<place>".
local function op_acquire_any(keys, argv, op)
  local q, problem = read_quota(argv[2])
  if not q then return fail(problem) end
  local cost, lead, nh = whole(argv[4], 1), whole(argv[7], 0), whole(argv[9], 0)
  local id, retry = read_id(argv[6])
  if not cost or not lead or not nh then return fail('bad acquire_any') end
  if not id then return fail('missing or bad call id') end
  problem = check_cost(q, cost)
  if problem then return fail(problem) end
  local np, kept = 0, 10 -- partners, and where the history arguments begin
  if op == 'acquire_any_also' then
    np, kept = whole(argv[10], 1), 11
    if not np then return fail('bad partners for acquire_any') end
    kept = kept + 3 * np
  end
  local per, first = nh > 0 and 3 or 2, kept + nh
  local n = #argv - first + 1
  if n < 1 or #keys ~= per * n + 2 * np then return fail('bad keys for acquire_any') end
  local ks = {}
  for i = 1, n do
    ks[i], problem = open(keys[per * i - per + 1], keys[per * i - per + 2], q, i)
    if not ks[i] then return fail(problem) end
  end
  local group, costs = {false}, {cost} -- (a key of the pool, then its partners)
  for j = 1, np do
    local arg = 11 + 3 * (j - 1)
    local pq, pcost = read_quota(argv[arg]), whole(argv[arg + 1], 1)
    if not pq or not pcost or check_cost(pq, pcost) then
      return fail('bad partner #' .. j .. ' for acquire_any')
    end
    group[j + 1], problem = open(keys[per * n + 2 * j - 1], keys[per * n + 2 * j], pq, n + j)
    if not group[j + 1] then return fail(problem) end
    costs[j + 1] = pcost
  end
  local best
  if retry then
    for i = 1, n do
      if booked(ks[i], id) then best = i; break end
    end
  end
  if not best then
    local best_slot, best_last
    for i = 1, n do
      local slot
      if np > 0 then
        group[1] = ks[i]
        slot = common_slot(group, costs, lead)
      else
        slot = earliest_slot(ks[i], cost)
        if slot and slot < now + lead then slot = now + lead end
      end
      if not slot then best = i; break end -- (stale: its answer asks for the windows)
      -- (A key that lost its history is held when its call books: from the hold.)
      local held = lost_hold(ks[i], argv[first + i - 1])
      if held and held > slot then slot = held end
      local last = ks[i].last
      if last + q.horizon <= now then last = -1 end
      if not best_slot or slot < best_slot or (slot == best_slot and last < best_last) then
        best, best_slot, best_last = i, slot, last
      end
    end
  end
  local at = per * (best - 1)
  local answer
  if np > 0 then -- the chosen key's acquire_all with the partners
    if nh > 0 and not declare_history(keys[at + 2], keys[at + 3], argv, kept) then
      return fail('bad history')
    end
    local sub_keys = {keys[at + 1], keys[at + 2]}
    local sub_argv = {'acquire_all', argv[8] == '-1' and '-' or argv[8], argv[3], argv[5],
                      argv[6], argv[7], argv[2], argv[4], argv[first + best - 1]}
    for j = 1, np do
      sub_keys[2 * j + 1], sub_keys[2 * j + 2] = keys[per * n + 2 * j - 1], keys[per * n + 2 * j]
      for m = 0, 2 do sub_argv[#sub_argv + 1] = argv[11 + 3 * (j - 1) + m] end
    end
    answer = op_acquire_all(sub_keys, sub_argv, 'acquire_all')
  else
    local sub_keys = {keys[at + 1], keys[at + 2], nh > 0 and keys[at + 3] or nil}
    local sub_argv = {'acquire', argv[2], argv[3], argv[4], argv[5], argv[6], argv[7], argv[8],
                      argv[first + best - 1]}
    for j = 1, nh do sub_argv[9 + j] = argv[9 + j] end
    answer = op_acquire(ks[best], q, sub_keys, sub_argv)
  end
  if type(answer) ~= 'string' then return answer end -- (an error)
  return 'any:' .. best .. ' ' .. answer
end
