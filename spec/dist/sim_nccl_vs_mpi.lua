-- Run on every rank by spec/dist_nccl_spec.lua (#cuda): every collective on
-- CUDA tensors through NCCL against the same collective on CPU copies of the
-- same random values through MPI, in every dtype it takes, in place and out
-- of place, even and uneven, from every root, grouped send/recv (gather,
-- scatter, all_to_all) and plain send/recv.  Needs a world whose CUDA
-- tensors use NCCL (a GPU per rank; in the CUDA simulator GL_SIM_DEVICES =
-- ranks).
-- Moves must match bit for bit.  Reductions too where both sides reduce in
-- the same order; an uneven reduce_scatter (NCCL: one reduce per rank, MPI:
-- MPI_Reduce_scatter) may sum in another order, so reductions are held to
-- a few units in the last place of the dtype: float64 1e-14, float32 1e-6,
-- float16 2e-3, bfloat16 1.6e-2 (relative to the largest |value|), integers
-- exactly.  Prints "OK rank R of N via nccl (C checks, E exact)" at the end.
local gl = require 'gptlua'
local dist = require 'gptlua.dist'

local world = dist.init { backend = 'nccl', timeout = 120 }
local R, N = world.rank, world.size
local DEV = dist.device()

local function fail(msg) error(('rank %d: %s'):format(R, msg), 2) end
local function check(cond, msg) if not cond then fail(msg) end end
check(world.nccl, 'the world uses NCCL for CUDA tensors')
check(DEV ~= 'cpu', 'bound to a GPU')

local FLOATS = { 'float32', 'float64', 'bfloat16', 'float16' }
local REDUCIBLE = { 'float32', 'float64', 'bfloat16', 'float16', 'int32', 'int64' }
local ALL = { 'float32', 'float64', 'bfloat16', 'float16', 'int32', 'int64', 'uint16', 'uint8', 'bool' }
local TOL = { float64 = 1e-14, float32 = 1e-6, float16 = 2e-3, bfloat16 = 1.6e-2 }
local FLOATING = gl.Tensor.FLOATING

-- random values of dtype on the CPU, different on every rank and call
local calls = 0
local function rand(n, dtype)
  calls = calls + 1
  gl.manual_seed(1000 * calls + R)
  local x = gl.randn({ n }) * 40
  if dtype == 'bool' then return x:gt(0):to('bool') end
  if dtype == 'uint8' or dtype == 'uint16' then x = x:abs() end
  return x:to(dtype)
end

local checks, exact = 0, 0
-- got: the NCCL result (device), want: the MPI result (CPU)
local function same(got, want, what, reduced)
  checks = checks + 1
  check(got.device == DEV, what .. ': result on ' .. got.device)
  check(got.dtype == want.dtype and got:numel() == want:numel(), what .. ': dtype or size differs')
  local g, w = got:to('cpu'), want
  if g:numel() == 0 then exact = exact + 1; return end
  local diff = g:to('float64'):max_abs_diff(w:to('float64'))
  if diff == 0 then exact = exact + 1; return end
  local scale = w:to('float64'):abs():max():item()
  local tol = reduced and TOL[w.dtype]
  if not (tol and diff <= tol * math.max(scale, 1e-30)) then
    fail(('%s: max |nccl - mpi| = %.6g (largest |value| %.6g, tolerance %s)'):format(what, diff, scale,
      tol and ('%g relative'):format(tol) or 'exact'))
  end
end

-- runs f(place) once on CPU copies (MPI) and once on the device (NCCL);
-- place(t) gives t's copy where the run happens.  f returns the outputs.
local function both(what, reduced, f)
  local outs_cpu = f(function(t) return t:clone() end, 'mpi')
  local outs_dev = f(function(t) return t:to(DEV) end, 'nccl')
  for i = 1, #outs_cpu do same(outs_dev[i], outs_cpu[i], ('%s (output %d)'):format(what, i), reduced) end
end

-- every tensor of a collective goes the expected way
local function routed(route, send, recv)
  local got = world:route(send, recv)
  check(got == route, ('route %s, expected %s'):format(got, route))
end

local function total(counts) local s = 0 for _, c in ipairs(counts) do s = s + c end return s end
local function seq(n, f) local t = {} for i = 1, n do t[i] = f(i) end return t end

-- all_reduce: every dtype and op, sizes around MPI's message limits, and a
-- strided (transposed) tensor staged and written back in its layout
for _, dt in ipairs(REDUCIBLE) do
  local ops = FLOATING[dt] and { 'sum', 'avg', 'max', 'min' } or { 'sum', 'max', 'min' }
  for _, n in ipairs({ 1, 7, 4099 }) do
    for _, op in ipairs(ops) do
      local x = rand(n, dt)
      both(('all_reduce %s %s n=%d'):format(dt, op, n), true, function(place, route)
        local t = place(x)
        routed(route, t, t)
        world:all_reduce(t, op)
        return { t }
      end)
    end
  end
  local x = rand(12, dt)
  both('all_reduce strided ' .. dt, true, function(place)
    local t = place(x):view(3, 4)
    world:all_reduce(t:transpose(1, 2), 'sum')
    return { t:contiguous():view(12) }
  end)
end

-- reduce_scatter: even, uneven with a zero count, out of place and with the
-- output a view inside the input; every reducible dtype, every op
for _, dt in ipairs(REDUCIBLE) do
  local ops = FLOATING[dt] and { 'sum', 'avg', 'max', 'min' } or { 'sum', 'max', 'min' }
  for _, op in ipairs(ops) do
    local x = rand(3 * N, dt)
    both(('reduce_scatter even %s %s'):format(dt, op), true, function(place)
      local out = place(gl.zeros({ 3 }, { dtype = dt }))
      world:reduce_scatter(out, place(x), op)
      return { out }
    end)
    local counts = seq(N, function(r) return r == 2 and 0 or r + 1 end)
    local y = rand(total(counts), dt)
    both(('reduce_scatter uneven %s %s'):format(dt, op), true, function(place)
      local out = place(gl.zeros({ counts[R + 1] }, { dtype = dt }))
      world:reduce_scatter(out, place(y), op, { counts = counts })
      return { out }
    end)
  end
  local x = rand(2 * N, dt)
  both('reduce_scatter in place ' .. dt, true, function(place)
    local buf = place(x)
    local mine = buf:narrow(1, 2 * R + 1, 2)
    world:reduce_scatter(mine, buf, 'sum')
    return { buf }
  end)
end

-- all_gather: every dtype (moves are raw bytes), even, uneven (rank 0 sends
-- nothing), out of place and this rank's shard viewed inside the output
for _, dt in ipairs(ALL) do
  local x = rand(5, dt)
  both('all_gather even ' .. dt, false, function(place)
    local out = place(gl.zeros({ 5 * N }, { dtype = dt }))
    world:all_gather(out, place(x))
    return { out }
  end)
  local counts = seq(N, function(r) return (r - 1) * 3 end)
  local y = rand(counts[R + 1], dt)
  both('all_gather uneven ' .. dt, false, function(place)
    local out = place(gl.zeros({ total(counts) }, { dtype = dt }))
    world:all_gather(out, place(y), { counts = counts })
    return { out }
  end)
  local z = rand(4 * N, dt)
  both('all_gather in place ' .. dt, false, function(place)
    local whole = place(z)
    world:all_gather(whole, whole:narrow(1, 4 * R + 1, 4))
    return { whole }
  end)
end

-- broadcast and reduce from every root
for root = 0, N - 1 do
  for _, dt in ipairs({ 'float32', 'bfloat16', 'int64', 'uint8' }) do
    local x = rand(33, dt)
    both(('broadcast %s root %d'):format(dt, root), false, function(place)
      local t = place(x)
      world:broadcast(t, root)
      return { t }
    end)
  end
  for _, dt in ipairs(REDUCIBLE) do
    local x = rand(33, dt)
    both(('reduce sum %s root %d'):format(dt, root), true, function(place)
      local t = place(x)
      world:reduce(t, root, 'sum')
      return R == root and { t } or {}
    end)
  end
end

-- gather / scatter (grouped ncclSend / ncclRecv): one tensor and lists of
-- different sizes, from every root
for root = 0, N - 1 do
  for _, dt in ipairs({ 'float16', 'int32', 'float64' }) do
    local x = rand(3, dt)
    both(('gather %s root %d'):format(dt, root), false, function(place)
      local out = R == root and place(gl.zeros({ 3 * N }, { dtype = dt })) or nil
      world:gather(out, place(x), root)
      return R == root and { out } or {}
    end)
    local y = rand(R + 2, dt)
    both(('gather list %s root %d'):format(dt, root), false, function(place)
      local outs = R == root and seq(N, function(r) return place(gl.zeros({ r + 1 }, { dtype = dt })) end) or nil
      world:gather(outs, place(y), root)
      return outs or {}
    end)
    local s = rand(2 * N, dt)
    both(('scatter %s root %d'):format(dt, root), false, function(place)
      local out = place(gl.zeros({ 2 }, { dtype = dt }))
      world:scatter(out, R == root and place(s) or nil, root)
      return { out }
    end)
    local parts = seq(N, function(r) return rand(r, dt) end)
    both(('scatter list %s root %d'):format(dt, root), false, function(place)
      local out = place(gl.zeros({ R + 1 }, { dtype = dt }))
      world:scatter(out, R == root and seq(N, function(r) return place(parts[r]) end) or nil, root)
      return { out }
    end)
  end
end

-- all_to_all: even, and chunk sizes that depend on both ranks (lists)
for _, dt in ipairs({ 'float32', 'bfloat16', 'int64' }) do
  local x = rand(3 * N, dt)
  both('all_to_all even ' .. dt, false, function(place)
    local out = place(gl.zeros({ 3 * N }, { dtype = dt }))
    world:all_to_all(out, place(x))
    return { out }
  end)
  local parts = seq(N, function(d) return rand(R + d, dt) end)
  both('all_to_all uneven ' .. dt, false, function(place)
    local outs = seq(N, function(s) return place(gl.zeros({ s + R }, { dtype = dt })) end)
    world:all_to_all(outs, seq(N, function(d) return place(parts[d]) end))
    return outs
  end)
end

-- send / recv around the ring, small (eager) and large (rendezvous):
-- rank 0 sends first, every other rank receives first, so each send meets
-- a posted receive (an ungrouped send may wait for its receiver)
if N > 1 then
  for _, n in ipairs({ 9, 20000 }) do
    local x = rand(n, 'float32')
    both(('ring send/recv n=%d'):format(n), false, function(place)
      local into = place(gl.zeros({ n }))
      local nxt, prv = (R + 1) % N, (R - 1) % N
      if R == 0 then world:send(place(x), nxt); world:recv(into, prv)
      else world:recv(into, prv); world:send(place(x), nxt) end
      return { into }
    end)
  end
end

dist.finalize()
io.write(('OK rank %d of %d via nccl (%d checks, %d exact)\n'):format(R, N, checks, exact))
