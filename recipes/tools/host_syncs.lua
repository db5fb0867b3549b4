-- recipes/tools/host_syncs.lua — host synchronisations and communication
-- overlap of a data-parallel training step on the simulated GPU (issue 13,
-- "Communication"), read from the simulator's stream trace
-- (spec/cudasim/trace.cpp) on every rank:
--
--   GL_SIM_DEVICES=2 mpirun -np 2 build/sim/gptlua recipes/tools/host_syncs.lua \
--     [--policies=ddp,fsdp] [--steps=2] [--waits=host,device] [--out=DIR] [--skip_waits=N]
--     [--bucket_mb=0.02] [--dump=1]
--
-- Policies: those of gptlua.dist, 'tp' (tensor parallelism over every
-- rank, DDP under it: its forward and backward collectives), and 'ep' and
-- 'ep_counts' (DDP with a mixture-of-experts layer in every block, its 4
-- experts split over every rank: the fixed exchange, and the counts
-- exchange, whose counts are read on the host; gptlua.dist.expert_parallel).
-- For each policy and each way collectives are waited for ('host': the
-- host blocks until the NCCL event passed, as Work:wait did before; 'device':
-- the compute stream waits for it, gptlua.dist's Work:wait now), it trains a
-- tiny GPT-2 (spec/dist/policy_recipe.lua, float32; DDP buckets of
-- --bucket_mb, default 0.02: several) for --steps steps and
-- prints per step, counted between the step's first forward and the end of
-- the optimizer step:
--   host syncs      the simulator's blocking host waits (stream, event and
--                   device synchronisation, copies to pageable memory,
--                   cudaFree) plus host waits for NCCL works (gl_work_wait);
--                   the gradient norm's read, which the clipping decision
--                   needs on the host, is counted apart ("norm read")
--   collectives     NCCL calls queued, and on which stream: all of them on
--                   the communicator's stream, none on the compute stream
--   overlapped      collectives some later compute item is not ordered
--                   after (on a GPU they run beside that compute)
--   waited on device  cudaStreamWaitEvent of the compute stream on the
--                   communicator's stream
-- The step's loss is read after the step (a host wait where the host needs
-- the number).  A world of one rank has no NCCL: it only writes its losses
-- and parameters for the spec's comparison.  --dump=1 prints every trace
-- record (where a host sync comes from).
--
-- --out=DIR: rank 0 writes DIR/<policy>-<waits>.json (losses, per-step
-- counts) and DIR/<policy>-<waits>.safetensors (final parameters), which
-- spec/dist_overlap_spec.lua compares with a one-rank run.  --skip_waits=N
-- leaves out the first N device waits of the first step (gptlua.dist's test
-- hook): where no later wait orders the collective before its consumer
-- (DDP with one bucket: --bucket_mb=25), the simulator's stream check must
-- then report a missing stream wait.
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local train = require 'gptlua.train'
local ckpt = require 'gptlua.checkpoint'
local cjson = require 'cjson'

local opts = { policies = 'ddp,fsdp', waits = 'host,device', steps = '2', skip_waits = '0', bucket_mb = '0.02',
  dump = '0' }
for _, a in ipairs(arg) do
  local k, v = a:match('^%-%-([%w_]+)=(.*)$')
  if not k or (opts[k] == nil and k ~= 'out') then
    error('host_syncs: unknown argument ' .. a .. ' (--policies, --waits, --steps, --out, --skip_waits, --bucket_mb, --dump)', 0)
  end
  opts[k] = v
