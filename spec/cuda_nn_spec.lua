-- The CUDA embedding and index ops (kernels/index.cu), cross-entropy
-- (kernels/loss.cu) and optimizers (kernels/optim.cu) against their CPU
-- twins, through spec/support/cuda_twin.lua's harness (its rule for the
-- tolerances at its top; poisoning: spec/cuda_spec.lua).  `make test-race` runs this
-- file again in the simulator's race mode.
local gl = require 'gptlua'
local cuda = require 'gptlua.cuda'
local ffi, lib = gl.ffi, gl.lib

-- the harness (pair, compare, ...) lives in spec/support/cuda_twin.lua
local twin = require 'support.cuda_twin'
local DEV = twin.DEV
local copy_shape, pair, id_pair, output = twin.copy_shape, twin.pair, twin.id_pair, twin.output
local compare, K = twin.compare, twin.K

local gpu_it = twin.gpu_it(it, pending)

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
        end, dt, ('embedding %s ids %s'):format(dt, idt), { n = 4 * 33 })  -- a row's positions, at most
      end
    end
    -- wide tables use several column blocks; repeated ids keep position order
    local ins = { ids = id_pair({ 3000 }, 7, 'int64'), g = pair({ 3000, 300 }) }
    compare(ins, function(S)
      local d = S.out({ 40, 300 }); K(lib.gl_embedding_backward(d.c, S.g.c, S.ids.c))
      return d
    end, 'float32', 'embedding backward, many repeats', { n = 3000 })
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
          if dt == 'float32' then  -- the same sums in the same order as the twin's
            if S.gpu then assert.equal(0, d:to('cpu'):max_abs_diff(ref), what .. ': not bit for bit')
            elseif not S.ref then ref = d end
          end
          return d
        end, dt, what, { n = n })
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
        end, dt, ('index ops %s dim %d'):format(dt, dim), { n = 5 })  -- base + 4 sources
      end
    end
  end)
end)

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
        end, dt, ('cross-entropy %s softcap %g'):format(dt, cap), { n = V })
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
      end, 'float32', 'optimizers, grads ' .. gdt, { n = 3 })  -- (three steps)
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
    -- the outputs' sums: the rounding check, the sum of squares of every
    -- gradient, then each tensor's p, m and v after two steps
    local adamw_multi_n = { 1, 0 }
    for _, n in ipairs(sizes) do adamw_multi_n[2] = adamw_multi_n[2] + n end
    for i = 3, 2 + 3 * k do adamw_multi_n[i] = 2 end
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
          if S.ref then
            -- m = b1 m + (1 - b1) g cancels when m and g differ in sign (a
            -- tensor of one element: 0.005 from terms of about 1), and p -
            -- lr u when the step is as large as p: each errs at its terms'
            -- scale.  (v sums squares: no cancellation.)
            for i = 1, k do
              local p_in, m_in, g = S['p' .. i], S['m' .. i], S['g' .. i]
              S.terms[2 + 3 * i - 2] = twin.max_abs(p_in) + (sizes[i] > 0 and twin.max_abs(res[3 * i - 2] - p_in) or 0)
              S.terms[2 + 3 * i - 1] = twin.max_abs(m_in) + twin.max_abs(g)
            end
          end
          local rounded = 0  -- each output holds its parameter, rounded
          for i, o in pairs(outs) do
            rounded = math.max(rounded, o:to('float64'):max_abs_diff(res[3 * i - 2]:to(o.dtype):to('float64')))
          end
          local sq = ffi.new('double[1]')
          K(lib.gl_sumsq_multi(k, G, sq))
          return rounded, sq[0], unpack(res)
        end, pdt, ('AdamW multi, %s params, %s grads'):format(pdt, gdt), { n = adamw_multi_n })
      end
    end
    -- views the segment table cannot take go through the single sum
    local ins = { a = pair({ 70, 90 }, { layout = 'transposed' }), b = pair({ 5000 }, { dtype = 'bfloat16' }) }
    compare(ins, function(S)
      local sq = ffi.new('double[1]')
      K(lib.gl_sumsq_multi(2, ffi.new('const gl_tensor *[2]', { S.a.c, S.b.c }), sq))
      return sq[0]
    end, 'float32', 'sum of squares, a transposed view and bfloat16', { n = 70 * 90 + 5000 })
  end)
end)
