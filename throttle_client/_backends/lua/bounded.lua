-- The script, part 4: bounded rates, counted in coarse logs kept in M.

-- Bounded rates (coarse.py: Coarse, coarse_of; sliding_log.placed). A bounded rate counts in a
-- coarse log kept in M (name -> a string): one entry per bucket at the bucket's last
-- moment, 13 bytes each, its slot (7 bytes) and the running total after it (6), the
-- first entry the base. About buckets + 3 entries, read in place by bisection: no
-- redis.call, and no table built per call.
local function slot_at(c, i) return (struct.unpack('>I7', c, 13 * i - 12)) end
local function cum_at(c, i) return (struct.unpack('>I6', c, 13 * i - 5)) end
local function c_entry(slot, cum) return struct.pack('>I7I6', slot, cum) end

local function upto(c, read, value) -- how many entries have read(c, i) <= value
  local lo, hi = 0, #c / 13
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    if read(c, mid) <= value then lo = mid else hi = mid - 1 end
  end
  return lo
end

local function c_add(c, at, cost) -- c with cost more in the bucket ending at `at`
  local n = #c / 13
  local cum = cum_at(c, n) + cost
  if at <= slot_at(c, n) then return string.sub(c, 1, -7) .. struct.pack('>I6', cum) end
  return c .. c_entry(at, cum)
end

-- The coarse log `name`, holding every unit of the key: begun with all of them at the
-- newest slot if there is none (or not this key's), and the units it lacks (booked while
-- the rate was not bounded) added there. Kept in M only when a call is booked in it
-- (book_coarse), as on every store; k.views holds it for the rest of this call.
local function coarse_of(k, name)
  local c = k.views[name]
  if c then return c end
  c = k.coarse[name]
  local total = c and cum_at(c, #c / 13)
  if not c or total > k.total then
    c = k.last < 0 and c_entry(0, k.total) or c_entry(0, 0) .. c_entry(k.last, k.total)
  elseif total < k.total then
    c = c_add(c, k.last, k.total - total)
  end
  k.views[name] = c
  return c
end

-- Rate i's "running total through t" and "slot at which the total reaches `target`": in
-- its coarse log if it is bounded, else in the key's log.
local function through(k, i, t)
  local name = k.q.names[i]
  if not name then return cum_through(k, t) end
  local c = coarse_of(k, name)
  return cum_at(c, math.max(upto(c, slot_at, t), 1))
end

local function reach(k, i, target)
  local name = k.q.names[i]
  if not name then return time_at_cum(k, target) end
  local c = coarse_of(k, name)
  return slot_at(c, upto(c, cum_at, target - 1) + 1)
end

