-- The fused ops of issue 13 on the CPU (nanochat's own: spec/layer_fusion_spec.lua): gl.mlp and gl.add_layer_norm /
-- gl.add_rms_norm against the unfused ops they replace (the same kernels run on the CPU, so the results are identical,
-- which keeps `make run`'s losses where they were), gl_matmul_epilogue and
-- gl_linear_backward against their definitions, and their argument checks.
-- Gradients: spec/autograd_spec.lua (float64 central differences); the GPU
-- and the simulator: spec/cuda_spec.lua ("matmul epilogues"),
-- spec/account_spec.lua (one cuBLASLt launch and nothing else per epilogue).
local gl = require 'gptlua'
local lib = gl.lib

local function K(rc) if rc ~= 0 then error(require('ffi').string(lib.gl_last_error()), 2) end end

-- the tensors' grads after backward(g) of f(inputs...), in order
local function grads_of(f, inputs, g)
  for _, t in ipairs(inputs) do t.grad = nil end
  local y = f(unpack(inputs))
  y:backward(g)
  local r = {}
  for i, t in ipairs(inputs) do r[i] = t.grad end
  return y, r
end

describe('fused ops on the CPU', function()
  it('gl.mlp equals linear -> activation -> linear, forward and every gradient, bit for bit', function()
    for _, dt in ipairs({ 'float32', 'bfloat16' }) do
      for _, act in ipairs({ 'gelu', 'relu2' }) do
        for _, bias in ipairs({ true, false }) do
          local o = { dtype = dt, seed = 5 }
          local x = gl.randn({ 3, 5, 16 }, o):requires_grad_()
          local W1 = (gl.randn({ 40, 16 }, { seed = 6 }) * 0.3):to(dt):requires_grad_()
          local W2 = (gl.randn({ 16, 40 }, { seed = 7 }) * 0.3):to(dt):requires_grad_()
          local ins = { x, W1, W2 }
          local b1, b2
          if bias then
            b1 = gl.randn({ 40 }, { dtype = dt, seed = 8 }):requires_grad_()
            b2 = gl.randn({ 16 }, { dtype = dt, seed = 9 }):requires_grad_()
            ins = { x, W1, W2, b1, b2 }
          end
          local g = gl.randn({ 3, 5, 16 }, { dtype = dt, seed = 10 })
          local y, gf = grads_of(function(x_, w1, w2, c1, c2) return gl.mlp(x_, w1, c1, w2, c2, act) end, ins, g)
          local r, gr = grads_of(function(x_, w1, w2, c1, c2)
            return gl.linear(gl[act](gl.linear(x_, w1, c1)), w2, c2)
          end, ins, g)
          local what = ('%s %s bias=%s'):format(act, dt, tostring(bias))
          assert.are.equal(0, y:max_abs_diff(r), what .. ' forward')
          -- (relu2's backward reads h, not pre: dpre = 2 sqrt(h) (g W2); still bit
          -- for bit, as sqrt(fl(p^2)) = |p| in binary floating point rounded to nearest)
          for i = 1, #ins do assert.are.equal(0, gf[i]:max_abs_diff(gr[i]), what .. ' grad ' .. i) end
        end
      end
    end
  end)

  it('gl.mlp gives only the gradients asked for, and runs without autograd', function()
    local x = gl.randn({ 4, 8 }, { seed = 1 }):requires_grad_()
    local W1, W2 = gl.randn({ 24, 8 }, { seed = 2 }), gl.randn({ 8, 24 }, { seed = 3 })
    local b1 = gl.randn({ 24 }, { seed = 4 }):requires_grad_()
    local y = gl.mlp(x, W1, b1, W2, nil, 'gelu')
    y:sum():backward()
    assert.is_nil(W1.grad); assert.is_nil(W2.grad)
    local ref = gl.linear(gl.gelu(gl.linear(x:detach(), W1, b1:detach())), W2)
    assert.are.equal(0, y:detach():max_abs_diff(ref))
    assert(x.grad and b1.grad)
    local y2 = gl.no_grad(function() return gl.mlp(x, W1, b1, W2, nil, 'relu2') end)
    assert.is_nil(y2.grad_fn)
    assert.are.equal(0, y2:max_abs_diff(gl.linear(gl.relu2(gl.linear(x:detach(), W1, b1:detach())), W2)))
  end)

  it('the models run their MLPs through gl.mlp and their residual adds fused (nanochat: in the products)', function()
    local seen = {}
    local mlp, aln, arn, lin, rrn = gl.mlp, gl.add_layer_norm, gl.add_rms_norm, gl.linear, gl.rope_rms_norm
    gl.mlp = function(...)
      seen[select(6, ...)] = true
      if select(7, ...) then seen.mlp_residual = true end
      return mlp(...)
    end
    gl.linear = function(...) if select(4, ...) then seen.linear_residual = true end; return lin(...) end
    gl.rope_rms_norm = function(...) seen.rope_rms_norm = true; return rrn(...) end
    gl.add_layer_norm = function(...) seen.add_layer_norm = true; return aln(...) end
    gl.add_rms_norm = function(...) seen.add_rms_norm = true; return arn(...) end
    local ok, err = pcall(function()
      for _, name in ipairs({ 'gpt2', 'nanochat' }) do
        local m = require('gptlua.models.' .. name).GPT({ n_layer = 1, n_head = 2, n_embd = 16, block_size = 8,
                                                          vocab_size = 11 })
        m:forward(gl.tensor({ { 1, 2, 3 } }, { dtype = 'int64' }))
      end
    end)
    gl.mlp, gl.add_layer_norm, gl.add_rms_norm, gl.linear, gl.rope_rms_norm = mlp, aln, arn, lin, rrn
    assert(ok, err)
    assert(seen.add_layer_norm, 'gpt2 did not call gl.add_layer_norm')
    assert(seen.linear_residual, 'nanochat did not add x + attn in c_proj\'s product (gl.linear\'s residual)')
    assert(seen.mlp_residual, 'nanochat did not add s + mlp in the MLP\'s product (gl.mlp\'s residual)')
    assert(seen.rope_rms_norm, 'nanochat did not call gl.rope_rms_norm')
    assert(seen.gelu, 'gpt2 did not call gl.mlp')
    assert(seen.relu2, 'nanochat did not call gl.mlp')
  end)

  it('gl.add_layer_norm / gl.add_rms_norm equal x + r then the norm, forward and every gradient, bit for bit', function()
    for _, dt in ipairs({ 'float32', 'bfloat16', 'float64' }) do
      for _, center in ipairs({ true, false }) do
        local x = gl.randn({ 2, 3, 8 }, { dtype = dt, seed = 1 }):requires_grad_()
        local r = gl.randn({ 2, 3, 8 }, { dtype = dt, seed = 2 }):requires_grad_()
        local w = gl.randn({ 8 }, { dtype = dt, seed = 3 }):requires_grad_()
        local b = center and gl.randn({ 8 }, { dtype = dt, seed = 4 }):requires_grad_() or nil
        local g1, g2 = gl.randn({ 2, 3, 8 }, { dtype = dt, seed = 5 }), gl.randn({ 2, 3, 8 }, { dtype = dt, seed = 6 })
        local function run(fused)
          for _, t in ipairs({ x, r, w, b }) do t.grad = nil end
          local s, h
          if fused and center then s, h = gl.add_layer_norm(x, r, w, b)
          elseif fused then s, h = gl.add_rms_norm(x, r, w)
          else
            s = x + r
            h = center and gl.layer_norm(s, w, b) or gl.rms_norm(s, w)
          end
          -- s feeds the next residual add and the norm, as in a block
          gl.sum(s * g1 + h * g2):backward()
          return { s:detach(), h:detach(), x.grad, r.grad, w.grad, b and b.grad }
        end
        local f, u = run(true), run(false)
        for i = 1, 6 do
          if u[i] then assert.are.equal(0, f[i]:max_abs_diff(u[i]), ('%s center=%s output %d'):format(dt, center, i)) end
        end
      end
    end
  end)

  it('the norm node adds the residual gradient whichever consumer of s runs first', function()
    local x = gl.randn({ 4, 6 }, { seed = 7 }):requires_grad_()
    local r = gl.randn({ 4, 6 }, { seed = 8 })
    local s, h = gl.add_rms_norm(x, r)
    -- only the norm's path (nothing to take over), then only s's path
    gl.sum(h * h):backward()
    local want = gl.randn({ 4, 6 }, { seed = 7 }):requires_grad_()
    gl.sum(gl.rms_norm(want + r) ^ 2):backward()
    assert.are.equal(0, x.grad:max_abs_diff(want.grad))
    x.grad = nil
    s, h = gl.add_rms_norm(x, r)
    gl.sum(s * 3):backward()
    assert.are.equal(0, x.grad:max_abs_diff(gl.full({ 4, 6 }, 3)))
    local _ = h
  end)

  it('gl_matmul_epilogue: GELU with its input kept, GELU\' with the bias gradient, a bias gradient', function()
    local a, b = gl.randn({ 6, 5 }, { seed = 11 }), gl.randn({ 5, 7 }, { seed = 12 })
    local bias, aux, out = gl.randn({ 7 }, { seed = 13 }), gl.empty({ 6, 7 }), gl.empty({ 6, 7 })
    K(lib.gl_matmul_epilogue(lib.GL_EPI_GELU, out.c, a.c, b.c, bias.c, aux.c))
    local pre = gl.matmul(a, b) + bias
    assert(aux:allclose(pre, 1e-6, 1e-6))
    assert(out:allclose(gl.gelu(pre), 1e-6, 1e-6))
    K(lib.gl_matmul_epilogue(lib.GL_EPI_GELU, out.c, a.c, b.c, nil, nil))
    assert(out:allclose(gl.gelu(gl.matmul(a, b)), 1e-6, 1e-6))
    -- out = (a b) * gelu'(aux), bias = its sums over rows
    local db = gl.empty({ 7 })
    K(lib.gl_matmul_epilogue(lib.GL_EPI_DGELU, out.c, a.c, b.c, db.c, aux.c))
    local want = gl.empty({ 6, 7 })
    K(lib.gl_unary_backward(lib.GL_U_GELU_TANH, want.c, gl.matmul(a, b).c, aux.c, 0, 0))
    assert(out:allclose(want, 1e-6, 1e-6))
    assert(db:allclose(want:sum(1), 1e-5, 1e-5))
    -- dW = a b with a a transposed view; bias = a's sums over K
    local g = gl.randn({ 9, 6 }, { seed = 14 })
    local dw, dbias = gl.empty({ 6, 7 }), gl.empty({ 6 })
    K(lib.gl_matmul_epilogue(lib.GL_EPI_BGRAD, dw.c, g:t().c, gl.randn({ 9, 7 }, { seed = 15 }).c, dbias.c, nil))
    assert(dbias:allclose(g:sum(1), 1e-5, 1e-5))
  end)

  it('gl_matmul_epilogue: ReLU² (the product not kept) and its gradient from the output, with the bias gradient', function()
    for _, dt in ipairs({ 'float64', 'float32' }) do
      local o = { dtype = dt }
      local a, b = gl.randn({ 6, 5 }, { dtype = dt, seed = 21 }), gl.randn({ 5, 7 }, { dtype = dt, seed = 22 })
      local bias, out = gl.randn({ 7 }, { dtype = dt, seed = 23 }), gl.empty({ 6, 7 }, o)
      local pre = gl.matmul(a, b) + bias
      K(lib.gl_matmul_epilogue(lib.GL_EPI_RELU2, out.c, a.c, b.c, bias.c, nil))
      assert.are.equal(0, out:max_abs_diff(gl.relu2(pre)))
      assert(pre:min():item() < 0 and pre:max():item() > 0, 'both signs of the pre-activation')
      local h = gl.empty({ 6, 7 }, o)
      K(lib.gl_matmul_epilogue(lib.GL_EPI_RELU2, h.c, a.c, b.c, nil, nil))
      assert.are.equal(0, h:max_abs_diff(gl.relu2(gl.matmul(a, b))))
      -- dpre = (g b2) * 2 relu(pre), relu(pre) = sqrt(h); db = its sums over rows
      local g, w = gl.randn({ 6, 4 }, { dtype = dt, seed = 24 }), gl.randn({ 4, 7 }, { dtype = dt, seed = 25 })
      local dpre, db = gl.empty({ 6, 7 }, o), gl.empty({ 7 }, o)
      K(lib.gl_matmul_epilogue(lib.GL_EPI_DRELU2, dpre.c, g.c, w.c, db.c, h.c))
      local want = gl.matmul(g, w) * gl.relu(gl.matmul(a, b)) * 2
      local tol = dt == 'float64' and 1e-12 or 1e-5
      assert(dpre:allclose(want, tol, tol), dt)
      assert(db:allclose(want:sum(1), tol, tol), dt)
      K(lib.gl_matmul_epilogue(lib.GL_EPI_DRELU2, dpre.c, g.c, w.c, nil, h.c))
      assert(dpre:allclose(want, tol, tol), dt)
      -- a transposed out: the two-pass path (sqrt into a temporary)
      local dpre_t = gl.empty({ 7, 6 }, o):t()
      K(lib.gl_matmul_epilogue(lib.GL_EPI_DRELU2, dpre_t.c, g.c, w.c, nil, h.c))
      assert.are.equal(0, dpre_t:max_abs_diff(dpre), dt)
    end
  end)

  it('gl.mlp relu2 keeps only h for its backward, not the product', function()
    local x = gl.randn({ 4, 8 }, { seed = 1 }):requires_grad_()
    local W1, W2 = gl.randn({ 24, 8 }, { seed = 2 }), gl.randn({ 8, 24 }, { seed = 3 })
    local y = gl.mlp(x, W1, nil, W2, nil, 'relu2')
    local fn = y.grad_fn
    assert.are.equal(1, #fn.owned)
    assert.are.same({ 4, 24 }, fn.owned[1].shape)
    assert.is_nil(fn.saved[4])
    local yg = gl.mlp(x, W1, nil, W2, nil, 'gelu')
    assert.are.equal(2, #yg.grad_fn.owned)
  end)

  it('refuses bad epilogue and linear-backward arguments by name', function()
    local a, b, out = gl.randn({ 4, 3 }), gl.randn({ 3, 8 }), gl.empty({ 4, 8 })
    local function err(f) local ok, e = pcall(f); assert.is_false(ok); return e end
    assert.matches('gl_matmul_epilogue: epilogue is 9, expected GL_EPI_GELU',
      err(function() K(lib.gl_matmul_epilogue(9, out.c, a.c, b.c, nil, nil)) end))
    assert.matches('gl_matmul_epilogue: aux is NULL, expected the GELU input',
      err(function() K(lib.gl_matmul_epilogue(lib.GL_EPI_DGELU, out.c, a.c, b.c, nil, nil)) end))
    assert.matches('gl_matmul_epilogue: aux is NULL, expected the ReLU² output h %(GL_EPI_DRELU2%)',
      err(function() K(lib.gl_matmul_epilogue(lib.GL_EPI_DRELU2, out.c, a.c, b.c, nil, nil)) end))
    assert.matches('gl_matmul_epilogue: aux is given, expected NULL with GL_EPI_RELU2',
      err(function() K(lib.gl_matmul_epilogue(lib.GL_EPI_RELU2, out.c, a.c, b.c, nil, gl.empty({ 4, 8 }).c)) end))
    assert.matches('gl_matmul_epilogue: bias has shape {4}, expected {8} %(N, the columns of out%)',
      err(function() K(lib.gl_matmul_epilogue(lib.GL_EPI_GELU, out.c, a.c, b.c, gl.empty({ 4 }).c, nil)) end))
    assert.matches('gl_matmul_epilogue: aux has dtype float64, expected float32',
      err(function()
        K(lib.gl_matmul_epilogue(lib.GL_EPI_GELU, out.c, a.c, b.c, nil, gl.empty({ 4, 8 }, { dtype = 'float64' }).c))
      end))
    assert.matches('gl_matmul_epilogue: aux is not contiguous',
      err(function() K(lib.gl_matmul_epilogue(lib.GL_EPI_GELU, out.c, a.c, b.c, nil, gl.empty({ 8, 4 }):t().c)) end))
    local dy, x, W = gl.randn({ 4, 8 }), gl.randn({ 4, 3 }), gl.randn({ 8, 3 })
    assert.matches('gl_linear_backward: dx_bias is given without pre_gelu',
      err(function() K(lib.gl_linear_backward(gl.empty({ 4, 3 }).c, nil, nil, gl.empty({ 3 }).c, dy.c, x.c, W.c, nil)) end))
    assert.matches('gl_linear_backward: weight has shape {3,8}, expected {8,3}',
      err(function() K(lib.gl_linear_backward(nil, nil, nil, nil, dy.c, x.c, W:t().c, nil)) end))
    assert.matches('gl_linear_backward: dbias has shape {3}, expected {8}',
      err(function() K(lib.gl_linear_backward(nil, nil, gl.empty({ 3 }).c, nil, dy.c, x.c, W.c, nil)) end))
    assert.matches('add_layer_norm: r has shape {4,4}, expected {4,3}',
      err(function() gl.add_layer_norm(x, gl.randn({ 4, 4 })) end))
    assert.matches('gl_norm_backward_add: dres has shape {4,4}, expected the shape of x {4,3}',
      err(function()
        K(lib.gl_norm_backward_add(gl.empty({ 4, 3 }).c, nil, nil, x.c, x.c, nil, nil, gl.empty({ 4 }).c,
          gl.empty({ 4, 4 }).c, 0))
      end))
    assert.matches('gl_add_norm_forward: mean given with center 0',
      err(function()
        K(lib.gl_add_norm_forward(gl.empty({ 4, 3 }).c, gl.empty({ 4, 3 }).c, gl.empty({ 4 }).c, gl.empty({ 4 }).c,
          x.c, x.c, nil, nil, 1e-5, 0))
      end))
    assert.matches("mlp: activation is tanh, expected 'gelu' or 'relu2'",
      err(function() gl.mlp(x, gl.randn({ 6, 3 }), nil, gl.randn({ 3, 6 }), nil, 'tanh') end))
    assert.matches('mlp: proj_weight has shape {3,5}, expected {%*,6}',
      err(function() gl.mlp(x, gl.randn({ 6, 3 }), nil, gl.randn({ 3, 5 }), nil, 'gelu') end))
  end)
end)
