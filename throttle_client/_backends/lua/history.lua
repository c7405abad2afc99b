-- The script, part 7: usage history (opt-in), and its operations.

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


-- history_read: a key's usage history, "field count field count ..." (keys: H).
local function op_history_read(keys)
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

-- history: declares where the next operation's bookings are counted (keys: M, H).
local function op_history(keys, argv)
  if #keys ~= 2 or not declare_history(keys[1], keys[2], argv, 4) then
    return fail('bad history')
  end
  return '1'
end
