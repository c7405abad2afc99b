-- The script, part 2 (redis_script.py, PARTS): a key opened, with whatever of it is lost or
-- damaged rebuilt first.

-- Partial state. L and M expire together, but either can be lost alone (maxmemory
-- eviction, a DEL, keys written by an older version) and M can hold bytes this script
-- cannot read. Whatever is missing is rebuilt here, in this atomic step, so that the
-- slot arithmetic never admits a call the lost state would have refused. A key of the
-- wrong type is not repaired: the GET or ZREVRANGEBYSCORE on it fails, and stays an error.
--
-- An entry made by a repair holds every lost unit, more than any call may cost: its
-- member is marked, entry(total) .. 'r' (7 bytes), so that a summary rebuilt from the
-- log later does not take it for an entry of at most the smallest limit.
local function collapsed(cum)
  return entry(cum) .. 'r'
end

-- A log of the older layout ("tc1": two members per call, "s%015d" by slot and
-- "c<call id>" by -(running total)) is rewritten in this layout, entry for entry, in the
-- step that first finds it; its ids go (a retry across an upgrade books anew). Its
-- repaired entry (id "c:repaired") stays marked as one. Returns the oldest slot (-1: no
-- entry) and the running total of the newest entry that cost more than 1 (or whose cost
-- is unknown: the oldest, when `base` is not known).
local function convert(log, base)
  local old = redis.call('ZRANGEBYSCORE', log, 0, '+inf', 'WITHSCORES')
  local mended = redis.call('ZSCORE', log, 'c:repaired')
  mended = mended and -tonumber(mended)
  redis.call('DEL', log)
  local args, wcum, before = {}, 0, base
  for i = 1, #old, 2 do
    local cum = tonumber(string.sub(old[i], 2))
    args[#args + 1] = old[i + 1]
    args[#args + 1] = cum == mended and collapsed(cum) or entry(cum)
    if not before or cum - before > 1 or cum == mended then wcum = cum end
    before = cum
    if #args >= 2000 or i + 1 >= #old then -- (unpack's limit on arguments)
      redis.call('ZADD', log, unpack(args))
      args = {}
    end
  end
  return old[2] and tonumber(old[2]) or -1, wcum
end

-- Damage. M may also read well and still hold what no step of this script writes (a hand
-- in the store, a restored backup, a bug): each field is checked against its range and
-- the others, and against L's newest entry (read in place of a plain EXISTS: no more
-- calls), so that a meta that counts fewer units than L holds can never admit more:
-- - numbers out of range or at odds with each other (a total below `base`, a negative
--   or fractional field, `first` after `last`, a log said empty with units past `base`),
--   or a newest entry of L beyond M's total or at another slot, or one that still matters
--   while M says L is empty: M is rebuilt from L as if it were lost (a readable pause is
--   kept): "repaired:damaged";
-- - L's newest entry below M's total (units deleted from L): the units it lacks are put
--   at the newest slot, as for a lost log: "repaired:log";
-- - a slot, a pause or a learned limit's end further ahead than any limiter sets (10
--   years, _ranges.py): no conservative repair exists (the key would wait that long),
--   so every call on the key fails, naming the store key, until it is reset.
local AHEAD = 315662400000000 -- 10 years and a day (µs): _ranges.FAR_AHEAD_US

local function damaged(meta, what) -- the error for a key no call may use until it is reset
  local name = string.match(meta, '^tc:(.+):meta$') or meta
  return format('store key %s is damaged: %s; reset() the key', name, what)
end

