-- The CUDA backend against its CPU twins (make test-cuda).
--
-- Every kernel runs on fresh random inputs (a new seed each run, printed in
-- failure messages) of odd sizes, contiguous and not (transposed, narrowed,
-- broadcast views), with every GPU output poisoned (NaN) before the call,
-- and is compared with the CPU kernel on the same values:
--   float32: max |gpu - cpu| <= 1e-5 * max |cpu|     (relative to the result's scale)
--   bfloat16: the same with 1e-2, against the CPU twin run in float32 on the
--             same bfloat16 input values;  float64: 1e-10;  integers exactly.
-- All tests sit in describes tagged #cuda, so `make test` (which excludes
-- the tag) only loads this file; without a GPU every GPU test is pending.
local gl = require 'gptlua'
local cuda = require 'gptlua.cuda'
local ffi, lib = gl.ffi, gl.lib

-- the harness (pair, compare, ...) lives in spec/support/cuda_twin.lua
local twin = require 'support.cuda_twin'
local HAVE_GPU, DEV, NO_GPU = twin.HAVE_GPU, twin.DEV, twin.NO_GPU
local next_seed, copy_shape, pair, id_pair, output = twin.next_seed, twin.copy_shape, twin.pair, twin.id_pair, twin.output
local check_close, compare, K = twin.check_close, twin.compare, twin.K

local function gpu_it(name, fn)  -- it() and pending() are busted's, in this file's environment
  if HAVE_GPU then it(name, fn) else pending(name .. ' (' .. NO_GPU .. ')') end
end

