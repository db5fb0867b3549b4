-- bench/fsdp_bench.lua — step time and memory per rank of the data-parallel
-- policies on one model, FSDP against no sharding.
--
--   gptlua -n 2 bench/fsdp_bench.lua [--policies=none,ddp,zero2,fsdp,fsdp-noprefetch]
--          [--n_layer=6] [--n_embd=256] [--vocab_size=4096] [--block_size=64]
--          [--batch_size=4] [--steps=5] [--warmup=2] [--json=PATH]
--
-- Every policy trains the same GPT-2 on random tokens with the same batch per
-- rank ('none': each rank trains alone, no communication).  Per policy, on
-- rank 0, the slowest rank's ms/step, and per rank the bytes held between
-- steps (parameters, gradients, optimizer state) and the step's peak over
-- the allocator's baseline.  For FSDP also the seconds per step spent
-- waiting for all-gathers; with 'fsdp-noprefetch' among the policies the
-- share of all-gather time that prefetch hides is
--   1 - wait(prefetch) / wait(no prefetch)
-- (without prefetch every gather is waited for in full).
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local train = require 'gptlua.train'
local fsdp = require 'gptlua.dist.fsdp'
local cjson = require 'cjson'
local now = require('gptlua.cli').now

local opts = { policies = 'none,ddp,zero2,fsdp,fsdp-noprefetch', n_layer = '6', n_embd = '256', vocab_size = '4096',
               block_size = '64', batch_size = '4', steps = '5', warmup = '2', json = '' }
for _, a in ipairs(arg or {}) do
  local k, v = a:match('^%-%-([%w_]+)=(.*)$')
  if not k or opts[k] == nil then error('bench/fsdp_bench: unknown argument ' .. a, 0) end
  opts[k] = v
end

local world = dist.init {}
-- fsdp options travel with the policy name: 'fsdp-noprefetch'
local prefetch = true
package.loaded['fsdp_bench_policy'] = { new = function(name, o)
  o.prefetch = prefetch
  return fsdp.new(name, o)
end }
dist.POLICIES.fsdp = 'fsdp_bench_policy'

local function recipe(pol)
  return { name = 'fsdp_bench', model = 'gpt2', data = 'random', vocab_size = tonumber(opts.vocab_size),
    n_layer = tonumber(opts.n_layer), n_head = 4, n_embd = tonumber(opts.n_embd), block_size = tonumber(opts.block_size),
    batch_size = tonumber(opts.batch_size), max_iters = 1000, eval_interval = 0, log_interval = 0, sample_length = 0,
    warmup_iters = 0, quiet = true, device = 'cpu', peak_flops = 1e12, bias = false, seed = 1, dist = pol,
    out_dir = os.tmpname() .. '.d' }
end

local function settle() collectgarbage('collect'); collectgarbage('collect') end
local function max_over_ranks(x) return world:all_reduce_number(x, 'max') end
local function per_rank(x)
  local out = {}
  for r = 0, world.size - 1 do out[r + 1] = world:all_reduce_number(r == world.rank and x or 0, 'sum') end
  return out
end

local function bench(name)
  local pol = name:match('^fsdp') and 'fsdp' or name
  prefetch = name ~= 'fsdp-noprefetch'
  settle()
  local base = gl.memory_stats().allocated
  local t = train.new(recipe(pol), {})
  for _ = 1, tonumber(opts.warmup) do t:train_step(); t.step = t.step + 1 end
  settle()
  local held = gl.memory_stats().allocated - base
  local st = t.policy.stats
  local wait0 = st and st.gather_wait or 0
  gl.reset_peak_memory()
  world:barrier()
  local t0 = now()
  local steps = tonumber(opts.steps)
  for _ = 1, steps do t:train_step(); t.step = t.step + 1 end
  local dt = (now() - t0) / steps
  local r = { policy = name, ms_per_step = 1000 * max_over_ranks(dt), params = t.model:num_params(),
              held = per_rank(held), peak = per_rank(gl.memory_stats().peak - base) }
  if st then r.gather_wait_ms = 1000 * max_over_ranks((st.gather_wait - wait0) / steps) end
  if t.policy.detach then t.policy:detach() end
  t = nil
  settle()
  return r
end

local results = {}
for name in opts.policies:gmatch('[^,]+') do results[#results + 1] = bench(name) end

local function mib(b) return string.format('%.1f', b / 2 ^ 20) end
if world.rank == 0 then
  local r1 = results[1]
  print(('gpt2 %d layers, width %d, vocab %d: %.2fM parameters; %d ranks, batch %d x %d per rank, %d steps'):format(
    tonumber(opts.n_layer), tonumber(opts.n_embd), tonumber(opts.vocab_size), r1.params / 1e6, world.size,
    tonumber(opts.batch_size), tonumber(opts.block_size), tonumber(opts.steps)))
  print(('%-16s %10s %22s %22s %14s'):format('policy', 'ms/step', 'held MiB (per rank)', 'peak MiB (per rank)',
    'gather wait ms'))
  local wait = {}
  for _, r in ipairs(results) do
    local held, peak = {}, {}
    for i = 1, world.size do held[i], peak[i] = mib(r.held[i]), mib(r.peak[i]) end
    print(('%-16s %10.1f %22s %22s %14s'):format(r.policy, r.ms_per_step, table.concat(held, ' / '),
      table.concat(peak, ' / '), r.gather_wait_ms and string.format('%.1f', r.gather_wait_ms) or '-'))
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
