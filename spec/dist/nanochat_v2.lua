-- Run on every rank by spec/dist_nanochat_v2_spec.lua: nanochat v2 (value
-- embeddings with gates, smear, backout, lambdas, sliding windows, QK scale,
-- the vocabulary padded: 40 -> 64, so a tp rank's shard is part padding)
-- cut over tensor, context and pipeline parallelism, each case one forward
-- and backward of a tiny float64 model against the whole model on the whole
-- batch in this process: the loss and every gradient to 1e-10.  Then, for
-- each trainer case (OUT/NAME and its overrides), 5 steps of the trainer of
-- spec/dist/tp_recipe.lua with nanochat v2, written to OUT/NAME/result.json
-- for the spec to compare with one process.
-- args: OUT case ... where a case is a grads case
--   tp2, tp2sp, cp2, cp2ring, pp2, pp2late (the backout inside the first
--   stage), dp2tp2sp, tp2cp2, tp2cp2ring
-- or a trainer case NAME:--override,--override,...
-- Prints "OK rank R of N".
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local TP = require 'gptlua.dist.tensor_parallel'
local CP = require 'gptlua.dist.context_parallel'
local PP = require 'gptlua.dist.pipeline'

local world = dist.init { backend = 'mpi', timeout = 120 }
local OUT = arg[1]
local V, T = 40, 8

local function build(over)
  gl.manual_seed(7)
  local cfg = { version = 'v2', vocab_size = V, block_size = T, n_layer = 4, n_head = 4, n_kv_head = 2, n_embd = 32,
    head_dim = 8, depth = 4, short_window = 3 }
  for k, v in pairs(over or {}) do cfg[k] = v end
  local m = require('gptlua.models.nanochat').GPT(cfg):to('float64')
  -- nanochat's init zeroes the projections and smear_lambda: random values
  -- so every path carries a gradient
  gl.manual_seed(11)
  gl.no_grad(function()
    for _, np in ipairs(m:named_parameters()) do
      local p = np[2]
      if np[1]:match('c_proj') or np[1]:match('lambda') then p:copy_(gl.randn(p.shape, { dtype = p.dtype }) * 0.3) end
    end
  end)
  return m
end

local function rows(n, seed)
  local xs, ys = {}, {}
  for b = 1, n do
    xs[b], ys[b] = {}, {}
    for t = 1, T do xs[b][t] = (b * 7 + t * 3 + seed) % V; ys[b][t] = (b * 5 + t * 11 + seed) % V end
  end
  return gl.tensor(xs, { dtype = 'int64' }), gl.tensor(ys, { dtype = 'int64' })
end

local function close(what, got, want)
  local err = (got - want):abs():max():item() / math.max(want:abs():max():item(), 1e-30)
  assert(err < 1e-10, ('%s differs, relative error %.3g'):format(what, err))
end

local function reference(over, x, y)
  local ref = build(over)
  local _, loss = ref:forward(x, y)
  loss:backward()
  local grads = {}
  for _, np in ipairs(ref:named_parameters()) do grads[np[1]] = np[2].grad end
  return loss:item(), grads, ref
end

-- dp x tp (sp) x cp (mode): the model cut, each dp rank its slice of the batch
local function mesh_case(name, sizes, sp, mode, over)
  local mesh = dist.mesh(sizes)
  local dp = mesh.size.dp
  local X, Y = rows(2 * dp, 1)
  local want, ref_grads, ref = reference(over, X, Y)
  local model = build(over)
  local layout
  if mesh.size.tp > 1 then layout = TP.parallelize(model, mesh.tp, { sequence_parallel = sp }) end
  if mesh.size.cp > 1 then CP.parallelize(model, mesh.cp, { mode = mode }) end
  local x = X:narrow(1, mesh.coord.dp * 2 + 1, 2):contiguous()
  local y = Y:narrow(1, mesh.coord.dp * 2 + 1, 2):contiguous()
  local _, loss = model:forward(x, y)
  loss:backward()
  if layout then TP.sum_replicated_grads(layout, model:parameters()) end
  local avg = mesh.size.cp > 1 and mesh.dp_cp or mesh.dp
  local l = avg:all_reduce_number(loss:item(), 'avg')
  assert(math.abs(l - want) < 1e-10, ('%s: loss %.15g, expected %.15g'):format(name, l, want))
  for _, np in ipairs(model:named_parameters()) do
    local g = np[2].grad:clone()
    avg:all_reduce(g, 'avg')
    local spec = layout and layout.specs[np[1]]
    if spec then g = TP.gather(g, spec, mesh.tp) end
    close(('%s: %s gradient'):format(name, np[1]), g, ref_grads[np[1]])
  end
  -- sampling (KV caches, the smear's kept row, gathered logits): the whole model's tokens
  local prompt = X:narrow(1, 1, 1):narrow(2, 1, 4):contiguous()
  local a = ref:generate(prompt, 4, { temperature = 0 }):totable()
  local b = model:generate(prompt, 4, { temperature = 0 }):totable()
  for t = 1, #a[1] do assert(a[1][t] == b[1][t], name .. ': generated tokens differ') end
end

-- pp 2, 1F1B, 2 microbatches; partition: block counts per stage
local function pp_case(name, partition)
  local mesh = dist.mesh({ pp = 2 })
  local xs, ys = {}, {}
  for j = 1, 2 do xs[j], ys[j] = rows(2, j) end
  local ref = build()
  local want = 0
  for j = 1, 2 do
    local _, loss = ref:forward(xs[j], ys[j])
    want = want + loss:item() / 2
    gl.backward(loss * 0.5)
  end
  local refp = {}
  for _, np in ipairs(ref:named_parameters()) do refp[np[1]] = np[2] end
  local model = build()
  local pipe = PP.new(model, mesh.pp, { schedule = '1f1b', microbatches = 2, batch = { 2, T }, partition = partition })
  local l = pipe:step(xs, ys)
  assert(math.abs(l - want) < 1e-10, ('%s: loss %.15g, expected %.15g'):format(name, l, want))
  local seen = 0
  for _, np in ipairs(pipe.named) do
    close(('%s: %s gradient'):format(name, np[1]), np[2].grad, refp[np[1]].grad)
    seen = seen + 1
  end
  -- every parameter trained by some stage
  local total = mesh.pp:all_reduce_number(seen, 'sum')
  assert(total >= #ref:named_parameters(), ('%s: %d parameters trained, the model has %d'):format(name, total,
    #ref:named_parameters()))
end

local cases = {
  tp2 = function() mesh_case('tp2', { tp = 2 }) end,
  tp2sp = function() mesh_case('tp2 + sp', { tp = 2 }, true) end,
  cp2 = function() mesh_case('cp2 ulysses', { cp = 2 }, false, 'ulysses') end,
  cp2ring = function() mesh_case('cp2 ring', { cp = 2 }, false, 'ring', { window_pattern = 'L' }) end,
  dp2tp2sp = function() mesh_case('dp2 x tp2 + sp', { dp = 2, tp = 2 }, true) end,
  tp2cp2 = function() mesh_case('tp2 x cp2 ulysses', { tp = 2, cp = 2 }, false, 'ulysses', { n_kv_head = 4 }) end,
  tp2cp2ring = function() mesh_case('tp2 x cp2 ring', { tp = 2, cp = 2 }, false, 'ring', { window_pattern = 'L' }) end,
  pp2 = function() pp_case('pp2', { 2, 2 }) end,
  pp2late = function() pp_case('pp2 backout on stage 1', { 3, 1 }) end,
}

local train = require 'gptlua.train'
local recipe = dofile(gl.root .. '/spec/dist/tp_recipe.lua')
local write_result = dofile(gl.root .. '/spec/dist/write_result.lua')
for i = 2, #arg do
  local name, overrides = arg[i]:match('^([%w_]+):(.*)$')
  if name then
    local args = {}
    for o in overrides:gmatch('[^,]+') do args[#args + 1] = o end
    local dir = OUT .. '/' .. name
    local res = train.main(recipe('nanochat', { max_iters = 5, out_dir = dir, checkpoint_interval = 5,
      nanochat = { version = 'v2', short_window = 3 } }), args)
    if world.rank == 0 then
      write_result(dir .. '/result.json', res)
    end
  else
    assert(cases[arg[i]], 'unknown case ' .. arg[i])()
  end
end
world:barrier()
print(('OK rank %d of %d'):format(world.rank, world.size))
