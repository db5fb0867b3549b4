-- recipes/tools/account_decode.lua — the account's decode figure: the
-- predicted speed of the KV-cache engine's decode step (gptlua.infer) on one
-- GPU, with recipes/tools/account.lua's device and efficiency tables
-- (`recipes/tools/bench_cuda.lua --account --decode=1`; spec/account_spec.lua).
--
-- A decode step: one new token for each of B rows against caches holding ctx positions.
-- Its products are matrix-vector ones (B rows): 2 B FLOPs per weight of 2
-- bytes, B FLOP per byte, far under the H100's ridge point (about 295), so
-- the step is memory-bound: every weight is read once (bf16), each row's K
-- and V of every layer are read and the new position's written (bf16), the
-- logits written and read back (bf16, for the sampling on the host), and a
-- token and a position row looked up per row.  The activations (a few
-- dozen rows of C per layer) are left out: under 1% of the bytes at B = 8.
-- The bytes come from the shapes (M.decode_bytes); the device work items
-- per step (kernels, copies) are counted in the simulator's trace of one
-- decode step as the engine replays it in a CUDA graph (gptlua.infer_graph,
-- run op by op: the graph's kernels and the writes of its inputs), of a
-- model of the same depth at a small width (M.count_decode_launches; their
-- number does not depend on the width).
-- Step time = bytes / (bandwidth x mem) + launches x gap_us, per
-- efficiency table of account.lua's M.EFFICIENCY; tokens/s = B / step time.
local gl = require 'gptlua'
local A = dofile(gl.root .. '/recipes/tools/account.lua')

local M = {}

M.DECODE_MODELS = {
  -- GPT-2 124M: 12 layers of width 768, the head tied to the 50257-row token table
  gpt2_124m = { layers = 12, C = 768, V = 50257, ctx = 1024 },
}

-- bytes of one decode step of model m (layers, C, V) for B rows at context ctx
function M.decode_bytes(m, B, ctx)
  local L, C, V = m.layers, m.C, m.V
  local layer = 12 * C * C + 13 * C  -- qkv, attention projection, MLP (weights and biases), two LayerNorms
  local b = {
    weights = 2 * (L * layer + V * C + 2 * C),  -- the layers, the tied head (V x C), the final LayerNorm
    lookups = 2 * B * 2 * C,                    -- a token row and a position row per row
    kv_read = 2 * 2 * L * B * ctx * C,          -- K and V of every layer, ctx positions per row
    kv_written = 2 * 2 * L * B * C,             -- the new position's K and V
    logits = 2 * 2 * B * V,                     -- written, then read for the sampling
  }
  b.total = b.weights + b.lookups + b.kv_read + b.kv_written + b.logits
  return b
end

-- device work items of one decode step of a GPT-2 of L layers (any width),
-- counted in the simulator's trace; nil and why outside the simulator
function M.count_decode_launches(L, B)
  local trace = dofile(gl.root .. '/recipes/tools/sim_trace.lua')
  if not trace.library() then return nil, 'counting a decode step\'s launches needs the CUDA simulator (build/sim/gptlua)' end
  local cuda = require 'gptlua.cuda'
  local infer = require 'gptlua.infer'
  local infer_graph = require 'gptlua.infer_graph'
  gl.manual_seed(1)
  local model = require('gptlua.models.gpt2').GPT({ vocab_size = 64, block_size = 32, n_layer = L, n_head = 2,
                                                    n_embd = 64 })
  model:to('cuda'); model:to('bfloat16'); model:eval()
  local e, ids = infer.Engine.new(model, nil), {}
  for b = 1, B do ids[b] = b end
  local n = 0
  gl.no_grad(function()
    local caches = e:prefill({ 1, 2, 3 }, B, 8)
    local step = infer_graph.new(e, caches, B, { capture = false })
    step:step(ids)  -- (the first step allocates the logits' buffer)
    cuda.synchronize(0)
    trace.start()
    step:step(ids)
    cuda.synchronize(0)
    trace.stop()
    for _, r in ipairs(trace.records()) do if r.kind == 'work' then n = n + 1 end end
  end)
  return n
end

-- the predicted decode step of model m (name: its label) for B rows at
-- context ctx with `launches` work items, under every efficiency table:
-- { pessimistic = {step_s, tps}, central = ..., optimistic = ..., bytes = ... }
function M.decode_prediction(m, B, ctx, launches, tables, dev)
  dev, tables = dev or A.H100, tables or A.EFFICIENCY
  local bytes = M.decode_bytes(m, B, ctx)
  local r = { bytes = bytes }
  for _, k in ipairs(A.EFFICIENCY_ORDER) do
    local e = tables[k]
    local step = bytes.total / (dev.bw * e.mem) + launches * e.gap_us * 1e-6
    r[k] = { step_s = step, tps = B / step }
  end
  return r
end

-- prints the decode prediction of model `name` at batches Bs and contexts
-- ctxs with `launches(B)` work items per step; returns the predictions
function M.decode_report(name, Bs, ctxs, launches, out, tables)
  out = out or print
  local m, dev = M.DECODE_MODELS[name], A.H100
  out(('decode on one %s (%.2f TB/s), %s: prediction (not a measurement), memory-bound: each step reads every '
       .. 'weight once and each row\'s KV cache (bf16), plus a gap per launch; assumes no host time on the critical '
       .. 'path (the step replayed as a CUDA graph, sampling overlapped), activations left out (under 1%% of the bytes); '
       .. 'efficiencies (recipes/tools/account.lua, M.EFFICIENCY):'):format(dev.name, dev.bw / 1e12, name))
  for _, k in ipairs(A.EFFICIENCY_ORDER) do out(('  %-11s %s'):format(k, A.describe_efficiency((tables or A.EFFICIENCY)[k]))) end
  local res = {}
  for _, B in ipairs(Bs) do
    for _, ctx in ipairs(ctxs) do
      local n = launches(B)
      local p = M.decode_prediction(m, B, ctx, n, tables, dev)
      res[#res + 1] = { B = B, ctx = ctx, launches = n, p = p }
      out(('  batch %d, context %d: %.1f MB and %d launches per step; predicted %.0f tokens/s (range %.0f..%.0f), '
           .. '%.3f ms per step'):format(B, ctx, p.bytes.total / 1e6, n, p.central.tps, p.pessimistic.tps,
           p.optimistic.tps, p.central.step_s * 1e3))
    end
  end
  return res
end

-- `bench_cuda.lua --account --decode=1 [--model=gpt2_124m]`: the decode
-- prediction at batches 1 and 8, contexts 128 and the model's whole one
function M.main(opts, out)
  local m = M.DECODE_MODELS[opts.model]
  if not m then error(('account: --decode has a model for gpt2_124m only, got %s'):format(tostring(opts.model)), 0) end
  local counted = {}
  local function launches(B)
    if not counted[B] then counted[B] = assert(M.count_decode_launches(m.layers, B)) end
    return counted[B]
  end
  return M.decode_report(opts.model, { 1, 8 }, { 128, m.ctx }, launches, out)
end

return M
