-- What recipes/embed/host.c runs in its Lua state: a linear regression
-- trained with gptlua's autograd and AdamW, one step per call of step(),
-- and the trained weight for the host to read through the engine's C API.
local gl = require 'gptlua'
local nn = require 'gptlua.nn'
local optim = require 'gptlua.optim'
local ffi = require 'ffi'

gl.manual_seed(1)
local model = nn.Linear(4, 1)
local x = gl.randn({ 32, 4 }, { seed = 2 }):keep()
local y = x:matmul(gl.tensor({ { 1 }, { -2 }, { 0.5 }, { 3 } })):keep()   -- the weights to find
local opt = optim.AdamW(model:parameters(), { lr = 0.1, weight_decay = 0 })

local M = {}

-- one optimizer step; returns the loss before it
function M.step()
  return gl.scope(function()
    for _, p in ipairs(model:parameters()) do if p.grad then p.grad:zero_() end end
    local loss = gl.mean(gl.square(model(x) - y))
    loss:backward()
    opt:step()
    return loss:item()
  end)
end

-- the weight tensor's engine handle (a gl_tensor *) as an integer, for C;
-- the tensor stays alive as long as the model does
function M.weight_handle() return tonumber(ffi.cast('uintptr_t', model.weight.c)) end

-- the same values as Lua reads them
function M.weight_values() return table.concat(model.weight:view({ 4 }):tolist(), ' ') end

return M
