-- The FP8 scaled product (gl_fp8_quantize, gl_fp8_matmul, gl.fp8_linear)
-- against references computed here in float64 from spec/support/fp8_ref.lua:
--  - quantization bit for bit (the scale and x * s are float32 operations,
--    which the reference rounds with ffi floats: each is a single correctly
--    rounded float64 operation, exact before the rounding or innocuous as a
--    double rounding since 53 >= 2 * 24 + 2);
--  - the product within float32 accumulation's bound, K u32 times the sum of
--    |terms|, plus one rounding of the scale product and one of the output;
--  - the layer's gradients two ways: against the emulated FP8 reference
--    (Q(dy) Q(W), Q(dy)^T Q(x), the same bound), and as a float64 gradient
--    check of the straight-through function x W^T (central differences in
--    float64) within the quantization's error bound (each operand off by at
--    most half an ulp of its format, or half a subnormal, per element).
-- The #cuda section runs the same ops on the GPU (the simulator) against
-- the CPU twin.
local gl = require 'gptlua'
local ffi = gl.ffi
local ref = require 'support.fp8_ref'
local twin = require 'support.cuda_twin'
local F = ref.FORMATS

local f32buf = ffi.new('float[1]')
local function r32(v) f32buf[0] = v; return f32buf[0] end
local U32 = 2 ^ -24

