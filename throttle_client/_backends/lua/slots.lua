-- The script, part 6: a call's earliest slot, what remains at a slot, call ids, and the
-- checks before a booking.

-- The earliest slot for `cost`: max(now, last + gap, pause, each sliding rate's), then
-- the calendar windows; or nil and the time whose window the limiter did not give.
-- A sliding rate first looks up the running total through now - period (k.seen[i]):
-- when that already reaches the target, the rate does not hold the call back, and the
-- same figure gives its remaining at now, so a rate that is not full costs one lookup.
local function earliest_slot(k, cost)
  local q = k.q
  for i = 1, q.nrates do
    if q.windows[i] and now < q.windows[i].keep then return nil, now end
  end
  local slot = math.max(now, k.pause, k.last + q.gap)
  if k.last < 0 then slot = math.max(now, k.pause) end
  k.seen = {}
  for i = 1, q.nrates do
    if not q.windows[i] then
      local target, older = k.total - q.limits[i] + cost, through(k, i, now - q.periods[i])
      k.seen[i] = older
      if target > older then
        slot = math.max(slot, reach(k, i, target) + q.periods[i])
      end
    end
  end
  return calendar_slot(k, slot, cost)
end

local function remaining_at(k, point, out)
  local q = k.q
  for i = 1, q.nrates do
    local w, used = q.windows[i]
    if not w then
      local older = point == now and k.seen and k.seen[i] -- (bookings come at now or later)
      used = k.total - (older or through(k, i, point - q.periods[i]))
    else
      local first, last = counting(w, point)
      if first then
        used = 0
        for j = first, last do used = math.max(used, counted(k, i, j)) end
      else -- outside the windows given: the one holding now, every booked unit counted
        used = k.total - through(k, i, w.keep - w.margin - 1)
      end
    end
    out[#out + 1] = math.max(0, q.limits[i] - used)
  end
  return out
end

local function stale(at) -- the windows given do not reach `at`: nothing was written
  return reply({now, at}, 'stale ')
end

-- Call ids. A retried call (its answer lost, the limiter tries again with the same id,
-- marked as a retry) must get the slot its first attempt booked, never a second one.
-- An entry's member carries its call's id after its running total (entry(cum) .. id):
-- no member of its own, and a first attempt, whose id is new, never looks. A retry looks
-- through the entries of the last KEEP_IDS (a limiter's retries of a call end within its
-- retry_for, 1 s by default, plus a 1 s timeout), which trimming spares (at_now). Past
-- that, an id serves no one: entries are rewritten without it in batches (compact_ids),
-- once the oldest that may hold one (M's idold) is 2 x KEEP_IDS old, so that a long log
-- costs what its running totals cost. An older version kept the ids as members of their
-- own, "c" .. id scored -(slot + 1): those go in the same step.

local function booked(k, id) -- the slot an earlier attempt of this call booked, if any
  -- Newest first, a page at a time: slots go in arrival order, so a retried call's entry
  -- is among the newest, even behind a queue booked far ahead.
  local since, at = format('%d', now - KEEP_IDS), 0
  repeat
    local page = redis.call('ZREVRANGEBYSCORE', k.log, '+inf', since, 'WITHSCORES', 'LIMIT', at, 64)
    for i = 1, #page, 2 do
      if string.sub(page[i], 7) == id then return tonumber(page[i + 1]) end
    end
    at = at + 64
  until #page < 128
end

local function compact_ids(k) -- entries past KEEP_IDS lose their ids; true if any did
  if k.idold < 0 or k.idold >= now - 2 * KEEP_IDS then return false end
  local from, upto = format('%d', k.idold), format('(%d', now - KEEP_IDS)
  local old = redis.call('ZRANGEBYSCORE', k.log, from, upto, 'WITHSCORES')
  if #old > 0 then
    redis.call('ZREMRANGEBYSCORE', k.log, from, upto)
    local args = {}
    for i = 1, #old, 2 do -- each again by its running total alone (a repair's keeps its mark)
      args[#args + 1] = old[i + 1]
      args[#args + 1] = #old[i] > 7 and string.sub(old[i], 1, 6) or old[i]
      if #args >= 2000 or i + 1 >= #old then -- (unpack's limit on arguments)
        redis.call('ZADD', k.log, unpack(args))
        args = {}
      end
    end
  end
  redis.call('ZREMRANGEBYSCORE', k.log, '-inf', '(0') -- an older version's id members
  -- The entries from now - KEEP_IDS on may still hold ids, if the log has any.
  k.idold = k.last >= now - KEEP_IDS and now - KEEP_IDS or -1
  return true
end

-- A call's id as the limiter sends it: "~" before a retry's, "=" before a first
-- attempt's; then 2 to 9 bytes (a limiter's are 6): an entry stays small, and its member
-- is neither a repair's (7 bytes) nor the older layout's (16).
local function read_id(arg)
  local mark = arg and string.sub(arg, 1, 1)
  if mark ~= '~' and mark ~= '=' then return nil end
  local id = string.sub(arg, 2)
  if #id < 2 or #id > 9 then return nil end
  return id, mark == '~'
end

-- A refused acquire books nothing, but takes the ids past their time out of the log.
local function tidy(k)
  if compact_ids(k) then save(k, math.max(k.last, k.pause) + k.q.horizon, false) end
end

local function past_totals(k, cost) -- a 6-byte member holds totals below 2^48
  if k.total + cost >= TOTALS then
    return format('running total %d + %d reaches 2^48: reset the key', k.total, cost)
  end
end

local function check_cost(q, cost)
  for i = 1, q.nrates do
    if cost > q.limits[i] then return format('cost %d above limit %d', cost, q.limits[i]) end
  end
end

-- A call at `slot`, in each coarse log of the key's bounded rates (once per log; before
-- k.total counts it): in the bucket that counts it, the entries no window from now on
-- reads dropped but the newest of them, the base (sliding_log.book).
local function book_coarse(k, slot, cost)
  local q, done = k.q, {}
  for i = 1, q.nrates do
    local name, w = q.names[i], q.windows[i]
    if name and not done[name] then
      done[name] = true
      local c, at, cutoff = coarse_of(k, name)
      if w then -- the end of its window, or of the margin before that end
        local own = counting(w, slot)
        at = w.ends[own] - 1
        if slot < w.ends[own] - w.margin then at = at - w.margin end
        cutoff = w.keep - w.margin - 1
      else
        at, cutoff = slot - slot % q.widths[i] + q.widths[i] - 1, now - q.periods[i]
      end
      c = c_add(c, at, cost)
      local drop = upto(c, slot_at, cutoff) - 1
      if drop > 0 then c = string.sub(c, 13 * drop + 1) end
      k.coarse[name], k.views[name] = c, c
    end
  end
end


-- Stacked keys without head-of-line blocking (filling.py, which says why): in a key a
-- stacked call shares (each after its first), the call takes the earliest slot from
-- `floor` on (`latest` at most: after the key's newest call, which always fits) at which
-- it fits among the bookings there; in a key of exact sliding rates, with a gap no
-- longer than its longest window, no learned limit in force, a booking at or after
-- `floor`, and at most FILL_MOST bookings from the longest window before `floor` on.
local FILL_MOST = 256

local function fillable(k, floor)
  local q = k.q
  return q.plain and k.last >= floor and k["until"] <= floor and q.gap <= q.reach
    and floor - q.reach >= k.trimmed
end

-- The spans [start, end) in which `cost` does not fit among the key's bookings from
-- `floor` on, in order by start (filling.spans_from), or nil when more than FILL_MOST
-- bookings bear on them: too near a booking for the gap, or in a window that would go
-- over. Each rate's events (a booking entering the windows, and leaving them a period
-- later) come from two lists in slot order, merged (a leave first at the same moment).
local function spans_from(k, floor, cost)
  local q = k.q
  local since = floor - q.reach
  local page = redis.call('ZRANGEBYSCORE', k.log, format('(%d', since), '+inf', 'WITHSCORES',
    'LIMIT', 0, FILL_MOST + 1)
  if #page > 2 * FILL_MOST then return nil end
  local before, slots, units, n = cum_through(k, since), {}, {}, 0
  for i = 1, #page, 2 do
    local cum = total_of(page[i])
    n = n + 1
    slots[n], units[n] = tonumber(page[i + 1]), cum - before
    before = cum
  end
  local spans = {}
  if q.gap > 0 then
    for j = 1, n do spans[#spans + 1] = {slots[j] - q.gap + 1, slots[j] + q.gap} end
  end
  for r = 1, q.nrates do
    local period, room = q.periods[r], q.limits[r] - cost
    local held, over_from, a, b = 0, nil, 1, 1
    while b <= n do
      local at
      if a <= n and slots[a] < slots[b] + period then -- a booking enters its windows
        at, held, a = slots[a], held + units[a], a + 1
      else -- one leaves them
        at, held, b = slots[b] + period, held - units[b], b + 1
      end
      if not over_from and held > room then
        over_from = at
      elseif over_from and held <= room then
        spans[#spans + 1] = {over_from - period + 1, at}
        over_from = nil
      end
    end
  end
  table.sort(spans, function(x, y) return x[1] < y[1] end)
  return spans
end

-- The earliest slot from `floor` on (`latest` at most) at which `cost` fits among the
-- key's bookings (filling.Fills.slot). The spans are read once per script call and key
-- (k.fill), for the rounds of common_slot and the keys of a pool: they stay true from any
-- later floor on, until the key books again (its total moves) or begins again.
local function fill_slot(k, floor, cost, latest)
  local f = k.fill
  if not f or f.floor > floor or f.cost ~= cost or f.total ~= k.total or f.born ~= k.born then
    f = {floor = floor, cost = cost, total = k.total, born = k.born,
         spans = spans_from(k, floor, cost)}
    k.fill = f
  end
  if not f.spans then return latest end
  local slot = floor
  for _, span in ipairs(f.spans) do -- the first moment no span covers
    if span[1] > slot then break end
    if span[2] > slot then slot = span[2] end
  end
  return math.min(slot, latest)
end

-- The slot that suits every key of a stacked call (sliding_log.common_slot), ks[1] its
-- own: from the latest of the keys' earliest slots (a shared key's counted only when it
-- cannot be filled), each shared key's first slot that suits it from there (fill_slot),
-- and every key's calendar windows, round again until the slot stays; or nil and the
-- time whose windows the limiter did not give.
local function common_slot(ks, costs, lead)
  local latest, n = {}, #ks
  for i = 1, n do
    local earliest, missing = earliest_slot(ks[i], costs[i])
    if not earliest then return nil, missing end
    latest[i] = earliest
  end
  local slot = math.max(now + lead, latest[1])
  for i = 2, n do
    if not fillable(ks[i], slot) then slot = math.max(slot, latest[i]) end
  end
  repeat
    local later = slot
    for i = 1, n do
      local k = ks[i]
      if i > 1 and later < latest[i] and fillable(k, later) then
        later = fill_slot(k, math.max(later, k.pause), costs[i], latest[i])
      elseif i > 1 then
        later = math.max(later, latest[i])
      end
      local fits, missing = calendar_slot(k, later, costs[i])
      if not fits then return nil, missing end
      later = math.max(later, fits)
    end
    local moved = later ~= slot
    slot = later
  until not moved
  return slot
end
