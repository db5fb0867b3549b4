-- recipes/tools/bench_collectives.lua — collective bandwidth in the style of nccl-tests.
--
--   gptlua -n 2 recipes/tools/bench_collectives.lua [--ops=all_reduce,all_gather,reduce_scatter,broadcast,all_to_all]
--          [--min=1K] [--max=256M] [--factor=2] [--dtype=float32] [--target=0.25]
--
-- For each size (bytes of the largest buffer, as nccl-tests counts them) it
-- times in-place/out-of-place collectives on CPU tensors and prints, on rank
-- 0, the time per op (slowest rank) and
--   algbw = size / time
--   busbw = algbw * factor, the factor turning algbw into the bytes each
--           link must carry: all_reduce 2(n-1)/n, all_gather, reduce_scatter
--           and all_to_all (n-1)/n, broadcast 1
-- so busbw compares with the hardware bandwidth whatever the rank count.
-- Iterations per size are picked so each size runs about --target seconds.
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local now = require('gptlua.cli').now

local function parse_size(s)
  local n, unit = tostring(s):match('^(%d+%.?%d*)([KkMmGg]?)$')
  if not n then error('bench_collectives: bad size ' .. tostring(s)) end
  local mult = ({ [''] = 1, k = 1024, m = 1024 ^ 2, g = 1024 ^ 3 })[unit:lower()]
  return math.floor(tonumber(n) * mult)
end

local opts = { ops = 'all_reduce,all_gather,reduce_scatter,broadcast,all_to_all', min = '1K', max = '256M',
               factor = '2', dtype = 'float32', target = '0.25' }
for _, a in ipairs(arg or {}) do
  local k, v = a:match('^%-%-([%w_]+)=(.*)$')
  if not k or opts[k] == nil then error('bench_collectives: unknown argument ' .. a) end
  opts[k] = v
end

local world = dist.init {}
local N = world.size
local esize = gl.lib.gl_dtype_size((gl.Tensor.dtype_id(opts.dtype)))
local min_bytes, max_bytes = parse_size(opts.min), parse_size(opts.max)
local factor, target = tonumber(opts.factor), tonumber(opts.target)

local BUS = {
  all_reduce = 2 * (N - 1) / N, all_gather = (N - 1) / N, reduce_scatter = (N - 1) / N,
  broadcast = 1, all_to_all = (N - 1) / N,
}

-- buffers for one op at `count` elements of the big side; returns run()
local function setup(op, count)
  local per = math.floor(count / N)
  local dt = { dtype = opts.dtype }
  if op == 'all_reduce' then
    local t = gl.ones({ count }, dt)
    return function() world:all_reduce(t, 'sum') end, count
  elseif op == 'broadcast' then
    local t = gl.ones({ count }, dt)
    return function() world:broadcast(t, 0) end, count
  elseif op == 'all_gather' then
    local out, input = gl.empty({ per * N }, dt), gl.ones({ per }, dt)
    return function() world:all_gather(out, input) end, per * N
  elseif op == 'reduce_scatter' then
    local out, input = gl.empty({ per }, dt), gl.ones({ per * N }, dt)
    return function() world:reduce_scatter(out, input, 'sum') end, per * N
  elseif op == 'all_to_all' then
    local out, input = gl.empty({ per * N }, dt), gl.ones({ per * N }, dt)
    return function() world:all_to_all(out, input) end, per * N
  end
  error('bench_collectives: unknown op ' .. op)
end

local slowest = gl.zeros({ 1 }, { dtype = 'float64' })
local function max_over_ranks(x)
  slowest:fill_(x)
  world:all_reduce(slowest, 'max')
  return slowest:item()
end

dist.print0(('# gptlua collectives: %d ranks (%s backend), %s, %d thread(s) per rank'):format(
  N, world.backend, opts.dtype, gl.get_num_threads()))
dist.print0(('# %-14s %12s %12s %10s %12s %12s %12s'):format('op', 'size(B)', 'count', 'iters', 'time(us)',
  'algbw(GB/s)', 'busbw(GB/s)'))
for op in opts.ops:gmatch('[^,]+') do
  local bytes = min_bytes
  while bytes <= max_bytes do
    local run, count = setup(op, math.max(N, math.floor(bytes / esize)))
    -- warm-up, also the estimate that sets the iterations (a fixed count:
    -- every rank must run the same number of collectives)
    local warm = bytes >= 16 * 2 ^ 20 and 1 or 5
    world:barrier()
    local t0 = now()
    for _ = 1, warm do run() end
    local once = max_over_ranks((now() - t0) / warm)
    local iters = math.max(2, math.min(1000, math.floor(target / math.max(once, 1e-6))))
    world:barrier()
    t0 = now()
    for _ = 1, iters do run() end
    local per_op = max_over_ranks((now() - t0) / iters)
    local size = count * esize
    local algbw = size / per_op / 1e9
    dist.print0(('  %-14s %12d %12d %10d %12.1f %12.3f %12.3f'):format(op, size, count, iters, per_op * 1e6,
      algbw, algbw * BUS[op]))
    run = nil
    collectgarbage('collect')
    bytes = bytes * factor
  end
end
dist.finalize()
