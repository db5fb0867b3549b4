-- Central finite-difference gradient checks in float64.
local gl = require 'gptlua'

local M = {}

-- gradcheck(f, inputs, {eps=1e-6, tol=1e-6, sample=nil}): f(...) -> tensor.
-- The scalar checked is sum(f(...) * R) with a fixed random R, so every
-- output element contributes.  Returns the worst relative error, and asserts
-- it is < tol.  sample = k checks k evenly spaced elements of each input
-- (the first and last among them) instead of all (whole models).
function M.check(f, inputs, opts)
  opts = opts or {}
  local eps, tol = opts.eps or 1e-6, opts.tol or 1e-6
  for _, x in ipairs(inputs) do
    if x.requires_grad then x.grad = nil end
  end
  local out = f(unpack(inputs))
  local R = gl.randn(out.shape, { dtype = 'float64', seed = 99 })
  local function scalar()
    return gl.no_grad(function() return gl.sum(f(unpack(inputs)):to('float64') * R):item() end)
  end
  gl.sum(out * R):backward()
  local worst = 0
  for k, x in ipairs(inputs) do
    if x.requires_grad then
      assert(x.grad, 'no gradient reached input ' .. k)
      local analytic = x.grad:contiguous():tolist()
      local n = x:numel()
      local flat = x:contiguous()
      assert(flat == x, 'gradcheck inputs must be contiguous')
      local picks = {}
      if opts.sample and opts.sample < n then
        for j = 0, opts.sample - 1 do picks[#picks + 1] = 1 + math.floor(j * (n - 1) / math.max(opts.sample - 1, 1)) end
      else
        for i = 1, n do picks[i] = i end
      end
      for _, i in ipairs(picks) do
        local idx = {}
        local rem = i - 1
        for d = #x.shape, 1, -1 do idx[d] = rem % x.shape[d] + 1; rem = math.floor(rem / x.shape[d]) end
        local v = x:get(unpack(idx))
        -- perturbing a leaf that requires grad: outside grad mode, as any in-place change
        local function put(val) gl.no_grad(function() x:set(val, unpack(idx)) end) end
        put(v + eps); local fp = scalar()
        put(v - eps); local fm = scalar()
        put(v)
        local numeric = (fp - fm) / (2 * eps)
        local err = math.abs(numeric - analytic[i]) / math.max(1, math.abs(numeric), math.abs(analytic[i]))
        if err > worst then worst = err end
        assert(err < tol, ('input %d element %d: analytic %.10g vs numeric %.10g (rel err %.3g)'):format(
          k, i, analytic[i], numeric, err))
      end
    end
  end
  return worst
end

function M.rand(shape, seed, grad)
  local t = gl.randn(shape, { dtype = 'float64', seed = seed })
  if grad ~= false then t:requires_grad_() end
  return t
end

return M
