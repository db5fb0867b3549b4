-- Run on 2 ranks by spec/cuda_ep_graph_spec.lua under the CUDA simulator
-- (GL_SIM_DEVICES=2) or on 2 GPUs: the trainer's whole step as one CUDA
-- graph (gptlua.train_graph) under ddp with expert parallelism (ep 2, a MoE
-- layer in every block; moe.ep_exchange 'auto' picks the fixed exchange
-- while capturing), against the same trainer whose steps all run op by op
-- (the counts exchange): every step's loss and gradient norm and the final
-- parameters bit for bit, the routers' bias included; 'auto' does not
-- capture on several ranks, and true under fsdp is refused in one line.  arg 1: the capacity
-- factor (0: dropless); arg 2: ep (2; 1: ddp alone).  Prints "OK rank R of N".
local gl = require 'gptlua'
local train = require 'gptlua.train'
local assert = require 'luassert'

local cf = tonumber(arg[1] or '0')
local ep = tonumber(arg[2] or '2')
local recipe = dofile(gl.root .. '/spec/dist/policy_recipe.lua')

local function trainer(warmup)
  local out = os.tmpname()
  os.remove(out)
  return train.new(recipe({ optimizer = 'adamw', dist = 'ddp', ep = ep, device = 'cuda', out_dir = out, quiet = true,
    gradient_accumulation_steps = 2, cuda_graph = true, cuda_graph_warmup = warmup, max_iters = 4,
    moe = { experts = 4, top_k = 2, hidden = 32, capacity_factor = cf, bias_update = 0.01 } }), {}), out
end

local graphed, out_a = trainer(1)
local eager, out_b = trainer(100)
for s = 1, 4 do
  local la, na, _, ta = graphed:train_step()
  local lb, nb, _, tb = eager:train_step()
  assert.is_true(ta and tb, 'step ' .. s .. ' taken')
  assert.are.equal(lb, la, 'loss of step ' .. s)
  assert.are.equal(nb, na, 'gradient norm of step ' .. s)
end
assert.is_truthy(graphed.graph.g, 'the graphed trainer captured its step')
assert.is_nil(eager.graph.g)
local rank, comm = graphed.rank, graphed.comm
for i, p in ipairs(graphed.model:parameters()) do
  assert.are.same(eager.model:parameters()[i]:to('cpu'):tolist(), p:to('cpu'):tolist(), 'parameter ' .. i)
end
local moe_layer = graphed.moe_layers[1][2]
local bias = moe_layer.expert_bias:to('cpu')
assert.are.same(eager.moe_layers[1][2].expert_bias:to('cpu'):tolist(), bias:tolist())
assert.is_true(bias:abs():max():item() > 0, 'the bias moved')
print(('ep_train_graph: rank %d captured %d nodes'):format(rank, graphed.graph.g.nodes))
graphed.graph:free()
-- several ranks capture under cuda_graph = true only, and only under ddp
local auto = train.new(recipe({ dist = 'ddp', ep = ep, device = 'cuda', out_dir = out_a, quiet = true,
  moe = { experts = 4, top_k = 2, hidden = 32 } }), {})
assert.is_nil(auto.graph, "cuda_graph = 'auto' on several ranks")
local ok, err = pcall(train.new, recipe({ dist = 'fsdp', ep = ep, device = 'cuda', out_dir = out_a, quiet = true,
  cuda_graph = true, moe = { experts = 4, top_k = 2, hidden = 32 } }), {})
assert.is_false(ok)
assert.matches('cuda_graph = true: the run has 2 ranks (graphs serve one process, or ranks under ddp', tostring(err),
  1, true)
comm:barrier()
os.execute(("rm -rf '%s' '%s'"):format(out_a, out_b))
print(('OK rank %d of %d'):format(rank, comm.size))
