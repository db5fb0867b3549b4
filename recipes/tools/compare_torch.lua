-- Step-by-step comparison with PyTorch (needs python3-torch): the default
-- recipe's configuration with nanoGPT's GPT-2 block (--model=gpt2) and its
-- optimizer from identical initial weights on identical batches, N steps in
-- both, printing the largest relative loss difference.
--   gptlua recipes/tools/compare_torch.lua [--steps=50]
local gl = require 'gptlua'
local train = require 'gptlua.train'
local cjson = require 'cjson'
local ffi = gl.ffi

local steps = 50
for _, a in ipairs(arg) do
  local v = a:match('^%-%-steps=(%d+)$')
  if not v then error('compare_torch: unknown argument ' .. a .. ' (--steps=N)', 0) end
  steps = tonumber(v)
end
local dir = os.tmpname(); os.remove(dir); os.execute('mkdir -p ' .. dir)
local r = dofile(gl.root .. '/recipes/shakespeare.lua')
r.quiet, r.device, r.model = true, 'cpu', 'gpt2'
r.optimizer = 'adamw'  -- PyTorch's side runs AdamW
local t = train.new(r, {})
local function write(path, tensor, ctype)
  local c = tensor:contiguous()
  local f = assert(io.open(path, 'wb'))
  f:write(ffi.string(c:data_ptr(), c:numel() * ffi.sizeof(ctype)))
  f:close()
end
for _, np in ipairs(t.model:named_parameters()) do write(dir .. '/' .. np[1] .. '.f32', np[2], 'float') end
-- record the batches the loader gives, then replay them in both
local rows = {}
local B, T = r.batch_size, r.block_size
for _ = 1, steps do
  local x, y = t.data.train:next_batch()
  rows[#rows + 1] = gl.cat({ x, y:narrow(2, T, 1) }, 2)
end
write(dir .. '/batches.i64', gl.cat(rows, 1), 'int64_t')
local k = 0
t.data.train = { next_batch = function() k = k + 1; local b = rows[k]; return b:narrow(2, 1, T):contiguous(), b:narrow(2, 2, T):contiguous() end }
local ours = {}
for s = 1, steps do ours[s] = t:train_step(); t.step = t.step + 1 end
local p = io.popen(('/usr/bin/python3 %s/recipes/tools/bench_torch_gpt.py %d 1 --replay %s'):format(gl.root, steps, dir))
local out = p:read('*a'); p:close()
os.execute('rm -rf ' .. dir)
local ok, res = pcall(cjson.decode, out)
if not ok then error('compare_torch: PyTorch run failed: ' .. out, 0) end
local worst = 0
for s = 1, steps do
  local d = math.abs(ours[s] - res.losses[s]) / math.abs(res.losses[s])
  worst = math.max(worst, d)
  if s <= 3 or s % 10 == 0 then print(('step %3d: gptlua %.6f  torch %.6f'):format(s, ours[s], res.losses[s])) end
end
print(('largest relative loss difference over %d steps: %.2e'):format(steps, worst))
