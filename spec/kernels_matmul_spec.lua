-- The CPU matmul kernel (engine/gl_ops.h) in every operand layout, batched,
-- by precision, split over threads and side by side.
-- Called directly through gl.lib.gl_xxx(t.c, ...): every forward kernel is
-- compared with a plain Lua float64 reference (odd sizes, size-1 dims, several
-- memory layouts), every backward kernel with a central finite difference of
-- its forward in float64.  Helpers: spec/support/kernels.lua.
local gl = require 'gptlua'
local lib, ffi = gl.lib, gl.ffi
local K = require 'support.kernels'
local check, randn, empty, numel, copy_shape, assert_close, layout, map =
  K.check, K.randn, K.empty, K.numel, K.copy_shape, K.assert_close, K.layout, K.map

-- =================================================================== matmul
local function ref_matmul(a, b, out0, alpha, beta)
  local nd = #a.shape
  local M, K, N = a.shape[nd - 1], a.shape[nd], b.shape[nd]
  local av, bv, ov = a:tolist(), b:tolist(), out0 and out0:tolist()
  local nb = numel(a.shape) / (M * K)
  local r = {}
  for bi = 0, nb - 1 do
    for m = 0, M - 1 do
      for n = 0, N - 1 do
        local s = 0
        for k = 0, K - 1 do s = s + av[bi * M * K + m * K + k + 1] * bv[bi * K * N + k * N + n + 1] end
        local o = bi * M * N + m * N + n + 1
        r[o] = alpha * s + (beta ~= 0 and beta * ov[o] or 0)
      end
    end
  end
  return r
end

-- a layout no BLAS call can take: every other element of a wider tensor
local function strided2(t)
  local nd, s = #t.shape, copy_shape(t.shape)
  s[nd] = 2 * s[nd]
  local big = gl.zeros(s, { dtype = t.dtype })
  local st = big:stride(); st[nd] = 2
  return big:_as_strided(t.shape, st, 0):copy_(t)
end
local MAT_LAYOUTS = {
  contiguous = function(t) return layout(t, 'contiguous') end,
  transposed = function(t) return layout(t, 'transposed') end,
  narrowed = function(t) return layout(t, 'narrowed') end,
  strided = strided2,
}

