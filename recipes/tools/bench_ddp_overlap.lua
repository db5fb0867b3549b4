-- recipes/tools/bench_ddp_overlap.lua — how much of DDP's gradient communication hides
-- behind backward, and tokens/s of the default recipe at 1 and N ranks.
--
--   gptlua recipes/tools/bench_ddp_overlap.lua [--ranks=2] [--steps=5] [--rounds=3] [--bucket_mb=1]
--                                [--recipe=recipes/shakespeare.lua]
--
-- Without a launcher it measures one rank (all cores), then starts
-- `gptlua -n RANKS` on itself; every rank of that job times, per step
-- (slowest rank, mean over --steps after 2 warm-up steps, best of --rounds):
--   compute   the same step with no communication (the local policy)
--   overlap   DDP: each bucket's all-reduce starts from the gradient-ready
--             hooks during backward
--   serial    DDP with every all-reduce started after backward
--   comm      the all-reduces of all buckets alone
-- hidden = 1 - (overlap - compute) / (serial - compute): the fraction of
-- the communication time that backward covers.  The default 25 MB bucket
-- would hold the whole default model (3.2 MB of gradients) in one bucket,
-- which can only start when backward ends, hence --bucket_mb=1.
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local train = require 'gptlua.train'
local now = require('gptlua.cli').now

local opts = { ranks = '2', steps = '5', rounds = '3', bucket_mb = '1', recipe = 'recipes/shakespeare.lua' }
local passthrough = {}
for _, a in ipairs(arg or {}) do
  local k, v = a:match('^%-%-([%w_]+)=(.*)$')
  if not k or opts[k] == nil then error('bench_ddp_overlap: unknown argument ' .. a, 0) end
  opts[k] = v
  passthrough[#passthrough + 1] = a
end
local steps, bucket_mb = tonumber(opts.steps), tonumber(opts.bucket_mb)

local world = dist.init {}
local N = world.size

local function load_recipe()
  local path = opts.recipe
  local f = io.open(path)
  if f then f:close() else path = gl.root .. '/' .. path end
  local r = dofile(path)
  -- train_step only: nothing is written to out_dir
  r.quiet, r.eval_interval, r.sample_length, r.log_interval, r.peak_flops = true, 0, 0, 0, 1e12
  r.out_dir = (os.getenv('TMPDIR') or '/tmp') .. '/gptlua_ddp_overlap'
  return r
end

-- mean seconds per train_step over `steps` after 2 warm-up steps, slowest rank
local function time_steps(t, setup)
  if setup then setup(t) end
  for _ = 1, 2 do t:train_step() end
  world:barrier()
  local t0 = now()
  for _ = 1, steps do t:train_step() end
  local dt = (now() - t0) / steps
  return world:all_reduce_number(dt, 'max')
end

local function trainer(policy)
  local r = load_recipe()
  r.dist, r.bucket_mb = policy, bucket_mb
  return train.new(r, {})
end

if N == 1 then
  local t = trainer('none')
  local B, T = t.cfg.batch_size, t.cfg.block_size
  local s1 = math.huge
  for _ = 1, tonumber(opts.rounds) do s1 = math.min(s1, time_steps(t)) end
  local tps1 = B * T / s1
  print(('1 rank  (%d threads): %.1f ms/step, %.0f tokens/s'):format(gl.get_num_threads(), 1000 * s1, tps1))
  io.stdout:flush()
  local cmd = ('%s -n %s %s %s 2>&1'):format(GPTLUA.exe, opts.ranks, arg[0], table.concat(passthrough, ' '))
  local p = io.popen(cmd)
  local tpsN
  for line in p:lines() do
    print(line)
    tpsN = tpsN or tonumber(line:match('^tokens/s: ([%d.]+)'))
  end
  local ok = p:close()
  if not tpsN then error('bench_ddp_overlap: the ' .. opts.ranks .. '-rank run failed (' .. cmd .. ')', 0) end
  print(('scaling 1 -> %s ranks: %.2fx tokens/s (ideal %sx)'):format(opts.ranks, tpsN / tps1, opts.ranks))
  return ok and 0 or 1  -- the exit status of the N-rank run
end

-- the modes alternate over rounds and each keeps its best round, so load
-- from other processes that comes and goes hits them alike
local tl, t = trainer('none'), trainer('ddp')
local buckets = t.policy.buckets
local function comm_alone()
  local ws = {}
  for _, b in ipairs(buckets) do ws[#ws + 1] = world:all_reduce_async(b.grad, 'avg') end
  for _, w in ipairs(ws) do w:wait() end
end
local function time_comm()
  for _ = 1, 2 do comm_alone() end
  world:barrier()
  local t0 = now()
  for _ = 1, steps do comm_alone() end
  return world:all_reduce_number((now() - t0) / steps, 'max')
end
local best = { compute = math.huge, overlap = math.huge, serial = math.huge, comm = math.huge }
for _ = 1, tonumber(opts.rounds) do
  best.compute = math.min(best.compute, time_steps(tl))
  best.overlap = math.min(best.overlap, time_steps(t, function(x) x.policy.overlap = true end))
  best.serial = math.min(best.serial, time_steps(t, function(x) x.policy.overlap = false end))
  best.comm = math.min(best.comm, time_comm())
end
local compute, overlap, serial, comm = best.compute, best.overlap, best.serial, best.comm

local B, T = t.cfg.batch_size, t.cfg.block_size
local bytes = 0
for _, b in ipairs(buckets) do bytes = bytes + b.grad:numel() * 4 end
if world.rank == 0 then
  local exposed, total = overlap - compute, serial - compute
  print(('%d ranks (%d threads each), %d buckets of <= %g MB, %.1f MB of gradients'):format(N, gl.get_num_threads(),
    #buckets, bucket_mb, bytes / 2 ^ 20))
  print(('compute %.1f ms | overlap %.1f ms | serial %.1f ms | comm alone %.1f ms   (per step, slowest rank)'):format(
    1000 * compute, 1000 * overlap, 1000 * serial, 1000 * comm))
  if total > 0 then
    local hidden = 1 - exposed / total
    local note = (hidden < 0 or hidden > 1) and ' (clamped: the step-time noise exceeds the difference)' or ''
    print(('communication after backward costs %.1f ms; overlapped %.1f ms: %.0f%% hidden behind backward%s'):format(
      1000 * total, 1000 * exposed, 100 * math.max(0, math.min(1, hidden)), note))
  else
    print(('communication after backward costs %.1f ms, overlapped %.1f ms: below the noise of this machine '
      .. '(the collectives alone take %.1f ms)'):format(1000 * total, 1000 * exposed, 1000 * comm))
  end
  print(('tokens/s: %.0f (%d ranks x %d x %d per step, %.1f ms/step)'):format(N * B * T / overlap, N, B, T,
    1000 * overlap))
end
