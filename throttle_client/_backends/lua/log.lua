-- The script, part 3: the log's running totals, looked up by time and by total, and a
-- key whose recent history the store lost.

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
-- (lost_hold: until when it would hold the key, or nil, writing nothing: a pool's choice.)
local function lost_hold(k, expect)
  if not expect or k.life == 2 then return nil end
  local born, seen = string.match(expect, '^(%d+),(%d+)$')
  if not born then return nil end
  local from
  if tonumber(born) ~= k.born then
    if k.life ~= 0 then return nil end
    from = k.born
  elseif tonumber(seen) > k.total then
    from = now
  else
    return nil
  end
  return counts_until(k.q, from)
end

local function lost_history(k, expect)
  local held = lost_hold(k, expect)
  if not held then return false end
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
  -- At or after the newest entry: its total, which open() checked M's against. (A
  -- transport's mark, `margin` before a call's slot, is one of these whenever its calls
  -- come further apart than the margin.)
  if t >= k.last then return k.total end
  local hit = redis.call('ZREVRANGEBYSCORE', k.log, format('%d', t), 0, 'LIMIT', 0, 1)[1]
  return hit and total_of(hit) or k.base -- (none: a `first` later than M says)
end

