-- The fusions that cut a nanochat layer's activation passes
-- (recipes/tools/ACCOUNT.md):
--   rotary + QK RMSNorm as one op (gl.rope_rms_norm, gl_rope_rmsnorm_forward /
--     _backward; engine/cpu/rope_norm.c, kernels/rope_norm.cu);
--   norms and linear layers adding their input's other gradient where they
--     make theirs (autograd's adds_into: gl_norm_backward_add's dres, the dx
--     product's beta 1);
--   the block's closing residual add in the MLP's second product
--     (gl.mlp's residual, gl_matmul_add: cuBLASLt's C != D).
-- CPU: each against the unfused ops (float64 and float32), float64 central
-- differences, argument errors.  #cuda: the GPU (or the simulator) against
-- the CPU twin in float32, bfloat16 and float64 over warp, row and layout
-- edges, by spec/support/cuda_twin.lua's rule; `make test-race` runs this
-- file again in the simulator's race mode.
local gl = require 'gptlua'
local lib = gl.lib
local gc = require 'support.gradcheck'
local twin = require 'support.cuda_twin'
local pair, compare, K = twin.pair, twin.compare, twin.K

local gpu_it = twin.gpu_it(it, pending)

-- rotary tables (T, D/2) as nanochat builds them
local function tables(T, D, dtype)
  local cos, sin = {}, {}
  for t = 1, T do
    cos[t], sin[t] = {}, {}
    for i = 1, D / 2 do
      local a = (t - 1) / 10000 ^ ((2 * (i - 1)) / D)
      cos[t][i], sin[t][i] = math.cos(a), math.sin(a)
    end
  end
  return gl.tensor(cos, { dtype = dtype }), gl.tensor(sin, { dtype = dtype })
end

-- forward and the gradient of x under g, for f(x)
local function run(f, x, g)
  x.grad = nil
  local y = f(x)
  y:backward(g)
  return y, x.grad
end

describe('gl.rope_rms_norm on the CPU', function()
  it('equals rms_norm(rope(x)) forward and backward, float64 and float32, contiguous and strided', function()
    for _, dt in ipairs({ 'float64', 'float32' }) do
      local tol = dt == 'float64' and 1e-12 or 3e-6
      for _, s in ipairs({ { 2, 5, 3, 8 }, { 1, 7, 2, 70 } }) do
        local B, T, H, D = s[1], s[2], s[3], s[4]
        local cos, sin = tables(T, D, dt)
        for _, strided in ipairs({ false, true }) do
          -- strided: a (B, T, H, D) view of a (B, H, T, D) buffer, as attention hands q back
          local base = gl.randn(strided and { B, H, T, D } or s, { dtype = dt, seed = 3 })
          local x = (strided and base:transpose(2, 3) or base):detach():requires_grad_()
          local g = gl.randn(s, { dtype = dt, seed = 4 })
          local y, dx = run(function(v) return gl.rope_rms_norm(v, cos, sin, 1e-6) end, x, g)
          local yr, dxr = run(function(v) return gl.rms_norm(gl.rope(v, cos, sin), nil, 1e-6) end, x, g)
          local what = ('%s {%s} strided=%s'):format(dt, table.concat(s, ','), tostring(strided))
          assert.is_true(y:max_abs_diff(yr) <= tol, what .. ' forward ' .. y:max_abs_diff(yr))
          assert.is_true(dx:max_abs_diff(dxr) <= tol * 10, what .. ' backward ' .. dx:max_abs_diff(dxr))
        end
      end
    end
  end)

  it('has the gradient of its float64 central differences', function()
    local cos, sin = tables(3, 6, 'float64')
    local x = gl.randn({ 2, 3, 2, 6 }, { dtype = 'float64', seed = 11 }):requires_grad_()
    gc.check(function(v) return gl.rope_rms_norm(v, cos, sin, 1e-6) end, { x })
    -- eps large enough to matter
    gc.check(function(v) return gl.rope_rms_norm(v, cos, sin, 0.5) * 2 end, { x })
  end)

  it('refuses bad arguments in one line naming them', function()
    local x = gl.randn({ 1, 2, 1, 4 })
    local cos, sin = tables(2, 4, 'float32')
    local function msg(f) local ok, e = pcall(f); assert.is_false(ok); return tostring(e) end
    assert.matches('gl_rope_rmsnorm_forward: x has head dim D = 3, expected an even D',
      msg(function() gl.rope_rms_norm(gl.randn({ 1, 2, 1, 3 }), gl.randn({ 2, 1 }), gl.randn({ 2, 1 })) end), 1, true)
    assert.matches('gl_rope_rmsnorm_forward: cos has shape {3,2}, expected {2,2}',
      msg(function() gl.rope_rms_norm(x, gl.randn({ 3, 2 }), sin) end), 1, true)
    assert.matches('gl_rope_rmsnorm_forward: eps is -1, expected >= 0',
      msg(function() gl.rope_rms_norm(x, cos, sin, -1) end), 1, true)
    local y, dx = gl.empty({ 1, 2, 1, 4 }), gl.empty({ 1, 2, 1, 4 })
    local bad_rstd = gl.empty({ 1, 2, 1 }, { dtype = 'float64' })
    assert.are.equal(-1, lib.gl_rope_rmsnorm_backward(dx.c, y.c, x.c, cos.c, sin.c, bad_rstd.c))
    assert.matches('gl_rope_rmsnorm_backward: rstd', require('ffi').string(lib.gl_last_error()), 1, true)
  end)
end)

describe('norms and linear layers that add their input\'s other gradient where they make theirs', function()
  it('take the gradient over (adds_into) and give the gradient of x used twice', function()
    local R = function(s, seed) return gl.randn(s, { dtype = 'float64', seed = seed }):requires_grad_() end
    local x, w, b = R({ 3, 6 }, 21), R({ 6 }, 22), R({ 6 }, 23)
    assert.are.equal(1, gl.rms_norm(x).grad_fn.adds_into)
    assert.are.equal(1, gl.layer_norm(x, w, b).grad_fn.adds_into)
    -- the residual's gradient there before the norm's backward (x + f(norm(x))) and after it
    gc.check(function(v) return v * 1.5 + gl.tanh(gl.rms_norm(v)) end, { x })
    gc.check(function(v, ww, bb) return gl.layer_norm(v, ww, bb) * 2 + gl.exp(v * 0.3) end, { x, w, b })
    gc.check(function(v, ww) return gl.rms_norm(v * 1, ww) + v end, { x, w })
  end)

  it('gl.linear adds dx into the gradient its input has (beta 1), in place only when that is its own', function()
    local R = function(s, seed) return gl.randn(s, { dtype = 'float64', seed = seed }):requires_grad_() end
    local x, W1, W2, W3 = R({ 2, 3, 4 }, 51), R({ 5, 4 }, 52), R({ 6, 4 }, 53), R({ 4, 4 }, 54)
    assert.are.equal(1, gl.linear(x, W1).grad_fn.adds_into)
    -- three products of one input (nanochat's c_q, c_k, c_v), and through a norm as in a block
    gc.check(function(v, a, b, c) return gl.cat({ gl.linear(v, a), gl.linear(v, b), gl.linear(v, c) }, 3) end,
      { x, W1, W2, W3 })
    gc.check(function(v, a, b) local h = gl.rms_norm(v); return v + gl.linear(h, a):narrow(3, 1, 4) * gl.linear(h, b):narrow(3, 1, 4) end,
      { x, W1, W2 })
    -- an add hands both its inputs one gradient tensor: never written in place
    gc.check(function(v, c) return gl.linear(v, c) + v end, { x, W3 })
    gc.check(function(v, c) return v * 2 + gl.linear(v, c) end, { x, W3 })
    gc.check(function(v, c) return gl.linear(v + 0, c) + v end, { x, W3 })
  end)

  it('give the gradient autograd\'s own sum gives (float32, bit for bit on the CPU)', function()
    local x = gl.randn({ 4, 16 }, { seed = 31 }):requires_grad_()
    local g = gl.randn({ 4, 16 }, { seed = 32 })
    local _, fused = run(function(v) return gl.rms_norm(v, nil, 1e-6) + v * 0.5 end, x, g)
    -- the same sum through an op that takes nothing over (mul by 1 breaks the sharing)
    local _, plain = run(function(v) return gl.rms_norm(v * 1, nil, 1e-6) + v * 0.5 end, x, g)
    assert.are.equal(0, fused:max_abs_diff(plain))
  end)
end)

describe('residual adds in the products (gl.mlp\'s and gl.linear\'s residual, gl_matmul_add) on the CPU', function()
  it('equals residual + mlp(x), forward and every gradient (float32 bit for bit, bfloat16), with and without biases', function()
    for _, dt in ipairs({ 'float32', 'bfloat16' }) do
      for _, bias in ipairs({ false, true }) do
        local function P(s, seed, k) return (gl.randn(s, { seed = seed }) * (k or 1)):to(dt):requires_grad_() end
        local x, r = P({ 2, 5, 16 }, 61), P({ 2, 5, 16 }, 62)
        local W1, W2 = P({ 40, 16 }, 63, 0.3), P({ 16, 40 }, 64, 0.3)
        local b1, b2 = bias and P({ 40 }, 65) or nil, bias and P({ 16 }, 66) or nil
        local g = gl.randn({ 2, 5, 16 }, { seed = 67 }):to(dt)
        local ins = { x, r, W1, W2, b1, b2 }
        local function grads(f)
          for _, t in ipairs(ins) do t.grad = nil end
          local y = f()
          y:backward(g)
          local res = { y }
          for i, t in ipairs(ins) do res[i + 1] = t.grad end
          return res
        end
        local fused = grads(function() return gl.mlp(x, W1, b1, W2, b2, 'relu2', r) end)
        local plain = grads(function() return r + gl.mlp(x, W1, b1, W2, b2, 'relu2') end)
        -- float32: the same sums; bfloat16: the product and the residual rounded once, not twice
        for i = 1, #fused do
          local d, scale = fused[i]:max_abs_diff(plain[i]), gl.max(gl.abs(plain[i]:to('float32'))):item()
          local what = ('%s bias=%s output/grad %d: %g of %g'):format(dt, tostring(bias), i, d, scale)
          if dt == 'float32' then assert.are.equal(0, d, what) else assert.is_true(d <= scale * 2 ^ -7, what) end
        end
      end
    end
  end)

  it('gl.linear with a residual equals residual + linear(x), forward and gradients (float32 bit for bit)', function()
    for _, bias in ipairs({ false, true }) do
      local function P(sh, seed) return gl.randn(sh, { seed = seed }):requires_grad_() end
      local x, r, W, b = P({ 2, 5, 16 }, 91), P({ 2, 5, 12 }, 92), P({ 12, 16 }, 93), bias and P({ 12 }, 94) or nil
      local g = gl.randn({ 2, 5, 12 }, { seed = 95 })
      local function grads(f)
        for _, t in ipairs({ x, r, W, b }) do t.grad = nil end
        local y = f()
        y:backward(g)
        return { y, x.grad, r.grad, W.grad, b and b.grad }
      end
      local fused = grads(function() return gl.linear(x, W, b, r) end)
      local plain = grads(function() return r + gl.linear(x, W, b) end)
      for i = 1, #fused do assert.are.equal(0, fused[i]:max_abs_diff(plain[i]), ('bias=%s %d'):format(tostring(bias), i)) end
    end
    local R = function(sh, seed) return gl.randn(sh, { dtype = 'float64', seed = seed }):requires_grad_() end
    gc.check(function(x, w, r) return gl.linear(x, w, nil, r) end, { R({ 2, 3, 4 }, 96), R({ 5, 4 }, 97), R({ 2, 3, 5 }, 98) })
    local ok, e = pcall(gl.linear, R({ 2, 3, 4 }, 96), R({ 5, 4 }, 97), nil, R({ 2, 3, 4 }, 99))
    assert.is_false(ok)
    assert.matches('linear: residual has shape {2,3,4}, expected {2,3,5}', tostring(e), 1, true)
  end)

  it('has the gradient of its float64 central differences, and refuses a residual of another shape', function()
    local R = function(s, seed) return gl.randn(s, { dtype = 'float64', seed = seed }):requires_grad_() end
    gc.check(function(x, w1, w2, r) return gl.mlp(x, w1, nil, w2, nil, 'relu2', r) end,
      { R({ 2, 3, 4 }, 71), R({ 6, 4 }, 72), R({ 5, 6 }, 73), R({ 2, 3, 5 }, 74) })
    -- relu2's backward from h alone (dpre = 2 sqrt(h) (g W2), db1 its sums):
    -- with both biases, with and without the residual
    gc.check(function(x, w1, b1, w2, b2, r) return gl.mlp(x, w1, b1, w2, b2, 'relu2', r) end,
      { R({ 2, 3, 4 }, 81), R({ 6, 4 }, 82), R({ 6 }, 83), R({ 5, 6 }, 84), R({ 5 }, 85), R({ 2, 3, 5 }, 86) })
    gc.check(function(x, w1, b1, w2, b2) return gl.mlp(x, w1, b1, w2, b2, 'relu2') end,
      { R({ 3, 4 }, 91), R({ 7, 4 }, 92), R({ 7 }, 93), R({ 5, 7 }, 94), R({ 5 }, 95) })
    local x, w1, w2 = R({ 2, 3, 4 }, 71), R({ 6, 4 }, 72), R({ 5, 6 }, 73)
    local ok, e = pcall(gl.mlp, x, w1, nil, w2, nil, 'relu2', R({ 2, 3, 4 }, 75))
    assert.is_false(ok)
    assert.matches('mlp: residual has shape {2,3,4}, expected {2,3,5}', tostring(e), 1, true)
    local out, a, b = gl.empty({ 3, 5 }), gl.randn({ 3, 4 }), gl.randn({ 4, 5 })
    assert.are.equal(-1, lib.gl_matmul_add(out.c, a.c, b.c, gl.randn({ 3, 4 }).c))
    assert.matches('gl_matmul_add: ', require('ffi').string(lib.gl_last_error()), 1, true)
    assert.are.equal(-1, lib.gl_matmul_add(out.c, a.c, b.c, out.c))
    assert.matches('gl_matmul_add: out', require('ffi').string(lib.gl_last_error()), 1, true)
  end)
end)

describe('CUDA rope + QK RMSNorm vs CPU #cuda', function()
  gpu_it('forward and backward over warp and row edges, strided q, float32 / bfloat16 / float64', function()
    -- D/2 = 1, 31, 32, 33, 64 pairs (a warp's lanes take pairs j, j + 32, ...; 16-byte
    -- vectors of pairs when D/2 is a multiple of a vector's elements); rows B*T*H not a
    -- multiple of the 4 warps per block; x and dy dense, strided (q's (B, H, T, D)
    -- transposed) and one element off 16-byte alignment (the vector launch's
    -- element-by-element rows)
    for _, dt in ipairs({ 'float32', 'bfloat16', 'float64' }) do
      local sdt = dt == 'float64' and 'float64' or 'float32'
      for _, s in ipairs({ { 1, 3, 1, 2 }, { 2, 5, 3, 62 }, { 1, 3, 2, 64 }, { 1, 2, 3, 66 }, { 2, 9, 2, 128 } }) do
        local B, T, H, D = s[1], s[2], s[3], s[4]
        local cos, sin = tables(T, D, dt)
        local n = B * T * H * D
        local ins = { x = pair(s, { dtype = dt }), xh = pair({ B, H, T, D }, { dtype = dt }),
                      g = pair(s, { dtype = dt }), gh = pair({ B, H, T, D }, { dtype = dt }),
                      xo = pair({ n + 1 }, { dtype = dt }), go = pair({ n + 1 }, { dtype = dt }),
                      cos = { cos, cos:to(twin.DEV) }, sin = { sin, sin:to(twin.DEV) } }
        for _, strided in ipairs({ false, true, 'offset' }) do
          compare(ins, function(S)
            local x = strided and S.xh:transpose(2, 3) or S.x
            local g = strided and S.gh:transpose(2, 3) or S.g
            if strided == 'offset' then x, g = S.xo:narrow(1, 2, n):view(s), S.go:narrow(1, 2, n):view(s) end
            local y, rstd = S.out(s, dt), S.out({ B, T, H }, sdt)
            K(lib.gl_rope_rmsnorm_forward(y.c, rstd.c, x.c, S.cos.c, S.sin.c, 1e-6))
            local dx = S.out(s, dt)
            K(lib.gl_rope_rmsnorm_backward(dx.c, g.c, x.c, S.cos.c, S.sin.c, rstd.c))
            -- dx = rstd (g' - x^ mean(g' x^)), |mean(g' x^)| <= max |g| (mean x^2 = 1):
            -- terms up to max rstd * max |g| * max(1, max |x^|)
            if S.ref then
              local xhat = twin.max_abs(x * rstd:view({ B, T, H, 1 }))
              S.terms[3] = twin.max_abs(rstd) * twin.max_abs(g) * math.max(1, xhat)
            end
            return y, rstd, dx
          end, dt, ('rope_rmsnorm %s {%s} strided=%s'):format(dt, table.concat(s, ','), tostring(strided)), { n = D })
        end
      end
    end
  end)

  gpu_it('gl_matmul_add: a residual as cuBLASLt\'s C (out\'s layout) or copied (any other), float32 / bfloat16 / float64', function()
    for _, dt in ipairs({ 'float32', 'bfloat16', 'float64' }) do
      -- {lead..., M, K, N}: rows of a tile and not; a batch that folds into M
      for _, s in ipairs({ { 8, 32, 16 }, { 9, 24, 40 }, { 2, 7, 16, 8 } }) do
        local n = #s
        local M, Kd, N = s[n - 2], s[n - 1], s[n]
        local function shape(r, c) local t = {}; for i = 1, n - 3 do t[i] = s[i] end; t[#t + 1] = r; t[#t + 1] = c; return t end
        local ins = { a = pair(shape(M, Kd), { dtype = dt }), b = pair({ Kd, N }, { dtype = dt }),
                      c = pair(shape(M, N), { dtype = dt }), ct = pair(shape(M, N), { dtype = dt, layout = 'transposed' }) }
        compare(ins, function(S)
          local out1, out2 = S.out(shape(M, N), dt), S.out(shape(M, N), dt)
          local b = n > 3 and S.b:unsqueeze(1):expand(shape(Kd, N)) or S.b  -- a weight shared by the batch
          K(lib.gl_matmul_add(out1.c, S.a.c, b.c, S.c.c))
          K(lib.gl_matmul_add(out2.c, S.a.c, b.c, S.ct.c))  -- c's strides are not out's: copied
          return out1, out2
        end, dt, ('matmul_add %s {%s}'):format(dt, table.concat(s, ',')), { n = Kd + 1 })
      end
    end
  end)

  gpu_it('gl.mlp with a residual on the GPU equals the CPU\'s, forward and gradients (bfloat16)', function()
    -- the float64 reference, the CPU twin and the GPU, on the same bfloat16 values
    local res = {}
    for i, side in ipairs({ { 'cpu', 'float64' }, { 'cpu', 'bfloat16' }, { twin.DEV, 'bfloat16' } }) do
      local function P(s, seed, k)
        return (gl.randn(s, { seed = seed }) * (k or 1)):to('bfloat16'):to(side[2]):to(side[1]):detach():requires_grad_()
      end
      local x, r, W1, W2 = P({ 3, 8, 32 }, 81), P({ 3, 8, 32 }, 82), P({ 128, 32 }, 83, 0.2), P({ 32, 128 }, 84, 0.1)
      local y = gl.mlp(x, W1, nil, W2, nil, 'relu2', r)
      y:backward(gl.randn({ 3, 8, 32 }, { seed = 85 }):to('bfloat16'):to(side[2]):to(side[1]))
      res[i] = { y:to('cpu'), x.grad:to('cpu'), r.grad:to('cpu'), W1.grad:to('cpu'), W2.grad:to('cpu') }
    end
    for k = 1, 5 do twin.check('mlp with residual ' .. k, res[3][k], res[2][k], res[1][k], 'bfloat16', 128) end
  end)

  gpu_it('the norms\' residual gradient on the GPU equals the CPU\'s (bfloat16)', function()
    local x = gl.randn({ 6, 128 }, { seed = 41 }):to('bfloat16')
    local g = gl.randn({ 6, 128 }, { seed = 42 }):to('bfloat16')
    local grads = {}
    -- the float64 reference, the CPU twin and the GPU, on the same bfloat16 values
    for i, side in ipairs({ { 'cpu', 'float64' }, { 'cpu', 'bfloat16' }, { twin.DEV, 'bfloat16' } }) do
      local xv = x:to(side[2]):to(side[1]):detach():requires_grad_()
      local y = gl.rms_norm(xv, nil, 1e-6) + xv * 0.5
      y:backward(g:to(side[2]):to(side[1]))
      grads[i] = xv.grad:to('cpu')
    end
    twin.check('rms_norm + residual gradient', grads[3], grads[2], grads[1], 'bfloat16', 128)
  end)
end)
