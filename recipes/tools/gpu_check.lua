-- recipes/tools/gpu_check.lua — `make gpu-check`: one command that shows a
-- GPU works with gptlua, and how fast.
--   build/gptlua recipes/tools/gpu_check.lua [--mode=gpu|sim] [--out=build/gpu-check] [--stages=a,b,...]
--                                            [--archs="90"] [--fail=STAGE]
-- The stages, each in its own processes under a time budget:
--   device      the engine sees every GPU nvidia-smi lists, each of an arch
--               it was built for
--   specs       every #cuda spec on the device (make test-cuda's command)
--   train       the default recipe (recipes/shakespeare.lua) for a few
--               hundred steps in bf16 on the device and in float32 on the
--               CPU, same seed and data; the losses compared (the loss
--               rule, M.LOSS_REL below)
--   throughput  GPT-2 124M and nanochat d20 at the account's configurations
--               (recipes/tools/account.lua, M.MODELS), after warm-up, with
--               the CUDA graph on and off: tokens/s and MFU against the
--               account's pessimistic..optimistic prediction
--   fp8         on a GPU of sm_89 or newer, GPT-2 124M at the account's
--               configuration (CUDA graph on) in bf16 and with
--               --fp8=tensorwise and --fp8=rowwise: tokens/s of each and
--               the ratio to bf16 (reported, never judged); below sm_89
--               the stage is "skipped: sm_XX < sm_89" and does not fail
--   nccl        every collective over NCCL, one rank per GPU present
-- It writes OUT/report.json and OUT/report.md (the table it prints) and
-- exits 1 when a stage fails.  --mode=sim (the default without a GPU) runs
-- the same stages in the CUDA simulator (build/sim/gptlua) at tiny sizes,
-- so that CI keeps the tool working; its throughput is no GPU's and is not
-- compared.  --fail=STAGE makes that stage fail (to test the failure path).
-- On the GPU the account predicts (an H100 SXM, or an H200), a measured
-- speed below the pessimistic end of the prediction fails the run (the
-- engine is slower than its own worst case: a fallback path, a graph not
-- captured, a host wait); above the optimistic end is reported.
local gl = require 'gptlua'
local cjson = require 'cjson'
local now = require('gptlua.cli').now

local ROOT = gl.root
local M = {}

-- ------------------------------------------------------------------ settings
-- Per mode: the engine the stages run, and each stage's size and budget
-- (seconds; the throughput stage's is for its four runs together, fp8's
-- for its three).  The GPU budgets add up to 8 minutes, which with the
-- build of one arch (under a minute on 16 cores) fits 9.
M.MODES = {
  gpu = {
    exe = 'build/gptlua',
    device = { budget = 15 },
    specs = { budget = 165, args = { '--tags=cuda', '--exclude-tags=sim' } },
    train = { budget = 60, steps = 300, over = {} },
    throughput = { budget = 140, warmup = 3, steps = 10, over = {} },
    fp8 = { budget = 60, warmup = 3, steps = 5, over = {} },
    nccl = { budget = 40 },
  },
  sim = {
    exe = 'build/sim/gptlua',
    device = { budget = 60 },
    -- (budgets: a loaded CI machine runs the simulator many times slower than an idle one)
    specs = { budget = 240, args = { '--tags=cuda', 'spec/cuda_graph_spec.lua', 'spec/cuda_step_block_spec.lua' } },
    train = { budget = 240, steps = 6,
              over = { '--n_layer=2', '--n_embd=64', '--n_head=2', '--batch_size=4', '--block_size=32',
                       '--warmup_iters=1' } },
    throughput = { budget = 240, warmup = 2, steps = 2,
                   over = { '--n_layer=1', '--n_embd=64', '--n_head=1', '--batch_size=1', '--block_size=32',
                            '--vocab_size=256' } },
    -- (three layers: FP8 leaves the first and the last block in bf16)
    fp8 = { budget = 240, warmup = 2, steps = 2,
            over = { '--n_layer=3', '--n_embd=64', '--n_head=1', '--batch_size=1', '--block_size=32',
                     '--vocab_size=256' } },
    nccl = { budget = 120 },
  },
}
M.STAGES = { 'device', 'specs', 'train', 'throughput', 'fp8', 'nccl' }
-- the fp8 stage's model and its runs (the first, bf16, is the ratios' base)
M.FP8_MODEL = 'gpt2_124m'
M.FP8_RUNS = { 'off', 'tensorwise', 'rowwise' }
M.MODELS = { 'gpt2_124m', 'nanochat_d20' }
M.SIM_NOTE = 'simulator: not a GPU figure'

