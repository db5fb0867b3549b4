-- The mixture-of-experts ops on the GPU (kernels/moe.cu) against their CPU
-- twins (engine/cpu/moe.c), through spec/support/cuda_twin.lua's harness and
-- its rule; the plans (slots, counts, load) must equal the CPU's exactly.
-- Edge cases: an expert without tokens, capacity drops, top_k = 1, int32 ids
-- in a strided view, more experts than one launch of the grouped products
-- takes (32), rows past the last expert's.  A MoE model on the device:
-- spec/cuda_model_spec.lua and spec/cuda_train_graph_spec.lua.  Also in race mode
-- (Makefile RACE_SPECS).
local gl = require 'gptlua'
local ffi, lib = gl.ffi, gl.lib
local twin = require 'support.cuda_twin'
local DEV = twin.DEV
local pair, compare, K = twin.pair, twin.compare, twin.K
local gpu_it = twin.gpu_it(it, pending)

-- the kernels one call launched, by name, in the simulator (nil on a GPU)
local trace = dofile(gl.root .. '/recipes/tools/sim_trace.lua')
local launched = trace.launched
local count = trace.count

-- expert ids (N, K) drawn from [0, hot), each token's K distinct; int32
-- ids come as the transposed view of a (K, N) tensor (a strided read)
local function experts_pair(N, k, hot, dtype)
  math.randomseed(twin.next_seed())
  local rows = {}
  for n = 1, N do
    local row, used = {}, {}
    for j = 1, k do
      local e
      repeat e = math.random(0, hot - 1) until not used[e]
      used[e], row[j] = true, e
    end
    rows[n] = row
  end
  local t = gl.tensor(rows, { dtype = dtype or 'int64' })
  if dtype == 'int32' then t = t:t():contiguous():t() end
  return { t, t:to(DEV) }
end

-- the plan of a case on the CPU, as an input pair
local function plan_pair(ex, E, cap)
  local slots, counts = gl.moe_route(ex[1], E, cap)
  return { slots, slots:to(DEV) }, { counts, counts:to(DEV) }
end

-- N tokens, top-k of E experts (ids from [0, hot): the experts past hot get
-- none), capacity cap (0: dropless)
local CASES = {
  { N = 300, k = 2, E = 8, hot = 6, cap = 0, what = 'dropless, two experts idle' },
  { N = 300, k = 2, E = 8, hot = 8, cap = 40, what = 'capacity 40: drops' },
  { N = 57, k = 1, E = 5, hot = 5, cap = 0, what = 'top_k 1' },
  { N = 90, k = 3, E = 40, hot = 37, cap = 0, what = '40 experts (two launches), three idle', idt = 'int32' },
}
local function rows_of(c) return c.cap > 0 and math.min(c.N * c.k, c.E * c.cap) or c.N * c.k end