end
local POLICIES = {}
for p in tostring(opts.policies or 'ddp,fsdp'):gmatch('[^,]+') do POLICIES[#POLICIES + 1] = p end
local WAITS = {}
for w in tostring(opts.waits or 'host,device'):gmatch('[^,]+') do
  if w ~= 'host' and w ~= 'device' then error(("host_syncs: --waits expected 'host' and/or 'device', got '%s'"):format(w), 0) end
  WAITS[#WAITS + 1] = w
end
local STEPS = tonumber(opts.steps or 2)
if not STEPS or STEPS < 1 or STEPS % 1 ~= 0 then error('host_syncs: --steps expected an integer >= 1', 0) end
local OUT = opts.out
local SKIP = tonumber(opts.skip_waits)
local BUCKET_MB = tonumber(opts.bucket_mb)
local DUMP = opts.dump == '1'
if not SKIP or not BUCKET_MB then error('host_syncs: --skip_waits and --bucket_mb expect numbers', 0) end

local world = dist.init { backend = 'auto', timeout = 300 }
local multi = world.size > 1
if multi and not world.nccl then
  error('host_syncs: the ranks have no NCCL (run the simulator build with GL_SIM_DEVICES=<ranks>)', 0)
end
local recipe = dofile(gl.root .. '/spec/dist/policy_recipe.lua')
local trace = dofile(gl.root .. '/recipes/tools/sim_trace.lua')
local lib = trace.library()
if not lib then error('host_syncs: this engine is not the CUDA simulator (build/sim/gptlua)', 0) end
local device_host_waits = dist.device_host_waits

-- One step as gptlua.train's Trainer:train_step, with marks, the batches
-- fetched first and the loss read at the end.
local function step(t, accum)
  local policy = t.policy
  t.optimizer:set_lr_mult(t.schedule(t.step))
  local batches = {}
  for m = 1, accum do batches[m] = { t.data.train:next_batch() } end
  local losses = {}
  local hw0 = device_host_waits()
  dist._skip_device_waits = t.step == 0 and SKIP or 0  -- the test hook: the first step's first waits
  trace.mark('step')
  policy:zero_grad()
  for m = 1, accum do
    gl.scope(function()
      policy:before_micro_step(m, accum)
      local _, loss = t.model:forward(batches[m][1], batches[m][2])
      losses[m] = loss:detach():keep()
      local scaled = loss * (1 / accum)
      scaled:backward(nil, { free_activations = true })
    end)
  end
  policy:after_backward()
  local hw1 = device_host_waits()
  trace.mark('norm')
  local norm = policy:grad_norm()
  trace.mark('norm read')
  local hw2 = device_host_waits()
  if t.cfg.grad_clip > 0 and norm > t.cfg.grad_clip then policy:scale_grads(t.cfg.grad_clip / (norm + 1e-6)) end
  gl.scope(function() policy:step() end)
  local hw3 = device_host_waits()
  trace.mark('end')
  local sum = 0
  for m = 1, accum do sum = sum + losses[m]:item() end
  t.step = t.step + 1
  return policy:average_number(sum / accum), (hw1 - hw0) + (hw3 - hw2), hw2 - hw1
end

local function run(policy, waits)
  dist.device_waits = waits == 'device'
  -- 'tp': tensor parallelism over every rank (dp 1: the ranks read the same
  -- batch), DDP under it; one rank is the whole model
  local tp = policy == 'tp'
  local ep = policy == 'ep' or policy == 'ep_counts'
  local accum = (multi or tp) and 1 or 2  -- one rank runs both ranks' batches
  local tmp = os.tmpname()  -- the trainer's run directory, removed at the end
  os.remove(tmp)
  local t = train.new(recipe({ optimizer = 'adamw', dist = (tp or ep) and 'ddp' or policy, device = 'cuda',
    gradient_accumulation_steps = accum, max_iters = STEPS, out_dir = tmp, quiet = true, bucket_mb = BUCKET_MB,
    tp = tp and world.size or nil, vocab_size = tp and 66 or nil,  -- (65 characters, padded for tp 2)
    ep = ep and world.size or nil,
    moe = ep and { experts = 4, top_k = 2, hidden = 32, ep_exchange = policy == 'ep' and 'fixed' or 'counts' } or nil }),
    {})
  -- The set-up's garbage (FSDP's set-up drops pinned host buffers to the
  -- GC) and the previous run's are collected here, not by a collection
  -- that the measured step's allocations happen to trigger: its finalizers'
  -- cudaFreeHost calls would count as the step's host syncs, at a step that
  -- depends on how much a busy machine's wait loops allocated.
  collectgarbage('collect'); collectgarbage('collect')
  local dev = tonumber(dist.device():match('^cuda:(%d+)$'))
  local compute = lib.gl_sim_trace_stream_id(gl.lib.gl_cuda_stream(dev, 0))
  local rows, losses = {}, {}
  for s = 1, STEPS do
    trace.start()
    local loss, waits_in, waits_norm = step(t, accum)
    trace.stop()
    local recs = trace.records()
    if DUMP then  -- every record, to see where a host sync comes from
      for _, r in ipairs(recs) do
        print(('  %s rank %d: %-5s dev %d stream %d (other %d) seq %d %s'):format(policy, world.rank, r.kind,
          r.device, r.stream, r.other, r.seq, r.what))
      end
    end
    local c = trace.summary(recs, compute)
    c.host_syncs = c.window['step'].syncs + c.window['norm read'].syncs + waits_in
    c.norm_syncs = c.window['norm'].syncs + waits_norm
    rows[s], losses[s] = c, loss
  end
  local sd = t.policy.full_state_dict and t.policy:full_state_dict() or t.model:state_dict()
  if t.tp_layout then sd = require('gptlua.dist.tensor_parallel').full_state(t.tp_layout, sd) end  -- collective
  t.policy:detach()
  os.execute("rm -rf '" .. tmp .. "'")
  return rows, losses, sd
end

dist.print0(('host syncs per step on the simulated GPU, %d rank(s), tiny GPT-2 (float32), %d steps'):format(world.size,
  STEPS))
dist.print0(('%-6s %-7s %5s %10s %10s %12s %11s %11s %10s'):format('policy', 'waits', 'step', 'host syncs', 'norm read',
  'collectives', 'on compute', 'overlapped', 'dev waits'))
for _, p in ipairs(POLICIES) do
  for _, w in ipairs(WAITS) do
    local rows, losses, sd = run(p, w)
    for s, c in ipairs(rows) do
      dist.print0(('%-6s %-7s %5d %10d %10d %12d %11d %11d %10d'):format(p, w, s, c.host_syncs, c.norm_syncs,
        c.collectives, c.collectives_on_compute, c.overlapped, c.device_waits))
      for _, wname in ipairs({ 'step', 'norm', 'norm read' }) do
        for what, n in pairs(c.window[wname].sync_kinds) do
          dist.print0(('         %s: %s x%d'):format(wname == 'norm read' and 'optimizer' or wname, what, n))
        end
      end
    end
    if OUT and world.rank == 0 then
      local label = ('%s/%s-%s'):format(OUT, p, w)
      ckpt.save_safetensors(label .. '.safetensors', sd)
      local f = assert(io.open(label .. '.json', 'wb'))
      f:write(cjson.encode({ losses = losses, world = world.size, steps = rows }))
      f:close()
    end
  end
end
if multi then world:barrier() end
print(('OK rank %d of %d'):format(world.rank, world.size))
