-- Run on every rank by spec/dist_pp_spec.lua: the small gpt2 of tp_recipe
-- at pp 2.  First what a rank holds: exactly its stages' parameters
-- (float64 elements: rank 0 wte 68x32 + wpe 16x32 + block 0, rank 1 block 1
-- + ln_f + its copy of the tied wte; a block is 12 C^2 + 13 C), the others
-- without storage, as the allocator counts them too; then an evaluation
-- (forward through the stages) and a sample (the other stage's parameters
-- lent for it, released after), written to OUT/eval.json for the spec to
-- compare with one process.  Then 3 trainer steps; at the second the last
-- stage's copy of the tied embedding gets a NaN gradient after the copies
-- were summed (the first stage's gradients are finite).  Every rank must
-- skip that step (the norm is the whole model's, reduced over the world)
-- and take the other two, and the third step's loss must be finite.
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local train = require 'gptlua.train'
local cjson = require 'cjson'

local out = arg[1]
local world = dist.init { backend = 'mpi', timeout = 120 }
local recipe = dofile(gl.root .. '/spec/dist/tp_recipe.lua')
local t = train.new(recipe('gpt2', { max_iters = 3, out_dir = out, checkpoint_interval = 0, eval_iters = 2 }),
  { '--pp=2', '--dist=ddp' })
local me = t.mesh.coord.pp
-- the parameters this rank holds: its stages' share, exactly
local C, block = 32, 12 * 32 * 32 + 13 * 32
local want = (me == 0 and 68 * C + 16 * C + block or block + 2 * C + 68 * C) * 8
local function held_bytes()
  local n, storages = 0, 0
  for _, np in ipairs(t.model:named_parameters()) do
    local p = np[2]
    if p:is_freed() then assert(rawget(p, 'held_by') == 1 - me, np[1] .. ' is freed but not held by the other stage')
    else n = n + p:numel() * 8; storages = storages + tonumber(p.c.storage.nbytes) end
  end
  return n, storages
end
local n, storages = held_bytes()
assert(n == want, ('rank %d holds %d parameter bytes, expected its stages\' %d'):format(me, n, want))
assert(storages == want, ('rank %d: the parameters\' storages hold %d bytes, expected %d'):format(me, storages, want))
-- evaluation through the stages, and a sample, equal one process's (the spec compares)
local ev = t:evaluate()
local tok = t.data.tokenizer  -- (ids, not text: the padded vocabulary's last ids decode to nothing)
t.data.tokenizer = setmetatable({ decode = function(_, ids) return table.concat(ids, ' ') end }, { __index = tok })
local text = t:sample(12)
t.data.tokenizer = tok
assert(held_bytes() == want, 'the sample kept the lent parameters')
if world.rank == 0 then
  require('gptlua.checkpoint').mkdir_p(out)
  local f = assert(io.open(out .. '/eval.json', 'wb'))
  f:write(cjson.encode({ train = ev.train, val = ev.val, sample = text }))
  f:close()
end
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
