-- Benchmarks (`make bench`): engine dispatch and allocation overhead, the
-- transformer block stack's GFLOP/s and BLAS share, training steps at the
-- default recipe's sizes (nanoGPT's block with AdamW, the recipe's block
-- with AdamW, and the recipe as it trains: Muon + AdamW), and nanoGPT's
-- step in PyTorch when PyTorch is installed.  `--device=cuda` runs the GPU benchmark instead.
--   gptlua recipes/tools/bench.lua [--iters=30] [--rounds=3] [--threads=N] [--only=dispatch,alloc,block,step,torch]
local gl = require 'gptlua'
local now = require('gptlua.cli').now
local train = require 'gptlua.train'

local opts = { iters = 30, rounds = 3, threads = 0, only = '', device = 'cpu', models = 'gpt2_124m,nanochat_d12,nanochat_d20',
               kernels = 1, small = 0 }
for _, a in ipairs(arg) do
  local k, v = a:match('^%-%-([%w_]+)=(.*)$')
  if not k or opts[k] == nil then error('bench: unknown argument ' .. a .. ' (--iters, --rounds, --threads, --only, --device)', 0) end
  opts[k] = tonumber(v) or v
end
local function median(t) table.sort(t); return t[math.ceil(#t / 2)] end

-- Whole-model training steps of the full-size GPU configurations on random
-- tokens: tokens/s, MFU (the model's FLOPs/token against the device's peak,
-- 989 TFLOP/s bf16 for an H100), ms/step, peak memory.  --small=1 shrinks
-- the models (a smoke test of this path on any device).
local function model_bench(device)
  local configs = {
    gpt2_124m = { recipe = 'gpt2_124m', over = { '--batch_size=32', '--block_size=1024' } },
    nanochat_d12 = { recipe = 'nanochat_d20', over = { '--depth=12', '--batch_size=32', '--block_size=2048' } },
    nanochat_d20 = { recipe = 'nanochat_d20', over = { '--depth=20', '--batch_size=32', '--block_size=2048' } },
  }
  for name in tostring(opts.models):gmatch('[^,]+') do
    local c = configs[name]
    if not c then error('bench: unknown model ' .. name .. ' (gpt2_124m, nanochat_d12, nanochat_d20)', 0) end
    local args = { '--data=random', '--device=' .. device, '--total_batch_size=0', '--quiet=true',
                   '--max_iters=' .. opts.iters, '--eval_interval=0', '--sample_length=0' }
    for _, a in ipairs(c.over) do args[#args + 1] = a end
    if opts.small == 1 then
      for _, a in ipairs({ '--batch_size=2', '--block_size=64', '--n_layer=2', '--n_head=2', '--n_embd=64',
                           '--depth=2', '--vocab_size=512', '--dtype=float32' }) do args[#args + 1] = a end
    end
    local r = dofile(gl.root .. '/recipes/' .. c.recipe .. '.lua')
    local t = train.new(r, args)
    for _ = 1, 3 do t:train_step() end
    if device ~= 'cpu' then require('gptlua.cuda').synchronize() end
    gl.reset_peak_memory(device)
    local times = {}
    for _ = 1, opts.iters do
      local t0 = now()
      t:train_step()
      if device ~= 'cpu' then require('gptlua.cuda').synchronize() end
      times[#times + 1] = now() - t0
    end
    local dt = median(times)
    local tps = t.tokens_per_step / dt
    local peak = device == 'cpu' and train.measure_cpu_flops() or 989e12
    print(('%s: %.1f ms/step, %.0f tokens/s, MFU %.1f%%, peak memory %s (%.1fM parameters, %d tokens/step)'):format(
      name, dt * 1000, tps, 100 * tps * t.flops_per_token / peak, train.fmt_bytes(gl.memory_stats(device).peak),
      t.model:num_params() / 1e6, t.tokens_per_step))
  end
end

if opts.device ~= 'cpu' then
  if opts.kernels == 1 then dofile(gl.root .. '/recipes/tools/bench_cuda.lua') end
  return model_bench(opts.device)
end
if opts.only == 'models' then return model_bench('cpu') end
if opts.threads > 0 then gl.set_num_threads(opts.threads) end
local threads = gl.get_num_threads()
local want = {}
for w in tostring(opts.only):gmatch('[^,]+') do want[w] = true end
local function on(name) return next(want) == nil or want[name] end

print(('gptlua %s benchmark, %d threads, %s, %s'):format(gl.version, threads, jit.version, gl.blas_info()))

if on('dispatch') then
  local a, b = gl.ones({ 4 }), gl.ones({ 4 })
  local n = 1000000
  gl.no_grad(function()
    local t0 = now()
    for _ = 1, n do a:add_(b) end
    local inplace = (now() - t0) / n
    collectgarbage(); collectgarbage()
    t0 = now()
    for _ = 1, n do local c = a + b end  -- results die young; the GC and the cache recycle them
    local outofplace = (now() - t0) / n
    print(('dispatch: %.0f ns/op in place (a:add_(b)), %.0f ns/op with a new result tensor (a + b)'):format(
      inplace * 1e9, outofplace * 1e9))
  end)
end

if on('alloc') then
  local n = 1000000
  collectgarbage(); collectgarbage()
  for _ = 1, 100 do gl.empty({ 256 }):free() end
  local st0 = gl.memory_stats()
  local t0 = now()
  for _ = 1, n do gl.empty({ 256 }):free() end
  local dt = (now() - t0) / n
  local st = gl.memory_stats()
  print(('alloc: %.0f ns per empty()+free() of 1 KiB through the cache (hit rate %.1f%%, reserved %s before and after)'):format(
    dt * 1e9, 100 * (st.cache_hits - st0.cache_hits) / (st.n_allocs - st0.n_allocs),
    st0.reserved == st.reserved and 'unchanged' or 'CHANGED'))
end

-- runs fn with the raw matrix products timed: returns the seconds in BLAS
local function matmul_timer(fn)
  local blas = 0
  local ops = require 'gptlua.ops'
  local raw, pair = gl.matmul_raw, ops.matmul_pair_raw
  local function timed(f)
    return function(...)
      local t0 = now()
      local r1, r2 = f(...)
      blas = blas + now() - t0
      return r1, r2
    end
  end
  ops.matmul_raw, gl.matmul_raw, ops.matmul_pair_raw = timed(raw), timed(raw), timed(pair)
  local ok, err = pcall(fn)
  ops.matmul_raw, gl.matmul_raw, ops.matmul_pair_raw = raw, raw, pair
  if not ok then error(err, 0) end
  return blas
end

local function fixed_batch(B, T, V)
  local d = gl.uniform({ B, T + 1 }, 0, V, { seed = 5, dtype = 'float64' }):clamp_(0, V - 1):to('int64')
  return d:narrow(2, 1, T):contiguous(), d:narrow(2, 2, T):contiguous()
end

if on('block') then
  local gpt2 = require 'gptlua.models.gpt2'
  gl.manual_seed(1)
  local m = gpt2.GPT({ vocab_size = 65, block_size = 64, n_layer = 4, n_head = 4, n_embd = 128, bias = false })
  local B, T, C = 12, 64, 128
  local x = gl.randn({ B, T, C }):requires_grad_()
  local function run()
    gl.scope(function()
      local h = x
      for i = 1, 4 do h = m.transformer.h[i](h) end
      gl.sum(h):backward()
    end)
  end
  for _ = 1, 3 do run() end
  local times, blas_total, total = {}, 0, 0
  for _ = 1, opts.iters do
    local t0 = now()
    blas_total = blas_total + matmul_timer(run)
    local dt = now() - t0
    total = total + dt
    times[#times + 1] = dt
  end
  local per_layer = 12 * C * C
  local flops = 6 * 4 * per_layer * B * T + 12 * 4 * C * T * B * T / 2
  local dt = median(times)
  print(('block stack (4 layers, width 128, batch 12, context 64) fwd+bwd: %.2f ms, %.1f GFLOP/s, %.0f%% of time in BLAS'):format(
    dt * 1000, flops / dt / 1e9, 100 * blas_total / total))
end

-- The training steps measured, each on the default recipe's sizes (4x128,
-- batch 12, context 64) and a fixed batch: what it is, and what it changes
-- in the recipe.  'gpt2' is the one PyTorch runs below.
local STEPS = {
  { kind = 'gpt2', label = "nanoGPT's GPT-2 block, AdamW (the PyTorch comparison)",
    over = { model = 'gpt2', optimizer = 'adamw' } },
  { kind = 'nanochat', label = "the recipe's block (nanochat v1), AdamW",
    over = { model = 'nanochat', optimizer = 'adamw' } },
  { kind = 'recipe', label = "the default recipe as it trains (nanochat v1 block, Muon + AdamW)", over = {} },
}
local STEP = {}
for _, s in ipairs(STEPS) do STEP[s.kind] = s end

-- One of STEPS on a fixed batch: median ms over opts.iters steps, the
-- share of that time in BLAS, the trainer, and its peak memory.
local trainers = {}
local function our_step(kind)
  local tr = trainers[kind]
  if not tr then
    local r = dofile(gl.root .. '/recipes/shakespeare.lua')
    r.quiet, r.device, r.nanochat = true, 'cpu', { version = 'v1' }
    for k, v in pairs(STEP[kind].over) do r[k] = v end
    local x, y = fixed_batch(r.batch_size, r.block_size, 65)
    r.build_data = function()
      local L = { next_batch = function() return x, y end, state = function() return {} end, set_state = function() end }
      return { train = L, val = L, vocab_size = 65 }
    end
    collectgarbage(); collectgarbage()  -- earlier benchmarks' tensors go now, not during the count
    local before = gl.memory_stats().allocated
    tr = train.new(r, {})
    trainers[kind] = tr
    for _ = 1, 3 do tr:train_step() end
    tr.bench_resident = gl.memory_stats().allocated - before  -- its weights, grads, optimizer state
  end
  gl.reset_peak_memory()
  local base = gl.memory_stats().allocated
  local times, total = {}, 0
  local blas = matmul_timer(function()
    for _ = 1, opts.iters do
      local t0 = now()
      tr:train_step()
      times[#times + 1] = now() - t0
      total = total + times[#times]
    end
  end)
  -- the peak this trainer alone would reach: its resident memory plus the
  -- step's transient peak (the other trainer's memory left out)
  return median(times) * 1000, blas / total, tr, tr.bench_resident + gl.memory_stats().peak - base
end

-- PyTorch running nanoGPT's model on the same configuration in a child
-- process, as a user would start it: none of this process's OpenMP tuning
-- (OMP_WAIT_POLICY, GOMP_SPINCOUNT), and torch and its BLAS both limited
-- to the same thread count.  nil and a reason when it cannot run.
local function torch_step()
  local py = '/usr/bin/python3'
  local probe = io.popen(py .. ' -c "import torch" 2>/dev/null; echo $?')
  local rc = probe:read('*a'); probe:close()
  if tonumber(rc) ~= 0 then return nil, 'skipped (PyTorch not installed: apt-get install python3-torch)' end
  local p = io.popen(('env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT OMP_NUM_THREADS=%d OPENBLAS_NUM_THREADS=%d %s %s/recipes/tools/bench_torch_gpt.py %d %d'):format(
    threads, threads, py, gl.root, opts.iters, threads))
  local line = p:read('*a'); p:close()
  local ok, res = pcall(require('cjson').decode, line)
  if not ok or type(res) ~= 'table' then return nil, 'failed: ' .. line end
  return res.ms_per_iter, res.torch
end

-- gptlua (each of STEPS) and PyTorch alternate
-- for opts.rounds rounds on this (shared, noisy) machine; the fastest round
-- of each is its figure, the one least disturbed by other load.
if on('step') or on('torch') then
  local best = { gpt2 = math.huge, nanochat = math.huge, recipe = math.huge, torch = math.huge }
  local share, tr, peak_mem, torch_version, why = {}, {}, {}, nil, nil
  for round = 1, opts.rounds do
    local line = ('round %d:'):format(round)
    if on('step') then
      for _, s in ipairs(STEPS) do
        local ms, sh, t, mem = our_step(s.kind)
        if ms < best[s.kind] then best[s.kind], share[s.kind], tr[s.kind], peak_mem[s.kind] = ms, sh, t, mem end
        line = line .. (' gptlua %s %.1f ms/iter,'):format(s.kind, ms)
      end
    end
    if on('torch') and not why then
      local ms, info = torch_step()
      if ms then
        best.torch, torch_version = math.min(best.torch, ms), info
        line = line .. (' torch %.1f ms/iter'):format(ms)
      else why = info end
    end
    if opts.rounds > 1 then print((line:gsub(',$', ''))) end
  end
  if on('step') then
    local peak = train.measure_cpu_flops()
    for _, s in ipairs(STEPS) do
      local t = tr[s.kind]
      local tps = t.cfg.batch_size * t.cfg.block_size / (best[s.kind] / 1000)
      -- (MFU counts the model's FLOPs per token: Muon's Newton-Schulz is work beyond them)
      print(('training step (4x128, batch 12, context 64), %s: %.1f ms/iter, %.0f tokens/s, MFU %.1f%% of %.1f GFLOP/s sgemm%s, %.0f%% in BLAS, peak memory %s'):format(
        s.label, best[s.kind], tps, 100 * tps * t.flops_per_token / peak, peak / 1e9,
        s.kind == 'recipe' and ' (model FLOPs; Newton-Schulz not counted)' or '', 100 * share[s.kind],
        train.fmt_bytes(peak_mem[s.kind])))
    end
  end
  if on('torch') then
    if why then print('torch: ' .. why)
    else
      print(('torch %s, nanoGPT\'s model at the same configuration, %d threads: %.1f ms/iter'):format(
        torch_version, threads, best.torch))
      if on('step') then
        print(('speed-up of gptlua over PyTorch, same model and loss curve: %.2fx'):format(best.torch / best.gpt2))
      end
    end
  end
end
