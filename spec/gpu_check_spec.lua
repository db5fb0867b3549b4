-- `make gpu-check` (recipes/tools/gpu_check.lua) in its simulator mode, end
-- to end: every stage runs in the CUDA simulator at tiny sizes, the report
-- (report.json, report.md) holds each stage's result, and a failing stage
-- fails the run and is named.  The driver is build/gptlua; the stages run
-- build/sim/gptlua.  Tagged #cuda #sim: only under the simulator (make test).
local S = require 'support.mpi'
local cjson = require 'cjson'

local G = dofile(S.ROOT .. '/recipes/tools/gpu_check.lua')
local DRIVER = S.ROOT .. '/build/gptlua recipes/tools/gpu_check.lua'

local function read(path)
  local f = assert(io.open(path, 'rb'), path)
  local s = f:read('*a')
  f:close()
  return s
end

local function stage(rep, name)
  for _, s in ipairs(rep.stages) do if s.name == name then return s end end
end

describe('make gpu-check in the simulator #cuda #sim', function()
  it('runs every stage at tiny sizes, passes, and reports each in report.json and report.md', function()
    local dir = S.tmpdir()
    local out, rc = S.sh(('%s --mode=sim --out=%s'):format(DRIVER, dir), 900)
    assert.equal(0, rc, out)
    local rep = cjson.decode(read(dir .. '/report.json'))
    assert.equal('sim', rep.mode)
    assert.equal('CUDA simulator', rep.device)
    assert.is_true(rep.ok)
    local names = {}
    for i, s in ipairs(rep.stages) do
      names[i] = s.name
      assert.equal('pass', s.status, s.name .. ': ' .. tostring(s.detail))
      assert.is_true(s.seconds >= 0 and s.seconds <= s.budget + 10, s.name)
    end
    assert.same({ 'device', 'specs', 'train', 'throughput', 'fp8', 'nccl' }, names)

    assert.equal(1, stage(rep, 'device').count)
    assert.matches('cuda-sim', stage(rep, 'device').detail, 1, true)
    local specs = stage(rep, 'specs')
    assert.is_true(specs.passed > 0 and specs.failed == 0, specs.detail)

    local train = stage(rep, 'train')
    assert.is_true(train.loss_cuda_bf16 > 0 and train.loss_cuda_bf16 < 5, tostring(train.loss_cuda_bf16))
    assert.is_true(train.loss_cpu_f32 > 0 and train.loss_cpu_f32 < 5, tostring(train.loss_cpu_f32))
    assert.is_true(train.difference <= train.tolerance, train.detail)

    local rows = stage(rep, 'throughput').rows
    local seen = {}
    for _, r in ipairs(rows) do
      seen[#seen + 1] = r.model .. ' ' .. r.graph
      assert.is_true(r.tokens_per_s > 0 and r.mfu > 0 and r.ms_per_step > 0, r.model)
      assert.equal(G.SIM_NOTE, r.verdict)
      assert.is_nil(r.predicted)  -- the simulator's speed is no GPU's: nothing compared
      assert.equal(r.graph == 'on', r.whole_step_graph, r.model .. ' graph ' .. r.graph)
    end
    assert.same({ 'gpt2_124m on', 'gpt2_124m off', 'nanochat_d20 on', 'nanochat_d20 off' }, seen)
    assert.equal(2, stage(rep, 'nccl').ranks)

    -- FP8 against bf16 (the simulator is an sm_90): three runs, their ratios to the first
    local f8 = stage(rep, 'fp8')
    assert.equal(90, f8.capability)
    local precisions = {}
    for i, r in ipairs(f8.rows) do
      precisions[i] = r.fp8
      assert.is_true(r.tokens_per_s > 0 and r.ms_per_step > 0, r.fp8)
      assert.near(r.tokens_per_s / f8.rows[1].tokens_per_s, r.ratio, 1e-12)
      assert.is_true(r.whole_step_graph, r.fp8)
    end
    assert.same({ 'off', 'tensorwise', 'rowwise' }, precisions)
    assert.matches('^gpt2_124m B=1 T=32 %(tiny%), CUDA graph on: bf16 %d+ tokens/s, tensorwise %d+ %(%d+%.%d%dx%), '
                   .. 'rowwise %d+ %(%d+%.%d%dx%) %(' .. G.SIM_NOTE .. '%)$', f8.detail)

    local md = read(dir .. '/report.md')
    assert.matches('# gpu%-check: CUDA simulator %(sim mode%), PASS', md)
    assert.matches('| stage | status | seconds (budget) | result |', md, 1, true)
    assert.matches('| gpt2_124m | B=1 T=32 (tiny) | on |', md, 1, true)
    assert.matches(G.SIM_NOTE, md, 1, true)
    assert.matches('| model | config | precision | ms/step | tokens/s | vs bf16 |', md, 1, true)
    assert.matches('| gpt2_124m | B=1 T=32 %(tiny%) | bf16 | [%d.]+ | %d+ | 1.00x |', md)
    assert.matches('| gpt2_124m | B=1 T=32 %(tiny%) | fp8 tensorwise | [%d.]+ | %d+ | %d+%.%d%dx |', md)
    assert.matches('| gpt2_124m | B=1 T=32 %(tiny%) | fp8 rowwise | [%d.]+ | %d+ | %d+%.%d%dx |', md)
    assert.matches(md, out, 1, true)  -- the table it printed
  end)

  it('fails the run when a stage fails, names that stage, and still runs and reports the others', function()
    local dir = S.tmpdir()
    local out, rc = S.sh(('%s --mode=sim --out=%s --stages=specs,nccl --fail=specs'):format(DRIVER, dir), 300)
    assert.equal(1, rc, out)
    local rep = cjson.decode(read(dir .. '/report.json'))
    assert.is_false(rep.ok)
    assert.equal('fail', stage(rep, 'specs').status)
    assert.equal('injected failure (--fail=specs)', stage(rep, 'specs').detail)
    assert.equal('pass', stage(rep, 'nccl').status)
    assert.is_nil(stage(rep, 'train'))
    assert.matches('| specs | fail |', read(dir .. '/report.md'), 1, true)
    assert.matches('gpu-check: FAIL', out, 1, true)
  end)

  it('skips the fp8 stage on a GPU below sm_89, says so in the table, and passes', function()
    local dir = S.tmpdir()
    local out, rc = S.sh(('env GL_SIM_ARCH=80 %s --mode=sim --out=%s --stages=fp8'):format(DRIVER, dir), 120)
    assert.equal(0, rc, out)
    local rep = cjson.decode(read(dir .. '/report.json'))
    assert.is_true(rep.ok)
    local f8 = stage(rep, 'fp8')
    assert.equal('skipped', f8.status)
    assert.equal('skipped: sm_80 < sm_89', f8.detail)
    assert.same({}, f8.rows)
    assert.matches('| fp8 | skipped | %d+ %(240%) | skipped: sm_80 < sm_89 |', read(dir .. '/report.md'))
  end)

  it('refuses an unknown stage or option with one line', function()
    local out, rc = S.sh(('%s --mode=sim --stages=specs,bogus'):format(DRIVER), 60)
    assert.are_not.equal(0, rc)
    assert.matches('gpu_check: unknown stage bogus (device, specs, train, throughput, fp8, nccl)', out, 1, true)
    out, rc = S.sh(('%s --mode=sim --fail=nothing'):format(DRIVER), 60)
    assert.are_not.equal(0, rc)
    assert.matches('gpu_check: --fail names no stage: nothing', out, 1, true)
    out, rc = S.sh(('%s --speed=1'):format(DRIVER), 60)
    assert.are_not.equal(0, rc)
    assert.matches('gpu_check: unknown option --speed', out, 1, true)
  end)
end)

describe('gpu-check verdicts', function()
  it('compares a GPU\'s tokens/s with the account\'s range only on the GPU it predicts', function()
    local pred = { tokens_per_s = { pessimistic = 100, central = 150, optimistic = 200 } }
    local v, bad = G.verdict(99, pred, 'gpu', 'NVIDIA H100 80GB HBM3')
    assert.matches('^BELOW the predicted range %(100%.%.200%)', v)
    assert.is_true(bad)
    v, bad = G.verdict(150, pred, 'gpu', 'NVIDIA H200')
    assert.matches('^within', v); assert.is_false(bad)
    v, bad = G.verdict(201, pred, 'gpu', 'NVIDIA H100 80GB HBM3')
    assert.matches('^above', v); assert.is_false(bad)
    v, bad = G.verdict(1, pred, 'gpu', 'NVIDIA H100 PCIe')
    assert.matches('not compared', v); assert.is_false(bad)
    v, bad = G.verdict(1, pred, 'gpu', 'NVIDIA A100-SXM4-80GB')
    assert.matches('not compared', v); assert.is_false(bad)
    v, bad = G.verdict(1, pred, 'sim', 'gptlua cuda-sim')
    assert.equal(G.SIM_NOTE, v); assert.is_false(bad)
  end)

  it('prints a GPU\'s measurements beside the account\'s range', function()
    local pred = { tokens_per_s = { pessimistic = 493239, central = 590204, optimistic = 694341 },
                   mfu = { pessimistic = 0.427, central = 0.510, optimistic = 0.601 } }
    local rep = { device = 'NVIDIA H100 80GB HBM3', mode = 'gpu', ok = false, stages = {
      { name = 'throughput', status = 'fail', seconds = 40, budget = 150, detail = 'gpt2_124m graph off below its range',
        rows = { { model = 'gpt2_124m', config = 'B=64 T=1024', graph = 'off', ms_per_step = 140.2, tokens_per_s = 467000,
                   mfu = 0.404, predicted = pred, verdict = (G.verdict(467000, pred, 'gpu', 'NVIDIA H100 80GB HBM3')) } } } } }
    local md = G.markdown(rep)
    assert.matches('# gpu-check: NVIDIA H100 80GB HBM3 (gpu mode), FAIL', md, 1, true)
    assert.matches('| throughput | fail | 40 (150) | gpt2_124m graph off below its range |', md, 1, true)
    assert.matches('| gpt2_124m | B=64 T=1024 | off | 140.2 | 467000 | 40.4% | 590204 (493239..694341) | '
                   .. '51.0% (42.7..60.1%) | BELOW the predicted range (493239..694341) |', md, 1, true)
  end)

  it('reads the account\'s kept predictions for both models', function()
    for _, name in ipairs(G.MODELS) do
      local p = G.prediction(name)
      assert.is_table(p, name)
      assert.is_true(p.tokens_per_s.pessimistic < p.tokens_per_s.central and p.tokens_per_s.central < p.tokens_per_s.optimistic)
      assert.is_true(p.mfu.pessimistic < p.mfu.central and p.mfu.central < p.mfu.optimistic)
    end
  end)

  it('keeps what the account saves and reads it back (--save=1)', function()
    local acc = dofile(S.ROOT .. '/recipes/tools/account.lua')
    local dir = S.tmpdir()
    acc.PREDICTIONS = dir .. '/predictions.json'
    assert.is_nil((acc.load_prediction('tiny')))
    local range = { pessimistic = { tps = 100, mfu = 0.1 }, central = { tps = 150, mfu = 0.15 },
                    optimistic = { tps = 200, mfu = 0.2 } }
    acc.save_prediction('tiny', { B = 2, T = 64, layers = 1 }, { range = range })
    acc.save_prediction('other', { B = 1, T = 32, layers = 2 }, { range = range })
    local p = acc.load_prediction('tiny')
    assert.same({ pessimistic = 100, central = 150, optimistic = 200 }, p.tokens_per_s)
    assert.same({ pessimistic = 0.1, central = 0.15, optimistic = 0.2 }, p.mfu)
    assert.equal(64, p.T)
    assert.equal(2, acc.load_prediction('other').layers)
  end)

  it('holds the losses to the window\'s noise plus the bf16 allowance', function()
    local losses = {}
    for i = 1, 60 do losses[i] = 2 + 0.1 * ((i % 2) * 2 - 1) end  -- 1.9, 2.1, ...: mean 2, sd 0.1
    local mean, se = G.window(losses, 60, 50)
    assert.near(2, mean, 1e-12)
    assert.near(0.1 * math.sqrt(50 / 49) / math.sqrt(50), se, 1e-12)
    local ok, diff, tol = G.compare_losses(2 + 0.05, se, mean, se)
    assert.near(3 * math.sqrt(2) * se + 2 * G.LOSS_REL, tol, 1e-12)
    assert.is_true(ok and diff <= tol)
    assert.is_false((G.compare_losses(2 + tol + 1e-3, se, mean, se)))
    losses[60] = 0 / 0
    assert.is_nil(G.window(losses, 60, 50))
  end)
end)
