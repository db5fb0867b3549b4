-- recipes/tools/bench_pipeline.lua — pipeline schedules measured on CPU ranks:
-- step time, bubble fraction and peak activation memory per stage, for
-- GPipe, 1F1B, interleaved 1F1B (2 virtual stages), ZB-H1 and ZB-H2 at p =
-- 2 and 4 stages and m = 4, 8 and 16 microbatches, next to the schedule's
-- theory.
--
--   gptlua recipes/tools/bench_pipeline.lua [--steps=2] [--n_layer=8] [--n_embd=128] [--block_size=64]
--                                     [--batch_size=2] [--ps=2,4] [--ms=4,8,16] [--detail=1]
--
-- Without a launcher it starts `gptlua -n P` on itself for each P.  A gpt2
-- (float32, one BLAS thread per rank) is cut into balanced stages; each
-- step's microbatches go through gptlua.dist.pipeline.  When the ranks fit
-- the cores this process may use, rank r is pinned to the r-th of them.
-- Timestamps around each action (pipeline.on_action) give three numbers:
--   wall      the bubble a clock on the wall sees: a rank is busy from the
--             moment an action's message arrived ('ready', or its start
--             when it receives nothing) to its end, idle the rest of the
--             step; idle / (ranks x step time).  Honest only with a core
--             per rank (pinned, a quiet machine): with more ranks than
--             cores a rank waits for a core, not for its message, and the
--             number is printed in brackets.
--   replay    each action's thread CPU time over the same span (what it
--             computed, whatever else ran on its core), averaged over the
--             steps, replayed through the schedule's dependencies
--             (schedules.simulate with cost.each): the bubble this step
--             has on a core per rank with messages that cost nothing.  It
--             differs from the theory where real actions differ from the
--             units (the embedding on the first stage, the head and loss
--             on the last, B and W unequal), and from wall by the messages
--             and the cores.
--   theory    the schedule's unit-time simulation: (p-1)/(m+p-1) for GPipe
--             and 1F1B, over v for interleaved, a backward twice a forward;
--             ZB-H1's and ZB-H2's B and W one forward each: (p-1)/(3m+p-1)
--             with the optimizer step synchronising the ranks (ours does:
--             the clipping norm).  overlap: the same if steps could overlap
--             (schedules.simulate's steady; ZB-H2's zero bubble).
-- Step time: the slowest rank's, averaged over --steps after one warm-up.
-- Peak activation memory: the CPU allocator's peak during the step less
-- what was allocated before it (parameters, the gradients the warm-up step
-- made, receive buffers), per stage (rank: with v = 2 a rank holds two).
-- --detail=1 also prints each rank's mean F, B and W thread CPU ms.
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local PP = require 'gptlua.dist.pipeline'
local S = require 'gptlua.dist.schedules'
local now = require('gptlua.cli').now
local ffi = require 'ffi'

local opts = { steps = '2', n_layer = '8', n_embd = '128', block_size = '64', batch_size = '2', ps = '2,4',
  ms = '4,8,16', p = '', detail = '0', cores = '' }