describe('CUDA mixture-of-experts ops vs CPU #cuda', function()
  gpu_it('moe_route: the same slots, counts and load as the CPU', function()
    for _, c in ipairs(CASES) do
      local ins = { ex = experts_pair(c.N, c.k, c.hot, c.idt) }
      compare(ins, function(S)
        local slots = S.out({ c.N, c.k }, 'int64')
        local counts, load = S.out({ c.E }, 'int64'), S.out({ c.E }, 'int64')
        K(lib.gl_moe_route(slots.c, counts.c, load.c, S.ex.c, c.cap))
        return slots, counts, load
      end, 'int64', 'moe_route ' .. c.what)
    end
  end)

  gpu_it('moe_permute, moe_combine and moe_combine_wgrad in float32 and bfloat16', function()
    for _, c in ipairs(CASES) do
      for _, dt in ipairs({ 'float32', 'bfloat16' }) do
        local C, rows = 24, rows_of(c)
        local slots = plan_pair(experts_pair(c.N, c.k, c.hot, c.idt), c.E, c.cap)
        local ins = { slots = slots, x = pair({ c.N, C }, { dtype = dt, layout = 'narrow' }),
                      w = pair({ c.N, c.k }, { dtype = dt, dist = { 0, 1 } }), y = pair({ rows, C }, { dtype = dt }),
                      g = pair({ c.N, C }, { dtype = dt, layout = 'transposed' }) }
        compare(ins, function(S)
          local p = S.out({ rows, C }, S.x.dtype); K(lib.gl_moe_permute(p.c, S.x.c, S.slots.c, nil))
          local pw = S.out({ rows, C }, S.x.dtype); K(lib.gl_moe_permute(pw.c, S.x.c, S.slots.c, S.w.c))
          local o = S.out({ c.N, C }, S.x.dtype, 'transposed'); K(lib.gl_moe_combine(o.c, S.y.c, S.slots.c, S.w.c))
          local dw = S.out({ c.N, c.k }, S.x.dtype); K(lib.gl_moe_combine_wgrad(dw.c, S.g.c, S.y.c, S.slots.c))
          return p, pw, o, dw
        end, dt, ('moe permute/combine %s %s'):format(dt, c.what), { n = { 1, 1, c.k, C } })
      end
    end
  end)

  -- widths and layouts: a's rows padded (the CUDA-core tiles), then in
  -- bfloat16 the tensor-core tiles (gemm_mma.cu's, grouped, both products)
  -- with b a transposed view (the forward's W^T) and b row-major (the
  -- backward's W); the weight gradients half transposed views
  local SHAPES = {
    { Kd = 20, Nout = 36, a = 'narrow', b = 'transposed', mma = false },
    { Kd = 32, Nout = 48, b = 'transposed', mma = true },
    { Kd = 40, Nout = 24, mma = true },
  }
  gpu_it('grouped_matmul and grouped_matmul_wgrad in float32 and bfloat16', function()
    for _, c in ipairs(CASES) do
      for _, sh in ipairs(SHAPES) do
        for _, dt in ipairs({ 'float32', 'bfloat16' }) do
          local Kd, Nout, rows = sh.Kd, sh.Nout, rows_of(c) + 5  -- 5 rows past the experts': zero
          local _, counts = plan_pair(experts_pair(c.N, c.k, c.hot, c.idt), c.E, c.cap)
          local ins = { counts = counts, a = pair({ rows, Kd }, { dtype = dt, layout = sh.a }),
                        g = pair({ rows, Nout }, { dtype = dt }) }
          for e = 1, c.E do ins['b' .. e] = pair({ Kd, Nout }, { dtype = dt, layout = sh.b }) end
          local most = 0
          for _, v in ipairs(counts[1]:tolist()) do most = math.max(most, v) end
          compare(ins, function(S)
            local bs, dbs, outs = ffi.new('const gl_tensor *[?]', c.E), ffi.new('gl_tensor *[?]', c.E), {}
            for e = 1, c.E do bs[e - 1] = S['b' .. e].c end
            local o = S.out({ rows, Nout }, S.a.dtype)
            local names = launched(function() K(lib.gl_grouped_matmul(o.c, S.a.c, c.E, bs, S.counts.c)) end)
            if S.gpu and names then
              local want = dt == 'bfloat16' and sh.mma and math.ceil(c.E / 32) or 0
              assert.are.equal(want, count(names, '^gemm_mma_kernel'), table.concat(names, ' '))
            end
            outs[1] = o
            for e = 1, c.E do
              outs[e + 1] = S.out({ Kd, Nout }, S.a.dtype, e % 2 == 0 and 'transposed' or nil)
              dbs[e - 1] = outs[e + 1].c
            end
            names = launched(function() K(lib.gl_grouped_matmul_wgrad(c.E, dbs, S.a.c, S.g.c, S.counts.c)) end)
            if S.gpu and names then
              local want = dt == 'bfloat16' and sh.mma and math.ceil(c.E / 32) or 0
              assert.are.equal(want, count(names, '^gemm_mma_kernel'), 'wgrad: ' .. table.concat(names, ' '))
            end
            return unpack(outs)
          end, dt, ('grouped_matmul %s %s, K %d N %d'):format(dt, c.what, Kd, Nout), { n = math.max(Kd, most) })
        end
      end
    end
  end)

  gpu_it('bad values are reported with the CPU\'s wording at the next host wait', function()
    local bad = gl.tensor({ { 0, 3 }, { 1, 0 } }, { dtype = 'int64' })
    local ok, err = pcall(function() return gl.moe_route(bad:to(DEV), 3, 0)[1]:tolist() end)
    assert.is_false(ok)
    assert.matches('gl_moe_route: experts%[1%] is 3, expected 0 <= experts < 3 %(experts: the size of counts%)',
      tostring(err))
    local x = gl.randn({ 2, 4 }):to(DEV)
    local slots = gl.tensor({ { 0, 9 }, { 1, -1 } }, { dtype = 'int64' }):to(DEV)
    ok, err = pcall(function() return gl.moe_permute(x, slots, 4):tolist() end)
    assert.is_false(ok)
    assert.matches('gl_moe_permute: slots%[1%] is 9, expected 0 <= slots < 4', tostring(err))
    local counts = gl.tensor({ 2, -1 }, { dtype = 'int64' }):to(DEV)
    ok, err = pcall(function()
      return gl.grouped_linear(gl.randn({ 4, 3 }):to(DEV), { gl.randn({ 2, 3 }):to(DEV), gl.randn({ 2, 3 }):to(DEV) },
        counts):tolist()
    end)
    assert.is_false(ok)
    assert.matches('gl_grouped_matmul: counts%[1%] is %-1, expected 0 <= counts < 5', tostring(err))
  end)
end)
