-- The script, part 10: limits learned from the upstream.

-- learn: a limit the upstream reported (k, read with quota q).
local function op_learn(k, q, keys, argv)
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
