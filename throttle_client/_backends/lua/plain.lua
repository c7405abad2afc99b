-- The script, part 12: a plain decision, in a straight line.
--
-- Most decisions are one acquire, tried for the first time, alone in its script call,
-- on a key in steady state under exact sliding rates: its M readable, well formed and in
-- agreement with L's newest entry; no learned limit in force, no usage history, no call
-- ids due to go. plain() decides those with only the work they need (TIME,
-- GET, L's newest entry, ZADD, SET, and the lookups its rates need): no dispatch, no
-- closures, no per-call copy of the quota, and earliest_slot and remaining_at reduced
-- to what exact sliding rates ask of them. For anything else, or anything it is not sure of, it returns nil before
-- its first write, and the operation runs the whole way (op_acquire), which answers and
-- writes the same: tests/test_plain_decision.py holds the two to the same replies and
-- the same bytes in the store. A feature added to op_acquire is one more reason to step
-- aside here, never one more cost here.

local NONE = {} -- a key's coarse logs when it has none (never written to here)

local function plain(keys, argv)
  if keys[3] then return nil end -- its usage history: op_acquire declares it
  local q = read_quota(argv[2])
  if not q or not q.plain then return nil end
  local id, retry = read_id(argv[6])
  if not id or retry then return nil end -- (a retry looks for its id: op_acquire)
  local cost, max_wait = whole(argv[4], 1), whole(argv[5], -1)
  local lead, mark_us = whole(argv[7] or 0, 0), whole(argv[8] or -1, -1)
  if not cost or not max_wait or not lead or not mark_us or check_cost(q, cost) then return nil end
  local state = redis.call('GET', keys[2])
  if not state then return nil end -- a new key, or its M lost: open() makes or rebuilds it
  local ok, tag, last, total, base, pause, first, expires, since, till, learned, from, born,
        wcum, idold, coarse, trimmed, life = pcall(cmsgpack.unpack, state)
  if not ok or tag ~= 'tc2' or coarse ~= nil or type(last) ~= 'number' or type(total) ~= 'number'
      or type(base) ~= 'number' or type(pause) ~= 'number' or type(first) ~= 'number'
      or type(expires) ~= 'number' or type(since) ~= 'number' or type(till) ~= 'number'
      or type(learned) ~= 'number' or type(from) ~= 'number' or type(born) ~= 'number'
      or type(wcum) ~= 'number' or type(idold) ~= 'number' or type(trimmed) ~= 'number' then
    return nil
  end
  if till > now or first < 0 or expires > now + 3 * AHEAD then return nil end
  if idold >= 0 and idold < now - 2 * KEEP_IDS then return nil end -- ids due to go: compact_ids
  local k = {log = keys[1], meta = keys[2], q = q, last = last, total = total, base = base,
             pause = pause, first = first, expires = expires, since = since, ["until"] = till,
             learned = learned, from = from, born = born, wcum = wcum, idold = idold,
             coarse = NONE, trimmed = trimmed,
             life = (life == 1 or life == 2 or life == 3) and life or 0}
  if not well_formed(k) or too_far(k, true) or past_totals(k, cost) then return nil end
  local newest, top = placed(k, 0) -- L's newest entry, as open() checks it
  if newest ~= last or top ~= total then return nil end
  if lost_history(k, argv[9]) then return nil end -- (it wrote nothing yet: save() waits)
  -- The earliest slot (earliest_slot, for exact sliding rates): the gap, the pause, the
  -- lead, and each rate's: a rate whose running total through now - period already
  -- reaches the call's target does not hold it back, and its lookup gives its remaining.
  local limits, periods, seen = q.limits, q.periods, {}
  local slot = math.max(now + lead, pause, last + q.gap)
  for i = 1, q.nrates do
    local older = cum_through(k, now - periods[i])
    seen[i] = older
    if total - limits[i] + cost > older then
      slot = math.max(slot, time_at_cum(k, total - limits[i] + cost) + periods[i])
    end
  end
  local out = {0, now, slot, pause}
  if max_wait >= 0 and slot - now > max_wait then -- refused: nothing booked or written
    for i = 1, q.nrates do out[i + 4] = math.max(0, limits[i] - total + seen[i]) end
    out[#out + 1] = born
    out[#out + 1] = total
    return reply(out)
  end
  -- Admitted: booked by book() (which trims the log when its time comes), and M written
  -- at once by flush() (renewing the TTLs when their time comes): nothing else of this
  -- call opens the key.
  local marked = mark_us >= 0 and cum_through(k, slot - mark_us - 1)
  book(k, slot, cost, id)
  flush(k)
  local cum = k.total
  out[1] = 1
  for i = 1, q.nrates do
    local older = slot == now and seen[i] or cum_through(k, slot - periods[i])
    out[i + 4] = math.max(0, limits[i] - cum + older)
  end
  if marked then out[#out + 1] = marked; out[#out + 1] = born end
  out[#out + 1] = born
  out[#out + 1] = cum
  return reply(out)
end
