-- The script, part 5: calendar rates, whose windows the client computes and passes in.

-- Calendar rates (calendar_windows.py, step for step): the given windows that count a slot
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