-- the reference quantization of a Lua matrix (rows of values); given: its
-- amax (a list: one, or one per row) instead of the rows' own
local function ref_quantize(x, dtype, rowwise, given)
  local f = F[dtype]
  local function amax(rows)
    local m = 0
    for _, r in ipairs(rows) do for _, v in ipairs(r) do
      if v ~= v then return 0 / 0 end
      m = math.max(m, math.abs(v))
    end end
    return m
  end
  local codes, scale_inv = {}, {}
  local whole = not rowwise and (given and given[1] or amax(x)) or nil
  for i, row in ipairs(x) do
    local a = whole or (given and given[i]) or amax({ row })
    local s = r32(f.max / (a < 1e-12 and r32(1e-12) or a))
    codes[i] = {}
    for j, v in ipairs(row) do codes[i][j] = ref.encode(f, r32(v * s)) end
    if rowwise or i == 1 then scale_inv[#scale_inv + 1] = r32(1 / s) end
  end
  return codes, scale_inv
end

local function codes_of(q)
  local R, C = q.shape[1], q.shape[2]
  local flat = q:contiguous():view_dtype('uint8', { R * C }):totable()
  local out = {}
  for i = 1, R do out[i] = {} for j = 1, C do out[i][j] = flat[(i - 1) * C + j] end end
  return out
end

local function transpose(m)
  local t = {}
  for j = 1, #m[1] do t[j] = {} for i = 1, #m do t[j][i] = m[i][j] end end
  return t
end

-- the product of decoded codes with scales, in float64, and its bound
local function ref_product(ca, fa, sa, cb, fb, sb, out_eps)
  local M, N, K = #ca, #cb, #ca[1]
  local val, bound = {}, {}
  for m = 1, M do
    val[m], bound[m] = {}, {}
    for n = 1, N do
      local s, abs = 0, 0
      for k = 1, K do
        local t = ref.decode(fa, ca[m][k]) * ref.decode(fb, cb[n][k])
        s = s + t; abs = abs + math.abs(t)
      end
      local scale = (sa[m] or sa[1]) * (sb[n] or sb[1])
      val[m][n] = s * scale
      -- float32 accumulation (K roundings), the scale product and the multiply, then out's rounding
      bound[m][n] = ((K + 3) * U32 * abs * scale + out_eps * math.abs(s * scale)) * 1.01
    end
  end
  return val, bound
end

local function randm(R, C, seed, scale)
  return gl.mul(gl.randn({ R, C }, { seed = seed }), scale or 1):totable()
end

describe('gl_fp8_quantize', function()
  for _, dtype in ipairs({ 'float8_e4m3fn', 'float8_e5m2' }) do
    for _, recipe in ipairs({ 'tensorwise', 'rowwise' }) do
      it(('%s %s: codes and scale_inv bit for bit, from float32 and bfloat16 of any strides'):format(dtype, recipe), function()
        local x = randm(7, 13, 11, 3)
        x[2][5] = 1e-30; x[3][1] = 0; x[4] = { 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 }  -- tiny, zeros, a zero row
        for _, src in ipairs({ 'float32', 'bfloat16' }) do
          local t = gl.tensor(x, { dtype = 'float64' }):to(src)
          local xv = t:to('float64'):totable()
          local q, s = gl.fp8_quantize(t, dtype, recipe)
          local want, wscale = ref_quantize(xv, dtype, recipe == 'rowwise')
          assert.same(want, codes_of(q))
          assert.same(wscale, s:totable())
          -- a transposed view quantizes its own rows
          local qt = gl.fp8_quantize(t:t(), dtype, recipe)
          assert.same((ref_quantize(transpose(xv), dtype, recipe == 'rowwise')), codes_of(qt))
        end
      end)
    end
  end

  it('propagates a NaN into every code and the scale', function()
    local x = gl.tensor({ { 1, 0 / 0 }, { 2, 3 } })
    local q, s = gl.fp8_quantize(x, 'float8_e4m3fn', 'tensorwise')
    assert.is_true(s:item() ~= s:item())
    for _, v in ipairs(q:to('float64'):totable()[2]) do assert.is_true(v ~= v) end
  end)

  it('refuses bad arguments in one line', function()
    local x = gl.randn({ 4, 4 })
    local q = gl.empty({ 4, 4 }, { dtype = 'float8_e4m3fn' })
    local s = gl.empty({ 1 })
    local function err(f) local ok, e = pcall(f); assert.is_false(ok); return tostring(e) end
    assert.truthy(err(function() gl.check(gl.lib.gl_fp8_quantize(x.c, s.c, x.c, 0)) end):find('expected float8_e4m3fn or float8_e5m2', 1, true))
    assert.truthy(err(function() gl.check(gl.lib.gl_fp8_quantize(q.c, s.c, x.c, 1)) end):find('one per row of x', 1, true))
    assert.truthy(err(function() gl.fp8_quantize(x:double(), 'float8_e4m3fn') end):find('expected float32 or bfloat16', 1, true))
    assert.truthy(err(function() gl.fp8_quantize(x, 'float8_e4m3fn', 'blockwise') end):find("expected 'tensorwise' or 'rowwise'", 1, true))
  end)
end)

-- gl_fp8_quantize in parts (gl_fp8_amax, gl_fp8_cast, gl_fp8_scale_inv:
-- what FSDP's FP8 all-gather runs on each rank's pieces): x's codes and
-- scale_inv, with amax taken over pieces (row blocks) and folded by max
local function quantize_in_parts(x, dtype, recipe, cut)
  local R, C = x.shape[1], x.shape[2]
  local rw = recipe == 'rowwise' and 1 or 0
  local amax = gl.zeros({ rw == 1 and R or 2 }, { device = x.device })
  for k, piece in ipairs({ { 0, cut }, { cut, R - cut } }) do
    local xv = x:narrow(1, piece[1] + 1, piece[2])
    local slot = rw == 1 and amax:narrow(1, piece[1] + 1, piece[2]) or amax:narrow(1, k, 1)
    gl.check(gl.lib.gl_fp8_amax(slot.c, xv.c, rw))
  end
  if rw == 0 then
    local whole = gl.empty({ 1 }, { device = x.device })
    gl.check(gl.lib.gl_fp8_amax(whole.c, amax:view({ 1, 2 }).c, 0))
    amax = whole
  end
  local q = gl.empty({ R, C }, { dtype = dtype, device = x.device })
  gl.check(gl.lib.gl_fp8_cast(q.c, x.c, amax.c))
  local s = gl.empty({ amax.shape[1] }, { device = x.device })
  gl.check(gl.lib.gl_fp8_scale_inv(s.c, amax.c, dtype == 'float8_e4m3fn' and gl.lib.GL_F8E4M3 or gl.lib.GL_F8E5M2))
  return q, s
end

describe('gl_fp8_amax, gl_fp8_cast, gl_fp8_scale_inv', function()
  for _, dtype in ipairs({ 'float8_e4m3fn', 'float8_e5m2' }) do
    for _, recipe in ipairs({ 'tensorwise', 'rowwise' }) do
      it(('%s %s: amax over pieces, then the cast, are gl_fp8_quantize bit for bit'):format(dtype, recipe), function()
        local x = randm(7, 13, 12, 3)
        x[2][5] = 1e-30; x[4] = { 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 }
        for _, src in ipairs({ 'float32', 'bfloat16' }) do
          local t = gl.tensor(x, { dtype = 'float64' }):to(src)
          for _, v in ipairs({ t, t:t() }) do   -- and a transposed view
            local q, s = gl.fp8_quantize(v, dtype, recipe)
            local pq, ps = quantize_in_parts(v, dtype, recipe, 3)
            assert.same(codes_of(q), codes_of(pq))
            assert.same(s:totable(), ps:totable())
          end
        end
      end)
    end
  end

  it('refuses bad arguments in one line', function()
    local x, q = gl.randn({ 3, 4 }), gl.empty({ 3, 4 }, { dtype = 'float8_e4m3fn' })
    local function err(f) local ok, e = pcall(f); assert.is_false(ok); return tostring(e) end
    assert.truthy(err(function() gl.check(gl.lib.gl_fp8_amax(gl.empty({ 2 }).c, x.c, 1)) end):find('amax has 1 dims of 2, expected {1} (tensorwise) or {3} (rowwise)', 1, true))
    assert.truthy(err(function() gl.check(gl.lib.gl_fp8_cast(q.c, x.c, gl.empty({ 2 }).c)) end):find('expected {1} (tensorwise) or {3} (rowwise)', 1, true))
    assert.truthy(err(function() gl.check(gl.lib.gl_fp8_scale_inv(gl.empty({ 1 }).c, gl.empty({ 1 }).c, 0)) end):find('expected float8_e4m3fn', 1, true))
    assert.truthy(err(function() gl.check(gl.lib.gl_fp8_cast(x.c, x.c, gl.empty({ 1 }).c)) end):find('expected float8_e4m3fn or float8_e5m2', 1, true))
  end)
end)

-- the same parts as gl.fp8_quantize_amax (tp's and cp's split operands: the
-- amax given, max-reduced over the ranks)
describe('gl.fp8_quantize_amax', function()
  for _, recipe in ipairs({ 'tensorwise', 'rowwise' }) do
    it(recipe .. ": x's own amax quantizes as gl_fp8_quantize bit for bit; a larger amax (another rank's) sets the scale", function()
      local x = gl.tensor(randm(6, 9, 21, 2))
      local own = recipe == 'rowwise' and gl.max(gl.abs(x), 2) or gl.max(gl.abs(x)):reshape({ 1 })
      local q, s = gl.fp8_quantize(x, 'float8_e4m3fn', recipe)
      local q2, s2 = gl.fp8_quantize_amax(x, 'float8_e4m3fn', own:contiguous())
      assert.same(codes_of(q), codes_of(q2))
      assert.same(s:totable(), s2:totable())
      -- amax 4 times x's: every code the reference makes with that amax (scale_inv 4 times, a power of two: exact)
      local q4, s4 = gl.fp8_quantize_amax(x, 'float8_e4m3fn', (own * 4):contiguous())
      local want = ref_quantize(x:to('float64'):totable(), 'float8_e4m3fn', recipe == 'rowwise', (own * 4):totable())
      assert.same(want, codes_of(q4))
      for i, v in ipairs(s4:totable()) do assert.equal(4 * s:totable()[i], v) end
    end)
  end

  it('refuses an amax that is neither one scale nor one per row, in one line', function()
    local x = gl.randn({ 4, 4 })
    local ok, e = pcall(gl.fp8_quantize_amax, x, 'float8_e4m3fn', gl.ones({ 3 }))
    assert.is_false(ok)
    assert.truthy(tostring(e):find('expected {1} (tensorwise) or {4} (rowwise)', 1, true), tostring(e))
    assert.is_nil(tostring(e):find('\n'), tostring(e))
  end)
end)

describe('gl_fp8_matmul', function()
  for _, recipe in ipairs({ 'tensorwise', 'rowwise' }) do
    for _, pair in ipairs({ { 'float8_e4m3fn', 'float8_e4m3fn' }, { 'float8_e5m2', 'float8_e4m3fn' } }) do
      it(('%s x %s %s: within float32 accumulation of the float64 product'):format(pair[1], pair[2], recipe), function()
        local M, N, K = 5, 6, 48
        local a = gl.tensor(randm(M, K, 21, 2))
        local b = gl.tensor(randm(N, K, 22, 0.05))
        local qa, sa = gl.fp8_quantize(a, pair[1], recipe)
        local qb, sb = gl.fp8_quantize(b, pair[2], recipe)
        for _, dt in ipairs({ 'float32', 'bfloat16' }) do
          local out = gl.fp8_matmul(qa, sa, qb, sb, dt):to('float64'):totable()
          local val, bound = ref_product(codes_of(qa), F[pair[1]], sa:totable(), codes_of(qb), F[pair[2]], sb:totable(),
            dt == 'bfloat16' and 2 ^ -8 or U32)
          for m = 1, M do for n = 1, N do
            assert(math.abs(out[m][n] - val[m][n]) <= bound[m][n],
              ('%s [%d,%d]: %.9g vs %.9g (bound %.3g)'):format(dt, m, n, out[m][n], val[m][n], bound[m][n]))
          end end
        end
      end)
    end
  end

  it('refuses two e5m2 operands and operands that are not row-major', function()
    local q = gl.empty({ 4, 16 }, { dtype = 'float8_e5m2' })
    local s = gl.ones({ 1 })
    local ok, e = pcall(gl.fp8_matmul, q, s, q, s)
    assert.is_false(ok); assert.truthy(tostring(e):find('at least one float8_e4m3fn', 1, true))
    local r = gl.empty({ 16, 4 }, { dtype = 'float8_e4m3fn' })
    ok, e = pcall(gl.fp8_matmul, q, s, r:t(), s)
    assert.is_false(ok); assert.truthy(tostring(e):find('b must be contiguous', 1, true))
  end)
end)

describe('gl.fp8_linear', function()
  for _, recipe in ipairs({ 'tensorwise', 'rowwise' }) do
    it(recipe .. ': forward and gradients as the emulated FP8 reference, and a float64 gradient check of x W^T', function()
      local B, T, K, N = 2, 3, 32, 16
      local x = gl.tensor(randm(B * T, K, 31, 1)):view({ B, T, K }):requires_grad_()
      local W = gl.tensor(randm(N, K, 32, 0.1)):requires_grad_()
      local g = gl.tensor(randm(B * T, N, 33, 0.01))
      local y = gl.fp8_linear(x, W, recipe)
      assert.same({ B, T, N }, y.shape)
      y:backward(g:view({ B, T, N }))
      local rw = recipe == 'rowwise'
      local xv, Wv, gv = x:detach():view({ B * T, K }):to('float64'):totable(), W:detach():to('float64'):totable(),
        g:to('float64'):totable()
      local function check(got, a, fa, b, fb, what)
        local ca, sa = ref_quantize(a, fa, rw)
        local cb, sb = ref_quantize(b, fb, rw)
        local val, bound = ref_product(ca, F[fa], sa, cb, F[fb], sb, U32)
        for m = 1, #val do for n = 1, #val[1] do
          assert(math.abs(got[m][n] - val[m][n]) <= bound[m][n],
            ('%s [%d,%d]: %.9g vs emulated %.9g (bound %.3g)'):format(what, m, n, got[m][n], val[m][n], bound[m][n]))
        end end
        return sa, sb
      end
      check(y:detach():view({ B * T, N }):to('float64'):totable(), xv, 'float8_e4m3fn', Wv, 'float8_e4m3fn', 'y')
      local dx = x.grad:view({ B * T, K }):to('float64'):totable()
      local sg, sw = check(dx, gv, 'float8_e5m2', transpose(Wv), 'float8_e4m3fn', 'dx')
      local dW = W.grad:to('float64'):totable()
      local sgt, sxt = check(dW, transpose(gv), 'float8_e5m2', transpose(xv), 'float8_e4m3fn', 'dW')

      -- float64 central differences of L = sum(g * (x W^T)), the function the
      -- straight-through backward differentiates
      local x64, W64, g64 = gl.tensor(xv, { dtype = 'float64' }), gl.tensor(Wv, { dtype = 'float64' }),
        gl.tensor(gv, { dtype = 'float64' })
      local function L() return gl.sum(gl.mul(gl.matmul(x64, W64:t()), g64)):item() end
      local function fd(t, i, j)
        local h, v = 1e-3, t:totable()[i][j]
        local row = t:select(1, i)
        row:narrow(1, j, 1):fill_(v + h); local up = L()
        row:narrow(1, j, 1):fill_(v - h); local dn = L()
        row:narrow(1, j, 1):fill_(v)
        return (up - dn) / (2 * h)
      end
      -- |Q(a)Q(b) - ab| summed over the inner dim, per element's quantization bound
      local function qbound(arow, fa, sa, bcol, fb, sb)
        local s = 0
        for k = 1, #arow do
          local ea, eb = ref.error_bound(F[fa], arow[k], sa), ref.error_bound(F[fb], bcol[k], sb)
          s = s + ea * math.abs(bcol[k]) + math.abs(arow[k]) * eb + ea * eb
        end
        return s
      end
      local Wt, xt, gt = transpose(Wv), transpose(xv), transpose(gv)
      for _, ij in ipairs({ { 1, 1 }, { 3, 7 }, { B * T, K } }) do
        local i, j = ij[1], ij[2]
        local want = fd(x64, i, j)
        local bnd = qbound(gv[i], 'float8_e5m2', rw and sg[i] or sg[1], Wt[j], 'float8_e4m3fn', rw and sw[j] or sw[1])
          + (N + 3) * U32 * math.abs(want) + 1e-9
        assert(math.abs(dx[i][j] - want) <= bnd, ('dx[%d,%d] %.9g vs float64 %.9g (bound %.3g)'):format(i, j, dx[i][j], want, bnd))
      end
      for _, ij in ipairs({ { 1, 1 }, { 5, 9 }, { N, K } }) do
        local i, j = ij[1], ij[2]
        local want = fd(W64, i, j)
        local bnd = qbound(gt[i], 'float8_e5m2', rw and sgt[i] or sgt[1], xt[j], 'float8_e4m3fn', rw and sxt[j] or sxt[1])
          + (B * T + 3) * U32 * math.abs(want) + 1e-9
        assert(math.abs(dW[i][j] - want) <= bnd, ('dW[%d,%d] %.9g vs float64 %.9g (bound %.3g)'):format(i, j, dW[i][j], want, bnd))
      end
    end)
  end
end)

-- the GPU's quantization bit for bit, its products within the bound of
-- float32 accumulation in another order, against the CPU twin
local gpu_it = twin.gpu_it(it, pending)
describe('FP8 scaled product on the GPU #cuda', function()
  gpu_it('empty operands: a tensor of no rows has the scale of amax 0, a product over K = 0 is zeros', function()
    local x = gl.empty({ 0, 8 })
    local _, s = gl.fp8_quantize(x, 'float8_e4m3fn', 'tensorwise')
    local _, gs = gl.fp8_quantize(x:to(twin.DEV), 'float8_e4m3fn', 'tensorwise')
    assert.same(s:totable(), gs:to('cpu'):totable())
    -- (an amax given: its scale, as the CPU's)
    local amax = gl.tensor({ 3 })
    local _, sa = gl.fp8_quantize_amax(x, 'float8_e4m3fn', amax)
    local _, gsa = gl.fp8_quantize_amax(x:to(twin.DEV), 'float8_e4m3fn', amax:to(twin.DEV))
    assert.same(sa:totable(), gsa:to('cpu'):totable())
    assert.equal(r32(1 / r32(448 / 3)), sa:totable()[1], 'scale_inv of amax 3')
    local a, b = gl.empty({ 3, 0 }, { dtype = 'float8_e4m3fn' }), gl.empty({ 2, 0 }, { dtype = 'float8_e4m3fn' })
    local one = gl.ones({ 1 })
    assert.same({ { 0, 0 }, { 0, 0 }, { 0, 0 } },
      gl.fp8_matmul(a:to(twin.DEV), one:to(twin.DEV), b:to(twin.DEV), one:to(twin.DEV)):to('cpu'):totable())
    assert.same({ { 0, 0 }, { 0, 0 }, { 0, 0 } }, gl.fp8_matmul(a, one, b, one):totable())
  end)

  for _, recipe in ipairs({ 'tensorwise', 'rowwise' }) do
    gpu_it(recipe .. ': amax over pieces, the cast and scale_inv as the CPU twin, bit for bit', function()
      local a = gl.tensor(randm(33, 70, 43, 2))
      for _, src in ipairs({ a, a:to('bfloat16') }) do
        for _, v in ipairs({ src, src:t() }) do
          local q, s = quantize_in_parts(v, 'float8_e4m3fn', recipe, 5)
          local gv = v:is_contiguous() and v:to(twin.DEV) or v:t():to(twin.DEV):t()
          local gq, gs = quantize_in_parts(gv, 'float8_e4m3fn', recipe, 5)
          assert.same(codes_of(q), codes_of(gq:to('cpu')))
          assert.same(s:totable(), gs:to('cpu'):totable())
        end
      end
    end)
  end

  for _, recipe in ipairs({ 'tensorwise', 'rowwise' }) do
    -- 32 x 48 x 64 takes cuBLASLt's FP8 path; 5 x 6 x 40 (K not a multiple of 16) the plain kernel
    for _, shape in ipairs({ { 32, 48, 64 }, { 5, 6, 40 } }) do
      gpu_it(('%s %dx%dx%d: quantization bit for bit, product as the CPU twin'):format(recipe, shape[1], shape[2], shape[3]), function()
        local M, N, K = shape[1], shape[2], shape[3]
        local a = gl.tensor(randm(M, K, 41, 2)):to('bfloat16')
        local b = gl.tensor(randm(N, K, 42, 0.05))
        for _, pair in ipairs({ { 'float8_e4m3fn', 'float8_e4m3fn' }, { 'float8_e5m2', 'float8_e4m3fn' } }) do
          local qa, sa = gl.fp8_quantize(a, pair[1], recipe)
          local qb, sb = gl.fp8_quantize(b, pair[2], recipe)
          local gqa, gsa = gl.fp8_quantize(a:to(twin.DEV), pair[1], recipe)
          local gqb, gsb = gl.fp8_quantize(b:t():to(twin.DEV):t(), pair[2], recipe)  -- from a transposed view
          assert.same(codes_of(qa), codes_of(gqa:to('cpu')))
          assert.same(codes_of(qb), codes_of(gqb:to('cpu')))
          assert.same(sa:totable(), gsa:to('cpu'):totable())
          assert.same(sb:totable(), gsb:to('cpu'):totable())
          -- an amax given (twice a's own, as a larger rank's): the same codes and scales as the CPU's
          local amax = (recipe == 'rowwise' and gl.max(gl.abs(a), 2) or gl.max(gl.abs(a)):reshape({ 1 })):to('float32') * 2
          local cq, cs = gl.fp8_quantize_amax(a, pair[1], amax:contiguous())
          local gq, gs = gl.fp8_quantize_amax(a:to(twin.DEV), pair[1], amax:contiguous():to(twin.DEV))
          assert.same(codes_of(cq), codes_of(gq:to('cpu')))
          assert.same(cs:totable(), gs:to('cpu'):totable())
          for _, dt in ipairs({ 'float32', 'bfloat16' }) do
            local got = gl.fp8_matmul(gqa, gsa, gqb, gsb, dt):to('cpu'):to('float64'):totable()
            local val, bound = ref_product(codes_of(qa), F[pair[1]], sa:totable(), codes_of(qb), F[pair[2]], sb:totable(),
              dt == 'bfloat16' and 2 ^ -8 or U32)
            for m = 1, M do for n = 1, N do
              assert(math.abs(got[m][n] - val[m][n]) <= bound[m][n],
                ('%s %s [%d,%d]: GPU %.9g vs %.9g (bound %.3g)'):format(recipe, dt, m, n, got[m][n], val[m][n], bound[m][n]))
            end end
          end
        end
      end)
    end
  end
end)
