-- Run on every rank by spec/dist_fsdp_fp8_spec.lua: FSDP's FP8 all-gather
-- (gptlua.dist.fsdp_fp8) on the small 3-block GPT of the FP8 specs, FP8
-- emulated on the CPU.  For each recipe and dtype:
--   codes   every FP8 weight's gathered codes and scales (both forms) equal
--           gl.fp8_quantize of the whole weight (gathered exactly), bit for bit
--   bytes   one training step's all-gather bytes of the shard group (the
--           ring rule of gptlua.dist: (N-1) x the bytes a rank sends), summed over ranks,
--           split into float8 and model-dtype sends, and the all-reduce
--           bytes, with fsdp.fp8_all_gather on and off
-- args: OUT [DEVICE [codes]]: 'codes' checks the codes only, under FSDP
-- and under HSDP with shard groups of 2 (4 ranks).  DEVICE 'cuda' (spec/dist_nccl_spec.lua's way, #cuda:
-- GL_SIM_DEVICES = N in the simulator) runs the codes and bytes on the
-- GPUs, the collectives through NCCL, the codes compared with the CPU's
-- quantization; without it, on the CPU over MPI.
-- Rank 0 writes OUT/fp8_gather.json; every rank prints "OK rank R of N".
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local train = require 'gptlua.train'
local cjson = require 'cjson'

local out, device, codes_only = arg[1], arg[2] or 'cpu', arg[3] == 'codes'
local world = dist.init { backend = device == 'cpu' and 'mpi' or 'nccl', timeout = 300 }
if device ~= 'cpu' then assert(world.nccl or world.size == 1, 'dist.init: the world does not use NCCL') end

local function recipe(over)
  local r = dofile(gl.root .. '/recipes/shakespeare.lua')
  r.n_layer, r.n_head, r.n_embd, r.block_size, r.batch_size = 3, 2, 32, 16, 4
  r.quiet, r.device, r.eval_interval, r.sample_length, r.tensorboard = true, 'cpu', 0, 0, false
  r.max_iters, r.warmup_iters, r.log_interval, r.checkpoint_interval = 1, 1, 1, 0
  r.gradient_accumulation_steps = world.size
  r.out_dir = out .. '/run'
  r.device = device
  for k, v in pairs(over or {}) do r[k] = v end
  return r
end

local function same(a, b)
  if a.shape[1] ~= b.shape[1] or #a.shape ~= #b.shape then return false end
  return a:to('cpu'):to('float32'):contiguous():max_abs_diff(b:to('cpu'):to('float32'):contiguous()) == 0
end

-- every FP8 weight's gathered forms against one process's quantization
local function check_codes(t, rc)
  local pol = t.policy
  local sd = pol:full_state_dict()
  local n, bad = 0, {}
  pol.prefetch = false
  for _, u in ipairs(pol.units) do
    if u.fp8 then
      pol.phase = 'backward'  -- the gather a backward makes: both forms
      pol:_acquire(u)
      for i, p in ipairs(u.params) do
        local g = rawget(p, 'fp8_gathered')
        if g then
          local W = sd[u.names[i]]
          local q, s = gl.fp8_quantize(W, 'float8_e4m3fn', rc)
          local qt, st = gl.fp8_quantize(W:t(), 'float8_e4m3fn', rc)
          n = n + 1
          if not (same(q, g.q) and same(s, g.s) and same(qt, g.qc:t()) and same(st, g.sc)) then
            bad[#bad + 1] = u.names[i]
          end
        end
      end
      pol:_release(u)
      pol.phase = 'idle'
    end
  end
  pol.prefetch = true
  return n, bad
end

-- one step's collective bytes this rank sends, by kind
local function count_step(over)
  local t = train.new(recipe(over), {})
  local c = { f8 = 0, hp = 0, amax = 0, gathers8 = 0 }
  local shard = t.policy.shard
  local gather, reduce = shard.all_gather_async, shard.all_reduce_async
  function shard.all_gather_async(comm, o, input, opts)
    local b = input:numel() * gl.lib.gl_dtype_size(input.c.dtype) * (comm.size - 1)
    if input.dtype == 'float8_e4m3fn' then c.f8 = c.f8 + b; c.gathers8 = c.gathers8 + 1 else c.hp = c.hp + b end
    return gather(comm, o, input, opts)
  end
  function shard.all_reduce_async(comm, x, op, opts)
    if op == 'max' then c.amax = c.amax + 2 * (comm.size - 1) / comm.size * x:numel() * 4 end
    return reduce(comm, x, op, opts)
  end
  t:run()
  for _, k in ipairs({ 'f8', 'hp', 'amax', 'gathers8' }) do c[k] = world:all_reduce_number(c[k], 'sum') end
  return c, t
end

local res = {}
if codes_only then
  for _, rc in ipairs({ 'tensorwise', 'rowwise' }) do
    for _, d in ipairs({ 'fsdp', 'hsdp' }) do
      local t = train.new(recipe({ fp8 = rc, fp8_emulate = true, dist = d, shard_size = d == 'hsdp' and 2 or nil }), {})
      local n, bad = check_codes(t, rc)
      res[rc .. '_' .. d] = { weights = n, bad = bad, shard = t.policy.S }
    end
  end
end
for _, rc in ipairs(codes_only and {} or { 'tensorwise', 'rowwise' }) do
  for _, dt in ipairs({ 'float32', 'bfloat16' }) do
    local over = { fp8 = rc, fp8_emulate = true, dtype = dt, dist = 'fsdp' }
    local t = train.new(recipe(over), {})
    local n, bad = check_codes(t, rc)
    local on = count_step(over)
    local off_over = {}
    for k, v in pairs(over) do off_over[k] = v end
    off_over.fsdp = { fp8_all_gather = false }
    local off = count_step(off_over)
    local f8_elems = 0
    for _, l in ipairs(require('gptlua.fp8').choose(t.model)) do f8_elems = f8_elems + l.weight:numel() end
    res[rc .. '_' .. dt] = { weights = n, bad = bad, on = on, off = off, fp8_elements = f8_elems,
      dtype_bytes = dt == 'float32' and 4 or 2 }
  end
end
if world.rank == 0 then
  local f = assert(io.open(out .. '/fp8_gather.json', 'wb'))
  f:write(cjson.encode(res))
  f:close()
end
print(('OK rank %d of %d'):format(world.rank, world.size))
