local gl = require 'gptlua'
local optim = require 'gptlua.optim'

describe('optimizers', function()
  it('AdamW matches the reference update over several steps', function()
    local p = gl.tensor({ 0.5, -1.0, 2.0 }, { dtype = 'float64' }):requires_grad_()
    local opt = optim.AdamW({ p }, { lr = 0.1, betas = { 0.9, 0.99 }, eps = 1e-8, weight_decay = 0.1 })
    local ref, m, v = { 0.5, -1.0, 2.0 }, { 0, 0, 0 }, { 0, 0, 0 }
    for t = 1, 5 do
      local g = {}
      for i = 1, 3 do g[i] = math.sin(t + i) end
      p.grad = gl.tensor(g, { dtype = 'float64' })
      opt:step()
      for i = 1, 3 do
        ref[i] = ref[i] - 0.1 * 0.1 * ref[i]
        m[i] = 0.9 * m[i] + 0.1 * g[i]
        v[i] = 0.99 * v[i] + 0.01 * g[i] * g[i]
        local mh, vh = m[i] / (1 - 0.9 ^ t), v[i] / (1 - 0.99 ^ t)
        ref[i] = ref[i] - 0.1 * mh / (math.sqrt(vh) + 1e-8)
      end
    end
    local got = p:tolist()
    for i = 1, 3 do assert.near(ref[i], got[i], 1e-5) end
  end)
  it('keeps an fp32 master copy for bfloat16 parameters (mixed precision)', function()
    local p32 = gl.randn({ 4, 3 }, { seed = 8 }):requires_grad_()
    local pb = p32:to('bfloat16'):detach():requires_grad_()
    p32 = pb:to('float32'):detach():requires_grad_()  -- same starting values
    local o32 = optim.AdamW({ p32 }, { lr = 0.01, weight_decay = 0.1 })
    local ob = optim.AdamW({ pb }, { lr = 0.01, weight_decay = 0.1 })
    for t = 1, 5 do
      local g = gl.randn({ 4, 3 }, { seed = 20 + t }):to('bfloat16')
      p32.grad, pb.grad = g:to('float32'), g
      o32:step(); ob:step()
    end
    local master = ob.state[pb].master
    assert.is_true(master:max_abs_diff(p32) < 1e-6)  -- the update ran in fp32
    assert.equal('bfloat16', pb.dtype)
    assert.same(p32:to('bfloat16'):totable(), pb:totable())
    local sd = ob:state_dict()
    assert.is_not_nil(sd.tensors['adamw.g1.1.master'])
  end)
  it('updates every parameter in one gl_adamw_update_multi call, as the single update, checking each', function()
    local ffi, lib = gl.ffi, gl.lib
    local function K(rc) gl.check(rc, 2) end
    local sizes, k = { 5, 1, 0, 300 }, 4
    local P, G, M, V = ffi.new('gl_tensor *[4]'), ffi.new('const gl_tensor *[4]'), ffi.new('gl_tensor *[4]'),
                       ffi.new('gl_tensor *[4]')
    local O, lrs, wds = ffi.new('gl_tensor *[4]'), ffi.new('double[4]'), ffi.new('double[4]')
    local keep = {}
    for i, n in ipairs(sizes) do
      local p, g = gl.randn({ n }, { seed = i }), gl.randn({ n }, { seed = 10 + i }):to('bfloat16')
      local m, v = gl.randn({ n }, { seed = 20 + i }), gl.uniform({ n }, 0, 1, { seed = 30 + i })
      local p1, m1, v1 = p:clone(), m:clone(), v:clone()
      local lr, wd = i * 1e-3, i % 2 * 0.1
      for step = 1, 2 do K(lib.gl_adamw_update(p1.c, g.c, m1.c, v1.c, 0, n, lr, 0.9, 0.95, 1e-8, wd, step)) end
      local o = gl.zeros({ n }, { dtype = 'bfloat16' })
      P[i - 1], G[i - 1], M[i - 1], V[i - 1], O[i - 1] = p.c, g.c, m.c, v.c, i ~= 2 and o.c or nil
      lrs[i - 1], wds[i - 1] = lr, wd
      keep[i] = { p, m, v, o, p1, m1, v1, g }
    end
    for step = 1, 2 do K(lib.gl_adamw_update_multi(k, P, G, M, V, O, lrs, wds, 0.9, 0.95, 1e-8, step)) end
    for i = 1, k do
      local e = keep[i]
      for j = 1, 3 do assert.same(e[j + 4]:tolist(), e[j]:tolist()) end
      if i ~= 2 then assert.same(e[1]:to('bfloat16'):tolist(), e[4]:tolist()) end
    end
    local function err(f) local ok, e = pcall(f); assert.is_false(ok); return tostring(e) end
    M[3] = keep[1][2].c  -- 5 elements against a 300-element parameter
    assert.matches('gl_adamw_update_multi: ms%[3%] has 5 elements, expected 300 %(the numel of params%[3%]%)',
      err(function() K(lib.gl_adamw_update_multi(k, P, G, M, V, O, lrs, wds, 0.9, 0.95, 1e-8, 3)) end))
    M[3] = keep[4][2].c
    O[0] = keep[4][4].c
    assert.matches('gl_adamw_update_multi: outs%[0%] has 300 elements, expected 5',
      err(function() K(lib.gl_adamw_update_multi(k, P, G, M, V, O, lrs, wds, 0.9, 0.95, 1e-8, 3)) end))
    assert.matches('gl_adamw_update_multi: step is 0, expected >= 1',
      err(function() K(lib.gl_adamw_update_multi(1, P, G, M, V, nil, lrs, wds, 0.9, 0.95, 1e-8, 0)) end))
    assert.matches('gl_adamw_update_multi: n is %-1, expected >= 0',
      err(function() K(lib.gl_adamw_update_multi(-1, P, G, M, V, nil, lrs, wds, 0.9, 0.95, 1e-8, 1)) end))
    -- the sum of squares of many tensors
    local sq = ffi.new('double[1]')
    K(lib.gl_sumsq_multi(k, G, sq))
    local want = 0
    for i = 1, k do for _, x in ipairs(keep[i][8]:tolist()) do want = want + x * x end end
    assert.near(want, sq[0], 1e-12 * want)
    assert.matches('gl_sumsq_multi: xs is NULL', err(function() K(lib.gl_sumsq_multi(2, nil, sq)) end))
  end)

  it('Newton-Schulz orthogonalises: singular values land near 1', function()
    local G = gl.randn({ 16, 8 }, { seed = 3 })
    local X = optim.newton_schulz(G, 5)
    assert.same({ 16, 8 }, X.shape)
    local XtX = gl.matmul(X:t(), X)
    for i = 1, 8 do
      local d = XtX:get(i, i)
      assert.is_true(d > 0.4 and d < 1.6, 'diag ' .. d)
    end
  end)
  it('Newton-Schulz is the quintic iteration a X + (b A + c A^2) X, A = X Xt (float64, both orientations)', function()
    for _, shape in ipairs({ { 6, 9 }, { 9, 6 } }) do
      local G = gl.randn(shape, { seed = 11, dtype = 'float64' })
      local X = G:t():contiguous()
      if shape[1] <= shape[2] then X = G:clone() end
      X = X * (1 / (gl.global_norm({ X }) + 1e-7))
      local a, b, c = 3.4445, -4.7750, 2.0315
      for _ = 1, 5 do
        local A = gl.matmul(X, X:t())
        X = X * a + gl.matmul(A * b + gl.matmul(A, A) * c, X)
      end
      if shape[1] > shape[2] then X = X:t():contiguous() end
      local d = optim.newton_schulz(G, 5):max_abs_diff(X)
      assert.is_true(d < 1e-12, ('%dx%d: off by %g'):format(shape[1], shape[2], d))
    end
  end)
  it('Muon steps 2-D matrices with the shape-scaled lr and rejects other shapes', function()
    local W = gl.randn({ 8, 4 }, { seed = 4 }):requires_grad_()
    local w0 = W:clone()
    local opt = optim.Muon({ W }, { lr = 0.01 })
    W.grad = gl.randn({ 8, 4 }, { seed = 5 })
    opt:step()
    local delta = (W - w0):detach()
    local rel = gl.global_norm({ delta }) / (0.01 * math.sqrt(2))
    assert.is_true(rel > 0.5 and rel < 3, 'update norm ratio ' .. rel)
    assert.has_error(function() optim.Muon({ gl.zeros({ 3 }) }) end)
  end)
  it('saves and restores optimizer state exactly', function()
    local function run(restore_at)
      local p = gl.tensor({ 1, 2, 3, 4 }, { dtype = 'float32' }):view(2, 2):requires_grad_()
      local opt = optim.Combined({ optim.AdamW({ { 'p', p } }, { lr = 0.01 }), optim.Muon({ { 'q', p } }, { lr = 0.01 }) })
      for t = 1, 4 do
        if t == restore_at then
          local sd = opt:state_dict()
          local copy = { steps = sd.steps, tensors = {} }
          for k, v in pairs(sd.tensors) do copy.tensors[k] = v:clone() end
          opt = optim.Combined({ optim.AdamW({ { 'p', p } }, { lr = 0.01 }), optim.Muon({ { 'q', p } }, { lr = 0.01 }) })
          opt:load_state_dict(copy)
        end
        p.grad = gl.full({ 2, 2 }, 0.1 * t)
        opt:step()
      end
      return p:tolist()
    end
    assert.same(run(nil), run(3))
  end)
  it('clips by global norm and reports the norm', function()
    local a, b = gl.zeros({ 2 }):requires_grad_(), gl.zeros({ 1 }):requires_grad_()
    a.grad, b.grad = gl.tensor({ 3, 0 }), gl.tensor({ 4 })
    local n = optim.clip_grad_norm({ a, b }, 1)
    assert.near(5, n, 1e-6)
    assert.near(1, gl.global_norm({ a.grad, b.grad }), 1e-5)
  end)
  it('has warmup, cosine, WSD and momentum schedules', function()
    local s = optim.schedules
    local c = s.cosine(10, 110, 0.1)
    assert.near(0.1, c(0), 1e-12); assert.near(1, c(9), 1e-12)
    assert.near(0.55, c(60), 1e-12); assert.near(0.1, c(110), 1e-12)
    local w = s.wsd(0, 100, 0.2, 0)
    assert.equal(1, w(50)); assert.near(0.5, w(90), 1e-12)
    local m = s.muon_momentum(0.85, 0.95, 300)
    assert.near(0.85, m(0), 1e-12); assert.near(0.95, m(300), 1e-12)
  end)
end)

