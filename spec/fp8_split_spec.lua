-- gl.fp8_linear on a layer split over ranks (gptlua.ops_fp8's split: the
-- tp group cutting W's rows (column-parallel, split.n) or columns
-- (row-parallel, split.k), the cp group cutting the tokens (split.tokens)):
-- each rank's FP8 operands are exactly the parts of one process's, so the
-- ranks' outputs and gradients, put together, equal one process's but for
-- float32 accumulation in another order.  The ranks run here in one
-- process, as coroutines, over a group whose all-reduce (max: the only
-- collective the layer makes) waits for every rank's tensor.  The same
-- layer with each rank's local scales (no split given) misses that bound:
-- the check can fail.
local gl = require 'gptlua'

local U32 = 2 ^ -24

-- runs body(rank, comm) for ranks 0 .. n-1 in lockstep; returns their
-- results.  (Autograd's grad mode is one per process: each rank keeps its
-- own across the switches, as a backward turns it off while it runs.)
local function run_ranks(n, body)
  local threads, results, comms = {}, {}, {}
  for r = 1, n do
    comms[r] = { size = n, rank = r - 1, all_reduce_async = function(_, t, op)
      assert.equal('max', op)
      local mode = gl.is_grad_enabled()
      coroutine.yield(t)
      gl.set_grad_enabled(mode)
      return { wait = function() end }
    end }
    threads[r] = coroutine.create(function() return body(r - 1, comms[r]) end)
  end
  local done = false
  while not done do
    local held = {}
    for r = 1, n do
      local mode = gl.is_grad_enabled()
      local ok, v = coroutine.resume(threads[r])
      gl.set_grad_enabled(mode)
      assert(ok, v)
      if coroutine.status(threads[r]) == 'dead' then results[r] = v else held[r] = v end
    end
    if next(held) == nil then done = true
    else
      assert.equal(n, #held, 'every rank meets the collective')
      local m = held[1]:clone()
      for r = 2, n do m = gl.maximum(m, held[r]) end
      for r = 1, n do held[r]:copy_(m) end
    end
  end
  return results
end

local function randn(shape, seed, scale) return gl.randn(shape, { seed = seed }) * scale end

-- |want - got| <= c * 2^-24 * S element by element, S the sum of |terms|
-- of the product in float64 (the operands' FP8 values are within 1/8 of
-- theirs: 1.25 S bounds theirs), c the accumulation's roundings
local function within(got, want, S, c, what)
  local g, w, s = got:to('float64'):totable(), want:to('float64'):totable(), S:totable()
  local worst = 0
  for i = 1, #w do for j = 1, #w[1] do
    local bound = c * U32 * 1.25 * s[i][j]
    local e = math.abs(g[i][j] - w[i][j])
    worst = math.max(worst, e / bound)
    if e > bound then return false, ('%s [%d,%d]: %.9g vs one process %.9g (bound %.3g)'):format(what, i, j, g[i][j],
      w[i][j], bound) end
  end end
  return true, worst
end

local L, K, N, RANKS = 8, 16, 12, 2

-- one process: y, dx, dW and the sums of |terms| of each product
local function whole(recipe, x, W, g)
  local xr, Wr = x:clone():requires_grad_(), W:clone():requires_grad_()
  local y = gl.fp8_linear(xr, Wr, recipe)
  y:backward(g)
  local a = function(t) return t:to('float64'):abs() end
  return { y = y:detach(), dx = xr.grad, dW = Wr.grad,
    Sy = gl.matmul(a(x), a(W):t()), Sdx = gl.matmul(a(g), a(W)), SdW = gl.matmul(a(g):t(), a(x)) }
end

-- the split layer on RANKS ranks, its pieces put together as one process's
local CUTS = {
  -- column-parallel: W's rows cut, x whole; dx summed over ranks
  n = function(x, W, g, r)
    local per = N / RANKS
    return x, W:narrow(1, r * per + 1, per), g:narrow(2, r * per + 1, per)
  end,
  -- row-parallel: W's and x's columns cut; y summed over ranks
  k = function(x, W, g, r)
    local per = K / RANKS
    return x:narrow(2, r * per + 1, per), W:narrow(2, r * per + 1, per), g
  end,
  -- context parallelism: the tokens cut; dW summed over ranks
  tokens = function(x, W, g, r)
    local per = L / RANKS
    return x:narrow(1, r * per + 1, per), W, g:narrow(1, r * per + 1, per)
  end,
}
local function assemble(cut, parts)
  local function cat(name, dim) local t = {} for r = 1, RANKS do t[r] = parts[r][name] end return gl.cat(t, dim) end
  local function sum(name) local s = parts[1][name] for r = 2, RANKS do s = s + parts[r][name] end return s end
  if cut == 'n' then return { y = cat('y', 2), dx = sum('dx'), dW = cat('dW', 1) } end
  if cut == 'k' then return { y = sum('y'), dx = cat('dx', 2), dW = cat('dW', 2) } end
  return { y = cat('y', 1), dx = cat('dx', 1), dW = sum('dW') }
end

local function split_run(recipe, cut, x, W, g, shared)
  local parts = run_ranks(RANKS, function(r, comm)
    local xs, Ws, gs = CUTS[cut](x, W, g, r)
    xs, Ws = xs:contiguous():clone():requires_grad_(), Ws:contiguous():clone():requires_grad_()  -- (each rank its own leaf)
    local y = gl.fp8_linear(xs, Ws, recipe, shared and { [cut] = comm } or nil)
    y:backward(gs:contiguous())
    return { y = y:detach(), dx = xs.grad, dW = Ws.grad }
  end)
  return assemble(cut, parts)
end

describe('gl.fp8_linear split over ranks', function()
  for _, recipe in ipairs({ 'tensorwise', 'rowwise' }) do
    for _, cut in ipairs({ 'n', 'k', 'tokens' }) do
      it(('%s, cut along %s: one process\'s FP8 operands on every rank (output and gradients within float32 '
        .. 'accumulation of its), and not with local scales'):format(recipe, cut), function()
        -- rows and columns of unequal sizes, so each rank's part has its own amax
        local scale_rows = gl.tensor((function() local t = {} for i = 1, L do t[i] = { 2 ^ (i % 5) } end return t end)())
        local x = randn({ L, K }, 41, 1) * scale_rows
        local W = randn({ N, K }, 42, 0.1)
        local g = randn({ L, N }, 43, 0.01)
        local want = whole(recipe, x, W, g)
        local got = split_run(recipe, cut, x, W, g, true)
        -- the roundings: the inner dim's sum, the scale's product, the ranks' partial sums added
        for _, c in ipairs({ { 'y', 'Sy', K }, { 'dx', 'Sdx', N }, { 'dW', 'SdW', L } }) do
          local ok, msg = within(got[c[1]], want[c[1]], want[c[2]], c[3] + 2 + RANKS, c[1])
          assert(ok, msg)
        end
        local loc = split_run(recipe, cut, x, W, g, false)
        local all_ok = true
        for _, c in ipairs({ { 'y', 'Sy', K }, { 'dx', 'Sdx', N }, { 'dW', 'SdW', L } }) do
          local ok = within(loc[c[1]], want[c[1]], want[c[2]], c[3] + 2 + RANKS, c[1])
          all_ok = all_ok and ok
        end
        assert.is_false(all_ok, 'local scales met the bound too: the check cannot tell them apart')
      end)
    end
  end
end)
