-- Muon's 'current' variant (Polar Express, MuonEq, Muon+, NorMuon, cautious
-- weight decay: gptlua.optim, expressed in existing ops) on the CUDA backend
-- (the simulator in make test) against the CPU: float32 steps agree, a
-- bfloat16 parameter runs the iteration in bfloat16 around fp32 state, and
-- a whole step is captured in a CUDA graph, which a host wait would break.
local gl = require 'gptlua'
local cuda = require 'gptlua.cuda'
local optim = require 'gptlua.optim'
local twin = require 'support.cuda_twin'
local DEV = twin.DEV

local gpu_it = twin.gpu_it(it, pending)

local OPTS = { lr = 0.02, variant = 'current', weight_decay = 0.2 }

-- W0 and 3 gradients of shape, on the CPU
local function inputs(shape, seed)
  local g = {}
  for s = 1, 3 do g[s] = gl.randn(shape, { seed = seed + s }) end
  return gl.randn(shape, { seed = seed }), g
end

-- steps optim.Muon(OPTS) over W (a copy of W0 on device, in dtype) with the
-- gradients; returns W and the optimizer
local function run(W0, grads, device, dtype)
  local W = W0:clone():to(device):to(dtype or 'float32')   -- (W0:to('cpu') would be W0 itself)
  local opt = optim.Muon({ W }, OPTS)
  for _, g in ipairs(grads) do
    W.grad = g:to(device):to(W.dtype)
    opt:step()
  end
  return W, opt
end

-- runs f with Newton-Schulz in the GPU's precision on the CPU too (the twin
-- of a bfloat16 parameter on the device)
local function as_gpu_ns(f)
  local muon = require('gptlua.optim.muon').optim  -- where Muon looks it up
  local ns_dtype = muon.ns_dtype
  muon.ns_dtype = function(p) return p.dtype == 'bfloat16' and 'bfloat16' or nil end
  local ok, a, b = pcall(f)
  muon.ns_dtype = ns_dtype
  if not ok then error(a, 0) end
  return a, b
end

-- Tolerances by the kernel twins' rule (spec/support/cuda_twin.lua): the
-- same steps in float64 on the CPU (the reference), in the run's precision
-- on the CPU (the twin) and on the device; the device's error at most twice
-- the twin's plus the rounding bound, n the longest reduction (the
-- iteration's products run over the longer side).
describe('Muon variants on the GPU #cuda', function()
  gpu_it("'current' steps on the device equal the CPU's in float32 (wide and tall)", function()
    for i, shape in ipairs({ { 24, 40 }, { 40, 24 } }) do
      local W0, grads = inputs(shape, 10 * i)
      local n = math.max(shape[1], shape[2])
      local Wr, orf = run(W0, grads, 'cpu', 'float64')
      local Wc, oc = run(W0, grads, 'cpu')
      local Wg, og = run(W0, grads, DEV)
      local what = ('W {%d,%d}'):format(shape[1], shape[2])
      twin.check(what, Wg:to('cpu'), Wc, Wr, 'float32', n)
      local vr, vc, vg = orf.state[Wr].second_momentum_buffer, oc.state[Wc].second_momentum_buffer,
                         og.state[Wg].second_momentum_buffer
      assert.same(vc.shape, vg.shape)
      -- (the state is fp32 in every run, the reference's too: no float64
      -- form, so the rule compares with the twin at the bound)
      assert.equal('float32', vr.dtype)
      twin.check(what .. ' NorMuon second moment', vg:to('cpu'), vc, nil, 'float32', n)
    end
  end)

  gpu_it('a bfloat16 parameter keeps fp32 state and master and runs the iteration in bfloat16', function()
    local W0, grads = inputs({ 40, 24 }, 3)
    -- every side from the same bfloat16 values
    W0 = W0:to('bfloat16'):to('float32')
    for s = 1, 3 do grads[s] = grads[s]:to('bfloat16'):to('float32') end
    local Wf = run(W0, grads, 'cpu')
    local Wr = run(W0, grads, 'cpu', 'float64')
    local Wc, oc = as_gpu_ns(function() return run(W0, grads, 'cpu', 'bfloat16') end)
    local Wb, ob = run(W0, grads, DEV, 'bfloat16')
    local st = ob.state[Wb]
    assert.equal('float32', st.master.dtype)
    assert.equal('float32', st.momentum_buffer.dtype)
    assert.equal('float32', st.second_momentum_buffer.dtype)
    -- the fp32 master after the steps, by the rule with the bfloat16 twin
    -- (its iteration in bfloat16 too)
    twin.check('bf16 master', st.master:to('cpu'), oc.state[Wc].master, Wr, 'bfloat16', 40)
    -- and the iteration did run in bfloat16: float32's update differs by
    -- far more than float32's own rounding
    local dc, db = Wf - W0, st.master:to('cpu') - W0
    local e = gl.global_norm({ db - dc }) / gl.global_norm({ dc })
    assert.is_true(e > 1e-3, 'the iteration did not run in bfloat16: ' .. e)
  end)

  gpu_it('a step has no host wait: it is captured in a CUDA graph, and replays equal direct steps', function()
    local W0, grads = inputs({ 24, 40 }, 5)
    local direct = W0:to(DEV)
    local od = optim.Muon({ direct }, OPTS)
    local W = W0:to(DEV)
    local o = optim.Muon({ W }, OPTS)
    local G = gl.zeros({ 24, 40 }, { device = DEV })
    W.grad = G
    -- the first step makes the state (allocations outside the graph)
    G:copy_(grads[1]); o:step()
    direct.grad = grads[1]:to(DEV); od:step()
    local g = cuda.graph(function() o:step() end)
    for s = 2, 3 do
      G:copy_(grads[s]); g:replay()
      direct.grad = grads[s]:to(DEV); od:step()
    end
    assert.equal(0, W:to('cpu'):max_abs_diff(direct:to('cpu')))
    g:free()
  end)
end)
