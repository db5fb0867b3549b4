-- gptlua.ops_moe — the mixture-of-experts ops (engine/ops_moe.c): the
-- routing plan, the permutation of token rows into expert order and the
-- weighted combine back, and the grouped product over every expert's rows.
-- Functions land in gptlua.ops (gl.*).  The layer that uses them, and the
-- router that chooses the experts, are gptlua.moe.
local G = require 'gptlua.ffi'
local Tensor = require 'gptlua.tensor'
local A = require 'gptlua.autograd'
local O = require 'gptlua.ops'
local ffi, lib = G.ffi, G.lib
local record = A.record
local empty_like = O.empty_like

local function contiguous(t) return t:is_contiguous() and t or t:contiguous() end

-- moe_route(experts (N, K) int, E, capacity) -> slots (N, K) int64, counts
-- (E) int64, load (E) int64: each assignment's row in the expert-ordered
-- buffer (-1: dropped), the rows each expert keeps, the assignments routed
-- to each.  capacity 0: dropless.  No gradient.
function O.moe_route(experts, E, capacity)
  local dev = experts.device
  local slots = Tensor.empty(experts.shape, { dtype = 'int64', device = dev })
  local counts = Tensor.empty({ E }, { dtype = 'int64', device = dev })
  local load = Tensor.empty({ E }, { dtype = 'int64', device = dev })
  G.check(lib.gl_moe_route(slots.c, counts.c, load.c, experts.c, capacity or 0), 2)
  return slots, counts, load
end

local combine
-- the engine's permutation: out[slots[n][k]] = weights[n][k] x[n] (weights nil: 1)
local function permute(x, slots, rows, weights)
  local out = empty_like(x, { rows, x.shape[2] })
  G.check(lib.gl_moe_permute(out.c, x.c, slots.c, weights and weights.c or nil), 3)
  return out
end
-- moe_permute(x (N, C), slots (N, K), rows) -> (rows, C): row slots[n][k]
-- is x[n], the rows no slot names are zero
function O.moe_permute(x, slots, rows)
  local out = permute(x, slots, rows)
  return record(out, { x }, function(_, g)
    return combine(contiguous(g), slots)
  end, { slots }, 'moe_permute')
end

-- the engine's combine: out[n] = sum over k of weights[n][k] y[slots[n][k]] (weights nil: 1)
combine = function(y, slots, weights)
  local out = empty_like(y, { slots.shape[1], y.shape[2] })
  G.check(lib.gl_moe_combine(out.c, y.c, slots.c, weights and weights.c or nil), 3)
  return out
end
-- moe_combine(y (rows, C), slots (N, K), weights (N, K)) -> (N, C): out[n]
-- = sum over k of weights[n][k] y[slots[n][k]], dropped assignments left out
function O.moe_combine(y, slots, weights)
  local out = combine(y, slots, weights)
  return record(out, { y, weights }, function(_, g)
    g = contiguous(g)
    local gy = y.requires_grad and permute(g, slots, y.shape[1], weights) or nil
    local gw
    if weights.requires_grad then
      gw = empty_like(weights)
      G.check(lib.gl_moe_combine_wgrad(gw.c, g.c, y.c, slots.c), 2)
    end
    return gy, gw
  end, { y, slots, weights }, 'moe_combine')
end

-- a list of tensors as a C array of their handles
local function pointers(list, ctype)
  local arr = ffi.new(ctype .. '[?]', #list)
  for i, t in ipairs(list) do arr[i - 1] = t.c end
  return arr
end
local function grouped(a, bs, counts, n_out)
  local out = empty_like(a, { a.shape[1], n_out })
  G.check(lib.gl_grouped_matmul(out.c, a.c, #bs, pointers(bs, 'const gl_tensor *'), counts.c), 3)
  return out
end
-- grouped_linear(a (M, K), weights {E of (N, K)}, counts (E)) -> (M, N):
-- the rows of expert e times weights[e]^T (nn.Linear's layout), rows past
-- the experts' zero.  One engine call for every expert, each way.
function O.grouped_linear(a, weights, counts)
  local E = #weights
  if E < 1 then error('grouped_linear: weights is empty, expected one matrix per expert', 2) end
  if counts:numel() ~= E then
    error(('grouped_linear: counts has %d entries, expected %d (one per weight)'):format(counts:numel(), E), 2)
  end
  local ts = {}
  for e = 1, E do ts[e] = weights[e]:t() end
  local out = grouped(a, ts, counts, weights[1].shape[1])
  local inputs = { a }
  for e = 1, E do inputs[e + 1] = weights[e] end
  return record(out, inputs, function(_, g)
    g = contiguous(g)
    local grads = { a.requires_grad and grouped(g, weights, counts, a.shape[2]) or false }
    local any = false
    for e = 1, E do if weights[e].requires_grad then any = true end end
    if any then
      local dws = {}
      for e = 1, E do dws[e] = empty_like(weights[e]) end
      -- dW_e (N, K) = g_e^T a_e
      G.check(lib.gl_grouped_matmul_wgrad(E, pointers(dws, 'gl_tensor *'), g.c, a.c, counts.c), 2)
      for e = 1, E do grads[e + 1] = weights[e].requires_grad and dws[e] or false end
    end
    for i = 1, E + 1 do if grads[i] == false then grads[i] = nil end end
    return unpack(grads, 1, E + 1)
  end, { a, counts, unpack(weights) }, 'grouped_linear')
end

return O
