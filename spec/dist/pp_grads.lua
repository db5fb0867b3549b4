-- Run on every rank by spec/dist_pp_spec.lua: a tiny float64 model cut into
-- pipeline stages over the mesh's pp group, 5 AdamW steps of m microbatches
-- through the schedule, against one process running the whole model with
-- the same microbatches as accumulation steps: the loss of every step,
-- every owned parameter's gradient after the first step and every owned
-- parameter after the last must agree to 1e-10.
-- args: PP SCHEDULES M V model ...     Prints "OK rank R of N".  SCHEDULES:
-- one name or several with commas, each checked in this launch, each with
-- M microbatches or its own after a colon (zbh1,zbh2:8).
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local PP = require 'gptlua.dist.pipeline'
local optim = require 'gptlua.optim'

local pp, scheds, m, v = tonumber(arg[1]), arg[2], tonumber(arg[3]), tonumber(arg[4])
local world = dist.init { backend = os.getenv('GPTLUA_SPEC_BACKEND') or 'mpi', timeout = 120 }
local mesh = dist.mesh { pp = pp }

local function build(kind)
  gl.manual_seed(7)
  local model
  if kind == 'gpt2' then
    model = require('gptlua.models.gpt2').GPT({ vocab_size = 16, block_size = 8, n_layer = 8, n_head = 2, n_embd = 8,
      dropout = 0 })
  else
    model = require('gptlua.models.nanochat').GPT({ vocab_size = 16, block_size = 8, n_layer = 8, n_head = 2,
      n_embd = 16, head_dim = 8, depth = 4 })
  end
  return model:to('float64')
end

local B, T, STEPS = 2, 8, 5
local function batch(step, i)
  local xs, ys = {}, {}
  for b = 1, B do
    xs[b], ys[b] = {}, {}
    for t = 1, T do
      xs[b][t] = (step * 13 + i * 7 + b * 5 + t * 3) % 16
      ys[b][t] = (step * 11 + i * 3 + b * 7 + t * 5) % 16
    end
  end
  ys[1][2] = -1  -- an ignored target
  return gl.tensor(xs, { dtype = 'int64' }), gl.tensor(ys, { dtype = 'int64' })
end

local function adamw(params) return optim.AdamW(params, { lr = 1e-2, weight_decay = 0.1 }) end
local function zero_grad(params) for _, p in ipairs(params) do p.grad = nil end end

local runs = {}  -- every (schedule, microbatches, model)
for s in scheds:gmatch('[^,]+') do
  local name, own = s:match('^([^:]+):?(%d*)$')
  for i = 5, #arg do runs[#runs + 1] = { name, tonumber(own) or m, arg[i] } end
end
for _, run in ipairs(runs) do
  local sched, m, kind = run[1], run[2], run[3]
  -- the reference: one process, m accumulation steps of loss / m
  local ref = build(kind)
  local ropt = adamw(ref:parameters())
  local ref_losses, ref_grads = {}, {}
  for step = 1, STEPS do
    zero_grad(ref:parameters())
    local sum = 0
    for j = 1, m do
      local x, y = batch(step, j)
      local _, loss = ref:forward(x, y)
      sum = sum + loss:item()
      gl.backward(loss * (1 / m))
    end
    ref_losses[step] = sum / m
    if step == 1 then
      for _, np in ipairs(ref:named_parameters()) do ref_grads[np[1]] = np[2].grad:clone() end
    end
    ropt:step()
  end
  local refp = {}
  for _, np in ipairs(ref:named_parameters()) do refp[np[1]] = np[2] end

  local model = build(kind)
  local pipe = PP.new(model, mesh.pp, { schedule = sched, microbatches = m, virtual = v, batch = { B, T } })
  local opt = adamw(pipe.params)
  for step = 1, STEPS do
    zero_grad(pipe.params)
    local xs, ys = {}, {}
    for j = 1, m do xs[j], ys[j] = batch(step, j) end
    local l = pipe:step(xs, ys)
    assert(math.abs(l - ref_losses[step]) < 1e-10,
      ('%s %s: step %d loss %.15g, expected %.15g'):format(kind, sched, step, l, ref_losses[step]))
    if step == 1 then
      for _, np in ipairs(pipe.named) do
        local g, r = np[2].grad, ref_grads[np[1]]
        local err = (g - r):abs():max():item() / math.max(r:abs():max():item(), 1e-30)
        assert(err < 1e-10, ('%s %s: %s gradient differs, relative error %.3g'):format(kind, sched, np[1], err))
      end
    end
    opt:step()
  end
  for _, np in ipairs(pipe.named) do
    local err = (np[2] - refp[np[1]]):abs():max():item()
    assert(err < 1e-10, ('%s %s: %s after %d steps differs by %.3g'):format(kind, sched, np[1], STEPS, err))
  end
end
world:barrier()
print(('OK rank %d of %d'):format(world.rank, world.size))
