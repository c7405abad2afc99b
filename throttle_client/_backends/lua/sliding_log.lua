-- throttle_client: one key's sliding-window log, decided and booked in one atomic step.
-- The algorithm is sliding_log.py's (see that module for the reasoning); the storage is
-- shaped so that an admission costs five redis.call()s: TIME, GET, ZRANGE (L's newest
-- entry, checked against M), ZADD, SET (and a batch of admissions of one key, one ZADD
-- each and the other four once: run_batch).
--
-- KEYS[1] L, the log: one zset holding each admitted call once: member = its running
--         total as 6 bytes big-endian (so members of one slot sort by total), score =
--         its slot (µs, >= 0). "Running total through t" is one range lookup by score;
--         "slot at which the running total reaches y" is one lookup by rank from the
--         newest entry while every entry after y cost 1 (M's `wcum`), a bisection over
--         ranks otherwise. One member of <= 6 bytes keeps an entry at ~105 bytes.
--         Besides, for KEEP_IDS after their slot only, the calls' ids: member "c" .. call
--         id, score -(slot + 1) (<= -1), so that a retried call finds its slot ("Call ids").
-- KEYS[2] M, the meta: msgpack of ("tc2", last, total, base, pause, first, exp, since,
--            until, limit, from, born, wcum, idold, coarse, trimmed) (µs and costs; -1 for no entry; since..from:
--            a limit learned from the upstream, counted from running total `from`, until 0
--            for none; born: when the key's running totals began, the script's now when
--            it makes a meta afresh; wcum: the running total of the newest entry that cost
--            more than 1; idold: the slot of the oldest call id in L, -1 for none; coarse:
--            the bounded rates' coarse logs, name -> 13 bytes per entry, see "Bounded
--            rates", or nil for none: older versions read the rest and drop it;
--            trimmed: L holds every entry after this slot, 0 for all). A
--            "tc1" meta is an older version's layout (two members per call, kept as
--            long as the entries): its log is rewritten in this one, see convert().
--            L and M are given one TTL together.
--   Both share one {hash tag}, so the script is legal on a Redis Cluster.
--
-- ARGV[1] the operation: acquire | inspect | pause | learn | reset | acquire_all | lease |
--         release | renew (the last three: concurrency caps, see "Concurrency caps" below),
--         card (a key's card, beside it: see run_one), or batch: several of them in one
--         call (see run_batch at the end). A transport's pause also gets KEYS[3], the
--         key's pushback, and ARGV[5] its reason, ARGV[6] "1" for a 429 (see push_back).
-- ARGV[2] the quota, msgpack of [gap, limit, period, limit, period, ...] (µs), which a
--         limiter encodes once: cmsgpack decodes it in C, far cheaper than parsing text.
--         A period is a number (sliding), [period, width] (a bounded sliding rate, in
--         buckets of width), or a calendar rate's windows (read_windows).
-- ARGV[3] now in µs, or "-" to use the server's TIME (only tests pass a time)
-- then    acquire: cost, max wait µs (-1 = any), call id, lead µs (no slot before
--         now + lead; optional, 0), mark (optional, -1: see Acquire.mark_us), expect
--         (optional, -1: "born,total" of the key as the worker knows it, see
--         lost_history);  pause:
--         duration µs;  learn: since, until, limit, from (-1: read from the log)
-- acquire_all (one call charged to several keys, all or nothing): KEYS are L, M pairs,
--         one per key, all in one hash slot; ARGV[2] "-" or the mark (Acquire.mark_us,
--         for the first key), ARGV[3] now, then max wait,
--         call id, lead, and per key its quota, its cost and its expect. One slot for every key, the
--         latest of their earliest slots, booked in every L under one call id, or nowhere.
-- The reply is one string of integers: a single bulk string costs a client far less
-- to read than an array:
--   acquire, acquire_all: ALLOWED NOW SLOT PAUSE REMAINING... [MARK BORN] (LIFE TOTAL)...
--   (acquire_all: each key's rates in turn, PAUSE the latest; MARK BORN: an admitted call
--   that asked for it; LIFE TOTAL: each key's born and running total, the last words; led
--   by "lost" when this call found a key that lost its history and held it: see
--   lost_history)
--   inspect: NOW NEXT PAUSE BOOKED (USED READY)...
--   pause: PAUSE NOW   reset, learn: 1   (inspect: IN_FLIGHT WAITING, 0 0 uncapped, and a
--   learned limit's LIMIT UNITS UNTIL, -1 -1 -1 for none, follow BOOKED;
--   a capped key's inspect gives its H, Q, A after L and M)
--
-- `first` (the oldest logged slot) lets a window that starts before it skip its
-- lookup; trimming runs in batches, once that entry is a tenth of the log's reach
-- (its longest exact window) past it; the TTLs are renewed only when the horizon
-- passes `exp`. Numbers travel as integers formatted with %d: Lua's own conversion
-- of a number would give 1.7e+15 for a timestamp in µs.
--
-- A part of the key that is lost (L or M) or unreadable (M) is rebuilt, conservatively,
-- by whichever call finds it so (see "Partial state" below); that call's reply is led
-- by the word "repaired:log" or "repaired:meta" (acquire_all: "repaired:log:2" names its
-- second key), "repaired:damaged" for an M that held what no call writes (see "Damage"
-- below), or "repaired:older" for a log rewritten from the older layout, so that the
-- client can say so.

-- The chunk only defines; run() does the work. So the same text is a script for EVALSHA
-- (its last line runs it) and, on Redis >= 7, a function library for FCALL (the backend
-- replaces that line with a registration), whose functions are then defined once, at
-- load, not on every call; a library's top level may not read globals such as `string`.
local format -- string.format, bound by run()

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

local function reply(values, word) -- integers, formatted with %d: never 1.7e+15
  for i = 1, #values do values[i] = format('%d', values[i]) end
  local text = (word or '') .. table.concat(values, ' ')
  if repaired then return 'repaired:' .. repaired .. ' ' .. text end
  return text
end

local now -- this call's time (µs): the server's, or the one a test passes

-- A calendar rate's windows (sliding_log.py, "calendar rates"; base.Windows), read from
-- its msgpack [keep_from, margin, start, end, start, end, ...], led by the name of its
-- coarse log if it is bounded: {keep, margin, starts, ends, longest, name}; the windows
-- in order, none overlapping.
local function read_windows(packed)
  local name, at = nil, 0
  if type(packed[1]) == 'string' then name, at = packed[1], 1 end
  local keep, margin, n = whole(packed[at + 1], 0), whole(packed[at + 2], 0), (#packed - at - 2) / 2
  if not keep or not margin or n < 1 or n % 1 ~= 0 then return nil end
  local w = {keep = keep, margin = margin, starts = {}, ends = {}, longest = 0, name = name}
  for i = 1, n do
    local a, b = whole(packed[at + 2 * i + 1], 0), whole(packed[at + 2 * i + 2], 0)
    if not a or not b or b <= a or (i > 1 and a < w.ends[i - 1]) then return nil end
    w.starts[i], w.ends[i] = a, b
    if b - a > w.longest then w.longest = b - a end
  end
  w.longest = w.longest + margin
  return w
end

-- How long a logged call (so its id) is kept after its slot at least (base.KEEP_IDS_US):
-- the log's horizon when every rate is bounded.
local KEEP_IDS = 5000000

-- A quota, read from its msgpack: {gap, limits, periods, windows, names, widths, nrates,
-- longest, smallest, horizon, slack, batch, keep, cutoff}, or nil and what is wrong with it. A
-- rate's period is a number (sliding, µs), [period, width] (bounded sliding: names[i]
-- its coarse log) or an array of windows (calendar; names[i] if bounded). `keep` and
-- `cutoff` are the log's: bounded rates count in their coarse logs instead.
local function parse_quota(packed)
  local ok, quota = pcall(cmsgpack.unpack, packed or '')
  if not ok or type(quota) ~= 'table' then return nil, 'bad quota' end
  local gap, nrates = whole(quota[1], 0), (#quota - 1) / 2
  if not gap or nrates < 1 or nrates % 1 ~= 0 then return nil, 'bad quota' end
  local q = {gap = gap, nrates = nrates, limits = {}, periods = {}, windows = {}, names = {},
             widths = {}, longest = 0, smallest = math.huge, keep = math.huge}
  for i = 1, nrates do
    local limit, period = whole(quota[2 * i], 1), quota[2 * i + 1]
    if type(period) == 'table' and #period == 2 then -- a bounded sliding rate
      local length, width = whole(period[1], 1), whole(period[2], 1)
      if not limit or not length or not width then return nil, 'bad rate #' .. i end
      q.limits[i], q.periods[i], q.widths[i] = limit, length, width
      q.names[i] = format('%d/%d', length, width)
      if length + width > q.longest then q.longest = length + width end
    elseif type(period) == 'table' then
      local w = read_windows(period)
      if not limit or not w then return nil, 'bad calendar rate #' .. i end
      q.limits[i], q.periods[i], q.windows[i], q.names[i] = limit, 0, w, w.name
      if w.longest > q.longest then q.longest = w.longest end
      if not w.name and w.keep - w.margin < q.keep then q.keep = w.keep - w.margin end
    else
      period = whole(period, 1)
      if not limit or not period then return nil, 'bad rate #' .. i end
      q.limits[i], q.periods[i] = limit, period
      if period > q.longest then q.longest = period end
      if now - period + 1 < q.keep then q.keep = now - period + 1 end
    end
    if limit < q.smallest then q.smallest = limit end
  end
  q.horizon = math.max(q.longest, gap)
  if q.keep == math.huge then -- only bounded rates: the log keeps its calls KEEP_IDS
    q.keep, q.horizon = now - KEEP_IDS, math.max(q.horizon, KEEP_IDS)
  end
  q.slack = math.max(math.floor(q.horizon / 10), 1000000) -- TTL renewal batch, µs
  -- Trimming batch: a tenth of how far back the log reaches (not of the bounded rates'
  -- periods, which it does not hold), so it holds at most 10 % more than it must.
  q.batch = math.max(math.floor((now - q.keep) / 10), 1000000)
  q.cutoff = q.keep - 1 -- entries at or before it count in no window any more
  return q
end

-- The quotas read at this `now`, by their msgpack: a batch's operations of one limiter
-- send the same quota, read once (and the same table, by which open() knows its keys).
local quotas, quotas_now = {}, nil

local function read_quota(packed)
  if quotas_now ~= now then quotas, quotas_now = {}, now end
  local q = quotas[packed or '']
  if q then return q end
  local problem
  q, problem = parse_quota(packed)
  if q then quotas[packed] = q end -- (a quota that reads is a string)
  return q, problem
end

local TOTALS = 281474976710656 -- 2^48: a running total is 6 bytes

local function entry(cum) -- the member of the entry whose running total is cum
  return struct.pack('>I6', cum)
end

local function total_of(member)
  return (struct.unpack('>I6', member))
end

local function pack_meta(k)
  -- (nil when the key has no coarse log: a key without bounded rates pays 1 byte)
  return cmsgpack.pack('tc2', k.last, k.total, k.base, k.pause, k.first, k.expires, k.since, k["until"],
    k.learned, k.from, k.born, k.wcum, k.idold, next(k.coarse) and k.coarse or nil, k.trimmed, k.life)
end

-- The coarse logs of a meta, as pack_meta writes them: name -> string of entries; one
-- that is not well formed is left out (begun again, as if lost: coarse_of).
local function read_coarse(packed)
  local logs = {}
  if type(packed) ~= 'table' then return logs end
  for name, c in pairs(packed) do
    if type(name) == 'string' and type(c) == 'string' and #c >= 13 and #c % 13 == 0 then
      logs[name] = c
    end
  end
  return logs
end

-- Write a key's M. When what still matters (`needed`) reaches past `expires`, L and M
-- get one new TTL together; otherwise M keeps the TTL it has (KEEPTTL). So the two
-- parts always expire together: a TTL computed from one worker's clock and written to
-- M alone could outlive L's (two injected clocks 10 s apart left M 10 s longer than L).
-- The write waits for the end of the script call (flush): a batch of acquires on one
-- key then reads and writes its M once, not once per acquire.
local function save(k, needed, renew)
  if k["until"] > needed then needed = k["until"] end -- a learned limit in force is kept
  if not k.needed or needed > k.needed then k.needed = needed end
  k.renew, k.saved_at = k.renew or renew, now
end

local function flush(k)
  local needed, renew = k.needed, k.renew
  if not needed then return end
  k.needed, k.renew = nil, false
  if not renew and needed <= k.expires then
    redis.call('SET', k.meta, pack_meta(k), 'KEEPTTL')
    return
  end
  k.expires = needed + k.q.slack
  local ttl = format('%d', math.ceil((k.expires - k.saved_at) / 1000))
  redis.call('PEXPIRE', k.log, ttl)
  redis.call('SET', k.meta, pack_meta(k), 'PX', ttl)
end

-- The keys this script call opened, by M's name, in order: a batch's later operations
-- on a key find it here, read already (with the same quota, at the same now).
local opened, opened_order

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
  local fields = {k.last, -1, k.first, -1, k.idold, -1, k.total, 0, k.base, 0, k.wcum, 0,
    k.pause, 0, k.expires, 0, k.born, 0, k.trimmed, 0, k.since, 0, k["until"], 0, k.learned, 0, k.from, 0}
  for i = 1, #fields, 2 do
    if not whole(fields[i], fields[i + 1]) then return false end
  end
  if k.total >= TOTALS or k.from >= TOTALS or k.base > k.total or k.wcum > k.total then return false end
  if k.first < 0 then return k.total == k.base end -- (an empty log: every unit trimmed)
  return k.first <= k.last and k.total > k.base -- (every entry's total is above `base`)
end

-- What lies further ahead than any limiter sets, if anything; `slot`: the newest slot
-- too (M's, which L's newest entry may yet correct, is checked before L is written).
local function too_far(k, slot)
  local function years(t) return (t - now) / 31557600000000 end
  if slot and k.last > now + AHEAD then return format('its newest slot is %.0f years ahead', years(k.last)) end
  if k.pause > now + AHEAD then return format('its pause ends %.0f years ahead', years(k.pause)) end
  if k["until"] > now + AHEAD then
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
    if known.q == q and known.log == log then
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
      if #newest[1] >= 16 then -- the older layout's "s" .. 15 digits: rewritten first
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
    repaired = index and (fixed .. ':' .. index) or fixed
    save(k, math.max(now, k.last, k.pause) + q.horizon, true)
  end
  opened[meta] = k
  opened_order[#opened_order + 1] = k
  return k
end

-- Until when a call logged at `from` may still count in a window of quota q: a sliding
-- rate's period after it (a bounded one's bucket more), a calendar rate's window that
-- counts it to its end (the longest window, when it lies outside those given), the gap.
local function counts_until(q, from)
  local last = from + q.gap
  for i = 1, q.nrates do
    local w, ends = q.windows[i], nil
    if w then
      for j = 1, #w.starts do
        if w.starts[j] - w.margin <= from and from < w.ends[j] then ends = w.ends[j] end
      end
      ends = ends or from + w.longest
    else
      ends = from + q.periods[i] + (q.widths[i] or 0)
    end
    if ends > last then last = ends end
  end
  return last
end

-- A store that lost a key's recent history (restarted without persistence, failed over
-- to a replica that lagged, restored from an older copy) would give its calls a second
-- quota. A worker that booked on the key within its horizon says which life of it it
-- knows and the running total it saw (`expect`: "born,total"). A key begun afresh since
-- (not at a reset, not rebuilt from its log: `life` 0) lost its history: it is held as if
-- every window had been full when it began again. One of that life that counts fewer
-- units than the worker saw lost its latest calls: held as if full now. Once per life
-- (`life` 2). True if it was held by this call.
local function lost_history(k, expect)
  if not expect or k.life == 2 then return false end
  local born, seen = string.match(expect, '^(%d+),(%d+)$')
  if not born then return false end
  local from
  if tonumber(born) ~= k.born then
    if k.life ~= 0 then return false end
    from = k.born
  elseif tonumber(seen) > k.total then
    from = now
  else
    return false
  end
  local held = counts_until(k.q, from)
  if held > k.pause then k.pause = held end
  k.life = 2
  save(k, math.max(k.pause, k.last) + k.q.horizon, false)
  return true
end

-- The slot at which the running total reaches `target` (0 < target <= total): that
-- of the oldest entry whose total is at least `target`; `trimmed` for a unit trimmed (it
-- lies at or before it: sliding_log.LogView.trimmed). When every entry after it cost
-- 1, it is `total - target` places before the newest: one lookup. Otherwise a bisection
-- over places: the entry at `lo` reaches the target, the one at `hi` does not (each entry
-- costs at least 1, so `total - target + 1` places back is below it, or not there).
local function time_at_cum(k, target)
  if target <= k.base then return k.trimmed end
  if target >= k.wcum then
    local slot, cum = placed(k, k.total - target)
    if cum == target then return slot end -- (else a damaged wcum: the bisection holds)
  end
  local lo, hi, slot = 0, k.total - target + 1, k.last
  while hi - lo > 1 do
    local mid = math.floor((lo + hi) / 2)
    local at, cum = placed(k, mid)
    if at and cum >= target then lo, slot = mid, at else hi = mid end
  end
  return slot
end

local function cum_through(k, t)
  if t < k.trimmed then return 0 end -- (how many trimmed units lie before t is not known)
  if k.first < 0 or t < k.first then return k.base end
  local hit = redis.call('ZREVRANGEBYSCORE', k.log, format('%d', t), 0, 'LIMIT', 0, 1)[1]
  return hit and total_of(hit) or k.base -- (none: a `first` later than M says)
end

-- Bounded rates (sliding_log.py: Coarse, coarse_of, placed). A bounded rate counts in a
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

-- Calendar rates (sliding_log.py, step for step): the given windows that count a slot
-- (first and last index; nil if one is not given), the units a window counts, and the
-- earliest slot from `slot` at which `cost` fits every calendar rate (or only rate
-- `only`): nil and the time whose window is missing, when one is.
local function counting(w, slot)
  local own = 0
  while own < #w.starts and w.starts[own + 1] <= slot do own = own + 1 end
  if own == 0 or slot >= w.ends[own] then return nil end
  if slot < w.ends[own] - w.margin then return own, own end
  if own == #w.starts or w.starts[own + 1] ~= w.ends[own] then return nil end
  return own, own + 1
end

local function counted(k, r, i) -- (rate r's window i)
  local w = k.q.windows[r]
  return through(k, r, w.ends[i] - 1) - through(k, r, w.starts[i] - w.margin - 1)
end

local function learned_units(k) -- units a learned limit counts: slots in [since, until),
  return cum_through(k, k["until"] - 1) - k.from -- the entries after running total `from`
end

local function calendar_slot(k, slot, cost, only)
  local q, moved = k.q, true
  while moved do
    moved = false
    for i = only or 1, only or q.nrates do
      local w = q.windows[i]
      if w then
        local first, last = counting(w, slot)
        if not first then return nil, slot end
        for j = first, last do
          if counted(k, i, j) + cost > q.limits[i] then
            slot, moved = w.ends[j], true
            break
          end
        end
      end
    end
    -- A limit learned from the upstream (not when asked about one rate only).
    if not only and k.since <= slot and slot < k["until"] and learned_units(k) + cost > k.learned then
      slot, moved = k["until"], true
    end
  end
  return slot
end

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

-- Call ids. A retried call (its answer lost, the limiter tries again with the same id)
-- must get the slot its first attempt booked, never a second one. The ZADD that books an
-- entry adds "c" .. id beside it, NX: a second booking of the id is found and undone.
-- The ids are kept only while a retry can come: KEEP_IDS after their slot (a limiter's
-- retries of a call end within its retry_for, 1 s by default, plus a 1 s timeout), then
-- dropped in batches (M's idold), so they add almost nothing to a long log's memory.

local function booked(k, id) -- the slot an earlier attempt of this call booked, if any
  local score = redis.call('ZSCORE', k.log, 'c' .. id)
  return score and -tonumber(score) - 1
end

local function drop_ids(k) -- the ids past KEEP_IDS go, a batch at a time; true if any went
  if k.idold >= 0 and k.idold < now - 2 * KEEP_IDS then
    redis.call('ZREMRANGEBYSCORE', k.log, format('(%d', -(now - KEEP_IDS) - 1), -1)
    local oldest = redis.call('ZREVRANGEBYSCORE', k.log, -1, '-inf', 'WITHSCORES', 'LIMIT', 0, 1)[2]
    k.idold = oldest and -tonumber(oldest) - 1 or -1
    return true
  end
end

-- A refused acquire books nothing, but drops the ids past their time: a key filled in a
-- burst and then refused would otherwise keep the burst's ids until it expires.
local function tidy(k)
  if drop_ids(k) then save(k, math.max(k.last, k.pause) + k.q.horizon, false) end
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

-- Usage history (throttle_client/_backends/history.py): per key, a hash H of the calls
-- booked per hour, day and month local to a zone ("h" .. id, "d" .. id, "m" .. id) and
-- the units beyond one per call ("H", "D", "M"), the newest `keep` periods of each. An
-- acquire carries H as its third key and the history's arguments after its own; a
-- stacked call's keys are declared by batch items "history" before it (keys: M, H;
-- argv: history, -, now, then the same arguments). book() counts each call it books,
-- in the same step.
local histories -- M's name -> {key, keep, offset, ttl}, for this script call
local HOUR, DAY = 3600000000, 86400000000
local GRAINS = {'h', 'd', 'm'}

local function month_of(day) -- days since 1970-01-01 -> year * 12 + month - 1
  local z = day + 719468 -- (H. Hinnant's civil_from_days, in whole numbers)
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
    - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local month, year = mp < 10 and mp + 3 or mp - 9, yoe + era * 400
  if month <= 2 then year = year + 1 end
  return year * 12 + month - 1
end

local function forget_before(key, grain, oldest) -- a grain's periods up to `oldest` go
  for _, field in ipairs(redis.call('HKEYS', key)) do
    local g, id = string.match(field, '^(%a)(%-?%d+)$')
    if g and string.lower(g) == grain and tonumber(id) <= oldest then
      redis.call('HDEL', key, field)
    end
  end
end

-- Where the bookings of key M are counted in this call: H, and argv[at..at + 4] (the
-- hours, days and months kept, the zone's offset in µs, H's TTL in ms); false if bad.
local function declare_history(m_key, h_key, argv, at)
  local h, d, m = whole(argv[at], 1), whole(argv[at + 1], 1), whole(argv[at + 2], 1)
  local offset, ttl = tonumber(argv[at + 3]), whole(argv[at + 4], 1)
  if not h or not d or not m or not offset or offset % 1 ~= 0 or not ttl then return false end
  histories[m_key] = {key = h_key, keep = {h, d, m}, offset = offset, ttl = ttl}
  return true
end

local function count_history(h, slot, cost)
  local here = slot + h.offset
  local day = math.floor(here / DAY)
  local ids, fresh = {math.floor(here / HOUR), day, month_of(day)}, false
  for i = 1, 3 do
    if redis.call('HINCRBY', h.key, format('%s%d', GRAINS[i], ids[i]), 1) == 1 then
      if not fresh then -- (the TTL first: a prune that fails leaves no hash without one)
        redis.call('PEXPIRE', h.key, format('%d', h.ttl))
      end
      fresh = true -- a new period: the one past what is kept goes
      forget_before(h.key, GRAINS[i], ids[i] - h.keep[i])
    end
    if cost > 1 then
      redis.call('HINCRBY', h.key, format('%s%d', string.upper(GRAINS[i]), ids[i]), cost - 1)
    end
  end
  if fresh then -- (a period begins: the offset it is counted at)
    redis.call('HSET', h.key, 'o', format('%d', h.offset)) -- (history.py's OFFSET)
  end
end

-- Book ``cost`` at ``slot`` under call ``id`` (nil: a stacked call's other keys, whose
-- retries are found in the first key); false if the id is already booked.
local function book(k, slot, cost, id)
  local cum = k.total + cost
  if id then
    if redis.call('ZADD', k.log, 'NX', format('%d', slot), entry(cum), format('%d', -slot - 1), 'c' .. id) < 2 then
      redis.call('ZREM', k.log, entry(cum))
      return false
    end
    if k.idold < 0 then k.idold = slot end
    drop_ids(k)
  else
    redis.call('ZADD', k.log, format('%d', slot), entry(cum))
  end
  book_coarse(k, slot, cost)
  local h = histories[k.meta]
  -- (Best effort: a history it cannot write, an ACL without HINCRBY say, never fails or
  -- half-writes a booking.)
  if h then pcall(count_history, h, slot, cost) end
  if cost > 1 then k.wcum = cum end
  k.total, k.last = cum, slot
  local fresh = k.first < 0 -- L was empty, so it was just created: it needs its TTL
  if fresh then k.first = slot end
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
  return true
end

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

-- A key's pushback (KEYS[3] of a transport's pause, a hash P): the reason of the pause in
-- force it set ("reason", with its end, "until"), and the refusals (429s) per step of
-- 10 s ("s:" .. step), the last 6 kept. P lives while the pause does, 70 s at least.
local PUSHBACK_STEP, PUSHBACK_STEPS = 10000000, 6

local function push_back(p, set_until, reason, refused) -- set_until: the pause it set
  if set_until and reason and reason ~= '' then
    redis.call('HSET', p, 'reason', reason, 'until', format('%d', set_until))
  end
  if refused then
    local step = math.floor(now / PUSHBACK_STEP)
    redis.call('HINCRBY', p, format('s:%d', step), 1)
    for _, field in ipairs(redis.call('HKEYS', p)) do
      local old = string.match(field, '^s:(%d+)$')
      if old and tonumber(old) <= step - PUSHBACK_STEPS then redis.call('HDEL', p, field) end
    end
  end
  local till = tonumber(redis.call('HGET', p, 'until') or '0') or 0
  local ttl = math.max(till - now, (PUSHBACK_STEPS + 1) * PUSHBACK_STEP)
  redis.call('PEXPIRE', p, format('%d', math.ceil(ttl / 1000)))
end

-- One operation, from its keys and arguments (KEYS and ARGV of the script).
local function run_one(keys, argv)
  repaired = nil
  local op = argv[1]
  if op == 'history_read' then -- a key's usage history: "field count field count ..."
    -- Only fields as count_history writes them pass, so that no name or value can break
    -- the reply (a space, a line of a batch's reply); the others are counted, as "? N".
    local all, out, skipped = redis.call('HGETALL', keys[1]), {}, 0
    for i = 1, #all, 2 do
      local name, count = all[i], all[i + 1]
      if (name == 'o' or string.match(name, '^[hdmHDM]%-?%d+$')) and string.match(count, '^%-?%d+$') then
        out[#out + 1] = name
        out[#out + 1] = count
      else
        skipped = skipped + 1
      end
    end
    if skipped > 0 then out[#out + 1] = '?'; out[#out + 1] = format('%d', skipped) end
    return table.concat(out, ' ')
  end
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

  if op == 'reset' then
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

  if op == 'history' then -- declares where the next operation's bookings are counted
    if #keys ~= 2 or not declare_history(keys[1], keys[2], argv, 4) then
      return fail('bad history')
    end
    return '1'
  end
  if op == 'fingerprint' then
    -- A namespace's record (base.Fingerprint; keys: R; argv: fingerprint, -, now, the
    -- fingerprint, a TTL in ms, 0 to only read it): the one it holds ("" for none), kept
    -- if it is the caller's, begun with it if it holds none.
    local ttl = whole(argv[5], 0)
    if #keys ~= 1 or type(argv[4]) ~= 'string' or not ttl then return fail('bad fingerprint') end
    local held = redis.call('GET', keys[1])
    if ttl == 0 then return held or '' end
    if not held or held == argv[4] then
      redis.call('SET', keys[1], argv[4], 'PX', format('%d', ttl))
      return argv[4]
    end
    return held
  end

  if op == 'card' then
    -- A key's card (JSON for operators: its label and rules), beside its M (keys: M, C;
    -- argv: card, -, now, the card, a TTL in ms), after the operation it rides with: it
    -- lasts as long as M will when this call ends (see flush), or that TTL if longer.
    local ttl = whole(argv[5], 1)
    if #keys ~= 2 or type(argv[4]) ~= 'string' or not ttl then return fail('bad card') end
    local k = opened[keys[1]]
    if k then
      local ends = k.expires
      if k.needed and (k.renew or k.needed > k.expires) then ends = k.needed + k.q.slack end
      ttl = math.max(ttl, math.ceil((ends - now) / 1000))
    else
      ttl = math.max(ttl, redis.call('PTTL', keys[1]))
    end
    -- The card it replaces, when that one said otherwise: workers that disagree about the
    -- key's rules (the client compares them).
    local before = redis.call('SET', keys[2], argv[4], 'PX', format('%d', ttl), 'GET')
    -- (Not a damaged one that holds a line break: a batch's answer is one line per item.)
    if before and before ~= argv[4] and not string.find(before, '\n', 1, true) then
      return before
    end
    return '1'
  end

  if op == 'release' or op == 'renew' then
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

  if op == 'acquire_all' or op == 'lease' then
    -- 'lease' is a capped call: argv[7] is its lease id: per key, argv gives quota, cost,
    -- expect (the life the worker knows, -1: none; see lost_history), and for a lease its
    -- cap (0: none) and lease TTL; keys give a capped key's H, Q, A after its L and M.
    local max_wait, id, lead = whole(argv[4], -1), argv[5], whole(argv[6], 0)
    local mark_us = argv[2] == '-' and -1 or whole(argv[2], 0) -- Acquire.mark_us, first key
    if not mark_us then return fail('bad mark') end
    if not max_wait then return fail('bad max wait') end
    if not id or id == '' then return fail('missing call id') end
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
    local earlier = booked(keys[1], id) -- the same call again: it holds its slot everywhere
    if earlier then return admitted(earlier) end
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
    local slot = now + lead
    for i = 1, n do
      local earliest, missing = earliest_slot(keys[i], costs[i])
      if not earliest then return stale(missing) end
      slot = math.max(slot, earliest)
    end
    repeat -- a key's calendar windows may move the slot on: round again until it stays
      local later = slot
      for i = 1, n do
        local fits, missing = calendar_slot(keys[i], slot, costs[i])
        if not fits then return stale(missing) end
        later = math.max(later, fits)
      end
      local moved = later ~= slot
      slot = later
    until not moved
    if max_wait >= 0 and slot - now > max_wait then
      for _, lk in ipairs(capped) do touch(lk) end
      for i = 1, n do tidy(keys[i]) end
      return answer(remaining_all(now, {0, now, slot, pause})) -- refused: nothing booked
    end
    local marked = mark_us >= 0 and cum_through(keys[1], slot - mark_us - 1) -- before booking
    book(keys[1], slot, costs[1], id) -- (not booked yet: booked() was asked above)
    for i = 2, n do book(keys[i], slot, costs[i]) end
    for _, lk in ipairs(capped) do -- held through the sleep to its slot too
      dequeue(lk, lease)
      hold(lk, lease, math.max(slot, now) + lk.ttl)
      touch(lk)
    end
    return admitted(slot, marked)
  end

  local q, problem = read_quota(argv[2])
  if not q then return fail(problem) end
  local k
  k, problem = open(keys[1], keys[2], q)
  if not k then return fail(problem) end

  if op == 'acquire' then
    -- A third key: its usage history, in argv[10..14] (lead, mark, expect are then given);
    -- expect is "born,total" (see lost_history), or -1.
    if keys[3] and not declare_history(keys[2], keys[3], argv, 10) then
      return fail('bad history')
    end
    local cost, max_wait, id = whole(argv[4], 1), whole(argv[5], -1), argv[6]
    local lead, mark_us = whole(argv[7] or 0, 0), whole(argv[8] or -1, -1)
    local expect = argv[9]
    if not cost then return fail('bad cost ' .. tostring(argv[4])) end
    if not max_wait then return fail('bad max wait') end
    if not lead or not mark_us then return fail('bad lead') end
    if not id or id == '' then return fail('missing call id') end
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
    local earliest, missing = earliest_slot(k, cost)
    if not earliest then
      local earlier = booked(k, id)
      if earlier then return admitted(earlier) end
      return stale(missing)
    end
    local slot = math.max(earliest, now + lead)
    if slot > earliest then -- a slot the lead moved on must fit the calendar windows there too
      slot, missing = calendar_slot(k, slot, cost)
      if not slot then
        local earlier = booked(k, id)
        if earlier then return admitted(earlier) end
        return stale(missing)
      end
    end
    if max_wait >= 0 and slot - now > max_wait then
      local earlier = booked(k, id)
      if earlier then return admitted(earlier) end
      tidy(k)
      return answer(remaining_at(k, now, {0, now, slot, k.pause})) -- refused: nothing booked
    end
    problem = past_totals(k, cost)
    if problem then return fail(problem) end
    local marked = mark_us >= 0 and cum_through(k, slot - mark_us - 1)
    if not book(k, slot, cost, id) then
      -- The same call again (a retry): it keeps the slot it booked.
      return admitted(booked(k, id))
    end
    local out = remaining_at(k, slot, {1, now, slot, k.pause})
    if marked then out[#out + 1] = marked; out[#out + 1] = k.born end
    return answer(out)
  end

  if op == 'inspect' then -- sliding_log.inspect: used (slots up to now) apart from booked (ahead)
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

  if op == 'learn' then -- sliding_log.learn: the newest report of the upstream holds
    local since, till, limit = whole(argv[4], 0), whole(argv[5], 0), whole(argv[6], 0)
    local from, born = whole(argv[7] or -1, -1), whole(argv[8] or -1, -1)
    if not since or not till or not limit or not from or not born then
      return fail('bad learned limit')
    end
    if till <= now or (k["until"] > now and since < k.since) then return '1' end
    if from < 0 then -- not marked: from the log, if it still holds every entry needed
      if since >= q.keep then
        from = cum_through(k, since - 1)
      else -- an answer later than the log keeps entries: a lower bound from the coarse
        for i = 1, q.nrates do -- logs of the bounded rates whose windows still reach it
          local name, w, reaches = q.names[i], q.windows[i], nil -- (counted_before), else
          if w then reaches = w.keep - w.margin <= since else reaches = now - q.periods[i] < since end
          if name and reaches then -- it is ignored
            local c = coarse_of(k, name)
            from = math.max(from, cum_at(c, math.max(upto(c, slot_at, since - 1), 1)))
          end
        end
        if from < 0 then return '1' end
      end
    elseif born ~= k.born or from > k.total then -- the key was forgotten since: count all
      from = 0
    end
    k.since, k["until"], k.learned, k.from = since, till, limit, from
    save(k, math.max(till, math.max(k.last, k.pause) + q.horizon), false)
    return '1'
  end

  if op == 'pause' then
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

  return fail('unknown op ' .. tostring(op))
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
  if argv[1] == 'batch' then ok, answer = true, run_batch(keys, argv) else ok, answer = pcall(run_one, keys, argv) end
  -- (What an operation wrote before it failed stays, as in any script: its M is written
  -- too, so that L never runs ahead of it.)
  for _, k in ipairs(opened_order) do flush(k) end
  if not ok then error(answer, 0) end
  return answer
end

return run(KEYS, ARGV)