describe('matmul kernel', function()
  local function run(out, a, b, alpha, beta) check(lib.gl_matmul(out.c, a.c, b.c, alpha, beta)) end
  it('multiplies matrices in every operand layout, alpha and beta', function()
    for _, dims in ipairs({ { 5, 7, 3 }, { 1, 4, 6 }, { 6, 1, 1 }, { 3, 3, 1 } }) do
      local M, K, N = dims[1], dims[2], dims[3]
      local a, b = randn({ M, K }), randn({ K, N })
      for an, af in pairs(MAT_LAYOUTS) do
        for bn, bf in pairs(MAT_LAYOUTS) do
          local av, bv = af(a), bf(b)
          local out = empty({ M, N })
          run(out, av, bv, 1, 0)
          assert_close(out:tolist(), ref_matmul(av, bv, nil, 1, 0), 1e-13, ('%s @ %s'):format(an, bn))
        end
      end
      for on, of in pairs(MAT_LAYOUTS) do
        local c0 = randn({ M, N })
        local out = of(c0)
        run(out, a, b, 0.5, 2)
        assert_close(out:tolist(), ref_matmul(a, b, c0, 0.5, 2), 1e-13, 'alpha/beta into ' .. on)
      end
    end
  end)
  it('copies operands broadcast along their rows or columns (0 strides)', function()
    for _, dt in ipairs({ 'float64', 'float32' }) do
      local a = randn({ 1, 6 }, dt):expand({ 5, 6 })
      local b = randn({ 6, 1 }, dt):expand({ 6, 4 })
      local out = empty({ 5, 4 }, dt)
      run(out, a, b, 1, 0)
      assert_close(out:tolist(), ref_matmul(a, b, nil, 1, 0), dt == 'float64' and 1e-13 or 1e-6, 'broadcast ' .. dt)
    end
  end)
  it('overwrites with beta = 0 even over NaN, and handles K = 0', function()
    local a, b = randn({ 3, 4 }), randn({ 4, 2 })
    local out = gl.full({ 3, 2 }, 0 / 0, { dtype = 'float64' })
    run(out, a, b, 1, 0)
    assert_close(out:tolist(), ref_matmul(a, b, nil, 1, 0), 1e-13, 'beta 0')
    -- rows with a gap (ld > N) and a transposed out, both over NaN, in both dtypes
    for _, dt in ipairs({ 'float32', 'float64' }) do
      local a2, b2 = randn({ 3, 4 }, dt), randn({ 4, 2 }, dt)
      for _, v in ipairs({ gl.full({ 3, 5 }, 0 / 0, { dtype = dt }):narrow(2, 2, 2),
                           gl.full({ 2, 3 }, 0 / 0, { dtype = dt }):t() }) do
        run(v, a2, b2, 1, 0)
        assert_close(v:tolist(), ref_matmul(a2, b2, nil, 1, 0), dt == 'float64' and 1e-13 or 1e-6, 'beta 0 strided ' .. dt)
      end
    end
    local c0 = randn({ 3, 2 })
    local c = c0:clone()
    run(c, empty({ 3, 0 }), empty({ 0, 2 }), 1, 3)
    assert_close(c:tolist(), map(c0:tolist(), function(v) return 3 * v end), 1e-15, 'K = 0')
  end)
  it('batches with broadcast batch dims, folded and transposed views', function()
    local cases = {
      { a = { 2, 3, 4, 5 }, b = { 2, 3, 5, 6 } },
      { a = { 2, 1, 4, 5 }, b = { 1, 3, 5, 2 }, out = { 2, 3, 4, 2 } },
      { a = { 4, 6, 5 }, b = { 1, 5, 3 }, out = { 4, 6, 3 } }, -- b shared: folds into one GEMM
      { a = { 3, 1, 5 }, b = { 1, 5, 7 }, out = { 3, 1, 7 } },
    }
    for ci, c in ipairs(cases) do
      local nd = #c.a
      local out_shape = copy_shape(c.out or c.a); out_shape[nd] = c.b[nd]
      -- each operand broadcast to the batch dims of out
      local function full(s) local r = copy_shape(out_shape); r[nd - 1], r[nd] = s[nd - 1], s[nd]; return r end
      local a, b = randn(c.a), randn(c.b)
      for _, la in ipairs({ 'contiguous', 'transposed', 'narrowed' }) do
        for _, lb in ipairs({ 'contiguous', 'transposed' }) do
          local ae, be = MAT_LAYOUTS[la](a):expand(full(c.a)), MAT_LAYOUTS[lb](b):expand(full(c.b))
          for _, lo in ipairs({ 'contiguous', 'transposed', 'strided' }) do
            local c0 = randn(out_shape)
            local out = MAT_LAYOUTS[lo](c0)
            run(out, ae, be, 1.5, 1)
            assert_close(out:tolist(), ref_matmul(ae, be, c0, 1.5, 1), 1e-13,
              ('case %d %s @ %s -> %s'):format(ci, la, lb, lo))
          end
        end
      end
    end
  end)
  it('computes float32 close to float64 and bfloat16 through float32', function()
    local a, b = randn({ 2, 33, 17 }), randn({ 2, 17, 9 })
    local want = ref_matmul(a, b, nil, 1, 0)
    for dt, tol in pairs({ float32 = 1e-6, bfloat16 = 2e-2 }) do
      local out = empty({ 2, 33, 9 }, dt)
      run(out, a:to(dt), layout(b:to(dt), 'transposed'), 1, 0)
      assert_close(out:tolist(), want, tol, 'matmul ' .. dt)
    end
  end)
  it('splits tall products by rows over the threads, a operand plain or transposed', function()
    local nt = gl.get_num_threads()
    local b, c0 = randn({ 5, 7 }), randn({ 301, 7 })
    for _, threads in ipairs({ 1, 2, 3 }) do
      gl.set_num_threads(threads)
      for _, an in ipairs({ 'contiguous', 'transposed' }) do
        local a = layout(randn({ 301, 5 }), an)
        local out = c0:clone()
        run(out, a, b, 0.5, 2)
        assert_close(out:tolist(), ref_matmul(a, b, c0, 0.5, 2), 1e-13, ('%s a, %d threads'):format(an, threads))
        local out32 = empty({ 301, 7 }, 'float32')
        run(out32, a:to('float32'), b:to('float32'), 1, 0)
        assert_close(out32:tolist(), ref_matmul(a, b, nil, 1, 0), 1e-5, ('float32 %s a, %d threads'):format(an, threads))
      end
    end
    gl.set_num_threads(nt)
  end)
  it('runs a pair of independent products side by side, on 1 and 2 threads', function()
    local nt = gl.get_num_threads()
    local a1, b1 = randn({ 70, 33 }), randn({ 33, 21 })
    local a2, b2 = layout(randn({ 33, 70 }), 'transposed'), randn({ 2, 70, 5 })
    local c0, c1 = randn({ 2, 33, 5 }), randn({ 70, 21 })
    for _, threads in ipairs({ 1, 2 }) do
      gl.set_num_threads(threads)
      -- alpha and beta apply to both products
      local o1, o2 = c1:clone(), c0:clone()
      check(lib.gl_matmul_pair(o1.c, a1.c, b1.c, o2.c, a2:expand({ 2, 33, 70 }).c, b2.c, 0.5, 2))
      assert_close(o1:tolist(), ref_matmul(a1, b1, c1, 0.5, 2), 1e-13, 'first of the pair')
      assert_close(o2:tolist(), ref_matmul(a2:expand({ 2, 33, 70 }), b2, c0, 0.5, 2), 1e-13, 'second of the pair')
    end
    gl.set_num_threads(nt)
    local o1 = empty({ 70, 21 })
    local rc = lib.gl_matmul_pair(o1.c, a1.c, b1.c, empty({ 4, 4 }).c, a1.c, b1.c, 1, 0)
    assert.equal(-1, rc)
    assert.equal('gl_matmul_pair (second product): out has shape {4,4}, expected {70,21} (M of a is 70, N of b is 21)',
                 ffi.string(lib.gl_last_error()))
  end)
end)
