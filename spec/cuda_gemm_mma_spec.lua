-- kernels/gemm_mma.cu against its CPU twin (engine/unfused.c: the product,
-- then the passes): nanochat's ReLU² MLP products, GL_EPI_RELU2 (h =
-- relu(a b + bias)^2, b a weight's transposed view: the TN layout) and
-- GL_EPI_DRELU2 (dpre = (a b) * 2 sqrt(h), b a row-major weight: NN, read
-- with ldmatrix.trans), in bfloat16 over the 128 x 128 x 32 tile's edges:
-- M, N, K below, at and past a tile, a K-loop of one step and of more steps
-- than the 3-stage ring, pre-activations of both signs and exact zeros.
-- The simulator's trace shows which kernel ran: the fused one (one launch)
-- for what it takes, cuBLASLt and the passes for what it does not (float32,
-- a misaligned or narrowed operand, K or N not a multiple of 8) and under
-- GL_CUDA_RELU2_GEMM=0.
-- Also in race mode (Makefile RACE_SPECS).
local gl = require 'gptlua'
local lib = gl.lib
local twin = require 'support.cuda_twin'
local pair, compare, K = twin.pair, twin.compare, twin.K

local gpu_it = twin.gpu_it(it, pending)

-- the kernels one call launched, by name, when the engine is the simulator
-- (nil on a GPU: no trace there)
local trace = dofile(gl.root .. '/recipes/tools/sim_trace.lua')
local launched = trace.launched
local count = trace.count

-- a pair of bf16 h = relu2(pre) values (zeros where pre <= 0), both sides equal
local function h_pair(M, N, dt)
  local h = gl.relu2(gl.randn({ M, N }, { seed = twin.next_seed() })):to(dt)
  return { h, h:to(twin.DEV) }
end