local passthrough = {}
for _, a in ipairs(arg or {}) do
  local k, v = a:match('^%-%-([%w_]+)=(.*)$')
  if not k or opts[k] == nil then error('bench_pipeline: unknown argument ' .. a, 0) end
  if not v:match('^[%d,]+$') then error(('bench_pipeline: --%s expected numbers, got %s'):format(k, v), 0) end
  opts[k] = v
  if k ~= 'p' and k ~= 'ps' and k ~= 'cores' then passthrough[#passthrough + 1] = a end
end
local function list(s) local t = {} for n in s:gmatch('%d+') do t[#t + 1] = tonumber(n) end return t end

ffi.cdef [[ int sched_getaffinity(int pid, size_t size, uint64_t *mask);
            int sched_setaffinity(int pid, size_t size, const uint64_t *mask); ]]
-- the cores this process may run on (0-based ids)
local function allowed_cores()
  local mask, cores = ffi.new('uint64_t[16]'), {}
  if ffi.C.sched_getaffinity(0, ffi.sizeof(mask), mask) ~= 0 then return cores end
  for c = 0, 1023 do
    if bit.band(bit.rshift(mask[math.floor(c / 64)], c % 64), 1ULL) ~= 0ULL then cores[#cores + 1] = c end
  end
  return cores
end

local world = dist.init {}
if world.size == 1 and opts.p == '' then
  local cores = allowed_cores()   -- (the ranks get this list: mpirun may bind each to one core already)
  print(('%d cores; ranks are pinned to one each where they fit (wall is meaningful there only)'):format(#cores))
  print('schedule       p   m | step ms | bubble wall | replay | theory | overlap | peak activations MB per stage')
  for _, p in ipairs(list(opts.ps)) do
    local cmd = ('OMPI_MCA_mpi_yield_when_idle=1 %s -n %d %s --p=%d --cores=%s %s 2>&1'):format(GPTLUA.exe, p,
      arg[0], p, table.concat(cores, ','), table.concat(passthrough, ' '))
    local h = io.popen(cmd)
    for line in h:lines() do print(line) end
    if not h:close() then return 1 end
  end
  return 0
end

gl.set_num_threads(1)
local p, steps = world.size, tonumber(opts.steps)
local cores = opts.cores ~= '' and list(opts.cores) or allowed_cores()
local pinned = #cores >= p
if pinned then
  local mask = ffi.new('uint64_t[16]')
  local c = cores[world.rank + 1]
  mask[math.floor(c / 64)] = bit.lshift(1ULL, c % 64)
  pinned = ffi.C.sched_setaffinity(0, ffi.sizeof(mask), mask) == 0
end
local thread_cpu = require('gptlua.libc').thread_cpu_seconds

local B, T = tonumber(opts.batch_size), tonumber(opts.block_size)
local mesh = dist.mesh { pp = p }
local function build()
  gl.manual_seed(1)
  return require('gptlua.models.gpt2').GPT({ vocab_size = 256, block_size = T, n_layer = tonumber(opts.n_layer),
    n_head = 4, n_embd = tonumber(opts.n_embd), dropout = 0 })
end
local model = build()

-- where each rank's numbers start in one list of them all, and its length
local function offsets(sizes)
  local n, offset = 0, {}
  for r = 1, p do offset[r] = n; n = n + sizes[r] end
  return offset, n
end

local function run(name, m, v)
  local pipe = PP.new(model, mesh.pp, { schedule = name, microbatches = m, virtual = v, batch = { B, T } })
  local sched = pipe.schedule
  local xs, ys = {}, {}
  local function ids(seed)
    local rows = {}
    for b = 1, B do rows[b] = {} for t = 1, T do rows[b][t] = (seed * 131 + b * 31 + t * 7) % 256 end end
    return gl.tensor(rows, { dtype = 'int64' })
  end
  for i = 1, m do xs[i], ys[i] = ids(i), ids(100 + i) end
  local mine = sched.ranks[world.rank + 1]
  local cpu = {}   -- this rank's action n: thread CPU seconds summed over the measured steps
  for n = 1, #mine do cpu[n] = 0 end
  local busy, from, cpu_from, measuring = 0, 0, 0, false
  pipe.on_action = function(at, _, n)
    local t, c = now(), thread_cpu()
    if at == 'start' or at == 'ready' then from, cpu_from = t, c
    else
      busy = busy + (t - from)
      if measuring then cpu[n] = cpu[n] + (c - cpu_from) end
    end
  end
  local total_t, total_busy, peak = 0, 0, 0
  for s = 0, steps do
    for _, prm in ipairs(pipe.params) do if prm.grad then prm.grad:zero_() end end  -- (kept: not activations)
    world:barrier()
    gl.reset_peak_memory('cpu')
    local base = gl.memory_stats('cpu').allocated
    busy, measuring = 0, s > 0   -- (step 0 warms up)
    local t0 = now()
    pipe:step(xs, ys)
    local dt = world:all_reduce_number(now() - t0, 'max')   -- the step ends with its slowest rank
    if s > 0 then
      total_t, total_busy = total_t + dt, total_busy + world:all_reduce_number(busy, 'sum')
      peak = math.max(peak, gl.memory_stats('cpu').peak - base)
    end
  end
  local step_t = total_t / steps
  local bubble = 1 - total_busy / (steps * p * step_t)
  -- every rank's action times and peaks to every rank: one float64 all-reduce
  local sizes = {}
  for r = 1, p do sizes[r] = #sched.ranks[r] + 1 end
  local offset, total = offsets(sizes)
  local d = {}
  for k = 1, total do d[k] = 0 end
  local o = offset[world.rank + 1]
  for n = 1, #mine do d[o + n] = cpu[n] / steps end
  d[o + #mine + 1] = peak / 2 ^ 20
  local buf = gl.tensor(d, { dtype = 'float64' })
  world:all_reduce(buf, 'sum')
  d = buf:tolist()
  local each, peaks = {}, {}
  for r = 1, p do
    each[r] = {}
    for n = 1, #sched.ranks[r] do each[r][n] = d[offset[r] + n] end
    peaks[r] = ('%.1f'):format(d[offset[r] + #sched.ranks[r] + 1])
  end
  local replay = S.simulate(sched, { each = each }).bubble
  local theory = S.simulate(sched)
  local wall = ('%.1f%%'):format(100 * bubble)
  dist.print0(('%-14s %d %3d | %7.1f | %11s | %5.1f%% | %5.1f%% | %6.1f%% | %s'):format(
    name .. (v > 1 and ' v' .. v or ''), p, m, 1000 * step_t, pinned and wall or '(' .. wall .. ')', 100 * replay,
    100 * theory.bubble, 100 * theory.steady, table.concat(peaks, ' ')))
  if opts.detail ~= '0' then
    for r = 1, p do
      local sum, count, line = {}, {}, {}
      for n, a in ipairs(sched.ranks[r]) do sum[a[1]] = (sum[a[1]] or 0) + each[r][n]; count[a[1]] = (count[a[1]] or 0) + 1 end
      for _, op in ipairs({ 'F', 'B', 'W' }) do
        if sum[op] then line[#line + 1] = ('%s %.2f'):format(op, 1000 * sum[op] / count[op]) end
      end
      dist.print0(('    rank %d: mean thread CPU ms %s'):format(r - 1, table.concat(line, ', ')))
    end
  end
end

for _, m in ipairs(list(opts.ms)) do
  run('gpipe', m, 1)
  run('1f1b', m, 1)
  if m % p == 0 and tonumber(opts.n_layer) >= 2 * p then run('interleaved', m, 2) end
  run('zbh1', m, 1)
  run('zbh2', m, 1)
end