-- The loss rule.  Both runs start from the same parameters and read the
-- same batches; they differ in rounding (bf16 activations and parameters
-- with fp32 master weights against float32 throughout), which makes their
-- trajectories part, so the losses are compared as statistics, not step by
-- step: the mean training loss over the last `window` steps, whose
-- standard error comes from the steps' spread around it (the batch noise,
-- which dominates late in training).  The two means may differ by at most
--   3 * sqrt(se_gpu^2 + se_cpu^2) + REL * mean_cpu
-- the first term the two windows' sampling noise at three sigma, the second
-- the bias bf16 may add: REL = 2^-6 (1.6%), four times the relative size of
-- a bf16 rounding step of the logits (2^-8) that enter the loss.  A broken
-- kernel lands far outside (a stuck or diverging run, or NaN).  (The
-- default recipe at 300 steps on the CPU: standard errors about 0.01 on a
-- mean of 1.74, a tolerance of about 0.06; three float32 runs that differ
-- only in their seed end within 0.012 of each other.)
M.LOSS_REL = 2 ^ -6
M.LOSS_SIGMAS = 3

-- ------------------------------------------------------------------ helpers
local function shq(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

local function read(path)
  local f = io.open(path, 'rb')
  if not f then return nil end
  local s = f:read('*a')
  f:close()
  return s
end

-- writes through a temporary file and a rename, so a reader sees the old
-- file or the new one
local function write_atomic(path, s)
  local tmp = path .. '.tmp'
  local f = assert(io.open(tmp, 'wb'))
  f:write(s)
  f:close()
  assert(os.rename(tmp, path))
end

-- Runs shell commands side by side from the root, each with its output in
-- its log, all within `budget` seconds; returns each exit status (124 or
-- 137: over the budget) and the seconds taken.
local function run_all(cmds, budget)
  local parts = {}
  for i, c in ipairs(cmds) do
    parts[i] = ('(timeout -k 5 %d sh -c %s > %s 2>&1; echo $? > %s) &'):format(budget, shq(c.cmd), shq(c.log),
                                                                          shq(c.log .. '.rc'))
  end
  local t0 = now()
  os.execute(('cd %s && OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 sh -c %s'):format(shq(ROOT),
    shq(table.concat(parts, ' ') .. ' wait')))
  local rcs = {}
  for i, c in ipairs(cmds) do
    rcs[i] = tonumber((read(c.log .. '.rc') or ''):match('%d+')) or -1
    os.remove(c.log .. '.rc')
  end
  return rcs, now() - t0
end

-- the status of a process that failed, in words: its error line (a Lua
-- error's, else one that says error, else its last line with words)
local function why_failed(rc, budget, log)
  if rc == 124 or rc == 137 then return ('over its budget of %d s (%s)'):format(budget, log) end
  local text = '\n' .. (read(log) or '')
  local msg = text:match('\n([^\n]-%.lua:%d+: [^\n]*)') or text:match('\n([^\n]-[Ee]rror[^\n]*)')
  if not msg then
    for l in text:gmatch('[^\n]+') do if l:find('%a') then msg = l end end
  end
  return ('exit %d: %s (%s)'):format(rc, msg or 'no output', log)
end

-- ------------------------------------------------------------------ stages
-- Each stage: fn(ctx, conf) -> { status = 'pass' | 'fail', detail, ... };
-- ctx: { mode, exe, out, archs, gpus }.

-- the engine sees every GPU nvidia-smi lists, each of an arch it was built for
local DEVICE_QUERY = [[
local cuda = require 'gptlua.cuda'
print('COUNT ' .. cuda.device_count())
for i = 0, cuda.device_count() - 1 do
  local p = cuda.get_device_properties(i)
  print(('DEVICE %d %d%d %s, sm_%d%d, %d SMs, %.0f GiB'):format(i, p.major, p.minor, p.name, p.major, p.minor,
    p.multiprocessor_count, p.total_memory / 2 ^ 30))
end]]

local function stage_device(ctx, conf)
  local log = ctx.out .. '/device.log'
  local rcs = run_all({ { cmd = ('%s -e %s'):format(ctx.exe, shq(DEVICE_QUERY)), log = log } }, conf.budget)
  local out = read(log) or ''
  local n = tonumber(out:match('COUNT (%d+)'))
  local res = { log = log, count = n, devices = {} }
  local archs = {}
  for a in tostring(ctx.archs or ''):gmatch('%d+') do archs[a] = true end
  local wrong = {}
  for i, cap, desc in out:gmatch('DEVICE (%d+) (%d+) ([^\n]*)') do
    res.devices[#res.devices + 1] = desc
    if next(archs) and not archs[cap] then wrong[#wrong + 1] = ('cuda:%s is sm_%s'):format(i, cap) end
  end
  if rcs[1] ~= 0 or not n then
    res.status, res.detail = 'fail', why_failed(rcs[1], conf.budget, log)
  elseif n < ctx.gpus then
    res.status = 'fail'
    res.detail = ('the engine sees %d CUDA device%s, nvidia-smi lists %d'):format(n, n == 1 and '' or 's', ctx.gpus)
  elseif #wrong > 0 then
    res.status = 'fail'
    res.detail = ('built for sm_%s, but %s'):format(ctx.archs, table.concat(wrong, ', '))
  else
    res.status, res.detail = 'pass', table.concat(res.devices, '; ')
  end
  return res
end

local function stage_specs(ctx, conf)
  local log = ctx.out .. '/specs.log'
  local args = {}
  for i, a in ipairs(conf.args) do args[i] = shq(a) end
  local rcs = run_all({ { cmd = ('%s spec/run.lua %s'):format(ctx.exe, table.concat(args, ' ')), log = log } },
                      conf.budget)
  local out = read(log) or ''
  local p, f, s = out:match('(%d+) passed, (%d+) failed, (%d+) skipped')
  local res = { log = log, passed = tonumber(p), failed = tonumber(f), skipped = tonumber(s) }
  if rcs[1] == 0 and p and tonumber(f) == 0 then
    res.status, res.detail = 'pass', ('%s passed, %s pending or skipped'):format(p, s)
  else
    res.status = 'fail'
    res.detail = p and ('%s passed, %s failed (%s)'):format(p, f, log) or why_failed(rcs[1], conf.budget, log)
  end
  return res
end

-- the training loss of every step of a run (its metrics.jsonl)
local function step_losses(run_dir)
  local s = read(run_dir .. '/metrics.jsonl')
  if not s then return nil end
  local losses = {}
  for line in s:gmatch('[^\n]+') do
    local ok, r = pcall(cjson.decode, line)
    if ok and type(r) == 'table' and r.loss and r.step then losses[r.step] = r.loss end
  end
  return losses
end

-- mean and standard error of the last `w` of n steps' losses
function M.window(losses, n, w)
  local sum, sq, k = 0, 0, 0
  for i = n - w + 1, n do
    local v = losses[i]
    if type(v) ~= 'number' or v ~= v then return nil end
    sum, k = sum + v, k + 1
  end
  local mean = sum / k
  for i = n - w + 1, n do sq = sq + (losses[i] - mean) ^ 2 end
  local sd = k > 1 and math.sqrt(sq / (k - 1)) or 0
  return mean, sd / math.sqrt(k)
end

-- the loss rule (M.LOSS_REL): ok, the difference and the tolerance
function M.compare_losses(gpu_mean, gpu_se, cpu_mean, cpu_se)
  local tol = M.LOSS_SIGMAS * math.sqrt(gpu_se ^ 2 + cpu_se ^ 2) + M.LOSS_REL * cpu_mean
  local diff = math.abs(gpu_mean - cpu_mean)
  return diff <= tol, diff, tol
end

local function stage_train(ctx, conf)
  local n = conf.steps
  local w = math.max(2, math.floor(n / 6))
  local function cmd(exe, device, dtype, name)
    local a = { exe, 'recipes/shakespeare.lua', '--device=' .. device, '--dtype=' .. dtype, '--max_iters=' .. n,
                '--log_interval=1', '--eval_interval=0', '--sample_length=0', '--out_dir=' .. ctx.out .. '/runs',
                '--name=' .. name, '--overwrite=true', '--tensorboard=false', '--journal=false', '--control=false',
                '--quiet=true' }
    for _, o in ipairs(conf.over) do a[#a + 1] = o end
    for i = 2, #a do a[i] = shq(a[i]) end
    return table.concat(a, ' ')
  end
  local runs = {
    { cmd = cmd(ctx.exe, 'cuda', 'bfloat16', 'train_cuda'), log = ctx.out .. '/train_cuda.log' },
    { cmd = cmd('build/gptlua', 'cpu', 'float32', 'train_cpu'), log = ctx.out .. '/train_cpu.log' },
  }
  local rcs = run_all(runs, conf.budget)
  local res = { steps = n, window = w, log = runs[1].log, cpu_log = runs[2].log }
  for i, which in ipairs({ 'the bf16 run on the device', 'the float32 run on the CPU' }) do
    if rcs[i] ~= 0 then
      res.status, res.detail = 'fail', which .. ': ' .. why_failed(rcs[i], conf.budget, runs[i].log)
      return res
    end
  end
  local g = step_losses(ctx.out .. '/runs/train_cuda')
  local c = step_losses(ctx.out .. '/runs/train_cpu')
  local gm, gse = M.window(g or {}, n, w)
  local cm, cse = M.window(c or {}, n, w)
  if not gm or not cm then
    res.status = 'fail'
    res.detail = ('no finite loss for each of the last %d steps in %s'):format(w, not gm and 'the device run' or 'the CPU run')
    return res
  end
  local ok, diff, tol = M.compare_losses(gm, gse, cm, cse)
  res.loss_cuda_bf16, res.loss_cpu_f32, res.se_cuda, res.se_cpu = gm, cm, gse, cse
  res.difference, res.tolerance = diff, tol
  res.status = ok and 'pass' or 'fail'
  res.detail = ('mean loss of steps %d-%d: %.4f bf16 on the device, %.4f float32 on the CPU; difference %.4f, at most %.4f')
               :format(n - w + 1, n, gm, cm, diff, tol)
  return res
end

-- The account's prediction for a model (recipes/tools/account_predictions.json,
-- written by `bench_cuda.lua --account --model=NAME --save=1`), or nil and why.
function M.prediction(name)
  local acc = dofile(ROOT .. '/recipes/tools/account.lua')
  return acc.load_prediction(name)
end

-- measured tokens/s against the prediction's range: a verdict and whether it fails
function M.verdict(tps, pred, mode, device_name)
  if mode == 'sim' then return M.SIM_NOTE, false end
  if not pred then return 'no prediction (recipes/tools/account_predictions.json)', false end
  local _, key = require('gptlua.progress').gpu_peak(device_name)  -- (an H100 PCIe is not one)
  if key ~= 'H100' and key ~= 'H200' and key ~= 'GH200' then
    return 'not compared: the account predicts an H100 SXM', false
  end
  local lo, hi = pred.tokens_per_s.pessimistic, pred.tokens_per_s.optimistic
  if tps < lo then return ('BELOW the predicted range (%.0f..%.0f)'):format(lo, hi), true end
  if tps > hi then return ('above the predicted range (%.0f..%.0f)'):format(lo, hi), false end
  return ('within the predicted range (%.0f..%.0f)'):format(lo, hi), false
end

-- one worker run (--worker=throughput) of a model within `left` seconds:
-- its RESULT, the seconds taken, or nil and why it failed
local function measure(ctx, conf, name, graph, fp8, log, left)
  local a = { ctx.exe, 'recipes/tools/gpu_check.lua', '--worker=throughput', '--model=' .. name, '--graph=' .. graph,
              '--fp8=' .. fp8, '--warmup=' .. conf.warmup, '--steps=' .. conf.steps }
  for _, o in ipairs(conf.over) do a[#a + 1] = '--over=' .. o end
  for i = 2, #a do a[i] = shq(a[i]) end
  local rcs, secs = run_all({ { cmd = table.concat(a, ' '), log = log } }, left)
  local r = rcs[1] == 0 and ('\n' .. (read(log) or '')):match('\nRESULT (%b{})')
  if not r then return nil, secs, why_failed(rcs[1], left, log) end
  return cjson.decode(r), secs
end

local function stage_throughput(ctx, conf)
  local res = { status = 'pass', rows = {} }
  local failed = {}
  local deadline = now() + conf.budget  -- each run may take what the ones before it left
  for _, name in ipairs(M.MODELS) do
    local pred = M.prediction(name)
    for _, graph in ipairs({ 'on', 'off' }) do
      local log = ('%s/throughput_%s_graph_%s.log'):format(ctx.out, name, graph)
      local left = math.max(1, math.floor(deadline - now()))
      local m, secs, why = measure(ctx, conf, name, graph, 'off', log, left)
      local row = { model = name, graph = graph, log = log, seconds = secs }
      if m then
        for k, v in pairs(m) do row[k] = v end
        row.predicted = ctx.mode == 'gpu' and pred and { tokens_per_s = pred.tokens_per_s, mfu = pred.mfu } or nil
        local below
        row.verdict, below = M.verdict(m.tokens_per_s, pred, ctx.mode, m.device)
        if below then failed[#failed + 1] = ('%s graph %s below its range'):format(name, graph) end
      else
        row.verdict = 'failed: ' .. why
        failed[#failed + 1] = ('%s graph %s: %s'):format(name, graph, row.verdict)
      end
      res.rows[#res.rows + 1] = row
    end
  end
  if #failed > 0 then res.status, res.detail = 'fail', table.concat(failed, '; ')
  else res.detail = ('%d runs measured'):format(#res.rows) end
  return res
end

-- FP8 against bf16: the compute capability the engine sees on cuda:0
-- first (FP8 tensor cores are sm_89's and newer), then GPT-2 124M in bf16
-- and with each FP8 recipe, the CUDA graph on; tokens/s and the ratio to
-- bf16's, reported and not judged (no prediction to hold it to: the
-- account's FP8 figures are recipes/tools/account_fp8.lua's)
local CAPABILITY_QUERY = [[
local p = require('gptlua.cuda').get_device_properties(0)
print(('CAPABILITY %d%d'):format(p.major, p.minor))]]

function M.fp8_detail(rows, mode)
  local parts = {}
  for _, r in ipairs(rows) do
    if r.tokens_per_s then
      parts[#parts + 1] = r.fp8 == 'off' and ('bf16 %.0f tokens/s'):format(r.tokens_per_s)
                          or ('%s %.0f (%s)'):format(r.fp8, r.tokens_per_s, r.ratio and ('%.2fx'):format(r.ratio) or '-')
    else
      parts[#parts + 1] = ('%s %s'):format(r.fp8 == 'off' and 'bf16' or r.fp8, r.verdict or 'failed')
    end
  end
  local first = rows[1] or {}
  return ('%s %s, CUDA graph on: %s%s'):format(M.FP8_MODEL, first.config or '', table.concat(parts, ', '),
    mode == 'sim' and (' (' .. M.SIM_NOTE .. ')') or '')
end

local function stage_fp8(ctx, conf)
  local deadline = now() + conf.budget
  local log = ctx.out .. '/fp8_device.log'
  local rcs = run_all({ { cmd = ('%s -e %s'):format(ctx.exe, shq(CAPABILITY_QUERY)), log = log } }, conf.budget)
  local cap = tonumber((read(log) or ''):match('CAPABILITY (%d+)'))
  if rcs[1] ~= 0 or not cap then return { status = 'fail', detail = why_failed(rcs[1], conf.budget, log) } end
  local res = { status = 'pass', capability = cap, rows = {} }
  if cap < 89 then
    res.status, res.detail = 'skipped', ('skipped: sm_%d < sm_89'):format(cap)
    return res
  end
  local failed, base = {}, nil
  for _, fp8 in ipairs(M.FP8_RUNS) do
    local rlog = ('%s/fp8_%s.log'):format(ctx.out, fp8)
    local left = math.max(1, math.floor(deadline - now()))
    local m, secs, why = measure(ctx, conf, M.FP8_MODEL, 'on', fp8, rlog, left)
    local row = { model = M.FP8_MODEL, fp8 = fp8, log = rlog, seconds = secs }
    if m then
      for k, v in pairs(m) do row[k] = v end
      if fp8 == 'off' then base = m.tokens_per_s end
      row.ratio = base and m.tokens_per_s / base or nil
    else
      row.verdict = 'failed: ' .. why
      failed[#failed + 1] = ('%s: %s'):format(fp8, row.verdict)
    end
    res.rows[#res.rows + 1] = row
  end
  if #failed > 0 then res.status = 'fail' end
  res.detail = M.fp8_detail(res.rows, ctx.mode)
  return res
end

local function stage_nccl(ctx, conf)
  local n, cmd = ctx.gpus, nil
  if ctx.mode == 'sim' then
    n = 2  -- the simulator's NCCL, over MPI, one simulated GPU per rank
    cmd = ('env GL_SIM_DEVICES=2 %s -n 2 spec/dist/cuda_collectives.lua nccl'):format(ctx.exe)
  elseif n == 1 then  -- one GPU: an NCCL world of one MPI rank
    cmd = ('mpirun -np 1 --allow-run-as-root %s spec/dist/cuda_collectives.lua nccl'):format(ctx.exe)
  else
    cmd = ('%s -n %d spec/dist/cuda_collectives.lua nccl'):format(ctx.exe, n)
  end
  local log = ctx.out .. '/nccl.log'
  local rcs = run_all({ { cmd = cmd, log = log } }, conf.budget)
  local out = read(log) or ''
  local res = { ranks = n, log = log }
  local missing = {}
  for r = 0, n - 1 do
    if not out:find(('OK rank %d of %d via nccl'):format(r, n), 1, true) then missing[#missing + 1] = r end
  end
  if rcs[1] == 0 and #missing == 0 then
    res.status, res.detail = 'pass', ('every collective over NCCL on %d rank%s, one GPU each'):format(n, n > 1 and 's' or '')
  else
    res.status = 'fail'
    res.detail = rcs[1] ~= 0 and why_failed(rcs[1], conf.budget, log)
                 or ('ranks %s did not report OK'):format(table.concat(missing, ', '))
  end
  return res
end

M.RUN = { device = stage_device, specs = stage_specs, train = stage_train, throughput = stage_throughput, fp8 = stage_fp8,
          nccl = stage_nccl }

-- ------------------------------------------------------------------ the worker
-- `--worker=throughput`: in the stage's engine, one model at the account's
-- configuration on cuda:0, `warmup` steps, then `steps` timed steps (each
-- ended by a device synchronize); prints RESULT {json}.
local function worker_throughput(opts)
  local train = require 'gptlua.train'
  local cuda = require 'gptlua.cuda'
  local progress = require 'gptlua.progress'
  local acc = dofile(ROOT .. '/recipes/tools/account.lua')
  local model = acc.MODELS[opts.model]
  if not model then error('gpu_check: unknown model ' .. tostring(opts.model), 0) end
  local args = { '--data=random', '--device=cuda', '--dtype=bfloat16', '--total_batch_size=0', '--quiet=true',
                 '--eval_interval=0', '--sample_length=0', '--max_iters=1000000', '--batch_size=' .. model.B,
                 '--block_size=' .. model.T, '--cuda_graph=' .. (opts.graph == 'on' and 'true' or 'off'),
                 '--fp8=' .. (opts.fp8 or 'off'),
                 '--control=false', '--journal=false', '--tensorboard=false' }
  for _, a in ipairs(model.args(model.layers)) do args[#args + 1] = a end
  for _, a in ipairs(opts.over) do args[#args + 1] = a end
  local t = train.new(dofile(ROOT .. '/recipes/' .. model.recipe .. '.lua'), args)
  for _ = 1, opts.warmup do t:train_step() end
  cuda.synchronize()
  gl.reset_peak_memory('cuda')
  local times = {}
  for _ = 1, opts.steps do
    local t0 = now()
    t:train_step()
    cuda.synchronize()
    times[#times + 1] = now() - t0
  end
  table.sort(times)
  local dt = times[math.ceil(#times / 2)]
  local tps = t.tokens_per_step / dt
  local peak = progress.peak_flops(t.cfg)
  print('RESULT ' .. cjson.encode({
    device = cuda.get_device_name(0), tokens_per_step = t.tokens_per_step, ms_per_step = dt * 1e3,
    tokens_per_s = tps, mfu = tps * t.flops_per_token / peak, peak_flops = peak,
    flops_per_token = t.flops_per_token, peak_memory = gl.memory_stats('cuda').peak,
    whole_step_graph = (t.graph and t.graph.g) ~= nil,  -- replaying the step as one CUDA graph
    fp8 = t.cfg.fp8,
    config = ('B=%d T=%d%s'):format(t.cfg.batch_size, t.cfg.block_size, #opts.over > 0 and ' (tiny)' or '') }))
end

-- ------------------------------------------------------------------ report
local function fmt_num(v, f) return v and (f or '%.0f'):format(v) or '-' end

function M.markdown(rep)
  local L = {}
  L[#L + 1] = ('# gpu-check: %s (%s mode), %s'):format(rep.device, rep.mode, rep.ok and 'PASS' or 'FAIL')
  if rep.commit then L[#L + 1] = ''; L[#L + 1] = ('gptlua at commit %s, %s'):format(rep.commit, rep.started or '') end
  L[#L + 1] = ''
  L[#L + 1] = '| stage | status | seconds (budget) | result |'
  L[#L + 1] = '| --- | --- | --- | --- |'
  for _, s in ipairs(rep.stages) do
    L[#L + 1] = ('| %s | %s | %.0f (%d) | %s |'):format(s.name, s.status, s.seconds or 0, s.budget or 0,
      (s.detail or ''):gsub('|', '/'))
  end
  local tp
  for _, s in ipairs(rep.stages) do if s.name == 'throughput' then tp = s end end
  if tp and tp.rows and #tp.rows > 0 then
    L[#L + 1] = ''
    L[#L + 1] = '| model | config | CUDA graph | ms/step | tokens/s | MFU | predicted tokens/s (pessimistic..optimistic) | predicted MFU | verdict |'
    L[#L + 1] = '| --- | --- | --- | --- | --- | --- | --- | --- | --- |'
    for _, r in ipairs(tp.rows) do
      local p = r.predicted
      L[#L + 1] = ('| %s | %s | %s | %s | %s | %s | %s | %s | %s |'):format(r.model, r.config or '-', r.graph,
        fmt_num(r.ms_per_step, '%.1f'), fmt_num(r.tokens_per_s), r.mfu and ('%.1f%%'):format(100 * r.mfu) or '-',
        p and ('%.0f (%.0f..%.0f)'):format(p.tokens_per_s.central, p.tokens_per_s.pessimistic, p.tokens_per_s.optimistic) or '-',
        p and ('%.1f%% (%.1f..%.1f%%)'):format(100 * p.mfu.central, 100 * p.mfu.pessimistic, 100 * p.mfu.optimistic) or '-',
        r.verdict or '-')
    end
  end
  local f8
  for _, s in ipairs(rep.stages) do if s.name == 'fp8' then f8 = s end end
  if f8 and f8.rows and #f8.rows > 0 then
    L[#L + 1] = ''
    L[#L + 1] = '| model | config | precision | ms/step | tokens/s | vs bf16 |'
    L[#L + 1] = '| --- | --- | --- | --- | --- | --- |'
    for _, r in ipairs(f8.rows) do
      L[#L + 1] = ('| %s | %s | %s | %s | %s | %s |'):format(r.model, r.config or '-',
        r.fp8 == 'off' and 'bf16' or ('fp8 ' .. r.fp8), fmt_num(r.ms_per_step, '%.1f'), fmt_num(r.tokens_per_s),
        r.ratio and ('%.2fx'):format(r.ratio) or (r.verdict or '-'))
    end
  end
  L[#L + 1] = ''
  return table.concat(L, '\n')
end

-- ------------------------------------------------------------------ main
local function parse(argv)
  local o = { over = {} }
  for _, a in ipairs(argv) do
    local k, v = a:match('^%-%-([%w_]+)=(.*)$')
    if not k then error('gpu_check: expected --key=value, got ' .. a, 0) end
    if k == 'over' then o.over[#o.over + 1] = v
    elseif ({ mode = 1, out = 1, stages = 1, archs = 1, fail = 1, worker = 1, model = 1, graph = 1, warmup = 1,
              steps = 1, fp8 = 1 })[k] then o[k] = tonumber(v) or v
    else error('gpu_check: unknown option --' .. k .. ' (--mode, --out, --stages, --archs, --fail)', 0) end
  end
  return o
end

-- the GPUs nvidia-smi lists: names and compute capabilities
local function gpus()
  local p = io.popen('nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader 2>/dev/null')
  local list = {}
  for line in p:lines() do
    local name, cap = line:match('^%s*(.-)%s*,%s*([%d%.]+)%s*$')
    if name then list[#list + 1] = { name = name, cap = cap } end
  end
  p:close()
  return list
end

function M.main(argv)
  local o = parse(argv)
  if o.worker then
    if o.worker ~= 'throughput' then error('gpu_check: unknown worker ' .. o.worker, 0) end
    return worker_throughput(o)
  end
  local list = gpus()
  local mode = o.mode or (#list > 0 and 'gpu' or 'sim')
  local conf = M.MODES[mode]
  if not conf then error("gpu_check: --mode expected 'gpu' or 'sim', got " .. tostring(mode), 0) end
  if mode == 'gpu' and #list == 0 then error('gpu_check: --mode=gpu, but nvidia-smi lists no GPU', 0) end
  local out = o.out or (ROOT .. '/build/gpu-check')
  if out:sub(1, 1) ~= '/' then out = ROOT .. '/' .. out end
  os.execute('mkdir -p ' .. shq(out .. '/runs'))
  if not io.open(ROOT .. '/' .. conf.exe, 'rb') then
    error(('gpu_check: %s is missing: %s'):format(conf.exe, mode == 'sim' and 'make sim' or 'make'), 0)
  end
  local want = {}
  for s in tostring(o.stages or table.concat(M.STAGES, ',')):gmatch('[^,]+') do
    if not M.RUN[s] then error(('gpu_check: unknown stage %s (%s)'):format(s, table.concat(M.STAGES, ', ')), 0) end
    want[s] = true
  end
  if o.fail and not M.RUN[o.fail] then error('gpu_check: --fail names no stage: ' .. o.fail, 0) end
  local device = mode == 'sim' and 'CUDA simulator' or list[1].name
  if #list > 1 then device = ('%d x %s'):format(#list, device) end
  local ctx = { mode = mode, exe = conf.exe, out = out, gpus = math.max(#list, 1), archs = o.archs }
  local p = io.popen('cd ' .. shq(ROOT) .. ' && git rev-parse --short HEAD 2>/dev/null')
  local commit = p:read('*l')
  p:close()
  local rep = { mode = mode, device = device, gpus = #list > 0 and list or nil, archs = o.archs, commit = commit,
                started = os.date('!%Y-%m-%dT%H:%M:%SZ'), out = out, stages = {}, ok = true }
  local t_all = now()
  for _, name in ipairs(M.STAGES) do
    if want[name] then
      io.stdout:write(('gpu-check: %s (budget %d s) ... '):format(name, conf[name].budget))
      io.stdout:flush()
      local t0 = now()
      local res
      if o.fail == name then
        res = { status = 'fail', detail = 'injected failure (--fail=' .. name .. ')' }
      else
        local ok, r = pcall(M.RUN[name], ctx, conf[name])
        res = ok and r or { status = 'fail', detail = 'error: ' .. tostring(r) }
      end
      res.name, res.seconds, res.budget = name, now() - t0, conf[name].budget
      rep.stages[#rep.stages + 1] = res
      if res.status ~= 'pass' and res.status ~= 'skipped' then rep.ok = false end
      print(('%s in %.0f s: %s'):format(res.status, res.seconds, res.detail or ''))
    end
  end
  rep.seconds = now() - t_all
  write_atomic(out .. '/report.json', cjson.encode(rep))
  local md = M.markdown(rep)
  write_atomic(out .. '/report.md', md)
  print('')
  print(md)
  print(('gpu-check: %s in %.0f s; report: %s/report.json, %s/report.md'):format(rep.ok and 'PASS' or 'FAIL',
    rep.seconds, out, out))
  if not rep.ok then os.exit(1) end
end

-- run as a script: the check; loaded (dofile) by a spec: the module
if arg and arg[0] and arg[0]:match('gpu_check%.lua$') then
  M.main(arg)
  return  -- (a script that returns a table would be a training config)
end
return M
