-- recipes/tools/bench_fsdp.lua — step time and memory per rank of the data-parallel
-- policies on one model, FSDP against no sharding.
--
--   gptlua -n 2 recipes/tools/bench_fsdp.lua [--policies=none,ddp,zero2,fsdp,fsdp-noprefetch,fsdp-noreshard]
--          [--n_layer=6] [--n_embd=256] [--vocab_size=4096] [--block_size=64]
--          [--batch_size=4] [--rounds=5] [--steps=2] [--warmup=2] [--json=PATH]
--          [--dtype=float32] [--fp8=off|tensorwise|rowwise]
--
-- Every policy trains the same GPT-2 on random tokens with the same batch per
-- rank ('none': each rank trains alone, no communication).  All trainers
-- are built first; then `rounds` times each policy runs `steps` steps in
-- turn, so a busy machine slows every policy alike, and the median round
-- counts.  Per policy, on rank 0: the slowest rank's ms/step, and per rank
-- the bytes held between steps (parameters, gradients, optimizer state)
-- and the step's peak (held + the largest transient of any step).  For
-- FSDP also the ms per step spent waiting for all-gathers; with
-- 'fsdp-noprefetch' among the policies the share of all-gather time that
-- prefetch hides is
--   1 - wait(prefetch) / wait(no prefetch)
-- (without prefetch every gather is waited for in full; a wait includes
-- waiting for the slower rank to arrive).  'fsdp-noreshard' keeps each
-- block gathered from its forward to its backward (reshard_after_forward =
-- false): no recomputation, more memory.  Per policy also the bytes a rank
-- sends per step (every collective, counted as gptlua.dist counts them:
-- Comm.sent_bytes).  With --fp8 (emulated on the CPU) 'fsdp' gathers the FP8
-- layers' weights as float8 codes and 'fsdp-fp8hp' in the model's dtype
-- (fsdp.fp8_all_gather = false):
--   gptlua -n 2 recipes/tools/bench_fsdp.lua --policies=fsdp,fsdp-fp8hp --fp8=tensorwise
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local train = require 'gptlua.train'
local fsdp = require 'gptlua.dist.fsdp'
local cjson = require 'cjson'
local now = require('gptlua.cli').now

local opts = { policies = 'none,ddp,zero2,fsdp,fsdp-noprefetch,fsdp-noreshard', n_layer = '6', n_embd = '256',
               vocab_size = '4096', block_size = '64', batch_size = '4', rounds = '5', steps = '2', warmup = '2',
               json = '', dtype = 'float32', fp8 = 'off' }
for _, a in ipairs(arg or {}) do
  local k, v = a:match('^%-%-([%w_]+)=(.*)$')
  if not k or opts[k] == nil then error('bench_fsdp: unknown argument ' .. a, 0) end
  opts[k] = v
end

local world = dist.init {}
-- fsdp options travel with the policy name
local VARIANTS = { fsdp = {}, ['fsdp-noprefetch'] = { prefetch = false },
                   ['fsdp-noreshard'] = { reshard_after_forward = false },
                   ['fsdp-fp8hp'] = { fp8_all_gather = false } }
local variant = {}
package.loaded['fsdp_bench_policy'] = { new = function(name, o)
  for k, v in pairs(variant) do o[k] = v end
  return fsdp.new(name, o)
end }
dist.POLICIES.fsdp = 'fsdp_bench_policy'

local function recipe(pol)
  return { name = 'fsdp_bench', model = 'gpt2', data = 'random', vocab_size = tonumber(opts.vocab_size),
    n_layer = tonumber(opts.n_layer), n_head = 4, n_embd = tonumber(opts.n_embd), block_size = tonumber(opts.block_size),
    batch_size = tonumber(opts.batch_size), max_iters = 1e9, eval_interval = 0, log_interval = 0, sample_length = 0,
    warmup_iters = 0, quiet = true, device = 'cpu', peak_flops = 1e12, bias = false, seed = 1, dist = pol,
    dtype = opts.dtype, fp8 = opts.fp8, fp8_emulate = opts.fp8 ~= 'off',
    out_dir = (os.getenv('TMPDIR') or '/tmp') .. '/gptlua_fsdp_bench' }   -- nothing is written there
end

local function settle() collectgarbage('collect'); collectgarbage('collect') end
local function max_over_ranks(x) return world:all_reduce_number(x, 'max') end
local function per_rank(x)
  local out = {}
  for r = 0, world.size - 1 do out[r + 1] = world:all_reduce_number(r == world.rank and x or 0, 'sum') end
  return out