local function well_formed(k)
  -- (Each field checked in turn, with no table built: every call on a key runs this.)
  if not (whole(k.last, -1) and whole(k.first, -1) and whole(k.idold, -1) and whole(k.total, 0)
      and whole(k.base, 0) and whole(k.wcum, 0) and whole(k.pause, 0) and whole(k.expires, 0)
      and whole(k.born, 0) and whole(k.trimmed, 0) and whole(k.since, 0) and whole(k["until"], 0)
      and whole(k.learned, 0) and whole(k.from, 0)) then
    return false
  end
  if k.total >= TOTALS or k.from >= TOTALS or k.base > k.total or k.wcum > k.total then return false end
  if k.first < 0 then return k.total == k.base end -- (an empty log: every unit trimmed)
  return k.first <= k.last and k.total > k.base -- (every entry's total is above `base`)
end

-- What lies further ahead than any limiter sets, if anything; `slot`: the newest slot
-- too (M's, which L's newest entry may yet correct, is checked before L is written).
local function years(t) return (t - now) / 31557600000000 end

local function too_far(k, slot)
  local far = now + AHEAD
  if slot and k.last > far then return format('its newest slot is %.0f years ahead', years(k.last)) end
  if k.pause > far then return format('its pause ends %.0f years ahead', years(k.pause)) end
  if k["until"] > far then
    return format('its learned limit ends %.0f years ahead', years(k["until"]))
  end
end

local function placed(k, back) -- the entry `back` places before the newest: slot, total
  local hit = redis.call('ZRANGE', k.log, -back - 1, -back - 1, 'WITHSCORES')
  local slot = tonumber(hit[2]) -- (below the entries: the call ids, scored < 0)
  if slot and slot >= 0 then return slot, total_of(hit[1]) end
end

local function fresh_key(log, meta, q)
  return {log = log, meta = meta, q = q, last = -1, total = 0, base = 0, pause = 0, first = -1, expires = 0,
          since = 0, ["until"] = 0, learned = 0, from = 0, born = now, wcum = 0, idold = -1, coarse = {},
          views = {}, trimmed = 0, life = 0}
end

-- One key's state, read from its M, with whatever is lost or damaged rebuilt first
-- (nil and the error when it cannot be used).
local function open(log, meta, q, index) -- index: the key's place in an acquire_all
  local known = opened[meta]
  if known then
    if known.q == q and known.at == now and known.log == log then
      known.views, known.seen = {}, nil -- (this operation's own: coarse_of, earliest_slot)
      return known
    end
    flush(known) -- read by another quota or at another now: written first, read again
    opened[meta] = nil
  end
  local k = fresh_key(log, meta, q)
  local fixed, older, pause
  local state = redis.call('GET', meta)
  if state then
    local ok, tag, a, b, c, d, e, f, g, h, i, j, born, wcum, idold, coarse, trimmed, life = pcall(cmsgpack.unpack, state)
    if ok and (tag == 'tc2' or tag == 'tc1') and type(a) == 'number' and type(b) == 'number'
        and type(c) == 'number' and type(d) == 'number' and type(e) == 'number' and type(f) == 'number'
        and (tag == 'tc1' or (type(wcum) == 'number' and type(idold) == 'number')) then
      k.last, k.total, k.base, k.pause, k.first, k.expires = a, b, c, d, e, f
      k.born = type(born) == 'number' and born or 0
      if type(g) == 'number' and type(h) == 'number' and type(i) == 'number' and type(j) == 'number' then
        k.since, k["until"], k.learned, k.from = g, h, i, j
      end
      if tag == 'tc2' then
        k.wcum, k.idold, k.coarse = wcum, idold, read_coarse(coarse)
        k.trimmed = type(trimmed) == 'number' and trimmed or 0
        k.life = (life == 1 or life == 2 or life == 3) and life or 0
      else
        older = true
      end
      local wrong = too_far(k, false) -- (before the ranges: 2^62 is no whole number here)
      if wrong then return nil, damaged(meta, wrong) end
      if not well_formed(k) then -- rebuilt from L below, as if it were missing
        state, fixed, pause = nil, 'damaged', whole(k.pause, 0)
      end
    else
      state, fixed = nil, 'meta' -- unreadable: rebuilt from L below, as if it were missing
    end
  end
  if state then
    -- (A renewal past any time this script sets would never come: L would expire first.)
    if k.expires > now + 3 * AHEAD then k.expires = 0 end
    if older then -- (a log lost as well is repaired next, from what M says)
      local first, wcum = convert(log, k.base)
      if first >= 0 then k.first, k.wcum = first, wcum end
      k.idold, fixed = -1, 'older'
    end
    local slot, top = placed(k, 0) -- L's newest entry, checked against M
    if k.first >= 0 and (not slot or top < k.total) then -- (L is written below)
      local wrong = too_far(k, true)
      if wrong then return nil, damaged(meta, wrong) end
    end
    -- L lost, M kept: M says entries exist (and so L exists, the newest entry at least).
    -- Nothing tells when the lost units were admitted, so all of them are put at the
    -- newest slot: a rate that they fill waits until that slot + its period. A stall of at
    -- most one period after the last slot, never over-use.
    if k.first >= 0 and not slot then
      if k.total > k.base and k.last + q.horizon > now then
        redis.call('ZADD', log, format('%d', k.last), collapsed(k.total))
        k.first, k.wcum, k.idold, fixed = k.last, k.total, -1, 'log'
      else -- no window reaches the lost entries any more: no loss, an empty log
        k.first, k.base = -1, k.total
      end
    elseif k.first >= 0 and top < k.total then -- units gone from L: at its newest slot too
      k.last = math.max(k.last, slot)
      redis.call('ZADD', log, format('%d', k.last), collapsed(k.total))
      k.wcum, fixed = k.total, 'log'
    elseif slot and (top > k.total or (k.first >= 0 and slot ~= k.last)
        or (k.first < 0 and slot + q.horizon > now)) then
      state, fixed, pause = nil, 'damaged', k.pause -- M counts less than L holds
    end
  end
  if not state then
    -- No readable M: a new key, or M lost. If L still holds an entry that matters, M is
    -- rebuilt from it: last and total from the newest entry, first from the oldest, and
    -- base from the oldest's running total less the smallest limit (that entry cost no
    -- more than that: this counts too much, never too little), or 0 if the oldest was
    -- made by a repair (it may hold any number of units). A pause in force is lost, but
    -- that of a damaged M, when it reads as one. Costs are unknown: every entry up to the
    -- total counts as weighted (wcum).
    k = fresh_key(log, meta, q)
    k.pause = pause or 0
    local newest = redis.call('ZREVRANGEBYSCORE', log, '+inf', 0, 'WITHSCORES', 'LIMIT', 0, 1)
    if newest[1] and tonumber(newest[2]) + q.horizon > now then
      if #newest[1] == 16 and string.byte(newest[1], 1) == 115 then -- the older layout's
        -- "s" .. 15 digits (no entry of this one starts "s": a total's top byte is 0)
        convert(log, nil)
        newest = redis.call('ZREVRANGEBYSCORE', log, '+inf', 0, 'WITHSCORES', 'LIMIT', 0, 1)
      end
      local oldest = redis.call('ZRANGEBYSCORE', log, 0, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
      k.last, k.first, k.total = tonumber(newest[2]), tonumber(oldest[2]), total_of(newest[1])
      k.base = #oldest[1] == 7 and 0 or math.max(0, total_of(oldest[1]) - q.smallest)
      k.wcum, k.idold, fixed = k.total, 0, fixed or 'meta' -- (0: any ids there go at the next booking)
      k.life = 3 -- rebuilt from its log: no admitted call was lost
    elseif newest[1] then -- nothing in L can matter any more: a fresh start
      redis.call('DEL', log)
    end
  end
  local wrong = too_far(k, true)
  if wrong then return nil, damaged(meta, wrong) end
  if fixed then
    local word = index and (fixed .. ':' .. index) or fixed -- (every key's: a pool reads all)
    repaired = repaired and (repaired .. ' repaired:' .. word) or word
    save(k, math.max(now, k.last, k.pause) + q.horizon, true)
  end
  k.at = now -- (the now it was read at: a batch's operations may give others)
  opened[meta] = k
  opened_order[#opened_order + 1] = k
  return k
end

