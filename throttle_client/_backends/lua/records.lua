-- The script, part 9: what is kept for operators beside a key (pushback, cards) and a
-- namespace's record.

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


-- fingerprint: a namespace's record of its key secret's fingerprint.
local function op_fingerprint(keys, argv)
  -- A namespace's record (ops.Fingerprint; keys: R; argv: fingerprint, -, now, the
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

-- card: a key's card, written beside its M.
local function op_card(keys, argv)
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
