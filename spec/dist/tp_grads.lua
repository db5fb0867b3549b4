-- Run on every rank by spec/dist_tp_spec.lua: for each model named in the
-- arguments, one forward and backward of a tiny float64 model cut over the
-- mesh's tp group (dp x tp ranks, each dp group its slice of the batch)
-- against the whole model on the whole batch in this process: the loss and
-- every parameter's gradient (gathered to full size; replicated ones
-- averaged over dp) must agree to 1e-10.  Also sampling (gathered logits).
-- args: DP TP [sp] model[:n_kv_head] ... [, DP TP [sp] model ...]...   (sp:
-- sequence parallel; meshes separated by a lone ',' run one after another in
-- this launch, each on the whole world).  Prints "OK rank R of N".
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local TP = require 'gptlua.dist.tensor_parallel'

local world = dist.init { backend = 'mpi', timeout = 120 }

local function build(kind, kv)
  gl.manual_seed(7)
  local m
  if kind == 'gpt2' then
    m = require('gptlua.models.gpt2').GPT({ vocab_size = 16, block_size = 8, n_layer = 2, n_head = 4, n_embd = 16,
      dropout = 0 })
  else
    m = require('gptlua.models.nanochat').GPT({ vocab_size = 16, block_size = 8, n_layer = 2, n_head = 4,
      n_kv_head = kv or 4, n_embd = 32, head_dim = 8, depth = 2 })
  end
  return m:to('float64')
end

-- one mesh's check: args = { DP, TP, [sp,] model, ... }
local function check_mesh(args)
  local dp, tp = tonumber(args[1]), tonumber(args[2])
  local mesh = dist.mesh { dp = dp, tp = tp }
  local B, T = 2 * dp, 8
  gl.manual_seed(3)
  local xs, ys = {}, {}
  for b = 1, B do
    xs[b], ys[b] = {}, {}
    for t = 1, T do xs[b][t] = (b * 7 + t * 3) % 16; ys[b][t] = (b * 5 + t * 11) % 16 end
  end
  ys[1][2], ys[B / 2 + 1][2] = -1, -1  -- ignored targets, as many on every dp rank
  local X, Y = gl.tensor(xs, { dtype = 'int64' }), gl.tensor(ys, { dtype = 'int64' })

  local first, sp = 3, false
  if args[3] == 'sp' then first, sp = 4, true end
  for i = first, #args do
    local kind, kv = args[i]:match('^(%w+):?(%d*)$')
    kv = tonumber(kv)
    local what = ('%s at dp %d x tp %d%s'):format(args[i], dp, tp, sp and ' + sp' or '')
    local ref = build(kind, kv)
    local _, ref_loss = ref:forward(X, Y)
    ref_loss:backward()
    local model = build(kind, kv)
    local layout = TP.parallelize(model, mesh.tp, { sequence_parallel = sp })
    local per = B / dp
    local x = X:narrow(1, mesh.coord.dp * per + 1, per):contiguous()
    local y = Y:narrow(1, mesh.coord.dp * per + 1, per):contiguous()
    local _, loss = model:forward(x, y)
    loss:backward()
    TP.sum_replicated_grads(layout, model:parameters())
    local l = mesh.dp:all_reduce_number(loss:item(), 'avg')
    local want = ref_loss:item()
    assert(math.abs(l - want) < 1e-10, ('%s: loss %.15g, expected %.15g'):format(what, l, want))
    local refp = {}
    for _, np in ipairs(ref:named_parameters()) do refp[np[1]] = np[2] end
    for _, np in ipairs(model:named_parameters()) do
      local name, p = np[1], np[2]
      local g = p.grad:clone()
      mesh.dp:all_reduce(g, 'avg')
      local spec = layout.specs[name]
      if spec then g = TP.gather(g, spec, mesh.tp) end
      local r = refp[name].grad
      assert(gl.same_shape(g.shape, r.shape), name .. ': shape')
      local err = (g - r):abs():max():item() / math.max(r:abs():max():item(), 1e-30)
      assert(err < 1e-10, ('%s: %s gradient differs, relative error %.3g'):format(what, name, err))
    end
    -- sampling gathers the logits: the same tokens as the whole model
    local a = ref:generate(X:narrow(1, 1, 1):narrow(2, 1, 3):contiguous(), 4, { temperature = 0 }):totable()
    local b = model:generate(X:narrow(1, 1, 1):narrow(2, 1, 3):contiguous(), 4, { temperature = 0 }):totable()
    for t = 1, #a[1] do assert(a[1][t] == b[1][t], what .. ': generated tokens differ') end
  end
end

local group = {}
for i = 1, #arg + 1 do
  if arg[i] == ',' or i > #arg then check_mesh(group); group = {} else group[#group + 1] = arg[i] end
end
world:barrier()
print(('OK rank %d of %d'):format(world.rank, world.size))
