-- Plain SGD (no momentum, no weight decay) for the averaging specs: with it,
-- averaging the ranks' steps from one point equals one step on the averaged
-- gradient, so localsgd (sync_every 1) and diloco (H 1, outer lr 1, no
-- momentum) must match ddp.  Used as a recipe hook:
-- build_optimizer = dofile('spec/dist/avg_sgd.lua').  Has what the trainer
-- and checkpoints use: groups, set_lr_mult, step, state_dict (SGD keeps no
-- tensors), load_state_dict.
local gl = require 'gptlua'

local SGD = {}
SGD.__index = SGD

function SGD:set_lr_mult(m) for _, g in ipairs(self.groups) do g.lr = g.initial_lr * m end end

function SGD:step()
  self.t = self.t + 1
  gl.no_grad(function()
    for _, g in ipairs(self.groups) do
      for _, p in ipairs(g.params) do if p.grad then p:add_(p.grad, -g.lr) end end
    end
  end)
end

function SGD:state_dict() return { step = self.t, tensors = {} } end
function SGD:load_state_dict(sd) self.t = sd.step or 0 end

return function(cfg, model)
  local params = {}
  for _, np in ipairs(model:named_parameters()) do params[#params + 1] = np[2] end
  return setmetatable({ groups = { { params = params, lr = cfg.learning_rate, initial_lr = cfg.learning_rate } },
    state = {}, t = 0 }, SGD)
end
