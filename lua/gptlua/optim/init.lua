-- gptlua.optim — the optimizers, one file per concern: parameter groups and
-- state (optim/groups.lua), AdamW (adamw.lua), Muon and its variants
-- (muon.lua), the combined optimizer and nanochat's groups (combined.lua),
-- schedules (schedules.lua); gradient clipping and the argument checks here.  The per-element update
-- math is in C kernels that take a slice (start, len) of a flat tensor, so
-- the sharded optimizers of gptlua.dist run the same code on their shard.
local gl = require 'gptlua'
local G = require 'gptlua.ffi'
local check = require 'gptlua.check'
local ffi, lib, Tensor = gl.ffi, gl.lib, gl.Tensor

local optim = {}
for _, part in ipairs { 'groups', 'adamw', 'muon', 'combined' } do
  for k, v in pairs(require('gptlua.optim.' .. part).optim) do optim[k] = v end
end
local AdamW = require('gptlua.optim.adamw').AdamW
local Muon = require('gptlua.optim.muon').Muon
local Combined = require('gptlua.optim.combined').Combined
optim.AdamW, optim.Muon, optim.Combined = AdamW, Muon, Combined
optim.schedules = require 'gptlua.optim.schedules'

-- --------------------------------------------------------- gradient clipping
-- scales all gradients so their global L2 norm is at most max_norm;
-- returns the norm before clipping
optim.clip_grad_norm = check.wrap('clip_grad_norm', 'params:tensors, max_norm:number?', function(params, max_norm)
  local grads = {}
  for _, p in ipairs(params) do if p.grad then grads[#grads + 1] = p.grad end end
  local norm = gl.global_norm(grads)
  if max_norm and max_norm > 0 and norm > max_norm then
    local s = max_norm / (norm + 1e-6)
    for _, g in ipairs(grads) do g:mul_(s) end
  end
  return norm
end)

-- ------------------------------------------------------- argument checks
-- constructors and entry points check their arguments (gptlua.check.wrap)
local function checked(cls, name, sig)
  local mt = getmetatable(cls)
  mt.__call = check.wrap(name, 'class:any, ' .. sig, mt.__call)
end
checked(AdamW, 'AdamW', 'params:opts, opts:opts?')
checked(Muon, 'Muon', 'params:opts, opts:opts?')
checked(Combined, 'Combined', 'optimizers:opts')
for _, cls in ipairs({ AdamW, Muon, Combined }) do
  cls.load_state_dict = check.wrap('load_state_dict', 'self:opts, state_dict:opts', cls.load_state_dict)
  cls.step = check.wrap('step', 'self:opts', cls.step)
  cls.set_lr_mult = check.wrap('set_lr_mult', 'self:opts, mult:number', cls.set_lr_mult)
end
Combined.set_momentum = check.wrap('set_momentum', 'self:opts, momentum:number', Combined.set_momentum)
Combined.set_muon_weight_decay_mult = check.wrap('set_muon_weight_decay_mult', 'self:opts, mult:number',
  Combined.set_muon_weight_decay_mult)
optim.newton_schulz = check.wrap('newton_schulz', 'G:tensor, steps:integer?, dtype:string?, ortho:string?',
  optim.newton_schulz)
optim.nanochat = check.wrap('nanochat', 'model:opts, opts:opts?', optim.nanochat)  -- (a module, or a pipeline's stand-in)

return optim
