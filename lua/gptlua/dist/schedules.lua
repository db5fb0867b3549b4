-- gptlua.dist.schedules — pipeline schedules as plain Lua data.
--
-- A schedule says, for every pipeline rank, the order in which it runs its
-- actions on one optimizer step's microbatches:
--
--   s = schedules.one_f_one_b(4, 8)         -- 4 ranks, 8 microbatches
--   s.ranks[1] = { {'F', 1, 1}, {'F', 2, 1}, {'F', 3, 1}, {'F', 4, 1}, {'B', 1, 1}, ... }
--
-- An action is {op, microbatch, stage}: op 'F' (forward), 'B' (backward;
-- the whole backward of the stage: input and weight gradients, unless the
-- schedule also has 'W' actions: then B makes the input gradients only and
-- W(i, st), after it on the same rank, the weight gradients), microbatch
-- 1..m, stage 1..p*v the model's stage (its blocks).  Rank r (1-based here,
-- pp coordinate r-1) holds stages r, r + p, r + 2p, ... (v > 1 only with
-- virtual stages: interleaved 1F1B).  A user may print a schedule
-- (schedules.format), edit its lists, and hand it to the pipeline:
-- schedules.check verifies it runs (every action once, the dependencies of
-- F and B met, no rank waiting forever) before any rank starts.
--
-- schedules.simulate runs a schedule in unit time (an F costs cost.F, a B
-- cost.B; a message arrives at once) and gives each action's start and end:
-- the timeline `gptlua --plan` prints and the theoretical bubble fraction
-- (idle time over the ranks' total time) measured bubbles are compared with.
local M = {}

local function fail(msg) error('pipeline schedule: ' .. msg, 0) end

local function posint(v, what)
  if type(v) ~= 'number' or v < 1 or v ~= math.floor(v) then
    fail(('%s expected a positive integer, got %s'):format(what, tostring(v)))
  end
end

local function new(name, p, m, v)
  local s = { name = name, stages = p * v, ranks_n = p, microbatches = m, virtual = v, ranks = {} }
  for r = 1, p do s.ranks[r] = {} end
  return s
end

-- GPipe: every forward, then every backward (in the reverse order: the
-- last microbatch's activations are the freshest).  All m microbatches are
-- in flight at once.
function M.gpipe(p, m)
  posint(p, 'stages'); posint(m, 'microbatches')
  local s = new('gpipe', p, m, 1)
  for r = 1, p do
    local l = s.ranks[r]
    for i = 1, m do l[#l + 1] = { 'F', i, r } end
    for i = m, 1, -1 do l[#l + 1] = { 'B', i, r } end
  end
  return s
end

-- 1F1B (PipeDream-flush, Megatron-LM's default): rank r runs p - r warm-up
-- forwards, then alternates one forward and one backward, then drains the
-- backwards.  At most p - r + 1 microbatches are in flight on rank r: the
-- activation memory is bounded by the number of stages, not microbatches.
function M.one_f_one_b(p, m)
  posint(p, 'stages'); posint(m, 'microbatches')
  local s = new('1f1b', p, m, 1)
  for r = 1, p do
    local l = s.ranks[r]
    local warm = math.min(p - r, m)
    local f, b = 0, 0
    for _ = 1, warm do f = f + 1; l[#l + 1] = { 'F', f, r } end
    while f < m do
      f = f + 1; l[#l + 1] = { 'F', f, r }
      b = b + 1; l[#l + 1] = { 'B', b, r }
    end
    while b < m do b = b + 1; l[#l + 1] = { 'B', b, r } end
  end
  return s
end

-- Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): each rank holds v
-- model chunks (virtual stages r, r + p, ...); microbatches go through the
-- chunks in groups of p, so the pipeline fills v times faster: the bubble
-- shrinks by v at the cost of v times the point-to-point messages.  The
-- k-th forward of every rank (0-based) is chunk (k // p) % v of microbatch
-- (k // (p v)) p + k % p; backwards run the chunks in reverse.  m must be a
-- multiple of p.
function M.interleaved(p, m, v)
  posint(p, 'stages'); posint(m, 'microbatches'); posint(v, 'virtual stages')
  if m % p ~= 0 then
    fail(('interleaved 1F1B needs microbatches a multiple of the %d pipeline ranks, got %d'):format(p, m))
  end
  local s = new('interleaved', p, m, v)
  local total = m * v
  local function fwd(k) return (math.floor(k / p) % v), math.floor(k / (p * v)) * p + k % p end
  local function bwd(k) local c, i = fwd(k); return v - 1 - c, i end
  for r = 1, p do
    local l = s.ranks[r]
    local warm = (v == 1) and math.min(p - r, m) or math.min((p - r) * 2 + (v - 1) * p, total)
    local f, b = 0, 0
    local function F() local c, i = fwd(f); f = f + 1; l[#l + 1] = { 'F', i + 1, c * p + r } end
    local function B() local c, i = bwd(b); b = b + 1; l[#l + 1] = { 'B', i + 1, c * p + r } end
    for _ = 1, warm do F() end
    while f < total do F(); B() end
    while b < total do B() end
  end
  return s
end

-- ZB-H1 (Qi et al. 2023, zero-bubble pipeline parallelism): backward split
-- into B (input gradients, on the critical path between stages) and W
-- (weight gradients, which nothing downstream waits for).  Rank i (0-based)
-- runs p - i warm-up forwards, then for each microbatch k: B_k, W_{k-i}
-- (its W's trail by i) and the next forward, then its last i W's.  With F =
-- B = W in time every rank idles p - 1 units in all (a third of 1F1B's
-- bubble, whose whole backward costs two), and holds at most p microbatches
-- (F done, W not yet), 1F1B's peak on its first rank.
function M.zbh1(p, m)
  posint(p, 'stages'); posint(m, 'microbatches')
  local s = new('zbh1', p, m, 1)
  for r = 1, p do
    local l, lag = s.ranks[r], r - 1
    local f, w = 0, 0
    for _ = 1, math.min(p - lag, m) do f = f + 1; l[#l + 1] = { 'F', f, r } end
    for k = 1, m do
      l[#l + 1] = { 'B', k, r }
      if k - lag >= 1 then w = w + 1; l[#l + 1] = { 'W', w, r } end
      if f < m then f = f + 1; l[#l + 1] = { 'F', f, r } end
    end
    while w < m do w = w + 1; l[#l + 1] = { 'W', w, r } end
  end
  return s
end

-- ZB-H2 (Qi et al. 2023, section 3's second handcrafted schedule): ZB-H1's
-- split backward with up to 2p - 1 microbatches in flight on every rank
-- (F done, W not yet) instead of p, so rank i (0-based) runs 2(p - i) - 1
-- warm-up forwards and the W's it postpones fill the tail: with F = B = W
-- in time every rank works without a gap from its first action to its
-- last (a parallelogram, not ZB-H1's trapezoid).  The lists come from the
-- rule that draws the paper's figure, run in unit time: at each unit a rank
-- runs the first it can of its next B (its gradient has arrived), its next
-- F (its input has arrived and fewer than 2p - 1 are in flight) and its
-- oldest W.  With the optimizer step synchronised (ours: the clipping norm
-- and the NaN skip) the step still ends p - 1 units after the first rank's
-- 3m, as ZB-H1's; the bubble is gone only where a rank may start the next
-- step as soon as its own part of this one ends (simulate's .steady).
function M.zbh2(p, m)
  posint(p, 'stages'); posint(m, 'microbatches')
  local s = new('zbh2', p, m, 1)
  local cap = 2 * p - 1
  local f, b, w, fin_f, fin_b = {}, {}, {}, {}, {}   -- counts done; finish times of F and B per rank
  for r = 1, p do f[r], b[r], w[r], fin_f[r], fin_b[r] = 0, 0, 0, {}, {} end
  local left, t = 3 * m * p, 0
  while left > 0 do
    for r = 1, p do
      local l = s.ranks[r]
      local nb, nf = b[r] + 1, f[r] + 1
      if b[r] < f[r] and (r == p or (fin_b[r + 1][nb] or math.huge) <= t) then
        b[r] = nb; fin_b[r][nb] = t + 1; l[#l + 1] = { 'B', nb, r }; left = left - 1
      elseif f[r] < m and f[r] - w[r] < cap and (r == 1 or (fin_f[r - 1][nf] or math.huge) <= t) then
        f[r] = nf; fin_f[r][nf] = t + 1; l[#l + 1] = { 'F', nf, r }; left = left - 1
      elseif w[r] < b[r] then
        w[r] = w[r] + 1; l[#l + 1] = { 'W', w[r], r }; left = left - 1
      end
    end
    t = t + 1
  end
  return s
end

M.builders = { gpipe = M.gpipe, ['1f1b'] = M.one_f_one_b, interleaved = M.interleaved, zbh1 = M.zbh1, zbh2 = M.zbh2 }
M.NAMES = 'gpipe, 1f1b, interleaved, zbh1 or zbh2'

-- does the schedule run weight gradients apart (W actions)?
function M.split(s)
  for _, l in ipairs(s.ranks) do for _, a in ipairs(l) do if a[1] == 'W' then return true end end end
  return false
end

-- make(name, p, m, v): the named schedule
function M.make(name, p, m, v)
  local b = M.builders[name]
  if not b then fail(('unknown schedule %s (expected %s)'):format(tostring(name), M.NAMES)) end
  if name ~= 'interleaved' and (v or 1) ~= 1 then
    fail(('virtual stages %d need the interleaved schedule, not %s'):format(v, name))
  end
  return b(p, m, v or 1)
end

-- the rank (1-based) holding stage st
function M.rank_of(s, st) return (st - 1) % s.ranks_n + 1 end

-- Runs the schedule in unit time: cost.F, cost.B (default 1 and 2: a
-- backward is about twice a forward's FLOPs), cost.W (default 1: in a split
-- schedule W costs cost.W and B the rest, cost.B - cost.W).  F(i, st) waits
-- for F(i, st-1); B(i, st) for F(i, st) and B(i, st+1); W(i, st) for B(i,
-- st).  Each rank runs its list in
-- order.  cost.each[r][n], when given, is the time of rank r's n-th action
-- (measured ones: recipes/tools/bench_pipeline.lua replays a real step's).
-- Returns {time = makespan, bubble = idle / (ranks x makespan), steady,
-- busy = {per rank}, at = {[rank] = {{start, finish}, ...}}} or fails naming
-- the action no rank could run (a schedule that would hang).  steady is the
-- bubble when consecutive steps overlap, each rank starting the next step's
-- work as soon as its own part of this one ends (no optimizer step
-- synchronising the ranks between them): idle / (ranks x the longest
-- rank's own span, first start to last finish).
function M.simulate(s, cost)
  cost = cost or {}
  local cF, cB, cW = cost.F or 1, cost.B or 2, cost.W or 1
  if M.split(s) then cB = cB - cW end
  local p, S, m = s.ranks_n, s.stages, s.microbatches
  local done = {}  -- done['F' .. i .. ':' .. st] = finish time
  local function key(op, i, st) return op .. i .. ':' .. st end
  local pos, clock, busy, at = {}, {}, {}, {}
  for r = 1, p do pos[r], clock[r], busy[r], at[r] = 1, 0, 0, {} end
  local left = 0
  for r = 1, p do left = left + #s.ranks[r] end
  while left > 0 do
    local progressed = false
    for r = 1, p do
      local a = s.ranks[r][pos[r]]
      while a do
        local op, i, st = a[1], a[2], a[3]
        local deps
        if op == 'F' then deps = { st > 1 and key('F', i, st - 1) or nil }
        elseif op == 'W' then deps = { key('B', i, st) }
        else deps = { key('F', i, st), st < S and key('B', i, st + 1) or nil } end
        local ready = clock[r]
        local ok = true
        for _, d in pairs(deps) do
          if done[d] == nil then ok = false; break end
          ready = math.max(ready, done[d])
        end
        if not ok then break end
        local c = cost.each and cost.each[r][pos[r]] or op == 'F' and cF or op == 'W' and cW or cB
        at[r][pos[r]] = { ready, ready + c }
        clock[r] = ready + c
        busy[r] = busy[r] + c
        done[key(op, i, st)] = ready + c
        pos[r], left, progressed = pos[r] + 1, left - 1, true
        a = s.ranks[r][pos[r]]
      end
    end
    if not progressed then
      for r = 1, p do
        local a = s.ranks[r][pos[r]]
        if a then
          fail(('rank %d waits forever at %s%d of stage %d (action %d of its list)'):format(r - 1, a[1], a[2], a[3],
            pos[r]))
        end
      end
    end
  end
  local span = 0
  for r = 1, p do span = math.max(span, clock[r]) end
  local idle, own, work = 0, 0, 0
  for r = 1, p do
    idle, work = idle + (span - busy[r]), work + busy[r]
    if #at[r] > 0 then own = math.max(own, at[r][#at[r]][2] - at[r][1][1]) end
  end
  return { time = span, bubble = idle / (p * span), steady = 1 - work / (p * own), busy = busy, at = at,
    microbatches = m }
end

-- Checks a (possibly hand-edited) schedule: each rank runs only its own
-- stages, every (F|B, microbatch, stage) appears once, and it runs to the
-- end (simulate).  Also that the messages on each link arrive in the order
-- they are received (activations and gradients each travel in order between
-- two ranks).  Returns s.
function M.check(s)
  if type(s) ~= 'table' or type(s.ranks) ~= 'table' then fail('expected a schedule table with .ranks') end
  posint(s.ranks_n, 'ranks_n'); posint(s.stages, 'stages'); posint(s.microbatches, 'microbatches')
  if #s.ranks ~= s.ranks_n then fail(('has %d rank lists, expected %d'):format(#s.ranks, s.ranks_n)) end
  if s.stages % s.ranks_n ~= 0 then
    fail(('%d stages do not spread evenly over %d ranks'):format(s.stages, s.ranks_n))
  end
  local seen = {}
  for r = 1, s.ranks_n do
    for n, a in ipairs(s.ranks[r]) do
      local op, i, st = a[1], a[2], a[3]
      if (op ~= 'F' and op ~= 'B' and op ~= 'W') or type(i) ~= 'number' or i < 1 or i > s.microbatches or i ~= math.floor(i)
          or type(st) ~= 'number' or st < 1 or st > s.stages or st ~= math.floor(st) then
        fail(('rank %d action %d: expected {F|B|W, microbatch 1..%d, stage 1..%d}, got {%s, %s, %s}'):format(r - 1, n,
          s.microbatches, s.stages, tostring(op), tostring(i), tostring(st)))
      end
      if M.rank_of(s, st) ~= r then
        fail(('rank %d action %d: stage %d lives on rank %d'):format(r - 1, n, st, M.rank_of(s, st) - 1))
      end
      local k = op .. i .. ':' .. st
      if seen[k] then fail(('%s%d of stage %d appears twice'):format(op, i, st)) end
      seen[k] = true
    end
  end
  local ops = M.split(s) and { 'F', 'B', 'W' } or { 'F', 'B' }  -- W for all or none
  for st = 1, s.stages do
    for i = 1, s.microbatches do
      for _, op in ipairs(ops) do
        if not seen[op .. i .. ':' .. st] then fail(('%s%d of stage %d is missing'):format(op, i, st)) end
      end
    end
  end
  -- in-order links: the order stage st sends its F outputs equals the
  -- order stage st+1 runs its F (likewise gradients backwards)
  local order = {}
  for r = 1, s.ranks_n do
    for _, a in ipairs(s.ranks[r]) do
      local k = a[1] .. a[3]
      order[k] = order[k] or {}
      table.insert(order[k], a[2])
    end
  end
  for st = 1, s.stages - 1 do
    local sf, rf = order['F' .. st], order['F' .. (st + 1)]
    local sb, rb = order['B' .. (st + 1)], order['B' .. st]
    for i = 1, s.microbatches do
      if sf[i] ~= rf[i] then
        fail(('stage %d runs F%d as its %d-th forward but stage %d sent F%d then: messages arrive in order'):format(
          st + 1, rf[i], i, st, sf[i]))
      end
      if sb[i] ~= rb[i] then
        fail(('stage %d runs B%d as its %d-th backward but stage %d sent B%d then: messages arrive in order'):format(
          st, rb[i], i, st + 1, sb[i]))
      end
    end
  end
  M.simulate(s)
  return s
end

-- The most microbatches stage st holds activations for at once (F done, B
-- not yet; W not yet in a split schedule: its weight gradients read them):
-- the buffers the pipeline allocates and the activation memory.
function M.in_flight(s, st)
  local r = M.rank_of(s, st)
  local n, most = 0, 0
  local last = M.split(s) and 'W' or 'B'
  for _, a in ipairs(s.ranks[r]) do
    if a[3] == st and (a[1] == 'F' or a[1] == last) then
      n = n + (a[1] == 'F' and 1 or -1)
      if n > most then most = n end
    end
  end
  return most
end

-- 1F1B's bubble fraction in theory: (p - 1) / (m + p - 1); interleaved
-- divides the p - 1 by v; ZB-H1 (split: F = B = W) idles p - 1 units of
-- its 3m: (p - 1) / (3m + p - 1).
function M.theory(p, m, v, split)
  v = v or 1
  if split then return (p - 1) / (3 * m + p - 1) end
  return ((p - 1) / v) / (m + (p - 1) / v)
end

-- A timeline, one line per rank, one cell per unit of time (simulate's),
-- e.g.  "rank 0 |F1|F2|  |B1 B1|..."  then the bubble fraction and each
-- stage's microbatches in flight (in_flight: its activation memory).
function M.format(s, cost)
  local sim = M.simulate(s, cost)
  local lines = { ('schedule %s: %d ranks, %d stages, %d microbatches'):format(s.name or 'custom', s.ranks_n,
    s.stages, s.microbatches) }
  local width = #tostring(s.microbatches) + 1 + (s.virtual and s.virtual > 1 and 1 + #tostring(s.stages) or 0)
  local function cell(a)
    local c = a[1] .. a[2]
    if s.virtual and s.virtual > 1 then c = c .. '.' .. a[3] end
    return c .. (' '):rep(width - #c)
  end
  for r = 1, s.ranks_n do
    local row, t = {}, 0
    for n, a in ipairs(s.ranks[r]) do
      local st, fin = sim.at[r][n][1], sim.at[r][n][2]
      for _ = t + 1, st do row[#row + 1] = (' '):rep(width) end
      for _ = st + 1, fin do row[#row + 1] = cell(a) end
      t = fin
    end
    for _ = t + 1, sim.time do row[#row + 1] = (' '):rep(width) end
    lines[#lines + 1] = ('rank %d |%s|'):format(r - 1, table.concat(row, '|'))
  end
  local split = M.split(s)
  local units = split and ('F = %d, B = %d, W = %d units; theory (p-1)/(3m+p-1)'):format((cost or {}).F or 1,
    ((cost or {}).B or 2) - ((cost or {}).W or 1), (cost or {}).W or 1)
    or ('F = %d, B = %d units; theory (p-1)/(m+p-1), over v if interleaved'):format((cost or {}).F or 1,
      (cost or {}).B or 2)
  lines[#lines + 1] = ('bubble %.1f%% of %d rank-units (%s: %.1f%%)')
    :format(100 * sim.bubble, sim.time * s.ranks_n, units, 100 * M.theory(s.ranks_n, s.microbatches, s.virtual, split))
  if sim.steady < sim.bubble - 1e-9 then  -- (ZB-H2: the idle units all at the step's ends)
    lines[#lines + 1] = ('bubble %.1f%% when steps overlap (each rank goes on to the next step as its own part ends)')
      :format(100 * sim.steady)
  end
  local held = {}
  for st = 1, s.stages do held[st] = M.in_flight(s, st) end
  lines[#lines + 1] = ('microbatches in flight per stage (activations held): %s'):format(table.concat(held, ' '))
  return table.concat(lines, '\n'), sim
end

return M