describe("nanochat's optimizer groups", function()
  local gpt2 = require 'gptlua.models.gpt2'
  local function group_of(opt, p)
    for _, o in ipairs(opt.optimizers) do
      for _, g in ipairs(o.groups) do for _, q in ipairs(g.params) do if q == p then return g, o end end end
    end
  end

  it("trains gpt2's tied embedding/head at the head's rate (both variants), not the embedding's", function()
    local m = gpt2.GPT({ vocab_size = 16, block_size = 8, n_layer = 1, n_head = 2, n_embd = 16 })
    local scale = (16 / 768) ^ -0.5
    local wte = m.transformer.wte.weight
    local classic = optim.nanochat(m, { embedding_lr = 0.2, unembedding_lr = 0.004 })
    local g, o = group_of(classic, wte)
    assert.equal(optim.AdamW, getmetatable(o))
    assert.near(0.004 * scale, g.lr, 1e-15)
    local current = optim.nanochat(m, { variant = 'current', embedding_lr = 0.3, unembedding_lr = 0.008 })
    g = group_of(current, wte)
    assert.near(0.008 * scale, g.lr, 1e-15)
    assert.same({ 0.8, 0.96 }, g.betas)   -- the head's group
  end)

  it('keeps AdamW then Muon on a rank holding none of one of them (a pipeline stage), each steps', function()
    local m = gpt2.GPT({ vocab_size = 16, block_size = 8, n_layer = 1, n_head = 2, n_embd = 16 })
    local named = m:named_parameters()
    local function stand_in(keep)
      local list = {}
      for _, np in ipairs(named) do if keep(np[1]) then list[#list + 1] = np end end
      return { config = m.config, named_parameters = function() return list end }, list
    end
    for _, variant in ipairs({ 'classic', 'current' }) do
      local blocks, bl = stand_in(function(n) return n:match('^transformer%.h%.') and n:match('weight$') and not n:match('ln') end)
      local embs, el = stand_in(function(n) return n:match('wte') or n:match('wpe') end)
      for _, case in ipairs({ { blocks, bl }, { embs, el } }) do
        local opt = optim.nanochat(case[1], { variant = variant })
        assert.equal(2, #opt.optimizers)
        assert.equal(optim.AdamW, getmetatable(opt.optimizers[1]))
        assert.equal(optim.Muon, getmetatable(opt.optimizers[2]))
        for _, np in ipairs(case[2]) do np[2].grad = gl.ones(np[2].shape) end
        local before = case[2][1][2]:clone()
        opt:step()
        assert.is_true(gl.global_norm({ case[2][1][2] - before }) > 0)
        assert.equal(1, opt.optimizers[1].t); assert.equal(1, opt.optimizers[2].t)
        local sd = opt:state_dict()
        assert.same({ 1, 1 }, sd.steps)
        for _, np in ipairs(case[2]) do np[2].grad = nil end
      end
    end
  end)
end)
