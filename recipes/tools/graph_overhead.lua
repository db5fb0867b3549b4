-- Host time of a training step's forward and backward with and without a
-- CUDA graph (issue 13): the default recipe's model (bf16 on the GPU) on one
-- fixed batch, run op by op (Lua dispatch, the engine, the runtime's API)
-- against one cuda.graph capture of the same work replayed.  Under the CUDA
-- simulator (build/sim/gptlua) the host time is the wall time outside the
-- simulated device's work (gl_sim_work_seconds); on a GPU it is the time
-- until the host is free again (the launch calls return before the GPU is
-- done), with the device time from events beside it.
--   build/sim/gptlua recipes/tools/graph_overhead.lua [--steps=10] [--model=nanochat|gpt2]
--     [--optimizer=adamw|nanochat]  (default adamw; nanochat: Muon + AdamW, the default recipe's)
-- First the micro-step in the trainer's cuda_graph mode
-- (gptlua.train_graph): the model's loss and the backward into the
-- parameters' gradients, op by op against one graph launch.  Then the whole
-- step, the trainer's own train_step (forward, backward, gradient norm and
-- clipping, optimizer) with cuda_graph = 'off', 'auto' as it was before the
-- optimizer joined the graph (the micro-step replayed, the norm, clip and
-- AdamW op by op: the trainer's path for an optimizer without the step
-- block) and 'auto' (the whole step replayed, gptlua.step_block), on the
-- same fixed batch: host time per step and, under the simulator, the host
-- syncs of one step by API (its trace, recipes/tools/sim_trace.lua).
local gl = require 'gptlua'
local cuda = require 'gptlua.cuda'
local ffi = require 'ffi'
local now = require('gptlua.cli').now

local opts = { steps = 10, model = 'nanochat', optimizer = 'adamw' }
for _, a in ipairs(arg) do
  local k, v = a:match('^%-%-([%w_]+)=(.*)$')
  if not k or opts[k] == nil then error('graph_overhead: unknown argument ' .. a .. ' (--steps, --model, --optimizer)', 0) end
  if k == 'optimizer' and v ~= 'adamw' and v ~= 'nanochat' then
    error("graph_overhead: --optimizer expects 'adamw' or 'nanochat', got " .. v, 0)
  end
  opts[k] = type(opts[k]) == 'string' and v or (tonumber(v) or error('graph_overhead: --' .. k .. ' expects a number', 0))
end
if not cuda.is_available() then error('graph_overhead: needs a CUDA device (or build/sim/gptlua)', 0) end

local sim = pcall(function() ffi.cdef 'double gl_sim_work_seconds(void);' end) and
  pcall(function() return gl.lib.gl_sim_work_seconds end)
local function device_seconds() return sim and gl.lib.gl_sim_work_seconds() or 0 end

local r = dofile(gl.root .. '/recipes/shakespeare.lua')
r.model = opts.model
r.optimizer, r.nanochat = opts.optimizer, { version = 'v1' }  -- AdamW with the v1 block: the configuration its figures were measured with
local train = require 'gptlua.train'
r.quiet, r.device, r.eval_interval, r.sample_length, r.out_dir = true, 'cuda:0', 0, 0, os.tmpname()
os.remove(r.out_dir)
local xy = gl.uniform({ r.batch_size, r.block_size + 1 }, 0, 65, { seed = 5, dtype = 'float64' }):clamp_(0, 64)
  :to('int64'):to('cuda:0')
local x = xy:narrow(2, 1, r.block_size):contiguous():keep()
local y = xy:narrow(2, 2, r.block_size):contiguous():keep()
r.build_data = function()  -- one fixed batch
  local L = { next_batch = function() return x, y end, state = function() return {} end, set_state = function() end }
  return { train = L, val = L, vocab_size = 65 }
end
r.cuda_graph = 'off'
local t = train.new(r, {})
local model = t.model

-- forward and backward into the parameters' (kept) gradients
local function step()
  gl.scope(function()
    local _, loss = model:forward(x, y)
    loss:backward(nil, { free_activations = true })
  end)
end

for _ = 1, 2 do step() end  -- warm-up: gradients exist, the caching allocator has the step's blocks
cuda.synchronize()

-- host and device seconds per call of fn, n calls, then a synchronize
local function measure(fn, n)
  cuda.synchronize()
  local d0, t0 = device_seconds(), now()
  local e0, e1 = cuda.Event(), cuda.Event()
  e0:record()
  local host = 0
  for _ = 1, n do
    local h0, hd = now(), device_seconds()
    fn()
    host = host + (now() - h0) - (device_seconds() - hd)
  end
  e1:record()
  cuda.synchronize()
  local wall = now() - t0
  return host / n, (device_seconds() - d0) / n, wall / n, e0:elapsed_time(e1) / n
end

local g = cuda.graph(step)
local eager_host, eager_dev, eager_wall, eager_ev = measure(step, opts.steps)
local graph_host, graph_dev, graph_wall, graph_ev = measure(function() g:replay() end, opts.steps)
print(('graph_overhead: %s model of the default recipe (%d layers, width %d, B=%d T=%d, %s), %d steps each, %s')
  :format(opts.model, r.n_layer, r.n_embd, r.batch_size, r.block_size, tostring(t.cfg.dtype), opts.steps,
    sim and 'CUDA simulator (host time = wall time outside simulated device work)' or 'GPU'))
print(('graph: %d nodes, pool %.1f MB'):format(g.nodes, g.pool_bytes / 1e6))
local function row(name, h, d, w, ev)
  print(('%-28s host %8.2f ms/step   device %8.2f ms/step   wall %8.2f ms/step   events %8.2f ms/step')
    :format(name, h * 1e3, d * 1e3, w * 1e3, ev))
end
row('op by op (Lua dispatch)', eager_host, eager_dev, eager_wall, eager_ev)
row('one graph launch', graph_host, graph_dev, graph_wall, graph_ev)
print(('host time per step: %.2f ms op by op, %.3f ms with the graph (%.0fx less)')
  :format(eager_host * 1e3, graph_host * 1e3, eager_host / math.max(graph_host, 1e-9)))
g:free()

-- the whole step: train_step of a trainer with cuda_graph 'off' and one with
-- 'auto' (its warm-up step and the capture run before the measurement)
local trace = dofile(gl.root .. '/recipes/tools/sim_trace.lua')
local syncs_of = trace.syncs_of  -- host syncs of one call of fn by API, or nil on a GPU
local whole = {}
for _, mode in ipairs({ 'off', 'micro', 'auto' }) do
  r.cuda_graph = mode == 'micro' and 'auto' or mode
  local tr = train.new(r, {})
  if mode == 'micro' then tr.graph.whole = false end  -- the micro-step graph, the optimizer op by op
  for _ = 1, 2 do tr:train_step() end
  if mode ~= 'off' then assert(tr.graph and tr.graph.g, 'graph_overhead: the trainer did not capture') end
  local n, kinds = syncs_of(function() tr:train_step() end)
  local h, d, w, ev = measure(function() tr:train_step() end, opts.steps)
  whole[mode] = { h = h, d = d, w = w, ev = ev, syncs = n, kinds = kinds }
  if tr.graph then tr.graph:free() end
end
print(('whole step (train_step: forward, backward, norm, clip, optimizer %s), accum %d:'):format(
  opts.optimizer, t.cfg.gradient_accumulation_steps))
row("cuda_graph 'off'", whole.off.h, whole.off.d, whole.off.w, whole.off.ev)
row("'auto', micro-step graph", whole.micro.h, whole.micro.d, whole.micro.w, whole.micro.ev)
row("'auto', whole-step graph", whole.auto.h, whole.auto.d, whole.auto.w, whole.auto.ev)
if whole.off.syncs then
  print(("host syncs per whole step: 'off' %d (%s), micro-step graph %d (%s), whole-step graph %d (%s)"):format(
    whole.off.syncs, whole.off.kinds, whole.micro.syncs, whole.micro.kinds, whole.auto.syncs, whole.auto.kinds))
end
print(('host time per whole step: %.2f ms op by op, %.2f ms with the micro-step graph, %.2f ms with the whole '
  .. 'step in the graph (%.1fx less than op by op)'):format(whole.off.h * 1e3, whole.micro.h * 1e3,
  whole.auto.h * 1e3, whole.off.h / math.max(whole.auto.h, 1e-9)))
