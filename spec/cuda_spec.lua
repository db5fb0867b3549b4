-- The CUDA backend against its CPU twins (make test-cuda).
--
-- Every kernel runs on random inputs (fixed seeds; GL_CUDA_SPEC_SEED=N
-- draws others, and make test-seeds many) of odd sizes, contiguous and not
-- (transposed, narrowed, broadcast views), with every GPU output poisoned
-- (NaN) before the call, and is checked by spec/support/cuda_twin.lua's one
-- rule: against the CPU twin's float64 result on the same values, within
-- twice the error of the CPU twin in the same precision plus the dtype's
-- epsilon at the result's scale (and float32's times sqrt(n) for sums of n
-- terms); integers exactly.
-- All tests sit in describes tagged #cuda, so `make test` (which excludes
-- the tag) only loads this file; without a GPU every GPU test is pending.
local gl = require 'gptlua'
local cuda = require 'gptlua.cuda'
local ffi, lib = gl.ffi, gl.lib

-- the harness (pair, compare, ...) lives in spec/support/cuda_twin.lua
local twin = require 'support.cuda_twin'
local HAVE_GPU, DEV = twin.HAVE_GPU, twin.DEV
local next_seed, pair, id_pair, output = twin.next_seed, twin.pair, twin.id_pair, twin.output
local compare, K = twin.compare, twin.K

local gpu_it = twin.gpu_it(it, pending)

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

  -- (the float64 reference: the same draws in float64)
  gpu_it('draws the same Philox numbers as the CPU', function()
    local seed = next_seed()
    for _, dt in ipairs({ 'float32', 'float64', 'bfloat16' }) do
      local function randn(o) return gl.randn({ 33, 65 }, { seed = seed, offset = 7, dtype = o.dtype or dt, device = o.device }) end
      twin.check('randn ' .. dt, randn({ device = DEV }), randn({}), randn({ dtype = 'float64' }), dt)
      local function uniform(o) return gl.uniform({ 1001 }, -2, 3, { seed = seed, dtype = o.dtype or dt, device = o.device }) end
      twin.check('uniform ' .. dt, uniform({ device = DEV }), uniform({}), uniform({ dtype = 'float64' }), dt)
    end
    local function normal(device, dtype)
      local t = gl.empty({ 8, 12 }, { device = device, dtype = dtype }):t()
      t:normal_(1, 2, { seed = seed })
      return t
    end
    twin.check('normal_ on a transposed view', normal(DEV), normal('cpu'), normal('cpu', 'float64'), 'float32')
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
      end, dt, 'rope ' .. dt, { n = 2 })  -- x1 cos + x2 sin
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
  local function reduced(shape, mask)  -- the terms each output sums
    local n = 1
    for d = 1, #shape do if bit.band(mask, bit.lshift(1, d - 1)) ~= 0 then n = n * shape[d] end end
    return n
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
               ('reduce %s mask %d %s {%s}'):format(r[1], mask, dt, table.concat(shape, ',')),
               { n = reduced(shape, mask) })
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
      end, 'float64', 'sumsq ' .. layout, { n = 1001 * 257 })
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
          end, dt, ('matmul %s a %s b %s'):format(dt, la, lb), { n = Kd })
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
      end, dt, 'batched matmul ' .. dt, { n = 24 + 2 })  -- (acc: 2 a b + c / 2)
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
        end, dt, ('matmul_bias %s N=%d'):format(dt, N), { n = 24 + 1 })
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
        end, dt, ('matmul_epilogue %s N=%d'):format(dt, N), { n = math.max(C, M, N) })
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
        end, dt, ('mlp %s %s'):format(act, dt), { n = 64 })  -- (the hidden width; 18 rows, 16 inputs)
      end
    end
  end)
end)

-- row kernels (softmax, norms): spec/cuda_rows_spec.lua; embedding, index ops,
-- cross-entropy and optimizers: spec/cuda_nn_spec.lua; attention: spec/cuda_attention_spec.lua
