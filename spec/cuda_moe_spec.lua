-- The mixture-of-experts ops on a GPU tensor (kernels/moe.cu): they have no
-- CUDA kernels yet, so each refuses in one line naming the op and the way
-- out, and nothing runs on the device.  (The trainer refuses a MoE model off
-- the CPU before it builds one: spec/moe_spec.lua covers the keys.)
local gl = require 'gptlua'
local twin = require 'support.cuda_twin'
local gpu_it = twin.gpu_it(it, pending)

describe('CUDA mixture-of-experts ops #cuda', function()
  gpu_it('refuse a device tensor in one line naming the op', function()
    local dev = twin.DEV
    local function refused(op, f)
      local ok, err = pcall(f)
      assert.is_false(ok, op)
      assert.matches('gl_' .. op .. ': the mixture%-of%-experts ops have no CUDA kernels yet; train this model with '
        .. '%-%-device=cpu', tostring(err))
    end
    local slots = gl.moe_route(gl.tensor({ { 0, 1 }, { 1, 0 } }, { dtype = 'int64' }), 2, 0):to(dev)
    local x, w = gl.randn({ 2, 3 }, { seed = 1 }):to(dev), gl.rand({ 2, 2 }, { seed = 2 }):to(dev)
    local counts = gl.tensor({ 2, 2 }, { dtype = 'int64' }):to(dev)
    refused('moe_route', function() gl.moe_route(gl.zeros({ 2, 2 }, { dtype = 'int64' }):to(dev), 2, 0) end)
    refused('moe_permute', function() gl.moe_permute(x, slots, 4) end)
    refused('moe_combine', function() gl.moe_combine(gl.randn({ 4, 3 }, { seed = 3 }):to(dev), slots, w) end)
    refused('grouped_matmul', function()
      gl.grouped_linear(gl.randn({ 4, 3 }, { seed = 4 }):to(dev), { x, x }, counts)
    end)
  end)
end)