end
local function median(xs)
  local s = {}
  for i, x in ipairs(xs) do s[i] = x end
  table.sort(s)
  return s[math.floor((#s + 1) / 2)]
end
local function steps(t, n) for _ = 1, n do t:train_step(); t.step = t.step + 1 end end
-- bytes this rank has sent over the trainer's communicators (each counted once)
local function sent(t)
  local seen, n = {}, 0
  for _, c in ipairs({ world, t.policy and t.policy.comm, t.policy and t.policy.shard, t.policy and t.policy.replica }) do
    if c and not seen[c] then seen[c] = true; n = n + (c.sent_bytes or 0) end
  end
  return n
end

-- build and warm up every trainer; bytes held between steps
local runs = {}
for name in opts.policies:gmatch('[^,]+') do
  variant = VARIANTS[name] or {}
  settle()
  local base = gl.memory_stats().allocated
  local t = train.new(recipe(VARIANTS[name] and 'fsdp' or name), {})
  steps(t, tonumber(opts.warmup))
  settle()
  runs[#runs + 1] = { name = name, t = t, held = gl.memory_stats().allocated - base, transient = 0, times = {},
                      waits = {}, sent = {} }
end

for _ = 1, tonumber(opts.rounds) do
  for _, run in ipairs(runs) do
    local st = run.t.policy.stats
    local wait0 = st and st.gather_wait
    local before, sent0 = gl.memory_stats().allocated, sent(run.t)
    gl.reset_peak_memory()
    world:barrier()
    local t0 = now()
    steps(run.t, tonumber(opts.steps))
    local dt = (now() - t0) / tonumber(opts.steps)
    run.transient = math.max(run.transient, gl.memory_stats().peak - before)
    run.times[#run.times + 1] = max_over_ranks(dt)
    run.sent[#run.sent + 1] = (sent(run.t) - sent0) / tonumber(opts.steps)
    if st then run.waits[#run.waits + 1] = max_over_ranks((st.gather_wait - wait0) / tonumber(opts.steps)) end
  end
end

local results = {}
for _, run in ipairs(runs) do
  results[#results + 1] = { policy = run.name, ms_per_step = 1000 * median(run.times), params = run.t.model:num_params(),
    held = per_rank(run.held), peak = per_rank(run.held + run.transient),
    gather_wait_ms = #run.waits > 0 and 1000 * median(run.waits) or nil, sent = per_rank(median(run.sent)) }
end

local function mib(b) return string.format('%.1f', b / 2 ^ 20) end
if world.rank == 0 then
  print(('gpt2 %d layers, width %d, vocab %d: %.2fM parameters, %s, fp8 %s; %d ranks, batch %d x %d per rank; median of %d rounds of %d steps'):format(
    tonumber(opts.n_layer), tonumber(opts.n_embd), tonumber(opts.vocab_size), results[1].params / 1e6, opts.dtype,
    opts.fp8, world.size, tonumber(opts.batch_size), tonumber(opts.block_size), tonumber(opts.rounds),
    tonumber(opts.steps)))
  print(('%-16s %10s %22s %22s %14s %24s'):format('policy', 'ms/step', 'held MiB (per rank)', 'peak MiB (per rank)',
    'gather wait ms', 'sent MiB/step (per rank)'))
  local wait = {}
  for _, r in ipairs(results) do
    local held, peak, sentm = {}, {}, {}
    for i = 1, world.size do held[i], peak[i], sentm[i] = mib(r.held[i]), mib(r.peak[i]), mib(r.sent[i]) end
    print(('%-16s %10.1f %22s %22s %14s %24s'):format(r.policy, r.ms_per_step, table.concat(held, ' / '),
      table.concat(peak, ' / '), r.gather_wait_ms and string.format('%.1f', r.gather_wait_ms) or '-',
      table.concat(sentm, ' / ')))
    wait[r.policy] = r.gather_wait_ms
  end
  if wait.fsdp and wait['fsdp-noprefetch'] and wait['fsdp-noprefetch'] > 0 then
    local hidden = 1 - wait.fsdp / wait['fsdp-noprefetch']
    print(('all-gather time hidden by prefetch: %.0f%% (wait %.1f ms/step with prefetch, %.1f without)'):format(
      100 * hidden, wait.fsdp, wait['fsdp-noprefetch']))
  end
  if opts.json ~= '' then
    local f = assert(io.open(opts.json, 'wb'))
    f:write(cjson.encode({ world = world.size, options = opts, results = results }))
    f:close()
  end
end
