-- Run on every rank by spec/dist_pp_spec.lua: 3 trainer steps of the small
-- gpt2 of tp_recipe at pp 2; at the second step the last stage's copy of
-- the tied embedding gets a NaN gradient after the copies were summed (the
-- first stage's gradients are finite).  Every rank must skip that step
-- (the norm is the whole model's, reduced over the world) and take the
-- other two, and the third step's loss must be finite.
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local train = require 'gptlua.train'

local out = arg[1]
local world = dist.init { backend = 'mpi', timeout = 120 }
local recipe = dofile(gl.root .. '/spec/dist/tp_recipe.lua')
local t = train.new(recipe('gpt2', { max_iters = 3, out_dir = out, checkpoint_interval = 0 }),
  { '--pp=2', '--dist=ddp' })
local policy, calls = t.policy, 0
local after = policy.after_backward
policy.after_backward = function(self)
  after(self)
  calls = calls + 1
  if calls == 2 and t.mesh.coord.pp == 1 then
    assert(t.pipeline.params[1] == t.pipeline.tied_param)
    gl.no_grad(function() t.pipeline.params[1].grad:fill_(0 / 0) end)
  end
end
t:run()
local h = t.history
assert(h[3] == h[3], 'the step after the skipped one has a NaN loss: the NaN was applied')
print(('OK rank %d of %d: %d steps taken'):format(world.rank, world.size, t.optimizer.t))
