-- The CUDA row kernels (kernels/rows.cu: softmax, layernorm, rmsnorm, the
-- fused residual add + norm; the embedding forward's 16-byte rows in
-- kernels/index.cu) against their CPU twins (engine/cpu/rows.c,
-- engine/cpu/index.c, engine/unfused.c), through spec/support/cuda_twin.lua's harness (its
-- rule for the tolerances at its top; poisoning: spec/cuda_spec.lua).  `make
-- test-race` runs this file again in the simulator's race mode.
local gl = require 'gptlua'
local lib = gl.lib

-- the harness (pair, compare, ...) lives in spec/support/cuda_twin.lua
local twin = require 'support.cuda_twin'
local copy_shape, pair, id_pair, compare, K = twin.copy_shape, twin.pair, twin.id_pair, twin.compare, twin.K

local gpu_it = twin.gpu_it(it, pending)

local function rows(lead)  -- the rows of a (lead..., C) tensor
  local n = 1
  for _, s in ipairs(lead) do n = n * s end
  return n
end

-- The largest term of a norm's dx, rstd (g w - mean(g w) - x^ mean(g w x^))
-- (+ dres): dx is their difference and errs at their scale (cuda_twin's
-- S.terms), which cancellation can put far above dx's own (a row of one
-- element: x^ = +-1 and dx = 0 up to rounding).  x^ = (x - mean) rstd, per row.
local function norm_terms(x, mean, rstd, g, w, dres)
  local lead = copy_shape(x.shape)
  lead[#lead] = 1
  local xc = mean and (x - mean:view(lead)) or x
  local xhat = twin.max_abs(xc * rstd:view(lead))
  local gw = twin.max_abs(g) * (w and twin.max_abs(w) or 1)
  return twin.max_abs(rstd) * gw * (2 + xhat) + (dres and twin.max_abs(dres) or 0)
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
          end, dt, ('softmax log=%d %s {%s}'):format(log, dt, table.concat(shape, ',')), { n = shape[#shape] })
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
            if S.ref then S.terms[4], S.terms[9] = norm_terms(S.x, mean, rstd, S.g, w), norm_terms(S.x, nil, rr, S.g, w) end
            return y, mean, rstd, dx, dw, db, ry, rr, rdx, rdw
          end, dt, ('norms %s {%s} affine=%s'):format(dt, table.concat(shape, ','), tostring(affine)),
          { n = math.max(C, rows(lead)) })  -- a row's statistics; dw and db over the rows
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
          local x, r = S.x, S.r
          local s, y, mean, rstd = S.out(shape, dt), S.out(shape, dt), S.out(lead, sdt), S.out(lead, sdt)
          K(lib.gl_add_norm_forward(s.c, y.c, mean.c, rstd.c, x.c, r.c, S.w.c, S.b.c, 1e-5, 1))
          local dx, dw, db = S.out(shape, dt), S.out({ C }, dt), S.out({ C }, dt)
          K(lib.gl_norm_backward_add(dx.c, dw.c, db.c, S.g.c, s.c, S.w.c, mean.c, rstd.c, S.dres.c, 1))
          local rs, ry, rr = S.out(shape, dt), S.out(shape, dt), S.out(lead, sdt)
          K(lib.gl_add_norm_forward(rs.c, ry.c, nil, rr.c, x.c, r.c, nil, nil, 1e-6, 0))
          local rdx = S.out(shape, dt)
          K(lib.gl_norm_backward_add(rdx.c, nil, nil, S.g.c, rs.c, nil, nil, rr.c, nil, 0))
          if S.ref then
            S.terms[5], S.terms[11] = norm_terms(s, mean, rstd, S.g, S.w, S.dres), norm_terms(rs, nil, rr, S.g, nil)
          end
          return s, y, mean, rstd, dx, dw, db, rs, ry, rr, rdx
        end, dt, ('add_norm %s {%s} %s'):format(dt, table.concat(shape, ','), case[2]),
        { n = math.max(C, rows(lead)) })
      end
    end
  end)
end)