describe('CUDA ReLU² GEMM (kernels/gemm_mma.cu) vs CPU #cuda', function()
  -- {M, N, K}: one row and one K-step; rows under a tile; N past a tile and a
  -- K tail; M past a tile with 3 K-steps (the ring's depth); every edge and
  -- 5 K-steps; a whole tile
  local shapes = { { 1, 8, 8 }, { 15, 16, 32 }, { 17, 136, 40 }, { 129, 24, 96 }, { 200, 264, 136 }, { 128, 128, 32 } }

  gpu_it('forward h = relu(x W1^T + b1)^2 and backward dpre = (g W2) 2 sqrt(h), bf16, over tile edges', function()
    for si, s in ipairs(shapes) do
      local M, N, Kd = s[1], s[2], s[3]
      local bias = si % 2 == 0
      local ins = { x = pair({ M, Kd }, { dtype = 'bfloat16' }), w1 = pair({ N, Kd }, { dtype = 'bfloat16' }),
                    b1 = pair({ N }, { dtype = 'bfloat16' }), g = pair({ M, Kd }, { dtype = 'bfloat16' }),
                    w2 = pair({ Kd, N }, { dtype = 'bfloat16' }), h = h_pair(M, N, 'bfloat16') }
      -- a row of x of zeros: its pre-activations are exactly 0 (or b1)
      if M > 2 then for i = 1, 2 do ins.x[i]:narrow(1, 2, 1):fill_(0) end end
      compare(ins, function(S)
        local h, dpre = S.out({ M, N }, 'bfloat16'), S.out({ M, N }, 'bfloat16')
        local names = launched(function()
          K(lib.gl_matmul_epilogue(lib.GL_EPI_RELU2, h.c, S.x.c, S.w1:t().c, bias and S.b1.c or nil, nil))
          K(lib.gl_matmul_epilogue(lib.GL_EPI_DRELU2, dpre.c, S.g.c, S.w2.c, nil, S.h.c))
        end)
        if S.gpu and names then
          assert.are.same({ 'gemm_mma_kernel', 'gemm_mma_kernel' },
            { names[1] and names[1]:match('^gemm_mma_kernel'), names[2] and names[2]:match('^gemm_mma_kernel') },
            ('the fused kernel, once per product (M=%d N=%d K=%d): %s'):format(M, N, Kd, table.concat(names, ' ')))
          assert.are.equal(2, #names)
        end
        return h, dpre
      end, 'bfloat16', ('relu2 gemm M=%d N=%d K=%d bias=%s'):format(M, N, Kd, tostring(bias)), { n = Kd + 1 })
    end
  end)

  gpu_it('DRELU2 with the bias gradient: the fused product, then a sum over rows', function()
    local M, N, Kd = 33, 40, 24
    local ins = { g = pair({ M, Kd }, { dtype = 'bfloat16' }), w2 = pair({ Kd, N }, { dtype = 'bfloat16' }),
                  h = h_pair(M, N, 'bfloat16') }
    compare(ins, function(S)
      local dpre, db = S.out({ M, N }, 'bfloat16'), S.out({ N }, 'bfloat16')
      local names = launched(function()
        K(lib.gl_matmul_epilogue(lib.GL_EPI_DRELU2, dpre.c, S.g.c, S.w2.c, db.c, S.h.c))
      end)
      if S.gpu and names then assert.are.equal(1, count(names, '^gemm_mma_kernel'), table.concat(names, ' ')) end
      return dpre, db
    end, 'bfloat16', 'drelu2 with db', { n = math.max(Kd, M) })
  end)

  gpu_it('falls back to cuBLASLt and the passes: float32, misaligned or narrowed rows, K or N not a multiple of 8, GL_CUDA_RELU2_GEMM=0', function()
    local cases = {
      { 'float32', { 20, 16, 24 } },
      { 'bfloat16', { 20, 16, 12 }, 'K % 8' },
      { 'bfloat16', { 20, 12, 16 }, 'N % 8' },
      { 'bfloat16', { 20, 16, 24 }, 'narrow' },  -- rows of K + 3, one element in: not 16-byte aligned
      { 'bfloat16', { 20, 16, 24 }, 'GL_CUDA_RELU2_GEMM=0' },  -- the switch: operands the kernel takes
    }
    local ffi = require 'ffi'
    pcall(ffi.cdef, 'int setenv(const char *name, const char *value, int overwrite); int unsetenv(const char *name);')
    for _, c in ipairs(cases) do
      local dt, M, N, Kd, why = c[1], c[2][1], c[2][2], c[2][3], c[3] or c[1]
      local layout = why == 'narrow' and 'narrow' or nil
      local ins = { x = pair({ M, Kd }, { dtype = dt, layout = layout }), w1 = pair({ N, Kd }, { dtype = dt }),
                    b1 = pair({ N }, { dtype = dt }), g = pair({ M, Kd }, { dtype = dt, layout = layout }),
                    w2 = pair({ Kd, N }, { dtype = dt }), h = h_pair(M, N, dt) }
      compare(ins, function(S)
        local h, dpre, db = S.out({ M, N }, dt), S.out({ M, N }, dt), S.out({ N }, dt)
        local switch = why:match('^GL_CUDA_RELU2_GEMM')
        if switch then ffi.C.setenv('GL_CUDA_RELU2_GEMM', '0', 1) end
        local ok, names = pcall(launched, function()
          K(lib.gl_matmul_epilogue(lib.GL_EPI_RELU2, h.c, S.x.c, S.w1:t().c, S.b1.c, nil))
          K(lib.gl_matmul_epilogue(lib.GL_EPI_DRELU2, dpre.c, S.g.c, S.w2.c, db.c, S.h.c))
        end)
        if switch then ffi.C.unsetenv('GL_CUDA_RELU2_GEMM') end
        assert(ok, names)
        if S.gpu and names then
          assert.are.equal(0, count(names, '^gemm_mma_kernel'), why .. ': ' .. table.concat(names, ' '))
          assert(count(names, '^cublasLt') + count(names, '^gemm_fallback') >= 2, why .. ': ' .. table.concat(names, ' '))
        end
        return h, dpre, db
      end, dt, 'relu2 fallback ' .. why, { n = math.max(Kd + 1, M) })
    end
  end)
end)