-- ------------------------------------------------------------ runtime
describe('gptlua.cuda runtime #cuda', function()
  it('counts devices consistently and reports the build', function()
    assert.equal(lib.gl_cuda_device_count(), cuda.device_count())
    assert.equal(cuda.device_count() > 0, cuda.is_available())
    assert.is_boolean(cuda.built())
    assert.equal(cuda.is_available() and 'cuda:0' or 'cpu', gl.default_device())
  end)

  if not HAVE_GPU then
    it('raises clear errors when no GPU is present', function()
      assert.has_error(function() gl.randn({ 2, 2 }, { device = DEV }) end)
      if cuda.built() then
        local ok, err = pcall(cuda.Event)
        assert.is_false(ok)
        assert.matches('CUDA device', err)
        ok, err = pcall(cuda.get_device_properties, 0)
        assert.is_false(ok)
        assert.matches('cuda:0', err)
        assert.equal(0, cuda.pinned_bytes())
      end
      assert.has_error(function() cuda.Event('cpu') end)
    end)
  end

  gpu_it('reports device properties and memory', function()
    local p = cuda.get_device_properties(0)
    assert.is_true(#p.name > 0)
    assert.is_true(p.major >= 7)
    assert.is_true(p.multiprocessor_count > 0)
    local free, total = cuda.mem_get_info(0)
    assert.is_true(total > 0 and free > 0 and free <= total)
    assert.is_true(total <= p.total_memory and total > 0.5 * p.total_memory)
  end)

  gpu_it('times work with events and orders the streams', function()
    local a, b = cuda.Event(), cuda.Event()
    local x = gl.randn({ 512, 512 }, { device = DEV })
    a:record()
    for _ = 1, 3 do K(lib.gl_unary(lib.GL_U_EXP, x.c, x.c, 0, 0)) end
    b:record()
    assert.is_true(a:elapsed_time(b) >= 0)
    b:synchronize()
    assert.is_true(b:query())
    assert.is_true(cuda.time(function() K(lib.gl_unary(lib.GL_U_NEG, x.c, x.c, 0, 0)) end, { iters = 3 }) >= 0)
    local s0, s1 = cuda.stream(0, 'compute'), cuda.stream(0, 'comm')
    assert.is_not_nil(s0)
    assert.is_false(s0 == s1)
    cuda.stream_wait(0, 'comm', 'compute')
    cuda.stream_synchronize(0, 'comm')
    cuda.synchronize()
  end)

  gpu_it('keeps allocator statistics for the device', function()
    collectgarbage(); collectgarbage()
    collectgarbage('stop')  -- no tensor of another test is freed while we count
    cuda.synchronize(0)
    local before = cuda.memory_stats(0)
    local t = gl.empty({ 1024, 1024 }, { device = DEV })
    local mid = cuda.memory_stats(0)
    assert.is_true(mid.allocated >= before.allocated + 4 * 1024 * 1024)
    assert.is_true(mid.peak >= mid.allocated)
    t:free()
    assert.equal(before.allocated, cuda.memory_stats(0).allocated)
    collectgarbage('restart')
    cuda.empty_cache(0)
    assert.is_true(cuda.memory_reserved(0) <= mid.reserved)
  end)

  gpu_it('moves tensors of every dtype to the GPU and back unchanged', function()
    for _, dt in ipairs({ 'float32', 'float64', 'bfloat16', 'float16', 'int32', 'int64', 'uint16', 'uint8', 'bool' }) do
      local vals = { { 1, 0, 3 }, { 4, 5, 0 } }
      local t = gl.tensor(vals, { dtype = dt })
      local g = t:to(DEV)
      assert.equal(DEV, g.device)
      assert.same(t:totable(), g:to('cpu'):totable(), dt)
      assert.same(t:t():totable(), g:t():to('cpu'):totable(), dt .. ' transposed')
    end
  end)

  gpu_it('copies through pinned host buffers', function()
    local buf = cuda.HostBuffer(4 * 1000)
    assert.is_true(cuda.pinned_bytes() >= 4000)
    local h = buf:tensor({ 10, 100 }, 'float32')
    h:copy_(gl.randn({ 10, 100 }, { seed = next_seed() }))
    local g = h:to(DEV)
    assert.equal(0, g:to('cpu'):max_abs_diff(h))
    assert.has_error(function() buf:tensor({ 2000 }, 'float32') end)
    local keep = buf:tensor({ 1000 }, 'float32')
    keep:fill_(3)
    h = nil; g = nil
    collectgarbage()
    buf:free()  -- the memory stays while `keep` uses it
    assert.equal(3, keep:get(1000))
    assert.equal(3, keep:to(DEV):to('cpu'):get(1))
  end)
end)

-- ------------------------------------------------------------ elementwise
describe('CUDA elementwise kernels vs CPU #cuda', function()
  local U = {
    { 'neg', lib.GL_U_NEG }, { 'exp', lib.GL_U_EXP }, { 'log', lib.GL_U_LOG, pos = true },
    { 'sqrt', lib.GL_U_SQRT, pos = true }, { 'rsqrt', lib.GL_U_RSQRT, pos = true }, { 'tanh', lib.GL_U_TANH },
    { 'abs', lib.GL_U_ABS }, { 'relu', lib.GL_U_RELU }, { 'relu2', lib.GL_U_RELU2 },
    { 'gelu', lib.GL_U_GELU_TANH }, { 'silu', lib.GL_U_SILU }, { 'sigmoid', lib.GL_U_SIGMOID },
    { 'sin', lib.GL_U_SIN }, { 'cos', lib.GL_U_COS }, { 'square', lib.GL_U_SQUARE },
    { 'reciprocal', lib.GL_U_RECIPROCAL, pos = true }, { 'clamp', lib.GL_U_CLAMP, -0.5, 0.7 },
    { 'pow', lib.GL_U_POW, 1.7, pos = true }, { 'add_scalar', lib.GL_U_ADD_SCALAR, 0.25 },
    { 'mul_scalar', lib.GL_U_MUL_SCALAR, -1.5 }, { 'affine', lib.GL_U_AFFINE, 0.5, -2 },
    { 'rsub_scalar', lib.GL_U_RSUB_SCALAR, 3 }, { 'rdiv_scalar', lib.GL_U_RDIV_SCALAR, 2, pos = true },
    { 'softcap', lib.GL_U_SOFTCAP, 1.5 },
  }

  gpu_it('unary forward and backward, every op, float32 and bfloat16, strided', function()
    for _, u in ipairs(U) do
      local name, op, p0, p1 = u[1], u[2], u[3] or 0, u[4] or 0
      for _, dt in ipairs({ 'float32', 'bfloat16' }) do
        for _, layout in ipairs({ 'contiguous', 'transposed' }) do
          local shape = { 37, 29 }
          local dist = u.pos and { 0.5, 2 } or nil
          local ins = { x = pair(shape, { dtype = dt, layout = layout, dist = dist }),
                        dy = pair(shape, { dtype = dt }) }
          compare(ins, function(S)
            local y = S.out(shape, dt, layout == 'transposed' and 'transposed' or nil)
            K(lib.gl_unary(op, y.c, S.x.c, p0, p1))
            local dx = S.out(shape, dt)
            K(lib.gl_unary_backward(op, dx.c, S.dy.c, S.x.c, p0, p1))
            return y, dx
          end, dt, ('unary %s %s %s'):format(name, dt, layout))
        end
      end
    end
  end)

  gpu_it('unary into another dtype and in place', function()
    local ins = { x = pair({ 5, 7, 9 }, { dtype = 'bfloat16' }), z = pair({ 5, 7, 9 }) }
    compare(ins, function(S)
      local y = S.out({ 5, 7, 9 }, 'float32')
      K(lib.gl_unary(lib.GL_U_GELU_TANH, y.c, S.x.c, 0, 0))
      local z = S.z:clone()
      K(lib.gl_unary(lib.GL_U_TANH, z.c, z.c, 0, 0))
      return y, z
    end, 'bfloat16', 'unary mixed / in place')
  end)

  local B = {
    { 'add', lib.GL_B_ADD }, { 'sub', lib.GL_B_SUB }, { 'mul', lib.GL_B_MUL }, { 'div', lib.GL_B_DIV },
    { 'pow', lib.GL_B_POW, pos = true }, { 'maximum', lib.GL_B_MAXIMUM }, { 'minimum', lib.GL_B_MINIMUM },
    { 'eq', lib.GL_B_EQ, cmp = true }, { 'ne', lib.GL_B_NE, cmp = true }, { 'lt', lib.GL_B_LT, cmp = true },
    { 'le', lib.GL_B_LE, cmp = true }, { 'gt', lib.GL_B_GT, cmp = true }, { 'ge', lib.GL_B_GE, cmp = true },
  }

  gpu_it('binary, every op, with broadcast and transposed operands', function()
    for _, b in ipairs(B) do
      for _, dt in ipairs({ 'float32', 'bfloat16', 'float64' }) do
        local shape = { 13, 3, 41 }
        local dist = b.pos and { 0.5, 2 } or nil
        local ins = { a = pair(shape, { dtype = dt, layout = 'transposed', dist = dist }),
                      b = pair(shape, { dtype = dt, layout = 'broadcast', dist = dist }) }
        compare(ins, function(S)
          local y = S.out(shape, dt)
          K(lib.gl_binary(b[2], y.c, S.a.c, S.b.c))
          if not b.cmp then return y end
          local mask = S.out(shape, 'uint8')  -- comparisons into any dtype, e.g. a mask
          K(lib.gl_binary(b[2], mask.c, S.a.c, S.b.c))
          return y, mask
        end, dt, ('binary %s %s'):format(b[1], dt))
      end
    end
  end)

  -- contiguous operands starting 16-byte aligned move as 16-byte vectors
  -- (kernels/elementwise.cu, ew_vec_body), the tail element by element; the
  -- same values one element off alignment take the element-wise kernels:
  -- both agree with the CPU, and with each other bit for bit
  gpu_it('16-byte vectors in unary, its backward and binary: odd sizes, the tail, misaligned, in place', function()
    for _, dt in ipairs({ 'float32', 'bfloat16', 'float64' }) do
      for _, n in ipairs({ 1, 7, 8, 9, 17, 1029 }) do
        local ins = { a = pair({ n }, { dtype = dt }), b = pair({ n }, { dtype = dt }) }
        local function run(S, a, b)
          local y = S.out({ n }, dt); K(lib.gl_unary(lib.GL_U_GELU_TANH, y.c, a.c, 0, 0))
          local dx = S.out({ n }, dt); K(lib.gl_unary_backward(lib.GL_U_TANH, dx.c, b.c, a.c, 0, 0))
          local z = S.out({ n }, dt); K(lib.gl_binary(lib.GL_B_MUL, z.c, a.c, b.c))
          local w = b:clone(); K(lib.gl_binary(lib.GL_B_SUB, w.c, w.c, a.c))  -- in place
          return y, dx, z, w
        end
        local vec
        compare(ins, function(S)
          local r = { run(S, S.a, S.b) }
          if S.gpu then vec = r end
          return unpack(r)
        end, dt, ('16-byte vectors %s n=%d'):format(dt, n))
        local function shifted(t)  -- the same values starting one element past a 16-byte boundary
          local u = gl.empty({ n + 1 }, { dtype = dt, device = DEV }):narrow(1, 2, n)
          u:copy_(t)
          return u
        end
        local scalar = { run({ out = function(sh, d) return shifted(gl.zeros(sh, { dtype = d, device = DEV })) end },
                             shifted(ins.a[2]), shifted(ins.b[2])) }
        for i = 1, #vec do
          assert.equal(0, vec[i]:to('cpu'):max_abs_diff(scalar[i]:to('cpu')),
                       ('16-byte vectors %s n=%d output %d: differs from the element-wise kernel'):format(dt, n, i))
        end
      end
    end
  end)

  gpu_it('where with a uint8 condition', function()
    local shape = { 17, 23 }
    local c = id_pair(shape, 2, 'int64')
    local ins = { c = { c[1]:to('uint8'), c[2]:to('uint8') }, a = pair(shape), b = pair(shape, { layout = 'transposed' }) }
    compare(ins, function(S)
      local y = S.out(shape)
      K(lib.gl_where(y.c, S.c.c, S.a.c, S.b.c))
      return y
    end, 'float32', 'where')
  end)

  gpu_it('copies across dtypes and layouts, and fills', function()
    local ins = { x = pair({ 19, 31 }, { layout = 'transposed' }), i = id_pair({ 19, 31 }, 1000, 'int32') }
    compare(ins, function(S)
      local a = S.out({ 19, 31 }, 'bfloat16'); K(lib.gl_copy(a.c, S.x.c))
      local b = S.out({ 19, 31 }, 'float64'); K(lib.gl_copy(b.c, a.c))
      local c = S.out({ 19, 31 }, 'int64'); K(lib.gl_copy(c.c, S.i.c))
      local d = S.out({ 19, 31 }, 'float32', 'transposed'); K(lib.gl_copy(d.c, S.x.c))
      local e = S.out({ 19, 31 }, 'int64'); K(lib.gl_copy(e.c, S.x.c))  -- truncation toward zero
      local f = S.out({ 19, 31 }); K(lib.gl_copy(f.c, S.x:narrow(1, 1, 1):expand({ 19, 31 }).c))
      local g = S.out({ 7, 5 }, 'bfloat16'); K(lib.gl_fill(g.c, 1.2345))
      local h = S.out({ 7, 5 }, 'int32', 'transposed'); K(lib.gl_fill(h.c, -3))
      local z = S.out({ 9, 4 }); K(lib.gl_fill(z.c, 0))
      return a, b, c, d, e, f, g, h, z
    end, 'float32', 'copy / fill')
  end)

  gpu_it('draws the same Philox numbers as the CPU', function()
    local seed = next_seed()
    for _, dt in ipairs({ 'float32', 'float64', 'bfloat16' }) do
      check_close(gl.randn({ 33, 65 }, { seed = seed, offset = 7, dtype = dt, device = DEV }),
                  gl.randn({ 33, 65 }, { seed = seed, offset = 7, dtype = dt }), dt, 'randn ' .. dt)
      check_close(gl.uniform({ 1001 }, -2, 3, { seed = seed, dtype = dt, device = DEV }),
                  gl.uniform({ 1001 }, -2, 3, { seed = seed, dtype = dt }), dt, 'uniform ' .. dt)
    end
    local g = gl.empty({ 8, 12 }, { device = DEV }):t()
    local c = gl.empty({ 8, 12 }):t()
    g:normal_(1, 2, { seed = seed })
    c:normal_(1, 2, { seed = seed })
    check_close(g, c, 'float32', 'normal_ on a transposed view')
  end)

  gpu_it('dropout keeps the CPU mask', function()
    local ins = { x = pair({ 23, 45 }, { layout = 'transposed' }), y = pair({ 11, 7 }, { dtype = 'bfloat16' }) }
    local seed = next_seed()
    compare(ins, function(S)
      local a = S.out({ 23, 45 }); K(lib.gl_dropout(a.c, S.x.c, 0.3, seed, 11))
      local b = S.out({ 11, 7 }, 'bfloat16'); K(lib.gl_dropout(b.c, S.y.c, 0.5, seed, 0))
      local c = S.out({ 23, 45 }); K(lib.gl_dropout(c.c, S.x.c, 0, seed, 0))
      local d = S.out({ 23, 45 }); K(lib.gl_dropout(d.c, S.x.c, 0.95, seed, 0))
      return a, b, c, d
    end, 'float32', 'dropout')
    -- p = 1 would scale nothing by 1 / (1 - p): refused on both devices
    local out = gl.empty({ 23, 45 }, { device = DEV })
    assert.equal(-1, lib.gl_dropout(out.c, ins.x[2].c, 1, seed, 0))
    assert.truthy(ffi.string(lib.gl_last_error()):find('expected 0 <= p < 1', 1, true))
  end)

  gpu_it('rope forward and inverse, strided and in place', function()
    for _, dt in ipairs({ 'float32', 'bfloat16' }) do
      local ins = { x = pair({ 2, 9, 3, 16 }, { dtype = dt, layout = 'transposed' }),
                    cos = pair({ 9, 8 }), sin = pair({ 9, 8 }, { layout = 'narrow' }) }
      compare(ins, function(S)
        local y = S.out({ 2, 9, 3, 16 }, dt); K(lib.gl_rope(y.c, S.x.c, S.cos.c, S.sin.c, 0))
        local z = y:clone(); K(lib.gl_rope(z.c, z.c, S.cos.c, S.sin.c, 1))
        return y, z
      end, dt, 'rope ' .. dt)
    end
  end)
end)

-- ------------------------------------------------------------ reductions
describe('CUDA reductions vs CPU #cuda', function()
  local R = { { 'sum', lib.GL_R_SUM }, { 'mean', lib.GL_R_MEAN }, { 'max', lib.GL_R_MAX }, { 'min', lib.GL_R_MIN },
              { 'sumsq', lib.GL_R_SUMSQ }, { 'norm2', lib.GL_R_NORM2 } }

  local function keep_shape(shape, mask)
    local s = {}
    for d = 1, #shape do s[d] = bit.band(mask, bit.lshift(1, d - 1)) ~= 0 and 1 or shape[d] end
    return s
  end

  gpu_it('reduce over dims masks, row and column shapes, with splits', function()
    local cases = {
      { { 5, 7, 9 }, { 1, 2, 4, 5, 7 }, 'transposed' },
      { { 3, 100003 }, { 2, 3 } },      -- long rows: block per output with splits
      { { 4099, 7 }, { 1 } },           -- column sums: thread per output with splits
      { { 33, 70 }, { 1, 2 }, 'narrow' },
    }
    for _, cs in ipairs(cases) do
      local shape, masks, layout = cs[1], cs[2], cs[3]
      for _, dt in ipairs({ 'float32', 'bfloat16', 'float64' }) do
        local ins = { x = pair(shape, { dtype = dt, layout = layout, dist = { 0.5, 1.5 } }) }
        for _, mask in ipairs(masks) do
          for _, r in ipairs(R) do
            compare(ins, function(S)
              local out_dt = dt == 'float64' and 'float64' or 'float32'
              local y = S.out(keep_shape(shape, mask), out_dt)
              K(lib.gl_reduce(r[2], y.c, S.x.c, mask))
              return y
            end, dt == 'float64' and 'float64' or 'float32',
               ('reduce %s mask %d %s {%s}'):format(r[1], mask, dt, table.concat(shape, ',')))
          end
        end
      end
    end
  end)

  gpu_it('max over a dim with first-occurrence argmax', function()
    for _, dt in ipairs({ 'float32', 'bfloat16' }) do
      local shape = { 6, 77, 5 }
      local ins = { x = pair(shape, { dtype = dt, layout = 'transposed' }) }
      for dim = 0, 2 do
        compare(ins, function(S)
          local ks = { 6, 77, 5 }
          ks[dim + 1] = 1
          local v, i = S.out(ks, dt), S.out(ks, 'int64')
          K(lib.gl_reduce_max_dim(v.c, i.c, S.x.c, dim))
          return v, i
        end, dt, ('max_dim %d %s'):format(dim, dt))
      end
    end
  end)

  gpu_it('sum of squares in float64', function()
    for _, layout in ipairs({ 'contiguous', 'transposed' }) do
      local ins = { x = pair({ 301, 257 }, { layout = layout }), b = pair({ 1001 }, { dtype = 'bfloat16' }) }
      compare(ins, function(S)
        local d1, d2 = ffi.new('double[1]'), ffi.new('double[1]')
        K(lib.gl_sumsq(S.x.c, d1))
        K(lib.gl_sumsq(S.b.c, d2))
        return d1[0], d2[0]
      end, 'float64', 'sumsq ' .. layout)
    end
  end)
end)

-- ------------------------------------------------------------ matmul
describe('CUDA matmul (cuBLASLt) vs CPU #cuda', function()
  local function mm(S, a, b, out_shape, dt, alpha, beta, out_layout)
    local y = S.out(out_shape, dt, out_layout)
    K(lib.gl_matmul(y.c, a.c, b.c, alpha or 1, beta or 0))
    return y
  end

  gpu_it('2-d products in every operand layout', function()
    for _, dt in ipairs({ 'float32', 'bfloat16', 'float64' }) do
      local M, Kd, N = 37, 29, 41
      for _, la in ipairs({ 'contiguous', 'transposed', 'narrow' }) do
        for _, lb in ipairs({ 'contiguous', 'transposed' }) do
          local ins = { a = pair({ M, Kd }, { dtype = dt, layout = la }), b = pair({ Kd, N }, { dtype = dt, layout = lb }) }
          compare(ins, function(S)
            return mm(S, S.a, S.b, { M, N }, dt), mm(S, S.a, S.b, { M, N }, dt, 0.5, 0, 'transposed')
          end, dt, ('matmul %s a %s b %s'):format(dt, la, lb))
        end
      end
    end
  end)

  gpu_it('batched, broadcast (folded) and strided batches, alpha and beta', function()
    for _, dt in ipairs({ 'float32', 'bfloat16' }) do
      local ins = {
        a = pair({ 3, 17, 24 }, { dtype = dt }), b = pair({ 3, 24, 9 }, { dtype = dt, layout = 'transposed' }),
        w = pair({ 24, 9 }, { dtype = dt }), c = pair({ 3, 17, 9 }, { dtype = dt }),
        q = pair({ 2, 5, 3, 8 }, { dtype = dt }), k = pair({ 2, 5, 3, 8 }, { dtype = dt }),
        s = pair({ 17, 24, 2 }, { dtype = dt }),
      }
      compare(ins, function(S)
        local plain = mm(S, S.a, S.b, { 3, 17, 9 }, dt)
        local folded = mm(S, S.a, S.w:expand({ 3, 24, 9 }), { 3, 17, 9 }, dt)
        local shared_a = mm(S, S.a:narrow(1, 1, 1):expand({ 3, 17, 24 }), S.b, { 3, 17, 9 }, dt)
        local acc = S.c:clone()
        K(lib.gl_matmul(acc.c, S.a.c, S.b.c, 2, 0.5))
        -- (B, T, H, D) viewed as (B, H, T, D): batch dims that do not coalesce
        local qh, kh = S.q:transpose(2, 3), S.k:transpose(2, 3):transpose(3, 4)
        local att = mm(S, qh, kh, { 2, 3, 5, 5 }, dt)
        -- a non-BLAS layout (stride 2 along K) goes through a copy
        local odd = mm(S, S.s:select(3, 1), S.w, { 17, 9 }, dt)
        return plain, folded, shared_a, acc, att, odd
      end, dt, 'batched matmul ' .. dt)
    end
  end)

  -- the bias in cuBLASLt's epilogue (row-major out, one product, the folded
  -- batch included) and every case it cannot take (transposed out, a strided
  -- or differently typed bias): all equal the CPU's copy-then-accumulate
  gpu_it('matmul with a bias (gl_matmul_bias), in the epilogue and without it', function()
    for _, dt in ipairs({ 'float32', 'bfloat16', 'float64' }) do
      for _, N in ipairs({ 9, 16, 33 }) do
        local ins = { a = pair({ 3, 17, 24 }, { dtype = dt }), w = pair({ N, 24 }, { dtype = dt }),
                      bias = pair({ N }, { dtype = dt }), bias2 = pair({ N, 2 }, { dtype = dt }),
                      b32 = pair({ N }) }
        compare(ins, function(S)
          local wt = S.w:t()
          local function mb(out, a, b, bias) K(lib.gl_matmul_bias(out.c, a.c, b.c, bias.c)); return out end
          local flat = mb(S.out({ 17, N }, dt), S.a:select(1, 2), wt, S.bias)
          local folded = mb(S.out({ 3, 17, N }, dt), S.a, wt:expand({ 3, 24, N }), S.bias)
          local tout = mb(S.out({ 17, N }, dt, 'transposed'), S.a:select(1, 1), wt, S.bias)
          local strided = mb(S.out({ 17, N }, dt), S.a:select(1, 3), wt, S.bias2:select(2, 2))
          local mixed = mb(S.out({ 17, N }, dt), S.a:select(1, 3), wt, S.b32)
          return flat, folded, tout, strided, mixed
        end, dt, ('matmul_bias %s N=%d'):format(dt, N))
      end
    end
    local ok, err = pcall(function()
      K(lib.gl_matmul_bias(gl.empty({ 2, 3 }).c, gl.empty({ 2, 4 }).c, gl.empty({ 4, 3 }).c, gl.empty({ 4 }).c))
    end)
    assert.is_false(ok)
    assert.matches('gl_matmul_bias: bias has shape {4}, expected {3}', err)
  end)

  -- the MLP's fusions: cuBLASLt's GELU_AUX_BIAS / GELU, DGELU_BGRAD, BGRADB
  -- (row-major out) and BGRADA (transposed out) where the layout allows them,
  -- the product and then the unfused kernels where it does not (N = 9: an aux
  -- ld not a multiple of 8; float64; GELU into a transposed out)
  gpu_it('matmul epilogues (gl_matmul_epilogue, gl_linear_backward), in cuBLASLt and without it', function()
    local M, C = 17, 24
    for _, dt in ipairs({ 'float32', 'bfloat16', 'float64' }) do
      for _, N in ipairs({ 8, 32, 9 }) do
        local ins = { a = pair({ M, C }, { dtype = dt }), w = pair({ N, C }, { dtype = dt }),
                      bias = pair({ N }, { dtype = dt }), g = pair({ M, N }, { dtype = dt }),
                      pre = pair({ M, C }, { dtype = dt }) }
        compare(ins, function(S)
          local function E(e, out, a, b, bias, aux)
            K(lib.gl_matmul_epilogue(e, out.c, a.c, b.c, bias and bias.c, aux and aux.c))
            return out
          end
          local aux, db = S.out({ M, N }, dt), S.out({ N }, dt)
          local h = E(lib.GL_EPI_GELU, S.out({ M, N }, dt), S.a, S.w:t(), S.bias, aux)
          local h_nobias = E(lib.GL_EPI_GELU, S.out({ M, N }, dt), S.a, S.w:t(), nil, nil)
          local h_t = E(lib.GL_EPI_GELU, S.out({ M, N }, dt, 'transposed'), S.a, S.w:t(), S.bias, nil)
          local dgelu = E(lib.GL_EPI_DGELU, S.out({ M, N }, dt), S.a, S.w:t(), db, aux)
          -- a linear layer's backward whose input was gelu(pre): dx is d(pre)
          local dx, dW, dbias, dxb = S.out({ M, C }, dt), S.out({ N, C }, dt), S.out({ N }, dt), S.out({ C }, dt)
          K(lib.gl_linear_backward(dx.c, dW.c, dbias.c, dxb.c, S.g.c, S.a.c, S.w.c, S.pre.c))
          local dW_t, db_t = S.out({ N, C }, dt, 'transposed'), S.out({ N }, dt)
          E(lib.GL_EPI_BGRAD, dW_t, S.g:t(), S.a, db_t, nil)
          return aux, h, h_nobias, h_t, dgelu, db, dx, dW, dbias, dxb, dW_t, db_t
        end, dt, ('matmul_epilogue %s N=%d'):format(dt, N))
      end
    end
  end)

  gpu_it('the fused MLP (gl.mlp), GELU and ReLU^2, forward and backward', function()
    for _, dt in ipairs({ 'float32', 'bfloat16' }) do
      for _, act in ipairs({ 'gelu', 'relu2' }) do
        local ins = { x = pair({ 2, 9, 16 }, { dtype = dt }), w1 = pair({ 64, 16 }, { dtype = dt }),
                      b1 = pair({ 64 }, { dtype = dt }), w2 = pair({ 16, 64 }, { dtype = dt }),
                      b2 = pair({ 16 }, { dtype = dt }), g = pair({ 2, 9, 16 }, { dtype = dt }) }
        compare(ins, function(S)
          local leaves = {}
          for _, k in ipairs({ 'x', 'w1', 'b1', 'w2', 'b2' }) do leaves[k] = S[k]:detach():requires_grad_() end
          local y = gl.mlp(leaves.x, leaves.w1, leaves.b1, leaves.w2, leaves.b2, act)
          y:backward(S.g)
          return y:detach(), leaves.x.grad, leaves.w1.grad, leaves.b1.grad, leaves.w2.grad, leaves.b2.grad
          -- relu^2 in bfloat16: the GPU squares a bf16-rounded pre-activation
          -- and keeps the square in bf16, so its relative error is about twice
          -- gelu's (w2's gradient reached 1.05% of its scale at run seed
          -- 509914000; the CPU reference squares in float32)
        end, dt, ('mlp %s %s'):format(act, dt), act == 'relu2' and 2 or 1)
      end
    end
  end)
