-- The CUDA row kernels (kernels/rows.cu: softmax, layernorm, rmsnorm, the
-- fused residual add + norm) against their CPU twins (engine/cpu_nn.c,
-- engine/cpu_fused.c), through spec/support/cuda_twin.lua's harness
-- (tolerances and poisoning: the top of spec/cuda_spec.lua).  `make
-- test-race` runs this file again in the simulator's race mode.
local gl = require 'gptlua'
local lib = gl.lib

-- the harness (pair, compare, ...) lives in spec/support/cuda_twin.lua
local twin = require 'support.cuda_twin'
local HAVE_GPU, NO_GPU = twin.HAVE_GPU, twin.NO_GPU
local copy_shape, pair, compare, K = twin.copy_shape, twin.pair, twin.compare, twin.K

local function gpu_it(name, fn)  -- it() and pending() are busted's, in this file's environment
  if HAVE_GPU then it(name, fn) else pending(name .. ' (' .. NO_GPU .. ')') end
end

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
