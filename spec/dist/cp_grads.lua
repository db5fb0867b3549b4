-- Run on every rank by spec/dist_tp_spec.lua: one forward and backward of a
-- tiny float64 model whose sequence is split over the mesh's cp group
-- (Ulysses or ring; dp x cp ranks, each dp group its slice of the batch)
-- against the whole model on the whole batch in this process: the loss
-- averaged over the ranks and every gradient averaged over them must agree
-- to 1e-10.  Also sampling, and the logits of a forward that records
-- gradients without targets (rows gathered back in sequence order).
-- args: DP CP ulysses|ring model[:n_kv_head] ... [, DP CP ulysses|ring model ...]...
-- (meshes separated by a lone ',' run one after another in this launch, each
-- on the whole world).  Prints "OK rank R of N".
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local CP = require 'gptlua.dist.context_parallel'

local world = dist.init { backend = 'mpi', timeout = 120 }

local function build(kind, kv)
  gl.manual_seed(7)
  local m
  if kind == 'gpt2' then
    m = require('gptlua.models.gpt2').GPT({ vocab_size = 16, block_size = 16, n_layer = 2, n_head = 4, n_embd = 16,
      dropout = 0 })
  else
    m = require('gptlua.models.nanochat').GPT({ vocab_size = 16, block_size = 16, n_layer = 2, n_head = 4,
      n_kv_head = kv or 4, n_embd = 32, head_dim = 8, depth = 2 })
  end
  return m:to('float64')
end

-- one mesh's check: args = { DP, CP, ulysses|ring, model, ... }
local function check_mesh(args)
  local dp, cp, mode = tonumber(args[1]), tonumber(args[2]), args[3]
  local mesh = dist.mesh { dp = dp, cp = cp }
  local B, T = 2 * dp, 16
  local xs, ys = {}, {}
  for b = 1, B do
    xs[b], ys[b] = {}, {}
    for t = 1, T do xs[b][t] = (b * 7 + t * 3) % 16; ys[b][t] = (b * 5 + t * 11) % 16 end
  end
  local X, Y = gl.tensor(xs, { dtype = 'int64' }), gl.tensor(ys, { dtype = 'int64' })

  for i = 4, #args do
    local kind, kv = args[i]:match('^(%w+):?(%d*)$')
    kv = tonumber(kv)
    local what = ('%s at dp %d x cp %d %s'):format(args[i], dp, cp, mode)
    local ref = build(kind, kv)
    local _, ref_loss = ref:forward(X, Y)
    ref_loss:backward()
    local model = build(kind, kv)
    CP.parallelize(model, mesh.cp, { mode = mode })
    local per = B / dp
    local x = X:narrow(1, mesh.coord.dp * per + 1, per):contiguous()
    local y = Y:narrow(1, mesh.coord.dp * per + 1, per):contiguous()
    local _, loss = model:forward(x, y)
    loss:backward()
    local l = world:all_reduce_number(loss:item(), 'avg')
    local want = ref_loss:item()
    assert(math.abs(l - want) < 1e-10, ('%s: loss %.15g, expected %.15g'):format(what, l, want))
    local refp = {}
    for _, np in ipairs(ref:named_parameters()) do refp[np[1]] = np[2] end
    for _, np in ipairs(model:named_parameters()) do
      local name, p = np[1], np[2]
      local g = p.grad:clone()
      world:all_reduce(g, 'avg')
      local r = refp[name].grad
      local err = (g - r):abs():max():item() / math.max(r:abs():max():item(), 1e-30)
      assert(err < 1e-10, ('%s: %s gradient differs, relative error %.3g'):format(what, name, err))
    end
    -- logits without targets: the whole sequence's, in order
    local want_logits = gl.no_grad(ref.forward, ref, X)
    local got_logits = model:forward(X:narrow(1, 1, 1):contiguous())
    local e = (got_logits - want_logits:narrow(1, 1, 1)):abs():max():item()
    assert(e < 1e-10, ('%s: logits without targets differ by %.3g'):format(what, e))
    -- sampling: prompts of 3 tokens (not divisible: whole sequence) and 4 (split)
    for _, n in ipairs({ 3, 4 }) do
      local prompt = X:narrow(1, 1, 1):narrow(2, 1, n):contiguous()
      local a = ref:generate(prompt, 4, { temperature = 0 }):totable()
      local b = model:generate(prompt, 4, { temperature = 0 }):totable()
      for t = 1, #a[1] do assert(a[1][t] == b[1][t], what .. ': generated tokens differ') end
    end
  end
end

local group = {}
for i = 1, #arg + 1 do
  if arg[i] == ',' or i > #arg then check_mesh(group); group = {} else group[#group + 1] = arg[i] end
end
world:barrier()
print(('OK rank %d of %d'):format(world.rank, world.size))
