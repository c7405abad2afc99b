-- throttle_client: one key's sliding-window log, decided and booked in one atomic step.
-- The script's first part: the storage, the arguments and replies, quotas and a key's M.
-- The backend (_backends/redis_script.py, PARTS) joins the parts in order: each uses only what
-- the parts before it define.
-- The algorithm is sliding_log.py's (see that module for the reasoning); the storage is
-- shaped so that an admission on a key in steady state costs five redis.call()s: TIME,
-- GET, ZRANGE (L's newest entry, checked against M), ZADD, SET. A rate whose window
-- reaches into the log adds its lookups (ZREVRANGEBYSCORE: the running total through a
-- time; ZRANGE: where a total was reached), renewing the TTLs (once the horizon passes
-- `exp`) a PEXPIRE; a refusal costs TIME, GET, ZRANGE and a lookup, a key's first call
-- seven (TIME, GET, ZREVRANGEBYSCORE, ZADD, SET, PEXPIRE, SET); a batch of admissions of
-- one key, one ZADD each and the other four once (run_batch). benchmarks/commands.py
-- counts them.
--
-- KEYS[1] L, the log: one zset holding each admitted call once: member = its running
--         total as 6 bytes big-endian (so members of one slot sort by total), score =
--         its slot (µs, >= 0). "Running total through t" is one range lookup by score;
--         "slot at which the running total reaches y" is one lookup by rank from the
--         newest entry while every entry after y cost 1 (M's `wcum`), a bisection over
--         ranks otherwise. The call's id follows the 6 bytes (6 more: a retried call
--         finds its slot, see "Call ids") until it is KEEP_IDS old, then goes: a 6-byte
--         member keeps an entry at ~100 bytes. An older
--         version kept the ids as members of their own, "c" .. id scored -(slot + 1).
-- KEYS[2] M, the meta: msgpack of ("tc2", last, total, base, pause, first, exp, since,
--            until, limit, from, born, wcum, idold, coarse, trimmed) (µs and costs; -1 for no entry; since..from:
--            a limit learned from the upstream, counted from running total `from`, until 0
--            for none; born: when the key's running totals began, the script's now when
--            it makes a meta afresh; wcum: the running total of the newest entry that cost
--            more than 1; idold: the slot of the oldest entry that may still hold its id, -1 for none; coarse:
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
--         earliest that suits them all (after the first key's newest call; among the
--         others' bookings where it fits: fill_slot), booked in every L (under the call
--         id in the first), or nowhere.
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
-- second key; one such word per key rebuilt), "repaired:damaged" for an M that held what no call writes (see "Damage"
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

local lines = {[0] = ''} -- n -> the format of a line of n integers

local function reply(values, word) -- integers, formatted with %d: never 1.7e+15
  -- (One format of the whole line: ~2x faster than one per value and a concat.)
  local n = #values
  local line = lines[n]
  if not line then line = string.rep('%d ', n - 1) .. '%d'; lines[n] = line end
  local text = (word or '') .. format(line, unpack(values))
  if repaired then return 'repaired:' .. repaired .. ' ' .. text end
  return text
end

local now -- this call's time (µs): the server's, or the one a test passes

-- A calendar rate's windows (calendar_windows.py; quota.Windows), read from
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

-- How long a logged call (so its id) is kept after its slot at least (quota.KEEP_IDS_US):
-- the log's horizon when every rate is bounded.
local KEEP_IDS = 5000000

-- A quota, read from its msgpack: {gap, limits, periods, windows, names, widths, nrates,
-- longest, smallest, horizon, slack, reach, fixed_keep}, or nil and what is wrong with
-- it; what depends on `now` is added per call (at_now). A rate's period is a number
-- (sliding, µs), [period, width] (bounded sliding: names[i] its coarse log) or an array
-- of windows (calendar; names[i] if bounded). `reach` (the longest exact sliding period)
-- and `fixed_keep` (the earliest exact calendar window's start) say how far back the log
-- must keep its calls: bounded rates count in their coarse logs instead.
local function parse_quota(packed)
  local ok, quota = pcall(cmsgpack.unpack, packed or '')
  if not ok or type(quota) ~= 'table' then return nil, 'bad quota' end
  local gap, nrates = whole(quota[1], 0), (#quota - 1) / 2
  if not gap or nrates < 1 or nrates % 1 ~= 0 then return nil, 'bad quota' end
  local q = {gap = gap, nrates = nrates, limits = {}, periods = {}, windows = {}, names = {},
             widths = {}, longest = 0, smallest = math.huge, reach = 0, fixed_keep = math.huge}
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
      if not w.name and w.keep - w.margin < q.fixed_keep then q.fixed_keep = w.keep - w.margin end
    else
      period = whole(period, 1)
      if not limit or not period then return nil, 'bad rate #' .. i end
      q.limits[i], q.periods[i] = limit, period
      if period > q.longest then q.longest = period end
      if period > q.reach then q.reach = period end
    end
    if limit < q.smallest then q.smallest = limit end
  end
  -- Plain: exact sliding rates only, the quota a plain decision (plain.lua) serves.
  q.plain = next(q.windows) == nil and next(q.widths) == nil
  q.horizon = math.max(q.longest, gap)
  if q.reach == 0 and q.fixed_keep == math.huge then -- only bounded rates: the log keeps
    q.horizon = math.max(q.horizon, KEEP_IDS) -- its calls KEEP_IDS
  end
  q.slack = math.max(math.floor(q.horizon / 10), 1000000) -- TTL renewal batch, µs
  return q
end

-- A parsed quota made ready for this `now`: {keep, cutoff, batch, at} set on it, in place
-- (a copy per call costs a table of 16 fields; `at` says which now they are for).
-- `keep`: the windows need every call after it; `cutoff`: entries at or before it count
-- in no window any more, nor hold an id a retry may ask for; `batch`: trimming's, a
-- tenth of how far back the log reaches (not of the bounded rates' periods, which it
-- does not hold), so that it holds at most 10 % more than it must.
local function at_now(p)
  local keep = p.fixed_keep
  if p.reach > 0 and now - p.reach + 1 < keep then keep = now - p.reach + 1 end
  if keep == math.huge then keep = now - KEEP_IDS end
  -- Trimming spares the entries of the last KEEP_IDS whatever the windows: they hold the
  -- call ids a retry looks for. (What the windows need, `keep`, is unchanged by it.)
  local spared = math.min(keep, now - KEEP_IDS)
  p.keep, p.cutoff, p.at = keep, spared - 1, now
  p.batch = math.max(math.floor((now - spared) / 10), 1000000)
end

-- Parsed quotas by their msgpack, kept across calls where the script is a function
-- library (its chunk runs once, at load: a limiter's quota is then decoded and checked
-- once, not on every decision; as a script, once per call), at most PARSED of them (a
-- calendar rate's windows move on: its quotas change with time).
local PARSED = 256
local parsed, nparsed = {}, 0

-- A quota read from its msgpack, ready for this `now`: a batch's operations of one
-- limiter send the same quota, read once (the same table, by which open() knows its
-- keys).
local function read_quota(packed)
  local p = parsed[packed or '']
  if not p then
    local problem
    p, problem = parse_quota(packed)
    if not p then return nil, problem end
    if nparsed >= PARSED then parsed, nparsed = {}, 0 end
    parsed[packed], nparsed = p, nparsed + 1 -- (a quota that reads is a string)
  end
  if p.at ~= now then at_now(p) end
  return p
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