-- The 16-byte path of softmax and the norms (kernels/rows.cu, row_walk):
-- rows over the vector width's edges (C = 1, 7, 8, 9, 63, 64, 65, 768,
-- 1029: no whole vector, a tail, exact vectors), in float32 (4 a vector)
-- and bfloat16 (8); contiguous rows (aligned when C fills whole vectors,
-- alternating otherwise) and narrowed rows that start one element past
-- their allocation's alignment (the element-wise fallback), against the CPU
-- twin.  make test-race runs them in race mode with bounds checks.
describe('CUDA 16-byte rows vs CPU #cuda', function()
  -- (the weight and bias: contiguous and aligned, loaded as vectors with the
  -- rows, or narrowed one element past alignment, gathered into the vectors:
  -- at C = 8, 65 and 768, whole vectors with and without a tail)
  local WEIGHT_NARROW = { [8] = true, [65] = true, [768] = true }
  gpu_it('16-byte rows: softmax and the norms, forward and backward, over vector edges, aligned and not', function()
    for _, dt in ipairs({ 'float32', 'bfloat16' }) do
      for _, C in ipairs({ 1, 7, 8, 9, 63, 64, 65, 768, 1029 }) do
        for _, case in ipairs({ { 'contiguous', 'contiguous' }, { 'contiguous', 'narrow' }, { 'narrow', 'contiguous' } }) do
          local layout, wlayout = case[1], case[2]
          if wlayout == 'narrow' and not WEIGHT_NARROW[C] then goto next_case end
          local shape = { 3, C }
          local ins = { x = pair(shape, { dtype = dt, layout = layout }), g = pair(shape, { dtype = dt, layout = layout }),
                        dres = pair(shape, { dtype = dt }), w = pair({ C }, { dtype = dt, layout = wlayout }),
                        b = pair({ C }, { dtype = dt, layout = wlayout }) }
          compare(ins, function(S)
            local out = {}
            for log = 0, 1 do
              local y = S.out(shape, dt); K(lib.gl_softmax(y.c, S.x.c, log))
              local dx = S.out(shape, dt); K(lib.gl_softmax_backward(dx.c, y.c, S.g.c, log))
              out[#out + 1], out[#out + 2] = y, dx
            end
            local y, mean, rstd = S.out(shape, dt), S.out({ 3 }), S.out({ 3 })
            K(lib.gl_layernorm_forward(y.c, mean.c, rstd.c, S.x.c, S.w.c, S.b.c, 1e-5))
            local dx, dw, db = S.out(shape, dt), S.out({ C }, dt), S.out({ C }, dt)
            K(lib.gl_layernorm_backward(dx.c, dw.c, db.c, S.g.c, S.x.c, S.w.c, mean.c, rstd.c))
            local ry, rr = S.out(shape, dt), S.out({ 3 })
            K(lib.gl_rmsnorm_forward(ry.c, rr.c, S.x.c, S.w.c, 1e-6))
            local rdx = S.out(shape, dt)  -- with the residual gradient, no weight
            K(lib.gl_norm_backward_add(rdx.c, nil, nil, S.g.c, S.x.c, nil, nil, rr.c, S.dres.c, 0))
            -- the fused add + norm (its bfloat16 vector path: C % 8 == 0, aligned rows), with the
            -- weight and bias
            local ax, ar = S.x, S.dres
            local as, ay = S.out(shape, dt), S.out(shape, dt)
            K(lib.gl_add_norm_forward(as.c, ay.c, nil, nil, ax.c, ar.c, S.w.c, S.b.c, 1e-5, 1))
            -- (at C = 1 layernorm's dx is 0 up to rounding, which the two twins round differently)
            for _, t in ipairs({ y, mean, rstd, dw, db, ry, rr, rdx, as, ay }) do out[#out + 1] = t end
            if C > 1 then out[#out + 1] = dx end
            if S.ref then  -- (the two dx after the softmaxes' four outputs and the norms' first seven)
              S.terms[12], S.terms[15] = norm_terms(S.x, nil, rr, S.g, nil, S.dres), norm_terms(S.x, mean, rstd, S.g, S.w)
            end
            return unpack(out)
          end, dt, ('16-byte rows %s C=%d %s, weight %s'):format(dt, C, layout, wlayout), { n = math.max(C, 3) })
          ::next_case::
        end
      end
    end
  end)

  -- kernels/index.cu: rows of whole 16-byte vectors copy as vectors
  -- (C * size % 16 == 0, aligned rows); narrowed tables and other widths,
  -- and a bad id's NaN row, take the element kernel or the vector's lanes
  gpu_it('16-byte rows: the embedding forward over vector edges, aligned and not', function()
    for _, dt in ipairs({ 'float32', 'bfloat16' }) do
      for _, C in ipairs({ 1, 7, 8, 9, 63, 64, 65, 768, 1029 }) do
        for _, layout in ipairs({ 'contiguous', 'narrow' }) do
          local ins = { tab = pair({ 11, C }, { dtype = dt, layout = layout }), ids = id_pair({ 2, 5 }, 11, 'int64') }
          compare(ins, function(S)
            local e = S.out({ 2, 5, C }, dt); K(lib.gl_embedding_forward(e.c, S.tab.c, S.ids.c))
            local e2 = S.out({ 5, 2, C }, dt); K(lib.gl_embedding_forward(e2.c, S.tab.c, S.ids:t().c))
            return e, e2
          end, dt, ('16-byte embedding %s C=%d %s'):format(dt, C, layout))
        end
      end
    end
  end)

  -- kernels/loss.cu: the cross-entropy rows, forward and backward (into a
  -- new tensor, in place, with the device factor scale_by), with and
  -- without softcap (narrowed rows: with), over vector edges and GPT-2's
  -- padded vocabulary (50304: whole vectors).  Contiguous rows start aligned where V * size is a
  -- multiple of 16 (every row), else in every 16 / gcd(V * size, 16)-th row
  -- (row 0 and 8 of bfloat16 at odd V: a vector walk with a tail); narrowed
  -- rows are one element past.  Targets: ignored rows (1: unaligned, 8:
  -- aligned at odd V), the last element (row 0 and 2: in the tail at odd V),
  -- the first (row 3), the rest random.
  gpu_it('16-byte rows: cross-entropy forward and backward, softcap, ignore_index, scale_by, aligned and not', function()
    for _, dt in ipairs({ 'float32', 'bfloat16' }) do
      for _, V in ipairs({ 1, 8, 9, 65, 1001, 50304 }) do
        local N = V > 2000 and 3 or 10
        math.randomseed(V)
        local tv = {}
        for r = 0, N - 1 do tv[r + 1] = math.random(0, V - 1) end
        tv[1], tv[2], tv[3] = V - 1, -100, V - 1
        if N > 3 then tv[4], tv[9] = 0, -100 end
        local tg = gl.tensor(tv, { dtype = 'int64' })
        for _, layout in ipairs({ 'contiguous', 'narrow' }) do
          local ins = { x = pair({ N, V }, { dtype = dt, layout = layout }), t = { tg, tg:to(twin.DEV) },
                        s = pair({ 1 }) }
          for _, cap in ipairs(layout == 'narrow' and { 15 } or { 0, 15 }) do
            compare(ins, function(S)
              local loss, lse = S.out({ N }, 'float32'), S.out({ N }, 'float32')
              K(lib.gl_cross_entropy_forward(loss.c, lse.c, S.x.c, S.t.c, -100, cap))
              local d = S.out({ N, V }, dt)
              K(lib.gl_cross_entropy_backward(d.c, S.x.c, S.t.c, lse.c, -100, cap, 1 / N, nil))
              local inplace = S.x:clone()  -- contiguous: aligned where x's rows would be
              K(lib.gl_cross_entropy_backward(inplace.c, inplace.c, S.t.c, lse.c, -100, cap, 1 / N, S.s.c))
              -- (at V = 1 the gradient is 0 up to rounding, which the two twins round differently)
              if V == 1 then return loss, lse end
              return loss, lse, d, inplace
            end, dt, ('16-byte cross-entropy %s V=%d %s softcap %g'):format(dt, V, layout, cap), { n = V })
          end
        end
      end
    end
  end)
end)
