-- What a pipeline rank holds (issue 17): parameter, gradient and optimizer
-- bytes and the allocator's peak per rank of the default recipe (nanochat,
-- 4 layers, width 128, float32, AdamW) at pp = the number of ranks, from
-- the tensors themselves and the allocator's statistics (gl.memory_stats).
-- Random tokens (vocabulary 65), so the dataset does not hide the model;
-- 4 microbatches a step.
--   gptlua -n N recipes/tools/pp_memory.lua [--steps=2] [--key=value ...]
-- (N = 1 is the one-rank baseline.)  Rank 0 prints one line per rank:
-- bytes of the parameters it holds, of their gradients and of the
-- optimizer's state after the steps; the allocator's allocated bytes after
-- set-up, its peak during set-up (the model's two-pass build included) and
-- its peak over the steps.
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local train = require 'gptlua.train'

local steps, over = 2, {}
for _, a in ipairs(arg) do
  local k, v = a:match('^%-%-([%w_]+)=(.*)$')
  if not k then error('pp_memory: expected --key=value arguments, got ' .. a, 0) end
  if k == 'steps' then steps = tonumber(v) or error('pp_memory: --steps expected a number, got ' .. v, 0)
  else over[#over + 1] = a end
end
local world = dist.init { timeout = 120 }
local out = os.tmpname()
os.remove(out)
local args = { '--dist=ddp', '--pp=' .. world.size, '--data=random', '--vocab_size=65', '--max_iters=' .. steps,
  '--eval_interval=0', '--sample_length=0', '--checkpoint_interval=0', '--out_dir=' .. out, '--quiet=true',
  '--log_interval=0', '--always_save_checkpoint=false', '--gradient_accumulation_steps=4', unpack(over) }
local recipe = dofile(gl.root .. '/recipes/shakespeare.lua')
local t = train.new(recipe, args)
local set_up = gl.memory_stats()
gl.reset_peak_memory()
local function bytes(list)
  local n = 0
  for _, x in pairs(list) do  -- (elements: a gradient may be a view into a bucket)
    if not x:is_freed() then n = n + x:numel() * gl.lib.gl_dtype_size(x.c.dtype) end
  end
  return n
end
for _ = 1, steps do t:train_step() end
local params, grads = {}, {}
for _, p in ipairs(t.params) do params[#params + 1] = p; grads[#grads + 1] = p.grad end
local line = { bytes(params), bytes(grads), bytes(t.optimizer:state_dict().tensors), set_up.allocated, set_up.peak,
  gl.memory_stats().peak }
local all = {}
for r = 0, world.size - 1 do
  local buf = gl.tensor(line, { dtype = 'float64' })
  world:broadcast(buf, r)
  all[r + 1] = buf:tolist()
end
if world.rank == 0 then
  local mib = function(b) return ('%8.3f'):format(b / 2 ^ 20) end
  print(('pp %d, MiB per rank: params  grads  optimizer | allocated after set-up, set-up peak, step peak'):format(world.size))
  for r, l in ipairs(all) do
    print(('rank %d: %s %s %s | %s %s %s'):format(r - 1, mib(l[1]), mib(l[2]), mib(l[3]), mib(l[4]), mib(l[5]), mib(l[6])))
  end
end
os.execute("rm -rf '" .. out .. "'")
