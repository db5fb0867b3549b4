-- recipes/bench_pipeline.lua — pipeline schedules measured on CPU ranks:
-- step time, bubble fraction and peak activation memory per stage, for
-- GPipe, 1F1B, interleaved 1F1B (2 virtual stages) and ZB-H1 at p = 2 and 4
-- stages and m = 4, 8 and 16 microbatches, next to the schedule's theory.
--
--   gptlua recipes/bench_pipeline.lua [--steps=2] [--n_layer=8] [--n_embd=128] [--block_size=64]
--                                     [--batch_size=2] [--ps=2,4] [--ms=4,8,16]
--
-- Without a launcher it starts `gptlua -n P` on itself for each P.  A gpt2
-- (float32, one thread per rank) is cut into balanced stages; each step's
-- microbatches go through gptlua.dist.pipeline.  The bubble is measured
-- from timestamps around each action (pipeline.on_action): a rank is busy
-- from the moment an action's message arrived ('ready', or its start when
-- it receives nothing) to its end; the rest of the step is idle.  Bubble =
-- idle / (ranks x step time), the step time the slowest rank's, averaged
-- over --steps after one warm-up step.  Theory: (p-1)/(m+p-1) for GPipe and
-- 1F1B, over v for interleaved, as the schedule's unit-time simulation with
-- a backward twice a forward gives; ZB-H1's B and W one forward each:
-- (p-1)/(3m+p-1).  Peak activation memory: the CPU
-- allocator's peak during the step less what was allocated before it
-- (parameters, the gradients the warm-up step made, receive buffers), per
-- stage (rank: with v = 2 a rank holds two stages).  On a shared machine with more ranks
-- than cores the times are noisy and a waiting rank's poll takes a core
-- from a busy one: compare ratios within one run.
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local PP = require 'gptlua.dist.pipeline'
local S = require 'gptlua.dist.schedules'
local now = require('gptlua.cli').now

local opts = { steps = '2', n_layer = '8', n_embd = '128', block_size = '64', batch_size = '2', ps = '2,4',
  ms = '4,8,16', p = '' }
local passthrough = {}
for _, a in ipairs(arg or {}) do
  local k, v = a:match('^%-%-([%w_]+)=(.*)$')
  if not k or opts[k] == nil then error('bench_pipeline: unknown argument ' .. a, 0) end
  if not v:match('^[%d,]+$') then error(('bench_pipeline: --%s expected numbers, got %s'):format(k, v), 0) end
  opts[k] = v
  if k ~= 'p' and k ~= 'ps' then passthrough[#passthrough + 1] = a end
end
local function list(s) local t = {} for n in s:gmatch('%d+') do t[#t + 1] = tonumber(n) end return t end

local world = dist.init {}
if world.size == 1 and opts.p == '' then
  print('schedule     p   m | step ms | bubble measured | theory | peak activations MB per stage')
  for _, p in ipairs(list(opts.ps)) do
    local cmd = ('OMPI_MCA_mpi_yield_when_idle=1 %s -n %d %s --p=%d %s 2>&1'):format(GPTLUA.exe, p, arg[0], p,
      table.concat(passthrough, ' '))
    local h = io.popen(cmd)
    for line in h:lines() do print(line) end
    if not h:close() then return 1 end
  end
  return 0
end

gl.set_num_threads(1)
local p, steps = world.size, tonumber(opts.steps)
local B, T = tonumber(opts.batch_size), tonumber(opts.block_size)
local mesh = dist.mesh { pp = p }
local function build()
  gl.manual_seed(1)
  return require('gptlua.models.gpt2').GPT({ vocab_size = 256, block_size = T, n_layer = tonumber(opts.n_layer),
    n_head = 4, n_embd = tonumber(opts.n_embd), dropout = 0 })
end
local model = build()

local function run(name, m, v)
  local pipe = PP.new(model, mesh.pp, { schedule = name, microbatches = m, virtual = v, batch = { B, T } })
  local xs, ys = {}, {}
  local function ids(seed)
    local rows = {}
    for b = 1, B do rows[b] = {} for t = 1, T do rows[b][t] = (seed * 131 + b * 31 + t * 7) % 256 end end
    return gl.tensor(rows, { dtype = 'int64' })
  end
  for i = 1, m do xs[i], ys[i] = ids(i), ids(100 + i) end
  local busy, from = 0, 0
  pipe.on_action = function(at)
    local t = now()
    if at == 'start' or at == 'ready' then from = t else busy = busy + (t - from) end
  end
  local total_t, total_busy, peak = 0, 0, 0
  for s = 0, steps do
    for _, prm in ipairs(pipe.params) do if prm.grad then prm.grad:zero_() end end  -- (kept: not activations)
    world:barrier()
    gl.reset_peak_memory('cpu')
    local base = gl.memory_stats('cpu').allocated
    busy = 0
    local t0 = now()
    pipe:step(xs, ys)
    local dt = world:all_reduce_number(now() - t0, 'max')   -- the step ends with its slowest rank
    if s > 0 then  -- (step 0 warms up)
      total_t, total_busy = total_t + dt, total_busy + world:all_reduce_number(busy, 'sum')
      peak = math.max(peak, gl.memory_stats('cpu').peak - base)
    end
  end
  local step_t = total_t / steps
  local bubble = 1 - total_busy / (steps * p * step_t)
  local peaks = {}
  local buf = gl.zeros({ p }, { dtype = 'float64' })
  local t = buf:tolist(); t[world.rank + 1] = peak / 2 ^ 20
  buf = gl.tensor(t, { dtype = 'float64' })
  world:all_reduce(buf, 'sum')
  for i, x in ipairs(buf:tolist()) do peaks[i] = ('%.1f'):format(x) end
  local theory = S.simulate(pipe.schedule).bubble
  dist.print0(('%-12s %d %3d | %7.1f | %14.1f%% | %5.1f%% | %s'):format(name .. (v > 1 and ' v' .. v or ''), p, m,
    1000 * step_t, 100 * bubble, 100 * theory, table.concat(peaks, ' ')))
end

for _, m in ipairs(list(opts.ms)) do
  run('gpipe', m, 1)
  run('1f1b', m, 1)
  if m % p == 0 and tonumber(opts.n_layer) >= 2 * p then run('interleaved', m, 2) end
  run('zbh1', m, 1)
end