end)

-- ------------------------------------------------------------ rows
describe('CUDA softmax and norms vs CPU #cuda', function()
  gpu_it('softmax and log_softmax, forward and backward', function()
    for _, dt in ipairs({ 'float32', 'bfloat16', 'float64' }) do
      for _, shape in ipairs({ { 7, 13, 33 }, { 5, 3001 } }) do
        local ins = { x = pair(shape, { dtype = dt, layout = 'transposed' }), g = pair(shape, { dtype = dt }) }
        for log = 0, 1 do
          compare(ins, function(S)
            local y = S.out(shape, dt); K(lib.gl_softmax(y.c, S.x.c, log))
            local dx = S.out(shape, dt, 'transposed'); K(lib.gl_softmax_backward(dx.c, y.c, S.g.c, log))
            return y, dx
          end, dt, ('softmax log=%d %s {%s}'):format(log, dt, table.concat(shape, ',')))
        end
      end
    end
  end)

  gpu_it('layernorm and rmsnorm, forward and backward, with and without affine', function()
    for _, dt in ipairs({ 'float32', 'bfloat16', 'float64' }) do
      local sdt = dt == 'float64' and 'float64' or 'float32'
      for _, shape in ipairs({ { 3, 17, 96 }, { 1000, 67 } }) do
        local C, lead = shape[#shape], copy_shape(shape)
        lead[#lead] = nil
        local ins = { x = pair(shape, { dtype = dt, layout = 'narrow' }), g = pair(shape, { dtype = dt }),
                      w = pair({ C }, { dtype = dt }), b = pair({ C }, { dtype = dt }) }
        for _, affine in ipairs({ true, false }) do
          compare(ins, function(S)
            local w, b = affine and S.w or nil, affine and S.b or nil
            local y, mean, rstd = S.out(shape, dt), S.out(lead, sdt), S.out(lead, sdt)
            K(lib.gl_layernorm_forward(y.c, mean.c, rstd.c, S.x.c, w and w.c, b and b.c, 1e-5))
            local dx, dw, db = S.out(shape, dt), S.out({ C }, dt), S.out({ C }, dt)
            K(lib.gl_layernorm_backward(dx.c, dw.c, db.c, S.g.c, S.x.c, w and w.c, mean.c, rstd.c))
            local ry, rr = S.out(shape, dt), S.out(lead, sdt)
            K(lib.gl_rmsnorm_forward(ry.c, rr.c, S.x.c, w and w.c, 1e-6))
            local rdx, rdw = S.out(shape, dt), S.out({ C }, dt)
            K(lib.gl_rmsnorm_backward(rdx.c, rdw.c, S.g.c, S.x.c, w and w.c, rr.c))
            return y, mean, rstd, dx, dw, db, ry, rr, rdx, rdw
          end, dt, ('norms %s {%s} affine=%s'):format(dt, table.concat(shape, ','), tostring(affine)))
        end
      end
    end
  end)

  -- gl_add_norm_forward: the 16-byte vector path (bf16, C % 8 == 0, aligned
  -- contiguous rows), the scalar one (C = 67, padded rows of x), and a row
  -- too wide for shared memory (the unfused ops); gl_norm_backward_add with
  -- and without the residual gradient
  gpu_it('residual add + norm (gl_add_norm_forward, gl_norm_backward_add)', function()
    for _, dt in ipairs({ 'float32', 'bfloat16', 'float64' }) do
      local sdt = dt == 'float64' and 'float64' or 'float32'
      for _, case in ipairs({ { { 3, 17, 96 }, 'contiguous' }, { { 200, 67 }, 'narrow' }, { { 2, 13000 }, 'contiguous' } }) do
        local shape = case[1]
        local C, lead = shape[#shape], copy_shape(shape)
        lead[#lead] = nil
        local ins = { x = pair(shape, { dtype = dt, layout = case[2] }), r = pair(shape, { dtype = dt }),
                      g = pair(shape, { dtype = dt }), dres = pair(shape, { dtype = dt }),
                      w = pair({ C }, { dtype = dt }), b = pair({ C }, { dtype = dt }) }
        compare(ins, function(S)
          -- the float32 reference of a bfloat16 run takes s as bfloat16 stores it (the GPU's statistics,
          -- like the unfused ops', are of the rounded s; near-zero means would otherwise differ by it)
          local x, r = S.x, S.r
          if not S.gpu and dt == 'bfloat16' then x, r = (S.x + S.r):to('bfloat16'):to('float32'), gl.zeros(shape) end
          local s, y, mean, rstd = S.out(shape, dt), S.out(shape, dt), S.out(lead, sdt), S.out(lead, sdt)
          K(lib.gl_add_norm_forward(s.c, y.c, mean.c, rstd.c, x.c, r.c, S.w.c, S.b.c, 1e-5, 1))
          local dx, dw, db = S.out(shape, dt), S.out({ C }, dt), S.out({ C }, dt)
          K(lib.gl_norm_backward_add(dx.c, dw.c, db.c, S.g.c, s.c, S.w.c, mean.c, rstd.c, S.dres.c, 1))
          local rs, ry, rr = S.out(shape, dt), S.out(shape, dt), S.out(lead, sdt)
          K(lib.gl_add_norm_forward(rs.c, ry.c, nil, rr.c, x.c, r.c, nil, nil, 1e-6, 0))
          local rdx = S.out(shape, dt)
          K(lib.gl_norm_backward_add(rdx.c, nil, nil, S.g.c, rs.c, nil, nil, rr.c, nil, 0))
          return s, y, mean, rstd, dx, dw, db, rs, ry, rr, rdx
        end, dt, ('add_norm %s {%s} %s'):format(dt, table.concat(shape, ','), case[2]))
      end
    end
  end)
end)

-- ------------------------------------------------------------ index ops
describe('CUDA embedding and index ops vs CPU #cuda', function()
  gpu_it('embedding forward and deterministic backward', function()
    for _, dt in ipairs({ 'float32', 'bfloat16', 'float64' }) do
      for _, idt in ipairs({ 'int64', 'int32' }) do
        local V, C = 1000, 70
        local ins = { tab = pair({ V, C }, { dtype = dt, layout = 'narrow' }), ids = id_pair({ 4, 33 }, 60, idt),
                      g = pair({ 4, 33, C }, { dtype = dt, layout = 'transposed' }) }
        compare(ins, function(S)
          local e = S.out({ 4, 33, C }, dt); K(lib.gl_embedding_forward(e.c, S.tab.c, S.ids.c))
          local d = S.out({ V, C }, dt); K(lib.gl_embedding_backward(d.c, S.g.c, S.ids.c))
          local e2 = S.out({ 33, 4, C }, dt); K(lib.gl_embedding_forward(e2.c, S.tab.c, S.ids:t().c))
          return e, d, e2
        end, dt, ('embedding %s ids %s'):format(dt, idt))
      end
    end
    -- wide tables use several column blocks; repeated ids keep position order
    local ins = { ids = id_pair({ 3000 }, 7, 'int64'), g = pair({ 3000, 300 }) }
    compare(ins, function(S)
      local d = S.out({ 40, 300 }); K(lib.gl_embedding_backward(d.c, S.g.c, S.ids.c))
      return d
    end, 'float32', 'embedding backward, many repeats')
  end)

  -- the backward sorts the ids once (a radix sort of 8 bits a pass over
  -- tiles of 1024 positions, kernels/index.cu) and sums each row's positions
  -- in order: float32 equals the CPU's position-order sums bit for bit
  gpu_it('embedding backward over sort tiles and passes, repeated ids and the table edges', function()
    local cases = {  -- V (1, 2 or 3 radix passes), n (tile edges), C (column blocks), ids drawn from [0, hot)
      { 1, 5, 7, 1 }, { 37, 1023, 5, 37 }, { 256, 1024, 33, 3 }, { 257, 1025, 300, 257 }, { 1000, 2100, 70, 1000 },
      { 70000, 1100, 3, 70000 },
    }
    for _, cs in ipairs(cases) do
      local V, n, C, hot = cs[1], cs[2], cs[3], cs[4]
      math.randomseed(twin.next_seed())
      local vals = {}
      for i = 1, n do vals[i] = math.random(0, hot - 1) end
      for i = 1, n, 7 do vals[i] = V - 1 end  -- the last row, repeated
      for i = 3, n, 11 do vals[i] = 0 end     -- the first row, repeated
      for _, dt in ipairs({ 'float32', 'bfloat16' }) do
        local idt = dt == 'float32' and 'int64' or 'int32'
        local t = gl.tensor(vals, { dtype = idt })
        local ins = { ids = { t, t:to(DEV) }, g = pair({ n, C }, { dtype = dt, layout = C > 1 and 'transposed' or nil }) }
        local what = ('embedding backward V=%d n=%d C=%d %s'):format(V, n, C, dt)
        local ref
        compare(ins, function(S)
          local d = S.out({ V, C }, dt); K(lib.gl_embedding_backward(d.c, S.g.c, S.ids.c))
          if dt == 'float32' then  -- the same sums in the same order
            if S.gpu then assert.equal(0, d:to('cpu'):max_abs_diff(ref), what .. ': not bit for bit')
            else ref = d end
          end
          return d
        end, dt, what)
      end
    end
  end)

  -- id checks queue on the device (no host wait inside a step) and are read
  -- where the host waits: cuda.check_flags, a copy to the host, synchronize
  gpu_it('reports out-of-range ids at the next host wait, with the CPU message, staying in bounds', function()
    local function strip(e) return (e:gsub('^.-: gl_', 'gl_')) end
    local tab = gl.randn({ 10, 4 })
    local bad = gl.tensor({ 1, 2, 10, 3 }, { dtype = 'int64' })
    local okc, errc = pcall(function() K(lib.gl_embedding_forward(gl.empty({ 4, 4 }).c, tab.c, bad.c)) end)
    assert.is_false(okc)
    local out = output({ 4, 4 }, 'float32', true)
    K(lib.gl_embedding_forward(out.c, tab:to(DEV).c, bad:to(DEV).c))  -- queued, not waited for
    local okg, errg = pcall(cuda.check_flags)
    assert.is_false(okg)
    assert.equal(strip(errc), strip(errg))
    cuda.check_flags()  -- read once: the queue is empty again
    local got = out:to('cpu')
    for c = 1, 4 do
      assert.equal(tab:get(2, c), got:get(1, c))
      assert.is_true(got:get(3, c) ~= got:get(3, c))  -- the bad row is NaN, nothing read out of bounds
    end
    -- a copy to the host reads the checks; the first bad check in queue order is reported
    local logits, tg = gl.randn({ 3, 5 }), gl.tensor({ 1, 7, 2 }, { dtype = 'int64' })
    local losses = output({ 3 }, 'float32', true)
    K(lib.gl_cross_entropy_forward(losses.c, nil, logits:to(DEV).c, tg:to(DEV).c, -100, 0))
    K(lib.gl_embedding_forward(out.c, tab:to(DEV).c, bad:to(DEV).c))
    okg, errg = pcall(function() return losses:to('cpu') end)
    assert.is_false(okg)
    assert.matches('gl_cross_entropy_forward: targets%[1%] is 7, expected 0 <= targets < 5', errg)
    assert.is_true(losses:get(2) ~= losses:get(2))
    -- backward, gather and scatter skip a bad id; each names its op
    local g = gl.randn({ 4, 4 }):to(DEV)
    K(lib.gl_embedding_backward(gl.zeros({ 10, 4 }, { device = DEV }).c, g.c, bad:to(DEV).c))
    okg, errg = pcall(cuda.synchronize)
    assert.matches('gl_embedding_backward: ids%[2%] is 10, expected 0 <= ids < 10 %(rows of dtable%)', errg)
    local idx = gl.tensor({ { 0, 4 }, { 1, 2 } }, { dtype = 'int64' }):to(DEV)
    local sc = gl.zeros({ 2, 4 }, { device = DEV })
    K(lib.gl_scatter_add(sc.c, 1, idx.c, gl.ones({ 2, 2 }, { device = DEV }).c))
    okg, errg = pcall(cuda.check_flags, 0)
    assert.matches('gl_scatter_add: idx%[1%] is 4, expected 0 <= idx < 4 %(size of out in dim%)', errg)
    assert.same({ { 1, 0, 0, 0 }, { 0, 1, 1, 0 } }, sc:totable())
    -- more checks than the queue holds without a wait: the full queue is read and reused
    local good = gl.tensor({ 1, 2, 3, 0 }, { dtype = 'int64' }):to(DEV)
    for _ = 1, 150 do K(lib.gl_embedding_forward(out.c, tab:to(DEV).c, good.c)) end
    K(lib.gl_embedding_forward(out.c, tab:to(DEV).c, bad:to(DEV).c))
    assert.has_error(cuda.check_flags)
    cuda.check_flags()
  end)

  gpu_it('index_select, gather, scatter_add and index_add over every dim', function()
    local shape = { 5, 7, 9 }
    for _, dt in ipairs({ 'float32', 'int64', 'bfloat16' }) do
      for dim = 0, 2 do
        local n = shape[dim + 1]
        local ishape = copy_shape(shape)
        ishape[dim + 1] = 4
        local xs = dt == 'int64' and id_pair(shape, 1000, 'int64') or pair(shape, { dtype = dt, layout = 'transposed' })
        local src = dt == 'int64' and id_pair(ishape, 1000, 'int64') or pair(ishape, { dtype = dt })
        local ins = { x = xs, src = src, i1 = id_pair({ 4 }, n, 'int32'), ig = id_pair(ishape, n, 'int64'),
                      base = dt == 'int64' and id_pair(shape, 1000, 'int64') or pair(shape, { dtype = dt }) }
        compare(ins, function(S)
          local sel = S.out(ishape, dt); K(lib.gl_index_select(sel.c, S.x.c, dim, S.i1.c))
          local gat = S.out(ishape, dt); K(lib.gl_gather(gat.c, S.x.c, dim, S.ig.c))
          local sca = S.base:clone(); K(lib.gl_scatter_add(sca.c, dim, S.ig.c, S.src.c))
          local iad = S.base:clone(); K(lib.gl_index_add(iad.c, dim, S.i1.c, S.src.c))
          return sel, gat, sca, iad
        end, dt, ('index ops %s dim %d'):format(dt, dim))
      end
    end
  end)
end)

-- attention: spec/cuda_attention_spec.lua

-- ------------------------------------------------------------ loss and optimizers
describe('CUDA cross-entropy and optimizers vs CPU #cuda', function()
  gpu_it('cross-entropy forward and backward with ignore_index and softcap', function()
    for _, dt in ipairs({ 'float32', 'bfloat16' }) do
      local N, V = 37, 1001
      local ins = { x = pair({ N, V }, { dtype = dt, layout = 'narrow' }), t = id_pair({ N }, V, 'int64', -100),
                    s = pair({ 1 }) }
      for _, cap in ipairs({ 0, 15 }) do
        compare(ins, function(S)
          local loss, lse = S.out({ N }, 'float32'), S.out({ N }, 'float32')
          K(lib.gl_cross_entropy_forward(loss.c, lse.c, S.x.c, S.t.c, -100, cap))
          local d = S.out({ N, V }, dt)
          K(lib.gl_cross_entropy_backward(d.c, S.x.c, S.t.c, lse.c, -100, cap, 1 / N, nil))
          local inplace = S.x:clone()  -- dlogits may overwrite the logits
          K(lib.gl_cross_entropy_backward(inplace.c, inplace.c, S.t.c, lse.c, -100, cap, 1 / N, nil))
          local scaled = S.out({ N, V }, dt)  -- a factor read on the device (no host wait)
          K(lib.gl_cross_entropy_backward(scaled.c, S.x.c, S.t.c, lse.c, -100, cap, 1 / N, S.s.c))
          return loss, lse, d, inplace, scaled
        end, dt, ('cross-entropy %s softcap %g'):format(dt, cap))
      end
    end
  end)

  gpu_it('Newton-Schulz runs in bfloat16 on the GPU (fp32 in, fp32 out) against float32 on the CPU', function()
    local optim = require 'gptlua.optim'
    for _, shape in ipairs({ { 48, 80 }, { 80, 48 } }) do  -- wide, and tall (transposed inside)
      local G = gl.randn(shape, { seed = 7 })
      local Xc = optim.newton_schulz(G, 5)
      local Gd = G:to(DEV)
      assert.equal('bfloat16', optim.ns_dtype(Gd:to('bfloat16')))  -- Muon's choice for a bf16 parameter
      assert.is_nil(optim.ns_dtype(Gd)); assert.is_nil(optim.ns_dtype(G:to('bfloat16')))
      local Xg = optim.newton_schulz(Gd, 5, 'bfloat16')
      assert.equal('float32', Xg.dtype)
      local scale = Xc:abs():max():item()
      local bf = Xg:to('cpu'):max_abs_diff(Xc) / scale
      local f32 = optim.newton_schulz(Gd, 5):to('cpu'):max_abs_diff(Xc) / scale
      -- bf16 products: about 6% of the largest entry at most (measured 4-6%),
      -- and visibly not the float32 iteration (which agrees to ~1e-6)
      assert.is_true(bf < 0.1, 'bf16 Newton-Schulz off by ' .. bf)
      assert.is_true(f32 < 1e-4, 'fp32 Newton-Schulz off by ' .. f32)
      assert.is_true(bf > 10 * f32, 'the bfloat16 iteration did not run in bfloat16')
    end
  end)

  gpu_it('AdamW and momentum on slices, with bfloat16 grads', function()
    local n = 1003
    for _, gdt in ipairs({ 'float32', 'bfloat16' }) do
      local ins = { p = pair({ n }), g = pair({ n }, { dtype = gdt }), m = pair({ n }), v = pair({ n }, { dist = { 0, 1 } }) }
      compare(ins, function(S)
        local p, m, v = S.p:clone(), S.m:clone(), S.v:clone()
        for step = 1, 3 do
          K(lib.gl_adamw_update(p.c, S.g.c, m.c, v.c, 13, 900, 1e-3, 0.9, 0.95, 1e-8, 0.1, step))
        end
        local out, buf = S.out({ n }, 'float32'), S.m:clone()
        K(lib.gl_momentum_update(out.c, buf.c, S.g.c, 0, n, 0.95, 1))
        local g2, buf2 = S.g:clone(), S.v:clone()
        K(lib.gl_momentum_update(g2.c, buf2.c, g2.c, 5, 500, 0.9, 0))  -- out aliasing grad
        return p, m, v, out, buf, g2, buf2
      end, 'float32', 'optimizers, grads ' .. gdt)
    end
    local ins = { p = pair({ 257 }, { dtype = 'float64' }), g = pair({ 257 }, { dtype = 'float64' }),
                  m = pair({ 257 }, { dtype = 'float64' }), v = pair({ 257 }, { dtype = 'float64', dist = { 0, 1 } }) }
    compare(ins, function(S)
      local p, m, v = S.p:clone(), S.m:clone(), S.v:clone()
      K(lib.gl_adamw_update(p.c, S.g.c, m.c, v.c, 0, 257, 1e-2, 0.9, 0.999, 1e-8, 0, 1))
      return p, m, v
    end, 'float64', 'AdamW float64')
  end)

  -- one launch for the whole model: segments of every size around the
  -- 4096-element chunk, two rate classes, grads fp32 / bf16, master copies
  -- rounded into bf16 and fp32 outputs, a float64 list (the per-tensor path)
  gpu_it('AdamW over many tensors in one call, and the sum of squares of many, as the single ops', function()
    local sizes = { 4096, 1, 4097, 0, 8191, 33 }
    local k = #sizes
    for _, pdt in ipairs({ 'float32', 'float64' }) do
      for _, gdt in ipairs(pdt == 'float64' and { 'float64' } or { 'float32', 'bfloat16' }) do
        local ins = {}
        for i, n in ipairs(sizes) do
          ins['p' .. i], ins['g' .. i] = pair({ n }, { dtype = pdt }), pair({ n }, { dtype = gdt })
          ins['m' .. i], ins['v' .. i] = pair({ n }, { dtype = pdt }), pair({ n }, { dtype = pdt, dist = { 0, 1 } })
        end
        compare(ins, function(S)
          local P, G, M, V = ffi.new('gl_tensor *[?]', k), ffi.new('const gl_tensor *[?]', k),
                             ffi.new('gl_tensor *[?]', k), ffi.new('gl_tensor *[?]', k)
          local O, lrs, wds = ffi.new('gl_tensor *[?]', k), ffi.new('double[?]', k), ffi.new('double[?]', k)
          local res, outs = {}, {}
          for i = 1, k do
            local p, m, v = S['p' .. i]:clone(), S['m' .. i]:clone(), S['v' .. i]:clone()
            P[i - 1], G[i - 1], M[i - 1], V[i - 1] = p.c, S['g' .. i].c, m.c, v.c
            lrs[i - 1], wds[i - 1] = i % 2 == 0 and 1e-3 or 3e-3, i % 3 == 0 and 0 or 0.1
            if i % 2 == 1 then outs[i] = S.out({ sizes[i] }, i == 1 and 'float32' or 'bfloat16'); O[i - 1] = outs[i].c end
            res[#res + 1], res[#res + 2], res[#res + 3] = p, m, v
          end
          for step = 1, 2 do K(lib.gl_adamw_update_multi(k, P, G, M, V, O, lrs, wds, 0.9, 0.95, 1e-8, step)) end
          local rounded = 0  -- each output holds its parameter, rounded
          for i, o in pairs(outs) do
            rounded = math.max(rounded, o:to('float64'):max_abs_diff(res[3 * i - 2]:to(o.dtype):to('float64')))
          end
          local sq = ffi.new('double[1]')
          K(lib.gl_sumsq_multi(k, G, sq))
          return rounded, sq[0], unpack(res)
        end, pdt, ('AdamW multi, %s params, %s grads'):format(pdt, gdt))
      end
    end
    -- views the segment table cannot take go through the single sum
    local ins = { a = pair({ 70, 90 }, { layout = 'transposed' }), b = pair({ 5000 }, { dtype = 'bfloat16' }) }
    compare(ins, function(S)
      local sq = ffi.new('double[1]')
      K(lib.gl_sumsq_multi(2, ffi.new('const gl_tensor *[2]', { S.a.c, S.b.c }), sq))
      return sq[0]
    end, 'float32', 'sum of squares, a transposed view and bfloat16')
  end)
end)
